"""Math answer reward: math-verify on the completion's final answer, bounded in time and memory; nothing is `eval`-ed.

The final answer is found by string scanning, in one of `ANSWER_FORMATS` (docs/algorithms.md "Answer formats"); a
completion without one in the required format is a format error and scores 0. math-verify runs in worker processes
started as `python -c` on this file (not forks of the trainer: no torch, CUDA or NCCL state), each with capped memory
and CPU time and a SIGALRM per item; a worker silent past its timeout (stuck in C code) is killed and replaced, and
only the item it was on scores 0, as a timeout. Integer answers are compared here, without a worker: math-verify's
verdict on two integers is their equality. docs/benchmarks.md "Reward scoring" has the rest.

A reasoning-gym row's gold (`task_gold`, common/tasks.py) names its task instead: the answer read in the same format
goes to the task's own `score_answer` in the same workers, under the same timeouts and accounting (docs/tasks.md).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import pickle
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any

MAX_ANSWER_CHARS = 1000  # longer extracted answers score 0 (counted as errors) without parsing
NUM_WORKERS = -1  # -1: default_workers(); 0: score in the calling process; set by set_workers (--reward-workers)
MEMORY_LIMIT_BYTES = 4 << 30  # RLIMIT_AS of each worker
_CHUNK = 32  # max items per message to a worker
_GRACE_S = 1.0  # extra wall time before the parent kills a worker (its own alarm fires at timeout_s)
_START_TIMEOUT_S = 120.0

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"\\[{}]|[{}]")  # escaped braces `\{ \}` are text, not structure
_ANSWER_LINE = re.compile(r"^[^\w\n]*(?:final[ \t]+)?answer[^\w\n:]*:(.*)$", re.IGNORECASE | re.MULTILINE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # the R1 template's answer tags
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # verl math_dapo's answer_pattern (is_correct_minerva)
_DAPO_TAIL = 300  # math_dapo reads only the last 300 characters ("the longest answer in MATH-500 has 159")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+|[eE][+-]?\d+)?")  # thousands: "2,125"
# scientific notation: digits, e or E (at most one space either side), a signed integer; not inside a word or number
_SCI = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+) ?[eE] ?([+-]?\d+)(?![\w.])")
_INTEGER = re.compile(r"-?\d{1,30}")  # decided without math-verify (see the module docstring)
_SURROGATE = re.compile("[\ud800-\udfff]")  # lone surrogates: not valid unicode text
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
TASK_PREFIX = "reasoning-gym:"  # a dataset name of common/tasks.py
_TASK_GOLD = '{"reasoning-gym": '  # how a task_gold string starts
ANSWER_FORMATS = ("any", "boxed", "answer-line", "answer-line-strict", "answer-tag")
TEMPLATE_ANSWER_FORMATS = {
    "none": "any",
    "qwen-boxed": "boxed",
    "dapo": "answer-line",
    "r1": "answer-tag",
    "torl": "boxed",
}


def answer_format_for(prompt_template: str, reward_format: str = "auto") -> str:
    """The answer format a script scores with: --reward-format, or with "auto" the one its --prompt-template asks for
    (none: any, qwen-boxed: boxed, dapo: answer-line, r1: answer-tag, torl: boxed)."""
    return TEMPLATE_ANSWER_FORMATS[prompt_template] if reward_format == "auto" else reward_format


def _unwrap(s: str) -> str:
    s = s.strip()
    for left, right in _WRAPPERS:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _last_boxed(text: str, limit: int | None = None) -> str | None:
    """Content of the last balanced `\\boxed{...}` (or `\\fbox`); with `limit`, cut after limit+1 chars."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts[-4:]):  # a truncated last box falls back to an earlier one
        depth, stop = 1, None if limit is None else start + limit + 1
        for m in _BRACE.finditer(text, start, stop if stop is not None else len(text)):
            if len(m.group()) == 1:
                depth += 1 if m.group() == "{" else -1
                if depth == 0:
                    return _unwrap(text[start : m.start()])
        if stop is not None and stop < len(text):
            return text[start:stop]  # too long: the caller sees len > limit
    return None


def _answer_line(line: str, limit: int | None) -> str | None:
    """The answer on an `Answer:` line: the last box on it if one opens there (None if it never closes, e.g. cut
    off by the budget); else the line without trailing periods, `**` around it and `$ $`, `\\( \\)`, `\\[ \\]`."""
    starts = [m.start() for m in _BOX.finditer(line)]
    return _last_boxed(line[starts[-1] :], limit) if starts else _unwrap(line.strip().rstrip(".").strip("* "))


