"""Brute-force float64 references, written with Python loops and `math` independently of the scripts and of
common/, so the vectorised code is checked against a second, obvious implementation."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], group_size: int, use_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(R - mean_g) / (std_g + eps) with the unbiased std; without std when use_std is False."""
    out = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g : g + group_size]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (len(grp) - 1))
        out += [(r - mean) / (std + eps) if use_std else r - mean for r in grp]
    return out


def ppo_clip_token(logp: float, old: float, adv: float, eps_low: float, eps_high: float) -> float:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A) for one token."""
    r = math.exp(logp - old)
    return -min(r * adv, min(max(r, 1 - eps_low), 1 + eps_high) * adv)


def k3(logp: float, ref: float) -> float:
    """pi_ref/pi - log(pi_ref/pi) - 1."""
    return math.exp(ref - logp) - (ref - logp) - 1


def aggregate(per_token: list[list[float]], mask: list[list[int]], mode: str, max_len: int | None = None) -> float:
    """The aggregations the scripts write (token mean, sequence mean, constant), by loops."""
    if mode == "token-mean":
        tot = sum(v for row, m in zip(per_token, mask) for v, k in zip(row, m) if k)
        return tot / sum(sum(m) for m in mask)
    if mode == "seq-mean-token-mean":
        seqs = [sum(v for v, k in zip(row, m) if k) / max(sum(m), 1) for row, m in zip(per_token, mask)]
        return sum(seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        tot = sum(v for row, m in zip(per_token, mask) for v, k in zip(row, m) if k)
        return tot / (len(mask) * max_len)
    raise ValueError(mode)
