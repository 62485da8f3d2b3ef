"""ppo.py's pure functions and the critic (common/critic.py) against float64 brute-force references written with
loops: GAE as the sum of discounted TD errors (masked spans carried), the outcome reward's position, the
whitening, the clipped value loss and its clip fraction, the policy loss with per-token advantages; the critic's
values against its backbone's own forward; the critic's update in one or several micro-batches; LoRA; resume."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

import ppo
from common.batching import make_batch
from common.critic import TokenValues, build_critic, compute_values, value_metrics
from common.sampling import Completion
from tests.checks import (
    PPO_CLIP_STATS,
    SingleProcess,
    assert_grad_matches_finite_differences,
    assert_loss_matches_reference,
    assert_micro_batches_add_up,
    run_scripts,
)
from tests.reference import aggregate, ppo_clip_token

F64 = torch.float64


def make_args(**kw):
    return ppo.Args(**{"group_size": 4, **kw})


# brute-force references ----------------------------------------------------------------------------------------


def brute_gae(rewards, values, mask, gamma, lams):
    """GAE as its definition, A_j = sum_k (gamma lam)^k delta_{j+k} over a row's unmasked positions j (delta_j = r_j +
    gamma V_next - V_j, V_next the next unmasked position's value, 0 after the last); a masked position takes the
    advantage of the next unmasked one to its right (0 if none): verl's carry. Returns (advantages, returns) lists."""
    advantages, returns = [], []
    for i, row in enumerate(mask):
        kept = [t for t, m in enumerate(row) if m]
        deltas = []
        for n, t in enumerate(kept):
            v_next = values[i][kept[n + 1]] if n + 1 < len(kept) else 0.0
            deltas.append(rewards[i][t] + gamma * v_next - values[i][t])
        adv_kept = [sum((gamma * lams[i]) ** k * deltas[n + k] for k in range(len(kept) - n)) for n in range(len(kept))]
        row_adv = []
        for t in range(len(row)):
            right = [n for n, s in enumerate(kept) if s >= t]
            row_adv.append(adv_kept[right[0]] if right else 0.0)
        advantages.append(row_adv)
        returns.append([a + v for a, v in zip(row_adv, values[i])])
    return advantages, returns


def loop_gae(rewards, values, mask, gamma, lam):
    """The scripts' former GAE, a loop over positions right to left (verl's compute_gae_advantage_return with the
    carry over masked positions), kept as the reference of the scan that replaced it. Tensors in and out."""
    lam = torch.as_tensor(lam, dtype=values.dtype)
    next_value, running = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        keep = mask[:, t] > 0
        next_value = torch.where(keep, values[:, t], next_value)
        running = torch.where(keep, delta + gamma * lam * running, running)
        advantages[:, t] = running
    return advantages, advantages + values


def brute_whiten(advantages, mask, unbiased=False, eps=1e-8):
    """(A - mean) / sqrt(var) over the masked entries, 0 elsewhere: ORZ's var clamped at eps (population), verl's
    var + eps (unbiased)."""
    kept = [a for row, m in zip(advantages, mask) for a, k in zip(row, m) if k]
    mean = sum(kept) / len(kept)
    var = sum((a - mean) ** 2 for a in kept) / (len(kept) - 1 if unbiased else len(kept))
    scale = 1 / math.sqrt(var + eps) if unbiased else 1 / math.sqrt(max(var, eps))
    return [[(a - mean) * scale if k else 0.0 for a, k in zip(row, m)] for row, m in zip(advantages, mask)]


def brute_value_loss(values, old, returns, mask, clip):
    """1/2 token mean of max((V - R)^2, (clip(V, old - c, old + c) - R)^2), loop by loop (clip None: unclipped)."""
    per_token = []
    for v_row, o_row, r_row in zip(values, old, returns):
        row = []
        for v, o, r in zip(v_row, o_row, r_row):
            loss = (v - r) ** 2
            if clip is not None:
                loss = max(loss, (min(max(v, o - clip), o + clip) - r) ** 2)
            row.append(0.5 * loss)
        per_token.append(row)
    return aggregate(per_token, mask, "token-mean")


