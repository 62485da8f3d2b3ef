"""What a critic costs: grpo.py against ppo.py and vapo.py on the same model, batch and lengths, back to back.

    python benchmarks/bench_critic.py                        # CPU: a random Qwen2 (hidden 256 x 4 layers), 64 tokens
    python benchmarks/bench_critic.py --hidden 64 --layers 2 --new-tokens 16 --rounds 3   # toy-sized

All three: the same randomly initialised Qwen2 (benchmarks/bench_step.py's), the toy a+b prompts, G = --group-size
completions for --prompts prompts per step, at most --new-tokens new tokens (the random model rarely samples EOS),
Hugging Face generate, fp32, one policy update per rollout, lr 1e-6, their default micro-batches. grpo.py without its
KL (--beta 0: no reference model); ppo.py and vapo.py with one critic optimizer step per rollout
(--critic-num-mini-batches 1), so that the critic's work matches the policy's, and vapo.py without value
pre-training (--value-warmup-steps 0: its steps are all full steps). Reported: the median seconds per step over the
steps after --warmup (per round, and the median over rounds), the per-phase medians of the last round (the critic's
forward over the rollout is in old_logprobs, its update in train_critic), and each run's peak resident set size
(wait4's rusage of the child: weights, both optimizers' states, activations). With --rounds the scripts alternate, so
load on a shared machine hits all of them. Writes benchmarks/results/critic_<device>_h<hidden>x<layers>_<n>tok.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_step import build_model  # noqa: E402

SCRIPTS = {
    "grpo": ["--beta", "0"],
    "ppo": ["--critic-num-mini-batches", "1", "--truncated-reward", "keep"],
    "vapo": ["--critic-num-mini-batches", "1", "--value-warmup-steps", "0"],
}
PHASES = ("generate", "reward", "old_logprobs", "train", "train_critic", "weight_sync")


def run(script: str, model: str, data: str, a) -> tuple[float, dict[str, float], float]:
    """One run: (median s/step after the warm-up, median s per phase, peak RSS in GiB)."""
    out = tempfile.mkdtemp()
    flags = {
        "model-name-or-path": model,
        "dataset-name": data,
        "prompt-column": "question",
        "answer-column": "answer",
        "prompt-template": "none",
        "group-size": a.group_size,
        "prompts-per-step": a.prompts,
        "max-new-tokens": a.new_tokens,
        "learning-rate": 1e-6,
        "total-steps": a.steps,
        "sampler": "hf",
        "output-dir": out,
        "save-every": 0,
        "log-samples-every": 0,
    }
    cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), *SCRIPTS[script]]
    cmd += [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{script}.py failed:\n{err[-4000:]}")
    (run_dir,) = os.listdir(out)
    rows = [json.loads(line) for line in open(os.path.join(out, run_dir, "metrics.jsonl"))][a.warmup :]
    phases = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in rows) for k in PHASES}
    return statistics.median(r["time/step"] for r in rows), phases, usage.ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="alternate the scripts this many times")
    a = p.parse_args()
    from tests.toy import write_dataset

    root = tempfile.mkdtemp()
    model = build_model(root, a.hidden, a.layers)
    data = write_dataset(os.path.join(root, "train.jsonl"), n=512)
    rounds, phases, rss = [], {}, {}
    for _ in range(a.rounds):
        times = {}
        for script in SCRIPTS:
            times[script], phases[script], rss[script] = run(script, model, data, a)
        rounds.append(times)
        print(times, flush=True)
    import torch

    cuda = torch.cuda.is_available()
    where = f"{torch.cuda.get_device_name()}, bf16 autocast" if cuda else f"{os.cpu_count()} CPU threads, fp32"
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}; Qwen2 hidden {a.hidden} x {a.layers} "
        f"layers, {a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, HF generate, "
        f"{a.steps} steps of which {a.warmup} warm-up, {a.rounds} round(s)",
        "",
        "| s/step | " + " | ".join(f"{s}.py" for s in SCRIPTS) + " | ppo / grpo | vapo / grpo |",
        "|---|" + "---|" * (len(SCRIPTS) + 2),
    ]
    med = {s: statistics.median(r[s] for r in rounds) for s in SCRIPTS}
    for name, r in [*((f"round {k + 1}", r) for k, r in enumerate(rounds)), ("**median**", med)]:
        cells = " | ".join(f"{r[s]:.3f}" for s in SCRIPTS)
        lines.append(f"| {name} | {cells} | {r['ppo'] / r['grpo']:.2f} | {r['vapo'] / r['grpo']:.2f} |")
    lines += ["", "| phase (median s, last round) | " + " | ".join(f"{s}.py" for s in SCRIPTS) + " |"]
    lines.append("|---|" + "---|" * len(SCRIPTS))
    for k in PHASES:
        lines.append(f"| {k} | " + " | ".join(f"{phases[s][k]:.3f}" for s in SCRIPTS) + " |")
    lines.append("| peak RSS (GiB, last round) | " + " | ".join(f"{rss[s]:.2f}" for s in SCRIPTS) + " |")
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = f"critic_{'cuda' if cuda else 'cpu'}_h{a.hidden}x{a.layers}_{a.new_tokens}tok.md"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
