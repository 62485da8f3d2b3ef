# docs and results: README.md#the-algorithms
"""VAPO: Value-model-based Augmented Proximal Policy Optimization.

Paper: Yue et al. 2025, https://arxiv.org/abs/2504.05118 (ByteDance Seed), on VC-PPO (Yuan et al.
2025, https://arxiv.org/abs/2503.01491: value pre-training, decoupled GAE) and DAPO (Clip-Higher,
the token-level loss, https://arxiv.org/abs/2503.14476). No official code.

What this algorithm changes vs ppo.py (PPO with a critic and GAE), the paper's seven changes:
1. Value pre-training (§3.1): the critic alone trains first, on the initial policy's samples.
2. Decoupled GAE (§3.1): lambda = 1.0 for the critic's targets (with lambda < 1 they mix in its own
   biased values and the end reward decays through a long completion: VC-PPO), a smaller one for
   the policy's advantages.
3. Length-adaptive GAE (§3.2): lambda_policy = 1 - 1 / (alpha l) for l tokens (sum_t lambda^t =
   alpha l), clamped at 0 for l < 1 / alpha (our choice: the formula is negative there).
4. Clip-Higher (§3.3, DAPO §3.1).   5. A token-level policy loss (§3.2, DAPO §3.3).
6. Positive-example LM loss (§3.3): mu times the token-mean NLL of the correct completions.
7. Group sampling (§3.3): many samples of fewer prompts.

    A_t = GAE(gamma, lambda_policy(l)) on V, whitened;   R_t = GAE(gamma, 1.0) + V (the targets)
    L = -1/sum_i |o_i| sum_i sum_t min(r A, clip(r, 1 - 0.2, 1 + 0.28) A)
        - mu / sum_{i correct} |o_i| sum_{i correct} sum_t log pi(o_it)

Defaults: §4.1 in DAPO's setting (docs/algorithms.md). Our choices: Qwen2.5-7B (the paper's 32B
does not fit one node); the critic from the policy (the paper's from a reward model, which a
verifier-based run lacks); where the paper is silent, DAPO's +-1 reward, gamma 1, verl's whitening
and value clip 0.5, no critic warm-up or weight decay; --rollout-correction (on with vLLM).

    accelerate launch vapo.py                                  # the paper setting, on GPUs
    python vapo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import tyro

from common.args import PromptTemplate
from common.batching import global_sum, grad_normalizers, make_batch, micro_batch, micro_batches
from common.critic import (
    CriticArgs,
    check_critic_args,
    compute_values,
    critic_backward,
    critic_grad_norm,
    load_critic,
    value_metrics,
)
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction, weights_cast_once
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.models import load_model, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(CriticArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # §4.1, in DAPO's setting, which VAPO compares in (dapo.py's one-node translation)
    model_name_or_path: str = "Qwen/Qwen2.5-7B"  # the paper's Qwen2.5-32B does not fit one node
    dataset_name: str = "open-r1/DAPO-Math-17k-Processed"  # DAPO's data, as dapo.py loads it
    dataset_config: str | None = "en"
    prompt_column: str = "prompt"
    prompt_template: PromptTemplate = "dapo"
    max_prompt_tokens: int = 2048
    group_size: int = 16  # §4.1 group sampling: 512 prompts, 16 samples each
    prompts_per_step: int = 512
    max_new_tokens: int = 20480
    num_mini_batches: int = 16  # §4.1: mini-batches of 512 of the 8192 samples
    eval_datasets: list[str] = field(default_factory=lambda: ["math-ai/aime24"])
    eval_answer_column: str = "solution"
    eval_samples: int = 32  # AIME 2024 avg@32 (Table 1); the rest of the evaluation dapo.py's
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7
    eval_max_new_tokens: int = 20480
    critic_learning_rate: float = 2e-6  # §4.1
    critic_warmup_steps: int = 0  # the paper is silent: none
    critic_num_mini_batches: int = 16  # §4.1, the policy's mini-batches

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.28
    """Clip-Higher: r > 1 + clip_eps_high stops a positive-advantage token's gradient"""
    gamma: float = 1.0
    """GAE's discount, the critic's and the policy's (the paper is silent: 1)"""
    lam_critic: float = 1.0
    """GAE's lambda of the critic's targets (§3.1, decoupled GAE: 1.0, Monte-Carlo returns)"""
    lam_alpha: float = 0.05
    """the policy's lambda for a completion of l tokens is max(0, 1 - 1 / (lam_alpha l)) (§3.2)"""
    value_warmup_steps: int = 50
    """value pre-training: the first this many steps train the critic alone (§4.1: 50)"""
    nll_coef: float = 0.1
    """mu: weight of the NLL of the mini-batch's correct completions in the policy loss (§4.1)"""
    value_clip: float | None = 0.5
    """how far values may move from the rollout's per update (verl's default; None: unclipped)"""