def rollout(seed, b=6, t=7, interior_gaps=True):
    """Random float64 rewards, values and a mask with right padding and (optionally) masked spans inside."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    if interior_gaps:
        mask[0, 2:4] = 0  # a tool's output inside a completion
        mask[1, 1] = 0
    rewards = torch.randint(0, 2, (b,), generator=g).to(F64)
    values = torch.rand(b, t, dtype=F64, generator=g) * 2 - 0.5
    return rewards, values, mask


# GAE -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, "per-row")])
def test_gae_is_the_sum_of_discounted_td_errors_with_masked_spans_carried(gamma, lam):
    rewards, values, mask = rollout(0)
    token_rewards = ppo.outcome_token_rewards(rewards, mask)
    token_rewards[2, 0] = 0.3  # an intermediate reward too (a KL or process reward would sit there)
    lams = torch.linspace(0.0, 1.0, len(rewards), dtype=F64) if lam == "per-row" else torch.full((6,), lam, dtype=F64)
    got_adv, got_ret = ppo.compute_gae(token_rewards, values, mask, gamma, lams if lam == "per-row" else lam)
    want_adv, want_ret = brute_gae(token_rewards.tolist(), values.tolist(), mask.tolist(), gamma, lams.tolist())
    # <= 7 terms of size <= 3 per sum, each rounding once: 1e-14 is ~10x gamma_14(fp64) * 21
    torch.testing.assert_close(got_adv, torch.tensor(want_adv, dtype=F64), rtol=0, atol=1e-13)
    torch.testing.assert_close(got_ret, torch.tensor(want_ret, dtype=F64), rtol=0, atol=1e-13)


def test_a_masked_span_is_skipped_whatever_its_values():
    """gamma = lam = 1, R = 1 on the last token: A_t = R - V(s_t) at every kept token; the masked span's values (a
    tool's output) neither enter the TD errors nor stop the running advantage, which it carries (verl). OpenRLHF
    zeroes them instead (values * mask), which for an interior span gives other advantages (docs/algorithms.md)."""
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    values = torch.tensor([[0.1, 0.2, 0.7, 0.8, 0.3]], dtype=F64)
    rewards = ppo.outcome_token_rewards(torch.tensor([1.0], dtype=F64), mask)
    adv, ret = ppo.compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.7, 0.7, 0.7]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(ret[0, [0, 1, 4]], torch.ones(3, dtype=F64), rtol=0, atol=1e-15)  # Monte-Carlo R
    other = values.clone()
    other[0, 2:4] = torch.tensor([-5.0, 9.0])
    assert torch.equal(ppo.compute_gae(rewards, other, mask, 1.0, 1.0)[0], adv)


def long_rollout(seed, b=9, t=300):
    """Rows of up to `t` tokens with masked spans of every kind: leading, interior (many, some one token long),
    trailing padding, a row with no kept token, a row of one kept token; intermediate rewards on kept tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[0] = 1
    mask[1, : t // 6] = 0  # a masked span at the start
    mask[2] = 0  # nothing kept
    mask[3] = 0
    mask[3, t // 2] = 1  # one kept token
    mask[4:, t // 2 + 1 :] = 0  # trailing padding
    mask[5, t // 3 : t // 2] = 0  # a long interior span
    values = torch.rand(b, t, dtype=F64, generator=g) * 2 - 0.5
    rewards = torch.randn(b, t, dtype=F64, generator=g) * (torch.rand(b, t, generator=g) < 0.05) * mask
    return rewards, values, mask


@pytest.mark.parametrize("t", [1, 2, 5, 64, 300])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.0, 1.0), (1.0, "per-row")])
def test_gae_scan_equals_the_loop_over_positions(t, gamma, lam):
    """The scan against the loop it replaced, in float64, on long rows with masked spans everywhere: equal to a few
    roundings of the sums (<= 300 terms of size <= 4, added in another order: 1e-12). gamma lam = 0 (TD(0)) and per-row
    lambdas in [0, 1] (vapo.py's policy lambda) included; float32 inputs give float32 out, within its rounding."""
    rewards, values, mask = long_rollout(t, t=t)
    lams = torch.linspace(0.0, 1.0, len(mask), dtype=F64) if lam == "per-row" else lam
    got = ppo.compute_gae(rewards, values, mask, gamma, lams)
    want = loop_gae(rewards, values, mask, gamma, lams)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    got32 = ppo.compute_gae(rewards.float(), values.float(), mask, gamma, lams)
    assert got32[0].dtype == torch.float32
    torch.testing.assert_close(got32[0], want[0].float(), rtol=0, atol=1e-3)


def test_the_outcome_reward_sits_on_the_last_kept_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 0, 1]])
    got = ppo.outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0, 5.0]), mask)
    want = torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 3.0], [4.0, 0, 0, 0], [0, 0, 0, 5.0]])
    assert torch.equal(got, want)


