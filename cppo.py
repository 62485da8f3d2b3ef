# docs and results: README.md#the-algorithms
"""CPPO: Completion Pruning Policy Optimization.

Paper: Lin et al. 2025, https://arxiv.org/abs/2503.22342 (§3: completion pruning, dynamic
completion allocation). Official code: lzhxmu/CPPO (src/open_r1/grpo_trainer_math.py, on TRL).

GRPO (grpo.py's advantages and loss) trained on part of its rollout: after the group advantages
are computed on all G completions of each prompt, the P share with the smallest |A_i| is pruned,
and only the kept completions K enter the batch: they alone get old and reference log-probs and a
backward pass (generation is not cut). The loss is GRPO's over K, so its normaliser is |K|:

    J = E[ 1/|K| sum_{i in K} 1/|o_i| sum_t { min(r_it A_i, clip(r_it) A_i) - beta KL } ]
    K = all but the int(N P) completions of smallest |A| among this rank's N

Dynamic completion allocation (--allocation) samples int(1 / (1 - P)) times the prompts, so that
|K| is GRPO's batch of --prompts-per-step x G. A zero-advantage group (all right or all wrong) is
pruned first. Ties in |A| at the cut are broken at random (seeded by seed, step and rank; the
official torch.topk leaves them to the kernel).

Several ranks: each prunes its own completions, as the official code prunes each process's slice.
Every rank then keeps the same count, so the mini-batches and DDP's gradient sync stay in step
without moving completions between ranks; groups never straddle ranks, so each A_i is the same
either way, and the loss normalisers count every rank's kept rows (common.batching). A global
top-k (the official verl port, whose single controller sees the whole batch) could leave a rank
with fewer or no rows. Defaults and the code's other departures: docs/algorithms.md "CPPO".

    accelerate launch cppo.py                                  # the paper's MATH setting, P = 0.5
    accelerate launch cppo.py --pruning 0.875 --no-allocation
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
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # lzhxmu/CPPO's scripts/CPPO_math.sh, recipes/math/Qwen2.5-7B-Instruct.yaml; else grpo.py's
    model_name_or_path: str = "Qwen/Qwen2.5-7B-Instruct"
    max_prompt_tokens: int = 512  # max_prompt_length
    group_size: int = 16  # num_generations
    ppo_epochs: int = 2  # num_iterations

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """PPO clip: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    beta: float = 0.04
    """k3 KL coefficient to the frozen reference model (0 loads no reference model)"""
    adv_eps: float = 1e-4  # (std_grouped_rewards + 1e-4)
    """eps in A = (R - mean) / (std + eps)"""
    pruning: float = 0.5  # CPPO_math.sh --pruning=0.5
    """P: the share of each rank's completions pruned (the smallest |A|) before training"""
    allocation: bool = True  # CPPO_math.sh --allocation
    """sample int(1 / (1 - P)) x --prompts-per-step prompts, so the kept batch is GRPO's size"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The outcome reward: 1 for a verified answer, else 0. [N] tensors."""
    return correct.float()


def prune_completions(advantages: torch.Tensor, args: Args, generator) -> torch.Tensor:
    """The kept rows, ascending: all but the int(N P) of smallest |A| (grpo_trainer_math.py's
    count), ties broken in the random order of `generator`. advantages: this rank's [N]."""
    n = advantages.numel()
    shuffle = torch.randperm(n, generator=generator)
    order = shuffle[torch.sort(advantages.detach().abs().cpu()[shuffle], stable=True).indices]
    return order[int(n * args.pruning) :].sort().values


def allocation(args: Args) -> int:
    """How many times --prompts-per-step a step samples: int(1 / (1 - P)), the official repeat."""
    return int(1 / (1 - args.pruning) + 1e-9) if args.allocation else 1


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) (DeepSeekMath §4.1.2, R1 eq. 3), std
    unbiased. rewards: [N], groups contiguous."""
    r = rewards.view(-1, args.group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + args.adv_eps)
    return adv.view(-1)


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
    """GRPO loss (DeepSeekMath eq. 3): -1/G sum_i 1/|o_i| sum_t [min(r A, clip(r) A) - beta KL_k3].

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -surrogate * rc_weight
    if args.beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || pi_ref), R1 eq. 2
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    seq_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # 1/|o_i| sum_t
    loss = seq_means.sum() / num_seqs  # 1/G sum_i
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


def check_args(args: Args, world: int) -> None:
    """One line for --pruning outside [0, 1), with --replay (it stores whole groups), or leaving
    each rank a kept count that --num-mini-batches does not divide."""
    if not 0 <= args.pruning < 1 or args.replay:
        raise SystemExit(f"--pruning must be in [0, 1), got {args.pruning}; no --replay")
    n = args.prompts_per_step // world * allocation(args) * args.group_size
    if (n - int(n * args.pruning)) % args.num_mini_batches:
        raise SystemExit(
            f"--num-mini-batches {args.num_mini_batches} must divide each rank's "
            f"{n - int(n * args.pruning)} kept completions (--pruning {args.pruning})"
        )


def pruning_counts(advantages: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """[kept, pruned, pruned with A != 0] completions of this rank (float64)."""
    pruned = torch.ones(len(advantages), dtype=torch.bool)
    pruned[kept] = False
    signal = int((pruned & (advantages.detach().cpu() != 0)).sum())
    counts = [len(kept), len(advantages) - len(kept), signal]
    return torch.tensor(counts, dtype=torch.float64, device=advantages.device)


def pruning_metrics(accelerator, counts: torch.Tensor) -> dict[str, float]:
    """train/cppo_kept, train/cppo_pruned (all ranks) and the pruned share that had a signal."""
    kept, pruned, signal = accelerator.reduce(counts, "sum").tolist()
    frac = signal / pruned if pruned else float("nan")
    return {
        "train/cppo_kept": kept,
        "train/cppo_pruned": pruned,
        "train/cppo_pruned_signal_frac": frac,
    }


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    check_args(args, world)
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
        # ROLLOUT: G completions per prompt; ALGO LOGIC: allocation's extra prompts
        count = args.prompts_per_step // world * allocation(args)
        rows, completions, staleness = data.rollout(step, sampler, rank, world, count)
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

        # ALGO LOGIC: rewards and advantages
        rewards = compute_rewards(correct, lengths, truncated, args)
        advantages = compute_advantages(rewards, args)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)
            advantages = compute_advantages(trained_rewards, args)

        # ALGO LOGIC: completion pruning; the pruned rows never enter the batch
        ties = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
        kept = prune_completions(advantages, args, ties).tolist()
        pruning = pruning_counts(advantages, kept)
        advantages = advantages[kept]
        kept_prompts = [groups.prompts[i // args.group_size] for i in kept]
        kept_completions = [groups.completions[i] for i in kept]

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        batch = make_batch(kept_prompts, kept_completions, pad_id, device)
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
            if ref_policy is not None and has_signal:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
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
        metrics.update(pruning_metrics(accelerator, pruning))  # ALGO LOGIC: what pruning dropped
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
