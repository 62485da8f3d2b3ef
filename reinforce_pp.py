# docs and results: README.md#the-algorithms
"""REINFORCE++: PPO without a critic, the KL inside the reward and advantages normalised globally.

Paper: Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global
Normalization", https://arxiv.org/abs/2501.03262 (v9: eq. 1, 4-5, Algorithm 1; w/ Baseline: eq.
6-8; the settings: v1 §4.2 Table 1). Official code: OpenRLHF (experience_maker.py).

What this algorithm changes vs GRPO: no group statistics and no KL term in the loss: a k1 KL to a
frozen reference is a penalty in every token's reward, the outcome sits on the last token, and a
token's advantage is its return, normalised over all the rollout's tokens (every rank). PPO's clip
with GRPO's per-sequence token mean:

    R_t = [t = |o|] r - beta KL(t),   KL(t) = log pi_old(o_t) - log pi_ref(o_t)        (eq. 4)
    G_t = sum_{u >= t} gamma^(u-t) R_u,   A_t = (G_t - mean_batch G) / (std_batch G + eps)  (eq. 5)
    J = E[ 1/|o| sum_t min(s_t A_t, clip(s_t, 1-eps, 1+eps) A_t) ],  s_t = pi / pi_old  (eq. 1)

--group-baseline (w/ Baseline): A' = r - mean_g r on every token, normalised as above; the KL is a
k2 loss, beta/2 (log pi - log pi_ref)^2, in the same mean. A masked token inside a completion (a
tool's output) gets no reward; the return carries past it (verl).

Defaults: v1 Table 1 (docs/algorithms.md), grpo.py's model, data and lengths. Our choices: the
population std over tokens (OpenRLHF; verl: unbiased) plus eps = 1e-6 (eq. 5; OpenRLHF clamps the
variance at 1e-8); unclamped KL estimates (OpenRLHF: +-10); no k = 1 (--group-size >= 2);
--rollout-correction (on with vLLM) weights the policy term.

    accelerate launch reinforce_pp.py                              # the paper setting, on GPUs
    python reinforce_pp.py --model-name-or-path /tmp/toy/model ... # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import tyro

from common.args import SharedArgs
from common.batching import global_sum, grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # v1 §4.2 Table 1 (OpenRLHF's units); the model and data are grpo.py's
    group_size: int = 4  # samples per prompt
    prompts_per_step: int = 256  # rollout batch, in prompts
    learning_rate: float = 5e-7  # actor lr
    num_mini_batches: int = 8  # training batch 128 of the 1024 samples

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """PPO clip: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    beta: float = 0.001
    """KL coefficient: k1 in the reward; --group-baseline: a k2 loss (0: no reference)"""
    adv_eps: float = 1e-6
    """eps in A = (G - mean) / (std + eps), over all the rollout's tokens"""
    gamma: float = 1.0
    """discount in a token's return (1: the paper's undiscounted sum)"""
    group_baseline: bool = False
    """REINFORCE++ w/ Baseline: r - mean_g r on every token; KL as a k2 loss (eq. 6-8)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The outcome reward r of eq. 4: 1 for a verified answer, 0 otherwise. [N] tensors."""
    return correct.float()


def compute_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = R_t + gamma G_t+1 over the tokens with mask 1; a masked token gets 0 and the return
    carries past it. token_rewards, mask: [B, T]."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, 0.0)
    return returns


def compute_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    args: Args,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [N, T] (eq. 4-7). rewards: [N], this rank's share, groups contiguous;
    mask, old_logps (the sampler's policy), ref_logps: [N, T] (log-probs needed if beta > 0)."""
    r = rewards
    if args.group_baseline:  # eq. 6: the group's mean reward as the baseline, no std
        g = rewards.view(-1, args.group_size)
        r = (g - g.mean(dim=1, keepdim=True)).view(-1)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)  # a row's last token
    token_rewards = last * r[:, None]
    if args.beta > 0 and not args.group_baseline:  # eq. 4: k1, in the reward of every token
        token_rewards = token_rewards - args.beta * (old_logps - ref_logps) * mask
    returns = compute_returns(token_rewards, mask, args.gamma)
    m = mask.to(returns.dtype)
    count, total = global_sum(torch.stack([m.sum(), (returns * m).sum()]))  # eq. 5, all ranks
    mean = total / count.clamp(min=1)
    std = (global_sum(((returns - mean) ** 2 * m).sum()) / count.clamp(min=1)).sqrt()
    return (returns - mean) / (std + args.adv_eps) * m


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
    """REINFORCE++ loss (eq. 1): -1/B sum_i 1/|o_i| sum_t min(s A_t, clip(s) A_t); with
    --group-baseline + beta k2 in the same mean (eq. 8).

    logps, old_logps, mask, ref_logps, advantages: [B, T] (docs/design.md "The contract").
    num_seqs / num_tokens: the mini-batch's normalisers (default: this batch's), so its
    micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -surrogate * rc_weight
    if args.beta > 0 and args.group_baseline:
        kl = 0.5 * (logps - ref_logps) ** 2  # k2 as the loss: the reverse KL's gradient (App. B.1)
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    elif ref_logps is not None:  # the k1 that is in the reward
        stats["kl_ref"] = token_mean(old_logps - ref_logps).detach()
    seq_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # 1/|o_i| sum_t
    loss = seq_means.sum() / num_seqs  # 1/B sum_i
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
        stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
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
    if not 0 < args.gamma <= 1 or (args.group_baseline and args.gamma != 1):  # ALGO LOGIC
        raise SystemExit("--gamma must be in (0, 1], and 1 with --group-baseline (eq. 6)")
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    tokenizer, model = load_model(args)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    if args.beta > 0:  # ALGO LOGIC: the KL term's frozen reference
        ref_policy = load_reference(args, accelerator, policy)
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

        # ALGO LOGIC: rewards; the advantages follow the log-probs (the KL is in the reward)
        rewards = compute_rewards(correct, lengths, truncated, args)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        trained_rewards = rewards
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        # ALGO LOGIC: per-token advantages, set after the log-probs
        batch = make_batch(groups.prompts, groups.completions, pad_id, device, ["advantages"])
        plan = micro_batches(list(range(len(trained_rewards))), batch["lens"], args)
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        recompute = recompute or (args.beta > 0 and not args.group_baseline)  # ALGO: KL(t)'s pi_old
        with torch.no_grad():
            if recompute:
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            if ref_policy is not None:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
            # ALGO LOGIC: per-token advantages over every rank's rollout (eq. 4-7); a replayed
            # row's KL is at today's policy (update_replay caps its ratio by the advantage's sign)
            advantages = compute_advantages(
                trained_rewards, batch["mask"], args, batch.get("old_logps"), batch.get("ref_logps")
            )
            batch["advantages"] = advantages
            if recompute:  # DATA: --replay's rows keep their stored log-probs
                batch["old_logps"] = data.update_replay(groups, batch["old_logps"], advantages)
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        timer.lap("old_logprobs")

        # TRAIN
        stats = {"grad_norm": 0.0, "skipped_updates": 0.0}  # no advantage anywhere: no update
        if has_signal:
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
