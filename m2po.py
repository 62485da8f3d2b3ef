# docs and results: README.md#the-algorithms
"""M2PO: Second-Moment Trust Policy Optimization.

Paper: "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
Zheng et al. 2025, https://arxiv.org/abs/2510.01161 (v2), section 5.2, eq. (5) and Algorithm 1
(M2: eq. (4), section 5.1; tau = 0.04: section 5.2, App. B). Official code: Infini-AI-Lab/M2PO.

What this algorithm changes vs GRPO: it trains on stale rollouts. The ratio is to the behaviour
policy mu, the sampler's own log-probs (the paper's pi_theta_old), unclipped; instead the mean
(log r)^2 of the trust-region tokens T (those a ratio clip acts on: A > 0 with r > 1, A < 0 with
r < 1, as the official code) is kept under tau by dropping the largest. Dropped tokens still count
in the token mean:

    J = 1/sum_i |o_i| sum_i sum_t M_it r_it A_i,   r_it = pi_theta(o_it) / mu(o_it)
    Algorithm 1: M2_it = (log r_it)^2; while mean_T M2 > tau: j = argmax_T M2, M_j = 0, T = T - {j}
    A_i = (R_i - mean_g R) / (std_g R + eps)

Our choices: Algorithm 1 as the paper states it, once per mini-batch over all ranks, at the
mini-batch's starting policy (the official code solves for an adaptive ratio clip instead; the
peers select per micro-batch); mu = old_logps for rows the sampler did not produce; no
--rollout-correction on top of r (explicit modes are refused). Defaults: the official
train-scripts on one node (docs/algorithms.md), with qwen-boxed's prompt, a 0/1 reward (the paper:
0.1 for an extractable answer + 1 if correct) and grpo.py's evaluation.

    accelerate launch m2po.py                                  # the paper setting (s0), on GPUs
    accelerate launch m2po.py --off-policy-steps 64 --num-mini-batches 4   # s256: 256 stale updates
    python m2po.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
import tyro

from common.args import SharedArgs
from common.batching import global_cat, grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # the official train-scripts/m2po-qwen-math-7b-s*.sh, one node
    model_name_or_path: str = "Qwen/Qwen2.5-Math-7B"
    dataset_name: str = "agentica-org/DeepScaleR-Preview-Dataset"
    answer_column: str = "answer"
    max_prompt_tokens: int = 1536
    group_size: int = 8
    prompts_per_step: int = 256
    max_new_tokens: int = 2560
    num_mini_batches: int = 4
    eval_max_new_tokens: int = 2560

    # Algorithm specific arguments
    m2po_threshold: float = 0.04
    """tau: the largest (log pi/mu)^2 of the candidates are dropped until their mean is <= tau"""
    m2po_scope: Literal["trust-region", "all"] = "trust-region"
    """trust-region: the tokens a ratio clip acts on (official code); all: every token (AReaL)"""
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


def behaviour(old_logps: torch.Tensor, rollout_logps: torch.Tensor | None) -> torch.Tensor:
    """mu: the sampler's log-probs, or old_logps where it has none (NaN rows: not sampled now)."""
    if rollout_logps is None:
        return old_logps
    return torch.where(torch.isnan(rollout_logps), old_logps, rollout_logps.to(old_logps.dtype))


def m2po_select(now, mu, advantages, mask, args: Args) -> torch.Tensor:
    """Algorithm 1 over all ranks: the dropped tokens, [B, T] bool; now, mu: [B, T] log-probs.
    Dropping the largest M2 never raises the mean, so the loop drops the shortest prefix of the
    sorted M2 whose remaining suffix has mean <= tau (all if none has)."""
    d = now - mu
    m2, adv = d * d, advantages[:, None]
    cand = mask > 0
    if args.m2po_scope == "trust-region":  # the tokens a ratio clip would act on
        cand = cand & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    vals = torch.sort(global_cat(m2[cand]), descending=True).values
    n = torch.arange(len(vals), 0, -1, device=vals.device)
    suffix_mean = vals.flip(0).cumsum(0).flip(0) / n  # mean of vals[j:], j = 0 .. len - 1
    ok = torch.nonzero(suffix_mean <= args.m2po_threshold)
    j = int(ok[0]) if len(ok) else len(vals)  # how many to drop
    return cand & (m2 >= vals[j - 1]) if j > 0 else torch.zeros_like(cand)


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
    m2po_drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO loss: -1/sum_i |o_i| sum_i sum_t M_it r_it A_i, r = pi/mu unclipped, M = ~m2po_drop.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up. rollout_logps:
    mu (NaN rows and None: old_logps). m2po_drop: [B, T], m2po_select's (None: on this batch)."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    mu = behaviour(old_logps, rollout_logps)
    if m2po_drop is None:
        m2po_drop = m2po_select(logps.detach(), mu, advantages, mask, args)
    log_ratio = logps - mu
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    per_token = -ratio * adv * ~m2po_drop.bool()  # dropped: no gradient, still in the token count
    stats = {}
    if args.beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || pi_ref), R1 eq. 2
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    loss = (per_token * mask).sum() / num_tokens  # 1/sum_i |o_i| sum_i sum_t
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["m2po_drop_frac"] = token_mean(m2po_drop.bool())
        stats["m2"] = token_mean(log_ratio**2)  # before dropping
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(mu || pi)
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
            with torch.no_grad():  # ALGO LOGIC: Algorithm 1 once per mini-batch, at pi_theta now
                if epoch == 0 and mb == 0 and "old_logps" in batch and not args.replay:
                    now = batch["old_logps"]  # the policy has not moved since
                else:
                    now = compute_logps(policy, batch, args.temperature, plan)
                mu = behaviour(batch.get("old_logps", now), batch.get("sampler_logps"))
                mine = torch.zeros_like(batch["mask"])  # the tokens of this mini-batch's rows
                mine[mini_rows] = batch["mask"][mini_rows]
                batch["m2po_drop"] = m2po_select(now, mu, batch["advantages"], mine, args)
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
                        extra["m2po_drop"] = m["m2po_drop"]  # ALGO LOGIC: this micro-batch's part
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
    if args.rollout_correction not in ("auto", "none"):  # ALGO LOGIC: r = pi/mu is the IS weight
        raise SystemExit("m2po.py weighs by pi/mu, mu the sampler: drop --rollout-correction")
    args = replace(args, rollout_correction="none")  # what runs, in args.json
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
        batch = make_batch(groups.prompts, groups.completions, pad_id, device, ["m2po_drop"])
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
