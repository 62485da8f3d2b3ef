"""The data strategies: which prompts a step draws and what a group holds. They are part of no algorithm's story, all
off by default, and `common.data.TrainData` applies them with the same lines in every script; the definitions and
measurements are in docs/data_strategies.md.

- `PromptTracker`: per-prompt counts over every rollout, gathered over ranks, forgetting with --tracker-half-life;
  the estimated pass rate is (correct + 1) / (samples + 2), so an unseen prompt counts as 0.5.
- `draw_probabilities` / `draw_prompts`: --prompt-sampling medium weights a prompt by s(p) = 1 - p^G - (1 - p)^G, the
  chance that its group has a signal; curriculum also by a Gaussian around a target going from 1 to
  --curriculum-min-target; prioritized by 1 - p (Kimi k1.5 §2.3.4, "proportional to 1 - s_i"); hard-after-warmup
  (Kimi k1.5 §2.3.4 and Fig. 9) draws as uniform for --hard-warmup-steps steps, then only the prompts whose p is
  below --hard-pass-rate, all alike (all of them while none is). A share --uniform-floor of every mode but uniform is
  uniform (ours, not Kimi's: a prompt solved now keeps f / N and can come back), and a step never draws a prompt
  twice.
- `inject_and_replay` (before the batch is built): --gt-injection and --replay; `update_replay` (after the old
  log-probs): returns them with the replayed rows' stored ones, and stores new high-value groups.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from common.args import SharedArgs
from common.sampling import Completion

CURRICULUM_STD = 0.2  # --prompt-sampling curriculum: width of the Gaussian around the moving target pass rate
REPLAY_HARD, REPLAY_EASY = (0.2, 0.8)  # a group is high-value when its prompt's estimate is below / above these
REPLAY_RATIO_CAP = 3.0  # dual-clip's c (Ye et al. 2020; verl's clip_ratio_c): the bound on replayed rows with A < 0


class PromptTracker:
    """Per-prompt counts over all ranks' rollouts, decayed by the forgetting rule (float64)."""

    def __init__(self, num_prompts: int) -> None:
        self.samples = np.zeros(num_prompts)
        self.correct = np.zeros(num_prompts)
        self.groups = np.zeros(num_prompts)  # groups sampled per prompt over the run (never forgotten): coverage

    def update(self, rows: list[int], correct: list[float], group_size: int, half_life: float = 0.0) -> None:
        """Adds one step's rollout: `rows` one prompt index per group, `correct` one value per completion, after
        multiplying every count by 0.5 ** (1 / half_life) (half_life 0: no forgetting)."""
        if half_life > 0:
            decay = 0.5 ** (1.0 / half_life)
            self.samples *= decay
            self.correct *= decay
        np.add.at(self.groups, np.asarray(rows, dtype=np.int64), 1.0)
        idx = np.repeat(np.asarray(rows, dtype=np.int64), group_size)
        np.add.at(self.samples, idx, 1.0)
        np.add.at(self.correct, idx, np.asarray(correct, dtype=np.float64))

    def pass_rate(self) -> np.ndarray:
        """Posterior mean pass rate under a Beta(1, 1) prior: (correct + 1) / (samples + 2); 0.5 when unseen."""
        return (self.correct + 1.0) / (self.samples + 2.0)

    def load_prior(self, path: str, keys: list[str]) -> int:
        """Counts from a tools/profile_data.py file: a row of K samples at pass rate p counts as K samples of which
        p K were correct. A row goes to its `index` when that training prompt decodes to its `prompt` text (same data
        and template), else to every training prompt with that text. Returns the rows matched."""
        where: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            where.setdefault(k, []).append(i)
        matched = 0
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                i = row.get("index")
                same = isinstance(i, int) and 0 <= i < len(keys) and keys[i] == row.get("prompt")
                targets = [i] if same else where.get(row.get("prompt"), [])
                k = float(row.get("samples", 1))
                for i in targets:
                    self.samples[i] += k
                    self.correct[i] += float(row["pass_rate"]) * k
                matched += bool(targets)
        return matched

    def state_dict(self) -> dict[str, list[float]]:
        return {k: getattr(self, k).tolist() for k in ("samples", "correct", "groups")}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for k in ("samples", "correct", "groups"):
            getattr(self, k)[:] = np.asarray(state[k], dtype=np.float64)


def signal_chance(pass_rate: np.ndarray, group_size: int) -> np.ndarray:
    """s(p) = 1 - p^G - (1 - p)^G, the chance that a group of G completions at pass rate p holds a right and a
    wrong one (computed as -expm1(G log1p(-p)) - p^G, exact for small p)."""
    return -np.expm1(group_size * np.log1p(-pass_rate)) - pass_rate**group_size


