"""cispo.py's pure functions against float64 brute-force references.

CISPO's per-token term is -sg(w) A logp with w = min(r, cap) (or clip(r, floor, cap)): the weight is a constant
for the gradient, so the reference gradient is the finite difference of the loss in logp with the weight held
at its value, and every token, whatever its ratio, gets -w A / num_tokens."""

from __future__ import annotations

import math

import pytest
import torch

import cispo
import grpo
from tests.checks import assert_loss_matches_reference, assert_micro_batches_add_up, assert_standardised_advantages
from tests.reference import aggregate


def make_args(**kw):
    return cispo.Args(**{"group_size": 4, **kw})


def is_weight(logp: float, old: float, cap: float, floor: float | None = None) -> float:
    r = math.exp(logp - old)
    return min(max(r, floor), cap) if floor is not None else min(r, cap)


def brute_loss(logps, weight_logps, old, adv, mask, cap, floor=None) -> float:
    """Token mean of -w A logp; the weight w is computed from `weight_logps` (held fixed for the gradient)."""
    per_token = [
        [-is_weight(weight_logps[i][t], old[i][t], cap, floor) * adv[i] * logps[i][t] for t in range(len(logps[i]))]
        for i in range(len(logps))
    ]
    return aggregate(per_token, mask, "token-mean")


def rollout(seed, groups=3, g=4, t=6, spread=1.5):
    """Ratios from about e^-3 to e^3: some far above the cap 5 and far outside PPO's trust region."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    logps = old + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps


def cap_of(args) -> float:
    return args.eps_max if args.cispo_form == "scalerl" else 1 + args.is_eps_high


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(cispo.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"eps_max": 2.0},
        {"cispo_form": "minimax"},
        {"cispo_form": "minimax", "is_eps_high": 0.28, "is_eps_low": 0.5},
    ],
)
def test_policy_loss_value_and_gradient_match_reference(kw):
    args = make_args(**kw)
    rewards, mask, old, logps = rollout(1)
    adv = cispo.compute_advantages(rewards, args)
    cap, floor = cap_of(args), None if args.is_eps_low is None else 1 - args.is_eps_low
    lp, o, a, m = logps.detach().tolist(), old.tolist(), adv.tolist(), mask.tolist()
    reference = lambda bumped: brute_loss(bumped.tolist(), lp, o, a, m, cap, floor)  # the weight held at its value
    keys = ("cap_frac", "is_weight_mean", "approx_kl", "policy_loss")
    grad, stats = assert_loss_matches_reference(
        cispo.compute_policy_loss, reference, logps, old, adv, mask, args, stat_keys=keys
    )
    num_tokens = int(mask.sum())
    for i in range(len(lp)):
        for t in range(len(lp[0])):
            if m[i][t]:  # the closed form: -w A / num_tokens
                want = -is_weight(lp[i][t], o[i][t], cap, floor) * a[i] / num_tokens
                assert grad[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    ratio = torch.exp(logps.detach() - old)
    assert stats["cap_frac"].item() == pytest.approx(((ratio > cap) & mask.bool()).sum().item() / num_tokens)
    assert 0 < stats["cap_frac"].item() < 1
    assert ("floor_frac" in stats) == (floor is not None)


def test_tokens_ppo_would_clip_keep_a_gradient():
    """Ratios far outside PPO's trust region (r = 3 with A > 0, r = 0.3 with A < 0) get no gradient from a PPO
    clip (0.2 / 0.28), but in CISPO every one gets -min(r, eps_max) A / num_tokens."""
    args = make_args()
    old = torch.zeros(2, 2, dtype=torch.float64)
    r = torch.tensor([[3.0, 8.0], [0.3, 0.05]], dtype=torch.float64)
    logps = torch.log(r).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 2)
    loss, stats = cispo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    want = torch.tensor([[-3.0 / 4, -5.0 / 4], [0.3 / 4, 0.05 / 4]], dtype=torch.float64)  # cap 5 on r = 8, no floor
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert stats["cap_frac"].item() == 0.25
    loss_ppo, _ = grpo.compute_policy_loss(logps, old, adv, mask, grpo.Args(group_size=2, beta=0.0, clip_eps_high=0.28))
    (g_ppo,) = torch.autograd.grad(loss_ppo, logps)
    assert (g_ppo == 0).all()


def test_is_weight_carries_no_gradient():
    """The weight is detached: no gradient reaches old_logps, and the gradient is not the one of the undetached
    IS objective r A (whose gradient is r A grad logp, without the cap) nor of w(logp) A logp."""
    args = make_args(eps_max=2.0)
    rewards, mask, old, logps = rollout(2, spread=0.5)
    adv = cispo.compute_advantages(rewards, args)
    logps.requires_grad_(True)
    old = old.clone().requires_grad_(True)
    loss, _ = cispo.compute_policy_loss(logps, old, adv, mask, args)
    g_logps, g_old = torch.autograd.grad(loss, (logps, old), allow_unused=True)
    assert g_old is None or (g_old == 0).all()
    w = torch.clamp(torch.exp(logps.detach() - old.detach()), max=2.0)
    n = mask.sum()
    torch.testing.assert_close(g_logps, -(w * adv[:, None]) * mask / n, rtol=1e-12, atol=1e-15)
    w_live = torch.clamp(torch.exp(logps - old.detach()), max=2.0)
    (g_live,) = torch.autograd.grad((-(w_live * adv[:, None] * logps) * mask).sum() / n, logps)
    assert (g_live - g_logps).abs().max() > 1e-3


def test_token_mean_weighs_every_token_the_same():
    """Two sequences of lengths 1 and 4 with the same A and r: every token's gradient is -w A / 5 (token mean),
    not -w A / (2 |o_i|) (GRPO's per-sequence mean)."""
    args = make_args()
    logps = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, _ = cispo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad[mask.bool()], torch.full((5,), -0.2, dtype=torch.float64))
    assert loss.item() == 0.0  # logp = 0: the surrogate's value is 0 while its gradient is not


