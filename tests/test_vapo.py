"""vapo.py's pure functions against float64 brute-force references written with loops (the GAE reference is
tests/test_ppo.py's): the length-adaptive lambda, decoupled GAE (Monte-Carlo targets for the critic, the policy's
own lambda per row), verl's whitening, the loss with the positive-example LM term and its micro-batch additivity,
its update in micro-batches; end to end, value pre-training leaves the policy untouched while the critic trains."""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch

import vapo
from common.batching import grad_normalizers
from tests.checks import (
    MICRO_CHUNKS,
    SingleProcess,
    TablePolicy,
    assert_grad_matches_finite_differences,
    declared_token_fields,
    run_scripts,
)
from tests.reference import aggregate, ppo_clip_token
from tests.test_ppo import brute_gae, brute_whiten, long_rollout, loop_gae, rollout

F64 = torch.float64


def make_args(**kw):
    return vapo.Args(**{"group_size": 4, "num_mini_batches": 1, **kw})


def brute_loss(logps, old, adv, mask, positive, args):
    """Token-mean PPO clip (eps 0.2 / 0.28) plus mu times the NLL of the correct rows over their tokens, by loops."""
    b, t = len(mask), len(mask[0])
    per_token = [[ppo_clip_token(logps[i][k], old[i][k], adv[i][k], 0.2, 0.28) for k in range(t)] for i in range(b)]
    pg = aggregate(per_token, mask, "token-mean")
    nll_sum = sum(-logps[i][k] for i in range(b) for k in range(t) if mask[i][k] and positive[i])
    nll_count = sum(1 for i in range(b) for k in range(t) if mask[i][k] and positive[i])
    return pg + args.nll_coef * (nll_sum / nll_count if nll_count else 0.0)


def loss_case(seed=0, b=12, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]).long()
    old = -torch.rand(b, t, dtype=F64, generator=g) * 3
    logps = old + 0.4 * torch.randn(b, t, dtype=F64, generator=g)
    adv = torch.randn(b, t, dtype=F64, generator=g)
    positive = (torch.rand(b, generator=g) < 0.5).to(F64)
    positive[:2] = torch.tensor([1.0, 0.0])
    return logps, old, adv, mask, positive


def test_the_policys_lambda_grows_with_the_length_and_is_never_negative():
    mask = (torch.arange(1000)[None] < torch.tensor([1, 10, 20, 21, 40, 100, 1000])[:, None]).long()
    got = vapo.policy_lambda(mask, make_args())
    want = [max(0.0, 1 - 1 / (0.05 * n)) for n in (1, 10, 20, 21, 40, 100, 1000)]  # 1000 tokens: 0.98
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-7)
    assert got[-1].item() == pytest.approx(0.98, abs=1e-7) and got[2] == 0  # l = 1 / alpha: TD(0)


def test_decoupled_gae_gives_the_critic_monte_carlo_returns_and_the_policy_its_own_lambda():
    rewards, values, mask = rollout(0)
    rewards = 2 * rewards - 1  # +-1
    args = make_args(lam_alpha=0.4)  # lengths 2-7: lambdas 0-0.64, each row its own
    adv, ret = vapo.compute_advantages(rewards, values, mask, args)
    token_rewards = vapo.outcome_token_rewards(rewards, mask).tolist()
    lams = [max(0.0, 1 - 1 / (0.4 * sum(row))) for row in mask.tolist()]
    assert len(set(lams)) > 3
    raw, _ = brute_gae(token_rewards, values.tolist(), mask.tolist(), 1.0, lams)
    want = brute_whiten(raw, mask.tolist(), unbiased=True)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=F64), rtol=0, atol=1e-13)
    _, mc = brute_gae(token_rewards, values.tolist(), mask.tolist(), 1.0, [1.0] * len(lams))
    torch.testing.assert_close(ret, torch.tensor(mc, dtype=F64), rtol=0, atol=1e-13)
    # lambda_critic = gamma = 1: the target of every kept token is the outcome itself, whatever V
    torch.testing.assert_close(ret[mask > 0], rewards[:, None].expand_as(ret)[mask > 0], rtol=0, atol=1e-14)


def test_gae_scan_with_the_policys_lambdas_equals_the_loop_and_ppos_function():
    """vapo.py's GAE is ppo.py's function, line for line, and with the length-adaptive lambda of each row (0 for
    the short ones, up to 0.98) equals the loop over positions in float64 on long rows with masked spans."""
    import inspect

    import ppo

    assert inspect.getsource(vapo.compute_gae) == inspect.getsource(ppo.compute_gae)
    rewards, values, mask = long_rollout(7, t=1000)
    lams = vapo.policy_lambda(mask, make_args()).to(F64)
    assert lams.min() == 0 and lams.max() > 0.95
    for got, want in zip(
        vapo.compute_gae(rewards, values, mask, 1.0, lams), loop_gae(rewards, values, mask, 1.0, lams)
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_policy_loss_with_the_positive_example_lm_loss_matches_a_loop():
    logps, old, adv, mask, positive = loss_case()
    args = make_args()

    def reference(lp):
        return brute_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), positive.tolist(), args)

    lp = logps.clone().requires_grad_(True)
    loss, stats = vapo.compute_policy_loss(lp, old, adv, mask, args, positive=positive)
    assert abs(loss.item() - reference(logps)) < 1e-12
    (grad,) = torch.autograd.grad(loss, lp)
    assert assert_grad_matches_finite_differences(grad, reference, lp) >= 10
    assert (grad[mask == 0] == 0).all() and {"policy_loss", "nll_loss", "clip_frac_high"} <= set(stats)
    # without correct completions the LM term is 0, not NaN, and the loss is the token-mean PPO loss alone
    none, _ = vapo.compute_policy_loss(logps, old, adv, mask, args, positive=torch.zeros_like(positive))
    assert none.item() == pytest.approx(stats["policy_loss"].item(), abs=1e-15)


