"""Optional speed-ups of the trainer's model, each off by default: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE,
torch.compile of the decoder layers, and a varlen attention for padding-free micro-batches
(`TokenLogProbs(padding_free=True)`; on CUDA without flash-attn they run padded: `packs`). Each changes how the model
computes, not what (tests/test_fast_paths.py); Liger and compile refuse in one line where they cannot work. Apply them
to the Hugging Face model before LoRA adapters and before `accelerator.prepare`.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from torch import nn


def use_liger_kernels(model: nn.Module, device: torch.device | str) -> None:
    """Liger-Kernel's RMSNorm, SwiGLU (GEGLU for Gemma) and RoPE kernels in `model`, in place; never its fused
    cross-entropy or logits path (common.logprobs computes the log-probs). Note: Liger swaps RoPE (and the norm and
    MLP classes of models built later) for the whole process, as its `apply_liger_kernel_to_*` functions do."""
    if torch.device(device).type != "cuda":
        raise SystemExit(f"--liger-kernel needs a CUDA GPU (Liger's kernels are Triton), not {device}: drop the flag")
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError:
        raise SystemExit("--liger-kernel needs liger-kernel: pip install liger-kernel==0.8.5") from None
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise SystemExit(f"--liger-kernel: liger-kernel has no kernels for {model_type!r} models: drop the flag")
    kernels = dict(rope=True, rms_norm=True, swiglu=True, geglu=True)  # each family's function takes the ones it has
    _apply_liger_kernel_to_instance(model, **kernels, cross_entropy=False, fused_linear_cross_entropy=False)


def compile_decoder_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer in place, with dynamic shapes (every micro-batch has its own width)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise SystemExit(f"--torch-compile: {type(model).__name__} has no decoder `layers` to compile: drop the flag")
    for layer in layers:
        layer.compile(dynamic=True)


# attention kernels that run packed rows without computing the blocks between them ("flex_attention" only when set by
# hand: padding_free_attention never picks it, see there)
PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
_warned = False


def packed_attention_available() -> bool:
    """Whether --padding-free can pack rows here: on a CPU always (the model's own attention with the block-diagonal
    mask), on CUDA when flash-attn is installed (`padding_free_attention`)."""
    return not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is not None


def padding_free_attention(model: nn.Module, device: torch.device | str) -> str:
    """Sets and returns the attention for padding-free micro-batches. On CUDA flash-attn's varlen kernel
    ("flash_attention_2") when flash-attn is installed; without it the model keeps its own attention and
    `TokenLogProbs` runs the micro-batches padded (`packs`), said in one line: sdpa on packed rows would compute every
    block of their [tokens x tokens] mask, and torch's flex attention, which skips them, was still compiling after
    65 s at bench_trainer.py's 1.5B shape. On a CPU the model's own (sdpa or eager with the block-diagonal mask: what
    the tests compare)."""
    global _warned
    if torch.device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401

            model.set_attn_implementation("flash_attention_2")
        except ImportError:
            if not _warned and os.environ.get("RANK", "0") == "0":
                print(
                    "warning: --padding-free on CUDA needs flash-attn (pip install flash-attn); without it the "
                    "micro-batches run padded",
                    file=sys.stderr,
                    flush=True,
                )
            _warned = True
    return model.config._attn_implementation


def packs(model: nn.Module, device: torch.device | str) -> bool:
    """Whether padding-free micro-batches of `model` run packed on `device`: on a CPU with any attention, on CUDA only
    with one of PACKED_ATTENTION (`padding_free_attention` sets flash-attn's where it is installed)."""
    return torch.device(device).type != "cuda" or model.config._attn_implementation in PACKED_ATTENTION