# verl math_dapo's normalize_final_answer (Minerva, Lewkowycz et al. 2022, appendix D), for "answer-line-strict"
_DAPO_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"))
_DAPO_SUBSTITUTIONS += ((",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_REMOVED = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents degrees cm gm "
    "pounds meters meals edges students childrentickets multiples \\text{s} \\text{.}"
).split() + [
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
]
_DAPO_REMOVED += ["\\;", ",\\!", "{,}", '"', "\\dots"]


def dapo_normalize(answer: str) -> str:
    """verl math_dapo's `normalize_final_answer`: the text after the last `=`, fixed substitutions and unit words
    removed, `$...$`, `\\text{}`, `\\textbf{}`, `\\overline{}`, `\\boxed{}` unwrapped, `\\fracab` / `\\sqrta`
    expanded, and thousands commas dropped from a whole number. "answer-line-strict" compares the results as strings."""
    s = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _DAPO_REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for macro in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{macro}\{{)(.*?)(\}})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s).replace("$", "")
    return (s.replace(",", "") if s.replace(",", "").isdigit() else s).strip()


def _extract(text: str, limit: int | None, answer_format: str = "any") -> str | None:
    if answer_format == "boxed":
        return _last_boxed(text, limit) or None
    if answer_format == "answer-tag":  # the last <answer>...</answer>; a box inside wins (understand-r1-zero)
        tags = _ANSWER_TAG.findall(text)
        return (
            ((_last_boxed(tags[-1], limit) if _BOX.search(tags[-1]) else _unwrap(tags[-1])) or None) if tags else None
        )
    if answer_format in ("answer-line", "answer-line-strict"):  # math_dapo: its pattern's last match in the tail
        lines = _DAPO_ANSWER.findall(text[-_DAPO_TAIL:])
        if answer_format == "answer-line-strict":  # math_dapo's own normalised prediction, compared as a string
            return (dapo_normalize(lines[-1]) or None) if lines else None
        return (_answer_line(lines[-1], limit) or None) if lines else None
    if answer_format != "any":
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    boxed = _last_boxed(text, limit)
    if boxed is None:
        tags = _ANSWER_TAG.findall(text)
        inner = tags[-1] if tags else text
        boxed = _last_boxed(inner, limit) if tags else None
        if boxed is None and tags:
            boxed = _unwrap(inner)
    if boxed is None:
        lines = _ANSWER_LINE.findall(text)
        boxed = _unwrap(lines[-1].strip().rstrip(".").strip("* ")) if lines else None
    if boxed is None:  # no answer marker at all: the last number of the last non-empty line
        last_line = text.strip().rsplit("\n", 1)[-1][-200:]
        numbers = _NUMBER.findall(last_line)
        boxed = numbers[-1].replace(",", "") if numbers else None
    return boxed or None


def extract_final_answer(text: str, answer_format: str = "any") -> str | None:
    """The completion's final answer in `answer_format` (docs/algorithms.md "Answer formats"), None if it has none
    there (a format error)."""
    return _extract(text, None, answer_format)


@functools.lru_cache(maxsize=1 << 16)
def gold_text(answer: str) -> str:
    """The gold answer as a bare string: the last boxed content of a full solution, else the string (a task gold's:
    its entry's answer, "" when the task has none)."""
    if is_task_gold(answer):
        return str(parse_task_gold(answer)["answer"] or "")
    return (_last_boxed(answer) if "\\boxed" in answer or "\\fbox" in answer else None) or _unwrap(answer)


def task_gold(task: str, config: dict[str, Any], index: int, answer: str | None) -> str:
    """A reasoning-gym row's gold: its task, the generator's config and the item's index (which identify the entry
    `score_answer` reads), and its answer (for --gt-injection's demonstrations), as JSON."""
    return json.dumps({"reasoning-gym": task, "index": index, "answer": answer, "config": config})


def is_task_gold(gold: Any) -> bool:
    return isinstance(gold, str) and gold.startswith(_TASK_GOLD)


@functools.lru_cache(maxsize=1 << 16)
def parse_task_gold(gold: str) -> dict[str, Any]:
    """A task gold's fields (shared: do not modify)."""
    return json.loads(gold)


@functools.lru_cache(maxsize=16)
def task_dataset(task: str, config: str):
    """reasoning-gym's dataset object of `task` with `config` (sorted JSON of its config's fields): it generates the
    rows (common/tasks.py) and holds the task's `score_answer`."""
    from reasoning_gym.factory import DATASETS

    dataset_cls, config_cls = DATASETS[task]
    return dataset_cls(config=config_cls(**json.loads(config)))


