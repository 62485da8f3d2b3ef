"""Data strategies (common/data.py, README "Data strategies"): the per-prompt tracker against a brute-force count
(also on 2 processes), the prompt draws against their definitions, ground-truth injection and replay, resume with
a full replay buffer, a learning test for injection, and tools/profile_data.py on the toy data."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import grpo
from common.data import (
    DataStrategies,
    PromptTracker,
    ReplayBuffer,
    draw_prompts,
    finish_batch,
    init_data,
    inject_and_replay,
    sampling_weights,
)
from common.sampling import Completion
from tests.checks import launch_cmd
from tests.test_scripts import ROOT, read_metrics, run_script, toy_flags

ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def trainer_state(run_dir: str, step: int) -> dict:
    with open(os.path.join(run_dir, "checkpoints", f"step_{step}", "trainer.json")) as f:
        return json.load(f)


# 1. Tracker -----------------------------------------------------------------------------------------------


def test_tracker_matches_a_brute_force_count():
    rng = np.random.default_rng(0)
    num, g, tracker, seen = 7, 3, PromptTracker(7), {}
    for _ in range(5):  # rollouts with repeated prompts, as i.i.d. draws give
        rows = rng.integers(0, num, size=4).tolist()
        correct = rng.integers(0, 2, size=4 * g).astype(float).tolist()
        lengths = rng.integers(1, 50, size=4 * g).tolist()
        tracker.update(rows, correct, lengths, g)
        for k, r in enumerate(rows):
            for j in range(g):
                seen.setdefault(r, []).append((correct[k * g + j], lengths[k * g + j]))
    for r in range(num):
        obs = seen.get(r, [])
        n, c = len(obs), sum(x for x, _ in obs)
        mean = sum(n_ for _, n_ in obs) / n if n else 0.0
        var = sum((n_ - mean) ** 2 for _, n_ in obs) / n if n else 0.0
        assert (tracker.samples[r], tracker.correct[r]) == (n, c)
        assert tracker.pass_rate()[r] == pytest.approx((c + 1) / (n + 2), abs=1e-12)  # Beta(1, 1) posterior mean
        assert tracker.length_mean()[r] == pytest.approx(mean, abs=1e-9)
        assert tracker.length_var()[r] == pytest.approx(var, abs=1e-6)  # float64 sums of squares < 1e5: exact to ~1e-11
    restored = PromptTracker(num)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))  # through JSON, as trainer.json keeps it
    assert np.array_equal(restored.pass_rate(), tracker.pass_rate()) and np.array_equal(
        restored.length_var(), tracker.length_var()
    )


@pytest.mark.slow
def test_tracker_is_gathered_over_two_processes(toy_assets, tmp_path):
    """grpo.py on 2 processes (torchrun, gloo) with --prompt-sampling medium: after each step the checkpointed tracker
    holds both ranks' completions, counted by re-drawing each step's prompts from the definition. The verifier also
    reports rank + 1 timeouts per step (tests/grpo_rank_faults.py): train/reward_timeouts is their sum over ranks."""
    g, p = 4, 4
    flags = toy_flags(
        toy_assets,
        str(tmp_path),
        2,
        **{
            "prompt-sampling": "medium",
            "save-every": 1,
            "group-size": g,
            "prompts-per-step": p,
            "exp-name": "d2",
            "log-samples-every": 0,
        },
    )
    cmd = [*launch_cmd(os.path.join(ROOT, "tests", "grpo_rank_faults.py")), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = glob.glob(os.path.join(tmp_path, "d2__*"))
    metrics = read_metrics(run_dir)
    assert [m["train/reward_timeouts"] for m in metrics] == [3.0, 3.0]  # rank 0's 1 + rank 1's 2
    tracker, prev_c, prev_l = PromptTracker(512), 0.0, 0.0
    for step in (0, 1):
        rows = draw_prompts(tracker, "medium", 1, step, p, step / 2)  # both ranks' prompts: rank r takes [2r, 2r + 2)
        expected = tracker.samples + np.bincount(rows, minlength=512) * g
        tracker.load_state_dict(trainer_state(run_dir, step + 1)["data"]["tracker"])
        assert np.array_equal(tracker.samples, expected), step
        assert tracker.correct.sum() - prev_c == pytest.approx(metrics[step]["train/accuracy"] * g * p)
        assert tracker.len_sum.sum() - prev_l == pytest.approx(metrics[step]["train/response_length_mean"] * g * p)
        prev_c, prev_l = tracker.correct.sum(), tracker.len_sum.sum()


# 2. Prompt sampling ---------------------------------------------------------------------------------------


def tracker_with(pass_counts: list[tuple[int, int]]) -> PromptTracker:
    t = PromptTracker(len(pass_counts))
    for i, (c, n) in enumerate(pass_counts):
        t.samples[i], t.correct[i] = n, c
    return t


def test_uniform_is_todays_shuffled_order():
    args = grpo.Args(prompts_per_step=8, seed=3)
    tracker = tracker_with([(i % 5, 8) for i in range(40)])
    for step in range(12):  # past an epoch boundary (40 rows / 8 per step)
        for rank, world in ((0, 1), (1, 2)):
            start = (step * world + rank) * (8 // world)
            reference = [
                int(np.random.default_rng([3, k // 40]).permutation(40)[k % 40])
                for k in range(start, start + 8 // world)
            ]
            assert grpo.step_indices(step, 40, args, rank, world, tracker=tracker) == reference


@pytest.mark.parametrize(
    "mode,progress", [("medium", 0.0), ("curriculum", 0.0), ("curriculum", 0.5), ("curriculum", 1.0)]
)
def test_draw_frequencies_match_the_definitions(mode, progress):
    """i.i.d. draws with P(i) = w_i / sum w: medium w = exp(-(p - 0.5)^2 / (2 0.1^2)); curriculum w = exp(-(p - tau)^2 /
    (2 0.2^2)), tau = 1 - progress. 200k draws: each frequency within 5 binomial standard deviations."""
    counts = [
        (0, 8),
        (1, 8),
        (3, 8),
        (4, 8),
        (6, 8),
        (8, 8),
        (0, 0),
    ]  # estimates 0.1, 0.2, 0.4, 0.5, 0.7, 0.9 and unseen 0.5
    tracker = tracker_with(counts)
    est = [(c + 1) / (n + 2) for c, n in counts]
    mean, std = (0.5, 0.1) if mode == "medium" else (1.0 - progress, 0.2)
    w = [math.exp(-((p - mean) ** 2) / (2 * std**2)) for p in est]
    expected = [x / sum(w) for x in w]
    n = 200_000
    freq = Counter(draw_prompts(tracker, mode, 7, 3, n, progress))
    for i, q in enumerate(expected):
        assert abs(freq[i] / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-12, (i, freq[i] / n, q)
    assert np.allclose(sampling_weights(tracker.pass_rate(), mode, progress), w, rtol=1e-12)


def test_every_rank_draws_the_same_list_and_takes_its_slice():
    args = grpo.Args(prompts_per_step=8, prompt_sampling="medium", total_steps=10)
    tracker = tracker_with([(i % 9, 8) for i in range(30)])
    whole = grpo.step_indices(4, 30, args, 0, 1, tracker=tracker)
    assert (
        grpo.step_indices(4, 30, args, 0, 2, tracker=tracker) + grpo.step_indices(4, 30, args, 1, 2, tracker=tracker)
        == whole
    )
    assert whole == draw_prompts(tracker, "medium", args.seed, 4, 8, 0.4)
    assert whole != grpo.step_indices(5, 30, args, 0, 1, tracker=tracker)  # a fresh draw each step


# 3. Injection and replay ----------------------------------------------------------------------------------


class WordTokenizer:
    """Characters as token ids, EOS 0: enough for building demonstrations."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) for ch in text])


