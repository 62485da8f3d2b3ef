"""Shared test harness: properties every script's `compute_policy_loss` must have, checked the same way,
stand-ins for running a script's `update_policy` in one process, and the ways tests start scripts: launchers for
several processes, and several runs in one process for the tests that need a run, not a fresh interpreter."""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import torch

from common.batching import TOKEN_FIELDS, grad_normalizers
from tests.fp_bounds import gamma
from tests.reference import group_advantages

MICRO_CHUNKS = (slice(0, 5), slice(5, 7), slice(7, 12))  # uneven micro-batches of a 12-sequence rollout
PPO_CLIP_STATS = ("clip_frac_low", "clip_frac_high", "approx_kl")  # the token means every PPO-clip loss reports


GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free TCP port on the loopback interface, for a launcher's rendezvous; never one this session was given
    before, so launches that start side by side get different ones."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in GIVEN_PORTS:
            GIVEN_PORTS.add(port)
            return port


def selected_cases(request, test_name: str) -> dict[str, dict]:
    """The cases of `test_name` this session runs (after -k and the like), {id: parameters}, for a fixture that
    prepares all of them at once."""
    items = [it for it in request.session.items if getattr(it, "originalname", "") == test_name]
    return {it.callspec.id: it.callspec.params for it in items}


def run_scripts(runs: list[tuple[str, list[str]]], work_dir: str, env: dict, timeout: int = 1800):
    """Runs [(script, flags)] one after another in one process (tests/script_runner.py): the finished process and
    each run's outcome, None when it ended normally, else its traceback (or a note that the process died first)."""
    spec = os.path.join(work_dir, "runs.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script_runner.py")
    root = os.path.dirname(os.path.dirname(runner))
    proc = subprocess.run(
        [sys.executable, runner, spec], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    outcomes = []
    if os.path.exists(spec + ".out"):
        with open(spec + ".out") as f:
            outcomes = json.load(f)
    died = f"the runner ended (exit {proc.returncode}) before this run ended:\n{proc.stderr[-4000:]}"
    return proc, outcomes + [died] * (len(runs) - len(outcomes))


def run_selected_cases(request, tests: dict, work_dir: str, env: dict, timeout: int = 1800):
    """The cases this session runs of the tests in `tests`, {test name: make_run}, as script runs one after another in
    one process (`run_scripts`: the imports and the interpreter's exit once, not per case): make_run(parameters,
    out_dir) gives a case's (script, flags), or None to leave it out. Returns the runner's process and {(test name,
    case id): (out_dir, outcome)}; a test reads its own with `case_run`."""
    runs, dirs = [], {}
    for test_name, make_run in tests.items():
        for case, params in selected_cases(request, test_name).items():
            out = os.path.join(work_dir, f"{test_name[5:40]}-{case}")
            run = make_run(params, out)
            if run is not None:
                runs.append(run)
                dirs[test_name, case] = out
    proc, outcomes = run_scripts(runs, work_dir, env, timeout)
    return proc, {key: (out, outcome) for (key, out), outcome in zip(dirs.items(), outcomes)}


def run_side_by_side(
    jobs: dict[str, tuple[list[str], dict]], work_dir: str, at_once: int = 2, timeout: float = 600
) -> dict[str, tuple[int, str, str]]:
    """Runs {key: (command, environment)} from the repository's root, `at_once` at a time, each in its own session
    with its output in files under `work_dir`: {key: (exit code, stdout, stderr)}, -9 for one killed at `timeout`.
    Launches spend much of their time in one thread (imports, process groups, engines), which a second launch
    beside them fills; for tests whose runs are separate processes anyway."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pending, running, done = list(jobs.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                key, (cmd, env) = pending.pop(0)
                out, err = (open(os.path.join(work_dir, f"{key}.{x}"), "w") for x in ("out", "err"))
                proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=err, start_new_session=True)
                running[key] = (proc, out, err, time.monotonic())
            for key, (proc, out, err, start) in list(running.items()):
                if proc.poll() is None and time.monotonic() - start < timeout:
                    continue
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                for f in (out, err):
                    f.close()
                done[key] = (proc.returncode, open(out.name).read(), open(err.name).read())
                del running[key]
            time.sleep(0.2)
    finally:  # interrupted: no launch outlives the test
        for proc, out, err, _ in running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.close(), err.close()
    return done


def case_run(request, runs) -> str:
    """This case's output directory from `run_selected_cases`' result, after checking its run ended normally and,
    when every run did, that the runner's output holds no traceback (an engine's shutdown, say)."""
    proc, cases = runs
    out, outcome = cases[request.node.originalname, request.node.callspec.id]
    assert outcome is None, outcome
    if all(o is None for _, o in cases.values()):  # else the failed run's traceback is there
        assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return out


def launch_cmd(target: str, procs: int = 2, zero3: bool = False, deepspeed_config: str | None = None) -> list[str]:
    """The command that starts the Python file `target` on `procs` CPU processes (append its arguments): torchrun
    (gloo), or with `zero3` / `deepspeed_config` accelerate's DeepSpeed launcher, as a user runs configs/zero3.yaml
    (ZeRO-3 saving 16-bit full weights, or the given --deepspeed_config_file)."""
    if not zero3 and deepspeed_config is None:
        port = ["--master_port", str(free_port())]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), *port, target]
    ds = ["--deepspeed_config_file", deepspeed_config] if deepspeed_config else ["--zero_stage", "3"]
    ds += [] if deepspeed_config else ["--zero3_save_16bit_model", "true"]
    port = ["--main_process_port", str(free_port())]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--use_deepspeed",
        *ds,
        "--num_processes",
        str(procs),
        *port,
        target,
    ]


def declared_token_fields(mod) -> frozenset:
    """The per-token fields a script's main() declares to make_batch (its fifth argument: a list, or a name bound to
    one), with the shared ones: what a hand-built batch for its update_policy holds as `token_fields`."""
    tree = ast.parse(inspect.getsource(mod))
    lists = {
        t.id: n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.List)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "make_batch"]
    assert calls, f"{mod.__name__} never calls make_batch"
    args = calls[0].args
    if len(args) < 5:
        return frozenset(TOKEN_FIELDS)
    fields = lists[args[4].id] if isinstance(args[4], ast.Name) else args[4]
    return frozenset(TOKEN_FIELDS + tuple(ast.literal_eval(fields)))


def assert_micro_batches_add_up(
    compute_policy_loss, logps, old, adv, mask, args, stat_keys=(), chunks=MICRO_CHUNKS, **extra
):
    """The loss, its gradient and the `stat_keys` stats of the whole mini-batch equal the sums over its
    micro-batches when each gets the mini-batch's normalisers (common.batching.grad_normalizers). `extra` tensors
    ([B, ...]) are sliced like the batch. Returns the whole mini-batch's (loss, stats)."""
    logps = logps.detach().requires_grad_(True)
    loss, stats = compute_policy_loss(logps, old, adv, mask, args, **extra)
    (whole,) = torch.autograd.grad(loss, logps)
    num_tokens, num_seqs = grad_normalizers([mask[c] for c in chunks])
    parts = [
        compute_policy_loss(
            logps[c],
            old[c],
            adv[c],
            mask[c],
            args,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            **{k: v[c] for k, v in extra.items()},
        )
        for c in chunks
    ]
    total = sum(p[0] for p in parts)
    (split,) = torch.autograd.grad(total, logps)
    # float64 losses of O(1) terms summed over <= 12 x T tokens: gamma_100(fp64) = 1.1e-14 of sum |terms|, < 1e-12
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(total, loss, rtol=0, atol=1e-12)
    for k in stat_keys:
        bound = stat_sum_bound(stats[k], int(mask.sum()), len(chunks))
        assert abs(sum(p[1][k] for p in parts).item() - stats[k].item()) <= bound, k
    return loss, stats