def test_whitening_matches_a_loop_over_every_kept_token():
    _, values, mask = rollout(1)
    got = ppo.whiten(values, mask)
    want = brute_whiten(values.tolist(), mask.tolist())
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-13)
    assert torch.equal(got[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=F64))
    # equal advantages whiten to their mean's rounding error times 1e4 (var clamped at 1e-8), as in ORZ and verl
    assert ppo.whiten(torch.full((2, 3), 0.7, dtype=F64), torch.ones(2, 3)).abs().max() < 1e-10


def test_advantages_with_gamma_and_lambda_one_are_r_minus_v_whitened():
    rewards, values, mask = rollout(2, interior_gaps=False)
    adv, ret = ppo.compute_advantages(rewards, values, mask, make_args())
    raw = [[(rewards[i] - values[i, t]).item() if mask[i, t] else 0.0 for t in range(7)] for i in range(6)]
    torch.testing.assert_close(adv, torch.tensor(brute_whiten(raw, mask.tolist()), dtype=F64), rtol=0, atol=1e-13)
    torch.testing.assert_close(ret[mask > 0], rewards[:, None].expand_as(ret)[mask > 0], rtol=0, atol=1e-15)


# the value loss -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_value_gradient_and_clip_fraction_match_a_loop(clip):
    rewards, old, mask = rollout(3)
    returns = ppo.compute_gae(ppo.outcome_token_rewards(rewards, mask), old, mask, 1.0, 1.0)[1]
    g = torch.Generator().manual_seed(4)
    # moves of 0.05-0.15 and 0.25-0.6 from the old values: inside and outside a 0.2 clip, away from its edges
    step = torch.where(torch.rand(old.shape, generator=g) < 0.5, 0.1, 0.4) + 0.05 * torch.rand(old.shape, generator=g)
    values = (old + step * torch.sign(torch.randn(old.shape, generator=g, dtype=F64))).requires_grad_(True)
    args = make_args(value_clip=clip)
    loss, stats = ppo.compute_value_loss(values, old, returns, mask, args)

    def reference(v):
        return brute_value_loss(v.tolist(), old.tolist(), returns.tolist(), mask.tolist(), clip)

    assert abs(loss.item() - reference(values.detach())) < 1e-13
    (grad,) = torch.autograd.grad(loss, values)
    assert assert_grad_matches_finite_differences(grad, reference, values) >= 10
    frac = sum(
        int(k) * ((min(max(v, o - clip), o + clip) - r) ** 2 > (v - r) ** 2 if clip else 0)
        for vr, orow, rr, mr in zip(values.tolist(), old.tolist(), returns.tolist(), mask.tolist())
        for v, o, r, k in zip(vr, orow, rr, mr)
    ) / int(mask.sum())
    assert stats["value_clip_frac"].item() == pytest.approx(frac, rel=1e-6) and (frac > 0) == (clip is not None)


def test_value_loss_of_micro_batches_adds_up_to_the_mini_batch():
    rewards, old, mask = rollout(5, b=12)
    returns = ppo.compute_gae(ppo.outcome_token_rewards(rewards, mask), old, mask, 1.0, 1.0)[1]
    noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    values = (old + 0.3 * noise).requires_grad_()
    args = make_args()
    loss, stats = ppo.compute_value_loss(values, old, returns, mask, args)
    (whole,) = torch.autograd.grad(loss, values)
    from common.batching import grad_normalizers
    from tests.checks import MICRO_CHUNKS

    num_tokens, _ = grad_normalizers([mask[c] for c in MICRO_CHUNKS])
    parts = [ppo.compute_value_loss(values[c], old[c], returns[c], mask[c], args, num_tokens) for c in MICRO_CHUNKS]
    (split,) = torch.autograd.grad(sum(p[0] for p in parts), values)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-14)
    assert sum(p[1]["value_clip_frac"] for p in parts).item() == pytest.approx(stats["value_clip_frac"].item())