def sampling_weights(
    pass_rate: np.ndarray, mode: str, progress: float, min_target: float, group_size: int, hard_below: float = 0.5
) -> np.ndarray:
    """Unnormalised draw weight of each prompt (see the module docstring for the definitions)."""
    if mode == "medium":
        return signal_chance(pass_rate, group_size)
    if mode == "curriculum":
        target = 1.0 - (1.0 - min_target) * min(max(progress, 0.0), 1.0)
        return signal_chance(pass_rate, group_size) * np.exp(-((pass_rate - target) ** 2) / (2 * CURRICULUM_STD**2))
    if mode == "prioritized":
        return 1.0 - pass_rate  # > 0: the tracker's estimate is below 1
    if mode == "hard-after-warmup":
        hard = (pass_rate < hard_below).astype(np.float64)
        return hard if hard.any() else np.ones_like(pass_rate)
    raise ValueError(f"no weights for --prompt-sampling {mode!r}")


def draw_probabilities(
    pass_rate: np.ndarray,
    mode: str,
    progress: float,
    floor: float,
    min_target: float,
    group_size: int,
    hard_below: float = 0.5,
) -> np.ndarray:
    """P(i) = (1 - floor) w_i / sum w + floor / N: the weights with a uniform share `floor` (w > 0 for 0 < p < 1)."""
    w = sampling_weights(pass_rate, mode, progress, min_target, group_size, hard_below)
    return (1.0 - floor) * w / w.sum() + floor / len(w)


def draw_prompts(p: np.ndarray, seed: int, position: int, count: int) -> list[int]:
    """`count` prompt indices drawn from `p` without replacement (successive sampling: the first with P(i), the
    next from the rest renormalised, ...; as Gumbel top-k: the largest log p_i + Gumbel noise), from an RNG keyed by
    (seed, position) alone: every rank draws the same list, a resumed run the same as before. More than len(p):
    passes of len(p) each. Prompts of probability 0 (hard-after-warmup without a floor) come after all the others,
    in random order."""
    rng, out = np.random.default_rng([seed, position, 11]), []
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    while len(out) < count:
        keys = logp + rng.gumbel(size=len(p))
        if np.isinf(logp).any():  # -inf keys tie: a random order among them
            order = np.lexsort((rng.random(len(p)), -keys))
        else:
            order = np.argsort(-keys, kind="stable")
        out += order[: count - len(out)].tolist()
    return out


@dataclass
class ReplayBuffer:
    """High-value groups with their generating policy's per-token log-probs and step, newest last, at most `size`."""

    size: int
    groups: list[dict[str, Any]] = field(default_factory=list)

    def push(self, group: dict[str, Any]) -> None:
        self.groups.append(group)
        del self.groups[: max(0, len(self.groups) - self.size)]  # the oldest go first

    def pop(self, step: int, max_age: int) -> dict[str, Any] | None:
        """The newest group (the least stale), removed: a group is replayed once. Groups generated more than
        `max_age` steps before `step` are dropped."""
        self.groups = [g for g in self.groups if step - g["step"] <= max_age]
        return self.groups.pop() if self.groups else None

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "groups": self.groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [dict(g) for g in state["groups"]]


class Demonstration(NamedTuple):
    """A verified demonstration for --gt-injection; `bare` when it is the bare reference answer (no worked solution,
    or the solution did not fit or verify)."""

    completion: Completion
    bare: bool


class RewardInputs(NamedTuple):
    """What a script's compute_rewards reads, one value per completion ([N] tensors)."""

    correct: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor


@dataclass
class TrainGroups:
    """What the step trains on: one prompt per group, completions and their scores (groups contiguous; 1 is correct,
    a score below 1 other than 0 comes with --partial-credit), the stored old log-probs of replayed rows, and how the
    groups came about."""

    prompts: list[list[int]]
    completions: list[Completion]
    correct: list[float]
    rows: list[int]  # per group: the training row sampled for it (before any replay)
    pass_rate: list[float]  # per group: the tracker's estimate for its prompt, before this step
    step: int
    fresh: list[bool] = field(default_factory=list)  # per group: sampled this step (maybe with a demonstration)
    injected: list[bool] = field(default_factory=list)  # per group
    stored_logps: dict[int, list[float]] = field(default_factory=dict)  # completion row -> generating policy's
    replayed: int = 0
    bare: int = 0  # injected demonstrations that are the bare answer (no solution, or it did not fit or verify)

    @property
    def changed(self) -> bool:
        """True when some group is not this step's own sample (injected or replayed): its rewards differ."""
        return any(self.injected) or self.replayed > 0

    def tensors(self, device) -> RewardInputs:
        """The trained completions' correctness, lengths and truncation, for compute_rewards."""
        return RewardInputs(
            correct=torch.tensor(self.correct, device=device),
            lengths=torch.tensor([len(c.token_ids) for c in self.completions], device=device),
            truncated=torch.tensor([c.truncated for c in self.completions], device=device),
        )


