"""Side by side: the losses of sapo.py, gmpo.py, dppo.py, clip_cov.py (Clip-Cov and KL-Cov) and m2po.py, the
advantages and losses of reinforce_pp.py and rloo.py, and ppo.py's and vapo.py's GAE, whitening and value loss, against
the peers' own code (verl, TRL, SkyRL, AReaL, prime-rl, OpenRLHF, Open-Reasoner-Zero and the papers' official
repositories), on the same random float64 inputs: for each (loss, peer, configuration) the loss values and max |d loss
/ d logps ours - theirs| (the value loss's: d loss / d values); for an advantage, max |ours - theirs| over the
completions' tokens.

The peers' code is never copied into this repository: it is read at run time from clones you provide, at the commits
pinned in PEERS, and only the functions listed in CUTS (path:lines) are cut out and exec'd, with small stand-ins for
their config objects. --mirrors DIR holds one git repository per peer, named <owner>+<name>: a mirror directory with
the bare repository in repo/ (DIR/<owner>+<name>/repo), a normal clone, or a bare clone. A peer whose repository or
pinned commit is missing is skipped with a one-line note. Not part of the test suite (it needs those clones); the
scripts' own tests check the losses against loop references.

    python tools/compare_peers.py --mirrors DIR [--markdown OUT.md]

Prints a Markdown table (and writes it with --markdown); exits 1 when a row expected to agree does not.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import math
import os
import shlex
import subprocess
import sys
import textwrap
import types
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.dont_write_bytecode = True  # importing the scripts leaves no __pycache__ in the checkout
import clip_cov  # noqa: E402
import dppo  # noqa: E402
import gmpo  # noqa: E402
import m2po  # noqa: E402
import ppo  # noqa: E402
import reinforce_pp  # noqa: E402
import rloo  # noqa: E402
import sapo  # noqa: E402
import vapo  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# The pinned peer code
# ---------------------------------------------------------------------------------------------------------------------
VERL, VERL_PR, TRL = "verl-project+verl", "volcengine+verl", "huggingface+trl"
SKYRL, AREAL, PRIME = "NovaSky-AI+SkyRL", "inclusionAI+AReaL", "PrimeIntellect-ai+prime-rl"
STABLE, GMPO_OFF = "sail-sg+Stable-RL", "callsys+GMPO"
COV_OFF, M2PO_OFF = "PRIME-RL+Entropy-Mechanism-of-RL", "Infini-AI-Lab+M2PO"
OPENRLHF, ORZ = "OpenRLHF+OpenRLHF", "Open-Reasoner-Zero+Open-Reasoner-Zero"  # OpenRLHF: REINFORCE++'s code

PEERS: dict[str, str] = {  # repository -> the commit read
    VERL: "1dda039b9c6311889a9c9a26040677e1254814f9",  # 2026-08-22 (volcengine/verl's new home)
    # the head of the unmerged M2PO PR #4131, not on a branch: in a clone, `git fetch origin pull/4131/head`
    VERL_PR: "2c5ef1e1c8ed057bcd315504c699e4f627422ca0",
    TRL: "f2cd57710ae345ea6428ae95363267fcf38a3dc8",  # 2026-07-24
    SKYRL: "a9564572eb8e91076be43c1bd5e4615e3de17265",  # 2026-08-21
    AREAL: "4aef98d8d818af55b43621aaadba047ae10f4e77",  # 2026-05-21
    PRIME: "559b44772e471d1538537b8805cc77f3824a5e64",  # 2026-08-21
    STABLE: "c6af1d119c0fe30d16dd9a837d35fdf695acd226",  # 2026-03-02, DPPO's official code
    GMPO_OFF: "205b2bf412f150cf96c29b33273b81bcd1a9b20f",  # 2025-07-30, GMPO's official code (on oat)
    COV_OFF: "88505792fd97a11993445e93195145e3c1181955",  # 2025-06-26, Clip-Cov / KL-Cov's official code
    M2PO_OFF: "af54a3e8feffb7a66a8258003aebefa37759cec0",  # 2025-10-08, M2PO's official code
    OPENRLHF: "3c3be6234e0cb353e76bb8019947db9dfe99fca7",  # 2026-08-13, REINFORCE++'s official code
    ORZ: "3fdd9a07b4fb01e06005e6e74fc56690cde8a341",  # 2025-06-03, Open-Reasoner-Zero's official code
}

_VF, _VC = "verl/utils/torch_functional.py", "verl/trainer/ppo/core_algos.py"
_SK = "skyrl/backends/skyrl_train/utils/"
_ORL, _ORL_EM = "openrlhf/models/", "openrlhf/trainer/ppo_utils/experience_maker.py"
_TRL_RLOO, _TRL_U = "trl/trainer/rloo_trainer.py", "trl/trainer/utils.py"
# unit -> the cuts (repository, path, first line, last line, the def/class they hold; "" for a code block), exec'd
# together in one namespace; decorators are left out, except a dataclass's
CUTS: dict[str, list[tuple[str, str, int, int, str]]] = {
    "verl.F": [(VERL, _VF, 273, 291, "masked_sum"), (VERL, _VF, 294, 308, "masked_mean")],
    "verl": [
        (VERL, _VC, 1140, 1206, "agg_loss"),
        (VERL, _VC, 1622, 1703, "compute_policy_loss_sapo"),
        (VERL, _VC, 1928, 2010, "compute_policy_loss_geo_mean"),
        (VERL, _VC, 1380, 1457, "compute_policy_loss_dppo_tv"),
        (VERL, _VC, 1461, 1542, "compute_policy_loss_dppo_kl"),
        (VERL, _VC, 1743, 1844, "compute_policy_loss_clip_cov"),
        (VERL, _VC, 1848, 1924, "compute_policy_loss_kl_cov"),
    ],
    "trl.grpo": [(TRL, "trl/trainer/grpo_trainer.py", 2991, 3260, "_compute_loss")],  # GRPOTrainer's
    "trl.gmpo": [(TRL, "trl/experimental/gmpo/gmpo_trainer.py", 43, 155, "_compute_loss")],  # GMPOTrainer's
    "skyrl": [
        (SKYRL, _SK + "torch_utils.py", 180, 184, "masked_mean"),
        (SKYRL, _SK + "torch_utils.py", 187, 192, "safe_exp_delta"),
        (SKYRL, _SK + "ppo_utils.py", 1145, 1149, "reduce_loss"),
        (SKYRL, _SK + "ppo_utils.py", 591, 660, "sapo_policy_loss"),
        (SKYRL, _SK + "ppo_utils.py", 867, 935, "dppo_policy_loss"),
        (SKYRL, _SK + "ppo_utils.py", 939, 998, "compute_policy_loss_clip_cov"),
        (SKYRL, _SK + "ppo_utils.py", 1002, 1053, "compute_policy_loss_kl_cov"),
    ],
    "areal.sapo": [(AREAL, "areal/utils/functional/functional.py", 562, 638, "sapo_loss_fn")],
    "areal.ppo": [(AREAL, "areal/utils/functional/functional.py", 429, 559, "ppo_actor_loss_fn")],
    "areal.m2po": [
        (AREAL, "areal/trainer/ppo/actor.py", 769, 810, "_apply_m2po_masking"),
        (AREAL, "areal/trainer/ppo/actor.py", 813, 850, "_get_m2po_loss_mask"),
    ],
    # the body of `elif self.args.critic_type_modify == "gmpo":` in the loss of one micro-batch
    "gmpo.official": [(GMPO_OFF, "train_zero_math_gmpo.py", 676, 688, "")],
    "stable.F": [(STABLE, _VF, 266, 284, "masked_sum"), (STABLE, _VF, 287, 301, "masked_mean")],
    "stable": [
        (STABLE, _VC, 1026, 1081, "agg_loss"),
        (STABLE, _VC, 1160, 1238, "compute_policy_loss_with_mask"),
        (STABLE, _VC, 1241, 1308, "_compute_token_mask_for_policy_loss"),
    ],
    "prime": [
        (PRIME, "src/prime_rl/trainer/rl/loss.py", 13, 28, "LossInputs"),
        (PRIME, "src/prime_rl/trainer/rl/loss.py", 31, 36, "LossOutputs"),
        (PRIME, "src/prime_rl/trainer/rl/loss.py", 94, 97, "_safe_mean"),
        (PRIME, "src/prime_rl/trainer/rl/loss.py", 100, 106, "compute_importance_ratio_and_mismatch_kl"),
        (PRIME, "src/prime_rl/trainer/rl/loss.py", 109, 161, "default_loss_fn"),
    ],
    "cov.official.F": [(COV_OFF, _VF, 118, 120, "masked_sum"), (COV_OFF, _VF, 123, 125, "masked_mean")],
    "cov.official": [
        (COV_OFF, _VC, 316, 351, "agg_loss"),
        (COV_OFF, _VC, 469, 518, "compute_policy_loss_clip_cov"),
        (COV_OFF, _VC, 426, 467, "compute_policy_loss_kl_cov"),
    ],
    "m2po.official.F": [(M2PO_OFF, _VF, 132, 134, "masked_sum"), (M2PO_OFF, _VF, 137, 150, "masked_mean")],
    "m2po.official": [
        (M2PO_OFF, _VC, 451, 484, "agg_loss"),
        (M2PO_OFF, _VC, 683, 723, "_solve_tau_from_sorted_delta2"),
        (M2PO_OFF, _VC, 726, 755, "_get_trust_region_tokens_delta_sq"),
        (M2PO_OFF, _VC, 758, 809, "kpo_clip_harmful_tokens"),
        (M2PO_OFF, _VC, 487, 612, "get_ratio_stats"),
        (M2PO_OFF, _VC, 812, 867, "compute_m2po_policy_loss"),
    ],
    # REINFORCE++ and RLOO: verl's advantage estimators, its KL penalty (apply_kl_penalty's kl_penalty) and whitening
    "verl.W": [
        (VERL, _VF, 273, 291, "masked_sum"),
        (VERL, _VF, 294, 308, "masked_mean"),
        (VERL, _VF, 311, 326, "masked_var"),
        (VERL, _VF, 329, 346, "masked_whiten"),
    ],
    "verl.adv": [
        (VERL, _VC, 694, 731, "compute_reinforce_plus_plus_outcome_advantage"),
        (VERL, _VC, 536, 584, "compute_reinforce_plus_plus_baseline_outcome_advantage"),
        (VERL, _VC, 588, 636, "compute_rloo_outcome_advantage"),
        (VERL, _VC, 834, 868, "compute_rloo_vectorized_outcome_advantage"),
        (VERL, _VC, 2187, 2212, "kl_penalty"),
        (VERL, _VC, 2215, 2250, "kl_penalty_forward"),
    ],
    "verl.vanilla": [(VERL, _VC, 1140, 1206, "agg_loss"), (VERL, _VC, 1286, 1377, "compute_policy_loss_vanilla")],
    # OpenRLHF's whole advantage step (baselines, KL in the reward, returns, the global normalisation) and its loss
    "openrlhf.adv": [
        (OPENRLHF, _ORL + "utils.py", 64, 95, "compute_approx_kl"),
        (OPENRLHF, _ORL + "utils.py", 98, 126, "compute_reward"),
        (OPENRLHF, _ORL_EM, 238, 330, "compute_advantages_and_returns"),
        (OPENRLHF, _ORL_EM, 380, 411, "get_cumulative_returns"),
    ],
    "openrlhf.loss": [
        (OPENRLHF, _ORL + "utils.py", 166, 169, "masked_mean"),
        (OPENRLHF, _ORL + "loss.py", 11, 39, "aggregate_loss"),
        (OPENRLHF, _ORL + "loss.py", 116, 230, "PolicyLoss"),
    ],
    "trl.rloo.F": [
        (TRL, _TRL_U, 857, 890, "nanstd"),
        (TRL, _TRL_U, 960, 972, "nanmin"),
        (TRL, _TRL_U, 975, 987, "nanmax"),
    ],
    # RLOOTrainer._generate_and_score_completions from the KL in the reward to the advantages (a code block)
    "trl.rloo.adv": [(TRL, _TRL_RLOO, 1525, 1561, "")],
    "trl.rloo.loss": [(TRL, _TRL_RLOO, 1655, 1722, "_compute_loss")],
    "m2po.pr.F": [(VERL_PR, _VF, 163, 168, "masked_sum"), (VERL_PR, _VF, 171, 185, "masked_mean")],
    "m2po.pr": [
        (VERL_PR, _VC, 772, 808, "agg_loss"),
        (VERL_PR, _VC, 1779, 1823, "_solve_tau_from_sorted_delta2"),
        (VERL_PR, _VC, 1757, 1777, "_get_trust_region_tokens_delta_sq"),
        (VERL_PR, _VC, 1825, 1876, "kpo_clip_harmful_tokens"),
        (VERL_PR, _VC, 1880, 2000, "get_ratio_stats"),
        (VERL_PR, _VC, 2004, 2075, "compute_policy_loss_m2po"),
    ],
}
_OR = "openrlhf/"
CUTS.update(
    {  # the critics: GAE, whitening, the value loss
        "verl.critic": [
            (VERL, _VF, 210, 228, "clip_by_value"),
            (VERL, _VF, 273, 291, "masked_sum"),
            (VERL, _VF, 294, 308, "masked_mean"),
            (VERL, _VF, 311, 326, "masked_var"),
            (VERL, _VF, 329, 346, "masked_whiten"),
            (VERL, _VC, 1140, 1206, "agg_loss"),
            (VERL, _VC, 216, 263, "compute_gae_advantage_return"),
            (VERL, _VC, 2124, 2184, "compute_value_loss"),
        ],
        "openrlhf": [
            (OPENRLHF, _OR + "models/utils.py", 166, 169, "masked_mean"),
            (OPENRLHF, _OR + "models/loss.py", 11, 39, "aggregate_loss"),
            (OPENRLHF, _OR + "models/loss.py", 233, 269, "ValueLoss"),
            (OPENRLHF, _OR + "trainer/ppo_utils/experience_maker.py", 333, 377, "get_advantages_and_returns"),
        ],
        "orz": [
            (ORZ, "orz/ppo/utils.py", 118, 121, "masked_mean"),
            (ORZ, "orz/ppo/utils.py", 219, 290, "get_advantages_and_returns"),
            (ORZ, "orz/ppo/utils.py", 293, 319, "normalize_advantages"),
            (ORZ, "orz/ppo/actors.py", 81, 107, "ValueLoss"),
        ],
    }
)
FUTURE_ANNOTATIONS = {"areal.ppo", "prime"}  # their annotations name types the namespace does not have


# ---------------------------------------------------------------------------------------------------------------------
# Reading the peers' code
# ---------------------------------------------------------------------------------------------------------------------
class Missing(Exception):
    """A peer's repository, or its pinned commit, is not under --mirrors."""

    def __init__(self, repo: str, reason: str):
        super().__init__(f"{repo.replace('+', '/')}: {reason}")
        self.repo = repo


