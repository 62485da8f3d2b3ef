# docs and results: README.md#the-algorithms
"""Kimi k1.5: online policy mirror descent with a length penalty.

Paper: Kimi Team 2025, https://arxiv.org/abs/2501.12599, §2.3.2-2.3.4. No official code.

What this algorithm changes vs GRPO: each iteration solves max E[r] - tau KL(pi || pi_old) (eq. 2)
by the squared residual of its closed form, tau log Z estimated by the k samples' mean reward r_bar;
no clip, value network or reference model. Divided by 2 tau, its gradient is minus eq. 3's:

    L = 1/N sum_j (r_j - r_bar - tau log(pi(y_j|x) / pi_old(y_j|x)))^2 / (2 tau)

The reward is 0/1 plus a weighted length reward (§2.3.3), over the same problem's k samples:

    lambda_j = 0.5 - (len_j - min_len) / (max_len - min_len)   (0 for all if max_len = min_len)
    len_reward_j = lambda_j if correct, min(0, lambda_j) if wrong

off for --length-penalty-warmup-steps steps, then constant. The optimizer is reset every iteration
(§2.3.2). §2.3.4's sampling is the shared --prompt-sampling prioritized / hard-after-warmup.
Ours (not reported): tau, the weight, the warm-up; grpo.py's model, data, k and batch. With
--rollout-correction token t's log-ratio carries its weight w_t in the gradient, not in its value.

    accelerate launch kimi_k15.py                                  # the paper setting, on GPUs
    python kimi_k15.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import tyro

from common.args import SharedArgs
from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # the shared defaults are grpo.py's: the paper reports no k, batch, lr or length for its RL runs

    # Algorithm specific arguments
    tau: float = 1.0
    """tau of eq. 2, KL(pi || pi_old)'s weight: the squared loss's weight on log pi/pi_old"""
    length_penalty_weight: float = 1.0
    """weight of the length reward (§2.3.3) added to the 0/1 reward (0: none)"""
    length_penalty_warmup_steps: int = 50
    """steps without the length reward, after which its weight is constant (§2.3.3's warm-up)"""
    reset_optimizer: bool = True
    """reset the optimizer's state at the start of every iteration (rollout step), §2.3.2"""


# ALGO LOGIC: rewards, advantages and the loss
def length_reward(correct: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """§2.3.3's len_reward over each group of k = group_size samples (groups contiguous): lambda =
    0.5 - (len - min_len) / (max_len - min_len), 0 where the group's lengths are all equal; lambda
    if correct, min(0, lambda) if not. [N] tensors; the result in correct's float dtype (>= fp32)."""
    length = lengths.to(torch.promote_types(correct.dtype, torch.float32)).view(-1, group_size)
    shortest = length.min(dim=1, keepdim=True).values
    spread = length.max(dim=1, keepdim=True).values - shortest
    lam = 0.5 - (length - shortest) / torch.where(spread > 0, spread, 1.0)
    lam = torch.where(spread > 0, lam, 0.0).view(-1)
    return torch.where(correct.bool(), lam, lam.clamp(max=0.0))


def compute_rewards(correct, lengths, truncated, args: Args, step: int) -> torch.Tensor:
    """The 0/1 outcome reward plus --length-penalty-weight x the length reward, which is off while
    step < --length-penalty-warmup-steps (§2.3.3). [N] tensors, groups contiguous."""
    reward = correct.to(torch.promote_types(correct.dtype, torch.float32))
    if step < args.length_penalty_warmup_steps or args.length_penalty_weight == 0:
        return reward
    return reward + args.length_penalty_weight * length_reward(correct, lengths, args.group_size)


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """r_j - r_bar, the group's mean reward as tau log Z (§2.3.2), no std. rewards: [N], groups
    contiguous; a group whose rewards are all equal gets 0."""
    r = rewards.view(-1, args.group_size)
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


def compute_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    args: Args,
    num_tokens: torch.Tensor | None = None,
    num_seqs: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    rollout_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Kimi's squared loss (§2.3.2 over 2 tau): 1/N sum_i (A_i - tau log pi(o_i)/pi_old(o_i))^2 /
    (2 tau), A_i = r_i - r_bar, the log-ratio summed over the completion's tokens; its gradient is
    minus eq. 3's. No reference model: ref_logps is unused.

    logps, old_logps, mask: [B, T]; advantages: [B]. num_seqs / num_tokens: the mini-batch's
    normalisers when this batch is one micro-batch of it (common.batching.grad_normalizers); by
    default the batch's own. Stats are token means over the same mini-batch, so they add up over
    micro-batches too."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    log_ratio = logps - old_logps
    # 1 without --rollout-correction; with it, token t's log-ratio keeps its value and its gradient
    # is weighted by w_t, as every script weighs its per-token policy terms
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    weighted = rc_weight * log_ratio + (1 - rc_weight) * log_ratio.detach()
    seq_log_ratio = (weighted * mask).sum(-1)  # log pi(o_i|x) / pi_old(o_i|x)
    residual = advantages - args.tau * seq_log_ratio  # r - tau log Z - tau log(pi / pi_old)
    loss = (residual**2 / (2 * args.tau)).sum() / num_seqs
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        k3 = torch.exp(log_ratio) - 1 - log_ratio  # k3 estimate of KL(old || new)
        stats["approx_kl"] = (k3 * mask).sum() / num_tokens
    return loss, stats


# TRY NOT TO MODIFY: the update loop
def update_policy(
    policy, optimizer, scheduler, accelerator, batch, args: Args, step: int, num_mini_batches=None
):
    """--ppo-epochs passes of `num_mini_batches` optimizer steps, each accumulating micro-batches
    with the mini-batch's normalisers. Returns rollout-mean stats."""
    n, device = batch["ids"].shape[0], batch["ids"].device
    num_mini_batches = num_mini_batches or args.num_mini_batches
    mb_size, updates = n // num_mini_batches, num_mini_batches * args.ppo_epochs
    stats, norms, skipped, canary = {}, [], 0, LogprobCanary()
    for epoch in range(args.ppo_epochs):
        seed = args.seed * 1_000_003 + step * 101 + epoch
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        for mb in range(num_mini_batches):
            mini_rows = perm[mb * mb_size : (mb + 1) * mb_size].tolist()
            plan = micro_batches(mini_rows, batch["lens"], args)
            micro = [micro_batch(batch, rows, p_w, c_w) for rows, p_w, c_w in plan]
            num_tokens, num_seqs = grad_normalizers([m["mask"] for m in micro])
            with weights_cast_once():
                for j, m in enumerate(micro):
                    last = j == len(micro) - 1
                    accelerator.sync_gradients = last  # DeepSpeed's engine steps at the last only
                    with contextlib.nullcontext() if last else accelerator.no_sync(policy):
                        logps, entropy = policy(m["ids"], m["attn"], m["p_len"], args.temperature)
                        # one on-policy update: pi_old = pi, the ratio is 1
                        old = m.get("old_logps", logps.detach())
                        adv, mask, ref = m["advantages"], m["mask"], m.get("ref_logps")
                        extra = dict(ref_logps=ref, rollout_logps=m.get("sampler_logps"))
                        loss, mb_stats = compute_policy_loss(
                            logps, old, adv, mask, args, num_tokens, num_seqs, **extra
                        )
                        accelerator.backward(loss)
                    mb_stats.update(loss=loss, entropy=(entropy * mask).sum() / num_tokens)
                    add_stats(stats, mb_stats, 1 / updates)
                    if "sampler_logps" in m and epoch == 0 and mb == 0:  # sampler = our weights
                        canary.add(logps, m["sampler_logps"], mask)
            norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            # under DeepSpeed a float, or None
            norm = torch.as_tensor(torch.nan if norm is None else norm, device=device)
            if torch.isfinite(norm):  # one host sync per optimizer step, never per micro-batch
                optimizer.step()
            else:
                skipped += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            norms.append(norm.detach().float())
    stats.update(
        canary.stats(), grad_norm=torch.stack(norms).mean(), skipped_updates=float(skipped)
    )
    return stats


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    tokenizer, model = load_model(args)
    if args.tau <= 0 or args.length_penalty_weight < 0:  # ALGO LOGIC: eq. 2's tau > 0
        raise SystemExit("need --tau > 0 and --length-penalty-weight >= 0")
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only
        run.log(evaluate(sampler, eval_sets, args), 0)
        return run.close(sampler)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0

    for step in range(start_step, args.total_steps):
        timer = Timer()
        # ROLLOUT: G completions per prompt
        rows, completions, staleness = data.rollout(step, sampler, rank, world)
        prompts = [data.prompts[i] for i in rows]
        if args.vllm_enable_sleep_mode:
            sampler.sleep()  # free vLLM's memory for training; update_weights wakes it
        timer.lap("generate")
        golds = [data.golds[i] for i in rows for _ in range(args.group_size)]
        texts = [c.text for c in completions]
        correct, reward_info = data.score(completions, golds)  # the verifier, or --env's returns
        correct = torch.tensor(correct, device=device)
        lengths = torch.tensor([len(c.token_ids) for c in completions], device=device)
        truncated = torch.tensor([c.truncated for c in completions], device=device)
        timer.lap("reward")

        # ALGO LOGIC: rewards (the step: the length reward's warm-up) and advantages
        rewards = compute_rewards(correct, lengths, truncated, args, step)
        advantages = compute_advantages(rewards, args)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args, step)
            advantages = compute_advantages(trained_rewards, args)

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        batch = make_batch(groups.prompts, groups.completions, pad_id, device)
        batch["advantages"] = advantages
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        plan = micro_batches(list(range(len(advantages))), batch["lens"], args)
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        with torch.no_grad():
            if recompute and has_signal:
                old_logps = compute_logps(policy, batch, args.temperature, plan)
                # DATA: --replay's rows keep their stored log-probs
                batch["old_logps"] = data.update_replay(groups, old_logps, advantages)
        timer.lap("old_logprobs")

        # TRAIN
        stats = {"grad_norm": 0.0, "skipped_updates": 0.0}  # no advantage anywhere: no update
        if has_signal:
            if args.reset_optimizer:  # ALGO LOGIC: a new problem each iteration, a fresh optimizer
                optimizer.state.clear()
            stats = update_policy(policy, optimizer, scheduler, accelerator, batch, args, step)
        run.count_bad_updates(int(stats["skipped_updates"]), step)
        timer.lap("train")
        sampler.update_weights(accelerator.unwrap_model(policy).lm)  # the next rollout's policy
        timer.lap("weight_sync")

        # TRY NOT TO MODIFY: record metrics
        stats.update(
            no_signal=float(not has_signal), lr=scheduler.get_last_lr()[0], staleness=staleness
        )
        metrics = step_metrics(
            accelerator, completions, correct, rewards, reward_info, stats, timer, args.group_size
        )
        metrics.update(data.metrics(groups, accelerator))
        last_step = step + 1 == args.total_steps
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or last_step):
            metrics.update(evaluate(sampler, eval_sets, args))
        run.log(metrics, step)
        run.log_samples(step, prompts, texts, rewards, tokenizer.decode)
        stopping = run.stop_requested()  # SIGINT / SIGTERM: finish the step, save, exit cleanly
        if stopping or (
            args.save_every > 0 and (step + 1) % args.save_every == 0 and not last_step
        ):
            save_checkpoint(run, policy, tokenizer, sampler, data, step + 1)
        if stopping:
            accelerator.print(
                f"stopped by signal after step {step + 1}; resume: --resume {run.dir}"
            )
            return run.close(sampler)

    save_checkpoint(run, policy, tokenizer, sampler, data, args.total_steps)
    accelerator.print(f"done: {run.dir}")
    run.close(sampler)


if __name__ == "__main__":
    main(tyro.cli(Args))
