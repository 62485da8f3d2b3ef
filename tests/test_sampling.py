"""common/sampling.py: the HF generate backend on the toy model, the weight buckets fed to vLLM (names,
shapes, sharded and wrapped models), backend selection, and (GPU + vLLM only) the weight-sync canary."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.sampling import (
    Completion,
    HFSampler,
    Sampler,
    VLLMSampler,
    iter_weight_buckets,
    make_sampler,
    unwrap_model,
    vllm_available,
)
from tests.checks import free_port
from tests.fp_bounds import assert_within, log_softmax_error_bounds, unit_roundoff

QUESTIONS = ["1+2=", "3+4=", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "0+0=", "4+1=4"]


@pytest.fixture(scope="module")
def tok(toy_assets):
    return AutoTokenizer.from_pretrained(toy_assets["model"])


@pytest.fixture()
def model(toy_assets, request):
    """fp32 unless a test asks for another dtype (FP64 below)."""
    return AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=getattr(request, "param", torch.float32))


# Tests that check log-probs use an fp64 model, so the sampler's batched, left-padded, KV-cached forward and the
# teacher-forced one agree to fp64 rounding and only the sampler's own fp32 log-softmax is left (_logp_bound).
FP64 = pytest.mark.parametrize("model", [torch.float64], indirect=True, ids=["fp64"])


@pytest.fixture()
def prompts(tok):
    ids = [tok(q)["input_ids"] for q in QUESTIONS]
    assert len({len(p) for p in ids}) > 2  # mixed lengths, so batches are left-padded
    return ids


@pytest.fixture()
def gloo_group():
    """A single-process gloo group, for DDP / FSDP2 wrappers; destroyed afterwards."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _teacher_forced_logps(
    model: nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log softmax(logits / T) of `completion` given `prompt`, one unpadded forward pass (float64, CPU)."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double().cpu()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def _logp_bound(model: nn.Module, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Rounding-error bound on the sampler's log-probs (tests/fp_bounds.py): it rounds the fp64 model's logits
    to fp32 and divides by T (2 u32 |z| each; the fp64 forwards differ by ~u64 |z|, 1e3 x that still
    negligible), then takes an fp32 log-softmax over the vocabulary."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        z = model(ids).logits[0, len(prompt) - 1 : -1].double().cpu() / temperature
    u32, u64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
    dz = (2 * u32 + 1e3 * u64) * z.abs()
    return log_softmax_error_bounds(z, torch.tensor(completion), dz, torch.float32)["logps"]


def _ref_and_bound(model: nn.Module, prompt: list[int], completion: list[int], temperature: float):
    ref = _teacher_forced_logps(model, prompt, completion, temperature)
    return ref, _logp_bound(model, prompt, completion, temperature)


def _assert_logps(c: Completion, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert_within(torch.tensor(c.logprobs, dtype=torch.float64), ref, bound, "logprobs")


def _eos_bias(model: nn.Module, eos_id: int, bias: float):
    """Adds `bias` to the EOS logit (a forward hook on lm_head), so the random toy model stops sometimes."""
    onehot = lambda v: torch.nn.functional.one_hot(torch.tensor(eos_id), v)
    return model.lm_head.register_forward_hook(lambda mod, inp, out: out + onehot(out.shape[-1]) * bias)


def _check_shape(completions: list[Completion], tok, max_new_tokens: int, eos_ids: list[int]) -> None:
    for c in completions:
        assert 1 <= len(c.token_ids) <= max_new_tokens
        eos_at = [i for i, t in enumerate(c.token_ids) if t in eos_ids]
        assert c.truncated == (not eos_at)
        if eos_at:  # stops at the first EOS, nothing (no padding) after it
            assert eos_at == [len(c.token_ids) - 1]
        else:
            assert len(c.token_ids) == max_new_tokens
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)


# ---------------------------------------------------------------------------------------------------------
# HF backend
# ---------------------------------------------------------------------------------------------------------


