# docs and results: README.md#the-algorithms
"""DARO: Difficulty-Aware Reweighting Policy Optimization.

Paper: Zhou, Ma, Liang, Shen, Cui, Zhang 2025, https://arxiv.org/abs/2510.09001. Read for this file:
the first author's write-up of the paper (cited "W eq. n"); the PDF and code were not available.

What this algorithm changes: GRPO's token-mean loss becomes a sum over difficulty buckets, each with
a learnt weight. Completions are bucketed by their group's pass rate mu = #correct / G; bucket mu's
loss L_mu is its share of the token-mean PPO-clip loss (W eq. 2; L: the mini-batch's completion
tokens), and a -ln w penalty makes every bucket contribute equally at the optimum; mu = 0 and 1 have
no advantage (W eq. 4):

    L_DARO = sum_{mu = 1/G .. (G-1)/G} ( w_mu L_mu - ln w_mu )
    L_mu   = 1/L sum_{i: mu_i = mu} sum_t -min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)

With w = 1 it is GRPO with a token mean; for a fixed L_mu > 0 the optimal weight is 1/L_mu. Our
choice (the write-up is silent): on policy L_mu = -1/L sum_{i in mu} |o_i| A_i is often ~0 or
negative, where min_w (w L_mu - ln w) has no minimum, so w is fitted to the advantage mass
M_mu = 1/L sum_{i in mu} |o_i| |A_i| > 0: before each policy step s_mu = ln w_mu takes one step of
its own optimizer on sum_mu (exp(s_mu) M_mu - s_mu), clamped to [ln w_min, ln w_max], optimal at
w_mu M_mu = 1 (docs/algorithms.md, "DARO's weights"). M_mu and the bucket counts are all-reduced
over ranks; w starts at 1 and is checkpointed. Defaults: docs/algorithms.md; the std, the verifier
and --rollout-correction (on with vLLM) as grpo.py.

    accelerate launch daro.py                                  # the paper setting, on GPUs
    python daro.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import math
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
from common.models import load_model, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # the write-up's 128 prompts per step; G = 8 our choice
    group_size: int = 8  # G - 1 weighted pass-rate buckets 1/G .. (G-1)/G
    prompts_per_step: int = 128

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """PPO clip: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""
    daro_w_optimizer: Literal["sgd", "adam"] = "sgd"
    """optimizer of the bucket log-weights s_mu = ln w_mu (their own, not the policy's)"""
    daro_w_lr: float = 0.1
    """learning rate of the bucket log-weights (SGD: near the optimum an EMA of ln(1/M_mu))"""
    daro_w_min: float = 1e-3
    """lower bound of every w_mu (s_mu is clamped to [ln w_min, ln w_max] after each step)"""
    daro_w_max: float = 1e3
    """upper bound of every w_mu (keeps w finite when a bucket's loss is ~0)"""
    daro_w_target: Literal["mass", "loss"] = "mass"
    """w_mu -> 1/target: mass, the advantage mass M_mu; loss, L_mu at r = 1, floored (w L = C)"""
    daro_loss_floor: float = 0.1
    """--daro-w-target loss: L_mu floored at this fraction of M_mu (so -ln w_mu is bounded)"""
    daro_w_normalize: bool = False
    """ablation: the policy step's w_mu scaled to mean 1 over the buckets present"""


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


def pass_rate_bucket(correct: torch.Tensor, args: Args) -> torch.Tensor:
    """Each completion's bucket c = #correct in its group, pass rate mu = c / G (W "Idea"). correct:
    [N], groups contiguous; returns [N] long in 0..G."""
    return (correct.view(-1, args.group_size) == 1).sum(1).repeat_interleave(args.group_size)


def bucket_from_advantages(advantages: torch.Tensor, args: Args) -> torch.Tensor:
    """The same buckets from whole groups' advantages: with 0/1 rewards A > 0 marks the correct
    completions (mu = 0 or 1: 0)."""
    return (advantages.view(-1, args.group_size) > 0).sum(1).repeat_interleave(args.group_size)


def bucket_onehot(bucket: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B, G+1] one-hot of each sequence's bucket, mu = 0, 1 (columns 0, G) left out (W eq. 4)."""
    onehot = torch.nn.functional.one_hot(bucket.long(), group_size + 1)
    onehot[:, 0] = onehot[:, group_size] = 0
    return onehot