def script_advantages(mod, rewards, mask, args, old_logps=None, ref_logps=None):
    """A script's advantages as its main() computes them: `compute_advantages(rewards, args)`, [N], or for a script
    whose advantages are per token (reinforce_pp.py, whose reward holds the KL) `compute_advantages(rewards, mask,
    args, old_logps, ref_logps)`, [N, T]; with a critic (ppo.py, vapo.py) GAE's on values of 0, [N, T]."""
    if hasattr(mod, "update_critic"):  # ppo.py, vapo.py: GAE on values of 0, [N, T]
        zeros = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
        return mod.compute_advantages(rewards, zeros, mask, args)[0]
    if "mask" in inspect.signature(mod.compute_advantages).parameters:
        return mod.compute_advantages(rewards, mask, args, old_logps, ref_logps)
    return mod.compute_advantages(rewards, args)


def assert_standardised_advantages(compute_advantages, rewards, args) -> torch.Tensor:
    """`compute_advantages` gives each float64 reward standardised within its group, (R - mean) / (std + eps) with
    the unbiased std (tests/reference.py), to 1e-12. Returns the advantages."""
    got = compute_advantages(rewards, args)
    want = group_advantages(rewards.tolist(), args.group_size, eps=args.adv_eps)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    return got


def on_policy_pair():
    """Two answers of 1 and 4 tokens at r = 1 (log-probs 0, old ones equal) with A = +1 and -1: the gradient shows how
    an aggregation weighs a token of a short and of a long answer. Returns (logps [2, 4] requiring grad, mask, adv)."""
    logps = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    return (logps, torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]]), torch.tensor([1.0, -1.0], dtype=torch.float64))


