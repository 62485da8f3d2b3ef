"""reasoning-gym's procedural tasks (PyPI `reasoning-gym`, offline) as a data source and a reward: docs/tasks.md.

    --dataset-name reasoning-gym:<task>[:<option>=<value>,...]      training rows (--dataset-split train or test)
    --eval-datasets reasoning-gym:<task>[:<option>=<value>,...]     held-out rows (split test)

The options are the task's own config fields (`countdown:min_numbers=3,max_numbers=3`; a list or tuple field takes
its items separated by `|`, `operators=+|-`), plus `size` (rows, default 500, reasoning-gym's default) and `seed` (of
the generator, default 0: every run and every rank has the same rows; the run's --seed orders them).

- Splits: the generator's stream of items is cut by the question's text: a question is held out when its SHA-256
  falls in the first quarter (`held_out`), so no training row of a task ever has a held-out row's question, whatever
  the seeds, sizes or options of either. The train split is the first `size` items of the stream that are not held
  out, the test split the first `size` that are.
- Golds: a row's gold answer is a JSON string naming its task, the generator's config and the item's index
  (`common.reward.task_gold`), so `common.reward.score` scores it with the task's own `score_answer` in its worker
  processes (with the same timeouts and format-error accounting as math-verify); the entries generated here are kept
  by that key (`task_payload`), so the workers get the exact entry, not a regenerated one.
- The reward is 1 for a score of 1 and 0 otherwise; `with_partial_credit` (--partial-credit, training only) marks
  golds whose score is the task's own, partial credit included. "Correct" stays a score of 1 everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import urllib.error
from typing import Any

from common.reward import TASK_PREFIX, parse_task_gold, task_dataset, task_gold

DEFAULT_SIZE = 500  # reasoning-gym's own default dataset size
DEFAULT_SEED = 0
HELD_OUT_SHARE = 0.25  # the quarter of each task's question space kept for evaluation
SPLITS = ("train", "test")
# reasoning-gym 0.1.23's scorers that run the answer as code: Python's eval (it expects a list literal), and sympy's
# parse_expr (an eval of the transformed expression); `unsafe_answer` keeps code out of both
PYTHON_EVAL_TASKS = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
SYMPY_TASKS = frozenset(
    {"countdown", "puzzle24", "simple_integration", "intermediate_integration", "polynomial_multiplication"}
)
# the only calls an answer to a SYMPY_TASKS task may make: pure math functions (and an unevaluated Integral, which
# intermediate_integration's own answers hold)
MATH_CALLS = frozenset(
    "sin cos tan cot sec csc asin acos atan acot sinh cosh tanh asinh acosh atanh exp log ln sqrt Abs abs".split()
    + ["Integral"]
)
_CALL = re.compile(r"([\w.]*)\s*\(")  # what stands before each "(": a name, or nothing (a grouping parenthesis)
_NETWORK_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError)  # socket errors reach urllib as URLError
_NETWORK_MODULES = ("requests", "urllib3", "httpx", "huggingface_hub", "nltk")
_ENTRIES: dict[tuple[str, str, int], dict[str, Any]] = {}  # (task, config as sorted JSON, index) -> its entry


def is_task_name(name: str) -> bool:
    return name.startswith(TASK_PREFIX)


def _registry() -> dict[str, tuple[type, type]]:
    try:
        import reasoning_gym  # noqa: F401 - registers the tasks
    except ImportError:
        raise SystemExit("reasoning-gym tasks need the package: pip install reasoning-gym==0.1.23") from None
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _convert(text: str, default: Any, option: str, where: str) -> Any:
    """An option's value from its text, by the type of the config field's default."""
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"{where}: option {option!r} takes true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, (tuple, list)):
        first = default[0] if default else ""
        return [_convert(item, first, option, where) for item in text.split("|")]
    if default is None or isinstance(default, (int, float, str)):
        kind = str if isinstance(default, str) else float if isinstance(default, float) else int
        for k in (kind,) if default is not None else (int, float, str):
            try:
                return k(text)
            except ValueError:
                continue
        raise SystemExit(f"{where}: option {option!r} takes a {kind.__name__}, got {text!r}")
    raise SystemExit(f"{where}: option {option!r} is a {type(default).__name__}, which a dataset name cannot set")


def parse_task_name(name: str, flag: str) -> tuple[str, dict[str, Any], int, int]:
    """(task, the task's options, size, seed) of `reasoning-gym:<task>[:k=v,...]`; one line naming `flag` for an
    unknown task, an unknown option or a bad value."""
    task, _, rest = name[len(TASK_PREFIX) :].partition(":")
    registry = _registry()
    if task not in registry:
        close = difflib.get_close_matches(task, registry, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise SystemExit(
            f"{flag}: no reasoning-gym task {task!r}; {hint}the {len(registry)} tasks: {', '.join(sorted(registry))}"
        )
    config_cls = registry[task][1]
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")}
    where, options, size, seed = f"{flag} {name!r}", {}, DEFAULT_SIZE, DEFAULT_SEED
    for item in [x for x in rest.split(",") if x] if rest else []:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise SystemExit(f"{where}: options are key=value separated by commas, got {item!r}")
        if key in ("size", "seed"):
            try:
                value = int(text)
            except ValueError:
                raise SystemExit(f"{where}: option {key!r} takes an integer, got {text!r}") from None
            if key == "size" and value < 1:
                raise SystemExit(f"{where}: size must be >= 1, got {value}")
            size, seed = (value, seed) if key == "size" else (size, value)
            continue
        if key not in fields:
            names = ", ".join(["size", "seed", *fields])
            raise SystemExit(f"{where}: {task} has no option {key!r}; its options: {names}")
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        options[key] = _convert(text.strip(), default, key, where)
    try:  # the task's own checks of its options (e.g. min <= max)
        config = config_cls(**options, seed=seed, size=size)
        getattr(config, "validate", lambda: None)()
    except (AssertionError, ValueError, TypeError) as e:
        raise SystemExit(f"{where}: reasoning-gym refuses these options: {e or type(e).__name__}") from None
    return task, options, size, seed


def held_out(question: str) -> bool:
    """True for the quarter of all questions kept for evaluation (by the question's SHA-256, never by position)."""
    digest = hashlib.sha256(question.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT_SHARE * 2**64


def _needs_network(e: BaseException) -> bool:
    return isinstance(e, _NETWORK_ERRORS) or type(e).__module__.split(".")[0] in _NETWORK_MODULES


def load_task_rows(name: str, split: str, flag: str) -> tuple[list[str], list[str]]:
    """The questions and golds of a reasoning-gym split (module docstring), generated here; one line for a bad name,
    a bad split, a generator that fails (one that needs the network says so) or a split it cannot fill."""
    task, options, size, seed = parse_task_name(name, flag)
    if split not in SPLITS:
        raise SystemExit(
            f"--dataset-split: reasoning-gym tasks have the splits {SPLITS} (test: held out), not {split!r}"
        )
    share = HELD_OUT_SHARE if split == "test" else 1 - HELD_OUT_SHARE
    horizon = math.ceil(2 * size / share) + 64  # twice the expected draws: then too few distinct questions
    fields = {**options, "seed": seed, "size": horizon}
    config = json.dumps(fields, sort_keys=True)
    questions, golds = [], []
    try:
        dataset = task_dataset(task, config)
        for index in range(horizon):
            entry = dataset[index]
            if held_out(entry["question"]) == (split == "test"):
                _ENTRIES[(task, config, index)] = entry
                questions.append(entry["question"])
                golds.append(task_gold(task, fields, index, entry["answer"]))
                if len(questions) == size:
                    return questions, golds
    except Exception as e:  # noqa: BLE001 - a generator's failure: one line
        first = (str(e).splitlines() or [""])[0][:200]
        if _needs_network(e):
            raise SystemExit(
                f"{flag}: reasoning-gym task {task!r} needs the network to generate its rows ({type(e).__name__}: "
                f"{first}); this project runs offline"
            ) from None
        raise SystemExit(
            f"{flag}: reasoning-gym task {task!r} failed to generate: {type(e).__name__}: {first}"
        ) from None
    raise SystemExit(
        f"{flag}: {name!r} gave {len(questions)} {split} rows of the {size} asked for in {horizon} draws: its question "
        "space is too small at these options for that many (lower size=)"
    )


def task_payload(gold: str) -> tuple:
    """What a reward worker scores a task gold with: (task, config, the entry, partial credit?); the entry is the one
    generated at load time (regenerated from its config and index if this process never loaded it)."""
    g = parse_task_gold(gold)
    key = (g["reasoning-gym"], json.dumps(g["config"], sort_keys=True), g["index"])
    if key not in _ENTRIES:
        _ENTRIES[key] = task_dataset(key[0], key[1])[key[2]]
    return (key[0], key[1], _ENTRIES[key], g.get("partial", False))


def with_partial_credit(golds: list[str]) -> list[str]:
    """--partial-credit: the golds with their task's own score as the reward (partial credit included)."""
    return [json.dumps({**parse_task_gold(g), "partial": True}) for g in golds]


def unsafe_answer(task: str, answer: str) -> bool:
    """True for an answer the task's scorer would run as code: one with a parenthesis for a PYTHON_EVAL_TASKS task
    (its literal needs none, and no call happens without one), or for a SYMPY_TASKS task a dunder, a string, or a
    call of anything but MATH_CALLS (a grouping parenthesis is no call)."""
    if task in PYTHON_EVAL_TASKS:
        return "(" in answer or "__" in answer
    if task in SYMPY_TASKS:
        if "__" in answer or any(q in answer for q in "'\"`\\[]{}:;"):
            return True
        for m in _CALL.finditer(answer):
            name = m.group(1)
            if (name and name not in MATH_CALLS) or (not name and answer[: m.start()].rstrip().endswith(")")):
                return True
    return False