def strategies(n: int, size: int = 4, solutions=None) -> DataStrategies:
    return DataStrategies(PromptTracker(n), ReplayBuffer(size), solutions or {})


def comp(text: str) -> Completion:
    return Completion(token_ids=[ord(ch) for ch in text] + [0], text=text, truncated=False)


def test_injection_replaces_the_last_completion_of_an_all_wrong_group_by_a_verified_demonstration():
    args = SimpleNamespace(
        group_size=3, gt_injection=True, replay=False, prompt_template="qwen-boxed", max_new_tokens=64
    )
    data = strategies(3, solutions={2: "Adding, 1+2 = 3, so \\boxed{3}."})
    completions = [comp(t) for t in ("5", "6", "7", "4", "x", "y", "1", "2", "9")]
    correct = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    train = inject_and_replay(
        data, [0, 1, 2], [[1], [2], [3]], completions, correct, ["8", "4", "3"], WordTokenizer(), args
    )
    assert train.injected == [True, False, True] and train.changed
    assert (
        train.completions[2].text == "The answer is \\boxed{8}." and train.completions[2].token_ids[-1] == 0
    )  # EOS ends it
    assert train.completions[8].text == "Adding, 1+2 = 3, so \\boxed{3}."  # the worked solution goes first
    assert (
        train.correct == [0, 0, 1, 1, 0, 0, 0, 0, 1] and correct[2] == 0.0 and completions[2].text == "7"
    )  # inputs untouched
    short = SimpleNamespace(**{**vars(args), "max_new_tokens": 8})  # no demonstration fits: the group stays as it is
    assert not inject_and_replay(
        strategies(3), [0], [[1]], completions[:3], correct[:3], ["8"], WordTokenizer(), short
    ).changed
    wrong = inject_and_replay(
        strategies(3, solutions={0: "so \\boxed{9}."}),
        [0],
        [[1]],
        completions[:3],
        correct[:3],
        ["8"],
        WordTokenizer(),
        args,
    )
    assert wrong.completions[2].text == "The answer is \\boxed{8}."  # a solution the verifier rejects is not used


