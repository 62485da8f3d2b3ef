"""dppo.py's pure functions against float64 brute-force references written with loops and `math`.

DPPO's per-token term is -M sg(w) A logp, with w = min(pi/mu, C) and the binary-TV / binary-KL mask M evaluated at
the detached current log-probs: both are constants for the gradient, so the reference takes them at a fixed point
(`sg_logps`) and only its log pi factor moves under the finite differences. mu is the sampler's log-probs (NaN rows:
old_logps)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dppo
import dr_grpo
from tests.checks import (
    assert_explicit_rollout_correction_refused,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
)
from tests.reference import k3

L_MAX = 8  # the generation budget in these tests (longer than any completion below)
STATS = ("policy_loss", "approx_kl", "dppo_mask_frac_high", "dppo_mask_frac_low", "is_weight_mean")
NAN_ROWS = (2, 7)  # rows the sampler did not produce (injected / replayed): NaN sampler log-probs


def make_args(**kw):
    return dppo.Args(**{"group_size": 4, "max_new_tokens": L_MAX, **kw})


def rollout(seed, groups=3, g=4, t=6, spread=0.3):
    """Probabilities p_mu in (0.02, 0.98) and p = p_mu + N(0, spread) in (0.01, 0.99): |p - p_mu| above and below
    0.15 in both directions, with both advantage signs. old_logps = mu + noise (used on the NaN rows only); the
    padding holds garbage (positive log-probs, NaN-free huge ratios) that must not matter."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    rewards[g] = 0.5  # a non-binary reward
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    p_mu = 0.02 + 0.96 * torch.rand(n, t, dtype=torch.float64, generator=gen)
    p = (p_mu + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)).clamp(0.01, 0.99)
    mu, logps = torch.log(p_mu), torch.log(p)
    old = mu + 0.2 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    old = old.clamp(max=-1e-3)
    sampler = mu.clone()
    for i in NAN_ROWS:
        sampler[i] = math.nan
    pad = mask == 0
    logps, old = logps.masked_fill(pad, 3.0), old.masked_fill(pad, -40.0)
    sampler = sampler.masked_fill(pad & ~sampler.isnan(), 0.0)  # make_batch zero-pads the sampler's log-probs
    ref = mu + 0.1 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps, sampler, ref.clamp(max=0)


def behaviour(old, sampler) -> list[list[float]]:
    """mu by loops: the sampler's log-prob, or old_logps on a row the sampler did not produce."""
    return [
        [o if math.isnan(s) else s for o, s in zip(orow, srow)] for orow, srow in zip(old.tolist(), sampler.tolist())
    ]


def keep_token(lq: float, lm: float, a: float, divergence: str, d_low: float, d_high: float) -> bool:
    """DPPO's binary mask for one token, written as the official code's two cases (Stable-RL core_algos.py)."""
    p, pm = math.exp(lq), math.exp(lm)
    if divergence == "binary-tv":
        return (p - pm <= d_high) if a > 0 else (p - pm >= -d_low)
    kl = pm * (lm - lq) + ((1 - pm) * math.log((1 - pm) / (1 - p)) if pm < 1 else 0.0)
    return (kl <= d_high or p <= pm) if a > 0 else (kl <= d_low or p >= pm)


def ref_dppo(
    logps,
    sg_logps,
    mu,
    adv,
    mask,
    divergence="binary-tv",
    d_low=0.15,
    d_high=0.15,
    cap=None,
    beta=0.0,
    ref=None,
    max_len=L_MAX,
) -> float:
    """The loss at `logps`, with the stop-gradient weight and mask at `sg_logps` (losses.ref_dppo): -1/(N L_max)
    sum_i sum_t [keep sg(min(pi/mu, C)) A log pi - beta k3]."""
    total = 0.0
    for i in range(len(logps)):
        a = float(adv[i])
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            lq, lm = float(sg_logps[i][t]), float(mu[i][t])
            w = math.exp(min(lq - lm, 20.0))
            w = w if cap is None else min(w, cap)
            if keep_token(lq, lm, a, divergence, d_low, d_high):
                total += -w * a * float(logps[i][t])
            if beta > 0:
                total += beta * k3(float(logps[i][t]), float(ref[i][t]))
    return total / (len(logps) * max_len)


