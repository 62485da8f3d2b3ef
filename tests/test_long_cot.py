"""long_cot.py against float64 references from "Demystifying Long Chain-of-Thought Reasoning in LLMs" (arXiv
2502.03373) and its code, eddycmu/demystify-long-cot@e90cf9b30203bb74b1ea4ba008fa54bf731ad1a4 (an OpenRLHF fork,
ported below function by function, with the path of each): the cosine reward by a table of hand-computed values and
against CosineScaledSparseReward; the dense repetition penalty by hand and against RepetitionDensePenalty; the two
streams' returns with their own discounts and the KL split between them by a loop (masked spans carried) and
against the fork's compute_reward, multi-gamma get_advantages_and_returns and whitening; the policy loss by a loop,
finite differences, micro-batches and against the fork's PolicyLoss; open-r1's get_cosine_scaled_reward and
get_repetition_penalty_reward side by side (huggingface/open-r1@1416fa0cf21595d2083b399a2a0bbddd7f6e9563
src/open_r1/rewards.py); the flags refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

import long_cot
import ppo
from tests.checks import PPO_CLIP_STATS, assert_loss_matches_reference, assert_micro_batches_add_up
from tests.reference import aggregate, ppo_clip_token

F64 = torch.float64
MAX_LEN_MARGIN = 16  # demystify-long-cot openrlhf/openrlhf/reward/common.py


def make_args(**kw):
    return long_cot.Args(**{"group_size": 4, **kw})


# the cosine reward --------------------------------------------------------------------------------------------

R2 = math.sqrt(2) / 2  # cos(pi / 4)
# (name, correct, L, the reward at L_max = 100 with the paper's values, by hand)
COSINE_TABLE = [
    ("correct at length 0: r^c_0", 1, 0, 2.0),
    ("correct at a quarter", 1, 25, 1 + (1 + R2) / 2),
    ("correct at half", 1, 50, 1.5),
    ("correct at three quarters", 1, 75, 1 + (1 - R2) / 2),
    ("wrong at length 0: r^w_0", 0, 0, -10.0),
    ("wrong at a quarter", 0, 25, -5 * (1 + R2)),
    ("wrong at half", 0, 50, -5.0),
    ("wrong at three quarters", 0, 75, -5 * (1 - R2)),
    ("the last length before the margin", 1, 83, 1 + (1 + math.cos(0.83 * math.pi)) / 2),
    ("within the 16-token margin: r_e", 1, 84, -10.0),
    ("truncated at the budget, correct: r_e", 1, 100, -10.0),
    ("truncated at the budget, wrong: r_e", 0, 100, -10.0),
]


@pytest.mark.parametrize("name,correct,length,want", COSINE_TABLE, ids=[t[0] for t in COSINE_TABLE])
def test_cosine_reward_table(name, correct, length, want):
    args = make_args(max_new_tokens=100)
    got = long_cot.compute_rewards(torch.tensor([float(correct)], dtype=F64), torch.tensor([length]), None, args)
    assert got.dtype == F64 and got.item() == pytest.approx(want, abs=1e-14)


def test_every_sample_truncated_and_no_margin():
    """A group cut off at the budget gets r_e everywhere (the margin fires before); with --exceed-margin -1 nothing
    exceeds and the budget's own values apply: r^c_L = 1, r^w_L = 0 (a 0/1 reward: the toy's runs)."""
    lengths, correct = torch.full((4,), 100), torch.tensor([1.0, 0, 1, 0], dtype=F64)
    assert long_cot.compute_rewards(correct, lengths, None, make_args(max_new_tokens=100)).tolist() == [-10.0] * 4
    free = make_args(max_new_tokens=100, exceed_margin=-1)
    assert long_cot.compute_rewards(correct, lengths, None, free).tolist() == pytest.approx([1, 0, 1, 0], abs=1e-15)
    assert long_cot.compute_rewards(correct.float(), lengths, None, free).dtype == torch.float32


# demystify-long-cot openrlhf/openrlhf/reward/cosine.py: CosineScaledSparseReward.reward, the loop verbatim (the
# verdicts `scores` given, the sparse repetition penalty at its default max_penalty 0: off)
def demystify_cosine(gen_lengths, scores, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct,
                     max_len, exceed_length):  # fmt: skip
    rewards = []
    for gen_len, score in zip(gen_lengths, scores):
        if gen_len + MAX_LEN_MARGIN >= max_len:
            rewards.append(exceed_length)
            continue
        if score == 1:
            min_value = min_value_correct
            max_value = max_value_correct
            rep_penalty = 0
        else:
            # Yes, they are swapped. This is required for the cosine formula below
            # to work with negative numbers.
            min_value = max_value_wrong
            max_value = min_value_wrong
            rep_penalty = 0
        progress = gen_len / max_len
        cosine = math.cos(progress * math.pi)
        r = min_value + 0.5 * (max_value - min_value) * (1.0 + cosine)
        r += rep_penalty
        rewards.append(r)
    return rewards


@pytest.mark.parametrize("max_len", [14336, 200])
def test_cosine_reward_against_the_papers_code(max_len):
    """The section 4.2 script's values (min_value_wrong -10, max_value_wrong 0, min_value_correct 1,
    max_value_correct 2, exceed_length -10) on random lengths, the margin's edge included."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, max_len + 1, (300,), generator=g)
    lengths[:4] = torch.tensor([max_len - 17, max_len - 16, max_len - 15, max_len])
    scores = torch.randint(0, 2, (300,), generator=g).to(F64)
    theirs = demystify_cosine(lengths.tolist(), scores.tolist(), -10, 0, 1, 2, max_len, -10)
    ours = long_cot.compute_rewards(scores, lengths, None, make_args(max_new_tokens=max_len))
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=F64), rtol=0, atol=1e-14)
    assert ours[0] != -10 and (ours[1:4] == -10).all()


