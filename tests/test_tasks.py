"""reasoning-gym's tasks as data and reward (common/tasks.py, docs/tasks.md): our reward path against the package's own
score_answer on the same answers, partial credit only with the flag, "correct" a score of 1 wherever it is counted,
deterministic splits that never share a question, answers a scorer would run as code, the one-line refusals, and one
script end to end."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import cispo
import dapo
import daro
import grpo
from common import tasks
from common.data import TrainData, check_data_args, load_rows
from common.data_strategies import inject_and_replay
from common.metrics import step_metrics
from common.reward import extract_final_answer, parse_task_gold, score, task_dataset
from common.sampling import Completion
from tests.checks import reward_wall_bound, run_scripts
from tests.test_scripts import ROOT, read_metrics, toy_flags

NO_ERRORS = {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0}
# each answer format and a completion that puts the answer where that format reads it
WRAP = {
    "answer-tag": lambda a: f"<think>I work it out.</think> <answer>{a}</answer>",
    "boxed": lambda a: f"So the answer is \\boxed{{{a}}}",
    "answer-line": lambda a: f"Working.\nAnswer: {a}",
    "any": lambda a: f"Hence \\boxed{{{a}}}",
}


def rows(name: str, split: str = "train") -> tuple[list[str], list[str]]:
    return load_rows(name, None, split, "question", "answer", "--dataset-name")


def package_entry(gold: str) -> tuple:
    """The task's dataset and entry built by the package itself from the gold's config and index (not our cache)."""
    import reasoning_gym

    g = parse_task_gold(gold)
    dataset = reasoning_gym.create_dataset(g["reasoning-gym"], **g["config"])
    return dataset, dataset[g["index"]]


def flip_one(entry: dict) -> str:
    """A knights-and-knaves answer with its first person's role swapped (one assignment of two wrong)."""
    terms, answer = entry["metadata"]["knight_knave_terms"], entry["answer"]
    knight, knave = str(terms["a_knight"]), str(terms["a_knave"])
    first, other = (knight, knave) if knave not in answer or knight in answer.split(knave)[0] else (knave, knight)
    return answer.replace(first, other, 1)


# per task: the options of a small instance, and answers beyond the gold: wrong, malformed and (where the task has
# it) partial credit, built from the entry
TASKS = {
    "countdown": (
        "min_numbers=3,max_numbers=3",
        lambda e: [
            "+".join(map(str, e["metadata"]["numbers"])),  # all the numbers, the wrong value (0.05 unless it hits)
            "1+1",  # other numbers: 0.05
            "94*4 -",  # malformed: 0.01
            "(3+4",  # malformed: 0.01
        ],
    ),
    "knights_knaves": (
        "",
        lambda e: [
            e["answer"].replace(str(e["metadata"]["names"][0]), "Nobody"),  # a wrong name
            "I do not know.",
            flip_one(e),  # one assignment of two wrong: partial credit
        ],
    ),
    "basic_arithmetic": ("max_digits=2", lambda e: [str(int(e["answer"]) + 1), "seven", "1/0"]),
    "chain_sum": ("max_digits=2", lambda e: [str(int(e["answer"]) - 3), "--", "12.5"]),
    "leg_counting": ("max_animals=3", lambda e: [str(int(e["answer"]) + 2), "many legs", "0"]),
    "propositional_logic": (
        "",
        lambda e: [
            e["metadata"]["example_answer"],  # a valid conclusion: 1.0 (the task has no single answer)
            e["metadata"]["variables"][0],  # a bare variable: a trivial conclusion (0.25) or a wrong one (0.05)
            f"({e['metadata']['variables'][0]} ∨ ¬{e['metadata']['variables'][0]})",  # a tautology: 0.25
            "Z",  # a variable not in the premises: 0.0
            "((P →",  # malformed: 0.0
        ],
    ),
}


@pytest.mark.parametrize("partial", [False, True], ids=["binary", "partial-credit"])
def test_scores_equal_the_packages_own_score_answer(partial):
    """Every answer of TASKS' tasks (the gold, wrong, malformed and partial-credit ones), in each answer format,
    scores through common.reward.score (its workers) as the package's own score_answer scores the answer that format
    reads: that score with --partial-credit, 1 for a score of 1 and 0 below it without."""
    completions, golds, expected, partial_cases = [], [], [], 0
    for task, (options, others) in TASKS.items():
        _, task_golds = rows(f"reasoning-gym:{task}:size=3,{options}")
        if partial:
            task_golds = tasks.with_partial_credit(task_golds)
        for gold in task_golds:
            dataset, entry = package_entry(gold)
            answers = ([entry["answer"]] if entry["answer"] is not None else []) + others(entry)
            for answer in answers:
                for fmt, wrap in WRAP.items():
                    read = extract_final_answer(wrap(answer), fmt)
                    assert read is not None, (task, fmt, answer)
                    reference = dataset.score_answer(read, entry)
                    partial_cases += 0 < reference < 1
                    completions.append((wrap(answer), fmt))
                    golds.append(gold)
                    expected.append(reference if partial else float(reference == 1.0))
    got = []
    for fmt in WRAP:  # one call per format, as a run scores
        idx = [i for i, (_, f) in enumerate(completions) if f == fmt]
        scores, counts = score([completions[i][0] for i in idx], [golds[i] for i in idx], answer_format=fmt)
        assert counts == NO_ERRORS
        got += list(zip(idx, scores))
    assert [s for _, s in sorted(got)] == expected
    assert partial_cases >= 20 and 0 < sum(expected) < len(expected)  # partial credit and both verdicts occur


