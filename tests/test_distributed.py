"""Token normalisation across micro-batches and ranks: a script's update on a fixed rollout gives the same
gradient with 1 process x 1 micro-batch, 1 process x k row micro-batches, 2 processes (torchrun, gloo) with the
default token-budget micro-batches capped at k rows, 2 processes with micro-batches packed by a small token budget,
and DeepSpeed ZeRO-3 on 2 processes."""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.checks import launch_cmd, run_side_by_side, script_advantages, selected_cases
from tests.dist_worker import job_file
from tests.test_scripts import SCRIPTS, read_metrics, toy_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")


def worker_launch(out_dir, model, procs, jobs, zero3=False, fsdp2=False) -> tuple[list[str], dict]:
    """The command and environment of one launch of tests/dist_worker.py on `procs` processes for `jobs`, [(script,
    micro-batch size, overrides)]; it writes their gradients into `out_dir` (read by `load_grad`)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if zero3:  # accelerate's DeepSpeed launcher, as a user runs configs/zero3.yaml, on CPU
        ds = os.path.join(out_dir, "ds.json")  # persistence threshold 0: every parameter really is partitioned
        with open(ds, "w") as f:
            json.dump(
                {
                    "zero_optimization": {
                        "stage": 3,
                        "stage3_param_persistence_threshold": 0,
                        "stage3_max_reuse_distance": 0,
                        "stage3_prefetch_bucket_size": 0,
                        "stage3_gather_16bit_weights_on_model_save": True,
                    },
                    "train_micro_batch_size_per_gpu": "auto",
                    "train_batch_size": "auto",
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": "auto",
                },
                f,
            )
        cmd = launch_cmd(WORKER, procs, deepspeed_config=ds)
    elif procs == 1:
        cmd = [sys.executable, WORKER]
    else:
        cmd = launch_cmd(WORKER, procs)
    cmd += [str(out_dir), model] + ["fsdp2=1"] * fsdp2
    cmd += [",".join([s, str(micro), *(f"{k}={v}" for k, v in kw.items())]) for s, micro, kw in jobs]
    return cmd, env


def run_launches(launches: dict, out_dir) -> dict[str, SimpleNamespace]:
    """{key: (command, environment)} of `worker_launch`, two side by side (tests.checks.run_side_by_side: process and
    process-group starts are most of a launch's time, in one thread): {key: its output, for `load_grad`}."""
    done = run_side_by_side(launches, str(out_dir), timeout=900)
    return {key: SimpleNamespace(returncode=c, stdout=o, stderr=e) for key, (c, o, e) in done.items()}


def load_grad(out_dir, script, procs, micro, kw, zero3=False, fsdp2=False, launch=None):
    """The gradient a job saved, or a failure that shows the launch's output (`launch`) when it saved none."""
    path = os.path.join(out_dir, job_file(script, procs, micro, {k: str(v) for k, v in kw.items()}, zero3, fsdp2))
    if not os.path.exists(path):
        output = (launch.stdout[-3000:] + launch.stderr[-5000:]) if launch is not None else ""
        pytest.fail(f"no gradient for {script} micro={micro} {kw} on {procs} processes:\n{output}")
    return torch.load(path)


# Per-script settings of the worker: the losses that select tokens over the whole mini-batch (over all ranks) get an
# off-policy rollout (stale=1) so that their selection acts; Clip-Cov draws its tokens at random per rank, so every
# candidate is taken (ratio 1) in a band that has candidates on this rollout. REINFORCE++'s reward holds the KL to the
# reference at pi_old: stale=1 gives it a pi_old different from the policy, and its advantages are normalised over
# both ranks (the test after the next).
REINFORCE_PP = ("reinforce_pp", {"stale": 1})
CASES = [(s, {}) for s in SCRIPTS if s not in ("clip_cov", "m2po", "reinforce_pp")]
CASES += [(s, kw) for s, kw in [
    ("clip_cov", {"stale": 1, "clip_cov_ratio": 1.0, "clip_cov_lb": 0.0}),
    ("clip_cov", {"stale": 1, "cov_form": "kl", "kl_cov_ratio": 0.2}),
    ("m2po", {"stale": 1}),
    ("m2po", {"stale": 1, "m2po_scope": "all"}),
    REINFORCE_PP,
] if s in SCRIPTS]  # fmt: skip


# Every split for the scripts whose update reaches across the mini-batch beyond the two normalisers (GRPO's reference,
# LitePPO's batch std, DARO's weights, Clip-Cov's and M2PO's token selections, the critics' whitening over both ranks
# and VAPO's LM-loss token count); the others' losses are sums over the rollout divided by those normalisers (their
# micro-batch additivity: each script's float64 test), so 1 process against 2 ranks in micro-batches checks them.
# Which rows a micro-batch holds is common code, the same for all.
ALL_SPLITS = ("grpo", "lite_ppo", "daro", "clip_cov", "m2po", "ppo", "vapo")
# FSDP2 as well (see the test's docstring): grpo, LitePPO's batch std, DARO's weights, ppo.py's critic (a second
# sharded model), and the token selections of Clip-Cov and M2PO over both ranks' mini-batch (their first case each)
FSDP2_CASES = [(s, kw) for s, kw in CASES if s in ("grpo", "lite_ppo", "daro", "ppo")]
FSDP2_CASES += [(s, kw) for s, kw in CASES if s in ("clip_cov", "m2po")][::2]


SAME_GRADIENT = "test_same_gradient_for_one_or_many_micro_batches_and_ranks"
GLOBAL_NORM = "test_reinforce_pp_normalises_over_every_rank"


@pytest.fixture(scope="module")
def gradients(request, toy_assets, tmp_path_factory):
    """The gradients of the cases of the test below that this session runs, and grpo's on 1 process, in three
    launches of the worker (1 process, 2, 2 with FSDP2; two side by side) instead of ~4 per case: process and
    process-group starts are most of a job's time. (launch key, script, micro-batch size, overrides) -> gradient
    file's contents."""
    cases = [(c["script"], c["kw"]) for c in selected_cases(request, SAME_GRADIENT).values()]
    norm_test = any(getattr(it, "originalname", "") == GLOBAL_NORM for it in request.session.items)
    if norm_test and REINFORCE_PP not in cases and "reinforce_pp" in SCRIPTS:
        cases.append(REINFORCE_PP)  # the test below reads that case's launches
    plan = {"1": [("grpo", 16, {})], "2": [], "FSDP2": []}
    for script, kw in cases:
        plan["1"].append((script, 16, kw))
        plan["2"].append((script, 3, kw))  # the default token budget, <= 3 rows each
        if script in ALL_SPLITS:  # rows in order (--micro-batch-tokens 0); packed by a small token budget on 2 ranks
            plan["1"].append((script, 3, {**kw, "micro_batch_tokens": 0}))
            plan["2"].append((script, 16, {**kw, "micro_batch_tokens": 20}))
        if (script, kw) in FSDP2_CASES:
            plan["FSDP2"].append((script, 3, kw))
    out, launches = tmp_path_factory.mktemp("gradients"), {}
    for key, jobs in plan.items():
        jobs = [job for i, job in enumerate(jobs) if job not in jobs[:i]]
        if jobs:
            launches[key] = worker_launch(out, toy_assets["model"], 1 if key == "1" else 2, jobs, fsdp2=key == "FSDP2")
    launches = run_launches(launches, out)

    def load(key, script, micro, kw):
        procs = 1 if key == "1" else 2
        return load_grad(out, script, procs, micro, kw, fsdp2=key == "FSDP2", launch=launches.get(key))

    return load


@pytest.mark.slow
@pytest.mark.parametrize("script,kw", CASES, ids=[s + "".join(f"-{v}" for v in kw.values()) for s, kw in CASES])
def test_same_gradient_for_one_or_many_micro_batches_and_ranks(script, kw, gradients):
    """And for FSDP2_CASES, FSDP2 (accelerate's `fully_shard` of each decoder layer and of the policy, as
    configs/fsdp2.yaml) on 2 CPU processes in micro-batches: the same update, the weight push gathers full tensors,
    and HF generate samples from the sharded policy with ranks of different lengths (tests/dist_worker.py). accelerate
    turns FSDP on for accelerator processes only, so the worker sets that state itself on CPU ones."""
    whole = gradients("1", script, 16, kw)
    dist = gradients("2", script, 3, kw)  # the default token budget, <= 3 rows each
    assert whole["world_size"] == 1 and dist["world_size"] == 2
    others = {"2 ranks in micro-batches": dist}
    if script in ALL_SPLITS:
        # rows in order (--micro-batch-tokens 0), and micro-batches packed by a small token budget on 2 ranks
        others["micro-batches"] = gradients("1", script, 3, {**kw, "micro_batch_tokens": 0})
        others["2 ranks, token budget"] = gradients("2", script, 16, {**kw, "micro_batch_tokens": 20})
        assert others["2 ranks, token budget"]["world_size"] == 2
    if (script, kw) in FSDP2_CASES:
        others["FSDP2"] = gradients("FSDP2", script, 3, kw)
        assert others["FSDP2"]["type"] == "DistributedType.FSDP"
    norm = sum(g.norm() ** 2 for g in whole["grad"].values()) ** 0.5
    assert norm > 1e-6  # the rollout really produces a gradient
    for k, g in whole["grad"].items():
        for name, other in others.items():  # float64 throughout
            torch.testing.assert_close(other["grad"][k], g, rtol=1e-9, atol=1e-12, msg=f"{name}: {k}")


@pytest.mark.slow
@pytest.mark.skipif("reinforce_pp" not in SCRIPTS, reason="reinforce_pp.py")
def test_reinforce_pp_normalises_over_every_rank(gradients):
    """reinforce_pp.py's advantages, each rank computing those of its own half of the groups (as main() does), equal
    one process's and a float64 loop's over the whole rollout (eq. 5: the mean and std of every rank's tokens); each
    rank's own statistics would give others. From the same launches as the test above (its REINFORCE_PP case)."""
    import reinforce_pp
    from tests.test_reinforce_pp import brute_advantages

    script, kw = REINFORCE_PP
    whole, dist = gradients("1", script, 16, kw)["per_token"], gradients("2", script, 3, kw)["per_token"]
    for k in whole:  # the log-probs on the completions' tokens (the padding differs between micro-batch plans)
        x, y = (run[k].double() * (run["mask"] if k in ("old", "ref") else 1) for run in (dist, whole))
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=k)
    args = reinforce_pp.Args(group_size=4)
    inputs = whole["rewards"].double(), whole["mask"], whole["old"], whole["ref"]
    torch.testing.assert_close(whole["advantages"], brute_advantages(*inputs, args), rtol=0, atol=1e-12)
    halves = [brute_advantages(*(x[h] for x in inputs), args) for h in (slice(0, 8), slice(8, 16))]
    assert not torch.allclose(torch.cat(halves), dist["advantages"], atol=1e-3)  # per-rank statistics differ


