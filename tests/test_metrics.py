"""common/metrics.py against hand-computed values and closed forms."""

from __future__ import annotations

import itertools
import math

import pytest

from common.metrics import (
    completion_stats,
    distinct_ngrams,
    has_reflection,
    majority_correct,
    pass_at_k,
    repetition_rate,
)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (4, 4, 2), (8, 1, 8), (16, 5, 4)])
def test_pass_at_k_equals_closed_form_and_enumeration(n, c, k):
    closed = 1 - math.comb(n - c, k) / math.comb(n, k)
    samples = [1] * c + [0] * (n - c)  # every k-subset of the n samples, equally likely
    enumerated = sum(any(samples[i] for i in s) for s in itertools.combinations(range(n), k)) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(enumerated, abs=1e-12)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_majority_vote_and_ties():
    assert majority_correct(["4", "4", "5"], [1, 1, 0]) == 1.0
    assert majority_correct(["5", "5", "4"], [0, 0, 1]) == 0.0
    assert majority_correct(["4", "5"], [1, 0]) == 0.5  # a tie counts as the tied answers' mean correctness
    assert majority_correct([None, None, "4"], [0, 0, 1]) == 1.0  # no-answer samples do not vote
    assert majority_correct([None, None], [0, 0]) == 0.0


def test_repetition_rate():
    assert repetition_rate("a b c d e") == 0.0
    # 8 words "a b c d a b c d": 5 4-grams, of which "a b c d" repeats once -> 1/5
    assert repetition_rate("a b c d a b c d") == pytest.approx(1 / 5)
    assert repetition_rate("too short") == 0.0


def test_distinct_ngrams_within_group():
    assert distinct_ngrams(["x y z", "x y z"], 2) == pytest.approx(2 / 4)
    assert distinct_ngrams(["x y", "u v"], 2) == 1.0


def test_reflection_words_and_accuracy_split():
    assert has_reflection("Wait, let me check that.") and has_reflection("HOWEVER this")
    assert not has_reflection("awaiting the butter")  # whole words only
    stats = completion_stats(["wait no 3", "7", "however 4", "5"], [1.0, 0.0, 0.0, 1.0], group_size=2)
    assert stats["reflection_frac"] == 0.5
    assert stats["accuracy_with_reflection"] == 0.5 and stats["accuracy_without_reflection"] == 0.5


def test_evaluate_scores_avg_pass_and_majority_on_the_toy_set():
    """common.metrics.evaluate with a scripted sampler: 2 questions x k=4 samples with known answers."""
    import grpo
    from common.metrics import evaluate
    from common.sampling import Completion

    class Scripted:
        def generate(self, prompts, n, temperature, top_p, max_new_tokens):
            texts = {
                0: ["4", "4", "5", "x"],
                1: ["1", "2", "2", "3"],
            }  # gold 4 (2/4 right, majority 4); gold 3 (1/4, majority 2)
            return [Completion(token_ids=[1], text=t, truncated=False) for q in range(len(prompts)) for t in texts[q]]

    args = grpo.Args(eval_samples=4, eval_temperature=0.0, eval_max_new_tokens=8, reward_format="any")
    metrics = evaluate(Scripted(), {"data/toy.jsonl": ([[1], [2]], ["4", "3"])}, args)
    assert metrics["eval/toy/avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["eval/toy/pass@4"] == 1.0
    assert metrics["eval/toy/maj@4"] == pytest.approx(0.5)


def test_health_metrics_language_mix_patterns_and_length_splits():
    texts = [
        "Wait, 2+2 is 4. Let me check: \\boxed{4}",
        "答案是 \\frac{1}{2}",
        "我们 compute 结果 4",
        "Alternatively, wait... 5",
        "4",
        "but but 7",
    ]
    correct = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    lengths = [12, 7, 5, 9, 1, 3]  # mean 37/6: long = [12, 7, 9]
    s = completion_stats(texts, correct, 3, lengths)
    assert s["language_mix_frac"] == pytest.approx(1 / 6)  # only the third: \frac is a LaTeX command, not a word
    assert s["reflection/wait_frac"] == pytest.approx(2 / 6) and s["reflection/wait_accuracy"] == pytest.approx(0.5)
    assert s["reflection/let_me_check_frac"] == pytest.approx(1 / 6) and s["reflection/let_me_check_accuracy"] == 1.0
    assert s["reflection/alternatively_frac"] == pytest.approx(1 / 6) and s["reflection/alternatively_accuracy"] == 0.0
    assert "reflection/but_frac" not in s and not has_reflection("but but 7")  # "but" joins clauses: no reflection
    assert math.isnan(s["reflection/mistake_accuracy"]) and s["reflection/mistake_frac"] == 0.0
    assert s["response_length_with_reflection"] == pytest.approx((12 + 9) / 2)
    assert s["response_length_without_reflection"] == pytest.approx((7 + 5 + 1 + 3) / 4)
    assert s["accuracy_long"] == pytest.approx(1 / 3) and s["accuracy_short"] == pytest.approx(2 / 3)
    assert "accuracy_long" not in completion_stats(texts, correct, 3)  # without lengths: no length splits
