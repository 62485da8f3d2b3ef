"""m2po.py's pure functions and its per-mini-batch selection against float64 brute-force references.

M2PO's per-token term is -M r A with r = pi/mu unclipped and M = 1 - the tokens Algorithm 1 drops; the selection is
made once per mini-batch (update_policy, before the micro-batches) and reaches the loss as `m2po_drop`, so the loss
is checked given a selection, and the selection against a literal while-loop port of Algorithm 1."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import m2po
from tests.checks import (
    MICRO_CHUNKS,
    SingleProcess,
    TablePolicy,
    assert_explicit_rollout_correction_refused,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    assert_standardised_advantages,
    declared_token_fields,
)
from tests.reference import k3

STATS = ("policy_loss", "approx_kl", "m2po_drop_frac", "m2")
NAN_ROWS = (2, 7)  # rows the sampler did not produce (injected / replayed): NaN sampler log-probs


def make_args(**kw):
    return m2po.Args(**{"group_size": 4, **kw})


def rollout(seed, groups=3, g=4, t=6, spread=0.5):
    """Log-ratios to mu of N(0, spread): many trust-region tokens with (log r)^2 far above 0.04 on both advantage
    signs. old_logps = mu + noise (the NaN rows use it); garbage in the padding."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    mu = -0.1 - 3 * torch.rand(n, t, dtype=torch.float64, generator=gen)
    logps = mu + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
    old = mu + 0.3 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    sampler = mu.clone()
    for i in NAN_ROWS:
        sampler[i] = math.nan
    pad = mask == 0
    logps, old = logps.masked_fill(pad, -0.5), old.masked_fill(pad, -7.0)
    sampler = sampler.masked_fill(pad & ~sampler.isnan(), 0.0)  # make_batch zero-pads the sampler's log-probs
    ref = mu + 0.1 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps, sampler, ref


def behaviour(old, sampler) -> list[list[float]]:
    """mu by loops: the sampler's log-prob, or old_logps on a row the sampler did not produce."""
    return [
        [o if math.isnan(s) else s for o, s in zip(orow, srow)] for orow, srow in zip(old.tolist(), sampler.tolist())
    ]


def ref_m2po_select(cur, mu, adv, mask, tau=0.04, scope="trust-region") -> list[list[bool]]:
    """Algorithm 1 literally (losses.ref_m2po_select): T = the candidates; while the mean of M2 over T exceeds tau,
    drop T's argmax."""
    T = []
    for i in range(len(cur)):
        for t in range(len(cur[i])):
            if not mask[i][t]:
                continue
            d, a = float(cur[i][t]) - float(mu[i][t]), float(adv[i])
            if scope == "all" or (a > 0 and d > 0) or (a < 0 and d < 0):
                T.append((d * d, i, t))
    drop = [[False] * len(cur[0]) for _ in cur]
    while T and sum(v for v, _, _ in T) / len(T) > tau:
        j = max(range(len(T)), key=lambda q: T[q][0])
        _, i, t = T.pop(j)
        drop[i][t] = True
    return drop


