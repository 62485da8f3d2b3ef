"""Data strategies (common/data_strategies.py, common/data.py's TrainData, docs/data_strategies.md): the per-prompt
tracker against a brute-force count
(also on 2 processes), the prompt draws against their definitions, ground-truth injection and replay, resume with
a replay buffer holding groups, a learning test for injection, and tools/profile_data.py on the toy data."""

from __future__ import annotations

import dataclasses
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
from common.batching import make_batch
from common.data import TrainData, load_data, step_indices
from common.data_strategies import (
    REPLAY_RATIO_CAP,
    PromptTracker,
    ReplayBuffer,
    draw_probabilities,
    draw_prompts,
    inject_and_replay,
    sampling_weights,
    update_replay,
)
from common.sampling import Completion
from tests.checks import assert_refused_in_one_line, launch_cmd
from tests.test_scripts import ROOT, SCRIPTS, read_metrics, run_script, toy_flags

ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def trainer_state(run_dir: str, step: int) -> dict:
    with open(os.path.join(run_dir, "checkpoints", f"step_{step}", "trainer.json")) as f:
        return json.load(f)


# 1. Tracker -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("half_life", [0.0, 3.0])
def test_tracker_matches_a_brute_force_count(half_life):
    """Each completion counted once, weighted 0.5 ** (steps since its step / half-life) (0: weight 1)."""
    rng = np.random.default_rng(0)
    num, g, tracker, seen = 7, 3, PromptTracker(7), {}
    for t in range(5):  # rollouts with repeated prompts
        rows = rng.integers(0, num, size=4).tolist()
        correct = rng.integers(0, 2, size=4 * g).astype(float).tolist()
        tracker.update(rows, correct, g, half_life)
        for k, r in enumerate(rows):
            for j in range(g):
                seen.setdefault(r, []).append((t, correct[k * g + j]))
    for r in range(num):
        w = [0.5 ** ((4 - t) / half_life) if half_life else 1.0 for t, _ in seen.get(r, [])]
        n, c = sum(w), sum(wi * x for wi, (_, x) in zip(w, seen.get(r, [])))
        assert tracker.samples[r] == pytest.approx(n, abs=1e-12) and tracker.correct[r] == pytest.approx(c, abs=1e-12)
        assert tracker.pass_rate()[r] == pytest.approx((c + 1) / (n + 2), abs=1e-12)  # Beta(1, 1) posterior mean
        assert tracker.groups[r] == len(seen.get(r, [])) / g  # groups drawn, never forgotten
    restored = PromptTracker(num)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))  # through JSON, as trainer.json keeps it
    assert np.array_equal(restored.pass_rate(), tracker.pass_rate())


def test_a_forgetting_tracker_follows_a_policy_that_learned_a_prompt():
    """A prompt failed 10 times then solved 5 times: without forgetting its estimate stays near 0.3 (the collapse
    of a never-forgetting tracker: a solved prompt still looks medium); with a half-life of 2 steps it is > 0.75."""
    estimates = {}
    for half_life in (0.0, 2.0):
        t = PromptTracker(1)
        for correct in [0.0] * 10 + [1.0] * 5:
            t.update([0], [correct] * 8, 8, half_life)
        estimates[half_life] = t.pass_rate()[0]
    assert estimates[0.0] == pytest.approx(41 / 122) and estimates[2.0] > 0.75


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
    tracker, prev_c, decay = PromptTracker(512), 0.0, 0.5 ** (1 / grpo.Args().tracker_half_life)
    for step in (0, 1):
        probs = draw_probabilities(tracker.pass_rate(), "medium", step / 2, grpo.Args().uniform_floor, 0.2, g)
        rows = draw_prompts(probs, 1, step, p)  # both ranks' prompts: rank r takes [2r, 2r + 2)
        expected = tracker.samples * decay + np.bincount(rows, minlength=512) * g
        tracker.load_state_dict(trainer_state(run_dir, step + 1)["data"]["tracker"])
        assert np.allclose(tracker.samples, expected, rtol=0, atol=1e-12), step
        assert tracker.correct.sum() - prev_c * decay == pytest.approx(metrics[step]["train/accuracy"] * g * p)
        prev_c = tracker.correct.sum()


