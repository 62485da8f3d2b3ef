"""The scripts' shape (docs/design.md "Shape"): each reads top to bottom, its main() dominated by the loop, and what
they share stays identical, so `diff grpo.py X.py` shows the algorithm and nothing else."""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import io
import math
import os
import tokenize

import pytest

from common.critic import CriticArgs
from tests.test_scripts import ROOT, SCRIPTS

MAX_LINES = 650  # a script
MAX_MAIN, MAX_SETUP = 200, 80  # main(), and its lines before the training loop
MAX_LONG_LINES = 30  # lines over 100 characters (readers put two scripts side by side); none over 120
MAX_COMMON_NAMES = 30  # names a script imports from common/
MAX_ARGS = 45  # lines of a script's own flags and overrides in Args (common/args.py holds the shared ones)
MAX_GRPO = 320  # grpo.py's lines: the model script reads in one sitting
# Each script's shape as last reviewed (2026-11-29): its lines, main()'s lines, main()'s lines before the loop, its
# Args lines (args_lines), the names it imports from common/, and `diff grpo.py X.py`'s changed lines. A script may
# grow HEADROOM above each (so a one-line fix passes) and shrink freely. A record rises only when the algorithm needs
# it, with the reason on its line; scaffolding never raises one (docs/design.md "Shape"). `python -m tests.test_shape`
# prints the measured table.
HEADROOM = 0.05
SHAPE_FIELDS = ("lines", "main", "setup", "args", "imports", "diff")
RECORDED = {
    "grpo": (271, 99, 17, 8, 22, 0),
    "dapo": (378, 147, 30, 38, 23, 211),
    "dr_grpo": (273, 97, 15, 13, 21, 84),
    "lite_ppo": (281, 97, 15, 17, 21, 86),
    "gspo": (272, 97, 15, 7, 21, 81),
    "cispo": (372, 145, 30, 40, 23, 221),
    "daro": (422, 110, 22, 22, 21, 227),
    "sapo": (280, 101, 19, 9, 22, 77),
    "gmpo": (291, 99, 17, 19, 22, 92),
    "dppo": (311, 102, 20, 21, 22, 138),
    "clip_cov": (356, 100, 17, 28, 23, 149),
    "m2po": (326, 103, 20, 17, 22, 141),
    "reinforce_pp": (325, 107, 19, 16, 23, 162),  # the KL in the reward, returns, global normalisation
    "rloo": (293, 105, 17, 13, 22, 136),
    "ppo": (404, 115, 20, 22, 29, 269),  # the critic: values once per rollout, GAE, the value loss, update_critic
    "vapo": (443, 121, 22, 35, 29, 316),
    "kimi_k15": (279, 98, 16, 8, 21, 146),  # the squared loss, the length reward, the optimizer reset
    "long_cot": (481, 136, 33, 36, 29, 352),  # ppo.py's critic, the cosine reward, the penalty's stream, the KL
    "l1": (399, 110, 24, 31, 26, 198),  # the target in the prompt, the reward, the budgets' evaluation
    "cppo": (344, 110, 18, 16, 22, 125),  # the pruning, the allocation, their flags and metrics
}
# prose (docstring and comment characters) per code character: cleanRL's ppo.py is at 0.23, nanochat's chat_rl.py at
# 0.50; a docstring keeps the paper, the change, its equations and our deviations, the defaults' provenance lives in
# docs/algorithms.md (docs/design.md "Shape")
MAX_PROSE, MAX_PROSE_ALL = 0.55, 0.50  # any one script; the scripts together
# names a script imports from common/ beyond grpo.py's, and grpo.py's that it does not need
EXTRA_IMPORTS = {
    "dapo": {"gather", "PromptTemplate"},  # dynamic sampling's kept-group fraction; the template's type
    "cispo": {"gather", "PromptTemplate"},
    "dppo": {"PromptTemplate"},
    "clip_cov": {"batching"},  # global_sum / global_cat: the token selection over all ranks
    "m2po": {"global_cat"},
    "reinforce_pp": {"global_sum"},  # the advantages' mean and std over all ranks
    # the critic (common/critic.py) and the whitening over all ranks
    "ppo": {"global_sum", "CriticArgs", "check_critic_args", "compute_values", "critic_backward", "critic_grad_norm"}
    | {"load_critic", "value_metrics", "PromptTemplate"},
}
EXTRA_IMPORTS["vapo"] = EXTRA_IMPORTS["ppo"]
EXTRA_IMPORTS["long_cot"] = EXTRA_IMPORTS["ppo"] - {"PromptTemplate"}
# |n_y - N| over ranks; the budgets' prompts and their scores
EXTRA_IMPORTS["l1"] = {"gather", "encode_prompts", "load_rows", "score"}
UNUSED_IMPORTS = {"load_reference"}  # GRPO's frozen reference, for its KL term
# the ratio is to the sampler's own log-probs: no rollout correction on top
UNUSED_BY = {"dppo": {"rollout_correction"}, "m2po": {"rollout_correction"}}
# their Args inherit it through common.critic.CriticArgs
UNUSED_BY.update(ppo={"SharedArgs"}, vapo={"SharedArgs"}, long_cot={"SharedArgs"})
# update_policy differs: DARO also steps its bucket weights; Clip-Cov / KL-Cov and M2PO select tokens once per
# mini-batch over all ranks; VAPO counts the tokens of its LM loss over the mini-batch
OWN_UPDATE = ("daro", "clip_cov", "m2po", "vapo")


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
    """Setup is a few named calls (common/setup.py, models.py, data.py, run.py); the loop and what the algorithm
    changes dominate main()."""
    main = functions(source(name))["main"]
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    assert main.end_lineno - main.lineno + 1 <= MAX_MAIN
    assert loop.lineno - main.lineno <= MAX_SETUP
    assert len(common_names(source(name))) <= MAX_COMMON_NAMES