@pytest.mark.parametrize("script", SCRIPTS)
def test_micro_batches_hold_every_row_once_within_the_token_budget_and_the_row_cap(script):
    """The plan update_policy follows: token budget (longest completion first) capped at --micro-batch-size rows, or
    exactly --micro-batch-size rows in order with --micro-batch-tokens 0; a row over the budget goes alone."""
    mod = importlib.import_module(script)
    assert mod.Args().micro_batch_tokens > 0  # token budgets are the default
    g = torch.Generator().manual_seed(0)
    prompts, completions = (torch.randint(1, 40, (200,), generator=g), torch.randint(1, 300, (200,), generator=g))
    lens = [(int(p), int(c)) for p, c in zip(prompts, completions)]
    rows = torch.randperm(200, generator=g).tolist()[:150]
    for tokens, cap in [(1000, 256), (1000, 3), (8192, 256), (200, 256), (0, 7)]:
        budget = SimpleNamespace(micro_batch_size=cap, micro_batch_tokens=tokens, padding_free=False)
        plan = mod.micro_batches(rows, lens, budget)
        assert sorted(r for group, _, _ in plan for r in group) == sorted(rows)
        for group, p_w, c_w in plan:
            assert (p_w, c_w) == (max(lens[r][0] for r in group), max(lens[r][1] for r in group))
            assert len(group) <= cap and (tokens == 0 or len(group) == 1 or len(group) * (p_w + c_w) <= tokens)
        if tokens == 0:
            assert [r for group, _, _ in plan for r in group] == rows and all(len(gr) == cap for gr, _, _ in plan[:-1])
        else:
            firsts = [lens[group[0]][1] for group, _, _ in plan]
            assert firsts == sorted(firsts, reverse=True)  # longest first
            assert len(plan) > 1 and (cap > 3 or max(len(gr) for gr, _, _ in plan) == 3)  # the cap binds when small


