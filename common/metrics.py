"""What a run shows beyond reward: completion statistics and evaluation scores.

Completion statistics and evaluation, shared by every script's logging: pure functions of texts and 0/1
correctness, plus `evaluate` (samples with the run's sampler) and `log_samples` (writes samples.jsonl and
TensorBoard text). No algorithm reads them: they only describe what the policy is doing.

- repetition: the fraction of a completion's word n-grams that repeat an earlier n-gram (0 = no loop).
- within-group diversity: distinct word n-grams / total n-grams over a group's completions (1 = all different).
- reflection words ("wait", "however", "let me check", ...): how often completions use them, and accuracy with
  and without them (the "aha moment" question: does reflecting go with being right?); also each pattern on its
  own (frequency and accuracy), and the response length with and without any of them. "but" is not one: it
  joins clauses in plain reasoning far more often than it marks a second look.
- accuracy of completions longer than the step's mean length against the others (does thinking longer pay?).
- language mixing: a completion holding both a CJK character and a Latin word of two or more letters (LaTeX
  commands such as \\frac are not words).
- evaluation (`evaluate`): common/evaluation.py's scores, which evaluate.py reports too.
- `health_metrics`: all of the above over all ranks: each rank reduces its texts to per-completion numbers
  (`text_features`), which are gathered with correctness and lengths, so 2 processes log what 1 process holding
  every completion would (`completion_stats`).
- `rollout_metrics` / `log_samples`: the step's reward, accuracy and length metrics over all ranks, and a few
  prompt/completion/reward samples, as every script logs them.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from common.args import SharedArgs
from common.evaluation import (  # noqa: F401 - pass_at_k and majority_correct: their home before common/evaluation.py
    dataset_key,
    generate_and_score,
    majority_correct,
    pass_at_k,
    summarise,
    training_metrics,
)

REFLECTION_WORDS = (
    "wait",
    "however",
    "let me check",
    "let me verify",
    "re-evaluate",
    "recheck",
    "mistake",
    "alternatively",
    "double-check",
)
_REFLECTION = re.compile(r"\b(" + "|".join(re.escape(w) for w in REFLECTION_WORDS) + r")\b", re.IGNORECASE)
_WORD = re.compile(r"\w+|[^\w\s]")
_PATTERNS = {w: re.compile(r"\b" + re.escape(w) + r"\b", re.IGNORECASE) for w in REFLECTION_WORDS}
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # not preceded by a backslash: LaTeX commands are no words


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """Word-level n-grams (words and punctuation marks are tokens, lower-cased)."""
    words = [w.lower() for w in _WORD.findall(text)]
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def repetition_rate(text: str, n: int = 4) -> float:
    """Fraction of the text's n-grams that already occurred earlier in it (0 when it has none)."""
    grams = ngrams(text, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def distinct_ngrams(texts: Sequence[str], n: int = 2) -> float:
    """Distinct n-grams / all n-grams over `texts` (1.0 when there are none)."""
    grams = [g for t in texts for g in ngrams(t, n)]
    return len(set(grams)) / len(grams) if grams else 1.0


def has_reflection(text: str) -> bool:
    """Whether the text uses one of REFLECTION_WORDS (whole words, any case)."""
    return _REFLECTION.search(text) is not None


def language_mix(text: str) -> bool:
    """Whether the text holds both a CJK character and a Latin word (two or more letters, not a LaTeX command)."""
    return _CJK.search(text) is not None and _LATIN_WORD.search(text) is not None


def pattern_key(word: str) -> str:
    """Metric-key spelling of a reflection pattern: "let me check" -> "let_me_check"."""
    return re.sub(r"[^a-z]+", "_", word.lower())


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


FEATURES = ("repetition_rate", "group_distinct_2gram", "reflection", "language_mix") + tuple(_PATTERNS)


def text_features(texts: Sequence[str], group_size: int) -> np.ndarray:
    """[len(texts), len(FEATURES)] numbers per completion (groups of `group_size` contiguous): 4-gram repetition,
    its group's distinct 2-gram fraction, any reflection word (0/1), language mixing (0/1), each pattern (0/1)."""
    groups = [texts[i : i + group_size] for i in range(0, len(texts), group_size)]
    distinct = []
    for g in groups:  # once per group, repeated on each of its completions
        distinct += [distinct_ngrams(g, 2)] * len(g)
    rows = [
        [
            repetition_rate(t),
            d,
            has_reflection(t),
            language_mix(t),
            *(p.search(t) is not None for p in _PATTERNS.values()),
        ]
        for t, d in zip(texts, distinct)
    ]
    return np.asarray(rows, dtype=np.float64).reshape(len(texts), len(FEATURES))


def stats_from_features(
    features: np.ndarray, correct: Sequence[float], lengths: Sequence[float] | None = None
) -> dict[str, float]:
    """completion_stats from `text_features` rows (of one rank or gathered over all). The group distinct fraction
    is repeated on each of a group's completions, so its mean over completions is the mean over groups."""
    f = {k: features[:, j] for j, k in enumerate(FEATURES)}
    correct, n = np.asarray(correct, dtype=np.float64), len(features)
    refl = f["reflection"] > 0
    out = {
        "repetition_rate": float(np.mean(f["repetition_rate"])) if n else 0.0,
        "group_distinct_2gram": float(np.mean(f["group_distinct_2gram"])) if n else 1.0,
        "reflection_frac": float(np.mean(refl)) if n else 0.0,
        "accuracy_with_reflection": _mean(correct[refl]),
        "accuracy_without_reflection": _mean(correct[~refl]),
        "language_mix_frac": float(np.mean(f["language_mix"])) if n else 0.0,
    }
    for w in _PATTERNS:
        hit = f[w] > 0
        out[f"reflection/{pattern_key(w)}_frac"] = float(np.mean(hit)) if n else 0.0
        out[f"reflection/{pattern_key(w)}_accuracy"] = _mean(correct[hit])
    if lengths is not None:
        lengths = np.asarray(lengths, dtype=np.float64)
        long = lengths > (float(np.mean(lengths)) if n else 0.0)
        out["response_length_with_reflection"] = _mean(lengths[refl])
        out["response_length_without_reflection"] = _mean(lengths[~refl])
        out["accuracy_long"] = _mean(correct[long])
        out["accuracy_short"] = _mean(correct[~long])
    return out


def completion_stats(
    texts: Sequence[str], correct: Sequence[float], group_size: int, lengths: Sequence[float] | None = None
) -> dict[str, float]:
    """Per-step text statistics of a rollout whose groups of `group_size` are contiguous; with `lengths` (tokens
    per completion) also lengths with/without reflection and the accuracy of long (> the mean) and short ones."""
    return stats_from_features(text_features(texts, group_size), correct, lengths)


def health_metrics(texts: Sequence[str], correct, lengths, group_size: int, accelerator) -> dict[str, float]:
    """train/ completion statistics of all ranks' completions: this rank's `text_features`, correctness and
    lengths ([n] tensors) are gathered (float64, padded with NaN where ranks hold different counts), so the result
    is `completion_stats` of every rank's completions, groups kept whole."""
    x = torch.cat(
        [
            torch.as_tensor(text_features(texts, group_size), device=correct.device),
            correct.double().reshape(-1, 1),
            lengths.double().reshape(-1, 1),
        ],
        dim=1,
    )
    x = accelerator.gather(accelerator.pad_across_processes(x, pad_index=float("nan")))
    x = x[~x[:, 0].isnan()].cpu().numpy()
    return {f"train/{k}": v for k, v in stats_from_features(x[:, :-2], x[:, -2], x[:, -1]).items()}


def evaluate(sampler, eval_sets, args: SharedArgs) -> dict[str, float]:
    """Every evaluation set ({name: (prompt ids, golds)}) through common.evaluation, evaluate.py's code path: k =
    --eval-samples completions per question at --eval-temperature (0: greedy, top-p then 1), --eval-top-p and
    --eval-max-new-tokens, one sampler call per set, the final answer read in the run's resolved --reward-format.
    Logs eval/<dataset>/avg@k, pass@j for each j of --eval-pass-k (default k), maj@k (math-verify-equivalent answers
    vote together), lengths, truncation, format errors and verifier timeouts (docs/metrics.md). With --env the golds
    are its held-out tasks and an episode is correct when the environment calls it a success (no maj@k: no final
    answer)."""
    k, start = args.eval_samples, time.time()
    temperature, metrics = args.eval_temperature, {}
    for name, (prompts, golds) in eval_sets.items():
        if args.env != "none":
            top_p = args.eval_top_p if temperature > 0 else 1.0
            outs = sampler.generate(prompts, k, temperature, top_p, args.eval_max_new_tokens, golds)
            groups = [[float(o.env.success) for o in outs[q * k : (q + 1) * k]] for q in range(len(prompts))]
            short = name.split(":")[-1]
            metrics[f"eval/{short}/avg@{k}"] = float(np.mean([np.mean(c) for c in groups]))
            for j in args.eval_pass_k or [k]:
                metrics[f"eval/{short}/pass@{j}"] = float(np.mean([pass_at_k(k, int(sum(c)), j) for c in groups]))
            continue
        scored = generate_and_score(
            sampler, prompts, golds, k, args.eval_temperature, args.eval_top_p, args.eval_max_new_tokens,
            args.reward_format,
        )  # fmt: skip
        metrics.update(training_metrics(dataset_key(name), summarise(scored), args.eval_pass_k or [k]))
    metrics["time/eval"] = time.time() - start
    return metrics


def gather(accelerator, x: torch.Tensor) -> torch.Tensor:
    """Every rank's values of `x` (flattened, as float) in one 1-D tensor; ranks may hold different counts."""
    if isinstance(x, DTensor):  # FSDP2's clip_grad_norm_ returns the norm as a DTensor
        x = x.full_tensor()
    x = accelerator.pad_across_processes(x.float().reshape(-1), pad_index=float("nan"))
    x = accelerator.gather(x)
    return x[~x.isnan()]


# the stats an update keeps as running extremes (min / max over micro-batches, then over ranks); the others are means
EXTREMES = {
    "rollout_corr_weight_min": torch.minimum,
    "rollout_corr_weight_max": torch.maximum,
    "logprob_diff_max": torch.maximum,
}


def add_stats(sums: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], weight: float) -> None:
    """Adds one micro-batch's stats (0-d tensors) to `sums`: weight * value, so that with weight 1 / (updates per
    rollout) the sums are means over the rollout, or the running min / max for the keys of EXTREMES. On the device."""
    for k, v in stats.items():
        v = v.detach()
        if k in EXTREMES:
            sums[k] = EXTREMES[k](sums[k], v) if k in sums else v
        else:
            sums[k] = sums.get(k, 0.0) + v * weight


