"""dr_grpo.py's pure functions against float64 brute-force references written with loops."""

from __future__ import annotations

import dataclasses
import math

import torch

import dr_grpo
import grpo
from tests.checks import (
    PPO_CLIP_STATS,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    clip_probe,
    on_policy_pair,
)
from tests.fp_bounds import assert_within, group_advantage_bound
from tests.reference import ppo_clip_token

L_MAX = 8  # the generation budget in these tests (longer than any completion below)


def make_args(**kw):
    return dr_grpo.Args(**{"group_size": 4, "max_new_tokens": L_MAX, **kw})


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * g,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    rewards[g] = 0.5  # a non-binary reward, so the mean is not a multiple of 1/G only
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    return rewards, mask, old, logps


def brute_advantages(rewards: list[float], g: int) -> list[float]:
    """R_i - mean of its group, by loops."""
    out = []
    for k in range(0, len(rewards), g):
        grp = rewards[k : k + g]
        mean = math.fsum(grp) / len(grp)
        out += [r - mean for r in grp]
    return out


def brute_loss(logps, old, adv, mask, args) -> float:
    """-1/(N L_max) sum_i sum_{t in o_i} min(r A, clip(r) A), by loops (Listing 1 of the paper)."""
    total = 0.0
    n = logps.shape[0]
    for i in range(n):
        for t in range(logps.shape[1]):
            if mask[i, t]:
                total += ppo_clip_token(
                    logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high
                )
    return total / (n * args.max_new_tokens)


def test_advantages_are_centred_rewards_without_std():
    args = make_args()
    rewards, *_ = rollout(0)
    got = dr_grpo.compute_advantages(rewards, args)
    want = torch.tensor(brute_advantages(rewards.tolist(), 4), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert (got[:4] == 0).all()  # zero-variance group: exactly 0, no division by a zero std
    # one correct out of four: +3/4 and -1/4 (GRPO would divide by the unbiased std 0.5: +1.5, -0.5)
    adv = dr_grpo.compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), args)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]), rtol=0, atol=0)
    one_of_four, eps = torch.tensor([1.0, 0.0, 0.0, 0.0]), grpo.Args().adv_eps
    want = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) / (0.5 + eps)  # fp32 rounding bound
    got = grpo.compute_advantages(one_of_four, grpo.Args(group_size=4))
    assert_within(got, want, group_advantage_bound(one_of_four, 4, eps, got.dtype))


def test_advantages_have_no_difficulty_reweighting():
    """Without the std, the advantage scales with the reward gap: an easy group (7/8 correct) and a hard one
    (1/8 correct) get the same |A| for their odd sample as with std, but scaling all rewards scales A."""
    args = make_args(group_size=8)
    easy = [1.0] * 7 + [0.0]
    hard = [1.0] + [0.0] * 7
    adv = dr_grpo.compute_advantages(torch.tensor(easy + hard, dtype=torch.float64), args)
    torch.testing.assert_close(adv[7], torch.tensor(-7 / 8, dtype=torch.float64))
    torch.testing.assert_close(adv[8], torch.tensor(7 / 8, dtype=torch.float64))
    rewards, *_ = rollout(3)
    torch.testing.assert_close(
        dr_grpo.compute_advantages(3 * rewards + 5, make_args()), 3 * dr_grpo.compute_advantages(rewards, make_args())
    )


def test_policy_loss_value_and_gradient_match_reference():
    args = make_args()
    rewards, mask, old, logps = rollout(1)
    adv = dr_grpo.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args)
    _, stats = assert_loss_matches_reference(dr_grpo.compute_policy_loss, reference, logps, old, adv, mask, args)
    assert "kl_ref" not in stats


def test_on_policy_gradient_is_advantage_over_budget_for_every_token():
    """At r = 1 the gradient w.r.t. logp_it is -A_i / (N L_max): the same for a 1-token and a 4-token answer
    (GRPO would give -A_i / (N |o_i|)), and the denominator is the budget, not the batch's token count."""
    args = make_args(group_size=2, max_new_tokens=10)
    logps, mask, adv = on_policy_pair()
    loss, _ = dr_grpo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    want = torch.tensor([[-1 / 20, 0, 0, 0], [1 / 20] * 4], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-15)
    # on-policy the value is -sum_i A_i |o_i| / (N L_max)
    torch.testing.assert_close(loss, torch.tensor(-(1 * 1 - 1 * 4) / 20, dtype=torch.float64))


