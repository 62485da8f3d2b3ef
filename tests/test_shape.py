"""The scripts' shape (docs/design.md "Shape"): each reads top to bottom, its main() dominated by the loop, and what
they share stays identical, so `diff grpo.py X.py` shows the algorithm and nothing else."""

from __future__ import annotations

import ast
import os

import pytest

from tests.test_scripts import ROOT, SCRIPTS

MAX_LINES = 650  # a script
MAX_MAIN, MAX_SETUP = 200, 80  # main(), and its lines before the training loop
MAX_LONG_LINES = 30  # lines over 100 characters (readers put two scripts side by side); none over 120
MAX_COMMON_NAMES = 30  # names a script imports from common/
# names a script imports from common/ beyond grpo.py's, and grpo.py's that it does not need
EXTRA_IMPORTS = {
    "dapo": {"gather"},  # dynamic sampling's kept-group fraction
    "cispo": {"gather"},
    "clip_cov": {"batching"},  # global_sum / global_cat: the token selection over all ranks
    "m2po": {"global_cat"},
    "reinforce_pp": {"global_sum"},  # the advantages' mean and std over all ranks
}
UNUSED_IMPORTS = {"load_reference"}  # GRPO's frozen reference, for its KL term
# the ratio is to the sampler's own log-probs: no rollout correction on top
UNUSED_BY = {"dppo": {"rollout_correction"}, "m2po": {"rollout_correction"}}
# update_policy differs: DARO also steps its bucket weights; Clip-Cov / KL-Cov and M2PO select tokens once per
# mini-batch over all ranks
OWN_UPDATE = ("daro", "clip_cov", "m2po")


def source(name: str) -> str:
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        return f.read()


def functions(src: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def common_names(src: str) -> set[str]:
    """The names the script imports from common/."""
    tree = ast.parse(src)
    return {
        a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module.startswith("common") for a in n.names
    }


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_fits_the_line_budget(name):
    lines = source(name).splitlines()
    assert len(lines) <= MAX_LINES, f"{name}.py has {len(lines)} lines, the budget is {MAX_LINES}"
    assert max(len(line) for line in lines) <= 120
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert len(long) <= MAX_LONG_LINES, f"{name}.py lines over 100 characters: {long}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_main_is_mostly_the_loop(name):
    """Setup is a few named calls (common/run.py); the loop and what the algorithm changes dominate main()."""
    main = functions(source(name))["main"]
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    assert main.end_lineno - main.lineno + 1 <= MAX_MAIN
    assert loop.lineno - main.lineno <= MAX_SETUP
    assert len(common_names(source(name))) <= MAX_COMMON_NAMES


def test_shared_scaffolding_is_identical():
    srcs = {name: source(name) for name in SCRIPTS}
    grpo_names = common_names(srcs["grpo"])
    for name, src in srcs.items():
        names = common_names(src)
        assert names - grpo_names <= EXTRA_IMPORTS.get(name, set()), f"{name}.py imports other shared helpers"
        unused = UNUSED_IMPORTS | UNUSED_BY.get(name, set())
        assert grpo_names - names <= unused, f"{name}.py lacks shared helpers: {grpo_names - names}"
        if name not in OWN_UPDATE:
            got, want = functions(src)["update_policy"], functions(srcs["grpo"])["update_policy"]
            assert ast.get_source_segment(src, got) == ast.get_source_segment(srcs["grpo"], want), name
        assert src.rstrip().endswith('if __name__ == "__main__":\n    main(tyro.cli(Args))'), name
