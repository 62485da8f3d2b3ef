"""sapo.py's pure functions against float64 brute-force references.

SAPO's per-token term is -f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau (tau = tau_pos if A > 0 else
tau_neg), averaged per sequence then over sequences as in GRPO; its gradient in log pi is -w r A / (G |o_i|) with
w = 4 s (1 - s), s = sigmoid(tau (r - 1)): 1 at r = 1 (GRPO's on-policy gradient), smaller the further r is from 1,
never exactly 0 (no hard clip)."""

from __future__ import annotations

import math

import pytest
import torch

import grpo
import sapo
from tests.checks import (
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    assert_standardised_advantages,
    clip_probe,
)
from tests.reference import aggregate, k3

STATS = ("sapo_gate_weight_mean", "approx_kl", "policy_loss")


def make_args(**kw):
    return sapo.Args(**{"group_size": 4, **kw})


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def tau_of(a: float, args) -> float:
    return args.sapo_tau_pos if a > 0 else args.sapo_tau_neg


def brute_loss(logps, old, adv, mask, args, ref=None) -> float:
    """1/G sum_i 1/|o_i| sum_t [-sigmoid(tau (r - 1)) 4 / tau A_i + beta k3], by loops."""
    per_token = []
    for i in range(logps.shape[0]):
        a, row = adv[i].item(), []
        tau = tau_of(a, args)
        for t in range(logps.shape[1]):
            r = math.exp(logps[i, t].item() - old[i, t].item())
            v = -sigmoid(tau * (r - 1.0)) * 4.0 / tau * a
            if args.beta > 0:
                v += args.beta * k3(logps[i, t].item(), ref[i, t].item())
            row.append(v)
        per_token.append(row)
    return aggregate(per_token, mask.tolist(), "seq-mean-token-mean")


def closed_form_grad(r: float, a: float, tau: float, g: int, n: int) -> float:
    """d/d log pi of -f(r) A / (G |o|): -4 s (1 - s) r A / (G |o|)."""
    s = sigmoid(tau * (r - 1.0))
    return -4.0 * s * (1.0 - s) * r * a / (g * n)


