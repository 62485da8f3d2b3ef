"""A vLLM server on its own GPUs or machine (`--vllm-mode server`): `ServerSampler`, the trainer's client of
tools/vllm_server.py, and a "torch_pg" backend for vLLM's weight-transfer API: the weights travel over a
torch.distributed process group (NCCL on GPUs, gloo on CPU) whose every operation has a timeout.

The server is vLLM's own OpenAI-compatible server (vLLM 0.32) with its RL routes on (VLLM_SERVER_DEV_MODE=1);
nothing here generates a token. Generation: one POST /inference/v1/generate per prompt (token ids in; token ids,
text and processed log-probs out; the sampling parameters and per-prompt seeds of the in-process `VLLMSampler`).
Weights: vLLM's weight-transfer protocol (vllm/distributed/weight_transfer/): trainer rank 0 and the server's
workers join a process group of their own (`init_weight_transfer_engine`); a push is /pause (in-flight requests
finish), /start_weight_update, the weights broadcast while /update_weights receives them into vLLM's layerwise
reload, /finish_weight_update, /reset_prefix_cache, /resume. vLLM's own backends are CUDA-only, and its NCCL
communicator has no timeout (a dead peer hangs the trainer: TRL #6797). `WorkerWeightTransferEngine` /
`TrainerWeightTransferEngine` add "torch_pg" (registered when this module is imported: the server's workers import it
through --worker-extension-cls): torch's process group, NCCL when the trainer has CUDA (the trainer says which in
the init info), else gloo, which on CPU also re-packs the engine's GEMM weights after a push (common.vllm_sampler's
`repack_cpu_linears`). Tested on CPU (gloo); the NCCL route has not run yet.

Every call is bounded: HTTP requests by --vllm-server-timeout, the group's rendezvous and every collective by the
same; a failure raises SystemExit with one line naming the server and what the trainer was doing.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from torch import nn

from common.completion import Completion, Segment, check_request, copy_completion, episode_seed, request_seed
from common.env import Env, Request, episode_completions, run_episodes
from common.tool import Tool, ToolConfig
from common.vllm_sampler import keep_cpu_linear_weights, repack_cpu_linears
from common.weight_sync import iter_weight_buckets

BACKEND = "torch_pg"  # vLLM's name for our weight-transfer engines


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    numel = 1
    for x in shape:
        numel *= int(x)
    return numel * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str, listen_socket=None):
    """A process group of its own (not the default group; `backend` "gloo" or "nccl"). Trainer rank 0 hosts its store
    on `listen_socket` (bound and listening at host:port): torch's tcp:// rendezvous would connect to torchrun's agent
    store instead (TORCHELASTIC_USE_AGENT_STORE), where nobody serves this group."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    timeout = timedelta(seconds=timeout_s)
    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend, listen_socket=listen_socket, timeout=timeout
    )


