"""common/logprobs.py and common/batching.py: chunked log-probs against full log-softmax, and the global normalisers
across micro-batches."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.batching import grad_normalizers
from common.logprobs import TokenLogProbs, chunked_logprobs
from tests.checks import assert_micro_batches_add_up
from tests.fp_bounds import assert_within, fp32_gemm_sums, logprob_error_bounds


def naive(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprobs_match_full_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (3, 7), generator=g)
    lp, ent = chunked_logprobs(h, w, t, temperature, chunk)
    ref_lp, ref_ent = naive(h, w, t, temperature)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-12)
    upstream = torch.randn(3, 7, dtype=torch.float64, generator=g)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref_lp * upstream).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=0, atol=1e-10)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-10)
    assert not ent.requires_grad


def test_chunked_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (4,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: chunked_logprobs(h, w, t, 0.7, 3)[0], (h, w))


def test_chunked_logprobs_fp32_accumulation_for_bf16():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 16, generator=g)
    w = torch.randn(50, 16, generator=g)
    t = torch.randint(0, 50, (6,), generator=g)
    lp, _ = chunked_logprobs(h.bfloat16(), w.bfloat16(), t)
    assert lp.dtype == torch.float32
    ref, _ = naive(h.bfloat16().double(), w.bfloat16().double(), t, 1.0)
    # the bf16 matmul rounds each logit to bf16 (u = 2^-9 of sum |h w|), the softmax runs in fp32 (tests/fp_bounds.py)
    bound = logprob_error_bounds(h.bfloat16(), w.bfloat16(), t, 1.0, torch.float32, rounded_to=torch.bfloat16)
    assert_within(lp, ref, 2 * bound["logps"], "logps")


def autocast_inputs(seed=3, n=37, hid=48, vocab=301):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, hid, generator=g), torch.randn(vocab, hid, generator=g) * 0.5
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t, torch.randn(n, generator=g)


def logprobs_and_grads(h, w, t, upstream, temperature=0.7, chunk=16, kernel="torch", autocast=None):
    """(logps, entropy, d hidden, d weight) of chunked_logprobs, under autocast to `autocast` if given."""
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ctx = torch.autocast(h.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        lp, ent = chunked_logprobs(h, w, t, temperature, chunk, kernel)
    return (lp, ent, *torch.autograd.grad((lp * upstream).sum(), (h, w)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_autocast_gradients_are_the_fp32_ones_within_bf16_rounding(device):
    """Under bf16 autocast (fp32 weights, as the scripts train on CUDA) the GEMMs of the forward and the backward run
    in bf16: log-probs, entropy and both gradients are within the bf16 path's rounding-error bound plus the fp32
    path's of the fp32 results, and within the former of the float64 ones (tests/fp_bounds.py: h and w rounded to
    bf16, logits, d logits and each chunk's products stored in bf16, fp32 sums); they come back in fp32."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, w, t, upstream = (x.to(device) for x in autocast_inputs())
    with fp32_gemm_sums():  # the bound assumes fp32 sums
        fp32 = logprobs_and_grads(h, w, t, upstream)
        bf16 = logprobs_and_grads(h, w, t, upstream, autocast=torch.bfloat16)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    lp, ent = naive(hr, wr, t, 0.7)
    exact = (lp, ent, *torch.autograd.grad((lp * upstream.double()).sum(), (hr, wr)))
    b32 = logprob_error_bounds(h, w, t, 0.7, torch.float32, upstream)
    b16 = logprob_error_bounds(h, w, t, 0.7, torch.float32, upstream, rounded_to=torch.bfloat16, autocast=True)
    used = {}
    for name, got, want, ref in zip(("logps", "entropy", "grad_h", "grad_w"), bf16, fp32, exact):
        assert got.dtype == torch.float32, name
        used[name] = assert_within(got, want, b16[name] + b32[name], name)
        assert_within(got, ref, b16[name], f"{name} against float64")
    assert max(used.values()) > 1e-3  # the bound is not vacuous: bf16 uses a visible part of it