# open-r1 src/open_r1/rewards.py: get_cosine_scaled_reward (lines 205-283) as shipped, but for the completions' chat
# format; math-verify judges as in open-r1
def open_r1_cosine(contents, solution, min_value_wrong=-1.0, max_value_wrong=-0.5, min_value_correct=0.5,
                   max_value_correct=1.0, max_len=1000):  # fmt: skip
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    rewards = []
    for content, sol in zip(contents, solution):
        gold_parsed = parse(sol, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()])
        if len(gold_parsed) == 0:
            rewards.append(1.0)  # Skip unparseable examples
            continue
        answer_parsed = parse(
            content,
            extraction_config=[
                LatexExtractionConfig(
                    normalization_config=NormalizationConfig(
                        nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed=True, units=True
                    ),
                    boxed_match_priority=0,
                    try_extract_without_anchor=False,
                )
            ],
            extraction_mode="first_match",
        )
        is_correct = verify(answer_parsed, gold_parsed)
        gen_len = len(content)
        progress = gen_len / max_len
        cosine = math.cos(progress * math.pi)
        if is_correct:
            min_value = min_value_correct
            max_value = max_value_correct
        else:
            min_value = max_value_wrong
            max_value = min_value_wrong
        reward = min_value + 0.5 * (max_value - min_value) * (1.0 + cosine)
        rewards.append(float(reward))
    return rewards


def test_side_by_side_with_open_r1s_cosine_reward():
    """open-r1's function at its own defaults and max_len 60 equals ours with the same endpoints, L_max = 60 and no
    exceed rule (--exceed-margin -1), lengths counted in characters as open-r1 does (ours: tokens). Past max_len
    open-r1's cosine turns back up (progress > 1; it has no exceed reward), where the paper gives r_e."""
    texts = ["\\boxed{4}", "it is \\boxed{4}" + "." * 30, "\\boxed{5}", "so \\boxed{3}" + "." * 40]
    theirs = open_r1_cosine(texts, ["$4$"] * 4, max_len=60)
    args = make_args(max_new_tokens=60, cosine_correct=(1.0, 0.5), cosine_wrong=(-1.0, -0.5), exceed_margin=-1)
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=F64)
    ours = long_cot.compute_rewards(correct, torch.tensor([len(t) for t in texts]), None, args)
    assert ours.tolist() == pytest.approx(theirs, abs=1e-14)
    past = open_r1_cosine(["\\boxed{4}" + "." * 100], ["$4$"], max_len=60)[0]
    assert past > 0.5  # beyond max_len: back above r_L (progress 1.83)


