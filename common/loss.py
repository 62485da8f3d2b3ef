"""Per-token log-probs and entropy without materialising [tokens x vocab] fp32 logits, and the global normalisers
of a mini-batch's loss.

Nothing here is specific to one algorithm: each script writes its own aggregation. Also here: the
rollout correction's weight (docs/design.md), which each script's compute_policy_loss multiplies into its policy term,
and the batching of a rollout into padded tensors and token-budget micro-batches.

Log-probs. `TokenLogProbs` wraps a Hugging Face causal LM. Its forward runs the decoder to the final hidden
states and turns only the completion positions into log-probs, `chunk_size` rows at a time, through
`chunked_logprobs`, a custom autograd function: the forward keeps the hidden states, the output weight and
one logsumexp per token; the backward recomputes each chunk's logits and writes the gradient straight into
d(hidden) and d(weight). Peak extra memory is one chunk x vocab in fp32 instead of all tokens x vocab.
With kernel="triton" (GPU) the forward is instead one fused Triton kernel (common/triton_logprobs.py) that
never holds more than a tile of logits; the backward is the same chunked recompute.
Logits are divided by the sampling temperature before the log-softmax, so log-probs match what the sampler
drew from; accumulation is fp32 whatever the model dtype. Entropy is returned for logging, without gradient.

Normalisers. A loss over a mini-batch is `sum(l * mask) / normaliser`. When the mini-batch is split into
micro-batches and across ranks, the normaliser must be the whole mini-batch's, or the gradient is
re-weighted per micro-batch (the classic "per-micro-batch token-mean" bug). `grad_normalizers` computes the token
and sequence counts once per mini-batch with one all-reduce; each script's compute_policy_loss divides by them.
No function here reads a tensor value on
the host, so none of them syncs with the device inside a micro-batch loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

KERNELS = ("torch", "triton")


def _acc_dtype(x: Tensor) -> torch.dtype:
    """fp32 accumulation for half-precision models, fp64 kept for fp64 (gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def _check_kernel(kernel: str) -> None:
    """Rejects unknown kernels, and kernel="triton" without triton installed, before any work is done."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown log-prob kernel {kernel!r}; choose one of {KERNELS}")
    if kernel == "triton":
        try:
            import common.triton_logprobs  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "kernel='triton' needs the triton package (it comes with CUDA builds of torch; otherwise "
                "pip install triton), or use kernel='torch'"
            ) from e


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and its entropy, chunk by chunk over rows (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int, kernel: str):
        if kernel == "triton":  # fused forward; the backward below only needs its lse
            from common.triton_logprobs import fused_logprobs_forward

            h, w, dev = hidden, weight, hidden.device.type
            if torch.is_autocast_enabled(dev):  # multiply in the autocast dtype, as `hidden @ weight.T` would
                h, w = hidden.to(torch.get_autocast_dtype(dev)), weight.to(torch.get_autocast_dtype(dev))
            logps, entropy, lse = fused_logprobs_forward(h, w, targets, temperature)
        else:
            n, acc = hidden.shape[0], _acc_dtype(hidden)
            logps = torch.empty(n, dtype=acc, device=hidden.device)
            entropy = torch.empty(n, dtype=acc, device=hidden.device)
            lse = torch.empty(n, dtype=acc, device=hidden.device)
            for s in range(0, n, chunk_size):
                # In-place ops throughout: at most two [chunk x vocab] fp32 buffers are alive at once.
                logits = (hidden[s : s + chunk_size] @ weight.T).to(acc).div_(temperature)
                lse_c = torch.logsumexp(logits, dim=-1)
                logps[s : s + chunk_size] = logits.gather(1, targets[s : s + chunk_size, None]).squeeze(1) - lse_c
                logp_all = logits.sub_(lse_c[:, None])
                entropy[s : s + chunk_size] = -logp_all.exp().mul_(logp_all).sum(-1)
                lse[s : s + chunk_size] = lse_c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, grad_entropy: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc_dtype(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_logps = grad_logps.to(acc)
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[s : s + ctx.chunk_size]
            g = grad_logps[s : s + ctx.chunk_size]
            logits = (h @ weight.T).to(acc).div_(ctx.temperature)
            # d logp_target / d logits = onehot(target) - softmax(logits), times 1/T for the temperature.
            d_logits = logits.sub_(lse[s : s + ctx.chunk_size, None]).exp_().mul_(-g[:, None])
            d_logits.scatter_add_(1, targets[s : s + ctx.chunk_size, None], g[:, None])
            d_logits.div_(ctx.temperature)
            if need_h:
                grad_h[s : s + ctx.chunk_size] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(d_logits.T, h.to(acc))
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    kernel: str = "torch",
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of `targets` and entropies under logits `hidden @ weight.T / temperature`.

    hidden: [..., H]; weight: [V, H] (a bias-free output layer); targets: [...] token ids.
    Returns (logps, entropy), both fp32 (fp64 for fp64 inputs) of shape [...]; only logps carries a gradient.
    kernel: "torch" (chunked matmul + log-softmax) or "triton" (fused Triton forward, CUDA tensors; the
    backward is the same chunked recompute either way, `chunk_size` rows at a time).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    _check_kernel(kernel)
    shape = targets.shape
    logps, entropy = _ChunkedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), float(temperature), int(chunk_size), kernel
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
    """

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, kernel: str = "torch"):
        super().__init__()
        _check_kernel(kernel)
        self.lm = lm
        self.chunk_size = chunk_size
        self.kernel = kernel
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("TokenLogProbs supports bias-free output layers only")

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, completion_start: int, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """input_ids/attention_mask: [B, L], prompts left-padded to `completion_start` columns followed by
        right-padded completions. Returns (logps, entropy), each [B, L - completion_start]: entry t is
        token `completion_start + t` given everything before it."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[:, completion_start - 1 : -1]
        targets = input_ids[:, completion_start:]
        weight = self.lm.get_output_embeddings().weight
        return chunked_logprobs(hidden, weight, targets, temperature, self.chunk_size, self.kernel)


def grad_normalizers(masks: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The token and sequence normalisers of one optimizer step's mini-batch.

    masks: the completion masks ([b, T] each) of all micro-batches this rank will process before the
    optimizer step. Returns (num_tokens, num_seqs) as 0-d fp32 tensors: the totals over every micro-batch of
    every rank, divided by the world size. Each rank divides its loss sums by these, and DDP's gradient
    *average* over ranks is then exactly the gradient of the global mean. One all-reduce, no host sync.
    """
    counts = torch.stack(
        [
            sum(m.sum() for m in masks).float(),
            torch.tensor(float(sum(m.shape[0] for m in masks)), device=masks[0].device),
        ]
    )
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
        world = dist.get_world_size()
    counts = counts / world
    return counts[0], counts[1]


