"""Floating-point error bounds for the tests' tolerances: worst-case first-order bounds in the style of
Higham, "Accuracy and Stability of Numerical Algorithms" (2002), ch. 2-3, so that a tolerance follows from the
computation and its dtype rather than from one machine's observed error.

    u = unit roundoff of the dtype (eps / 2: 6.0e-8 for fp32, 1.1e-16 for fp64),  gamma(n) = n u / (1 - n u).
    A sum or dot product of n terms, in any order (any BLAS kernel, SIMD width, thread split or tile order),
    errs by at most gamma(n) * sum |terms|.

The bounds hold on every IEEE-754 machine whatever order its kernels add in, which is what differs between
CPUs (AVX2 vs AVX-512 dot products) and between the Triton kernel's tiles and torch's matmul. Two
implementations that are each within B of the exact value are within 2 B of each other; a float64 reference
is within B(fp64) <= B(dtype) of it, so `2 * B(dtype)` bounds both comparisons.
"""

from __future__ import annotations

import contextlib
import math

import torch


@contextlib.contextmanager
def fp32_gemm_sums():
    """cuBLAS adds bf16 GEMMs' split-K partial sums in fp32 inside the block: the bounds here assume fp32 sums.
    (Set and restored by hand: pytest's monkeypatch cannot undo this attribute, which __getattr__ serves.)"""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of one rounding to nearest in `dtype` (half the machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings in a row."""
    u = unit_roundoff(dtype)
    assert n * u < 0.5, (n, dtype)
    return n * u / (1 - n * u)


def logprob_error_bounds(
    h, w, targets, temperature, dtype, upstream=None, rounded_to=None, autocast=False
) -> dict[str, torch.Tensor]:
    """Bounds on the error of log softmax(h @ w.T / T)[target], its entropy and logsumexp, computed in `dtype`
    (either path of common.logprobs.chunked_logprobs, or a float64 reference when dtype is float64), and, with
    `upstream` (d loss / d logp), of the gradients d(hidden) and d(weight) of common.logprobs' chunked backward.

    h: [N, H], w: [V, H] (the values the computation saw, any dtype; evaluated in fp64 here), targets: [N].
    rounded_to: a half dtype that the logits, the backward's d logits and d(hidden) / d(weight) are stored in
    while `dtype` (fp32) accumulates, as in the torch path under autocast or with bf16 weights: u(rounded_to) more
    per rounding (the products of half inputs are exact in fp32). autocast: h and w are fp32 values that the GEMMs
    round to `rounded_to` first (u(rounded_to) each, 2 per product); without it they are taken as already in it.
    Returns elementwise bounds {"logps", "entropy", "lse": [N], "grad_h": [N, H], "grad_w": [V, H]} (fp64).

    Derivation (first order in u; the H + 2, V + 8 and 3u terms count the roundings of each step):
      logits   |dz_nv| <= gamma(H + 2) (|h| @ |w|.T)_nv / T     dot product of H terms, times a rounded 1/T
      lse      log of s = sum_v exp(z_v - m): its V terms are positive, each off by the rounding of z - m and of
               exp (< 2 ulp), the online rescaling exp(m - m') adds one per tile; relative error of s and so
               absolute error of log s <= (2 V + 8) u =: d_sum, plus u |log s| <= u log V for the log itself.
               log-sum-exp is 1-Lipschitz in max|dz|:   E_lse = max_v |dz_nv| + d_sum + u log V + u |lse|
      logp     z_t - lse:                                 E_logp = |dz_nt| + E_lse + u |logp|
      entropy  H = -sum p log p; d H / d z_v = -p_v (log p_v + H), sum_v |.| <= 2 H, so rounded logits move it
               by <= 2 H max|dz|; a uniform error c in every log p (the lse's) moves it by <= |c| (1 + H);
               the final sum of V terms of one sign errs by gamma(V) H (the fused kernel's log s - a / s: a / s
               = E_p[m - z] <= H, the same bound):   E_H = 2 H max|dz| + (1 + H) E_lse + gamma(V + 2) H
      d logits D_nv = g_n (1[v = t] - p_nv) / T with p = exp(z - lse): relative error of p <= |dz| + E_lse + 2u,
               3 more roundings (times -g, the one-hot add, / T):  |dD| <= |g| / T (p (|dz| + E_lse + 2u)
               + 3u (p + 1[v = t]))
      grad_h   D @ W, V terms:      |dD| @ |W| + gamma(V) |D| @ |W|
      grad_w   D.T @ h, N terms:    |dD|.T @ |h| + gamma(N) |D|.T @ |h|   (chunk by chunk: still N terms)
    With rounded_to (u_r), first order: z gains u_r (stored), 2 u_r under autocast (h, w rounded); grad_h 2 u_r (D and
    D @ W stored) + u_r under autocast (W rounded); grad_w 3 u_r (D, each chunk's D.T @ h, and the sum cast to a half
    weight) + u_r under autocast (h rounded). A value stored in half precision below its smallest normal errs by up to
    eta = half the subnormal spacing instead (fp16: 3e-8, which d logits of p ~ e^-30 reach; bf16: 5e-41): eta |W| and
    eta |h| summed over D's entries, and eta per stored product (at most N chunks).
    """
    h64, w64 = h.detach().double().cpu(), w.detach().double().cpu()
    t = targets.cpu()
    n, hid = h64.shape
    vocab = w64.shape[0]
    u = unit_roundoff(dtype)
    ur = unit_roundoff(rounded_to) if rounded_to is not None else 0.0
    ua = ur if autocast else 0.0  # each fp32 operand rounded to half before a GEMM
    dz = (gamma(hid + 2, dtype) + ur + 2 * ua) * (h64.abs() @ w64.abs().T) / temperature  # [N, V]
    logits = h64 @ w64.T / temperature
    bounds = log_softmax_error_bounds(logits, t, dz, dtype)
    p, e_lse = bounds.pop("p"), bounds["lse"]
    if upstream is not None:
        g = upstream.detach().double().cpu().abs()[:, None] / temperature
        onehot = torch.zeros_like(p).scatter_(1, t[:, None], 1.0)
        d_abs = g * (p + onehot)  # >= |D|
        dd = g * (p * (dz + e_lse[:, None] + 2 * u) + 3 * u * (p + onehot))
        eta = torch.finfo(rounded_to).smallest_normal * torch.finfo(rounded_to).eps / 2 if rounded_to else 0.0
        bounds["grad_h"] = dd @ w64.abs() + (gamma(vocab, dtype) + 2 * ur + ua) * d_abs @ w64.abs()
        bounds["grad_h"] += eta * (w64.abs().sum(0) + 1)
        bounds["grad_w"] = dd.T @ h64.abs() + (gamma(n, dtype) + 3 * ur + ua) * d_abs.T @ h64.abs()
        bounds["grad_w"] += eta * (h64.abs().sum(0) + n)
    return bounds


def log_softmax_error_bounds(logits, targets, dz, dtype) -> dict[str, torch.Tensor]:
    """Bounds {"logps", "entropy", "lse": [N]} (and "p", the softmax) on log softmax(z)[target] and its entropy
    computed in `dtype` from logits z ([N, V], exact values) that are each off by at most dz ([N, V]): the
    lse, logp and entropy lines of logprob_error_bounds."""
    z = logits.detach().double().cpu()
    t = targets.cpu()
    vocab = z.shape[-1]
    u = unit_roundoff(dtype)
    dz_max = dz.max(-1).values
    lse = torch.logsumexp(z, -1)
    logp_all = z - lse[:, None]
    logp = logp_all.gather(1, t[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    e_lse = dz_max + (2 * vocab + 8) * u + u * math.log(vocab) + u * lse.abs()
    return {
        "lse": e_lse,
        "logps": dz.gather(1, t[:, None]).squeeze(1) + e_lse + u * logp.abs(),
        "entropy": 2 * ent * dz_max + (1 + ent) * e_lse + gamma(vocab + 2, dtype) * ent,
        "p": logp_all.exp(),
    }


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, name: str = "") -> float:
    """|got - want| <= bound elementwise; returns max |got - want| / bound (how much of the bound is used)."""
    diff = (got.detach().double().cpu() - want.detach().double().cpu()).abs()
    bound = bound.double().cpu().expand_as(diff)
    used = (diff / bound).nan_to_num(0.0).max().item()  # 0 / 0: an exact result where no error is possible
    assert (diff <= bound).all(), f"{name}: |diff| is {used:.3g}x its error bound (max |diff| {diff.max().item():.3g})"
    return used


def group_advantage_bound(rewards, group_size: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Bound on the rounding error of A_i = (R_i - mean_g R) / (std_g R + eps) (unbiased std) computed in `dtype`
    from `rewards` (the values it saw), elementwise [N], by first-order propagation through each step:
      centring   d = R - mean:   |dd| <= gamma(n + 1) (max |R| + |mean|)     (n-term sum, / n, subtraction)
      variance   v = sum d^2 / (n - 1):   |dv| <= 2 sum |d| |dd| / (n - 1) + gamma(n + 1) v
      std        s = sqrt(v):   |ds| <= min(|dv| / (2 s), sqrt(|dv|)) + u s
      A          d / (s + eps):   |dA| <= |dd| / (s + eps) + |A| (|ds| + u (s + eps)) / (s + eps) + u |A|
    """
    u = unit_roundoff(dtype)
    r = rewards.detach().double().cpu().view(-1, group_size)
    n = group_size
    mean = r.mean(1, keepdim=True)
    d = r - mean
    dd = gamma(n + 1, dtype) * (r.abs().max(1, keepdim=True).values + mean.abs())
    v = (d**2).sum(1, keepdim=True) / (n - 1)
    s = v.sqrt()
    dv = 2 * (d.abs() * dd).sum(1, keepdim=True) / (n - 1) + gamma(n + 1, dtype) * v
    ds = torch.where(s > 0, torch.minimum(dv / (2 * s).clamp(min=1e-300), dv.sqrt()), dv.sqrt()) + u * s
    a = d.abs() / (s + eps)
    return (dd / (s + eps) + a * (ds + u * (s + eps)) / (s + eps) + u * a).view(-1)