# the policy loss ------------------------------------------------------------------------------------------------


def policy_case(seed=7, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]).long()
    old = -torch.rand(b, t, dtype=F64, generator=g) * 3
    logps = old + 0.4 * torch.randn(b, t, dtype=F64, generator=g)
    adv = torch.randn(b, t, dtype=F64, generator=g)  # one advantage per token
    return logps, old, adv, mask


def test_policy_loss_with_per_token_advantages_matches_a_loop():
    logps, old, adv, mask = policy_case()
    args = make_args()

    def reference(lp):
        per_token = [
            [ppo_clip_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.2) for t in range(5)]
            for i in range(6)
        ]
        return aggregate(per_token, mask.tolist(), "token-mean")

    assert_loss_matches_reference(ppo.compute_policy_loss, reference, logps, old, adv, mask, args)


def test_policy_loss_of_micro_batches_adds_up():
    logps, old, adv, mask = policy_case(8, b=12)
    assert_micro_batches_add_up(ppo.compute_policy_loss, logps, old, adv, mask, make_args(), PPO_CLIP_STATS)


# the critic -----------------------------------------------------------------------------------------------------


def toy_critic(path, std=0.3):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    critic = TokenValues(lm.get_decoder(), lm.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight, std=std, generator=torch.Generator().manual_seed(0))
    return critic, lm


def toy_batch():
    g = torch.Generator().manual_seed(1)
    completions = [Completion(torch.randint(3, 60, (k,), generator=g).tolist(), "", False) for k in (3, 5, 2, 4, 1, 5)]
    return make_batch([[5, 6, 7], [8, 9], [10]], completions, 0, "cpu", ["old_values", "returns", "advantages"])


def test_critic_values_are_the_head_on_the_hidden_state_before_each_token(toy_assets):
    """Each row alone, unpadded, through the backbone's own forward: V(s_t) = w . h_{p + t - 1}, the state in which
    completion token t was sampled; the zero-initialised head gives V = 0."""
    critic, lm = toy_critic(toy_assets["model"])
    batch = toy_batch()
    with torch.no_grad():
        got = critic(batch["ids"], batch["attn"], batch["p_len"])
        for i, (p, c) in enumerate(batch["lens"]):
            ids = batch["ids"][i, batch["p_len"] - p : batch["p_len"] + c][None]
            hidden = lm(ids, output_hidden_states=True).hidden_states[-1][0]
            want = hidden[p - 1 : p + c - 1] @ critic.value_head.weight[0]
            torch.testing.assert_close(got[i, :c], want, rtol=1e-10, atol=1e-12)
    assert got.dtype == F64
    fresh = TokenValues(lm.get_decoder(), lm.config.hidden_size)
    assert torch.equal(fresh(batch["ids"], batch["attn"], batch["p_len"]), torch.zeros_like(got))