def deltas(args):
    default = 0.15 if args.dppo_divergence == "binary-tv" else 0.05
    return tuple(default if d is None else d for d in (args.dppo_delta_low, args.dppo_delta_high))


def test_advantages_are_centred_rewards_without_std():
    args = make_args()
    rewards, *_ = rollout(0)
    got = dppo.compute_advantages(rewards, args)
    want = []
    for k in range(0, len(rewards), 4):
        grp = rewards[k : k + 4].tolist()
        want += [r - math.fsum(grp) / 4 for r in grp]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    assert (got[:4] == 0).all()
    torch.testing.assert_close(got, dr_grpo.compute_advantages(rewards, dr_grpo.Args(group_size=4)), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"dppo_divergence": "binary-kl"},
        {"dppo_is_cap": 1.5, "dppo_delta_low": 0.1, "dppo_delta_high": 0.25},
        {"dppo_divergence": "binary-kl", "dppo_delta_low": 0.02, "dppo_is_cap": 2.0, "beta": 0.04},
    ],
)
def test_policy_loss_value_and_gradient_match_reference(kw):
    args = make_args(**kw)
    rewards, mask, old, logps, sampler, ref = rollout(1)
    adv = dppo.compute_advantages(rewards, args)
    d_low, d_high = deltas(args)
    mu, sg, a, m = behaviour(old, sampler), logps.tolist(), adv.tolist(), mask.tolist()
    div, cap, beta = args.dppo_divergence, args.dppo_is_cap, args.beta
    reference = lambda bumped: ref_dppo(bumped.tolist(), sg, mu, a, m, div, d_low, d_high, cap, beta, ref.tolist())
    grad, stats = assert_loss_matches_reference(
        dppo.compute_policy_loss,
        reference,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=STATS,
        rollout_logps=sampler,
        ref_logps=ref,
    )
    # the stats by loops: masked fractions by the advantage's sign (fp32: counts / num_tokens), the mean weight, k3 of
    # the log-ratio to mu
    n_tok, high, low, w_sum, kl_sum = int(mask.sum()), 0, 0, 0.0, 0.0
    for i in range(len(sg)):
        for t in range(len(sg[0])):
            if not m[i][t]:
                continue
            masked = not keep_token(sg[i][t], mu[i][t], a[i], div, d_low, d_high)
            high, low = high + (masked and a[i] > 0), low + (masked and a[i] <= 0)
            d = sg[i][t] - mu[i][t]
            w_sum += min(math.exp(d), cap) if cap is not None else math.exp(d)
            kl_sum += math.expm1(d) - d
            if masked and beta == 0:
                assert grad[i, t] == 0
    assert high > 0 and low > 0  # both rules act on this rollout
    for key, want in [
        ("dppo_mask_frac_high", high / n_tok),
        ("dppo_mask_frac_low", low / n_tok),
        ("is_weight_mean", w_sum / n_tok),
        ("approx_kl", kl_sum / n_tok),
    ]:
        assert stats[key].item() == pytest.approx(want, rel=1e-7 if "frac" in key else 1e-12, abs=1e-15), key
    assert ("kl_ref" in stats) == (beta > 0)