def test_weight_is_capped_at_eps_max_and_has_no_floor():
    old = torch.zeros(1, 4, dtype=torch.float64)
    r = torch.tensor([[0.01, 1.0, 4.9, 50.0]], dtype=torch.float64)
    logps = torch.log(r).requires_grad_(True)
    adv = torch.tensor([-2.0], dtype=torch.float64)
    for args, want_w in [
        (make_args(), [0.01, 1.0, 4.9, 5.0]),
        (make_args(eps_max=4.0), [0.01, 1.0, 4.0, 4.0]),
        (make_args(cispo_form="minimax"), [0.01, 1.0, 1.2, 1.2]),  # 1 + is_eps_high, no lower bound
        (make_args(cispo_form="minimax", is_eps_high=0.28, is_eps_low=0.2), [0.8, 1.0, 1.28, 1.28]),
        (make_args(is_eps_low=0.5), [0.5, 1.0, 4.9, 5.0]),  # a floor applies to either form
    ]:
        loss, stats = cispo.compute_policy_loss(logps, old, adv, torch.ones(1, 4), args)
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(grad[0], torch.tensor(want_w, dtype=torch.float64) * 2.0 / 4, rtol=1e-12, atol=0)
        assert stats["is_weight_mean"].item() == pytest.approx(sum(want_w) / 4)
        assert stats["cap_frac"].item() == pytest.approx(sum(x > cap_of(args) for x in r[0].tolist()) / 4)


def test_on_policy_gradient_is_reinforce():
    """At r = 1 (first mini-batch) w = 1 and the gradient is the plain policy gradient -A / num_tokens."""
    rewards, mask, _, logps = rollout(3)
    args = make_args()
    adv = cispo.compute_advantages(rewards, args)
    logps.requires_grad_(True)
    loss, stats = cispo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad, -adv[:, None].expand_as(grad) * mask / mask.sum(), rtol=1e-12, atol=1e-15)
    assert stats["cap_frac"].item() == 0 and stats["is_weight_mean"].item() == pytest.approx(1.0)


def test_micro_batches_sum_to_the_mini_batch_gradient():
    args = make_args()
    rewards, mask, old, logps = rollout(4)
    adv = cispo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(
        cispo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=("cap_frac", "is_weight_mean", "approx_kl")
    )


def test_filter_groups_keeps_groups_with_some_but_not_all_correct():
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0])
    keep = cispo.filter_groups(correct, 4)
    want = []
    for g in range(0, len(correct), 4):
        c = int(correct[g : g + 4].sum())
        want.append(0 < c < 4)
    assert keep.tolist() == want == [False, False, True, True, True]
    assert cispo.filter_groups(torch.tensor([True, False, True, True]), 2).tolist() == [True, False]


