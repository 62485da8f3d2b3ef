"""kimi_k15.py against float64 references straight from Kimi k1.5 (arXiv 2501.12599): §2.3.3's length reward by a
loop and by a table of hand-computed values (all lengths equal, one sample, every sample truncated), side by side
with open-r1's `len_reward` (ported below, run with math-verify as open-r1 runs it); §2.3.2's loss by value and
finite differences, its gradient against eq. 3 on free log-probs and on a tiny model's parameters, its minimiser
(log pi/pi_old = A / tau), micro-batch additivity, OpenKimi's PMD loss (ported) as a check of its scale; the optimizer
reset of every iteration in a run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimi_k15
from tests.checks import assert_loss_matches_reference, assert_micro_batches_add_up

F64 = torch.float64


def make_args(**kw):
    return kimi_k15.Args(**{"group_size": 4, **kw})


# §2.3.3: the length reward ------------------------------------------------------------------------------------


def paper_length_reward(correct: list[float], lengths: list[int], k: int) -> list[float]:
    """§2.3.3 as written, one problem's k samples at a time: 0 for all when max_len = min_len, else lambda = 0.5 -
    (len(i) - min_len) / (max_len - min_len), and lambda for a correct sample, min(0, lambda) for a wrong one."""
    out = []
    for g in range(0, len(lengths), k):
        lens, right = lengths[g : g + k], correct[g : g + k]
        lo, hi = min(lens), max(lens)
        for n, c in zip(lens, right):
            lam = 0.0 if hi == lo else 0.5 - (n - lo) / (hi - lo)
            out.append(lam if c == 1 else min(0.0, lam))
    return out


# (name, group size, correct, lengths in tokens, len_reward by hand)
TABLE = [
    ("spread", 4, [1, 1, 0, 0], [3, 5, 7, 9], [0.5, 1 / 6, -1 / 6, -0.5]),
    ("the shortest wrong gets 0, not +0.5", 4, [0, 1, 0, 1], [2, 4, 4, 6], [0.0, 0.0, 0.0, -0.5]),
    ("two lengths", 4, [1, 1, 0, 0], [1, 2, 1, 2], [0.5, -0.5, 0.0, -0.5]),
    ("all lengths equal", 4, [1, 0, 1, 0], [5, 5, 5, 5], [0.0, 0.0, 0.0, 0.0]),
    ("every sample truncated at the budget", 4, [0, 0, 0, 0], [8, 8, 8, 8], [0.0, 0.0, 0.0, 0.0]),
    ("one sample per problem", 1, [1, 0, 1], [3, 9, 1], [0.0, 0.0, 0.0]),
    ("groups apart: min and max per problem", 2, [1, 1, 1, 1], [1, 3, 100, 300], [0.5, -0.5, 0.5, -0.5]),
]


@pytest.mark.parametrize("name,k,correct,lengths,want", TABLE, ids=[t[0] for t in TABLE])
def test_length_reward_table(name, k, correct, lengths, want):
    c, n = torch.tensor(correct, dtype=F64), torch.tensor(lengths)
    got = kimi_k15.length_reward(c, n, k)
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-15)
    assert paper_length_reward(correct, lengths, k) == pytest.approx(want, abs=1e-15)


def test_length_reward_matches_the_papers_loop_on_random_groups():
    g = torch.Generator().manual_seed(0)
    correct = torch.randint(0, 2, (64,), generator=g).to(F64)
    lengths = torch.randint(1, 30, (64,), generator=g)
    lengths[8:16] = 7  # a group of equal lengths
    want = paper_length_reward(correct.tolist(), lengths.tolist(), 8)
    got = kimi_k15.length_reward(correct, lengths, 8)
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-15)


def test_rewards_add_the_weighted_length_reward_after_the_warm_up():
    """0/1 before --length-penalty-warmup-steps, then 0/1 + weight x len_reward at a constant weight; fp32 from the
    scripts' fp32 correctness, the length reward in the dtype of `correct` otherwise."""
    args = make_args(length_penalty_weight=0.3, length_penalty_warmup_steps=5)
    correct, lengths = torch.tensor([1.0, 1, 0, 0], dtype=F64), torch.tensor([3, 5, 7, 9])
    for step in (0, 4):
        assert kimi_k15.compute_rewards(correct, lengths, None, args, step).tolist() == [1, 1, 0, 0]
    want = [1 + 0.3 * 0.5, 1 + 0.3 / 6, -0.3 / 6, -0.3 * 0.5]
    for step in (5, 500):
        got = kimi_k15.compute_rewards(correct, lengths, None, args, step)
        torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=0, atol=1e-15)
    assert kimi_k15.compute_rewards(correct.float(), lengths, None, args, 9).dtype == torch.float32
    off = make_args(length_penalty_weight=0.0, length_penalty_warmup_steps=0)
    assert kimi_k15.compute_rewards(correct, lengths, None, off, 9).tolist() == [1, 1, 0, 0]


