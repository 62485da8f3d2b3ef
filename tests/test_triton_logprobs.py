"""common/triton_logprobs.py: the fused Triton forward against a float64 full-softmax reference and against
the torch path of common.logprobs, through the same chunked backward.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before the kernel module
is imported: `triton.jit` reads it when the kernel is decorated). The interpreter runs fp32, fp64 and fp16
tiles through numpy; bf16 only on a GPU (see test_compiled_kernel_matches_torch_path_on_cuda).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from common import triton_logprobs  # noqa: E402  (imports triton; after TRITON_INTERPRET is set)
from common.logprobs import TokenLogProbs, chunked_logprobs  # noqa: E402
from tests.fp_bounds import (  # noqa: E402
    assert_within,
    fp32_gemm_sums,
    log_softmax_error_bounds,
    logprob_error_bounds,
)
from tests.test_loss import GemmDtypes, naive  # noqa: E402  (naive: the float64 full log-softmax reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp64 runs in the interpreter only: compiled for CUDA the kernel refuses it (test_fp64_on_cuda_is_refused)
DTYPES = [torch.float32, torch.float64] if DEVICE == "cpu" else [torch.float32]
N, H, V = 37, 48, 301  # no multiple of any block size below
SMALL_BLOCKS = dict(block_n=16, block_v=32, block_k=16)  # 3 row blocks, 10 vocab tiles, 3 hidden steps
TRITON_KERNELS = ("triton", "triton-fused")  # Triton's softmax around torch's matmuls; the fused forward
# Tolerances: 2 x the worst-case rounding-error bound B of tests/fp_bounds.py, elementwise, from the inputs, the
# dtype's unit roundoff, H, V, N and 1/T (each side is within B of the exact value). B holds for any summation
# order, so for any CPU or GPU; here the errors use up to ~6% of it (fp32 and fp64). A real defect (a missing
# 1/T, a lost online-softmax rescale, TF32 or half precision where fp32 is promised) is 10x-1000x over it.


def inputs(dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, dtype=torch.float64, generator=g) * scale
    w = torch.randn(V, H, dtype=torch.float64, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[0], t[-1] = (0, V - 1)  # the first and last vocabulary entries, in the first and last row blocks
    return h.to(DEVICE, dtype), w.to(DEVICE, dtype), t.to(DEVICE)


def reference(h, w, t, temperature):
    """(logps, entropy, lse) from the full float64 softmax."""
    h, w = h.double(), w.double()
    logps, entropy = naive(h, w, t, temperature)
    return logps, entropy, torch.logsumexp(h @ w.T / temperature, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_forward_matches_fp64_reference(dtype, temperature):
    h, w, t = inputs(dtype)
    wide = torch.zeros(N, H + 5, dtype=dtype, device=DEVICE)
    wide[:, :H] = h  # a strided view: rows H + 5 apart
    got = triton_logprobs.fused_logprobs_forward(wide[:, :H], w, t, temperature, **SMALL_BLOCKS)
    bound = logprob_error_bounds(h, w, t, temperature, dtype)
    for name, x, ref in zip(("logps", "entropy", "lse"), got, reference(h, w, t, temperature)):
        assert x.dtype == dtype
        assert_within(x, ref, 2 * bound[name], name)


def test_large_logits_with_the_max_in_the_last_tile():
    """The online max grows across tiles and must rescale s and a; logits of a few hundred must not overflow."""
    h, w, t = inputs(torch.float32, seed=1, scale=4.0)
    w[-1] = 3 * h.abs().max(0).values  # the last vocab entry dominates every row
    got = triton_logprobs.fused_logprobs_forward(h, w, t, 0.7, **SMALL_BLOCKS)
    bound = logprob_error_bounds(h, w, t, 0.7, torch.float32)  # grows with the logits' size (|h| @ |w|.T / T)
    for name, x, ref in zip(("logps", "entropy", "lse"), got, reference(h, w, t, 0.7)):
        assert torch.isfinite(x).all()
        assert_within(x, ref, 2 * bound[name], name)


@pytest.mark.parametrize("dtype", [*DTYPES, *([torch.float16] if DEVICE == "cpu" else [torch.bfloat16])])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_softmax_kernels_match_fp64_over_many_tiles(dtype, temperature):
    """kernel="triton"'s two kernels on given logits, 10 vocabulary tiles (block_v=32), the largest logit of some
    rows in the last tile and logits up to ~100: lse, logp and entropy within fp_bounds' bound of the float64
    ones (the logits exact, dz = the rounding of z / T); d logits within the backward's bound plus one rounding to
    the logits' dtype (tests/fp_bounds.py's d logits line)."""
    g = torch.Generator().manual_seed(11)
    z = (torch.randn(N, V, dtype=torch.float64, generator=g) * 8).to(dtype)
    z[::3, -1] = 100.0  # the max in the last tile, after nine tiles of smaller ones: the online rescale
    t = torch.randint(0, V, (N,), generator=g)
    t[0], t[1] = V - 1, 0
    up = torch.randn(N, dtype=torch.float64, generator=g)
    acc = torch.promote_types(dtype, torch.float32)
    wide = torch.zeros(N, V + 7, dtype=dtype)
    wide[:, :V] = z  # rows V + 7 apart
    logits = wide.to(DEVICE)[:, :V]
    temp = torch.full((1,), temperature, dtype=acc, device=DEVICE)
    logps, entropy, lse = (torch.empty(N, dtype=acc, device=DEVICE) for _ in range(3))
    triton_logprobs.softmax_stats(logits, t.to(DEVICE), temp, logps, entropy, lse, block_v=32)
    z64 = z.double() / temperature  # the exact logits over T
    u = torch.finfo(acc).eps / 2
    dz = u * z64.abs()
    bound = log_softmax_error_bounds(z64, t, dz, acc)
    ref = torch.log_softmax(z64, -1)
    want = (ref.gather(1, t[:, None]).squeeze(1), -(ref.exp() * ref).sum(-1), torch.logsumexp(z64, -1))
    for name, got, w in zip(("logps", "entropy", "lse"), (logps, entropy, lse), want):
        assert got.dtype == acc
        assert_within(got, w, 2 * bound[name], name)
    d = triton_logprobs.softmax_grad_(logits, t.to(DEVICE), lse, up.to(DEVICE, acc), temp, block_v=32)
    assert d.data_ptr() == logits.data_ptr() and d.dtype == dtype  # in place, in the logits' dtype
    assert torch.equal(wide[:, V:], torch.zeros(N, 7, dtype=dtype))  # nothing written past a row
    p = ref.exp()
    onehot = torch.zeros_like(p).scatter_(1, t[:, None], 1.0)
    want = up[:, None] * (onehot - p) / temperature
    gabs = up.abs()[:, None] / temperature
    e_lse = bound["lse"][:, None]
    store = torch.finfo(dtype).eps / 2
    tol = gabs * (p * (dz + e_lse + 2 * u) + 3 * u * (p + onehot)) + store * want.abs()
    # p ~ e^-100 is subnormal: exp, the product with g and the division by T each round by up to half its spacing
    tol += torch.finfo(acc).smallest_normal * u * (gabs + 2) + torch.finfo(dtype).smallest_normal * store
    assert_within(d, want, 2 * tol, "d logits")


@pytest.mark.parametrize("kernel", TRITON_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_path_matches_torch_path_and_reference_with_gradients(kernel, dtype, temperature):
    h, w, t = inputs(dtype, seed=2)
    upstream = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    results = {}
    for k in (kernel, "torch"):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hk, wk, t, temperature, chunk_size=16, kernel=k)
        assert not ent.requires_grad
        results[k] = (lp, ent, *torch.autograd.grad((lp * upstream).sum(), (hk, wk)))
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, ent = naive(hr, wr, t, temperature)
    ref = (lp, ent, *torch.autograd.grad((lp * upstream.double()).sum(), (hr, wr)))
    bound = logprob_error_bounds(h, w, t, temperature, dtype, upstream)
    names = ("logps", "entropy", "grad_h", "grad_w")
    for name, got, want, want_torch in zip(names, results[kernel], ref, results["torch"]):
        assert got.dtype == dtype
        assert_within(got, want, 2 * bound[name], name)
        assert_within(got, want_torch, 2 * bound[name], name)


@pytest.mark.parametrize("kernel", TRITON_KERNELS)
def test_triton_path_multiplies_in_the_autocast_dtype(kernel):
    h, w, t = inputs(torch.float32, seed=4)
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter has no bf16 arithmetic
    with torch.autocast(DEVICE, dtype=half):
        lp, ent = chunked_logprobs(h, w, t, 0.7, chunk_size=16, kernel=kernel)
        lp_torch, ent_torch = chunked_logprobs(h, w, t, 0.7, chunk_size=16, kernel="torch")
    hh, wh = h.to(half), w.to(half)
    ref_lp, ref_ent, _ = reference(hh, wh, t, 0.7)
    assert lp.dtype == torch.float32
    # all multiply the half-rounded inputs (exact products, fp32 sums): the fused kernel is within the fp32 bound
    # of the fp64 result on those inputs; torch and triton round the logits to half before an fp32 softmax
    fused = logprob_error_bounds(hh, wh, t, 0.7, torch.float32)
    torch_path = logprob_error_bounds(hh, wh, t, 0.7, torch.float32, rounded_to=half)
    own = fused if kernel == "triton-fused" else torch_path
    assert_within(lp, ref_lp, 2 * own["logps"], "logps")
    assert_within(ent, ref_ent, 2 * own["entropy"], "entropy")
    assert_within(lp, lp_torch, own["logps"] + torch_path["logps"], "logps vs torch")
    assert_within(ent, ent_torch, own["entropy"] + torch_path["entropy"], "entropy vs torch")


def test_triton_path_backward_multiplies_in_the_autocast_dtype():
    """The Triton paths' backward (Triton's d logits, or the torch path's) runs its three GEMMs per chunk in the
    autocast dtype too: every path's gradients are within the half-precision bound of the float64 ones
    (tests/fp_bounds.py, fp32 inputs rounded by autocast)."""
    h, w, t = inputs(torch.float32, seed=6)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter has no bf16 arithmetic
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, _ = naive(hr, wr, t, 0.7)
    exact = torch.autograd.grad((lp * upstream.double()).sum(), (hr, wr))
    bound = logprob_error_bounds(h, w, t, 0.7, torch.float32, upstream, rounded_to=half, autocast=True)
    for kernel in (*TRITON_KERNELS, "torch"):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with torch.autocast(DEVICE, dtype=half):
            lp, _ = chunked_logprobs(hk, wk, t, 0.7, chunk_size=16, kernel=kernel)
        with GemmDtypes() as gemms:
            grads = torch.autograd.grad((lp * upstream).sum(), (hk, wk))
        assert len(gemms.seen) == 3 * -(-N // 16) and all(set(d[-2:]) == {half} for d in gemms.seen), gemms.seen
        for name, got, want in zip(("grad_h", "grad_w"), grads, exact):
            assert got.dtype == torch.float32
            assert_within(got, want, bound[name], f"{kernel} {name}")


@pytest.mark.skipif(DEVICE == "cuda", reason="in fp64, which the compiled kernels refuse")
@pytest.mark.parametrize("kernel", TRITON_KERNELS)
def test_token_logprobs_triton_matches_torch_on_toy_qwen2(kernel, toy_assets):
    """The kernel wired into TokenLogProbs: same log-probs, entropies and parameter gradients as the torch path.
    In fp64, so that the decoder's own rounding, which both paths share, stays far below what is checked."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11]], device=DEVICE)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], device=DEVICE)
    out = {}
    for k in (kernel, "torch"):
        lm = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64).to(DEVICE)
        seen = []  # the decoder's last hidden states: the head's inputs
        keep = lambda mod, args, kwargs, res, seen=seen: seen.append(res.last_hidden_state.detach())
        lm.get_decoder().register_forward_hook(keep, with_kwargs=True)
        policy = TokenLogProbs(lm, chunk_size=3, kernel=k)
        lp, ent = policy(ids, attn, completion_start=4, temperature=0.7)
        lp.sum().backward()
        out[k] = (lp, ent, {n: p.grad for n, p in lm.named_parameters() if p.grad is not None})
    lp_t, ent_t, grads_t = out.pop("torch")
    ((lp, ent, grads),) = out.values()  # the Triton kernel's
    hidden, weight = (seen[0][:, 3:-1].reshape(-1, seen[0].shape[-1]), lm.get_output_embeddings().weight)
    bound = logprob_error_bounds(hidden, weight, ids[:, 4:].reshape(-1), 0.7, torch.float64)  # tests/fp_bounds.py
    assert_within(lp, lp_t, 2 * bound["logps"].view_as(lp), "logps")
    assert_within(ent, ent_t, 2 * bound["entropy"].view_as(ent), "entropy")
    assert grads.keys() == grads_t.keys() and len(grads) > 2
    # The backward is the same fp64 code on both paths; they differ by the saved lse (<= 2 B above, ~1e-14 here)
    # plus each backward's rounding: 2 layers of sums of <= 16 positions x 128 features, gamma_2048 = 2.3e-13 of
    # the terms' |sum| per layer. rtol 1e-9 leaves a factor > 1e3 for cancellation inside those sums; a kernel
    # or wiring defect changes the gradients at the 1e-2 level.
    for name in grads:
        atol = 1e-12 * grads_t[name].abs().max().item()
        torch.testing.assert_close(grads[name], grads_t[name], rtol=1e-9, atol=atol, msg=name)