def broadcast(group, tensor: torch.Tensor, timeout_s: float) -> None:
    """From group rank 0, on a group torch.distributed does not know (its wrapper wants a registered one)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=timeout_s)
    group.broadcast([tensor], opts).wait()


@functools.cache
def _engine_classes():
    """The server-side and trainer-side engines, defined on first use (vllm is imported only when needed)."""
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class WorkerInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        torch_backend: str = "gloo"
        timeout_s: float = 300.0

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class WorkerWeightTransferEngine(WeightTransferEngine[WorkerInitInfo, UpdateInfo]):
        """In each server worker: joins the trainer's group, receives one broadcast per tensor (in the order of the
        update's metadata) into vLLM's layerwise reload, and re-packs the CPU GEMM weights after it."""

        init_info_cls = WorkerInitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group, self.timeout_s, self.buffer_device = None, 300.0, "cpu"

        def init_transfer_engine(self, init_info: WorkerInitInfo) -> None:
            pc = self.parallel_config  # a rank per worker over every data-parallel replica
            rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
            self.timeout_s = init_info.timeout_s
            self.buffer_device = self.device if init_info.torch_backend == "nccl" else "cpu"
            self.group = open_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_s,
                init_info.torch_backend,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator sync: CPU has none

        def receive_weights(self, info: UpdateInfo) -> None:
            for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes):
                buf = torch.empty(_nbytes(dtype, shape), dtype=torch.uint8, device=self.buffer_device)
                broadcast(self.group, buf, self.timeout_s)
                self.model.load_weights([(name, buf.view(getattr(torch, dtype)).view(shape))])

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            from vllm.platforms import current_platform

            finalize_layerwise_reload(self.model, self.model_config)
            if current_platform.is_cpu():  # vLLM's CPU GEMMs read packed copies: pack them from the new weights
                repack_cpu_linears(self.model)

        def shutdown(self) -> None:
            _destroy(self.group)
            self.group = None

    @dataclass
    class TrainerInit(TrainerInitInfo):
        backend: ClassVar[str] = BACKEND
        master_address: str
        master_port: int
        world_size: int
        torch_backend: str = "gloo"
        timeout_s: float = 300.0
        listen_socket: Any = None  # bound to master_address:master_port and listening

    class TrainerEngine(TrainerWeightTransferEngine[TrainerInit]):
        """Trainer rank 0: hosts the group and broadcasts each tensor while the server receives it."""

        init_info_cls = TrainerInit

        def __init__(self, *, client, source=None, is_sender=True, timeout_s=300.0, torch_backend="gloo"):
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.group, self.timeout_s, self.torch_backend = None, timeout_s, torch_backend

        @classmethod
        def trainer_init(cls, init_info: TrainerInit, *, client, source=None):
            engine = cls(
                client=client, source=source, timeout_s=init_info.timeout_s, torch_backend=init_info.torch_backend
            )
            info = WorkerInitInfo(
                init_info.master_address,
                init_info.master_port,
                1,
                init_info.world_size,
                init_info.torch_backend,
                init_info.timeout_s,
            )
            # the server joins inside its /init_weight_transfer_engine call: run it beside our own join
            engine.group = _beside(
                lambda: client.init_weight_transfer_engine(asdict(info)),
                lambda: open_group(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    init_info.timeout_s,
                    init_info.torch_backend,
                    init_info.listen_socket,
                ),
                init_info.timeout_s,
            )
            return engine

        def send_weights(self, weights) -> None:
            """One update: `weights` a list of (checkpoint name, full tensor)."""
            names = [n for n, _ in weights]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in weights]
            info = UpdateInfo(names, dtypes, [list(t.shape) for _, t in weights])
            self.client.start_weight_update()
            device = "cuda" if self.torch_backend == "nccl" else "cpu"

            def send() -> None:
                for _, t in weights:
                    t = t.detach().to(device).contiguous().view(-1).view(torch.uint8)
                    broadcast(self.group, t, self.timeout_s)

            _beside(lambda: self.client.update_weights(asdict(info)), send, self.timeout_s)
            self.client.finish_weight_update()

        def shutdown(self) -> None:
            _destroy(self.group)
            self.group = None

    return WorkerWeightTransferEngine, TrainerEngine, TrainerInit


def _destroy(group) -> None:
    if group is not None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        try:
            stateless_destroy_torch_distributed_process_group(group)
        except Exception:  # noqa: BLE001 - a group whose peer died may refuse a clean shutdown
            pass


def _beside(remote, local, timeout_s: float):
    """Runs `remote` (an HTTP call that returns when the server is done) in a thread while `local` runs here; waits
    for it with a timeout and never joins a thread stuck on a dead peer. Returns local's result."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(remote)
        result = local()
        future.result(timeout=timeout_s)
        return result
    finally:
        pool.shutdown(wait=False)


