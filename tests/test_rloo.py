"""rloo.py's pure functions against float64 brute-force references written with loops: the KL-shaped reward, the
leave-one-out baseline (and its identity with G/(G-1) times the group-centred reward), REINFORCE's loss and its
gradient, the token-clip variant. Its learning run is in tests/test_scripts.py."""

from __future__ import annotations

import math

import pytest
import torch

import rloo
from tests.checks import (
    PPO_CLIP_STATS,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    clip_probe,
    on_policy_pair,
)
from tests.reference import group_advantages, ppo_clip_token


def make_args(**kw):
    return rloo.Args(**{"group_size": 4, **kw})


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    rewards[g] = 0.5  # a non-binary reward
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    ref = old + 0.3 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    logps = old + 0.4 * torch.randn(n, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    return rewards, mask, old, ref, logps


def brute_advantages(rewards: list[float], g: int) -> list[float]:
    """R_i minus the mean of the other G - 1 rewards of its group, by loops."""
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        out += [grp[i] - math.fsum(grp[j] for j in range(g) if j != i) / (g - 1) for i in range(g)]
    return out


def brute_shaped(rewards, mask, old, ref, beta) -> list[float]:
    """r_i - beta sum_t (log pi_old - log pi_ref) over the completion's tokens, by loops."""
    out = []
    for i in range(mask.shape[0]):
        kl = math.fsum(old[i, t].item() - ref[i, t].item() for t in range(mask.shape[1]) if mask[i, t])
        out.append(rewards[i].item() - beta * kl)
    return out


def brute_loss(logps, old, adv, mask, args) -> float:
    """reinforce: -1/N sum_i A_i sum_t log pi; token-clip: -1/sum|o| sum_i sum_t min(r A, clip(r) A), by loops."""
    terms, count = [], 0
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[i, t]:
                lp, a = logps[i, t].item(), adv[i].item()
                if args.rloo_loss == "reinforce":
                    terms.append(-a * lp)
                else:
                    terms.append(ppo_clip_token(lp, old[i, t].item(), a, args.clip_eps_low, args.clip_eps_high))
                count += 1
    return math.fsum(terms) / (logps.shape[0] if args.rloo_loss == "reinforce" else count)


@pytest.mark.parametrize("g", [2, 4, 5])
def test_leave_one_out_baseline_matches_reference_and_the_centred_identity(g):
    """A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g R): the group-centred reward (Dr. GRPO's) scaled."""
    gen = torch.Generator().manual_seed(g)
    rewards = torch.rand(6 * g, generator=gen, dtype=torch.float64)
    rewards[:g] = 1.0  # equal 0/1 rewards (the verifier's): exactly 0, so a step without signal skips its update
    got = rloo.compute_advantages(rewards, make_args(group_size=g))
    torch.testing.assert_close(got, torch.tensor(brute_advantages(rewards.tolist(), g), dtype=torch.float64))
    centred = torch.tensor(group_advantages(rewards.tolist(), g, use_std=False), dtype=torch.float64)
    torch.testing.assert_close(got, g / (g - 1) * centred, rtol=0, atol=1e-14)
    assert (got[:g] == 0).all()
    # one correct of four: +1 and -1/3 (its baseline is 0, the others' 1/3)
    one = rloo.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), make_args())
    torch.testing.assert_close(one, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_the_kl_is_summed_over_the_completion_in_its_reward():
    rewards, mask, old, ref, _ = rollout(1)
    args = make_args(beta=0.05)
    got = rloo.kl_shaped_rewards(rewards, mask, old, ref, args)
    torch.testing.assert_close(got, torch.tensor(brute_shaped(rewards, mask, old, ref, 0.05), dtype=torch.float64))
    assert rloo.kl_shaped_rewards(rewards, mask, None, None, make_args(beta=0.0)) is rewards
    # in an all-correct group the KL alone now separates the completions: the one that strays further loses
    adv = rloo.compute_advantages(got, args)
    kl = ((old - ref) * mask).sum(-1)[:4]
    assert adv[:4].argmin() == kl.argmax() and adv[:4].abs().sum() > 0


@pytest.mark.parametrize("loss", ["reinforce", "token-clip"])
def test_policy_loss_value_and_gradient_match_reference(loss):
    args = make_args(rloo_loss=loss)
    rewards, mask, old, ref, logps = rollout(2)
    adv = rloo.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args)
    keys = (*PPO_CLIP_STATS, "policy_loss") if loss == "token-clip" else ("approx_kl", "policy_loss", "kl_ref")
    _, stats = assert_loss_matches_reference(
        rloo.compute_policy_loss, reference, logps, old, adv, mask, args, stat_keys=keys, ref_logps=ref
    )
    torch.testing.assert_close(stats["kl_ref"], (old - ref)[mask > 0].mean(), rtol=0, atol=1e-12)


def test_reinforce_gradient_is_the_advantage_on_every_token_with_no_ratio():
    """-A_i / N on every token of completion i, whatever its length (GRPO: -A_i / (N |o_i|)) and whatever pi_old is:
    the paper's second step on stale samples takes the same estimator, no importance ratio, no clip."""
    logps, mask, adv = on_policy_pair()
    args = make_args(group_size=2)
    loss, stats = rloo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0, 0, 0], [0.5] * 4], dtype=torch.float64))
    stale = logps.detach() - 2.0  # ratio e^2: PPO would clip both
    loss, _ = rloo.compute_policy_loss(logps, stale, adv, mask, args)
    torch.testing.assert_close(torch.autograd.grad(loss, logps)[0], grad, rtol=0, atol=0)
    assert "clip_frac_low" not in stats


def test_token_clip_clips_and_takes_the_token_mean():
    args = make_args(group_size=2, rloo_loss="token-clip")
    logps, old, adv, mask = clip_probe()
    loss, stats = rloo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r = 1.5 with A > 0, r = 0.5 with A < 0: clipped
    torch.testing.assert_close(grad[0, 1], torch.tensor(-1.1 / 4, dtype=torch.float64))
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25
    logps, mask, adv = on_policy_pair()  # on-policy: -A_i / sum|o| per token
    loss, _ = rloo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    want = torch.tensor([[-0.2, 0, 0, 0], [0.2] * 4], dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(loss, logps)[0], want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("loss", ["reinforce", "token-clip"])
def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient(loss):
    args = make_args(rloo_loss=loss)
    rewards, mask, old, ref, logps = rollout(3)
    adv = rloo.compute_advantages(rewards, args)
    keys = PPO_CLIP_STATS if loss == "token-clip" else ("approx_kl", "kl_ref")
    assert_micro_batches_add_up(rloo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=keys, ref_logps=ref)


def test_defaults_are_the_papers():
    a = rloo.Args()
    assert (a.beta, a.learning_rate, a.group_size) == (0.03, 1e-6, 4)  # App. C (TL;DR); k in {2, 4}
    assert (a.group_size * a.prompts_per_step, a.num_mini_batches, a.ppo_epochs) == (512, 2, 1)  # 512 in 2 x 256
    assert (a.total_steps, a.warmup_steps) == (600, 36)  # 3% of the 1200 optimizer steps
    assert a.rloo_loss == "reinforce"
    assert (a.model_name_or_path, a.dataset_name) == ("Qwen/Qwen2.5-Math-1.5B", "DigitalLearningGmbH/MATH-lighteval")