def rollout_correction(old_logps, rollout_logps, mask, mode: str, cap: float, num_tokens=None):
    """Rollout correction for the sampler/trainer mismatch: a detached weight on each token's policy-loss
    term (never on a KL term), from w = exp(old_logps - rollout_logps) per token (mode token-*) or exp(the sum of that
    log-ratio over the sequence's tokens) per sequence (sequence-*). *-truncate: min(w, cap); *-mask: w where
    w <= cap, else 0 (only w > cap is dropped, as TRL; verl's mask also drops w < 1/cap). A masked token still
    counts in the loss's normaliser. old_logps, rollout_logps, mask: [B, T]. Returns (weight [B, T], or 1.0 when
    the correction is off or "auto", which the scripts' main() resolves from the sampler; stats: token means over the
    mini-batch, and min/max). With top_p < 1 the sampler's log-probs are renormalised over the nucleus, so w is the
    nucleus mass (<= 1) even without any mismatch (docs/algorithms.md "Rollout correction")."""
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
    token_mean = lambda x: (x.float() * mask).sum() / num_tokens  # noqa: E731
    stats = {
        "rollout_corr_weight_mean": token_mean(weight),
        "rollout_corr_capped_frac": token_mean(over),
        "rollout_corr_weight_min": torch.where(mask > 0, weight, torch.inf).amin(),
        "rollout_corr_weight_max": torch.where(mask > 0, weight, -torch.inf).amax(),
    }
    return weight, stats