def args_lines(src: str) -> int:
    """The lines of Args that define its own flags and overrides: fields and their docstrings, without the class line,
    comments, blank lines and --exp-name (every script names itself)."""
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    lines = src.splitlines()[cls.lineno : cls.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith(("#", "exp_name:")))


@pytest.mark.parametrize("name", SCRIPTS)
def test_args_hold_only_the_algorithm(name):
    """Args inherits the shared flags and adds only its algorithm's flags and the defaults its paper overrides, each
    override with its source in a comment (above it or on its line)."""
    src = source(name)
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Args")
    assert [ast.unparse(b) for b in cls.bases] in (["SharedArgs"], ["CriticArgs"]), name  # CriticArgs: the critic's
    assert args_lines(src) <= MAX_ARGS, f"{name}.py's Args has {args_lines(src)} lines of flags"
    shared = {f.name for f in dataclasses.fields(CriticArgs)} - {"exp_name"}
    lines = src.splitlines()
    overrides = [n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id in shared]
    if overrides:  # a comment opens the block of the paper's defaults (its source), or ends the override's line
        opened = lines[overrides[0].lineno - 2].strip().startswith("#")
        bare = [n.target.id for n in overrides if not opened and "  # " not in lines[n.lineno - 1]]
        assert not bare, f"{name}.py overrides {bare} without a source"


def changed_lines(a: str, b: str) -> int:
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def shape(name: str) -> tuple[int, ...]:
    """The script's measured shape, in SHAPE_FIELDS' order."""
    src = source(name)
    main = functions(src)["main"]
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    main_lines, setup = main.end_lineno - main.lineno + 1, loop.lineno - main.lineno
    diff = changed_lines(source("grpo"), src)
    return len(src.splitlines()), main_lines, setup, args_lines(src), len(common_names(src)), diff


def limit(recorded: int) -> int:
    return math.floor(recorded * (1 + HEADROOM)) + (recorded < 20)  # a small count may still take one line


def test_diff_against_grpo_shows_the_algorithm():
    """No script outgrows its recorded shape by more than the headroom; grpo.py stays readable in one sitting."""
    assert len(source("grpo").splitlines()) <= MAX_GRPO
    assert set(RECORDED) == set(SCRIPTS), "record a new script's shape (python -m tests.test_shape)"
    grown = {}
    for name in SCRIPTS:
        for field, now, was in zip(SHAPE_FIELDS, shape(name), RECORDED[name]):
            if now > limit(was):
                grown[f"{name} {field}"] = (now, was, limit(was))
    assert not grown, f"grown past the headroom (now, recorded, limit): {grown}"


def test_the_headroom_check_sees_growth():
    """The check above fails on a script grown past its headroom: a recorded shape 10% under today's is refused."""
    for name in ("grpo", "ppo"):
        for now in shape(name):
            assert now <= limit(now) and (now < 20 or now > limit(math.floor(now / 1.1)))


