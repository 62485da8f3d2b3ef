"""l1.py (LCPO, arXiv 2503.04697) against its equations by hand and a port of the official reward (cmu-l3/l1's
math_reward.py, below), and the shared length percentiles (common/metrics.py rollout_metrics)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import grpo
import l1
from common.metrics import rollout_metrics
from tests.checks import PPO_CLIP_STATS, assert_loss_matches_reference, assert_micro_batches_add_up
from tests.reference import aggregate, group_advantages, k3, ppo_clip_token


def make_args(**kw):
    return l1.Args(**{"group_size": 4, "beta": 0.0, **kw})


# The official reward, ported line for line (cmu-l3/l1@93dd330102f49450e1bc8227ad8979f8b5482e44 math_reward.py:
# get_delta_score_linear, get_delta_score_linear_both and the combination in math_reward_fn, given is_correct).
# num_tokens < 0 marks a Max prompt, -1 none; valid_response_length is the whole response (main_ppo.py).


def get_delta_score_linear(num_tokens, used_tokens, alpha=1 / 3000):
    z_score = abs(used_tokens - num_tokens) * alpha
    delta_score = 1 - z_score
    return delta_score - 1


def get_delta_score_linear_both(num_tokens, used_tokens, alpha=0.002):
    if num_tokens < 0:
        beta = alpha
        delta = used_tokens - abs(num_tokens)
        sc = 0
        if delta < 0:
            sc = beta * delta * -1
        else:
            sc = alpha * delta * -1
        sc = max(-1, min(1, sc))
        return (sc + 1) / 2
    return get_delta_score_linear(num_tokens, used_tokens, alpha)


def official_reward(is_correct, num_tokens, valid_response_length, alpha, linear=True, multiplier=False):
    """math_reward_fn after the verdict (the sigmoid variant aside): with no reward_config flag set (the yaml
    defaults, which run_l1_max.sh keeps) the verdict alone."""
    if not linear and not multiplier:
        return is_correct
    if num_tokens == -1:
        return is_correct
    if num_tokens < 0:
        delta_score = get_delta_score_linear_both(num_tokens, float(valid_response_length), alpha)
    else:
        delta_score = get_delta_score_linear(num_tokens, float(valid_response_length), alpha)
    correctness_score = 0 if not is_correct else 1
    if multiplier:
        return max(0, delta_score) * correctness_score
    return delta_score + correctness_score


def rewards(correct, lengths, targets, **kw):
    """l1.compute_rewards in float64 on Python lists."""
    c = torch.tensor(correct, dtype=torch.float64)
    n = torch.tensor(lengths)
    out = l1.compute_rewards(c, n, torch.zeros_like(n, dtype=torch.bool), make_args(**kw), torch.tensor(targets))
    assert out.dtype == torch.float64
    return out.tolist()


# the reward, by hand -------------------------------------------------------------------------------------------

# (correct, n_y, N, eq. 1 or 2 by hand); N < 0: a Max prompt; alpha = 0.0003, delta = 0.5
TABLE = [
    (1, 1000, 1000, 1.0),  # on target
    (1, 1500, 1000, 1 - 0.0003 * 500),  # 0.85: over by 500
    (1, 500, 1000, 0.85),  # under by 500: the same (|N - n_y|)
    (0, 500, 1000, -0.15),  # wrong: the length term alone
    (1, 4096, 100, 1 - 0.0003 * 3996),  # -0.1988: a correct answer far off target scores below a wrong one on it
    (0, 100, 100, 0.0),
    (1, 1000, -1000, 0.5),  # Max at the budget: delta
    (1, 1, -1000, 0.0003 * 999 + 0.5),  # 0.7997: under budget, more
    (1, 2000, -1000, 0.2),  # over by 1000: 0.5 - 0.3
    (1, 2667, -1000, 0.0),  # over by 1667 = delta / alpha (and a hair): clipped at 0
    (1, 3000, -1000, 0.0),  # far over: 0, as a wrong answer
    (1, 1, -4000, 1.0),  # clipped at 1
    (0, 1, -4000, 0.0),  # wrong: 0 whatever the length
    (0, 9000, -100, 0.0),
]


def test_rewards_match_the_equations_by_hand():
    correct, lengths, targets, want = zip(*TABLE)
    got = rewards(list(correct), list(lengths), list(targets))
    for row, g, w in zip(TABLE, got, want):
        assert abs(g - w) <= 1e-12, (row, g)


def test_rewards_edge_cases():
    """One sample; every sample truncated (truncation plays no part: the verdict and n_y decide); all lengths
    equal in a group: eq. 1 shifts every reward by the same amount and eq. 2 scales them alike, so the group's
    advantages are GRPO's on the verdicts, until eq. 2's factor reaches 0 (over budget by delta / alpha = 1667
    tokens), where a right and a wrong answer score alike and the group has no signal."""
    args = make_args()
    one = l1.compute_rewards(torch.tensor([1.0]), torch.tensor([7]), torch.tensor([False]), args, torch.tensor([5]))
    assert one.tolist() == pytest.approx([1 - 0.0003 * 2], abs=1e-7)
    c, n, t = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([30] * 4), torch.tensor([20] * 4)
    kept = l1.compute_rewards(c, n, torch.zeros(4, dtype=torch.bool), args, t)
    cut = l1.compute_rewards(c, n, torch.ones(4, dtype=torch.bool), args, t)
    assert torch.equal(kept, cut)
    grpo_adv = grpo.compute_advantages(c, grpo.Args(group_size=4))
    for target in (20, -20, -40):  # exact, max under and over budget
        r = l1.compute_rewards(c, n, torch.ones(4, dtype=torch.bool), args, torch.tensor([target] * 4))
        adv = l1.compute_advantages(r, args)
        torch.testing.assert_close(adv, grpo_adv, rtol=0, atol=1e-5)  # eps = 1e-6 against std ~ 0.58 x scale
    over = l1.compute_rewards(
        c, torch.tensor([3000] * 4), torch.ones(4, dtype=torch.bool), args, torch.tensor([-1000] * 4)
    )
    assert over.tolist() == [0.0] * 4 and (l1.compute_advantages(over, args) == 0).all()


def test_float32_rewards_of_the_training_loop():
    """The loop's verdicts are float32 (score's list); lengths and targets integer tensors: the same values."""
    c = torch.tensor([1.0, 0.0, 1.0])
    r = l1.compute_rewards(
        c, torch.tensor([50, 60, 70]), torch.zeros(3, dtype=torch.bool), make_args(), torch.tensor([60, -60, -60])
    )
    assert r.dtype == torch.float32
    assert r.tolist() == pytest.approx([1 - 0.003, 0.0, 0.5 - 0.003], abs=1e-6)


# side by side with the official reward ------------------------------------------------------------------------


def random_cases(n=400, seed=0):
    rng = random.Random(seed)
    return [(rng.random() < 0.5, rng.randint(1, 5000), rng.randint(100, 4000) * rng.choice([1, -1])) for _ in range(n)]


def test_exact_prompts_equal_the_official_reward():
    """run_l1_exact.sh (linear_reward=True, multiplier_reward=False, alpha 0.0003): delta + correct, delta =
    -alpha |N - n_y|: eq. 1 exactly."""
    cases = [c for c in random_cases() if c[2] > 0]
    ours = rewards([float(c) for c, _, _ in cases], [n for _, n, _ in cases], [t for _, _, t in cases])
    theirs = [official_reward(c, t, n, 0.0003) for c, n, t in cases]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-12


def test_max_prompts_against_the_official_reward():
    """Three departures, each exact: (1) with multiplier_reward=True the code's Max reward is eq. 2 at alpha_code / 2
    (its (sc + 1) / 2 halves the slope): ours at alpha equals theirs at 2 alpha; (2) with the default
    multiplier_reward=False (run_l1_exact.sh's setting, and what a Max run gets if it passes only linear_reward) it
    is additive, correct + clip(alpha_code / 2 (N - n_y) + 1/2, 0, 1), so a wrong answer under budget earns up to 1;
    (3) run_l1_max.sh passes no reward_config flag, and the yaml defaults (all False) leave the verdict alone."""
    cases = [c for c in random_cases(seed=1) if c[2] < 0]
    correct, lengths, targets = [float(c) for c, _, _ in cases], [n for _, n, _ in cases], [t for _, _, t in cases]
    ours = rewards(correct, lengths, targets)
    mult = [official_reward(c, t, n, 2 * 0.0003, multiplier=True) for c, n, t in cases]
    assert max(abs(a - b) for a, b in zip(ours, mult)) <= 1e-12
    additive = [official_reward(c, t, n, 2 * 0.0003) for c, n, t in cases]
    half = rewards([1.0] * len(cases), lengths, targets)  # clip(alpha (N - n_y) + 1/2, 0, 1)
    assert max(abs(a - (c + h)) for a, c, h in zip(additive, correct, half)) <= 1e-12
    wrong_paid = [a for a, c in zip(additive, correct) if c == 0 and a > 0]
    assert len(wrong_paid) > 50  # wrong answers with reward > 0: ours gives them 0
    assert [official_reward(c, t, n, 0.0003, linear=False) for c, n, t in cases] == [bool(c) for c in correct]


def test_official_multiplier_zeroes_every_exact_prompt():
    """multiplier_reward=True on an Exact prompt: max(0, -alpha |N - n_y|) * correct = 0 for every completion (so the
    flag only suits Max prompts); eq. 1 (ours) keeps the signal."""
    cases = [c for c in random_cases(seed=2) if c[2] > 0]
    assert all(official_reward(c, t, n, 0.0003, multiplier=True) == 0 for c, n, t in cases)


# targets: drawn per row, in the prompt, reproducible -----------------------------------------------------------


def test_target_range_scales_the_papers_to_the_budget():
    assert l1.target_range(make_args(max_new_tokens=4096)) == (100, 4000)  # §4: U(100, 4000) at a 4K context
    assert l1.target_range(make_args(max_new_tokens=64)) == (2, 62)
    assert l1.target_range(make_args(max_new_tokens=2)) == (1, 2)  # the toy's 2 tokens: at least 1
    assert l1.target_range(make_args(max_new_tokens=16, target_frac=(0.5, 0.5))) == (8, 8)


def test_targets_are_uniform_reproducible_and_signed_by_prompt_type():
    """N ~ U{n_min..n_max} per row (20,000 rows, each value within 5 binomial sigma of 1/4), the same for the same
    (seed, row) and not for another seed; with --lcpo-mode max a share 1 - --exact-share of the rows are Max prompts
    (negative), none with --lcpo-mode exact."""
    args = make_args(max_new_tokens=4, target_frac=(0.25, 1.0))
    draws = [l1.draw_target(r, args) for r in range(20_000)]
    counts = np.bincount(draws, minlength=5)[1:]
    sigma = math.sqrt(20_000 * 0.25 * 0.75)
    assert min(draws) >= 1 and max(draws) <= 4 and all(abs(c - 5000) < 5 * sigma for c in counts), counts
    assert draws[:50] == [l1.draw_target(r, args) for r in range(50)]
    assert draws[:50] != [
        l1.draw_target(r, make_args(max_new_tokens=4, target_frac=(0.25, 1.0), seed=2)) for r in range(50)
    ]
    mixed = make_args(lcpo_mode="max", exact_share=0.3)
    signs = [l1.draw_target(r, mixed) < 0 for r in range(20_000)]
    assert abs(np.mean(signs) - 0.7) < 5 * math.sqrt(0.21 / 20_000)
    assert all(l1.draw_target(r, make_args(lcpo_mode="max", exact_share=0.0)) < 0 for r in range(200))
    assert all(t > 0 for t in draws)


def test_target_text_is_the_official_instruction_tail():
    """scripts/data/deepscaler_dataset.py: f"{instruction} Think for {N} tokens." / "... Think for maximum {N}
    tokens." after the question; num_tokens = -N marks the second."""
    for n in (100, 2048, 4000):
        assert l1.target_text(n) == f" Think for {n} tokens."
        assert l1.target_text(-n) == f" Think for maximum {abs(-n)} tokens."


def test_prompts_hold_their_rows_target_across_drops_and_resume(toy_assets, tmp_path):
    """load_data's suffix puts each row's target at the end of its prompt; source_rows keeps rows and targets
    aligned when rows are dropped (an over-long question, an unparseable answer); a second load (what --resume does)
    gives the same prompts and targets."""
    import json

    from transformers import AutoTokenizer

    from common.data import load_data

    path = tmp_path / "train.jsonl"
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (0, 1)]]
    rows.insert(1, {"question": "1+" * 40 + "1=", "answer": "41"})  # over --max-prompt-tokens
    rows.insert(3, {"question": "2+2=", "answer": "\\frac{"})  # no parseable answer
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = make_args(
        model_name_or_path=toy_assets["model"], dataset_name=str(path), prompt_column="question",
        answer_column="answer", prompt_template="none", max_prompt_tokens=40, max_new_tokens=64,
        max_bad_answer_frac=0.5,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(toy_assets["model"])
    data, _ = load_data(args, tok, lambda *_: None, l1.prompt_suffix(args))
    assert data.source_rows == [0, 2, 4, 5]
    for prompt, row in zip(data.prompts, data.source_rows):
        n = l1.draw_target(row, args)
        assert tok.decode(prompt) == rows[row]["question"] + f" Think for {n} tokens."
    again, _ = load_data(args, tok, lambda *_: None, l1.prompt_suffix(args))
    assert again.prompts == data.prompts and again.source_rows == data.source_rows
    target_of = {tuple(p): l1.draw_target(r, args) for p, r in zip(data.prompts, data.source_rows)}
    got = l1.completion_targets(data.prompts[:2], target_of, args, "cpu")
    assert got.tolist() == [l1.draw_target(0, args)] * 4 + [l1.draw_target(2, args)] * 4


# the loss is GRPO's: value, finite differences, micro-batches -------------------------------------------------


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    correct = torch.randint(0, 2, (groups * g,), generator=gen).double()
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    targets = torch.tensor([3, 3, 3, 3, -2, -2, -2, -2, 6, 6, 6, 6])
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)
    ref = old + 0.1 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)
    return correct, lengths, targets, mask, old, logps, ref