@FP64
def test_hf_greedy_groups_equal_single_prompt_generate(model, tok, prompts):
    """Temperature 0: n identical completions per prompt, groups contiguous, each equal to a plain greedy
    generate on the prompt alone (so left padding in mixed-length batches changes nothing)."""
    n, max_new = 3, 10
    sampler = HFSampler(model, tok, batch_size=2, seed=0)  # 5 prompts -> batches of 2, 2, 1
    out = sampler.generate(prompts, n, 0.0, 1.0, max_new)
    assert len(out) == len(prompts) * n
    model.eval()
    for i, p in enumerate(prompts):
        group = out[i * n : (i + 1) * n]
        assert all(c.token_ids == group[0].token_ids for c in group)
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        assert group[0].token_ids == ref
        # greedy log-probs are log_softmax(logits), and batch position / padding does not change them
        _assert_logps(group[0], *_ref_and_bound(model, p, ref, 1.0))
    _check_shape(out, tok, max_new, sampler.eos_token_ids)


def test_hf_eos_truncation_padding_and_text(model, tok, prompts):
    """With EOS made likely, completions end at different lengths within one padded batch: EOS is kept and
    is the last token, nothing after it, `truncated` exactly when there is no EOS, text = decode(ids)."""
    _eos_bias(model, tok.eos_token_id, 5.0)
    max_new = 4
    out = HFSampler(model, tok, batch_size=8, seed=1).generate(prompts, 6, 1.0, 1.0, max_new)
    assert len(out) == len(prompts) * 6
    _check_shape(out, tok, max_new, [tok.eos_token_id])
    assert any(c.truncated for c in out) and any(not c.truncated for c in out)
    assert len({len(c.token_ids) for c in out}) > 2
    assert all(c.text == "" for c in out if c.token_ids == [tok.eos_token_id])  # special tokens skipped