def test_args_json_records_requested_and_resolved(tmp_path):
    """start() resolves "auto" into a copy (the caller's args untouched), and records what was asked for."""
    import grpo
    from common.setup import resolve_modes

    asked = grpo.Args(sampler="auto", prompt_template="r1")
    got = resolve_modes(asked)
    assert (asked.sampler, asked.reward_format, asked.rollout_correction) == ("auto", "auto", "auto")
    assert (got.sampler, got.reward_format, got.rollout_correction, got.mixed_precision) == (
        "hf",
        "answer-tag",
        "none",
        "no",
    )
    assert got.requested == {
        "sampler": "auto",
        "reward_format": "auto",
        "rollout_correction": "auto",
        "mixed_precision": "auto",
    }
    assert resolve_modes(grpo.Args(sampler="hf", reward_format="boxed", mixed_precision="no")).requested == {
        "rollout_correction": "auto"
    }


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


def test_the_critic_scripts_share_one_critic_update():
    """ppo.py and vapo.py train their critics with the same update_critic, line for line."""
    srcs = {name: source(name) for name in SCRIPTS if "update_critic" in functions(source(name))}
    assert {"ppo", "vapo"} <= set(srcs)
    segments = {ast.get_source_segment(src, functions(src)["update_critic"]) for src in srcs.values()}
    assert len(segments) == 1


def code_of(node: ast.AST) -> str:
    """The node's code without docstrings or comments (what it does, not how it is described)."""
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        docstring = isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        if docstring and isinstance(body[0].value, ast.Constant):
            n.body = body[1:] or [ast.Pass()]
    return ast.unparse(node)


def dynamic_sampling(src: str) -> list[str]:
    """A script's dynamic-sampling rollout: the statements of its training loop from the round counter to the
    mini-batch count, and the helpers they call."""
    loop = next(n for n in ast.walk(functions(src)["main"]) if isinstance(n, ast.For))
    code = [code_of(n) for n in loop.body]
    first = next(i for i, c in enumerate(code) if c.startswith("share, rounds = "))
    last = next(i for i, c in enumerate(code) if c.startswith("num_mini_batches = mini_batch_count("))
    return code[first : last + 1] + [code_of(functions(src)[f]) for f in ("filter_groups", "mini_batch_count")]


def test_dapo_and_cispo_share_one_dynamic_sampling_loop():
    """cispo.py's dynamic sampling is dapo.py's (MiniMax-M1 takes it from DAPO), statement for statement: a fix in
    one is a fix in both."""
    dapo, cispo = dynamic_sampling(source("dapo")), dynamic_sampling(source("cispo"))
    assert len(dapo) > 10 and dapo == cispo


def prose_and_code(src: str) -> tuple[int, int]:
    """(prose, code) characters of a source, each line stripped: the lines of a string statement (a module, class,
    function or field docstring) and the comments are prose, the rest is code."""
    lines = src.splitlines()
    doc_lines = set()
    for node in ast.walk(ast.parse(src)):
        if not isinstance(getattr(node, "body", None), list):
            continue
        for stmt in node.body:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                doc_lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    comments = {
        tok.start[0]: len(tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    }
    prose = sum(len(lines[i - 1].strip()) for i in doc_lines) + sum(comments.values())
    code = 0
    for i, line in enumerate(lines, 1):
        text = line.strip()
        if i in doc_lines or text.startswith("#"):
            continue
        code += len(text[: len(text) - comments.get(i, 0)].strip())
    return prose, code


def test_prose_stays_at_the_anchors_density():
    counts = {name: prose_and_code(source(name)) for name in SCRIPTS}
    dense = {name: round(p / c, 2) for name, (p, c) in counts.items() if p > MAX_PROSE * c}
    assert not dense, f"prose per code character above {MAX_PROSE}: {dense}"
    prose, code = (sum(column) for column in zip(*counts.values()))
    assert prose <= MAX_PROSE_ALL * code, f"the scripts' prose per code character: {prose / code:.2f} > {MAX_PROSE_ALL}"


if __name__ == "__main__":  # the measured table, to review against RECORDED
    print("name", *SHAPE_FIELDS)
    for script in SCRIPTS:
        print(f'    "{script}": {shape(script)},')
