"""docs/design.md's reliability guarantees, on grpo.py (the scaffolding every script shares) and common/reward.py:

- stop/resume: a hard kill (SIGKILL) after a periodic save, or a SIGTERM, then --resume, gives the same
  metrics as an uninterrupted run, one row per step; half-written checkpoints are ignored;
- bad input: a one-line error naming the flag, a non-zero exit and nothing written to the output dir;
- non-finite loss / grad norm: the update is skipped and logged, the run stops after --max-bad-steps;
- a rollout without signal (all groups' rewards equal) changes nothing and says so;
- the reward never raises, returns 0.0/1.0, is bounded in time and never executes its input (hypothesis fuzz).

Most runs are in-process (`grpo.main(grpo.Args(...))`); the kill/signal tests and one stderr test run the
script as a subprocess.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grpo
from common import reward, run
from common.data import encode_prompts
from tests.checks import reward_wall_bound
from tests.test_scripts import ROOT, read_metrics, run_script

# tiny, fast settings: 16 completions of 2 tokens per step, one micro-batch, no reference model
TINY = {
    "prompt_column": "question",
    "answer_column": "answer",
    "prompt_template": "none",
    "group_size": 4,
    "prompts_per_step": 4,
    "max_new_tokens": 2,
    "max_prompt_tokens": 32,
    "micro_batch_size": 64,
    "sampler": "hf",
    "save_every": 0,
    "log_samples_every": 0,
    "beta": 0.0,
    "learning_rate": 2e-3,
    "total_steps": 2,
}
KEYS = ("train/reward_mean", "train/response_length_mean", "train/grad_norm")


def make_args(assets, out, **kw) -> grpo.Args:
    return grpo.Args(
        **{"model_name_or_path": assets["model"], "dataset_name": assets["train"], "output_dir": str(out), **TINY, **kw}
    )


def cli_flags(assets, out, **kw) -> list[str]:
    flags = {
        "model_name_or_path": assets["model"],
        "dataset_name": assets["train"],
        "output_dir": str(out),
        **TINY,
        **kw,
    }
    return [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def run_dir_of(out) -> str:
    (run_dir,) = glob.glob(os.path.join(str(out), "*__*__*"))
    return run_dir


def weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_weights(a: str, b: str, same: bool = True) -> None:
    wa, wb = weights(a), weights(b)
    assert wa and set(wa) == set(wb)
    equal = all(torch.equal(wa[k], wb[k]) for k in wa)
    assert equal == same, "weights changed" if same else "weights did not change"


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def assert_metrics_match(rows, reference, steps) -> None:
    assert [r["step"] for r in rows] == list(range(steps)), "exactly one row per step"
    for a, b in zip(rows, reference):  # tolerance: see test_scripts.py::test_resume_continues_where_it_stopped
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """main() installs SIGINT/SIGTERM handlers; in-process runs must not leave them on pytest."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def expect_exit(args: grpo.Args, *needles: str) -> str:
    """main(args) stops with a one-line message holding every needle."""
    with pytest.raises(SystemExit) as e:
        grpo.main(args)
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg.strip(), msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# 1. Stop / resume ----------------------------------------------------------------------------------------

