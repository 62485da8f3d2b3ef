# docs and experiment results: README.md#the-algorithms (this script's row, and its section if any)
"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization.

Paper: Yu et al. 2025, https://arxiv.org/abs/2503.14476 (recipe: verl
`recipe/dapo/run_dapo_qwen2.5_32b.sh`).

What this algorithm changes vs GRPO: no KL term and no reference model (§2.3); a +-1 correctness
reward (eq. 7) plus a soft overlong punishment (eq. 13); decoupled clip bounds with a larger upper
one, "Clip-Higher" (§3.1); a token-level loss: every token of the mini-batch weighs the same,
whatever the length of its sequence (§3.3); and dynamic sampling (§3.2, Algorithm 1): groups whose
completions are all right or all wrong have zero advantage, so they are dropped and more prompts are
sampled until the batch is full of informative groups.

    J = E[1/sum_i |o_i| sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)]   (eq. 8)
        subject to 0 < #correct < G
    A_i = (R_i - mean_g R) / (std_g R + eps)                                                 (eq. 9)
    R_i = +1 if correct else -1 (eq. 7)  +  R_len(|o_i|) (eq. 13):
    R_len = 0 if |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache if |y| <= L_max, else -1

Defaults are the paper's (§4.1) where a single node can: G=16, 512 prompts per step in mini-batches
of 32 (16 updates per rollout), lr 1e-6 constant after a linear warm-up of 20 rollout steps (320
optimizer steps), eps_low 0.2 / eps_high 0.28, L_max = 20480 generated tokens of which L_cache =
4096 are the soft punishment zone, temperature 1.0 / top_p 1.0, DAPO-Math-17k (open-r1's
deduplicated English copy, whose prompts carry the "Answer:" instruction) and AIME 2024 avg@32 at
temperature 1.0, top_p 0.7. From verl's recipe (the paper is silent): weight decay 0.1, grad clip
1.0, max prompt 2048, filtering on accuracy, --max-gen-batches 10, penalty factor 1.0. Model: the
paper's Qwen2.5-32B does not fit one node; the default is Qwen2.5-7B, the same base family.

Choices the paper leaves open: std is unbiased, eps_std = 1e-6; the filter counts correct answers
(eq. 8's constraint, verl's metric=acc), not distinct rewards; generation rounds take
--gen-prompts-per-round fresh prompts from one checkpointed data stream (a resumed run replays the
same prompts); the ranks keep as many groups as the poorest one, and after --max-gen-batches rounds
the step trains on what it has. Rollout metrics are over every generated completion (the kept ones
are biased towards accuracy 0.5 by construction). Overlong filtering (§3.4) masks truncated
completions out of the loss and its token count; it is off, as in the final recipe. Verifier: DAPO's
(verl math_dapo): the answer on the last "Answer:" line within the last 300 characters
(--reward-format auto with the dapo template), judged by math-verify where math_dapo compares
normalised strings. Not from the paper: --rollout-correction (TRL / verl; on with vLLM).

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
from common.reward import score
from common.run import (
    load_model,
    load_sampler,
    open_run,
    prepare_training,
    resume,
    save_checkpoint,
    start,
)