def test_format_errors_overlong_answers_and_timeouts_are_counted_as_for_math():
    """No answer in the format: 0 and a format error, also with partial credit (where countdown's own scorer gives
    0.01 to a missing answer); an answer over twice the gold's length or with a lone surrogate: an error; a scorer
    stuck past the timeout (sympy computing 9**9**9**9 for countdown): 0 and a timeout, within the pool's bound."""
    _, golds = rows("reasoning-gym:countdown:size=1,min_numbers=3,max_numbers=3")
    gold = tasks.with_partial_credit(golds)[0]
    dataset, entry = package_entry(gold)
    assert dataset.score_answer(None, entry) == 0.01
    texts = ["I give up.", "\\boxed{" + "1+" * 1000 + "1}", "\\boxed{\ud800}"]
    assert score(texts, [gold] * 3, answer_format="boxed") == (
        [0.0] * 3,
        {"timeouts": 0, "errors": 2, "no_answer": 1, "format_errors": 1},
    )
    start = time.monotonic()
    scores, counts = score(["\\boxed{9**9**9**9}"], [gold], timeout_s=1.0, answer_format="boxed")
    assert time.monotonic() - start < reward_wall_bound(1, 1.0, num_kills=1)
    assert scores == [0.0] and counts == {**NO_ERRORS, "timeouts": 1}


@pytest.mark.parametrize(
    "task,options",
    [("n_queens", "n=4,min_remove=1,max_remove=2"), ("countdown", "min_numbers=3,max_numbers=3")],
)
def test_an_answer_the_scorer_would_run_as_code_is_refused(task, options, tmp_path):
    """n_queens' scorer passes the answer to Python's eval and countdown's to sympy's parse_expr: the package runs a
    program written as the answer (the file appears), our reward path refuses it as an error (nothing runs)."""
    _, golds = rows(f"reasoning-gym:{task}:size=1,{options}")
    dataset, entry = package_entry(golds[0])
    witness = tmp_path / "ran"
    hostile = [f"__import__('pathlib').Path({str(witness)!r}).touch()", f"open({str(witness)!r}, 'w')"]
    dataset.score_answer(hostile[0], entry)
    assert witness.exists()  # the package's scorer ran it
    witness.unlink()
    scores, counts = score([f"<answer>{h}</answer>" for h in hostile], golds * 2, answer_format="answer-tag")
    assert scores == [0.0, 0.0] and counts == {**NO_ERRORS, "errors": 2} and not witness.exists()


def test_the_code_guard_passes_every_correct_answer_of_the_tasks_it_guards():
    """The guard refuses no gold answer of the tasks whose scorers run code (it would make them unlearnable), and
    refuses calls other than math functions, strings and dunders."""
    for task in sorted(tasks.PYTHON_EVAL_TASKS | tasks.SYMPY_TASKS):
        dataset = task_dataset(task, json.dumps({"seed": 5, "size": 5}))
        for i in range(5):
            answer = dataset[i]["answer"]
            assert not tasks.unsafe_answer(task, answer), (task, answer)
    safe = ["3*(4+5) - 6/2", "x**2/2 + sin(x) + C", "-3*Integral(x*exp(x), x)", "sqrt (2)"]
    unsafe = ["x.subs(x, 1)", "(lambda: 1)()", "lambdify(x, 1)", "[1][0]", "'a'", "x.__class__", "(1)(2)"]
    assert [tasks.unsafe_answer("countdown", a) for a in safe + unsafe] == [False] * len(safe) + [True] * len(unsafe)
    assert tasks.unsafe_answer("n_queens", "print(1)") and not tasks.unsafe_answer("n_queens", "_ Q _ _\nQ _ _ _")


# the splits --------------------------------------------------------------------------------------------------------

SMALL = "reasoning-gym:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1"  # a few hundred questions


