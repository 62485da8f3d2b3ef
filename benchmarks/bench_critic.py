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

Also GAE alone at 20k tokens (16 rows x 1250 positions, lengths 250-1250, a masked span inside each row, fp32 as the
scripts compute it, per-row lambdas as vapo.py's): ppo.compute_gae (the scan) against the loop over positions it
replaced (tests/test_ppo.py's loop_gae), median of --gae-repeats each, in this process, their ratio; the two are
checked equal in float64 first. `--gae-only` runs just that (seconds; on CUDA too) and writes critic_gae_<device>.md.
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


def gae_timing(repeats: int) -> dict:
    """GAE at 20k tokens: the scan (ppo.compute_gae) and the loop over positions, median seconds each and the ratio."""
    import torch

    import ppo
    from tests.test_ppo import loop_gae

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, width = 16, 1250
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(250, width, rows).round().long()
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    starts = (torch.rand(rows, generator=g) * lengths * 0.8).long()
    for row, start in enumerate(starts.tolist()):
        mask[row, start : start + 20] = 0  # a tool's output inside the completion
    values = torch.rand(rows, width, generator=g, dtype=torch.float64)
    rewards = ppo.outcome_token_rewards(torch.randint(0, 2, (rows,), generator=g).double(), mask)
    lams = (1 - 1 / (0.05 * mask.sum(-1).double())).clamp(min=0)  # vapo.py's policy lambda (alpha 0.05)
    scan, loop = ppo.compute_gae(rewards, values, mask, 1.0, lams), loop_gae(rewards, values, mask, 1.0, lams)
    for a, b in zip(scan, loop):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    inputs = (rewards.float().to(device), values.float().to(device), mask.to(device), 1.0, lams.float().to(device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {"device": device.type, "rows": rows, "width": width, "tokens": rows * width, "kept": int(mask.sum())}
    for name, fn in (("loop_s", loop_gae), ("scan_s", ppo.compute_gae)):
        fn(*inputs)  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn(*inputs)
            sync()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    out["ratio"] = out["loop_s"] / out["scan_s"]
    return out


def gae_line(r: dict) -> str:
    return (
        f"GAE at {r['tokens']} tokens ({r['rows']} rows x {r['width']}, {r['kept']} kept, fp32, {r['device']}): "
        f"loop over positions {r['loop_s'] * 1e3:.2f} ms, scan {r['scan_s'] * 1e3:.2f} ms, {r['ratio']:.1f}x faster"
    )


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
    p.add_argument("--gae-repeats", type=int, default=20)
    p.add_argument("--gae-only", action="store_true", help="time GAE alone, not the scripts")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = p.parse_args()
    gae = gae_line(gae_timing(a.gae_repeats))
    print(gae, flush=True)
    os.makedirs(a.out, exist_ok=True)
    if a.gae_only:
        import torch

        where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPU threads"
        name = f"critic_gae_{'cuda' if torch.cuda.is_available() else 'cpu'}.md"
        with open(os.path.join(a.out, name), "w") as f:
            f.write(f"{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}: `python benchmarks/"
                    f"bench_critic.py {' '.join(sys.argv[1:])}`\n\n{gae}\n")  # fmt: skip
        return
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
    lines += ["", gae]
    table = "\n".join(lines)
    name = f"critic_{'cuda' if cuda else 'cpu'}_h{a.hidden}x{a.layers}_{a.new_tokens}tok.md"
    with open(os.path.join(a.out, name), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