def test_update_critic_in_micro_batches_gives_the_whole_mini_batchs_step(toy_assets):
    """One critic optimizer step (SGD, lr 1, no clipping) on a rollout: in one micro-batch and in micro-batches of 2
    rows with the mini-batch's token count, the same parameters after it (the backbone moves too: the head is not 0)."""
    after = []
    for micro in (16, 2):
        critic, _ = toy_critic(toy_assets["model"])
        args = make_args(group_size=2, micro_batch_size=micro, micro_batch_tokens=0, critic_num_mini_batches=1)
        args.critic_max_grad_norm = 1e9
        batch = toy_batch()
        plan = ppo.micro_batches(list(range(6)), batch["lens"], args)
        with torch.no_grad():
            batch["old_values"] = compute_values(critic, batch, plan).to(F64)
        batch["advantages"], batch["returns"] = ppo.compute_advantages(
            torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=F64), batch["old_values"], batch["mask"], args
        )
        optimizer = torch.optim.SGD(critic.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        before = {k: v.clone() for k, v in critic.state_dict().items()}
        stats = ppo.update_critic(critic, optimizer, scheduler, SingleProcess(), batch, args, 0)
        assert stats["value_loss"] > 0 and stats["critic_skipped_updates"] == 0
        after.append({k: before[k] - v for k, v in critic.state_dict().items()})
    assert after[0]["backbone.layers.0.mlp.up_proj.weight"].abs().max() > 1e-8
    for k in after[0]:
        torch.testing.assert_close(after[1][k], after[0][k], rtol=1e-9, atol=1e-12, msg=k)


def test_value_metrics_match_a_loop():
    rewards, values, mask = rollout(9)
    returns = ppo.compute_gae(ppo.outcome_token_rewards(rewards, mask), values, mask, 1.0, 1.0)[1]
    adv = ppo.whiten(returns - values, mask)
    got = value_metrics(values, returns, adv, mask)
    kept = [(v, r, a) for vr, rr, ar, mr in zip(values.tolist(), returns.tolist(), adv.tolist(), mask.tolist())
            for v, r, a, k in zip(vr, rr, ar, mr) if k]  # fmt: skip
    n = len(kept)

    def var(xs):
        return sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)

    ev = 1 - var([r - v for v, r, _ in kept]) / (var([r for _, r, _ in kept]) + 1e-5)
    assert got["explained_variance"].item() == pytest.approx(ev, rel=1e-6)
    assert got["value_mean"].item() == pytest.approx(sum(v for v, _, _ in kept) / n, rel=1e-6)
    assert got["return_mean"].item() == pytest.approx(sum(r for _, r, _ in kept) / n, rel=1e-6)
    advs = [a for a, k in zip(adv.flatten().tolist(), mask.flatten().tolist()) if k]  # all positions < 16
    mean = sum(advs) / len(advs)
    assert got["adv_mean_pos0"].item() == pytest.approx(mean, abs=1e-6)
    assert got["adv_std_pos0"].item() == pytest.approx(math.sqrt(var(advs)), rel=1e-6)
    assert math.isnan(got["adv_mean_pos16"].item())


def test_a_lora_critic_trains_its_adapters_and_head_only(toy_assets):
    args = make_args(lora_rank=2)
    critic = build_critic(toy_assets["model"], args)
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert "value_head.weight" in trainable and trainable - {"value_head.weight"}
    assert all("lora_" in n for n in trainable - {"value_head.weight"})
    assert not any("lm_head" in n for n, _ in critic.named_parameters())  # the output layer is dropped


class MainProcess:
    """The accelerate calls save_critic makes, on one process with an unwrapped critic."""

    is_main_process = True

    def get_state_dict(self, module):
        return module.state_dict()

    def unwrap_model(self, module):
        return module


def critic_values(critic, batch):
    with torch.no_grad():
        return critic(batch["ids"], batch["attn"], batch["p_len"]) * batch["mask"]