def test_a_correct_answer_outranks_every_wrong_one_of_its_group_at_the_default_weight():
    """Weight 1 (ours): correct >= 1 - 0.5 > 0 >= wrong, whatever the lengths."""
    args = make_args(length_penalty_warmup_steps=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        correct = torch.randint(0, 2, (4,), generator=g).to(F64)
        r = kimi_k15.compute_rewards(correct, torch.randint(1, 50, (4,), generator=g), None, args, 0)
        assert (r[correct == 1] >= 0.5).all() and (r[correct == 0] <= 0).all()


# open-r1's len_reward, ported: huggingface/open-r1@1416fa0cf21595d2083b399a2a0bbddd7f6e9563
# src/open_r1/rewards.py:len_reward (lines 132-202), verbatim but for the completions' chat format
def open_r1_len_reward(contents: list[str], solution: list[str]) -> list[float]:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    correctness = []
    for content, sol in zip(contents, solution):
        gold_parsed = parse(sol, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()])
        if len(gold_parsed) == 0:
            correctness.append(True)  # Treat as correct to avoid penalizing
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
        correctness.append(verify(answer_parsed, gold_parsed))
    lengths = [len(content) for content in contents]
    min_len, max_len = min(lengths), max(lengths)
    if max_len == min_len:
        return [0.0] * len(contents)
    rewards = []
    for length, is_correct in zip(lengths, correctness):
        lambda_val = 0.5 - (length - min_len) / (max_len - min_len)
        rewards.append(float(lambda_val if is_correct else min(0, lambda_val)))
    return rewards


def test_side_by_side_with_open_r1s_len_reward():
    """One problem's group, lengths counted in characters: open-r1's len_reward equals ours exactly. Two problems in
    one call (as TRL hands open-r1 a batch): open-r1 takes min and max over the whole call, §2.3.3 (ours) over each
    problem's samples, so the rewards differ. And open-r1 counts characters, we count tokens (docs/algorithms.md)."""
    group = ["\\boxed{4}", "so it is \\boxed{4}", "\\boxed{5}", "a long way round to \\boxed{3}"]
    sols = ["$4$"] * 4
    theirs = open_r1_len_reward(group, sols)
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=F64)
    ours = kimi_k15.length_reward(correct, torch.tensor([len(t) for t in group]), 4)
    assert ours.tolist() == pytest.approx(theirs, abs=1e-15) and theirs[0] == 0.5

    other = ["\\boxed{7}" + " and so on" * 8, "\\boxed{7}" + " and so on" * 12]  # a second problem, longer answers
    theirs = open_r1_len_reward(group + other, sols + ["$7$", "$7$"])
    lengths = torch.tensor([len(t) for t in group] + [len(t) for t in other])
    ours = kimi_k15.length_reward(torch.tensor([1.0, 1, 0, 0, 1, 1], dtype=F64), lengths, 2)
    assert ours[4:].tolist() == [0.5, -0.5]  # per problem: the shorter of the two gets +0.5
    assert theirs[4] < 0 and theirs[0] == 0.5  # over the batch: both long, both below the first problem's


# §2.3.2: the loss ---------------------------------------------------------------------------------------------


