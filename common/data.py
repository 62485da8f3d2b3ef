"""Data shared by every script: loading, prompt templates and encoding, the order of the prompts, and `TrainData`,
which applies the data strategies (common/data_strategies.py, docs/data_strategies.md) with identical lines in every
script.

- `load_data` (a script's setup): the training set (None for an evaluation-only run) and the evaluation sets, each
  prompt rendered in --prompt-template and tokenised by `encode_prompt`, over-long prompts and unparseable answers
  dropped and counted.
- `encode_prompt`: chat templates (qwen-boxed, dapo) render through the tokenizer's own template, which writes the
  model's special tokens (BOS included) itself, so their text is tokenised as it is. Raw text (none, r1, and the
  plain-text fallback for a model without a chat template) gets the special tokens the tokenizer adds to a
  document, as in pre-training: BOS for Llama, Gemma, Mistral or OLMo tokenizers, once (never twice, never an EOS).
  Without it such a base model reads its input as the middle of a document.
- `TrainData.next_rows`: a step's prompts: shuffled epochs (uniform), or drawn by --prompt-sampling, keyed by (seed,
  position in the data stream), so --resume replays them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from common.args import SharedArgs
from common.completion import Completion, done_future
from common.data_strategies import (
    Demonstration,
    PromptTracker,
    ReplayBuffer,
    TrainGroups,
    draw_probabilities,
    draw_prompts,
    inject_and_replay,
    update_replay,
)
from common.env import EVAL_TASKS, Env, GymEnv, failed_turn, open_env
from common.evaluation import champ_rows, check_samples
from common.reward import answer_format_for, find_unparseable_gold, gold_text, score
from common.tasks import is_task_name, load_task_rows, parse_task_name, with_partial_credit
from common.tool import Tool, ToolConfig, splice_text

# Prompt templates
SYSTEM_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\nAssistant: <think>"
)
STOP_STRINGS = {"r1": ["</answer>"]}  # a completion ends there (understand-r1-zero's stop), kept in its text
# ToRL's prompt for base models with the Python tool (GAIR-NLP/ToRL@cb78cf1, verl/utils/dataset/rl_dataset.py
# `tir_base_0309`, the template of scripts/torl_1.5b.sh); no stop string of its own: ToRL's turns end at EOS, and the
# tool's fence (common/tool.py) is the sampler's
TORL_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\nUser: "
    "Please integrate natural language reasoning with programs to solve the problem above, and put your final answer "
    "within \\boxed{{}}.\n{question}\nAssistant:\n"
)
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
CHAT_TEMPLATES = ("qwen-boxed", "dapo")  # rendered by the tokenizer's chat template (plain text without one)
DEMO_FORMAT = {  # --gt-injection: the bare reference answer as a demonstration, in the template's answer format
    "none": "The answer is \\boxed{{{a}}}.",
    "qwen-boxed": "The answer is \\boxed{{{a}}}.",
    "r1": " The answer is {a}. </think> <answer> {a} </answer>",
    "dapo": "Answer: {a}",
    "torl": "The answer is \\boxed{{{a}}}.",
}


def format_prompt(question: str, template: str, tokenizer) -> str:
    """The text the model is asked to continue; chat templates go through the tokenizer's own (without one, the
    messages' contents joined by blank lines)."""
    if template == "none":
        return question
    if template == "r1":
        return R1_TEMPLATE.format(question=question)
    if template == "torl":
        return TORL_TEMPLATE.format(question=question)
    if template == "qwen-boxed":
        messages = [{"role": "system", "content": SYSTEM_BOXED}, {"role": "user", "content": question}]
    else:  # DAPO-Math-17k's prompts carry the instruction already
        content = question if question.startswith(DAPO_TEMPLATE[:46]) else DAPO_TEMPLATE.format(question=question)
        messages = [{"role": "user", "content": content}]
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def encode_prompt(question: str, template: str, tokenizer) -> list[int]:
    """The prompt's token ids (see the module docstring): a chat-rendered prompt as its text says, raw text with the
    special tokens the tokenizer puts before a document."""
    text = format_prompt(question, template, tokenizer)
    plain = tokenizer(text, add_special_tokens=False).input_ids
    if template in CHAT_TEMPLATES and tokenizer.chat_template:
        return plain
    ids = tokenizer(text).input_ids
    starts = [k for k in range(len(ids) - len(plain) + 1) if ids[k : k + len(plain)] == plain]
    prefix = ids[: starts[0]] if starts else []  # what the tokenizer adds before the text; nothing after it
    if prefix and plain[:1] == prefix[-1:]:  # the text starts with BOS itself: once
        prefix = prefix[:-1]
    return prefix + plain