def brute_loss(logps, old, adv, mask, args, ref):
    per_token = [
        [
            ppo_clip_token(logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high)
            + args.beta * k3(logps[i, t].item(), ref[i, t].item())
            for t in range(logps.shape[1])
        ]
        for i in range(logps.shape[0])
    ]
    return aggregate(per_token, mask.tolist(), "seq-mean-token-mean")


def test_loss_value_gradient_and_micro_batches_on_lcpo_advantages():
    args = make_args(beta=0.001, alpha=0.1)
    correct, lengths, targets, mask, old, logps, ref = rollout(1)
    r = l1.compute_rewards(correct, lengths, torch.zeros(12, dtype=torch.bool), args, targets)
    adv = l1.compute_advantages(r, args)
    want = group_advantages(r.tolist(), 4, eps=args.adv_eps)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    reference = lambda lp: brute_loss(lp, old, adv, mask, args, ref)
    assert_loss_matches_reference(
        l1.compute_policy_loss, reference, logps, old, adv, mask, args, loss_atol=1e-10, ref_logps=ref
    )
    assert_micro_batches_add_up(
        l1.compute_policy_loss, logps, old, adv, mask, args, stat_keys=(*PPO_CLIP_STATS, "kl_ref"), ref_logps=ref
    )


# metrics, evaluation at budgets, flags --------------------------------------------------------------------------


