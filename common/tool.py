"""A Python tool during rollouts (tool-integrated reasoning, as ToRL, arXiv 2503.23383): the model writes a fenced
```python block; generation stops at the block's closing fence; the program runs in the sandbox (common/sandbox.py);
its output, cut short, is appended as an ```output block; generation goes on from there (docs/tools.md). The tool is
one environment of common/env.py: a turn ends at a closing fence, the answer is the program's output block (no reward:
the verifier scores the text), EOS ends the episode, and the driver there runs it in every sampler.

    tool = open_env(args, tokenizer)                # common.env: Tool(config, tokenizer), one per process
    sampler = make_sampler(..., env=tool)           # its episodes: common.env.run_episodes

Tokens. A completion's token ids are the sampler's ids exactly as sampled, segment after segment, with each output
block's ids appended between them (the block's text tokenised on its own; the whole text is never re-tokenised), so
the trainer's log-probs condition on exactly what the sampler saw. The completion's mask is 1 on the model's tokens and
0 on the output blocks' (common.batching.make_batch folds it into the loss mask); their sampler log-probs are 0.0,
never read (masked). `max_new_tokens` counts both: an output block that does not fit is cut to the budget and the
completion ends there, truncated.

Stops. The tool's stop string is the closing fence followed by a newline, FENCE (an opening fence "```python\\n"
never holds it): any closing fence stops generation, and `closed_program` decides whether it closed a python block
(then the program runs) or another one (generation goes on, nothing appended). ToRL stops at "```output" instead,
which a model writes only once it has learnt the format (Qwen2.5-Math's ToRA habit); stopping at the closing fence
works for any model, and the appended block starts with "```output" itself. After `max_calls` programs the fence
stops nothing more: later blocks are text (ToRL's last round drops its stop string the same way).

What the model is shown (`shown_output`, ToRL's post-processing, GAIR-NLP/ToRL@cb78cf1
verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py `postproc_observation`): stdout, stripped; on an error the
last line of stderr (e.g. "ZeroDivisionError: division by zero"), on a timeout or the output cap one line saying so;
longer than `max_output_chars` (ToRL: 256), the first and last halves around "...".
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from common.args import SharedArgs
from common.completion import Segment, ToolStats
from common.env import Env, Episode, Turn, after_segment, after_turn, episode_text
from common.sandbox import SANDBOXES, Limits, RunResult, Sandbox, ToolPool, require_sandbox

__all__ = ["FENCE", "Segment", "Tool", "ToolConfig", "ToolStats", "Trajectory", "closed_program", "splice_text"]

TOOLS = ("none", "python")
FENCE = "```\n"  # the tool's stop string: a closing fence and its newline
OPEN = "```python"


@dataclass(frozen=True)
class ToolConfig:
    """The tool's settings (the --tool-* flags)."""

    max_calls: int = 1
    """programs run per completion (ToRL's setting, scripts/torl_1.5b.sh numcall=1)"""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    """bwrap: bubblewrap; none: no isolation (the program runs as the trainer, with its files and network)"""
    timeout_s: float = 10.0
    """wall-clock seconds per program"""
    memory_mb: int = 1024
    """address space per process of a program"""
    max_output_chars: int = 256
    """characters of output the model is shown per call (ToRL: 256)"""
    workers: int = 4
    """programs run at once (the pool's threads)"""

    def __post_init__(self) -> None:
        if self.max_calls < 1 or self.workers < 1 or self.memory_mb < 16 or self.max_output_chars < 16:
            raise ValueError(f"max_calls and workers must be >= 1, memory_mb and max_output_chars >= 16; got {self}")
        if not self.timeout_s > 0 or self.sandbox not in SANDBOXES:  # NaN too
            raise ValueError(f"timeout_s must be > 0 and sandbox one of {SANDBOXES}; got {self}")

    def limits(self) -> Limits:
        return Limits(timeout_s=self.timeout_s, memory_mb=self.memory_mb)


