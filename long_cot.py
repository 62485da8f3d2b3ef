# docs and results: README.md#the-algorithms
"""Long-CoT reward shaping: the cosine length-scaled reward and a dense repetition penalty, on PPO.

Paper: Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs",
https://arxiv.org/abs/2502.03373, §4. Code: eddycmu/demystify-long-cot@e90cf9b, an OpenRLHF fork
(openrlhf/reward/, trainer/ppo_utils/experience_maker.py, the §4.2 script with the repetition penalty).

Built on ppo.py: the paper trains with PPO (a critic, GAE with lambda = 1), and the dense penalty is
a reward on single tokens with its own discount, which per-token returns hold and a group baseline
cannot. A completion of L tokens, L_max = --max-new-tokens, (r_0, r_L) = (2, 1) if correct, (-10, 0)
if wrong, gets (the code swaps min and max for the wrong branch: the same formula)

    r = r_L + (r_0 - r_L) (1 + cos(pi L / L_max)) / 2,   r_e = -10 if L + 16 >= L_max

(the code's 16-token margin; the paper: L = L_max). The dense penalty p_t is -0.05 on each token of
a token 40-gram seen earlier in the completion. The k1 KL to the initial policy (beta = 0.01) is in
every token's reward, half in each stream; each stream has its own discount and, lambda being 1:

    R_t = sum_{u>=t} 1^(u-t) (r [u = last] - beta/2 KL_u) + 0.99^(u-t) (p_u - beta/2 KL_u)
    A_t = R_t - V(s_t), whitened over the rollout's tokens (all ranks), as ppo.py

Without the penalty it is ppo.py's GAE on one stream. The policy loss is PPO's clip, a per-sequence
token mean (the fork's). Ours: grpo.py's model and data, constant learning rates, ppo.py's critic
(docs/algorithms.md). Not from the paper: --rollout-correction (on with vLLM).

    accelerate launch long_cot.py                                  # the paper setting, on GPUs
    python long_cot.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import tyro

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
from common.models import load_model, load_reference, prepare_training
from common.run import open_run, resume, save_checkpoint
from common.setup import load_sampler, start


@dataclass
class Args(CriticArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    # the §4.2 script (cosine + dense repetition penalty); the model and data are grpo.py's
    max_prompt_tokens: int = 2048  # --prompt_max_len
    group_size: int = 16  # --n_samples_per_prompt
    prompts_per_step: int = 512  # --rollout_batch_size
    max_new_tokens: int = 14336  # --generate_max_len: L_max
    learning_rate: float = 5e-7  # --actor_learning_rate
    num_mini_batches: int = 16  # --train_batch_size 512 of the 8192 completions
    ppo_epochs: int = 2  # --max_epochs
    critic_learning_rate: float = 9e-6  # --critic_learning_rate
    critic_warmup_steps: int = 0  # ours, constant (OpenRLHF: cosine after a 3% warm-up)
    critic_num_mini_batches: int = 16  # OpenRLHF trains the critic on the policy's mini-batches

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: r < 1 - clip_eps_low stops a negative-advantage token's gradient"""
    clip_eps_high: float = 0.2
    """PPO clip: ratios above 1 + clip_eps_high stop the gradient of positive-advantage tokens"""
    cosine_correct: tuple[float, float] = (2.0, 1.0)
    """(r_0, r_L): a correct answer's reward at length 0 and at --max-new-tokens"""
    cosine_wrong: tuple[float, float] = (-10.0, 0.0)
    """(r_0, r_L): a wrong answer's reward at length 0 and at --max-new-tokens"""
    exceed_reward: float = -10.0
    """r_e: the reward of a completion of L tokens with L + --exceed-margin >= --max-new-tokens"""
    exceed_margin: int = 16
    """the code's MAX_LEN_MARGIN (common.py); -1: no completion exceeds"""
    repetition_ngram: int = 40
    """n of the dense penalty's token n-grams"""
    repetition_penalty: float = -0.05
    """the reward of each token of a repeated n-gram, in its own stream (0: no penalty)"""
    repetition_gamma: float = 0.99
    """the penalty stream's discount (the outcome's is --gamma)"""
    beta: float = 0.01
    """k1 KL to the initial policy in every token's reward (--init_kl_coef; 0: no reference)"""
    gamma: float = 1.0
    """the outcome stream's discount"""
    lam: float = 1.0
    """GAE's lambda (1 with the penalty: the code's per-stream returns are Monte-Carlo)"""
    value_clip: float | None = 0.2
    """the critic's values move at most this far from the rollout's per update (None: unclipped)"""