def test_solutions_are_matched_to_the_kept_training_rows_by_their_prompt_tokens():
    args = SimpleNamespace(difficulty_file=None, prompt_template="none", replay_buffer_size=4)
    questions, solutions = ["1+1=", "too long question", "2+2="], ["s0", "s1", "s2"]
    train_prompts = [[ord(c) for c in "2+2="], [ord(c) for c in "1+1="]]  # what encode_prompts kept, in its order
    data = init_data(args, questions, solutions, train_prompts, WordTokenizer(), lambda q, template, tok: q)
    assert data.solutions == {0: "s2", 1: "s0"} and data.tracker.samples.shape == (2,)


def test_replay_swaps_a_no_signal_group_for_the_newest_buffered_one_and_its_log_probs_give_the_ratio():
    g = 2
    args = SimpleNamespace(
        group_size=g,
        gt_injection=False,
        replay=True,
        prompt_template="none",
        max_new_tokens=8,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        beta=0.0,
        rollout_correction="none",
    )
    data = strategies(4, size=2)
    data.tracker.samples[:], data.tracker.correct[:] = [8, 8, 8, 8], [0, 8, 4, 0]  # estimates 0.1, 0.9, 0.5, 0.1
    old = {
        "prompt": [9, 9],
        "token_ids": [[5, 6], [7]],
        "texts": ["a", "b"],
        "truncated": [False, True],
        "correct": [1.0, 0.0],
        "logps": [[-0.5, -1.5], [-2.0]],
    }
    data.buffer.push({**old, "prompt": [8]})
    data.buffer.push(old)  # the newest: replayed first
    completions = [comp(t) for t in ("x", "y", "z", "w", "u", "v", "s", "t")]
    correct = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # groups: signal, none (all wrong), none (all correct), signal
    train = inject_and_replay(
        data, [0, 1, 2, 3], [[1], [2], [3], [4]], completions, correct, ["1"] * 4, WordTokenizer(), args
    )
    assert train.replayed == 2 and train.fresh == [True, False, False, True]
    assert train.prompts == [[1], [9, 9], [8], [4]] and train.correct[2:4] == [1.0, 0.0]
    assert [c.token_ids for c in train.completions[2:4]] == [[5, 6], [7]] and train.completions[3].truncated
    assert set(train.stored_logps) == {2, 3, 4, 5} and len(data.buffer.groups) == 0

    ids, attn, mask, p_len = grpo.pad_batch(
        [p for p in train.prompts for _ in range(g)], [c.token_ids for c in train.completions], 0
    )
    current = -torch.rand(mask.shape, dtype=torch.float64)  # the policy's log-probs now
    batch = {"old_logps": current.clone(), "mask": mask}
    finish_batch(data, train, batch, args)
    for r in (2, 4):  # both replayed groups carried these log-probs
        assert batch["old_logps"][r, :2].tolist() == [-0.5, -1.5] and batch["old_logps"][r + 1, 0].item() == -2.0
    assert torch.equal(batch["old_logps"][[0, 1, 6, 7]], current[[0, 1, 6, 7]])  # fresh rows keep the policy's own
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, _ = grpo.compute_policy_loss(current, batch["old_logps"], adv, mask.double(), args)
    ref = 0.0
    for i in range(8):  # brute force: ratio of each token against the policy that generated it
        n = int(mask[i].sum())
        olds = {2: [-0.5, -1.5], 3: [-2.0], 4: [-0.5, -1.5], 5: [-2.0]}.get(i, current[i, :n].tolist())
        terms = []
        for t in range(n):
            r = math.exp(current[i, t].item() - olds[t])
            terms.append(min(r * adv[i].item(), min(max(r, 0.8), 1.2) * adv[i].item()))
        ref += -sum(terms) / n / 8
    assert loss.item() == pytest.approx(ref, abs=1e-12)

    # this step's high-value groups enter the buffer with their log-probs: groups 0 and 3 (estimate 0.1, solved); the
    # replayed ones never go back
    assert [grp["prompt"] for grp in data.buffer.groups] == [[1], [4]]
    assert data.buffer.groups[0]["logps"][0] == current[0, :2].tolist()


