"""A run's setup from its flags (docs/design.md "Shape"): `start` resolves the "auto" modes into a copy, checks every
shared flag and builds the Accelerator; `load_sampler` builds the --sampler for this rank. Everything that can be
refused is refused here or in the other setup calls (common/models.py, common/data.py) before `open_run` writes
anything, in one line (SystemExit) naming the flag; each script keeps its own algorithm's checks next to these calls.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from common.args import SharedArgs
from common.data import check_data_args
from common.env import check_env_args, open_env
from common.kernels import packed_attention_available
from common.reward import answer_format_for, set_workers
from common.run import complete_checkpoints
from common.sampling import make_sampler, resolve_sampler
from common.tool import tool_config

if TYPE_CHECKING:
    from accelerate import Accelerator


def check_shared_args(args: SharedArgs) -> None:
    """Refuses a bad value of a flag every script has, before anything is written."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be >= 2 for group-relative advantages, got {args.group_size}")
    if args.max_new_tokens < 1 or args.total_steps < 0 or args.micro_batch_size < 1 or args.prompts_per_step < 1:
        raise SystemExit("--max-new-tokens, --micro-batch-size and --prompts-per-step must be >= 1, --total-steps >= 0")
    triton = args.logprob_kernel.startswith("triton")
    if triton and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            f"--logprob-kernel {args.logprob_kernel} needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's slow CPU "
            "interpreter)"
        )
    if args.micro_batch_tokens < 0:
        raise SystemExit(
            f"--micro-batch-tokens must be >= 0 (0: --micro-batch-size rows), got {args.micro_batch_tokens}"
        )
    if args.reward_workers < -1:
        raise SystemExit(f"--reward-workers must be >= -1 (-1: cores per local rank), got {args.reward_workers}")
    if args.temperature <= 0:
        raise SystemExit(f"--temperature must be > 0 for RL sampling, got {args.temperature}")
    if args.rollout_correction_cap < 1:
        raise SystemExit(f"--rollout-correction-cap must be >= 1, got {args.rollout_correction_cap}")
    if args.total_steps == 0 and args.eval_every <= 0:
        raise SystemExit("--total-steps 0 only evaluates: set --eval-every 1 (and --eval-datasets)")
    if args.vllm_enable_sleep_mode and (args.sampler != "vllm" or not torch.cuda.is_available()):
        raise SystemExit(
            "--vllm-enable-sleep-mode needs the vLLM sampler on a CUDA GPU (vLLM's CPU backend cannot sleep)"
        )
    if args.vllm_tensor_parallel_size != 1:
        raise SystemExit("--vllm-tensor-parallel-size must be 1: each rank samples its own prompts (README, Multi-GPU)")
    if args.resume and not complete_checkpoints(args.resume):
        raise SystemExit(f"--resume: {args.resume!r} is not a run directory with a complete checkpoint")
    if args.off_policy_steps < 0 or args.vllm_server_timeout <= 0:
        raise SystemExit("--off-policy-steps must be >= 0 (0: synchronous), --vllm-server-timeout > 0")
    if args.vllm_mode == "server" and args.vllm_enable_sleep_mode:
        raise SystemExit("--vllm-enable-sleep-mode is for a colocated engine; a server's memory is its own")
    if args.lora_rank < 0 or args.lora_alpha <= 0 or not 0 <= args.lora_dropout < 1:
        raise SystemExit("--lora-rank must be >= 0 (0: full fine-tuning), --lora-alpha > 0, --lora-dropout in [0, 1)")
    if args.lora_sync == "adapter" and (args.lora_rank == 0 or args.sampler != "vllm" or args.vllm_mode != "colocate"):
        raise SystemExit("--lora-sync adapter needs --lora-rank > 0 and the colocated vLLM engine (--sampler vllm)")
    tool_config(args)  # a bad --tool-* value: one line (the sandbox is checked where the tool is built: open_env)
    check_env_args(args)
    check_data_args(args)


