"""Runs several scripts' `main` one after another in this one process, as `python SCRIPT.py FLAGS` would each:

    python tests/script_runner.py RUNS_JSON

RUNS_JSON holds [[script, [flag, ...]], ...]: a script's module name (grpo), or the path of a .py file (a mutated
copy of one). After each run, RUNS_JSON + ".out" holds one entry per finished run:
null, or the traceback that ended it (a refused flag's SystemExit included); the next run goes on either way. A
test session pays the imports (torch, transformers, vLLM: ~10 s on 2 cores) and the interpreter's exit once for all
of them instead of once per run; each run builds its own accelerator, model, sampler and engine, and closes them.
`tests.checks.run_scripts` starts it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(script: str):
    """The module of a script name, or of a .py file outside the repository (imported under its own name)."""
    if not script.endswith(".py"):
        return importlib.import_module(script)
    name = os.path.splitext(os.path.basename(script))[0]
    spec = importlib.util.spec_from_file_location(name, script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses (the script's Args) look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    import tyro

    with open(sys.argv[1]) as f:
        runs = json.load(f)
    results = []
    for script, flags in runs:
        try:
            mod = load(script)
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
