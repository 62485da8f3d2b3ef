"""lite_ppo.py's pure functions against float64 brute-force references written with loops, and the batch std
across 2 processes (torchrun, gloo)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess

import torch

import grpo
import lite_ppo
from tests.checks import (
    PPO_CLIP_STATS,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    clip_probe,
    launch_cmd,
    on_policy_pair,
)
from tests.reference import ppo_clip_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_args(**kw):
    return lite_ppo.Args(**{"group_size": 4, **kw})


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * g,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    rewards[g : 2 * g] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # a group with signal
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    return rewards, mask, old, logps


def brute_advantages(rewards: list[float], g: int, eps: float) -> list[float]:
    """(R_i - mean of its group) / (unbiased std of all rewards + eps), by loops."""
    n = len(rewards)
    mean_all = math.fsum(rewards) / n
    std_all = math.sqrt(math.fsum((r - mean_all) ** 2 for r in rewards) / (n - 1))
    out = []
    for k in range(0, n, g):
        grp = rewards[k : k + g]
        mean = math.fsum(grp) / len(grp)
        out += [(r - mean) / (std_all + eps) for r in grp]
    return out


def brute_loss(logps, old, adv, mask, args) -> float:
    """-1/sum_i |o_i| sum_i sum_t min(r A, clip(r) A), by loops."""
    total, count = 0.0, 0
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[i, t]:
                total += ppo_clip_token(
                    logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high
                )
                count += 1
    return total / count


def test_advantages_use_the_group_mean_and_the_batch_std():
    args = make_args()
    for seed in range(4):
        rewards, *_ = rollout(seed)
        got = lite_ppo.compute_advantages(rewards, args)
        want = torch.tensor(brute_advantages(rewards.tolist(), 4, args.adv_eps), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
        assert (got[:4] == 0).all()  # zero-variance group
    # a hand-computed case: rewards 1,0,0,0 | 1,1,1,1: batch mean 5/8, unbiased std sqrt(15/56)
    adv = lite_ppo.compute_advantages(
        torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.float64), make_args(adv_eps=0.0)
    )
    s = math.sqrt(15 / 56)
    torch.testing.assert_close(
        adv, torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0], dtype=torch.float64)
    )


def test_batch_std_differs_from_group_std():
    args = make_args()
    rewards = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float64)
    lite = lite_ppo.compute_advantages(rewards, args)
    group = grpo.compute_advantages(rewards, grpo.Args(group_size=4))
    assert not torch.allclose(lite, group, atol=1e-3)
    assert torch.equal(lite.sign(), group.sign())  # same baseline: only each group's scale changes
    ratio = lite[[4, 5, 8, 10]] / group[[4, 5, 8, 10]]
    assert not torch.allclose(ratio[:2].mean(), ratio[2:].mean())  # by a different factor per group
    # the scale depends on the other groups: changing group 3 changes group 2's advantages (never with GRPO)
    other = rewards.clone()
    other[8:12] = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # 8/12 right instead of 7/12
    assert not torch.allclose(lite_ppo.compute_advantages(other, args)[4:8], lite[4:8])
    torch.testing.assert_close(grpo.compute_advantages(other, grpo.Args(group_size=4))[4:8], group[4:8])


def test_a_batch_without_signal_gives_zero_advantages():
    args = make_args()
    for value in (0.0, 1.0):
        adv = lite_ppo.compute_advantages(torch.full((12,), value), args)
        assert torch.equal(adv, torch.zeros(12))


def test_policy_loss_value_and_gradient_match_reference():
    args = make_args()
    rewards, mask, old, logps = rollout(3)
    adv = lite_ppo.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args)
    _, stats = assert_loss_matches_reference(lite_ppo.compute_policy_loss, reference, logps, old, adv, mask, args)
    assert "kl_ref" not in stats


def test_on_policy_gradient_is_the_token_mean():
    """At r = 1 the gradient w.r.t. logp_it is -A_i / (total tokens): the same weight for a token of a 1-token
    and of a 4-token answer (GRPO: -A_i / (N |o_i|))."""
    args = make_args(group_size=2)
    logps, mask, adv = on_policy_pair()
    loss, _ = lite_ppo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(
        grad, torch.tensor([[-0.2, 0, 0, 0], [0.2] * 4], dtype=torch.float64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(loss, torch.tensor(3 / 5, dtype=torch.float64))  # -(1*1 - 1*4) / 5
    gl, _ = grpo.compute_policy_loss(logps, logps.detach(), adv, mask, grpo.Args(group_size=2, beta=0.0))
    assert not torch.allclose(torch.autograd.grad(gl, logps)[0], grad)


def test_clipped_tokens_get_no_gradient_and_are_counted():
    args = make_args(group_size=2)
    logps, old, adv, mask = clip_probe()
    loss, stats = lite_ppo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r=1.5 with A>0 and r=0.5 with A<0 are clipped (symmetric 0.2)
    torch.testing.assert_close(grad[0, 1], torch.tensor(-1.1 / 4, dtype=torch.float64))
    torch.testing.assert_close(grad[1, 1], torch.tensor(0.9 / 4, dtype=torch.float64))
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25
    # r = 1.25 is clipped at 1 + 0.2 (no clip-higher)
    l2, _ = lite_ppo.compute_policy_loss(
        torch.log(torch.tensor([[1.25]], dtype=torch.float64)).requires_grad_(True),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, 1),
        args,
    )
    assert l2.item() == -1.2


def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient():
    args = make_args()
    rewards, mask, old, logps = rollout(4)
    adv = lite_ppo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(lite_ppo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=PPO_CLIP_STATS)


def test_defaults_are_the_papers():
    a = lite_ppo.Args()
    assert "beta" not in {f.name for f in dataclasses.fields(a)}  # no KL
    assert a.model_name_or_path == "Qwen/Qwen3-4B-Base"
    assert (a.dataset_name, a.prompt_column, a.answer_column) == ("zwhe99/DeepMath-103K", "question", "final_answer")
    assert (a.group_size, a.prompts_per_step, a.max_new_tokens) == (8, 128, 8192)
    assert (a.temperature, a.top_p, a.learning_rate) == (0.99, 0.99, 1e-6)
    assert (a.clip_eps_low, a.clip_eps_high, a.adv_eps) == (0.2, 0.2, 1e-6)
    assert (a.num_mini_batches, a.ppo_epochs) == (1, 1)


def test_batch_std_is_gathered_across_two_processes(tmp_path):
    """Each of 2 ranks computes the advantages of its own half of the groups; together they equal the advantages
    computed by one process on all rewards, which the ranks' local stds would not give."""
    from tests.lite_ppo_dist_worker import rewards_of_the_rollout

    out = tmp_path / "adv.pt"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [*launch_cmd(os.path.join(ROOT, "tests", "lite_ppo_dist_worker.py")), str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=300, capture_output=True)
    res = torch.load(out)
    assert res["world_size"] == 2
    rewards = rewards_of_the_rollout()
    assert torch.equal(res["rewards"], rewards)
    one_process = lite_ppo.compute_advantages(rewards, make_args())
    torch.testing.assert_close(res["advantages"], one_process, rtol=1e-14, atol=1e-14)
    want = torch.tensor(brute_advantages(rewards.tolist(), 4, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(res["advantages"], want, rtol=1e-14, atol=1e-14)
    assert not torch.allclose(res["local"], one_process, atol=1e-3)  # the gather matters for this rollout
