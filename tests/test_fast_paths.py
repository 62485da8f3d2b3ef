"""The trainer's speed paths compute what the plain path computes: each weight cast to bf16 once per optimizer step
(`common.logprobs.weights_cast_once`, on a CPU under bf16 autocast), padding-free micro-batches
(`TokenLogProbs(padding_free=True)`, float64, ten families, sdpa and eager); the optional kernels (common/kernels.py)
refuse in one line where they cannot work. On CUDA (`gpu`): Liger's kernels and flash-attn's varlen attention."""

from __future__ import annotations

import contextlib
import sys
from types import MethodType, SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.batching import micro_batches
from common.kernels import compile_decoder_layers, padding_free_attention, use_liger_kernels
from common.logprobs import TokenLogProbs, weights_cast_once
from tests import test_families

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def tiny_qwen2(gradient_checkpointing: bool = False, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True)).to(dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def bf16_forward(policy: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    """`policy` with its forward under bf16 autocast and fp32 outputs, as accelerate's prepare_model wraps it with
    mixed_precision="bf16" (accelerate/accelerator.py: autocast_context(forward), then convert_outputs_to_fp32)."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast(device, dtype=torch.bfloat16)(type(policy).forward)
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


def toy_micro_batches(k: int = 3):
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
    device = next(policy.parameters()).device
    with counter, weights_cast_once() if cast_once else contextlib.nullcontext():
        for ids, attn, w in batches:
            ids, attn, w = ids.to(device), attn.to(device), w.to(device)
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
    batches = toy_micro_batches(3)
    plain, plain_casts = accumulate(policy, batches, cast_once=False)
    once, once_casts = accumulate(policy, batches, cast_once=True)
    assert plain_casts.keys() == once_casts.keys() and "lm.model.embed_tokens.weight" in once_casts
    decoder = 6 if gradient_checkpointing else 3
    assert all(n == (3 if "embed_tokens" in name else decoder) for name, n in plain_casts.items()), plain_casts
    assert set(once_casts.values()) == {1}, once_casts
    for name in plain:
        assert torch.equal(plain[name], once[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_each_weight_is_cast_once_per_step_on_cuda(gradient_checkpointing):
    """On CUDA the backward runs on autograd's device thread: without gradient checkpointing each weight is still cast
    once per step; with it, each recomputed layer's autocast block clears torch's cache when it exits on that thread,
    so the decoder's casts are at most as many as without the block. The gradient is bit for bit the same."""
    policy = bf16_forward(TokenLogProbs(tiny_qwen2(gradient_checkpointing).cuda(), chunk_size=4), "cuda")
    batches = toy_micro_batches(3)
    plain, plain_casts = accumulate(policy, batches, cast_once=False)
    once, once_casts = accumulate(policy, batches, cast_once=True)
    assert once_casts["lm.model.embed_tokens.weight"] == 1
    if gradient_checkpointing:
        assert all(once_casts[name] <= n for name, n in plain_casts.items())
    else:
        assert set(once_casts.values()) == {1}, once_casts
    for name in plain:
        assert torch.equal(plain[name], once[name]), name


def test_casts_do_not_outlive_the_block():
    """After the block an optimizer step changes the weights in place; the next block's forward must see the new
    weights, not a cast kept from before (torch's cache is cleared when the last nesting level closes)."""
    policy = bf16_forward(TokenLogProbs(tiny_qwen2(), chunk_size=4))
    batches = toy_micro_batches(2)
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
    batches = toy_micro_batches(2)
    plain, plain_casts = accumulate(policy, batches, cast_once=False)
    once, once_casts = accumulate(policy, batches, cast_once=True)
    assert plain_casts == once_casts == {}
    assert all(torch.equal(plain[n], once[n]) for n in plain)


FAMILIES = sorted(test_families.FAMILIES)


def packed_batch(vocab: int = 64):
    """4 rows: prompts of 1-4 tokens left-padded to 4, completions of 0-5 tokens right-padded to 5."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (4, 9), generator=g)
    attn = torch.zeros_like(ids)
    for row, (p, c) in enumerate([(4, 5), (1, 3), (3, 0), (2, 1)]):
        attn[row, 4 - p : 4 + c] = 1
    return ids * attn, attn


def log_probs_and_grads(model, ids, attn, start, upstream, padding_free=False):
    model.zero_grad(set_to_none=True)
    logps, entropy = TokenLogProbs(model, chunk_size=3, padding_free=padding_free)(ids, attn, start, 0.7)
    (logps * upstream).sum().backward()
    return logps, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_free_gives_the_padded_log_probs_and_gradient(family, attention):
    """In float64: the rows packed into one sequence (positions restarting per row, no mask: transformers builds a
    block-diagonal mask from the positions) give the log-probs, entropies and parameter gradients of each row run
    alone without padding, and with sdpa of the padded forward, on every completion token; 0 on padding. (Eager
    attention in float64 turns left-padded rows into NaN in transformers 5.19's padded forward: no padded reference.)
    Eager attention's softmax and Gemma's and Cohere's norms compute in fp32 whatever the model dtype: there they agree
    to fp32 rounding, 4e-5 of each tensor's largest value (gamma(600) in fp32: sums of at most 36 positions x 16
    features). A wrong packing (rows attending across each other, a position off by one) errs by 1e-2 or more."""
    model = test_families.tiny(family)
    model.set_attn_implementation(attention)
    fp32 = attention == "eager" or family in ("gemma2", "gemma3", "cohere")
    tol = dict(rtol=4e-5, atol=4e-5) if fp32 else dict(rtol=1e-10, atol=1e-12)
    ids, attn = packed_batch()
    mask = attn[:, 4:].bool()
    upstream = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * mask
    lp, ent, grads = log_probs_and_grads(model, ids, attn, 4, upstream, padding_free=True)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    alone = {n: torch.zeros_like(g) for n, g in grads.items()}
    for row in range(ids.shape[0]):
        keep, start = attn[row].bool(), int(attn[row, :4].sum())
        lp_row, ent_row, grads_row = log_probs_and_grads(
            model, ids[row, keep][None], torch.ones_like(ids[row, keep])[None], start, upstream[row, mask[row]][None]
        )
        torch.testing.assert_close(lp[row, mask[row]], lp_row[0], **tol)
        torch.testing.assert_close(ent[row, mask[row]], ent_row[0], **tol)
        for name, g in grads_row.items():
            alone[name] += g
    references = [alone]
    if attention == "sdpa":
        padded_lp, padded_ent, padded = log_probs_and_grads(model, ids, attn, 4, upstream)
        torch.testing.assert_close(lp[mask], padded_lp[mask], **tol)
        torch.testing.assert_close(ent[mask], padded_ent[mask], **tol)
        references.append(padded)
    for reference in references:
        for name in grads:
            scale = reference[name].abs().max().item()
            rtol, atol = (4e-5, 4e-5 * scale) if fp32 else (1e-9, 1e-12 * scale)
            torch.testing.assert_close(grads[name], reference[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_critic_padding_free_gives_the_padded_values_and_gradient(family):
    """The critic (common.critic.TokenValues) with padding_free, in float64 with sdpa: the padded forward's values on
    every completion token, 0 on padding, and the same parameter gradient (a random head, so the decoder's gradient
    is not 0). A wrong packing errs by 1e-2 or more."""
    from common.critic import TokenValues

    model = test_families.tiny(family)
    model.set_attn_implementation("sdpa")
    padded, packed = (TokenValues(model.get_decoder(), SMALL["hidden_size"], padding_free=pf) for pf in (False, True))
    packed.value_head = padded.value_head
    torch.nn.init.normal_(padded.value_head.weight, std=0.3, generator=torch.Generator().manual_seed(5))
    ids, attn = packed_batch()
    mask = attn[:, 4:].bool()
    upstream = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * mask
    results = []
    for critic in (padded, packed):
        critic.zero_grad(set_to_none=True)
        values = critic(ids, attn, 4)
        (values * upstream).sum().backward()
        results.append((values, {n: p.grad.clone() for n, p in critic.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert got.dtype == torch.float64 and (got[~mask] == 0).all()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-12)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-12 * g.abs().max().item(), msg=name)


def test_the_critic_takes_the_policys_speed_flags(toy_assets):
    """build_critic applies --padding-free, --liger-kernel and --torch-compile as load_model does for the policy
    (common.models.speed_paths): the critic packs its micro-batches, and Liger refuses on a CPU in the same line."""
    import ppo
    from common.critic import build_critic

    args = ppo.Args(group_size=4, padding_free=True)
    assert build_critic(toy_assets["model"], args).padding_free
    assert not build_critic(toy_assets["model"], ppo.Args(group_size=4)).padding_free
    with pytest.raises(SystemExit, match="--liger-kernel needs a CUDA GPU"):
        build_critic(toy_assets["model"], ppo.Args(group_size=4, liger_kernel=True))


def test_padding_free_micro_batches_count_tokens_without_padding():
    """With padding_free the token budget counts each row's own tokens: every row once, longest completion first,
    within the budget and the row cap (a row over the budget alone), fewer micro-batches than padded for the same
    budget on long-tailed lengths."""
    g = torch.Generator().manual_seed(0)
    lens = [
        (int(p), int(c))
        for p, c in zip(torch.randint(1, 40, (200,), generator=g), torch.randint(1, 300, (200,), generator=g))
    ]
    rows = torch.randperm(200, generator=g).tolist()[:150]
    for tokens, cap in [(1000, 256), (1000, 3), (200, 256)]:
        budget = SimpleNamespace(micro_batch_size=cap, micro_batch_tokens=tokens, padding_free=False)
        padded = micro_batches(rows, lens, budget)
        args = SimpleNamespace(micro_batch_size=cap, micro_batch_tokens=tokens, padding_free=True)
        plan = micro_batches(rows, lens, args)
        assert sorted(r for group, _, _ in plan for r in group) == sorted(rows)
        for group, _, _ in plan:
            assert len(group) <= cap and (len(group) == 1 or sum(sum(lens[r]) for r in group) <= tokens)
        firsts = [lens[group[0]][1] for group, _, _ in plan]
        assert firsts == sorted(firsts, reverse=True)
        assert len(plan) <= len(padded) and (cap == 3 or len(plan) < len(padded))


def test_the_speed_flags_refuse_in_one_line_where_they_cannot_work(monkeypatch):
    model = tiny_qwen2()
    with pytest.raises(SystemExit, match="--liger-kernel needs a CUDA GPU"):
        use_liger_kernels(model, "cpu")
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # as if not installed
    with pytest.raises(SystemExit, match="--liger-kernel needs liger-kernel: pip install liger-kernel"):
        use_liger_kernels(model, "cuda")
    assert padding_free_attention(model, "cpu") == "sdpa"  # with the block-diagonal mask: nothing to change
    with pytest.raises(SystemExit, match="--torch-compile: .* has no decoder `layers`"):
        compile_decoder_layers(SimpleNamespace(get_decoder=lambda: torch.nn.Linear(2, 2), __class__=object))


def test_padding_free_on_cuda_without_flash_attn_runs_padded_after_one_warning_line(monkeypatch, capsys):
    """On CUDA without flash-attn, --padding-free keeps the model's attention and says so in one line, once per
    process (not per model: the reference model is set up too); the policy's forward then runs the padded path, the
    same log-probs bit for bit (the device check of `packs` answered as on CUDA). With a varlen attention it packs."""
    import common.kernels
    import common.logprobs

    model = tiny_qwen2()
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed
    monkeypatch.setattr(common.kernels, "_warned", False)
    assert padding_free_attention(model, "cuda") == "sdpa"
    assert padding_free_attention(tiny_qwen2(), "cuda") == "sdpa"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --padding-free") and "pip install flash-attn" in err[0]
    assert common.kernels.packs(model, "cpu") and not common.kernels.packs(model, "cuda")
    varlen = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert common.kernels.packs(varlen, "cuda")

    monkeypatch.setattr(common.logprobs, "packs", lambda lm, device: common.kernels.packs(lm, "cuda"))
    packed_calls = []
    original = TokenLogProbs._packed
    monkeypatch.setattr(TokenLogProbs, "_packed", lambda self, *a: packed_calls.append(1) or original(self, *a))
    ids, attn = packed_batch()
    got = TokenLogProbs(model, chunk_size=3, padding_free=True)(ids, attn, 4, 0.7)
    want = TokenLogProbs(model, chunk_size=3)(ids, attn, 4, 0.7)
    assert not packed_calls and all(torch.equal(g, w) for g, w in zip(got, want))
    monkeypatch.setattr(common.logprobs, "packs", lambda lm, device: True)  # a varlen attention: packed
    TokenLogProbs(model, chunk_size=3, padding_free=True)(ids, attn, 4, 0.7)
    assert packed_calls


def cuda_step(model, padding_free=False, autocast=True):
    """(log-probs, parameter gradients) of one micro-batch of the toy layout on CUDA under bf16 autocast (or fp32)."""
    ids, attn = (t.cuda() for t in packed_batch())
    mask = attn[:, 4:].bool()
    upstream = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)).cuda() * mask
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logps, _ = TokenLogProbs(model, chunk_size=3, padding_free=padding_free)(ids, attn, 4, 0.7)
    (logps * upstream).sum().backward()
    return logps[mask], {n: p.grad.float() for n, p in model.named_parameters()}


def assert_bf16_close(got, want, name):
    """Two bf16-autocast computations of a 2-layer model that round differently: each entry within 2^-6 (a few bf16
    roundings of 2^-9, through 2 layers) of the tensor's largest value."""
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * want.abs().max().item(), msg=name)


def assert_as_close_as_bf16(got, own, exact, name):
    """`got` (a fast path under bf16 autocast) is at most 4x as far from `exact` (the model's fp32 result) as `own`
    (the model's own bf16 path) is, plus 2^-8 of exact's largest entry: each tensor's tolerance is its own bf16
    rounding, however large cancellation makes it (a key bias's gradient sums terms of both signs over positions:
    2^-6 of its largest entry was too tight for qwen2's on an H200, for Liger and the model alike)."""
    err, own_err = (got - exact).abs().max().item(), (own - exact).abs().max().item()
    floor = 2**-8 * exact.abs().max().item()
    assert err <= 4 * own_err + floor, f"{name}: {err:.3g} from fp32; the model's bf16 {own_err:.3g}, floor {floor:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_liger_kernels_on_cuda_give_the_same_log_probs_and_gradient(family):
    """Liger's RMSNorm, SwiGLU and RoPE in place of the model's own, under bf16 autocast as the scripts train: as close
    to the fp32 result as the model's own bf16 computation, tensor by tensor."""
    pytest.importorskip("liger_kernel")
    model = test_families.tiny(family).float().cuda().train()
    exact_lp, exact = cuda_step(model, autocast=False)
    own_lp, own = cuda_step(model)
    module = vars(sys.modules[type(model).__module__])  # Liger swaps RoPE, norm and MLP classes in it: restored after
    saved = dict(module)
    try:
        use_liger_kernels(model, "cuda")
        got_lp, got = cuda_step(model)
    finally:
        module.update(saved)
    assert_as_close_as_bf16(got_lp, own_lp, exact_lp, "logps")
    for name in exact:
        assert_as_close_as_bf16(got[name], own[name], exact[name], name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_critic_with_liger_and_padding_free_on_cuda_is_as_close_to_fp32_as_bf16():
    """The critic's speed paths on CUDA (what build_critic applies with --liger-kernel --padding-free: Liger's kernels,
    flash-attn's varlen attention where installed, else padded), under bf16 autocast: its values and gradients as close
    to the fp32 result as the model's own bf16 computation, tensor by tensor."""
    pytest.importorskip("liger_kernel")
    from common.critic import TokenValues

    model = test_families.tiny("qwen2").float().cuda().train()
    ids, attn = (t.cuda() for t in packed_batch())
    mask = attn[:, 4:].bool()
    upstream = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)).cuda() * mask
    head = torch.randn(1, SMALL["hidden_size"], generator=torch.Generator().manual_seed(5)).cuda() * 0.3

    def step(padding_free=False, autocast=True):
        critic = TokenValues(model.get_decoder(), SMALL["hidden_size"], padding_free=padding_free).cuda()
        with torch.no_grad():
            critic.value_head.weight.copy_(head)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            values = critic(ids, attn, 4)
        (values * upstream).sum().backward()
        return values[mask], {n: p.grad.float() for n, p in critic.named_parameters()}

    exact_v, exact = step(autocast=False)
    own_v, own = step()
    module = vars(sys.modules[type(model).__module__])  # Liger swaps classes in it: restored after
    saved = dict(module)
    try:
        use_liger_kernels(model, "cuda")
        padding_free_attention(model, "cuda")
        got_v, got = step(padding_free=True)
    finally:
        module.update(saved)
    assert_as_close_as_bf16(got_v, own_v, exact_v, "values")
    for name in exact:
        assert_as_close_as_bf16(got[name], own[name], exact[name], name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["flash_attention_2", "flex_attention", "sdpa"])
