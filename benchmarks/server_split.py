"""Where a step's time goes with the sampler colocated, on a vLLM server (--vllm-mode server) and one step off-policy
on that server (--off-policy-steps 1), on a real model on this machine: benchmarks/real_model.py's setting
(SmolLM2-135M-Instruct on tools/smollm2.py's word problems, 4 prompts x G = 8, 64 new tokens, vLLM's CPU build),
grpo.py, --steps steps, one seed.

    python tools/smollm2.py /tmp/smol
    python benchmarks/server_split.py /tmp/smol                 # ~15 minutes on 2 cores

Per mode: the median over the steps after the first of each phase the scripts log (time/generate, time/reward,
time/old_logprobs, time/train, time/weight_sync, time/step; docs/metrics.md), the largest log-prob canary
(train/logprob_diff_max, which checks every push) and the staleness. The server is tools/vllm_server.py on
127.0.0.1, started fresh for each server mode; it and the trainer share this machine's cores, so here an overlap of
generation with training cannot gain what it gains when the server has its own GPUs. The table goes to
benchmarks/results/server_split.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.real_model import PER_SCRIPT, common_flags  # noqa: E402
from common.vllm_server import wait_until_healthy  # noqa: E402
from tests.checks import free_port  # noqa: E402

PHASES = ("generate", "reward", "old_logprobs", "train", "weight_sync", "step")


def start_server(model: str, log_path: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "tools", "vllm_server.py"), "--model", model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--kv-cache-gib", "1", "--max-model-len", "1024"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until_healthy(f"http://127.0.0.1:{port}", 600)
    return proc, port


def run_mode(name: str, flags: list[str], out: str, data: str) -> list[dict]:
    proc, extra = None, []
    if name != "colocated":
        proc, port = start_server(os.path.join(data, "model"), os.path.join(out, f"{name}_server.log"))
        extra = ["--vllm-mode", "server", "--vllm-server-port", str(port), "--vllm-server-timeout", "600"]
        extra += ["--off-policy-steps", "1" if name.endswith("K=1") else "0"]
    try:
        run_out = os.path.join(out, name.replace(" ", "_").replace("=", ""))
        cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), *flags, *extra, "--output-dir", run_out]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (run_dir,) = [os.path.join(run_out, d) for d in os.listdir(run_out)]
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="tools/smollm2.py's OUT_DIR (model/, train.jsonl, test.jsonl)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-limit", type=int, default=48)
    p.add_argument("--eval-k", type=int, default=2)
    p.add_argument("--sampler", default="vllm")
    a = p.parse_args()
    out = os.path.join(a.data, f"server_split_{int(time.time())}")
    os.makedirs(out)
    flags = [*common_flags(a.data, a), *PER_SCRIPT["grpo"], "--model-name-or-path", os.path.join(a.data, "model")]
    flags += ["--total-steps", str(a.steps), "--eval-every", "0", "--seed", str(a.seed)]
    t0 = time.time()
    lines = ["| mode | " + " | ".join(f"{k} s" for k in PHASES) + " | canary max | staleness |"]
    lines.append("|---" * (len(PHASES) + 3) + "|")
    for name in ("colocated", "server K=0", "server K=1"):
        rows = [r for r in run_mode(name, flags, out, a.data) if "time/step" in r]
        later = rows[1:]
        times = [statistics.median(r.get(f"time/{k}", 0.0) for r in later) for k in PHASES]
        canary = max(r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r)
        stale = sorted({r.get("train/staleness", 0) for r in rows})
        lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {canary:.1e} | {stale} |")
        print(lines[-1], flush=True)
    import torch

    head = (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads, torch {torch.__version__}; grpo.py on "
        f"SmolLM2-135M-Instruct, {a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, {a.steps} steps, "
        f"seed {a.seed}; medians over steps 2-{a.steps}; server and trainer share the machine; "
        f"{(time.time() - t0) / 60:.0f} min"
    )
    table = "\n".join([head, "", *lines])
    with open(os.path.join(ROOT, "benchmarks", "results", "server_split.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