class OneProcess:
    """accelerate's gather on one process."""

    def pad_across_processes(self, x, pad_index=0):
        return x

    def gather(self, x):
        return x


def test_target_metrics_by_hand():
    """n_y [10, 11, 20, 5], N [10, 10, 10, -5]: |n_y - N| = 0, 1, 10, 0 -> mean 2.75; within N / 10: 0, 1 (= 1.0),
    0 -> yes, yes, no, yes (a Max prompt's N counts as its budget)."""
    m = l1.target_metrics(OneProcess(), torch.tensor([10, 11, 20, 5]), torch.tensor([10, 10, 10, -5]))
    assert m == {"train/target_error": 2.75, "train/target_within_10pct": 0.75}


class FixedSampler:
    """Returns completions of given lengths and texts, k per prompt, whatever the prompt."""

    def __init__(self, outs):
        self.outs, self.calls = outs, []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens):
        from common.sampling import Completion

        self.calls.append((len(prompts), n, temperature, top_p, max_new_tokens))
        return [Completion(list(range(length)), text, False) for length, text in self.outs[: len(prompts) * n]]


def test_evaluate_budgets_by_hand():
    """Two questions x k = 2 at budget 10: lengths 10, 11, 4, 20 (|n_y - 10| = 0, 1, 6, 10: mean 4.25; within 1 of
    10, the boundary included: two), three right answers of four."""
    args = make_args(eval_samples=2, eval_temperature=0.6, eval_max_new_tokens=32, reward_format="any")
    sampler = FixedSampler([(10, "5"), (11, "4"), (4, "7"), (20, "7")])
    m = l1.evaluate_budgets(sampler, {("data/test.jsonl", 10): ([[1], [2]], ["5", "7"])}, args)
    assert m == {
        "eval/test/n10/avg@2": 0.75,  # "5" right, "4" wrong, "7" right twice
        "eval/test/n10/length_mean": 11.25,
        "eval/test/n10/target_error": 4.25,
        "eval/test/n10/target_within_10pct": 0.5,
    }
    assert sampler.calls == [(2, 2, 0.6, 1.0, 32)]