def check_world(args: SharedArgs, world: int) -> None:
    """Refuses a step that cannot be split evenly over `world` processes and --num-mini-batches."""
    if args.prompts_per_step % world:
        raise SystemExit(
            f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes {world}"
        )
    if (args.prompts_per_step // world * args.group_size) % args.num_mini_batches:
        raise SystemExit(
            f"--num-mini-batches {args.num_mini_batches} "
            f"must divide each rank's {args.prompts_per_step // world * args.group_size} completions"
        )


# the flags whose "auto" (or --resume with --total-steps 0) start() decides; args.json keeps both values
RESOLVED = ("sampler", "reward_format", "rollout_correction", "mixed_precision", "model_name_or_path", "padding_free")


def resolve_modes(args: SharedArgs) -> SharedArgs:
    """A copy of `args` with every "auto" decided, its `requested` holding what the command line asked for where the
    two differ. With --total-steps 0 and --resume RUN_DIR the model is RUN_DIR's last checkpoint (evaluated in a new
    run directory; RUN_DIR is not touched)."""
    if args.vllm_mode == "server" and args.sampler == "hf":
        raise SystemExit("--vllm-mode server samples with the vLLM server: drop --sampler hf")
    try:
        sampler = resolve_sampler("vllm" if args.vllm_mode == "server" else args.sampler)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    correction = args.rollout_correction
    if correction == "auto":  # HF generate's log-probs are the trainer's own, unless off-policy
        correction = "none" if sampler == "hf" and not args.off_policy_steps else "token-truncate"
    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() else "no"
    model = args.model_name_or_path
    checkpoints = complete_checkpoints(args.resume) if args.resume else []
    if checkpoints and args.total_steps == 0:
        model = os.path.join(checkpoints[-1], "model")
    resolved = replace(
        args,
        sampler=sampler,
        reward_format=answer_format_for(args.prompt_template, args.reward_format),
        rollout_correction=correction,
        mixed_precision=mixed,
        # on CUDA packed rows need flash-attn (common.kernels); without it the micro-batches are planned padded
        padding_free=args.padding_free and packed_attention_available(),
        model_name_or_path=model,
    )
    resolved.requested = {k: getattr(args, k) for k in RESOLVED if getattr(args, k) != getattr(resolved, k)}
    return resolved


def start(args: SharedArgs) -> tuple[SharedArgs, Accelerator]:
    """The flags with their "auto" modes resolved (`resolve_modes`) and checked, and the Accelerator (on a CPU over
    gloo). The caller's args are left as they were."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    args = resolve_modes(args)
    check_shared_args(args)
    set_workers(args.reward_workers)
    # CPU (tests): gloo. accelerate's cpu=True means DDP, so DeepSpeed on CPU takes the launcher path with gloo named.
    cpu, use_deepspeed = (
        not torch.cuda.is_available(),
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true",
    )
    accelerator = Accelerator(
        cpu=cpu and not use_deepspeed,
        mixed_precision=args.mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu and use_deepspeed else None,
    )
    check_world(args, accelerator.num_processes)
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and accelerator.distributed_type.value != "FSDP":
        raise SystemExit(
            f"FSDP launch on {accelerator.device.type}: accelerate enables FSDP only on accelerators (on a CPU it "
            "would silently run DDP); on a CPU use DDP or DeepSpeed ZeRO-3 (docs/gpu.md)"
        )
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    if (args.tool == "python" or args.env != "none") and args.sampler == "hf" and sharded:
        flag = "--tool python" if args.tool == "python" else "--env"
        raise SystemExit(
            f"{flag} with HF generate under {accelerator.distributed_type.value}: the ranks would generate "
            "different numbers of rounds over sharded weights; use --sampler vllm, or DDP"
        )
    if args.lora_rank > 0 and sharded:
        raise SystemExit(
            f"--lora-rank under {accelerator.distributed_type.value}: LoRA runs on one process or under DDP "
            "(configs/ddp.yaml); its optimizer state is small and the base weights are frozen"
        )
    if args.lora_rank > 0 and args.learning_rate <= 1e-6:
        accelerator.print(
            f"note: --lora-rank {args.lora_rank} at --learning-rate {args.learning_rate:g}, a full fine-tuning rate: "
            "LoRA learns at ~10x the full fine-tuning rate (docs/lora.md)"
        )
    if args.requested.get("padding_free"):
        accelerator.print("warning: --padding-free on CUDA needs flash-attn (pip install flash-attn): running padded")
    return args, accelerator


def max_model_len(args: SharedArgs, model) -> int:
    """The longest sequence a run samples: the longest prompt plus the larger of the training and evaluation budgets;
    refused in one line beyond the model's positions when sampling with vLLM, which would refuse it."""
    eval_tokens = args.eval_max_new_tokens if args.eval_every > 0 else 0
    length = args.max_prompt_tokens + max(args.max_new_tokens, eval_tokens)
    positions = getattr(model.config, "max_position_embeddings", None)
    if args.sampler == "vllm" and positions is not None and length > positions:
        raise SystemExit(
            f"--max-prompt-tokens + --max-new-tokens (or --eval-max-new-tokens) = {length} "
            f"exceeds the model's {positions} positions, which vLLM refuses: lower them"
        )
    return length


def load_sampler(args: SharedArgs, model, tokenizer, accelerator):
    """The --sampler (common.sampling.make_sampler) for this rank (seed + rank * 100003): vLLM with the --vllm-*
    settings, room for `max_model_len`, and the template's stop strings. --vllm-mode server: a
    client of tools/vllm_server.py (common.vllm_server), given the model's weights first (the server may hold
    another run's). With --env or --tool python its episodes run in the process's environment (common.env.open_env,
    which the data shares; the sampler closes it)."""
    from common.data import STOP_STRINGS

    seed, stop = args.seed + accelerator.process_index * 100003, STOP_STRINGS.get(args.prompt_template, [])
    env = open_env(args, tokenizer)
    if args.vllm_mode == "server":
        from common.vllm_server import ServerSampler

        host, port, rank, world = (
            args.vllm_server_host,
            args.vllm_server_port,
            accelerator.process_index,
            accelerator.num_processes,
        )
        sampler = ServerSampler(
            host,
            port,
            seed=seed,
            timeout=args.vllm_server_timeout,
            stop=stop,
            rank=rank,
            world=world,
            env=env,
            tokenizer=tokenizer,
        )
        sampler.update_weights(model)
        return sampler

    # FSDP2 (`fully_shard`): the prepared policy wrapping `model`, whose own parameters HF generate must gather
    from torch.distributed.fsdp import FSDPModule

    fsdp_roots = [m for m in accelerator._models if isinstance(m, FSDPModule)]
    return make_sampler(
        args.sampler,
        model=model,
        fsdp_root=fsdp_roots[0] if fsdp_roots else None,
        tokenizer=tokenizer,
        model_name_or_path=args.model_name_or_path,
        seed=seed,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_model_len=max_model_len(args, model),
        stop=stop,
        lora_rank=args.lora_rank if args.lora_sync == "adapter" else 0,
        env=env,
    )
