# docs and results: README.md#the-algorithms
"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization.

Paper: Yu et al. 2025, https://arxiv.org/abs/2503.14476 (recipe: verl
`recipe/dapo/run_dapo_qwen2.5_32b.sh`).

What this algorithm changes vs GRPO: no KL and no reference model (§2.3); a +-1 reward (eq. 7) plus
a soft overlong punishment (eq. 13); a larger upper clip bound, "Clip-Higher" (§3.1); a token-level
loss, every token of the mini-batch weighing the same (§3.3); dynamic sampling (§3.2, Algorithm 1):
all-right and all-wrong groups (A = 0) are dropped and more prompts sampled until the batch is full.

    J = E[1/sum_i |o_i| sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)]   (eq. 8)
        subject to 0 < #correct < G
    A_i = (R_i - mean_g R) / (std_g R + eps)                                                 (eq. 9)
    R_i = +1 if correct else -1 (eq. 7)  +  R_len(|o_i|) (eq. 13):
    R_len = 0 if |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, else -1

Defaults: §4.1 where one node can, else verl's recipe (docs/algorithms.md). Our choices: Qwen2.5-7B
(the paper's 32B does not fit one node); the unbiased std; the filter counts correct answers (eq.
8, verl's metric=acc); the rounds draw fresh prompts from one checkpointed stream, the ranks keep
as many groups as the poorest, and after --max-gen-batches rounds a step trains on what it has;
rollout metrics cover every generated completion; no overlong filtering (§3.4; the final recipe
has none); math-verify judges math_dapo's "Answer:" line (math_dapo: normalised strings).
--rollout-correction (on with vLLM) is not from the paper.

    accelerate launch dapo.py --eval-every 5                   # the paper setting, on GPUs
    python dapo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import tyro

from common.args import PromptTemplate, SharedArgs
from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, gather, step_metrics
from common.models import load_model, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # §4.1, and verl's recipe run_dapo_qwen2.5_32b.sh where the paper is silent (docs/algorithms.md)
    model_name_or_path: str = "Qwen/Qwen2.5-7B"  # the paper's is Qwen2.5-32B: too big for one node
    dataset_name: str = "open-r1/DAPO-Math-17k-Processed"  # DAPO-Math-17k, deduplicated
    dataset_config: str | None = "en"
    prompt_column: str = "prompt"
    prompt_template: PromptTemplate = "dapo"  # the prompts carry the "Answer:" instruction
    max_prompt_tokens: int = 2048  # verl's recipe
    group_size: int = 16
    prompts_per_step: int = 512
    max_new_tokens: int = 20480  # L_max
    warmup_steps: int = 320  # 20 rollout steps
    weight_decay: float = 0.1  # verl's recipe
    num_mini_batches: int = 16  # mini-batches of 32 of the 512 prompts
    eval_datasets: list[str] = field(default_factory=lambda: ["math-ai/aime24"])
    eval_answer_column: str = "solution"
    eval_samples: int = 32  # AIME 2024 avg@32
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7
    eval_max_new_tokens: int = 20480

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.28
    """PPO clip: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""
    overlong_penalty: bool = True
    """add the soft overlong punishment (eq. 13) to the +-1 reward"""
    overlong_buffer_len: int = 4096
    """L_cache: the budget's last L_cache tokens are penalised, down to -1 at the budget"""
    overlong_penalty_factor: float = 1.0
    """scale of the soft overlong punishment (verl's overlong_buffer.penalty_factor)"""
    overlong_filtering: bool = False
    """mask truncated completions out of the loss (§3.4; not in the final recipe)"""
    dynamic_sampling: bool = True
    """drop all-right and all-wrong groups, refilling the batch with new prompts (§3.2)"""
    max_gen_batches: int = 10
    """generation rounds per step, at most; then train on the informative groups so far"""
    gen_prompts_per_round: int = 0
    """prompts per generation round, over all ranks (0: --prompts-per-step; verl's recipe: 3x)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """DAPO's reward: +-1 (eq. 7) plus --overlong-penalty-factor x R_len (eq. 13), L_max =
    --max-new-tokens. [N] tensors."""
    rewards = correct.float() * 2 - 1
    if args.overlong_penalty:
        expected_len = args.max_new_tokens - args.overlong_buffer_len
        r_len = ((expected_len - lengths.float()) / args.overlong_buffer_len).clamp(-1.0, 0.0)
        rewards = rewards + args.overlong_penalty_factor * r_len
    return rewards


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) (DAPO eq. 9, as GRPO), std unbiased.
    rewards: [N], groups contiguous."""
    r = rewards.view(-1, args.group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + args.adv_eps)
    return adv.view(-1)


def filter_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling's filter, DAPO eq. 8's 0 < #correct < G. correct: [num_groups * G], groups
    contiguous; returns [num_groups] bool, True for a kept group."""
    num_correct = (correct.view(-1, group_size) == 1).sum(dim=1)
    return (num_correct > 0) & (num_correct < group_size)


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor, args: Args) -> torch.Tensor:
    """Overlong filtering (§3.4): truncated rows zeroed in the [B, T] mask, so they add neither loss
    nor tokens."""
    return mask * ~truncated.bool()[:, None] if args.overlong_filtering else mask


def mini_batch_count(rows: int, size: int) -> int:
    """Optimizer steps for `rows` rows in mini-batches of at least `size`: the largest divisor of
    `rows` up to rows // size (fewer groups, fewer steps; at least 1)."""
    count = max(1, rows // size)
    while rows % count:
        count -= 1
    return count


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
    """DAPO loss (eq. 8): -1/sum_i |o_i| sum_i sum_t min(r A, clip(r, 1-eps_l, 1+eps_h) A), no KL.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the
    mini-batch's normalisers (default: this batch's), so its micro-batches add up."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)  # Clip-Higher
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -surrogate * rc_weight
    num_tokens = torch.where(num_tokens > 0, num_tokens, 1.0)  # all overlong-filtered: not 0/0
    loss = (per_token * mask).sum() / num_tokens  # 1/sum_i |o_i| sum_i sum_t, token-level (§3.3)
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
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if (args.gt_injection or args.replay) and args.dynamic_sampling:  # ALGO LOGIC: dynamic sampling
        raise SystemExit("--gt-injection and --replay need --no-dynamic-sampling")
    if args.max_gen_batches < 1 or args.overlong_buffer_len < 1:
        raise SystemExit("need --max-gen-batches, --overlong-buffer-len >= 1")
    gen_prompts = args.gen_prompts_per_round or args.prompts_per_step
    if args.off_policy_steps and (args.dynamic_sampling or gen_prompts != args.prompts_per_step):
        raise SystemExit(
            "--off-policy-steps: refills need the current policy; use --no-dynamic-sampling"
        )
    if gen_prompts < 0 or gen_prompts % world:  # ALGO LOGIC: the rounds are split over the ranks
        raise SystemExit(
            f"--gen-prompts-per-round {gen_prompts}: not >= 0 and divisible by {world}"
        )
    if args.overlong_penalty and args.overlong_buffer_len >= args.max_new_tokens:
        accelerator.print("note: --overlong-buffer-len >= --max-new-tokens: all are penalised")
    tokenizer, model = load_model(args)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only
        run.log(evaluate(sampler, eval_sets, args), 0)
        return run.close(sampler)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0

    for step in range(start_step, args.total_steps):
        timer = Timer()
        # ALGO LOGIC: dynamic sampling (DAPO §3.2, Algorithm 1): rounds until each rank has its
        # share of informative groups or --max-gen-batches; all keep the smallest count, as verl
        share, rounds = args.prompts_per_step // world, 0
        rows, completions, correct, kept, reward_info = [], [], [], [], {}
        while rounds < args.max_gen_batches:
            rounds += 1
            # DATA: --prompt-sampling, --off-policy-steps (then one round a step)
            idx, outs, staleness = data.rollout(step, sampler, rank, world, gen_prompts // world)
            timer.lap("generate")
            golds = [data.golds[i] for i in idx for _ in range(args.group_size)]
            verdicts, info = data.score(outs, golds)  # the verifier, or --env's returns
            timer.lap("reward")
            keep = filter_groups(torch.tensor(verdicts), args.group_size)
            if not args.dynamic_sampling:
                keep = torch.ones_like(keep)
            kept += [len(rows) + k for k in keep.nonzero().flatten().tolist()]
            rows, completions, correct = rows + idx, completions + outs, correct + verdicts
            reward_info = {k: reward_info.get(k, 0) + v for k, v in info.items()}
            num_kept = int(accelerator.gather(torch.tensor([len(kept)], device=device)).min())
            if num_kept >= share:
                break
        kept = kept[: min(num_kept, share)]  # as many on every rank
        if len(kept) < share:
            accelerator.print(f"step {step}: {len(kept) * world} of {args.prompts_per_step} groups")
        if args.vllm_enable_sleep_mode:
            sampler.sleep()  # free vLLM's memory for training; update_weights wakes it
        prompts = [data.prompts[i] for i in rows]
        texts = [c.text for c in completions]
        correct = torch.tensor(correct, device=device)
        lengths = torch.tensor([len(c.token_ids) for c in completions], device=device)
        truncated = torch.tensor([c.truncated for c in completions], device=device)

        # ALGO LOGIC: rewards and advantages
        rewards = compute_rewards(correct, lengths, truncated, args)
        advantages = compute_advantages(rewards, args)
        # ALGO LOGIC: train on the kept groups (none: one with A = 0 stands in, no update); with
        # fewer, mini-batches keep their size (fewer optimizer steps)
        keep = kept or [0]
        sel = [k * args.group_size + j for k in keep for j in range(args.group_size)]
        advantages = advantages[sel]
        if not kept:
            advantages = torch.zeros_like(advantages)
        mini_batch_rows = share * args.group_size // args.num_mini_batches
        num_mini_batches = mini_batch_count(len(advantages), mini_batch_rows)
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator, keep)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)
            advantages = compute_advantages(trained_rewards, args)

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        batch = make_batch(groups.prompts, groups.completions, pad_id, device)
        batch["advantages"] = advantages
        truncated_rows = groups.tensors(device).truncated
        batch["mask"] = overlong_filter(batch["mask"], truncated_rows, args)  # ALGO LOGIC: §3.4
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
            stats = update_policy(
                policy, optimizer, scheduler, accelerator, batch, args, step, num_mini_batches
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
        informative = filter_groups(gather(accelerator, correct), args.group_size).float().mean()
        metrics["train/gen_rounds"] = float(rounds)  # ALGO LOGIC: dynamic sampling's counts
        metrics["train/kept_group_frac"] = informative.item() if args.dynamic_sampling else 1.0
        metrics["train/train_groups"] = float(len(kept) * world)
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