# the dense repetition penalty ---------------------------------------------------------------------------------


# (name, token ids, n, the penalised positions by hand)
PENALTY_TABLE = [
    ("a loop of 3 from its second turn", [1, 2, 3, 1, 2, 3, 1, 2], 3, [3, 4, 5, 6, 7]),
    ("no repeat", [1, 2, 3, 4, 5, 6], 3, []),
    ("shorter than n", [7, 7, 7], 4, []),
    ("one token repeated: every token once however many repeats cover it", [5] * 6, 2, [1, 2, 3, 4, 5]),
    ("two separate repeats", [1, 2, 9, 1, 2, 8, 3, 4, 3, 4], 2, [3, 4, 8, 9]),
]


@pytest.mark.parametrize("name,ids,n,positions", PENALTY_TABLE, ids=[t[0] for t in PENALTY_TABLE])
def test_repetition_penalty_table(name, ids, n, positions):
    args = make_args(repetition_ngram=n, repetition_penalty=-0.05)
    got = long_cot.repetition_penalty([ids], args, 12)
    want = torch.zeros(1, 12, dtype=F64)
    want[0, positions] = -0.05
    assert torch.equal(got, want)


# demystify-long-cot openrlhf/openrlhf/reward/repetition.py: RepetitionDensePenalty.reward and zipngram_tokens,
# verbatim but for the arguments it does not read (sequences, answers, scores)
def zipngram_tokens(tokens: list[int], ngram_size: int):
    return zip(*[tokens[i:] for i in range(ngram_size)])


def demystify_dense(output_ids, gen_lengths, num_actions, ngram_size, penalty, only_start=False):
    rewards = []
    for out, out_len in zip(output_ids, gen_lengths):
        gen = out[: int(out_len)]
        repeated = []
        ngrams = set()
        for start_idx, ng in enumerate(zipngram_tokens(gen, ngram_size)):
            if ng in ngrams:
                repeated.append(start_idx)
            ngrams.add(ng)
        curr_reward = [0] * num_actions
        curr_end_idx = -1
        for start_idx in repeated:
            if not only_start or start_idx > curr_end_idx:
                for i in range(start_idx, start_idx + ngram_size):
                    curr_reward[i] = penalty
            curr_end_idx = start_idx + ngram_size
        rewards.append(curr_reward)
    return torch.tensor(rewards)


@pytest.mark.parametrize("n,vocab,length", [(40, 3, 400), (3, 4, 60), (1, 5, 30)])
def test_repetition_penalty_against_the_papers_code(n, vocab, length):
    """Random completions from a small vocabulary (many repeats), of ragged lengths, plus a long loop: the penalised
    tokens and values equal RepetitionDensePenalty's (the paper's n = 40, -0.05, and others)."""
    g = torch.Generator().manual_seed(n)
    seqs = [
        torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, length, (12,), generator=g)
    ]
    seqs.append(list(range(50)) * 5)  # a model stuck in a loop
    width = max(len(s) for s in seqs)
    args = make_args(repetition_ngram=n, repetition_penalty=-0.05)
    ours = long_cot.repetition_penalty(seqs, args, width)
    theirs = demystify_dense(seqs, [len(s) for s in seqs], width, n, -0.05)  # float32: torch.tensor of a list
    assert torch.equal(ours.float(), theirs) and (ours != 0).sum() > 100


# open-r1 src/open_r1/rewards.py: get_repetition_penalty_reward (lines 286-353), language "en", as shipped
def open_r1_repetition(contents, ngram_size, max_penalty):
    def zipngram(text: str, ngram_size: int):
        words = text.lower().split()
        return zip(*[words[i:] for i in range(ngram_size)]), words

    rewards = []
    for completion in contents:
        if completion == "":
            rewards.append(0.0)
            continue
        ngrams = set()
        total = 0
        ngram_array, words = zipngram(completion, ngram_size)
        if len(words) < ngram_size:
            rewards.append(0.0)
            continue
        for ng in ngram_array:
            ngrams.add(ng)
            total += 1
        scaling = 1 - len(ngrams) / total
        reward = scaling * max_penalty
        rewards.append(reward)
    return rewards