def test_budget_eval_sets_put_each_budget_in_the_prompts(toy_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_assets["model"])
    common = dict(
        eval_every=1, eval_datasets=[toy_assets["test"]], eval_prompt_column="question", eval_answer_column="answer",
        eval_limit=3, prompt_template="none", max_prompt_tokens=64, max_new_tokens=16, eval_budget_frac=[0.25, 1.0],
    )  # fmt: skip
    sets = l1.budget_eval_sets(make_args(**common), tok, lambda *_: None)
    assert sorted(sets) == [(toy_assets["test"], 4), (toy_assets["test"], 16)]
    (prompts, golds) = sets[toy_assets["test"], 4]
    assert len(prompts) == 3 and all(tok.decode(p).endswith(" Think for 4 tokens.") for p in prompts)
    maximum = l1.budget_eval_sets(make_args(**common, lcpo_mode="max"), tok, lambda *_: None)
    assert tok.decode(maximum[toy_assets["test"], 16][0][0]).endswith(" Think for maximum 16 tokens.")
    assert l1.budget_eval_sets(make_args(**{**common, "eval_every": 0}), tok, lambda *_: None) == {}


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"target_frac": (0.5, 0.2)}, "--target-frac"),
        ({"target_frac": (0.1, 1.5)}, "--target-frac"),
        ({"exact_share": 1.5}, "--exact-share"),
        ({"alpha": -1.0}, "--alpha"),
        ({"eval_budget_frac": [0.5, 0.0]}, "--eval-budget-frac"),
    ],
)
def test_bad_flags_are_one_line(flags, message):
    with pytest.raises(SystemExit, match=message):
        l1.check_args(make_args(**flags))