def ref_m2po(logps, mu, adv, mask, drop, beta=0.0, ref=None) -> float:
    """-1/N sum_{i,t} [(1 - drop) exp(logp - mu) A - beta k3], N all the tokens (the dropped ones too)."""
    total, n_tok = 0.0, 0
    for i in range(len(logps)):
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            n_tok += 1
            if not drop[i][t]:
                total += -math.exp(float(logps[i][t]) - float(mu[i][t])) * float(adv[i])
            if beta > 0:
                total += beta * k3(float(logps[i][t]), float(ref[i][t]))
    return total / max(n_tok, 1)


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(m2po.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()


@pytest.mark.parametrize("scope", ["trust-region", "all"])
def test_selection_is_algorithm_1(scope):
    """m2po_select (sorted suffix means, one threshold) equals the literal while-loop on 300 random mini-batches of
    different sizes, spreads and budgets, among them T emptied (tau 0), nothing dropped (tau 100), an empty T (all
    A = 0 with the trust-region scope) and a single row."""
    gen = torch.Generator().manual_seed(11)
    seen = {"all": 0, "none": 0, "some": 0}
    for case in range(300):
        n, t = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        spread = [0.02, 0.1, 0.3, 1.0][case % 4]
        tau = [0.04, 0.04, 0.01, 0.2, 0.0, 100.0][case % 6]
        args = make_args(m2po_threshold=tau, m2po_scope=scope)
        mask = (torch.rand(n, t, generator=gen) < 0.8).long()
        adv = torch.randn(n, dtype=torch.float64, generator=gen).round(decimals=1)
        if case % 25 == 0:
            adv = torch.zeros(n, dtype=torch.float64)
        mu = -3 * torch.rand(n, t, dtype=torch.float64, generator=gen)
        now = mu + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
        got = m2po.m2po_select(now, mu, adv, mask, args)
        want = ref_m2po_select(now.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), tau, scope)
        assert got.dtype == torch.bool and got.tolist() == want, case
        d = now - mu
        cand = (
            (mask > 0)
            if scope == "all"
            else (mask > 0) & (((adv[:, None] > 0) & (d > 0)) | ((adv[:, None] < 0) & (d < 0)))
        )
        k, c = int(got.sum()), int(cand.sum())
        seen["all" if c and k == c else "none" if k == 0 else "some"] += 1
        assert not (got & ~cand).any()  # only candidates are dropped
    assert min(seen.values()) >= 20, seen


def test_selection_keeps_the_mean_under_the_budget_minimally():
    """What is kept has mean M2 <= tau, and putting back the smallest dropped token would exceed it."""
    rewards, mask, _, logps, sampler, _ = rollout(1)
    args = make_args()
    adv = m2po.compute_advantages(rewards, args)
    mu = torch.where(sampler.isnan(), logps - 0.3, sampler)
    drop = m2po.m2po_select(logps, mu, adv, mask, args)
    d = logps - mu
    cand = (mask > 0) & (((adv[:, None] > 0) & (d > 0)) | ((adv[:, None] < 0) & (d < 0)))
    m2 = d * d
    kept = m2[cand & ~drop]
    assert 0 < int(drop.sum()) < int(cand.sum())
    assert kept.mean() <= args.m2po_threshold
    back = torch.cat([kept, m2[drop].min().reshape(1)])
    assert back.mean() > args.m2po_threshold
    assert m2[drop].min() >= kept.max()  # the largest ones go


@pytest.mark.parametrize("kw", [{}, {"m2po_scope": "all"}, {"beta": 0.04}])
def test_policy_loss_value_and_gradient_match_reference(kw):
    args = make_args(**kw)
    rewards, mask, old, logps, sampler, ref = rollout(2)
    adv = m2po.compute_advantages(rewards, args)
    mu = behaviour(old, sampler)
    a, m = adv.tolist(), mask.tolist()
    drop_list = ref_m2po_select(logps.tolist(), mu, a, m, args.m2po_threshold, args.m2po_scope)
    drop = torch.tensor(drop_list)
    assert drop.any()
    reference = lambda lp: ref_m2po(lp.tolist(), mu, a, m, drop_list, args.beta, ref.tolist())
    grad, stats = assert_loss_matches_reference(
        m2po.compute_policy_loss,
        reference,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=STATS,
        loss_atol=1e-11,
        rollout_logps=sampler,
        ref_logps=ref,
        m2po_drop=drop,
    )
    n_tok = int(mask.sum())
    m2_sum = kl_sum = 0.0
    for i in range(len(m)):
        for t in range(len(m[0])):
            if m[i][t]:
                d = logps[i, t].item() - mu[i][t]
                m2_sum, kl_sum = m2_sum + d * d, kl_sum + math.expm1(d) - d
                if drop_list[i][t] and args.beta == 0:
                    assert grad[i, t] == 0  # a dropped token gets no gradient
                elif a[i] != 0 and args.beta == 0:  # -r A / N, r unclipped
                    assert grad[i, t].item() == pytest.approx(-math.exp(d) * a[i] / n_tok, rel=1e-12)
    assert stats["m2po_drop_frac"].item() == pytest.approx(int(drop[mask.bool()].sum()) / n_tok, rel=1e-7)
    assert stats["m2"].item() == pytest.approx(m2_sum / n_tok, rel=1e-12)
    assert stats["approx_kl"].item() == pytest.approx(kl_sum / n_tok, rel=1e-12)
    # without a selection the loss selects on its own batch (the whole mini-batch here): the same
    loss_self, _ = m2po.compute_policy_loss(logps, old, adv, mask, args, rollout_logps=sampler, ref_logps=ref)
    assert loss_self.item() == pytest.approx(reference(logps), abs=1e-12)


