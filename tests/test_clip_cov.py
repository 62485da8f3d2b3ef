"""clip_cov.py's pure functions against float64 brute-force references.

The selection S (select_tokens) is checked against loop references of the official code's selection: Clip-Cov's
candidates in row-major order taken in a given random order (the order of their keys), KL-Cov's tokens sorted by
covariance. The loss is checked with S held fixed (value and finite-difference gradient); update_policy's selection
once per mini-batch is checked not to depend on the micro-batch split, and the rank split on simulated ranks."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import clip_cov
from common import batching
from tests.checks import (
    SingleProcess,
    TablePolicy,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    assert_standardised_advantages,
    declared_token_fields,
)
from tests.reference import k3

CLIP_STATS = ("cov_selected_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "policy_loss")
KL_STATS = ("cov_selected_frac", "abs_log_ratio", "approx_kl", "policy_loss")


def make_args(**kw):
    return clip_cov.Args(**{"group_size": 4, **kw})


def rollout(seed, groups=3, g=4, t=6, spread=0.8, ties=False):
    """Log-probs spread over [-6, 0] (so Cov reaches the (1, 5) band), ratios up to e^+-2 (some PPO-clipped even at
    eps 1), one all-correct group (A = 0), garbage in the padding. ties: the current log-probs take 4 values, so that
    many tokens share a Cov (as the same token after the same prefix in completions of equal reward)."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 6
    logps = old + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
    if ties:
        logps = -torch.randint(0, 4, (n, t), generator=gen).double()
    logps = torch.where(mask.bool(), logps, torch.full_like(logps, -9.0))
    old = torch.where(mask.bool(), old, torch.full_like(old, 0.5))
    return rewards, mask, old, logps


def ref_cov(cur, adv, mask):
    vals = [(adv[i], cur[i][t]) for i in range(len(cur)) for t in range(len(cur[i])) if mask[i][t]]
    mean_a = sum(a for a, _ in vals) / len(vals)
    mean_l = sum(lp for _, lp in vals) / len(vals)
    return [[(adv[i] - mean_a) * (cur[i][t] - mean_l) for t in range(len(cur[i]))] for i in range(len(cur))]


def ref_clip_cov_select(cur, old, adv, mask, args, order):
    """The official compute_policy_loss_clip_cov's selection, by loops: candidates (valid, not PPO-clipped, lb < Cov
    < ub) in row-major order; `order(candidates)` is the random permutation (the official torch.randperm); the
    first clip_num = max(int(ratio N), 1) of it."""
    cov = ref_cov(cur, adv, mask)
    cands = []
    for i in range(len(cur)):
        for t in range(len(cur[i])):
            if not mask[i][t]:
                continue
            r, a = math.exp(cur[i][t] - old[i][t]), adv[i]
            clipped = -a * min(max(r, 1 - args.clip_eps_low), 1 + args.clip_eps_high) > -a * r
            if not clipped and args.clip_cov_lb < cov[i][t] < args.clip_cov_ub:
                cands.append((i, t))
    clip_num = max(int(args.clip_cov_ratio * sum(map(sum, mask))), 1)
    sel = [[False] * len(cur[0]) for _ in cur]
    for j in order(cands)[:clip_num]:
        i, t = cands[j]
        sel[i][t] = True
    return sel


def ref_kl_cov_select(cur, adv, mask, args, keys):
    """The official compute_policy_loss_kl_cov's selection: the k = max(1, int(ratio N)) valid tokens of largest
    Cov (torch.topk); ties broken by the smallest key."""
    cov = ref_cov(cur, adv, mask)
    items = sorted((-cov[i][t], keys[i][t], i, t) for i in range(len(cur)) for t in range(len(cur[i])) if mask[i][t])
    sel = [[False] * len(cur[0]) for _ in cur]
    for _, _, i, t in items[: max(1, int(args.kl_cov_ratio * len(items)))]:
        sel[i][t] = True
    return sel


