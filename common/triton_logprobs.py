"""Triton kernels of the log-prob path (common.logprobs.chunked_logprobs): the softmax around cuBLAS's GEMMs
(kernel="triton"), or the output layer fused into the forward (kernel="triton-fused").

kernel="triton": the chunk's logits z = h W^T come from cuBLAS in the GEMMs' dtype (bf16 under autocast), and two
kernels replace torch's half-dozen passes over them in fp32:
  `softmax_stats`  one pass over each row of z: lse, logp_target and entropy (the online softmax below);
  `softmax_grad_`  d logp / d(h W^T) = g (onehot(target) - softmax(z / T)) / T, written over z in its own dtype,
                   ready for the two backward GEMMs.
Each reads the logits once, in their own dtype, and does its arithmetic in fp32 (fp64 for fp64 logits).

kernel="triton-fused": the output layer -> per-token log-prob + entropy forward as one Triton kernel.

`fused_logprobs_forward(hidden, weight, targets, temperature)` returns, for each row i,

    logp_i = z_i[target_i] - lse_i,   entropy_i = -sum_v p_iv log p_iv,   lse_i = logsumexp_v z_iv,
    with z_i = hidden_i @ weight.T / temperature,

without ever materialising the [rows x vocab] logits. Each program owns BLOCK_N rows and walks the vocabulary
in BLOCK_V tiles. A tile's logits come from `tl.dot` over the hidden dimension in BLOCK_K steps, accumulated
in fp32 (fp64 for fp64 inputs), then multiplied by 1/T. Per row the kernel keeps an online softmax state:

    m = max z seen so far,   s = sum exp(z - m),   a = sum exp(z - m) (z - m),   z_target.

When a tile raises the max from m to m', the old sums are rescaled by exp(m - m'); a also shifts by
(m - m') s because its terms are measured from m. At the end lse = m + log s and, since
entropy = lse - E[z] = log s - a / s, the entropy never subtracts two large numbers. (Keeping a relative to
m is the same algorithm as summing exp(z - m) z; it only avoids that cancellation for large logits.)

Only the forward is fused. `common.logprobs._ChunkedLogProbs` saves the returned lse and runs its usual chunked
PyTorch backward, which recomputes each chunk's logits from hidden and weight.

This module imports triton at the top; common.logprobs imports it only when a Triton kernel is asked for.
On a CPU (tests) set TRITON_INTERPRET=1 before triton is first imported: `triton.jit` reads it when the
kernel below is decorated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _logprobs_fwd_kernel(
    h_ptr, w_ptr, tgt_ptr, inv_temp_ptr, logp_ptr, ent_ptr, lse_ptr,
    n_rows, vocab, hidden,
    stride_hn, stride_hk, stride_wv, stride_wk,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=0)
    inv_temp = tl.load(inv_temp_ptr)  # a tensor of dtype ACC, so fp64 runs scale by the exact fp64 1/T
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hn  # int64 offsets: V x H can exceed 2^31

    m = tl.full([BLOCK_N], float("-inf"), ACC)
    s = tl.zeros([BLOCK_N], ACC)
    a = tl.zeros([BLOCK_N], ACC)
    z_tgt = tl.zeros([BLOCK_N], ACC)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
        z = tl.zeros([BLOCK_N, BLOCK_V], ACC)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            h = tl.load(h_rows + ks[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            z = tl.dot(h, w, z, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_V] += h [N, K] @ w^T [K, V]
        z = tl.where(col_ok[None, :], z * inv_temp, float("-inf"))

        m_new = tl.maximum(m, tl.max(z, axis=1))
        p = tl.exp(z - m_new[:, None])  # 0 in masked columns
        z_rel = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)  # keeps 0 * -inf out of the sum below
        scale = tl.exp(m - m_new)  # 0 on the first tile, where m = -inf and s = 0
        a = scale * (a + tl.where(s > 0, m - m_new, 0.0) * s) + tl.sum(p * z_rel, axis=1)
        s = scale * s + tl.sum(p, axis=1)
        z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new

    log_s = tl.log(s)
    lse = m + log_s
    tl.store(logp_ptr + rows, z_tgt - lse, mask=row_ok)
    tl.store(ent_ptr + rows, log_s - a / s, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def _launch_checks(x: Tensor, kernel) -> None:
    """Refuses, in one line, what `kernel` cannot run on `x`: a CPU tensor outside Triton's interpreter, bf16 inside it
    (it multiplies bf16 tiles as raw integers), fp64 compiled for CUDA."""
    interpreted = not isinstance(kernel, triton.runtime.JITFunction)
    if x.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"the Triton log-prob kernels need CUDA tensors, got {x.device}; on a CPU use kernel='torch' "
            "(or set TRITON_INTERPRET=1 before importing triton, for tests)"
        )
    if interpreted and x.dtype == torch.bfloat16:
        raise NotImplementedError("triton's interpreter has no bf16 arithmetic; test in fp16, fp32 or fp64")
    if not interpreted and x.dtype == torch.float64:
        raise NotImplementedError("the Triton log-prob kernels do not compile for fp64 on CUDA; use kernel='torch'")


def fused_logprobs_forward(
    hidden2d: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    *,
    block_n: int = 64,
    block_v: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
) -> tuple[Tensor, Tensor, Tensor]:
    """(logps, entropy, lse), each [N], of logits `hidden2d @ weight.T / temperature` (see module docstring).

    hidden2d: [N, H]; weight: [V, H], same dtype (fp32, bf16 or fp16; fp64 in the interpreter only); targets: [N]
    ids in [0, V).
    Outputs are fp32 (fp64 for fp64 inputs). fp32 inputs multiply in full fp32 unless
    torch.backends.cuda.matmul.allow_tf32 is set, like torch's own matmul. Block sizes must be powers of
    two, at least 16 on a GPU (tl.dot); the defaults are untuned starting points.
    """
    if hidden2d.dim() != 2 or weight.dim() != 2 or hidden2d.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and weight [V, H], got {tuple(hidden2d.shape)} and {tuple(weight.shape)}"
        )
    if hidden2d.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden2d.dtype} vs {weight.dtype}")
    # fp64: a CompilationError at its tl.dot, seen with Triton 3.6 on an H100
    _launch_checks(hidden2d, _logprobs_fwd_kernel)
    n, h = hidden2d.shape
    acc = torch.promote_types(hidden2d.dtype, torch.float32)
    logps, entropy, lse = (torch.empty(n, dtype=acc, device=hidden2d.device) for _ in range(3))
    if n == 0:
        return logps, entropy, lse
    inv_temp = torch.full((1,), 1.0 / temperature, dtype=acc, device=hidden2d.device)
    tf32 = hidden2d.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    _logprobs_fwd_kernel[(triton.cdiv(n, block_n),)](
        hidden2d, weight, targets.contiguous(), inv_temp, logps, entropy, lse,
        n, weight.shape[0], h,
        hidden2d.stride(0), hidden2d.stride(1), weight.stride(0), weight.stride(1),
        ACC=_TL_DTYPES[acc], DOT_PRECISION="tf32" if tf32 else "ieee",
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return logps, entropy, lse


@triton.jit
def _softmax_stats_kernel(
    z_ptr, tgt_ptr, temp_ptr, logp_ptr, ent_ptr, lse_ptr, vocab, stride_zn,
    ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_zn
    temp = tl.load(temp_ptr)
    m = float("-inf")  # the online softmax of the fused kernel above, one row per program
    s = 0.0
    a = 0.0
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < vocab
        z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(ACC) / temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        p = tl.exp(z - m_new)
        z_rel = tl.where(ok, z - m_new, 0.0)
        scale = tl.exp(m - m_new)
        a = scale * (a + tl.where(s > 0, m - m_new, 0.0) * s) + tl.sum(p * z_rel, axis=0)
        s = scale * s + tl.sum(p, axis=0)
        m = m_new
    z_tgt = tl.load(z_row + tl.load(tgt_ptr + row)).to(ACC) / temp
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(logp_ptr + row, z_tgt - lse)
    tl.store(ent_ptr + row, log_s - a / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _softmax_grad_kernel(
    z_ptr, tgt_ptr, lse_ptr, g_ptr, temp_ptr, vocab, stride_zn,
    ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < vocab
    ptrs = z_ptr + row.to(tl.int64) * stride_zn + cols
    temp = tl.load(temp_ptr)
    g = tl.load(g_ptr + row).to(ACC)
    z = tl.load(ptrs, mask=ok, other=0.0).to(ACC)
    # as the torch path: (-g exp(z / T - lse) + g onehot(target)) / T
    d = -g * tl.exp(z / temp - tl.load(lse_ptr + row))
    d = tl.where(cols == tl.load(tgt_ptr + row), d + g, d) / temp
    tl.store(ptrs, d.to(z_ptr.dtype.element_ty), mask=ok)


def _check_logits(logits: Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"expected logits [N, V] with contiguous rows, got shape {tuple(logits.shape)}")


def _block(vocab: int) -> int:
    return min(4096, triton.next_power_of_2(vocab))


def softmax_stats(
    logits: Tensor,
    targets: Tensor,
    temperature: Tensor,
    logps: Tensor,
    entropy: Tensor,
    lse: Tensor,
    block_v: int | None = None,
) -> None:
    """Per row of `logits` ([N, V], any float dtype) over `temperature` (a 1-element tensor in the outputs' dtype):
    logp of `targets` ([N]), entropy and logsumexp, written into `logps`, `entropy`, `lse` ([N] each, contiguous,
    fp32 or fp64: the arithmetic's dtype). block_v: the vocabulary tile (a power of two; default up to 4096)."""
    _launch_checks(logits, _softmax_stats_kernel)
    _check_logits(logits)
    n, vocab = logits.shape
    if n == 0:
        return
    _softmax_stats_kernel[(n,)](
        logits, targets.contiguous(), temperature, logps, entropy, lse, vocab, logits.stride(0),
        ACC=_TL_DTYPES[lse.dtype], BLOCK_V=block_v or _block(vocab), num_warps=8,
    )  # fmt: skip


def softmax_grad_(
    logits: Tensor, targets: Tensor, lse: Tensor, grad_logps: Tensor, temperature: Tensor, block_v: int | None = None
) -> Tensor:
    """d(sum_rows g * logp_target) / d logits with logp = log_softmax(logits / T), i.e. per row
    g (onehot(target) - softmax(logits / T)) / T, written over `logits` ([N, V], its own dtype) and returned; lse (of
    logits / T), grad_logps ([N]) and temperature (1 element) in the arithmetic's dtype (fp32, or fp64)."""
    _launch_checks(logits, _softmax_grad_kernel)
    _check_logits(logits)
    n, vocab = logits.shape
    if n == 0:
        return logits
    block = block_v or _block(vocab)
    _softmax_grad_kernel[(n, triton.cdiv(vocab, block))](
        logits, targets.contiguous(), lse.contiguous(), grad_logps.contiguous(), temperature, vocab,
        logits.stride(0), ACC=_TL_DTYPES[lse.dtype], BLOCK_V=block, num_warps=8,
    )  # fmt: skip
    return logits