def tool_config(args: SharedArgs) -> ToolConfig | None:
    """The --tool-* flags as a ToolConfig, None with --tool none (one line naming the flag if a value is bad)."""
    if args.tool == "none":
        return None
    bounds = (  # ToolConfig's own checks, each naming its flag
        ("--max-tool-calls", args.max_tool_calls, 1),
        ("--tool-workers", args.tool_workers, 1),
        ("--tool-memory-mb", args.tool_memory_mb, 16),
        ("--tool-output-chars", args.tool_output_chars, 16),
    )
    for flag, value, least in bounds:
        if value < least:
            raise SystemExit(f"{flag} must be >= {least}, got {value}")
    if not args.tool_timeout > 0:
        raise SystemExit(f"--tool-timeout must be > 0 seconds, got {args.tool_timeout}")
    if args.tool_sandbox not in SANDBOXES:
        raise SystemExit(f"--tool-sandbox must be one of {', '.join(SANDBOXES)}, got {args.tool_sandbox!r}")
    return ToolConfig(
        max_calls=args.max_tool_calls,
        sandbox=args.tool_sandbox,
        timeout_s=args.tool_timeout,
        memory_mb=args.tool_memory_mb,
        max_output_chars=args.tool_output_chars,
        workers=args.tool_workers,
    )


def closed_program(text: str) -> str | None:
    """The code of the ```python block that `text` closes at its very end (its last line a bare fence), else None:
    a fence closing another kind of block, or a fence not on a line of its own."""
    lines = text.split("\n")
    if len(lines) < 3 or lines[-1] != "" or lines[-2].strip() != "```":
        return None
    for k in range(len(lines) - 3, -1, -1):  # the nearest fence above: it must open a python block
        line = lines[k].rstrip()
        if line.endswith(OPEN) or line.startswith(OPEN):
            return "\n".join(lines[k + 1 : -2]) + "\n" if line.endswith(OPEN) else None
        if line.lstrip().startswith("```"):
            return None
    return None


def _cut(text: str, n: int) -> str:
    """`text` if at most n characters, else its first and last halves around "..." (n characters in all)."""
    if len(text) <= n:
        return text
    if n <= 3:
        return ""
    head = (n - 3) // 2
    return text[:head] + "..." + text[len(text) - (n - 3 - head) :]


def shown_output(result: RunResult, config: ToolConfig) -> str:
    """What the model is shown of a run (see the module docstring), at most config.max_output_chars characters."""
    limits = config.limits()
    note = None
    if result.timed_out:
        note = f"TimeoutError: the program ran longer than {limits.timeout_s:g} s and was stopped"
    elif result.output_limited:
        note = f"OutputLimitError: the program wrote more than {limits.max_output_bytes} bytes and was stopped"
    elif result.exit_code:
        lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
        if lines:
            note = lines[-1].strip()
        elif result.exit_code > 128:
            note = f"the program was killed by signal {result.exit_code - 128}"
        else:
            note = f"the program exited with code {result.exit_code}"
    out = result.stdout.strip()
    if note is None:
        return _cut(out, config.max_output_chars)
    note = _cut(note, config.max_output_chars)
    out = _cut(out, config.max_output_chars - len(note) - 1)
    return f"{out}\n{note}" if out else note


def output_block(shown: str, after: str = "\n") -> str:
    """The block appended after the model's text `after` (its last characters): ToRL's "```output\\n...\\n```\\n",
    on a line of its own."""
    return ("" if after.endswith("\n") else "\n") + f"```output\n{shown}\n```\n"


class ToolRules(Env):
    """The tool's side of the state transition (common.env), from its config alone: a turn ends at a closing fence
    while programs are left (else at EOS, which ends the episode); the action is the python block the fence closed
    (None: another kind of block, generation goes on); no reward."""

    rewards = False

    def __init__(self, config: ToolConfig):
        super().__init__()
        self.config = config

    def new_stats(self) -> ToolStats:
        return ToolStats()

    def stops(self, ep: Episode) -> list[str]:
        return [FENCE] if ep.stats.calls < self.config.max_calls else []

    def ends(self, ep: Episode, seg: Segment) -> bool:
        return seg.stop != FENCE  # EOS or the template's stop string: the completion is complete

    def action(self, ep: Episode, seg: Segment) -> str | None:
        return closed_program(seg.text)

    def tally(self, stats: ToolStats, turn: Turn) -> ToolStats:
        result: RunResult | None = turn.result
        if result is None:  # the pool itself failed (common.env counts the episode's error): a failed call
            return ToolStats(stats.calls + 1, stats.errors + 1, stats.timeouts, stats.seconds, stats.overlap_seconds)
        return ToolStats(
            stats.calls + 1,
            stats.errors + result.failed,
            stats.timeouts + result.timed_out,
            stats.seconds + result.seconds,
            stats.overlap_seconds + result.overlap_s,
        )

    def fields(self, ep: Episode) -> dict[str, Any]:
        return {"tool": ep.stats}


