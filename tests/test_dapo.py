"""dapo.py's pure functions against float64 brute-force references written with loops (here and in
tests/reference.py), plus end-to-end checks of dynamic sampling and of its resume state."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

import dapo
import grpo
from tests.checks import PPO_CLIP_STATS, assert_loss_matches_reference, assert_micro_batches_add_up, on_policy_pair
from tests.fp_bounds import assert_within, gamma, group_advantage_bound
from tests.reference import aggregate, group_advantages, ppo_clip_token


def make_args(**kw):
    return dapo.Args(**{"group_size": 4, **kw})


# brute-force references -------------------------------------------------------------------------------------


def soft_overlong(length: int, l_max: int, l_cache: int) -> float:
    """Eq. 13, case by case as printed in the paper."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def brute_groups_kept(correct: list[float], g: int) -> list[bool]:
    """Eq. 8's constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G, group by group."""
    kept = []
    for start in range(0, len(correct), g):
        n = 0
        for c in correct[start : start + g]:
            if c > 0:
                n += 1
        kept.append(0 < n < g)
    return kept


def brute_loss(logps, old, adv, mask, args):
    """Eq. 8: -(1 / sum_i |o_i|) sum_i sum_t min(r A, clip(r, 1-eps_low, 1+eps_high) A)."""
    per_token = [
        [
            ppo_clip_token(logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high)
            for t in range(logps.shape[1])
        ]
        for i in range(logps.shape[0])
    ]
    return aggregate(per_token, mask.tolist(), "token-mean")


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    correct = torch.randint(0, 2, (groups * g,), generator=gen).double()
    correct[:g] = 1.0  # one all-correct group: advantage exactly 0
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    lengths[g] = 1
    lengths[g + 1] = t  # unequal lengths inside a group
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)  # ratios well outside 1 +- 0.28
    return correct, lengths, mask, old, logps


# rewards ----------------------------------------------------------------------------------------------------


def test_reward_is_plus_minus_one_without_the_penalty():
    args = make_args(overlong_penalty=False, max_new_tokens=10)
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    r = dapo.compute_rewards(correct, torch.tensor([10, 10, 1, 3]), torch.tensor([True, True, False, False]), args)
    assert r.tolist() == [1.0, -1.0, 1.0, -1.0]  # eq. 7; a truncated correct answer keeps +1 without the penalty


@pytest.mark.parametrize("l_max,l_cache", [(20, 8), (20480, 4096), (5, 5)])
def test_soft_overlong_punishment_matches_eq_13_at_every_length(l_max, l_cache):
    args = make_args(max_new_tokens=l_max, overlong_buffer_len=l_cache)
    lengths = sorted(
        {0, 1, l_max - l_cache, l_max - l_cache + 1, l_max - 1, l_max, l_max + 1, l_max + 7}
        | set(range(min(l_max, 60)))
    )
    for correct in (0.0, 1.0):
        got = dapo.compute_rewards(
            torch.full((len(lengths),), correct),
            torch.tensor(lengths),
            torch.zeros(len(lengths), dtype=torch.bool),
            args,
        )
        want = [(1.0 if correct else -1.0) + soft_overlong(n, l_max, l_cache) for n in lengths]
        for n, a, b in zip(lengths, got.tolist(), want):
            # fp32: (L_max - L_cache - n) is exact, then / L_cache, x factor, +-1: 3 roundings of values <= 2
            assert a == pytest.approx(b, abs=2 * gamma(3, torch.float32)), (n, a, b)


def test_soft_overlong_punishment_boundaries_and_factor():
    args = make_args(max_new_tokens=20, overlong_buffer_len=8)  # expected length 12
    lengths = torch.tensor([12, 13, 16, 20, 21])
    got = dapo.compute_rewards(torch.ones(5), lengths, lengths >= 20, args)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0 - 1 / 8, 0.5, 0.0, 0.0]))
    half = dapo.compute_rewards(
        torch.zeros(5),
        lengths,
        lengths >= 20,
        make_args(max_new_tokens=20, overlong_buffer_len=8, overlong_penalty_factor=0.5),
    )
    torch.testing.assert_close(half, torch.tensor([-1.0, -1.0 - 1 / 16, -1.25, -1.5, -1.5]))
    off = dapo.compute_rewards(
        torch.zeros(5),
        lengths,
        lengths >= 20,
        make_args(max_new_tokens=20, overlong_buffer_len=8, overlong_penalty=False),
    )
    assert off.tolist() == [-1.0] * 5


