"""The Hugging Face `generate` backend (CPU, or GPU without vLLM): `HFSampler` samples from the live policy, so
`update_weights` has nothing to do. Plain temperature / top-p, the processed log-probs recorded as it samples
(common/sampling.py's docstring has the contract every backend keeps); with an environment (common/env.py) its
episodes run in rounds of batched generation.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor, nn

from common.completion import Completion, Segment, check_request, copy_completion, done_future
from common.env import Env, Request, episode_completions, run_episodes
from common.tool import Tool, ToolConfig
from common.weight_sync import unwrap_model


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
        env: Env | None = None,
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
        if (tool is not None or env is not None) and (fsdp_root is not None or _zero3()):
            raise ValueError(
                "the tool (or an environment) with HF generate under FSDP / ZeRO-3: sharded generation needs every "
                "rank to generate in step, and with an environment each rank's episodes take their own number of "
                "rounds; use the vLLM sampler"
            )
        # the environment its episodes run in: the run's (common.env.open_env), or a tool of its own (`tool`)
        self.env = env if env is not None else Tool(tool, tokenizer) if tool is not None else None

    def submit(self, prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks=None) -> Future:
        """`generate` now (in this process), as a completed future."""
        return done_future(self.generate(prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks))

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
        """Closes the environment (the tool's pool), if any (no engine); idempotent."""
        if self.env is not None:
            self.env.close()
            self.env = None

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        tasks: list | None = None,
    ) -> list[Completion]:
        """See `Sampler.generate`."""
        check_request(prompt_token_ids, n, max_new_tokens)
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
                if self.env is not None:
                    return self._generate_env(
                        model, device, prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks
                    )
                for i in range(0, len(prompt_token_ids), self.batch_size):
                    chunk = prompt_token_ids[i : i + self.batch_size]
                    rows = 1 if temperature <= 0 else n  # greedy: one decode per prompt, copied n times
                    segments = self._generate_batch(
                        model, device, chunk, rows, temperature, top_p, max_new_tokens, self.stop
                    )
                    for seg in segments:
                        c = Completion(seg.token_ids, seg.text, seg.truncated, seg.logprobs)
                        out += [c] if rows == n else [copy_completion(c) for _ in range(n)]
        finally:
            for m, training in modes:
                m.training = training
            if self.fsdp_root is not None:
                self.fsdp_root.reshard()
        return out

    def _generate_env(self, model, device, prompts, n, temperature, top_p, max_new_tokens, tasks) -> list[Completion]:
        """`generate` with the environment: common.env.run_episodes over rounds of `_round`."""
        rows = 1 if temperature <= 0 else n
        generate = functools.partial(self._round, model, device, temperature, top_p)
        episodes = run_episodes(self.env, prompts, rows, max_new_tokens, self.stop, generate, tasks=tasks)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        return episode_completions(self.env, episodes, decode, self.stop, n // rows)

    def _round(self, model, device, temperature, top_p, requests: list[Request], finished, stopped) -> None:
        """One round of an environment's episodes: the requests grouped by stop strings, a unit's requests (a
        prompt's first turns) as one prompt with several return sequences, `batch_size` prompts a batch, each batch to
        its longest budget; `finished(i, segment)` for every request, `stopped` as a row meets a stop string."""
        by_stops: dict[tuple[str, ...], list[int]] = {}
        for i, r in enumerate(requests):
            by_stops.setdefault(tuple(r.stop), []).append(i)
        for stops, members in by_stops.items():
            units: list[list[int]] = []  # consecutive requests of one unit share their prefix
            for i in members:
                if units and requests[units[-1][0]].unit == requests[i].unit:
                    units[-1].append(i)
                else:
                    units.append([i])
            batches: list[list[list[int]]] = []
            for unit in units:  # batch_size prompts of equal row counts (num_return_sequences is one per batch)
                if batches and len(batches[-1]) < self.batch_size and len(batches[-1][0]) == len(unit):
                    batches[-1].append(unit)
                else:
                    batches.append([unit])
            for batch in batches:
                order = [i for unit in batch for i in unit]
                prefixes = [requests[unit[0]].prefix for unit in batch]
                budget = max(requests[i].max_tokens for i in order)

                def on_stop(row: int, ids: list[int], order=order, stops=stops) -> None:
                    text = self._stop_text(ids, list(stops))
                    stopped(order[row], ids, text, _stop_hit(text, stops))

                segments = self._generate_batch(
                    model, device, prefixes, len(batch[0]), temperature, top_p, budget, list(stops), on_stop
                )
                for i, seg in zip(order, segments):
                    finished(i, seg)

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


def _stop_hit(text: str, stop: Sequence[str]) -> str | None:
    """The stop string a backend's text (cut after its stop string) ends with, if any."""
    return next((s for s in stop if text.endswith(s)), None)