def program_turn(result: RunResult, config: ToolConfig) -> Turn:
    """A program's run as the environment's answer: what the model is shown, the run kept for the statistics."""
    return Turn(observation=shown_output(result, config), seconds=result.seconds, result=result)


def output_ids(ep: Episode, shown: str, tool: Any) -> list[int]:
    """The ids of the output block appended after `ep`'s last segment (`tool` encodes and decodes)."""
    return tool.encode(output_block(shown, tool.decode(ep.token_ids[ep.last_start :])))


class Tool(ToolRules):
    """The Python tool as an environment (see the module docstring): the sandbox checked (SystemExit in one line when
    it cannot run; once per process), the pool its programs run in beside generation, the tokenizer that encodes the
    output blocks. An answer depends on the program alone, so HF generate starts it the step a row stops (`early`)."""

    early = True

    def __init__(self, config: ToolConfig, tokenizer: Any):
        require_sandbox(config.sandbox)
        super().__init__(config)
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # a server's rollouts run in threads; fast tokenizers object to sharing
        self.pool = ToolPool(Sandbox(config.sandbox, config.limits()), config.workers, self.clock)

    def submit(self, code: str) -> Future:
        """A future of `code`'s RunResult."""
        return self.pool.submit(code)

    def answer(self, ep: Episode) -> Future:
        future: Future = Future()

        def done(run: Future) -> None:
            try:
                future.set_result(program_turn(run.result(), self.config))
            except BaseException as e:  # noqa: BLE001 - handed to the driver, which ends the episode
                future.set_exception(e)

        self.submit(ep.action).add_done_callback(done)
        return future

    def observe(self, ep: Episode, turn: Turn) -> list[int]:
        return output_ids(ep, turn.observation, self)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        self.pool.close()
        super().close()


@dataclass
class Trajectory(Episode):
    """A completion built with the tool by hand (the demonstrations' `splice_text`, tests): common.env's transition
    applied in place, the programs run by `tool` (anything with `config`, `submit`, `encode` and `decode`). The
    samplers drive theirs with common.env.run_episodes."""

    stats: ToolStats = field(default_factory=ToolStats)
    future: Future | None = None  # the program of the last segment, running

    def stops(self, stop: list[str], config: ToolConfig) -> list[str]:
        """The stop strings of this trajectory's next request: the template's, and the fence while calls are left."""
        return list(stop) + ToolRules(config).stops(self)

    def add(self, seg: Segment, budget: int, tool: Any) -> None:
        """Appends a generated segment (cut to `budget` new tokens in all); starts the program it closes, if any."""
        self.__dict__.update(vars(after_segment(self, seg, budget, ToolRules(tool.config))))
        if self.action is not None:
            self.future = tool.submit(self.action)

    def splice(self, budget: int, tool: Any) -> None:
        """Waits for the pending program and appends its output block (mask 0), cut to the budget."""
        if self.future is None:
            return
        turn = program_turn(self.future.result(), tool.config)
        self.future = None
        ids = output_ids(self, turn.observation, tool)
        self.__dict__.update(vars(after_turn(self, turn, ids, budget, ToolRules(tool.config))))

    def text(self, decode, stop: list[str]) -> str:
        """The completion's text: all its ids decoded, the last model segment cut after the template's stop string
        that ended it (as without the tool)."""
        return episode_text(self, decode, stop)


def splice_text(text: str, tool: Any, budget: int) -> Trajectory:
    """A text written with the tool's blocks (a worked solution, for --gt-injection) as a rollout would hold it: its
    text tokenised piece by piece up to each closed ```python block, the block's program run and its output block
    spliced in (an output block the text already holds after it is dropped: the tool's own replaces it), within
    `budget` tokens; at most the config's max_calls programs."""
    t, rest = Trajectory(0, 0), text
    t.logprobs = None
    while rest and not t.done:
        end = None
        if t.stats.calls < tool.config.max_calls:
            starts = (i + len(FENCE) for i in range(len(rest)) if rest.startswith(FENCE, i))
            end = next((e for e in starts if closed_program(rest[:e]) is not None), None)
        piece, rest = (rest, "") if end is None else (rest[:end], rest[end:])
        if rest.startswith("```output\n") and (close := rest.find("\n```\n")) >= 0:
            rest = rest[close + len("\n```\n") :]
        t.add(Segment(tool.encode(piece), None, piece, FENCE if end is not None else None, False), budget, tool)
        t.splice(budget, tool)
    return t
