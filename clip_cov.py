# docs and results: README.md#the-algorithms
"""Clip-Cov and KL-Cov: restrain the tokens whose log-prob and advantage covary most.

Paper: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", https://arxiv.org/abs/2505.22617 (v1), section 4.2, eqs. (10)-(14) and Listing 1 (which
adds the PPO clip to eq. (12)); hyperparameters: section 4.3. Official code:
PRIME-RL/Entropy-Mechanism-of-RL.

What this algorithm changes vs GRPO: entropy collapses while log pi and A covary, so a tiny share of
the highest-covariance tokens leaves the update (Clip-Cov) or is held near pi_old (KL-Cov), as the
official code (verl/trainer/ppo/core_algos.py), with a token mean (DAPO's) over the mini-batch's N
tokens and r = pi / pi_old:

    Cov_it = (A_i - mean A) (log pi_it - mean log pi)        (means over the mini-batch's tokens)
    clip: L = 1/N sum_it 1[it not in S] max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))
          S: max(1, int(clip_cov_ratio N)) drawn uniformly from unclipped tokens with lb < Cov < ub
    kl:   L = 1/N sum_it [-A_i r_it + coef 1[it in S] |log r_it|]    (no clip; |log r|: the KL)
          S: the max(1, int(kl_cov_ratio N)) tokens of largest Cov

Our choices: S is chosen once per mini-batch over all ranks, at the policy the update starts from
(the official code: per micro-batch, so S depends on the split), ties broken by random keys;
--rollout-correction (on with vLLM) weights the policy term. Defaults: the official 7B recipes
(docs/algorithms.md) on grpo.py's MATH (the paper's DAPO-MATH files are not on the hub), without
dynamic sampling (dapo.py has it).

    accelerate launch clip_cov.py                              # the 7B recipe, on GPUs
    python clip_cov.py --model-name-or-path /tmp/toy/model ... # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from common import batching
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
    # the official 7B recipes, recipe/dapo/7b_clip_cov.sh and 7b_kl_cov.sh
    model_name_or_path: str = "Qwen/Qwen2.5-7B"
    max_prompt_tokens: int = 2048
    group_size: int = 8
    prompts_per_step: int = 256
    max_new_tokens: int = 8192
    learning_rate: float = 5e-7
    num_mini_batches: int = 8  # the recipes: mini-batches of 32 of the 256 prompts
    eval_max_new_tokens: int = 8192

    # Algorithm specific arguments
    cov_form: Literal["clip", "kl"] = "clip"
    """clip: Clip-Cov (the selected tokens get no gradient); kl: KL-Cov (a |log r| penalty)"""
    clip_eps_low: float = 1.0
    """clip form: PPO clip, r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 1.0
    """clip form: PPO clip, r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    clip_cov_ratio: float = 2e-4
    """clip form: the share of a mini-batch's tokens drawn and detached (at least 1)"""
    clip_cov_lb: float = 1.0
    """clip form: only tokens with clip_cov_lb < Cov < clip_cov_ub are drawn"""
    clip_cov_ub: float = 5.0
    """clip form: the band's upper end"""
    kl_cov_ratio: float = 2e-3
    """kl form: the share of tokens, largest Cov first, penalised (at least 1; 32B: 2e-4)"""
    kl_cov_coef: float = 1.0
    """kl form: coefficient of the |log r| penalty on them (the official ppo_kl_coef)"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen reference model (0: none loaded)"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The outcome reward: 1 for a verified answer, else 0. [N] tensors."""
    return correct.float()


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) (DeepSeekMath §4.1.2, R1 eq. 3), std
    unbiased. rewards: [N], groups contiguous."""
    r = rewards.view(-1, args.group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + args.adv_eps)
    return adv.view(-1)


def select_tokens(now, old, advantages, mask, args: Args, keys) -> torch.Tensor:
    """S, [N, C] bool, over all ranks: kl, the k largest Cov (float64); clip, the k candidates of
    smallest key (the official randperm's law). now: the log-probs the update starts from; mask:
    this rank's tokens of the mini-batch; keys: i.i.d. uniform, also breaking ties (exactly k)."""

    def kth_largest(x, k):  # over all ranks, each sending its k largest
        return batching.global_cat(x.flatten().topk(min(k, x.numel())).values).topk(k).values[-1]

    valid = mask > 0
    now, adv = now.double(), advantages.double()[:, None].expand_as(now)
    sums = torch.stack([adv[valid].sum(), now[valid].sum(), valid.sum().double()])
    sum_adv, sum_logp, n = batching.global_sum(sums)
    cov = (adv - sum_adv / n) * (now - sum_logp / n)
    if args.cov_form == "kl":
        ratio, score, eligible = args.kl_cov_ratio, cov, valid
    else:  # candidates: not already PPO-clipped, Cov in the band
        r = torch.exp(now - old)
        unclipped = -adv * r.clamp(1 - args.clip_eps_low, 1 + args.clip_eps_high) <= -adv * r
        band = (cov > args.clip_cov_lb) & (cov < args.clip_cov_ub)
        ratio, score, eligible = args.clip_cov_ratio, -keys, valid & unclipped & band
    k = max(1, int(ratio * n.item()))  # host reads: here and for the ties, once per mini-batch
    score = torch.where(eligible, score, -torch.inf)
    kth = kth_largest(score, k)  # -inf when fewer than k are eligible: then all of them
    above, tied = score > kth, eligible & (score == kth)
    missing = k - int(batching.global_sum(above.sum()))
    return above | (tied & (-keys >= kth_largest(torch.where(tied, -keys, -torch.inf), missing)))


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
    cov_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov / KL-Cov loss, the token mean above, on S = `cov_select` ([B, T] bool; update_policy
    selects it once per mini-batch; None: within this batch, as the official code, by global RNG).

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    if cov_select is None:
        keys = torch.rand(mask.shape, dtype=torch.float64, device=mask.device)
        cov_select = select_tokens(logps.detach(), old_logps, advantages, mask, args, keys)
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if args.cov_form == "kl":  # no ratio clip
        surrogate = ratio * adv
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -surrogate * rc_weight
    if args.cov_form == "clip":  # S's terms are 0 (no gradient), still counted in num_tokens
        per_token = torch.where(cov_select, 0.0, per_token)
    else:  # the official code's KL penalty on S: |log r|
        per_token = per_token + args.kl_cov_coef * log_ratio.abs() * cov_select
    if args.beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || pi_ref), R1 eq. 2
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    loss = (per_token * mask).sum() / num_tokens  # token mean
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["cov_selected_frac"] = token_mean(cov_select)
        if args.cov_form == "clip":
            stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
            stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        else:
            stats["abs_log_ratio"] = token_mean(log_ratio.abs())  # the official code's "ppo_kl"
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
            # ALGO LOGIC: S once per mini-batch over all ranks, at the policy its update starts from
            if epoch == mb == 0 and "old_logps" in batch:
                now = batch["old_logps"]
            else:
                with torch.no_grad():
                    now = compute_logps(policy, batch, args.temperature, plan)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            gen = torch.Generator().manual_seed(hash((args.seed, step, epoch, mb, rank)) % 2**63)
            keys = torch.rand(now.shape, generator=gen, dtype=torch.float64).to(device)
            mask = torch.zeros_like(batch["mask"])
            mask[mini_rows] = batch["mask"][mini_rows]  # this mini-batch's tokens
            old = batch.get("old_logps", now)
            batch["cov_select"] = select_tokens(now, old, batch["advantages"], mask, args, keys)
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
                        extra["cov_select"] = m["cov_select"]  # ALGO LOGIC: this micro-batch's S
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

        # ALGO LOGIC: rewards and advantages
        rewards = compute_rewards(correct, lengths, truncated, args)
        advantages = compute_advantages(rewards, args)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)
            advantages = compute_advantages(trained_rewards, args)

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        # ALGO LOGIC: update_policy's token selection, per token
        batch = make_batch(groups.prompts, groups.completions, pad_id, device, ["cov_select"])
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