def test_side_by_side_with_open_r1s_repetition_penalty():
    """open-r1 ships the paper's sparse variant: one number per completion, (1 - distinct / all word n-grams) x
    max_penalty. On a loop of 10 tokens written 6 times (each token id a word), n = 40: 21 n-grams, 10 distinct,
    so open-r1 gives -11/21 for the whole completion, where the dense penalty (ours, the paper's best runs) puts
    -0.05 on each of the 50 tokens from the loop's second turn on, each discounted by its own distance (0.99)."""
    ids = list(range(10)) * 6
    sparse = open_r1_repetition([" ".join(map(str, ids))], 40, -1.0)[0]
    assert sparse == pytest.approx(-11 / 21, abs=1e-15)
    dense = long_cot.repetition_penalty([ids], make_args(), 60)[0]
    assert dense[:10].tolist() == [0.0] * 10 and dense[10:].tolist() == [-0.05] * 50


# the two streams' returns and the KL --------------------------------------------------------------------------


def streams_case(seed, b=6, t=9, interior_gaps=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    if interior_gaps:
        mask[0, 3:5] = 0  # a tool's output inside a completion: no reward or KL there, the returns carry past it
    rewards = torch.randn(b, generator=g, dtype=F64) * 3
    penalty = torch.where(torch.rand(b, t, generator=g) < 0.4, -0.05, 0.0).to(F64) * mask
    values = torch.randn(b, t, generator=g, dtype=F64)
    kl = 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    return rewards, penalty, values, mask, kl


def brute_streams(rewards, penalty, values, mask, kl, beta, gammas):
    """R_t = sum over the kept positions u >= t of gamma_1^(u-t) ([u = last] r - beta/2 KL_u) + gamma_2^(u-t) (p_u -
    beta/2 KL_u), the distance u - t counted in kept positions; a masked position takes the returns of the next kept
    one (0 if none). A = R - V on the kept positions. Returns (raw advantages, returns) lists."""
    adv, ret = [], []
    for i, row in enumerate(mask.tolist()):
        kept = [t for t, m in enumerate(row) if m]
        last = kept[-1]
        at = {}
        for n, t in enumerate(kept):
            total = 0.0
            for d, u in enumerate(kept[n:]):
                k = float(kl[i, u])
                total += gammas[0] ** d * ((float(rewards[i]) if u == last else 0.0) - beta / 2 * k)
                total += gammas[1] ** d * (float(penalty[i, u]) - beta / 2 * k)
            at[t] = total
        r_row = [at[min([u for u in kept if u >= t], default=None)] if any(u >= t for u in kept) else 0.0
                 for t in range(len(row))]  # fmt: skip
        ret.append(r_row)
        adv.append([r - float(values[i, t]) if row[t] else 0.0 for t, r in enumerate(r_row)])
    return adv, ret


@pytest.mark.parametrize("gaps", [False, True])
def test_two_streams_with_their_own_discounts_and_half_the_kl_each_match_a_loop(gaps):
    from tests.test_ppo import brute_whiten

    rewards, penalty, values, mask, kl = streams_case(1, interior_gaps=gaps)
    args = make_args(beta=0.2, gamma=0.97, repetition_gamma=0.9)
    adv, ret = long_cot.compute_advantages(rewards, values, mask, args, penalty, kl)
    want_adv, want_ret = brute_streams(rewards, penalty, values, mask, kl, 0.2, (0.97, 0.9))
    m = mask.bool()
    torch.testing.assert_close(ret[m], torch.tensor(want_ret, dtype=F64)[m], rtol=0, atol=1e-13)
    want = torch.tensor(brute_whiten(want_adv, mask.tolist()), dtype=F64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)


def test_without_the_penalty_it_is_ppos_gae_with_the_whole_kl():
    """--repetition-penalty 0: one stream, ppo.py's GAE (any lambda) on the outcome and -beta KL."""
    rewards, _, values, mask, kl = streams_case(2, interior_gaps=True)
    args = make_args(repetition_penalty=0.0, lam=0.9, gamma=0.99, beta=0.1)
    adv, ret = long_cot.compute_advantages(rewards, values, mask, args, torch.zeros_like(values), kl)
    token_rewards = ppo.outcome_token_rewards(rewards, mask) - 0.1 * kl * mask
    raw, want_ret = ppo.compute_gae(token_rewards, values, mask, 0.99, 0.9)
    torch.testing.assert_close(ret, want_ret, rtol=0, atol=1e-15)
    torch.testing.assert_close(adv, ppo.whiten(raw, mask), rtol=0, atol=1e-15)
    no_kl = long_cot.compute_advantages(rewards, values, mask, make_args(repetition_penalty=0.0))[0]
    torch.testing.assert_close(no_kl, ppo.compute_advantages(rewards, values, mask, ppo.Args())[0], rtol=0, atol=0)


# demystify-long-cot openrlhf/openrlhf/models/utils.py compute_approx_kl (k1) and compute_reward (its r.dim() == 3
# branch), openrlhf/openrlhf/reward/common.py sparse_to_dense, trainer/ppo_utils/experience_maker.py
# get_advantages_and_returns (the multiple-gamma branch) and trainer/ppo_utils/replay_buffer.py normalize (one
# process), verbatim but for the strategy's all_reduce
def demystify_sparse_to_dense(action_mask, reward):
    r = torch.tensor(reward, device=action_mask.device)
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    return torch.zeros_like(action_mask, dtype=r.dtype).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1))