@pytest.mark.parametrize("temperature", [0.7, 1.3])
@FP64
def test_hf_logprobs_are_processed_logprobs(model, tok, prompts, temperature):
    """The returned log-probs are log softmax(logits / T) of the sampled tokens (top_p=1), position by
    position, even for prompts left-padded in a batch; with top_p < 1 they are renormalised over the
    nucleus, so never below the full-vocabulary value."""
    _eos_bias(model, tok.eos_token_id, 3.0)
    n = 2
    out = HFSampler(model, tok, batch_size=4, seed=2).generate(prompts, n, temperature, 1.0, 8)
    for i, c in enumerate(out):
        _assert_logps(c, *_ref_and_bound(model, prompts[i // n], c.token_ids, temperature))
    out = HFSampler(model, tok, batch_size=4, seed=2).generate(prompts, n, temperature, 0.5, 8)
    for i, c in enumerate(out):
        ref, bound = _ref_and_bound(model, prompts[i // n], c.token_ids, temperature)
        assert (torch.tensor(c.logprobs, dtype=torch.float64) >= ref - bound).all()
        assert (torch.tensor(c.logprobs, dtype=torch.float64) <= bound).all()  # <= 0 up to rounding


def test_hf_seeding_rng_and_train_mode(model, tok, prompts):
    """Same seed -> same samples; each call and each seed differ; the global RNG state is untouched; every
    submodule's train/eval mode is restored, and generation itself runs in eval mode."""
    model.train()
    model.model.layers[0].eval()  # mixed modes must survive too
    seen_training = []
    model.model.register_forward_pre_hook(lambda mod, args: seen_training.append(mod.training))

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = HFSampler(model, tok, seed=7)
    first = a.generate(prompts, 4, 1.0, 1.0, 8)
    second = a.generate(prompts, 4, 1.0, 1.0, 8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(4), expected)  # the caller's random stream continues as if nothing ran

    again = HFSampler(model, tok, seed=7).generate(prompts, 4, 1.0, 1.0, 8)
    other = HFSampler(model, tok, seed=8).generate(prompts, 4, 1.0, 1.0, 8)
    ids = lambda cs: [c.token_ids for c in cs]
    assert ids(first) == ids(again)
    assert ids(first) != ids(second)
    assert ids(first) != ids(other)
    assert seen_training and not any(seen_training)
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training


@FP64
def test_hf_ignores_checkpoint_sampling_defaults(model, tok, prompts):
    """Neither transformers' default top_k=50 nor a generation_config.json's top_k / repetition penalty
    may leak into RL sampling: sampled tokens come from the whole vocabulary (the near-uniform toy model
    puts most of them beyond rank 50), the log-probs equal log softmax(logits / T), and the model's config
    is left as it was."""
    model.generation_config.top_k = 3
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.do_sample = True
    out = HFSampler(model, tok, seed=3).generate(prompts[:2], 3, 1.0, 1.0, 6)
    ranks = []
    for i, c in enumerate(out):
        _assert_logps(c, *_ref_and_bound(model, prompts[i // 3], c.token_ids, 1.0))
        with torch.no_grad():
            logits = model(torch.tensor([prompts[i // 3] + c.token_ids])).logits[0, len(prompts[i // 3]) - 1 : -1]
        ranks += (logits > logits.gather(1, torch.tensor(c.token_ids)[:, None])).sum(1).tolist()
    assert max(ranks) >= 50
    assert model.generation_config.top_k == 3 and model.generation_config.repetition_penalty == 1.5


@FP64
def test_hf_generates_from_live_wrapped_model(model, tok, prompts, gloo_group):
    """The policy may be DDP-wrapped; update_weights is a no-op because generation reads the live weights."""
    ddp = nn.parallel.DistributedDataParallel(model)
    sampler = HFSampler(ddp, tok, seed=0)
    before = sampler.generate(prompts[:2], 1, 0.0, 1.0, 6)
    with torch.no_grad():
        model.model.norm.weight.mul_(-3.0)
    sampler.update_weights(ddp)
    after = sampler.generate(prompts[:2], 1, 0.0, 1.0, 6)
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
    for p, c in zip(prompts[:2], after):
        _assert_logps(c, *_ref_and_bound(model, p, c.token_ids, 1.0))


# ---------------------------------------------------------------------------------------------------------
# Weight buckets (what update_weights streams into vLLM)
# ---------------------------------------------------------------------------------------------------------


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _flatten(buckets) -> list[tuple[str, torch.Tensor]]:
    return [item for b in buckets for item in b]


def _assert_matches_checkpoint(items: list[tuple[str, torch.Tensor]], ckpt: dict[str, torch.Tensor]) -> None:
    names = [n for n, _ in items]
    assert len(names) == len(set(names))
    assert set(names) == set(ckpt)
    for n, t in items:
        assert type(t) is torch.Tensor and not t.requires_grad
        assert t.shape == ckpt[n].shape, n
        torch.testing.assert_close(t, ckpt[n], atol=0, rtol=0)


def test_buckets_match_hf_checkpoint(model, toy_assets):
    """Names, shapes and values = save_pretrained's safetensors; order = state_dict order; the tied
    lm_head.weight (an alias of embed_tokens) is not sent; tensors are the live parameters, not copies."""
    ckpt = _checkpoint(toy_assets["model"])
    items = _flatten(iter_weight_buckets(model, 1 << 30))
    _assert_matches_checkpoint(items, ckpt)
    sd_keys = list(model.state_dict())
    assert [n for n, _ in items] == [k for k in sd_keys if k != "lm_head.weight"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    assert all(t.data_ptr() == params[n].data_ptr() for n, t in items)


def test_buckets_untied_model_keeps_lm_head(toy_assets, tmp_path):
    config = AutoModelForCausalLM.from_pretrained(toy_assets["model"]).config
    config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(config)
    untied.save_pretrained(tmp_path)
    items = _flatten(iter_weight_buckets(untied))
    _assert_matches_checkpoint(items, _checkpoint(str(tmp_path)))
    assert [n for n, _ in items] == list(untied.state_dict())
    assert "lm_head.weight" in dict(items)


def test_bucket_sizes(model):
    items = _flatten(iter_weight_buckets(model))
    sizes = {n: t.numel() * t.element_size() for n, t in items}
    largest = max(sizes.values())
    for limit in (largest, largest + 1000, 3 * largest, 50_000):
        buckets = list(iter_weight_buckets(model, limit))
        assert [n for n, _ in _flatten(buckets)] == [n for n, _ in items]
        for b in buckets:
            total = sum(sizes[n] for n, _ in b)
            assert total <= limit or len(b) == 1
        for prev, nxt in zip(buckets, buckets[1:]):  # greedy packing: the next tensor did not fit
            assert sum(sizes[n] for n, _ in prev) + sizes[nxt[0][0]] > limit
    tiny = list(iter_weight_buckets(model, 1))  # every tensor is bigger than the bucket: one per bucket
    assert [len(b) for b in tiny] == [1] * len(items)
    assert len(list(iter_weight_buckets(model, 1 << 40))) == 1
    with pytest.raises(ValueError):
        next(iter_weight_buckets(model, 0))


def test_buckets_strip_wrappers(model, toy_assets, gloo_group):
    """DDP (`module.`), torch.compile (`_orig_mod.`) and a compiled model nested in a training wrapper give
    the same HF names."""
    ckpt = _checkpoint(toy_assets["model"])
    ddp = nn.parallel.DistributedDataParallel(model)
    assert next(iter(ddp.state_dict())).startswith("module.")
    _assert_matches_checkpoint(_flatten(iter_weight_buckets(ddp, 10_000)), ckpt)

    compiled = torch.compile(model)  # OptimizedModule; compiles lazily, nothing runs here
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    _assert_matches_checkpoint(_flatten(iter_weight_buckets(compiled)), ckpt)
    _assert_matches_checkpoint(_flatten(iter_weight_buckets(nn.parallel.DistributedDataParallel(compiled))), ckpt)

    class Policy(nn.Module):  # e.g. a log-prob head around the LM, with the LM compiled inside
        def __init__(self, lm):
            super().__init__()
            self.module = lm

    assert unwrap_model(Policy(compiled)) is model


def _sharded_worker(rank: int, world: int, port: int, model_dir: str) -> None:
    """One rank of a 2-process gloo group: shard the toy model with FSDP2, then FSDP1, check the buckets."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        ckpt = _checkpoint(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
        assert model.model.layers[0].mlp.up_proj.weight.to_local().shape[0] == 128 // world
        _assert_matches_checkpoint(_flatten(iter_weight_buckets(model, 20_000)), ckpt)

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        # the tensors are read after the generator is exhausted, i.e. after FSDP1 re-sharded (freed) its
        # gathered storage: this only works because those tensors are copies
        _assert_matches_checkpoint(_flatten(iter_weight_buckets(model, 20_000)), ckpt)
    finally:
        # as common/run.py:close_run: FSDP holds the group in reference cycles; freed at the interpreter's exit, a
        # gloo thread can abort the process ("terminate called without an active exception", seen once in a suite)
        model = None
        dist.destroy_process_group()
        gc.collect()


def test_buckets_gather_sharded_models(toy_assets):
    """Two ranks, really sharded (FSDP2 DTensors, FSDP1 flat parameters): every rank gets the full tensors
    under the checkpoint names."""
    torch.multiprocessing.spawn(_sharded_worker, args=(2, free_port(), toy_assets["model"]), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize(
    "prompts,n,max_new,match",
    [([[1]], 0, 4, "n and max_new_tokens"), ([[1]], 2, 0, "n and max_new_tokens"), ([[1], []], 2, 4, "empty prompt")],
)
def test_both_backends_refuse_bad_requests_before_generating(backend, prompts, n, max_new, match, model, tok):
    if backend == "hf":
        sampler = HFSampler(model, tok, seed=0)
    else:  # no engine: the check runs before the engine is touched
        sampler = object.__new__(VLLMSampler)
        sampler.llm = None
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, n, 1.0, 1.0, max_new)
    assert getattr(sampler, "calls", 0) == 0  # nothing was drawn


def test_make_sampler(model, tok, toy_assets):
    kw = {"model": model, "tokenizer": tok, "model_name_or_path": toy_assets["model"], "seed": 0}
    hf = make_sampler("hf", **kw, gpu_memory_utilization=0.5)  # vLLM-only kwargs are ignored by HF
    assert isinstance(hf, HFSampler) and isinstance(hf, Sampler)
    with pytest.raises(ValueError, match="--sampler"):
        make_sampler("bogus", **kw)
    if not torch.cuda.is_available():  # auto stays HF on a CPU, even with vLLM's CPU build installed
        assert isinstance(make_sampler("auto", **kw), HFSampler)


def test_vllm_missing_is_one_clear_error(monkeypatch, model, tok, toy_assets):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert not vllm_available()
    kw = {"model": model, "tokenizer": tok, "model_name_or_path": toy_assets["model"], "seed": 0}
    with pytest.raises(RuntimeError, match="--sampler vllm needs the vllm package"):
        make_sampler("vllm", **kw)
    assert isinstance(make_sampler("auto", **kw), HFSampler)


def test_import_and_auto_on_cpu_do_not_import_vllm():
    """Importing common.sampling, and resolving --sampler auto on a CPU, never imports vllm (a heavy import that
    an HF-sampled run does not need)."""
    code = (
        "import sys, torch, common.sampling as s; assert 'vllm' not in sys.modules; "
        "assert torch.cuda.is_available() or s.resolve_sampler('auto') == 'hf'; assert 'vllm' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)


# ---------------------------------------------------------------------------------------------------------
# vLLM (GPU only)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not vllm_available(), reason="needs CUDA and vllm")
def test_vllm_generate_and_weight_sync_canary(toy_assets, tok, prompts):
    """vLLM samples the toy checkpoint; after the trainer's weights change, update_weights makes vLLM's
    weights and log-probs follow them (reload_weights path, load_weights path, and after a level-2 sleep)."""
    model = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float32).cuda()
    sampler = VLLMSampler(
        toy_assets["model"],
        seed=0,
        gpu_memory_utilization=0.2,
        max_model_len=256,
        dtype="float16",
        enable_sleep_mode=True,
        sleep_level=2,
        enforce_eager=True,
    )
    out = sampler.generate(prompts, 3, 1.0, 1.0, 8)
    assert len(out) == len(prompts) * 3
    eos = [tok.eos_token_id]
    _check_shape(out, tok, 8, eos)
    greedy = sampler.generate(prompts, 2, 0.0, 1.0, 8)
    assert all(greedy[2 * i].token_ids == greedy[2 * i + 1].token_ids for i in range(len(prompts)))

    def trainer_logps(cs):
        return [_teacher_forced_logps(model, prompts[i], c.token_ids, 1.0).float() for i, c in enumerate(cs)]

    def mean_abs_diff(cs):
        return torch.cat([(torch.tensor(c.logprobs) - t).abs() for c, t in zip(cs, trainer_logps(cs))]).mean().item()

    def vllm_param(fn):
        return sampler.llm.apply_model(lambda m: fn(m).detach().float().cpu().clone())[0]

    assert mean_abs_diff(sampler.generate(prompts, 1, 1.0, 1.0, 8)) < 0.02

    cases = [("reload_weights", False), ("load_weights", False), ("reload_weights", True)]
    for step, (sync, sleep) in enumerate(cases):
        stale = sampler.generate(prompts, 1, 1.0, 1.0, 8)
        with torch.no_grad():
            g = torch.Generator(device="cuda").manual_seed(step)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.2)
        stale_diff = mean_abs_diff(stale)
        sampler.weight_sync = sync
        if sleep:
            sampler.sleep()
            with pytest.raises(RuntimeError, match="update_weights"):
                sampler.generate(prompts, 1, 1.0, 1.0, 8)
        sampler.update_weights(model)
        assert not sampler.is_sleeping()
        close = functools.partial(torch.testing.assert_close, atol=2e-3, rtol=2e-3)  # fp16 copies of fp32
        close(vllm_param(lambda m: m.model.norm.weight), model.model.norm.weight.float().cpu())
        attn = model.model.layers[1].self_attn  # vLLM fuses q, k, v into one qkv_proj
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float().cpu()
        close(vllm_param(lambda m: m.model.layers[1].self_attn.qkv_proj.weight), qkv)
        fresh_diff = mean_abs_diff(sampler.generate(prompts, 1, 1.0, 1.0, 8))
        assert fresh_diff < 0.05 and fresh_diff < 0.25 * stale_diff, (sync, sleep, fresh_diff, stale_diff)
