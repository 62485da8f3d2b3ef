"""Learning curves of several runs side by side, from their metrics.jsonl files.

    python tools/plot.py runs/grpo__1__* runs/dapo__1__* --out curves.png
    python tools/plot.py runs/* --keys train/reward_mean train/entropy --smooth 10 --out sweep.png

Each argument is a run directory (or a metrics.jsonl file). Runs are labelled by their directory name up to
the seed (`<exp-name>__<seed>`); runs sharing an exp-name with different seeds are drawn as their mean with
a min-max band. One panel per metric key.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict

DEFAULT_KEYS = ["train/reward_mean", "train/accuracy", "train/response_length_mean", "train/entropy"]


def read_run(path: str) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} of one run; non-finite values are skipped."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    series[k].append((row["step"], float(v)))
    return series


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (window 1: unchanged)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def label(path: str) -> tuple[str, str]:
    """(experiment, seed) from a run directory named <exp-name>__<seed>__<unix time>."""
    path = os.path.dirname(path) if path.endswith(".jsonl") else path
    name = os.path.basename(os.path.normpath(path))
    parts = name.split("__")
    return (parts[0], parts[1]) if len(parts) >= 3 else (name, "")


def plot(runs: list[str], keys: list[str], out: str, window: int = 1, title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[label(r)[0]].append(read_run(r))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for i, (exp, members) in enumerate(sorted(groups.items())):
            curves = [dict(m[key]) for m in members if key in m]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            per_seed = [smooth([c[s] for s in steps], window) for c in curves]
            mean = [sum(v) / len(v) for v in zip(*per_seed)]
            name = exp if len(curves) == 1 else f"{exp} ({len(curves)} seeds)"
            style = ("-", "--", ":")[i // 10 % 3]  # the colour cycle holds 10: the next ten are dashed
            (line,) = ax.plot(steps, mean, label=name, color=f"C{i % 10}", linestyle=style)
            if len(curves) > 1:
                ax.fill_between(
                    steps,
                    [min(v) for v in zip(*per_seed)],
                    [max(v) for v in zip(*per_seed)],
                    color=line.get_color(),
                    alpha=0.2,
                )
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=1 if len(groups) <= 6 else 2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    p.add_argument("--keys", nargs="+", default=DEFAULT_KEYS, help="metric keys, one panel each")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")
    p.add_argument("--title", default=None)
    p.add_argument("--out", default="curves.png", help="output PNG")
    a = p.parse_args()
    for r in a.runs:
        if not os.path.exists(r if not os.path.isdir(r) else os.path.join(r, "metrics.jsonl")):
            p.error(f"no metrics.jsonl in {r!r}")
    print(plot(a.runs, a.keys, a.out, a.smooth, a.title))


if __name__ == "__main__":
    main()
