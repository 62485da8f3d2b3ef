"""Runs a program the way a rollout's Python tool does and prints what the model would be shown: the ```output block
appended after the model's ```python block (common/tool.py, docs/tools.md). For writing prompts and demonstrations.

    echo 'print(sum(range(101)))' | python tools/run_tool.py
    python tools/run_tool.py --timeout-s 2 < program.py

Same sandbox, limits and cut as a run with the tool's defaults (--sandbox none: no isolation at all).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.sandbox import SANDBOXES, Sandbox, require_sandbox  # noqa: E402
from common.tool import ToolConfig, output_block, shown_output  # noqa: E402


def show(code: str, config: ToolConfig) -> str:
    """The output block `code` gets in a rollout (after a model text that ends with a newline)."""
    return output_block(shown_output(Sandbox(config.sandbox, config.limits()).run(code), config))


def main(argv: list[str] | None = None) -> None:
    d = ToolConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandbox", choices=SANDBOXES, default=d.sandbox, help="bwrap, or none: no isolation")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="wall-clock seconds")
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="address space per process")
    p.add_argument("--max-output-chars", type=int, default=d.max_output_chars, help="characters shown")
    args = p.parse_args(argv)
    config = ToolConfig(
        sandbox=args.sandbox, timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_output_chars=args.max_output_chars
    )
    require_sandbox(config.sandbox)
    sys.stdout.write(show(sys.stdin.read(), config))


if __name__ == "__main__":
    main()