def rollout(seed, groups=3, g=4, t=6, spread=0.6):
    """Log-ratios of about +-1.2 (ratios from ~0.3 to ~3, far outside PPO's 0.2 trust region on many tokens), both
    advantage signs, one all-correct group (A = 0), padding with garbage."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    logps = old + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
    ref = old + 0.1 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    logps = torch.where(mask.bool(), logps, torch.full_like(logps, -7.0))  # garbage in the padding
    old = torch.where(mask.bool(), old, torch.full_like(old, 3.0))
    return rewards, mask, old, logps, ref


def test_advantages_match_reference_and_grpos():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(sapo.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()
    assert torch.equal(got, grpo.compute_advantages(rewards, grpo.Args(group_size=4)))


@pytest.mark.parametrize(
    "kw", [{}, {"beta": 0.04}, {"sapo_tau_pos": 0.5, "sapo_tau_neg": 3.0}, {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.0}]
)
def test_policy_loss_value_and_gradient_match_reference(kw):
    args = make_args(**kw)
    rewards, mask, old, logps, ref = rollout(1)
    adv = sapo.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args, ref)
    keys = STATS + (("kl_ref",) if args.beta else ())
    grad, stats = assert_loss_matches_reference(
        sapo.compute_policy_loss, reference, logps, old, adv, mask, args, stat_keys=keys, ref_logps=ref
    )
    assert ("kl_ref" in stats) == (args.beta > 0)
    b = logps.shape[0]
    ws = []
    for i in range(b):  # the closed form of the gradient (beta = 0), and the gate-weight stat from a loop
        n_i, a = int(mask[i].sum()), adv[i].item()
        for t in range(n_i):
            r = math.exp(logps[i, t].item() - old[i, t].item())
            s = sigmoid(tau_of(a, args) * (r - 1.0))
            ws.append(4 * s * (1 - s))
            if not args.beta:
                want = closed_form_grad(r, a, tau_of(a, args), b, n_i)
                assert grad[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert stats["sapo_gate_weight_mean"].item() == pytest.approx(sum(ws) / len(ws), rel=1e-12)
    assert 0 < stats["sapo_gate_weight_mean"].item() < 1


def test_on_policy_gradient_equals_grpos():
    """old = logps.detach(): r = 1, w = 4 * 1/2 * 1/2 = 1 for either tau (the 4 / tau normalisation), so the gradient
    is GRPO's (beta = 0): -A_i / (G |o_i|) per token. The loss value is not GRPO's (f(1) = 2 / tau)."""
    rewards, mask, _, logps, _ = rollout(3)
    for kw in ({}, {"sapo_tau_pos": 0.3, "sapo_tau_neg": 7.0}):
        args = make_args(**kw)
        adv = sapo.compute_advantages(rewards, args)
        x = logps.detach().clone().requires_grad_(True)
        loss, stats = sapo.compute_policy_loss(x, x.detach(), adv, mask, args)
        (g_sapo,) = torch.autograd.grad(loss, x)
        loss_grpo, _ = grpo.compute_policy_loss(x, x.detach(), adv, mask, grpo.Args(group_size=4, beta=0.0))
        (g_grpo,) = torch.autograd.grad(loss_grpo, x)
        torch.testing.assert_close(g_sapo, g_grpo, rtol=0, atol=1e-15)  # 4 / tau * tau: exact up to rounding
        assert g_sapo.abs().max() > 0.01
        assert stats["sapo_gate_weight_mean"].item() == 1.0 and stats["approx_kl"].item() == 0.0
        want = -sum(2 / tau_of(a, args) * a for a in adv.tolist()) / len(adv)  # every sequence: mean_t f(1) A = 2A/tau
        assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_no_hard_cut_where_grpo_clips():
    """clip_probe: r = 1.5 with A > 0 and r = 0.5 with A < 0 are clipped by GRPO (zero gradient); SAPO keeps a
    gradient there, -4 s (1 - s) r A / (G |o|), with the sign that pushes toward the advantage."""
    args = make_args()
    logps, old, adv, mask = clip_probe()
    loss, stats = sapo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    ratios = [[1.5, 1.1], [0.5, 0.9]]
    for i, a in enumerate(adv.tolist()):
        for t in range(2):
            want = closed_form_grad(ratios[i][t], a, tau_of(a, args), 2, 2)
            assert grad[i, t].item() == pytest.approx(want, rel=1e-12)
    assert grad[0, 0] < 0 and grad[1, 0] > 0  # still pushed up for A > 0, down for A < 0
    loss_grpo, _ = grpo.compute_policy_loss(logps, old, adv, mask, grpo.Args(group_size=2, beta=0.0))
    (g_grpo,) = torch.autograd.grad(loss_grpo, logps)
    assert g_grpo[0, 0] == 0 and g_grpo[1, 0] == 0
    assert set(stats) >= set(STATS) and "clip_frac_high" not in stats


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_gate_weight_decays_smoothly_away_from_one(a):
    """One token per sequence at ratios from 0.05 to 20: w = -grad G / (r A) (the gradient relative to the plain
    IS objective r A) is 1 at r = 1, strictly decreasing in |r - 1| on either side, never 0 and without a jump
    (neighbouring ratios 1% apart give weights within 3%); a larger tau decays faster."""
    ratios = [0.05, 0.2, 0.5, 0.7, 0.8, 0.9, 0.99, 1.0, 1.01, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0]

    def weights(args, rs):
        logps = torch.log(torch.tensor(rs, dtype=torch.float64))[:, None].requires_grad_(True)
        n = len(rs)
        adv = torch.full((n,), a, dtype=torch.float64)
        loss, _ = sapo.compute_policy_loss(logps, torch.zeros(n, 1, dtype=torch.float64), adv, torch.ones(n, 1), args)
        (grad,) = torch.autograd.grad(loss, logps)
        return [-grad[i, 0].item() * n / (r * a) for i, r in enumerate(rs)]

    args = make_args()
    w = weights(args, ratios)
    tau = tau_of(a, args)
    for r, got in zip(ratios, w):
        s = sigmoid(tau * (r - 1))
        assert got == pytest.approx(4 * s * (1 - s), rel=1e-12)
        assert got > 0
    one = ratios.index(1.0)
    assert w[one] == pytest.approx(1.0, rel=1e-15)
    assert all(x < y for x, y in zip(w[:one], w[1 : one + 1]))  # rising toward r = 1 from below
    assert all(x > y for x, y in zip(w[one:], w[one + 1 :]))  # falling above it
    for r0 in (0.79, 0.81, 1.19, 1.21, 1.5):  # no jump anywhere, e.g. across GRPO's 1 +- 0.2
        w0, w1 = weights(args, [r0, 1.01 * r0])
        assert abs(w1 / w0 - 1) < 0.03
    steep = weights(make_args(sapo_tau_pos=4.0, sapo_tau_neg=4.0), ratios)
    assert all(st < x for st, x, r in zip(steep, w, ratios) if r != 1.0)


def test_negative_advantages_use_tau_neg():
    """The same ratio 1.3 on a positive, a negative and a zero-advantage sequence: the first's gradient follows
    tau_pos, the second's tau_neg (and changes with tau_neg only), the third's is 0."""
    r = torch.tensor([[1.3, 0.6], [1.3, 0.6], [1.3, 0.6]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    mask, old = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.float64)

    def grad(**kw):
        logps = torch.log(r).requires_grad_(True)
        loss, _ = sapo.compute_policy_loss(logps, old, adv, mask, make_args(**kw))
        return torch.autograd.grad(loss, logps)[0]

    g = grad()
    for t, rt in enumerate((1.3, 0.6)):
        assert g[0, t].item() == pytest.approx(closed_form_grad(rt, 1.0, 1.0, 3, 2), rel=1e-12)
        assert g[1, t].item() == pytest.approx(closed_form_grad(rt, -1.0, 1.05, 3, 2), rel=1e-12)
        assert g[1, t].item() != pytest.approx(closed_form_grad(rt, -1.0, 1.0, 3, 2), rel=1e-6)
    assert (g[2] == 0).all()
    g_neg = grad(sapo_tau_neg=3.0)
    assert torch.equal(g_neg[0], g[0]) and (g_neg[1] - g[1]).abs().min() > 1e-3
    g_pos = grad(sapo_tau_pos=3.0)
    assert torch.equal(g_pos[1], g[1]) and (g_pos[0] - g[0]).abs().min() > 1e-3


@pytest.mark.parametrize("dtype,big", [(torch.float32, 100.0), (torch.float64, 1000.0)])
def test_huge_log_ratios_stay_finite(dtype, big):
    """|log r| beyond exp's range (fp32: 88.7, fp64: 709.8): the log-ratio is clamped to +-20 (verl, SkyRL), so the
    loss, gradient and stats stay finite, and the gate is flat there (zero gradient); the ordinary tokens beside
    them keep theirs. Without the clamp r = inf and sigmoid' * inf = NaN."""
    old = torch.zeros(2, 3, dtype=dtype)
    logps = torch.tensor([[big, 0.1, -big], [-big, big, -0.2]], dtype=dtype).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    mask = torch.ones(2, 3)
    loss, stats = sapo.compute_policy_loss(logps, old, adv, mask, make_args())
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[1, 0] == 0 and grad[1, 1] == 0
    assert grad[0, 1] < 0 and grad[1, 2] > 0
    want = closed_form_grad(math.exp(0.1), 1.0, 1.0, 2, 3)
    assert grad[0, 1].item() == pytest.approx(want, rel=1e-5 if dtype == torch.float32 else 1e-12)


