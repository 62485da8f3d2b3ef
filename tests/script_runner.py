"""Runs several scripts' `main` one after another in this one process, as `python SCRIPT.py FLAGS` would each:

    python tests/script_runner.py RUNS_JSON

RUNS_JSON holds [[script, [flag, ...]], ...]. After each run, RUNS_JSON + ".out" holds one entry per finished run:
null, or the traceback that ended it (a refused flag's SystemExit included); the next run goes on either way. A
test session pays the imports (torch, transformers, vLLM: ~10 s on 2 cores) and the interpreter's exit once for all
of them instead of once per run; each run builds its own accelerator, model, sampler and engine, and closes them.
`tests.checks.run_scripts` starts it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import tyro

    with open(sys.argv[1]) as f:
        runs = json.load(f)
    results = []
    for script, flags in runs:
        try:
            mod = importlib.import_module(script)
            mod.main(tyro.cli(mod.Args, args=flags))
            results.append(None)
        except SystemExit as e:  # a run's end (a refused flag, or a script's exit 0), not the runner's
            results.append(None if e.code in (0, None) else traceback.format_exc())
        except Exception:
            results.append(traceback.format_exc())
            traceback.print_exc()
        with open(sys.argv[1] + ".out", "w") as f:
            json.dump(results, f)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