def test_defaults_are_the_papers():
    a = l1.Args()
    assert (a.alpha, a.delta, a.lcpo_mode, a.exact_share) == (0.0003, 0.5, "exact", 0.5)
    assert (a.learning_rate, a.prompts_per_step, a.group_size, a.max_new_tokens, a.temperature) == (
        1e-6,
        128,
        16,
        4096,
        0.6,
    )
    assert (a.beta, a.num_mini_batches, a.eval_max_new_tokens) == (0.001, 2, 8192)
    assert [round(f * 4096) for f in a.eval_budget_frac] == [512, 1024, 2048, 3600]


# the shared length percentiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths,p50,p90",
    [
        ([1, 2, 3, 4], 2.5, 3.7),  # positions 1.5 and 2.7 between order statistics
        ([5], 5.0, 5.0),  # one sample
        ([7, 7, 7, 7], 7.0, 7.0),  # all equal
        ([10, 1, 100, 2, 3, 50, 4, 6, 8, 9], 7.0, 55.0),  # unsorted: sorted 1 2 3 4 6 8 9 10 50 100
    ],
)
def test_length_percentiles_by_hand(lengths, p50, p90):
    n = len(lengths)
    # as step_metrics passes them: gathered (float) over all ranks
    m = rollout_metrics(torch.zeros(n), torch.tensor(lengths, dtype=torch.float32), torch.zeros(n), torch.ones(n), n)
    assert (m["train/response_length_p50"], m["train/response_length_p90"]) == pytest.approx((p50, p90), abs=1e-12)
    assert (p50, p90) == pytest.approx(tuple(np.quantile(lengths, [0.5, 0.9])), abs=1e-12)


