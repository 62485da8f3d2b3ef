"""The learning test's measure for run directories: how much more often the policy of the second half of training
answers correctly than the nearly untrained one of the first 10 steps (tests/test_scripts.py asks for 0.05).

    for s in 1 2 3 4; do PLOT=/tmp/toy_s$s.png bash tools/sweep_toy.sh /tmp/learn/s$s --seed $s; done
    python tools/learning_rise.py /tmp/learn/s*/*

One line per run (its directory name, the two means of train/accuracy and the rise), then the lowest and highest
rise. Runs of other lengths are measured the same way: the first 10 steps, and the steps from half of the run on.
"""

from __future__ import annotations

import json
import os
import sys


def rise(accuracy: list[float]) -> tuple[float, float, float]:
    """(mean of the first 10 steps, mean of the second half, their difference)."""
    untrained = sum(accuracy[:10]) / len(accuracy[:10])
    half = accuracy[len(accuracy) // 2 :]
    trained = sum(half) / len(half)
    return untrained, trained, trained - untrained


def main(run_dirs: list[str]) -> None:
    if not run_dirs:
        sys.exit("usage: python tools/learning_rise.py RUN_DIR [RUN_DIR ...]")
    rises = []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            accuracy = [row["train/accuracy"] for row in map(json.loads, f) if "train/accuracy" in row]
        untrained, trained, r = rise(accuracy)
        rises.append(r)
        print(f"{os.path.basename(os.path.normpath(run_dir)):40s} {untrained:.3f} -> {trained:.3f}  rise {r:+.3f}")
    print(f"{len(rises)} runs: rise {min(rises):+.3f} to {max(rises):+.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