def git_dir(mirrors: str, repo: str) -> str:
    """The git directory of `repo` under `mirrors`: <repo>/repo (a bare mirror inside a directory), <repo>/.git (a
    clone) or <repo> (a bare clone)."""
    base = os.path.join(mirrors, repo)
    for inner in (os.path.join(base, "repo"), os.path.join(base, ".git")):
        if os.path.exists(inner):
            return inner
    return base


def cut(source: str, first: int, last: int, name: str) -> str:
    """Lines first..last (1-based, inclusive) of `source`, dedented; checked to hold the def/class `name` (a code
    block, name "": to parse)."""
    text = textwrap.dedent("\n".join(source.splitlines()[first - 1 : last]))
    body = ast.parse(text).body
    if name and not (len(body) == 1 and getattr(body[0], "name", None) == name):
        raise ValueError(f"lines {first}-{last} are not `{name}`")
    return text


def namespace(**extra: Any) -> dict[str, Any]:
    """Globals for exec'd peer code: what their modules import, and `extra` (stand-ins)."""
    import typing

    import numpy as np

    ns = dict(torch=torch, nn=torch.nn, np=np, math=math, Optional=typing.Optional, Any=Any, Callable=typing.Callable)
    ns.update(dataclass=dataclass, field=field, Tensor=Tensor, __name__="peer")
    sys.modules.setdefault("peer", types.ModuleType("peer"))  # dataclasses look their module up
    return {**ns, **extra}


class Peers:
    """The pinned peer code under --mirrors, read with `git show COMMIT:path` on first use."""

    def __init__(self, mirrors: str):
        self.mirrors = mirrors
        self.missing: dict[str, str] = {}  # repo -> why it is skipped
        self.used: list[str] = []  # provenance lines: repo@commit path:lines `name`
        self._sources: dict[tuple[str, str], str] = {}
        self._units: dict[str, dict[str, Any]] = {}

    def source(self, repo: str, path: str) -> str:
        if repo in self.missing:
            raise Missing(repo, self.missing[repo])
        if (repo, path) not in self._sources:
            where, commit = git_dir(self.mirrors, repo), PEERS[repo]
            if not os.path.exists(where):
                self.missing[repo] = f"no clone at {where}"
                raise Missing(repo, self.missing[repo])
            git = ["git", f"--git-dir={where}", "show", f"{commit}:{path}"]
            out = subprocess.run(git, capture_output=True, text=True)
            if out.returncode != 0:
                self.missing[repo] = f"cannot read {commit[:10]}:{path} in {where} ({out.stderr.strip()[:80]})"
                raise Missing(repo, self.missing[repo])
            self._sources[repo, path] = out.stdout
        return self._sources[repo, path]

    def code(self, unit: str) -> str:
        """`unit`'s cuts, joined."""
        parts = []
        for repo, path, first, last, name in CUTS[unit]:
            parts.append(cut(self.source(repo, path), first, last, name))
            what = f"`{name}`" if name else "(code block)"
            self.used.append(f"{repo.replace('+', '/')}@{PEERS[repo][:10]} {path}:{first}-{last} {what}")
        return "\n\n".join(parts)

    def load(self, unit: str, **extra: Any) -> dict[str, Any]:
        """The namespace with `unit`'s cuts exec'd in it (once; `extra` is used on the first call)."""
        if unit not in self._units:
            code = self.code(unit)
            if unit in FUTURE_ANNOTATIONS:
                code = "from __future__ import annotations\n" + code
            ns = namespace(**extra)
            exec(compile(code, f"<{unit}>", "exec"), ns)
            self._units[unit] = ns
        return self._units[unit]

    def functional(self, unit: str) -> SimpleNamespace:
        """A verl-style `verl_F` module: masked_mean and masked_sum."""
        ns = self.load(unit)
        return SimpleNamespace(masked_mean=ns["masked_mean"], masked_sum=ns["masked_sum"])


class Cfg(SimpleNamespace):
    """Stand-in for verl's ActorConfig / DictConfig and SkyRL's AlgorithmConfig: attributes plus .get()."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def noop_decorator(*args: Any, **kwargs: Any) -> Callable:
    return lambda f: f


def verl(p: Peers) -> dict[str, Any]:
    return p.load(
        "verl",
        verl_F=p.functional("verl.F"),
        register_policy_loss=noop_decorator,
        ActorConfig=Cfg,
        AlgoConfig=type("AlgoConfig", (), {}),
        DictConfig=Cfg,
        deprecated=noop_decorator,
    )


def verl_cfg(**kw: Any) -> Cfg:
    """verl's actor config: its defaults (ActorConfig clip_ratio_c 3.0), policy_loss fields and global_batch_info."""
    c = Cfg(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05)
    c.global_batch_info, c.loss_scale_factor = {}, None
    c.policy_loss = Cfg(clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002, ppo_kl_coef=0.1)
    for k, v in kw.items():
        setattr(c.policy_loss if k in vars(c.policy_loss) else c, k, v)
    return c


def skyrl(p: Peers) -> dict[str, Any]:
    def no_correction(loss, old, rollout, mask, cfg):
        return loss, mask, {}

    return p.load("skyrl", register_policy_loss=noop_decorator, apply_off_policy_correction=no_correction)


def skyrl_cfg(**kw: Any) -> Cfg:
    base = dict(
        loss_reduction="token_mean",
        eps_clip_low=0.2,
        eps_clip_high=0.2,
        off_policy_correction=None,
        sapo=Cfg(tau_pos=1.0, tau_neg=1.05),
        dppo=Cfg(dppo_type="binary_tv", delta_low=0.2, delta_high=0.2),
        clip_cov=Cfg(clip_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0),
        kl_cov=Cfg(kl_cov_frac=0.2, ppo_kl_coef=1.0),
    )
    return Cfg(**{**base, **kw})


class FakeAccelerator:
    num_processes, sync_gradients = 1, True

    def gather(self, t: Tensor) -> Tensor:
        return t

    gather_for_metrics = gather

    def reduce(self, t: Tensor, reduction: str = "sum") -> Tensor:
        return t