def test_the_normaliser_is_a_constant_not_the_token_count():
    """Lengthening or shortening one sequence leaves every other token's gradient unchanged; padding columns
    change nothing; the loss scales exactly with 1 / max_new_tokens."""
    args = make_args()
    rewards, mask, old, logps = rollout(2)
    adv = dr_grpo.compute_advantages(rewards, args)
    logps.requires_grad_(True)

    def grad_of(m, a=args):
        loss, _ = dr_grpo.compute_policy_loss(logps, old, adv, m, a)
        return loss, torch.autograd.grad(loss, logps)[0]

    loss, grad = grad_of(mask)
    for i in (5, 9):
        for new_len in (1, 6):
            m2 = mask.clone()
            m2[i] = (torch.arange(mask.shape[1]) < new_len).long()
            _, g2 = grad_of(m2)
            others = torch.ones(mask.shape[0], dtype=torch.bool)
            others[i] = False
            torch.testing.assert_close(g2[others], grad[others], rtol=0, atol=0)
            keep = (mask[i] * m2[i]).bool()  # the tokens of sequence i present in both
            torch.testing.assert_close(g2[i][keep], grad[i][keep], rtol=0, atol=0)
    # padding columns (mask 0) change nothing
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], 3), v, dtype=x.dtype)], 1)
    loss_p, _ = dr_grpo.compute_policy_loss(pad(logps.detach(), -1.0), pad(old, -2.0), adv, pad(mask, 0), args)
    torch.testing.assert_close(loss_p, loss.detach(), rtol=0, atol=1e-15)
    # the budget is the denominator
    loss_2, _ = dr_grpo.compute_policy_loss(logps.detach(), old, adv, mask, make_args(max_new_tokens=2 * L_MAX))
    torch.testing.assert_close(loss_2, loss.detach() / 2, rtol=1e-15, atol=0)


def test_clipped_tokens_get_no_gradient_and_are_counted():
    args = make_args(group_size=2)
    logps, old, adv, mask = clip_probe()
    loss, stats = dr_grpo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r=1.5 with A>0 and r=0.5 with A<0 are clipped
    # inside the trust region: d/dlogp of -r A / (N L) = -r A / (N L)
    torch.testing.assert_close(grad[0, 1], torch.tensor(-1.1 / (2 * L_MAX), dtype=torch.float64))
    torch.testing.assert_close(grad[1, 1], torch.tensor(0.9 / (2 * L_MAX), dtype=torch.float64))
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25
    # r=1.5 with A<0 and r=0.5 with A>0 are not clipped (the min keeps the unclipped, more pessimistic term)
    loss, _ = dr_grpo.compute_policy_loss(logps, old, -adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] > 0 and grad[1, 0] < 0


def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient():
    args = make_args()
    rewards, mask, old, logps = rollout(4)
    adv = dr_grpo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(dr_grpo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=PPO_CLIP_STATS)


def test_reference_log_probs_are_ignored():
    args = make_args()
    rewards, mask, old, logps = rollout(5)
    adv = dr_grpo.compute_advantages(rewards, args)
    a, _ = dr_grpo.compute_policy_loss(logps, old, adv, mask, args)
    b, stats = dr_grpo.compute_policy_loss(logps, old, adv, mask, args, ref_logps=old - 1.0)
    assert a.item() == b.item() and "kl_ref" not in stats


def test_defaults_are_the_papers():
    a = dr_grpo.Args()
    names = {f.name for f in dataclasses.fields(a)}
    assert "beta" not in names and "adv_eps" not in names  # no KL, no std
    assert a.model_name_or_path == "Qwen/Qwen2.5-Math-1.5B" and a.prompt_template == "qwen-boxed"
    assert (a.group_size, a.prompts_per_step, a.max_new_tokens, a.max_prompt_tokens) == (8, 128, 3000, 1024)
    assert (a.temperature, a.top_p, a.learning_rate, a.warmup_steps) == (1.0, 1.0, 1e-6, 0)
    assert (a.clip_eps_low, a.clip_eps_high, a.max_grad_norm, a.weight_decay) == (0.2, 0.2, 1.0, 0.0)
    assert (a.num_mini_batches, a.ppo_epochs) == (8, 1)
    assert (a.eval_temperature, a.eval_max_new_tokens, a.eval_samples) == (0.0, 3000, 1)
    assert (a.dataset_name, a.prompt_column, a.answer_column) == ("hiyouga/math12k", "problem", "answer")


def test_truncated_completions_get_reward_zero():
    """understand-r1-zero train_zero_math.py: a truncated output's reward is set to 0, a correct one included."""
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    truncated = torch.tensor([False, True, False, True])
    lengths = torch.tensor([5, 8, 3, 8])
    rewards = dr_grpo.compute_rewards(correct, lengths, truncated, dr_grpo.Args(max_new_tokens=8))
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    keep = dr_grpo.Args(max_new_tokens=8, truncated_reward="keep")
    assert dr_grpo.compute_rewards(correct, lengths, truncated, keep).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert grpo.compute_rewards(correct, lengths, truncated, grpo.Args()).tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]  # GRPO keeps it


def test_evaluation_does_not_apply_the_truncation_rule():
    """As oat's evaluation (understand-r1-zero zeroes truncated outputs in the actor's training step only), a cut-off
    completion that holds the right answer counts as correct in evaluation; training gives it reward 0 (README)."""
    from common.metrics import evaluate
    from common.sampling import Completion

    class Sampler:
        def generate(self, prompts, k, temperature, top_p, max_new_tokens):
            return [Completion([1, 2], r"so \boxed{4}, and then", truncated=True) for _ in prompts for _ in range(k)]

    args = dr_grpo.Args(eval_samples=2, eval_temperature=0.0, eval_max_new_tokens=8, reward_format="boxed")
    assert args.truncated_reward == "zero"
    metrics = evaluate(Sampler(), {"toy.jsonl": ([[5]], ["4"])}, args)
    assert metrics["eval/toy/avg@2"] == metrics["eval/toy/pass@2"] == metrics["eval/toy/maj@2"] == 1.0
    assert dr_grpo.compute_rewards(torch.tensor([1.0]), torch.tensor([2]), torch.tensor([True]), args).item() == 0.0