def chat_template_note(template: str, tokenizer, model: str) -> str | None:
    """The one line a run prints when --prompt-template asks for a chat template the model's tokenizer lacks."""
    if template in CHAT_TEMPLATES and not tokenizer.chat_template:
        bos = f" after the tokenizer's {tokenizer.bos_token}" if encode_prompt("x", "none", tokenizer)[:-1] else ""
        return (
            f"note: --prompt-template {template}: {model} has no chat template; the prompt is the template's "
            f"messages as plain text, joined by blank lines{bos}"
        )
    return None


def load_rows(name: str, config: str | None, split: str, prompt_column: str, answer_column: str, flag: str):
    """Questions and answers from a hub dataset, a local .jsonl/.json/.parquet file, or a reasoning-gym task
    (`reasoning-gym:<task>[:option=value,...]`, generated: common/tasks.py; config and columns unused)."""
    if is_task_name(name):
        return load_task_rows(name, split, flag)
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
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"{flag}: could not load {name!r} (split {split!r}): {type(e).__name__}: {first}") from None
    for col, col_flag in ((prompt_column, "--prompt-column"), (answer_column, "--answer-column")):
        if col not in ds.column_names:
            raise SystemExit(f"{col_flag}: column {col!r} not in {name!r}; available: {ds.column_names}")
    if len(ds) == 0:
        raise SystemExit(f"{flag}: dataset {name!r} split {split!r} is empty")
    return [str(q) for q in ds[prompt_column]], [str(a) for a in ds[answer_column]]


def load_eval_rows(name: str, config: str | None, split: str, prompt_column: str, answer_column: str, flag: str):
    """An evaluation set's questions and answers: `load_rows`, or `champ`, the champ-dataset package's competition
    problems with a numeric answer (columns problem, answer, solution, category, identifier; offline:
    common.evaluation.champ_rows)."""
    if name != "champ":
        return load_rows(name, config, split, prompt_column, answer_column, flag)
    rows = champ_rows()
    for col, col_flag in ((prompt_column, "--prompt-column"), (answer_column, "--answer-column")):
        if col not in rows[0]:
            raise SystemExit(f"{col_flag}: column {col!r} not in 'champ'; available: {list(rows[0])}")
    return [r[prompt_column] for r in rows], [r[answer_column] for r in rows]


