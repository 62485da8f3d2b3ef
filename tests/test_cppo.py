"""cppo.py (CPPO, arXiv 2503.22342): the pruning by hand and against ports of the official code, the allocation, the
loss on the kept completions (GRPO's), and a run whose log-prob passes and backward see the kept rows alone."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import cppo
from tests.checks import PPO_CLIP_STATS, assert_loss_matches_reference, assert_micro_batches_add_up
from tests.reference import aggregate, group_advantages, k3, ppo_clip_token


def make_args(**kw):
    return cppo.Args(**{"group_size": 4, "beta": 0.0, **kw})


def kept(advantages, pruning, seed=0):
    adv = torch.tensor(advantages, dtype=torch.float64)
    return cppo.prune_completions(adv, make_args(pruning=pruning), torch.Generator().manual_seed(seed)).tolist()


# The official pruning, ported (lzhxmu/CPPO@52faeb37e2ef629da1da3ff1e7d0c9be578c4bdc): the TRL version,
# src/open_r1/grpo_trainer_math.py (metric 'smallest', each process's slice), and the verl port,
# cppo_verl/recipe/cppo/src/cppo_ray_trainer.py (the whole batch, on the driver).


def official_trl(advantages: torch.Tensor, pruning_rate: float) -> torch.Tensor:
    k = int(advantages.shape[0] * pruning_rate)
    abs_advantages = torch.abs(advantages)
    _, min_indices = torch.topk(abs_advantages, k=k, largest=False)
    mask = torch.ones_like(advantages, dtype=torch.bool)
    mask[min_indices] = False
    return mask.nonzero().flatten()  # the rows kept, in order (advantages[mask])


def official_verl(advantages: torch.Tensor, pruning_rate: float) -> torch.Tensor:
    retain_rate = 1 - pruning_rate
    k = int(advantages.shape[0] * retain_rate)
    abs_advantages = torch.abs(advantages)
    _, indices = torch.topk(abs_advantages, k=k, largest=True)
    return indices.sort()[0]


def official_repeat(pruning: float) -> int:
    """grpo_trainer_math.py with --allocation: self.repeat = int(1 / (1 - self.args.pruning))."""
    return int(1 / (1 - pruning))


# the pruning by hand ---------------------------------------------------------------------------------------------


def test_pruning_by_hand():
    adv = [0.5, -1.5, 0.0, 2.0, -0.1, 0.0, 1.0, -0.7]  # |A| ascending: rows 2, 5 (0), 4, 0, 7, 6, 1, 3
    assert kept(adv, 0.5) == [1, 3, 6, 7]  # int(8 x 0.5) = 4 pruned: both zeros, 0.1 and 0.5
    assert kept(adv, 0.75) == [1, 3]  # 6 pruned
    assert kept(adv, 0.875) == [3]
    assert kept(adv, 0.0) == list(range(8))  # P = 0: GRPO's batch
    assert kept(adv, 0.3) == [0, 1, 3, 4, 6, 7]  # int(2.4) = 2: the zeros
    assert kept([0.3], 0.5) == [0]  # one sample: int(0.5) = 0 pruned
    assert len(kept([0.1] * 10, 0.75)) == 3  # all |A| equal; int(7.5) = 7 pruned of 10
    assert len(kept([0.0] * 8, 0.5)) == 4  # no signal anywhere: still the (1 - P) share


def test_ties_are_broken_at_random_and_reproducibly():
    """All |A| equal: the kept rows depend on the generator alone (the same seed, the same rows) and every row is
    kept under some seed; a tie at the cut never prunes a larger |A|."""
    equal = [1.0, -1.0] * 4
    runs = [kept(equal, 0.5, seed) for seed in range(40)]
    assert runs[3] == kept(equal, 0.5, 3) and len({tuple(r) for r in runs}) > 5
    assert set().union(*map(set, runs)) == set(range(8)) and all(len(r) == 4 for r in runs)
    cut = [1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 2.0, 0.5]  # 4 pruned: 0, 0, 0.5 and one of the four 1s
    for seed in range(10):
        rows = kept(cut, 0.5, seed)
        assert 6 in rows and not {4, 5, 7} & set(rows) and len(set(rows) & {0, 1, 2, 3}) == 3


def test_pruning_equals_the_official_trl_code():
    """Continuous advantages (no ties): the same rows, for the paper's P and a P where N P is not an integer.
    Group advantages of 0/1 rewards (ties): the same multiset of kept |A| (which tied row goes is torch.topk's
    choice there, a random one here)."""
    gen = torch.Generator().manual_seed(0)
    for n in (10, 16, 48, 64):
        for p in (0.3, 0.5, 0.75, 0.875, 0.9375):
            adv = torch.randn(n, dtype=torch.float64, generator=gen)
            ours = cppo.prune_completions(adv, make_args(pruning=p), torch.Generator().manual_seed(1))
            assert ours.tolist() == official_trl(adv, p).tolist(), (n, p)
            rewards = torch.randint(0, 2, (n,), generator=gen).double()
            a = cppo.compute_advantages(rewards, make_args(group_size=n // 2 if n % 4 else 4))
            ours = cppo.prune_completions(a, make_args(pruning=p), torch.Generator().manual_seed(1))
            theirs = official_trl(a, p)
            assert sorted(a[ours].abs().tolist()) == sorted(a[theirs].abs().tolist()), (n, p)


def test_the_verl_port_keeps_one_fewer_where_n_p_is_fractional():
    """The verl port keeps int(N (1 - P)), the TRL code (ours) prunes int(N P): the same count when N P is an
    integer, one fewer kept by verl otherwise (N = 10, P = 0.75: 3 kept here, 2 there)."""
    adv = torch.linspace(-1, 1.3, 10, dtype=torch.float64)
    assert len(official_trl(adv, 0.75)) == len(kept(adv.tolist(), 0.75)) == 3 and len(official_verl(adv, 0.75)) == 2
    adv16 = torch.linspace(-1, 1.3, 16, dtype=torch.float64)
    for p in (0.5, 0.75, 0.875, 0.9375):
        assert official_verl(adv16, p).tolist() == kept(adv16.tolist(), p)


def test_allocation_is_the_official_repeat_and_refills_the_batch():
    """int(1 / (1 - P)) more prompts (P = 0.75 floats to exactly 4 either way); the kept completions are then GRPO's
    --prompts-per-step x G when 1 / (1 - P) is an integer, more otherwise."""
    for p, m in ((0.0, 1), (0.3, 1), (0.5, 2), (0.6, 2), (0.65, 2), (0.75, 4), (0.8, 5), (0.875, 8), (0.9375, 16)):
        assert cppo.allocation(make_args(pruning=p)) == official_repeat(p) == m
        assert cppo.allocation(make_args(pruning=p, allocation=False)) == 1
    share, g = 4, 16
    for p in (0.5, 0.75, 0.875, 0.9375):
        n = share * cppo.allocation(make_args(pruning=p)) * g
        assert n - int(n * p) == share * g
    n = share * cppo.allocation(make_args(pruning=0.6)) * g
    assert n - int(n * 0.6) == 52  # 128 sampled, int(76.8) pruned: 52 kept, fewer than GRPO's 64


def test_pruning_counts():
    adv = torch.tensor([0.5, 0.0, -1.0, 0.0, 0.2, 0.0])
    counts = cppo.pruning_counts(adv, [0, 2])
    assert counts.tolist() == [2.0, 4.0, 1.0]  # pruned rows 1, 3, 4, 5: one (0.2) had a signal
    m = cppo.pruning_metrics(OneProcessReduce(), counts)
    assert m == {"train/cppo_kept": 2.0, "train/cppo_pruned": 4.0, "train/cppo_pruned_signal_frac": 0.25}
    none = cppo.pruning_metrics(OneProcessReduce(), cppo.pruning_counts(adv, list(range(6))))
    assert (
        none["train/cppo_pruned"] == 0
        and none["train/cppo_pruned_signal_frac"] != none["train/cppo_pruned_signal_frac"]
    )


class OneProcessReduce:
    def reduce(self, x, reduction):
        return x.clone()


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"pruning": 1.0}, "--pruning"),
        ({"pruning": -0.1}, "--pruning"),
        ({"replay": True}, "--replay"),
        ({"pruning": 0.75, "allocation": False, "prompts_per_step": 2, "num_mini_batches": 4}, "--num-mini-batches"),
    ],
)
def test_bad_flags_are_one_line(flags, message):
    with pytest.raises(SystemExit, match=message):
        cppo.check_args(make_args(**{"prompts_per_step": 4, **flags}), world=1)
    cppo.check_args(make_args(prompts_per_step=4, pruning=0.75, num_mini_batches=4), world=1)  # 16 kept of 64


# the loss on the kept completions ---------------------------------------------------------------------------------


def rollout(seed, groups=3, g=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * g,), generator=gen).double()
    rewards[:g] = 1.0  # an all-correct group: A = 0, pruned first
    lengths = torch.randint(1, t + 1, (groups * g,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = -torch.rand(groups * g, t, dtype=torch.float64, generator=gen) * 3
    logps = old + 0.4 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)
    ref = old + 0.1 * torch.randn(groups * g, t, dtype=torch.float64, generator=gen)
    return rewards, mask, old, logps, ref


def brute_loss(logps, old, adv, mask, args, ref):
    """1/|K| sum_{i in K} 1/|o_i| sum_t [-min(r A, clip(r) A) + beta k3], over the rows given (the kept ones)."""
    per_token = [
        [
            ppo_clip_token(logps[i, t].item(), old[i, t].item(), adv[i].item(), args.clip_eps_low, args.clip_eps_high)
            + args.beta * k3(logps[i, t].item(), ref[i, t].item())
            for t in range(logps.shape[1])
        ]
        for i in range(logps.shape[0])
    ]
    return aggregate(per_token, mask.tolist(), "seq-mean-token-mean")


def test_loss_on_the_kept_rows_value_gradient_and_micro_batches():
    args = make_args(beta=0.04, pruning=0.5)
    rewards, mask, old, logps, ref = rollout(1)
    adv = cppo.compute_advantages(rewards, args)
    want = group_advantages(rewards.tolist(), 4, eps=args.adv_eps)  # eps 1e-4 (the official code's)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    k = cppo.prune_completions(adv, args, torch.Generator().manual_seed(0))
    # two all-correct groups here (rows 0-7, A = 0): 6 of them pruned, all four rows with a signal kept
    assert len(k) == 6 and {8, 9, 10, 11} <= set(k.tolist())
    sub = [x[k] for x in (logps, old, adv, mask, ref)]
    reference = lambda lp: brute_loss(lp, sub[1], sub[2], sub[3], args, sub[4])
    assert_loss_matches_reference(
        cppo.compute_policy_loss, reference, sub[0], sub[1], sub[2], sub[3], args, loss_atol=1e-10, ref_logps=sub[4]
    )
    chunks = (slice(0, 1), slice(1, 4), slice(4, 6))
    assert_micro_batches_add_up(
        cppo.compute_policy_loss, *sub[:4], args, stat_keys=(*PPO_CLIP_STATS, "kl_ref"), chunks=chunks, ref_logps=sub[4]
    )


def test_pruning_zero_advantages_rescales_grpos_gradient():
    """On-policy without KL, a row with A = 0 adds nothing to GRPO's gradient but counts in its 1/N: pruning only
    such rows gives GRPO's gradient times N / |K| (CPPO's larger step on the rows with a signal)."""
    args = make_args(pruning=4 / 12)
    rewards, mask, _, logps, _ = rollout(2)
    adv = cppo.compute_advantages(rewards, args)
    assert (adv[:4] == 0).all() and (adv[4:] != 0).all()
    k = cppo.prune_completions(adv, args, torch.Generator().manual_seed(0))
    assert k.tolist() == list(range(4, 12))
    whole = logps.detach().requires_grad_(True)
    (g_all,) = torch.autograd.grad(cppo.compute_policy_loss(whole, whole.detach(), adv, mask, args)[0], whole)
    part = logps[k].detach().requires_grad_(True)
    (g_kept,) = torch.autograd.grad(cppo.compute_policy_loss(part, part.detach(), adv[k], mask[k], args)[0], part)
    torch.testing.assert_close(g_kept, g_all[k] * 12 / 8, rtol=1e-12, atol=1e-15)


def test_defaults_are_the_official_scripts():
    a = cppo.Args()
    assert (a.pruning, a.allocation, a.group_size, a.ppo_epochs, a.beta, a.adv_eps) == (0.5, True, 16, 2, 0.04, 1e-4)
    assert (a.max_new_tokens, a.max_prompt_tokens, a.temperature, a.learning_rate) == (1024, 512, 1.0, 1e-6)


# end to end: the pruned rows never reach the log-prob passes or the backward; P = 0 is grpo.py ---------------------


class Recorder:
    """Wraps cppo's compute_logps and update_policy, recording the rows each receives."""

    def __init__(self, monkeypatch):
        self.logps, self.updates = [], []
        inner_logps, inner_update = cppo.compute_logps, cppo.update_policy

        def compute_logps(policy, batch, *a, **kw):
            self.logps.append(batch["ids"].shape[0])
            return inner_logps(policy, batch, *a, **kw)

        def update_policy(policy, optimizer, scheduler, accelerator, batch, *a, **kw):
            self.updates.append(batch["ids"].shape[0])
            return inner_update(policy, optimizer, scheduler, accelerator, batch, *a, **kw)

        monkeypatch.setattr(cppo, "compute_logps", compute_logps)
        monkeypatch.setattr(cppo, "update_policy", update_policy)


