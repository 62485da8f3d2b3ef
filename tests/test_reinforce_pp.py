"""reinforce_pp.py's pure functions against float64 brute-force references written with loops: the KL-in-reward
returns, the global normalisation, the group-baseline variant, the loss and its gradient. Its normalisation over 2
processes is in tests/test_distributed.py (the shared launches), its learning run in tests/test_scripts.py."""

from __future__ import annotations

import math

import pytest
import torch

import reinforce_pp
from tests.checks import (
    PPO_CLIP_STATS,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    clip_probe,
    on_policy_pair,
)
from tests.reference import ppo_clip_token


def make_args(**kw):
    return reinforce_pp.Args(**{"group_size": 4, **kw})


def rollout(seed, groups=3, g=4, t=7, holes=True):
    """0/1 rewards (one all-correct group, one 1-of-4), ragged lengths and, with `holes`, a masked span inside
    some completions (a tool's output); old / reference / current log-probs a few tenths apart."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0
    rewards[g : 2 * g] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    lengths = torch.randint(2, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    if holes:
        mask[1, 1:3] = 0  # a span inside a completion
        mask[6, 0] = 0  # a completion that starts with one
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    ref = old + 0.3 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    logps = old + 0.4 * torch.randn(n, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    return rewards, mask, old, ref, logps


def brute_returns(rewards, mask, old, ref, args) -> list[list[float]]:
    """Eq. 4's token rewards and their discounted returns, by loops: r (minus its group's mean with
    --group-baseline) on the last token with mask 1, -beta (log pi_old - log pi_ref) on every token with mask 1 (not
    with --group-baseline); a masked token gets 0 and the running return passes it undiscounted."""
    n, t = mask.shape
    out = []
    for i in range(n):
        r = rewards[i].item()
        if args.group_baseline:
            k = i // args.group_size * args.group_size
            r -= math.fsum(rewards[k : k + args.group_size].tolist()) / args.group_size
        valid = [s for s in range(t) if mask[i, s]]
        token = [0.0] * t
        for s in valid:
            if args.beta > 0 and not args.group_baseline:
                token[s] -= args.beta * (old[i, s].item() - ref[i, s].item())
        if valid:
            token[valid[-1]] += r
        row, running = [0.0] * t, 0.0
        for s in reversed(range(t)):
            if mask[i, s]:
                running = token[s] + args.gamma * running
                row[s] = running
        out.append(row)
    return out


def brute_advantages(rewards, mask, old, ref, args) -> torch.Tensor:
    """(G - mean) / (std + eps) over every token with mask 1 of the whole batch, the population std (eq. 5)."""
    returns = brute_returns(rewards, mask, old, ref, args)
    values = [returns[i][s] for i in range(mask.shape[0]) for s in range(mask.shape[1]) if mask[i, s]]
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    adv = [[(g - mean) / (std + args.adv_eps) if m else 0.0 for g, m in zip(row, ms)] for row, ms in zip(returns, mask)]
    return torch.tensor(adv, dtype=torch.float64)


def brute_loss(logps, old, adv, mask, ref, args) -> float:
    """-1/B sum_i 1/|o_i| sum_t [min(s A_t, clip(s) A_t) - beta k2 with --group-baseline], by loops."""
    total = 0.0
    for i in range(logps.shape[0]):
        terms = []
        for s in range(logps.shape[1]):
            if mask[i, s]:
                lp = logps[i, s].item()
                term = ppo_clip_token(lp, old[i, s].item(), adv[i, s].item(), args.clip_eps_low, args.clip_eps_high)
                if args.group_baseline and args.beta > 0:
                    term += args.beta * 0.5 * (lp - ref[i, s].item()) ** 2
                terms.append(term)
        total += math.fsum(terms) / max(len(terms), 1)
    return total / logps.shape[0]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_advantages_match_reference(beta, gamma):
    args = make_args(beta=beta, gamma=gamma)
    for seed in range(3):
        rewards, mask, old, ref, _ = rollout(seed)
        got = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)
        torch.testing.assert_close(got, brute_advantages(rewards, mask, old, ref, args), rtol=0, atol=1e-12)
        assert (got[mask == 0] == 0).all()


def test_returns_by_hand():
    """A 3-token completion with reward 1 at gamma 0.5: returns 1/4, 1/2, 1; with its middle token masked the return
    passes it undiscounted: 1/2, 0, 1; the KL of each token is in the return of every token before it."""
    mask, r = torch.tensor([[1, 1, 1], [1, 0, 1]]), torch.tensor([[0.0, 0, 1], [0, 0, 1]], dtype=torch.float64)
    got = reinforce_pp.compute_returns(r, mask, 0.5)
    torch.testing.assert_close(got, torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.0, 1.0]], dtype=torch.float64))
    # gamma 1, beta 0.1, KL 0.2, 0.4, 0.6 on both completions, rewards 1 and 0: the first token's return is
    # r - 0.1 (0.2 + 0.4 + 0.6) (eq. 4), then normalised over the 6 tokens
    args = make_args(beta=0.1, group_size=2)
    old = torch.tensor([[0.2, 0.4, 0.6]] * 2, dtype=torch.float64)
    hand = torch.tensor([[1 - 0.12, 1 - 0.1, 1 - 0.06], [-0.12, -0.1, -0.06]], dtype=torch.float64)
    want = (hand - hand.mean()) / (hand.std(correction=0) + args.adv_eps)
    got = reinforce_pp.compute_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 3), args, old, torch.zeros(2, 3))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_normalised_over_the_batch_tokens_and_zero_without_signal():
    """The advantages of the valid tokens have mean 0 and population std 1 (eps 0), as the whole batch's, not per
    group; a batch whose returns are all equal gets exactly 0 everywhere."""
    args = make_args(beta=0.05, adv_eps=0.0)
    rewards, mask, old, ref, _ = rollout(4)
    adv = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)[mask > 0]
    assert abs(adv.mean().item()) < 1e-14 and abs(adv.std(correction=0).item() - 1) < 1e-12
    # the group that is all correct still gets advantages (the batch's mean is not its own), unlike GRPO
    assert (reinforce_pp.compute_advantages(rewards, mask, make_args(), old, ref)[:4][mask[:4] > 0] != 0).all()
    for value in (0.0, 1.0):
        same = torch.full((12,), value, dtype=torch.float64)
        for baseline in (False, True):
            got = reinforce_pp.compute_advantages(same, mask, make_args(beta=0.0, group_baseline=baseline))
            assert torch.equal(got, torch.zeros_like(got))


def test_group_baseline_is_the_centred_reward_on_every_token_and_ignores_the_kl():
    """Eq. 6-7: r - mean_g r on every token, normalised by the batch's token mean and std; the KL is not in it."""
    args = make_args(group_baseline=True, beta=0.05)
    rewards, mask, old, ref, _ = rollout(5)
    got = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)
    torch.testing.assert_close(got, brute_advantages(rewards, mask, old, ref, args), rtol=0, atol=1e-12)
    for i in range(12):  # one value per completion
        assert len(set(got[i][mask[i] > 0].tolist())) == 1
    assert (got[:4] == got[:4][mask[:4] > 0].max()).logical_or(mask[:4] == 0).all()  # an all-correct group: one value
    torch.testing.assert_close(reinforce_pp.compute_advantages(rewards, mask, args, old, old - 1.0), got)
    # centred: a completion above its group's mean is positive when the batch's token mean is near 0
    plain = reinforce_pp.compute_advantages(rewards, mask, make_args(beta=0.05), old, ref)
    assert not torch.allclose(plain, got)


