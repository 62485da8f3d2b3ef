"""gmpo.py's pure functions against float64 brute-force references.

GMPO's loss is per sequence: -A_i exp(1/|o_i| sum_t c_it) / G, with c_it the PPO pessimistic min of the token's
log-ratio d and its clip to [-eps_low, eps_high], taken in log space (min for A > 0, max for A <= 0). The loop
reference `ref_gmpo` writes it with Python loops and `math`; `official_gmpo` is the official code's formula
(callsys/GMPO train_zero_math_gmpo.py, critic_type_modify == "gmpo": the sign(A) trick, one sequence per backward
and the mean over the mini-batch by gradient accumulation)."""

from __future__ import annotations

import math

import pytest
import torch

import gmpo
import grpo
from tests.checks import assert_loss_matches_reference, assert_micro_batches_add_up, assert_standardised_advantages
from tests.reference import k3
from tests.test_rollout_correction import loop_weights

STATS = ("clip_frac_low", "clip_frac_high", "seq_ratio_mean", "approx_kl", "policy_loss")


def make_args(**kw):
    return gmpo.Args(**{"group_size": 4, **kw})


def clipped_log_ratio(d: float, a: float, lo: float, hi: float) -> float:
    dc = min(max(d, -lo), hi)
    return min(d, dc) if a > 0 else max(d, dc)


def ref_gmpo(logps, old, adv, mask, args, ref=None) -> float:
    """1/G sum_i [-A_i exp(1/|o_i| sum_t c_it) + beta 1/|o_i| sum_t k3_it], a sequence without tokens: 0."""
    total = 0.0
    for i in range(logps.shape[0]):
        a = adv[i].item()
        cs, kls, n = 0.0, 0.0, 0
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            d = logps[i, t].item() - old[i, t].item()
            cs += clipped_log_ratio(d, a, args.gmpo_clip_low, args.gmpo_clip_high)
            if args.beta > 0:
                kls += k3(logps[i, t].item(), ref[i, t].item())
            n += 1
        if n:
            total += -a * math.exp(cs / n) + args.beta * kls / n
    return total / logps.shape[0]


def official_gmpo(logps, old, adv, mask, cliprange):
    """The official per-sequence loss, transcribed: sgn = -1 if A >= 0 else 1; x = sgn * (new - old);
    d_max = sgn * max(x, clamp(x, -cliprange, cliprange)); ratio = exp(sum(d_max[mask]) / sum(mask)); loss = -A ratio.
    One sequence per backward (train_batch_size_per_device 1), averaged over the mini-batch by accumulation."""
    losses = []
    for i in range(logps.shape[0]):
        m = mask[i].bool()
        sgn = -1 if adv[i] >= 0 else 1
        x = sgn * (logps[i] - old[i])
        x_max = torch.max(x, torch.clamp(x, torch.tensor(-cliprange).to(x), torch.tensor(cliprange).to(x)))
        ratio = torch.exp((sgn * x_max)[m].sum() / m.sum())
        losses.append(-adv[i] * ratio)
    return torch.stack(losses).mean()