def test_defaults_are_the_papers():
    a = cispo.Args()
    assert (a.cispo_form, a.eps_max, a.is_eps_low) == (
        "scalerl",
        5.0,
        None,
    )  # ScaleRL cap, no lower bound (MiniMax, ScaleRL)
    assert a.is_eps_high == 0.2  # MiniMax's value is unreported; verl's CISPO example
    assert not hasattr(a, "beta") and not hasattr(a, "clip_eps_low")  # no KL, no PPO clip
    assert a.num_mini_batches == 16 and a.ppo_epochs == 1  # MiniMax §3.1: 16 off-policy updates per generation batch
    assert a.dynamic_sampling and a.max_gen_batches == 10  # MiniMax §3.1 uses DAPO's dynamic sampling
    # DAPO's setting, in which MiniMax compares CISPO with DAPO (§3.1), translated to one node as dapo.py does
    assert (a.dataset_name, a.dataset_config, a.prompt_template) == ("open-r1/DAPO-Math-17k-Processed", "en", "dapo")
    assert (a.group_size, a.prompts_per_step, a.learning_rate, a.max_new_tokens) == (16, 512, 1e-6, 20480)
    assert (a.temperature, a.top_p) == (1.0, 1.0)
    assert (a.eval_temperature, a.eval_top_p, a.eval_samples) == (
        1.0,
        0.95,
        32,
    )  # MiniMax §5: AIME x32, T 1.0, top-p 0.95
    assert (a.prompts_per_step * a.group_size) % a.num_mini_batches == 0


@pytest.mark.parametrize("l_max,l_cache", [(20, 8), (7, 7), (10, 1)])
def test_overlong_penalty_is_dapos_reward(l_max, l_cache):
    """--overlong-penalty (MiniMax-M1 §3.1 keeps DAPO's length penalty) is DAPO's reward exactly: R = +-1 (DAPO eq. 7)
    + factor * R_len, R_len from DAPO eq. 13 case by case (tests.test_dapo.soft_overlong), equal to dapo.py's; off by
    default (ScaleRL): the 0/1 reward."""
    import dapo
    from tests.test_dapo import soft_overlong

    lengths = torch.arange(0, l_max + 3)
    correct = (lengths % 2).double()
    for factor in (1.0, 0.5):
        args = make_args(
            max_new_tokens=l_max, overlong_buffer_len=l_cache, overlong_penalty=True, overlong_penalty_factor=factor
        )
        got = cispo.compute_rewards(correct, lengths, lengths >= l_max, args)
        want = [2 * c - 1 + factor * soft_overlong(int(n), l_max, l_cache) for c, n in zip(correct.tolist(), lengths)]
        torch.testing.assert_close(
            got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6
        )  # fp32 reward
        dapo_args = dapo.Args(max_new_tokens=l_max, overlong_buffer_len=l_cache, overlong_penalty_factor=factor)
        assert got.tolist() == dapo.compute_rewards(correct, lengths, lengths >= l_max, dapo_args).tolist()
    off = cispo.compute_rewards(
        correct, lengths, lengths >= l_max, make_args(max_new_tokens=l_max, overlong_buffer_len=l_cache)
    )
    assert off.tolist() == correct.tolist()


def test_overlong_penalty_weighs_as_in_dapo():
    """G = 4, correct [1, 1, 0, 0], R_len [0, -0.75, 0, -1]: DAPO's +-1 + R_len gives the advantages
    [1.08, 0.52, -0.42, -1.18]; 1[correct] + R_len would give [1.14, 0.23, -0.08, -1.29] (penalty weighed twice)."""
    args = make_args(group_size=4, max_new_tokens=20, overlong_buffer_len=4, overlong_penalty=True)
    lengths = torch.tensor([16, 19, 10, 20])  # R_len = (16 - |y|) / 4 clipped to [-1, 0]: 0, -0.75, 0, -1
    adv = cispo.compute_advantages(
        cispo.compute_rewards(torch.tensor([1, 1, 0, 0]), lengths, lengths >= 20, args), args
    )
    r = torch.tensor([1.0, 0.25, -1.0, -2.0], dtype=torch.float64)  # +-1 + R_len
    torch.testing.assert_close(adv.double(), (r - r.mean()) / (r.std() + args.adv_eps), rtol=0, atol=1e-6)
    assert [round(a, 2) for a in adv.tolist()] == [1.08, 0.52, -0.42, -1.18]