def test_splits_never_share_a_question_and_follow_the_seed():
    """On a task whose question space is small (so a seed-based split would overlap), the train and test splits of
    any seeds and sizes share no question, and a quarter of the distinct questions is held out; the same name gives
    the same rows, another seed others."""
    train, golds = rows(f"{SMALL},size=400")
    test, _ = rows(f"{SMALL},size=100,seed=7", "test")
    other_train, _ = rows(f"{SMALL},size=50,seed=3")
    assert not (set(train) | set(other_train)) & set(test)
    assert len(train) == 400 and len(test) == 100 and len(set(train)) < 400  # questions repeat here
    seen = set(train) | set(test) | set(other_train)
    assert 0.15 < sum(map(tasks.held_out, seen)) / len(seen) < 0.35
    task_dataset.cache_clear()
    tasks._ENTRIES.clear()
    assert rows(f"{SMALL},size=400") == (train, golds)  # regenerated from scratch
    assert rows(f"{SMALL},size=400,seed=1")[0] != train


def test_generation_is_the_same_in_another_process():
    """Another interpreter (another hash seed, so another set order) generates the same rows and golds, as every rank
    of a run and the standalone evaluator do."""
    names = ["reasoning-gym:knights_knaves:size=20", f"{SMALL},size=30", "reasoning-gym:propositional_logic:size=20"]
    here = [rows(n, split) for n in names for split in ("train", "test")]
    code = (
        "import json; from common.tasks import load_task_rows; "
        f"print(json.dumps([load_task_rows(n, s, 'f') for n in {names!r} for s in ('train', 'test')]))"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout) == [list(map(list, r)) for r in here]


# "correct" is a score of 1 -------------------------------------------------------------------------------------------


def test_partial_credit_reaches_the_reward_and_nothing_that_counts_correct_answers():
    """Scores (1, 0.65, 0.3, 0) in one group, (0.65, 0.65, 0, 0) in another: grpo.py's reward is the score, dynamic
    sampling (dapo, cispo) keeps only the first group (the second has no correct answer), DARO buckets by score-1
    counts, injection treats the second group as all-wrong, the tracker and the accuracy metrics count one pass in
    eight while the reward metrics see the scores."""
    scores = torch.tensor([1.0, 0.65, 0.3, 0.0, 0.65, 0.65, 0.0, 0.0])
    assert torch.equal(grpo.compute_rewards(scores, None, None, None), scores)
    assert dapo.filter_groups(scores, 4).tolist() == [True, False] == cispo.filter_groups(scores, 4).tolist()
    assert daro.pass_rate_bucket(scores, daro.Args(group_size=4)).tolist() == [1] * 4 + [0] * 4
    args = grpo.Args(group_size=4, gt_injection=True, prompt_template="none", max_new_tokens=64)
    data = TrainData(args, [[1], [2]], ["3", "5"], _CharTokenizer())
    completions = [Completion([7, 0], str(i), False) for i in range(8)]
    groups = inject_and_replay(args, data.buffer, data.demo, data.tracker.pass_rate(), [0, 1], data.prompts,
                               completions, scores.tolist(), 0)  # fmt: skip
    assert groups.injected == [False, True] and groups.correct[:4] == scores[:4].tolist()
    data.train_groups([0, 1], completions, scores.tolist(), 0, _OneProcess())
    assert data.tracker.correct.tolist() == [1.0, 0.0] and data.tracker.samples.tolist() == [4.0, 4.0]
    timer, info = SimpleNamespace(elapsed=lambda: 1.0, laps={}), {"timeouts": 0, "errors": 0, "format_errors": 0}
    metrics = step_metrics(_OneProcess(), completions, scores, scores, info, {}, timer, 4)
    assert metrics["train/accuracy"] == 1 / 8 and metrics["train/groups_all_wrong"] == 0.5
    assert metrics["train/reward_mean"] == pytest.approx(scores.mean().item())


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return type("Ids", (), {"input_ids": [ord(c) for c in text]})()


class _OneProcess:
    """What TrainData.train_groups and step_metrics need of an Accelerator, for one process."""

    device = torch.device("cpu")

    def gather(self, x):
        return x

    def reduce(self, x, op):
        return x

    def pad_across_processes(self, x, pad_index=0):
        return x


# bad input, and a script end to end ---------------------------------------------------------------------------------


class _NeedsNetworkConfig:
    pass


def _register_network_task() -> str:
    """A task whose generator fetches from the network (as a word list download would): registered in this process."""
    import dataclasses
    import urllib.request

    import reasoning_gym
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    @dataclasses.dataclass
    class Config:
        seed: int | None = None
        size: int = 500

    class NeedsNetwork(ProceduralDataset):
        def __init__(self, config):
            super().__init__(config, config.seed, config.size)

        def __getitem__(self, idx):
            urllib.request.urlopen("http://192.0.2.1/words.txt", timeout=2)  # TEST-NET-1: never reachable

    if "test_needs_network" not in DATASETS:
        reasoning_gym.register_dataset("test_needs_network", NeedsNetwork, Config)
    return "reasoning-gym:test_needs_network"