def rollout(seed, groups=3, g=4, t=6, spread=0.5, empty_row=None):
    """Log-ratios of about +-1 (many beyond the 0.4 log-space clip on either side), both advantage signs, one
    all-correct group (A = 0), garbage in the padding; `empty_row`: a sequence without tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:g] = 1.0  # one all-correct group: its advantage must be exactly 0
    rewards[g : 2 * g] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # the others both right and wrong answers
    rewards[2 * g : 3 * g] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    if empty_row is not None:
        lengths[empty_row] = 0
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(n, t, dtype=torch.float64, generator=gen) * 3
    logps = old + spread * torch.randn(n, t, dtype=torch.float64, generator=gen)
    ref = old + 0.1 * torch.randn(n, t, dtype=torch.float64, generator=gen)
    logps = torch.where(mask.bool(), logps, torch.full_like(logps, -7.0))  # garbage in the padding
    old = torch.where(mask.bool(), old, torch.full_like(old, 2.0))
    return rewards, mask, old, logps, ref


def test_advantages_match_reference_and_grpos():
    args = make_args()
    rewards, *_ = rollout(0)
    got = assert_standardised_advantages(gmpo.compute_advantages, rewards, args)
    assert (got[:4] == 0).all()
    assert torch.equal(got, grpo.compute_advantages(rewards, grpo.Args(group_size=4)))


@pytest.mark.parametrize(
    "kw", [{}, {"beta": 0.04}, {"gmpo_clip_low": 0.2, "gmpo_clip_high": 0.3}, {"gmpo_clip_low": 1.0}]
)
def test_policy_loss_value_and_gradient_match_loop_reference(kw):
    args = make_args(**kw)
    rewards, mask, old, logps, ref = rollout(1, empty_row=9)
    adv = gmpo.compute_advantages(rewards, args)
    assert adv[9] != 0  # the empty sequence has an advantage, and still contributes nothing
    reference = lambda lp: ref_gmpo(lp, old, adv, mask, args, ref)
    keys = STATS + (("kl_ref",) if args.beta else ())
    _, stats = assert_loss_matches_reference(
        gmpo.compute_policy_loss, reference, logps, old, adv, mask, args, stat_keys=keys, ref_logps=ref
    )
    assert ("kl_ref" in stats) == (args.beta > 0)
    d, a, m = logps - old, adv[:, None], mask.bool()
    n_tok = m.sum().item()
    want_low = ((d < -args.gmpo_clip_low) & (a < 0) & m).sum().item() / n_tok
    want_high = ((d > args.gmpo_clip_high) & (a > 0) & m).sum().item() / n_tok
    assert stats["clip_frac_low"].item() == pytest.approx(want_low)
    assert stats["clip_frac_high"].item() == pytest.approx(want_high)
    assert 0 < want_low + want_high and (kw or (want_low > 0 and want_high > 0))  # clipped tokens on both sides


def test_gradient_is_the_sequence_ratio_when_unclipped_and_zero_when_clipped():
    """d loss / d logp_it = -A_i s_i / (|o_i| G) for an unclipped token (s_i: the clipped geometric-mean ratio,
    the same for all of the sequence's tokens), exactly 0 for a token clipped in its advantage's direction."""
    args = make_args()
    rewards, mask, old, logps, _ = rollout(2)
    adv = gmpo.compute_advantages(rewards, args)
    x = logps.detach().clone().requires_grad_(True)
    loss, stats = gmpo.compute_policy_loss(x, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, x)
    b, clipped, kept, ratios = x.shape[0], 0, 0, []
    for i in range(b):
        a, n_i = adv[i].item(), int(mask[i].sum())
        ds = [logps[i, t].item() - old[i, t].item() for t in range(n_i)]
        s = math.exp(sum(clipped_log_ratio(d, a, 0.4, 0.4) for d in ds) / n_i)
        ratios.append(s)
        for t, d in enumerate(ds):
            if (a > 0 and d > 0.4) or (a < 0 and d < -0.4):
                assert grad[i, t].item() == 0.0
                clipped += 1
            else:
                assert grad[i, t].item() == pytest.approx(-a * s / (n_i * b), rel=1e-12, abs=1e-16)
                kept += a != 0
    assert clipped >= 3 and kept >= 10
    assert stats["seq_ratio_mean"].item() == pytest.approx(sum(ratios) / b, rel=1e-12)


def test_matches_the_official_code():
    """Loss and gradient equal the official code's formula (sign trick, torch.max with the clamp), float64. Its
    clip bounds are fp32 tensors (torch.tensor(0.4) = 0.4000000059604645): given the same bound, the two agree."""
    args = make_args(gmpo_clip_low=torch.tensor(0.4).item(), gmpo_clip_high=torch.tensor(0.4).item())
    rewards, mask, old, logps, _ = rollout(3)
    adv = gmpo.compute_advantages(rewards, args)
    x = logps.detach().clone().requires_grad_(True)
    loss, _ = gmpo.compute_policy_loss(x, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, x)
    y = logps.detach().clone().requires_grad_(True)
    want = official_gmpo(y, old, adv, mask, 0.4)
    (want_grad,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad * mask, want_grad * mask, rtol=0, atol=1e-15)


def test_on_policy_gradient_equals_grpos():
    """old = logps.detach(): d = 0 inside the clip range, s_i = 1, and the gradient is GRPO's with beta = 0,
    -A_i / (G |o_i|) per token (both are 1/G sum 1/|o| A grad log pi at r = 1); so is the loss, -mean A."""
    args = make_args()
    rewards, mask, _, logps, _ = rollout(4)
    adv = gmpo.compute_advantages(rewards, args)
    x = logps.detach().clone().requires_grad_(True)
    loss, stats = gmpo.compute_policy_loss(x, x.detach(), adv, mask, args)
    (g_gmpo,) = torch.autograd.grad(loss, x)
    loss_grpo, _ = grpo.compute_policy_loss(x, x.detach(), adv, mask, grpo.Args(group_size=4, beta=0.0))
    (g_grpo,) = torch.autograd.grad(loss_grpo, x)
    torch.testing.assert_close(g_gmpo, g_grpo, rtol=0, atol=1e-16)
    torch.testing.assert_close(loss, loss_grpo, rtol=0, atol=1e-16)
    assert g_gmpo.abs().max() > 0.01
    assert stats["seq_ratio_mean"].item() == 1.0 and stats["clip_frac_low"].item() == 0


@pytest.mark.parametrize("outlier", [10.0, 100.0, 1e4])
def test_an_outlier_ratio_moves_the_loss_less_than_in_grpo(outlier):
    """A sequence of 4 tokens with A = -1 (neither loss clips a ratio that rose against a negative advantage), all
    on-policy but one token at ratio R: GRPO's loss rises by (R - 1) / 4 (the arithmetic mean), GMPO's by
    R^(1/4) - 1 (the geometric mean); the largest token gradient is R / 4 in GRPO, R^(1/4) / 4 in GMPO."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 4)
    base = torch.zeros(1, 4, dtype=torch.float64)
    bumped = base.clone()
    bumped[0, 1] = math.log(outlier)
    out = {}
    for name, mod, args in (("gmpo", gmpo, make_args()), ("grpo", grpo, grpo.Args(group_size=4, beta=0.0))):
        losses, grads = [], []
        for lp in (base, bumped):
            x = lp.clone().requires_grad_(True)
            loss, _ = mod.compute_policy_loss(x, old, adv, mask, args)
            losses.append(loss.item())
            grads.append(torch.autograd.grad(loss, x)[0])
        out[name] = (losses[1] - losses[0], grads[1].abs().max().item())
    assert out["grpo"][0] == pytest.approx((outlier - 1) / 4, rel=1e-12)
    assert out["gmpo"][0] == pytest.approx(outlier**0.25 - 1, rel=1e-12)
    assert out["gmpo"][0] < out["grpo"][0] and out["gmpo"][1] < out["grpo"][1]
    assert out["gmpo"][1] == pytest.approx(outlier**0.25 / 4, rel=1e-12)


def test_clip_is_in_log_space_and_in_the_advantages_direction():
    """Ratios e^0.5 and e^-0.5 (|log r| = 0.5 > 0.4) and e^0.3 (inside): with A > 0 only the raised token is clipped
    (c = 0.4), with A < 0 only the lowered one (c = -0.4); the other side keeps its log-ratio (PPO's min)."""
    args = make_args()
    d = torch.tensor([[0.5, -0.5, 0.3], [0.5, -0.5, 0.3]], dtype=torch.float64)
    x = d.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = gmpo.compute_policy_loss(x, torch.zeros(2, 3, dtype=torch.float64), adv, torch.ones(2, 3), args)
    (grad,) = torch.autograd.grad(loss, x)
    s_pos, s_neg = math.exp((0.4 - 0.5 + 0.3) / 3), math.exp((0.5 - 0.4 + 0.3) / 3)
    assert loss.item() == pytest.approx((-s_pos + s_neg) / 2, rel=1e-12)
    assert grad[0, 0] == 0 and grad[1, 1] == 0
    for i, t, a, s in ((0, 1, 1, s_pos), (0, 2, 1, s_pos), (1, 0, -1, s_neg), (1, 2, -1, s_neg)):
        assert grad[i, t].item() == pytest.approx(-a * s / 6, rel=1e-12)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert stats["seq_ratio_mean"].item() == pytest.approx((s_pos + s_neg) / 2, rel=1e-12)


@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"])
def test_rollout_correction_weights_each_sequence_by_its_geometric_mean_weight(mode):
    """The correction's token weights w_it (a loop, tests/test_rollout_correction.py) enter as one detached weight
    per sequence, exp(mean_t log w_it) (verl's geo_mean): the loss and gradient of sequence i are W_i times the
    uncorrected ones; a *-mask zero drops the whole sequence; the KL term (beta > 0) is not weighted."""
    args = make_args(rollout_correction=mode, rollout_correction_cap=2.0, beta=0.04)
    rewards, mask, old, logps, ref = rollout(5, spread=0.3)
    gen = torch.Generator().manual_seed(7)
    sampler = old + 0.4 * torch.randn(old.shape, dtype=torch.float64, generator=gen)
    adv = gmpo.compute_advantages(rewards, args)
    w = loop_weights(old, sampler, mask, mode, 2.0)
    seq_w = []
    for i in range(len(w)):
        logs = [math.log(w[i][t]) if w[i][t] > 0 else -math.inf for t in range(mask.shape[1]) if mask[i, t]]
        seq_w.append(math.exp(sum(logs) / len(logs)))
    seq_w = torch.tensor(seq_w, dtype=torch.float64)
    if mode.endswith("mask"):
        assert ((seq_w == 0) & (adv != 0)).any() and (seq_w > 0).any()

    def grads(a, rc, beta):
        x = logps.detach().clone().requires_grad_(True)
        extra = {"rollout_logps": sampler} if rc else {}
        kw = {"rollout_correction": mode if rc else "none", "rollout_correction_cap": 2.0, "beta": beta}
        loss, stats = gmpo.compute_policy_loss(x, old, a, mask, make_args(**kw), ref_logps=ref, **extra)
        return torch.autograd.grad(loss, x)[0], stats

    got, stats = grads(adv, True, 0.04)
    policy, _ = grads(adv, False, 0.0)
    kl_only, _ = grads(torch.zeros_like(adv), False, 0.04)
    want = seq_w[:, None] * policy + kl_only
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert "rollout_corr_weight_mean" in stats


def test_micro_batches_sum_to_the_mini_batch_gradient_and_stats():
    args = make_args(beta=0.04)
    rewards, mask, old, logps, ref = rollout(6, empty_row=6)
    adv = gmpo.compute_advantages(rewards, args)
    assert_micro_batches_add_up(
        gmpo.compute_policy_loss,
        logps,
        old,
        adv,
        mask,
        args,
        stat_keys=("clip_frac_low", "clip_frac_high", "seq_ratio_mean", "approx_kl", "kl_ref"),
        ref_logps=ref,
    )
    sampler = old + 0.3
    rc = make_args(rollout_correction="token-mask", rollout_correction_cap=1.2)
    assert_micro_batches_add_up(gmpo.compute_policy_loss, logps, old, adv, mask, rc, rollout_logps=sampler)


def test_defaults_are_the_official_scripts():
    """callsys/GMPO scripts/qwen2.5-math-7b-gmpo.sh (oat): CLIPRANGE=0.4, --beta 0, --critic_type grpo,
    Qwen2.5-Math-7B, qwen_math template, N_SAMPLE=8, rollout_batch_size 128, generate_max_length 3000,
    prompt_max_length 1024, lr 1e-6 constant, temperature 1, top_p 1, train_batch_size 128 (of 1024 samples: 8
    optimizer steps), --num_ppo_epochs 1; --eval_temperature 0.6 --eval_top_p 0.95 --eval_n 16
    --eval_generate_max_length 3000."""
    a = gmpo.Args()
    assert (a.gmpo_clip_low, a.gmpo_clip_high, a.beta) == (0.4, 0.4, 0.0)
    assert not hasattr(a, "clip_eps_low") and not hasattr(a, "clip_eps_high")
    assert (a.model_name_or_path, a.prompt_template) == ("Qwen/Qwen2.5-Math-7B", "qwen-boxed")
    assert (a.group_size, a.prompts_per_step, a.max_new_tokens, a.max_prompt_tokens) == (8, 128, 3000, 1024)
    assert (a.learning_rate, a.warmup_steps, a.temperature, a.top_p) == (1e-6, 0, 1.0, 1.0)
    assert (a.num_mini_batches, a.ppo_epochs) == (8, 1)
    assert a.group_size * a.prompts_per_step // a.num_mini_batches == 128
    assert (a.eval_temperature, a.eval_top_p, a.eval_samples, a.eval_max_new_tokens) == (0.6, 0.95, 16, 3000)
    import dr_grpo  # the official MATH levels 3-5 have no hub id: dr_grpo.py's data default and its explanation

    d = dr_grpo.Args()
    assert (a.dataset_name, a.prompt_column, a.answer_column) == (d.dataset_name, d.prompt_column, d.answer_column)
