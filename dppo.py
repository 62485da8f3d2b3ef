# docs and results: README.md#the-algorithms
"""DPPO: Divergence Proximal Policy Optimization.

Paper: "Rethinking the Trust Region in LLM Reinforcement Learning", Qi et al. 2026,
https://arxiv.org/abs/2602.04879 (v3), section 4.3, eq. (12), binary TV / KL eqs. (13)-(14), the
gradient form eq. (23) (App. C.1). Official code: sail-sg/Stable-RL (compute_policy_loss_with_mask).

What this algorithm changes vs GRPO: the ratio is to the behaviour policy mu, the sampler's own
log-probs (with --off-policy-steps K, K steps old), and PPO's ratio clip becomes a mask on a
divergence D of the binary distribution {sampled token, the rest}: a token loses its gradient only
when D exceeds delta AND it moved in its advantage's direction (p > p_mu for A > 0, p < p_mu for
A <= 0). As the official code, with p = pi(o_it), p_mu = mu(o_it), M and the weight at the
detached current pi:

    L = -1/(N L_max) sum_i sum_t M_it sg(min(pi_it / mu_it, C)) A_i log pi_it
    D = |p - p_mu|                                                   --dppo-divergence binary-tv
    D = p_mu log(p_mu / p) + (1 - p_mu) log((1 - p_mu) / (1 - p))     --dppo-divergence binary-kl
    A_i = R_i - mean_g R                                                    (Dr. GRPO's: no std)

pi/mu is the whole importance weight: no --rollout-correction on top (explicit modes are refused);
rows the sampler did not produce take mu = old_logps. With --top-p < 1, p_mu is renormalised over
the nucleus and the masks see a systematic divergence. Defaults: the authors' verl script
(docs/algorithms.md). Our choices: Qwen3-8B-Base (their 30B-A3B does not fit one node); grpo.py's
evaluation. Not implemented: the Top-K divergence.

    accelerate launch dppo.py                                  # the paper setting, on GPUs
    python dppo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
import tyro

from common.args import PromptTemplate, SharedArgs
from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # the authors' verl script run_qwen30b_dppo.sh; grpo.py's evaluation
    model_name_or_path: str = "Qwen/Qwen3-8B-Base"  # the paper's 30B-A3B does not fit one node
    dataset_name: str = "open-r1/DAPO-Math-17k-Processed"  # DAPO-Math-17k, as dapo.py loads it
    dataset_config: str | None = "en"
    prompt_column: str = "prompt"
    prompt_template: PromptTemplate = "dapo"
    max_prompt_tokens: int = 2048
    group_size: int = 16
    prompts_per_step: int = 256
    max_new_tokens: int = 8192
    num_mini_batches: int = 8
    eval_max_new_tokens: int = 8192

    # Algorithm specific arguments
    dppo_divergence: Literal["binary-tv", "binary-kl"] = "binary-tv"
    """D of {sampled token, the rest}: binary-tv |p - p_mu|, binary-kl KL(Bern(p_mu) || Bern(p))"""
    dppo_delta_low: float | None = None
    """delta for A <= 0, p < p_mu (None: 0.15 binary-tv, 0.05 binary-kl)"""
    dppo_delta_high: float | None = None
    """delta for A > 0, p > p_mu (None: 0.15 binary-tv, 0.05 binary-kl)"""
    dppo_is_cap: float | None = None
    """C: sg(pi/mu) truncated at C (None: untruncated; the authors' 1e4)"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen reference model (0: none loaded)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The outcome reward: 1 for a verified answer, else 0. [N] tensors."""
    return correct.float()


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = R_i - mean_g R (Dr. GRPO's, as the authors' script: norm_adv_by_std_in_grpo=False).
    rewards: [N], groups contiguous."""
    r = rewards.view(-1, args.group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    return adv.view(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, without cancellation (Maechler 2012); -inf at x = 0."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


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
    """DPPO loss: -1/(N L_max) sum_i sum_t M_it sg(min(pi/mu, C)) A_i log pi_it, M the binary mask.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up. rollout_logps:
    mu (NaN rows and None: old_logps). A surrogate (it holds log pi): only its gradient matters."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    mu = old_logps if rollout_logps is None else rollout_logps.to(old_logps.dtype)
    mu = torch.where(torch.isnan(mu), old_logps, mu).clamp(max=0)  # NaN: not sampled this step
    now = logps.detach().clamp(max=0)  # M and the weight: at the current policy, no gradient
    log_ratio = now - mu
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # pi/mu; the clamp only guards exp's overflow
    weight = ratio if args.dppo_is_cap is None else ratio.clamp(max=args.dppo_is_cap)
    p, p_mu, adv = torch.exp(now), torch.exp(mu), advantages[:, None]
    if args.dppo_divergence == "binary-tv":
        div = (p - p_mu).abs()
    else:  # KL(Bern(p_mu) || Bern(p)); 0 log 0 = 0 at p_mu = 1
        rest = (1 - p_mu) * (log1mexp(mu) - log1mexp(now))
        div = p_mu * (mu - now) + torch.where(p_mu < 1, rest, 0.0)
    default = 0.15 if args.dppo_divergence == "binary-tv" else 0.05  # the authors' script
    low, high = (default if d is None else d for d in (args.dppo_delta_low, args.dppo_delta_high))
    # beyond delta AND moved in the advantage's direction (never when back towards mu)
    masked = torch.where(adv > 0, (div > high) & (p > p_mu), (div > low) & (p < p_mu))
    per_token = -weight * ~masked * adv * logps
    stats = {}
    if args.beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || pi_ref), R1 eq. 2
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    loss = (per_token * mask).sum() / (num_seqs * args.max_new_tokens)  # seq-mean-token-sum-norm
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["dppo_mask_frac_high"] = token_mean(masked & (adv > 0))
        stats["dppo_mask_frac_low"] = token_mean(masked & (adv <= 0))
        stats["is_weight_mean"] = token_mean(weight)
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
    if args.rollout_correction not in ("auto", "none"):  # ALGO LOGIC: pi/mu is the whole IS weight
        raise SystemExit("dppo.py weighs by pi/mu, mu the sampler: drop --rollout-correction")
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