def test_buffer_keeps_the_newest_size_groups():
    b = ReplayBuffer(2)
    for k in range(4):
        b.push({"k": k})
    assert [x["k"] for x in b.groups] == [2, 3] and b.pop()["k"] == 3 and b.pop()["k"] == 2 and b.pop() is None


# 4. Through the scripts -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_a_full_replay_buffer_equals_an_uninterrupted_run(toy_assets, tmp_path):
    """16 prompts, 8 per step: prompts come back every 2 steps, so hard ones get solved (into the buffer) and groups
    without signal get replayed (curriculum draws, 8 steps). The run is cut back to its step-6 checkpoint (as a kill
    after that save leaves it) and resumed: steps 6-7 and the final tracker and buffers are the uninterrupted run's."""
    rows = [json.loads(line) for line in open(toy_assets["train"])][:16]
    train = tmp_path / "train16.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = toy_flags(
        {**toy_assets, "train": str(train)},
        str(tmp_path / "full"),
        8,
        **{"replay-buffer-size": 2, "prompt-sampling": "curriculum", "log-samples-every": 0, "save-every": 6},
    ) + ["--replay"]
    run_script("grpo", flags)
    (full_dir,) = glob.glob(os.path.join(tmp_path, "full", "*__*"))
    cut_dir = str(tmp_path / "cut")
    shutil.copytree(full_dir, cut_dir)
    shutil.rmtree(os.path.join(cut_dir, "checkpoints", "step_8"))
    assert len(trainer_state(cut_dir, 6)["data"]["buffers"][0]["groups"]) == 2  # the buffer is full at the checkpoint
    run_script("grpo", flags + ["--resume", cut_dir])
    a, b = read_metrics(full_dir), read_metrics(cut_dir)
    assert [r["step"] for r in b] == list(range(8)) and sum(r["data/replayed"] for r in a[6:]) > 0
    for x, y in zip(a[6:], b[6:]):
        for k in (
            "data/prompt_pass_rate_mean",
            "data/replayed",
            "data/replay_buffer_size",
            "train/reward_mean",
            "train/grad_norm",
        ):
            assert x[k] == pytest.approx(y[k], abs=1e-6), (x["step"], k)
    assert trainer_state(full_dir, 8)["data"] == trainer_state(cut_dir, 8)["data"]


def strict_run(assets, out, steps, *switches: str) -> list[dict]:
    flags = toy_flags(
        assets,
        str(out),
        steps,
        **{
            "reward-format": "boxed",  # the strict verifier: no \\boxed{...}, no reward (issue 12's test task)
            "max-new-tokens": 12,
            "learning-rate": 5e-3,
            "beta": 0,
            "log-samples-every": 0,
            "eval-every": steps,
            "eval-datasets": assets["test"],
            "eval-prompt-column": "question",
            "eval-answer-column": "answer",
            "eval-limit": 32,
            "eval-samples": 4,
            "eval-temperature": 1.0,
            "eval-max-new-tokens": 12,
        },
    ) + list(switches)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "grpo.py"), *flags],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = glob.glob(os.path.join(out, "*__*"))
    return read_metrics(run_dir)