def test_the_graded_task_ranges_from_trivial_to_hopeless(toy_assets):
    """The graded toy task (docs/data_strategies.md): a third of each level; the hard sums' answers take more tokens
    than the 2 new tokens the measurements give, so they are never solved; every answer is its question's sum."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_assets["model"])
    rows = [json.loads(line) for line in open(toy_assets["graded_train"])]
    easy, medium, hard = rows[0::3], rows[1::3], rows[2::3]  # the levels in turn
    assert len(rows) == 96 and max(int(r["answer"]) for r in easy) <= 2 and max(int(r["answer"]) for r in medium) <= 8
    assert min(int(r["answer"]) for r in hard) >= 100
    assert all(sum(map(int, r["question"].rstrip("=").split("+"))) == int(r["answer"]) for r in rows)
    assert min(len(tok(r["answer"])["input_ids"]) for r in hard) > 2
    for level in ("easy", "medium", "hard"):
        assert len(open(toy_assets[f"test_{level}"]).readlines()) == 32


# 2. Prompt sampling ---------------------------------------------------------------------------------------


def tracker_with(pass_counts: list[tuple[int, int]]) -> PromptTracker:
    t = PromptTracker(len(pass_counts))
    for i, (c, n) in enumerate(pass_counts):
        t.samples[i], t.correct[i] = n, c
    return t


def train_data(n: int, tracker: PromptTracker | None = None, **flags) -> TrainData:
    """TrainData of n one-token prompts (golds "0"), grpo.py's flags with `flags` on top."""
    args = grpo.Args(**flags)
    return TrainData(args, [[i] for i in range(n)], ["0"] * n, WordTokenizer(), tracker=tracker)