def ref_loss(logps, old, adv, mask, sel, args) -> float:
    """Token mean of the official per-token terms, S = `sel` fixed: clip, max(-A r, -A clip(r)) and 0 on S; kl,
    -A r plus coef |log r| on S."""
    tot, ntok = 0.0, 0
    for i in range(len(logps)):
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            ntok += 1
            d, a = logps[i][t] - old[i][t], adv[i]
            r = math.exp(d)
            if args.cov_form == "clip":
                if not sel[i][t]:
                    tot += max(-a * r, -a * min(max(r, 1 - args.clip_eps_low), 1 + args.clip_eps_high))
            else:
                tot += -a * r + (args.kl_cov_coef * abs(d) if sel[i][t] else 0.0)
    return tot / ntok


def key_order(keys):
    """The random order that the keys define: candidates by ascending key (i.i.d. keys: a uniform permutation)."""
    return lambda cands: sorted(range(len(cands)), key=lambda j: keys[cands[j][0]][cands[j][1]])


def select(logps, old, adv, mask, args, seed=0):
    """select_tokens with i.i.d. uniform keys; returns (S, keys)."""
    keys = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return clip_cov.select_tokens(logps, old, adv, mask, args, keys), keys


def test_advantages_match_reference():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(clip_cov.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()


@pytest.mark.parametrize(
    "kw",
    [
        {},  # the recipe: clip_num = 1
        {"clip_cov_ratio": 0.05},
        {"clip_cov_ratio": 0.2, "clip_eps_low": 0.2, "clip_eps_high": 0.28},  # PPO-clipped tokens are excluded
        {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.5, "clip_cov_ub": 3.0},  # every candidate
        {"clip_cov_ratio": 0.1, "clip_cov_lb": -1.0},
    ],
)
def test_clip_selection_matches_reference_given_the_permutation(kw):
    args = make_args(**kw)
    selected = 0
    for seed in range(40):
        rewards, mask, old, logps = rollout(seed)
        adv = clip_cov.compute_advantages(rewards, args)
        sel, keys = select(logps, old, adv, mask, args, seed)
        want = ref_clip_cov_select(logps.tolist(), old.tolist(), adv.tolist(), mask.tolist(), args, key_order(keys))
        assert sel.tolist() == want, seed
        selected += int(sel.sum())
    assert selected >= 40  # something selected on every rollout: the checks are not vacuous


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("ratio", [2e-3, 2e-4, 0.05, 0.3, 1.0])
def test_kl_selection_matches_reference(ratio, ties):
    """Exactly k tokens, also when many share the k-th Cov (then those of smallest key)."""
    args = make_args(cov_form="kl", kl_cov_ratio=ratio)
    tied = 0
    for seed in range(40):
        rewards, mask, old, logps = rollout(seed, ties=ties)
        adv = clip_cov.compute_advantages(rewards, args)
        sel, keys = select(logps, old, adv, mask, args, seed)
        assert sel.tolist() == ref_kl_cov_select(logps.tolist(), adv.tolist(), mask.tolist(), args, keys), seed
        assert int(sel.sum()) == max(1, int(ratio * int(mask.sum())))
        cov = torch.tensor(ref_cov(logps.tolist(), adv.tolist(), mask.tolist()))
        kth = cov[sel].min()
        tied += bool(((cov == kth) & mask.bool() & ~sel).any())  # a tie at the k-th value left out
    assert (tied > 10) == (ties and ratio < 1)


def test_selection_ignores_padding_and_rows_outside_the_mask():
    """update_policy passes the whole rollout with only the mini-batch's rows in `mask`: the other rows and the
    padding are never selected and do not enter the covariance's means."""
    args = make_args(clip_cov_ratio=0.3, clip_cov_lb=-1.0)
    rewards, mask, old, logps = rollout(3)
    adv = clip_cov.compute_advantages(rewards, args)
    rows = [1, 4, 5, 8, 11]
    part = torch.zeros_like(mask)
    part[rows] = mask[rows]
    for form in ("clip", "kl"):
        args.cov_form = form
        sel, keys = select(logps, old, adv, part, args)
        assert not sel[part == 0].any() and sel.any()
        assert (
            sel[rows].tolist()
            == clip_cov.select_tokens(logps[rows], old[rows], adv[rows], mask[rows], args, keys[rows]).tolist()
        )


@pytest.mark.parametrize(
    "kw",
    [
        {"clip_cov_ratio": 0.1},
        {"clip_cov_ratio": 0.1, "clip_eps_low": 0.2, "clip_eps_high": 0.28, "spread": 0.3},
        {"clip_cov_ratio": 0.1, "beta": 0.04},
        {"cov_form": "kl", "kl_cov_ratio": 0.1},
        {"cov_form": "kl", "kl_cov_ratio": 0.3, "kl_cov_coef": 0.5},
        {"cov_form": "kl", "kl_cov_ratio": 0.1, "beta": 0.04},
    ],
)
def test_policy_loss_value_and_gradient_match_reference(kw):
    kw = dict(kw)
    spread = kw.pop("spread", 0.8)  # a PPO clip at 0.2 / 0.28: smaller steps, so that enough tokens are unclipped
    args = make_args(**kw)
    rewards, mask, old, logps = rollout(1, spread=spread)
    adv = clip_cov.compute_advantages(rewards, args)
    sel, _ = select(logps, old, adv, mask, args)
    ratio = torch.exp(logps - old)[mask.bool()]
    assert (ratio - 1 - args.clip_eps_high).abs().min() > 1e-3 and (ratio - 1 + args.clip_eps_low).abs().min() > 1e-3
    assert (logps - old)[mask.bool()].abs().min() > 1e-4  # away from |log r|'s kink
    ref = old + 0.1 * torch.randn(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    o, a, m, s, rf = old.tolist(), adv.tolist(), mask.tolist(), sel.tolist(), ref.tolist()

    def reference(lp):
        lp = lp.tolist()
        kl = [[k3(lp[i][t], rf[i][t]) if m[i][t] else 0.0 for t in range(len(m[i]))] for i in range(len(m))]
        return ref_loss(lp, o, a, m, s, args) + args.beta * sum(map(sum, kl)) / sum(map(sum, m))

    keys = CLIP_STATS if args.cov_form == "clip" else KL_STATS
    grad, stats = assert_loss_matches_reference(
        clip_cov.compute_policy_loss,
        reference,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=keys,
        ref_logps=ref,
        cov_select=sel,
    )
    num_tokens = int(mask.sum())
    assert 1 < int(sel.sum()) and stats["cov_selected_frac"].item() == pytest.approx(int(sel.sum()) / num_tokens)
    if args.cov_form == "kl":
        want = sum(abs(x) for x in (logps - old)[mask.bool()].tolist()) / num_tokens
        assert stats["abs_log_ratio"].item() == pytest.approx(want, rel=1e-12)
        assert "clip_frac_low" not in stats
    assert ("kl_ref" in stats) == (args.beta > 0)


@pytest.mark.parametrize("form", ["clip", "kl"])
def test_selected_tokens_get_zero_or_the_penalty_gradient(form):
    """Against the same loss with nothing selected: clip, the selected tokens' gradient is exactly 0 (and their term
    still counts in num_tokens); kl, they get an extra coef * sign(log r) / num_tokens; every other token is
    unchanged."""
    args = make_args(cov_form=form, clip_cov_ratio=0.2, kl_cov_ratio=0.2, kl_cov_coef=0.7)
    rewards, mask, old, logps = rollout(2)
    adv = clip_cov.compute_advantages(rewards, args)
    sel, _ = select(logps, old, adv, mask, args)
    grads = []
    for s in (sel, torch.zeros_like(sel)):
        lp = logps.clone().requires_grad_(True)
        loss, _ = clip_cov.compute_policy_loss(lp, old, adv, mask, args, cov_select=s)
        grads.append(torch.autograd.grad(loss, lp)[0])
    with_s, without = grads
    assert int(sel.sum()) > 2 and (without[sel] != 0).all()
    assert torch.equal(with_s[~sel], without[~sel])
    if form == "clip":
        assert (with_s[sel] == 0).all()
    else:
        extra = args.kl_cov_coef * torch.sign(logps - old)[sel] / int(mask.sum())
        torch.testing.assert_close(with_s[sel] - without[sel], extra, rtol=0, atol=1e-15)


@pytest.mark.parametrize("form", ["clip", "kl"])
def test_on_policy_gradient_is_the_token_mean_policy_gradient(form):
    """At r = 1 (the first mini-batch): kl, -A / N on every token (|log r| has no gradient at 0, as in the official
    code); clip, the same except 0 on the selected tokens (nothing is PPO-clipped at r = 1)."""
    args = make_args(cov_form=form, clip_cov_ratio=0.2, kl_cov_ratio=0.2)
    rewards, mask, _, logps = rollout(4)
    adv = clip_cov.compute_advantages(rewards, args)
    sel, _ = select(logps, logps, adv, mask, args)
    lp = logps.clone().requires_grad_(True)
    loss, stats = clip_cov.compute_policy_loss(lp, logps, adv, mask, args, cov_select=sel)
    (grad,) = torch.autograd.grad(loss, lp)
    want = -adv[:, None].expand_as(grad) * mask / mask.sum()
    if form == "clip":
        want = torch.where(sel, 0.0, want)
    assert sel.any()
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("form", ["clip", "kl"])
def test_micro_batches_sum_to_the_mini_batch_gradient(form):
    args = make_args(cov_form=form, clip_cov_ratio=0.1, kl_cov_ratio=0.1, beta=0.04)
    rewards, mask, old, logps = rollout(5)
    adv = clip_cov.compute_advantages(rewards, args)
    sel, _ = select(logps, old, adv, mask, args)
    ref = old + 0.1
    keys = tuple(k for k in (CLIP_STATS if form == "clip" else KL_STATS) if k != "policy_loss")
    assert_micro_batches_add_up(
        clip_cov.compute_policy_loss,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=(*keys, "kl_ref"),
        ref_logps=ref,
        cov_select=sel,
    )


def test_selecting_inside_each_micro_batch_is_not_invariant():
    """What the official code does (cov_select=None: select inside the batch given): over three micro-batches it
    penalises other tokens (at least one per micro-batch) and the gradient differs from the mini-batch's."""
    args = make_args(cov_form="kl", kl_cov_ratio=0.05)
    rewards, mask, old, logps = rollout(6)
    adv = clip_cov.compute_advantages(rewards, args)
    lp = logps.clone().requires_grad_(True)
    whole, whole_stats = clip_cov.compute_policy_loss(lp, old, adv, mask, args)
    num_tokens, num_seqs = batching.grad_normalizers([mask[c] for c in (slice(0, 5), slice(5, 7), slice(7, 12))])
    parts = [
        clip_cov.compute_policy_loss(lp[c], old[c], adv[c], mask[c], args, num_tokens, num_seqs)
        for c in (slice(0, 5), slice(5, 7), slice(7, 12))
    ]
    g_whole = torch.autograd.grad(whole, lp)[0]
    g_split = torch.autograd.grad(sum(p[0] for p in parts), lp)[0]
    num_tokens = int(mask.sum())
    assert round(whole_stats["cov_selected_frac"].item() * num_tokens) == int(0.05 * num_tokens) == 2
    assert round(sum(p[1]["cov_selected_frac"].item() for p in parts) * num_tokens) == 3  # one per micro-batch
    assert (g_whole - g_split).abs().max() > 1e-3


def test_random_draw_is_uniform_over_the_candidates():
    """Over many keys, each candidate is selected with probability clip_num / #candidates (a binomial count within
    5 standard deviations), exactly clip_num of them every time, never a non-candidate; and pairs as often as a
    uniform subset draws them."""
    args = make_args(clip_cov_ratio=0.1, clip_cov_lb=0.0)
    rewards, mask, old, logps = rollout(7)
    adv = clip_cov.compute_advantages(rewards, args)
    clip_num = max(int(args.clip_cov_ratio * int(mask.sum())), 1)
    every = make_args(clip_cov_ratio=1.0, clip_cov_lb=0.0)  # all candidates
    in_order = lambda c: list(range(len(c)))
    cand_mask = torch.tensor(
        ref_clip_cov_select(logps.tolist(), old.tolist(), adv.tolist(), mask.tolist(), every, in_order)
    )
    num_cands = int(cand_mask.sum())
    assert clip_num >= 3 and num_cands >= clip_num + 3
    trials, counts, pair = 4000, torch.zeros(mask.shape), 0
    gen = torch.Generator().manual_seed(11)
    first_two = cand_mask.flatten().nonzero()[:2].flatten()
    for _ in range(trials):
        keys = torch.rand(mask.shape, dtype=torch.float64, generator=gen)
        sel = clip_cov.select_tokens(logps, old, adv, mask, args, keys)
        assert int(sel.sum()) == clip_num and not sel[~cand_mask].any()
        counts += sel
        pair += bool(sel.flatten()[first_two].all())
    p = clip_num / num_cands
    assert ((counts[cand_mask] - trials * p).abs() <= 5 * math.sqrt(trials * p * (1 - p))).all(), counts[cand_mask]
    p2 = clip_num * (clip_num - 1) / (num_cands * (num_cands - 1))
    assert abs(pair - trials * p2) <= 5 * math.sqrt(trials * p2 * (1 - p2))


def simulated_ranks(monkeypatch, fn, shares):
    """fn(share) on each simulated rank in its own thread, common.batching's global_sum / global_cat exchanging the
    ranks' tensors (in rank order) between the threads. Returns the results in rank order."""
    barrier, local, box, out = threading.Barrier(len(shares), timeout=30), threading.local(), {}, {}

    def exchange(x):
        box[local.rank] = x
        barrier.wait()
        parts = [box[r] for r in range(len(shares))]
        barrier.wait()
        return parts

    monkeypatch.setattr(batching, "global_sum", lambda x: sum(exchange(x)))
    monkeypatch.setattr(batching, "global_cat", lambda x: torch.cat(exchange(x)))

    def run(rank, share):
        local.rank = rank
        out[rank] = fn(share)

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate(shares)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [out[r] for r in range(len(shares))]


def select_on_ranks(monkeypatch, shares, logps, old, adv, mask, args, keys):
    """select_tokens on simulated ranks holding the rows `shares` (and their keys); their selections concatenated."""
    f = lambda s: clip_cov.select_tokens(logps[s], old[s], adv[s], mask[s], args, keys[s])
    parts = simulated_ranks(monkeypatch, f, shares)
    monkeypatch.undo()
    return torch.cat(parts)


@pytest.mark.parametrize(
    "kw",
    [
        {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.2},
        {"cov_form": "kl", "kl_cov_ratio": 0.1},
        {"cov_form": "kl"},
        {"cov_form": "kl", "kl_cov_ratio": 0.2, "ties": True},
    ],
)
def test_selection_over_ranks_equals_one_process(monkeypatch, kw):
    """Rows split over 2 and 3 simulated ranks, each with its own rows' keys: the union of the ranks' selections is the
    one-process selection (the means by global_sum, the k-th best by global_cat of each rank's best k)."""
    kw = dict(kw)
    ties = kw.pop("ties", False)
    args = make_args(**kw)
    for seed in range(10):
        rewards, mask, old, logps = rollout(seed, ties=ties)
        adv = clip_cov.compute_advantages(rewards, args)
        whole, keys = select(logps, old, adv, mask, args, seed)
        for shares in ([slice(0, 5), slice(5, 12)], [slice(0, 4), slice(4, 8), slice(8, 12)]):
            parts = select_on_ranks(monkeypatch, shares, logps, old, adv, mask, args, keys)
            assert torch.equal(parts, whole), (seed, shares)


@pytest.mark.parametrize("form", ["clip", "kl"])
def test_update_policy_selects_once_per_mini_batch_whatever_the_micro_batches(monkeypatch, form):
    """update_policy's S for each mini-batch is the same with one micro-batch per mini-batch, several, or
    token-budgeted ones (so is the resulting update); it covers only the mini-batch's rows; it is computed at
    pi_old on the first mini-batch and at the current policy on the later ones."""
    g = torch.Generator().manual_seed(3)
    n, p_len, c_len = 8, 2, 5
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 4, 2])
    mask = (torch.arange(c_len)[None] < lengths[:, None]).long()
    ids = torch.randint(0, 30, (n, p_len + c_len), generator=g)
    attn = torch.cat([torch.ones(n, p_len, dtype=torch.long), mask], 1)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    results = []
    for micro, tokens in [(8, 0), (1, 0), (3, 0), (3, 9)]:
        policy = TablePolicy(30)
        batch = {
            "ids": ids,
            "attn": attn,
            "mask": mask,
            "p_len": p_len,
            "advantages": adv,
            "lens": [(p_len, int(k)) for k in lengths],
            "old_logps": policy.theta.detach()[ids[:, p_len:]],
            "token_fields": declared_token_fields(clip_cov),
        }
        args = clip_cov.Args(
            cov_form=form,
            clip_cov_ratio=0.3,
            clip_cov_lb=-10.0,
            kl_cov_ratio=0.3,
            ppo_epochs=2,
            num_mini_batches=2,
            micro_batch_size=micro,
            micro_batch_tokens=tokens,
            max_grad_norm=1e9,
        )
        calls, select_tokens = [], clip_cov.select_tokens

        def record(now, old, advantages, m, args, keys, policy=policy, calls=calls, f=select_tokens):
            calls.append((f(now, old, advantages, m, args, keys), m, now, policy.theta.detach()[ids[:, p_len:]]))
            return calls[-1][0]

        monkeypatch.setattr(clip_cov, "select_tokens", record)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        clip_cov.update_policy(policy, optimizer, scheduler, SingleProcess(), batch, args, 0)
        assert len(calls) == 4  # 2 epochs x 2 mini-batches
        for j, (sel, m, now, current) in enumerate(calls):
            assert torch.equal(now, batch["old_logps"]) == (j == 0)  # pi_old, then recomputed
            assert ((now - current) * m).abs().max() < 1e-6  # at the current policy (compute_logps: fp32)
            assert j == 0 or ((current - batch["old_logps"]) * m).abs().max() > 1e-2  # which has moved
            assert sel.any() and not sel[m == 0].any()
        results.append(([c[0] for c in calls], policy.theta.detach().clone()))
    for sels, theta in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(sels, results[0][0]))
        torch.testing.assert_close(theta, results[0][1], rtol=0, atol=1e-12)