def demystify_compute_reward(r, kl_coef, kl, action_mask):
    kl_reward = -kl_coef * kl
    assert r.dim() == 3
    last_reward = r
    kl_reward = kl_reward.unsqueeze(-1) / r.shape[-1]  # Divide the kl reward by the number of reward types
    return last_reward + kl_reward


def demystify_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    response_length = rewards.size(1)
    assert lambd == 1, "Only lambda = 1 is supported with multiple gammas"
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask.unsqueeze(-1) * rewards
    returns_reversed = []
    next_returns = torch.zeros(rewards.shape[0], len(gamma), dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(response_length)):
        step_returns = torch.zeros(rewards.shape[0], len(gamma), dtype=rewards.dtype, device=rewards.device)
        for i, g in enumerate(gamma):
            step_returns[:, i] = rewards[:, t, i] + g * next_returns[:, i]
        returns_reversed.append(step_returns.sum(dim=-1))
        next_returns = step_returns
    returns = torch.stack(returns_reversed[::-1], dim=1)
    advantages = returns - values
    return advantages.detach(), returns


def demystify_normalize(items_vector, action_masks_vector):
    num_actions = action_masks_vector.sum()
    mean = (items_vector * 1).sum() / num_actions  # their items are zero outside the mask (masked values/rewards)
    std = ((items_vector - mean).pow(2) * action_masks_vector).sum()
    rstd = (std / num_actions).clamp(min=1e-8).rsqrt()
    return (items_vector - mean) * rstd


def test_side_by_side_with_the_papers_multi_gamma_ppo():
    """The paper's pipeline for `--remote_rm_url math_rule_cosine_scale,math_rule_repetition_dense --gamma 1,0.99
    --lambd 1 --init_kl_coef 0.01`: k1 = log pi_old - log pi_ref on the action tokens, the cosine reward at the EOS
    index, the dense penalty per token, the KL split over the two, the per-stream returns, A = R - V, whitened over
    the batch's action tokens. Equal to ours on every action token (right padding: their masks are ours)."""
    rewards, penalty, values, mask, _ = streams_case(3)
    rewards = rewards.float().double()  # sparse_to_dense makes a float32 tensor of them: the same numbers both sides
    g = torch.Generator().manual_seed(4)
    old, ref = -torch.rand(values.shape, dtype=F64, generator=g), -torch.rand(values.shape, dtype=F64, generator=g)
    kl = (old - ref) * mask  # compute_approx_kl(action_log_probs, base_action_log_probs, action_mask), k1
    sparse = demystify_sparse_to_dense(mask, rewards.tolist())
    r = demystify_compute_reward(torch.stack([sparse, penalty], dim=-1), 0.01, kl, mask)
    adv, ret = demystify_advantages_and_returns(values, r, mask, [1.0, 0.99], 1)
    adv = demystify_normalize(adv.flatten(), mask.flatten()).view_as(adv)
    ours_adv, ours_ret = long_cot.compute_advantages(rewards, values, mask, make_args(), penalty, old - ref)
    m = mask.bool()
    torch.testing.assert_close(ours_ret[m], ret[m], rtol=0, atol=1e-13)
    torch.testing.assert_close(ours_adv[m], adv[m], rtol=0, atol=1e-12)