class GemmDtypes(TorchDispatchMode):
    """The input dtypes of every matrix multiplication dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_every_gemm_runs_in_the_autocast_dtype(autocast):
    """Each chunk's h W^T in the forward, and its recomputed h W^T, d logits W and d logits^T h in the backward, take
    the autocast dtype (fp32 weights and hidden states under bf16 autocast); without autocast, the inputs' fp32."""
    h, w, t, upstream = autocast_inputs()
    with GemmDtypes() as gemms:
        logprobs_and_grads(h, w, t, upstream, chunk=16, autocast=autocast)
    chunks = -(-h.shape[0] // 16)
    want = autocast or torch.float32
    # addmm's first input is the fp32 sum it adds to (d weight accumulated over chunks)
    assert len(gemms.seen) == 4 * chunks and all(set(d[-2:]) == {want} for d in gemms.seen), gemms.seen


def test_token_logprobs_match_hf_logits_and_ignore_left_padding(toy_assets):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64)
    policy = TokenLogProbs(lm, chunk_size=2)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    lp, ent = policy(ids, attn, completion_start=4, temperature=0.8)
    for row, start in ((0, 2), (1, 0)):  # each row alone, unpadded, through the plain HF forward
        logits = lm(ids[row : row + 1, start:]).logits[0].double() / 0.8
        logp = torch.log_softmax(logits, -1)[4 - start - 1 : -1]
        ref = logp.gather(-1, ids[row, 4:, None]).squeeze(-1)
        torch.testing.assert_close(lp[row], ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(ent[row], -(logp.exp() * logp).sum(-1).detach(), rtol=0, atol=1e-10)


def random_batch(seed, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, dtype=torch.float64, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return values, mask


def test_grad_normalizers_are_the_whole_mini_batch_counts():
    _, mask = random_batch(4, b=8, t=6)
    num_tokens, num_seqs = grad_normalizers([mask[c] for c in (slice(0, 3), slice(3, 5), slice(5, 8))])
    assert num_tokens.item() == mask.sum().item() and num_seqs.item() == 8


@pytest.mark.parametrize("script", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_need_the_mini_batch_normalisers(script):
    """The three aggregations (GRPO's per-sequence token mean, DAPO's token mean, Dr. GRPO's constant): summed over
    micro-batches that get the mini-batch's normalisers, the loss has the whole mini-batch's gradient; normalising
    each micro-batch by its own counts instead re-weights the tokens (the per-micro-batch token-mean bug)."""
    mod = importlib.import_module(script)
    args = mod.Args(beta=0.0, max_new_tokens=6) if script == "grpo" else mod.Args(max_new_tokens=6)
    logps, mask = random_batch(4, b=8, t=6)
    old = logps + 0.1 * random_batch(5, b=8, t=6)[0]
    adv = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    chunks = [slice(0, 3), slice(3, 5), slice(5, 8)]
    loss, _ = assert_micro_batches_add_up(mod.compute_policy_loss, logps, old, adv, mask, args, chunks=chunks)
    logps.requires_grad_(True)
    (whole,) = torch.autograd.grad(mod.compute_policy_loss(logps, old, adv, mask, args)[0], logps)
    local = sum(mod.compute_policy_loss(logps[c], old[c], adv[c], mask[c], args)[0] for c in chunks) / len(chunks)
    (wrong,) = torch.autograd.grad(local, logps)
    assert (wrong - whole).abs().max() > 1e-4
    if script == "grpo":  # the batch tells the aggregations apart (unequal lengths)
        assert abs(loss - importlib.import_module("dapo").compute_policy_loss(logps, old, adv, mask, args)[0]) > 1e-3


def test_micro_batch_cuts_the_declared_per_token_fields_and_refuses_the_rest():
    """A batch declares its per-token fields (make_batch's `token_fields`): micro_batch cuts those to the micro-batch's
    completion width and every other tensor by row, whatever the shapes happen to be; a 2-D field not declared, or a
    declared one not [N, C], is an error rather than rows cut wrongly."""
    from common.batching import make_batch, micro_batch
    from common.sampling import Completion

    completions = [Completion(list(range(3, 3 + k)), "", False) for k in (4, 2, 3, 1)]
    batch = make_batch([[1, 2], [1]], completions, 0, "cpu", ["advantages"])
    n, c = batch["mask"].shape
    batch["advantages"] = torch.arange(n * c, dtype=torch.float64).view(n, c)  # per token: declared
    batch["bucket"] = torch.arange(n)  # per row
    mb = micro_batch(batch, [1, 3], batch["p_len"], 2)
    assert torch.equal(mb["advantages"], batch["advantages"][[1, 3], :2]) and torch.equal(
        mb["bucket"], torch.tensor([1, 3])
    )
    assert torch.equal(mb["mask"], batch["mask"][[1, 3], :2]) and mb["ids"].shape == (2, batch["p_len"] + 2)
    batch["returns"] = torch.zeros(n, c)  # per token, not declared
    with pytest.raises(ValueError, match="'returns'.*not declared per token"):
        micro_batch(batch, [0], batch["p_len"], 2)
    del batch["returns"]
    batch["advantages"] = torch.zeros(n)  # declared per token, given per row
    with pytest.raises(ValueError, match="'advantages'.*not \\[N, C\\]"):
        micro_batch(batch, [0], batch["p_len"], 2)
