"""Data shared by every script: loading and prompt order, and the data strategies (SPEC §11; seeds/000
进阶策略探索, seeds/002 Gaussian difficulty).

- loading (identical for every algorithm): the templates (`SYSTEM_BOXED`, `R1_TEMPLATE`, `DAPO_TEMPLATE`) and
  `format_prompt`, `load_rows` (a hub dataset or a local .jsonl/.json/.parquet file), `encode_prompts`
  (tokenised, over-long prompts and unparseable answers dropped and counted), `epoch_order` / `step_indices` (a
  step's prompts: shuffled epochs keyed by (seed, step), so --resume replays them).

The data strategies below are not part of an algorithm's story either: they decide which prompts a step draws and
what a group holds. All are off by default; the scripts call them with identical lines (README "Data strategies").

- `PromptTracker`: per-prompt pass rate, sample count and response-length mean/variance over every rollout,
  gathered over ranks, optionally seeded by `--difficulty-file` (tools/profile_data.py's output).
  Estimated pass rate: the posterior mean under a Beta(1, 1) prior, (correct + 1) / (samples + 2), so an
  unseen prompt counts as 0.5.
- `sampling_weights` / `draw_prompts`: `--prompt-sampling medium` weights a prompt by a Gaussian of its
  estimated pass rate p, exp(-(p - 0.5)^2 / (2 * 0.1^2)) (seeds/002's first attempt); `curriculum` by
  exp(-(p - tau)^2 / (2 * 0.2^2)) with the target tau = 1 - progress going linearly from 1 (easy) to 0 (hard)
  over the run. The step's prompts are drawn i.i.d. with P(i) = w_i / sum w, from an RNG keyed by (seed,
  step), the same draw on every rank (the tracker is identical everywhere), each rank taking its slice.
- `inject_and_replay`: `--gt-injection` replaces the last completion of an all-wrong group by a verified
  demonstration; `--replay` replaces a group with no signal (all rewards equal) by the newest group of a
  `ReplayBuffer` of high-value groups, whose per-token log-probs under the generating policy were stored.
- health metrics live in common/metrics.py (`completion_stats`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.reward import answer_format_for, find_unparseable_gold, gold_text, score
from common.sampling import Completion

MEDIUM_MEAN, MEDIUM_STD = 0.5, 0.1  # --prompt-sampling medium: seeds/002's Gaussian over pass rates
CURRICULUM_STD = 0.2  # --prompt-sampling curriculum: width of the Gaussian around the moving target pass rate
REPLAY_HARD, REPLAY_EASY = 0.2, 0.8  # a group is high-value when its prompt's estimate is below / above these
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


def encode_prompts(questions, answers, tokenizer, args, flag: str):
    """Tokenised prompts and their answers; prompts over --max-prompt-tokens and unparseable answers dropped."""
    bad = set(find_unparseable_gold(answers))
    if len(bad) > args.max_bad_answer_frac * len(answers):
        examples = [answers[i][:60] for i in sorted(bad)[:3]]
        raise SystemExit(
            f"{flag}: {len(bad)} of {len(answers)} answers cannot be parsed, "
            f"more than --max-bad-answer-frac {args.max_bad_answer_frac}; e.g. {examples}"
        )
    prompts, golds, too_long = [], [], 0
    for i, (q, a) in enumerate(zip(questions, answers)):
        ids = tokenizer(format_prompt(q, args.prompt_template, tokenizer), add_special_tokens=False).input_ids
        if len(ids) > args.max_prompt_tokens:
            too_long += 1
        elif i not in bad:
            prompts.append(ids)
            golds.append(a)
    if bad:
        examples = [answers[i][:60] for i in sorted(bad)[:3]]
        print(f"{flag}: dropped {len(bad)} rows whose answer cannot be parsed, e.g. {examples}")
    if too_long:
        print(f"{flag}: dropped {too_long} prompts longer than --max-prompt-tokens {args.max_prompt_tokens}")
    if not prompts:
        raise SystemExit(
            f"{flag}: no usable rows left (unparseable answers: {len(bad)}, "
            f"longer than --max-prompt-tokens {args.max_prompt_tokens}: {too_long})"
        )
    return prompts, golds


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    """The shuffled row order of one pass over the training set."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def step_indices(
    step: int,
    num_rows: int,
    args,
    rank: int,
    world: int,
    count: int | None = None,
    tracker=None,
    progress: float | None = None,
) -> list[int]:
    """This rank's prompt indices for `step` (`count` prompts; default its share of --prompts-per-step).
    The order is a function of (seed, step) alone, so a resumed run replays an uninterrupted run's data; with
    --prompt-sampling curriculum/medium also of the tracker (restored on resume), at `progress` (default: step /
    --total-steps)."""
    count = args.prompts_per_step // world if count is None else count
    if tracker is not None and args.prompt_sampling != "uniform":  # the same draw on every rank, each takes its slice
        progress = step / max(args.total_steps, 1) if progress is None else progress
        drawn = draw_prompts(tracker, args.prompt_sampling, args.seed, step, count * world, progress)
        return drawn[rank * count : (rank + 1) * count]
    start = (step * world + rank) * count
    return [int(epoch_order(args.seed, k // num_rows, num_rows)[k % num_rows]) for k in range(start, start + count)]


class PromptTracker:
    """Per-prompt counts over all ranks' rollouts (float64, so sums are exact for any realistic run)."""

    def __init__(self, num_prompts: int) -> None:
        self.samples = np.zeros(num_prompts)
        self.correct = np.zeros(num_prompts)
        self.len_sum = np.zeros(num_prompts)
        self.len_sq = np.zeros(num_prompts)

    def update(self, rows: list[int], correct: list[float], lengths: list[float], group_size: int) -> None:
        """Adds one rollout: `rows` one prompt index per group, `correct`/`lengths` one value per completion."""
        idx = np.repeat(np.asarray(rows, dtype=np.int64), group_size)
        c, n = np.asarray(correct, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
        np.add.at(self.samples, idx, 1.0)
        np.add.at(self.correct, idx, c)
        np.add.at(self.len_sum, idx, n)
        np.add.at(self.len_sq, idx, n * n)

    def pass_rate(self) -> np.ndarray:
        """Posterior mean pass rate under a Beta(1, 1) prior: (correct + 1) / (samples + 2); 0.5 when unseen."""
        return (self.correct + 1.0) / (self.samples + 2.0)

    def length_mean(self) -> np.ndarray:
        return self.len_sum / np.maximum(self.samples, 1.0)

    def length_var(self) -> np.ndarray:
        """Population variance of the response lengths (0 when unseen)."""
        return np.maximum(self.len_sq / np.maximum(self.samples, 1.0) - self.length_mean() ** 2, 0.0)

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
                mean, std = float(row.get("length_mean", 0.0)), float(row.get("length_std", 0.0))
                for i in targets:
                    self.samples[i] += k
                    self.correct[i] += float(row["pass_rate"]) * k
                    self.len_sum[i] += mean * k
                    self.len_sq[i] += (std * std + mean * mean) * k
                matched += bool(targets)
        return matched

    def state_dict(self) -> dict[str, list[float]]:
        return {k: getattr(self, k).tolist() for k in ("samples", "correct", "len_sum", "len_sq")}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for k, v in state.items():
            getattr(self, k)[:] = np.asarray(v, dtype=np.float64)


def sampling_weights(pass_rate: np.ndarray, mode: str, progress: float) -> np.ndarray:
    """Unnormalised draw weight of each prompt (see the module docstring for the definitions)."""
    if mode == "medium":
        return np.exp(-((pass_rate - MEDIUM_MEAN) ** 2) / (2 * MEDIUM_STD**2))
    if mode == "curriculum":
        target = 1.0 - min(max(progress, 0.0), 1.0)
        return np.exp(-((pass_rate - target) ** 2) / (2 * CURRICULUM_STD**2))
    raise ValueError(f"no weights for --prompt-sampling {mode!r}")


def draw_prompts(tracker: PromptTracker, mode: str, seed: int, step: int, count: int, progress: float) -> list[int]:
    """`count` prompt indices drawn i.i.d. with P(i) proportional to `sampling_weights`, from an RNG keyed by
    (seed, step) alone: every rank draws the same list (and takes its slice), a resumed run the same as before."""
    w = sampling_weights(tracker.pass_rate(), mode, progress)
    w = w / w.sum() if w.sum() > 0 else np.full(len(w), 1.0 / len(w))  # all weights underflowed: uniform
    return np.random.default_rng([seed, step, 11]).choice(len(w), size=count, replace=True, p=w).tolist()


@dataclass
class ReplayBuffer:
    """High-value groups with their generating policy's per-token log-probs, newest last, at most `size`."""

    size: int
    groups: list[dict[str, Any]] = field(default_factory=list)

    def push(self, group: dict[str, Any]) -> None:
        self.groups.append(group)
        del self.groups[: max(0, len(self.groups) - self.size)]  # the oldest go first

    def pop(self) -> dict[str, Any] | None:
        """The newest group (the least stale), removed: a group is replayed once."""
        return self.groups.pop() if self.groups else None

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "groups": self.groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [dict(g) for g in state["groups"]]


def demonstration(gold: str, solution: str | None, template: str) -> list[str]:
    """Candidate demonstration texts, best first: the worked solution if any, then the reference answer in the
    template's answer format (e.g. "The answer is \\boxed{7}.")."""
    return ([solution] if solution else []) + [DEMO_FORMAT[template].format(a=gold_text(gold))]


def load_solutions(args) -> list[str]:
    """The --solution-column texts, aligned with the dataset's rows (empty without the flag)."""
    if not args.solution_column:
        return []
    try:
        return load_rows(
            args.dataset_name,
            args.dataset_config,
            args.dataset_split,
            args.prompt_column,
            args.solution_column,
            "--solution-column",
        )[1]
    except SystemExit as e:
        raise SystemExit(str(e).replace("--answer-column", "--solution-column")) from None


@dataclass
class DataStrategies:
    """Everything a run keeps for the data strategies: the tracker, this rank's replay buffer and demonstrations."""

    tracker: PromptTracker
    buffer: ReplayBuffer
    solutions: dict[int, str]  # training row -> --solution-column text
    demos: dict[int, Completion | None] = field(default_factory=dict)  # verified demonstrations, built lazily


def check_args(args) -> None:
    """One-line SystemExit for bad data-strategy flags (before anything is written)."""
    if args.replay and args.replay_buffer_size < 1:
        raise SystemExit(f"--replay-buffer-size must be >= 1 with --replay, got {args.replay_buffer_size}")
    if args.solution_column and not args.gt_injection:
        raise SystemExit("--solution-column is read only by --gt-injection: add --gt-injection or drop it")
    if args.difficulty_file and not os.path.isfile(args.difficulty_file):
        raise SystemExit(f"--difficulty-file: no such file {args.difficulty_file!r}")


def init_data(args, questions, solutions, train_prompts, tokenizer, format_prompt=format_prompt) -> DataStrategies:
    """The run's tracker (with --difficulty-file's prior), an empty replay buffer and the solution texts."""
    tracker = PromptTracker(len(train_prompts))
    if args.difficulty_file:
        if not tracker.load_prior(args.difficulty_file, [tokenizer.decode(p) for p in train_prompts]):
            raise SystemExit(
                f"--difficulty-file: none of {args.difficulty_file!r}'s prompts is in --dataset-name "
                "(same --prompt-template?)"
            )
    by_ids = {}
    if solutions:  # training rows are what encode_prompts kept: match them by their prompt tokens
        for q, s in zip(questions, solutions):
            text = format_prompt(q, args.prompt_template, tokenizer)
            by_ids[tuple(tokenizer(text, add_special_tokens=False).input_ids)] = s
    sols = {i: by_ids[tuple(p)] for i, p in enumerate(train_prompts) if tuple(p) in by_ids}
    return DataStrategies(tracker, ReplayBuffer(max(args.replay_buffer_size, 1)), sols)


def _demo(data: DataStrategies, row: int, gold: str, tokenizer, args) -> Completion | None:
    """The row's demonstration: the first candidate that fits in --max-new-tokens (EOS included) and that the
    verifier scores correct in the run's answer format; None if none does (then the group is left as it is)."""
    if row not in data.demos:
        data.demos[row] = None
        answer_format = answer_format_for(args.prompt_template, getattr(args, "reward_format", "auto"))
        for text in demonstration(gold, data.solutions.get(row), args.prompt_template):
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            if len(ids) <= args.max_new_tokens and score([text], [gold], answer_format=answer_format)[0][0] == 1.0:
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
    replayed: int = 0

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


def inject_and_replay(data: DataStrategies, rows, prompts, completions, correct, golds, tokenizer, args) -> TrainGroups:
    """The groups to train on. rows/prompts: one per group; completions/correct: per completion; golds: per group.
    --gt-injection: an all-wrong group's last completion becomes the row's verified demonstration.
    --replay: a group whose rewards are all equal (all correct, or all wrong and not injected) is replaced by
    the buffer's newest group. The inputs are not modified (they stay the policy's own samples)."""
    g, est = args.group_size, data.tracker.pass_rate()
    out = TrainGroups(
        list(prompts),
        list(completions),
        list(correct),
        {},
        [True] * len(rows),
        [False] * len(rows),
        [float(est[r]) for r in rows],
    )
    for k, row in enumerate(rows):
        group = out.correct[k * g : (k + 1) * g]
        if args.gt_injection and max(group) == 0 and (demo := _demo(data, row, golds[k], tokenizer, args)) is not None:
            out.completions[(k + 1) * g - 1], out.correct[(k + 1) * g - 1] = demo, 1.0
            out.injected[k] = True
        elif args.replay and min(group) == max(group) and (old := data.buffer.pop()) is not None:
            out.prompts[k], out.fresh[k] = old["prompt"], False
            stored = zip(old["token_ids"], old["texts"], old["truncated"], old["correct"], old["logps"])
            for j, (ids, text, trunc, c, lp) in enumerate(stored):
                out.completions[k * g + j] = Completion(token_ids=ids, text=text, truncated=trunc)
                out.correct[k * g + j] = c
                out.stored_logps[k * g + j] = lp
            out.replayed += 1
    return out


def finish_batch(data: DataStrategies, train: TrainGroups, batch: dict, args) -> None:
    """After the old log-probs are computed: replayed rows take their stored log-probs (the ratio is then against
    the policy that generated them), and this step's high-value groups enter the buffer with theirs: a hard prompt
    solved (estimate < REPLAY_HARD), an easy prompt failed (estimate > REPLAY_EASY), or an injected group; only
    groups with signal (0 < #correct < G). The batch's rows must be train's completions, in order."""
    if not args.replay or "old_logps" not in batch:
        return
    old, g = batch["old_logps"], args.group_size
    for r, lp in train.stored_logps.items():
        old[r, : len(lp)] = torch.tensor(lp, dtype=old.dtype, device=old.device)
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
                }
            )


def data_metrics(train: TrainGroups, data: DataStrategies, accelerator) -> dict[str, float]:
    """data/* metrics, summed (counts) or averaged (pass rate) over ranks."""
    t = torch.tensor(
        [sum(train.pass_rate), len(train.pass_rate), sum(train.injected), train.replayed, len(data.buffer.groups)],
        dtype=torch.float64,
        device=accelerator.device,
    )
    s = accelerator.reduce(t, "sum").tolist()
    return {
        "data/prompt_pass_rate_mean": s[0] / max(s[1], 1.0),
        "data/gt_injected": s[2],
        "data/replayed": s[3],
        "data/replay_buffer_size": s[4],
    }


def data_state(data: DataStrategies, buffers: list[dict[str, Any]]) -> dict[str, Any]:
    """What trainer.json keeps: the tracker (identical on all ranks) and every rank's buffer."""
    return {"tracker": data.tracker.state_dict(), "buffers": buffers}


def load_data_state(data: DataStrategies, state: dict[str, Any] | None, rank: int) -> None:
    if state is not None:  # checkpoints written before the data strategies have none
        data.tracker.load_state_dict(state["tracker"])
        data.buffer.load_state_dict(state["buffers"][rank])