def rollout(seed, groups=3, k=4, t=6):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * k,), generator=g).to(F64)
    rewards[:k] = 1.0  # one all-correct group: A = 0 there, only the regulariser acts
    lengths = torch.randint(1, t + 1, (groups * k,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * k, t, dtype=F64, generator=g) * 3
    logps = old + 0.3 * torch.randn(groups * k, t, dtype=F64, generator=g)
    return rewards, mask, old, logps


def brute_loss(logps, old, adv, mask, tau) -> float:
    """1/N sum_i (A_i - tau sum_t (log pi - log pi_old)_it)^2 / (2 tau), by loops."""
    total = 0.0
    for i in range(logps.shape[0]):
        s = sum(float(logps[i, t] - old[i, t]) for t in range(logps.shape[1]) if mask[i, t])
        total += (float(adv[i]) - tau * s) ** 2 / (2 * tau)
    return total / logps.shape[0]


@pytest.mark.parametrize("tau", [1.0, 0.05, 7.0])
def test_loss_value_and_gradient_match_a_loop(tau):
    args = make_args(tau=tau)
    rewards, mask, old, logps = rollout(1)
    adv = kimi_k15.compute_advantages(rewards, args)
    reference = lambda lp: brute_loss(lp, old, adv, mask, tau)
    assert_loss_matches_reference(
        kimi_k15.compute_policy_loss, reference, logps, old, adv, mask, args, ("policy_loss", "approx_kl")
    )


def test_advantages_are_the_reward_minus_the_groups_mean():
    args = make_args()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.5, 1.5, 1.5, 1.5, 0.2, 1.0, -0.3, 0.0], dtype=F64)
    want = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0.2 - 0.225, 1.0 - 0.225, -0.3 - 0.225, -0.225]
    torch.testing.assert_close(
        kimi_k15.compute_advantages(rewards, args), torch.tensor(want, dtype=F64), atol=1e-15, rtol=0
    )


def eq3_objective(seq_logp, seq_old, rewards, k, tau):
    """Eq. 3 as written, as an objective whose gradient it is: per problem, 1/k sum_j [log pi(y_j|x) (r_j - r_bar)
    - tau/2 (log pi(y_j|x) / pi_i(y_j|x))^2], r_bar = mean of the k rewards (a constant), averaged over problems."""
    total = 0.0
    for g in range(0, len(rewards), k):
        r_bar = sum(rewards[g : g + k].tolist()) / k
        for j in range(g, g + k):
            total = total + (seq_logp[j] * (float(rewards[j]) - r_bar) - tau / 2 * (seq_logp[j] - seq_old[j]) ** 2) / k
    return total / (len(rewards) // k)


@pytest.mark.parametrize("tau", [1.0, 0.1])
def test_the_gradient_is_minus_eq3_on_free_log_probs(tau):
    args = make_args(tau=tau)
    rewards, mask, old, logps = rollout(2)
    x = logps.clone().requires_grad_(True)
    loss, _ = kimi_k15.compute_policy_loss(x, old, kimi_k15.compute_advantages(rewards, args), mask, args)
    (ours,) = torch.autograd.grad(loss, x)
    y = logps.clone().requires_grad_(True)
    objective = eq3_objective((y * mask).sum(-1), (old * mask).sum(-1), rewards, 4, tau)
    (paper,) = torch.autograd.grad(objective, y)
    torch.testing.assert_close(ours, -paper, rtol=0, atol=1e-13)
    assert (ours[mask == 0] == 0).all() and ours.abs().max() > 1e-2


class Bigram(torch.nn.Module):
    """A tiny float64 policy: the next token's logits are a row of W chosen by the previous token."""

    def __init__(self, vocab=7, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(vocab, vocab, dtype=F64, generator=g))

    def forward(self, ids):  # ids [B, T + 1]: log-probs of ids[:, 1:] given the previous token, [B, T]
        logp = torch.log_softmax(self.w[ids[:, :-1]], dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_the_gradient_is_minus_eq3_on_a_tiny_models_parameters():
    """The parameters' gradient of our loss is minus eq. 3, with grad log pi(y_j|x) and grad (log pi/pi_i)^2 taken
    sample by sample through the model, after the policy moved away from pi_i (so both terms of eq. 3 act)."""
    tau, k = 0.5, 4
    args = make_args(tau=tau)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (8, 6), generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 4, 1, 5, 2, 5, 4])[:, None]).long()
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1], dtype=F64)
    reference, policy = Bigram(seed=0), Bigram(seed=0)
    with torch.no_grad():
        old = reference(ids)
        policy.w.add_(0.2 * torch.randn(7, 7, dtype=F64, generator=g))  # pi != pi_i
    loss, _ = kimi_k15.compute_policy_loss(policy(ids), old, kimi_k15.compute_advantages(rewards, args), mask, args)
    (ours,) = torch.autograd.grad(loss, policy.w)
    paper = torch.zeros_like(policy.w)
    for grp in range(0, 8, k):
        r_bar = rewards[grp : grp + k].mean().item()
        for j in range(grp, grp + k):
            seq = (policy(ids[j : j + 1]) * mask[j]).sum()
            (grad_logp,) = torch.autograd.grad(seq, policy.w, retain_graph=True)
            (grad_sq,) = torch.autograd.grad((seq - (old[j] * mask[j]).sum()) ** 2, policy.w)
            paper += (grad_logp * (rewards[j].item() - r_bar) - tau / 2 * grad_sq) / k
    paper /= 8 // k
    torch.testing.assert_close(ours, -paper, rtol=0, atol=1e-13)
    assert paper.abs().max() > 1e-2