def _task_verify(pred: str, payload: tuple) -> tuple[float, str]:
    """The task's own score of an extracted answer: 1.0 for a score of 1 and 0.0 below it, or with partial credit
    (--partial-credit) the score itself; a score outside [0, 1] is an error."""
    task, config, entry, partial = payload
    value = float(task_dataset(task, config).score_answer(pred, entry))
    if not 0.0 <= value <= 1.0:
        return 0.0, "error"
    return (value if partial else float(value == 1.0)), "ok"


# math-verify, in the workers


def _parse(answer: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # a bare string is not LaTeX to math-verify until it sits in an environment such as \boxed{}
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"\\boxed{{{sci_to_latex(answer)}}}", config, parsing_timeout=None)


def sci_to_latex(answer: str) -> str:
    """`3.83e35`, `3.83 E 35`, `6.6e-34` -> `3.83 \\times 10^{35}` ...: math-verify reads e as Euler's number. e with no
    digits on both sides (`2e`, `e^{2}`, `x e 5`, `2e - 1`) is left alone; `2e-1` is read as 0.2."""
    return _SCI.sub(r"\1 \\times 10^{\2}", answer)


@functools.lru_cache(maxsize=1 << 16)
def parse_gold(answer: str) -> list[Any]:
    """math-verify's parse of a gold answer (bare, or a solution whose last `\\boxed{}` holds it), cached; no sympy
    object in it means unparseable. Unbounded: `find_unparseable_gold` is the bounded check."""
    return _parse(gold_text(answer))


def _has_expr(parsed: list[Any]) -> bool:
    return any(not isinstance(p, str) for p in parsed)


class _ItemTimeout(BaseException):  # BaseException: math-verify's `except Exception` must not swallow it
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ItemTimeout


def _verify(pred: str | None, gold: str | tuple) -> tuple[float, str]:
    if isinstance(gold, tuple):  # a reasoning-gym task's (common.tasks.task_payload)
        return _task_verify(pred, gold)
    from math_verify import verify

    g = parse_gold(gold)
    if pred is None:  # gold check only
        return float(_has_expr(g)), "ok"
    if not _has_expr(g):
        return 0.0, "error"
    p = _parse(pred)
    if not p:
        return 0.0, "no_answer"
    return float(verify(g, p, timeout_seconds=None)), "ok"


def _score_item(pred: str | None, gold: str, timeout_s: float) -> tuple[float, str]:
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return _verify(pred, gold)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _ItemTimeout:
        return 0.0, "timeout"
    except Exception:  # noqa: BLE001 - any failure scores 0 (includes RecursionError, MemoryError)
        return 0.0, "error"