@pytest.mark.parametrize("family,lora", [("qwen2", 0), ("qwen2", 2), ("cohere", 0)])
def test_a_saved_critic_loads_back_with_its_values(family, lora, tmp_path):
    """save_critic writes a Hugging Face model that --critic-model-name-or-path (build_critic) and, where transformers
    has the family's sequence classifier, AutoModelForSequenceClassification read back with the same values: the
    head (not the zero a fresh critic starts with), the decoder, LoRA's adapters merged (Cohere has no classifier
    class: its decoder and value_head.safetensors)."""
    from transformers import AutoModelForSequenceClassification

    from common.critic import save_critic
    from tests.test_families import tiny

    tiny(family).save_pretrained(tmp_path / "base")
    args = make_args(lora_rank=lora)
    critic = build_critic(str(tmp_path / "base"), args)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in critic.parameters():  # a trained critic: every weight moved, the adapters' B too
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_critic(MainProcess(), critic, str(tmp_path / "critic"))
    batch = toy_batch()
    want = critic_values(critic, batch)
    assert want.abs().sum() > 0
    back = build_critic(str(tmp_path / "critic"), make_args())
    torch.testing.assert_close(critic_values(back, batch), want, rtol=1e-5, atol=1e-6)  # merged LoRA: rounding
    if family == "cohere":
        assert os.path.exists(tmp_path / "critic" / "value_head.safetensors")
        return
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "critic")).eval()
    position_ids = (batch["attn"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = hf.model(input_ids=batch["ids"], attention_mask=batch["attn"], position_ids=position_ids)[0]
        values = hf.score(hidden[:, batch["p_len"] - 1 : -1]).squeeze(-1) * batch["mask"]
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-6)


def test_save_checkpoint_refuses_a_prepared_model_it_is_not_given():
    """accelerate's state holds every prepared model in order; a script that prepares one more (a critic) and does
    not pass it would write it there unnamed, and no Hugging Face copy of it."""
    from types import SimpleNamespace

    from common.run import save_checkpoint

    policy, critic = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    run = SimpleNamespace(accelerator=SimpleNamespace(_models=[policy, critic], unwrap_model=lambda m: m))
    with pytest.raises(RuntimeError, match=r"2 prepared models, named \['policy'\]"):
        save_checkpoint(run, policy, None, None, None, 1)
    with pytest.raises(RuntimeError, match="named \\['policy', 'critic'\\]"):
        save_checkpoint(run, policy, None, None, None, 1, critic=torch.nn.Linear(1, 1))


def test_defaults_are_the_papers():
    a = ppo.Args()
    assert (a.gamma, a.lam, a.clip_eps_low, a.clip_eps_high, a.value_clip) == (1.0, 1.0, 0.2, 0.2, 0.2)
    assert (a.critic_learning_rate, a.critic_warmup_steps, a.critic_weight_decay) == (5e-6, 50, 0.0)
    assert (a.critic_num_mini_batches, a.num_mini_batches, a.truncated_reward) == (12, 1, "zero")
    assert not hasattr(a, "beta")  # no KL
    # ORZ §3.1: 128 prompts x 64, a 50-step warm-up, R1's prompt, 8000 new tokens (its code)
    assert (a.group_size, a.prompts_per_step, a.warmup_steps, a.prompt_template) == (64, 128, 50, "r1")
    assert (a.model_name_or_path, a.max_new_tokens, a.max_prompt_tokens) == ("Qwen/Qwen2.5-7B", 8000, 2048)
    r = ppo.compute_rewards(torch.tensor([1.0, 1.0, 0.0]), None, torch.tensor([False, True, False]), a)
    assert r.tolist() == [1.0, 0.0, 0.0]  # a truncated correct answer gets 0 (ORZ's code)


# end to end -----------------------------------------------------------------------------------------------------

RESUME_FLAGS = {"exp-name": "a", "truncated-reward": "keep", "critic-warmup-steps": 3, "critic-learning-rate": 1e-2}


@pytest.fixture(scope="module")
def runs(toy_assets, tmp_path_factory):
    """ppo.py runs in one process (tests/script_runner.py): 4 steps; the same cut at 2; 2 steps with LoRA."""
    from tests.test_scripts import ROOT, toy_flags

    out = tmp_path_factory.mktemp("ppo_runs")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    lora = {"exp-name": "l", "truncated-reward": "keep", "lora-rank": 2, "learning-rate": 2e-2, "save-every": 1}
    jobs = [
        ("ppo", toy_flags(toy_assets, str(out / "full"), 4, **RESUME_FLAGS)),
        ("ppo", toy_flags(toy_assets, str(out / "part"), 2, **RESUME_FLAGS)),
        ("ppo", toy_flags(toy_assets, str(out / "lora"), 2, **lora)),
    ]
    proc, outcomes = run_scripts(jobs, str(out), env)
    assert outcomes == [None] * 3, outcomes
    return out, env


@pytest.mark.slow
def test_resume_restores_the_critic_exactly(runs, toy_assets):
    """4 steps against 2 + a resumed 2: the value loss, the critic's gradient norm, the explained variance and the
    policy's metrics agree, so the critic's weights, optimizer and scheduler came back (the critic's lr warm-up is
    mid-way at step 2). A critic not restored starts from V = 0 again and moves the value loss by far more than the
    tolerance."""
    from tests.test_scripts import read_metrics, toy_flags

    out, env = runs
    (run_dir,) = glob.glob(os.path.join(out, "part", "a__*"))
    proc, outcomes = run_scripts(
        [("ppo", toy_flags(toy_assets, str(out / "part"), 4, **RESUME_FLAGS, resume=run_dir))], str(out), env
    )
    assert outcomes == [None], outcomes
    (full_dir,) = glob.glob(os.path.join(out, "full", "a__*"))
    resumed, uninterrupted = read_metrics(run_dir), read_metrics(full_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    keys = ("train/value_loss", "train/critic_grad_norm", "train/explained_variance", "train/value_mean")
    keys += ("train/reward_mean", "train/grad_norm", "train/critic_lr")
    assert uninterrupted[3]["train/value_mean"] != 0  # the critic moved
    for a, b in zip(resumed, uninterrupted):  # as tests/test_scripts.py's resume test: fp32 sums of O(1)
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (b["step"], key)


@pytest.mark.slow
def test_a_lora_run_trains_the_critics_adapters_and_saves_them(runs):
    """--lora-rank 2: the critic trains (its LoRA adapters and head in the accelerate state, next to the policy's),
    the policy's checkpoint holds PEFT's adapter and the merged model, as with every script."""
    from safetensors.torch import load_file

    from tests.test_scripts import read_metrics

    out, _ = runs
    (run_dir,) = glob.glob(os.path.join(out, "lora", "l__*"))
    rows = read_metrics(run_dir)
    assert all(r["train/critic_grad_norm"] > 0 for r in rows) and rows[-1]["train/value_mean"] != 0
    step = os.path.join(run_dir, "checkpoints", "step_2")
    assert os.path.exists(os.path.join(step, "adapter", "adapter_config.json"))
    critic = load_file(os.path.join(step, "state", "model_1.safetensors"))
    assert "value_head.weight" in critic and any("lora_B" in k for k in critic)
    assert critic["value_head.weight"].abs().sum() > 0
    with open(os.path.join(step, "trainer.json")) as f:
        assert json.load(f)["models"] == ["policy", "critic"]  # state/'s model.safetensors, model_1.safetensors
    saved = load_file(os.path.join(step, "critic", "model.safetensors"))  # a sequence classifier, adapters merged
    assert torch.equal(saved["score.weight"], critic["value_head.weight"]) and not any("lora" in k for k in saved)


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"critic_model_name_or_path": "/nonexistent/critic"}, "--critic-model-name-or-path: cannot load"),
        ({"critic_model_name_or_path": "SMALL"}, "--critic-model-name-or-path: "),
        ({"critic_num_mini_batches": 0}, "--critic-num-mini-batches must be in [1, 32]"),
        ({"lam": 1.5}, "need 0 <= --gamma <= 1, 0 <= --lam <= 1"),
        ({"value_clip": -0.1}, "--value-clip > 0"),
        ({"value_clip": 0.0}, "--value-clip > 0"),
    ],
)
def test_bad_critic_flags_are_one_line_and_write_nothing(flags, message, toy_assets, tmp_path):
    """Refused before the run directory is written; "SMALL": a critic whose embedding has fewer rows than the
    policy's tokenizer has ids (it could not read the policy's tokens)."""
    import json

    if flags.get("critic_model_name_or_path") == "SMALL":
        with open(os.path.join(toy_assets["model"], "config.json")) as f:
            config = json.load(f)
        os.makedirs(tmp_path / "small")
        with open(tmp_path / "small" / "config.json", "w") as f:
            json.dump({**config, "vocab_size": 10}, f)
        flags = {"critic_model_name_or_path": str(tmp_path / "small")}
    args = ppo.Args(
        model_name_or_path=toy_assets["model"],
        dataset_name=toy_assets["train"],
        prompt_column="question",
        answer_column="answer",
        prompt_template="none",
        group_size=4,
        prompts_per_step=8,
        sampler="hf",
        output_dir=str(tmp_path / "out"),
        **flags,
    )
    with pytest.raises(SystemExit) as e:
        ppo.main(args)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
