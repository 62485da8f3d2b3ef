# docs and results: README.md#the-algorithms
"""L1 / LCPO: Length Controlled Policy Optimization.

Paper: Aggarwal & Welleck 2025, https://arxiv.org/abs/2503.04697 (§3, eq. 1-2; §4 the setup).
Official code: cmu-l3/l1 (a verl fork).

GRPO with a target length N in every training prompt, drawn once per prompt, N ~ U(n_min, n_max),
and appended as " Think for N tokens." (" Think for maximum N tokens." for LCPO-Max), and a reward
that trades correctness against |N - n_y|, n_y the completion's tokens (EOS included):

    r = 1[correct] - alpha |N - n_y|                          (eq. 1, LCPO-Exact)
    r = 1[correct] * clip(alpha (N - n_y) + delta, 0, 1)      (eq. 2, LCPO-Max, delta = 0.5)

L1-Max trains on both prompt types, each with its own reward (--lcpo-mode max, --exact-share 0.5).
n_min, n_max and the evaluation budgets are fractions of --max-new-tokens (§4: 100 to 4000 and 512
to 3600 of 4096). The official code departs from the paper (its Max reward is additive, alpha is
halved there, its Max script trains on correctness alone) and its prompt holds its own instruction:
docs/algorithms.md "L1 / LCPO".

    accelerate launch l1.py                                                      # L1-Exact (§4)
    accelerate launch l1.py --lcpo-mode max --model-name-or-path CKPT --learning-rate 4e-6  # L1-Max
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

from common.args import SharedArgs
from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import encode_prompts, load_data, load_rows
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, gather, step_metrics
from common.models import load_model, load_reference, prepare_training
from common.reward import score
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # L1-Exact: §4, and cmu-l3/l1's scripts/train/run_l1_exact.sh where the paper is silent
    model_name_or_path: str = "agentica-org/DeepScaleR-1.5B-Preview"  # §4
    dataset_name: str = "agentica-org/DeepScaleR-Preview-Dataset"  # §4
    answer_column: str = "answer"  # the dataset's
    group_size: int = 16  # rollout.n
    prompts_per_step: int = 128  # "a batch size of 128"
    max_new_tokens: int = 4096  # "the maximum context length is set to 4K tokens at training time"
    temperature: float = 0.6  # rollout.temperature
    num_mini_batches: int = 2  # ppo_mini_batch_size 64 of 128 prompts
    eval_samples: int = 16  # rollout.n_val
    eval_temperature: float = 0.6  # rollout.val_temperature
    eval_max_new_tokens: int = 8192  # "extended to 8K tokens during evaluation"

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """PPO clip: ratios above 1 + clip_eps_high stop the gradient of positive-advantage tokens"""
    beta: float = 0.001  # kl_loss_coef (verl's low_var_kl: k3 clamped at +-10)
    """k3 KL coefficient to the frozen reference model (0 loads no reference model)"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""
    lcpo_mode: Literal["exact", "max"] = "exact"
    """exact: "Think for N tokens." prompts, eq. 1; max: "Think for maximum N tokens.", eq. 2"""
    exact_share: float = 0.5  # deepscaler_dataset.py --use_both_both
    """--lcpo-mode max: this share of the prompts ask for N exactly (eq. 1), as L1-Max (0: none)"""
    alpha: float = 0.0003  # §4; run_l1_exact.sh reward_config.alpha
    """alpha: the reward per token of |N - n_y| (eq. 1) and eq. 2's slope"""
    delta: float = 0.5  # §3
    """delta of eq. 2: the Max reward of a correct answer at n_y = N"""
    target_frac: tuple[float, float] = (100 / 4096, 4000 / 4096)  # §4
    """N's range as fractions of --max-new-tokens (the paper: U(100, 4000) at 4096)"""
    eval_budget_frac: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 3600 / 4096])
    """evaluation budgets N as fractions of --max-new-tokens (§4: 512, 1024, 2048, 3600 of 4096)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args, targets) -> torch.Tensor:
    """Eq. 1, or eq. 2 where targets < 0 (a Max prompt: the official data's sign). [N] tensors."""
    c = correct if correct.is_floating_point() else correct.float()
    n_gold, n_y = targets.abs().to(c.dtype), lengths.to(c.dtype)
    exact = c - args.alpha * (n_gold - n_y).abs()  # eq. 1
    maximum = c * (args.alpha * (n_gold - n_y) + args.delta).clamp(0.0, 1.0)  # eq. 2
    return torch.where(targets > 0, exact, maximum)


def target_range(args: Args) -> tuple[int, int]:
    """(n_min, n_max): --target-frac x --max-new-tokens, rounded, at least 1."""
    low = max(1, round(args.target_frac[0] * args.max_new_tokens))
    return low, max(low, round(args.target_frac[1] * args.max_new_tokens))


def draw_target(row: int, args: Args) -> int:
    """Dataset row `row`'s N, uniform on n_min..n_max, negative for a Max prompt; a function of
    (seed, row), so --resume draws the same (deepscaler_dataset.py: once per row)."""
    rng = np.random.default_rng([args.seed, row])
    low, high = target_range(args)
    n = int(rng.integers(low, high + 1))
    return -n if args.lcpo_mode == "max" and rng.random() >= args.exact_share else n


def target_text(n: int) -> str:
    """The sentence appended to the question (deepscaler_dataset.py); n < 0: a Max prompt."""
    return f" Think for {n} tokens." if n > 0 else f" Think for maximum {-n} tokens."


def prompt_suffix(args: Args):
    """load_data's suffix(row): the row's target sentence."""
    return lambda row: target_text(draw_target(row, args))


def completion_targets(prompts, target_of: dict, args: Args, device) -> torch.Tensor:
    """[N] targets of the G completions of each prompt (its token ids hold N)."""
    return torch.tensor(
        [target_of[tuple(p)] for p in prompts for _ in range(args.group_size)], device=device
    )


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


# ALGO LOGIC: the paper's evaluation of length control, and its flags
def target_metrics(accelerator, lengths, targets) -> dict[str, float]:
    """Mean |n_y - N| and the share within N / 10, over all ranks."""
    n_gold = gather(accelerator, targets.abs())
    error = (gather(accelerator, lengths) - n_gold).abs()
    within = (error <= 0.1 * n_gold).float().mean().item()
    return {"train/target_error": error.mean().item(), "train/target_within_10pct": within}


def budget_eval_sets(args: Args, tokenizer, log) -> dict[tuple[str, int], tuple[list, list]]:
    """{(dataset, N): (prompt ids, golds)}: the evaluation sets at each budget N (§4)."""
    budgets = sorted({max(1, round(f * args.max_new_tokens)) for f in args.eval_budget_frac})
    sets = {}
    for name in args.eval_datasets if args.eval_every > 0 else []:
        cols = (args.eval_prompt_column, args.eval_answer_column)
        qs, golds = load_rows(name, None, "test", *cols, "--eval-datasets")
        qs, golds = qs[: args.eval_limit or len(qs)], golds[: args.eval_limit or len(qs)]
        for n in budgets:
            text = target_text(n if args.lcpo_mode == "exact" else -n)
            questions = [q + text for q in qs]
            sets[name, n] = encode_prompts(
                questions, golds, tokenizer, args, "--eval-datasets", log
            )
    return sets


def evaluate_budgets(sampler, sets: dict, args: Args) -> dict[str, float]:
    """Per budget N: avg@k, the mean length, mean |n_y - N| and the share within N / 10."""
    k, temperature, metrics = args.eval_samples, args.eval_temperature, {}
    top_p = args.eval_top_p if temperature > 0 else 1.0
    for (name, n), (prompts, golds) in sets.items():
        outs = sampler.generate(prompts, k, temperature, top_p, args.eval_max_new_tokens)
        golds_k = [g for g in golds for _ in range(k)]
        correct, _ = score([o.text for o in outs], golds_k, answer_format=args.reward_format)
        lengths = torch.tensor([len(o.token_ids) for o in outs], dtype=torch.float64)
        error = (lengths - n).abs()
        key = f"eval/{os.path.splitext(os.path.basename(name.rstrip('/')))[0]}/n{n}/"
        metrics[key + f"avg@{k}"] = float(np.mean(correct))
        metrics[key + "length_mean"] = lengths.mean().item()
        metrics[key + "target_error"] = error.mean().item()
        metrics[key + "target_within_10pct"] = (error <= 0.1 * n).double().mean().item()
    return metrics


def check_args(args: Args) -> None:
    """One line for an L1 flag out of range."""
    f0, f1 = args.target_frac
    if not 0 <= f0 <= f1 <= 1 or not 0 <= args.exact_share <= 1 or args.alpha < 0:
        raise SystemExit(
            "need 0 <= --target-frac low <= high <= 1, 0 <= --exact-share <= 1, --alpha >= 0"
        )
    if any(f <= 0 for f in args.eval_budget_frac):
        raise SystemExit(f"--eval-budget-frac must be > 0, got {args.eval_budget_frac}")


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    check_args(args)
    tokenizer, model = load_model(args)
    # ALGO LOGIC: each training prompt ends with its target, "Think for N tokens." (§3)
    data, eval_sets = load_data(args, tokenizer, accelerator.print, prompt_suffix(args))
    budget_sets = budget_eval_sets(args, tokenizer, accelerator.print)  # ALGO LOGIC: the budgets
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    if args.beta > 0:  # ALGO LOGIC: the KL term's frozen reference
        ref_policy = load_reference(args, accelerator, policy)
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only
        run.log(
            evaluate(sampler, eval_sets, args) | evaluate_budgets(sampler, budget_sets, args), 0
        )
        return run.close(sampler)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0
    # ALGO LOGIC: a prompt's target, found by its token ids (they hold it; replayed groups too)
    target_of = {tuple(p): draw_target(r, args) for p, r in zip(data.prompts, data.source_rows)}

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
        targets = completion_targets(prompts, target_of, args, device)
        rewards = compute_rewards(correct, lengths, truncated, args, targets)
        advantages = compute_advantages(rewards, args)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        if groups.changed:
            t = groups.tensors(device)
            t_targets = completion_targets(groups.prompts, target_of, args, device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args, t_targets)
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
        metrics.update(target_metrics(accelerator, lengths, targets))  # ALGO LOGIC: |n_y - N|
        last_step = step + 1 == args.total_steps
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or last_step):
            metrics.update(evaluate(sampler, eval_sets, args))
            metrics.update(evaluate_budgets(sampler, budget_sets, args))  # ALGO LOGIC: L1's budgets
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