class Timer:
    """Seconds spent in each phase of a step: `lap(name)` adds the time since the previous lap to `name`."""

    def __init__(self) -> None:
        self.start = self.last = time.time()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now

    def elapsed(self) -> float:
        return time.time() - self.start


def step_metrics(accelerator, completions, correct, rewards, reward_info, stats, timer, group_size) -> dict:
    """A step's metrics over all ranks (docs/metrics.md). completions, correct [N], rewards [N]: the policy's own
    samples (before injection or replay) and their verdicts; reward_info: common.reward.score's counts; stats: the
    update's sums (update_policy: means over the rollout, EXTREMES as extremes) and values that are the same on every
    rank (floats); timer: the step's phases."""
    device, correct = correct.device, (correct == 1).float()  # a score of 1 (--partial-credit: rewards only)
    lengths = torch.tensor([c.model_tokens() for c in completions], device=device)  # the tool's tokens aside
    truncated = torch.tensor([c.truncated for c in completions], device=device)
    all_lengths = gather(accelerator, lengths)
    counts = [reward_info["timeouts"] + reward_info["errors"], reward_info["format_errors"]]
    failed, format_errors = accelerator.reduce(torch.tensor(counts, device=device, dtype=torch.float64), "sum")
    metrics = rollout_metrics(
        gather(accelerator, correct),
        all_lengths,
        gather(accelerator, rewards),
        gather(accelerator, truncated),
        group_size,
    )
    metrics["train/reward_timeouts"] = failed.item()  # verifications that timed out or failed, scored 0
    metrics["train/format_error_frac"] = format_errors.item() / len(all_lengths)
    metrics.update(health_metrics([c.text for c in completions], correct, lengths, group_size, accelerator))
    if completions and completions[0].tool is not None:  # a run with the tool (common/tool.py)
        metrics.update(tool_metrics(accelerator, completions))
    if completions and completions[0].env is not None:  # a run with an environment (common/env.py)
        metrics.update(env_metrics(accelerator, completions))
    for k, v in stats.items():
        if isinstance(v, torch.Tensor):
            v = gather(accelerator, v)
            v = v.mean() if k not in EXTREMES else (v.min() if EXTREMES[k] is torch.minimum else v.max())
        metrics[f"train/{k}"] = float(v)
    step_time = timer.elapsed()
    metrics.update({f"time/{k}": v for k, v in timer.laps.items()})
    metrics.update({"time/step": step_time, "time/tokens_per_s": all_lengths.sum().item() / step_time})
    return metrics