def test_defaults_are_the_official_recipes():
    """recipe/dapo/7b_clip_cov.sh and 7b_kl_cov.sh of PRIME-RL/Entropy-Mechanism-of-RL."""
    a = clip_cov.Args()
    assert a.cov_form == "clip"
    assert (a.clip_eps_low, a.clip_eps_high) == (1.0, 1.0)  # 7b_clip_cov.sh:17-18 clip_ratio_low/high=1
    assert (a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub) == (2e-4, 1.0, 5.0)  # 7b_clip_cov.sh:19-21
    assert a.kl_cov_ratio == 0.2 / 100  # 7b_kl_cov.sh:54 k_percent=0.2, a percent (core_algos.py: / 100)
    assert a.kl_cov_coef == 1.0  # 7b_kl_cov.sh:53 ppo_kl_coef=1
    assert a.beta == 0.0  # use_kl_loss=False, kl_loss_coef=0.0
    assert (a.model_name_or_path, a.group_size, a.learning_rate) == ("Qwen/Qwen2.5-7B", 8, 5e-7)  # :37, :105
    assert (a.max_prompt_tokens, a.max_new_tokens) == (2048, 8192)  # :23-24
    assert a.prompts_per_step == 256 and a.num_mini_batches == 256 // 32 and a.ppo_epochs == 1  # :34, :36
    assert (a.temperature, a.top_p, a.max_grad_norm, a.weight_decay) == (1.0, 1.0, 1.0, 0.0)
    assert a.adv_eps == 1e-6
