"""Evaluation scores, one code path for in-training evaluation (`common.metrics.evaluate`) and evaluate.py.

A dataset's evaluation is one `sampler.generate` call (k completions per question), one `common.reward.score` call
(the training reward's verifier and counts), and `summarise`:

- avg@k: the mean over questions of each question's fraction of correct completions (R1's "pass@1" over k samples,
  DAPO's avg@32), with its standard error over questions, std(a_q) / sqrt(Q) (sample std; the error bar of
  Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640, eq. 1, for questions drawn from a larger pool).
- pass@j for every j = 1..k: Chen et al. 2021's (arXiv:2107.03374, eq. 1) unbiased 1 - C(k-c, j) / C(k, j) per
  question, computed in exact integers and rounded once (`pass_at_k`), averaged over questions, with its standard
  error the same way.
- maj@k (R1's cons@k): each question's final answers vote; an answer joins the first class whose first member
  math-verify judges equivalent to it, so "1/2", "0.5" and "\\frac{1}{2}" vote together (Qwen2.5-Math's
  `group_pred(use_symbol=True)`, QwenLM/Qwen2.5-Math@a45202b:evaluation/rm_maj_eval.py); a completion without an
  answer in the format does not vote; a question whose completions have no answer scores 0. Tie rule: the classes
  with the most votes share the win, so maj@k is the mean correctness of the tied classes (the expected score of a
  uniformly random tie-break, independent of the order of the samples; Qwen2.5-Math's takes the class sampled
  first). A class's correctness is its members' mean verdict (the same verdict unless math-verify disagrees with
  itself across spellings). "answer-line-strict" answers vote by string equality, the format's own comparison.
- lengths (the tokens the model sampled) of all, correct and incorrect completions; the fraction truncated (the
  budget ran out); the fraction of format errors (no final answer in the format); verifications that timed out or
  failed (scored 0, as in training).

Across datasets (`overall`) every number is the mean of the datasets' (the "avg" column of Qwen2.5-Math's
math_eval.py), a standard error sqrt(sum se_d^2) / D, pass@j for the j every dataset has; counts are summed.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from common.reward import extract_final_answer, score


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (0 < k <= n). Python divides
    the two integers with one correct rounding, so the result is within an ulp of the exact rational."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_curve(n: int, c: int) -> list[float]:
    """[pass@1, ..., pass@n] of one question with c of n samples correct."""
    return [pass_at_k(n, c, k) for k in range(1, n + 1)]


def majority_correct(labels: Sequence[Hashable | None], correct: Sequence[float]) -> float:
    """maj@k of one question: labels[i] is sample i's answer class (None: no answer, no vote). The classes with the
    most votes share the win: the mean over them of each class's mean correctness; 0 when nobody voted."""
    votes = Counter(a for a in labels if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    return float(np.mean([np.mean([c for a, c in zip(labels, correct) if a == t]) for t in tied]))


def answer_classes(
    answers: Sequence[Sequence[str | None]], answer_format: str, timeout_s: float = 5.0
) -> tuple[list[list[int | None]], dict[str, int]]:
    """Each question's answers as classes of equivalent answers (see the module docstring): per question, each
    sample's class index (numbered by first appearance; None for no answer), and the verifier's counts of the
    pairwise checks. Every pair of a question's distinct answers is checked in one batched `score` call (bounded in
    time like the reward), the answer inside \\boxed{} as the prediction and the earlier answer as the gold."""
    distinct = [list(dict.fromkeys(a for a in group if a is not None)) for group in answers]
    pairs = []
    if answer_format != "answer-line-strict":
        pairs = [(q, i, j) for q, d in enumerate(distinct) for j in range(len(d)) for i in range(j)]
    info = {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0}
    same: set[tuple[int, int, int]] = set()
    if pairs:
        preds = [f"\\boxed{{{distinct[q][j]}}}" for q, _, j in pairs]
        verdicts, info = score(preds, [distinct[q][i] for q, i, _ in pairs], timeout_s, answer_format="boxed")
        same = {p for p, v in zip(pairs, verdicts) if v == 1.0}
    classes = []
    for q, group in enumerate(answers):
        founders: list[int] = []  # index in distinct[q] of each class's first answer
        class_of: dict[str, int] = {}
        for j, a in enumerate(distinct[q]):
            c = next((c for c, i in enumerate(founders) if (q, i, j) in same), None)
            if c is None:
                c = len(founders)
                founders.append(j)
            class_of[a] = c
        classes.append([None if a is None else class_of[a] for a in group])
    return classes, info


@dataclass
class Scored:
    """One dataset's completions, scored: [Q, k] arrays, groups as the sampler returns them."""

    k: int
    texts: list[list[str]]
    correct: np.ndarray  # 0/1 verdicts
    lengths: np.ndarray  # tokens the model sampled (the tool's output tokens aside)
    truncated: np.ndarray  # the budget ran out before EOS or a stop string
    answers: list[list[str | None]]  # the final answer read in the format (None: a format error)
    classes: list[list[int | None]]  # maj@k's answer classes
    info: dict[str, int]  # common.reward.score's counts
    vote_info: dict[str, int]  # the same counts of maj@k's pairwise equivalence checks


def score_completions(completions, golds: Sequence[str], k: int, answer_format: str) -> Scored:
    """Scores len(golds) * k completions (groups of k contiguous) against their questions' gold answers."""
    texts = [c.text for c in completions]
    correct, info = score(texts, [g for g in golds for _ in range(k)], answer_format=answer_format)
    answers = [extract_final_answer(t, answer_format) for t in texts]
    grouped = [answers[q * k : (q + 1) * k] for q in range(len(golds))]
    classes, vote_info = answer_classes(grouped, answer_format)
    return Scored(
        k=k,
        texts=[texts[q * k : (q + 1) * k] for q in range(len(golds))],
        correct=np.asarray(correct, dtype=np.float64).reshape(len(golds), k),
        lengths=np.asarray([c.model_tokens() for c in completions], dtype=np.float64).reshape(len(golds), k),
        truncated=np.asarray([c.truncated for c in completions], dtype=bool).reshape(len(golds), k),
        answers=grouped,
        classes=classes,
        info=info,
        vote_info=vote_info,
    )


def generate_and_score(
    sampler, prompts: list[list[int]], golds: Sequence[str], k: int, temperature: float, top_p: float,
    max_new_tokens: int, answer_format: str,
) -> Scored:  # fmt: skip
    """k completions per prompt in one `sampler.generate` call (temperature 0: greedy, top-p then 1), scored."""
    top_p = top_p if temperature > 0 else 1.0
    return score_completions(sampler.generate(prompts, k, temperature, top_p, max_new_tokens), golds, k, answer_format)


def stderr(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` over questions: sample std / sqrt(Q) (NaN for fewer than 2)."""
    values = np.asarray(values, dtype=np.float64)
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if x.size else float("nan")


def summarise(s: Scored) -> dict[str, float]:
    """Every number of one dataset (module docstring), keyed as the in-training metrics after eval/<dataset>/."""
    k, questions = s.k, len(s.correct)
    per_question = s.correct.mean(axis=1)
    counts = s.correct.sum(axis=1).astype(int)
    out = {"questions": float(questions), "samples": float(k)}
    out[f"avg@{k}"], out[f"avg@{k}_stderr"] = float(per_question.mean()), stderr(per_question)
    for j in range(1, k + 1):
        values = [pass_at_k(k, int(c), j) for c in counts]
        out[f"pass@{j}"], out[f"pass@{j}_stderr"] = float(np.mean(values)), stderr(values)
    maj = [majority_correct(labels, c) for labels, c in zip(s.classes, s.correct)]
    out[f"maj@{k}"], out[f"maj@{k}_stderr"] = float(np.mean(maj)), stderr(maj)
    right = s.correct > 0
    out["response_length_mean"] = _mean(s.lengths)
    out["response_length_correct"] = _mean(s.lengths[right])
    out["response_length_incorrect"] = _mean(s.lengths[~right])
    out["truncated_frac"] = float(s.truncated.mean())
    out["format_error_frac"] = s.info["format_errors"] / s.correct.size
    out["reward_timeouts"] = float(s.info["timeouts"] + s.info["errors"])  # as train/reward_timeouts
    out["vote_check_failures"] = float(s.vote_info["timeouts"] + s.vote_info["errors"])
    return out


COUNTS = ("reward_timeouts", "vote_check_failures")  # summed over datasets, not averaged


def overall(summaries: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of the datasets' numbers (NaNs aside: a dataset without correct answers has no length of correct
    ones), standard errors combined as sqrt(sum se^2) / D, the COUNTS
    summed; pass@j for the j every dataset has, avg and maj as "avg" and "maj" (each dataset at its own k)."""
    keys = [re.sub(r"(avg|maj)@\d+", r"\1", key) for key in summaries[0]]
    renamed = [{re.sub(r"(avg|maj)@\d+", r"\1", key): v for key, v in s.items()} for s in summaries]
    out = {}
    for key in keys:
        if key in ("questions", "samples") or not all(key in s for s in renamed):
            continue
        values = np.asarray([s[key] for s in renamed], dtype=np.float64)
        finite = values[~np.isnan(values)]
        if key in COUNTS:
            out[key] = float(np.sum(values))
        elif key.endswith("_stderr"):  # NaN when a dataset has none (one question)
            out[key] = float(math.sqrt(np.sum(values**2)) / len(values))
        else:
            out[key] = float(np.mean(finite)) if len(finite) else float("nan")
    out["questions"] = float(sum(s["questions"] for s in summaries))
    return out


# the keys in-training evaluation logs under eval/<dataset>/ besides avg@k, pass@k and maj@k (docs/metrics.md)
TRAINING_KEYS = (
    "response_length_mean",
    "response_length_correct",
    "response_length_incorrect",
    "truncated_frac",
    "format_error_frac",
    "reward_timeouts",
)


def training_metrics(name: str, summary: dict[str, float], pass_ks: Sequence[int]) -> dict[str, float]:
    """In-training evaluation's keys for one dataset: eval/<name>/avg@k, pass@j for each j of `pass_ks`, maj@k and
    TRAINING_KEYS."""
    k = int(summary["samples"])
    keys = [f"avg@{k}", *(f"pass@{j}" for j in pass_ks), f"maj@{k}", *TRAINING_KEYS]
    return {f"eval/{name}/{key}": summary[key] for key in keys}


def dataset_key(name: str) -> str:
    """A dataset's name in metric keys: the file name without its extension, or the hub id's last part."""
    return os.path.splitext(os.path.basename(name.rstrip("/")))[0]


def check_samples(k: int, pass_ks: Sequence[int], samples_flag: str, pass_flag: str) -> None:
    """One line when the samples per question are fewer than 1 or a k of pass@k is not within 1..n."""
    if k < 1:
        raise SystemExit(f"{samples_flag} must be >= 1, got {k}")
    bad = [j for j in pass_ks if not 1 <= j <= k]
    if bad:
        raise SystemExit(f"{pass_flag}: pass@k needs 1 <= k <= n = {samples_flag} {k}, got {bad}")


# The offline benchmark of the champ-dataset package (CHAMP, Mao, Kim and Zhou 2024, arXiv:2401.06961; MIT licence):
# 270 competition problems, of which those whose answer is a number or a closed-form constant (sqrt(2), 1/3) are the
# ones a verifier can score; the others are statements ("No", "At least 1 number", "0 (i.e., no sequence is bounded)")
# or expressions in n that math-verify would compare as text.
_CONSTANT = re.compile(r"-?(\d+(\.\d+)?|sqrt\(\d+\))(/(\d+|sqrt\(\d+\)))?")


@functools.lru_cache(maxsize=1)  # the package's file is 73 MB of JSON (problems, model conversations)
def champ_rows() -> tuple[dict[str, str], ...]:
    """CHAMP's problems with a numeric answer, in the package's order: {"problem", "answer", "solution",
    "category", "identifier"} (the `@@` math markers removed, the solution's steps joined)."""
    try:
        import champ_dataset
    except ImportError:
        raise SystemExit("champ: needs the champ-dataset package (pip install champ-dataset==1.0.0)") from None
    rows = []
    for p in champ_dataset.load("v0").problems.values():
        answer = p.answer.strip()
        if _CONSTANT.fullmatch(answer):
            steps = " ".join(step.text for step in (p.solution.steps if p.solution else []))
            row = {"problem": p.text, "answer": answer, "solution": steps}
            rows.append({**row, "category": p.category, "identifier": p.identifier})
    return tuple(rows)
