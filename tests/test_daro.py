"""daro.py's pure functions and weight state against float64 brute-force references written with loops."""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch

import daro
from tests.checks import (
    SingleProcess,
    TablePolicy,
    assert_loss_matches_reference,
    assert_standardised_advantages,
    clip_probe,
    stat_sum_bound,
)
from tests.fp_bounds import unit_roundoff
from tests.reference import aggregate, ppo_clip_token

G = 4
# one group per bucket c = #correct, plus a second c = 2 group: buckets 4, 0, 1, 2, 3, 2
REWARDS = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]]
# w_0 and w_G are not 1 on purpose: mu = 0 and mu = 1 must ignore them
WEIGHTS = [5.0, 0.5, 2.0, 3.0, 7.0]


def make_args(**kw):
    return daro.Args(**{"group_size": G, **kw})


def rollout(seed, t=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.tensor(REWARDS, dtype=torch.float64).flatten()
    n = rewards.numel()
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(n, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.2
    return rewards, mask, old, logps


def brute_buckets(rewards, group_size):
    """c = number of correct answers in the completion's group, by loops."""
    out = []
    for g in range(0, len(rewards), group_size):
        c = sum(1 for r in rewards[g : g + group_size] if r > 0)
        out += [c] * group_size
    return out


def brute_daro_loss(logps, old, adv, mask, bucket, weights, args):
    """sum over the buckets 0 < c < G present of (w_c L_c - ln w_c), L_c = bucket c's token sum / all tokens."""
    total_tokens = sum(sum(row) for row in mask.tolist())
    sums, present = {}, set()
    for i in range(logps.shape[0]):
        c = int(bucket[i])
        if c == 0 or c == args.group_size:
            continue
        present.add(c)
        for t in range(logps.shape[1]):
            if mask[i, t]:
                tok = ppo_clip_token(
                    logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high
                )
                sums[c] = sums.get(c, 0.0) + tok
    return sum(weights[c] * sums.get(c, 0.0) / total_tokens - math.log(weights[c]) for c in present)


def brute_mass(adv, mask, bucket, group_size):
    """M_c = sum over bucket c's sequences of |o_i| |A_i| / all tokens."""
    total_tokens = sum(sum(row) for row in mask.tolist())
    mass = [0.0] * (group_size + 1)
    for i in range(len(bucket)):
        if 0 < int(bucket[i]) < group_size:
            mass[int(bucket[i])] += sum(mask[i].tolist()) * abs(adv[i].item()) / total_tokens
    return mass


def brute_onpolicy_loss(adv, mask, bucket, group_size):
    """L_c at r = 1: each token's PPO-clip term is -A_i, so L_c = sum over bucket c's sequences of -|o_i| A_i / L."""
    total_tokens = sum(sum(row) for row in mask.tolist())
    loss = [0.0] * (group_size + 1)
    for i in range(len(bucket)):
        if 0 < int(bucket[i]) < group_size:
            loss[int(bucket[i])] -= sum(mask[i].tolist()) * adv[i].item() / total_tokens
    return loss


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(daro.compute_advantages, rewards, args)
    assert (got[:8] == 0).all()


def test_buckets_from_rewards_and_from_advantages():
    args = make_args()
    rewards, *_ = rollout(0)
    got = daro.pass_rate_bucket(rewards, args)
    assert got.tolist() == brute_buckets(rewards.tolist(), G) == [c for c in (4, 0, 1, 2, 3, 2) for _ in range(G)]
    assert got.dtype == torch.long
    assert daro.pass_rate_bucket(rewards.bool(), args).tolist() == got.tolist()
    # read off the advantages: the same for mixed groups, 0 for the all-correct group (mu = 1 is dropped either way)
    from_adv = daro.bucket_from_advantages(daro.compute_advantages(rewards, args), args)
    assert from_adv.tolist() == [c for c in (0, 0, 1, 2, 3, 2) for _ in range(G)]


@pytest.mark.parametrize("weights", [None, WEIGHTS])
def test_policy_loss_value_and_gradient_match_reference(weights):
    args = make_args()
    rewards, mask, old, logps = rollout(1)
    adv = daro.compute_advantages(rewards, args)
    bucket = daro.pass_rate_bucket(rewards, args)
    w = [1.0] * (G + 1) if weights is None else weights
    kw = {} if weights is None else {"weights": torch.tensor(weights, dtype=torch.float64)}

    def brute(lp):
        return brute_daro_loss(lp, old, adv, mask, bucket, w, args)

    grad, stats = assert_loss_matches_reference(
        daro.compute_policy_loss, brute, logps, old, adv, mask, args, loss_atol=1e-10, bucket=bucket, **kw
    )
    assert (grad[:8] == 0).all()  # mu = 1 and mu = 0 groups: no loss, no gradient
    # per-bucket stats, named by mu: L_mu and M_mu from the loops, w_mu as given
    total = mask.sum().item()
    for c in range(1, G):
        sel = [i for i in range(len(bucket)) if bucket[i] == c]
        want_l = (
            sum(
                ppo_clip_token(logps[i, t].item(), old[i, t].item(), adv[i].item(), 0.2, 0.2)
                for i in sel
                for t in range(6)
                if mask[i, t]
            )
            / total
        )
        assert abs(stats[f"daro_L_{c / G:.4g}"].item() - want_l) < 1e-12
        assert abs(stats[f"daro_M_{c / G:.4g}"].item() - brute_mass(adv, mask, bucket, G)[c]) < 1e-12
        assert stats[f"daro_w_{c / G:.4g}"].item() == pytest.approx(w[c], abs=1e-12)
    assert {k for k in stats if k.startswith("daro_w_")} == {"daro_w_0.25", "daro_w_0.5", "daro_w_0.75"}
    assert abs(stats["policy_loss"].item() - (brute(logps.detach()) + sum(math.log(w[c]) for c in (1, 2, 3)))) < 1e-10


def test_unit_weights_give_token_mean_grpo():
    """With w = 1 the loss is the token-mean PPO-clip loss (W eq. 2): mu = 0, 1 tokens count in L but add 0."""
    args = make_args()
    rewards, mask, old, logps = rollout(2)
    adv = daro.compute_advantages(rewards, args)
    loss, _ = daro.compute_policy_loss(logps, old, adv, mask, args, bucket=daro.pass_rate_bucket(rewards, args))
    per_token = [
        [ppo_clip_token(logps[i, t].item(), old[i, t].item(), adv[i].item(), 0.2, 0.2) for t in range(6)]
        for i in range(24)
    ]
    assert abs(loss.item() - aggregate(per_token, mask.tolist(), "token-mean")) < 1e-12


def test_all_correct_and_all_wrong_groups_get_no_weight_and_no_loss():
    args = make_args()
    rewards, mask, old, logps = rollout(3)
    adv = daro.compute_advantages(rewards, args)
    bucket = daro.pass_rate_bucket(rewards, args)
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    base, _ = daro.compute_policy_loss(logps, old, adv, mask, args, bucket=bucket, weights=w)
    w2 = w.clone()
    w2[0], w2[G] = 1e-3, 1e3
    other, _ = daro.compute_policy_loss(logps, old, adv, mask, args, bucket=bucket, weights=w2)
    assert other.item() == base.item()  # w_0, w_G: no -ln w term, no loss term
    moved = logps.clone()
    moved[:8] += 1.0  # the mu = 1 and mu = 0 groups' log-probs do not matter
    again, _ = daro.compute_policy_loss(moved, old, adv, mask, args, bucket=bucket, weights=w)
    assert again.item() == base.item()
    # a mini-batch with only mu = 0 / mu = 1 groups has loss 0 and leaves every weight where it is
    loss, _ = daro.compute_policy_loss(logps[:8], old[:8], adv[:8], mask[:8], args, bucket=bucket[:8], weights=w)
    assert loss.item() == 0.0
    state = daro.DaroWeights(args)
    mass, seqs, _ = daro.bucket_mass(adv[:8], bucket[:8], mask[:8], args)
    assert (mass == 0).all() and (seqs == 0).all()
    state.step(
        torch.full((G + 1,), 0.01, dtype=torch.float64), torch.ones(G + 1, dtype=torch.bool)
    )  # even if told otherwise
    assert state.weights()[0] == 1 and state.weights()[G] == 1 and (state.weights()[1:G] > 1).all()


def test_clipped_tokens_get_no_gradient_and_are_counted():
    args = make_args(group_size=2)
    logps, old, adv, mask = clip_probe()
    loss, stats = daro.compute_policy_loss(logps, old, adv, mask, args, weights=torch.tensor([1.0, 3.0, 1.0]))
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # r=1.5 with A>0 and r=0.5 with A<0 are clipped
    # inside the trust region: d/dlogp of -w r A / L = -w r A / 4 (token-mean over 4 tokens, w_1/2 = 3)
    assert grad[0, 1].item() == pytest.approx(-3 * 1.1 / 4) and grad[1, 1].item() == pytest.approx(3 * 0.9 / 4)
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25


def test_micro_batches_sum_to_the_mini_batch_loss_gradient_and_stats():
    from common.batching import grad_normalizers

    args = make_args()
    rewards, mask, old, logps = rollout(4)
    adv = daro.compute_advantages(rewards, args)
    bucket = daro.pass_rate_bucket(rewards, args)
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    logps.requires_grad_(True)
    loss, stats = daro.compute_policy_loss(logps, old, adv, mask, args, bucket=bucket, weights=w)
    (whole,) = torch.autograd.grad(loss, logps)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))  # micro-batches cut across groups
    chunks = [perm[:5], perm[5:7], perm[7:16], perm[16:]]
    num_tokens, num_seqs = grad_normalizers([mask[c] for c in chunks])
    mass, seqs, onpolicy = daro.bucket_mass(adv, bucket, mask, args, num_tokens)
    parts = [
        daro.compute_policy_loss(
            logps[c],
            old[c],
            adv[c],
            mask[c],
            args,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            bucket=bucket[c],
            weights=w,
            bucket_seqs=seqs,
        )
        for c in chunks
    ]
    total = sum(p[0] for p in parts)
    (split,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(total, loss, rtol=0, atol=1e-12)
    for k, v in stats.items():  # fp32 token means of one sign (tests/checks.py); fp64 bucket stats as the loss
        tol = stat_sum_bound(v, int(mask.sum()), len(chunks)) if v.dtype == torch.float32 else 1e-12
        assert abs(sum(p[1][k] for p in parts).item() - v.item()) <= tol, k
    # the w-update's inputs add up over micro-batches too, and match the loops
    summed = sum(daro.bucket_mass(adv[c], bucket[c], mask[c], args, num_tokens) for c in chunks)
    torch.testing.assert_close(summed, torch.stack([mass, seqs, onpolicy]), rtol=0, atol=1e-12)
    want_onpolicy = torch.tensor(brute_onpolicy_loss(adv, mask, bucket, G), dtype=torch.float64)
    torch.testing.assert_close(onpolicy, want_onpolicy, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        mass, torch.tensor(brute_mass(adv, mask, bucket, G), dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert seqs.tolist() == [0, 4, 8, 4, 0]


@pytest.mark.parametrize("optimizer,lr,steps", [("sgd", 0.1, 400), ("adam", 0.05, 3000)])
def test_weights_converge_to_inverse_loss_for_fixed_positive_losses(optimizer, lr, steps):
    """The w-optimizer alone on fixed L_mu > 0: w_mu -> 1/L_mu, so every bucket contributes w_mu L_mu = 1."""
    args = make_args(group_size=6, daro_w_optimizer=optimizer, daro_w_lr=lr)
    state = daro.DaroWeights(args)
    losses = torch.tensor([9.0, 0.02, 0.25, 1.0, 3.0, 0.5, 9.0], dtype=torch.float64)
    present = torch.tensor([True, True, True, True, True, False, True])
    for _ in range(steps):
        state.step(losses, present)
    w = state.weights()
    # A convergence bound, then fp64 rounding: once e^s L ~ 1, SGD contracts s - s* by |1 - lr e^s L| = 0.9 per
    # step (|w L - 1| measured 1.6e-3, 4e-8, 2e-15 after 100, 200, 400 steps); Adam is at 9e-16 by step 750.
    # At the fixed point only the rounding of e^s is left, |s*| u64 < 1e-15; 1e-12 leaves a 1000x margin.
    torch.testing.assert_close(w[1:5], 1 / losses[1:5], rtol=1e-12, atol=0)
    assert w[5] == 1 and w[0] == 1 and w[6] == 1  # absent bucket and mu = 0, 1 never move
    # brute-force check of one SGD step on sum (e^s L - s): s <- s - lr (e^s L - 1)
    if optimizer == "sgd":
        fresh = daro.DaroWeights(args)
        fresh.step(losses, present)
        want = [0.0] + [-lr * (math.exp(0.0) * losses[c].item() - 1) for c in range(1, 5)] + [0.0, 0.0]
        torch.testing.assert_close(fresh.log_w.detach(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_bucket_absent_from_a_mini_batch_keeps_its_weight(optimizer):
    """No L_mu term for a bucket that is not there: its weight stays put, even with momentum from earlier steps."""
    state = daro.DaroWeights(make_args(daro_w_optimizer=optimizer))
    losses = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.0], dtype=torch.float64)
    for _ in range(3):
        state.step(losses, torch.ones(G + 1, dtype=torch.bool))
    before = state.weights()
    state.step(losses, torch.tensor([True, False, True, False, True]))
    after = state.weights()
    assert after[1] == before[1] and after[3] == before[3] and after[2] != before[2]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("loss_value", [0.0, -0.3, 1e-12, -1e6, 1e6, 1e12])
def test_weights_stay_bounded_and_finite_for_any_loss(optimizer, loss_value):
    """An on-policy surrogate can be ~0 or negative: -ln w is then unbounded, the clamp keeps w in [w_min, w_max]."""
    args = make_args(daro_w_optimizer=optimizer, daro_w_lr=1.0, daro_w_min=0.01, daro_w_max=50.0)
    state = daro.DaroWeights(args)
    losses = torch.full((G + 1,), loss_value, dtype=torch.float64)
    for _ in range(300):
        state.step(losses, torch.ones(G + 1, dtype=torch.bool))
        w = state.weights()
        assert torch.isfinite(w).all() and (w >= 0.01 * (1 - 1e-12)).all() and (w <= 50.0 * (1 + 1e-12)).all()
    if loss_value <= 1e-12:
        torch.testing.assert_close(w[1:G], torch.full((G - 1,), 50.0, dtype=torch.float64))  # pinned at w_max, finite
    if loss_value >= 1e6:
        torch.testing.assert_close(w[1:G], torch.full((G - 1,), 0.01, dtype=torch.float64))


def test_weights_state_is_saved_and_restored(tmp_path):
    for optimizer in ("sgd", "adam"):
        args = make_args(daro_w_optimizer=optimizer)
        a = daro.DaroWeights(args)
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            a.step(torch.rand(G + 1, dtype=torch.float64, generator=gen), torch.ones(G + 1, dtype=torch.bool))
        torch.save(a.state_dict(), tmp_path / "w.pkl")  # what accelerate's save_state does with registered objects
        b = daro.DaroWeights(args)
        b.load_state_dict(torch.load(tmp_path / "w.pkl", weights_only=False))
        assert torch.equal(a.weights(), b.weights()) and not torch.equal(a.weights(), daro.DaroWeights(args).weights())
        nxt = torch.rand(G + 1, dtype=torch.float64, generator=gen)
        for s in (a, b):  # the optimizer's state came back too (Adam's moments): the next steps agree
            s.step(nxt, torch.ones(G + 1, dtype=torch.bool))
            s.step(nxt, torch.ones(G + 1, dtype=torch.bool))
        assert torch.equal(a.weights(), b.weights())


@pytest.mark.parametrize("given", [True, False])
def test_update_policy_steps_the_weights_then_uses_them(given):
    args = make_args(micro_batch_size=5, max_grad_norm=1e9)
    rewards, mask, *_ = rollout(6)
    adv = daro.compute_advantages(rewards, args)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (24, 2 + 6), generator=gen)
    attn = torch.cat([torch.ones(24, 2, dtype=torch.long), mask], 1)
    batch = {
        "ids": ids,
        "attn": attn,
        "mask": mask,
        "p_len": 2,
        "advantages": adv,
        "lens": [(2, int(k)) for k in mask.sum(1)],
    }
    state = daro.DaroWeights(args)
    if given:
        state.step(torch.tensor([0.0, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64), torch.ones(G + 1, dtype=torch.bool))
        batch.update(bucket=daro.pass_rate_bucket(rewards, args))
    want_state = daro.DaroWeights(args)
    want_state.load_state_dict(state.state_dict())
    policy = TablePolicy(50)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = policy.theta.detach().clone()
    w = state if given else None  # main's weights, or update_policy's own (w = 1)
    sums = daro.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0, daro=w)
    skipped = sums["skipped_updates"]
    assert skipped == 0
    # expected: one w step on the whole mini-batch's M_mu (from the loops), then the loss gradient with those w
    bucket = daro.pass_rate_bucket(rewards, args)
    present = torch.tensor([bool((bucket == c).any()) for c in range(G + 1)])
    want_state.step(torch.tensor(brute_mass(adv, mask, bucket, G), dtype=torch.float64), present)
    if given:
        assert torch.equal(state.weights(), want_state.weights())
    w = want_state.weights()
    assert len(set(w[1:G].tolist())) == G - 1  # the weights really differ per bucket
    theta = before.clone().requires_grad_(True)
    logps = theta[ids[:, 2:]]
    loss, _ = daro.compute_policy_loss(logps, logps.detach(), adv, mask, args, bucket=bucket, weights=w)
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(before - policy.theta.detach(), grad, rtol=1e-10, atol=1e-13)
    for c in range(1, G):
        assert sums[f"daro_w_{c / G:.4g}"].item() == pytest.approx(w[c].item(), rel=1e-9)
    assert sums["loss"].item() == pytest.approx(loss.item(), rel=1e-9)


@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"])
def test_loss_target_is_the_policy_steps_bucket_loss_with_the_rollout_correction(mode):
    """--daro-w-target loss fits w to L_mu exactly as the policy step has it: at the rollout policy (r = 1) each
    token's term is -rc_it A_i, rc the rollout-correction weight. bucket_mass's row 2 equals the policy step's
    train/daro_L_mu with weights far from 1, and update_policy steps w on that corrected L_mu."""
    args = make_args(daro_w_target="loss", rollout_correction=mode, rollout_correction_cap=1.5, daro_loss_floor=0.01)
    args.micro_batch_size = 5
    rewards, mask, old, _ = rollout(7)
    rollout_logps = old + 0.3 * torch.randn(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    adv, bucket = daro.compute_advantages(rewards, args), daro.pass_rate_bucket(rewards, args)
    _, stats = daro.compute_policy_loss(old, old, adv, mask, args, rollout_logps=rollout_logps, bucket=bucket)
    policy_step = torch.tensor(
        [0.0] + [stats[f"daro_L_{c / G:.4g}"].item() for c in range(1, G)] + [0.0], dtype=torch.float64
    )
    _, _, onpolicy = daro.bucket_mass(adv, bucket, mask, args, None, old, rollout_logps)
    torch.testing.assert_close(onpolicy, policy_step, rtol=0, atol=1e-12)
    uncorrected = torch.tensor(brute_onpolicy_loss(adv, mask, bucket, G), dtype=torch.float64)
    mass = torch.tensor(brute_mass(adv, mask, bucket, G), dtype=torch.float64)
    target = daro.w_target(mass, policy_step, args)
    assert (target - daro.w_target(mass, uncorrected, args)).abs().max() > 1e-3  # the weight matters here
    # update_policy: the w step's L_mu is the corrected one (pi_old given, as main computes it for this target)
    ids = torch.randint(0, 50, (24, 2 + 6), generator=torch.Generator().manual_seed(1))
    batch = {"ids": ids, "attn": torch.cat([torch.ones(24, 2, dtype=torch.long), mask], 1), "mask": mask, "p_len": 2}
    state, want = daro.DaroWeights(args), daro.DaroWeights(args)
    batch.update(advantages=adv, lens=[(2, int(k)) for k in mask.sum(1)], old_logps=old, sampler_logps=rollout_logps)
    batch.update(bucket=bucket)
    policy = TablePolicy(50)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    daro.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0, daro=state)
    want.step(target, mass > 0)
    torch.testing.assert_close(state.weights(), want.weights(), rtol=1e-12, atol=0)


def test_defaults_are_the_papers():
    a = daro.Args()
    assert not hasattr(a, "beta")  # no KL (W eq. 2)
    assert (a.clip_eps_low, a.clip_eps_high) == (0.2, 0.2)  # symmetric clip, W eq. 2's f
    assert (a.prompts_per_step, a.total_steps) == (128, 500)  # the write-up's worked example
    assert (a.group_size, a.learning_rate, a.model_name_or_path) == (8, 1e-6, "Qwen/Qwen2.5-Math-1.5B")  # choices
    assert a.num_mini_batches == 1 and a.ppo_epochs == 1
    assert (a.daro_w_optimizer, a.daro_w_lr, a.daro_w_min, a.daro_w_max) == ("sgd", 0.1, 1e-3, 1e3)
    assert torch.equal(daro.DaroWeights(a).weights(), torch.ones(9, dtype=torch.float64))  # w starts at 1


@pytest.mark.slow
def test_weights_are_checkpointed_and_resumed(toy_assets, tmp_path):
    import json

    from tests.test_scripts import read_metrics, run_script, toy_flags

    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_script("daro", toy_flags(toy_assets, full, 4, **{"exp-name": "a"}))
    run_script("daro", toy_flags(toy_assets, part, 2, **{"exp-name": "a"}))
    (run_dir,) = glob.glob(os.path.join(part, "a__*"))
    saved = torch.load(
        os.path.join(run_dir, "checkpoints", "step_2", "state", "custom_checkpoint_0.pkl"), weights_only=False
    )
    last = [r for r in read_metrics(run_dir) if "train/daro_w_0.5" in r][-1]  # the w used in the last update
    # fp64 exp(log_w) times token shares that add up to 1 within gamma_8(fp64), logged after one rounding to fp32:
    # relative error <= u32 + gamma_8(fp64) < 2 u32 (it differs from the saved w by 3.6e-8 = 0.6 u32 here)
    for c in range(1, 8):
        want = math.exp(saved["log_w"][c].item())
        assert want == pytest.approx(last[f"train/daro_w_{c / 8:.4g}"], rel=2 * unit_roundoff(torch.float32), abs=0)
    assert not torch.equal(saved["log_w"], torch.zeros(9, dtype=torch.float64))
    run_script("daro", toy_flags(toy_assets, part, 4, **{"exp-name": "a", "resume": run_dir}))
    resumed = read_metrics(run_dir)
    (full_dir,) = glob.glob(os.path.join(full, "a__*"))
    uninterrupted = read_metrics(full_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    keys = [k for k in uninterrupted[3] if k.startswith("train/daro_") or k in ("train/loss", "train/reward_mean")]
    assert "train/daro_w_0.5" in keys
    for a, b in zip(resumed, uninterrupted):  # same machine: equal up to a fresh process's summation order (the
        assert set(a) == set(b)  # fp32 loss of O(1): ~1e-7); a state not restored moves them by far more
        for key in keys:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (b["step"], key)
    with open(os.path.join(run_dir, "args.json")) as f:
        assert json.load(f)["daro_w_lr"] == 0.1


def test_loss_target_converges_to_inverse_loss_and_stays_bounded():
    """--daro-w-target loss: w_mu -> 1/L_mu for fixed L_mu above the floor (the write-up's w_mu L_mu = 1); where
    L_mu <= floor x M_mu (here 0, negative, tiny) the target is floor x M_mu, so w_mu -> 1/(floor M_mu): finite and
    bounded, far below --daro-w-max. Tolerance: SGD on sum (e^s T - s) converges geometrically; 400 steps at lr 0.1
    leave a relative error below 1e-6 for these targets."""
    args = make_args(group_size=6, daro_w_target="loss", daro_loss_floor=0.1)
    mass = torch.tensor([0.0, 0.8, 0.5, 1.0, 0.6, 0.4, 0.0], dtype=torch.float64)
    loss = torch.tensor([0.0, 0.3, 0.25, 0.0, -0.2, 1e-9, 0.0], dtype=torch.float64)
    target = daro.w_target(mass, loss, args)
    torch.testing.assert_close(target, torch.tensor([0.0, 0.3, 0.25, 0.1, 0.06, 0.04, 0.0], dtype=torch.float64))
    state = daro.DaroWeights(args)
    for _ in range(400):
        state.step(target, mass > 0)
    w = state.weights()
    torch.testing.assert_close(w[1:3], 1 / loss[1:3], rtol=1e-6, atol=0)
    torch.testing.assert_close(w[3:6], 1 / (0.1 * mass[3:6]), rtol=1e-6, atol=0)
    assert w[0] == 1 and w[6] == 1 and (w <= 1 / (0.1 * mass[1:6].min())).all()
    assert torch.equal(daro.w_target(mass, loss, make_args(group_size=6)), mass)  # the default target is the mass


def test_normalised_weights_have_mean_one_over_present_buckets():
    """--daro-w-normalize: the policy step's w_mu are the learnt ones divided by their mean over the buckets present
    (groups with c = 1, 2, 2 here: bucket 3 is absent and mu = 0, 1 never count), so the loss and its gradient are
    those of the given weights divided by that mean; the step-scale stats use the same weights."""
    rewards, mask, old, logps = rollout(5)
    rows = torch.cat([torch.arange(8, 16), torch.arange(20, 24)])  # groups 2, 3, 5 of REWARDS
    rewards, mask, old, logps = rewards[rows], mask[rows], old[rows], logps[rows]
    args, norm = make_args(), make_args(daro_w_normalize=True)
    adv = daro.compute_advantages(rewards, args)
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    scaled = w / ((w[1] + w[2]) / 2)
    x = logps.detach().clone().requires_grad_(True)
    loss, stats = daro.compute_policy_loss(x, old, adv, mask, norm, weights=w)
    (g,) = torch.autograd.grad(loss, x)
    y = logps.detach().clone().requires_grad_(True)
    want_loss, _ = daro.compute_policy_loss(y, old, adv, mask, args, weights=scaled)
    (want,) = torch.autograd.grad(want_loss, y)
    torch.testing.assert_close((g, loss), (want, want_loss), rtol=0, atol=1e-12)
    mass = brute_mass(adv, mask, daro.pass_rate_bucket(rewards, args), G)
    assert stats["daro_mass"].item() == pytest.approx(sum(mass), rel=1e-12)
    weighted = sum(scaled[c].item() * mass[c] for c in range(G + 1))
    assert stats["daro_weighted_mass"].item() == pytest.approx(weighted, rel=1e-12)
    # a mini-batch with no bucket present (only mu = 0 / mu = 1 groups) still has loss 0, not 0/0
    all_or_none, mask0, old0, logps0 = rollout(5)
    adv0 = daro.compute_advantages(all_or_none[:8], args)
    loss0, _ = daro.compute_policy_loss(logps0[:8], old0[:8], adv0, mask0[:8], norm, weights=w)
    assert loss0.item() == 0.0


@pytest.mark.slow
def test_loss_target_with_a_rollout_correction_runs_end_to_end(toy_assets, tmp_path):
    """main computes pi_old's log-probs for the loss target's corrected L_mu even with one update per rollout: the
    toy run trains, and HF generate's own fp32 log-probs give weights of 1 (test_rollout_correction.py)."""
    from tests.test_scripts import read_metrics, run_script, toy_flags

    extra = {"daro-w-target": "loss", "rollout-correction": "token-truncate", "exp-name": "rc"}
    run_script("daro", toy_flags(toy_assets, str(tmp_path), 2, **extra))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "rc__*"))
    updated = [r for r in read_metrics(run_dir) if r["train/no_signal"] == 0]
    assert updated and all(abs(r["train/rollout_corr_weight_mean"] - 1) < 1e-4 for r in updated)
    assert all("train/daro_w_0.5" in r for r in updated)
