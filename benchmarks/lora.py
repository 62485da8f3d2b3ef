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

    python benchmarks/lora.py /tmp/smol --timing-rounds 2 --sampler hf                 # ~20 minutes on 2 cores

--timing-rounds N instead runs full fine-tuning and rank --rank LoRA alternately, N rounds of --timing-steps steps
each (fresh runs, no evaluation), so that load on a shared machine hits both alike, and writes the medians of each
phase's time over the steps after the first, their ratio, and the peak RSS (with `--sampler hf` the trainer's
alone) to benchmarks/results/lora_timing_<sampler>.md.
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


PHASES = ("generate", "old_logprobs", "train", "weight_sync", "step")


def timing(a, base: list[str], model: str, out: str) -> None:
    """Full fine-tuning and LoRA alternately, --timing-rounds rounds (see the module docstring)."""
    times = {s: {k: [] for k in PHASES} for s in ("full", "lora")}
    rss = {"full": [], "lora": []}
    for r in range(a.timing_rounds):
        for setting, rank, lr in (("full", 0, a.lr), ("lora", a.rank, a.lora_lr)):
            flags = [*base, *PER_SCRIPT.get("grpo", []), "--model-name-or-path", model, "--seed", "1"]
            flags += ["--total-steps", str(a.timing_steps), "--eval-every", "0", "--learning-rate", str(lr)]
            flags += ["--lora-rank", str(rank)]
            run_dir = run("grpo", flags, out, f"timing_{a.sampler}_{setting}_round{r}", 1)
            rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
            for row in [x for x in rows if "time/step" in x][1:]:
                for k in PHASES:
                    times[setting][k].append(row.get(f"time/{k}", 0.0))
            rss[setting].append(peak_rss_gb(run_dir))
            print(f"round {r} {setting}: {statistics.median(times[setting]['step']):.1f} s/step so far", flush=True)
    med = {s: {k: statistics.median(v) for k, v in times[s].items()} for s in times}
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads; grpo.py on SmolLM2-135M-Instruct, {a.prompts} "
        f"prompts x G={a.group_size}, {a.new_tokens} new tokens, sampler {a.sampler}; full fine-tuning against LoRA "
        f"r={a.rank} on all linear layers, alternately, {a.timing_rounds} rounds of {a.timing_steps} steps; medians "
        "over the steps after each run's first",
        "",
        "| phase | full s | LoRA s | LoRA / full |",
        "|---|---|---|---|",
    ]
    for k in PHASES:
        ratio = med["lora"][k] / med["full"][k] if med["full"][k] else float("nan")
        lines.append(f"| time/{k} | {med['full'][k]:.2f} | {med['lora'][k]:.2f} | {ratio:.2f} |")
    full_rss, lora_rss = max(rss["full"]), max(rss["lora"])
    lines.append(f"| peak RSS GiB | {full_rss:.2f} | {lora_rss:.2f} | {lora_rss / full_rss:.2f} |")
    table = "\n".join(lines)
    with open(os.path.join(ROOT, "benchmarks", "results", f"lora_timing_{a.sampler}.md"), "w") as f:
        f.write(table + "\n")
    print(table)


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
    p.add_argument("--timing-rounds", type=int, default=0, help="instead: full and LoRA alternately, N rounds")
    p.add_argument("--timing-steps", type=int, default=4)
    p.add_argument("--results", default="lora.md", help="the table's file in benchmarks/results/")
    p.add_argument("--only", default="", help="run only these settings (e.g. lora_r8,lora_r32); default: all")
    a = p.parse_args()
    model, seeds = os.path.join(a.data, "model"), [int(s) for s in a.seeds.split(",")]
    out = os.path.join(a.data, "lora")
    base = common_flags(a.data, a)
    if a.timing_rounds:
        return timing(a, base, model, os.path.join(a.data, f"lora_timing_{int(time.time())}"))
    t0, rows = time.time(), []
    settings = [("full", 0, a.lr, seeds, []), (f"lora_r{a.rank}", a.rank, a.lora_lr, seeds, [])]
    settings += [(f"lora_r{r}", int(r), a.lora_lr, seeds[:1], []) for r in a.more_ranks.split(",") if r]
    if a.sampler == "vllm":  # vLLM's LoRA path instead of merged weights, first seed
        settings.append((f"lora_r{a.rank}_adapter", a.rank, a.lora_lr, seeds[:1], ["--lora-sync", "adapter"]))
    if a.only:
        settings = [x for x in settings if x[0] in a.only.split(",")]
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
    with open(os.path.join(ROOT, "benchmarks", "results", a.results), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