def bucket_mass(adv, bucket, mask, args, num_tokens=None, old_logps=None, rollout_logps=None):
    """[3, G+1] float64, per bucket: M_mu, the sequences, L_mu at r = 1 (tokens weighted by the
    rollout correction given old_logps). With the mini-batch's num_tokens the rows add up over
    micro-batches and ranks."""
    onehot = bucket_onehot(bucket, args.group_size).double()
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    rc = 1.0 if old_logps is None else rollout_correction(old_logps, rollout_logps, mask, args)[0]
    mass = onehot.T @ (adv.double().abs() * mask.sum(-1)) / denom
    onpolicy_loss = onehot.T @ (-adv.double() * (rc * mask).double().sum(-1)) / denom
    return torch.stack([mass, onehot.sum(0), onpolicy_loss])


def w_target(mass: torch.Tensor, onpolicy_loss: torch.Tensor, args: Args) -> torch.Tensor:
    """[G+1] w_mu -> 1/target_mu: M_mu (--daro-w-target mass), or L_mu at r = 1 floored at
    --daro-loss-floor x M_mu (loss)."""
    if args.daro_w_target == "mass":
        return mass
    return torch.maximum(onpolicy_loss, args.daro_loss_floor * mass)


class DaroWeights:
    """The bucket weights w_mu = exp(s_mu), c = 0..G (0, G unused), and their optimizer; float64,
    so ranks stepping on the same inputs stay identical."""

    def __init__(self, args: Args, device: torch.device | str = "cpu"):
        self.group_size = args.group_size
        self.bounds = (math.log(args.daro_w_min), math.log(args.daro_w_max))
        log_w = torch.zeros(args.group_size + 1, dtype=torch.float64, device=device)  # w = 1
        self.log_w = log_w.clamp(*self.bounds).requires_grad_()
        optimizer = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[args.daro_w_optimizer]
        self.optimizer = optimizer([self.log_w], lr=args.daro_w_lr)
        self.interior = torch.ones_like(log_w, dtype=torch.bool)  # 0 < mu < 1: c = 1..G-1
        self.interior[0] = self.interior[args.group_size] = False

    def weights(self) -> torch.Tensor:
        """w_mu, detached: the policy step treats them as constants."""
        return self.log_w.detach().exp()

    def step(self, mass: torch.Tensor, present: torch.Tensor) -> None:
        """One step on sum_mu (exp(s_mu) M_mu - s_mu) over the present buckets 0 < mu < 1, then s
        clamped to the bounds; absent buckets keep their weight. No host sync."""
        present = present & self.interior
        with torch.enable_grad():
            objective = torch.where(present, self.log_w.exp() * mass - self.log_w, 0.0).sum()
            self.optimizer.zero_grad()
            objective.backward()
        before = self.log_w.detach().clone()
        self.optimizer.step()
        with torch.no_grad():
            self.log_w.copy_(torch.where(present, self.log_w, before).clamp(*self.bounds))

    def state_dict(self) -> dict:
        return {"log_w": self.log_w.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.log_w.copy_(state["log_w"])
        self.optimizer.load_state_dict(state["optimizer"])


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
    bucket: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    bucket_seqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DARO loss (W eq. 4): sum_mu (w_mu L_mu - ln w_mu), L_mu = 1/L sum_{i in mu} sum_t -PPO-clip.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up. bucket: [B],
    c = #correct in the group; weights: [G+1] w_mu (constants; 1); bucket_seqs: [G+1] the
    mini-batch's sequences per bucket."""
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
    bucket = bucket_from_advantages(advantages, args) if bucket is None else bucket
    w = (torch.ones(args.group_size + 1) if weights is None else weights).to(per_token)
    onehot = bucket_onehot(bucket, args.group_size).to(per_token)
    # L_mu: bucket mu's share of the token-mean loss (W eq. 2)
    bucket_loss = onehot.T @ (per_token * mask).sum(-1) / num_tokens
    seqs = onehot.sum(0) if bucket_seqs is None else bucket_seqs.to(per_token)
    if args.daro_w_normalize:  # ablation (our choice): mean 1 over the buckets present (not 0, 1)
        present = seqs > 0
        mean_w = (w * present).sum() / present.sum().clamp(min=1)
        w = w / torch.where(present.any(), mean_w, 1.0)  # none present: w as is
    neg_log_w = torch.where(seqs > 0, -torch.log(w) / seqs.clamp(min=1e-12), 0.0)  # over mu's seqs
    weighted = (w * bucket_loss).sum()
    loss = weighted + (onehot @ neg_log_w).sum()  # W eq. 4
    with torch.no_grad():
        stats["policy_loss"] = weighted.detach()
        stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
        stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
        mass = bucket_mass(advantages, bucket, mask, args, num_tokens)[0]
        stats["daro_mass"], stats["daro_weighted_mass"] = mass.sum(), (w.double() * mass).sum()
        # per bucket, named by mu: L_mu, M_mu and w_mu (as a token mean of a constant)
        for c in range(1, args.group_size):
            mu = f"{c / args.group_size:.4g}"
            stats[f"daro_L_{mu}"], stats[f"daro_M_{mu}"] = bucket_loss[c].detach(), mass[c]
            stats[f"daro_w_{mu}"] = w[c] * mask.sum() / num_tokens
    return loss, stats


# TRY NOT TO MODIFY: the update loop
def update_policy(
    policy,
    optimizer,
    scheduler,
    accelerator,
    batch,
    args: Args,
    step: int,
    num_mini_batches=None,
    daro=None,
):
    """--ppo-epochs passes of `num_mini_batches` optimizer steps, each accumulating micro-batches
    with the mini-batch's normalisers. Returns rollout-mean stats."""
    n, device = batch["ids"].shape[0], batch["ids"].device
    # ALGO LOGIC: main's w_mu, else w = 1
    daro = DaroWeights(args, device) if daro is None else daro
    bucket = (
        batch["bucket"] if "bucket" in batch else bucket_from_advantages(batch["advantages"], args)
    )
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
            idx = perm[mb * mb_size : (mb + 1) * mb_size].to(device)  # ALGO LOGIC: DARO's weights
            num_tokens, num_seqs = grad_normalizers([m["mask"] for m in micro])
            old = batch["old_logps"][idx] if "old_logps" in batch else None
            sampled = batch["sampler_logps"][idx] if "sampler_logps" in batch else None
            adv, mask = batch["advantages"][idx], batch["mask"][idx]
            sums_mu = bucket_mass(adv, bucket[idx], mask, args, num_tokens, old, sampled)
            mass, bucket_seqs, onpolicy_loss = accelerator.reduce(sums_mu, "mean")
            daro.step(w_target(mass, onpolicy_loss, args), bucket_seqs > 0)
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
                        w = daro.weights()  # ALGO LOGIC: the bucket weights and counts
                        extra.update(bucket=bucket[m["rows"]], weights=w, bucket_seqs=bucket_seqs)
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
    floor, w_min, w_max = args.daro_loss_floor, args.daro_w_min, args.daro_w_max  # ALGO LOGIC
    if not (0 < floor <= 1 and 0 < w_min <= w_max and args.daro_w_lr > 0):
        raise SystemExit(
            "need 0 < --daro-loss-floor <= 1, 0 < --daro-w-min <= max, --daro-w-lr > 0"
        )
    tokenizer, model = load_model(args)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    daro = DaroWeights(args, device)  # ALGO LOGIC: the bucket weights, saved with the state
    accelerator.register_for_checkpointing(daro)
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
        bucket = pass_rate_bucket(groups.tensors(device).correct, args)  # ALGO LOGIC: DARO

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        batch = make_batch(groups.prompts, groups.completions, pad_id, device)
        batch["advantages"] = advantages
        batch["bucket"] = bucket  # ALGO LOGIC: for update_policy
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        plan = micro_batches(list(range(len(advantages))), batch["lens"], args)
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        # ALGO LOGIC: --daro-w-target loss weighs L_mu by the rollout correction, from pi_old
        recompute = recompute or args.daro_w_target == "loss" and args.rollout_correction != "none"
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
            stats = update_policy(
                policy, optimizer, scheduler, accelerator, batch, args, step, daro=daro
            )
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
