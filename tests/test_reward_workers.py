"""common/reward.py's pool: how many workers score (--reward-workers), and which answers skip the workers."""

from __future__ import annotations

import os
import threading

import pytest

from common import reward
from common.reward import score

# (completion, gold, score): both answers integers, decided without math-verify
INTEGERS = [(r"\boxed{007}", "7", 1.0), (r"\boxed{-0}", "0", 1.0), (r"\boxed{41}", "42", 0.0), ("so -1", "1", 0.0)]
# anything else (decimals, fractions, LaTeX): math-verify, in the workers
OTHER = [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{0.50}", "1/2", 1.0),
    ("1/3", "0.3", 0.0),
]


@pytest.fixture
def pool_tasks(monkeypatch):
    """The indices of the items the worker pool is asked to score, call by call."""
    sent: list[list[int]] = []
    run = reward._Pool.run

    def recording_run(self, tasks, timeout_s):
        sent.append([i for i, _, _ in tasks])
        return run(self, tasks, timeout_s)

    monkeypatch.setattr(reward._Pool, "run", recording_run)
    monkeypatch.setattr(reward, "NUM_WORKERS", -1)  # restored after the test, whatever it sets
    return sent


def test_integers_are_decided_without_math_verify_and_the_rest_by_workers(pool_tasks, monkeypatch):
    batch = INTEGERS + OTHER
    scores, counts = score([c for c, _, _ in batch], [g for _, g, _ in batch])
    assert scores == [s for _, _, s in batch]
    assert counts == {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0}
    assert pool_tasks == [list(range(len(INTEGERS), len(batch)))]  # only the non-integer items crossed to a worker
    monkeypatch.setattr(reward, "_verify", lambda pred, gold: 1 / 0)  # math-verify is never called for integers
    assert score([c for c, _, _ in INTEGERS], [g for _, g, _ in INTEGERS])[0] == [s for _, _, s in INTEGERS]


@pytest.mark.parametrize(
    "pred,gold",
    [
        ("7", "007"),
        ("-0", "0"),
        ("-5", "5"),
        ("10", "1"),
        ("0", "00"),
        ("-12", "-12"),
        ("1" * 30, "1" * 30),
        ("1" * 29 + "2", "1" * 30),
        ("100", "1e2"),
        ("12", "12.0"),
    ],
)
def test_the_integer_shortcut_is_math_verifys_verdict(pred, gold):
    """The reference is math-verify itself (reward._verify, in this process) on the same pair."""
    want = reward._verify(pred, gold)[0]
    assert score([rf"\boxed{{{pred}}}"], [gold])[0] == [want]


def test_zero_workers_scores_everything_in_process(pool_tasks):
    reward.set_workers(0)
    batch = INTEGERS + OTHER
    assert score([c for c, _, _ in batch], [g for _, g, _ in batch])[0] == [s for _, _, s in batch]
    assert pool_tasks == []


def test_zero_workers_off_the_main_thread_uses_one_worker(pool_tasks):
    """In-process scoring is bounded in time by SIGALRM, which only the main thread receives."""
    reward.set_workers(0)
    out = []
    thread = threading.Thread(target=lambda: out.append(score([c for c, _, _ in OTHER], [g for _, g, _ in OTHER])))
    thread.start()
    thread.join(timeout=120)
    assert out and out[0][0] == [s for _, _, s in OTHER]
    assert pool_tasks == [list(range(len(OTHER)))] and len(reward._POOL.workers) == 1


def test_the_pool_is_resized_to_the_worker_count(pool_tasks):
    reward.set_workers(1)
    assert score([OTHER[0][0]], [OTHER[0][1]])[0] == [1.0]
    assert len(reward._POOL.workers) == 1
    with pytest.raises(ValueError, match="set_workers"):
        reward.set_workers(-2)


def test_a_worker_whose_item_timed_out_is_replaced_and_its_later_answers_are_not_kept(pool_tasks):
    """The worker's alarm cuts math-verify short mid-parse, which can leave its (and sympy's) caches half-updated:
    the same input, scored again by that worker, once came back at once as a plain 0 instead of timing out. So a
    worker is replaced after a timeout, and the rest of its chunk is scored by the fresh one."""
    reward.set_workers(1)
    slow = r"\boxed{" + "(" * 300 + "1" + ")" * 300 + "}"  # parsed, slowly: times out at 1 s
    assert score([OTHER[0][0]], [OTHER[0][1]])[0] == [1.0]
    before = reward._POOL.workers[0].proc
    scores, counts = score([slow, OTHER[0][0], OTHER[1][0]], ["1", OTHER[0][1], OTHER[1][1]], timeout_s=1.0)
    assert scores == [0.0, 1.0, 1.0] and counts["timeouts"] == 1, counts
    assert reward._POOL.workers[0].proc is not before and before.poll() is not None  # replaced, and the old one gone


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")
@pytest.mark.parametrize("local_ranks,want", [(None, 8), ("1", 8), ("4", 2), ("3", 2), ("16", 1)])
def test_default_workers_divide_this_process_cores_among_local_ranks(monkeypatch, local_ranks, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count is not what this process may use
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert reward.default_workers() == want
