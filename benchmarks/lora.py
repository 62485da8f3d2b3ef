"""LoRA against full fine-tuning on a real model on a CPU: benchmarks/real_model.py's setting (SmolLM2-135M-Instruct
on tools/smollm2.py's word problems, 10 steps of 4 prompts x G = 8, vLLM's CPU build as the sampler, avg@2 on 48
held-out questions), each script once with full fine-tuning at --lr and once with rank --rank LoRA on all linear layers
at --lora-lr (10x, "LoRA Without Regret"), over --seeds; then the --more-ranks, and rank --rank with
--lora-sync adapter (vLLM's LoRA path), on the first seed.

    python tools/smollm2.py /tmp/smol
    python benchmarks/lora.py /tmp/smol --scripts grpo,dr_grpo --seeds 1,2,3        # ~2 hours on 2 cores

Per run: held-out accuracy, the median step time, the process's peak resident memory (the vLLM engine's KV cache,
the same in every run, included) and the optimizer's state (the size of the final checkpoint's state/optimizer.bin:
AdamW's two moments of every trained parameter). Runs land in OUT/lora/, a rerun reuses finished ones; the table
goes to benchmarks/results/lora.md, and `python tools/compare.py OUT/lora/* --keys eval/test/avg@2 time/step`
gives the intervals over seeds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.real_model import PER_SCRIPT, common_flags, final_eval, finished  # noqa: E402


def run(script: str, flags: list[str], out: str, name: str, seed: int) -> str:
    """Runs one script (or reuses a finished run of that name and seed, benchmarks/real_model.py's `finished`);
    the child's peak RSS (wait4's rusage) goes to the run directory's rusage.json."""
    if done := finished(out, name, seed):
        return done
    before = set(glob.glob(os.path.join(out, "*")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), *flags, "--output-dir", out, "--exp-name", name]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{script} failed:\n{err[-3000:]}")
    (run_dir,) = set(glob.glob(os.path.join(out, "*"))) - before
    with open(os.path.join(run_dir, "rusage.json"), "w") as f:
        json.dump({"maxrss_kb": usage.ru_maxrss}, f)
    return run_dir


def peak_rss_gb(run_dir: str) -> float:
    """The run's peak resident set size in GiB (`run` records it in rusage.json)."""
    with open(os.path.join(run_dir, "rusage.json")) as f:
        return json.load(f)["maxrss_kb"] / 2**20


def optimizer_mb(run_dir: str) -> float:
    (path,) = glob.glob(os.path.join(run_dir, "checkpoints", "step_*", "state", "optimizer.bin"))
    return os.path.getsize(path) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", help="tools/smollm2.py's OUT_DIR (model/, train.jsonl, test.jsonl)")
    p.add_argument("--scripts", default="grpo,dr_grpo")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--more-ranks", default="8,32", help="LoRA ranks run on the first seed only")
    p.add_argument("--lr", type=float, default=1e-5, help="full fine-tuning's learning rate")
    p.add_argument("--lora-lr", type=float, default=1e-4, help="LoRA's learning rate")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--eval-limit", type=int, default=48)
    p.add_argument("--eval-k", type=int, default=2)
    p.add_argument("--sampler", default="vllm")
    a = p.parse_args()
    model, seeds = os.path.join(a.data, "model"), [int(s) for s in a.seeds.split(",")]
    out = os.path.join(a.data, "lora")
    base = common_flags(a.data, a)
    t0, rows = time.time(), []
    settings = [("full", 0, a.lr, seeds, []), (f"lora_r{a.rank}", a.rank, a.lora_lr, seeds, [])]
    settings += [(f"lora_r{r}", int(r), a.lora_lr, seeds[:1], []) for r in a.more_ranks.split(",") if r]
    if a.sampler == "vllm":  # vLLM's LoRA path instead of merged weights, first seed
        settings.append((f"lora_r{a.rank}_adapter", a.rank, a.lora_lr, seeds[:1], ["--lora-sync", "adapter"]))
    for script in [x for x in a.scripts.split(",") if x]:
        for setting, rank, lr, its_seeds, extra in settings:
            accs, secs, rss, opt = [], [], [], []
            for seed in its_seeds:
                flags = [*base, *PER_SCRIPT.get(script, []), "--model-name-or-path", model, "--seed", str(seed)]
                flags += ["--total-steps", str(a.steps), "--eval-every", str(a.steps), "--learning-rate", str(lr)]
                flags += ["--lora-rank", str(rank), *extra]
                name = f"{script}_{setting}"
                run_dir = run(script, flags, out, name, seed)
                acc, s = final_eval(run_dir)
                accs.append(acc), secs.append(s), rss.append(peak_rss_gb(run_dir)), opt.append(optimizer_mb(run_dir))
                print(f"{name}, seed {seed}: eval {acc:.3f}, {s:.1f} s/step, {rss[-1]:.2f} GiB, {opt[-1]:.1f} MiB")
            rows.append((script, setting, lr, accs, secs, rss, opt))
    import torch

    head = (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads, torch {torch.__version__}; SmolLM2-135M-Instruct, "
        f"{a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, T={a.temperature}, {a.steps} steps, "
        f"sampler {a.sampler}; eval avg@{a.eval_k} on {a.eval_limit} held-out questions; this invocation "
        f"{(time.time() - t0) / 60:.0f} min (finished runs are reused)"
    )
    lines = [
        head,
        "",
        "| script | setting | lr | eval accuracy, mean (per seed) | s/step | peak RSS GiB | optimizer MiB |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for script, setting, lr, accs, secs, rss, opt in rows:
        per = ", ".join(f"{x:.3f}" for x in accs)
        lines.append(
            f"| {script} | {setting} | {lr:g} | {statistics.mean(accs):.3f} ({per}) | {statistics.median(secs):.1f} | "
            f"{statistics.mean(rss):.2f} | {statistics.mean(opt):.2f} |"
        )
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "lora.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
