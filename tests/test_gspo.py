"""gspo.py's pure functions against float64 brute-force references.

The reference is GSPO's *sequence-level* objective (paper eq. 5), written with loops and `math`:
s_i = exp(mean_t (logp_it - old_it)), loss = 1/B sum_i -min(s_i A_i, clip(s_i) A_i). The script implements the
GSPO-token form (eq. 13-14) with stop-gradients; with one advantage per sequence both have the same value and
gradient, so finite differences of the sequence-level reference check the script's autograd gradient."""

from __future__ import annotations

import math

import pytest
import torch

import grpo
import gspo
from tests.checks import (
    PPO_CLIP_STATS,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    assert_standardised_advantages,
)


def make_args(**kw):
    return gspo.Args(**{"group_size": 4, **kw})


def seq_ratio(logps_row, old_row, mask_row) -> float:
    """s_i: the geometric mean of the token ratios over the sequence's masked tokens."""
    terms = [lp - o for lp, o, k in zip(logps_row, old_row, mask_row) if k]
    return math.exp(sum(terms) / len(terms)) if terms else 1.0


def brute_loss(logps, old, adv, mask, eps_low, eps_high) -> float:
    """GSPO eq. 5 as a loss: -1/B sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)."""
    total = 0.0
    for i in range(logps.shape[0]):
        m = mask[i].tolist()
        if not any(m):
            continue  # an empty sequence contributes nothing (but still counts in 1/B)
        s = seq_ratio(logps[i].tolist(), old[i].tolist(), m)
        a = adv[i].item()
        total += -min(s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a)
    return total / logps.shape[0]


