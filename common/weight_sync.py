"""Weight sync from the trainer to a sampler: the policy's weights as Hugging Face checkpoint tensors, whatever wraps
or shards them (pure torch, CPU-testable). The vLLM backends (common/vllm_sampler.py, common/vllm_server.py) stream
`iter_weight_buckets` into their engines; checkpoints save LoRA's merged weights with it (common/run.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

# Attribute names that training wrappers insert into parameter names: DDP / DeepSpeed (`module.`),
# torch.compile (`_orig_mod.`), FSDP1 (`_fsdp_wrapped_module.`), activation checkpointing.
WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _wrapper_chain(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then each module it wraps: DDP / DataParallel / DeepSpeedEngine / FSDP1 (`.module`) and
    torch.compile's OptimizedModule (`._orig_mod`), down to the first module that wraps none."""
    while True:
        yield model
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strips training wrappers (`_wrapper_chain`), repeatedly. FSDP2 (`fully_shard`) changes the module in place
    and needs no unwrapping."""
    return list(_wrapper_chain(model))[-1]


def _clean_name(name: str) -> str:
    """HF checkpoint name of a parameter reached through wrappers (see WRAPPER_PREFIXES)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _named_checkpoint_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) in `module.state_dict()` order, parameters and persistent buffers, without the aliases
    of tied weights: a tensor object reached under two names (e.g. `lm_head.weight` tied to
    `model.embed_tokens.weight`) is yielded once, under its first name, which is the one `save_pretrained`
    keeps. The tensors are the live ones (Parameters, possibly sharded), not copies."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        own = list(mod._parameters.items())
        own += [(k, b) for k, b in mod._buffers.items() if k not in mod._non_persistent_buffers_set]
        for name, t in own:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield _clean_name(prefix + name), t


def _lora_merged_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """A peft LoRA model's weights as the base model's checkpoint has them, merged: W + (alpha / r) B A for every
    adapted layer (peft's `get_delta_weight`, computed apart: the base weights are never merged in place and
    unmerged, so they cannot drift), under the base names (`base_model.model.` and `.base_layer` stripped, the
    adapters' own tensors left out). Single process or DDP only (common/setup.py refuses LoRA under FSDP / ZeRO-3)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and mod.active_adapters:
            with torch.no_grad():
                delta = sum(mod.get_delta_weight(a) for a in mod.active_adapters if a in mod.lora_A)
            deltas[_clean_name(name) + ".base_layer.weight"] = delta
    for name, t in _named_checkpoint_tensors(model):
        if ".lora_" in name:
            continue
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        yield base, (t.detach() + deltas[name].to(t.dtype) if name in deltas else t)


def _is_zero3(t: Tensor) -> bool:
    return hasattr(t, "ds_id")  # DeepSpeed ZeRO-3 partitioned parameter


def _full_nbytes(t: Tensor) -> int:
    """Bytes of the full (unsharded) tensor."""
    numel = t.ds_numel if _is_zero3(t) else t.numel()  # DTensor.numel() is the global numel
    return int(numel) * t.element_size()


def _materialize(t: Tensor, copy: bool = False) -> Tensor:
    """The full tensor behind a (possibly sharded) parameter, detached. Call inside the gather context.

    ZeRO-3 and FSDP1 free the gathered storage when their context exits, while the consumer may hold on to
    the tensor a little longer (vLLM buffers a layer until all of its weights arrived), so those are copied
    (`copy=True` for FSDP1)."""
    if _is_zero3(t):
        return t.data.detach().clone()
    t = t.detach()
    if copy:
        return t.clone()
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        DTensor = ()  # type: ignore[assignment]
    if isinstance(t, DTensor):
        if t.device.type == "cpu" and torch.cuda.is_available():  # CPU-offloaded FSDP2 shards, NCCL gathers
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        t = t.full_tensor()
    return t


def _fsdp1_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP1 (FullyShardedDataParallel) wrapper on the path `unwrap_model` walks, if any."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return None
    return next((m for m in _wrapper_chain(model) if isinstance(m, FSDP)), None)


def iter_weight_buckets(model: nn.Module, bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, Tensor]]]:
    """Yields the policy's weights as lists of (checkpoint name, full tensor), about `bucket_bytes` each, in
    `state_dict` order (each layer's weights together, as vLLM's layerwise reload wants). Names are
    `save_pretrained`'s keys: no wrapper prefixes, no tied alias (vLLM 0.32's loader raises on an alias without its
    canonical name). Tensors are full whatever the sharding (FSDP2 `full_tensor()`, ZeRO-3 and FSDP1 gathered, then
    copied because their storage is freed) and LoRA's are merged, W + (alpha / r) B A. The gathers are collective:
    every rank iterates in step."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    fsdp1 = _fsdp1_root(model)
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if fsdp1 is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        ctx = FSDP.summon_full_params(fsdp1, writeback=False, recurse=True)
    with ctx:
        base = unwrap_model(model)
        # LoRA (a peft model, or a module holding its layers, as the critic's decoder): the merged weights
        peft = hasattr(base, "peft_config") or any(hasattr(m, "lora_A") for m in base.modules())
        items = list((_lora_merged_tensors if peft else _named_checkpoint_tensors)(base))
        buckets: list[list[tuple[str, Tensor]]] = []
        size = 0
        for name, t in items:
            nbytes = _full_nbytes(t)
            if not buckets or (size + nbytes > bucket_bytes and buckets[-1]):
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += nbytes
        for bucket in buckets:
            zero3 = [t for _, t in bucket if _is_zero3(t)]
            gather: contextlib.AbstractContextManager = contextlib.nullcontext()
            if zero3:
                import deepspeed  # only reachable when the parameters are ZeRO-3 partitioned

                gather = deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)
            with gather, torch.no_grad():
                yield [(name, _materialize(t, copy=fsdp1 is not None)) for name, t in bucket]
