"""What the Python tool's sandbox costs: seconds per program (bubblewrap against the unisolated `none` and a bare
`python -` subprocess) and programs per second through the pool (common/sandbox.py, docs/tools.md).

    python benchmarks/bench_tool.py --programs 64 --workers 1 4

Each program is run `--programs` times: `print(1)` (start-up only) and a sympy factorisation (an import and some
work). Per program: the median wall time of one at a time; through the pool: the total for all of them at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.sandbox import Limits, Sandbox, ToolPool, require_sandbox  # noqa: E402

PROGRAMS = {"print": "print(1)", "sympy": "import sympy\nprint(sympy.factorint(2**64 + 1))"}


def bare(code: str) -> None:
    subprocess.run([sys.executable, "-s", "-u", "-"], input=code.encode(), capture_output=True, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    require_sandbox("bwrap")
    print(f"cores {len(os.sched_getaffinity(0))}, {args.programs} programs each, root: {os.geteuid() == 0}")
    pools = " | ".join(f"pool of {w} prog/s" for w in args.workers)
    print(f"| program | bare python s | none s | bwrap s | {pools} |")
    print("|---" * (4 + len(args.workers)) + "|")
    for name, code in PROGRAMS.items():
        row = [name]
        for run in (bare, Sandbox("none", Limits()).run, Sandbox("bwrap", Limits()).run):
            times = []
            for _ in range(args.programs):
                start = time.perf_counter()
                run(code)
                times.append(time.perf_counter() - start)
            row.append(f"{statistics.median(times):.3f}")
        for workers in args.workers:
            pool = ToolPool(Sandbox("bwrap", Limits()), workers)
            start = time.perf_counter()
            results = [f.result() for f in [pool.submit(code) for _ in range(args.programs)]]
            elapsed = time.perf_counter() - start
            pool.close()
            assert all(r.exit_code == 0 for r in results), results[0]
            row.append(f"{args.programs / elapsed:.1f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
