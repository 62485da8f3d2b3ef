"""Token normalisation across micro-batches and ranks: a script's update on a fixed rollout gives the same
gradient with 1 process x 1 micro-batch, 1 process x k micro-batches and 2 processes (torchrun, gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.test_scripts import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(script, out_dir, model, micro, procs):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if procs == 1:
        cmd = [sys.executable, WORKER]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(free_port()), WORKER]
    subprocess.run(cmd + [script, str(out_dir), model, str(micro)], check=True, cwd=ROOT, env=env, timeout=300)
    return torch.load(os.path.join(out_dir, f"grad_{script}_{procs}_{micro}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_same_gradient_for_one_or_many_micro_batches_and_ranks(script, toy_assets, tmp_path):
    whole = run_worker(script, tmp_path, toy_assets["model"], 16, 1)
    micro = run_worker(script, tmp_path, toy_assets["model"], 3, 1)
    dist = run_worker(script, tmp_path, toy_assets["model"], 3, 2)
    assert whole["world_size"] == 1 and dist["world_size"] == 2
    norm = sum(g.norm() ** 2 for g in whole["grad"].values()) ** 0.5
    assert norm > 1e-6  # the rollout really produces a gradient
    for k, g in whole["grad"].items():
        torch.testing.assert_close(micro["grad"][k], g, rtol=1e-9, atol=1e-12, msg=f"micro-batches: {k}")
        torch.testing.assert_close(dist["grad"][k], g, rtol=1e-9, atol=1e-12, msg=f"2 ranks: {k}")
