"""common/triton_logprobs.py: the fused Triton forward against a float64 full-softmax reference and against
the torch path of common.loss, through the same chunked backward.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before the kernel module
is imported: `triton.jit` reads it when the kernel is decorated). The interpreter runs fp32, fp64 and fp16
tiles through numpy; bf16 only on a GPU (see test_compiled_kernel_matches_torch_path_on_cuda).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from common import triton_logprobs  # noqa: E402  (imports triton; after TRITON_INTERPRET is set)
from common.loss import TokenLogProbs, chunked_logprobs  # noqa: E402
from tests.test_loss import naive  # noqa: E402  (the float64 full log-softmax reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, H, V = 37, 48, 301  # no multiple of any block size below
SMALL_BLOCKS = dict(block_n=16, block_v=32, block_k=16)  # 3 row blocks, 10 vocab tiles, 3 hidden steps
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.float64: dict(rtol=0, atol=1e-12)}


def inputs(dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, dtype=torch.float64, generator=g) * scale
    w = torch.randn(V, H, dtype=torch.float64, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[0], t[-1] = 0, V - 1  # the first and last vocabulary entries, in the first and last row blocks
    return h.to(DEVICE, dtype), w.to(DEVICE, dtype), t.to(DEVICE)


def reference(h, w, t, temperature):
    """(logps, entropy, lse) from the full float64 softmax."""
    h, w = h.double(), w.double()
    logps, entropy = naive(h, w, t, temperature)
    return logps, entropy, torch.logsumexp(h @ w.T / temperature, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_forward_matches_fp64_reference(dtype, temperature):
    h, w, t = inputs(dtype)
    wide = torch.zeros(N, H + 5, dtype=dtype, device=DEVICE)
    wide[:, :H] = h  # a strided view: rows H + 5 apart
    got = triton_logprobs.fused_logprobs_forward(wide[:, :H], w, t, temperature, **SMALL_BLOCKS)
    for x, ref in zip(got, reference(h, w, t, temperature)):
        assert x.dtype == dtype
        torch.testing.assert_close(x.double(), ref, **TOL[dtype])


def test_large_logits_with_the_max_in_the_last_tile():
    """The online max grows across tiles and must rescale s and a; logits of a few hundred must not overflow."""
    h, w, t = inputs(torch.float32, seed=1, scale=4.0)
    w[-1] = 3 * h.abs().max(0).values  # the last vocab entry dominates every row
    got = triton_logprobs.fused_logprobs_forward(h, w, t, 0.7, **SMALL_BLOCKS)
    for x, ref in zip(got, reference(h, w, t, 0.7)):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_path_matches_torch_path_and_reference_with_gradients(dtype, temperature):
    h, w, t = inputs(dtype, seed=2)
    upstream = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    results = {}
    for kernel in ("triton", "torch"):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hk, wk, t, temperature, chunk_size=16, kernel=kernel)
        assert not ent.requires_grad
        results[kernel] = (lp, ent, *torch.autograd.grad((lp * upstream).sum(), (hk, wk)))
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, ent = naive(hr, wr, t, temperature)
    ref = (lp, ent, *torch.autograd.grad((lp * upstream.double()).sum(), (hr, wr)))
    for got, want, want_torch in zip(results["triton"], ref, results["torch"]):
        torch.testing.assert_close(got.double(), want.detach(), **TOL[dtype])
        torch.testing.assert_close(got, want_torch, **TOL[dtype])


def test_triton_path_multiplies_in_the_autocast_dtype():
    h, w, t = inputs(torch.float32, seed=4)
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter has no bf16 tl.dot
    with torch.autocast(DEVICE, dtype=half):
        lp, ent = chunked_logprobs(h, w, t, 0.7, kernel="triton")
        lp_torch, ent_torch = chunked_logprobs(h, w, t, 0.7, kernel="torch")
    ref_lp, ref_ent, _ = reference(h.to(half), w.to(half), t, 0.7)
    assert lp.dtype == torch.float32
    # both multiply half-precision inputs; torch also rounds the logits to half before the fp32 softmax
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-4)
    torch.testing.assert_close(lp, lp_torch, rtol=0, atol=0.1)
    torch.testing.assert_close(ent, ent_torch, rtol=0, atol=0.1)


def test_token_logprobs_triton_matches_torch_on_toy_qwen2(toy_assets):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11]], device=DEVICE)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], device=DEVICE)
    out = {}
    for kernel in ("triton", "torch"):
        lm = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float32).to(DEVICE)
        policy = TokenLogProbs(lm, chunk_size=3, kernel=kernel)
        lp, ent = policy(ids, attn, completion_start=4, temperature=0.7)
        lp.sum().backward()
        out[kernel] = (lp, ent, {n: p.grad for n, p in lm.named_parameters() if p.grad is not None})
    (lp, ent, grads), (lp_t, ent_t, grads_t) = out["triton"], out["torch"]
    torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_t.keys() and len(grads) > 2
    for name in grads:
        torch.testing.assert_close(grads[name], grads_t[name], rtol=1e-4, atol=1e-5, msg=name)


def test_kernel_errors(monkeypatch):
    h, w, t = inputs(torch.float32)
    with pytest.raises(ValueError, match="unknown log-prob kernel 'cuda'"):
        chunked_logprobs(h, w, t, kernel="cuda")
    with pytest.raises(ValueError, match="unknown log-prob kernel"):
        TokenLogProbs(torch.nn.Module(), kernel="fused")
    monkeypatch.setitem(sys.modules, "common.triton_logprobs", None)  # as if triton were not installed
    with pytest.raises(ImportError, match="kernel='triton' needs the triton package"):
        chunked_logprobs(h, w, t, kernel="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernel_matches_torch_path_on_cuda(dtype):
    """The compiled kernel at default block sizes, on shapes that are no multiple of them."""
    g = torch.Generator().manual_seed(5)
    n, hid, vocab = 1000, 200, 5003
    h = torch.randn(n, hid, generator=g).cuda().to(dtype)
    w = (torch.randn(vocab, hid, generator=g) * 0.2).cuda().to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g).cuda()
    t[0], t[-1] = 0, vocab - 1
    ref = reference(h, w, t, 0.7)
    got = triton_logprobs.fused_logprobs_forward(h, w, t, 0.7)
    for x, r in zip(got, ref):  # fp32 accumulation of exact products: close to fp64 in both dtypes
        torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-4)
    # the torch path rounds bf16 logits (|z| up to ~10) to bf16 before its fp32 softmax
    tol = dict(rtol=0, atol=0.1) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    grad_tol = dict(rtol=5e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    res = {}
    for kernel in ("triton", "torch"):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hk, wk, t, 0.7, chunk_size=256, kernel=kernel)
        res[kernel] = (lp, ent, *torch.autograd.grad(lp.sum(), (hk, wk)))
    for name, a, b in zip(("logps", "entropy", "grad hidden", "grad weight"), res["triton"], res["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **(tol if name in ("logps", "entropy") else grad_tol), msg=name)
