"""Time and peak memory of the output layer -> per-token log-probs + entropy -> loss -> backward path.

    python benchmarks/bench_logprob.py              # writes benchmarks/results/logprob_<device>_V<vocabs>_chunk<c>.md
    python benchmarks/bench_logprob.py --vocab 32768 --tokens 4096 --methods naive ours

Methods (weights and hidden states in --dtype, fp32 by default; same inputs; loss = token mean of -logp * adv):
  naive  full [tokens x vocab] fp32 logits, log_softmax, gather, entropy from the full distribution
  trl    full fp32 logits, TRL's `selective_log_softmax` + `entropy_from_logits` (if trl is installed)
  ours   common.logprobs.chunked_logprobs: chunks of `--chunk` rows, logits recomputed in the backward
  triton ours with kernel="triton": the fused Triton forward (common/triton_logprobs.py), same backward;
         CUDA only (skipped with a note on a CPU)

Everything runs on CUDA when it is available, else on the CPU. Each (method, vocab, tokens) runs in a fresh
subprocess. Peak memory is the extra memory the path needs on top of hidden states and weights: on a CPU the
process's peak resident set size (getrusage ru_maxrss) after the run minus the same figure right after the
inputs were allocated; on CUDA torch.cuda.max_memory_allocated minus the memory allocated after the inputs.
Time is the median of --repeats runs after one warm-up. Configurations whose full logits would exceed
--max-logits-gib are skipped for naive/trl.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(method: str, vocab: int, tokens: int, hidden: int, chunk: int, repeats: int, dtype: str) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from common.logprobs import chunked_logprobs

    cuda = torch.cuda.is_available()
    device, dt = ("cuda" if cuda else "cpu"), getattr(torch, dtype)
    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden, device=device) * 0.5).to(dt).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device) * 0.02).to(dt).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    adv = torch.randn(tokens, device=device)
    if method == "trl":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def step():
        if method in ("ours", "triton"):
            logps, entropy = chunked_logprobs(
                h, w, targets, 1.0, chunk, kernel="torch" if method == "ours" else "triton"
            )
        else:
            logits = (h @ w.T).float()
            if method == "naive":
                logp_all = torch.log_softmax(logits, -1)
                logps = logp_all.gather(-1, targets[:, None]).squeeze(-1)
                entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
            else:
                logps = selective_log_softmax(logits, targets)
                with torch.no_grad():
                    entropy = entropy_from_logits(logits)
        loss = -(logps * adv).mean()
        loss.backward()
        h.grad = w.grad = None
        return entropy

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**20 if cuda else peak_rss_mib()
    step()  # warm-up (and Triton's compilation)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
    return {"time_s": statistics.median(times), "peak_extra_mib": peak - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B's hidden size")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="hidden states and weights")
    p.add_argument("--methods", nargs="+", default=["naive", "trl", "ours", "triton"])
    p.add_argument("--max-logits-gib", type=float, default=4.0)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        method, vocab, tokens = a.one.split(",")
        print(json.dumps(run_one(method, int(vocab), int(tokens), a.hidden, a.chunk, a.repeats, a.dtype)))
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and "triton" in a.methods:
        print("note: skipping method 'triton': the fused Triton kernel needs CUDA", file=sys.stderr)
        a.methods = [m for m in a.methods if m != "triton"]
    rows = []
    for vocab in a.vocab:
        for tokens in a.tokens:
            res = {}
            for m in a.methods:
                if m not in ("ours", "triton") and tokens * vocab * 4 / 2**30 > a.max_logits_gib:
                    res[m] = None
                    continue
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        f"{m},{vocab},{tokens}",
                        "--hidden",
                        str(a.hidden),
                        "--chunk",
                        str(a.chunk),
                        "--repeats",
                        str(a.repeats),
                        "--dtype",
                        a.dtype,
                    ],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                res[m] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
                if out.returncode != 0:
                    print(f"{m} V={vocab} T={tokens} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            rows.append((vocab, tokens, res))
            print(vocab, tokens, res, file=sys.stderr)
    fmt = lambda r, k, f: "skipped" if r is None else f.format(r[k])  # noqa: E731
    lines = [
        "| vocab | tokens | "
        + " | ".join(f"{m} time (s)" for m in a.methods)
        + " | "
        + " | ".join(f"{m} peak extra (MiB)" for m in a.methods)
        + " | ours / naive memory |",
        "|---" * (2 + 2 * len(a.methods) + 1) + "|",
    ]
    for vocab, tokens, res in rows:
        ratio = (
            "-"
            if not res.get("naive") or not res.get("ours")
            else f"{res['ours']['peak_extra_mib'] / res['naive']['peak_extra_mib']:.3f}"
        )
        lines.append(
            f"| {vocab} | {tokens} | "
            + " | ".join(fmt(res.get(m), "time_s", "{:.3f}") for m in a.methods)
            + " | "
            + " | ".join(fmt(res.get(m), "peak_extra_mib", "{:.0f}") for m in a.methods)
            + f" | {ratio} |"
        )
    table = "\n".join(lines)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} CPU threads"
    header = (
        f"hidden {a.hidden}, chunk {a.chunk}, {a.dtype}, {where}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n\n"
    )
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    suffix = "" if a.dtype == "float32" else f"_{a.dtype}"
    name = f"logprob_{device}_V{'_'.join(str(v) for v in a.vocab)}_chunk{a.chunk}{suffix}.md"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
