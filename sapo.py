# docs and results: README.md#the-algorithms
"""SAPO: Soft Adaptive Policy Optimization.

Paper: Gao et al. 2025 (Qwen), https://arxiv.org/abs/2511.20347, eqs. (5)-(6) of v2 (its full text
was not available to us: numbers and defaults unchecked). No official code: the loss as verl, TRL,
SkyRL and AReaL implement it (identically, up to the aggregation).

What this algorithm changes vs GRPO: PPO's hard clip becomes a smooth gate on each token's ratio: a
token's gradient is scaled down as r moves away from 1, never dropped, faster for negative
advantages (tau_neg > tau_pos). The gate's slope is 1 at r = 1: on-policy SAPO is GRPO, hence
several optimizer steps per rollout. No clip, no KL; GRPO's per-sequence token mean:

    J = E[ 1/G sum_i 1/|o_i| sum_t f(r_it) A_i ],  f(r) = sigmoid(tau (r - 1)) 4 / tau
    tau = tau_pos if A_i > 0 else tau_neg,  A_i = (R_i - mean_g R) / (std_g R + eps)
    d [f(r) A] / d log pi = w r A,  w = 4 s (1 - s),  s = sigmoid(tau (r - 1))  (w = 1 at r = 1)

Defaults: docs/algorithms.md. Our choices: grpo.py's std and verifier; the log-ratio clamped to
+-20 (verl, SkyRL; the gate is flat there); A = 0 takes tau_neg (all peers; its term is 0);
--rollout-correction (on with vLLM) weights each token's policy term (verl, SkyRL), never the k3
KL that --beta > 0 adds (grpo.py's).

    accelerate launch sapo.py                                  # the paper setting, on GPUs
    python sapo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
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
    # verl's Qwen3-30B-A3B SAPO example: 256 prompts in mini-batches of 32
    num_mini_batches: int = 8  # with 1, SAPO is GRPO

    # Algorithm specific arguments
    sapo_tau_pos: float = 1.0
    """gate temperature for A > 0: the larger, the faster a token's gradient decays as r leaves 1"""
    sapo_tau_neg: float = 1.05
    """gate temperature for A <= 0 (above tau_pos: negative tokens' gradients decay faster)"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen reference model (0, SAPO's: no reference model loaded)"""
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
    """SAPO loss: -1/G sum_i 1/|o_i| sum_t [f(r_it) A_i - beta KL_k3], f the soft gate above.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = (logps - old_logps).clamp(-20.0, 20.0)  # verl, SkyRL: exp never overflows
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    # tau in the log-probs' dtype, on their device: torch.where rounds a Python float to fp32,
    # new_tensor copies from the host at every micro-batch
    tau_pos = torch.full_like(adv, args.sapo_tau_pos, dtype=ratio.dtype)
    tau = torch.where(adv > 0, tau_pos, torch.full_like(tau_pos, args.sapo_tau_neg))
    gate_s = torch.sigmoid(tau * (ratio - 1))
    gate = gate_s * 4 / tau  # f(r): slope 1 at r = 1
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -gate * adv * rc_weight
    if args.beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || pi_ref), R1 eq. 2
        per_token = per_token + args.beta * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / num_tokens
    seq_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # 1/|o_i| sum_t
    loss = seq_means.sum() / num_seqs  # 1/G sum_i
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        # w = d f / d r: 1 on-policy, decaying smoothly off-policy (GRPO's clip: 1 or 0)
        stats["sapo_gate_weight_mean"] = token_mean(4 * gate_s * (1 - gate_s))
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
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if args.sapo_tau_pos <= 0 or args.sapo_tau_neg <= 0:  # ALGO LOGIC: f divides by tau
        raise SystemExit("--sapo-tau-pos and --sapo-tau-neg must be > 0")
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