@dataclass
class Args(SharedArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # §4.1, and verl's recipe run_dapo_qwen2.5_32b.sh where the paper is silent (the docstring)
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
    """PPO clip: ratios below 1 - clip_eps_low stop the gradient of negative-advantage tokens"""
    clip_eps_high: float = 0.28
    """PPO clip: ratios above 1 + clip_eps_high stop the gradient of positive-advantage tokens"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""
    overlong_penalty: bool = True
    """add the soft overlong punishment (eq. 13) to the +-1 reward"""
    overlong_buffer_len: int = 4096
    """L_cache: completions over max_new_tokens - L_cache are penalised, down to -1 at the budget"""
    overlong_penalty_factor: float = 1.0
    """scale of the soft overlong punishment (verl's overlong_buffer.penalty_factor)"""
    overlong_filtering: bool = False
    """mask truncated completions out of the loss (§3.4; not in the final recipe)"""
    dynamic_sampling: bool = True
    """drop all-correct and all-wrong groups and sample more prompts to refill the batch (§3.2)"""
    max_gen_batches: int = 10
    """at most this many generation rounds per step; then train on the informative groups so far"""
    gen_prompts_per_round: int = 0
    """prompts per generation round, over all ranks (0: --prompts-per-step; verl's recipe: 3x)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """DAPO's reward: +1 for a verified answer, -1 otherwise (eq. 7), plus the soft overlong
    punishment (eq. 13), --overlong-penalty-factor x R_len: 0 up to L_max - L_cache tokens, then
    ((L_max - L_cache) - |y|) / L_cache down to -1 at L_max = max_new_tokens, and -1 beyond."""
    rewards = correct.float() * 2 - 1
    if args.overlong_penalty:
        expected_len = args.max_new_tokens - args.overlong_buffer_len
        r_len = ((expected_len - lengths.float()) / args.overlong_buffer_len).clamp(-1.0, 0.0)
        rewards = rewards + args.overlong_penalty_factor * r_len
    return rewards


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) (DAPO eq. 9, as GRPO). rewards: [N], groups
    contiguous. std is unbiased; a group whose rewards are all equal gets A = 0."""
    r = rewards.view(-1, args.group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + args.adv_eps)
    return adv.view(-1)


def filter_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling's filter (eq. 8's constraint 0 < |{o_i : correct}| < G): True for the groups
    kept. correct: [num_groups * G] (1 or True = correct), groups contiguous. [num_groups] bool."""
    num_correct = (correct.view(-1, group_size) == 1).sum(dim=1)
    return (num_correct > 0) & (num_correct < group_size)


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor, args: Args) -> torch.Tensor:
    """Overlong filtering (§3.4): the [B, T] loss mask with truncated completions' rows zeroed, so
    they add neither loss nor tokens to the token mean; unchanged without --overlong-filtering."""
    return mask * ~truncated.bool()[:, None] if args.overlong_filtering else mask


def mini_batch_count(rows: int, size: int) -> int:
    """Optimizer steps for `rows` rollout rows in mini-batches of at least `size` rows: the largest
    divisor of `rows` that is at most rows // size, at least 1 (fewer groups: fewer steps)."""
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
    mini-batch's normalisers when this batch is one micro-batch of it (common.batching
    .grad_normalizers); by default the batch's own. Stats are token means over the same mini-batch,
    so they add up over micro-batches too."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

    def token_mean(x: torch.Tensor) -> torch.Tensor:  # a mean over the mini-batch's tokens
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
    """PPO-style updates on one rollout: --ppo-epochs passes, each split into `num_mini_batches`
    optimizer steps (default --num-mini-batches), each accumulated over micro-batches whose losses
    share the mini-batch's global normalisers (so the accumulated gradient equals the whole
    mini-batch's, on any number of ranks). Returns the stats (means over the rollout; grad_norm,
    skipped_updates and the log-prob canary). Nothing in the micro-batch loop reads a tensor on the
    host."""
    n, device = batch["ids"].shape[0], batch["ids"].device
    num_mini_batches = num_mini_batches or args.num_mini_batches
    mb_size, updates = n // num_mini_batches, num_mini_batches * args.ppo_epochs
    stats, norms, skipped, canary = {}, [], 0, LogprobCanary()
    for epoch in range(args.ppo_epochs):
        seed = args.seed * 1_000_003 + step * 101 + epoch
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        for mb in range(num_mini_batches):
            mini_rows = perm[mb * mb_size : (mb + 1) * mb_size].tolist()
            plan = micro_batches(mini_rows, batch["lens"], args)  # (rows, prompt, completion width)
            micro = [micro_batch(batch, rows, p_w, c_w) for rows, p_w, c_w in plan]
            num_tokens, num_seqs = grad_normalizers([m["mask"] for m in micro])
            with weights_cast_once():  # each fp32 weight cast to bf16 once, not per micro-batch
                for j, m in enumerate(micro):
                    last = j == len(micro) - 1
                    accelerator.sync_gradients = last  # DeepSpeed's engine steps at the last only
                    with contextlib.nullcontext() if last else accelerator.no_sync(policy):
                        logps, entropy = policy(m["ids"], m["attn"], m["p_len"], args.temperature)
                        # pi_old not stored (one on-policy update): pi_old = pi, the ratio is 1
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
    # TRY NOT TO MODIFY: setup; everything is checked before the run directory is written
    args, accelerator = start(args)  # "auto" modes resolved; args.requested: what was asked
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
    run = open_run(args, accelerator)  # run directory, args.json, TensorBoard, signals
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only: the model, or --resume's last checkpoint
        run.log(evaluate(sampler, eval_sets, args), 0)
        return run.close(sampler)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0

    for step in range(start_step, args.total_steps):
        timer = Timer()
        # ALGO LOGIC: dynamic sampling (§3.2, Algorithm 1), the rollout: --gen-prompts-per-round prompts
        # a round until each rank has its share of informative groups (0 < #correct < G) or after
        # --max-gen-batches rounds; all keep the smallest count (DDP), drop the surplus, as verl
        share, rounds = args.prompts_per_step // world, 0
        rows, completions, correct, kept, reward_info = [], [], [], [], {}
        while rounds < args.max_gen_batches:
            rounds += 1
            # DATA: --prompt-sampling; --off-policy-steps K: generated K steps ago (one round a step)
            idx, outs, staleness = data.rollout(step, sampler, rank, world, gen_prompts // world)
            timer.lap("generate")
            golds = [data.golds[i] for i in idx for _ in range(args.group_size)]
            verdicts, info = score([c.text for c in outs], golds, answer_format=args.reward_format)
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
        kept = kept[: min(num_kept, share)]  # indices into the step's groups, as many on every rank
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
        # ALGO LOGIC: the training batch is the kept groups (none: one group with A = 0 stands in,
        # no update); with fewer, mini-batches keep their size (fewer optimizer steps)
        keep = kept or [0]
        sel = [k * args.group_size + j for k in keep for j in range(args.group_size)]
        advantages = advantages[sel]
        if not kept:
            advantages = torch.zeros_like(advantages)
        mini_batch_rows = share * args.group_size // args.num_mini_batches
        num_mini_batches = mini_batch_count(len(advantages), mini_batch_rows)
        # DATA: --gt-injection / --replay may replace groups (then the advantages follow); the
        # metrics describe the policy's own samples
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator, keep)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)
            advantages = compute_advantages(trained_rewards, args)

        # TRY NOT TO MODIFY: the batch; old and reference log-probs, once per rollout
        pad_id = tokenizer.pad_token_id
        batch = make_batch(groups.prompts, groups.completions, advantages, pad_id, device)
        truncated_rows = groups.tensors(device).truncated
        batch["mask"] = overlong_filter(batch["mask"], truncated_rows, args)  # ALGO LOGIC: §3.4
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        plan = micro_batches(list(range(len(advantages))), batch["lens"], args)
        # pi_old for several updates, replayed rows or off-policy rollouts: once, before the updates
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        with torch.no_grad():
            if recompute and has_signal:
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            data.update_replay(groups, batch)  # DATA: --replay's stored log-probs and buffer
            if ref_policy is not None and has_signal:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
        timer.lap("old_logprobs")

        # TRAIN: mini-batches of the rollout, each in micro-batches with one global normaliser
        stats = {"grad_norm": 0.0, "skipped_updates": 0.0}  # no advantage anywhere: no update
        if has_signal:
            stats = update_policy(
                policy, optimizer, scheduler, accelerator, batch, args, step, num_mini_batches
            )
        run.count_bad_updates(int(stats["skipped_updates"]), step)
        timer.lap("train")
        sampler.update_weights(accelerator.unwrap_model(policy).lm)  # the next rollout's policy
        timer.lap("weight_sync")

        # TRY NOT TO MODIFY: record metrics (gathered over ranks, read once per step)
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