def tool_metrics(accelerator, completions) -> dict[str, float]:
    """tool/ metrics of a rollout with the tool, over all ranks: programs per completion, the share of completions
    that ran one, the share of programs that failed or timed out, the programs' seconds (summed; they run in parallel,
    so more than the step's wall time is possible) and the share of them that overlapped generation, and the tool's
    output tokens per completion (in the sequence, out of the loss)."""
    rows = [
        [t.calls, t.calls > 0, t.errors, t.timeouts, t.seconds, t.overlap_seconds, len(c.token_ids) - c.model_tokens()]
        for c in completions
        if (t := c.tool) is not None
    ]
    totals = torch.tensor(rows or [[0.0] * 7], dtype=torch.float64, device=accelerator.device).sum(0)
    count = torch.tensor([float(len(rows))], dtype=torch.float64, device=accelerator.device)
    calls, used, errors, timeouts, seconds, overlap, tokens, n = accelerator.reduce(
        torch.cat([totals, count]), "sum"
    ).tolist()
    return {
        "tool/calls_per_completion": calls / max(n, 1.0),
        "tool/call_frac": used / max(n, 1.0),
        "tool/error_frac": errors / calls if calls else float("nan"),
        "tool/timeout_frac": timeouts / calls if calls else float("nan"),
        "tool/seconds": seconds,
        "tool/overlap_frac": overlap / seconds if seconds else float("nan"),
        "tool/output_tokens_mean": tokens / max(n, 1.0),
    }


