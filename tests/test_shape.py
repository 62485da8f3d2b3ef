"""The scripts' shape (docs/design.md "Shape"): each reads top to bottom in at most 800 lines, and what they share stays
identical, so `diff grpo.py X.py` shows the algorithm and nothing else."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["grpo", "dapo", "dr_grpo", "lite_ppo", "gspo", "cispo", "daro"]
MAX_LINES = 800


def source(name: str) -> str:
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        return f.read()


def functions(src: str) -> dict[str, str]:
    return {n.name: ast.get_source_segment(src, n) for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def common_imports(src: str) -> str:
    """The `from common... import` block: which shared helpers the script uses."""
    return src[src.index("from common.data import") : src.index("from common.sampling import")]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_fits_the_line_budget(name):
    src = source(name)
    assert len(src.splitlines()) <= MAX_LINES, f"{name}.py has {len(src.splitlines())} lines, the budget is {MAX_LINES}"
    assert max(len(line) for line in src.splitlines()) <= 120


def test_shared_scaffolding_is_identical():
    srcs = {name: source(name) for name in SCRIPTS}
    for name, src in srcs.items():
        assert common_imports(src) == common_imports(srcs["grpo"]), f"{name}.py imports other shared helpers"
        if name != "daro":  # DARO's update_policy also steps its bucket weights
            assert functions(src)["update_policy"] == functions(srcs["grpo"])["update_policy"], name
        assert src.rstrip().endswith('if __name__ == "__main__":\n    main(tyro.cli(Args))'), name