# Batching: rollout rows into padded tensors and micro-batches (host-side planning, no device reads)
def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """[N, P + C] ids and attention mask with left-padded prompts and right-padded completions, and the
    [N, C] completion mask. Prompt i is shared by its group (prompts given once per completion)."""
    p_len = max(len(p) for p in prompts)
    c_len = max(max(len(c) for c in completions), 1)
    ids = torch.full((len(prompts), p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        ids[i, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(c)] = 1
    return ids, attn, attn[:, p_len:].clone(), p_len


def pad_logprobs(logprobs: list[list[float] | None], width: int) -> torch.Tensor:
    """[N, width] per-token sampler log-probs, zero-padded; NaN for a row without any (one the sampler did not
    produce this step: an injected or replayed completion)."""
    return torch.tensor([[math.nan] * width if lp is None else lp + [0.0] * (width - len(lp)) for lp in logprobs])


def micro_batches(
    rows: list[int], lens: list[tuple[int, int]], max_rows: int, max_tokens: int
) -> list[tuple[list[int], int, int]]:
    """Splits rows of a rollout into micro-batches: (rows, prompt width, completion width), the widths being the
    longest prompt and completion among those rows, so each micro-batch is cut to its own padding.
    lens: (prompt length, completion length) per row. `max_rows` rows at a time in the given order (max_tokens 0), or
    longest completion first, as many rows as fit in `max_tokens` padded tokens (at most `max_rows`)."""
    if max_tokens <= 0:
        groups = [rows[i : i + max_rows] for i in range(0, len(rows), max_rows)]
    else:
        groups, width = [], (0, 0)
        for r in sorted(rows, key=lambda r: -lens[r][1]):
            w = (max(width[0], lens[r][0]), max(width[1], lens[r][1]))
            if not groups or (n := len(groups[-1]) + 1) > max_rows or n * sum(w) > max_tokens:
                groups.append([])
                w = lens[r]
            groups[-1].append(r)
            width = w
    return [(g, max(lens[r][0] for r in g), max(1, max(lens[r][1] for r in g))) for g in groups]


def cut(batch: dict, idx: torch.Tensor, p_w: int, c_w: int) -> dict:
    """Rows `idx` of the rollout's tensors, with the padding beyond the widths removed: input columns
    [p_len - p_w, p_len + c_w) and completion columns [0, c_w)."""
    p_len = batch["p_len"]
    out = {k: batch[k][idx, :c_w] for k in ("mask", "old_logps", "ref_logps", "sampler_logps") if k in batch}
    out.update(
        ids=batch["ids"][idx, p_len - p_w : p_len + c_w],
        attn=batch["attn"][idx, p_len - p_w : p_len + c_w],
        advantages=batch["advantages"][idx],
    )
    return out


def compute_logps(policy, batch: dict, temperature: float, plan: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """Per-token log-probs [N, C] of a whole rollout `batch` under `policy` at `temperature`, without gradient, one
    micro-batch of `plan` (`micro_batches`) at a time (zeros past each micro-batch's width)."""
    logps = torch.zeros(batch["mask"].shape, device=batch["ids"].device)
    for rows, p_w, c_w in plan:
        idx = torch.tensor(rows, device=logps.device)
        mb = cut(batch, idx, p_w, c_w)
        logps[idx, :c_w] = policy(mb["ids"], mb["attn"], p_w, temperature)[0].to(logps.dtype)
    return logps