def test_dropped_tokens_count_in_the_token_mean_and_ratios_are_not_clipped():
    """Two tokens with A = 1, r = e^1 (M2 = 1, dropped) and r = e^0.1 (M2 = 0.01, kept): the kept one's gradient is
    -e^0.1 / 2, the dropped token still in the normaliser; far outside PPO's 0.2 clip nothing is clipped."""
    logps = torch.tensor([[1.0, 0.1]], dtype=torch.float64) - 2.0
    mu = torch.full((1, 2), -2.0, dtype=torch.float64)
    adv = torch.ones(1, dtype=torch.float64)
    args = make_args()
    drop = m2po.m2po_select(logps, mu, adv, torch.ones(1, 2), args)
    assert drop.tolist() == [[True, False]]
    x = logps.clone().requires_grad_(True)
    loss, stats = m2po.compute_policy_loss(x, mu, adv, torch.ones(1, 2), args, m2po_drop=drop)
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.1) / 2]], dtype=torch.float64))
    assert stats["m2po_drop_frac"].item() == 0.5 and stats["m2"].item() == pytest.approx((1 + 0.01) / 2)
    r = torch.tensor([[3.0, 0.3]], dtype=torch.float64)  # no selection: far outside any clip, full gradient
    x = torch.log(r).requires_grad_(True)
    loss, _ = m2po.compute_policy_loss(
        x,
        torch.zeros(1, 2),
        torch.tensor([-1.0]),
        torch.ones(1, 2),
        args,
        m2po_drop=torch.zeros(1, 2, dtype=torch.bool),
    )
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], r / 2)


def test_mu_is_the_sampler_and_nan_rows_fall_back_to_old():
    args = make_args()
    rewards, mask, old, logps, sampler, _ = rollout(3)
    adv = m2po.compute_advantages(rewards, args)
    filled = torch.where(sampler.isnan(), old, sampler)
    drop = m2po.m2po_select(logps, filled, adv, mask, args)
    a, _ = m2po.compute_policy_loss(logps, old, adv, mask, args, rollout_logps=sampler, m2po_drop=drop)
    b, _ = m2po.compute_policy_loss(logps, old, adv, mask, args, rollout_logps=filled, m2po_drop=drop)
    c, _ = m2po.compute_policy_loss(logps, filled, adv, mask, args, m2po_drop=drop)  # None: mu = old_logps
    assert a.item() == b.item() == c.item()
    assert m2po.behaviour(old, None) is old


def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient():
    for kw in ({}, {"beta": 0.04, "m2po_scope": "all"}):
        args = make_args(**kw)
        rewards, mask, old, logps, sampler, ref = rollout(4)
        adv = m2po.compute_advantages(rewards, args)
        drop = m2po.m2po_select(logps, m2po.behaviour(old, sampler), adv, mask, args)  # once, on the mini-batch
        assert drop.any()
        assert_micro_batches_add_up(
            m2po.compute_policy_loss,
            logps,
            old,
            adv,
            mask,
            args,
            stat_keys=STATS[1:],
            rollout_logps=sampler,
            ref_logps=ref,
            m2po_drop=drop,
        )


def test_selecting_per_micro_batch_would_change_the_token_set():
    """Why the selection is made once per mini-batch: Algorithm 1 on each micro-batch alone (the official code's
    placement) drops other tokens than on the whole mini-batch."""
    args = make_args()
    rewards, mask, old, logps, sampler, _ = rollout(4)
    adv = m2po.compute_advantages(rewards, args)
    mu = m2po.behaviour(old, sampler)
    whole = m2po.m2po_select(logps, mu, adv, mask, args)
    parts = torch.cat([m2po.m2po_select(logps[c], mu[c], adv[c], mask[c], args) for c in MICRO_CHUNKS])
    assert not torch.equal(whole, parts)