def trl_loss(p: Peers, unit: str, logps: Tensor, x: SimpleNamespace, **attrs: Any) -> Tensor:
    """TRL's `_compute_loss` (cut out of its trainer class) with a stand-in `self` whose log-prob forward returns
    `logps`."""
    fn = p.load(unit, nanmin=torch.min, nanmax=torch.max)["_compute_loss"]
    b, t = x.logps.shape
    trl_args = SimpleNamespace(
        delta=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05
    )
    self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=FakeAccelerator(),
        epsilon_low=0.2,
        epsilon_high=0.2,
        max_completion_length=t,
        args=trl_args,
    )
    for k, v in attrs.items():
        setattr(self, k, v)
    z = torch.zeros(b, 1, dtype=torch.long)
    inputs = dict(
        prompt_ids=z,
        prompt_mask=z,
        completion_ids=torch.zeros(b, t, dtype=torch.long),
        completion_mask=x.mask,
        advantages=x.adv,
        old_per_token_logps=x.old,
    )
    return fn(self, None, inputs)


# ---------------------------------------------------------------------------------------------------------------------
# Inputs, selections the peers' way, measurement
# ---------------------------------------------------------------------------------------------------------------------
B, T = 16, 16  # sequences of <= T tokens, in groups of 4
TOL = 1e-8  # float64 rounding is < 1e-13 here; the peers' masked_mean / agg_loss add 1e-8 to token counts, which
# moves O(1) per-token terms by ~1e-8 / |o_i|
CHUNKS = (slice(0, 5), slice(5, 7), slice(7, 16))  # 3 uneven micro-batches
COV_SEED = 1234  # the peers draw Clip-Cov's tokens with torch.randperm on the global RNG, seeded with this


def make_inputs(
    seed: int = 0,
    noise: float = 0.3,
    lo: float = -6.0,
    hi: float = -0.02,
    equal_lengths: bool = False,
    behav_noise: float = 0.1,
) -> SimpleNamespace:
    """Random float64 inputs: logps ~ U(lo, hi), old = logps - noise N(0, 1), sampler = old + behav_noise N(0, 1)
    (all < 0), 0/1 rewards with every group of 4 mixed, GRPO std-normalised advantages, ragged lengths."""
    g, f64 = torch.Generator().manual_seed(seed), torch.float64
    logps = lo + (hi - lo) * torch.rand(B, T, generator=g, dtype=f64)
    old = (logps - noise * torch.randn(B, T, generator=g, dtype=f64)).clamp(max=-1e-3)
    sampler = (old + behav_noise * torch.randn(B, T, generator=g, dtype=f64)).clamp(max=-1e-3)
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    rewards[0::4], rewards[1::4] = 1.0, 0.0
    rg = rewards.view(-1, 4)
    adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-6)).view(-1)
    lens = torch.full((B,), T) if equal_lengths else torch.randint(4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).double()
    return SimpleNamespace(logps=logps, old=old, sampler=sampler, adv=adv, mask=mask, lens=lens)


def per_token_adv(x: SimpleNamespace) -> Tensor:
    return x.adv[:, None].expand_as(x.logps).clone()


def skyrl_scaled_adv(x: SimpleNamespace, reduction: str) -> Tensor:
    """SkyRL pre-scales the advantages per mini-batch (apply_loss_reduction_to_advantages_minibatch); its loss
    functions only sum (reduce_loss)."""
    a = per_token_adv(x)
    if reduction == "token_mean":
        return a / x.mask.sum().clamp(min=1)
    return a / (a.shape[0] * x.mask.sum(-1, keepdim=True).clamp(min=1))  # sequence_mean


def peer_clip_cov_select(
    logps: Tensor, old: Tensor, adv: Tensor, mask: Tensor, args: clip_cov.Args, seed: int
) -> tuple[Tensor, Tensor]:
    """Clip-Cov's detached tokens drawn as the official code, verl and SkyRL draw them: candidates are the valid
    tokens not already PPO-clipped with lb < Cov < ub (Cov's means over the valid tokens); torch.randperm over them
    in row-major order, on the global RNG (here a generator seeded with `seed`, which is what the peers draw after
    torch.manual_seed(seed)); the first max(1, int(ratio N)). Returns (S [B, T] bool, keys [B, T]): keys rank the
    candidates in the randperm's order, so clip_cov.select_tokens with them must pick the same S."""
    valid, ratio, a = mask > 0, torch.exp(logps - old), adv[:, None]
    clipped = -a * ratio.clamp(1 - args.clip_eps_low, 1 + args.clip_eps_high) > -a * ratio
    a_all = a.expand_as(logps)
    cov = (a_all - a_all[valid].mean()) * (logps - logps[valid].mean())
    cand = torch.nonzero(valid & ~clipped & (cov > args.clip_cov_lb) & (cov < args.clip_cov_ub))
    perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))
    k = max(1, int(args.clip_cov_ratio * int(valid.sum())))
    sel, keys = torch.zeros_like(valid), torch.ones_like(logps)
    pick = cand[perm[:k]]
    sel[pick[:, 0], pick[:, 1]] = True
    order = cand[perm]
    keys[order[:, 0], order[:, 1]] = torch.arange(1, len(cand) + 1, dtype=logps.dtype) / (len(cand) + 1)
    return sel, keys


def value_and_grad(fn: Callable[[Tensor], Tensor], logps: Tensor) -> tuple[Tensor, Tensor]:
    lp = logps.clone().requires_grad_(True)
    with contextlib.redirect_stdout(io.StringIO()):  # the official M2PO code prints
        loss = fn(lp)
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), (torch.zeros_like(lp) if g is None else g)


@dataclass
class Row:
    loss: str
    peer: str
    config: str
    ours: float
    theirs: float
    dloss: float
    dgrad: float
    expect: bool  # expected to agree
    note: str = ""
    tol: float = TOL  # "match" below it (a peer that computes in float32: its rounding)

    @property
    def result(self) -> str:
        if self.dloss < 1e-12 and self.dgrad < 1e-12:
            return "exact"
        if self.dloss < self.tol and self.dgrad < self.tol:
            return "match"
        return "differs (by design)" if not self.expect else "**UNEXPECTED DIFF**"

    @property
    def unexpected(self) -> bool:
        return self.expect and self.result not in ("exact", "match")


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # missing repo -> rows skipped

    def compare(
        self,
        loss: str,
        peer: str,
        config: str,
        ours: Callable[[Tensor], Tensor],
        theirs: Callable[[Tensor], Tensor],
        x: SimpleNamespace,
        note: str | Callable[[Tensor, Tensor], str] = "",
        expect: bool = True,
    ) -> None:
        """A row: both losses and their gradients wrt the log-probs at x.logps. note: text, or made from the two
        gradients (ours, theirs)."""
        try:
            lo, go = value_and_grad(ours, x.logps)
            lt, gt = value_and_grad(theirs, x.logps)
        except Missing as e:
            self.skip(e)
            return
        note = note(go, gt) if callable(note) else note
        dl, dg = abs(lo - lt).item(), (go - gt).abs().max().item()
        self.rows.append(Row(loss, peer, config, lo.item(), lt.item(), dl, dg, expect, note))

    def record(
        self,
        loss: str,
        peer: str,
        config: str,
        fn: Callable[[], tuple[float, float, float, str]],
        expect: bool = True,
        tol: float = TOL,
    ) -> None:
        """A row that is not a loss: fn() gives (ours, theirs, |difference|, note); `expect`: expected to agree (to
        `tol`)."""
        try:
            ours, theirs, diff, note = fn()
        except Missing as e:
            self.skip(e)
            return
        self.rows.append(Row(loss, peer, config, ours, theirs, diff, 0.0, expect, note, tol))

    def skip(self, e: Missing) -> None:
        if e.repo not in self.skipped:
            print(f"skipped {e}", file=sys.stderr)
        self.skipped[e.repo] = self.skipped.get(e.repo, 0) + 1


# ---------------------------------------------------------------------------------------------------------------------
# SAPO
# ---------------------------------------------------------------------------------------------------------------------
def run_sapo(p: Peers, t: Table) -> None:
    x = make_inputs(1, noise=0.6)
    args = sapo.Args(rollout_correction="none")

    def ours(lp: Tensor, x: SimpleNamespace = x) -> Tensor:
        return sapo.compute_policy_loss(lp, x.old, x.adv, x.mask, args)[0]

    cfg = verl_cfg()
    t.compare(
        "SAPO",
        "verl sapo",
        "tau 1/1.05, forced seq-mean-token-mean",
        ours,
        lambda lp: verl(p)["compute_policy_loss_sapo"](x.old, lp, per_token_adv(x), x.mask, config=cfg)[0],
        x,
    )
    t.compare(
        "SAPO",
        "TRL GRPOTrainer loss_type=sapo",
        "sapo_temperature_pos/neg 1/1.05",
        ours,
        lambda lp: trl_loss(p, "trl.grpo", lp, x, loss_type="sapo"),
        x,
    )
    t.compare(
        "SAPO",
        "SkyRL sapo",
        "sequence_mean (pre-scaled A, summed)",
        ours,
        lambda lp: skyrl(p)["sapo_policy_loss"](
            lp, x.old, skyrl_scaled_adv(x, "sequence_mean"), skyrl_cfg(loss_reduction="sequence_mean"), x.mask
        )[0],
        x,
    )

    def areal(lp: Tensor, x: SimpleNamespace) -> Tensor:
        return p.load("areal.sapo")["sapo_loss_fn"](lp, x.old, per_token_adv(x), 1.0, 1.05, x.mask.bool())[0]

    t.compare(
        "SAPO",
        "AReaL sapo_loss_fn",
        "as shipped: token-mean (ragged lengths)",
        ours,
        lambda lp: areal(lp, x),
        x,
        note="AReaL aggregates by token-mean over the micro-batch's tokens; the paper, verl, TRL, SkyRL by "
        "seq-mean-token-mean",
        expect=False,
    )
    xe = make_inputs(1, noise=0.6, equal_lengths=True)
    t.compare(
        "SAPO",
        "AReaL sapo_loss_fn",
        "equal lengths (token-mean = seq-mean)",
        lambda lp: ours(lp, xe),
        lambda lp: areal(lp, xe),
        xe,
    )