def test_micro_batches_add_up_with_the_lm_losss_own_normaliser():
    logps, old, adv, mask, positive = loss_case(1)
    args = make_args()
    lp = logps.clone().requires_grad_(True)
    loss, stats = vapo.compute_policy_loss(lp, old, adv, mask, args, positive=positive)
    (whole,) = torch.autograd.grad(loss, lp)
    num_tokens, num_seqs = grad_normalizers([mask[c] for c in MICRO_CHUNKS])
    num_pos, _ = grad_normalizers([mask[c] * positive[c][:, None] for c in MICRO_CHUNKS])
    total = sum(
        vapo.compute_policy_loss(
            lp[c], old[c], adv[c], mask[c], args, num_tokens, num_seqs, positive=positive[c], num_pos_tokens=num_pos
        )[0]
        for c in MICRO_CHUNKS
    )
    (split,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(total, loss, rtol=0, atol=1e-12)


def test_update_policy_in_micro_batches_gives_the_whole_mini_batchs_step():
    """vapo.update_policy (its own: the LM loss's normaliser over the mini-batch) with 1 and with 3 rows per
    micro-batch: the same step of a table policy (SGD, lr 1, no clipping)."""
    g = torch.Generator().manual_seed(2)
    n, p, c = 8, 2, 4
    ids = torch.randint(0, 20, (n, p + c), generator=g)
    lens = torch.randint(1, c + 1, (n,), generator=g)
    mask = (torch.arange(c)[None] < lens[:, None]).long()
    batch = {"ids": ids, "attn": torch.cat([torch.ones(n, p, dtype=torch.long), mask], 1), "mask": mask, "p_len": p}
    batch.update(lens=[(p, int(k)) for k in lens], advantages=torch.randn(n, c, generator=g, dtype=F64))
    batch["positive"] = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0], dtype=F64)
    batch["token_fields"] = declared_token_fields(vapo)
    steps = []
    for micro in (8, 3):
        args = make_args(micro_batch_size=micro, micro_batch_tokens=0, max_grad_norm=1e9)
        policy = TablePolicy(20)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        before = policy.theta.detach().clone()
        stats = vapo.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0)
        assert stats["nll_loss"] > 0
        steps.append(before - policy.theta.detach())
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=1e-12)


def test_defaults_are_the_papers():
    a = vapo.Args()
    assert (a.clip_eps_low, a.clip_eps_high, a.lam_critic, a.lam_alpha, a.gamma) == (0.2, 0.28, 1.0, 0.05, 1.0)
    assert (a.value_warmup_steps, a.nll_coef, a.critic_learning_rate, a.critic_num_mini_batches) == (50, 0.1, 2e-6, 16)
    # §4.1 group sampling in DAPO's setting, one node: 512 prompts x 16, mini-batches of 512, DAPO's data and budget
    assert (a.group_size, a.prompts_per_step, a.num_mini_batches, a.critic_warmup_steps) == (16, 512, 16, 0)
    assert (a.dataset_name, a.prompt_template, a.max_new_tokens) == ("open-r1/DAPO-Math-17k-Processed", "dapo", 20480)
    assert vapo.compute_rewards(torch.tensor([1.0, 0.0]), None, torch.tensor([True, False]), a).tolist() == [1, -1]


@pytest.mark.slow
def test_value_pretraining_trains_the_critic_alone(toy_assets, tmp_path):
    """--value-warmup-steps 2 of 3: the first two steps log value_warmup 1, no policy update and a moving critic;
    the checkpoint after step 2 holds the policy's initial weights bit for bit; step 3 updates the policy."""
    from safetensors.torch import load_file

    from tests.test_scripts import ROOT, read_metrics, toy_flags

    flags = {"exp-name": "w", "value-warmup-steps": 2, "save-every": 2, "critic-learning-rate": 1e-2}
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    proc, outcomes = run_scripts([("vapo", toy_flags(toy_assets, str(tmp_path), 3, **flags))], str(tmp_path), env)
    assert outcomes == [None], outcomes
    (run_dir,) = glob.glob(os.path.join(tmp_path, "w__*"))
    rows = read_metrics(run_dir)
    assert [r["train/value_warmup"] for r in rows] == [1.0, 1.0, 0.0]
    assert [r["train/grad_norm"] == 0 for r in rows] == [True, True, False]
    assert all(r["train/critic_grad_norm"] > 0 for r in rows) and rows[1]["train/value_mean"] != 0
    saved = load_file(os.path.join(run_dir, "checkpoints", "step_2", "model", "model.safetensors"))
    initial = load_file(os.path.join(toy_assets["model"], "model.safetensors"))
    assert all(torch.equal(saved[k], initial[k]) for k in initial)
    assert not math.isnan(rows[2]["train/nll_loss"])
