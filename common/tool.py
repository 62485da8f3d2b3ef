"""A Python tool during rollouts (tool-integrated reasoning, as ToRL, arXiv 2503.23383): the model writes a fenced
```python block; generation stops at the block's closing fence; the program runs in the sandbox (common/sandbox.py);
its output, cut short, is appended as an ```output block; generation goes on from there (docs/tools.md).

    tool = Tool(ToolConfig(max_calls=2), tokenizer)        # checks the sandbox, starts the pool
    sampler = make_sampler(..., tool=tool.config)          # common/sampling.py builds its own Tool

Tokens. A completion's token ids are the sampler's ids exactly as sampled, segment after segment, with each output
block's ids appended between them (the block's text tokenised on its own; the whole text is never re-tokenised), so
the trainer's log-probs condition on exactly what the sampler saw. `Trajectory.mask` is 1 on the model's tokens and
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
from common.sandbox import SANDBOXES, BusyClock, Limits, RunResult, Sandbox, ToolPool, require_sandbox

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


@dataclass
class ToolStats:
    """A completion's tool use: programs run, those that failed (an exception, a non-zero exit, the output cap) and
    those that timed out, their seconds and the part of those that overlapped generation."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    overlap_seconds: float = 0.0


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


class Tool:
    """A ToolConfig at work in one sampler: the sandbox checked (SystemExit in one line when it cannot run), the
    pool, the clock the sampler marks generation with, and the tokenizer that encodes the output blocks."""

    def __init__(self, config: ToolConfig, tokenizer: Any):
        require_sandbox(config.sandbox)
        self.config, self.tokenizer = config, tokenizer
        self.lock = threading.Lock()  # the server's request chains splice from many threads; fast tokenizers object
        self.clock = BusyClock()
        self.pool = ToolPool(Sandbox(config.sandbox, config.limits()), config.workers, self.clock)

    def submit(self, code: str) -> Future:
        return self.pool.submit(code)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        self.pool.close()


@dataclass
class Segment:
    """What one generation request gave: the sampled ids, their processed log-probs (None: the backend gives none),
    the backend's text (cut after a stop string), and how it ended: `stop` the stop string (None for EOS or the
    budget), `truncated` when the budget ran out."""

    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    stop: str | None
    truncated: bool


@dataclass
class Trajectory:
    """One completion being built with the tool: prompt index, sample index within its group, the ids so far (the
    model's segments and the output blocks), their mask and log-probs, the tool's stats, and the pending program."""

    prompt: int
    sample: int
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    stats: ToolStats = field(default_factory=ToolStats)
    done: bool = False
    truncated: bool = False
    last_start: int = 0  # where the last model segment begins (its stop string cuts the final text)
    last_stop: str | None = None
    future: Future | None = None  # the program of the last segment, running
    early: tuple[str, Future] | None = None  # a program started before its segment was returned (`start`)
    waves: int = 0  # generation requests so far (seeds the next)

    def stops(self, stop: list[str], config: ToolConfig) -> list[str]:
        """The stop strings of this trajectory's next request: the template's, and the fence while calls are left."""
        return list(stop) + ([FENCE] if self.stats.calls < config.max_calls else [])

    def add(self, seg: Segment, budget: int, tool: Tool) -> None:
        """Appends a generated segment (cut to `budget` new tokens in all); starts the program it closes, if any."""
        self.last_start, self.last_stop, self.waves = len(self.token_ids), seg.stop, self.waves + 1
        room = budget - len(self.token_ids)
        ids = seg.token_ids[:room]
        self.token_ids += ids
        self.mask += [1] * len(ids)
        if self.logprobs is not None and seg.logprobs is not None:
            self.logprobs += seg.logprobs[: len(ids)]
        else:
            self.logprobs = None
        if len(seg.token_ids) > room or seg.truncated:  # the budget ran out
            self.done, self.truncated = True, True
        elif seg.stop != FENCE:  # EOS or the template's stop string: the completion is complete
            self.done = True
        elif len(self.token_ids) >= budget:  # a closing fence, and no room left after it
            self.done, self.truncated = True, True
        elif (code := closed_program(seg.text)) is not None:  # else another block closed: generation goes on
            self.future = self.early[1] if self.early and self.early[0] == code else tool.submit(code)
        self.early = None

    def start(self, token_ids: list[int], text: str, budget: int, tool: Tool) -> None:
        """Starts the program a segment still being generated has just closed (HF generate calls it the step the
        row stops, so the program runs beside the other rows); `add` takes it over when the segment is returned."""
        room = budget - len(self.token_ids)
        if self.stats.calls < tool.config.max_calls and len(token_ids) < room and text.endswith(FENCE):
            code = closed_program(text)
            if code is not None:
                self.early = (code, tool.submit(code))

    def splice(self, budget: int, tool: Tool) -> None:
        """Waits for the pending program and appends its output block (mask 0), cut to the budget."""
        if self.future is None:
            return
        result: RunResult = self.future.result()
        self.future = None
        s = self.stats
        s.calls += 1
        s.errors += result.failed
        s.timeouts += result.timed_out
        s.seconds += result.seconds
        s.overlap_seconds += result.overlap_s
        after = tool.decode(self.token_ids[self.last_start :])
        ids = tool.encode(output_block(shown_output(result, tool.config), after))
        ids = ids[: budget - len(self.token_ids)]
        self.token_ids += ids
        self.mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)
        if len(self.token_ids) >= budget:
            self.done, self.truncated = True, True

    def text(self, decode, stop: list[str]) -> str:
        """The completion's text: all its ids decoded, the last model segment cut after the template's stop string
        that ended it (as without the tool)."""
        text = decode(self.token_ids)
        if self.last_stop is None or self.last_stop == FENCE:
            return text
        head = decode(self.token_ids[: self.last_start])
        if not text.startswith(head):  # a character split across the boundary: cut the whole text
            head = ""
        tail = text[len(head) :]
        ends = [i + len(s) for s in stop if (i := tail.find(s)) >= 0]
        return head + (tail[: min(ends)] if ends else tail)


def splice_text(text: str, tool: Tool, budget: int) -> Trajectory:
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