def test_the_loss_is_zero_where_log_pi_over_pi_old_is_a_over_tau():
    """The closed form of eq. 2: tau log(pi*/pi_i) = r - tau log Z, so a policy whose sequence log-ratio is A / tau has
    loss 0 and gradient 0, whatever the split over tokens."""
    args = make_args(tau=0.4)
    rewards, mask, old, _ = rollout(4)
    adv = kimi_k15.compute_advantages(rewards, args)
    share = torch.rand(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(5)) * mask
    share = share / share.sum(-1, keepdim=True)  # how each sequence's log-ratio is spread over its tokens
    logps = (old + share * (adv / args.tau)[:, None]).requires_grad_(True)
    loss, _ = kimi_k15.compute_policy_loss(logps, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, logps)
    assert abs(loss.item()) < 1e-28 and grad.abs().max() < 1e-14


@pytest.mark.parametrize("tau", [0.1, 10.0])
def test_on_policy_the_gradient_is_reinforce_with_the_mean_baseline_whatever_tau(tau):
    """At pi = pi_old: d L / d log pi_it = -(r_i - r_bar) / N on every token of completion i (a sum over its tokens,
    not a mean)."""
    args = make_args(tau=tau)
    rewards, mask, old, _ = rollout(6)
    adv = kimi_k15.compute_advantages(rewards, args)
    x = old.clone().requires_grad_(True)
    loss, _ = kimi_k15.compute_policy_loss(x, old, adv, mask, args)
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad, -(adv[:, None] * mask) / len(adv), rtol=0, atol=1e-15)


def test_micro_batches_sum_to_the_mini_batch_gradient():
    args = make_args(tau=0.7)
    rewards, mask, old, logps = rollout(7)
    adv = kimi_k15.compute_advantages(rewards, args)
    assert_micro_batches_add_up(kimi_k15.compute_policy_loss, logps, old, adv, mask, args, stat_keys=("approx_kl",))


# OpenKimi's PMD loss, ported: horizon-rl/OpenKimi@06db12ae7a55270e4561712d9f5b5410784f1357
# openkimi/pmd/core_algos.py:compute_policy_loss_opmd (partition weights 1, no rollout weights)
def openkimi_opmd_loss(old_log_prob, log_prob, advantages, response_mask, pmd_tau, loss_agg_mode):
    response_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_prob = torch.sum(log_prob * response_mask, dim=-1)
    seq_old_log_prob = torch.sum(old_log_prob * response_mask, dim=-1)
    seq_log_prob_ratio = seq_log_prob - seq_old_log_prob
    seq_advantages = torch.sum(advantages * response_mask, dim=-1) / response_lengths
    seq_partition_weights = torch.ones_like(seq_advantages)
    max_response_length = response_mask.shape[1]
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(
            0.5
            * pmd_tau
            * seq_partition_weights
            * ((seq_advantages / pmd_tau - seq_log_prob_ratio) ** 2)
            / response_lengths
        )
    weighted = torch.mean(
        0.5 * pmd_tau * seq_partition_weights * ((seq_advantages / pmd_tau - seq_log_prob_ratio) ** 2)
    )
    return weighted / max_response_length


