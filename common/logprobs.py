"""Per-token log-probs and entropy without materialising [tokens x vocab] fp32 logits, the log-prob canary, and the
rollout correction's weight (both compare the trainer's log-probs with the sampler's).

Nothing here is specific to one algorithm: each script writes its own loss.

Log-probs. `TokenLogProbs` wraps a Hugging Face causal LM. Its forward runs the decoder to the final hidden
states and turns only the completion positions into log-probs, `chunk_size` rows at a time, through
`chunked_logprobs`, a custom autograd function: the forward keeps the hidden states, the output weight and
one logsumexp per token; the backward recomputes each chunk's logits and writes the gradient straight into
d(hidden) and d(weight). Peak extra memory is one chunk x vocab in fp32 instead of all tokens x vocab.
With kernel="triton" (GPU) the GEMMs stay cuBLAS's and two Triton kernels (common/triton_logprobs.py) do each
chunk's softmax: one pass over its logits in their own dtype for the forward, one for d logits in the backward,
where torch takes half a dozen in fp32. With kernel="triton-fused" the forward is one Triton kernel with the
output layer inside, which never holds more than a tile of logits (slower); its backward is the torch path's.
Logits are divided by the sampling temperature before the log-softmax, so log-probs match what the sampler
drew from; accumulation is fp32 whatever the model dtype. Under autocast the three GEMMs (h W^T, dlogits W,
dlogits^T h) take the autocast dtype in the forward and the backward (fp32 accumulation inside the GEMM, the
softmax in fp32); fp32 and fp64 inputs without autocast multiply in their own dtype. Entropy is returned for
logging, without gradient. `weights_cast_once` keeps one half-precision copy of each weight for all micro-batches
of an optimizer step.
What a model's own forward does to its logits after the output layer is applied too (`LogitTransform`): a scale
(Cohere's `logit_scale`, Granite's `logits_scaling`) and Gemma's soft cap c tanh(z / c); a model with any other
head (a bias, several heads) is refused in one line instead of being trained on the wrong log-probs.

No function here reads a tensor value on the host, so none of them syncs with the device inside a micro-batch loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from common.args import SharedArgs
from common.kernels import packs

KERNELS = ("auto", "torch", "triton", "triton-fused")


@dataclass(frozen=True)
class LogitTransform:
    """What the model's forward does to h W^T before returning logits: z * scale, then cap * tanh(z / cap) when
    `softcap` is set (Gemma 2/3: `final_logit_softcapping`). The identity by default."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitTransform:
        """The transform of a transformers config: Cohere's logit_scale, Granite's 1 / logits_scaling, Gemma's
        final_logit_softcapping (text configs nested in `text_config` too)."""
        config = getattr(config, "text_config", None) or config
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        scale /= float(getattr(config, "logits_scaling", None) or 1.0)
        cap = getattr(config, "final_logit_softcapping", None)
        return cls(scale, float(cap) if cap else None)

    def __call__(self, z: Tensor) -> Tensor:
        """The final logits from z = h W^T, in place on `z` (an fp32 / fp64 buffer)."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def backward(self, d_logits: Tensor, z: Tensor | None) -> Tensor:
        """d(loss)/d(h W^T) from d(loss)/d(logits), in place on `d_logits`; `z` = self(h W^T), the final logits (only
        read, and overwritten, with a soft cap)."""
        if self.softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh(x / c)^2 = 1 - (z / c)^2
            d_logits.mul_(z.div_(self.softcap).square_().neg_().add_(1))
        if self.scale != 1.0:
            d_logits.mul_(self.scale)
        return d_logits


def _acc_dtype(x: Tensor) -> torch.dtype:
    """fp32 accumulation for half-precision models, fp64 kept for fp64 (gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def _gemm_dtype(x: Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's under autocast (as `x @ w.T` would be), else x's own; fp64 is never lowered."""
    device = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


# (id, dtype) -> (weight, its cast), while `weights_cast_once` is open; None outside it
_CASTS: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor]] | None = None


def _cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`weight` in `dtype`: cast once per `weights_cast_once` block, else once per call."""
    if weight.dtype == dtype:
        return weight
    if _CASTS is None:
        return weight.detach().to(dtype)
    key = (id(weight), dtype)
    if key not in _CASTS:  # the weight itself is kept too, so its id cannot be reused while the block is open
        _CASTS[key] = (weight, weight.detach().to(dtype))
    return _CASTS[key][1]


@contextlib.contextmanager
def weights_cast_once() -> Iterator[None]:
    """Around the micro-batches of one optimizer step (never around `optimizer.step()`, which would leave the casts
    stale): each fp32 weight is cast to the autocast dtype once instead of once per micro-batch; values and gradients
    are unchanged. Torch caches autocast's casts of leaf weights until the outermost autocast block exits (each
    forward's own, under accelerate); this holds one nesting level open without touching autocast's state, and keeps
    `chunked_logprobs`' cast of the output layer alike."""
    global _CASTS
    outer = _CASTS
    _CASTS = {} if outer is None else outer
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        _CASTS = outer


def _check_kernel(kernel: str) -> None:
    """Rejects unknown kernels, and a Triton kernel without triton installed, before any work is done."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown log-prob kernel {kernel!r}; choose one of {KERNELS}")
    if kernel.startswith("triton"):
        try:
            import common.triton_logprobs  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"kernel={kernel!r} needs the triton package (it comes with CUDA builds of torch; otherwise "
                "pip install triton), or use kernel='torch'"
            ) from e


def resolve_kernel(kernel: str, hidden: Tensor, transform: LogitTransform) -> str:
    """The kernel that `kernel` names for these inputs: "auto" is "triton" for CUDA tensors in half precision or fp32
    under a plain output layer (no logit scale or soft cap) with triton installed, else "torch"; any other is itself."""
    if kernel != "auto":
        return kernel
    if not hidden.is_cuda or hidden.dtype == torch.float64 or transform != LogitTransform():
        return "torch"
    try:
        import common.triton_logprobs  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(f(h W^T) / T)[target] and its entropy, chunk by chunk over rows (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, kernel: str, transform):
        # Under autocast the GEMMs take its dtype, here and in the backward; otherwise h and w are the inputs.
        dtype = _gemm_dtype(hidden)
        h, w = hidden.to(dtype), _cast(weight, dtype)
        n, acc = hidden.shape[0], _acc_dtype(hidden)
        if kernel == "triton-fused":  # the backward below only needs its lse
            from common.triton_logprobs import fused_logprobs_forward

            logps, entropy, lse = fused_logprobs_forward(h, w, targets, temperature)
        else:
            logps = torch.empty(n, dtype=acc, device=hidden.device)
            entropy = torch.empty(n, dtype=acc, device=hidden.device)
            lse = torch.empty(n, dtype=acc, device=hidden.device)
        if kernel == "triton":  # cuBLAS's logits in the GEMMs' dtype, one Triton pass over each chunk of them
            from common.triton_logprobs import softmax_stats

            temp = torch.full((1,), temperature, dtype=acc, device=hidden.device)
            for s in range(0, n, chunk_size):
                e = s + chunk_size
                softmax_stats(h[s:e] @ w.T, targets[s:e], temp, logps[s:e], entropy[s:e], lse[s:e])
        elif kernel == "torch":
            for s in range(0, n, chunk_size):
                # In-place ops throughout: at most two [chunk x vocab] fp32 buffers are alive at once.
                logits = transform((h[s : s + chunk_size] @ w.T).to(acc)).div_(temperature)
                lse_c = torch.logsumexp(logits, dim=-1)
                logps[s : s + chunk_size] = logits.gather(1, targets[s : s + chunk_size, None]).squeeze(1) - lse_c
                logp_all = logits.sub_(lse_c[:, None])
                entropy[s : s + chunk_size] = -logp_all.exp().mul_(logp_all).sum(-1)
                lse[s : s + chunk_size] = lse_c
        ctx.save_for_backward(h, w, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.transform, ctx.kernel = temperature, chunk_size, transform, kernel
        ctx.dtypes = hidden.dtype, weight.dtype  # the gradients'
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, grad_entropy: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors  # in the GEMMs' dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _acc_dtype(hidden)
        grad_h = torch.empty(hidden.shape, dtype=ctx.dtypes[0], device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_logps = grad_logps.to(acc)
        if ctx.kernel == "triton":
            from common.triton_logprobs import softmax_grad_

            temp = torch.full((1,), ctx.temperature, dtype=acc, device=hidden.device)
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[s : s + ctx.chunk_size]
            g = grad_logps[s : s + ctx.chunk_size]
            if ctx.kernel == "triton":  # one pass, over the logits in the GEMMs' dtype
                e = s + ctx.chunk_size
                d_logits = softmax_grad_(h @ weight.T, targets[s:e], lse[s:e], g, temp)
            else:
                z = ctx.transform((h @ weight.T).to(acc))  # a second buffer only with a soft cap (its derivative
                logits = z.clone() if ctx.transform.softcap is not None else z  # reads z)
                # d logp_target / d logits = onehot(target) - softmax(logits), times 1/T for the temperature.
                d_logits = logits.div_(ctx.temperature).sub_(lse[s : s + ctx.chunk_size, None]).exp_()
                d_logits.mul_(-g[:, None]).scatter_add_(1, targets[s : s + ctx.chunk_size, None], g[:, None])
                d_logits = ctx.transform.backward(d_logits.div_(ctx.temperature), z).to(weight.dtype)
            if need_h:
                grad_h[s : s + ctx.chunk_size] = d_logits @ weight
            if need_w and weight.dtype == acc:
                grad_w.addmm_(d_logits.T, h)
            elif need_w:  # a half-precision GEMM, its [V, H] result summed over chunks in fp32
                grad_w += d_logits.T @ h
        grad_w = grad_w.to(ctx.dtypes[1]) if need_w else None
        return grad_h, grad_w, None, None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    kernel: str = "torch",
    transform: LogitTransform = LogitTransform(),
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of `targets` and entropies under logits `transform(hidden @ weight.T) / temperature`.

    hidden: [..., H]; weight: [V, H] (a bias-free output layer); targets: [...] token ids.
    Returns (logps, entropy), both fp32 (fp64 for fp64 inputs) of shape [...]; only logps carries a gradient.
    kernel: "torch" (chunked matmul + log-softmax), "triton" (chunked cuBLAS matmuls, Triton's softmax and
    d logits; CUDA tensors, identity transform only), "triton-fused" (the output layer fused into a Triton
    forward; the torch path's backward) or "auto" (`resolve_kernel`: triton where it can run, else torch). Every
    backward recomputes the logits, `chunk_size` rows at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    _check_kernel(kernel)
    kernel = resolve_kernel(kernel, hidden, transform)
    if kernel != "torch" and transform != LogitTransform():
        raise ValueError(f"kernel={kernel!r} has no logit scale or soft cap ({transform}): use kernel='torch'")
    shape = targets.shape
    logps, entropy = _ChunkedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        float(temperature),
        int(chunk_size),
        kernel,
        transform,
    )
    return logps.view(shape), entropy.view(shape)


class TokenLogProbs(nn.Module):
    """A causal LM whose forward returns the log-probs and entropies of the completion tokens.

    Wrapping the LM in a module (rather than calling its decoder from outside) keeps DDP, FSDP and ZeRO
    hooks working: `accelerator.prepare(TokenLogProbs(model))` and call it like any model. Under ZeRO-3 the output
    weight, read here outside its own module, is gathered by DeepSpeed's external-parameter detection (tested with
    every parameter partitioned in tests/test_distributed.py). Save the LM with `unwrap_model(wrapper).lm
    .save_pretrained(dir, state_dict=...)`, the state dict from `accelerator.get_state_dict(wrapper)` with the
    "lm." prefix removed: under FSDP / ZeRO-3 the module's own tensors are shards.
    padding_free: the decoder sees the rows' tokens back to back as one sequence, positions restarting at 0 in each
    row and no attention mask, from which transformers attends within each row (flash-attn's varlen kernel, or a
    block-diagonal mask for sdpa / eager); only the completion tokens reach the output layer. Same log-probs and
    gradient on those tokens; 0 on padding. It reads the micro-batch's token count on the host once per forward. On
    CUDA only with a varlen attention (common.kernels.packs: flash-attn's), else the forward runs padded.
    """

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, kernel: str = "torch", padding_free: bool = False):
        super().__init__()
        _check_kernel(kernel)
        self.lm = lm
        self.chunk_size = chunk_size
        self.kernel = kernel
        self.padding_free = padding_free
        self.transform = LogitTransform.of(lm.config)
        head = lm.get_output_embeddings()
        if not isinstance(getattr(head, "weight", None), Tensor) or getattr(head, "bias", None) is not None:
            raise ValueError(
                f"{type(lm).__name__}: only a single bias-free linear output layer is supported "
                f"(this model's is {type(head).__name__})"
            )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, completion_start: int, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """input_ids/attention_mask: [B, L], prompts left-padded to `completion_start` columns followed by
        right-padded completions. Returns (logps, entropy), each [B, L - completion_start]: entry t is
        token `completion_start + t` given everything before it."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.padding_free and packs(self.lm, input_ids.device):  # else padded (CUDA without flash-attn)
            return self._packed(input_ids, attention_mask.bool(), position_ids, completion_start, temperature)
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[:, completion_start - 1 : -1]
        targets = input_ids[:, completion_start:]
        weight = self.lm.get_output_embeddings().weight
        return chunked_logprobs(hidden, weight, targets, temperature, self.chunk_size, self.kernel, self.transform)

    def _packed(self, input_ids, keep, position_ids, completion_start, temperature) -> tuple[Tensor, Tensor]:
        """forward() with padding_free: a row's tokens are contiguous (prompt left-padded, completion right-padded)."""
        hidden = self.lm.get_decoder()(
            input_ids=input_ids[keep][None], position_ids=position_ids[keep][None], use_cache=False
        ).last_hidden_state[0]
        place = keep.flatten().cumsum(0).view(keep.shape) - 1  # each kept token's index in the packed sequence
        scored = keep[:, completion_start:]  # completion tokens, each predicted from the kept token before it
        before = place[:, completion_start - 1 : -1][scored]
        targets = input_ids[:, completion_start:][scored]
        weight = self.lm.get_output_embeddings().weight
        logps, entropy = chunked_logprobs(
            hidden[before], weight, targets, temperature, self.chunk_size, self.kernel, self.transform
        )
        zeros = torch.zeros(scored.shape, dtype=logps.dtype, device=logps.device)
        return zeros.masked_scatter(scored, logps), zeros.masked_scatter(scored, entropy)


def compute_logps(policy, batch: dict, temperature: float, plan: list[tuple[list[int], int, int]]) -> Tensor:
    """Per-token log-probs [N, C] of a whole rollout `batch` under `policy` at `temperature`, without gradient, one
    micro-batch of `plan` (common.batching.micro_batches) at a time (zeros past each micro-batch's width), each weight
    cast once for all of them."""
    from common.batching import micro_batch

    logps = torch.zeros(batch["mask"].shape, device=batch["ids"].device)
    with weights_cast_once():
        for rows, p_w, c_w in plan:
            mb = micro_batch(batch, rows, p_w, c_w)
            logps[mb["rows"], :c_w] = policy(mb["ids"], mb["attn"], p_w, temperature)[0].to(logps.dtype)
    return logps


class LogprobCanary:
    """The trainer's log-probs against the sampler's on the tokens the sampler produced this step (not injected or
    replayed rows, whose sampler log-probs are NaN), before the first update: |difference| max and mean
    (`train/logprob_diff_*`: after every weight push both should hold the same weights, ~1e-6 in fp32, while a push
    that did not reach the sampler shows as a gap of order 1; with --off-policy-steps it is the policy's drift), the
    sampler-to-trainer KL, k3 of KL(sampler || trainer), and the effective sample size of the importance weights
    w = pi / pi_sampler, (sum w)^2 / (n sum w^2), 1 when they are all equal."""

    def __init__(self) -> None:
        self.log_ratios: list[Tensor] = []
        self.masks: list[Tensor] = []

    def add(self, logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> None:
        sampled = mask * sampler_logps.isfinite()
        self.log_ratios.append(((logps.detach() - sampler_logps).nan_to_num(nan=0.0) * sampled).flatten())
        self.masks.append(sampled.flatten())

    def stats(self) -> dict[str, Tensor]:
        if not self.log_ratios:
            return {}
        # float64, and k3 = w - 1 - log w as expm1(d) - d: it is >= 0 per token, which fp32 rounding breaks
        dtype = torch.promote_types(self.log_ratios[0].dtype, torch.float32)  # the stats come back in it
        d, m = torch.cat(self.log_ratios).double(), torch.cat(self.masks).double()
        n, d_capped = m.sum().clamp(min=1), d.clamp(max=20.0)
        w, k3 = torch.exp(d_capped) * m, (torch.expm1(d_capped) - d_capped).clamp(min=0) * m
        stats = {
            "logprob_diff_max": d.abs().max(),
            "logprob_diff_mean": d.abs().sum() / n,
            "sampler_kl": k3.sum() / n,
            "is_ess": w.sum() ** 2 / (n * w.square().sum()).clamp(min=1e-30),
        }
        return {k: v.to(dtype) for k, v in stats.items()}


def rollout_correction(old_logps, rollout_logps, mask, args: SharedArgs, num_tokens=None):
    """Rollout correction for the sampler/trainer mismatch: a detached weight on each token's policy-loss
    term (never on a KL term), from w = exp(old_logps - rollout_logps) per token (--rollout-correction token-*) or
    exp(the sum of that log-ratio over the sequence's tokens) per sequence (sequence-*), capped at
    --rollout-correction-cap. *-truncate: min(w, cap); *-mask: w where
    w <= cap, else 0 (only w > cap is dropped, as TRL; verl's mask also drops w < 1/cap). A masked token still
    counts in the loss's normaliser. old_logps, rollout_logps, mask: [B, T]. Returns (weight [B, T], or 1.0 when
    the correction is off or "auto", which the scripts resolve from the sampler; stats: token means over the
    mini-batch, and min/max). With top_p < 1 the sampler's log-probs are renormalised over the nucleus, so w is the
    nucleus mass (<= 1) even without any mismatch (docs/algorithms.md "Rollout correction")."""
    mode, cap = args.rollout_correction, args.rollout_correction_cap
    if mode in ("none", "auto"):
        return 1.0, {}
    if rollout_logps is None:
        raise ValueError(f"--rollout-correction {mode} needs the sampler's log-probs")
    # NaN rollout log-probs mark rows the sampler did not produce this step (injected, replayed): weight 1 there
    log_w = (old_logps.detach() - rollout_logps.to(old_logps.dtype)).nan_to_num(nan=0.0) * mask
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    over, log_cap = log_w > math.log(cap), math.log(cap)
    weight = torch.exp(log_w.clamp(max=log_cap))
    if mode.endswith("mask"):
        weight = torch.where(over, 0.0, weight)
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    stats = {
        "rollout_corr_weight_mean": (weight * mask).sum() / num_tokens,
        "rollout_corr_capped_frac": (over * mask).sum() / num_tokens,
        "rollout_corr_weight_min": torch.where(mask > 0, weight, torch.inf).amin(),
        "rollout_corr_weight_max": torch.where(mask > 0, weight, -torch.inf).amax(),
    }
    return weight, stats