# ---------------------------------------------------------------------------------------------------------------------
# GMPO
# ---------------------------------------------------------------------------------------------------------------------
def run_gmpo(p: Peers, t: Table) -> None:
    x = make_inputs(2, noise=0.4)
    args = gmpo.Args(rollout_correction="none")  # log-space clip 0.4 / 0.4

    def ours(lp: Tensor) -> Tensor:
        return gmpo.compute_policy_loss(lp, x.old, x.adv, x.mask, args)[0]

    cfg = verl_cfg(clip_ratio=0.4)

    def geo_mean(lp: Tensor, c: slice) -> Tensor:
        fn = verl(p)["compute_policy_loss_geo_mean"]
        return fn(x.old[c], lp[c], per_token_adv(x)[c], x.mask[c], config=cfg)[0]

    t.compare("GMPO", "verl geo_mean", "clip_ratio 0.4, one micro-batch", ours, lambda lp: geo_mean(lp, slice(None)), x)
    t.compare(
        "GMPO",
        "verl geo_mean",
        "3 uneven micro-batches, losses summed",
        ours,
        lambda lp: sum(geo_mean(lp, c) for c in CHUNKS),
        x,
        note="verl's geo_mean ends in torch.mean over the micro-batch's sequences and ignores global_batch_info: "
        "each micro-batch is weighted 1/its own size, not 1/mini-batch size",
        expect=False,
    )
    t.compare(
        "GMPO",
        "TRL experimental GMPOTrainer",
        "epsilon 0.4 (log space)",
        ours,
        lambda lp: trl_loss(p, "trl.gmpo", lp, x, epsilon_low=0.4, epsilon_high=0.4),
        x,
    )

    def official(lp: Tensor) -> Tensor:
        # train_batch_size_per_device = 1 (scripts/qwen2.5-math-7b-gmpo.sh): one sequence per backward, gradients
        # accumulated over the batch (DeepSpeed divides by the accumulation steps): the mean over sequences
        code = compile(p.code("gmpo.official"), "<gmpo.official>", "exec")
        total = torch.zeros(())
        for i in range(B):
            n = int(x.lens[i])
            env = dict(
                torch=torch,
                self=SimpleNamespace(args=SimpleNamespace(cliprange=0.4)),
                mb_advantage=x.adv[i : i + 1, None],
                new_logps=lp[i : i + 1, :n],
                mb_logps=x.old[i : i + 1, :n],
                mb_response_masks=x.mask[i : i + 1, :n].bool(),
            )
            exec(code, env)
            total = total + env["pg_losses"].sum()
        return total / B

    t.compare("GMPO", "official callsys/GMPO (oat)", "cliprange 0.4, per-sequence, mean", ours, official, x)


# ---------------------------------------------------------------------------------------------------------------------
# DPPO
# ---------------------------------------------------------------------------------------------------------------------
def dppo_token_mean(lp: Tensor, x: SimpleNamespace, args: dppo.Args) -> Tensor:
    """dppo.py's loss as a token mean: its seq-mean-token-sum-norm, sum / (num_seqs L_max), with num_seqs = the
    token count N and L_max = 1."""
    one = replace(args, max_new_tokens=1)
    return dppo.compute_policy_loss(lp, x.old, x.adv, x.mask, one, num_seqs=x.mask.sum(), rollout_logps=x.sampler)[0]