@pytest.mark.parametrize("scope", ["trust-region", "all"])
def test_selection_over_ranks_equals_the_whole_mini_batch(monkeypatch, scope):
    """Two simulated ranks holding rows 0-4 and 5-11: with global_cat gathering both ranks' candidate values, each
    rank's selection is its rows of the single-process selection of all 12 rows (the global threshold)."""
    args = make_args(m2po_scope=scope)
    rewards, mask, old, logps, sampler, _ = rollout(5)
    adv = m2po.compute_advantages(rewards, args)
    mu = m2po.behaviour(old, sampler)
    shares = (slice(0, 5), slice(5, 12))
    gathered = []
    monkeypatch.setattr(m2po, "global_cat", lambda x: gathered.append(x) or x)
    for s in shares:  # each rank's local candidate values, in rank order
        m2po.m2po_select(logps[s], mu[s], adv[s], mask[s], args)
    monkeypatch.setattr(m2po, "global_cat", lambda x: torch.cat(gathered))
    per_rank = torch.cat([m2po.m2po_select(logps[s], mu[s], adv[s], mask[s], args) for s in shares])
    monkeypatch.undo()
    whole = m2po.m2po_select(logps, mu, adv, mask, args)
    assert whole.any() and torch.equal(per_rank, whole)
    local = torch.cat([m2po.m2po_select(logps[s], mu[s], adv[s], mask[s], args) for s in shares])
    assert not torch.equal(local, whole)  # without the gather each rank would pick its own token set


