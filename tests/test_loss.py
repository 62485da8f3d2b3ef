"""common/loss.py: chunked log-probs against full log-softmax, aggregation against loops, and the global
normaliser across micro-batches."""

from __future__ import annotations

import pytest
import torch

from common.loss import TokenLogProbs, chunked_logprobs, grad_normalizers, masked_aggregate
from tests.fp_bounds import assert_within, logprob_error_bounds
from tests.reference import aggregate


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


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_aggregate_matches_loops(mode):
    values, mask = random_batch(3)
    got = masked_aggregate(values, mask, mode, max_len=5)
    assert abs(got.item() - aggregate(values.tolist(), mask.tolist(), mode, max_len=5)) < 1e-12


def test_modes_differ_on_unequal_lengths():
    """The test batches above would not tell the modes apart if all lengths were equal."""
    values, mask = random_batch(3)
    a = masked_aggregate(values, mask, "token-mean")
    b = masked_aggregate(values, mask, "seq-mean-token-mean")
    assert abs(a - b) > 1e-3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_normaliser_give_the_whole_batch_gradient(mode):
    values, mask = random_batch(4, b=8, t=6)
    values.requires_grad_(True)
    (whole,) = torch.autograd.grad(masked_aggregate(values, mask, mode, max_len=6), values)
    chunks = [slice(0, 3), slice(3, 5), slice(5, 8)]
    num_tokens, num_seqs = grad_normalizers([mask[c] for c in chunks])
    assert num_tokens.item() == mask.sum().item() and num_seqs.item() == 8
    total = sum(
        masked_aggregate(values[c], mask[c], mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=6) for c in chunks
    )
    (split,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    # ...while normalising each micro-batch by its own counts is a different (wrong) gradient
    local = sum(masked_aggregate(values[c], mask[c], mode, max_len=6) for c in chunks) / len(chunks)
    (wrong,) = torch.autograd.grad(local, values)
    assert (wrong - whole).abs().max() > 1e-4


def test_masked_aggregate_errors():
    values, mask = random_batch(0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        masked_aggregate(values, mask, "bogus")
    with pytest.raises(ValueError, match="max_len"):
        masked_aggregate(values, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="normaliser"):
        masked_aggregate(values, mask, "sum")
