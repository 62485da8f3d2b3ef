"""A rollout as padded tensors, split into micro-batches, and the global normalisers of a mini-batch's loss.

Nothing here is specific to one algorithm. Host-side planning only: no function reads a tensor value on the host but
`global_cat` (the ranks' counts, once per call, outside any micro-batch loop), so none of them syncs with the device
inside a micro-batch loop.

Normalisers. A loss over a mini-batch is `sum(l * mask) / normaliser`. When the mini-batch is split into
micro-batches and across ranks, the normaliser must be the whole mini-batch's, or the gradient is re-weighted per
micro-batch (the classic "per-micro-batch token-mean" bug). `grad_normalizers` computes the token and sequence counts
once per mini-batch with one all-reduce; each script's compute_policy_loss divides by them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from common.args import SharedArgs

# the per-token fields ([N, C]) of every batch; a script declares its own in make_batch (docs/design.md "The batch")
TOKEN_FIELDS = ("mask", "sampler_logps", "old_logps", "ref_logps")


def make_batch(prompts: list[list[int]], completions, pad_id: int, device, token_fields=()) -> dict:
    """The training batch of a rollout: `ids` and `attn` [N, P + C] with left-padded prompts and right-padded
    completions, the completion `mask` [N, C], the prompt width `p_len`, `lens` ((prompt, completion) lengths per row,
    host-side), `token_fields` (TOKEN_FIELDS and the script's `token_fields`: the fields micro_batch cuts as the mask)
    and, when the sampler gave log-probs, `sampler_logps` [N, C] (NaN rows for completions it did not sample this
    step). prompts: one per group; completions: common.sampling.Completion, groups of len(completions) // len(prompts)
    contiguous. With the tool, a completion's own mask (0 on the tool's output tokens) is folded into `mask`: those
    tokens stay in `ids` and `attn` (the model reads them) but are out of the loss, the log-prob canary, the rollout
    correction and the entropy, which all read `mask`. The script adds its advantages (and any field of its own)."""
    group_size = len(completions) // len(prompts)
    rows = [p for p in prompts for _ in range(group_size)]
    p_len = max(len(p) for p in rows)
    c_len = max(max(len(c.token_ids) for c in completions), 1)
    ids = torch.full((len(rows), p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(rows, completions)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        ids[i, p_len : p_len + len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(c.token_ids)] = 1
    mask = attn[:, p_len:].clone()
    for i, c in enumerate(completions):
        if c.mask is not None:  # the tool's output tokens: context, not actions
            mask[i, : len(c.mask)] = torch.tensor(c.mask, dtype=mask.dtype)
    batch = {
        "ids": ids.to(device),
        "attn": attn.to(device),
        "mask": mask.to(device),
        "p_len": p_len,
        "lens": [(len(p), len(c.token_ids)) for p, c in zip(rows, completions)],
        "token_fields": frozenset(TOKEN_FIELDS + tuple(token_fields)),
    }
    if any(c.logprobs is not None for c in completions):  # the canary and the rollout correction read them
        batch["sampler_logps"] = pad_logprobs([c.logprobs for c in completions], c_len).to(device)
    return batch


def pad_logprobs(logprobs: list[list[float] | None], width: int) -> Tensor:
    """[N, width] per-token sampler log-probs, zero-padded; NaN for a row without any (one the sampler did not
    produce this step: an injected or replayed completion)."""
    return torch.tensor([[math.nan] * width if lp is None else lp + [0.0] * (width - len(lp)) for lp in logprobs])


def micro_batches(rows: list[int], lens: list[tuple[int, int]], args: SharedArgs) -> list[tuple[list[int], int, int]]:
    """Splits rows of a rollout into micro-batches: (rows, prompt width, completion width), the widths being the
    longest prompt and completion among those rows, so each micro-batch is cut to its own padding.
    lens: (prompt length, completion length) per row. --micro-batch-size rows at a time in the given order
    (--micro-batch-tokens 0), or longest completion first, as many rows as fit in --micro-batch-tokens padded tokens
    (at most --micro-batch-size); with --padding-free, tokens without the padding."""
    max_rows, max_tokens = args.micro_batch_size, args.micro_batch_tokens
    if max_tokens <= 0:
        groups = [rows[i : i + max_rows] for i in range(0, len(rows), max_rows)]
    else:
        groups, width, tokens = [], (0, 0), 0
        for r in sorted(rows, key=lambda r: -lens[r][1]):
            w = (max(width[0], lens[r][0]), max(width[1], lens[r][1]))
            n = len(groups[-1]) + 1 if groups else 0
            cost = tokens + sum(lens[r]) if args.padding_free else n * sum(w)
            if not groups or n > max_rows or cost > max_tokens:
                groups.append([])
                w, cost = lens[r], sum(lens[r])
            groups[-1].append(r)
            width, tokens = w, cost
    return [(g, max(lens[r][0] for r in g), max(1, max(lens[r][1] for r in g))) for g in groups]


def micro_batch(batch: dict, rows: list[int], p_w: int, c_w: int) -> dict:
    """Rows `rows` of the batch, with the padding beyond the widths removed: input columns [p_len - p_w, p_len + c_w)
    and the per-token fields' (`batch["token_fields"]`, by default TOKEN_FIELDS) completion columns [0, c_w), so its
    `p_len` is p_w; every other tensor is per row. Also holds `rows` as an index tensor. A field that is neither (a
    2-D tensor not declared per token, or a declared one not [N, C]) is refused: its rows would be cut wrongly."""
    idx = torch.tensor(rows, device=batch["ids"].device)
    p_len, width, tokens = batch["p_len"], batch["mask"].shape, batch.get("token_fields", TOKEN_FIELDS)
    out = {"rows": idx, "p_len": p_w}
    for k, v in batch.items():
        if k in ("ids", "attn"):
            out[k] = v[idx, p_len - p_w : p_len + c_w]
        elif not isinstance(v, Tensor):
            continue
        elif k in tokens and v.shape == width:
            out[k] = v[idx, :c_w]
        elif k not in tokens and v.dim() == 1:
            out[k] = v[idx]
        else:
            kind = "per-token field, not [N, C]" if k in tokens else "2-D field not declared per token (make_batch)"
            raise ValueError(f"batch[{k!r}] {tuple(v.shape)}: a {kind}")
    return out


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
            # a fill kernel, not a copy from host memory: CUDA would wait for it (vapo.py calls this mid-loop)
            torch.full((), float(sum(m.shape[0] for m in masks)), device=masks[0].device),
        ]
    )
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
        world = dist.get_world_size()
    counts = counts / world
    return counts[0], counts[1]


def global_sum(x: Tensor) -> Tensor:
    """`x` summed over all ranks (itself on one process). For statistics of a whole mini-batch, e.g. the means a
    per-token selection compares against."""
    if dist.is_available() and dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def global_cat(x: Tensor) -> Tensor:
    """Every rank's 1-D `x` concatenated in rank order (itself on one process); the ranks may hold different counts.
    For a selection over the whole mini-batch (a top-k, a threshold) from each rank's candidates."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    counts = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([x.numel()], device=x.device))
    width = max(int(c) for c in counts)
    padded = torch.cat([x, x.new_zeros(width - x.numel())])
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts)])