def test_paper_lengths_boundaries():
    """L_max = 20480, L_cache = 4096: no penalty up to 16384 tokens, -1 at 20480."""
    args = make_args()
    lengths = torch.tensor([16384, 16385, 18432, 20480])
    got = dapo.compute_rewards(torch.ones(4), lengths, lengths == 20480, args)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0 - 1 / 4096, 0.5, 0.0]))


# dynamic sampling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", [2, 3, 4, 16])
def test_filter_groups_matches_brute_force(g):
    gen = torch.Generator().manual_seed(g)
    for trial in range(20):
        groups = 1 + trial % 7
        p = torch.rand((groups, 1), generator=gen)  # per-group accuracy, so all-0 / all-1 groups occur
        correct = (torch.rand((groups, g), generator=gen) < p).double().view(-1)
        correct[:g] = float(trial % 2)  # force one degenerate group
        got = dapo.filter_groups(correct, g)
        assert got.dtype == torch.bool and got.shape == (groups,)
        assert got.tolist() == brute_groups_kept(correct.tolist(), g)


def test_filter_groups_cases_and_bool_input():
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    assert dapo.filter_groups(correct, 4).tolist() == [False, False, True, True]
    # the filter counts correct answers, not rewards: an all-correct group stays out even when the overlong
    # punishment makes its rewards differ (eq. 8's constraint, verl's metric=acc)
    assert dapo.filter_groups(torch.tensor([1.0, 1.0]), 2).tolist() == [False]


def test_kept_groups_have_nonzero_advantage_and_dropped_ones_zero():
    args = make_args(overlong_penalty=False)
    correct, *_ = rollout(3, groups=6)
    correct[4:8] = 0.0
    rewards = dapo.compute_rewards(correct, torch.ones(24, dtype=torch.long), torch.zeros(24, dtype=torch.bool), args)
    adv = dapo.compute_advantages(rewards, args).view(-1, 4)
    keep = dapo.filter_groups(correct, 4)
    assert (adv[~keep] == 0).all()
    assert (adv[keep].abs().sum(1) > 0).all()


# advantages and loss ----------------------------------------------------------------------------------------


def test_advantages_match_reference():
    args = make_args()
    correct, lengths, *_ = rollout(0)
    rewards = dapo.compute_rewards(
        correct,
        lengths,
        torch.zeros_like(lengths, dtype=torch.bool),
        make_args(max_new_tokens=6, overlong_buffer_len=4),
    )
    got = dapo.compute_advantages(rewards, args)
    want = group_advantages(rewards.tolist(), 4, eps=args.adv_eps)
    assert rewards.dtype == torch.float32  # as GRPO's correct.float()
    bound = group_advantage_bound(rewards, 4, args.adv_eps, got.dtype)
    assert_within(got, torch.tensor(want, dtype=torch.float64), bound)
    assert (
        got[:4] != 0
    ).any()  # an all-correct group of unequal lengths: the punishment alone sets A (not filtered here)
    # +-1 rewards of {1, 0}-correct pairs: A = +-0.7071 exactly as GRPO's on 0/1 rewards (affine invariance)
    two = dapo.compute_advantages(
        dapo.compute_rewards(
            torch.tensor([1.0, 0.0]),
            torch.ones(2),
            torch.zeros(2, dtype=torch.bool),
            make_args(group_size=2, overlong_penalty=False),
        ),
        make_args(group_size=2),
    )
    want = torch.tensor([1.0, -1.0], dtype=torch.float64) / (math.sqrt(2) + args.adv_eps)  # std of {1, -1}: sqrt 2
    assert_within(two, want, group_advantage_bound(torch.tensor([1.0, -1.0]), 2, args.adv_eps, two.dtype))


def test_policy_loss_value_and_gradient_match_reference():
    args = make_args()
    correct, _, mask, old, logps = rollout(1)
    adv = dapo.compute_advantages(correct * 2 - 1, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args)
    grad, stats = assert_loss_matches_reference(dapo.compute_policy_loss, reference, logps, old, adv, mask, args)
    assert (grad[:4] == 0).all()  # the all-correct group has A = 0
    assert "kl_ref" not in stats