@pytest.mark.parametrize(
    "name,split,message",
    [
        ("reasoning-gym:leg_countin", "train", "--dataset-name: no reasoning-gym task 'leg_countin'; did you mean"),
        ("reasoning-gym:leg_counting:legs=3", "train", "leg_counting has no option 'legs'; its options: size, seed,"),
        ("reasoning-gym:leg_counting:max_animals=many", "train", "option 'max_animals' takes a int, got 'many'"),
        ("reasoning-gym:leg_counting:min_animals=9,max_animals=3", "train", "reasoning-gym refuses these options"),
        ("reasoning-gym:leg_counting:size", "train", "options are key=value separated by commas, got 'size'"),
        ("reasoning-gym:leg_counting:size=0", "train", "size must be >= 1"),
        ("reasoning-gym:time_intervals:min_time=1", "train", "option 'min_time' is a time, which a dataset name"),
        ("reasoning-gym:leg_counting", "validation", "--dataset-split: reasoning-gym tasks have the splits"),
        ("network", "train", "--dataset-name: reasoning-gym task 'test_needs_network' needs the network"),
    ],
)
def test_bad_names_are_one_line_naming_the_flag(name, split, message):
    name = _register_network_task() if name == "network" else name
    with pytest.raises(SystemExit) as e:
        rows(name, split)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_split_the_generator_cannot_fill_is_one_line(monkeypatch):
    monkeypatch.setattr(tasks, "held_out", lambda question: False)  # a task with no held-out question at all
    with pytest.raises(SystemExit, match=r"--dataset-name: .* gave 0 test rows of the 5 asked for in 104 draws"):
        rows(f"{SMALL},size=5", "test")


def test_flags_that_need_a_task_or_cannot_take_one_are_refused():
    bad_eval = grpo.Args(dataset_name="x.jsonl", eval_every=1, eval_datasets=["reasoning-gym:nope"])
    partial = grpo.Args(dataset_name="x.jsonl", partial_credit=True)
    solutions = grpo.Args(dataset_name="reasoning-gym:gcd", gt_injection=True, solution_column="solution")
    for args, message in [
        (bad_eval, "--eval-datasets: no reasoning-gym task 'nope'"),
        (partial, "--partial-credit: only a reasoning-gym --dataset-name"),
        (solutions, "--solution-column: reasoning-gym tasks have no worked solutions"),
    ]:
        with pytest.raises(SystemExit, match=message):
            check_data_args(args)
    check_data_args(grpo.Args(dataset_name="reasoning-gym:gcd", partial_credit=True, gt_injection=True))


@pytest.mark.slow
def test_a_script_trains_and_evaluates_on_a_task_and_refuses_bad_ones_before_writing(toy_assets, tmp_path):
    """dapo.py (dynamic sampling, the scores in its filter) on chain_sum for 2 steps with partial credit, evaluated on
    the held-out split; then a bad task and a bad option stop it with one line before anything is written. One
    process (tests/script_runner.py)."""
    task = {"dataset-name": f"{SMALL},size=64", "max-prompt-tokens": 160}
    evals = {"eval-every": 2, "eval-datasets": f"{SMALL},size=8", "eval-samples": 2, "eval-max-new-tokens": 3}
    extra = {"max-gen-batches": 2, "num-mini-batches": 1, "exp-name": "gym", **task, **evals}
    bad = [
        ("dapo", toy_flags(toy_assets, str(tmp_path / "bad_task"), 2, **{**extra, "dataset-name": "reasoning-gym:x"})),
        ("dapo", toy_flags(toy_assets, str(tmp_path / "bad_opt"), 2, **{**extra, "eval-datasets": f"{SMALL},n=1"})),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    flags = [*toy_flags(toy_assets, str(tmp_path / "run"), 2, **extra), "--partial-credit"]
    _, outcomes = run_scripts([("dapo", flags), *bad], str(tmp_path), env)
    assert outcomes[0] is None, outcomes[0]
    (run_dir,) = glob.glob(str(tmp_path / "run" / "gym__*"))
    rows_logged = read_metrics(run_dir)
    key = f"eval/{SMALL},size=8/avg@2"  # the name as the metric key (docs/metrics.md)
    assert [r["step"] for r in rows_logged] == [0, 1] and key in rows_logged[1]
    assert 0 <= rows_logged[1][key] <= 1 and "train/accuracy" in rows_logged[0]
    with open(os.path.join(run_dir, "args.json")) as f:
        assert json.load(f)["partial_credit"] is True
    for (_, bad_flags), outcome, message in zip(bad, outcomes[1:], ["no reasoning-gym task 'x'", "no option 'n'"]):
        assert message in outcome.strip().splitlines()[-1]
        assert not os.path.exists(bad_flags[bad_flags.index("--output-dir") + 1])
