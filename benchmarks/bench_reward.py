"""Completions scored per second by common.reward.score against the number of worker processes (--reward-workers).

    python benchmarks/bench_reward.py                    # 0, 1, 2, 4, ... up to this machine's default
    python benchmarks/bench_reward.py --workers 1 8 16   # writes benchmarks/results/reward_cpu.md

Two batches of 512 completions: a MATH-like mix (fractions, roots, sets, polynomials, decimals; right answers
written differently from the gold, so the exact-match shortcut never applies) that goes through math-verify in the
workers; and integer answers (half right, half off by one), decided in the calling process without math-verify
whatever the worker count. New gold strings every repeat, so no cache helps. 0 workers runs math-verify in the
calling process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import reward  # noqa: E402

N = 512
SEEDS = itertools.count()  # every batch new: new gold strings, so the workers' gold cache is cold too
PROSE = "Let us compute step by step. First we simplify the expression, then we check the cases. " * 8


def batch(seed: int, exact: bool) -> tuple[list[str], list[str]]:
    """Completions with varied answer forms; `exact=False` avoids the string fast path for right answers."""
    rng = random.Random(seed)
    completions, golds = [], []
    for _ in range(N):
        a, b = rng.randint(1, 99), rng.randint(2, 9)
        gold, right, wrong = rng.choice(
            [
                (str(a), str(a) if exact else f"{a}.0", str(a + 1)),
                (
                    rf"\frac{{{a}}}{{{b}}}",
                    rf"\frac{{{a}}}{{{b}}}" if exact else f"{a}/{b}",
                    rf"\frac{{{a + 1}}}{{{b}}}",
                ),
                (
                    rf"{a}\sqrt{{{b}}}",
                    rf"{a}\sqrt{{{b}}}" if exact else rf"\sqrt{{{a * a * b}}}",
                    rf"{a}\sqrt{{{b + 1}}}",
                ),
                (rf"\{{{a},{b}\}}", rf"\{{{a},{b}\}}" if exact else rf"\{{{b},{a}\}}", rf"\{{{a},{b + 1}\}}"),
                (f"x^2+{2 * a}x+{a * a}", f"x^2+{2 * a}x+{a * a}" if exact else f"(x+{a})^2", f"(x+{a + 1})^2"),
            ]
        )
        completions.append(PROSE + rf"So the answer is $\boxed{{{right if rng.random() < 0.5 else wrong}}}$.")
        golds.append(gold)
    return completions, golds


def integer_batch(seed: int) -> tuple[list[str], list[str]]:
    """Integer answers, half right and half off by one."""
    rng = random.Random(seed)
    golds = [str(rng.randint(1, 10**6)) for _ in range(N)]
    preds = [g if rng.random() < 0.5 else str(int(g) + 1) for g in golds]
    return [PROSE + rf"So the answer is $\boxed{{{p}}}$." for p in preds], golds


def rate(make, repeats: int) -> float:
    """Median completions per second over `repeats` fresh batches."""
    rates = []
    for _ in range(repeats):
        completions, golds = make(next(SEEDS))
        start = time.perf_counter()
        reward.score(completions, golds)
        rates.append(N / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", help="worker counts to measure (default: 0, 1, 2, 4, ... default)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    default = reward.default_workers()
    counts = a.workers or sorted({0, default, *(2**k for k in range(8) if 2**k <= default)})
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {len(os.sched_getaffinity(0))} cores usable by this process, "
        f"default workers here {default} (LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', '1')}); "
        f"{N} completions per batch, median of {a.repeats}",
        "",
        "| workers | pool start (s) | MATH-like mix / s | integer answers / s |",
        "|---|---|---|---|",
    ]
    for n in counts:
        reward.set_workers(n)
        start = time.perf_counter()
        reward.score([r"\boxed{\frac{1}{2}}"], ["0.5"])  # starts the pool (n >= 1)
        cold = time.perf_counter() - start
        latex, plain = (rate(lambda seed: batch(seed, exact=False), a.repeats), rate(integer_batch, a.repeats))
        lines.append(f"| {n} | {cold:.2f} | {latex:.0f} | {plain:.0f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "reward_cpu.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