@pytest.mark.parametrize("divergence", ["binary-tv", "binary-kl"])
def test_a_token_is_masked_only_beyond_delta_in_its_advantages_direction(divergence):
    """Columns: p_mu -> p of 0.5 -> 0.8 (up, far), 0.5 -> 0.2 (down, far), 0.5 -> 0.52 (up, near), 0.5 -> 0.48 (down,
    near). With A > 0 only the far move up loses its gradient, with A < 0 only the far move down; a token that moved
    against its advantage, however far, keeps -w A / (N L_max). At A = 0 the gradient is 0 whatever the mask."""
    p_mu = torch.full((3, 4), 0.5, dtype=torch.float64)
    p = torch.tensor([[0.8, 0.2, 0.52, 0.48]] * 3, dtype=torch.float64)
    logps, mu = torch.log(p).requires_grad_(True), torch.log(p_mu)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    loss, stats = dppo.compute_policy_loss(logps, mu, adv, torch.ones(3, 4), make_args(dppo_divergence=divergence))
    (grad,) = torch.autograd.grad(loss, logps)
    w = (p / p_mu)[0]
    want = torch.stack([-w, w, 0 * w]) / (3 * L_MAX)
    want[0, 0] = want[1, 1] = 0.0  # up far with A > 0, down far with A < 0
    torch.testing.assert_close(grad, want, rtol=1e-14, atol=0)
    assert stats["dppo_mask_frac_high"].item() == pytest.approx(1 / 12)
    assert stats["dppo_mask_frac_low"].item() == pytest.approx(2 / 12)  # A = 0 follows the A <= 0 rule (official)
    # the thresholds: 0.5 -> 0.8 has TV 0.3 and binary KL 0.223, so delta 0.35 / 0.25 keeps it
    big = {"binary-tv": 0.35, "binary-kl": 0.25}[divergence]
    loss, stats = dppo.compute_policy_loss(
        logps, mu, adv, torch.ones(3, 4), make_args(dppo_divergence=divergence, dppo_delta_high=big)
    )
    assert torch.autograd.grad(loss, logps)[0][0, 0] < 0 and stats["dppo_mask_frac_high"].item() == 0


def test_binary_kl_at_the_ends_of_the_simplex():
    """log(1 - p) by log1mexp: p -> 1 (log p = 0) gives D = inf, masked only if it moved in A's direction; p_mu = 1
    gives D = -log p (0 log 0 = 0); p = p_mu gives D = 0 exactly, even for tiny and near-1 probabilities."""
    mu = torch.tensor([[-0.5, -3.0, 0.0, -1e-12, -30.0]], dtype=torch.float64)
    now = torch.tensor([[0.0, 0.0, -0.1, -1e-12, -30.0]], dtype=torch.float64)
    args = make_args(dppo_divergence="binary-kl")
    for a, want_masked in [(1.0, [1, 1, 0, 0, 0]), (-1.0, [0, 0, 1, 0, 0])]:
        logps = now.clone().requires_grad_(True)
        loss, _ = dppo.compute_policy_loss(logps, mu, torch.tensor([a], dtype=torch.float64), torch.ones(1, 5), args)
        (grad,) = torch.autograd.grad(loss, logps)
        assert (grad[0] == 0).int().tolist() == want_masked
    # D itself, against math at a point where cancellation does not matter
    lp, lm = math.log(0.3), math.log(0.6)
    d = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
    assert math.log1p(-0.3) == pytest.approx(dppo.log1mexp(torch.tensor(lp, dtype=torch.float64)).item(), rel=1e-14)
    for delta, masked in [(d - 1e-9, False), (d + 1e-9, True)]:  # p < p_mu with A < 0: masked iff D > delta
        x = torch.tensor([[lp]], dtype=torch.float64, requires_grad=True)
        loss, _ = dppo.compute_policy_loss(
            x,
            torch.tensor([[lm]], dtype=torch.float64),
            -torch.ones(1, dtype=torch.float64),
            torch.ones(1, 1),
            make_args(dppo_divergence="binary-kl", dppo_delta_low=delta),
        )
        assert (torch.autograd.grad(loss, x)[0].item() == 0) == (not masked)


def test_mu_is_the_sampler_and_nan_rows_fall_back_to_old():
    """The weight and the mask are to the sampler's log-probs; a NaN row (not sampled this step) uses old_logps,
    exactly as if its sampler log-probs were old's; with no sampler log-probs mu is old_logps throughout."""
    args = make_args()
    rewards, mask, old, logps, sampler, _ = rollout(2)
    adv = dppo.compute_advantages(rewards, args)
    logps.requires_grad_(True)

    def run(**kw):
        loss, stats = dppo.compute_policy_loss(logps, old, adv, mask, args, **kw)
        return loss, torch.autograd.grad(loss, logps)[0], stats

    filled = torch.where(sampler.isnan(), old, sampler)
    a, b = run(rollout_logps=sampler), run(rollout_logps=filled)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert all(a[2][k].item() == b[2][k].item() for k in STATS)
    c, d = run(), run(rollout_logps=old)
    torch.testing.assert_close(c[1], d[1], rtol=0, atol=0)
    assert not torch.allclose(a[1], c[1])  # the sampler's log-probs do change the update
    assert torch.isfinite(a[1]).all()