def test_kernel_errors(monkeypatch):
    h, w, t = inputs(torch.float32)
    with pytest.raises(ValueError, match="unknown log-prob kernel 'cuda'"):
        chunked_logprobs(h, w, t, kernel="cuda")
    with pytest.raises(ValueError, match="unknown log-prob kernel"):
        TokenLogProbs(torch.nn.Module(), kernel="fused")
    monkeypatch.setitem(sys.modules, "common.triton_logprobs", None)  # as if triton were not installed
    with pytest.raises(ImportError, match="kernel='triton' needs the triton package"):
        chunked_logprobs(h, w, t, kernel="triton")


def test_auto_kernel_is_triton_where_it_can_run(monkeypatch):
    """--logprob-kernel auto (the scripts' default): triton for CUDA tensors in half precision or fp32 under a plain
    output layer with triton installed; torch otherwise, bit for bit the torch path on a CPU."""
    from common.logprobs import LogitTransform, resolve_kernel

    plain, capped = LogitTransform(), LogitTransform(softcap=30.0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_kernel("auto", SimpleNamespace(is_cuda=True, dtype=dtype), plain) == "triton"
    assert resolve_kernel("auto", SimpleNamespace(is_cuda=True, dtype=torch.float64), plain) == "torch"
    assert resolve_kernel("auto", SimpleNamespace(is_cuda=True, dtype=torch.bfloat16), capped) == "torch"
    assert resolve_kernel("auto", SimpleNamespace(is_cuda=False, dtype=torch.bfloat16), plain) == "torch"
    assert resolve_kernel("triton-fused", SimpleNamespace(is_cuda=False, dtype=torch.float64), capped) == "triton-fused"
    h, w, t = inputs(torch.float32, seed=8)
    if DEVICE == "cpu":
        for a, b in zip(chunked_logprobs(h, w, t, 0.7, kernel="auto"), chunked_logprobs(h, w, t, 0.7)):
            assert torch.equal(a, b)
    monkeypatch.setitem(sys.modules, "common.triton_logprobs", None)  # as if triton were not installed
    assert resolve_kernel("auto", SimpleNamespace(is_cuda=True, dtype=torch.bfloat16), plain) == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp64_on_cuda_is_refused():
    h, w, t = inputs(torch.float64)
    with pytest.raises(NotImplementedError, match="do not compile for fp64 on CUDA"):
        triton_logprobs.fused_logprobs_forward(h, w, t, 1.0)
    out = [torch.empty(N, dtype=torch.float64, device=DEVICE) for _ in range(4)]
    with pytest.raises(NotImplementedError, match="do not compile for fp64 on CUDA"):
        triton_logprobs.softmax_stats(h @ w.T, t, *out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@fp32_gemm_sums()  # the error bounds below assume fp32 sums
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
    # tests/fp_bounds.py: the kernel multiplies bf16 or fp32 inputs exactly into fp32 sums, in both dtypes; the
    # torch path stores bf16 logits (|z| up to ~10: u_bf16 |z| ~ 0.02 each) and bf16 d logits / gradients
    fused = logprob_error_bounds(h, w, t, 0.7, torch.float32, torch.ones(n))
    half = dtype if dtype == torch.bfloat16 else None
    torch_path = logprob_error_bounds(h, w, t, 0.7, torch.float32, torch.ones(n), rounded_to=half)
    for name, x, r in zip(("logps", "entropy", "lse"), got, ref):
        assert_within(x, r, 2 * fused[name], name)
    res = {}
    for kernel in (*TRITON_KERNELS, "torch"):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hk, wk, t, 0.7, chunk_size=256, kernel=kernel)
        res[kernel] = (lp, ent, *torch.autograd.grad(lp.sum(), (hk, wk)))
    for kernel in TRITON_KERNELS:
        for name, a, b in zip(("logps", "entropy", "grad_h", "grad_w"), res[kernel], res["torch"]):
            # forward: the fused kernel's own bound, or the torch path's (both read the logits in `dtype`);
            # backward: bf16 (or fp32) logits and gradients on every path
            own = fused if kernel == "triton-fused" else torch_path
            tol = own[name] + torch_path[name] if name in ("logps", "entropy") else 2 * torch_path[name]
            assert_within(a, b, tol, f"{kernel} {name}")
