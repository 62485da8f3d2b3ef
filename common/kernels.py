"""Optional speed-ups of the trainer's model, each off by default: Liger-Kernel's fused RMSNorm, SwiGLU and RoPE,
torch.compile of the decoder layers, and a varlen attention for padding-free micro-batches
(`TokenLogProbs(padding_free=True)`). Each changes how the model computes, not what (tests/test_fast_paths.py); Liger
and compile refuse in one line where they cannot work. Apply them to the Hugging Face model before LoRA adapters and
before `accelerator.prepare`.
"""

from __future__ import annotations

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


def padding_free_attention(model: nn.Module, device: torch.device | str) -> str:
    """Sets and returns the attention for padding-free micro-batches. On CUDA: flash-attn's varlen kernel
    ("flash_attention_2") when flash-attn is installed, else torch's flex attention ("flex_attention", compiled on first
    use), which skips the blocks the packed rows' block-diagonal mask excludes; sdpa would compute them all, quadratic
    in the micro-batch's tokens. On a CPU the model's own (sdpa or eager, with that mask: what the tests compare)."""
    if torch.device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401

            model.set_attn_implementation("flash_attention_2")
        except ImportError:
            model.set_attn_implementation("flex_attention")
    return model.config._attn_implementation