def test_side_by_side_with_openkimis_pmd_loss():
    """OpenKimi's `seq-mean-token-sum-norm` is the same squared residual divided by the batch's width T: ours = T x
    theirs, value and gradient. Its default `seq-mean-token-mean` divides each sequence's residual by its length,
    which §2.3.2 does not (docs/algorithms.md)."""
    args = make_args(tau=0.3)
    rewards, mask, old, logps = rollout(8)
    adv = kimi_k15.compute_advantages(rewards, args)
    token_adv = adv[:, None] * mask  # OpenKimi's advantages are per token (verl's), constant over a sequence
    x, y = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    ours, _ = kimi_k15.compute_policy_loss(x, old, adv, mask, args)
    theirs = openkimi_opmd_loss(old, y, token_adv, mask, 0.3, "seq-mean-token-sum-norm")
    t = mask.shape[1]
    torch.testing.assert_close(ours, t * theirs, rtol=1e-13, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(ours, x)[0], t * torch.autograd.grad(theirs, y)[0], rtol=0, atol=1e-13
    )
    per_length = openkimi_opmd_loss(old, logps, token_adv, mask, 0.3, "seq-mean-token-mean")
    assert abs(per_length.item() * t - ours.item()) > 1e-3


@pytest.mark.parametrize(
    "kw,flag", [({"tau": 0.0}, "--tau"), ({"length_penalty_weight": -1.0}, "--length-penalty-weight")]
)
def test_bad_flags_are_one_line_and_write_nothing(kw, flag, toy_assets, tmp_path):
    args = kimi_k15.Args(model_name_or_path=toy_assets["model"], output_dir=str(tmp_path / "out"), **kw)
    with pytest.raises(SystemExit) as e:
        kimi_k15.main(args)
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg and flag in msg, msg
    assert not (tmp_path / "out").exists()


def test_defaults():
    a = kimi_k15.Args()
    assert (a.tau, a.length_penalty_weight, a.length_penalty_warmup_steps, a.reset_optimizer) == (1.0, 1.0, 50, True)
    assert (a.num_mini_batches, a.ppo_epochs, a.prompt_sampling) == (1, 1, "uniform")


# the optimizer reset (§2.3.2), in a run ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("reset", [True, False])
def test_the_optimizer_starts_every_iteration_afresh(reset, toy_assets, tmp_path, monkeypatch):
    """Three steps whose groups all have a signal (rewards 0, 1, 0, 1, ...): each iteration's update starts from an
    empty optimizer state with the reset (the default), from the previous step's AdamW moments without it."""
    seen = []

    def recording_update(policy, optimizer, *a, **k):
        seen.append(len(optimizer.state))  # parameters with AdamW moments when the iteration's update starts
        return update_policy(policy, optimizer, *a, **k)

    update_policy = kimi_k15.update_policy
    monkeypatch.setattr(kimi_k15, "update_policy", recording_update)
    monkeypatch.setattr(kimi_k15, "compute_rewards", lambda c, *_: (torch.arange(c.numel()) % 2).float())
    flags = dict(prompt_column="question", answer_column="answer", prompt_template="none", max_prompt_tokens=32)
    flags.update(group_size=4, prompts_per_step=4, max_new_tokens=2, sampler="hf", save_every=0, total_steps=3)
    args = kimi_k15.Args(
        model_name_or_path=toy_assets["model"], dataset_name=toy_assets["train"], output_dir=str(tmp_path), **flags
    )
    kimi_k15.main(dataclasses.replace(args, reset_optimizer=reset, log_samples_every=0))
    assert len(seen) == 3 and seen[0] == 0
    assert (seen[1:] == [0, 0]) if reset else min(seen[1:]) > 0, seen