def update_batch(seed=3, n=8, p_len=2, c_len=5):
    """A rollout for update_policy with a TablePolicy: old log-probs the policy's own, sampler log-probs a stale
    policy's (theta minus noise: M2 well above the budget), two NaN rows (not sampled this step)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    mask = (torch.arange(c_len)[None] < lengths[:, None]).long()
    ids = torch.randint(0, 30, (n, p_len + c_len), generator=g)
    attn = torch.cat([torch.ones(n, p_len, dtype=torch.long), mask], 1)
    own = TablePolicy(30).theta.detach()[ids[:, p_len:]]
    sampler = own - 0.6 * torch.randn(n, c_len, generator=g, dtype=torch.float64)
    sampler[[1, 6]] = math.nan
    return {
        "ids": ids,
        "attn": attn,
        "mask": mask,
        "p_len": p_len,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "lens": [(p_len, int(k)) for k in lengths],
        "sampler_logps": sampler,
        "old_logps": own,
        "token_fields": declared_token_fields(m2po),
    }


def run_update(policy=None, **kw):
    policy, batch = policy or TablePolicy(30), update_batch()
    args = make_args(max_grad_norm=1e9, **kw)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    stats = m2po.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0)
    return policy.theta.detach(), stats, batch


@pytest.mark.parametrize("epochs,mini", [(1, 1), (2, 2)])
def test_update_policy_does_not_depend_on_the_micro_batches(epochs, mini):
    """update_policy with the sampler's log-probs set (tokens are dropped): one micro-batch, row micro-batches of 3
    and of 1, and token micro-batches give the same parameters and stats. With 2 epochs x 2 mini-batches the later
    selections are at the moved policy (compute_logps), the first at old_logps."""
    common = dict(ppo_epochs=epochs, num_mini_batches=mini)
    base, stats, _ = run_update(micro_batch_size=8, micro_batch_tokens=0, **common)
    assert stats["m2po_drop_frac"].item() > 0.05
    for split in (
        dict(micro_batch_size=3, micro_batch_tokens=0),
        dict(micro_batch_size=1, micro_batch_tokens=0),
        dict(micro_batch_size=8, micro_batch_tokens=12),
    ):
        theta, s, _ = run_update(**split, **common)
        torch.testing.assert_close(theta, base, rtol=0, atol=1e-12)
        for k in ("m2po_drop_frac", "m2", "policy_loss"):
            assert s[k].item() == pytest.approx(stats[k].item(), rel=1e-6, abs=1e-12), k


def test_update_policy_selects_on_the_whole_mini_batch_at_its_start():
    """One update (one epoch, one mini-batch): SGD(lr) moves theta by -lr times the gradient of the loss with the
    selection of Algorithm 1 on the whole rollout at old_logps (= the policy before the step) against mu."""
    theta, stats, batch = run_update(micro_batch_size=3, micro_batch_tokens=0, num_mini_batches=1)
    args = make_args()
    policy = TablePolicy(30)
    logps = policy(batch["ids"], batch["attn"], batch["p_len"], 1.0)[0]
    mu = m2po.behaviour(batch["old_logps"], batch["sampler_logps"])
    drop = m2po.m2po_select(batch["old_logps"], mu, batch["advantages"], batch["mask"], args)
    assert torch.equal(batch["m2po_drop"], drop) and drop.any()
    loss, _ = m2po.compute_policy_loss(
        logps,
        batch["old_logps"],
        batch["advantages"],
        batch["mask"],
        args,
        rollout_logps=batch["sampler_logps"],
        m2po_drop=drop,
    )
    loss.backward()
    torch.testing.assert_close(theta, TablePolicy(30).theta.detach() - 0.5 * policy.theta.grad, rtol=0, atol=1e-12)


def test_update_policy_selects_each_mini_batch_on_its_rows_at_its_start(monkeypatch):
    """2 epochs x 2 mini-batches: each selection sees only its mini-batch's rows (as update_policy permutes them) and
    the policy's log-probs at that mini-batch's start: old_logps themselves for the first, compute_logps afterwards."""
    policy, calls, select = TablePolicy(30), [], m2po.m2po_select

    def spy(now, mu, adv, mask, args):
        calls.append((now.clone(), mask.clone(), policy.theta.detach().clone()))
        return select(now, mu, adv, mask, args)

    monkeypatch.setattr(m2po, "m2po_select", spy)
    _, _, batch = run_update(policy, ppo_epochs=2, num_mini_batches=2, micro_batch_size=3, micro_batch_tokens=0)
    assert len(calls) == 4
    seed = make_args().seed * 1_000_003  # update_policy's permutation at step 0
    for k, (now, mask, theta) in enumerate(calls):
        epoch, mb = divmod(k, 2)
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(seed + epoch))
        rows = sorted(perm[mb * 4 : (mb + 1) * 4].tolist())
        assert (mask.sum(1) > 0).nonzero().flatten().tolist() == rows
        assert torch.equal(mask[rows], batch["mask"][rows])
        want = theta[batch["ids"][:, batch["p_len"] :]]
        if k == 0:
            assert torch.equal(now, batch["old_logps"])  # exactly the recomputed old log-probs
        torch.testing.assert_close((now * mask)[rows], (want * mask)[rows].to(now.dtype), rtol=1e-6, atol=1e-6)
    assert not torch.equal(calls[1][2], calls[0][2])  # the policy moved between the mini-batches


def test_explicit_rollout_correction_is_refused_before_anything_runs(monkeypatch):
    """r = pi/mu already is the full IS weight (tests.checks)."""
    assert_explicit_rollout_correction_refused(m2po, monkeypatch, off_policy_steps=64)


def test_defaults_are_the_papers():
    a = m2po.Args()
    names = {f.name for f in dataclasses.fields(a)}
    assert not {"clip_eps_low", "clip_eps_high"} & names  # no ratio clip
    # the official train-scripts/m2po-qwen-math-7b-s*.sh
    assert (a.m2po_threshold, a.m2po_scope, a.beta) == (0.04, "trust-region", 0.0)
    assert a.model_name_or_path == "Qwen/Qwen2.5-Math-7B" and a.prompt_template == "qwen-boxed"
    assert (a.dataset_name, a.prompt_column, a.answer_column) == (
        "agentica-org/DeepScaleR-Preview-Dataset",
        "problem",
        "answer",
    )
    assert (a.group_size, a.prompts_per_step, a.num_mini_batches, a.ppo_epochs) == (8, 256, 4, 1)
    assert (a.max_new_tokens, a.max_prompt_tokens, a.learning_rate) == (2560, 1536, 1e-6)
    assert (a.temperature, a.top_p, a.off_policy_steps) == (1.0, 1.0, 0)  # s0; s256: --off-policy-steps 64