def test_the_kl_makes_advantages_depend_on_the_token():
    """gamma = 1: inside a completion, A_t - A_t+1 = -beta KL(t) / std (eq. 4); without the KL they are equal."""
    args = make_args(beta=0.05, adv_eps=0.0)
    rewards, mask, old, ref, _ = rollout(6, holes=False)
    adv = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)
    returns = torch.tensor(brute_returns(rewards, mask, old, ref, args), dtype=torch.float64)
    std = returns[mask > 0].std(correction=0)
    i = int(mask.sum(-1).argmax())
    n = int(mask[i].sum())
    diffs = adv[i, : n - 1] - adv[i, 1:n]
    torch.testing.assert_close(diffs, -args.beta * (old[i, : n - 1] - ref[i, : n - 1]) / std, rtol=0, atol=1e-12)
    flat = reinforce_pp.compute_advantages(rewards, mask, make_args(beta=0.0), old, ref)
    assert all(len(set(flat[k][mask[k] > 0].tolist())) == 1 for k in range(12))


@pytest.mark.parametrize("baseline", [False, True])
def test_policy_loss_value_and_gradient_match_reference(baseline):
    args = make_args(beta=0.05, group_baseline=baseline)
    rewards, mask, old, ref, logps = rollout(7)
    adv = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)
    reference = lambda lp: brute_loss(lp, old, adv, mask, ref, args)
    _, stats = assert_loss_matches_reference(
        reinforce_pp.compute_policy_loss, reference, logps, old, adv, mask, args, ref_logps=ref
    )
    want_kl = (0.5 * (logps - ref) ** 2)[mask > 0].mean() if baseline else (old - ref)[mask > 0].mean()
    torch.testing.assert_close(stats["kl_ref"], want_kl, rtol=0, atol=1e-12)