@pytest.mark.slow
def test_a_run_rewards_each_completion_against_its_prompts_target(toy_assets, tmp_path, monkeypatch):
    """Two steps of l1.py on the toy task (N in 1..16 of 16 new tokens): every reward the loop computes gets, for
    each completion, the N its prompt says, and the logged train/target_error is the mean |n_y - N| of them."""
    import glob
    import json
    import os
    import re

    import tyro
    from transformers import AutoTokenizer

    from tests.test_scripts import toy_flags

    tok, seen = AutoTokenizer.from_pretrained(toy_assets["model"]), []
    inner = l1.compute_rewards

    def compute_rewards(correct, lengths, truncated, args, targets):
        seen.append((lengths.clone(), targets.clone()))
        return inner(correct, lengths, truncated, args, targets)

    def completion_targets(prompts, target_of, args, device):
        said = [int(re.search(r"Think for (\d+) tokens\.$", tok.decode(p)).group(1)) for p in prompts]
        got = inner_targets(prompts, target_of, args, device)
        assert got.tolist() == [n for n in said for _ in range(args.group_size)]
        return got

    inner_targets = l1.completion_targets
    monkeypatch.setattr(l1, "compute_rewards", compute_rewards)
    monkeypatch.setattr(l1, "completion_targets", completion_targets)
    extra = {"max-new-tokens": 16, "target-frac": "0.0 1.0", "beta": 0, "exp-name": "t", "max-prompt-tokens": 40}
    flags = toy_flags(toy_assets, str(tmp_path), 2, **extra)
    i = flags.index("--target-frac")
    flags[i + 1 : i + 2] = ["0.0", "1.0"]
    l1.main(tyro.cli(l1.Args, args=flags))
    (path,) = glob.glob(os.path.join(tmp_path, "t__*", "metrics.jsonl"))
    rows = [json.loads(line) for line in open(path)]
    assert len(seen) == len(rows) == 2 and len({t for _, targets in seen for t in targets.tolist()}) > 3
    for (lengths, targets), row in zip(seen, rows):
        want = (lengths - targets).abs().double().mean().item()
        assert row["train/target_error"] == pytest.approx(want, rel=1e-6)