def encode_prompts(questions, answers, tokenizer, args: SharedArgs, flag: str, log=print, kept=None):
    """Tokenised prompts (in --prompt-template) and their answers; prompts over --max-prompt-tokens and
    unparseable answers dropped and counted (refused when more than --max-bad-answer-frac cannot be parsed).
    `kept`, a list, receives the index of each question kept."""
    bad = set(find_unparseable_gold(answers))
    if len(bad) > args.max_bad_answer_frac * len(answers):
        raise SystemExit(
            f"{flag}: {len(bad)} of {len(answers)} answers cannot be parsed, more than --max-bad-answer-frac "
            f"{args.max_bad_answer_frac}; e.g. {[answers[i][:60] for i in sorted(bad)[:3]]}"
        )
    prompts, golds, too_long = [], [], 0
    for i, (q, a) in enumerate(zip(questions, answers)):
        ids = encode_prompt(q, args.prompt_template, tokenizer)
        if len(ids) > args.max_prompt_tokens:
            too_long += 1
        elif i not in bad:
            prompts.append(ids)
            golds.append(a)
            if kept is not None:
                kept.append(i)
    if bad:
        examples = [answers[i][:60] for i in sorted(bad)[:3]]
        log(f"{flag}: dropped {len(bad)} rows whose answer cannot be parsed, e.g. {examples}")
    if too_long:
        log(f"{flag}: dropped {too_long} prompts longer than --max-prompt-tokens {args.max_prompt_tokens}")
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
    position: int, num_rows: int, count: int, seed: int, rank: int = 0, world: int = 1, p: np.ndarray | None = None
) -> list[int]:
    """This rank's `count` prompt indices of draw number `position` from the data stream, out of `num_rows`:
    shuffled epochs, or drawn from the probabilities `p` (None: uniform). The order is a function of (seed, position)
    alone (and of p, from the tracker restored on resume), so a resumed run replays an uninterrupted run's data."""
    if p is not None:  # the same draw on every rank, each takes its slice
        drawn = draw_prompts(p, seed, position, count * world)
        return drawn[rank * count : (rank + 1) * count]
    start = (position * world + rank) * count
    return [int(epoch_order(seed, k // num_rows, num_rows)[k % num_rows]) for k in range(start, start + count)]


def demonstrations(gold: str, solution: str | None, template: str) -> list[str]:
    """Candidate demonstration texts, best first: the worked solution if any, then the reference answer in the
    template's answer format (e.g. "The answer is \\boxed{7}.")."""
    return ([solution] if solution else []) + [DEMO_FORMAT[template].format(a=gold_text(gold))]


@dataclass
class TrainData:
    """The training prompts (token ids) and reference answers, the position in their stream, and the data
    strategies' state: the pass-rate tracker (identical on every rank), this rank's replay buffer, the worked
    solutions (training row -> --solution-column text) and the demonstrations built from them. The strategies read
    their flags from `args`."""

    args: SharedArgs
    prompts: list[list[int]]
    golds: list[str]
    tokenizer: Any
    solutions: dict[int, str] = field(default_factory=dict)
    tracker: PromptTracker = None  # type: ignore[assignment]
    buffer: ReplayBuffer = None  # type: ignore[assignment]
    demos: dict[int, Demonstration | None] = field(default_factory=dict)
    position: int = 0  # draws from the data stream so far (dapo/cispo: several a step)
    pending: list[dict] = field(default_factory=list)  # rollouts generated ahead (--off-policy-steps), oldest first
    tool: ToolConfig | None = None  # the Python tool: demonstrations' programs run, their outputs spliced and masked
    env: Env | None = None  # the run's environment (common.env.open_env): the tool, or the game whose tasks are golds
    source_rows: list[int] = field(default_factory=list)  # the dataset row of each prompt
    _tool: Tool | None = None

    def __post_init__(self) -> None:
        self.tracker = self.tracker or PromptTracker(len(self.prompts))
        self.buffer = self.buffer or ReplayBuffer(max(self.args.replay_buffer_size, 1))

    def next_rows(self, step: int, count: int, rank: int, world: int) -> list[int]:
        """This rank's `count` training rows of the next draw (every rank's together: count * world rows), by
        --prompt-sampling (curriculum: at progress step / --total-steps; hard-after-warmup: uniform's shuffled epochs
        before step --hard-warmup-steps)."""
        a, p = self.args, None
        warming = a.prompt_sampling == "hard-after-warmup" and step < a.hard_warmup_steps
        if a.prompt_sampling != "uniform" and not warming:
            progress = step / max(a.total_steps, 1)
            rate = self.tracker.pass_rate()
            p = draw_probabilities(
                rate,
                a.prompt_sampling,
                progress,
                a.uniform_floor,
                a.curriculum_min_target,
                a.group_size,
                a.hard_pass_rate,
            )
        rows = step_indices(self.position, len(self.prompts), count, a.seed, rank, world, p)
        self.position += 1
        return rows

    def rollout(self, step: int, sampler, rank: int, world: int, count: int | None = None):
        """(rows, completions, staleness) of `step` on this rank: `count` prompts (default: this rank's share of
        --prompts-per-step) of the next draw, G completions each, and how many steps older than this step's policy
        the one that generated them is. With --off-policy-steps K the rollouts of the next K steps are submitted now,
        by this step's policy (a server generates them while this step trains), and this step's was submitted K
        steps ago: staleness K (less in the first steps)."""
        a = self.args
        count = count or a.prompts_per_step // world
        last = min(step + a.off_policy_steps, a.total_steps - 1)
        while not self.pending or self.pending[-1]["step"] < last:
            ahead = self.pending[-1]["step"] + 1 if self.pending else step
            rows = self.next_rows(ahead, count, rank, world)
            prompts = [self.prompts[r] for r in rows]
            tasks = [self.golds[r] for r in rows] if self.rewarded() else None  # an environment's: its seeds
            future = sampler.submit(prompts, a.group_size, a.temperature, a.top_p, a.max_new_tokens, tasks)
            self.pending.append({"step": ahead, "rows": rows, "policy": step, "future": future})
        done = self.pending.pop(0)
        return done["rows"], done["future"].result(), step - done["policy"]

    def rewarded(self) -> bool:
        """Whether the environment's episodes give the reward (--env): then the golds are its tasks."""
        return self.env is not None and self.env.rewards

    def score(self, completions: list[Completion], golds: list[str]) -> tuple[list[float], dict[str, int]]:
        """(reward per completion, counts) as common.reward.score gives them: the verifier on each completion's text
        against its gold, or with --env the episode's return (common.completion.EnvStats.reward: its turns' rewards
        summed, 0 when the environment raised), which the environment's golds (its tasks) do not enter."""
        if not self.rewarded():
            return score([c.text for c in completions], golds, answer_format=self.args.reward_format)
        returns = [c.env.reward if c.env is not None else 0.0 for c in completions]
        return returns, {"timeouts": 0, "errors": 0, "format_errors": 0}

    def train_groups(self, rows, completions, correct, step: int, accelerator, keep=None) -> TrainGroups:
        """The groups the step trains on (`inject_and_replay`: rows one per group, completions and correct one per
        completion, keep the groups kept); then the tracker counts the step's own samples of every rank."""
        prompts = [self.prompts[r] for r in rows]
        rates = self.tracker.pass_rate()
        groups = inject_and_replay(
            self.args, self.buffer, self.demo, rates, rows, prompts, completions, correct, step, keep
        )
        all_rows = accelerator.gather(torch.tensor(rows, device=accelerator.device)).tolist()
        all_correct = accelerator.gather(torch.tensor(correct, device=accelerator.device)).tolist()
        all_correct = [float(c == 1.0) for c in all_correct]  # a pass is a score of 1 (--partial-credit: below too)
        self.tracker.update(all_rows, all_correct, self.args.group_size, self.args.tracker_half_life)
        return groups

    def update_replay(self, groups: TrainGroups, old_logps: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """The old log-probs [N, C] the step trains against: with --replay, the replayed rows' stored ones, and this
        step's high-value groups stored (common.data_strategies.update_replay); otherwise `old_logps` as they are."""
        if not self.args.replay:
            return old_logps
        return update_replay(self.buffer, groups, old_logps, advantages, self.args.group_size)

    def demo(self, row: int) -> Demonstration | None:
        """The row's demonstration: the first candidate that fits in --max-new-tokens (EOS included) and that the
        verifier scores correct in the run's answer format; None if none does (then the group is left as it is)."""
        if row not in self.demos:
            self.demos[row] = None
            a, solution = self.args, self.solutions.get(row)
            answer_format = answer_format_for(a.prompt_template, a.reward_format)
            for text in demonstrations(self.golds[row], solution, a.prompt_template):
                c = self._demo_completion(text)
                verified = score([c.text], [self.golds[row]], answer_format=answer_format)[0][0] == 1.0
                if len(c.token_ids) <= a.max_new_tokens and not c.truncated and verified:
                    self.demos[row] = Demonstration(c, bare=text != solution)
                    break
        return self.demos[row]

    def _demo_completion(self, text: str) -> Completion:
        """A demonstration's completion (EOS appended); with the tool, its programs run and their outputs spliced in
        as a rollout's (common.tool.splice_text: mask 0 on them), its text the spliced one."""
        eos = self.tokenizer.eos_token_id
        if self._tool is None and self.tool is not None:  # built by hand (tests): a tool of its own
            self._tool = Tool(self.tool, self.tokenizer)
        tool = self.env if isinstance(self.env, Tool) else self._tool  # a run's: the process's (common.env.open_env)
        if tool is None:
            return Completion(self.tokenizer(text, add_special_tokens=False).input_ids + [eos], text, truncated=False)
        t = splice_text(text, tool, self.args.max_new_tokens - 1)
        spliced = self.tokenizer.decode(t.token_ids, skip_special_tokens=True)
        return Completion(t.token_ids + [eos], spliced, t.truncated, None, t.mask + [1], t.stats)

    def metrics(self, groups: TrainGroups, accelerator) -> dict[str, float]:
        """data/* metrics, summed (counts) or averaged (pass rate) over ranks; the tracker's quantiles and the share
        of all groups so far taken by the most sampled prompt / 10 prompts (after the step's update; identical on
        every rank), and the distinct training rows among all ranks' sampled groups."""
        counts = {
            "pass_rate_sum": sum(groups.pass_rate),
            "groups": len(groups.pass_rate),
            "gt_injected": sum(groups.injected),
            "gt_injected_bare": groups.bare,
            "replayed": groups.replayed,
            "replay_buffer_size": len(self.buffer.groups),
        }
        summed = torch.tensor(list(counts.values()), dtype=torch.float64, device=accelerator.device)
        total = dict(zip(counts, accelerator.reduce(summed, "sum").tolist()))  # over ranks
        rows = torch.tensor(groups.rows, dtype=torch.int64, device=accelerator.device)
        rows = accelerator.gather(accelerator.pad_across_processes(rows, pad_index=-1))
        rows = rows[rows >= 0]
        q10, q50, q90 = np.quantile(self.tracker.pass_rate(), [0.1, 0.5, 0.9]).tolist()
        top = np.sort(self.tracker.groups)[::-1] / max(self.tracker.groups.sum(), 1.0)
        return {
            "data/prompt_pass_rate_mean": total["pass_rate_sum"] / max(total["groups"], 1.0),
            "data/gt_injected": total["gt_injected"],
            "data/gt_injected_bare": total["gt_injected_bare"],
            "data/replayed": total["replayed"],
            "data/replay_buffer_size": total["replay_buffer_size"],
            "data/distinct_prompts_frac": len(set(rows.tolist())) / max(len(rows), 1),
            "data/top_prompt_share": float(top[0]),
            "data/top10_prompt_share": float(top[:10].sum()),
            "data/pass_rate_q10": q10,
            "data/pass_rate_q50": q50,
            "data/pass_rate_q90": q90,
        }

    def rank_state(self) -> dict[str, Any]:
        """This rank's part of the state: its replay buffer and the rollouts generated ahead (waited for)."""
        pending = [
            {**{k: p[k] for k in ("step", "rows", "policy")}, "completions": [asdict(c) for c in p["future"].result()]}
            for p in self.pending
        ]
        return {"buffer": self.buffer.state_dict(), "pending": pending}

    def state_dict(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """What trainer.json keeps: the tracker, every rank's `rank_state` (gathered) and the stream position."""
        return {"tracker": self.tracker.state_dict(), "ranks": ranks, "position": self.position}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.buffer.load_state_dict(state["ranks"][rank]["buffer"])
        self.position = state["position"]
        self.pending = []
        for p in state["ranks"][rank]["pending"]:
            completions = [Completion(**c) for c in p["completions"]]
            self.pending.append({k: p[k] for k in ("step", "rows", "policy")} | {"future": done_future(completions)})


def check_data_args(args: SharedArgs) -> None:
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
    for flag in ("uniform_floor", "curriculum_min_target", "gt_injection_max_frac", "hard_pass_rate"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be in [0, 1], got {getattr(args, flag)}")
    if args.hard_warmup_steps < 0:
        raise SystemExit(f"--hard-warmup-steps must be >= 0, got {args.hard_warmup_steps}")
    if args.tracker_half_life < 0:
        raise SystemExit(f"--tracker-half-life must be >= 0 (0: never forget), got {args.tracker_half_life}")
    task = is_task_name(args.dataset_name) and args.total_steps > 0
    if task:  # a bad task name or option: one line before the model loads (common/tasks.py)
        parse_task_name(args.dataset_name, "--dataset-name")
    for name in args.eval_datasets if args.eval_every > 0 else []:
        if is_task_name(name):
            parse_task_name(name, "--eval-datasets")
    if args.partial_credit and not task:
        raise SystemExit("--partial-credit: only a reasoning-gym --dataset-name has partial credit (docs/tasks.md)")
    if task and args.solution_column:
        raise SystemExit("--solution-column: reasoning-gym tasks have no worked solutions; drop it (docs/tasks.md)")


def load_data(
    args: SharedArgs, tokenizer, log=print, suffix=None
) -> tuple[TrainData | None, dict[str, tuple[list, list]]]:
    """The training data (None with --total-steps 0: an evaluation-only run reads none) and the evaluation sets
    ({name: (prompt ids, golds)}, empty without --eval-every). `log` (the main process's print) gets one line for each
    setting that quietly does less than it seems to. `suffix(row)`: text appended to the training question of
    dataset row `row` before its template (l1.py's length target); TrainData.source_rows maps prompts to rows."""
    if note := chat_template_note(args.prompt_template, tokenizer, args.model_name_or_path):
        log(note)
    env = open_env(
        args, tokenizer
    )  # the Python tool checks its sandbox here: a refusal comes before anything is written
    if isinstance(env, GymEnv):
        return env_data(args, tokenizer, env)
    train = None
    if args.total_steps > 0:
        dataset = (args.dataset_name, args.dataset_config, args.dataset_split)
        questions, answers = load_rows(*dataset, args.prompt_column, args.answer_column, "--dataset-name")
        if args.partial_credit:  # the task's own score as the reward; "correct" stays a score of 1
            answers = with_partial_credit(answers)
        if suffix is not None:
            questions = [q + suffix(i) for i, q in enumerate(questions)]
        rows: list[int] = []
        prompts, golds = encode_prompts(questions, answers, tokenizer, args, "--dataset-name", log, rows)
        train = TrainData(args, prompts, golds, tokenizer, env=env)  # with the tool: demonstrations' programs run
        train.source_rows = rows
        if args.gt_injection and args.solution_column:  # worked solutions, matched to the kept rows by their prompt
            try:
                solutions = load_rows(*dataset, args.prompt_column, args.solution_column, "--solution-column")[1]
            except SystemExit as e:
                raise SystemExit(str(e).replace("--answer-column", "--solution-column")) from None
            by_ids = {tuple(encode_prompt(q, args.prompt_template, tokenizer)): s for q, s in zip(questions, solutions)}
            train.solutions = {i: by_ids[tuple(p)] for i, p in enumerate(prompts) if tuple(p) in by_ids}
        elif args.gt_injection:
            log(
                "note: --gt-injection without --solution-column: demonstrations are the bare reference answer "
                "(no reasoning; counted in data/gt_injected_bare)"
            )
        if args.difficulty_file:
            keys = [tokenizer.decode(p) for p in prompts]
            if not train.tracker.load_prior(args.difficulty_file, keys):
                raise SystemExit(
                    f"--difficulty-file: none of {args.difficulty_file!r}'s prompts is in --dataset-name "
                    "(same --prompt-template?)"
                )
        elif args.prompt_sampling == "curriculum":
            log(
                "note: --prompt-sampling curriculum without --difficulty-file: every prompt starts at an estimated "
                "pass rate of 0.5, so the first steps order nothing (tools/profile_data.py writes a profile)"
            )
    eval_sets = {}
    if args.eval_every > 0:
        check_samples(args.eval_samples, args.eval_pass_k, "--eval-samples", "--eval-pass-k")
    for name in args.eval_datasets if args.eval_every > 0 else []:
        cols = (args.eval_prompt_column, args.eval_answer_column)
        qs, ans = load_eval_rows(name, None, "test", *cols, "--eval-datasets")
        n = args.eval_limit or len(qs)
        eval_sets[name] = encode_prompts(qs[:n], ans[:n], tokenizer, args, "--eval-datasets", log)
    return train, eval_sets


def env_data(args: SharedArgs, tokenizer, env: GymEnv) -> tuple[TrainData | None, dict[str, tuple[list, list]]]:
    """`load_data` with --env: the tasks are seeds (training: 0 .. --env-tasks - 1; evaluation: --env-eval-tasks from
    common.env.EVAL_TASKS on, never a training seed), each prompt the task's first observation (common.env.ChatFormat)
    and each gold its seed, which the sampler starts the task's episodes from. Refused in one line when a prompt is
    longer than --max-prompt-tokens (a game's rules have no shorter version to drop it for)."""

    def prompts_of(seeds: list[int], flag: str) -> tuple[list[list[int]], list[str]]:
        try:
            prompts = [env.format.prompt_ids(env.first_observation(s)) for s in seeds]
        except Exception as e:  # noqa: BLE001 - a task that cannot start: one line
            raise SystemExit(f"{flag}: {args.env} cannot start its tasks: {failed_turn(e).error}") from None
        if (longest := max(len(p) for p in prompts)) > args.max_prompt_tokens:
            raise SystemExit(f"{flag}: {args.env}'s prompts take up to {longest} tokens, over --max-prompt-tokens")
        return prompts, [str(s) for s in seeds]

    train = None
    if args.total_steps > 0:
        prompts, golds = prompts_of(list(range(args.env_tasks)), "--env-tasks")
        train = TrainData(args, prompts, golds, tokenizer, env=env)
    evals = {}
    if args.eval_every > 0:
        evals[args.env] = prompts_of([EVAL_TASKS + j for j in range(args.env_eval_tasks)], "--env-eval-tasks")
    return train, evals
