"""grpo.py's pure functions against float64 brute-force references (tests/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

import grpo
from tests.checks import (
    PPO_CLIP_STATS,
    SingleProcess,
    TablePolicy,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    assert_standardised_advantages,
    clip_probe,
    on_policy_pair,
)
from tests.fp_bounds import assert_within, group_advantage_bound
from tests.reference import aggregate, k3, ppo_clip_token


def make_args(**kw):
    return grpo.Args(**{"group_size": 4, "beta": 0.0, **kw})


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * g,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    ref = old + 0.1 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps, ref


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(grpo.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()


def test_advantages_sign_and_scale():
    args = make_args(group_size=2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = grpo.compute_advantages(rewards, args)
    # two samples {1, 0}: mean 0.5, unbiased std 1/sqrt(2) -> +-0.5 / (0.7071 + eps); fp32 rounding bound
    want = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (math.sqrt(0.5) + args.adv_eps)
    assert_within(adv, want, group_advantage_bound(rewards, 2, args.adv_eps, adv.dtype))


def brute_loss(logps, old, adv, mask, args, ref=None):
    per_token = []
    for i in range(logps.shape[0]):
        row = []
        for t in range(logps.shape[1]):
            v = ppo_clip_token(
                logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high
            )
            if args.beta > 0:
                v += args.beta * k3(logps[i, t].item(), ref[i, t].item())
            row.append(v)
        per_token.append(row)
    return aggregate(per_token, mask.tolist(), "seq-mean-token-mean")


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_loss_value_and_gradient_match_reference(beta):
    args = make_args(beta=beta)
    rewards, mask, old, logps, ref = rollout(1)
    adv = grpo.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args, ref)
    _, stats = assert_loss_matches_reference(
        grpo.compute_policy_loss, reference, logps, old, adv, mask, args, loss_atol=1e-10, ref_logps=ref
    )
    if beta:
        assert stats["kl_ref"].item() > 0


def test_clipped_tokens_get_no_gradient_and_are_counted():
    args = make_args()
    logps, old, adv, mask = clip_probe()
    loss, stats = grpo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r=1.5 with A>0 and r=0.5 with A<0 are clipped
    assert grad[0, 1] < 0 and grad[1, 1] > 0  # inside the trust region: push logp up for A>0, down for A<0
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25


def test_on_policy_gradient_is_advantage_weighted_sequence_mean():
    """At r = 1 the gradient w.r.t. logp_it is -A_i / (G |o_i|): the per-sequence mean, not a token mean."""
    args = make_args(group_size=2)
    logps, mask, adv = on_policy_pair()
    loss, _ = grpo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad[0, 0], torch.tensor(-0.5, dtype=torch.float64))
    torch.testing.assert_close(grad[1], torch.full((4,), 0.125, dtype=torch.float64))


def test_micro_batches_sum_to_the_mini_batch_gradient():
    args = make_args(beta=0.04)
    rewards, mask, old, logps, ref = rollout(2)
    adv = grpo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(
        grpo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=(*PPO_CLIP_STATS, "kl_ref"), ref_logps=ref
    )


def test_defaults_are_the_papers():
    a = grpo.Args()
    assert (a.clip_eps_low, a.clip_eps_high, a.beta, a.learning_rate, a.group_size) == (0.2, 0.2, 0.04, 1e-6, 64)
    assert a.num_mini_batches == 1 and a.ppo_epochs == 1


@pytest.mark.parametrize("tokens", [0, 12])
def test_update_policy_canary_is_the_mean_sampler_gap_before_any_step(tokens):
    """train/logprob_diff_*: |trainer - sampler| log-prob on the first mini-batch's tokens, before it is trained on,
    whatever the number of epochs and mini-batches, with row or token micro-batches (cut to their own padding)."""
    g = torch.Generator().manual_seed(3)
    n, p_len, c_len = 8, 2, 5
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    mask = (torch.arange(c_len)[None] < lengths[:, None]).long()
    ids = torch.randint(0, 30, (n, p_len + c_len), generator=g)
    attn = torch.cat([torch.ones(n, p_len, dtype=torch.long), mask], 1)
    policy = TablePolicy(30)
    gap = torch.rand(n, c_len, generator=g, dtype=torch.float64)
    sampler = policy.theta.detach()[ids[:, p_len:]] + gap  # the trainer's log-probs plus a known gap
    batch = {
        "ids": ids,
        "attn": attn,
        "mask": mask,
        "p_len": p_len,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "lens": [(p_len, int(k)) for k in lengths],
        "sampler_logps": sampler,
        "old_logps": policy.theta.detach()[ids[:, p_len:]],
    }
    args = grpo.Args(
        beta=0.0, ppo_epochs=2, num_mini_batches=2, micro_batch_size=3, micro_batch_tokens=tokens, max_grad_norm=1e9
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = policy.theta.detach().clone()
    sums = grpo.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0)
    skipped = sums["skipped_updates"]
    first = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 1_000_003))[
        : n // 2
    ]  # epoch 0, mini-batch 0
    want = gap[first][mask[first].bool()]
    assert skipped == 0 and not torch.equal(policy.theta.detach(), before)  # the policy did move afterwards
    torch.testing.assert_close(sums["logprob_diff_mean"], want.mean(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sums["logprob_diff_max"], want.max(), rtol=1e-12, atol=1e-12)
