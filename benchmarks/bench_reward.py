"""Wall time of common.reward.score on 512 ordinary completions (warm pool), in seconds per 100 items.

Run: python benchmarks/bench_reward.py
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import reward  # noqa: E402

N = 512
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


def main() -> None:
    start = time.perf_counter()
    reward.math_reward([r"\boxed{1}"], ["1.0"])
    print(f"pool start (cold, {reward.NUM_WORKERS} workers): {time.perf_counter() - start:.2f} s")
    for exact in (False, True):
        for seed in range(3):  # new seeds: new gold strings, so the workers' gold cache is cold too
            completions, golds = batch(seed, exact)
            start = time.perf_counter()
            scores, counts = reward.score(completions, golds)
            elapsed = time.perf_counter() - start
            print(
                f"{'exact-match fast path allowed' if exact else 'all through math-verify'}, seed {seed}: "
                f"{N} items in {elapsed:.2f} s = {100 * elapsed / N:.3f} s per 100 items; "
                f"accuracy {sum(scores) / N:.3f}, {counts}"
            )


if __name__ == "__main__":
    main()
