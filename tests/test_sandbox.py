"""common/sandbox.py: the tool's sandbox against hostile programs, one test each. Every program is contained with
a one-line output (what `tools/run_tool.py` shows the model) and the pool goes on running programs afterwards.

The trainer may run as root (CI does): the fork bomb and the leftover checks hold then too (the programs run as
an unprivileged uid of their own, `common.sandbox.sandbox_uid`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from common.sandbox import Limits, Sandbox, ToolPool, require_sandbox, sandbox_uid
from common.tool import ToolConfig, output_block, shown_output
from tests.conftest import ROOT

CONFIG = ToolConfig(timeout_s=2.0, memory_mb=512)
LIMITS = CONFIG.limits()


def bwrap_or_skip() -> None:
    """Skips the caller, with require_sandbox's line (what to install), where bubblewrap cannot run: installed without
    root, the tool is the only thing missing (tools/install_cpu.sh). CI sets REQUIRE_SANDBOX=1: it fails there."""
    try:
        require_sandbox("bwrap")
    except SystemExit as e:
        if os.environ.get("REQUIRE_SANDBOX") == "1":
            raise RuntimeError(f"REQUIRE_SANDBOX=1 but {e}") from None
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def pool():
    bwrap_or_skip()
    p = ToolPool(Sandbox("bwrap", LIMITS), workers=2)
    yield p
    p.close()


def run(pool, code: str):
    """Runs `code` in the pool, checks that the pool still runs an ordinary program afterwards, and returns the
    result and the lines the model is shown."""
    result = pool.submit(code).result(timeout=LIMITS.timeout_s + 30)
    assert pool.submit("print(6 * 7)").result(timeout=LIMITS.timeout_s + 30).stdout == "42\n"
    shown = shown_output(result, CONFIG)
    assert len(shown) <= CONFIG.max_output_chars
    return result, shown.splitlines()


def sandbox_processes() -> list[str]:
    """Processes the sandboxes of this test process may have left: as root, those of its slots' uids; otherwise
    those in a PID namespace other than the init one (the sandboxes' are the only ones a test makes)."""
    if os.geteuid() == 0:
        uids = ",".join(str(sandbox_uid(slot)) for slot in range(64))
        out = subprocess.run(["ps", "-o", "pid=,uid=,args=", "-U", uids], capture_output=True, text=True).stdout
        return out.strip().splitlines()
    own = os.readlink("/proc/self/ns/pid")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != own and os.stat(f"/proc/{pid}").st_uid == os.getuid():
                found.append(pid)
        except OSError:
            pass
    return found


def test_an_ordinary_program_and_what_the_model_is_shown(pool):
    result, shown = run(pool, "import sympy\nprint(sympy.factorint(2**32 + 1))\nprint(sum(range(101)))")
    assert shown == ["{641: 1, 6700417: 1}", "5050"] and result.exit_code == 0 and not result.failed
    assert output_block("5050") == "```output\n5050\n```\n"
    result, shown = run(pool, "x = 1\nprint('before')\nprint(x / 0)")
    assert shown == ["before", "ZeroDivisionError: division by zero"] and result.failed


def test_infinite_loop_is_stopped_at_the_timeout(pool):
    result, shown = run(pool, "while True:\n    pass")
    assert shown == [f"TimeoutError: the program ran longer than {LIMITS.timeout_s:g} s and was stopped"]
    assert result.timed_out and LIMITS.timeout_s <= result.seconds < LIMITS.timeout_s + 5  # the kill is prompt


def test_a_64_gib_allocation_is_refused(pool):
    # 64 chunks of 1 GiB: each alone passes the kernel's overcommit check (and is never touched), so only the
    # sandbox's address-space limit stops it
    result, shown = run(pool, "chunks = [bytearray(1 << 30) for _ in range(64)]\nprint('allocated', len(chunks))")
    assert shown == ["MemoryError"] and result.failed


BOMB = "import os\nwhile True:\n    os.fork()"
# a fork bomb of depth 6 (64 processes if nothing stops it) whose processes all wait; the first one counts the
# processes it can see in its PID namespace (the sandbox's init process aside) and leaves the others behind
COUNTED_BOMB = """import os, time
main = os.getpid()
for _ in range(6):
    try:
        os.fork()
    except OSError:
        break
if os.getpid() != main:
    time.sleep(600)
time.sleep(0.5)
print(sum(p.isdigit() for p in os.listdir('/proc')) - 1, 'processes')
"""


def test_a_fork_bomb_is_held_to_the_process_limit_and_leaves_nothing_running(pool):
    assert not sandbox_processes()
    result, shown = run(pool, BOMB)
    assert len(shown) == 1 and ("Resource temporarily unavailable" in shown[0] or result.timed_out), shown
    result, shown = run(pool, COUNTED_BOMB)
    count = int(shown[0].split()[0])
    assert len(shown) == 1 and 1 < count <= LIMITS.max_processes, shown
    time.sleep(0.2)  # the namespace's processes are killed as its init exits; give the kernel a moment
    assert not sandbox_processes()


SECRET = "hf_sandbox_secret_4711"


def test_the_trainers_environment_is_not_visible(pool, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)  # in the trainer's environment, which every child inherits by default
    code = (
        "import glob, os\n"
        "seen = [open(p, 'rb').read().decode(errors='replace') for p in glob.glob('/proc/*/environ')\n"
        "        if os.access(p, os.R_OK)]\n"
        "print(sorted(os.environ), len(seen), any('HF_TOKEN' in s for s in seen))"
    )
    result, shown = run(pool, code)
    assert SECRET not in result.stdout + result.stderr and "HF_TOKEN" not in result.stdout, result.stdout
    assert len(shown) == 1 and shown[0].endswith("False")


def test_a_connection_to_a_listener_on_localhost_fails(pool):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
        result, shown = run(pool, code)
        listener.settimeout(0.5)  # a connection the program made would be waiting in the backlog by now
        with pytest.raises(TimeoutError):
            listener.accept()[0].close()
    assert len(shown) == 1 and "Error" in shown[0] and result.failed, shown


def test_files_outside_the_sandbox_stay_untouched(pool, tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("original")
    planted = os.path.join(sys.prefix, "planted_by_the_tool.py")
    code = (
        "import os\n"
        f"for path in ({str(target)!r}, {str(tmp_path / 'new.txt')!r}, {planted!r}):\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "    except OSError as e:\n"
        "        err = e\n"
        "open('/tmp/mine.txt', 'w').write('private')  # its own /tmp is writable\n"
        "raise err"
    )
    result, shown = run(pool, code)
    assert len(shown) == 1 and "Error" in shown[0] and result.failed
    assert target.read_text() == "original" and sorted(os.listdir(tmp_path)) == ["outside.txt"]
    assert not os.path.exists(planted)


def test_100_mb_of_output_is_cut_and_never_buffered(pool):
    result, shown = run(pool, "print('x' * 100_000_000)")
    assert result.output_limited and len(result.stdout) + len(result.stderr) <= LIMITS.max_output_bytes
    assert shown[-1] == (
        f"OutputLimitError: the program wrote more than {LIMITS.max_output_bytes} bytes and was stopped"
    )
    assert len(shown) == 2 and set(shown[0]) == {"x", "."}  # the output's ends around "..."


def test_killing_its_parent_harms_nothing(pool):
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        err = e\n"
        "os.killpg(0, signal.SIGKILL)  # and its own process group\n"
    )
    result, shown = run(pool, code)  # run() also checks that the pool still works
    assert shown == ["the program was killed by signal 9"], shown
    assert not sandbox_processes()


def test_run_tool_prints_the_output_block():
    code = "print(sum(range(101)))\n"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "run_tool.py")], input=code, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout == "```output\n5050\n```\n", out.stderr


def test_without_bubblewrap_a_run_stops_with_one_line(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None if name == "bwrap" else "/usr/bin/" + name)
    with pytest.raises(SystemExit) as e:
        require_sandbox("bwrap")
    assert "apt-get install bubblewrap" in str(e.value) and "--tool-sandbox none" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_weaker_choice_runs_with_limits_but_no_isolation(tmp_path):
    sandbox = Sandbox("none", Limits(timeout_s=0.5))
    target = tmp_path / "reachable.txt"
    result = sandbox.run(f"open({str(target)!r}, 'w').write('written')\nwhile True:\n    pass")
    assert target.read_text() == "written" and result.timed_out  # the host's files are its own; the limits hold


def test_many_programs_run_at_once_and_each_result_is_its_own(pool):
    started = time.monotonic()
    futures = [pool.submit(f"import time\ntime.sleep({0.3 * (k % 3)})\nprint({k} ** 2)") for k in range(8)]
    assert [f.result().stdout for f in futures] == [f"{k**2}\n" for k in range(8)]
    assert time.monotonic() - started < 8 * LIMITS.timeout_s  # bounded by the limits, not a speed claim