# the policy loss --------------------------------------------------------------------------------------------------


def policy_case(seed=7, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]).long()
    old = -torch.rand(b, t, dtype=F64, generator=g) * 3
    logps = old + 0.4 * torch.randn(b, t, dtype=F64, generator=g)
    adv = torch.randn(b, t, dtype=F64, generator=g)
    return logps, old, adv, mask


def test_policy_loss_is_a_per_sequence_token_mean_of_the_clipped_surrogate():
    logps, old, adv, mask = policy_case()
    args = make_args()

    def reference(lp):
        per_token = [
            [ppo_clip_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.2) for t in range(5)]
            for i in range(6)
        ]
        return aggregate(per_token, mask.tolist(), "seq-mean-token-mean")

    _, stats = assert_loss_matches_reference(
        long_cot.compute_policy_loss, reference, logps, old, adv, mask, args, ref_logps=old - 0.2
    )
    assert stats["kl_ref"].item() == pytest.approx(0.2, abs=1e-12)  # the k1 the reward carries, at pi_old


# demystify-long-cot openrlhf/openrlhf/models/loss.py PolicyLoss.forward and models/utils.py masked_mean
def demystify_policy_loss(log_probs, old_log_probs, advantages, action_mask, clip_eps=0.2):
    ratio = (log_probs - old_log_probs).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -torch.min(surr1, surr2)
    return ((loss * action_mask).sum(axis=-1) / action_mask.sum(axis=-1)).mean()


def test_policy_loss_against_the_papers_code():
    logps, old, adv, mask = policy_case(9)
    x, y = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    ours, _ = long_cot.compute_policy_loss(x, old, adv, mask, make_args())
    theirs = demystify_policy_loss(y, old, adv, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, y)[0], rtol=0, atol=1e-15)


def test_policy_loss_of_micro_batches_adds_up():
    logps, old, adv, mask = policy_case(8, b=12)
    assert_micro_batches_add_up(
        long_cot.compute_policy_loss, logps, old, adv, mask, make_args(), (*PPO_CLIP_STATS, "kl_ref"),
        ref_logps=old - 0.1,
    )  # fmt: skip


def test_defaults_are_the_papers():
    a = long_cot.Args()
    assert (a.cosine_correct, a.cosine_wrong, a.exceed_reward, a.exceed_margin) == ((2.0, 1.0), (-10.0, 0.0), -10, 16)
    assert (a.repetition_ngram, a.repetition_penalty, a.repetition_gamma, a.gamma, a.lam) == (40, -0.05, 0.99, 1, 1)
    assert (a.beta, a.group_size, a.prompts_per_step, a.max_new_tokens, a.max_prompt_tokens) == (
        0.01,
        16,
        512,
        14336,
        2048,
    )
    assert (a.learning_rate, a.critic_learning_rate, a.num_mini_batches, a.ppo_epochs) == (5e-7, 9e-6, 16, 2)
    assert (a.clip_eps_low, a.clip_eps_high, a.value_clip) == (0.2, 0.2, 0.2)


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"lam": 0.95}, "--lam"),
        ({"repetition_penalty": 0.05}, "--repetition-penalty"),
        ({"repetition_gamma": 1.5}, "--repetition-gamma"),
        ({"repetition_ngram": 0}, "--repetition-ngram"),
    ],
)
def test_bad_flags_are_one_line_and_write_nothing(kw, flag, toy_assets, tmp_path):
    args = long_cot.Args(model_name_or_path=toy_assets["model"], output_dir=str(tmp_path / "out"), **kw)
    with pytest.raises(SystemExit) as e:
        long_cot.main(args)
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg and flag in msg, msg
    assert not (tmp_path / "out").exists()
