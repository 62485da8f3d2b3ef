"""The trainer's speed paths compute what the plain path computes: each weight cast to bf16 once per optimizer step
(`common.logprobs.weights_cast_once`), on a CPU under bf16 autocast."""

from __future__ import annotations

import contextlib
from types import MethodType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.logprobs import TokenLogProbs, weights_cast_once

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def tiny_qwen2(gradient_checkpointing: bool = False, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True)).to(dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def bf16_forward(policy: torch.nn.Module) -> torch.nn.Module:
    """`policy` with its forward under CPU bf16 autocast and fp32 outputs, as accelerate's prepare_model wraps it with
    mixed_precision="bf16" (accelerate/accelerator.py: autocast_context(forward), then convert_outputs_to_fp32)."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast("cpu", dtype=torch.bfloat16)(type(policy).forward)
    policy.forward = MethodType(convert_outputs_to_fp32(forward), policy)
    return policy


class CastCounter(TorchDispatchMode):
    """How many times each of `params` is cast to bf16 while active, by parameter name."""

    def __init__(self, named_params):
        super().__init__()
        self.names = {p.data_ptr(): n for n, p in named_params}
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.names.get(args[0].data_ptr())
            if name is not None and args[0].dtype == torch.float32:
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **kwargs)


def micro_batches(k: int = 3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2 * k, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = attn[3, :1] = 0  # left padding
    weights = torch.rand(2 * k, 5, generator=g)
    return [(ids[i : i + 2], attn[i : i + 2], weights[i : i + 2]) for i in range(0, 2 * k, 2)]


def accumulate(policy, batches, cast_once: bool):
    """One optimizer step's gradient accumulated over `batches`, as update_policy's micro-batch loop does, with or
    without weights_cast_once around the loop; returns (grads by name, bf16 casts by name)."""
    policy.zero_grad(set_to_none=True)
    counter = CastCounter(policy.named_parameters())
    with counter, weights_cast_once() if cast_once else contextlib.nullcontext():
        for ids, attn, w in batches:
            logps, _ = policy(ids, attn, 4, 0.7)
            (logps * w).sum().backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}, counter.counts


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_each_weight_is_cast_once_per_step_with_the_same_gradient(gradient_checkpointing):
    """Under accelerate's bf16 autocast wrapper, 3 micro-batches cast every weight 3 times (and 6 with gradient
    checkpointing, whose backward recomputes each layer's forward); inside weights_cast_once each is cast once, the
    output layer (tied to the embedding) included, and the gradient is bit for bit the same. (On a CPU the backward
    runs on this thread; on CUDA a checkpointed layer's recompute runs on autograd's device thread, whose own autocast
    block clears torch's cache when it exits: the casts are then as without the block, the gradient still the same.)"""
    policy = bf16_forward(TokenLogProbs(tiny_qwen2(gradient_checkpointing), chunk_size=4))
    batches = micro_batches(3)
    plain, plain_casts = accumulate(policy, batches, cast_once=False)
    once, once_casts = accumulate(policy, batches, cast_once=True)
    assert plain_casts.keys() == once_casts.keys() and "lm.model.embed_tokens.weight" in once_casts
    decoder = 6 if gradient_checkpointing else 3
    assert all(n == (3 if "embed_tokens" in name else decoder) for name, n in plain_casts.items()), plain_casts
    assert set(once_casts.values()) == {1}, once_casts
    for name in plain:
        assert torch.equal(plain[name], once[name]), name


def test_casts_do_not_outlive_the_block():
    """After the block an optimizer step changes the weights in place; the next block's forward must see the new
    weights, not a cast kept from before (torch's cache is cleared when the last nesting level closes)."""
    policy = bf16_forward(TokenLogProbs(tiny_qwen2(), chunk_size=4))
    batches = micro_batches(2)
    accumulate(policy, batches, cast_once=True)
    torch.optim.SGD(policy.parameters(), lr=0.5).step()
    ids, attn, _ = batches[0]
    with weights_cast_once():
        after, _ = policy(ids, attn, 4, 0.7)
    fresh = bf16_forward(TokenLogProbs(tiny_qwen2(), chunk_size=4))  # other tensors: nothing cached for them
    fresh.load_state_dict(policy.state_dict())
    assert torch.equal(after, fresh(ids, attn, 4, 0.7)[0])


def test_without_autocast_nothing_is_cast_and_fp32_is_unchanged():
    policy = TokenLogProbs(tiny_qwen2(), chunk_size=4)
    batches = micro_batches(2)
    plain, plain_casts = accumulate(policy, batches, cast_once=False)
    once, once_casts = accumulate(policy, batches, cast_once=True)
    assert plain_casts == once_casts == {}
    assert all(torch.equal(plain[n], once[n]) for n in plain)
