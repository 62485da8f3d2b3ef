"""The learning test's measure for run directories: how much more often the policy of the second half of training
answers correctly than the nearly untrained one of the first 10 steps (tests/test_scripts.py asks for 0.05).

    for s in 1 2 3 4; do PLOT=/tmp/toy_s$s.png bash tools/sweep_toy.sh /tmp/learn/s$s --seed $s; done
    python tools/learning_rise.py /tmp/learn/s*/*

One line per run (its directory name, the two means of train/accuracy and the rise), then the lowest and highest
rise. Runs of other lengths are measured the same way: the first 10 steps, and the steps from half of the run on.
`--steps T` measures each run as if it had stopped after T steps (its first T rows): a toy run's schedule does not
depend on its length, so a run of T steps logs exactly these rows, and one long sweep tells how short a test may be.
`--key` measures another metric (the game's env/success_frac).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def rise(accuracy: list[float]) -> tuple[float, float, float]:
    """(mean of the first 10 steps, mean of the second half, their difference)."""
    untrained = sum(accuracy[:10]) / len(accuracy[:10])
    half = accuracy[len(accuracy) // 2 :]
    trained = sum(half) / len(half)
    return untrained, trained, trained - untrained


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="the learning test's rise of each run directory")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--steps", type=int, default=0, help="measure the first STEPS rows only (0: all)")
    parser.add_argument("--key", default="train/accuracy")
    args = parser.parse_args(argv)
    rises = []
    for run_dir in args.run_dirs:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            accuracy = [row[args.key] for row in map(json.loads, f) if args.key in row]
        if args.steps and len(accuracy) < args.steps:
            sys.exit(f"{run_dir}: {len(accuracy)} steps logged, fewer than --steps {args.steps}")
        untrained, trained, r = rise(accuracy[: args.steps or None])
        rises.append(r)
        print(f"{os.path.basename(os.path.normpath(run_dir)):40s} {untrained:.3f} -> {trained:.3f}  rise {r:+.3f}")
    print(f"{len(rises)} runs: rise {min(rises):+.3f} to {max(rises):+.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