@pytest.mark.slow
def test_ground_truth_injection_learns_a_format_the_model_never_samples(toy_assets, tmp_path):
    """Easy sums scored only inside \\boxed{}: the random model never writes it, so plain GRPO has no signal and its
    accuracy is exactly 0; with --gt-injection and the demonstration "The answer is \\boxed{s}." it learns the format
    (then one digit in ~9 is right by chance, more as it learns the sums). Threshold: over seeds 1-4, 40 steps gave
    eval avg@4 0.086-0.188 and pass@4 0.31-0.56 (README "Data strategies"); we ask pass@4 >= 0.1. Without injection
    no step has a signal, so nothing is updated: 10 steps show it as well as 40."""
    without = strict_run(toy_assets, tmp_path / "plain", 10)
    assert (
        all(r["train/accuracy"] == 0 and r["train/no_signal"] == 1 for r in without)
        and without[-1]["eval/test/avg@4"] == 0
    )
    with_gt = strict_run(toy_assets, tmp_path / "gt", 40, "--gt-injection")
    assert (
        with_gt[0]["data/gt_injected"] > 0 and with_gt[0]["train/accuracy"] == 0
    )  # metrics count the policy's samples only
    assert with_gt[-1]["eval/test/pass@4"] >= 0.1 and with_gt[-1]["eval/test/avg@4"] > 0


@pytest.mark.slow
def test_profile_data_on_the_toy_data_and_difficulty_file(toy_assets, tmp_path):
    out = tmp_path / "prof.jsonl"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "profile_data.py"),
        "--model-name-or-path",
        toy_assets["model"],
        "--dataset-name",
        toy_assets["train"],
        "--prompt-column",
        "question",
        "--answer-column",
        "answer",
        "--prompt-template",
        "none",
        "--sampler",
        "hf",
        "--samples",
        "4",
        "--limit",
        "6",
        "--max-new-tokens",
        "3",
        "--max-prompt-tokens",
        "32",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out)]
    assert [r["index"] for r in rows] == list(range(6)) and all(r["samples"] == 4 for r in rows)
    for r in rows:
        assert r["pass_rate"] in (0, 0.25, 0.5, 0.75, 1) and 1 <= r["length_mean"] <= 3 and r["length_std"] >= 0
        assert 0 <= r["no_reasoning_frac"] <= 1
    assert "| mean pass rate |" in proc.stdout and os.path.getsize(tmp_path / "prof.png") > 0
    # a run reads it as the tracker's prior: K samples at the profiled pass rate, for the matching prompts
    rows[0]["pass_rate"] = 0.75  # made up, to see it arrive
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script(
        "grpo",
        toy_flags(
            toy_assets,
            str(tmp_path / "run"),
            1,
            **{"difficulty-file": str(out), "save-every": 0, "prompts-per-step": 1},
        ),
    )
    (run_dir,) = glob.glob(os.path.join(tmp_path, "run", "*__*"))
    state = trainer_state(run_dir, 1)["data"]["tracker"]
    step0 = grpo.step_indices(0, 512, grpo.Args(prompts_per_step=1), 0, 1)[0]
    for r in rows:
        extra = 8 if r["index"] == step0 else 0
        assert state["samples"][r["index"]] == 4 + extra
        if not extra:
            assert state["correct"][r["index"]] == pytest.approx(r["pass_rate"] * 4)


def test_the_analysis_of_answers_without_reasoning():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_data import answers_without_reasoning

    assert answers_without_reasoning("\\boxed{7}") and answers_without_reasoning("The answer is \\boxed{\\frac{1}{2}}.")
    assert not answers_without_reasoning("First add three and four to get seven, so \\boxed{7}.")
    assert not answers_without_reasoning("no final answer here at all")


# 5. Bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script,kw,flag",
    [
        ("grpo", {"replay": True, "replay_buffer_size": 0}, "--replay-buffer-size"),
        ("grpo", {"difficulty_file": "/nonexistent/profile.jsonl"}, "--difficulty-file"),
        ("grpo", {"solution_column": "solution"}, "--solution-column"),
        ("grpo", {"gt_injection": True, "solution_column": "nope"}, "--solution-column"),
        ("dapo", {"gt_injection": True}, "--no-dynamic-sampling"),
        ("cispo", {"replay": True}, "--no-dynamic-sampling"),
    ],
)
def test_bad_data_strategy_flags_stop_with_one_line_naming_the_flag(script, kw, flag, toy_assets, tmp_path):
    import importlib

    mod = importlib.import_module(script)
    args = mod.Args(
        model_name_or_path=toy_assets["model"],
        dataset_name=toy_assets["train"],
        prompt_column="question",
        answer_column="answer",
        prompt_template="none",
        max_prompt_tokens=32,
        sampler="hf",
        output_dir=str(tmp_path / "out"),
        **kw,
    )
    with pytest.raises(SystemExit) as e:
        mod.main(args)
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg.strip() and flag in msg, msg
    assert not os.path.exists(tmp_path / "out")  # nothing written