def rollout(seed, groups=3, g=4, t=6, near=1e-4, far=0.3):
    """Rows alternate between policies that moved little (|log s| << clip, unclipped at the paper's 3e-4/4e-4 on
    most rows) and far (clipped unless the advantage points the other way); padding holds garbage."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    scale = torch.tensor([near if i % 2 else far for i in range(n)], dtype=torch.float64)[:, None]
    logps = old + scale * torch.randn(n, t, dtype=torch.float64, generator=gen)
    logps = torch.where(mask.bool(), logps, torch.full_like(logps, -7.0))  # garbage in the padding
    old = torch.where(mask.bool(), old, torch.full_like(old, -0.1))
    return rewards, mask, old, logps


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(gspo.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()


@pytest.mark.parametrize(
    "eps_low,eps_high,near", [(3e-4, 4e-4, 1e-4), (3e-4, 4e-4, 3e-5), (0.2, 0.2, 1e-4), (0.05, 0.1, 1e-4)]
)
def test_policy_loss_value_and_gradient_match_sequence_level_reference(eps_low, eps_high, near):
    args = make_args(clip_eps_low=eps_low, clip_eps_high=eps_high)
    rewards, mask, old, logps = rollout(1, near=near)
    adv = gspo.compute_advantages(rewards, args)
    ref = lambda lp: brute_loss(lp, old, adv, mask, eps_low, eps_high)
    keys = ("clip_frac_low", "clip_frac_high", "seq_clip_frac", "approx_kl", "policy_loss")
    # min_nonzero: the check covers unclipped sequences, not only zero gradients
    _, stats = assert_loss_matches_reference(
        gspo.compute_policy_loss, ref, logps, old, adv, mask, args, stat_keys=keys, min_nonzero=6
    )
    assert "kl_ref" not in stats


def test_clip_fractions_count_whole_sequences():
    args = make_args()
    old = torch.zeros(4, 3, dtype=torch.float64)
    # s_i: 1.01 (A>0: clipped high), 0.99 (A<0: clipped low), 1.01 (A<0: not clipped), 1.0001 (A>0: inside)
    log_s = torch.log(torch.tensor([1.01, 0.99, 1.01, 1.0001], dtype=torch.float64))
    logps = log_s[:, None].expand(4, 3).clone()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    _, stats = gspo.compute_policy_loss(logps, old, adv, mask, args)
    assert stats["seq_clip_frac"].item() == pytest.approx(2 / 4)
    assert stats["clip_frac_high"].item() == pytest.approx(3 / 9)  # tokens of clipped sequences / all tokens
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 9)


def test_on_policy_first_mini_batch_equals_grpo():
    """old = logps.detach(): s_i = 1 everywhere, and GSPO's loss and gradient are GRPO's with beta = 0."""
    rewards, mask, _, logps = rollout(3)
    args = make_args()
    adv = gspo.compute_advantages(rewards, args)
    logps.requires_grad_(True)
    loss, stats = gspo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (g_gspo,) = torch.autograd.grad(loss, logps)
    g_args = grpo.Args(group_size=4, beta=0.0)
    loss_grpo, _ = grpo.compute_policy_loss(logps, logps.detach(), adv, mask, g_args)
    (g_grpo,) = torch.autograd.grad(loss_grpo, logps)
    torch.testing.assert_close(g_gspo, g_grpo, rtol=0, atol=1e-15)
    torch.testing.assert_close(loss, loss_grpo, rtol=0, atol=1e-15)
    assert g_gspo.abs().max() > 0
    assert stats["seq_clip_frac"].item() == 0


def test_off_policy_differs_from_grpo_and_weights_every_token_by_the_sequence_ratio():
    """Once the policy moved, GSPO weights each token of sequence i by s_i (gradient -s_i A_i / (B |y_i|)),
    GRPO by its own r_it: the gradients differ, even with clip ranges so wide that neither clips."""
    rewards, mask, old, logps = rollout(4, near=0.05, far=0.05)
    wide = {"clip_eps_low": 0.9, "clip_eps_high": 10.0}
    args = make_args(**wide)
    adv = gspo.compute_advantages(rewards, args)
    logps.requires_grad_(True)
    loss, _ = gspo.compute_policy_loss(logps, old, adv, mask, args)
    (g_gspo,) = torch.autograd.grad(loss, logps)
    loss_grpo, _ = grpo.compute_policy_loss(logps, old, adv, mask, grpo.Args(group_size=4, beta=0.0, **wide))
    (g_grpo,) = torch.autograd.grad(loss_grpo, logps)
    assert (g_gspo - g_grpo).abs().max() > 1e-3
    b = logps.shape[0]
    for i in range(b):
        n_i = int(mask[i].sum())
        s = seq_ratio(logps[i].tolist(), old[i].tolist(), mask[i].tolist())
        for t in range(n_i):
            assert g_gspo[i, t].item() == pytest.approx(-s * adv[i].item() / (b * n_i), abs=1e-14)


def test_sequence_clipping_zeroes_the_whole_sequence_in_the_advantage_direction():
    args = make_args()
    old = torch.zeros(4, 3, dtype=torch.float64)
    # token ratios (2.0, 0.9, 0.9): s = (2 * 0.81)^(1/3) = 1.174 > 1 + 4e-4, though two tokens went *down*
    up = torch.log(torch.tensor([2.0, 0.9, 0.9], dtype=torch.float64))
    down = torch.log(torch.tensor([0.5, 1.1, 1.1], dtype=torch.float64))  # s = 0.846 < 1 - 3e-4
    logps = torch.stack([up, up, down, down]).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 3)
    loss, _ = gspo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad[0] == 0).all()  # s above the range with A > 0: the whole sequence is dropped
    assert (grad[2] == 0).all()  # s below the range with A < 0: dropped
    s_up, s_down = (2 * 0.81) ** (1 / 3), (0.5 * 1.21) ** (1 / 3)
    # against the advantage's direction the unclipped term s A wins the min: every token keeps -s A / (B |y|)
    torch.testing.assert_close(grad[1], torch.full((3,), s_up / 12, dtype=torch.float64))
    torch.testing.assert_close(grad[3], torch.full((3,), -s_down / 12, dtype=torch.float64))
    # GRPO's token-level clip (even at 0.2) keeps the gradient of the tokens whose own ratio is inside the range
    loss_grpo, _ = grpo.compute_policy_loss(logps, old, adv, mask, grpo.Args(group_size=4, beta=0.0))
    (g_grpo,) = torch.autograd.grad(loss_grpo, logps)
    assert (g_grpo[0, 1:] != 0).all() and (g_grpo[2, 1:] != 0).all()


def test_ratio_is_length_normalised():
    """s_i is the geometric mean of the token ratios, not their product: with A = -1 and s above the range the
    loss is s itself; repeating a sequence's tokens leaves s unchanged."""
    args = make_args()
    ratios = [2.0, 0.5, 4.0]
    logps = torch.log(torch.tensor([ratios + [1.0] * 3, ratios + ratios], dtype=torch.float64))
    old = torch.zeros(2, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    geo = (2.0 * 0.5 * 4.0) ** (1 / 3)
    for row in (0, 1):
        loss, _ = gspo.compute_policy_loss(
            logps[row : row + 1],
            old[row : row + 1],
            torch.tensor([-1.0], dtype=torch.float64),
            mask[row : row + 1],
            args,
        )
        assert loss.item() == pytest.approx(geo, rel=1e-12)
        assert loss.item() != pytest.approx(4.0)  # the unnormalised sequence ratio


def test_micro_batches_sum_to_the_mini_batch_gradient_and_stats():
    args = make_args(clip_eps_low=0.05, clip_eps_high=0.1)
    rewards, mask, old, logps = rollout(2, near=0.02, far=0.2)
    adv = gspo.compute_advantages(rewards, args)
    _, stats = assert_micro_batches_add_up(
        gspo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=("seq_clip_frac", *PPO_CLIP_STATS)
    )
    assert 0 < stats["seq_clip_frac"].item() < 1


def test_defaults_are_the_papers():
    a = gspo.Args()
    assert (a.clip_eps_low, a.clip_eps_high) == (3e-4, 4e-4)  # GSPO §5.1
    assert a.num_mini_batches == 4 and a.ppo_epochs == 1  # GSPO §5.1: four mini-batches per rollout batch
    assert not hasattr(a, "beta")  # no KL, no reference model
    g = grpo.Args()  # the paper gives no model/data/G/lr/length: grpo.py's
    for k in (
        "model_name_or_path",
        "dataset_name",
        "group_size",
        "prompts_per_step",
        "learning_rate",
        "max_new_tokens",
        "temperature",
        "adv_eps",
    ):
        assert getattr(a, k) == getattr(g, k), k
    assert (a.prompts_per_step * a.group_size) % a.num_mini_batches == 0