def toy_flags(assets, out, **extra):
    from tests.test_scripts import toy_flags as flags

    return flags(assets, out, 2, **{"log-samples-every": 0, **extra})


@pytest.mark.slow
def test_pruned_rows_skip_the_log_prob_passes_and_the_backward(toy_assets, tmp_path, monkeypatch):
    """P = 0.75 with allocation on 8 prompts x G = 8 a step: 4 x 8 x 8 = 256 completions sampled (the metrics count
    them), 64 kept; the old and the reference log-prob passes (2 epochs, beta > 0) and the update get those 64."""
    import tyro

    rec = Recorder(monkeypatch)
    flags = toy_flags(toy_assets, str(tmp_path), **{"pruning": 0.75, "beta": 0.04, "exp-name": "p", "seed": 3})
    cppo.main(tyro.cli(cppo.Args, args=flags))
    rows = [json.loads(line) for line in open(glob.glob(os.path.join(tmp_path, "p__*", "metrics.jsonl"))[0])]
    assert [(r["train/cppo_kept"], r["train/cppo_pruned"]) for r in rows] == [(64.0, 192.0)] * 2
    signal = sum(r["train/no_signal"] == 0 for r in rows)
    assert signal > 0 and rec.logps == [64, 64] * signal and rec.updates == [64] * signal


@pytest.mark.slow
def test_no_pruning_is_grpo(toy_assets, tmp_path):
    """--pruning 0 --no-allocation with grpo.py's eps and epochs: every metric grpo.py logs, equal, step by step."""
    import tyro

    import grpo

    same = {"beta": 0.04, "exp-name": "x", "seed": 5, "ppo-epochs": 2, "adv-eps": 1e-6}
    grpo.main(tyro.cli(grpo.Args, args=toy_flags(toy_assets, str(tmp_path / "grpo"), **same)))
    flags = toy_flags(toy_assets, str(tmp_path / "cppo"), **same, pruning=0.0) + ["--no-allocation"]
    cppo.main(tyro.cli(cppo.Args, args=flags))
    metrics = []
    for name in ("grpo", "cppo"):
        (path,) = glob.glob(os.path.join(tmp_path, name, "x__*", "metrics.jsonl"))
        metrics.append([json.loads(line) for line in open(path)])
    assert len(metrics[0]) == len(metrics[1]) == 2
    for a, b in zip(*metrics):
        a = {k: v for k, v in a.items() if not k.startswith("time/")}
        assert a == {k: v for k, v in b.items() if k in a} and b["train/cppo_pruned"] == 0
