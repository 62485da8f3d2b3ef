"""--rollout-correction (docs/design.md) in every script's compute_policy_loss, against a float64 loop.

The correction multiplies each token's policy-loss term by a constant weight w (never the KL term). Every script's
loss is linear in its per-token policy terms and each term's gradient flows only through its own token's log-prob
(GSPO-token detaches the sequence ratio, CISPO its IS weight, DARO's bucket weights are constants), so the corrected
gradient must be w_it times the uncorrected policy gradient, token by token. The uncorrected losses are checked
against brute-force references in each script's own test file; here w comes from a Python loop:
  token-*:    lw = old - rollout per token;   sequence-*: lw = sum over the sequence's tokens of (old - rollout)
  *-truncate: w = min(exp(lw), cap);          *-mask:     w = exp(lw) if exp(lw) <= cap else 0
Tolerances: float64 throughout, and the two sides differ only by rounding (the weight is exp(min(lw, log cap)) on one
side and min(exp(lw), cap) on the other), so 1e-12."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.checks import assert_micro_batches_add_up, script_advantages
from tests.test_scripts import SCRIPTS

MODES = ("token-truncate", "token-mask", "sequence-truncate", "sequence-mask")
CAP = 2.0
# dppo.py and m2po.py take their ratio to the sampler's log-probs: no correction on top (main() refuses one)
CORRECTED = [s for s in SCRIPTS if s not in ("dppo", "m2po")]
KL_IN_LOSS = ("grpo", "l1", "cppo")  # grpo.py's k3 term to a reference, weighted by beta in the loss


def batch(seed: int, n: int = 12, t: int = 6):
    """3 groups of 4; trainer-vs-old log-ratios up to about +-0.5 (some PPO-clipped), sampler-vs-old per-token
    log-ratios of about +-0.4, so that token weights and sequence sums fall on both sides of log 2."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0])
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 2 - 0.1
    logps = old + 0.25 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    rollout = old + 0.4 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps, rollout


def loop_weights(old, rollout, mask, mode: str, cap: float) -> list[list[float]]:
    n, t = mask.shape
    out = []
    for i in range(n):
        lws = [float(old[i, s] - rollout[i, s]) if mask[i, s] else 0.0 for s in range(t)]
        seq = sum(lws)
        row = []
        for s in range(t):
            lw = seq if mode.startswith("sequence") else lws[s]
            w = math.exp(lw)
            row.append(min(w, cap) if mode.endswith("truncate") else (w if w <= cap else 0.0))
        out.append(row)
    return out


def make(script: str, **kw):
    mod = importlib.import_module(script)
    extra = {"beta": 0.04} if script in KL_IN_LOSS else {}
    return mod, mod.Args(**{"group_size": 4, "rollout_correction_cap": CAP, **extra, **kw})


def grad(mod, args, logps, old, adv, mask, **kw):
    if mod.__name__ == "clip_cov":  # a fixed token selection (update_policy's), so runs can be compared
        kw.setdefault("cov_select", selection(mask))
    x = logps.detach().clone().requires_grad_(True)
    ref = {"ref_logps": old - 0.3} if getattr(args, "beta", 0) > 0 else {}
    loss, stats = mod.compute_policy_loss(x, old, adv, mask, args, **ref, **kw)
    return torch.autograd.grad(loss, x)[0], loss, stats


def selection(mask):
    """Every fifth token: a fixed [B, T] selection for clip_cov.py's loss."""
    return (torch.arange(mask.numel()).view(mask.shape) % 5 == 0) & mask.bool()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", CORRECTED)