ZERO3_UPDATE = "test_zero3_gives_the_same_update"


@pytest.fixture(scope="module")
def zero3_gradients(request, toy_assets, tmp_path_factory):
    """The ZeRO-3 launches of the test below that this session runs (one per micro-batch size, grpo's and ppo.py's
    jobs in each), side by side: (out_dir, {micro: launch})."""
    pytest.importorskip("deepspeed")
    out, launches = tmp_path_factory.mktemp("zero3_update"), {}
    for params in selected_cases(request, ZERO3_UPDATE).values():
        jobs = [(s, params["micro"], {}) for s in ("grpo", "ppo") if s in SCRIPTS]
        launches[str(params["micro"])] = worker_launch(out, toy_assets["model"], 2, jobs, zero3=True)
    return out, {int(k): launch for k, launch in run_launches(launches, out).items()}


@pytest.mark.slow
@pytest.mark.parametrize("micro", [16, 3])
def test_zero3_gives_the_same_update(micro, gradients, zero3_gradients):
    """DeepSpeed ZeRO-3 on 2 CPU processes (every parameter partitioned, the tied output weight used outside its
    module, k micro-batches per optimizer step) gives the update of 1 process without DeepSpeed; so does ppo.py's,
    policy and critic: two engines, the critic's driven by its own backward and step (common/critic.py), in the same
    launch."""
    out, launches = zero3_gradients
    for script in [s for s in ("grpo", "ppo") if s in SCRIPTS]:
        whole = gradients("1", script, 16, {})
        zero3 = load_grad(out, script, 2, micro, {}, zero3=True, launch=launches[micro])
        assert zero3["world_size"] == 2 and zero3["type"] == "DistributedType.DEEPSPEED"
        assert set(zero3["grad"]) == set(whole["grad"])
        # DeepSpeed trains the fp64 toy model in fp32. Each gradient entry is ~10 sums deep (2 layers' matmuls,
        # norms, attention) of K <= 128 terms; the probabilistic bound sqrt(K) u32 per sum (Higham & Mary, SIAM J.
        # Sci. Comput. 2019) gives 10 sqrt(128) 6e-8 = 7e-6 relative: rtol 1e-5, atol 1e-6 for entries near 0.
        for k, g in whole["grad"].items():
            torch.testing.assert_close(zero3["grad"][k].double(), g, rtol=1e-5, atol=1e-6, msg=f"ZeRO-3 {script}: {k}")