def env_metrics(accelerator, completions) -> dict[str, float]:
    """env/ metrics of a rollout with an environment, over all ranks: turns answered, return and success per
    episode, episodes whose environment raised (ended with reward 0), episodes the turn cap ended, observation
    tokens per episode (in the sequence, out of the loss) and observations cut to the budget; time/env, the seconds
    the environment took to answer (summed over a rank's episodes, mean over ranks), against time/generate."""
    rows = [
        [e.turns, e.reward, e.success, bool(e.error), e.capped, e.obs_tokens, e.obs_truncated, e.seconds]
        for c in completions
        if (e := c.env) is not None
    ]
    totals = torch.tensor(rows or [[0.0] * 8], dtype=torch.float64, device=accelerator.device).sum(0)
    count = torch.tensor([float(len(rows)), 1.0], dtype=torch.float64, device=accelerator.device)
    turns, reward, success, errors, capped, obs, cut, seconds, n, ranks = accelerator.reduce(
        torch.cat([totals, count]), "sum"
    ).tolist()
    n = max(n, 1.0)
    return {
        "env/turns_mean": turns / n,
        "env/reward_mean": reward / n,
        "env/success_frac": success / n,
        "env/errors": errors,
        "env/capped_frac": capped / n,
        "env/obs_tokens_mean": obs / n,
        "env/obs_truncated": cut,
        "time/env": seconds / ranks,
    }


def rollout_metrics(correct, lengths, rewards, truncated, group_size: int) -> dict[str, float]:
    """train/ metrics of the policy's own samples (before injection or replay): correct, lengths, rewards, truncated
    are [N] tensors over all ranks, groups of group_size contiguous."""
    group_acc = correct.view(-1, group_size).mean(1)
    right, wrong = lengths[correct > 0], lengths[correct == 0]
    p50, p90 = torch.quantile(lengths.double(), torch.tensor([0.5, 0.9], dtype=torch.float64, device=lengths.device))
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std().item(),
        "train/accuracy": correct.mean().item(),
        "train/response_length_mean": lengths.mean().item(),
        "train/response_length_max": lengths.max().item(),
        "train/response_length_p50": p50.item(),  # linear interpolation between order statistics (numpy's default)
        "train/response_length_p90": p90.item(),
        "train/response_length_correct": right.mean().item() if len(right) else float("nan"),
        "train/response_length_incorrect": wrong.mean().item() if len(wrong) else float("nan"),
        "train/truncated_frac": truncated.float().mean().item(),
        "train/groups_all_correct": (group_acc == 1).float().mean().item(),
        "train/groups_all_wrong": (group_acc == 0).float().mean().item(),
    }


def log_samples(writer, run_dir: str, step: int, prompts, texts: list[str], rewards, group_size: int, decode):
    """The first completion of up to 4 groups, with its prompt and reward, to samples.jsonl and TensorBoard.
    prompts: token ids, one list per group (decoded by `decode`, only those written); texts, rewards: one per
    completion."""
    samples = [
        {"step": step, "prompt": decode(prompts[i // group_size]), "completion": texts[i], "reward": float(rewards[i])}
        for i in range(0, min(len(texts), 4 * group_size), group_size)
    ]
    with open(os.path.join(run_dir, "samples.jsonl"), "a") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    text = "\n\n---\n\n".join(
        f"**prompt** {s['prompt']}\n\n**completion** {s['completion']}\n\n**reward** {s['reward']}" for s in samples
    )
    writer.add_text("samples", text, step)