def test_on_policy_gradient_is_the_token_advantage_over_the_sequence_length():
    """At s = 1 the gradient w.r.t. logp_it is -A_it / (B |o_i|) (eq. 1's per-sequence token mean); the k2 loss of
    --group-baseline adds beta (logp - logp_ref) / (B |o_i|)."""
    logps, mask, _ = on_policy_pair()
    adv = torch.tensor([[1.0, 0, 0, 0], [-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64)
    loss, _ = reinforce_pp.compute_policy_loss(logps, logps.detach(), adv, mask, make_args(group_size=2))
    (grad,) = torch.autograd.grad(loss, logps)
    want = torch.tensor([[-0.5, 0, 0, 0], [1 / 8, 2 / 8, 3 / 8, 4 / 8]], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-15)
    ref = torch.full((2, 4), -0.5, dtype=torch.float64)  # logp - ref = 0.5 on every token
    args = make_args(group_size=2, group_baseline=True, beta=0.1)
    loss, _ = reinforce_pp.compute_policy_loss(logps, logps.detach(), adv, mask, args, ref_logps=ref)
    (grad,) = torch.autograd.grad(loss, logps)
    k2 = torch.tensor([[0.05 / 2, 0, 0, 0], [0.05 / 8] * 4], dtype=torch.float64)
    torch.testing.assert_close(grad, want + k2, rtol=0, atol=1e-15)


def test_clipped_tokens_get_no_gradient_and_are_counted():
    logps, old, adv, mask = clip_probe()
    adv = adv[:, None].expand(2, 2).clone()
    loss, stats = reinforce_pp.compute_policy_loss(logps, old, adv, mask, make_args(group_size=2, beta=0.0))
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r = 1.5 with A > 0 and r = 0.5 with A < 0 are clipped
    torch.testing.assert_close(grad[0, 1], torch.tensor(-1.1 / 4, dtype=torch.float64))
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25


@pytest.mark.parametrize("baseline", [False, True])
def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient(baseline):
    args = make_args(beta=0.05, group_baseline=baseline)
    rewards, mask, old, ref, logps = rollout(8)
    adv = reinforce_pp.compute_advantages(rewards, mask, args, old, ref)
    keys = (*PPO_CLIP_STATS, "kl_ref") if baseline else PPO_CLIP_STATS
    assert_micro_batches_add_up(
        reinforce_pp.compute_policy_loss, logps, old, adv, mask, args, stat_keys=keys, ref_logps=ref
    )


def test_replay_caps_the_ratio_of_each_token_with_a_negative_advantage():
    """common.data_strategies.update_replay with per-token advantages: a replayed row's stored log-probs are raised
    to log pi - log cap on its tokens with A < 0 only (a row's one advantage: the whole row, as before)."""
    from common.data_strategies import REPLAY_RATIO_CAP, ReplayBuffer, TrainGroups, update_replay
    from common.sampling import Completion

    now = torch.zeros(2, 4, dtype=torch.float64)  # log pi of the policy now; the batch is 4 tokens wide
    stored = [-5.0, -5.0, -5.0]  # a stale 3-token row: ratio e^5 on each token
    groups = TrainGroups(
        prompts=[[1]],
        completions=[Completion([1, 2, 3], "", False)] * 2,
        correct=[1.0, 0.0],
        rows=[0],
        pass_rate=[0.5],
        step=0,
        fresh=[False],
        injected=[False],
        stored_logps={1: stored},
    )
    floor = -math.log(REPLAY_RATIO_CAP)
    for adv, want in (
        (torch.tensor([[0.0] * 4, [1.0, -1.0, 2.0, 0.0]]), [-5.0, floor, -5.0, 0.0]),
        (torch.tensor([0.0, -1.0]), [floor] * 3 + [0.0]),
        (torch.tensor([0.0, 1.0]), [-5.0] * 3 + [0.0]),
    ):
        old = now.clone()
        got = update_replay(ReplayBuffer(4), groups, old, adv, 2)
        assert got[1].tolist() == pytest.approx(want)
        assert torch.equal(old, now)  # returned, not written in place


def test_defaults_are_the_papers():
    a = reinforce_pp.Args()
    assert (a.beta, a.clip_eps_low, a.clip_eps_high, a.gamma) == (0.001, 0.2, 0.2, 1.0)  # v1 Table 1 (mathematics)
    assert (a.group_size, a.prompts_per_step, a.num_mini_batches, a.ppo_epochs) == (4, 256, 8, 1)
    assert a.learning_rate == 5e-7 and a.adv_eps == 1e-6 and not a.group_baseline
    assert (a.model_name_or_path, a.dataset_name) == ("Qwen/Qwen2.5-Math-1.5B", "DigitalLearningGmbH/MATH-lighteval")


@pytest.mark.parametrize("kw", [{"gamma": 0.0}, {"gamma": 1.5}, {"gamma": 0.9, "group_baseline": True}])
def test_a_bad_gamma_is_refused_before_anything_is_written(kw, tmp_path):
    with pytest.raises(SystemExit, match="^--gamma must be in"):
        reinforce_pp.main(reinforce_pp.Args(output_dir=str(tmp_path / "out"), **kw))
    assert list(tmp_path.iterdir()) == []