# The scripts with their own code under DeepSpeed: GRPO's sharded reference model, DAPO's and CISPO's generation
# rounds and many updates per rollout, DARO's second optimizer, Clip-Cov's and M2PO's reductions over the mini-batch,
# ppo.py's critic (a second engine, saved and loaded with the first); the others run the same scaffolding line for
# line (tests/test_shape.py; vapo.py's critic is ppo.py's).
ZERO3_SCRIPTS = [s for s in SCRIPTS if s in ("grpo", "dapo", "cispo", "daro", "clip_cov", "m2po", "ppo")]


ZERO3_TEST = "test_zero3_run_trains_and_saves_full_weights"


@pytest.fixture(scope="module")
def zero3_runs(request, toy_assets, tmp_path_factory):
    """The launches of the test below that this session runs, two side by side (tests.checks.run_side_by_side: a
    launch's imports and set-up run in one thread per process; the seven took 83 s so, 96 s one after another):
    {script: (exit code, stdout, stderr, output directory)}."""
    pytest.importorskip("deepspeed")
    work = tmp_path_factory.mktemp("zero3")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    jobs = {}
    for params in selected_cases(request, ZERO3_TEST).values():
        script = params["script"]
        flags = toy_flags(
            toy_assets,
            str(work / script),
            2,
            # --reward-workers 0: scored in this process, so a worker that starts or answers slowly on a busy machine
            # (a wall-clock limit) cannot turn a correct answer into a timeout's 0, which can leave dapo.py's dynamic
            # sampling without an informative group and the run without an update
            **{"save-every": 2, "exp-name": "z3", "micro-batch-size": 16, "reward-workers": 0},
            # GRPO with its sharded reference model; Dr. GRPO keeps truncated rewards (the toy never emits EOS);
            # ppo.py too, with 512 samples (at the toy's ~1.5% accuracy a correct one, and so a signal, is all but
            # certain: the critic starts at V = 0, so without any reward nothing would move) and one critic step
            # per rollout
            **{
                "grpo": {"beta": 0.01},
                "dr_grpo": {"truncated-reward": "keep"},
                "ppo": {"truncated-reward": "keep", "prompts-per-step": 32, "critic-num-mini-batches": 1},
            }.get(script, {}),
        )
        jobs[script] = ([*launch_cmd(os.path.join(ROOT, f"{script}.py"), zero3=True), *flags], env)
    results = run_side_by_side(jobs, str(work))
    return {script: (*result, str(work / script)) for script, result in results.items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", ZERO3_SCRIPTS)
def test_zero3_run_trains_and_saves_full_weights(script, zero3_runs, toy_assets):
    """A script under `accelerate launch --use_deepspeed --zero_stage 3` on 2 CPU processes, with a ZeRO-3
    sharded reference model: one run directory, real updates, and a checkpoint with the full weights."""
    code, stdout, stderr, out_dir = zero3_runs[script]
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # both ranks end quietly
    (run_dir,) = glob.glob(os.path.join(out_dir, "z3__*"))  # the ranks agreed on one run directory
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1], rows
    timeouts = sum(r["train/reward_timeouts"] for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows), f"no update ({timeouts} verifications timed out): {rows}"
    if script == "ppo":  # the critic's engine trained and was saved beside the policy's
        assert any(r["train/critic_grad_norm"] > 0 for r in rows)
        assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step_2", "state", "pytorch_model_1"))
        from transformers import AutoModelForSequenceClassification

        critic = AutoModelForSequenceClassification.from_pretrained(
            os.path.join(run_dir, "checkpoints", "step_2", "critic")
        )
        assert critic.score.weight.shape == (1, critic.config.hidden_size)  # gathered: ZeRO-3's shards are empty
        assert critic.score.weight.abs().sum() > 0  # the head starts at zero: the critic's updates were saved
    from safetensors.torch import load_file

    saved = load_file(os.path.join(run_dir, "checkpoints", "step_2", "model", "model.safetensors"))
    initial = load_file(os.path.join(toy_assets["model"], "model.safetensors"))
    assert set(saved) == set(initial) and all(
        saved[k].shape == initial[k].shape for k in initial
    )  # gathered, not shards
    assert any(not torch.equal(saved[k], initial[k]) for k in initial)  # the updates reached the saved weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("script,kernel", [*((s, "torch") for s in SCRIPTS), ("grpo", "triton")])