def test_uniform_is_todays_shuffled_order():
    """Uniform draws are shuffled epochs, the stream's position (one draw a step) keying them."""
    for rank, world in ((0, 1), (1, 2)):
        data = train_data(40, tracker_with([(i % 5, 8) for i in range(40)]), prompts_per_step=8, seed=3)
        for step in range(12):  # past an epoch boundary (40 rows / 8 per step)
            start = (step * world + rank) * (8 // world)
            reference = [
                int(np.random.default_rng([3, k // 40]).permutation(40)[k % 40])
                for k in range(start, start + 8 // world)
            ]
            assert data.next_rows(step, 8 // world, rank, world) == reference
        assert data.position == 12


@pytest.mark.parametrize(
    "mode,progress,floor",
    [
        ("medium", 0.0, 0.25),
        ("medium", 0.0, 0.0),
        ("curriculum", 0.0, 0.25),
        ("curriculum", 0.5, 0.1),
        ("curriculum", 1.0, 0.25),
    ],
)
def test_draw_probabilities_match_the_definitions(mode, progress, floor):
    """P(i) = (1 - f) w_i / sum w + f / N; medium w = s(p), the chance that G Bernoulli(p) draws are not all equal,
    summed over the mixed outcomes (sum_k=1..G-1 C(G, k) p^k (1 - p)^(G - k)); curriculum w = s(p) exp(-(p - tau)^2 /
    (2 0.2^2)), tau = 1 - (1 - 0.2) progress (ending at the 0.2 target floor, not at 0)."""
    counts = [(0, 8), (1, 8), (3, 8), (4, 8), (6, 8), (8, 8), (0, 0)]  # estimates 0.1, 0.2, 0.4, 0.5, 0.7, 0.9, 0.5
    tracker = tracker_with(counts)
    est = [(c + 1) / (n + 2) for c, n in counts]
    for g in (2, 8):
        w = [sum(math.comb(g, k) * p**k * (1 - p) ** (g - k) for k in range(1, g)) for p in est]
        if mode == "curriculum":
            w = [x * math.exp(-((p - (1.0 - 0.8 * progress)) ** 2) / (2 * 0.2**2)) for x, p in zip(w, est)]
        expected = [(1 - floor) * x / sum(w) + floor / len(w) for x in w]
        got = draw_probabilities(tracker.pass_rate(), mode, progress, floor, 0.2, g)
        assert np.allclose(got, expected, rtol=1e-12, atol=0) and got.min() >= floor / len(w)
        assert np.allclose(sampling_weights(tracker.pass_rate(), mode, progress, 0.2, g), w, rtol=1e-12)
    if mode == "medium":  # an estimate near 0: w = G p (1 - (G - 1) p / 2) to second order, not lost to cancellation
        tiny = 1e-13  # 1 - (1 - p)^8 in floats is off by ~1e-4 of it here
        w = sampling_weights(np.array([tiny]), mode, progress, 0.2, 8)[0]
        assert w == pytest.approx(8 * tiny * (1 - 3.5 * tiny), rel=1e-9, abs=0)


def test_draws_are_without_replacement_and_follow_successive_sampling():
    """The step's prompts are distinct; over 40k steps the ordered pair (first, second) has the successive-sampling
    probability p_i p_j / (1 - p_i) (brute force over all pairs), each within 5 binomial standard deviations; a
    step larger than the data set takes whole passes."""
    p = np.array([0.5, 0.25, 0.15, 0.1])
    n, freq = 40_000, Counter()
    for step in range(n):
        drawn = draw_prompts(p, 3, step, 2)
        freq[tuple(drawn)] += 1
    for i in range(4):
        for j in range(4):
            q = p[i] * p[j] / (1 - p[i]) if i != j else 0.0
            assert abs(freq[(i, j)] / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-12, (i, j, freq[(i, j)] / n, q)
    drawn = draw_prompts(p, 3, 0, 10)
    assert sorted(drawn[:4]) == sorted(drawn[4:8]) == [0, 1, 2, 3] and len(set(drawn[8:])) == 2


def test_medium_sampling_no_longer_collapses_onto_a_few_prompts():
    """A tracker where 10 of 100 prompts look medium and the rest look solved: 16-prompt steps draw 16 distinct
    prompts, and the floor gives every prompt a chance ((1 - f) w_i / sum w + f / N >= f / N)."""
    tracker = tracker_with([(4, 8)] * 10 + [(8, 8)] * 90)
    p = draw_probabilities(tracker.pass_rate(), "medium", 0.0, 0.25, 0.2, 8)
    drawn = [draw_prompts(p, 1, step, 16) for step in range(200)]
    assert all(len(set(d)) == 16 for d in drawn) and p.min() >= 0.25 / 100
    assert len({i for d in drawn for i in d}) > 80  # the solved-looking prompts are revisited too


def test_every_rank_draws_the_same_list_and_takes_its_slice():
    tracker = tracker_with([(i % 9, 8) for i in range(30)])
    flags = dict(prompts_per_step=8, prompt_sampling="medium", total_steps=10)
    draws = {}
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        data = train_data(30, tracker, **flags)
        data.position = 4  # the fifth draw of the stream
        draws[rank, world] = data.next_rows(4, 8 // world, rank, world)
    whole = draws[0, 1]
    assert draws[0, 2] + draws[1, 2] == whole
    args = data.args
    probs = draw_probabilities(tracker.pass_rate(), "medium", 0.4, args.uniform_floor, 0.2, args.group_size)
    assert whole == draw_prompts(probs, args.seed, 4, 8) and len(set(whole)) == 8
    assert whole != data.next_rows(4, 8, 0, 1)  # the next position: a fresh draw


def draw_frequencies(data: TrainData, steps: range) -> Counter:
    """How often each row is the one prompt of a step's draw (`TrainData.next_rows` with a count of 1) over `steps`;
    the tracker is not updated, so every step draws from the same probabilities."""
    return Counter(data.next_rows(step, 1, 0, 1)[0] for step in steps)


def assert_frequencies(freq: Counter, n: int, probs: list[float]) -> None:
    """Every row's frequency within 5 binomial standard deviations of its probability."""
    for i, q in enumerate(probs):
        assert abs(freq[i] / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-12, (i, freq[i] / n, q)


# (correct, samples) per prompt: estimates 0.1, 0.3, 0.5 (unseen), 0.7 and 101/102 (solved a hundred times)
KIMI_COUNTS = [(0, 8), (2, 8), (0, 0), (6, 8), (100, 100)]


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_prioritized_draws_prompts_in_proportion_to_one_minus_their_pass_rate(floor):
    """Kimi k1.5 §2.3.4: P(i) = (1 - s_i) / sum_j (1 - s_j) with s the tracker's estimate (floor 0, the paper's rule);
    with --uniform-floor f, (1 - f) of that plus f / N (ours), so the solved prompt keeps at least f / N. 20k one-prompt
    draws through TrainData.next_rows against the definition, computed here by a loop."""
    est = [(c + 1) / (k + 2) for c, k in KIMI_COUNTS]
    total = sum(1 - s for s in est)
    probs = [(1 - floor) * (1 - s) / total + floor / len(est) for s in est]
    data = train_data(5, tracker_with(KIMI_COUNTS), prompt_sampling="prioritized", uniform_floor=floor)
    got = draw_probabilities(data.tracker.pass_rate(), "prioritized", 0.0, floor, 0.2, 8)
    assert np.allclose(got, probs, rtol=1e-12, atol=0) and got[4] >= floor / 5
    n = 20_000
    assert_frequencies(draw_frequencies(data, range(n)), n, probs)


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_hard_after_warmup_draws_the_whole_set_then_only_the_hard_prompts(floor):
    """Kimi k1.5 §2.3.4 and Fig. 9: for --hard-warmup-steps steps the draws are uniform's shuffled epochs (the same
    rows as --prompt-sampling uniform); after them only the prompts whose estimate is below --hard-pass-rate, each
    alike: P = (1 - f) / |H| + f / N for a hard prompt, f / N for the others (20k draws). With no hard prompt left
    the draw is uniform again."""
    flags = dict(prompt_sampling="hard-after-warmup", hard_warmup_steps=7, uniform_floor=floor, seed=3)
    data = train_data(5, tracker_with(KIMI_COUNTS), **flags)
    uniform = train_data(5, tracker_with(KIMI_COUNTS), seed=3)
    assert [data.next_rows(s, 2, 0, 1) for s in range(7)] == [uniform.next_rows(s, 2, 0, 1) for s in range(7)]
    hard = [(c + 1) / (k + 2) < 0.5 for c, k in KIMI_COUNTS]  # the first two: 0.1 and 0.3; unseen (0.5) is not hard
    probs = [(1 - floor) * h / sum(hard) + floor / 5 for h in hard]
    assert data.next_rows(7, 2, 0, 1) == draw_prompts(np.array(probs), 3, 7, 2)  # the first step after the warm-up
    n = 20_000
    assert_frequencies(draw_frequencies(data, range(8, 8 + n)), n, probs)
    solved = train_data(5, tracker_with([(8, 8)] * 5), **flags)  # every estimate 0.9: no hard prompt
    assert np.allclose(draw_probabilities(solved.tracker.pass_rate(), "hard-after-warmup", 0, floor, 0.2, 8), 0.2)


def test_a_step_larger_than_the_hard_set_fills_up_with_the_others_at_random():
    """Without a floor the easy prompts have probability 0: a step of 3 from 2 hard prompts takes both, and its third
    prompt is each of the 4 others alike (8000 steps, 5 binomial standard deviations)."""
    p = np.array([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    n, freq = 8000, Counter()
    for step in range(n):
        drawn = draw_prompts(p, 1, step, 3)
        assert sorted(drawn[:2]) == [0, 1]
        freq[drawn[2]] += 1
    assert_frequencies(freq, n, [0.0, 0.0, 0.25, 0.25, 0.25, 0.25])


# 3. Injection and replay ----------------------------------------------------------------------------------


class WordTokenizer:
    """Characters as token ids, EOS 0: enough for building demonstrations."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) for ch in text])


def strategies(n: int, size: int = 4, solutions=None, golds=None, **flags) -> TrainData:
    """n prompts with reference answers `golds` (default "0"), a buffer of `size` groups, grpo.py's flags with
    `flags` on top."""
    data = train_data(n, replay_buffer_size=size, **flags)
    data.golds, data.solutions = golds or data.golds, solutions or {}
    return data


def apply(data: TrainData, rows, prompts, completions, correct, step=0, keep=None):
    """inject_and_replay with the data's buffer, demonstrations and tracker (as TrainData.train_groups calls it)."""
    rates = data.tracker.pass_rate()
    return inject_and_replay(data.args, data.buffer, data.demo, rates, rows, prompts, completions, correct, step, keep)


def comp(text: str) -> Completion:
    return Completion(token_ids=[ord(ch) for ch in text] + [0], text=text, truncated=False)


def test_injection_replaces_the_last_completion_of_an_all_wrong_group_by_a_verified_demonstration():
    flags = dict(group_size=3, gt_injection=True, prompt_template="qwen-boxed", max_new_tokens=64)
    golds = ["8", "4", "3"]
    data = strategies(3, solutions={2: "Adding, 1+2 = 3, so \\boxed{3}."}, golds=golds, **flags)
    completions = [comp(t) for t in ("5", "6", "7", "4", "x", "y", "1", "2", "9")]
    correct = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    train = apply(data, [0, 1, 2], [[1], [2], [3]], completions, correct)
    assert train.injected == [True, False, True] and train.changed and train.bare == 1  # row 0: no solution
    assert (
        train.completions[2].text == "The answer is \\boxed{8}." and train.completions[2].token_ids[-1] == 0
    )  # EOS ends it
    assert train.completions[8].text == "Adding, 1+2 = 3, so \\boxed{3}."  # the worked solution goes first
    assert (
        train.correct == [0, 0, 1, 1, 0, 0, 0, 0, 1] and correct[2] == 0.0 and completions[2].text == "7"
    )  # inputs untouched
    short = strategies(3, golds=golds, **{**flags, "max_new_tokens": 8})  # no demonstration fits: left as it is
    assert not apply(short, [0], [[1]], completions[:3], correct[:3]).changed
    wrong_solution = strategies(3, solutions={0: "so \\boxed{9}."}, golds=golds, **flags)
    wrong = apply(wrong_solution, [0], [[1]], completions[:3], correct[:3])
    assert wrong.completions[2].text == "The answer is \\boxed{8}."  # a solution the verifier rejects is not used


def load_toy(toy_assets, tmp_path, rows, lines=None, **flags):
    """load_data on `rows` (written as a .jsonl) with the toy model's tokenizer and grpo.py's flags."""
    from transformers import AutoTokenizer

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(prompt_column="question", answer_column="answer", prompt_template="none", max_prompt_tokens=8)
    args = grpo.Args(dataset_name=str(path), **{**base, **flags})
    tokenizer = AutoTokenizer.from_pretrained(toy_assets["model"])
    return load_data(args, tokenizer, (lines if lines is not None else []).append)[0], tokenizer


def test_solutions_are_matched_to_the_kept_training_rows_by_their_prompt_tokens(toy_assets, tmp_path):
    rows = [{"question": q, "answer": a, "solution": s} for q, a, s in [("1+1=", "2", "s0"), ("1+2=" * 9, "3", "s1")]]
    rows += [{"question": "2+2=", "answer": "4", "solution": "s2"}]  # the second prompt is too long: dropped
    data, tok = load_toy(toy_assets, tmp_path, rows, gt_injection=True, solution_column="solution")
    assert [tok.decode(p) for p in data.prompts] == ["1+1=", "2+2="] and data.golds == ["2", "4"]
    assert data.solutions == {0: "s0", 1: "s2"} and data.tracker.samples.shape == (2,)


@pytest.mark.parametrize(
    "kw,says", [({"gt_injection": True}, "bare reference answer"), ({"prompt_sampling": "curriculum"}, "0.5")]
)
def test_a_setting_that_quietly_does_less_says_so_once(kw, says, toy_assets, tmp_path):
    """--gt-injection without --solution-column (bare answers) and curriculum without a profile (every estimate 0.5
    at the start) each print one line."""
    lines = []
    load_toy(toy_assets, tmp_path, [{"question": "1+1=", "answer": "2"}], lines, **kw)
    assert len(lines) == 1 and says in lines[0] and "\n" not in lines[0]


def test_replay_swaps_a_no_signal_group_for_the_newest_buffered_one_and_its_log_probs_give_the_ratio():
    g = 2
    data = strategies(4, size=2, group_size=g, replay=True, max_new_tokens=8, beta=0.0, rollout_correction="none")
    args = data.args
    data.tracker.samples[:], data.tracker.correct[:] = ([8, 8, 8, 8], [0, 8, 4, 0])  # estimates 0.1, 0.9, 0.5, 0.1
    old = {
        "prompt": [9, 9],
        "token_ids": [[5, 6], [7]],
        "texts": ["a", "b"],
        "truncated": [False, True],
        "correct": [1.0, 0.0],
        "logps": [[-0.5, -1.5], [-2.0]],
        "step": 0,
    }
    data.buffer.push({**old, "prompt": [8]})
    data.buffer.push(old)  # the newest: replayed first
    completions = [comp(t) for t in ("x", "y", "z", "w", "u", "v", "s", "t")]
    correct = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # groups: signal, none (all wrong), none (all correct), signal
    train = apply(data, [0, 1, 2, 3], [[1], [2], [3], [4]], completions, correct)
    assert train.replayed == 2 and train.fresh == [True, False, False, True]
    assert train.prompts == [[1], [9, 9], [8], [4]] and train.correct[2:4] == [1.0, 0.0]
    assert [c.token_ids for c in train.completions[2:4]] == [[5, 6], [7]] and train.completions[3].truncated
    assert set(train.stored_logps) == {2, 3, 4, 5} and len(data.buffer.groups) == 0

    mask = make_batch(train.prompts, train.completions, 0, "cpu")["mask"]
    current = -torch.rand(mask.shape, dtype=torch.float64)  # the policy's log-probs now
    current[3, 0] = current[5, 0] = -0.5  # the stored -2.0 would give these A < 0 tokens a ratio e^1.5 = 4.5 > 3
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    batch = {"old_logps": update_replay(data.buffer, train, current, adv, g)}
    for r in (2, 4):  # both replayed groups carried these log-probs; A > 0 rows take them as they are
        assert batch["old_logps"][r, :2].tolist() == [-0.5, -1.5]
        assert batch["old_logps"][r + 1, 0].item() == pytest.approx(-0.5 - math.log(REPLAY_RATIO_CAP))  # dual-clip cap
    assert torch.equal(batch["old_logps"][[0, 1, 6, 7]], current[[0, 1, 6, 7]])  # fresh rows keep the policy's own
    loss, _ = grpo.compute_policy_loss(current, batch["old_logps"], adv, mask.double(), args)
    ref = 0.0
    for i in range(8):  # brute force: ratio of each token against the policy that generated it, A < 0 capped at 3
        n = int(mask[i].sum())
        olds = {2: [-0.5, -1.5], 3: [-2.0], 4: [-0.5, -1.5], 5: [-2.0]}.get(i, current[i, :n].tolist())
        if adv[i] < 0:
            olds = [max(o, current[i, t].item() - math.log(3.0)) for t, o in enumerate(olds)]
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


def test_injection_cap_leaves_the_other_all_wrong_groups_to_replay():
    """--gt-injection-max-frac 0.5 of 4 groups: the first 2 all-wrong groups get a demonstration, the third (and the
    all-correct one) is replayed: how injection and replay share the groups without signal."""
    flags = dict(group_size=2, gt_injection=True, gt_injection_max_frac=0.5, replay=True, max_new_tokens=64)
    data = strategies(4, size=4, golds=["8"] * 4, prompt_template="qwen-boxed", **flags)
    old = {"prompt": [9], "token_ids": [[5], [6]], "texts": ["a", "b"], "truncated": [False] * 2, "step": 0}
    for _ in range(3):
        data.buffer.push({**old, "correct": [1.0, 0.0], "logps": [[-1.0], [-1.0]]})
    completions = [comp(t) for t in ("1", "2", "3", "4", "5", "6", "7", "8")]
    correct = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    train = apply(data, [0, 1, 2, 3], [[1], [2], [3], [4]], completions, correct, step=3)
    assert train.injected == [True, True, False, False] and train.fresh == [True, True, False, False]
    assert train.replayed == 2 and train.bare == 2


def test_replay_drops_groups_older_than_the_max_age():
    b = ReplayBuffer(4)
    for step in (1, 5, 8):
        b.push({"step": step})
    assert b.pop(12, 5)["step"] == 8 and b.pop(12, 5) is None  # steps 1 and 5 are 11 and 7 steps old: dropped


def test_buffer_keeps_the_newest_size_groups():
    b = ReplayBuffer(2)
    for k in range(4):
        b.push({"k": k, "step": 0})
    assert [x["k"] for x in b.groups] == [2, 3] and b.pop(0, 1)["k"] == 3 and b.pop(0, 1)["k"] == 2
    assert b.pop(0, 1) is None


# 4. Through the scripts -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_a_full_replay_buffer_equals_an_uninterrupted_run(toy_assets, tmp_path):
    """16 prompts, 8 per step: prompts come back every 2 steps, so hard ones get solved (into the buffer) and groups
    without signal get replayed (curriculum draws, 8 steps). The run is cut back to its step-6 checkpoint (as a kill
    after that save leaves it, the buffer not empty) and resumed: steps 6-7 and the final tracker and buffers are the
    uninterrupted run's."""
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
    assert trainer_state(cut_dir, 6)["data"]["ranks"][0]["buffer"][
        "groups"
    ]  # the buffer holds groups at the checkpoint
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


@pytest.mark.slow
@pytest.mark.parametrize("script", ["dapo", "cispo"])
def test_kept_groups_alone_reach_the_replay_buffer(script, toy_assets, tmp_path):
    """--no-dynamic-sampling with 16 prompts generated per round and 8 trained: only the 8 kept groups are
    injected, trained and buffered, each with the log-probs of its own completions (before, the 8 others entered the
    buffer with empty log-probs, and a replayed group could pair a prompt with another prompt's completions)."""
    flags = toy_flags(
        toy_assets,
        str(tmp_path),
        3,
        **{"max-new-tokens": 16, "gen-prompts-per-round": 16, "num-mini-batches": 1, "warmup-steps": 0},
    ) + ["--no-dynamic-sampling", "--gt-injection", "--replay"]
    run_script(script, flags)
    (run_dir,) = glob.glob(os.path.join(tmp_path, "*__*"))
    metrics = read_metrics(run_dir)
    assert all(m["train/train_groups"] == 8 and m["data/gt_injected"] <= 8 for m in metrics)
    groups = trainer_state(run_dir, 3)["data"]["ranks"][0]["buffer"]["groups"]
    assert groups and all(sum(g["step"] == s for g in groups) <= 8 for s in range(3))
    for grp in groups:
        assert [len(lp) for lp in grp["logps"]] == [len(ids) for ids in grp["token_ids"]]
        assert all(math.isfinite(x) and x <= 0 for lp in grp["logps"] for x in lp)


def strict_run(assets, out, steps, *switches: str) -> list[dict]:
    flags = toy_flags(
        assets,
        str(out),
        steps,
        **{
            "reward-format": "boxed",  # the strict verifier: no \\boxed{...}, no reward
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
    eval avg@4 0.086-0.188 and pass@4 0.31-0.56 (docs/data_strategies.md); we ask pass@4 >= 0.1. Without injection
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
    step0 = step_indices(0, 512, 1, grpo.Args().seed)[0]
    decay = 0.5 ** (1 / grpo.Args().tracker_half_life)  # the prior is forgotten like any count, here over 1 step
    for r in rows:
        extra = 8 if r["index"] == step0 else 0
        assert state["samples"][r["index"]] == pytest.approx(4 * decay + extra)
        if not extra:
            assert state["correct"][r["index"]] == pytest.approx(r["pass_rate"] * 4 * decay)


def test_profile_scores_in_the_runs_answer_format():
    """ "so the sum is 4" is right for a run that reads any final answer (template none) and wrong for a qwen-boxed
    run, which scores only \\boxed{}: the profile's pass rates are the run's."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_data import Args, profile_rows

    from common.reward import answer_format_for

    outs = [comp("so the sum is 4"), comp("so \\boxed{4}")]
    for template, rate in (("none", 1.0), ("qwen-boxed", 0.5)):
        fmt = answer_format_for(template, Args(prompt_template=template).reward_format)
        (row,) = profile_rows([0], outs, ["4"], 2, fmt, lambda ids: "q", [[1]])
        assert row["pass_rate"] == rate and row["samples"] == 2 and row["index"] == 0, template


def test_the_analysis_of_answers_without_reasoning():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_data import answers_without_reasoning

    assert answers_without_reasoning("\\boxed{7}") and answers_without_reasoning("The answer is \\boxed{\\frac{1}{2}}.")
    assert not answers_without_reasoning("First add three and four to get seven, so \\boxed{7}.")
    assert not answers_without_reasoning("no final answer here at all")


def test_profile_takes_the_runs_flags_from_the_scripts(capsys):
    """The profile's run flags are grpo.Args's fields (default and help), and every script's flag of that name has
    the same type, so that a run's value (e.g. --reward-format answer-line-strict) is one the profile takes."""
    import importlib
    import typing

    import tyro

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_data import RUN_FLAGS, Args, field_docs

    theirs = typing.get_type_hints(Args)
    for script in SCRIPTS:
        hints = typing.get_type_hints(importlib.import_module(script).Args)
        assert {n: hints[n] for n in RUN_FLAGS} == {n: theirs[n] for n in RUN_FLAGS}, script
    assert {n: getattr(Args(), n) for n in RUN_FLAGS} == {n: getattr(grpo.Args(), n) for n in RUN_FLAGS}

    @dataclasses.dataclass
    class Example:
        a: int = 1
        """one line"""
        b: str = "x"
        c: float = 2.0
        """two
        lines"""

    assert field_docs(Example) == {"a": "one line", "c": "two lines"}
    with pytest.raises(SystemExit):
        tyro.cli(Args, args=["--help"])
    assert "where the verifier reads the final answer" in " ".join(capsys.readouterr().out.split())


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
        ("grpo", {"replay": True, "replay_max_age": 0}, "--replay-max-age"),
        ("grpo", {"uniform_floor": 1.5}, "--uniform-floor"),
        ("grpo", {"curriculum_min_target": -0.1}, "--curriculum-min-target"),
        ("grpo", {"gt_injection_max_frac": 2.0}, "--gt-injection-max-frac"),
        ("grpo", {"tracker_half_life": -1.0}, "--tracker-half-life"),
        ("grpo", {"hard_pass_rate": 1.5}, "--hard-pass-rate"),
        ("grpo", {"hard_warmup_steps": -1}, "--hard-warmup-steps"),
    ],
)
def test_bad_data_strategy_flags_stop_with_one_line_naming_the_flag(script, kw, flag, toy_assets, tmp_path):
    import importlib

    assert_refused_in_one_line(importlib.import_module(script), toy_assets, tmp_path / "out", flag, **kw)
