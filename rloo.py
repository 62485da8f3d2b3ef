# docs and experiment results: README.md#the-algorithms (this script's row, and its section if any)
"""RLOO: REINFORCE with a leave-one-out baseline, each completion one action.

Paper: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", https://arxiv.org/abs/2402.14740 (v2): §2.2 eq. 3-4 (the KL-shaped
reward), §2.3 (the estimator), App. C (training details). No official code; the implementations
tools/compare_peers.py runs beside this one: TRL's RLOOTrainer, verl's and OpenRLHF's rloo.

What this algorithm changes vs GRPO: the whole completion is one action (a bandit, §2.2). Its
reward carries the KL to a frozen reference summed over its tokens (k1, at the policy that
sampled); its advantage is that reward minus the mean reward of the other G - 1 completions of its
prompt (no std); the loss is REINFORCE's, the advantage times the completion's log-probability,
averaged over completions, with no ratio, no clip and no KL term:

    R_i = r_i - beta sum_t (log pi_old(o_it) - log pi_ref(o_it))                      (eq. 3-4)
    A_i = R_i - 1/(G-1) sum_{j != i} R_j  =  G/(G-1) (R_i - mean_g R)                   (§2.3)
    L = -1/N sum_i A_i sum_t log pi(o_it)                                               (§2.3)

Every token of a completion gets the gradient -A_i / N: a long completion moves the policy more
than a short one (GRPO divides by |o_i|). The paper takes 2 gradient steps per rollout (App. C)
and writes its estimator without an importance ratio or clip (§2.3); this script applies it on
both steps, the second on samples of the policy before the first. --rloo-loss token-clip is
verl's and OpenRLHF's RLOO: PPO's clip per token, A_i on every token, a token mean. TRL's
RLOOTrainer clips the sequence ratio pi(o_i) / pi_old(o_i): the same gradient on the first step,
not on the second.

Defaults: App. C's TL;DR run (Pythia-6.9B): beta = 0.03, a rollout of 512 in 2 optimizer steps of
256, a constant lr of 1e-6 after a linear warm-up over 3% of the steps, 600 steps; G = 4 (the paper
runs k = 2 and 4; k = 4 is ahead on 2 of its 3 settings, Table 1). Our choices: the 512 are
completions (128 prompts x 4), the warm-up 3% of the 1200 optimizer steps (36); grpo.py's model,
data, length (1024) and evaluation (the paper: summarisation and dialogue with reward models). A
group of one completion cannot occur (--group-size >= 2; verl keeps its raw reward). Not from the
paper: the verifier reads the template's answer format (--reward-format auto), and
--rollout-correction (on with vLLM) weights each token's policy term.

    accelerate launch rloo.py                                  # the paper setting, on GPUs
    python rloo.py --model-name-or-path /tmp/toy/model ...     # README "Quickstart": a CPU run
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common.batching import grad_normalizers, make_batch, micro_batch, micro_batches
from common.data import load_data
from common.logprobs import LogprobCanary, compute_logps, rollout_correction
from common.metrics import Timer, add_stats, evaluate, step_metrics
from common.reward import score
from common.run import (
    load_model,
    load_reference,
    load_sampler,
    open_run,
    prepare_training,
    resume,
    save_checkpoint,
    start,
)


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the experiment's name (run directory: <output-dir>/<exp-name>__<seed>__<unix time>)"""
    seed: int = 1
    """seed of the experiment (each rank samples with seed + rank * 100003)"""
    output_dir: str = "runs"
    """where run directories are created"""
    resume: str | None = None
    """a run directory to continue from its latest checkpoint (with --total-steps 0: to evaluate)"""
    save_every: int = 100
    """save a checkpoint every this many steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many of the latest checkpoints to keep"""
    log_samples_every: int = 10
    """write a few prompts, completions and rewards to samples.jsonl every this many steps"""
    track: bool = False
    """track the run with Weights & Biases (TensorBoard synced, the flags as config)"""
    wandb_project_name: str = "rl-for-llm"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team or user; None: your default)"""

    # Model and data
    model_name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    """Hugging Face hub id or local directory of the policy (and of the frozen reference)"""
    dataset_name: str = "DigitalLearningGmbH/MATH-lighteval"
    """hub id, or a local .jsonl / .json / .parquet file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. 'en'), if it has several"""
    dataset_split: str = "train"
    """dataset split"""
    prompt_column: str = "problem"
    """column holding the question"""
    answer_column: str = "solution"
    """the reference answer (bare, or a solution whose last \\boxed{} is the answer)"""
    prompt_template: Literal["none", "qwen-boxed", "r1", "dapo"] = "qwen-boxed"
    """none: the question as is; qwen-boxed: Qwen2.5-Math's \\boxed{} chat prompt; r1: R1-Zero's
    <think>/<answer>; dapo: DAPO's 'Answer:' chat prompt (docs/flags.md)"""
    reward_format: Literal[
        "auto", "any", "boxed", "answer-line", "answer-line-strict", "answer-tag"
    ] = "auto"
    """where the verifier reads the final answer (none there: 0, a format error); auto: from
    --prompt-template (docs/algorithms.md "Answer formats")"""
    max_prompt_tokens: int = 1024
    """prompts longer than this are dropped at load time (and counted)"""
    max_bad_answer_frac: float = 0.1
    """refuse a dataset with more than this fraction of unparseable answers (fewer: dropped)"""

    # Sampling
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """auto: vLLM with CUDA and vllm installed, else Hugging Face generate (vllm runs on CPU too)"""
    group_size: int = 4
    """G, completions sampled per prompt"""
    prompts_per_step: int = 128
    """prompts per training step, over all ranks (so group_size * prompts_per_step completions)"""
    max_new_tokens: int = 1024
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use it too, so they match the sampler's)"""
    top_p: float = 1.0
    """nucleus sampling"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory the vLLM engine may take (CPU: of the memory, for its KV cache)"""
    vllm_tensor_parallel_size: int = 1
    """tensor parallel size of each vLLM engine; only 1 (each rank samples its own prompts)"""
    vllm_enable_sleep_mode: bool = False
    """offload vLLM's weights and KV cache while training (CUDA only)"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine in every training process; server: tools/vllm_server.py elsewhere"""
    vllm_server_host: str = "127.0.0.1"
    """--vllm-mode server: the server's address (docs/gpu.md "A vLLM server")"""
    vllm_server_port: int = 8000
    """--vllm-mode server: the server's port"""
    vllm_server_timeout: float = 600.0
    """seconds any call to the server may take (a rollout, a weight push) before the run stops"""
    off_policy_steps: int = 0
    """K: a step trains on rollouts generated K steps before, while the sampler works ahead"""

    # Data strategies (docs/data_strategies.md): all off by default
    prompt_sampling: Literal["uniform", "curriculum", "medium"] = "uniform"
    """uniform: shuffled epochs; medium: prompts whose groups likely have a signal; curriculum:
    those, easy to hard (docs/data_strategies.md)"""
    difficulty_file: str | None = None
    """tools/profile_data.py output: its per-prompt pass rates seed the tracker (the prior)"""
    gt_injection: bool = False
    """an all-wrong group's last completion is replaced by a verified demonstration"""
    solution_column: str | None = None
    """dataset column of worked solutions for --gt-injection (default: the bare reference answer)"""
    replay: bool = False
    """a group without signal is replaced by a buffered high-value group and its stored log-probs"""
    replay_buffer_size: int = 64
    """high-value groups each rank keeps for --replay (oldest dropped first)"""
    replay_max_age: int = 10
    """--replay: buffered groups generated more than this many steps ago are dropped"""
    gt_injection_max_frac: float = 1.0
    """--gt-injection: at most this share of a rank's groups per step get a demonstration"""
    tracker_half_life: float = 10.0
    """steps after which a pass-rate observation weighs half (0: never forget)"""
    uniform_floor: float = 0.5
    """curriculum/medium: the share of the draw probability spread uniformly over all prompts"""
    curriculum_min_target: float = 0.2
    """curriculum: the target pass rate at the end of the run (it starts at 1)"""

    # Optimisation
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    warmup_steps: int = 36
    """linear learning-rate warm-up, in optimizer steps; constant afterwards"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    total_steps: int = 600
    """training steps (one rollout each; 0: only evaluate)"""
    num_mini_batches: int = 2
    """optimizer steps per rollout and epoch (1: fully on-policy, DeepSeekMath's single update)"""
    ppo_epochs: int = 1
    """passes over each rollout"""
    micro_batch_size: int = 256
    """at most this many sequences per forward/backward on each rank"""
    micro_batch_tokens: int = 8192
    """padded tokens per forward/backward on each rank, longest sequences first; the gradient is the
    same (0: --micro-batch-size rows; docs/benchmarks.md)"""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on CUDA, none on CPU"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    logprob_chunk_size: int = 1024
    """tokens per chunk when turning hidden states into log-probs (bounds a tokens x vocab array)"""
    logprob_kernel: Literal["torch", "triton"] = "torch"
    """torch: chunked matmul + log-softmax; triton: fused output-layer forward (GPU)"""
    max_bad_steps: int = 5
    """stop after this many consecutive updates skipped for a non-finite loss or gradient norm"""
    rollout_correction: Literal[
        "auto", "none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"
    ] = "auto"
    """weight exp(old_logps - sampler_logps) on the policy term, for the sampler/trainer mismatch;
    auto: token-truncate with vLLM, none with HF generate (docs/algorithms.md)"""
    rollout_correction_cap: float = 2.0
    """cap of the rollout-correction weight: truncated to it, or tokens/sequences above it masked"""
    reward_workers: int = -1
    """math-verify worker processes (-1: this process's cores / local ranks; 0: none)"""

    # LoRA (peft; docs/lora.md): 0 is full fine-tuning
    lora_rank: int = 0
    """rank r of the LoRA adapters that train instead of the weights (0: full fine-tuning)"""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapted layer computes W x + (alpha / r) B A x"""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """the layers given adapters: module names or suffixes (all-linear: all but the output layer)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """what vLLM gets: merged weights W + (alpha / r) B A, or the adapter (vLLM's LoRA path)"""

    # Algorithm specific arguments
    # The shared defaults above that this paper sets (App. C, the TL;DR run):
    #   group_size = 4            k, samples per prompt (the paper runs 2 and 4)
    #   prompts_per_step = 128    rollout batch 512 (completions)
    #   num_mini_batches = 2      step batch 256: two gradient steps per rollout
    #   total_steps = 600         RL steps
    #   warmup_steps = 36         linear warm-up over 3% of the 1200 optimizer steps
    beta: float = 0.03
    """KL coefficient: R = r - beta sum_t log(pi_old / pi_ref) (0 loads no reference model)"""
    rloo_loss: Literal["reinforce", "token-clip"] = "reinforce"
    """reinforce: -A sum_t log pi, the paper's; token-clip: PPO's clip per token, token mean (verl)"""
    clip_eps_low: float = 0.2
    """--rloo-loss token-clip: ratios below 1 - clip_eps_low stop negative-advantage gradients"""
    clip_eps_high: float = 0.2
    """--rloo-loss token-clip: ratios above 1 + clip_eps_high stop positive-advantage gradients"""

    # Evaluation
    eval_every: int = 0
    """evaluate every this many steps and at the end (0 disables evaluation)"""
    eval_datasets: list[str] = field(default_factory=lambda: ["HuggingFaceH4/MATH-500"])
    """hub ids (split 'test') or local files to evaluate on"""
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
def compute_rewards(correct, lengths, truncated, args: Args) -> torch.Tensor:
    """The task reward r_i: 1 for a verified answer, 0 otherwise. [N] tensors."""
    return correct.float()


def kl_shaped_rewards(rewards, mask, old_logps, ref_logps, args: Args) -> torch.Tensor:
    """R_i = r_i - beta sum_t (log pi_old - log pi_ref)(o_it) (eq. 3-4: k1 summed over the
    completion, at the policy that sampled it). rewards: [N]; mask, old_logps, ref_logps: [N, T]."""
    if args.beta == 0:
        return rewards
    return rewards - args.beta * ((old_logps - ref_logps) * mask).sum(-1)


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = R_i - 1/(G-1) sum_{j != i} R_j (§2.3). rewards: [N], the KL-shaped R, groups
    contiguous. A group whose rewards are all equal gets A = 0."""
    r = rewards.view(-1, args.group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (args.group_size - 1)  # the other G - 1
    return (r - baseline).view(-1)


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
    """RLOO loss (§2.3): -1/N sum_i A_i sum_t log pi(o_it); --rloo-loss token-clip:
    -1/sum_i |o_i| sum_i sum_t min(r A_i, clip(r) A_i).

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
    # 1 without --rollout-correction
    rc_weight, stats = rollout_correction(old_logps, rollout_logps, mask, args, num_tokens)
    if args.rloo_loss == "reinforce":  # the completion's log-probability: a sum over its tokens
        loss = (-adv * logps * rc_weight * mask).sum() / num_seqs
    else:
        clipped = torch.clamp(ratio, 1 - args.clip_eps_low, 1 + args.clip_eps_high)
        surrogate = torch.minimum(ratio * adv, clipped * adv)
        loss = token_mean(-surrogate * rc_weight)
        with torch.no_grad():
            stats["clip_frac_low"] = token_mean((ratio < 1 - args.clip_eps_low) & (adv < 0))
            stats["clip_frac_high"] = token_mean((ratio > 1 + args.clip_eps_high) & (adv > 0))
    with torch.no_grad():
        stats["policy_loss"] = loss.detach()
        stats["approx_kl"] = token_mean((ratio - 1) - log_ratio)  # k3 estimate of KL(old || new)
        if ref_logps is not None:  # the k1 of the reward, per token
            stats["kl_ref"] = token_mean(old_logps - ref_logps)
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
            rows = perm[mb * mb_size : (mb + 1) * mb_size].tolist()
            plan = micro_batches(rows, batch["lens"], args)
            chunks = [micro_batch(batch, rows, p_w, c_w) for rows, p_w, c_w in plan]
            num_tokens, num_seqs = grad_normalizers([m["mask"] for m in chunks])
            for j, (m, (_, p_w, _)) in enumerate(zip(chunks, plan)):
                last = j == len(chunks) - 1
                accelerator.gradient_state._set_sync_gradients(last)  # DeepSpeed steps at the last
                with contextlib.nullcontext() if last else accelerator.no_sync(policy):
                    logps, entropy = policy(m["ids"], m["attn"], p_w, args.temperature)
                    old = m.get("old_logps", logps.detach())
                    extra = dict(ref_logps=m.get("ref_logps"), rollout_logps=m.get("sampler_logps"))
                    loss, mb_stats = compute_policy_loss(
                        logps, old, m["advantages"], m["mask"], args, num_tokens, num_seqs, **extra
                    )
                    accelerator.backward(loss)
                mb_stats.update(loss=loss, entropy=(entropy * m["mask"]).sum() / num_tokens)
                add_stats(stats, mb_stats, 1 / updates)
                if "sampler_logps" in m and epoch == 0 and mb == 0:  # the sampler has our weights
                    canary.add(logps, m["sampler_logps"], m["mask"])
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
    accelerator = start(args)  # the flags every script has, "auto" modes resolved (common/run.py)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    tokenizer, model = load_model(args)
    data, eval_sets = load_data(args, tokenizer, accelerator.print)  # no data: --total-steps 0
    run = open_run(args, accelerator)  # run directory, args.json, TensorBoard, signals
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    ref_policy = None
    if args.beta > 0:  # ALGO LOGIC: frozen reference for the KL term (sharded as the policy)
        ref_policy = load_reference(args, accelerator, policy)
    sampler = load_sampler(args, model, tokenizer, accelerator)
    if args.total_steps == 0:  # evaluation only: the model, or --resume's last checkpoint
        run.log(evaluate(sampler, eval_sets, args), 0)
        return run.close(sampler)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0

    for step in range(start_step, args.total_steps):
        timer = Timer()
        # ROLLOUT: G completions for each of this rank's prompts (--prompt-sampling chooses them);
        # --off-policy-steps K: generated K steps ago, by that step's policy
        rows, completions, staleness = data.rollout(step, sampler, rank, world)
        prompts = [data.prompts[i] for i in rows]
        if args.vllm_enable_sleep_mode:
            sampler.sleep()  # free vLLM's memory for training; update_weights wakes it
        timer.lap("generate")
        golds = [data.golds[i] for i in rows for _ in range(args.group_size)]
        texts = [c.text for c in completions]
        correct, reward_info = score(texts, golds, answer_format=args.reward_format)
        correct = torch.tensor(correct, device=device)
        lengths = torch.tensor([len(c.token_ids) for c in completions], device=device)
        truncated = torch.tensor([c.truncated for c in completions], device=device)
        timer.lap("reward")

        # ALGO LOGIC: rewards; the advantages come after the log-probs (the KL is in the reward)
        rewards = compute_rewards(correct, lengths, truncated, args)
        # DATA: --gt-injection / --replay may replace groups (then the rewards follow); the
        # metrics describe the policy's own samples
        groups = data.train_groups(rows, completions, correct.tolist(), step, accelerator)
        trained_rewards = rewards
        if groups.changed:
            t = groups.tensors(device)
            trained_rewards = compute_rewards(t.correct, t.lengths, t.truncated, args)

        # TRY NOT TO MODIFY: the batch; old and reference log-probs, once per rollout
        pad_id = tokenizer.pad_token_id
        # the rewards hold the advantages' place until the log-probs are in
        batch = make_batch(groups.prompts, groups.completions, trained_rewards, pad_id, device)
        plan = micro_batches(list(range(len(trained_rewards))), batch["lens"], args)
        # pi_old for several updates, replayed rows or off-policy rollouts: once, before the updates
        recompute = (
            args.num_mini_batches * args.ppo_epochs > 1 or args.replay or args.off_policy_steps
        )
        recompute = recompute or args.beta > 0  # ALGO LOGIC: the KL in the reward is at pi_old
        with torch.no_grad():
            if recompute:
                batch["old_logps"] = compute_logps(policy, batch, args.temperature, plan)
            if ref_policy is not None:
                batch["ref_logps"] = compute_logps(ref_policy, batch, args.temperature, plan)
            # ALGO LOGIC: the KL-shaped reward, then the leave-one-out advantages; a replayed
            # row's KL is at today's policy (update_replay caps its ratio by the advantage's sign)
            shaped = kl_shaped_rewards(
                trained_rewards, batch["mask"], batch.get("old_logps"), batch.get("ref_logps"), args
            )
            batch["advantages"] = compute_advantages(shaped, args)
            data.update_replay(groups, batch)  # DATA: --replay's stored log-probs and buffer
        any_signal = (batch["advantages"] != 0).any().float().reshape(1)
        has_signal = accelerator.reduce(any_signal, "sum").item() > 0  # on any rank
        timer.lap("old_logprobs")

        # TRAIN: mini-batches of the rollout, each in micro-batches with one global normaliser
        stats = {"grad_norm": 0.0, "skipped_updates": 0.0}  # no advantage anywhere: no update
        if has_signal:
            stats = update_policy(policy, optimizer, scheduler, accelerator, batch, args, step)
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