def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient():
    for kw in ({}, {"dppo_divergence": "binary-kl", "beta": 0.04, "dppo_is_cap": 2.0}):
        args = make_args(**kw)
        rewards, mask, old, logps, sampler, ref = rollout(3)
        adv = dppo.compute_advantages(rewards, args)
        assert_micro_batches_add_up(
            dppo.compute_policy_loss,
            logps,
            old,
            adv,
            mask,
            args,
            stat_keys=STATS[1:],
            rollout_logps=sampler,
            ref_logps=ref,
        )


@pytest.mark.parametrize("divergence", ["binary-tv", "binary-kl"])
def test_on_policy_gradient_is_dr_grpos(divergence):
    """mu = pi (the sampler holds the trainer's weights, one update per rollout): w = 1, D = 0, nothing masked, and
    the gradient is Dr. GRPO's -A / (N L_max) per token, whatever Dr. GRPO's clip eps (r = 1 is inside any)."""
    rewards, mask, _, logps, _, _ = rollout(4)
    args = make_args(dppo_divergence=divergence)
    adv = dppo.compute_advantages(rewards, args)
    logps = logps.clamp(max=0).requires_grad_(True)  # the padding's garbage too, so the two losses see the same
    loss, stats = dppo.compute_policy_loss(logps, logps.detach(), adv, mask, args, rollout_logps=logps.detach())
    (grad,) = torch.autograd.grad(loss, logps)
    for eps in (0.2, 1e-3, 10.0):
        dr = dr_grpo.Args(group_size=4, max_new_tokens=L_MAX, clip_eps_low=eps, clip_eps_high=eps)
        (want,) = torch.autograd.grad(dr_grpo.compute_policy_loss(logps, logps.detach(), adv, mask, dr)[0], logps)
        torch.testing.assert_close(grad, want, rtol=1e-14, atol=1e-17)
    torch.testing.assert_close(grad, -adv[:, None] * mask / (len(adv) * L_MAX), rtol=1e-14, atol=0)
    assert stats["dppo_mask_frac_high"] == 0 and stats["dppo_mask_frac_low"] == 0
    assert stats["is_weight_mean"].item() == pytest.approx(1.0) and stats["approx_kl"].item() == 0


def test_explicit_rollout_correction_is_refused_before_anything_runs(monkeypatch):
    """pi/mu already is the full IS weight (tests.checks)."""
    assert_explicit_rollout_correction_refused(dppo, monkeypatch)


def test_defaults_are_the_papers():
    a = dppo.Args()
    names = {f.name for f in dataclasses.fields(a)}
    assert not {"clip_eps_low", "clip_eps_high", "adv_eps"} & names  # no ratio clip, no std
    # the authors' verl script (PR #5397's run_qwen30b_dppo.sh, verl 182383bb / b8d91ef8)
    assert (a.dppo_divergence, a.dppo_delta_low, a.dppo_delta_high, a.dppo_is_cap, a.beta) == (
        "binary-tv",
        None,
        None,
        None,
        0.0,
    )
    assert deltas(a) == (0.15, 0.15) and deltas(dataclasses.replace(a, dppo_divergence="binary-kl")) == (0.05, 0.05)
    assert (a.group_size, a.prompts_per_step, a.num_mini_batches, a.ppo_epochs) == (16, 256, 8, 1)
    assert (a.max_new_tokens, a.max_prompt_tokens, a.learning_rate) == (8192, 2048, 1e-6)
    assert (a.temperature, a.top_p, a.off_policy_steps) == (1.0, 1.0, 0)
    assert (a.dataset_name, a.dataset_config, a.prompt_template) == ("open-r1/DAPO-Math-17k-Processed", "en", "dapo")
    assert a.model_name_or_path == "Qwen/Qwen3-8B-Base"  # our one-node choice (the paper: Qwen3-30B-A3B-Base)