def test_on_policy_gradient_is_token_mean_not_sequence_mean():
    """At r = 1 the gradient w.r.t. logp_it is -A_i / sum_j |o_j|: every token weighs the same (§3.3), where
    GRPO's per-sequence mean gives -A_i / (G |o_i|)."""
    args = make_args(group_size=2)
    logps, mask, adv = on_policy_pair()
    loss, _ = dapo.compute_policy_loss(logps, logps.detach(), adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad[0, 0], torch.tensor(-0.2, dtype=torch.float64))
    torch.testing.assert_close(grad[1], torch.full((4,), 0.2, dtype=torch.float64))
    # GRPO's seq-mean on the same batch: a different value and a different gradient
    g_args = grpo.Args(group_size=4, beta=0.0, clip_eps_high=args.clip_eps_high)
    correct, _, mask2, old, logps2 = rollout(5)
    adv2 = dapo.compute_advantages(correct * 2 - 1, make_args())
    ours = dapo.compute_policy_loss(logps2, old, adv2, mask2, make_args())[0].item()
    theirs = grpo.compute_policy_loss(logps2, old, adv2, mask2, g_args)[0].item()
    assert abs(ours - theirs) > 1e-3
    seq_mean = aggregate(
        [
            [ppo_clip_token(logps2[i, t].item(), old[i, t].item(), adv2[i].item(), 0.2, 0.28) for t in range(6)]
            for i in range(12)
        ],
        mask2.tolist(),
        "seq-mean-token-mean",
    )
    assert abs(theirs - seq_mean) < 1e-12 and abs(ours - seq_mean) > 1e-3


def test_clip_higher_is_asymmetric():
    """eps_low 0.2 / eps_high 0.28: r = 1.25 with A > 0 still learns (GRPO's 0.2 would clip it), r = 1.3 does
    not; on the low side r = 0.81 learns and r = 0.79 is clipped, as with a symmetric 0.2."""
    args = make_args()
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[1.25, 1.3, 1.1], [0.81, 0.79, 1.5]], dtype=torch.float64)
    logps = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    loss, stats = dapo.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[0, 0] < 0 and grad[0, 1] == 0 and grad[0, 2] < 0  # A > 0: clipped only above 1.28
    assert grad[1, 0] > 0 and grad[1, 1] == 0  # A < 0: clipped only below 0.8
    assert grad[1, 2] > 0  # A < 0 and r > 1: min() keeps the unclipped term, never clipped above
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 6) and stats["clip_frac_low"].item() == pytest.approx(
        1 / 6
    )
    sym = make_args(clip_eps_high=0.2)
    (g_sym,) = torch.autograd.grad(dapo.compute_policy_loss(logps, old, adv, mask, sym)[0], logps)
    assert g_sym[0, 0] == 0  # the symmetric clip stops r = 1.25


def test_micro_batches_sum_to_the_mini_batch_gradient():
    args = make_args()
    correct, _, mask, old, logps = rollout(2)
    adv = dapo.compute_advantages(correct * 2 - 1, args)
    assert_micro_batches_add_up(dapo.compute_policy_loss, logps, old, adv, mask, args, stat_keys=PPO_CLIP_STATS)


def test_a_fully_masked_mini_batch_gives_zero_not_nan():
    args = make_args()
    logps = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, stats = dapo.compute_policy_loss(
        logps, logps.detach(), torch.tensor([1.0, -1.0], dtype=torch.float64), mask, args, num_tokens=torch.tensor(0.0)
    )
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == 0 and (grad == 0).all() and all(torch.isfinite(v) for v in stats.values())


# overlong filtering -----------------------------------------------------------------------------------------


def test_overlong_filtering_masks_truncated_samples():
    correct, lengths, mask, old, logps = rollout(4)
    truncated = lengths == 6
    assert truncated.any() and (~truncated).any()
    args_on, args_off = make_args(overlong_filtering=True), make_args()
    assert torch.equal(dapo.overlong_filter(mask, truncated, args_off), mask)
    filtered = dapo.overlong_filter(mask, truncated, args_on)
    assert (filtered[truncated] == 0).all() and torch.equal(filtered[~truncated], mask[~truncated])
    adv = dapo.compute_advantages(correct * 2 - 1, args_on)
    logps.requires_grad_(True)
    loss, _ = dapo.compute_policy_loss(logps, old, adv, filtered, args_on)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad[truncated] == 0).all()
    keep = ~truncated  # the loss is the token-mean over the untruncated samples alone, their tokens the normaliser
    want = brute_loss(logps.detach()[keep], old[keep], adv[keep], mask[keep], args_on)
    assert abs(loss.item() - want) < 1e-12
    unfiltered = dapo.compute_policy_loss(logps, old, adv, mask, args_off)[0].item()
    assert abs(unfiltered - want) > 1e-6


# defaults and prompts ---------------------------------------------------------------------------------------