def test_no_host_sync_in_the_micro_batch_loop(script, kernel, toy_assets, monkeypatch):
    """GPU only (docs/gpu.md "GPU status"): from the mini-batch's normalisers to its gradient clip, `update_policy`
    runs under torch.cuda.set_sync_debug_mode("error"), i.e. no micro-batch reads the device (with the default
    log-prob kernel, and grpo.py with --logprob-kernel triton too)."""
    import importlib

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from common.logprobs import TokenLogProbs
    from tests.dist_worker import fixed_rollout

    mod = importlib.import_module(script)
    accelerator = Accelerator()
    args = mod.Args(group_size=4, micro_batch_size=3, num_mini_batches=2, ppo_epochs=1, max_new_tokens=6)
    args.rollout_correction = "token-truncate"  # as with vLLM: the correction's weights and the canary act too
    policy = TokenLogProbs(AutoModelForCausalLM.from_pretrained(toy_assets["model"]), kernel=kernel)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    batch, rewards, g = fixed_rollout()
    shape = batch["mask"].shape  # an off-policy rollout: stored pi_old, the sampler's and the reference's log-probs
    for key in ("old_logps", "sampler_logps", "ref_logps"):
        batch[key] = -torch.rand(shape, generator=g) * 6
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    critic = None
    if hasattr(mod, "update_critic"):  # ppo.py, vapo.py: their critic's update runs under the same check
        from common.critic import TokenValues

        lm = AutoModelForCausalLM.from_pretrained(toy_assets["model"])
        critic = TokenValues(lm.get_decoder(), lm.config.hidden_size)
        torch.nn.init.normal_(critic.value_head.weight, std=0.3)
        c_opt = torch.optim.SGD(critic.parameters(), lr=1e-3)
        critic, c_opt, c_sched = accelerator.prepare(
            critic, c_opt, torch.optim.lr_scheduler.LambdaLR(c_opt, lambda s: 1)
        )
        batch["old_values"] = torch.rand(shape, generator=g).cuda()
        batch["advantages"], batch["returns"] = mod.compute_advantages(
            rewards.cuda(), batch["old_values"], batch["mask"], args
        )
        batch["positive"] = (rewards > 0).float().cuda()
    else:
        batch["advantages"] = script_advantages(
            mod, rewards.cuda(), batch["mask"], args, batch["old_logps"], batch["ref_logps"]
        )
    normalizers, clip = mod.grad_normalizers, accelerator.clip_grad_norm_

    def then_strict(masks):
        out = normalizers(masks)
        torch.cuda.set_sync_debug_mode("error")
        return out

    def relaxed(*a, **kw):
        torch.cuda.set_sync_debug_mode("default")
        return clip(*a, **kw)

    monkeypatch.setattr(mod, "grad_normalizers", then_strict)
    monkeypatch.setattr(accelerator, "clip_grad_norm_", relaxed)
    # transformers' SDPA mask builder reads the padding mask on the host once per forward, to decide whether it
    # can pass is_causal instead of a mask (masking_utils._ignore_causal_mask_sdpa: `fast_all(padding_mask)` in
    # an `if`; seen on an H100, transformers 5.17). Not ours to change: here it answers "build the mask" without
    # reading the device, so what is checked is this project's code. (docs/benchmarks.md: its cost.)
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **kw: False)
    try:
        mod.update_policy(policy, optimizer, scheduler, accelerator, batch, args, 0)
        if critic is not None:
            mod.update_critic(critic, c_opt, c_sched, accelerator, batch, args, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("procs", [1, 2])
def test_health_metrics_cover_every_rank(procs, tmp_path):
    """The train/ text statistics on 2 processes (rank 0: 2 groups, rank 1: 1 group) equal those of 1 process
    holding all 3 groups, and completion_stats of all the texts: rank 1 alone holds the reflection words, the
    language mixing and the long completions, so rank 0's own texts would give other values. The tool/ metrics
    likewise (rank 1 holds the timeout and most of the programs' seconds)."""
    from common.metrics import completion_stats, tool_metrics
    from tests.health_worker import CORRECT, GROUP, LENGTHS, TEXTS, tool_completions
    from tests.test_tool import OneProcess

    worker, out = os.path.join(ROOT, "tests", "health_worker.py"), str(tmp_path / "m.json")
    cmd = [sys.executable, worker] if procs == 1 else launch_cmd(worker, procs)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd + [out], check=True, cwd=ROOT, env=env, timeout=300)
    with open(out) as f:
        got = json.load(f)
    expected = {f"train/{k}": v for k, v in completion_stats(TEXTS, CORRECT, GROUP, LENGTHS).items()}
    expected.update(tool_metrics(OneProcess(), tool_completions()))
    assert tool_metrics(OneProcess(), tool_completions()[:4])["tool/timeout_frac"] == 0  # rank 0's alone differ
    assert got.pop("world") == procs and set(got) == set(expected)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, abs=1e-12, nan_ok=True), k
    rank0 = completion_stats(TEXTS[:4], CORRECT[:4], GROUP, LENGTHS[:4])  # what a per-rank statistic would log
    assert rank0["reflection_frac"] == 0 and expected["train/reflection_frac"] > 0
    assert rank0["accuracy_long"] != pytest.approx(expected["train/accuracy_long"])


@pytest.mark.slow
def test_an_fsdp_launch_on_cpu_is_refused_in_one_line(toy_assets, tmp_path):
    """accelerate 1.15 turns FSDP on only for accelerator back-ends (state.py): `--use_fsdp` on CPU processes would
    run as DDP while the user believes the model sharded, so the scripts refuse it before anything is written."""
    from tests.checks import free_port

    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2"]
    launch += ["--num_processes", "2", "--main_process_port", str(free_port()), os.path.join(ROOT, "grpo.py")]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    flags = toy_flags(toy_assets, str(tmp_path / "out"), 1)
    proc = subprocess.run([*launch, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "FSDP launch on cpu" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")