def register_backend() -> None:
    """Registers "torch_pg" with vLLM's weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    worker, trainer, _ = _engine_classes()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, worker)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, trainer)


class WorkerExtension:
    """tools/vllm_server.py's --worker-extension-cls: importing this module in each server worker registers the
    "torch_pg" backend and keeps the CPU GEMMs' weights (before the model is loaded), so pushes reach them."""


if os.environ.get("RL_VLLM_SERVER_WORKER") == "1":  # set by tools/vllm_server.py for its worker processes
    register_backend()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        keep_cpu_linear_weights()


class _SyncClient:
    """The weight-sync client protocol vLLM's trainer engines call (vllm/distributed/weight_transfer/base.py), over
    the sampler's bounded HTTP calls."""

    def __init__(self, sampler: ServerSampler):
        self.call = sampler._call

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("post", "init_weight_transfer_engine", "joining the weight-transfer group", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("post", "start_weight_update", "starting a weight push")

    def update_weights(self, update_info: dict) -> None:
        self.call("post", "update_weights", "receiving pushed weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.call("post", "finish_weight_update", "finishing a weight push")


def closed_before_answering(error: BaseException) -> bool:
    """Whether a request failed because the server closed its connection without answering: a kept-alive connection
    from the session's pool that the server (uvicorn: after 5 idle seconds) closed just as the request went out. The
    server saw no request, so it goes again once, on a fresh connection (urllib3 retries such a request only for
    idempotent methods; generation is a POST)."""
    from http.client import RemoteDisconnected

    seen = set()
    while error is not None and id(error) not in seen:  # the chain of wrapped errors, each once
        if isinstance(error, RemoteDisconnected):
            return True
        seen.add(id(error))
        nested = [a for a in error.args if isinstance(a, BaseException)]
        error = nested[-1] if nested else error.__cause__
    return False


class ServerError(SystemExit):
    """A call to the server failed or timed out: one line naming the server and what the trainer was doing."""


class ServerSampler:
    """The Sampler interface (common.sampling) over HTTP to tools/vllm_server.py at host:port.

    `generate` sends one request per prompt, all at once (the server batches them), with the in-process engine's
    sampling parameters and per-prompt seeds, so a colocated and a server run sample alike. `submit` does the same
    in a background thread and returns a future (--off-policy-steps: the next rollout is generated while this one
    trains). `update_weights` (every rank calls it) pushes the model's full weights from rank 0 after the in-flight
    requests finished (/pause?mode=wait), and every rank waits until it is done. `state_dict` is the call counter
    that seeds the requests (as VLLMSampler's).

    With an environment (`env`, common/env.py; or `tool`, whose output blocks `tokenizer` encodes): a rollout's
    episodes run in rounds (common.env.run_episodes, in the rollout's thread), a round's requests all at once (each
    episode's prompt and tokens so far, seeded as the colocated engine's), the environment's answers beside the
    server's generation (the server only generates; tools/vllm_server.py needs nothing for an environment)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        seed: int,
        timeout: float,
        stop=(),
        rank=0,
        world=1,
        tool: ToolConfig | None = None,
        tokenizer=None,
        env: Env | None = None,
    ):
        import requests

        if tool is not None and tokenizer is None:
            raise ValueError("the tool needs the tokenizer, which encodes its output blocks")
        self.url, self.timeout, self.seed, self.stop = f"http://{host}:{port}", timeout, seed, list(stop)
        self.rank, self.world, self.calls, self.pushes = rank, world, 0, 0
        self.http = requests.Session()
        self.pool = ThreadPoolExecutor(max_workers=64)  # the requests of a rollout, one per prompt
        self.waiter = ThreadPoolExecutor(max_workers=4)  # a rollout's future: waits for its requests
        # the environment its episodes run in: the run's (common.env.open_env), or a tool of its own (`tool`)
        self.env = env if env is not None else Tool(tool, tokenizer) if tool is not None else None
        self.tokenizer = tokenizer
        self.pending: list[Future] = []
        self.lock = threading.Lock()
        self.engine = None
        self.model = self._call("get", "v1/models", "reading the served model")["data"][0]["id"]

    # HTTP ------------------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, doing: str, body=None, params=None):
        import requests

        for attempt in (1, 2):
            try:
                r = self.http.request(method, f"{self.url}/{path}", json=body, params=params, timeout=self.timeout)
                break
            except requests.RequestException as e:
                if attempt == 1 and closed_before_answering(e):  # a pooled connection the server closed when idle
                    continue
                raise ServerError(f"--vllm-server-host {self.url}: {doing} failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ServerError(f"--vllm-server-host {self.url}: {doing} failed: HTTP {r.status_code}: {r.text[:200]}")
        return r.json() if r.content else None

    # Sampler ---------------------------------------------------------------------------------------------------
    def submit(self, prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks=None) -> Future:
        """Starts generating in the background; the future's result is `generate`'s."""
        check_request(prompt_token_ids, n, max_new_tokens)
        call, self.calls = self.calls, self.calls + 1
        if self.env is not None:
            args = (prompt_token_ids, n, temperature, top_p, max_new_tokens, call, tasks)
            result = self.waiter.submit(self._episodes, *args)
        else:
            futures = [
                self.pool.submit(self._one, p, i, call, n, temperature, top_p, max_new_tokens)
                for i, p in enumerate(prompt_token_ids)
            ]
            result = self.waiter.submit(lambda: [c for f in futures for c in f.result()])
        with self.lock:
            self.pending = [f for f in self.pending if not f.done()] + [result]
        return result

    def generate(self, prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks=None) -> list[Completion]:
        return self.submit(prompt_token_ids, n, temperature, top_p, max_new_tokens, tasks).result()

    def _params(self, n: int, temperature: float, top_p: float, max_tokens: int, stop, seed: int) -> dict:
        """The in-process engine's sampling parameters (common.vllm_sampler), as the server's JSON."""
        greedy = temperature <= 0
        return {
            "n": n,
            "temperature": 0.0 if greedy else temperature,
            "top_p": 1.0 if greedy else top_p,
            "top_k": 0,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "seed": seed,
            "stop": list(stop) or None,
            "include_stop_str_in_output": True,
            "skip_special_tokens": True,
            "detokenize": True,
        }

    def _generate(self, token_ids: list[int], params: dict) -> list[dict]:
        """One POST /inference/v1/generate: its choices, in order, each checked to have finished."""
        body = {"token_ids": list(token_ids), "sampling_params": params, "output_mode": "text", "model": self.model}
        out = self._call("post", "inference/v1/generate", "generating", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        for c in choices:
            if c["finish_reason"] not in ("stop", "length"):
                raise ServerError(f"--vllm-server-host {self.url}: a request ended with {c['finish_reason']!r}")
        return choices

    def _one(self, prompt, i, call, n, temperature, top_p, max_new_tokens) -> list[Completion]:
        greedy = temperature <= 0
        rows = 1 if greedy else n
        params = self._params(
            rows, temperature, top_p, max_new_tokens, self.stop, request_seed(self.seed, call, i, rows)
        )
        completions = []
        for c in self._generate(prompt, params):
            logprobs = [e["logprob"] for e in c["logprobs"]["content"]]
            comp = Completion(c["token_ids"], c.get("text") or "", c["finish_reason"] == "length", logprobs)
            completions += [comp] if not greedy else [copy_completion(comp) for _ in range(n)]
        return completions

    def _episodes(self, prompts, n, temperature, top_p, max_new_tokens, call, tasks) -> list[Completion]:
        """A rollout with the environment (in the waiter's thread): common.env.run_episodes over rounds of
        `_round`, each episode's requests seeded as the colocated engine's (`episode_seed`)."""
        rows = 1 if temperature <= 0 else n

        def seed(ep) -> int:
            return episode_seed(self.seed, call, ep.prompt, ep.sample, ep.waves, rows)

        def generate(requests: list[Request], finished, stopped) -> None:
            futures = {
                self.pool.submit(self._segment, r, temperature, top_p): i for i, r in enumerate(requests)
            }  # all at once: the server batches them
            for future in as_completed(futures):
                finished(futures[future], future.result())

        episodes = run_episodes(self.env, prompts, rows, max_new_tokens, self.stop, generate, seed, tasks)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        return episode_completions(self.env, episodes, decode, self.stop, n // rows)

    def _segment(self, r: Request, temperature: float, top_p: float) -> Segment:
        """One request of an episode's round, as a Segment."""
        (c,) = self._generate(r.prefix, self._params(1, temperature, top_p, r.max_tokens, r.stop, r.seed))
        logprobs = [e["logprob"] for e in c["logprobs"]["content"]]
        stop = c.get("stop_reason") if isinstance(c.get("stop_reason"), str) else None
        return Segment(c["token_ids"], logprobs, c.get("text") or "", stop, c["finish_reason"] == "length")

    def update_weights(self, model: nn.Module) -> None:
        """Rank 0 pushes `model`'s weights (iter_weight_buckets: full tensors under checkpoint names, gathered over
        the ranks under FSDP / ZeRO-3, so every rank iterates them); all ranks wait until the server has them."""
        for future in self.pending:  # the rollouts generating now are the current policy's
            future.result()
        weights = [item for bucket in iter_weight_buckets(model) for item in bucket]
        if self.rank == 0:
            self._connect()
            self._call("post", "pause", "pausing generation for a weight push", params={"mode": "wait"})
            try:
                self.engine.send_weights(weights)
            except (RuntimeError, TimeoutError) as e:  # a broken group: the server stays paused
                raise ServerError(f"--vllm-server-host {self.url}: pushing weights failed: {e}") from None
            self.pushes += 1
            self._call(
                "post", "update_weight_version", "naming the pushed weights", {"new_version": f"push{self.pushes}"}
            )
            self._call("post", "reset_prefix_cache", "resetting the prefix cache")
            self._call("post", "resume", "resuming generation")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank samples before the push is complete

    def _connect(self) -> None:
        """Rank 0 joins the server's weight-transfer group once (any group an earlier trainer left is shut)."""
        if self.engine is not None:
            return
        _, trainer, init_info = _engine_classes()
        self._call("post", "shutdown_weight_transfer_engine", "closing an earlier trainer's group")
        workers = self._call("get", "get_world_size", "reading the server's world size")["world_size"]
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((self.own_address(), 0))  # a free port, held from now on (no race for it)
        listener.listen()
        host, port = listener.getsockname()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        info = init_info(host, port, workers + 1, backend, self.timeout, listener, rank=0)
        try:
            self.engine = trainer.trainer_init(info, client=_SyncClient(self))
        except (RuntimeError, TimeoutError) as e:
            raise ServerError(f"--vllm-server-host {self.url}: joining the weight-transfer group failed: {e}") from None

    def own_address(self) -> str:
        """This machine's address on the route to the server (what the server's workers connect to)."""
        host = self.url.split("//")[1].rsplit(":", 1)[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # UDP: nothing is sent
            s.connect((host, 9))
            return s.getsockname()[0]

    def sleep(self) -> None:
        """No-op: the server's memory is its own."""

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def close(self) -> None:
        """Leaves the weight-transfer group (the server stays up for the next trainer)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.waiter.shutdown(wait=False, cancel_futures=True)
        if self.env is not None:
            self.env.close()
            self.env = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def wait_until_healthy(url: str, timeout: float) -> float:
    """Seconds until GET url/health answers 200; TimeoutError after `timeout`."""
    import requests

    start = time.time()
    while time.time() - start < timeout:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.time() - start
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")