# Runs grpo.py with each step slowed by `delay` seconds (inside the step, before its metrics are logged), so a
# test can send a signal mid-run; nothing the run computes changes.
SLOW_DRIVER = (
    "import runpy, sys, time\n"
    "import common.metrics as m\n"
    "f, delay = m.completion_stats, float(sys.argv[1])\n"
    "m.completion_stats = lambda *a, **k: (time.sleep(delay), f(*a, **k))[1]\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
RESUME_STEPS = 6


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def uninterrupted(toy_assets, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("uninterrupted")
    run_script("grpo", cli_flags(toy_assets, out, total_steps=RESUME_STEPS, exp_name="r"))
    return read_metrics(run_dir_of(out))


def start_slow(flags: list[str], log_dir) -> subprocess.Popen:
    """grpo.py at about 1 s per step, its output in log_dir/{stdout,stderr}."""
    with open(os.path.join(log_dir, "stdout"), "w") as stdout, open(os.path.join(log_dir, "stderr"), "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", SLOW_DRIVER, "1.0", os.path.join(ROOT, "grpo.py"), *flags],
            cwd=ROOT,
            env=env(),
            stdout=stdout,
            stderr=stderr,
        )


def logs(log_dir) -> str:
    return "".join(pathlib.Path(log_dir, n).read_text()[-3000:] for n in ("stdout", "stderr"))


def wait_for_step(proc: subprocess.Popen, out, step: int, log_dir, timeout: float = 300) -> str:
    """Polls metrics.jsonl until the row of `step` is logged; returns the run directory."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, f"run ended before step {step} was logged:\n" + logs(log_dir)
        runs = glob.glob(os.path.join(str(out), "*__*__*", "metrics.jsonl"))
        if runs:
            with open(runs[0]) as f:
                if any(line.endswith("\n") and json.loads(line)["step"] >= step for line in f):
                    return os.path.dirname(runs[0])
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"step {step} not logged in {timeout}s:\n" + logs(log_dir))


@pytest.mark.slow
def test_hard_kill_after_a_periodic_save_then_resume_matches_uninterrupted(toy_assets, tmp_path, uninterrupted):
    out = tmp_path / "out"
    flags = cli_flags(toy_assets, out, total_steps=RESUME_STEPS, save_every=2, exp_name="r")
    proc = start_slow(flags, tmp_path)
    run_dir = wait_for_step(proc, out, 3, tmp_path)
    proc.send_signal(signal.SIGKILL)  # no handler, no cleanup: maybe mid-step, maybe mid-save of step_4
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert [os.path.basename(c) for c in run.complete_checkpoints(run_dir)] in (["step_2"], ["step_2", "step_4"])
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "train/reward_me')  # and a row cut short by the kill
    proc = run_script("grpo", flags + ["--resume", run_dir])
    assert "resumed from" in proc.stdout
    assert_metrics_match(read_metrics(run_dir), uninterrupted, RESUME_STEPS)
    assert [os.path.basename(c) for c in run.complete_checkpoints(run_dir)] == ["step_4", f"step_{RESUME_STEPS}"]
    assert not glob.glob(os.path.join(run_dir, "checkpoints", "*.tmp"))


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resume_matches_uninterrupted(toy_assets, tmp_path, uninterrupted):
    out = tmp_path / "out"
    flags = cli_flags(toy_assets, out, total_steps=RESUME_STEPS, exp_name="r")
    proc = start_slow(flags, tmp_path)
    run_dir = wait_for_step(proc, out, 1, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, logs(tmp_path)
    stdout = (tmp_path / "stdout").read_text()
    assert "stopped by signal after step" in stdout and f"--resume {run_dir}" in stdout
    done = len(read_metrics(run_dir))
    assert 2 <= done < RESUME_STEPS, "the signal should land mid-run"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(done))
    assert [os.path.basename(c) for c in run.complete_checkpoints(run_dir)] == [f"step_{done}"]
    proc = run_script("grpo", flags + ["--resume", run_dir])
    assert f"at step {done}" in proc.stdout
    assert_metrics_match(read_metrics(run_dir), uninterrupted, RESUME_STEPS)


def test_half_written_checkpoints_are_ignored_by_resume(toy_assets, tmp_path, capsys):
    full = tmp_path / "full"
    grpo.main(make_args(toy_assets, full, total_steps=3, exp_name="h"))
    reference = read_metrics(run_dir_of(full))
    out = tmp_path / "out"
    grpo.main(make_args(toy_assets, out, total_steps=2, save_every=1, exp_name="h"))
    run_dir = run_dir_of(out)
    ckpt = os.path.join(run_dir, "checkpoints")
    # a save killed before its rename (everything written, trainer.json included), and a step directory
    # without trainer.json: neither is a checkpoint
    shutil.copytree(os.path.join(ckpt, "step_2"), os.path.join(ckpt, "step_3.tmp"))
    with open(os.path.join(ckpt, "step_3.tmp", "trainer.json"), "w") as f:
        json.dump({"step": 3, "sampler": [{}]}, f)
    shutil.copytree(os.path.join(ckpt, "step_2"), os.path.join(ckpt, "step_5"))
    os.remove(os.path.join(ckpt, "step_5", "trainer.json"))
    assert [os.path.basename(c) for c in run.complete_checkpoints(run_dir)] == ["step_1", "step_2"]
    capsys.readouterr()
    grpo.main(make_args(toy_assets, out, total_steps=3, exp_name="h", resume=run_dir))
    assert f"resumed from {os.path.join(ckpt, 'step_2')} at step 2" in capsys.readouterr().out
    assert_metrics_match(read_metrics(run_dir), reference, 3)
    assert not os.path.exists(os.path.join(ckpt, "step_3.tmp"))
    assert [os.path.basename(c) for c in run.complete_checkpoints(run_dir)] == ["step_2", "step_3"]


def test_resume_without_a_complete_checkpoint_is_refused(toy_assets, tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints" / "step_4.tmp")
    (run_dir / "checkpoints" / "step_4.tmp" / "trainer.json").write_text('{"step": 4}')
    os.makedirs(run_dir / "checkpoints" / "step_2")  # no trainer.json
    before = sorted(str(p) for p in run_dir.rglob("*"))
    expect_exit(make_args(toy_assets, tmp_path / "out", resume=str(run_dir)), "--resume")
    assert sorted(str(p) for p in run_dir.rglob("*")) == before
    assert not (tmp_path / "out").exists()


# 2. Bad input: one line naming the flag, non-zero exit, nothing written ------------------------------------


@pytest.mark.parametrize("column,flag", [("prompt_column", "--prompt-column"), ("answer_column", "--answer-column")])
def test_missing_column_lists_the_available_ones(toy_assets, tmp_path, column, flag):
    out = tmp_path / "out"
    msg = expect_exit(
        make_args(toy_assets, out, **{column: "nope"}), flag, "'nope'", "available", "'question'", "'answer'"
    )
    assert not out.exists(), msg


def test_empty_dataset(toy_assets, tmp_path):
    out = tmp_path / "out"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    expect_exit(make_args(toy_assets, out, dataset_name=str(empty)), "--dataset-name", "empty")
    assert not out.exists()


def bad_answer_rows(n: int, bad: int) -> list[dict]:
    rows = [{"question": f"{i % 5}+1=", "answer": str(i % 5 + 1)} for i in range(n)]
    for i, junk in zip(range(bad), ["???", "@@", "#", "!!", "}{"] * n):
        rows[3 * i]["answer"] = junk
    return rows


def test_too_many_unparseable_answers_are_refused_with_count_and_examples(toy_assets, tmp_path):
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "bad.jsonl", bad_answer_rows(10, 3))
    expect_exit(make_args(toy_assets, out, dataset_name=data), "--max-bad-answer-frac", "3 of 10", "'???'", "'@@'")
    assert not out.exists()
    expect_exit(
        make_args(toy_assets, out, dataset_name=data, max_bad_answer_frac=0.2), "--max-bad-answer-frac", "3 of 10"
    )
    assert not out.exists()


def test_a_few_unparseable_answers_are_dropped_and_reported(toy_assets, capsys):
    from transformers import AutoTokenizer

    rows = bad_answer_rows(20, 2)
    tok = AutoTokenizer.from_pretrained(toy_assets["model"])
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    prompts, golds = encode_prompts(questions, answers, tok, make_args(toy_assets, "unused"), "--dataset-name")
    assert len(prompts) == len(golds) == 18 and "???" not in golds and "@@" not in golds
    assert "dropped 2 rows whose answer cannot be parsed" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["/nonexistent/model", "empty-dir"])
def test_unknown_model_path(toy_assets, tmp_path, model):
    if model == "empty-dir":
        model = str(tmp_path / "not_a_model")
        os.makedirs(model)
    out = tmp_path / "out"
    expect_exit(make_args(toy_assets, out, model_name_or_path=model), "--model-name-or-path", repr(model))
    assert not out.exists()


def test_group_size_below_two(toy_assets, tmp_path):
    out = tmp_path / "out"
    expect_exit(make_args(toy_assets, out, group_size=1), "--group-size")
    assert not out.exists()


def test_long_prompts_are_filtered_and_counted(toy_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_assets["model"])
    questions = ["1+2=", "1+2=" * 40, "3+1=", "4+4=" * 40, "0+0="]
    answers, args = ["3", "3", "4", "8", "0"], make_args(toy_assets, "unused")
    prompts, golds = encode_prompts(questions, answers, tok, args, "--dataset-name")
    assert golds == ["3", "4", "0"] and all(len(p) <= 32 for p in prompts)
    assert "dropped 2 prompts longer than --max-prompt-tokens 32" in capsys.readouterr().out


def test_all_prompts_too_long_names_max_prompt_tokens(toy_assets, tmp_path):
    out = tmp_path / "out"
    expect_exit(make_args(toy_assets, out, max_prompt_tokens=1), "--max-prompt-tokens", "512")
    assert not out.exists()


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"num_mini_batches": 3}, "--num-mini-batches"),  # 4 prompts x 4 completions is not divisible by 3
        ({"temperature": 0.0}, "--temperature"),
        ({"total_steps": 0}, "--total-steps"),  # evaluation only, but evaluation is off
        ({"vllm_enable_sleep_mode": True}, "--vllm-enable-sleep-mode"),  # with --sampler hf
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"micro_batch_tokens": -1}, "--micro-batch-tokens"),
    ],
)
def test_incompatible_flags(toy_assets, tmp_path, kw, flag):
    out = tmp_path / "out"
    expect_exit(make_args(toy_assets, out, **kw), flag)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_triton_kernel_without_gpu(toy_assets, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton tests set it for this process
    out = tmp_path / "out"
    expect_exit(make_args(toy_assets, out, logprob_kernel="triton"), "--logprob-kernel", "CUDA")
    assert not out.exists()


def test_existing_run_directory_without_resume(toy_assets, tmp_path, monkeypatch):
    out = tmp_path / "out"
    taken = out / "x__1__1234567"
    os.makedirs(taken)
    monkeypatch.setattr(run, "time", types.SimpleNamespace(time=lambda: 1234567.25))  # the run's timestamp
    expect_exit(make_args(toy_assets, out, exp_name="x"), "--output-dir", "already exists", "--resume")
    assert os.listdir(out) == ["x__1__1234567"] and os.listdir(taken) == []


@pytest.mark.parametrize(
    "script,kw,flag",
    [
        ("dapo", {"max_gen_batches": 0}, "--max-gen-batches"),
        ("cispo", {"eps_max": 0.0}, "--eps-max"),
        ("daro", {"daro_w_min": 2.0, "daro_w_max": 1.0}, "--daro-w-min"),
        ("daro", {"daro_loss_floor": 0.0}, "--daro-loss-floor"),
    ],
)
def test_an_algorithms_own_flags_out_of_range_stop_with_one_line(script, kw, flag, toy_assets, tmp_path):
    """The flags a script adds to grpo.py's are checked before anything is written, in one line naming them."""
    mod, out = importlib.import_module(script), tmp_path / "out"
    tiny = {k: v for k, v in TINY.items() if k != "beta"}
    args = mod.Args(model_name_or_path=toy_assets["model"], dataset_name=toy_assets["train"], output_dir=str(out))
    with pytest.raises(SystemExit) as e:
        mod.main(dataclasses.replace(args, **tiny, **kw))
    assert isinstance(e.value.code, str) and flag in e.value.code and "\n" not in e.value.code, e.value.code
    assert not out.exists()


def test_output_dir_under_a_regular_file(toy_assets, tmp_path):
    """Cannot be created even by root (a permission-bit check alone would pass as root)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("keep")
    expect_exit(make_args(toy_assets, blocker / "sub" / "runs"), "--output-dir", "not writable")
    assert blocker.read_text() == "keep" and os.listdir(tmp_path) == ["a_file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_output_dir_without_write_permission(toy_assets, tmp_path):
    parent = tmp_path / "ro"
    os.makedirs(parent)
    os.chmod(parent, 0o500)
    try:
        expect_exit(make_args(toy_assets, parent / "runs"), "--output-dir", "not writable")
        assert os.listdir(parent) == []
    finally:
        os.chmod(parent, 0o700)


@pytest.mark.parametrize("case", ["output-dir-under-file", "all-prompts-too-long", "empty-dataset"])
def test_bad_input_from_the_command_line_is_one_stderr_line(toy_assets, tmp_path, case):
    out = tmp_path / "out"
    (tmp_path / "a_file").write_text("")
    kw, flag = {
        "output-dir-under-file": ({"output_dir": str(tmp_path / "a_file" / "runs")}, "--output-dir"),
        "all-prompts-too-long": ({"max_prompt_tokens": 1}, "--max-prompt-tokens"),
        "empty-dataset": ({"dataset_name": str(tmp_path / "a_file.jsonl")}, "--dataset-name"),
    }[case]
    (tmp_path / "a_file.jsonl").write_text("")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "grpo.py"), *cli_flags(toy_assets, out, **kw)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert flag in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["a_file", "a_file.jsonl"]


# 3. Non-finite updates are skipped, logged, and stop the run after --max-bad-steps ---------------------------


def signal_rewards(correct, lengths, truncated, args):
    """Rewards 0, 1, 0, 1, ... in every group: every group has an advantage, so every step updates."""
    return (torch.arange(correct.numel(), device=correct.device) % 2).float()


def poisoned_loss(bad_calls: int | None, value: float):
    """compute_policy_loss whose loss is multiplied by `value` (nan/inf) on its first `bad_calls` calls (all: None)."""
    real, calls = grpo.compute_policy_loss, [0]

    def loss_fn(*a, **k):
        loss, stats = real(*a, **k)
        calls[0] += 1
        if bad_calls is None or calls[0] <= bad_calls:
            loss = loss * value
        return loss, stats

    return loss_fn


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_updates_are_skipped_and_the_run_stops_after_max_bad_steps(toy_assets, tmp_path, monkeypatch, value):
    monkeypatch.setattr(grpo, "compute_rewards", signal_rewards)
    monkeypatch.setattr(grpo, "compute_policy_loss", poisoned_loss(None, value))
    out = tmp_path / "out"
    expect_exit(
        make_args(toy_assets, out, total_steps=6, save_every=2, max_bad_steps=3), "3 consecutive", "--max-bad-steps"
    )
    run_dir = run_dir_of(out)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]  # the third bad step stops the run
    assert all(
        r["train/skipped_updates"] == 1 and r["train/no_signal"] == 0 and not math.isfinite(r["train/grad_norm"])
        for r in rows
    )
    assert_same_weights(os.path.join(run_dir, "checkpoints", "step_2", "model"), toy_assets["model"])


def test_a_few_non_finite_updates_are_skipped_then_training_goes_on(toy_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "compute_rewards", signal_rewards)
    monkeypatch.setattr(grpo, "compute_policy_loss", poisoned_loss(2, float("nan")))  # one call per step here
    out = tmp_path / "out"
    grpo.main(make_args(toy_assets, out, total_steps=4, save_every=2, max_bad_steps=3))
    run_dir = run_dir_of(out)
    rows = read_metrics(run_dir)
    assert [r["train/skipped_updates"] for r in rows] == [1, 1, 0, 0]
    assert all(math.isfinite(r["train/grad_norm"]) for r in rows[2:])
    assert_same_weights(os.path.join(run_dir, "checkpoints", "step_2", "model"), toy_assets["model"])
    assert_same_weights(os.path.join(run_dir, "checkpoints", "step_4", "model"), toy_assets["model"], same=False)


# 4. No signal: nothing trains, and the metrics say so ------------------------------------------------------


def test_a_rollout_with_equal_rewards_in_every_group_trains_nothing(toy_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(
        grpo, "compute_rewards", lambda correct, lengths, truncated, args: torch.zeros_like(correct, dtype=torch.float)
    )
    out = tmp_path / "out"
    grpo.main(make_args(toy_assets, out, total_steps=2))
    run_dir = run_dir_of(out)
    rows = read_metrics(run_dir)
    assert [(r["train/no_signal"], r["train/grad_norm"], r["train/skipped_updates"]) for r in rows] == [
        (1.0, 0.0, 0.0)
    ] * 2
    assert_same_weights(os.path.join(run_dir, "checkpoints", "step_2", "model"), toy_assets["model"])


# 5. The reward on hostile input: never raises, 0.0/1.0, bounded in time, never executes anything -----------

CANARY = os.path.join(tempfile.gettempdir(), f"reward_canary_{uuid.uuid4().hex}")
PAYLOADS = [
    f"__import__('os').system('touch {CANARY}')",
    f"\\boxed{{__import__('os').system('touch {CANARY}')}}",
    f"Answer: __import__('os').system('touch {CANARY}')",
    f"<answer>exec(\"open('{CANARY}', 'w')\")</answer>",
    f"\\boxed{{eval(\"__import__('os').system('touch {CANARY}')\")}}",
    f"\\boxed{{(lambda: __import__('os').system('touch {CANARY}'))()}}",
    f"\\boxed{{\\text{{__import__('os').system('touch {CANARY}')}}}}",
]
FRAGMENTS = [
    "\\frac{",
    "\\dfrac",
    "\\sqrt{",
    "\\sqrt[3]{",
    "^",
    "_",
    "{",
    "}",
    "\\{",
    "\\}",
    "\\boxed{",
    "\\fbox{",
    "\\left(",
    "\\right)",
    "\\left[",
    "\\right.",
    "x",
    "y",
    "=",
    "<",
    "\\le",
    "Answer:",
    "Final answer:",
    "**Answer:**",
    "$",
    "$$",
    "\\(",
    "\\)",
    "\\[",
    "\\]",
    "<answer>",
    "</answer>",
    "<think>",
    "\n",
    " ",
    "+",
    "-",
    "*",
    "/",
    ".",
    ",",
    ":",
    "\\pi",
    "\\infty",
    "\\cdot",
    "\\times",
    "\\text{",
    "\\mathrm{",
    "\\begin{pmatrix}",
    "\\end{pmatrix}",
    "&",
    "\\\\",
    "%",
    "!",
    "9^9^9^9",
    "10^{10^{10^{10}}}",
    "99999999999999999999!",
    "1e308",
    "\\ud800",
    "\ud800",
    "π",
    "√2",
    "½",
    "𝑥",
    "∞",
    "é",
    "中",
    "\x00",
    "\\",
    "'",
    '"',
    *PAYLOADS,
]
TIMEOUT_S = 2.0
atom = st.one_of(st.sampled_from(FRAGMENTS), st.integers(-(10**30), 10**30).map(str), st.text(max_size=4))
latexish = st.one_of(
    st.lists(atom, max_size=25).map("".join),
    st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 3000)).map(lambda t: t[0] * t[1]),  # long repeats
    st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 300), st.sampled_from(FRAGMENTS)).map(
        lambda t: t[0] * t[1] + "x" + t[2] * t[1]
    ),
)
golds = st.one_of(st.sampled_from(["7", "x^2+1", "\\frac{1}{2}", "\\sqrt{2}", "B", "(1,2)", "\\infty"]), latexish)


@pytest.fixture(scope="module")
def warm_reward_pool():
    reward.score(["\\boxed{1}"], ["2"])  # the workers' first start (math-verify import) is not the bound under test
    yield
    assert not os.path.exists(CANARY)


def check_scores(completions, answers):
    t0 = time.monotonic()
    scores, counts = reward.score(completions, answers, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert len(scores) == len(completions)
    assert all(type(s) is float and s in (0.0, 1.0) for s in scores), scores
    assert set(counts) == {"timeouts", "errors", "no_answer", "format_errors"} and all(
        isinstance(v, int) and v >= 0 for v in counts.values()
    )
    assert elapsed < reward_wall_bound(len(completions), TIMEOUT_S, num_kills=len(completions)), elapsed
    assert not os.path.exists(CANARY)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(pairs=st.lists(st.tuples(latexish, golds), min_size=1, max_size=3))
def test_reward_fuzz_never_raises_is_binary_bounded_and_executes_nothing(warm_reward_pool, pairs):
    completions, answers = [p[0] for p in pairs], [p[1] for p in pairs]
    check_scores(completions, answers)
    check_scores(completions, completions)  # a completion as its own gold: gold parsing is hostile input too
    t0 = time.monotonic()
    bad = reward.find_unparseable_gold(answers, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert set(bad) <= set(range(len(answers)))
    assert elapsed < reward_wall_bound(len(answers), TIMEOUT_S, num_kills=len(answers)), elapsed
    assert not os.path.exists(CANARY)


def test_reward_never_executes_code_in_completions_or_golds(warm_reward_pool):
    check_scores(PAYLOADS, ["1"] * len(PAYLOADS))
    check_scores(PAYLOADS, PAYLOADS)
    check_scores(["\\boxed{1}"] * len(PAYLOADS), PAYLOADS)
    assert set(reward.math_reward(PAYLOADS, PAYLOADS[::-1])) <= {0.0, 1.0}
    reward.find_unparseable_gold(PAYLOADS)
    assert not os.path.exists(CANARY)


def test_close_run_frees_process_groups_held_in_reference_cycles(tmp_path):
    """close_run destroys the process group and frees it while Python still runs, even when only a reference cycle
    holds it (DeepSpeed's engine does): collected at interpreter exit instead, a gloo worker thread that frees a
    tensor cannot take the GIL and aborts a finished multi-process run."""
    import gc
    import weakref

    import torch.distributed as dist

    from tests.checks import free_port

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")

    class Holder:
        pass

    holder = Holder()
    holder.group, holder.me = (dist.group.WORLD, holder)  # a cycle: only the garbage collector frees it
    alive = weakref.ref(holder)
    del holder
    accelerator = types.SimpleNamespace(end_training=dist.destroy_process_group)
    gc.disable()  # no automatic collection in between: only close_run's may free the cycle
    try:
        run.close_run(accelerator, None)
    finally:
        gc.enable()
    assert not dist.is_initialized() and alive() is None