def inject_and_replay(
    args: SharedArgs, buffer: ReplayBuffer, demo, pass_rate, rows, prompts, completions, correct, step: int, keep=None
) -> TrainGroups:
    """The groups to train on. rows/prompts: one per group; completions/correct: per completion; keep: the groups
    trained on, in order (default all; dapo/cispo's kept groups); demo(row): the row's verified Demonstration or
    None; pass_rate: the tracker's estimates. --gt-injection: an all-wrong group's last completion becomes the row's
    demonstration, for at most --gt-injection-max-frac of the kept groups (the first ones). --replay: a group whose
    rewards are all equal (all correct, or all wrong and not injected) is replaced by the buffer's newest group of at
    most --replay-max-age steps. The inputs are not modified (they stay the policy's own samples)."""
    g = args.group_size
    keep = range(len(rows)) if keep is None else keep
    out = TrainGroups(
        prompts=[prompts[k] for k in keep],
        completions=[completions[k * g + j] for k in keep for j in range(g)],
        correct=[correct[k * g + j] for k in keep for j in range(g)],
        rows=[rows[k] for k in keep],
        pass_rate=[float(pass_rate[rows[k]]) for k in keep],
        step=step,
        fresh=[True] * len(keep),
        injected=[False] * len(keep),
    )
    max_injected = math.floor(args.gt_injection_max_frac * len(keep) + 1e-9) if args.gt_injection else 0
    for k, row in enumerate(out.rows):
        group = out.correct[k * g : (k + 1) * g]
        d = demo(row) if args.gt_injection and max(group) < 1 and sum(out.injected) < max_injected else None
        if d is not None:
            out.completions[(k + 1) * g - 1], out.correct[(k + 1) * g - 1] = d.completion, 1.0
            out.injected[k] = True
            out.bare += d.bare
        elif args.replay and min(group) == max(group) and (old := buffer.pop(step, args.replay_max_age)):
            out.prompts[k], out.fresh[k] = old["prompt"], False
            masks = old.get("masks") or [None] * len(old["token_ids"])  # with the tool: 0 on its output tokens
            stored = zip(old["token_ids"], old["texts"], old["truncated"], old["correct"], old["logps"], masks)
            for j, (ids, text, trunc, c, lp, m) in enumerate(stored):
                out.completions[k * g + j] = Completion(token_ids=ids, text=text, truncated=trunc, mask=m)
                out.correct[k * g + j] = c
                out.stored_logps[k * g + j] = lp
            out.replayed += 1
    return out


def update_replay(
    buffer: ReplayBuffer, groups: TrainGroups, old_logps: Tensor, advantages: Tensor, group_size: int
) -> Tensor:
    """After the old log-probs are computed: returns them with the replayed rows' replaced by their stored ones (the
    ratio is then against the policy that generated them), raised where needed so that a row with A < 0 (with
    per-token advantages, a token with A < 0) starts the step with ratio at most REPLAY_RATIO_CAP (dual-clip's bound:
    PPO's clip leaves r A unbounded below for A < 0, and a stale token can have a huge ratio); `old_logps` itself is
    not modified. This step's high-value groups enter the buffer with their log-probs (the returned ones) and step:
    a hard prompt solved (estimate < REPLAY_HARD), an easy prompt failed (estimate > REPLAY_EASY), or an injected
    group; only groups with signal (0 < #correct < G). old_logps [N, C] and advantages ([N], or [N, C] per token)
    are the batch's, whose rows are the groups' completions, in order."""
    old, g = old_logps.clone(), group_size
    for r, lp in groups.stored_logps.items():
        stored = torch.tensor(lp, dtype=old.dtype, device=old.device)
        adv = advantages[r]  # one per row, or one per token (reinforce_pp.py's [N, T])
        negative = adv[: len(lp)] < 0 if adv.dim() else adv < 0
        floor = old_logps[r, : len(lp)] - math.log(REPLAY_RATIO_CAP)  # pi / pi_old <= cap, pi the policy now
        old[r, : len(lp)] = torch.where(negative, torch.maximum(stored, floor), stored)
    for k, prompt in enumerate(groups.prompts):
        c = groups.correct[k * g : (k + 1) * g]
        hard, easy = groups.pass_rate[k] < REPLAY_HARD, groups.pass_rate[k] > REPLAY_EASY
        if groups.fresh[k] and 0 < sum(x == 1 for x in c) < g and (hard or easy or groups.injected[k]):
            comps = groups.completions[k * g : (k + 1) * g]
            logps = old[k * g : (k + 1) * g].tolist()
            stored = {
                "prompt": list(prompt),
                "token_ids": [list(x.token_ids) for x in comps],
                "texts": [x.text for x in comps],
                "truncated": [bool(x.truncated) for x in comps],
                "correct": [float(x) for x in c],
                "logps": [lp[: len(x.token_ids)] for lp, x in zip(logps, comps)],
                "step": groups.step,
            }
            if any(x.mask is not None for x in comps):  # the tool's: its output tokens stay out of the loss
                stored["masks"] = [x.mask for x in comps]
            buffer.push(stored)
    return old