def run_dppo(p: Peers, t: Table) -> None:
    x = make_inputs(3, noise=0.5, lo=-2.5, hi=-0.02)
    z = torch.zeros(B, T)
    gbi = dict(dp_size=1, batch_num_tokens=x.mask.sum(), global_batch_size=B, loss_scale_factor=T)

    def verl_dppo(lp: Tensor, name: str, c: Cfg) -> Tensor:  # the authors' bypass mode: old_log_prob := mu
        agg = "seq-mean-token-sum-norm"
        return verl(p)[name](x.sampler, lp, per_token_adv(x), x.mask, loss_agg_mode=agg, config=c)[0]

    for div, delta in (("binary-tv", 0.15), ("binary-kl", 0.05)):
        tag, verl_fn = div[-2:].upper(), f"compute_policy_loss_dppo_{div[-2:]}"
        stable_mode = "dppo_" + div.replace("-", "_")
        args = dppo.Args(dppo_divergence=div, max_new_tokens=T)  # delta 0.15 (TV) / 0.05 (KL), C off

        def ours(lp: Tensor, a: dppo.Args = args) -> Tensor:
            return dppo.compute_policy_loss(lp, x.old, x.adv, x.mask, a, rollout_logps=x.sampler)[0]

        cfg = verl_cfg(clip_ratio=delta, clip_ratio_c=1e4, global_batch_info=gbi)
        t.compare(
            f"DPPO-{tag}",
            f"verl dppo_{div[-2:]}",
            f"bypass (old:=sampler), delta {delta}, C 1e4, sum-norm L=T",
            ours,
            lambda lp, f=verl_fn, c=cfg: verl_dppo(lp, f, c),
            x,
        )
        cfg3 = verl_cfg(clip_ratio=delta, global_batch_info=gbi)  # ActorConfig.clip_ratio_c default 3.0
        t.compare(
            f"DPPO-{tag}",
            f"verl dppo_{div[-2:]}",
            "as configured by default: ActorConfig clip_ratio_c=3.0",
            ours,
            lambda lp, f=verl_fn, c=cfg3: verl_dppo(lp, f, c),
            x,
            note="config.get('clip_ratio_c', 20.0) finds ActorConfig's field (3.0): w truncated at 3 unless "
            "clip_ratio_c is set (the authors' script sets 10000)",
            expect=False,
        )
        scfg = Cfg(clip_ratio=delta, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=1e4)
        scfg.global_batch_info, scfg.policy_loss = dict(batch_num_tokens=x.mask.sum()), Cfg(loss_mode=stable_mode)

        def stable(lp: Tensor, c: Cfg = scfg, m: str = stable_mode) -> Tensor:
            ns = p.load("stable", verl_F=p.functional("stable.F"))
            fn = ns["compute_policy_loss_with_mask"]
            adv = per_token_adv(x)
            topk = dict(topk_kl=z, topk_tv=z, entropy=z)
            return fn(x.old, lp, adv, x.mask, "token-mean", c, rollout_log_prob=x.sampler, loss_mode=m, **topk)[0]

        t.compare(
            f"DPPO-{tag}",
            "official sail-sg/Stable-RL",
            f"{stable_mode}, C 1e4, token-mean",
            lambda lp, a=args: dppo_token_mean(lp, x, a),
            stable,
            x,
            note="token-mean here: Stable-RL's older agg_loss has no 1/B in seq-mean-token-sum-norm; dppo.py's "
            "sum-norm with num_seqs = N tokens and L_max = 1 is the token mean",
        )

    for div, delta in (("binary-tv", 0.2), ("binary-kl", 0.05)):
        args = dppo.Args(dppo_divergence=div, dppo_delta_low=delta, dppo_delta_high=delta)
        c = skyrl_cfg(dppo=Cfg(dppo_type=div.replace("-", "_"), delta_low=delta, delta_high=delta))
        t.compare(
            f"DPPO-{div[-2:].upper()}",
            "SkyRL dppo",
            f"delta {delta}, token_mean (pre-scaled A)",
            lambda lp, a=args: dppo_token_mean(lp, x, a),
            lambda lp, c=c: skyrl(p)["dppo_policy_loss"](
                lp, x.old, skyrl_scaled_adv(x, "token_mean"), c, x.mask, rollout_logprobs=x.sampler
            )[0],
            x,
            note="SkyRL's loss is -M r A (ratio with gradient), ours -M sg(r) A log pi: same gradient, different "
            "value; SkyRL's ratio goes through fp32 (safe_exp_delta)",
            expect=False,
        )

    def prime(lp: Tensor, kl_tau: float) -> Tensor:
        ns = p.load("prime", Float=None, Bool=None)
        total = torch.zeros(())
        for i in range(B):
            n = int(x.lens[i])
            inp = ns["LossInputs"](
                trainer_logprobs=lp[i, :n],
                inference_logprobs=x.sampler[i, :n],
                ref_logprobs=None,
                advantages=x.adv[i].expand(n),
                loss_mask=torch.ones(n).bool(),
            )
            cfg = Cfg(dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=kl_tau)
            total = total + ns["default_loss_fn"](inp, cfg).loss
        return total / x.mask.sum()  # compute_loss: rl_loss / rl_scale (the global rl-token count)

    args = dppo.Args(dppo_delta_low=0.2, dppo_delta_high=0.2)
    t.compare(
        "DPPO-TV",
        "prime-rl default_loss_fn",
        "kl_tau=0, delta 0.2, token-mean",
        lambda lp: dppo_token_mean(lp, x, args),
        lambda lp: prime(lp, 0.0),
        x,
        note="prime-rl's loss is -M r A (ratio with gradient): same gradient, different value",
        expect=False,
    )
    t.compare(
        "DPPO-TV",
        "prime-rl default_loss_fn",
        "as shipped: kl_tau=1e-3",
        lambda lp: dppo_token_mean(lp, x, args),
        lambda lp: prime(lp, 1e-3),
        x,
        note="plus 1e-3 (log pi/mu)^2 on every token (Kimi-K2.5 KL)",
        expect=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Clip-Cov / KL-Cov
# ---------------------------------------------------------------------------------------------------------------------
def run_cov(p: Peers, t: Table) -> None:
    x = make_inputs(4, noise=0.3, lo=-8.0, hi=-0.02)
    n_tok, n_seq = x.mask.sum(), torch.tensor(float(B))

    def official() -> dict[str, Any]:
        return p.load("cov.official", verl_F=p.functional("cov.official.F"))

    # the peers draw Clip-Cov's tokens with torch.randperm on the global RNG: seeded before each call
    def official_clip_cov(lp: Tensor, ratio: float) -> Tensor:
        torch.manual_seed(COV_SEED)
        fn = official()["compute_policy_loss_clip_cov"]
        return fn(x.old, lp, per_token_adv(x), x.mask, cliprange=1.0, loss_agg_mode="token-mean", clip_ratio=ratio)[0]

    def verl_clip_cov(lp: Tensor, c: Cfg) -> Tensor:
        torch.manual_seed(COV_SEED)
        return verl(p)["compute_policy_loss_clip_cov"](x.old, lp, per_token_adv(x), x.mask, config=c)[0]

    def skyrl_clip_cov(lp: Tensor, c: Cfg, adv: Tensor) -> Tensor:
        torch.manual_seed(COV_SEED)
        return skyrl(p)["compute_policy_loss_clip_cov"](lp, x.old, adv, c, x.mask)[0]

    for ratio in (2e-4, 0.05):
        args = clip_cov.Args(cov_form="clip", clip_cov_ratio=ratio, rollout_correction="none")  # eps 1/1, (1, 5)
        sel, keys = peer_clip_cov_select(x.logps, x.old, x.adv, x.mask, args, COV_SEED)
        same = torch.equal(clip_cov.select_tokens(x.logps, x.old, x.adv, x.mask, args, keys), sel)
        how = f"S: the peers' randperm (seed {COV_SEED}) as cov_select (select_tokens in that order: same S {same})"

        def ours(lp: Tensor, a: clip_cov.Args = args, s: Tensor = sel) -> Tensor:
            return clip_cov.compute_policy_loss(lp, x.old, x.adv, x.mask, a, cov_select=s)[0]

        config = f"ratio {ratio:g} ({int(sel.sum())} detached), eps 1/1, lb 1, ub 5"
        t.compare(
            "Clip-Cov",
            "official PRIME-RL/Entropy-Mechanism",
            config,
            ours,
            lambda lp, r=ratio: official_clip_cov(lp, r),
            x,
            note="token-mean via masked_mean (+1e-8 in the count); " + how,
        )
        cfg = verl_cfg(clip_ratio=1.0, clip_cov_ratio=ratio, global_batch_info=dict(batch_num_tokens=n_tok))
        t.compare("Clip-Cov", "verl clip_cov", config, ours, lambda lp, c=cfg: verl_clip_cov(lp, c), x, note=how)
        band = Cfg(clip_ratio=ratio, clip_cov_lb=1.0, clip_cov_ub=5.0)
        c = skyrl_cfg(eps_clip_low=1.0, eps_clip_high=1.0, clip_cov=band)
        t.compare(
            "Clip-Cov",
            "SkyRL clip_cov",
            config + ", raw A, / N",
            ours,
            lambda lp, c=c: skyrl_clip_cov(lp, c, per_token_adv(x)) / n_tok,
            x,
            note="advantages NOT pre-scaled (not how SkyRL runs it); " + how,
        )
        t.compare(
            "Clip-Cov",
            "SkyRL clip_cov",
            "as run: A pre-scaled by 1/N (token_mean)",
            ours,
            lambda lp, c=c: skyrl_clip_cov(lp, c, skyrl_scaled_adv(x, "token_mean")),
            x,
            note="cov is computed from the pre-scaled A (A/N): the (1, 5) band is never reached, nothing is "
            "detached; Clip-Cov degenerates to the PPO clip",
            expect=False,
        )

    for ratio in (2e-3, 0.05):
        args = clip_cov.Args(cov_form="kl", kl_cov_ratio=ratio, rollout_correction="none")  # coef 1

        def ours(lp: Tensor, a: clip_cov.Args = args) -> Tensor:  # S selected inside the loss (top-k: no draw)
            return clip_cov.compute_policy_loss(lp, x.old, x.adv, x.mask, a)[0]

        config = f"ratio {ratio:g} ({max(1, int(n_tok.item() * ratio))} penalised), coef 1"
        t.compare(
            "KL-Cov",
            "official PRIME-RL/Entropy-Mechanism",
            config + " (k_percent = 100 ratio)",
            ours,
            lambda lp, r=ratio: official()["compute_policy_loss_kl_cov"](
                x.old, lp, per_token_adv(x), x.mask, k_percent=100 * r, ppo_kl_coef=1
            )[0],
            x,
            note="token-mean via masked_mean (+1e-8 in the count)",
        )
        cfg = verl_cfg(kl_cov_ratio=ratio, ppo_kl_coef=1.0, global_batch_info=dict(batch_num_tokens=n_tok))
        t.compare(
            "KL-Cov",
            "verl kl_cov",
            config,
            ours,
            lambda lp, c=cfg: verl(p)["compute_policy_loss_kl_cov"](x.old, lp, per_token_adv(x), x.mask, config=c)[0],
            x,
        )
        cfg01 = verl_cfg(kl_cov_ratio=ratio, global_batch_info=dict(batch_num_tokens=n_tok))
        t.compare(
            "KL-Cov",
            "verl kl_cov",
            f"ratio {ratio:g}, yaml ppo_kl_coef 0.1",
            ours,
            lambda lp, c=cfg01: verl(p)["compute_policy_loss_kl_cov"](x.old, lp, per_token_adv(x), x.mask, config=c)[0],
            x,
            note="verl's actor.yaml / PolicyLossConfig default ppo_kl_coef is 0.1 (code fallback 1.0; the "
            "authors' scripts 1)",
            expect=False,
        )
        c = skyrl_cfg(kl_cov=Cfg(kl_cov_frac=ratio, ppo_kl_coef=1.0))
        t.compare(
            "KL-Cov",
            "SkyRL kl_cov",
            config + ", raw A, / N",
            ours,
            lambda lp, c=c: skyrl(p)["compute_policy_loss_kl_cov"](lp, x.old, per_token_adv(x), c, x.mask)[0] / n_tok,
            x,
            note="advantages NOT pre-scaled (not how SkyRL runs it)",
        )

    # micro-batching: the peers select inside each micro-batch; clip_cov.py once per mini-batch
    args = clip_cov.Args(cov_form="kl", kl_cov_ratio=0.05, rollout_correction="none")

    def whole(lp: Tensor) -> Tensor:
        return clip_cov.compute_policy_loss(lp, x.old, x.adv, x.mask, args)[0]

    gbi = dict(batch_num_tokens=n_tok, global_batch_size=B, dp_size=1)
    cfg = verl_cfg(kl_cov_ratio=0.05, ppo_kl_coef=1.0, global_batch_info=gbi)
    t.compare(
        "KL-Cov",
        "verl kl_cov",
        "ratio 0.05, 3 micro-batches (global token count)",
        whole,
        lambda lp: sum(
            verl(p)["compute_policy_loss_kl_cov"](x.old[c], lp[c], per_token_adv(x)[c], x.mask[c], config=cfg)[0]
            for c in CHUNKS
        ),
        x,
        note="selection (covariance means, k) per micro-batch: not micro-batch invariant",
        expect=False,
    )
    keys = torch.rand(B, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sel = clip_cov.select_tokens(x.logps, x.old, x.adv, x.mask, args, keys)
    t.compare(
        "KL-Cov",
        "clip_cov.py --cov-form kl, 3 micro-batches",
        "select_tokens once per mini-batch, sliced, vs the whole batch",
        whole,
        lambda lp: sum(
            clip_cov.compute_policy_loss(lp[c], x.old[c], x.adv[c], x.mask[c], args, n_tok, n_seq, cov_select=sel[c])[0]
            for c in CHUNKS
        ),
        x,
    )
    c = skyrl_cfg()
    default = clip_cov.Args(cov_form="kl", rollout_correction="none")
    t.compare(
        "KL-Cov",
        "SkyRL kl_cov",
        "as run: kl_cov_frac 0.2 default, A pre-scaled",
        lambda lp: clip_cov.compute_policy_loss(lp, x.old, x.adv, x.mask, default)[0],
        lambda lp: skyrl(p)["compute_policy_loss_kl_cov"](lp, x.old, skyrl_scaled_adv(x, "token_mean"), c, x.mask)[0],
        x,
        note="kl_cov_frac=0.2 is used as a fraction (20% of tokens; the official 0.2 is a percent), and the "
        "|log r| penalty is summed without the 1/N the advantages carry (N x stronger)",
        expect=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# M2PO
# ---------------------------------------------------------------------------------------------------------------------
def run_m2po(p: Peers, t: Table) -> None:
    x = make_inputs(5, noise=0.3, lo=-4.0, hi=-0.02, behav_noise=0.3)
    n_tok, n_seq = x.mask.sum(), torch.tensor(float(B))
    valid = x.mask > 0

    # AReaL: the mask from the behaviour (old_logp = the sampler's) vs the proximal (recomputed: our old_logps)
    # log-probs, every token a candidate
    a_all = m2po.Args(m2po_scope="all")
    drop_all = m2po.m2po_select(x.old, x.sampler, x.adv, x.mask, a_all)

    def areal_mask() -> Tensor:
        return p.load("areal.m2po")["_apply_m2po_masking"](x.sampler, x.old, valid, 0.04)

    def mask_row() -> tuple[float, float, float, str]:
        kept = areal_mask()
        same = torch.equal(~drop_all & valid, kept)
        return int(drop_all.sum()), int((valid & ~kept).sum()), 0.0 if same else math.nan, "mask only (tokens dropped)"

    t.record("M2PO", "AReaL _apply_m2po_masking", "tau 0.04, all tokens (m2po_select, --m2po-scope all)", mask_row)

    def ours_all(lp: Tensor) -> Tensor:  # mu = old_logps (rollout_logps None): AReaL's ratio pi / pi_prox
        return m2po.compute_policy_loss(lp, x.old, x.adv, x.mask, a_all, m2po_drop=drop_all)[0]

    def areal(lp: Tensor) -> Tensor:
        fn = p.load("areal.ppo")["ppo_actor_loss_fn"]
        return fn(lp, x.old, x.sampler, per_token_adv(x), 1e9, areal_mask())[0]

    t.compare(
        "M2PO",
        "AReaL grpo_loss_fn (M2PO mask + PPO)",
        "eps_clip 1e9 (no clip), ratio pi/pi_prox",
        ours_all,
        areal,
        x,
        note="AReaL divides by the kept tokens' count (ours and the paper: all tokens)",
        expect=False,
    )
    t.compare(
        "M2PO",
        "AReaL grpo_loss_fn (M2PO mask + PPO)",
        "same, ours rescaled by N / N_kept",
        lambda lp: ours_all(lp) * n_tok / (valid & ~drop_all).sum(),
        areal,
        x,
    )

    # The official code (Infini-AI-Lab/M2PO) and the verl PR #4131: a ratio clip at exp(+-tau) from an M2 budget
    def official(lp: Tensor) -> Tensor:
        ns = p.load("m2po.official", verl_F=p.functional("m2po.official.F"))
        fn = ns["compute_m2po_policy_loss"]
        return fn(x.old, lp, per_token_adv(x), x.mask, M2_budget=0.04, miniclip_low=None, miniclip_high=None)[0]

    def verl_pr(lp: Tensor) -> Tensor:
        extra = dict(verl_F=p.functional("m2po.pr.F"), AlgoConfig=type("AlgoConfig", (), {}), DictConfig=Cfg)
        fn = p.load("m2po.pr", **extra)["compute_policy_loss_m2po"]
        return fn(x.old, lp, per_token_adv(x), x.mask, config=Cfg(policy_loss=Cfg(m2_budget=0.04)))[0]

    args = m2po.Args()  # trust-region tokens, tau 0.04

    def ours(lp: Tensor) -> Tensor:  # mu = old_logps (the official stale setup's), Algorithm 1 at the current logps
        return m2po.compute_policy_loss(lp, x.old, x.adv, x.mask, args)[0]

    def zero_grads(go: Tensor, gt: Tensor) -> str:
        zt, zo = int(((gt == 0) & valid).sum()), int(((go == 0) & valid).sum())
        return (
            "by design: a ratio clip at exp(+-tau), tau from capping (not dropping) harmful tokens' M2; "
            f"zero-gradient tokens: theirs {zt}, ours {zo}"
        )

    for name, fn in (("official Infini-AI-Lab/M2PO", official), ("verl PR #4131 m2po", verl_pr)):
        t.compare("M2PO", name, "M2 budget 0.04, miniclip None", ours, fn, x, note=zero_grads, expect=False)

    def m2_row() -> tuple[float, float, float, str]:
        ns = p.load("m2po.official", verl_F=p.functional("m2po.official.F"))
        _, _, m2_now, m2_after = ns["kpo_clip_harmful_tokens"](x.old, x.logps, per_token_adv(x), x.mask, 0.04)
        m2 = (x.logps - x.old) ** 2
        trust = m2po.m2po_select(x.logps, x.old, x.adv, x.mask, replace(args, m2po_threshold=-1.0))  # all of T
        drop = m2po.m2po_select(x.logps, x.old, x.adv, x.mask, args)
        ours_m2 = m2[trust].mean().item()
        note = (
            f"statistic only: same token set T and M2 (theirs after capping: {m2_after:.4f}; ours after dropping: "
            f"{m2[trust & ~drop].mean().item():.4f}); T: m2po_select with tau = -1 (drops all of T)"
        )
        return ours_m2, m2_now, abs(ours_m2 - m2_now), note

    t.record("M2PO", "official kpo_clip_harmful_tokens", "M2 over the trust-region tokens", m2_row)

    # micro-batching: m2po.py selects once per mini-batch (update_policy, at old_logps), the peers per micro-batch
    drop = m2po.m2po_select(x.old, x.sampler, x.adv, x.mask, args)

    def whole(lp: Tensor) -> Tensor:
        return m2po.compute_policy_loss(lp, x.old, x.adv, x.mask, args, rollout_logps=x.sampler, m2po_drop=drop)[0]

    def micro(lp: Tensor, per_micro_batch: bool) -> Tensor:
        total = torch.zeros(())
        for c in CHUNKS:
            d = m2po.m2po_select(x.old[c], x.sampler[c], x.adv[c], x.mask[c], args) if per_micro_batch else drop[c]
            total = (
                total
                + m2po.compute_policy_loss(
                    lp[c], x.old[c], x.adv[c], x.mask[c], args, n_tok, n_seq, rollout_logps=x.sampler[c], m2po_drop=d
                )[0]
            )
        return total

    t.compare(
        "M2PO",
        "m2po.py, 3 micro-batches",
        "m2po_select once per mini-batch (at old_logps), sliced",
        whole,
        lambda lp: micro(lp, False),
        x,
    )
    t.compare(
        "M2PO",
        "m2po.py, 3 micro-batches",
        "m2po_select per micro-batch (the peers' placement) vs once",
        whole,
        lambda lp: micro(lp, True),
        x,
        note="per-micro-batch M2 budget: a different token set",
        expect=False,
    )
    t.compare(
        "M2PO",
        "verl PR #4131 vs official",
        "(peer vs peer)",
        official,
        verl_pr,
        x,
        note="the PR's tau solver returns the exact cap, the official one the breakpoint below it",
        expect=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# ppo.py and vapo.py: GAE, whitening, the value loss
# ---------------------------------------------------------------------------------------------------------------------
def critic_inputs(seed: int, gaps: bool) -> SimpleNamespace:
    """B rows: 0/1 outcome rewards on each row's last kept token, values in [-0.5, 1.5], ragged right padding and,
    with `gaps`, masked spans inside rows (a tool's output); old values and predictions 0.05-0.6 apart (inside and
    outside a 0.2 clip)."""
    g, f64 = torch.Generator().manual_seed(seed), torch.float64
    lens = torch.randint(4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).double()
    if gaps:
        for i in range(0, B, 3):
            mask[i, 1 : 1 + int(lens[i]) // 3] = 0.0  # keeps the last token
    rewards = ppo.outcome_token_rewards(torch.randint(0, 2, (B,), generator=g).double(), mask)
    values = torch.rand(B, T, generator=g, dtype=f64) * 2 - 0.5
    step = torch.where(torch.rand(B, T, generator=g) < 0.5, 0.1, 0.5) + 0.05 * torch.rand(B, T, generator=g)
    preds = values + step * torch.sign(torch.randn(B, T, generator=g, dtype=f64))
    returns = ppo.compute_gae(rewards, values, mask, 1.0, 1.0)[1]
    return SimpleNamespace(rewards=rewards, values=values, mask=mask, logps=preds, returns=returns, lens=lens)


def max_diff(*pairs: tuple[Tensor, Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in pairs)


def run_critic(p: Peers, t: Table) -> None:
    def verl_ns() -> dict[str, Any]:
        ns = p.load("verl.critic", verl_F=None, register_adv_est=noop_decorator, AdvantageEstimator=Cfg(GAE="gae"))
        names = ("masked_sum", "masked_mean", "masked_whiten", "clip_by_value")
        ns["verl_F"] = SimpleNamespace(**{k: ns[k] for k in names})
        return ns

    def openrlhf_gae(x: SimpleNamespace, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
        fn = p.load("openrlhf")["get_advantages_and_returns"]
        return fn(None, x.values, x.rewards, x.mask, gamma, lam)  # a method: self unused

    def orz_gae(x: SimpleNamespace, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
        return p.load("orz")["get_advantages_and_returns"](x.values, x.rewards, x.mask, None, gamma, lam)

    def gae_row(peer, config, x, gamma, lam, whiten, theirs, note="", expect=True) -> None:
        """A row of max |A ours - A theirs| and |R ours - R theirs| over the kept tokens (masked ones hold whatever
        each implementation leaves there)."""

        def fn() -> tuple[float, float, float, str]:
            a, r = ppo.compute_gae(x.rewards, x.values, x.mask, gamma, lam)
            a = whiten(a, x.mask) if whiten else a
            ta, tr = theirs(x, gamma, lam)
            m = x.mask > 0
            return a[m].abs().sum().item(), ta[m].abs().sum().item(), max_diff((a[m], ta[m]), (r[m], tr[m])), note

        t.record("GAE (sum abs A; diff: max over A and R)", peer, config, fn, expect)

    def verl_gae(x: SimpleNamespace, gamma: float, lam) -> tuple[Tensor, Tensor]:
        return verl_ns()["compute_gae_advantage_return"](x.rewards, x.values, x.mask, gamma, lam)

    skipped = "values and rewards times the mask, then the recursion runs on through the span (V = 0 there, the "
    skipped += "running advantage decays by gamma lam per masked token); verl and ours skip it (value and "
    skipped += "advantage carried)"
    for gaps in (False, True):
        x = critic_inputs(3, gaps)
        span = "masked spans inside rows" if gaps else "right padding only"
        lam_rows = vapo.policy_lambda(x.mask, vapo.Args(lam_alpha=0.3))  # VAPO's per-row lambda, 0-0.92
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (1.0, lam_rows)):
            what = f"gamma {gamma}, lam {'per row (VAPO)' if isinstance(lam, Tensor) else lam}, {span}"
            verl_note = "whitened by verl: vapo.whiten (masked_mean's +1e-8 in the token count)"
            gae_row("verl compute_gae_advantage_return", what, x, gamma, lam, vapo.whiten, verl_gae, verl_note)
            if isinstance(lam, Tensor):  # OpenRLHF and ORZ take a float lambda
                continue
            same = (gamma, lam) == (1.0, 1.0)  # A_t = R - V_t however the span is treated
            note = "the same at gamma = lam = 1: A_t = R - V_t either way" if gaps and same else (skipped * gaps)
            gae_row("OpenRLHF get_advantages_and_returns", what + ", raw", x, gamma, lam, None, openrlhf_gae, note,
                    expect=same or not gaps)  # fmt: skip
            note = "ORZ computes in fp32 (values.float()): an fp32 rounding apart" + ("; " + note) * bool(note)
            gae_row("ORZ get_advantages_and_returns", what + ", raw", x, gamma, lam, None, orz_gae, note, expect=False)

    # whitening: ppo.py's is ORZ's, over a packed buffer where every entry is a token
    x = critic_inputs(4, False)
    kept = ppo.compute_gae(x.rewards, x.values, x.mask, 1.0, 1.0)[0][x.mask > 0][None]

    def orz_whiten() -> tuple[float, float, float, str]:
        (item,) = p.load("orz")["normalize_advantages"]([SimpleNamespace(advantages=kept.clone(), action_mask=None)])
        ours, theirs = ppo.whiten(kept, torch.ones_like(kept)), item.advantages.double()
        note = "ORZ stores the result in bf16: a bf16 rounding apart"
        return ours.abs().sum().item(), theirs.abs().sum().item(), max_diff((ours, theirs)), note

    t.record("whitening (sum abs A)", "ORZ normalize_advantages", "packed (no padding)", orz_whiten, expect=False)

    # the value loss, as a function of the critic's predictions (x.logps holds them)
    flat = SimpleNamespace(**{k: getattr(x, k).reshape(1, -1) for k in ("values", "mask", "returns", "logps")})
    for clip in (0.2, 0.5):

        def ours(v: Tensor, x: SimpleNamespace = x, clip: float = clip) -> Tensor:
            return ppo.compute_value_loss(v, x.values, x.returns, x.mask, ppo.Args(value_clip=clip))[0]

        def verl_loss(v: Tensor, clip: float = clip) -> Tensor:
            return verl_ns()["compute_value_loss"](v, x.returns, x.values, x.mask, clip)[0]

        def openrlhf_loss(v: Tensor, clip: float = clip) -> Tensor:
            return p.load("openrlhf")["ValueLoss"](clip)(v, x.values, x.returns, x.mask)

        def orz_loss(v: Tensor, x: SimpleNamespace = x, clip: float = clip) -> Tensor:
            return p.load("orz")["ValueLoss"](clip)(v, x.values, x.returns, x.mask)

        t.compare("value loss", "verl compute_value_loss", f"cliprange_value {clip}, token-mean", ours, verl_loss, x)
        t.compare("value loss", "OpenRLHF ValueLoss", f"clip_eps {clip}, token_level_loss", ours, openrlhf_loss, x)
        t.compare(
            "value loss",
            "ORZ ValueLoss",
            f"value_clip {clip}, packed (one row)",
            lambda v, clip=clip: ours(v, flat),
            lambda v, clip=clip: orz_loss(v, flat),
            flat,
        )
        note = "a token mean per row, then the mean of the rows; ORZ packs a micro-batch into one row, the token mean"
        t.compare("value loss", "ORZ ValueLoss", f"value_clip {clip}, padded rows", ours, orz_loss, x, note, False)

    def clip_fraction() -> tuple[float, float, float, str]:
        ours = ppo.compute_value_loss(x.logps, x.values, x.returns, x.mask, ppo.Args(value_clip=0.2))[1]
        theirs = verl_ns()["compute_value_loss"](x.logps, x.returns, x.values, x.mask, 0.2)[1].item()
        o = ours["value_clip_frac"].item()
        return o, theirs, abs(o - theirs), "verl's vf_clipfrac (its masked_mean adds 1e-8 to the token count)"

    t.record("value clip fraction", "verl compute_value_loss", "cliprange_value 0.2", clip_fraction)


# ---------------------------------------------------------------------------------------------------------------------
# REINFORCE++ and RLOO: advantages (the KL in the reward, returns, baselines, normalisation) and losses
# ---------------------------------------------------------------------------------------------------------------------
FP32 = 1e-6  # OpenRLHF computes its KL (compute_approx_kl: .float()) and its normalisation in float32


def reinforce_inputs(seed: int = 0, holes: bool = False) -> SimpleNamespace:
    """Random float64 rollouts of B completions in groups of 4: 0/1 rewards, every group mixed; ragged lengths (with
    `holes`, masked spans inside three completions, as a tool's output); old, reference and current log-probs 0.3
    apart (no ratio near a clip boundary)."""
    g, f64 = torch.Generator().manual_seed(seed), torch.float64
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    rewards[0::4], rewards[1::4] = 1.0, 0.0
    lens = torch.randint(4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    if holes:
        mask[1, 1:3], mask[5, 0], mask[9, 2:4] = 0, 0, 0
    old = -torch.rand(B, T, generator=g, dtype=f64) * 3 - 0.02
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=f64)
    logps = old + 0.3 * torch.randn(B, T, generator=g, dtype=f64)
    index = np.repeat(np.arange(B // 4), 4)  # verl's uid per prompt
    return SimpleNamespace(rewards=rewards, lens=lens, mask=mask, old=old, ref=ref, logps=logps, index=index)


def adv_row(ours: Tensor, theirs: Tensor, mask: Tensor, note: str = "") -> tuple[float, float, float, str]:
    """(sum |ours|, sum |theirs|, max |ours - theirs|) over the completions' tokens, for Table.record."""
    m = mask > 0
    a, b = ours.double()[m], theirs.double()[m]
    return a.abs().sum().item(), b.abs().sum().item(), (a - b).abs().max().item(), note


def verl_adv(p: Peers) -> dict[str, Any]:
    ns = p.load("verl.W")
    verl_f = SimpleNamespace(**{k: ns[k] for k in ("masked_sum", "masked_mean", "masked_whiten")})
    return p.load("verl.adv", verl_F=verl_f, defaultdict=defaultdict, AlgoConfig=Cfg)


def verl_token_rewards(p: Peers, x: SimpleNamespace, beta: float) -> Tensor:
    """verl's token_level_rewards: the score on the last response token (its reward manager), minus beta times the
    k1 KL of the rollout policy to the reference on every response token (ray_trainer.apply_kl_penalty)."""
    scores = torch.zeros_like(x.old)
    scores[torch.arange(B), x.lens - 1] = x.rewards
    return scores - beta * verl_adv(p)["kl_penalty"](x.old, x.ref, "kl") * x.mask


def openrlhf_adv(p: Peers, x: SimpleNamespace, estimator: str, beta: float, gamma: float = 1.0) -> Tensor:
    """OpenRLHF's advantages: make_experience's KL (k1 at the rollout policy; zero with --algo.kl.use_loss, the
    baseline recipe), then its own compute_advantages_and_returns on one experience holding the batch."""
    import itertools
    import typing

    extra = {k: getattr(typing, k) for k in ("Union", "Tuple", "List")}
    extra.update(Experience=Any, itertools=itertools, apply_length_penalties=lambda *a: None)
    extra.update(logger=SimpleNamespace(warning=print))
    ns = p.load("openrlhf.adv", **extra)
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=4),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=gamma, lambd=1.0, no_std_norm=False)),
        reward=SimpleNamespace(clip_range=(-10, 10)),
    )
    kl = ns["compute_approx_kl"](x.old, x.ref, kl_estimator="k1")
    kl = torch.zeros_like(kl) if estimator == "reinforce_baseline" else kl  # the recipe's KL is a loss
    self = SimpleNamespace(strategy=SimpleNamespace(args=args), kl_ctl=SimpleNamespace(value=beta))
    self.advantage_estimator = estimator
    self.get_cumulative_returns = lambda *a: ns["get_cumulative_returns"](self, *a)
    exp = SimpleNamespace(index=list(range(B)), rewards=x.rewards.clone(), info={}, kl=kl, action_mask=x.mask)
    (exp,) = ns["compute_advantages_and_returns"](self, [exp])
    return exp.advantages


def openrlhf_policy_loss(p: Peers, lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """OpenRLHF's PolicyLoss as its actor builds it (clip 0.2 both ways, token_level_loss default True)."""
    import torch.distributed as dist

    nn_ns = dict(nn=torch.nn, dist=dist, F=torch.nn.functional, Tuple=tuple)
    loss_fn = p.load("openrlhf.loss", **nn_ns)["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.2)
    return loss_fn(lp, old, adv, action_mask=mask)[0]


def verl_vanilla(p: Peers) -> dict[str, Any]:
    """verl's PPO loss (compute_policy_loss_vanilla) and agg_loss."""
    algo = type("AlgoConfig", (), {})  # its config must not be one
    return p.load("verl.vanilla", verl_F=p.functional("verl.F"), AlgoConfig=algo, ActorConfig=Cfg)


def run_reinforce_pp(p: Peers, t: Table) -> None:
    beta = 0.05

    def ours(x: SimpleNamespace, **kw: Any) -> Tensor:
        args = reinforce_pp.Args(**{"group_size": 4, "beta": beta, "adv_eps": 0.0, **kw})
        return reinforce_pp.compute_advantages(x.rewards, x.mask, args, x.old, x.ref)

    def unbiased(a: Tensor, x: SimpleNamespace) -> Tensor:  # ours rescaled to verl's unbiased std
        n = int(x.mask.sum())
        return a * math.sqrt((n - 1) / n)

    note_verl = (
        "ours x sqrt((n-1)/n): verl whitens with the unbiased variance and rsqrt(var + 1e-8), ours (OpenRLHF's) the "
        "population std; the rest equal"
    )
    for gamma, holes in ((1.0, False), (0.9, True)):
        x = reinforce_inputs(1, holes)
        cfg = f"beta {beta} (k1 in the reward), gamma {gamma}" + (", masked spans" if holes else "")

        def verl_row(x: SimpleNamespace = x, gamma: float = gamma) -> tuple[float, float, float, str]:
            fn = verl_adv(p)["compute_reinforce_plus_plus_outcome_advantage"]
            theirs = fn(verl_token_rewards(p, x, beta), x.mask, config=Cfg(gamma=gamma))[0]
            return adv_row(unbiased(ours(x, gamma=gamma), x), theirs, x.mask, note_verl)

        t.record("REINFORCE++ advantages", "verl reinforce_plus_plus", cfg, verl_row, tol=1e-7)

        def orl_row(
            x: SimpleNamespace = x, gamma: float = gamma, holes: bool = holes
        ) -> tuple[float, float, float, str]:
            theirs = openrlhf_adv(p, x, "reinforce", beta, gamma)
            note = (
                "float32 in OpenRLHF"
                if not holes
                else (
                    "OpenRLHF discounts across a masked span (get_cumulative_returns applies gamma at every position), "
                    "ours and verl carry the return past it undiscounted; equal at gamma 1 or without masked spans"
                )
            )
            return adv_row(ours(x, gamma=gamma), theirs, x.mask, note)

        t.record("REINFORCE++ advantages", "OpenRLHF reinforce", cfg, orl_row, expect=not holes, tol=FP32)
    x = reinforce_inputs(2)

    def eps_row() -> tuple[float, float, float, str]:
        args = reinforce_pp.Args(group_size=4, beta=beta)
        mine = reinforce_pp.compute_advantages(x.rewards, x.mask, args, x.old, x.ref)
        note = "ours divides by std + 1e-6 (eq. 5), OpenRLHF by sqrt(max(var, 1e-8)): a relative 1e-6 / std"
        return adv_row(mine, openrlhf_adv(p, x, "reinforce", beta), x.mask, note)

    t.record("REINFORCE++ advantages", "OpenRLHF reinforce", "our default --adv-eps 1e-6", eps_row, expect=False)
    for peer, fn_name in (("verl reinforce_plus_plus_baseline", "verl"), ("OpenRLHF reinforce_baseline", "orl")):

        def base_row(fn_name: str = fn_name) -> tuple[float, float, float, str]:
            mine = ours(x, group_baseline=True)
            if fn_name == "orl":
                return adv_row(mine, openrlhf_adv(p, x, "reinforce_baseline", beta), x.mask, "float32 in OpenRLHF")
            scores = verl_token_rewards(p, x, 0.0)  # the KL is a loss in this variant
            fn = verl_adv(p)["compute_reinforce_plus_plus_baseline_outcome_advantage"]
            return adv_row(unbiased(mine, x), fn(scores, x.mask, x.index)[0], x.mask, note_verl)

        t.record("REINFORCE++ w/ Baseline advantages", peer, "groups of 4, KL not in the reward", base_row, tol=FP32)

    # the loss: eq. 1's per-sequence token mean (verl's seq-mean-token-mean); OpenRLHF takes a token mean
    adv = ours(x)
    cfg = verl_cfg(clip_ratio_c=1e4)  # verl's dual clip (3.0) acts only at ratios above 3 with A < 0
    args = reinforce_pp.Args(group_size=4, beta=beta, rollout_correction="none")

    def mine(lp: Tensor) -> Tensor:
        return reinforce_pp.compute_policy_loss(lp, x.old, adv, x.mask, args, ref_logps=x.ref)[0]

    def vanilla(lp: Tensor) -> Tensor:
        fn = verl_vanilla(p)["compute_policy_loss_vanilla"]
        return fn(x.old, lp, adv, x.mask, loss_agg_mode="seq-mean-token-mean", config=cfg)[0]

    lx = SimpleNamespace(logps=x.logps)
    t.compare("REINFORCE++ loss", "verl vanilla", "seq-mean-token-mean, A per token", mine, vanilla, lx)
    t.compare(
        "REINFORCE++ loss",
        "OpenRLHF PolicyLoss",
        "its default token_level_loss",
        mine,
        lambda lp: openrlhf_policy_loss(p, lp, x.old, adv, x.mask),
        lx,
        note="OpenRLHF averages over all tokens of the batch; eq. 1 (ours, verl's seq-mean-token-mean) per sequence",
        expect=False,
    )
    base = reinforce_pp.Args(group_size=4, beta=beta, group_baseline=True, rollout_correction="none")
    base_adv = ours(x, group_baseline=True)

    def verl_base(lp: Tensor) -> Tensor:  # dp_actor: policy loss + kl_loss_coef * agg_loss(kl_penalty(k2))
        vloss = verl_vanilla(p)
        pg = vloss["compute_policy_loss_vanilla"](x.old, lp, base_adv, x.mask, "seq-mean-token-mean", config=cfg)[0]
        kld = verl_adv(p)["kl_penalty"](lp, x.ref, "k2")
        return pg + beta * vloss["agg_loss"](kld, x.mask, "seq-mean-token-mean")

    t.compare(
        "REINFORCE++ w/ Baseline loss",
        "verl vanilla + k2 kl loss",
        "seq-mean-token-mean, kl_loss_coef = beta",
        lambda lp: reinforce_pp.compute_policy_loss(lp, x.old, base_adv, x.mask, base, ref_logps=x.ref)[0],
        verl_base,
        lx,
    )


def trl_rloo_loss(p: Peers, lp: Tensor, x: SimpleNamespace, adv: Tensor, old: Tensor) -> Tensor:
    """RLOOTrainer._compute_loss with a stand-in `self` whose log-prob forward returns `lp` (one completion is one
    action: the sequence ratio, clipped at 0.2, a mean over completions)."""
    f = p.load("trl.rloo.F")
    fn = p.load("trl.rloo.loss", nanmin=f["nanmin"], nanmax=f["nanmax"])["_compute_loss"]
    z = torch.zeros(B, 1, dtype=torch.long)
    self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False,
        accelerator=FakeAccelerator(),
        model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)),
        epsilon_low=0.2,
        epsilon_high=0.2,
    )
    inputs = dict(prompt_ids=z, prompt_mask=z, completion_ids=torch.zeros(B, T, dtype=torch.long))
    inputs.update(completion_mask=x.mask, advantages=adv, old_logps=(old * x.mask).sum(1))
    return fn(self, None, inputs)


def run_rloo(p: Peers, t: Table) -> None:
    beta = 0.05
    x = reinforce_inputs(3)

    def ours(b: float = beta) -> Tensor:
        args = rloo.Args(group_size=4, beta=b)
        return rloo.compute_advantages(rloo.kl_shaped_rewards(x.rewards, x.mask, x.old, x.ref, args), args)

    def per_token(a: Tensor) -> Tensor:
        return a[:, None].expand(B, T)

    def verl_row(name: str) -> Callable[[], tuple[float, float, float, str]]:
        def row() -> tuple[float, float, float, str]:
            theirs = verl_adv(p)[name](verl_token_rewards(p, x, beta), x.mask, x.index)[0]
            return adv_row(per_token(ours()), theirs, x.mask, "the summed token rewards carry the KL (eq. 3)")

        return row

    cfg = f"groups of 4, beta {beta} (k1 summed in the reward)"
    t.record("RLOO advantages", "verl rloo", cfg, verl_row("compute_rloo_outcome_advantage"))
    t.record("RLOO advantages", "verl rloo_vectorized", cfg, verl_row("compute_rloo_vectorized_outcome_advantage"))

    def trl_row() -> tuple[float, float, float, str]:
        code = compile(p.code("trl.rloo.adv"), "<trl.rloo.adv>", "exec")
        env = dict(torch=torch, self=SimpleNamespace(beta=beta, normalize_advantages=False), rewards=x.rewards.clone())
        env.update(old_per_token_logps=x.old, ref_per_token_logps=x.ref, completion_mask=x.mask, gather=lambda v: v)
        env.update(num_generations=4, nanstd=p.load("trl.rloo.F")["nanstd"])
        exec(code, env)
        return adv_row(per_token(ours()), per_token(env["advantages"]), x.mask)

    t.record("RLOO advantages", "TRL RLOOTrainer", cfg + ", normalize_advantages False", trl_row)
    for b in (0.0, beta):

        def orl_row(b: float = b) -> tuple[float, float, float, str]:
            note = (
                "float32 in OpenRLHF"
                if b == 0
                else (
                    "OpenRLHF's baseline is the others' task reward without their KL, and each token gets the KL of "
                    "the tokens after it (its returns), not the completion's sum"
                )
            )
            return adv_row(per_token(ours(b)), openrlhf_adv(p, x, "rloo", b), x.mask, note)

        t.record("RLOO advantages", "OpenRLHF rloo", f"groups of 4, beta {b}", orl_row, expect=b == 0, tol=FP32)

    # the loss: REINFORCE on the completion (ours) vs TRL's clipped sequence ratio: the same gradient on-policy
    adv = ours()
    args = rloo.Args(group_size=4, beta=beta, rollout_correction="none")
    for name, old in (("on-policy (pi_old = pi)", x.logps), ("off-policy (pi_old 0.3 apart)", x.old)):

        def grad_row(old: Tensor = old) -> tuple[float, float, float, str]:
            g1 = value_and_grad(lambda lp: rloo.compute_policy_loss(lp, old, adv, x.mask, args)[0], x.logps)[1]
            g2 = value_and_grad(lambda lp: trl_rloo_loss(p, lp, x, adv, old), x.logps)[1]
            note = "gradients (the surrogates' values differ): " + (
                "-A_i / N on every token for both"
                if old is x.logps
                else "TRL weighs completion i by its clipped sequence ratio pi(o_i) / pi_old(o_i); the paper's "
                "second step (ours) has no ratio"
            )
            return g1.abs().sum().item(), g2.abs().sum().item(), (g1 - g2).abs().max().item(), note

        t.record("RLOO loss (gradient)", "TRL RLOOTrainer _compute_loss", name, grad_row, expect=old is x.logps)
    clip = rloo.Args(group_size=4, beta=beta, rloo_loss="token-clip", rollout_correction="none")
    cfg = verl_cfg(clip_ratio_c=1e4)
    lx = SimpleNamespace(logps=x.logps)

    def mine(lp: Tensor) -> Tensor:
        return rloo.compute_policy_loss(lp, x.old, adv, x.mask, clip)[0]

    def vanilla(lp: Tensor) -> Tensor:
        fn = verl_vanilla(p)["compute_policy_loss_vanilla"]
        return fn(x.old, lp, per_token(adv), x.mask, loss_agg_mode="token-mean", config=cfg)[0]

    t.compare("RLOO loss", "verl vanilla", "--rloo-loss token-clip, token-mean", mine, vanilla, lx)
    t.compare(
        "RLOO loss",
        "OpenRLHF PolicyLoss",
        "--rloo-loss token-clip",
        mine,
        lambda lp: openrlhf_policy_loss(p, lp, x.old, per_token(adv), x.mask),
        lx,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------------
def fmt(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:+.6e}"


def markdown(t: Table, p: Peers, command: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    scripts = subprocess.run(
        ["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    out = [
        "# Side by side: the scripts' losses vs the peers' code (float64, random inputs)",
        "",
        f"`{command}`, {when}; the scripts (sapo.py, gmpo.py, dppo.py, clip_cov.py, m2po.py) at `{scripts or '?'}`.",
        "",
        f"B={B} sequences of <= {T} tokens, groups of 4, GRPO std-normalised advantages, ragged lengths. ours: the "
        "script's `compute_policy_loss` with its `Args` set as the configuration says. |dL|: absolute loss "
        "difference; max|dG|: max abs difference of d loss / d logps. 'exact' = both < 1e-12 (float64 rounding); "
        "'match' = both < 1e-8 (the peers' masked_mean / agg_loss add 1e-8 to token counts, moving O(1) terms by "
        "~1e-8/|o_i|). Rows marked 'differs (by design)' are expected to differ; the note says why.",
        "",
        "| peer | commit | |",
        "|---|---|---|",
    ]
    for repo, commit in PEERS.items():
        status = f"skipped: {p.missing[repo]} ({t.skipped[repo]} rows left out)" if repo in t.skipped else ""
        out.append(f"| {repo.replace('+', '/')} | `{commit}` | {status} |")
    out += [
        "",
        "| loss | peer | configuration | ours | theirs | abs dL | max abs dG | result | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in t.rows:
        out.append(
            f"| {r.loss} | {r.peer} | {r.config} | {fmt(r.ours)} | {fmt(r.theirs)} | {r.dloss:.1e} | "
            f"{r.dgrad:.1e} | {r.result} | {r.note} |"
        )
    out += ["", "## Peer code used (cut out at run time; repo@commit path:lines)", ""]
    out += [f"- {s}" for s in dict.fromkeys(p.used)]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", required=True, help="directory of the peers' clones, named <owner>+<name>")
    parser.add_argument("--markdown", help="also write the table to this file")
    opts = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # tensors the peers' code creates
    p, t = Peers(opts.mirrors), Table()
    for run in (run_sapo, run_gmpo, run_dppo, run_cov, run_m2po, run_reinforce_pp, run_rloo, run_critic):
        run(p, t)
    text = markdown(t, p, shlex.join(["python", "tools/compare_peers.py", *sys.argv[1:]]))
    print(text)
    if opts.markdown:
        with open(opts.markdown, "w") as f:
            f.write(text)
    bad = [r for r in t.rows if r.unexpected]
    print(f"{len(t.rows)} comparisons, {len(bad)} unexpected differences, {sum(t.skipped.values())} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