def test_micro_batches_sum_to_the_mini_batch_gradient_and_stats():
    args = make_args(beta=0.04)
    rewards, mask, old, logps, ref = rollout(2)
    adv = sapo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(
        sapo.compute_policy_loss,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=("sapo_gate_weight_mean", "approx_kl", "kl_ref"),
        ref_logps=ref,
    )


def test_defaults_are_the_papers():
    a = sapo.Args()
    # the values verl (actor.yaml: "used in the paper with Qwen3-30B-A3B-Base"), TRL, SkyRL and AReaL ship
    assert (a.sapo_tau_pos, a.sapo_tau_neg) == (1.0, 1.05)
    assert a.beta == 0.0  # no KL in the recipe: no reference model is loaded
    assert not hasattr(a, "clip_eps_low") and not hasattr(a, "clip_eps_high")  # no ratio clip
    assert a.num_mini_batches == 8  # verl's Qwen3-30B-A3B SAPO example: 256 prompts in mini-batches of 32
    g = grpo.Args()  # the paper's runs are Qwen3-30B-A3B scale: model, data and batch are grpo.py's
    for k in (
        "model_name_or_path",
        "dataset_name",
        "prompt_template",
        "group_size",
        "prompts_per_step",
        "learning_rate",
        "max_new_tokens",
        "temperature",
        "ppo_epochs",
        "adv_eps",
        "eval_datasets",
    ):
        assert getattr(a, k) == getattr(g, k), k


def test_a_non_positive_tau_is_refused_before_anything_is_written(tmp_path):
    for kw in ({"sapo_tau_pos": 0.0}, {"sapo_tau_neg": -1.0}):
        with pytest.raises(SystemExit, match="--sapo-tau-pos and --sapo-tau-neg must be > 0"):
            sapo.main(sapo.Args(output_dir=str(tmp_path / "out"), **kw))
    assert list(tmp_path.iterdir()) == []