def _send(f: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def _set_limit(kind: int, soft: int) -> None:
    hard = resource.getrlimit(kind)[1]
    resource.setrlimit(kind, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _worker_main() -> None:
    sys.path[:] = [p for p in sys.path if p not in ("", os.path.dirname(__file__))]
    out, inp = os.fdopen(os.dup(1), "wb"), sys.stdin.buffer
    os.dup2(2, 1)  # stray prints must not corrupt the result stream
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    signal.signal(signal.SIGALRM, _on_alarm)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    _set_limit(resource.RLIMIT_AS, MEMORY_LIMIT_BYTES)
    if "reasoning-gym" in sys.argv[1:]:  # imported before any item's timer starts (seconds on a busy machine)
        import reasoning_gym  # noqa: F401
    _score_item("1", "1", 60.0)  # warm up imports and parser caches
    _send(out, "ready")
    while header := inp.read(4):
        items, timeout_s = pickle.loads(inp.read(struct.unpack("<I", header)[0]))
        cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # CPU cap: bounds us even if orphaned
        _set_limit(resource.RLIMIT_CPU, int(cpu + len(items) * (timeout_s + _GRACE_S)) + 2)
        for i, pred, gold in items:
            _send(out, (i, *_score_item(pred, gold, timeout_s)))


# the pool, in the caller


class _Worker:
    def __init__(self, tasks: bool = False) -> None:
        boot = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__reward_worker__')"
        cmd = [sys.executable, "-c", boot, os.path.abspath(__file__)] + (["reasoning-gym"] if tasks else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.buf, self.ready, self.items, self.since = b"", False, [], time.monotonic()

    def fileno(self) -> int:
        return self.proc.stdout.fileno()  # type: ignore[union-attr]

    def read(self) -> list[Any] | None:
        """Complete messages received so far; None when the worker has died."""
        data = os.read(self.fileno(), 1 << 20)
        if not data:
            return None
        self.buf += data
        msgs = []
        while len(self.buf) >= 4 and len(self.buf) >= 4 + (n := struct.unpack("<I", self.buf[:4])[0]):
            msgs.append(pickle.loads(self.buf[4 : 4 + n]))
            self.buf = self.buf[4 + n :]
        return msgs

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()  # type: ignore[union-attr]


class _Pool:
    def __init__(self, n: int, tasks: bool = False) -> None:
        self.pid, self.tasks, self.workers = os.getpid(), tasks, [_Worker(tasks) for _ in range(n)]

    def _replace(self, w: _Worker, queue: deque, results: dict, status: str | None) -> None:
        if status is not None and w.items:  # charge the item it was on; the rest of the chunk goes back
            results[w.items.pop(0)[0]] = (0.0, status)
        if w.items:
            queue.appendleft(w.items)
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.tasks)

    def run(self, tasks: list[tuple[int, str | None, str]], timeout_s: float) -> dict[int, tuple[float, str]]:
        chunk = max(1, min(_CHUNK, math.ceil(len(tasks) / (2 * len(self.workers)))))
        queue = deque(tasks[k : k + chunk] for k in range(0, len(tasks), chunk))
        results: dict[int, tuple[float, str]] = {}
        while len(results) < len(tasks):
            for w in list(self.workers):
                if w.ready and not w.items and queue:
                    w.items, w.since = list(queue.popleft()), time.monotonic()
                    try:
                        _send(w.proc.stdin, (w.items, timeout_s))
                    except OSError:  # died while idle: not the items' fault
                        self._replace(w, queue, results, None)
            busy = [w for w in self.workers if w.items or not w.ready]
            for w in select.select(busy, [], [], 0.1)[0]:
                msgs = w.read()
                if msgs is None and not w.ready:
                    raise RuntimeError("common.reward: a math-verify worker failed to start (see stderr)")
                if msgs is None:
                    self._replace(w, queue, results, "error")
                    continue
                for msg in msgs:
                    if msg == "ready":
                        w.ready = True
                    else:
                        i, value, status = msg
                        if w.items.pop(0)[0] != i:
                            raise RuntimeError("common.reward: worker answered out of order")
                        results[i] = (value, status)
                        if status == "timeout":  # its alarm cut math-verify / sympy mid-parse and their caches
                            # may be half-updated (a later verdict on the same input came back different): the rest
                            # of its chunk, answered or not, goes to a fresh worker
                            self._replace(w, queue, results, None)
                            break
                    w.since = time.monotonic()
            now = time.monotonic()
            for w in list(self.workers):
                if not w.ready and now - w.since > _START_TIMEOUT_S:
                    raise RuntimeError("common.reward: a math-verify worker did not start in time")
                if w.items and now - w.since > timeout_s + _GRACE_S:
                    self._replace(w, queue, results, "timeout")
        return results

    def close(self) -> None:
        for w in self.workers:
            w.kill()


_POOL: _Pool | None = None
_LOCK = threading.Lock()


def default_workers() -> int:
    """The cores this process may use (its CPU affinity) divided among the node's local ranks (LOCAL_WORLD_SIZE,
    set by torchrun / accelerate launch), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def set_workers(n: int) -> None:
    """Score with `n` worker processes from now on; -1: `default_workers()`; 0: in the calling process."""
    global NUM_WORKERS
    if n < -1:
        raise ValueError(f"set_workers: n must be >= -1, got {n}")
    NUM_WORKERS = n


def _run_here(tasks: list[tuple[int, str | None, str]], timeout_s: float) -> dict[int, tuple[float, str]]:
    """Scores tasks in this process, each under a SIGALRM timer (main thread only: signals go there)."""
    log = logging.getLogger("math_verify")  # its "timeout is disabled" warnings: our timer is the timeout
    previous, level = signal.signal(signal.SIGALRM, _on_alarm), log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {i: _score_item(pred, gold, timeout_s) for i, pred, gold in tasks}
    finally:
        signal.signal(signal.SIGALRM, previous)
        log.setLevel(level)


def _run(tasks: list[tuple[int, str | None, Any]], timeout_s: float) -> dict[int, tuple[float, str]]:
    global _POOL
    workers = default_workers() if NUM_WORKERS < 0 else NUM_WORKERS
    results: dict[int, tuple[float, str]] = {}
    for i, pred, gold in tasks:  # two integers: math-verify's verdict is integer equality (a gold alone parses)
        if isinstance(gold, tuple):  # a task's: its own scorer decides, in a worker
            continue
        if _INTEGER.fullmatch(pred or "0") and _INTEGER.fullmatch(gold_str := gold_text(gold)):
            results[i] = (float(pred is None or int(pred) == int(gold_str)), "ok")
    tasks = [t for t in tasks if t[0] not in results]
    if workers == 0 and threading.current_thread() is threading.main_thread():  # SIGALRM reaches the main thread only
        results.update(_run_here(tasks, timeout_s))
        tasks = []
    if not tasks:
        return results
    with _LOCK:
        need_tasks = any(isinstance(t[2], tuple) for t in tasks)  # workers that import reasoning-gym at start
        if _POOL is not None and (
            _POOL.pid != os.getpid() or len(_POOL.workers) != max(1, workers) or need_tasks > _POOL.tasks
        ):
            if _POOL.pid == os.getpid():  # resized: a forked child must not touch its parent's workers
                _POOL.close()
            _POOL = None
        if _POOL is None:  # a forked child must not share its parent's pipes
            _POOL = _Pool(max(1, workers), need_tasks)
        try:
            return {**results, **_POOL.run(tasks, timeout_s)}
        except BaseException:  # e.g. Ctrl-C mid-batch: late answers must not leak into the next call
            _POOL.close()
            _POOL = None
            raise


@atexit.register
def _shutdown() -> None:
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()


def score(
    completions: list[str], answers: list[str], timeout_s: float = 5.0, answer_format: str = "any"
) -> tuple[list[float], dict[str, int]]:
    """Score each completion 1.0/0.0 against its gold answer and count what went wrong.

    Returns `(scores, {"timeouts": n, "errors": n, "no_answer": n, "format_errors": n})`: timeouts are items that
    ran past `timeout_s` seconds; errors are exceptions, dead workers, answers too long or not valid unicode, and
    unparseable gold; no_answer is a completion with no final answer (or one math-verify extracts nothing from);
    format_errors, a subset of no_answer, is a completion with no answer in `answer_format` (see extract_final_answer).
    A reasoning-gym gold (`task_gold`) is scored by its task's `score_answer` (docs/tasks.md): its answer may be
    longer (twice the gold's), answer-line-strict reads the answer line without math_dapo's normalisation, and an
    answer the task's scorer would run as code is an error (common.tasks.unsafe_answer).
    """
    if len(completions) != len(answers):
        raise ValueError(f"score: {len(completions)} completions but {len(answers)} answers")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    scores, counts = ([0.0] * len(completions), {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0})
    key = {"timeout": "timeouts", "error": "errors", "no_answer": "no_answer"}
    tasks: list[tuple[int, str | None, Any]] = []
    for i, (completion, gold) in enumerate(zip(completions, answers)):
        task = is_task_gold(gold)
        fmt = "answer-line" if task and answer_format == "answer-line-strict" else answer_format
        limit = max(MAX_ANSWER_CHARS, 2 * len(gold_text(gold))) if task else MAX_ANSWER_CHARS
        ans = _extract(completion, limit, fmt)
        if ans is None:
            counts["no_answer"] += 1
            counts["format_errors"] += 1
        elif len(ans) > limit or _SURROGATE.search(ans):
            counts["errors"] += 1
        elif task:
            from common.tasks import task_payload, unsafe_answer

            payload = task_payload(gold)
            if unsafe_answer(payload[0], ans):
                counts["errors"] += 1
            else:
                tasks.append((i, ans, payload))
        elif answer_format == "answer-line-strict":  # math_dapo: normalised strings, equal or not
            scores[i] = float(ans == dapo_normalize(gold_text(str(gold))))
        elif ans == gold_text(str(gold)):
            scores[i] = 1.0
        else:
            tasks.append((i, ans, str(gold)))
    for i, (value, status) in _run(tasks, timeout_s).items():
        scores[i] = value
        if status in key:
            counts[key[status]] += 1
    return scores, counts


def math_reward(completions: list[str], answers: list[str], answer_format: str = "any") -> list[float]:
    """1.0 where math-verify judges the completion's final answer, read in `answer_format` (one of ANSWER_FORMATS),
    equivalent to the gold answer, else 0.0 (also when there is no answer in that format)."""
    return score(completions, answers, answer_format=answer_format)[0]


def find_unparseable_gold(answers: list[str], timeout_s: float = 5.0) -> list[int]:
    """Indices of gold answers math-verify cannot parse (report them at dataset load time)."""
    golds = [str(a) for a in answers]
    unique = {g: k for k, g in enumerate(golds) if g.strip() and not is_task_gold(g)}
    results = _run([(k, None, g) for g, k in unique.items()], timeout_s)
    ok = {golds[k] for k, (value, _) in results.items() if value == 1.0} | {g for g in golds if is_task_gold(g)}
    return [i for i, g in enumerate(golds) if g not in ok]


if __name__ == "__reward_worker__":
    _worker_main()
