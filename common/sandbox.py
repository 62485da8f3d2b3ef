"""Running model-written Python in a sandbox: bubblewrap (`bwrap`, Debian's `bubblewrap`), resource limits, and a
pool of workers that runs a step's programs in parallel (docs/tools.md).

    pool = ToolPool(Sandbox("bwrap", Limits(timeout_s=10)), workers=4)
    result = pool.submit("print(2 ** 100)").result()     # a RunResult: stdout, stderr, exit code, limits hit

Each program is one `python -s -u -` process reading its code on stdin, inside a fresh bubblewrap sandbox:

- the root is an empty tmpfs with /usr and the trainer's Python prefix bound read-only (nothing else of the host:
  no /home, /root, /etc, /work, checkpoints or tokens), a private /tmp (tmpfs, `Limits.tmp_mb`), a new /proc and a
  minimal /dev;
- new PID, network (loopback only, down), IPC, UTS and cgroup namespaces; no network at all;
- the environment cleared (`--clearenv`), then a few fixed variables (`ENV`);
- `--die-with-parent` (the sandbox dies with the worker) and `--new-session` (no terminal to inject into);
- limits set by util-linux `prlimit` on the program's processes: address space (`memory_mb`, per process), processes
  (`max_processes`), file size, open files, CPU seconds, no core dumps; the wall-clock `timeout_s` and the output
  cap (`max_output_bytes`, read in chunks: a program printing 100 MB is stopped at the cap, never buffered) are the
  worker's;
- on a timeout or the output cap the worker kills bwrap's process group; bwrap's init process then dies
  (`--die-with-parent`), and with it, by the kernel's rule for PID namespaces, every process the program started.

Root (CI, containers): RLIMIT_NPROC is not enforced for root (the kernel exempts the initial user and
CAP_SYS_RESOURCE), and a user namespace maps the sandbox's uid back to root. So a trainer running as root starts
bwrap as root without a user namespace and the program as an unprivileged uid of its own (util-linux `setpriv`: a
uid per pool slot, `sandbox_uid`, no groups, no capabilities, no_new_privs), where the process limit holds. A
non-root trainer uses an unprivileged user namespace (`--unshare-user`) instead; its processes count against a
limit of their own namespace.

`Sandbox("none")` is the explicit weaker choice: the same limits, a cleared environment, a fresh working directory
and the process group killed on a timeout, but no isolation at all: the program runs as the trainer's user, can read
and write its files (tokens, checkpoints), use the network, and a program that leaves its process group outlives it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

SANDBOXES = ("bwrap", "none")
# the program's environment: nothing of the trainer's (tokens, paths), single-threaded numerical libraries (threads
# count against the process limit) and a fixed hash seed (set and dict orders, so outputs, repeat run to run)
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
UID_BASE = 2_000_000_000  # root only: the programs' uids, far above any account's (no files on the host are theirs)
INSTALL = "apt-get install bubblewrap (Debian/Ubuntu; dnf install bubblewrap on Fedora)"


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    timeout_s: float = 10.0
    """wall-clock seconds before the program (and every process it started) is killed (ToRL's sandbox call: 10 s)"""
    memory_mb: int = 1024
    """address space of each process (RLIMIT_AS; a program's total is at most max_processes times this)"""
    max_processes: int = 4
    """processes and threads the program may run at once (RLIMIT_NPROC, for its own uid)"""
    max_output_bytes: int = 1 << 16
    """stdout + stderr read before the program is stopped (what the model is shown is cut much shorter)"""
    file_mb: int = 16
    """largest file the program may write (RLIMIT_FSIZE)"""
    tmp_mb: int = 64
    """size of its private /tmp (a tmpfs, in memory)"""


@dataclass
class RunResult:
    """What a program did."""

    stdout: str
    stderr: str
    exit_code: int | None
    """the program's exit status (bwrap passes it on; 128 + N when a signal N killed it); None when the worker
    killed it (timeout or output cap)"""
    timed_out: bool = False
    output_limited: bool = False
    seconds: float = 0.0
    """wall-clock seconds from starting the sandbox to its end"""
    overlap_s: float = 0.0
    """of those, the seconds during which the pool's `BusyClock` said the sampler was generating"""

    @property
    def failed(self) -> bool:
        """An execution error: it raised, exited non-zero or hit the output cap (a timeout is counted apart)."""
        return not self.timed_out and (self.output_limited or self.exit_code != 0)


def sandbox_uid(slot: int) -> int:
    """The unprivileged uid (and gid) of a pool slot's programs when the trainer runs as root: one per slot, so each
    slot's process limit is its own, and per trainer process (several ranks on one node rarely share one)."""
    return UID_BASE + (os.getpid() % 1_000_000) * 64 + slot % 64


@functools.cache
def _bwrap_version() -> tuple[int, ...]:
    """bwrap's version, e.g. (0, 8, 0); (0,) when it does not say."""
    try:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0,)