def test_gradient_is_the_loop_weight_times_the_policy_gradient(script, mode):
    if script == "gmpo" and mode.startswith("token"):
        pytest.skip("gmpo.py weighs a sequence by the geometric mean of its token weights (tests/test_gmpo.py)")
    mod, args = make(script, rollout_correction=mode)
    rewards, mask, old, logps, rollout = batch(1)
    adv = script_advantages(mod, rewards, mask, args, old, old - 0.3)
    w = torch.tensor(loop_weights(old, rollout, mask, mode, CAP), dtype=torch.float64)
    assert 0 < ((w == CAP) | (w == 0)).double().mul(mask).sum() < mask.sum()  # the cap binds on some tokens, not all
    got, _, stats = grad(mod, args, logps, old, adv, mask, rollout_logps=rollout)
    plain, _, _ = grad(mod, make(script, rollout_correction="none")[1], logps, old, adv, mask)
    want = w * plain
    if script in KL_IN_LOSS:  # the KL term's gradient is not weighted
        no_kl = make(script, rollout_correction="none", beta=0.0)[1]
        policy_only, _, _ = grad(mod, no_kl, logps, old, adv, mask)
        want = w * policy_only + (plain - policy_only)
        assert (plain - policy_only).abs().max() > 1e-3  # there is a KL gradient to leave alone
    torch.testing.assert_close(got * mask, want * mask, rtol=0, atol=1e-12)
    # stats from the same loop: token mean, extremes over real tokens, fraction of tokens above the cap
    m = mask.bool()
    raw = torch.tensor(
        loop_weights(old, rollout, mask, mode.split("-")[0] + "-truncate", math.inf), dtype=torch.float64
    )
    torch.testing.assert_close(stats["rollout_corr_weight_mean"].double(), w[m].mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(stats["rollout_corr_weight_min"].double(), w[m].min(), rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["rollout_corr_weight_max"].double(), w[m].max(), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        stats["rollout_corr_capped_frac"].double(), (raw[m] > CAP).double().mean(), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("script", CORRECTED)
def test_no_mismatch_changes_nothing_and_off_ignores_the_sampler(script):
    """rollout_logps == old_logps: every weight is 1 and the loss is the uncorrected one; with "none" (and "auto",
    which main() resolves) the sampler's log-probs are ignored."""
    rewards, mask, old, logps, rollout = batch(2)
    mod, plain_args = make(script, rollout_correction="none")
    adv = script_advantages(mod, rewards, mask, plain_args, old, old - 0.3)
    plain_grad, plain_loss, _ = grad(mod, plain_args, logps, old, adv, mask)
    for mode in MODES:
        g, loss, stats = grad(mod, make(script, rollout_correction=mode)[1], logps, old, adv, mask, rollout_logps=old)
        torch.testing.assert_close((g, loss), (plain_grad, plain_loss), rtol=0, atol=1e-12)
        assert stats["rollout_corr_capped_frac"] == 0 and stats["rollout_corr_weight_min"] == 1
    for off in ("none", "auto"):
        g, loss, stats = grad(
            mod, make(script, rollout_correction=off)[1], logps, old, adv, mask, rollout_logps=rollout
        )
        torch.testing.assert_close((g, loss), (plain_grad, plain_loss), rtol=0, atol=1e-12)
        assert not any(k.startswith("rollout_corr") for k in stats)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", [s for s in CORRECTED if s != "daro"])  # daro: its own test carries buckets
def test_micro_batches_add_up_with_the_correction(script, mode):
    mod, args = make(script, rollout_correction=mode)
    rewards, mask, old, logps, rollout = batch(3)
    adv = script_advantages(mod, rewards, mask, args, old, old - 0.3)
    extra = {"ref_logps": old - 0.3} if script in KL_IN_LOSS else {}
    if script == "clip_cov":
        extra["cov_select"] = selection(mask)
    assert_micro_batches_add_up(
        mod.compute_policy_loss,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=("rollout_corr_weight_mean", "rollout_corr_capped_frac"),
        rollout_logps=rollout,
        **extra,
    )


def test_an_explicit_mode_without_sampler_log_probs_is_an_error():
    mod, args = make("grpo", rollout_correction="token-truncate")
    rewards, mask, old, logps, _ = batch(4)
    with pytest.raises(ValueError, match="--rollout-correction token-truncate"):
        mod.compute_policy_loss(logps, old, mod.compute_advantages(rewards, args), mask, args, ref_logps=old)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_cap_below_one_is_refused_before_anything_is_written(script, tmp_path):
    mod = importlib.import_module(script)
    with pytest.raises(SystemExit, match="^--rollout-correction-cap must be >= 1"):
        mod.main(mod.Args(rollout_correction_cap=0.5, output_dir=str(tmp_path / "out")))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_hf_sampler_run_weights_are_one_in_fp32_and_auto_is_off(toy_assets, tmp_path):
    """End to end on the toy task with HF generate, whose log-probs come from the trainer's own fp32 weights: an
    explicit --rollout-correction logs weights within 1e-4 of 1 (the canary measures |diff| ~1e-6 here, so w is
    1 +- 1e-6; 1e-4 leaves room for other CPUs' kernels) and caps nothing; auto (the default) is off with HF."""
    import glob
    import json

    from tests.test_scripts import run_script, toy_flags

    for mode in ("token-truncate", "sequence-mask", "auto"):
        out = tmp_path / mode
        run_script(
            "grpo", toy_flags(toy_assets, str(out), 2, **{"rollout-correction": mode, "num-mini-batches": 2, "beta": 0})
        )
        (path,) = glob.glob(str(out / "*" / "metrics.jsonl"))
        rows = [json.loads(line) for line in open(path)]
        updated = [r for r in rows if r["train/no_signal"] == 0]
        if mode == "auto":
            assert not any(k.startswith("train/rollout_corr") for r in rows for k in r)
            continue
        assert updated, "no step had a signal"
        for r in updated:
            assert (
                abs(r["train/rollout_corr_weight_min"] - 1) < 1e-4
                and abs(r["train/rollout_corr_weight_max"] - 1) < 1e-4
            )
            assert r["train/rollout_corr_capped_frac"] == 0


def test_the_help_names_trls_default_as_the_installed_trl_has_it():
    """TRL 1.16's GRPOConfig defaults to sequence masking with clip_max 3, not to token truncation at 2 (that is
    verl's `rollout_is: token` and oat's TIS): the shared --rollout-correction-cap help (every script's --help) and
    docs/flags.md say so, with the values read from the installed TRL."""
    import dataclasses
    import os

    trl = pytest.importorskip("trl")
    cfg = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    mode, cap = (cfg["vllm_importance_sampling_mode"].replace("_", "-"), cfg["vllm_importance_sampling_clip_max"])
    assert cfg["vllm_importance_sampling_correction"] and mode in MODES
    want = f"TRL {'.'.join(trl.__version__.split('.')[:2])}'s default is {mode} with {cap:g}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ["common/args.py", "docs/flags.md"]:
        with open(os.path.join(root, name)) as f:
            text = " ".join(f.read().split())  # docstrings wrap lines
        assert want in text and "verl's and oat's TIS" in text, name
        assert "masked (TRL's default)" not in text, name


def test_the_canary_statistics_equal_a_float64_loop():
    """`LogprobCanary` over two micro-batches against per-token loops in float64: |Δ| max and mean, the k3 sampler KL
    (never negative, also when the log-probs agree to rounding) and the importance weights' effective sample size;
    tokens outside the mask or without a sampler log-prob (NaN) do not count."""
    from common.logprobs import LogprobCanary

    torch.manual_seed(0)
    canary, tokens = LogprobCanary(), []
    for _ in range(2):
        logps = -torch.rand(3, 5) * 3
        sampler = logps + torch.randn(3, 5) * 0.3
        sampler[0, 1] = float("nan")
        sampler[1] = logps[1] + 1e-7  # equal to rounding: k3 of these tokens is 0, not a negative rounding error
        mask = (torch.rand(3, 5) > 0.2).float()
        canary.add(logps, sampler, mask)
        tokens += [(float(a), float(b)) for a, b, k in zip(logps.flatten(), sampler.flatten(), mask.flatten())
                   if k and not math.isnan(b)]  # fmt: skip
    stats = {k: float(v) for k, v in canary.stats().items()}
    d = [a - b for a, b in tokens]
    w = [math.exp(x) for x in d]
    assert stats["logprob_diff_max"] == pytest.approx(max(abs(x) for x in d), rel=1e-6)
    assert stats["logprob_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / len(d), rel=1e-6)
    assert stats["sampler_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / len(d), rel=1e-5)
    assert stats["is_ess"] == pytest.approx(sum(w) ** 2 / (len(w) * sum(x * x for x in w)), rel=1e-6)
    same = LogprobCanary()
    same.add(torch.full((4, 8), -2.0), torch.full((4, 8), -2.0) + 3e-8, torch.ones(4, 8))
    assert float(same.stats()["sampler_kl"]) >= 0 and float(same.stats()["is_ess"]) == pytest.approx(1.0)
