# docs and results: README.md#the-algorithms
"""RLOO: REINFORCE with a leave-one-out baseline, each completion one action.

Paper: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", https://arxiv.org/abs/2402.14740 (v2): §2.2 eq. 3-4, §2.3, App. C. No
official code (tools/compare_peers.py runs TRL's, verl's and OpenRLHF's RLOO beside this one).

What this algorithm changes vs GRPO: the whole completion is one action (§2.2): its reward carries
the k1 KL to a frozen reference summed over its tokens, its baseline is the mean reward of the
other G - 1 (no std), and the loss is REINFORCE's on its log-probability: no ratio, no clip, no KL
term; a long completion moves the policy more than a short one:

    R_i = r_i - beta sum_t (log pi_old(o_it) - log pi_ref(o_it))                      (eq. 3-4)
    A_i = R_i - 1/(G-1) sum_{j != i} R_j  =  G/(G-1) (R_i - mean_g R)                   (§2.3)
    L = -1/N sum_i A_i sum_t log pi(o_it)                                               (§2.3)

As the paper (App. C): 2 gradient steps per rollout with this estimator, the second on the previous
policy's samples. --rloo-loss token-clip is verl's and OpenRLHF's RLOO; TRL clips the sequence
ratio. Defaults: App. C's TL;DR run (docs/algorithms.md) on grpo.py's model, data, lengths and
evaluation. --rollout-correction (on with vLLM; not from the paper) weights each token's term.

    accelerate launch rloo.py                                  # the paper setting, on GPUs
    python rloo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from common.args import SharedArgs
from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # App. C, the TL;DR run; the model and data are grpo.py's
    group_size: int = 4  # k, samples per prompt (the paper runs 2 and 4)
    prompts_per_step: int = 128  # rollout batch 512 (completions)
    warmup_steps: int = 36  # linear warm-up over 3% of the 1200 optimizer steps
    total_steps: int = 600  # RL steps
    num_mini_batches: int = 2  # step batch 256: two gradient steps per rollout

    # Algorithm specific arguments
    beta: float = 0.03
    """KL coefficient: R = r - beta sum_t log(pi_old / pi_ref) (0 loads no reference model)"""
    rloo_loss: Literal["reinforce", "token-clip"] = "reinforce"
    """reinforce: -A sum_t log pi, the paper's; token-clip: PPO's clip, a token mean (verl)"""
    clip_eps_low: float = 0.2
    """--rloo-loss token-clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """--rloo-loss token-clip: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The task reward r_i: 1 for a verified answer, 0 otherwise. [N] tensors."""
    return correct.float()


def kl_shaped_rewards(rewards, mask, old_logps, ref_logps, args: Args) -> torch.Tensor:
    """R_i of eq. 3-4: k1 summed over the completion, at the policy that sampled it. rewards: [N];
    mask, old_logps, ref_logps: [N, T]."""
    if args.beta == 0:
        return rewards
    return rewards - args.beta * ((old_logps - ref_logps) * mask).sum(-1)


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = R_i - 1/(G-1) sum_{j != i} R_j (§2.3). rewards: [N], the KL-shaped R, groups
    contiguous."""
    r = rewards.view(-1, args.group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (args.group_size - 1)  # the other G - 1
    return (r - baseline).view(-1)


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
    """RLOO loss (§2.3): -1/N sum_i A_i sum_t log pi(o_it); --rloo-loss token-clip:
    -1/sum_i |o_i| sum_i sum_t min(r A_i, clip(r) A_i).

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    if args.rloo_loss == "reinforce":  # the completion's log-probability: a sum over its tokens
        loss = (-adv * logps * rc_weight * mask).sum() / num_seqs
    else:
        clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
        surrogate = torch.minimum(ratio * adv, clipped * adv)
        loss = token_mean(-surrogate * rc_weight)
        with torch.no_grad():
            stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
            stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
        if ref_logps is not None:  # the k1 of the reward, per token
            stats["kl_ref"] = token_mean(old_logps - ref_logps)
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
        batch = make_batch(groups.prompts, groups.completions, pad_id, device)
        plan = micro_batches(list(range(len(trained_rewards))), batch["lens"], args)
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        recompute = recompute or args.beta > 0  # ALGO LOGIC: the KL in the reward is at pi_old
        with torch.no_grad():
            if recompute:
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            if ref_policy is not None:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
            # ALGO LOGIC: the KL-shaped reward, then the leave-one-out advantages; a replayed
            # row's KL is at today's policy (update_replay caps its ratio by the advantage's sign)
            shaped = kl_shaped_rewards(
                trained_rewards, batch["mask"], batch.get("old_logps"), batch.get("ref_logps"), args
            )
            advantages = compute_advantages(shaped, args)
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