def _python_dirs() -> list[str]:
    """The directories the trainer's Python needs, to bind read-only: its prefix (and a venv's base), where its
    real executable lives."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    exe = os.path.realpath(sys.executable)
    if not any(exe.startswith(d + os.sep) for d in dirs):
        dirs.add(os.path.dirname(exe))
    # /usr is bound whole; anything under it needs no bind of its own
    return sorted(d for d in dirs if d != "/usr" and not d.startswith("/usr/"))


class Sandbox:
    """Builds and runs one program's sandbox (see the module docstring). `kind`: "bwrap" or "none"."""

    def __init__(self, kind: Literal["bwrap", "none"] = "bwrap", limits: Limits | None = None):
        if kind not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {kind!r}")
        self.kind, self.limits = kind, limits or Limits()
        self.root = os.geteuid() == 0
        self.python = os.path.realpath(sys.executable)

    def _prlimit(self) -> list[str]:
        lim = self.limits
        cpu = int(lim.timeout_s) + 2  # a backstop: the wall-clock timeout ends it first
        return [
            "prlimit",
            f"--as={lim.memory_mb << 20}",
            f"--nproc={lim.max_processes}",
            f"--fsize={lim.file_mb << 20}",
            "--nofile=256",
            f"--cpu={cpu}",
            "--core=0",
            "--",
        ]

    def command(self, slot: int = 0) -> list[str]:
        """The command line that runs a program (read from stdin) in pool slot `slot`."""
        program = [self.python, "-s", "-u", "-"]  # no user site-packages, unbuffered (a killed program's output)
        if self.kind == "none":
            return self._prlimit() + program
        cmd = ["bwrap", "--die-with-parent", "--new-session", "--clearenv"]
        cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += ["--hostname", "sandbox"]
        if self.root:  # the program drops to its own uid (setpriv below): bwrap keeps only what that needs
            cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            cmd += ["--cap-add", "CAP_SETPCAP"]
        else:
            cmd += ["--unshare-user", "--cap-drop", "ALL"]
            cmd += ["--disable-userns"] if _bwrap_version() >= (0, 8) else []  # no nested user namespaces
        cmd += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):  # merged /usr: /bin -> usr/bin (a real directory is bound)
            path = f"/{link}"
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        made = {"/", "/usr", "/tmp", "/proc", "/dev"}
        for d in _python_dirs():
            parts = d.strip("/").split("/")
            for k in range(1, len(parts)):  # parents traversable by anyone (bwrap would copy the host's modes)
                parent = "/" + "/".join(parts[:k])
                if parent not in made:
                    cmd += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            cmd += ["--ro-bind", d, d]
            made.add(d)
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        cmd += ["--perms", "1777", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        for k, v in ENV.items():
            cmd += ["--setenv", k, v]
        cmd += ["--"] + self._prlimit()
        if self.root:  # RLIMIT_NPROC binds a non-root uid only
            uid = str(sandbox_uid(slot))
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
            cmd += ["--inh-caps=-all", "--bounding-set=-all", "--"]
        return cmd + program

    def run(self, code: str, slot: int = 0) -> RunResult:
        """Runs `code`; never raises for anything the program does."""
        lim, start = self.limits, time.monotonic()
        workdir = tempfile.mkdtemp(prefix="tool_") if self.kind == "none" else None
        env = dict(ENV) if self.kind == "none" else {"PATH": ENV["PATH"]}
        proc = subprocess.Popen(
            self.command(slot),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # bwrap (or the program) leads a process group the worker can kill
            env=env,
            cwd=workdir or "/",
        )
        try:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            except BrokenPipeError:  # it ended (or failed to start) before reading its code
                pass
            out, err, timed_out, limited = _read_capped(proc, start + lim.timeout_s, lim.max_output_bytes)
            if timed_out or limited:
                _kill_group(proc)
                exit_code = None
                proc.wait()
            else:
                try:
                    exit_code = proc.wait(timeout=max(0.0, start + lim.timeout_s - time.monotonic()))
                except subprocess.TimeoutExpired:  # closed its output but still runs
                    timed_out, exit_code = True, None
                    _kill_group(proc)
                    proc.wait()
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        return RunResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            output_limited=limited,
            seconds=time.monotonic() - start,
        )


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """stdout and stderr until both close, at most `cap` bytes together: (stdout, stderr, timed out, over the cap)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), True, False
            for key, _ in sel.select(left):
                total = sum(len(b) for b in bufs.values())
                chunk = os.read(key.fd, min(1 << 16, cap + 1 - total))
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
                if total + len(chunk) > cap:
                    out, err = bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()]
                    return bytes(out[: max(0, cap - len(err))]), bytes(err[:cap]), False, True
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), False, False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group led by `proc` (bwrap: its PID namespace dies with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def require_sandbox(kind: str) -> None:
    """One-line SystemExit when `kind` cannot run here: bwrap, prlimit or setpriv missing, or bwrap unable to make a
    sandbox (e.g. a container that forbids namespaces). Runs one tiny program."""
    if kind not in SANDBOXES:
        raise SystemExit(f"--tool-sandbox must be one of {', '.join(SANDBOXES)}, got {kind!r}")
    if shutil.which("prlimit") is None:
        raise SystemExit("--tool python needs util-linux's prlimit (apt-get install util-linux)")
    if kind == "none":
        return
    if shutil.which("bwrap") is None:
        raise SystemExit(
            f"--tool python runs model-written code in bubblewrap, which is not installed: {INSTALL}; or pass "
            "--tool-sandbox none to run it without isolation (see its help for the risks)"
        )
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        raise SystemExit("--tool python as root needs util-linux's setpriv (apt-get install util-linux)")
    result = Sandbox(kind, Limits(timeout_s=30)).run("print(6 * 7)")
    if result.stdout.strip() != "42":
        why = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
        raise SystemExit(
            f"--tool python: bubblewrap cannot start a sandbox here ({why}); it needs user or PID namespaces, which "
            "some containers forbid (docs/tools.md); or pass --tool-sandbox none (see its help for the risks)"
        )


class BusyClock:
    """Seconds spent busy so far: `with clock.busy():` around generation (nested or from several threads: busy while
    any is inside). A program's overlap with generation is the clock's advance between its start and end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside, self.total, self.since = 0, 0.0, 0.0

    def seconds(self) -> float:
        with self.lock:
            return self.total + (time.monotonic() - self.since if self.inside else 0.0)

    @contextlib.contextmanager
    def busy(self):
        with self.lock:
            if self.inside == 0:
                self.since = time.monotonic()
            self.inside += 1
        try:
            yield
        finally:
            with self.lock:
                self.inside -= 1
                if self.inside == 0:
                    self.total += time.monotonic() - self.since


class ToolPool:
    """`workers` threads, each running one program at a time in its own slot (its own uid when root): `submit`
    returns at once, so a sampler keeps generating while programs run. Each result belongs to its submission
    (never to a completion order). `clock`: the sampler's BusyClock, for each result's `overlap_s`."""

    def __init__(self, sandbox: Sandbox, workers: int = 4, clock: BusyClock | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.sandbox, self.clock = sandbox, clock or BusyClock()
        self.slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(workers):
            self.slots.put(slot)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    def _run(self, code: str) -> RunResult:
        slot = self.slots.get()
        try:
            busy = self.clock.seconds()
            result = self.sandbox.run(code, slot)
            result.overlap_s = min(result.seconds, self.clock.seconds() - busy)
            return result
        finally:
            self.slots.put(slot)

    def submit(self, code: str) -> Future:
        """A future of `code`'s RunResult."""
        return self.executor.submit(self._run, code)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