def test_padding_free_with_a_varlen_attention_on_cuda_gives_the_padded_result(attention, monkeypatch):
    """flash-attn's varlen kernel (padding_free_attention), or torch's flex attention set by hand, on the packed rows
    against sdpa on the padded batch; without flash-attn (sdpa) the padded path itself."""
    import common.kernels

    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    model = test_families.tiny("qwen2").float().cuda().train()
    want_lp, want = cuda_step(model)
    padding_free_attention(model, "cuda")
    if attention == "flex_attention":
        model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation == attention
    assert common.kernels.packs(model, "cuda") == (attention != "sdpa")
    got_lp, got = cuda_step(model, padding_free=True)
    assert_bf16_close(got_lp, want_lp, "logps")
    for name in want:
        assert_bf16_close(got[name], want[name], name)


def test_padding_free_flag_runs_a_script_with_the_same_updates(toy_assets, tmp_path, monkeypatch):
    """`--padding-free` reaches the policy and the micro-batch plan (common/models.py): grpo.py with and without it logs
    the same losses, gradient norms and log-probs to rounding (fp32, sdpa's packed-sequence mask on a CPU)."""
    import json
    import os

    import tyro

    import grpo
    from tests.test_scripts import toy_flags

    def run(*extra):
        out = str(tmp_path / ("pf" if extra else "padded"))
        flags = toy_flags(toy_assets, out, 3, beta=0.04, **{"num-mini-batches": 2, "prompts-per-step": 16})
        grpo.main(tyro.cli(grpo.Args, args=[*flags, *extra]))
        (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
        with open(os.path.join(run_dir, "args.json")) as f:
            assert json.load(f)["padding_free"] == bool(extra)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    packed_calls = []
    original = TokenLogProbs._packed
    monkeypatch.setattr(TokenLogProbs, "_packed", lambda self, *a: packed_calls.append(1) or original(self, *a))
    padded = run()
    assert not packed_calls
    packed = run("--padding-free")
    assert packed_calls  # the policy and the reference took the packed path
    keys = ("train/loss", "train/grad_norm", "train/kl_ref", "train/approx_kl", "train/entropy", "train/accuracy")
    assert [a["train/accuracy"] for a in padded] == [b["train/accuracy"] for b in packed]
    steps = [(a, b) for a, b in zip(padded, packed) if "train/loss" in a]  # not the steps without signal
    assert steps
    for a, b in steps:
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4, abs=1e-6)
    assert max(m.get("train/approx_kl", 0) for m in padded) > 0  # second mini-batches: the policy had moved


def test_padding_free_without_flash_attn_on_cuda_is_resolved_to_padded(monkeypatch):
    """start() resolves --padding-free like the other modes: on CUDA without flash-attn it is off (args.json records
    what was asked), so the micro-batch plan counts the padding the micro-batches will hold; with flash-attn, or on a
    CPU, it stays on."""
    import importlib.util

    import grpo
    from common import kernels
    from common.setup import resolve_modes

    asked = grpo.Args(padding_free=True, sampler="hf", mixed_precision="no")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    got = resolve_modes(asked)
    assert not got.padding_free and got.requested["padding_free"] is True
    assert not kernels.packed_attention_available()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert resolve_modes(asked).padding_free
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_modes(asked).padding_free and "padding_free" not in resolve_modes(asked).requested