# ALGO LOGIC: rewards, advantages and the losses
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The cosine length-scaled reward (CosineScaledSparseReward): r_L + (r_0 - r_L) (1 + cos(pi L /
    L_max)) / 2 with (r_0, r_L) the correct or the wrong pair, r_e from L + margin >= L_max. [N]
    tensors; the result in correct's float dtype (>= fp32)."""
    progress = lengths.to(torch.promote_types(correct.dtype, torch.float32)) / args.max_new_tokens
    right = correct.bool()
    r_0 = torch.full_like(progress, args.cosine_correct[0]).where(right, args.cosine_wrong[0])
    r_l = torch.full_like(progress, args.cosine_correct[1]).where(right, args.cosine_wrong[1])
    reward = r_l + 0.5 * (r_0 - r_l) * (1.0 + torch.cos(progress * math.pi))
    exceeded = lengths + args.exceed_margin >= args.max_new_tokens
    return torch.where(exceeded, args.exceed_reward, reward)


def repetition_penalty(completions: list[list[int]], args: Args, width: int) -> torch.Tensor:
    """The dense penalty (RepetitionDensePenalty): --repetition-penalty on each token of a token
    n-gram that starts later than the same n-gram's first occurrence in the completion, once per
    token however many repeats cover it. completions: token ids; returns [N, width] (float64)."""
    n, out = args.repetition_ngram, np.zeros((len(completions), width))
    for i, ids in enumerate(completions):
        if len(ids) < n or args.repetition_penalty == 0:
            continue
        grams = np.lib.stride_tricks.sliding_window_view(np.asarray(ids), n)
        _, first, which = np.unique(grams, axis=0, return_index=True, return_inverse=True)
        repeated = np.flatnonzero(first[which.reshape(-1)] != np.arange(len(grams)))
        covered = np.zeros(len(ids) + 1, dtype=np.int64)  # +1 from each repeat's start to its end
        np.add.at(covered, repeated, 1)
        np.add.at(covered, repeated + n, -1)
        out[i, : len(ids)] = np.where(np.cumsum(covered[:-1]) > 0, args.repetition_penalty, 0.0)
    return torch.from_numpy(out)


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
    """ORZ's normalize_advantages (orz/ppo/utils.py) over every rank's completion tokens:
    (A - mean) / sqrt(max(var, 1e-8)), var the population variance; 0 outside the mask."""
    m = mask.to(advantages.dtype)
    count, total = global_sum(torch.stack([m.sum(), (advantages * m).sum()]))
    mean = total / count.clamp(min=1)
    var = global_sum(((advantages - mean) ** 2 * m).sum()) / count.clamp(min=1)
    return (advantages - mean) * var.clamp(min=1e-8).rsqrt() * m