# ALGO LOGIC: rewards, advantages and the losses
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """+1 for a verified answer, -1 otherwise (DAPO eq. 7: the paper does not restate it). [N]."""
    return 2 * correct.float() - 1


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T]: each completion's reward on its last token (mask's last 1), 0 elsewhere (ORZ
    compute_reward, verl's reward managers)."""
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return token_rewards.scatter(1, last[:, None], rewards[:, None])


def compute_gae(token_rewards, values, mask, gamma, lam) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) as verl's compute_gae_advantage_return, unwhitened; a position
    with mask 0 (a tool's output) is skipped, the next value and the running advantage carrying
    past it. token_rewards, values, mask: [B, T]; lam: a float or [B]. Returns (A, R), [B, T], by a
    parallel scan of A_t = a_t + c_t A_t+1 in log2(T) steps."""
    keep, t = mask > 0, values.shape[1]
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device).reshape(-1, 1)
    idx = torch.where(keep, torch.arange(t, device=mask.device), t).flip(1).cummin(1).values
    nxt = torch.cat([idx.flip(1)[:, 1:], torch.full_like(idx[:, :1], t)], 1)  # next kept (t: none)
    v_next = torch.cat([values, torch.zeros_like(values[:, :1])], 1).gather(1, nxt)
    a = torch.where(keep, token_rewards + gamma * v_next - values, 0.0)  # A_t = a_t + c_t A_t+1
    c = torch.where(keep, gamma * lam, 1.0)  # skipped: A_t = A_t+1
    for k in (2**i for i in range((t - 1).bit_length())):  # a_t += c_t a_t+k; c_t *= c_t+k
        a = torch.cat([a[:, :-k] + c[:, :-k] * a[:, k:], a[:, -k:]], 1)
        c = torch.cat([c[:, :-k] * c[:, k:], c[:, -k:]], 1)
    return a, a + values


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten, as its compute_gae_advantage_return applies it, over every rank's
    completion tokens: (A - mean) / sqrt(var + 1e-8), var unbiased; 0 outside the mask."""
    m = mask.to(advantages.dtype)
    count, total = global_sum(torch.stack([m.sum(), (advantages * m).sum()]))
    mean = total / count.clamp(min=1)
    var = global_sum(((advantages - mean) ** 2 * m).sum()) / (count - 1).clamp(min=1)
    return (advantages - mean) * (var + 1e-8).rsqrt() * m


def policy_lambda(mask: torch.Tensor, args: Args) -> torch.Tensor:
    """Length-adaptive GAE (§3.2): max(0, 1 - 1 / (alpha l)), l each completion's length. [B]"""
    return (1 - 1 / (args.lam_alpha * mask.sum(-1).clamp(min=1).double())).clamp(min=0)


def compute_advantages(rewards, values, mask, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (§3.1) on the same values and last-token reward: the critic's targets with
    lambda_critic, the policy's advantages with the length-adaptive lambda, whitened. rewards: [N];
    values, mask: [N, T]. Returns (advantages, R_t), [N, T] each."""
    token_rewards = outcome_token_rewards(rewards, mask)
    _, returns = compute_gae(token_rewards, values, mask, args.gamma, args.lam_critic)
    lam = policy_lambda(mask, args)
    advantages, _ = compute_gae(token_rewards, values, mask, args.gamma, lam)
    return whiten(advantages, mask), returns


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
    positive: torch.Tensor | None = None,
    num_pos_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VAPO's loss (§3.3): the token-mean PPO loss with Clip-Higher plus mu times the correct
    completions' token-mean NLL.

    logps, old_logps, mask, advantages: [B, T] (the advantage is per token); positive: [B], 1 for a
    correct completion (None: no NLL term). num_tokens / num_pos_tokens: the mini-batch's token
    counts, all and correct (default: this batch's), so its micro-batches add up. No KL: ref_logps
    and num_seqs are unused."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / num_tokens

    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages
    clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    per_token = -surrogate * rc_weight
    policy_loss = token_mean(per_token)
    positive = torch.zeros_like(mask[:, 0]) if positive is None else positive
    pos_mask = mask * positive[:, None]
    num_pos = pos_mask.sum() if num_pos_tokens is None else num_pos_tokens
    nll = -(logps * pos_mask).sum() / num_pos.clamp(min=1e-8)  # 0 without a correct completion
    loss = policy_loss + args.nll_coef * nll
    with torch.no_grad():
        stats["policy_loss"] = policy_loss.detach()
        stats["nll_loss"] = nll.detach()
        stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
        stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
    return loss, stats


def compute_value_loss(values, old_values, returns, mask, args: Args, num_tokens=None):
    """PPO's clipped value loss above (verl compute_value_loss, ORZ's ValueLoss), c = --value-clip
    (None: unclipped, ORZ eq. 2). [B, T] inputs; num_tokens as compute_policy_loss's.
    value_clip_frac: the tokens whose clipped term is the larger, as verl's."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    per_token = (values - returns) ** 2
    clipped_more = torch.zeros_like(per_token, dtype=torch.bool)
    if args.value_clip is not None:
        c = args.value_clip
        clipped = (torch.clamp(values, old_values - c, old_values + c) - returns) ** 2
        clipped_more = clipped > per_token
        per_token = torch.maximum(per_token, clipped)
    loss = 0.5 * (per_token * mask).sum() / num_tokens
    clip_frac = (clipped_more * mask).sum() / num_tokens
    return loss, {"value_loss": loss.detach(), "value_clip_frac": clip_frac}


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
            # ALGO LOGIC: the NLL's normaliser, the mini-batch's correct tokens
            num_pos, _ = grad_normalizers([m["mask"] * m["positive"][:, None] for m in micro])
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
                        extra.update(positive=m["positive"], num_pos_tokens=num_pos)  # ALGO LOGIC
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


# TRY NOT TO MODIFY: the critic's update loop
def update_critic(critic, optimizer, scheduler, accelerator, batch, args: Args, step: int):
    """update_policy's loop on the value loss, in --critic-num-mini-batches optimizer steps per
    epoch. Backward and gradient norm are common.critic's (under DeepSpeed accelerate's own calls
    drive the policy's engine). Returns rollout-mean stats."""
    n, device = batch["ids"].shape[0], batch["ids"].device
    updates = args.critic_num_mini_batches * args.ppo_epochs
    stats, norms, skipped = {}, [], 0
    for epoch in range(args.ppo_epochs):
        seed = args.seed * 1_000_003 + step * 101 + epoch + 50_000  # not the policy's order
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        for mini_rows in perm.tensor_split(args.critic_num_mini_batches):  # sizes differ by <= 1
            plan = micro_batches(mini_rows.tolist(), batch["lens"], args)
            micro = [micro_batch(batch, rows, p_w, c_w) for rows, p_w, c_w in plan]
            num_tokens, _ = grad_normalizers([m["mask"] for m in micro])
            with weights_cast_once():
                for j, m in enumerate(micro):
                    last = j == len(micro) - 1
                    with contextlib.nullcontext() if last else accelerator.no_sync(critic):
                        values = critic(m["ids"], m["attn"], m["p_len"])
                        loss, mb_stats = compute_value_loss(
                            values, m["old_values"], m["returns"], m["mask"], args, num_tokens
                        )
                        critic_backward(accelerator, critic, loss, last)
                    add_stats(stats, mb_stats, 1 / updates)
            norm = critic_grad_norm(accelerator, critic, args.critic_max_grad_norm)
            norm = torch.as_tensor(torch.nan if norm is None else norm, device=device)
            if torch.isfinite(norm):  # one host sync per optimizer step, never per micro-batch
                optimizer.step()
            else:
                skipped += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            norms.append(norm.detach().float())
    stats.update(critic_grad_norm=torch.stack(norms).mean(), critic_skipped_updates=float(skipped))
    return stats


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: setup
    args, accelerator = start(args)  # "auto" modes resolved
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    tokenizer, model = load_model(args)
    clip_ok = args.value_clip is None or args.value_clip > 0  # ALGO LOGIC: GAE's and the critic's
    if not (0 <= args.gamma <= 1 and 0 <= args.lam_critic <= 1 and clip_ok):
        raise SystemExit("need 0 <= --gamma, --lam-critic <= 1 and --value-clip > 0 (or None)")
    if not (args.lam_alpha > 0 and args.value_warmup_steps >= 0 and args.nll_coef >= 0):
        raise SystemExit("need --lam-alpha > 0, --value-warmup-steps >= 0 and --nll-coef >= 0")
    check_critic_args(args, len(tokenizer), world)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only
        run.log(evaluate(sampler, eval_sets, args), 0)
        return run.close(sampler)
    # ALGO LOGIC: the critic, prepared after the policy (the checkpoint's order)
    critic, critic_optimizer, critic_scheduler = load_critic(args, accelerator)
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

        # ALGO LOGIC: rewards; the advantages need the critic's values (below)
        rewards = compute_rewards(correct, lengths, truncated, args)
        trained_rewards = rewards
        # DATA: --gt-injection / --replay may replace groups (metrics: the policy's own samples)
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)

        # TRY NOT TO MODIFY: the batch, its old and reference log-probs
        pad_id = tokenizer.pad_token_id
        # ALGO LOGIC: the critic's values, targets and advantages, per token
        token_fields = ["old_values", "returns", "advantages"]
        batch = make_batch(groups.prompts, groups.completions, pad_id, device, token_fields)
        plan = micro_batches(list(range(len(trained_rewards))), batch["lens"], args)
        with torch.no_grad():  # ALGO LOGIC: V(s_t) once per rollout, then GAE: advantages [N, C]
            batch["old_values"] = compute_values(critic, batch, plan)
        advantages, batch["returns"] = compute_advantages(
            trained_rewards, batch["old_values"], batch["mask"], args
        )
        batch["advantages"] = advantages
        batch["positive"] = (trained_rewards == 1).to(advantages.dtype)  # the LM loss's completions
        value_stats = value_metrics(
            batch["old_values"], batch["returns"], advantages, batch["mask"]
        )
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        warmup = step < args.value_warmup_steps  # ALGO LOGIC: value pre-training, the critic alone
        has_signal = has_signal and not warmup
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        with torch.no_grad():
            if recompute and has_signal:
                old_logps = compute_logps(policy, batch, args.temperature, plan)
                # DATA: --replay's rows keep their stored log-probs
                batch["old_logps"] = data.update_replay(groups, old_logps, advantages)
        timer.lap("old_logprobs")

        # TRAIN
        stats = {"grad_norm": 0.0, "skipped_updates": 0.0}  # no advantage anywhere: no update
        if has_signal:
            stats = update_policy(policy, optimizer, scheduler, accelerator, batch, args, step)
        timer.lap("train")
        # ALGO LOGIC: the critic, on the same rollout (its targets need no signal)
        critic_stats = update_critic(
            critic, critic_optimizer, critic_scheduler, accelerator, batch, args, step
        )
        stats.update(critic_stats, **value_stats, critic_lr=critic_scheduler.get_last_lr()[0])
        run.count_bad_updates(int(stats["skipped_updates"] + stats["critic_skipped_updates"]), step)
        timer.lap("train_critic")
        sampler.update_weights(accelerator.unwrap_model(policy).lm)  # the next rollout's policy
        timer.lap("weight_sync")

        # TRY NOT TO MODIFY: record metrics
        stats.update(
            no_signal=float(not has_signal), lr=scheduler.get_last_lr()[0], staleness=staleness
        )
        stats["value_warmup"] = float(warmup)
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
            save_checkpoint(run, policy, tokenizer, sampler, data, step + 1, critic)
        if stopping:
            accelerator.print(
                f"stopped by signal after step {step + 1}; resume: --resume {run.dir}"
            )
            return run.close(sampler)

    save_checkpoint(run, policy, tokenizer, sampler, data, args.total_steps, critic)
    accelerator.print(f"done: {run.dir}")
    run.close(sampler)


if __name__ == "__main__":
    main(tyro.cli(Args))