def clip_probe():
    """Two answers of two tokens, old log-probs 0, ratios [[1.5, 1.1], [0.5, 0.9]], A = [+1, -1]: under a 0.2 clip the
    first tokens are clipped (r = 1.5 with A > 0, r = 0.5 with A < 0), the second ones are inside the trust region.
    Returns (logps requiring grad, old, adv, mask)."""
    logps = torch.log(torch.tensor([[1.5, 1.1], [0.5, 0.9]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return logps, torch.zeros(2, 2, dtype=torch.float64), adv, torch.ones(2, 2)


def assert_loss_matches_reference(
    compute_policy_loss,
    reference_loss,
    logps,
    old,
    adv,
    mask,
    args,
    stat_keys=(*PPO_CLIP_STATS, "policy_loss"),
    loss_atol=1e-12,
    min_nonzero=10,
    **kwargs,
):
    """A script's `compute_policy_loss` against its float64 brute-force `reference_loss` (log-probs [B, T] ->
    float): the value within `loss_atol`, the gradient by finite differences at every position (at least
    `min_nonzero` of them nonzero, so that the check is not vacuous), exactly 0 on padding; the stats include
    `stat_keys` and are all scalars. `kwargs` go to compute_policy_loss. Returns (gradient, stats)."""
    logps = logps.detach().requires_grad_(True)
    loss, stats = compute_policy_loss(logps, old, adv, mask, args, **kwargs)
    assert abs(loss.item() - reference_loss(logps.detach())) < loss_atol
    (grad,) = torch.autograd.grad(loss, logps)
    assert assert_grad_matches_finite_differences(grad, reference_loss, logps) >= min_nonzero
    assert (grad[mask == 0] == 0).all()
    assert set(stat_keys) <= set(stats) and all(v.dim() == 0 for v in stats.values()), sorted(stats)
    return grad, stats


def assert_grad_matches_finite_differences(grad, reference_loss, logps, eps=1e-6, rtol=1e-6) -> int:
    """The autograd gradient `grad` of a script's loss matches central differences of `reference_loss` (a float64
    brute-force reference: log-probs [B, T] -> float) at every position of `logps`, padding included:
    |grad - fd| <= rtol * max(1, |fd|). Returns how many positions have a nonzero gradient, so that a caller can
    assert that the check is not vacuous.

    Tolerance: central differences are off by eps^2 / 6 times the third derivative (~1e-13 here) plus the
    reference's rounding error over eps; a float64 sum of m <= 150 terms of total size S <= 10 rounds by at most
    m u S = 1.7e-13, so at most 1.7e-7 at eps = 1e-6, under the default rtol = 1e-6 (measured: <= 2e-10 on the
    first seven scripts' tests). A position within eps of a kink of the reference (a clip boundary) would get the
    mean of the two slopes: the tests' rollouts keep their ratios away from the clip boundaries."""
    base = logps.detach().to(torch.float64)
    nonzero = 0
    for i, t in itertools.product(range(base.shape[0]), range(base.shape[1])):
        up, down = base.clone(), base.clone()
        up[i, t] += eps
        down[i, t] -= eps
        fd = (reference_loss(up) - reference_loss(down)) / (2 * eps)
        got = grad[i, t].item()
        assert abs(got - fd) <= rtol * max(1.0, abs(fd)), (i, t, got, fd)
        nonzero += got != 0
    return nonzero


def stat_sum_bound(value: torch.Tensor, num_terms: int, num_parts: int) -> float:
    """How far the sum of a stat's micro-batch parts may be from the whole mini-batch's value, by rounding alone,
    for a token mean of `num_terms` terms of one sign (fractions, k3 KL estimates, IS weights), computed in the
    stat's own dtype (fp32 for most stats): each side sums the terms, divides once and (the parts) adds
    `num_parts` partial means, so it is within gamma(num_terms + num_parts + 1) * sum |terms| / n of the exact
    mean, and sum |terms| / n = |value| for terms of one sign (tests/fp_bounds.py)."""
    return 2 * gamma(num_terms + num_parts + 1, value.dtype) * abs(value.item())


class TablePolicy(torch.nn.Module):
    """A stand-in for TokenLogProbs: log-prob of token x is theta[x] (enough to check update_policy's gradient)."""

    def __init__(self, vocab):
        super().__init__()
        self.theta = torch.nn.Parameter(
            -torch.rand(vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        )

    def forward(self, ids, attn, p_len, temperature):
        logps = self.theta[ids[:, p_len:]]
        return logps, torch.zeros_like(logps)


class SingleProcess:
    """The parts of accelerate.Accelerator that update_policy uses, for one process."""

    gradient_state = types.SimpleNamespace(_set_sync_gradients=lambda sync: None)

    def reduce(self, t, reduction):
        return t.clone()

    def backward(self, loss):
        loss.backward()

    def no_sync(self, model):
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def assert_refused_in_one_line(mod, toy_assets, out_dir, needle: str, **kw) -> None:
    """`mod.main` on the toy task with the flags `kw` stops with one line (SystemExit) naming `needle`, before
    anything is written to `out_dir`."""
    args = mod.Args(
        model_name_or_path=toy_assets["model"],
        dataset_name=toy_assets["train"],
        prompt_column="question",
        answer_column="answer",
        prompt_template="none",
        max_prompt_tokens=32,
        sampler="hf",
        output_dir=str(out_dir),
        **kw,
    )
    try:
        mod.main(args)
    except SystemExit as e:
        msg = e.code
    else:
        raise AssertionError(f"{mod.__name__}.main ran with {kw}")
    assert isinstance(msg, str) and "\n" not in msg.strip() and needle in msg, msg
    assert not os.path.exists(out_dir)  # nothing written


def assert_explicit_rollout_correction_refused(mod, monkeypatch, **kw) -> None:
    """A script whose ratio is already against the sampler's log-probs (pi / mu: the full importance weight) refuses
    an explicit --rollout-correction at once, and runs `auto` and `none` with the correction recorded as none (start()
    would otherwise resolve auto to token-truncate with vLLM). `kw`: other flags of the runs that start."""
    import pytest

    seen = []

    def fake_start(args):
        seen.append(args.rollout_correction)
        raise RuntimeError("stop")

    monkeypatch.setattr(mod, "start", fake_start)
    for mode in ("token-truncate", "token-mask", "sequence-truncate", "sequence-mask"):
        with pytest.raises(SystemExit, match="rollout-correction"):
            mod.main(mod.Args(rollout_correction=mode))
    assert seen == []
    for mode in ("auto", "none"):
        with pytest.raises(RuntimeError, match="stop"):
            mod.main(mod.Args(rollout_correction=mode, sampler="vllm", **kw))
    assert seen == ["none", "none"]


def reward_wall_bound(num_items: int, timeout_s: float, num_kills: int) -> float:
    """The longest a common.reward.score call over `num_items` items may take by the pool's own limits, on any
    machine (a bound from the code's contract, not from one machine's speed): the parent kills a worker
    timeout_s + _GRACE_S after it took an item, and each killed worker (and a cold pool) may take up to
    _START_TIMEOUT_S to start again, after which the pool gives up with an error."""
    from common import reward

    return num_items * (timeout_s + reward._GRACE_S) + (num_kills + 1) * reward._START_TIMEOUT_S