def test_defaults_are_the_papers():
    a = dapo.Args()
    assert not hasattr(a, "beta")  # no KL, no reference model (§2.3)
    assert (a.clip_eps_low, a.clip_eps_high) == (0.2, 0.28)  # §4.1
    assert (a.group_size, a.prompts_per_step, a.num_mini_batches, a.ppo_epochs) == (
        16,
        512,
        16,
        1,
    )  # 16 updates of 32 prompts
    assert (a.learning_rate, a.warmup_steps) == (1e-6, 20 * 16)  # warm-up over 20 rollout steps
    assert (a.max_new_tokens, a.overlong_buffer_len, a.overlong_penalty, a.overlong_penalty_factor) == (
        20480,
        4096,
        True,
        1.0,
    )
    assert a.max_new_tokens - a.overlong_buffer_len == 16384  # the expected maximum length
    assert (a.dynamic_sampling, a.max_gen_batches, a.overlong_filtering) == (True, 10, False)
    assert (a.temperature, a.top_p, a.weight_decay, a.max_grad_norm, a.max_prompt_tokens) == (1.0, 1.0, 0.1, 1.0, 2048)
    assert (a.dataset_name, a.dataset_config, a.prompt_column, a.answer_column, a.prompt_template) == (
        "open-r1/DAPO-Math-17k-Processed",
        "en",
        "prompt",
        "solution",
        "dapo",
    )
    assert (a.eval_samples, a.eval_temperature, a.eval_top_p, a.eval_max_new_tokens) == (32, 1.0, 0.7, 20480)
    assert a.eval_datasets == ["math-ai/aime24"]


class _NoChatTemplate:
    chat_template = None


def test_dapo_template_is_not_applied_twice():
    from common.data import DAPO_TEMPLATE, format_prompt

    bare = format_prompt("What is 1+1?", "dapo", _NoChatTemplate())
    assert bare.count("Solve the following math problem step by step.") == 1 and "What is 1+1?" in bare
    # DAPO-Math-17k's prompts already carry the instruction: formatting one again changes nothing
    inner = DAPO_TEMPLATE.format(question="What is 1+1?")
    assert format_prompt(inner, "dapo", _NoChatTemplate()) == bare


# end to end: dynamic sampling in main() and its resume state -----------------------------------------------


def _flags(assets, out, steps, *switches, **extra):
    from tests.test_scripts import toy_flags

    return toy_flags(assets, out, steps, **{"max-gen-batches": 3, "num-mini-batches": 2, **extra}) + list(switches)


@pytest.mark.slow
def test_dynamic_sampling_metrics_and_resume_replays_the_data(toy_assets, tmp_path):
    from tests.test_scripts import read_metrics, run_script

    full = str(tmp_path / "full")
    run_script("dapo", _flags(toy_assets, full, 4, **{"exp-name": "a"}))
    (full_dir,) = glob.glob(os.path.join(full, "a__*"))
    rows = read_metrics(full_dir)
    for r in rows:
        assert 1 <= r["train/gen_rounds"] <= 3
        assert 0 <= r["train/train_groups"] <= 8 and 0 <= r["train/kept_group_frac"] <= 1
        if r["train/train_groups"] < 8:  # the cap was hit: every round ran
            assert r["train/gen_rounds"] == 3
        assert r["train/no_signal"] == float(r["train/train_groups"] == 0)
    part = str(tmp_path / "part")
    run_script("dapo", _flags(toy_assets, part, 2, **{"exp-name": "a"}))
    (run_dir,) = glob.glob(os.path.join(part, "a__*"))
    with open(os.path.join(run_dir, "checkpoints", "step_2", "trainer.json")) as f:
        assert json.load(f)["data"]["position"] == sum(r["train/gen_rounds"] for r in rows[:2])
    proc = run_script("dapo", _flags(toy_assets, part, 4, **{"exp-name": "a", "resume": run_dir}))
    assert "resumed from" in proc.stdout
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(resumed, rows):  # tolerance: see test_scripts.py::test_resume_continues_where_it_stopped
        for key in (
            "train/reward_mean",
            "train/gen_rounds",
            "train/train_groups",
            "train/kept_group_frac",
            "train/loss",
        ):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


@pytest.mark.slow
def test_without_dynamic_sampling_one_round_trains_every_group(toy_assets, tmp_path):
    from tests.test_scripts import read_metrics, run_script

    run_script("dapo", _flags(toy_assets, str(tmp_path), 2, "--no-dynamic-sampling", **{"exp-name": "b"}))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "b__*"))
    for r in read_metrics(run_dir):
        assert (r["train/gen_rounds"], r["train/train_groups"], r["train/kept_group_frac"]) == (1, 8, 1.0)
        assert math.isfinite(r["train/reward_mean"])