def compute_advantages(rewards, values, mask, args: Args, penalty=None, kl=None):
    """The outcome reward on the last token, the dense penalty on its tokens, -beta KL on every
    token; one stream (no penalty): ppo.py's GAE with --gamma and --lam; two: each stream's returns
    with its own discount and half the KL (experience_maker.py's multiple gammas, lambda 1), A = R -
    V; whitened. rewards: [N]; values, mask, penalty (None: 0), kl (log pi_old - log pi_ref, None:
    no KL): [N, T]. Returns (advantages, the critic's targets R_t), [N, T] each."""
    outcome = outcome_token_rewards(rewards, mask)
    kl_reward = 0.0 if kl is None else -args.beta * kl * mask
    if args.repetition_penalty == 0:
        advantages, returns = compute_gae(outcome + kl_reward, values, mask, args.gamma, args.lam)
        return whiten(advantages, mask), returns
    zeros = torch.zeros_like(values)  # GAE on V = 0 with lambda 1: the discounted returns
    penalty = zeros if penalty is None else penalty
    _, outcome_returns = compute_gae(outcome + kl_reward / 2, zeros, mask, args.gamma, 1.0)
    gamma = args.repetition_gamma
    _, penalty_returns = compute_gae(penalty + kl_reward / 2, zeros, mask, gamma, 1.0)
    returns = outcome_returns + penalty_returns
    return whiten(returns - values, mask), returns


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
    """PPO loss with OpenRLHF's per-sequence token mean: -1/B sum_i 1/|o_i| sum_t min(r A_it,
    clip(r) A_it); the KL is in the reward (ref_logps: kl_ref, the k1 it carries, as a stat).

    logps, old_logps, mask, advantages: [B, T] (the advantage is per token). num_seqs / num_tokens:
    the mini-batch's normalisers when this batch is one micro-batch of it (common.batching
    .grad_normalizers); by default the batch's own. Stats are token means over the same mini-batch,
    so they add up over micro-batches too."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs

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
    seq_means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # 1/|o_i| sum_t
    loss = seq_means.sum() / num_seqs  # 1/B sum_i
    if ref_logps is not None:  # the k1 that is in the reward
        stats["kl_ref"] = token_mean(old_logps - ref_logps).detach()
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
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
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1 and clip_ok):
        raise SystemExit("need 0 <= --gamma <= 1, 0 <= --lam <= 1 and --value-clip > 0 (or None)")
    if not (
        0 <= args.repetition_gamma <= 1 and args.repetition_penalty <= 0 < args.repetition_ngram
    ):
        raise SystemExit(
            "need 0 <= --repetition-gamma <= 1, --repetition-penalty <= 0, --repetition-ngram >= 1"
        )
    if args.repetition_penalty and args.lam != 1:
        raise SystemExit(
            "--lam must be 1 with --repetition-penalty (each stream's returns are Monte-Carlo)"
        )
    check_critic_args(args, len(tokenizer), world)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    if args.beta > 0:  # ALGO LOGIC: the initial policy, for the KL in the reward
        ref_policy = load_reference(args, accelerator, policy)
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

        # ALGO LOGIC: rewards; the advantages need the critic's values and the KL (below)
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
        # pi_old, once, if the policy moves during the updates or rows are stale
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        recompute = recompute or ref_policy is not None  # ALGO LOGIC: the KL at pi_old
        with torch.no_grad():  # ALGO LOGIC: V(s_t), pi_old and pi_ref once per rollout
            batch["old_values"] = compute_values(critic, batch, plan)
            if recompute:
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            if ref_policy is not None:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
        # ALGO LOGIC: the dense penalty and the KL in the token rewards, the returns, A [N, C]
        token_ids = [c.token_ids for c in groups.completions]
        penalty = repetition_penalty(token_ids, args, batch["mask"].shape[1]).to(
            batch["old_values"]
        )
        kl = batch["old_logps"] - batch["ref_logps"] if ref_policy is not None else None
        advantages, batch["returns"] = compute_advantages(
            trained_rewards, batch["old_values"], batch["mask"], args, penalty, kl
        )
        batch["advantages"] = advantages
        value_stats = value_metrics(
            batch["old_values"], batch["returns"], advantages, batch["mask"]
        )
        any_signal = (advantages != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        if recompute:  # DATA: --replay's rows keep their stored log-probs
            batch["old_logps"] = data.update_replay(groups, batch["old_logps"], advantages)
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
