"""Data shared by every script: loading and prompt order, and the data strategies (docs/design.md "Data
strategies").

- loading (identical for every algorithm): the templates (`SYSTEM_BOXED`, `R1_TEMPLATE`, `DAPO_TEMPLATE`) and
  `format_prompt`, `load_rows` (a hub dataset or a local .jsonl/.json/.parquet file), `encode_prompts`
  (tokenised, over-long prompts and unparseable answers dropped and counted), `epoch_order` / `step_indices` (a
  step's prompts: shuffled epochs keyed by (seed, step), so --resume replays them).

The data strategies below are not part of an algorithm's story either: they decide which prompts a step draws and
what a group holds. All are off by default; the scripts call them with identical lines (docs/data_strategies.md).

- `PromptTracker`: per-prompt sample and correct counts over every rollout, gathered over ranks, optionally seeded
  by `--difficulty-file` (tools/profile_data.py's output). Estimated pass rate: the posterior mean under a
  Beta(1, 1) prior, (correct + 1) / (samples + 2), so an unseen prompt counts as 0.5. Forgetting: before each
  step's counts are added, all counts are multiplied by 0.5 ** (1 / --tracker-half-life), so an observation
  weighs half after that many steps: estimates follow the moving policy, and a prompt not drawn for long drifts
  back to 0.5 (uncertain) instead of keeping what an early policy did on it.
- `draw_probabilities` / `draw_prompts`: `--prompt-sampling medium` weights a prompt by the chance that a group of
  G completions at its estimated pass rate p has a signal (some right, some wrong), w = 1 - p^G - (1 - p)^G;
  `curriculum` by exp(-(p - tau)^2 / (2 * 0.2^2)),
  the target tau going linearly from 1 (easy) to --curriculum-min-target over the run. A share --uniform-floor
  of the probability is uniform, P(i) = (1 - f) w_i / sum w + f / N, so no prompt starves; the step's prompts
  are drawn from P without replacement (successive sampling, as Gumbel top-k), so none takes two groups of a
  step. The RNG is keyed by (seed, step): every rank draws the same list (the tracker is identical everywhere)
  and takes its slice.
- `train_groups` (before the batch is built): `inject_and_replay`, then the tracker counts the step's own samples.
  `--gt-injection` replaces the last completion of an all-wrong group by a verified demonstration (on at most
  --gt-injection-max-frac of a rank's groups); `--replay` replaces a group with no signal (all rewards equal)
  by the newest group of a `ReplayBuffer` of high-value groups at most --replay-max-age steps old, whose
  per-token log-probs under the generating policy were stored. `finish_batch` (after): replayed rows take those
  log-probs, with the ratio of rows with A < 0 capped at REPLAY_RATIO_CAP, and new high-value groups are stored.
  `data_metrics`: what the strategies did this step (data/* keys, docs/metrics.md).
- health metrics live in common/metrics.py (`health_metrics`, over all ranks).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.reward import answer_format_for, find_unparseable_gold, gold_text, score
from common.sampling import Completion

CURRICULUM_STD = 0.2  # --prompt-sampling curriculum: width of the Gaussian around the moving target pass rate
REPLAY_HARD, REPLAY_EASY = 0.2, 0.8  # a group is high-value when its prompt's estimate is below / above these
REPLAY_RATIO_CAP = 3.0  # dual-clip's c (Ye et al. 2020; verl's clip_ratio_c): the bound on replayed rows with A < 0
DEMO_FORMAT = {
    "none": "The answer is \\boxed{{{a}}}.",
    "qwen-boxed": "The answer is \\boxed{{{a}}}.",
    "r1": " The answer is {a}. </think> <answer> {a} </answer>",
    "dapo": "Answer: {a}",
}


# Loading: datasets, prompt templates and each step's prompts (identical for every algorithm)
SYSTEM_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\nAssistant: <think>"
)
STOP_STRINGS = {"r1": ["</answer>"]}  # a completion ends there (understand-r1-zero's stop), kept in its text
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def format_prompt(question: str, template: str, tokenizer) -> str:
    """The text the model is asked to continue; chat templates go through the tokenizer's own."""
    if template == "none":
        return question
    if template == "r1":
        return R1_TEMPLATE.format(question=question)
    if template == "qwen-boxed":
        messages = [{"role": "system", "content": SYSTEM_BOXED}, {"role": "user", "content": question}]
    else:
        messages = [
            {
                "role": "user",
                "content": question
                if question.startswith(DAPO_TEMPLATE[:46])
                else DAPO_TEMPLATE.format(question=question),
            }
        ]  # DAPO-Math-17k's prompts carry it already
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def load_rows(name: str, config: str | None, split: str, prompt_column: str, answer_column: str, flag: str):
    """Questions and answers from a hub dataset or a local .jsonl/.json/.parquet file."""
    import datasets

    datasets.logging.set_verbosity_error()
    ext = os.path.splitext(name)[1].lower()
    try:
        if ext in (".jsonl", ".json", ".parquet"):
            if not os.path.exists(name):
                raise SystemExit(f"{flag}: no such file {name!r}")
            if os.path.getsize(name) == 0:
                raise SystemExit(f"{flag}: dataset {name!r} is empty")
            ds = datasets.load_dataset("parquet" if ext == ".parquet" else "json", data_files=name, split="train")
        else:
            ds = datasets.load_dataset(name, config, split=split)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - any loading failure becomes one clear line
        raise SystemExit(
            f"{flag}: could not load {name!r} (split {split!r}): {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        ) from None
    for col, col_flag in ((prompt_column, "--prompt-column"), (answer_column, "--answer-column")):
        if col not in ds.column_names:
            raise SystemExit(f"{col_flag}: column {col!r} not in {name!r}; available: {ds.column_names}")
    if len(ds) == 0:
        raise SystemExit(f"{flag}: dataset {name!r} split {split!r} is empty")
    return [str(q) for q in ds[prompt_column]], [str(a) for a in ds[answer_column]]


def encode_prompts(questions, answers, tokenizer, template: str, max_tokens: int, max_bad_frac: float, flag: str):
    """Tokenised prompts (in --prompt-template `template`) and their answers; prompts over `max_tokens` tokens and
    unparseable answers dropped (refused when more than `max_bad_frac` of the answers cannot be parsed)."""
    bad = set(find_unparseable_gold(answers))
    if len(bad) > max_bad_frac * len(answers):
        examples = [answers[i][:60] for i in sorted(bad)[:3]]
        raise SystemExit(
            f"{flag}: {len(bad)} of {len(answers)} answers cannot be parsed, "
            f"more than --max-bad-answer-frac {max_bad_frac}; e.g. {examples}"
        )
    prompts, golds, too_long = [], [], 0
    for i, (q, a) in enumerate(zip(questions, answers)):
        ids = tokenizer(format_prompt(q, template, tokenizer), add_special_tokens=False).input_ids
        if len(ids) > max_tokens:
            too_long += 1
        elif i not in bad:
            prompts.append(ids)
            golds.append(a)
    if bad:
        examples = [answers[i][:60] for i in sorted(bad)[:3]]
        print(f"{flag}: dropped {len(bad)} rows whose answer cannot be parsed, e.g. {examples}")
    if too_long:
        print(f"{flag}: dropped {too_long} prompts longer than --max-prompt-tokens {max_tokens}")
    if not prompts:
        raise SystemExit(
            f"{flag}: no usable rows left (unparseable answers: {len(bad)}, "
            f"longer than --max-prompt-tokens {max_tokens}: {too_long})"
        )
    return prompts, golds


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    """The shuffled row order of one pass over the training set."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def step_indices(
    step: int, num_rows: int, count: int, seed: int, rank: int = 0, world: int = 1, p: np.ndarray | None = None
) -> list[int]:
    """This rank's `count` prompt indices for `step`, out of `num_rows`: shuffled epochs, or drawn from the
    probabilities `p` (`DataStrategies.draw`; None: uniform). The order is a function of (seed, step) alone (and of
    p, from the tracker restored on resume), so a resumed run replays an uninterrupted run's data."""
    if p is not None:  # the same draw on every rank, each takes its slice
        drawn = draw_prompts(p, seed, step, count * world)
        return drawn[rank * count : (rank + 1) * count]
    start = (step * world + rank) * count
    return [int(epoch_order(seed, k // num_rows, num_rows)[k % num_rows]) for k in range(start, start + count)]


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
        for k in ("samples", "correct", "groups"):  # older checkpoints: length sums (not read), no groups
            if k in state:
                getattr(self, k)[:] = np.asarray(state[k], dtype=np.float64)


def sampling_weights(
    pass_rate: np.ndarray, mode: str, progress: float, min_target: float, group_size: int
) -> np.ndarray:
    """Unnormalised draw weight of each prompt (see the module docstring for the definitions). medium's
    1 - p^G - (1 - p)^G is computed as -expm1(G log1p(-p)) - p^G, exact for small p."""
    if mode == "medium":
        return -np.expm1(group_size * np.log1p(-pass_rate)) - pass_rate**group_size
    if mode == "curriculum":
        target = 1.0 - (1.0 - min_target) * min(max(progress, 0.0), 1.0)
        return np.exp(-((pass_rate - target) ** 2) / (2 * CURRICULUM_STD**2))
    raise ValueError(f"no weights for --prompt-sampling {mode!r}")


def draw_probabilities(
    pass_rate: np.ndarray, mode: str, progress: float, floor: float, min_target: float, group_size: int
) -> np.ndarray:
    """P(i) = (1 - floor) w_i / sum w + floor / N: the weights with a uniform share `floor`. (The estimates lie
    strictly inside (0, 1), so medium's weights are > 0, and curriculum's Gaussian is >= exp(-12.5) on [0, 1]: sum w
    never underflows.)"""
    w = sampling_weights(pass_rate, mode, progress, min_target, group_size)
    return (1.0 - floor) * w / w.sum() + floor / len(w)


def draw_prompts(p: np.ndarray, seed: int, step: int, count: int) -> list[int]:
    """`count` prompt indices drawn from `p` without replacement (successive sampling: the first with P(i), the
    next from the rest renormalised, ...; as Gumbel top-k: the largest log p_i + Gumbel noise), from an RNG keyed by
    (seed, step) alone: every rank draws the same list, a resumed run the same as before. More than len(p):
    passes of len(p) each."""
    rng, logp, out = np.random.default_rng([seed, step, 11]), np.log(p), []
    while len(out) < count:
        keys = logp + rng.gumbel(size=len(p))
        out += np.argsort(-keys, kind="stable")[: count - len(out)].tolist()
    return out


@dataclass
class ReplayBuffer:
    """High-value groups with their generating policy's per-token log-probs and step, newest last, at most `size`."""

    size: int
    groups: list[dict[str, Any]] = field(default_factory=list)

    def push(self, group: dict[str, Any]) -> None:
        self.groups.append(group)
        del self.groups[: max(0, len(self.groups) - self.size)]  # the oldest go first

    def pop(self, step: int = 0, max_age: int | None = None) -> dict[str, Any] | None:
        """The newest group (the least stale), removed: a group is replayed once. Groups generated more than
        `max_age` steps before `step` are dropped (groups from checkpoints that did not record a step count as new)."""
        if max_age is not None:
            self.groups = [g for g in self.groups if step - g.get("step", step) <= max_age]
        return self.groups.pop() if self.groups else None

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "groups": self.groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [dict(g) for g in state["groups"]]


def demonstration(gold: str, solution: str | None, template: str) -> list[str]:
    """Candidate demonstration texts, best first: the worked solution if any, then the reference answer in the
    template's answer format (e.g. "The answer is \\boxed{7}.")."""
    return ([solution] if solution else []) + [DEMO_FORMAT[template].format(a=gold_text(gold))]


def load_solutions(dataset: tuple, prompt_column: str, solution_column: str | None) -> list[str]:
    """The --solution-column texts, aligned with the rows of `dataset` (name, config, split); empty without it."""
    if not solution_column:
        return []
    try:
        return load_rows(*dataset, prompt_column, solution_column, "--solution-column")[1]
    except SystemExit as e:
        raise SystemExit(str(e).replace("--answer-column", "--solution-column")) from None


@dataclass
class DataStrategies:
    """Everything a run keeps for the data strategies: the tracker, this rank's replay buffer and demonstrations, and
    the settings (the flags of the same names; the defaults: every strategy off)."""

    tracker: PromptTracker
    buffer: ReplayBuffer
    solutions: dict[int, str]  # training row -> --solution-column text
    tokenizer: Any = None  # builds the demonstrations
    group_size: int = 2
    prompt_template: str = "none"
    answer_format: str = "any"  # the run's resolved --reward-format
    max_new_tokens: int = 1024
    total_steps: int = 1
    prompt_sampling: str = "uniform"
    uniform_floor: float = 0.5
    curriculum_min_target: float = 0.2
    tracker_half_life: float = 0.0
    gt_injection: bool = False
    gt_injection_max_frac: float = 1.0
    replay: bool = False
    replay_max_age: int = 10
    demos: dict[int, Completion | None] = field(default_factory=dict)  # verified demonstrations, built lazily
    rounds: int = 0  # generation rounds drawn from the data stream so far (dapo.py, cispo.py: dynamic sampling)

    def draw(self, step: int) -> np.ndarray | None:
        """--prompt-sampling's draw probabilities for `step` (curriculum: at step / total_steps); None: uniform."""
        if self.prompt_sampling == "uniform":
            return None
        rate, progress = self.tracker.pass_rate(), step / max(self.total_steps, 1)
        mode, floor, target = self.prompt_sampling, self.uniform_floor, self.curriculum_min_target
        return draw_probabilities(rate, mode, progress, floor, target, self.group_size)


def check_args(args) -> None:
    """One-line SystemExit for bad data-strategy flags (before anything is written)."""
    if args.replay and (args.replay_buffer_size < 1 or args.replay_max_age < 1):
        raise SystemExit(
            f"--replay-buffer-size and --replay-max-age must be >= 1 with --replay, got {args.replay_buffer_size} "
            f"and {args.replay_max_age}"
        )
    if args.solution_column and not args.gt_injection:
        raise SystemExit("--solution-column is read only by --gt-injection: add --gt-injection or drop it")
    if args.difficulty_file and not os.path.isfile(args.difficulty_file):
        raise SystemExit(f"--difficulty-file: no such file {args.difficulty_file!r}")
    for flag in ("uniform_floor", "curriculum_min_target", "gt_injection_max_frac"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be in [0, 1], got {getattr(args, flag)}")
    if args.tracker_half_life < 0:
        raise SystemExit(f"--tracker-half-life must be >= 0 (0: never forget), got {args.tracker_half_life}")


def init_data(
    questions,
    solutions,
    train_prompts,
    tokenizer,
    log=print,
    format_prompt=format_prompt,
    *,
    difficulty_file: str | None,
    replay_buffer_size: int,
    **settings,
) -> DataStrategies:
    """The run's tracker (with --difficulty-file's prior), an empty replay buffer of `replay_buffer_size` groups and
    the solution texts (one per question, or none), with the `settings` (DataStrategies' fields). `log` (the main
    process's print) gets one line for each setting that quietly does less than it seems to."""
    data = DataStrategies(PromptTracker(len(train_prompts)), ReplayBuffer(max(replay_buffer_size, 1)), {}, tokenizer)
    for k, v in settings.items():
        if not hasattr(data, k):
            raise TypeError(f"init_data: no data-strategy setting {k!r}")
        setattr(data, k, v)
    if difficulty_file:
        if not data.tracker.load_prior(difficulty_file, [tokenizer.decode(p) for p in train_prompts]):
            raise SystemExit(
                f"--difficulty-file: none of {difficulty_file!r}'s prompts is in --dataset-name "
                "(same --prompt-template?)"
            )
    elif data.prompt_sampling == "curriculum":
        log(
            "note: --prompt-sampling curriculum without --difficulty-file: every prompt starts at an estimated pass "
            "rate of 0.5, so the first steps order nothing (tools/profile_data.py writes a profile)"
        )
    if data.gt_injection and not solutions:
        log(
            "note: --gt-injection without --solution-column: demonstrations are the bare reference answer "
            "(no reasoning; counted in data/gt_injected_bare)"
        )
    by_ids = {}
    if solutions:  # training rows are what encode_prompts kept: match them by their prompt tokens
        for q, s in zip(questions, solutions):
            text = format_prompt(q, data.prompt_template, tokenizer)
            by_ids[tuple(tokenizer(text, add_special_tokens=False).input_ids)] = s
    data.solutions = {i: by_ids[tuple(p)] for i, p in enumerate(train_prompts) if tuple(p) in by_ids}
    return data


def _demo(data: DataStrategies, row: int, gold: str) -> Completion | None:
    """The row's demonstration: the first candidate that fits in --max-new-tokens (EOS included) and that the
    verifier scores correct in the run's answer format; None if none does (then the group is left as it is)."""
    if row not in data.demos:
        data.demos[row] = None
        answer_format, tokenizer = answer_format_for(data.prompt_template, data.answer_format), data.tokenizer
        for text in demonstration(gold, data.solutions.get(row), data.prompt_template):
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            if len(ids) <= data.max_new_tokens and score([text], [gold], answer_format=answer_format)[0][0] == 1.0:
                data.demos[row] = Completion(token_ids=ids, text=text, truncated=False)
                break
    return data.demos[row]


@dataclass
class TrainGroups:
    """What the step trains on: one prompt per group, completions and 0/1 correctness (groups contiguous), the
    stored old log-probs of replayed rows, and how the groups came about."""

    prompts: list[list[int]]
    completions: list[Completion]
    correct: list[float]
    stored_logps: dict[int, list[float]]  # completion row -> generating policy's log-probs (replayed rows)
    fresh: list[bool]  # per group: sampled this step (possibly with an injected demonstration)
    injected: list[bool]  # per group
    pass_rate: list[float]  # per group: the tracker's estimate for its prompt, before this step
    rows: list[int]  # per group: the training row sampled for it (before any replay)
    step: int = 0
    replayed: int = 0
    bare: int = 0  # injected demonstrations that are the bare answer (no solution, or it did not fit or verify)

    @property
    def changed(self) -> bool:
        return any(self.injected) or self.replayed > 0

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(correct, lengths, truncated) of the trained completions, for compute_rewards."""
        return (
            torch.tensor(self.correct, device=device),
            torch.tensor([len(c.token_ids) for c in self.completions], device=device),
            torch.tensor([c.truncated for c in self.completions], device=device),
        )


def inject_and_replay(data: DataStrategies, rows, prompts, completions, correct, golds, step: int = 0, keep=None):
    """The groups to train on. rows/prompts/golds: one per group; completions/correct: per completion; keep: the
    groups trained on, in order (default all; dapo/cispo's kept groups). --gt-injection: an all-wrong group's last
    completion becomes the row's verified demonstration, for at most --gt-injection-max-frac of the kept groups
    (the first ones). --replay: a group whose rewards are all equal (all correct, or all wrong and not injected) is
    replaced by the buffer's newest group of at most --replay-max-age steps. The inputs are not modified (they stay
    the policy's own samples)."""
    g, est = data.group_size, data.tracker.pass_rate()
    keep = range(len(rows)) if keep is None else keep
    rows_kept = [rows[k] for k in keep]
    out = TrainGroups(
        [prompts[k] for k in keep],
        [completions[k * g + j] for k in keep for j in range(g)],
        [correct[k * g + j] for k in keep for j in range(g)],
        {},
        [True] * len(keep),
        [False] * len(keep),
        [float(est[r]) for r in rows_kept],
        rows_kept,
        step,
    )
    max_injected = math.floor(data.gt_injection_max_frac * len(keep) + 1e-9) if data.gt_injection else 0
    for k, (row, i) in enumerate(zip(rows_kept, keep)):
        group = out.correct[k * g : (k + 1) * g]
        if (
            data.gt_injection
            and max(group) == 0
            and sum(out.injected) < max_injected
            and (demo := _demo(data, row, golds[i])) is not None
        ):
            out.completions[(k + 1) * g - 1], out.correct[(k + 1) * g - 1] = demo, 1.0
            out.injected[k] = True
            out.bare += demo.text != data.solutions.get(row)
        elif data.replay and min(group) == max(group) and (old := data.buffer.pop(step, data.replay_max_age)):
            out.prompts[k], out.fresh[k] = old["prompt"], False
            stored = zip(old["token_ids"], old["texts"], old["truncated"], old["correct"], old["logps"])
            for j, (ids, text, trunc, c, lp) in enumerate(stored):
                out.completions[k * g + j] = Completion(token_ids=ids, text=text, truncated=trunc)
                out.correct[k * g + j] = c
                out.stored_logps[k * g + j] = lp
            out.replayed += 1
    return out


def train_groups(data: DataStrategies, rows, prompts, completions, correct, golds, accelerator, step, keep=None):
    """The data strategies before the batch is built: `inject_and_replay` (golds: one per training row, all of
    them), which reads the estimates before this step; then the tracker counts the step's own samples of every rank
    (rows: this rank's, one per group; correct: per completion) with the forgetting rule."""
    train = inject_and_replay(data, rows, prompts, completions, correct, [golds[r] for r in rows], step, keep)
    everyone = [accelerator.gather(torch.tensor(x, device=accelerator.device)).tolist() for x in (rows, correct)]
    data.tracker.update(*everyone, data.group_size, data.tracker_half_life)
    return train


def finish_batch(data: DataStrategies, train: TrainGroups, batch: dict) -> None:
    """After the old log-probs are computed: replayed rows take their stored log-probs (the ratio is then against
    the policy that generated them), raised where needed so that a row with A < 0 starts the step with ratio at
    most REPLAY_RATIO_CAP (dual-clip's bound: PPO's clip leaves r A unbounded below for A < 0, and a stale token
    can have a huge ratio). This step's high-value groups enter the buffer with their log-probs and step: a hard
    prompt solved (estimate < REPLAY_HARD), an easy prompt failed (estimate > REPLAY_EASY), or an injected group;
    only groups with signal (0 < #correct < G). The batch's rows must be train's completions, in order."""
    if not data.replay or "old_logps" not in batch:
        return
    old, g = batch["old_logps"], data.group_size
    for r, lp in train.stored_logps.items():
        stored = torch.tensor(lp, dtype=old.dtype, device=old.device)
        if batch["advantages"][r] < 0:  # pi / pi_old <= cap: log pi_old >= log pi - log cap, pi the policy now
            stored = torch.maximum(stored, old[r, : len(lp)] - math.log(REPLAY_RATIO_CAP))
        old[r, : len(lp)] = stored
    for k, prompt in enumerate(train.prompts):
        c = train.correct[k * g : (k + 1) * g]
        hard, easy = train.pass_rate[k] < REPLAY_HARD, train.pass_rate[k] > REPLAY_EASY
        if train.fresh[k] and 0 < sum(c) < g and (hard or easy or train.injected[k]):
            comps = train.completions[k * g : (k + 1) * g]
            logps = old[k * g : (k + 1) * g].tolist()
            data.buffer.push(
                {
                    "prompt": list(prompt),
                    "token_ids": [list(x.token_ids) for x in comps],
                    "texts": [x.text for x in comps],
                    "truncated": [bool(x.truncated) for x in comps],
                    "correct": [float(x) for x in c],
                    "logps": [lp[: len(x.token_ids)] for lp, x in zip(logps, comps)],
                    "step": train.step,
                }
            )


def data_metrics(train: TrainGroups, data: DataStrategies, accelerator) -> dict[str, float]:
    """data/* metrics, summed (counts) or averaged (pass rate) over ranks; the tracker's quantiles and the share of
    all groups so far taken by the most sampled prompt / 10 prompts (after the step's update; identical on every
    rank), and the distinct training rows among all ranks' sampled groups."""
    t = torch.tensor(
        [
            sum(train.pass_rate),
            len(train.pass_rate),
            sum(train.injected),
            train.bare,
            train.replayed,
            len(data.buffer.groups),
        ],
        dtype=torch.float64,
        device=accelerator.device,
    )
    s = accelerator.reduce(t, "sum").tolist()
    rows = accelerator.gather(
        accelerator.pad_across_processes(torch.tensor(train.rows, dtype=torch.int64, device=t.device), pad_index=-1)
    )
    rows = rows[rows >= 0]
    q10, q50, q90 = np.quantile(data.tracker.pass_rate(), [0.1, 0.5, 0.9]).tolist()
    top = np.sort(data.tracker.groups)[::-1] / max(data.tracker.groups.sum(), 1.0)
    return {
        "data/prompt_pass_rate_mean": s[0] / max(s[1], 1.0),
        "data/gt_injected": s[2],
        "data/gt_injected_bare": s[3],
        "data/replayed": s[4],
        "data/replay_buffer_size": s[5],
        "data/distinct_prompts_frac": len(set(rows.tolist())) / max(len(rows), 1),
        "data/top_prompt_share": float(top[0]),
        "data/top10_prompt_share": float(top[:10].sum()),
        "data/pass_rate_q10": q10,
        "data/pass_rate_q50": q50,
        "data/pass_rate_q90": q90,
    }


def data_state(data: DataStrategies, buffers: list[dict[str, Any]]) -> dict[str, Any]:
    """What trainer.json keeps: the tracker (identical on all ranks), every rank's buffer and the round counter."""
    return {"tracker": data.tracker.state_dict(), "buffers": buffers, "rounds": data.rounds}


def load_data_state(data: DataStrategies, state: dict[str, Any] | None, rank: int) -> None:
    if state is not None:  # checkpoints written before the data strategies have none
        data.tracker.load_state_dict(state["tracker"])
        data.buffer.load_state_dict(state["buffers"][rank])
        data.rounds = state.get("rounds", 0)
