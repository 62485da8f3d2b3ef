"""Time and peak memory of the output layer -> per-token log-probs + entropy -> loss -> backward path.

    python benchmarks/bench_logprob.py                 # writes benchmarks/results/logprob_<device>_V<vocabs>_chunk<c>.md
    python benchmarks/bench_logprob.py --vocab 32768 --tokens 4096 --methods naive ours

Methods (all fp32 master weights, same inputs, loss = token mean of -logp * adv):
  naive  full [tokens x vocab] fp32 logits, log_softmax, gather, entropy from the full distribution
  trl    full fp32 logits, TRL's `selective_log_softmax` + `entropy_from_logits` (if trl is installed)
  ours   common.loss.chunked_logprobs: chunks of `--chunk` rows, logits recomputed in the backward

Each (method, vocab, tokens) runs in a fresh subprocess. Peak memory is the process's peak resident set
size (getrusage ru_maxrss) after the run minus the same figure right after the inputs were allocated: the
extra memory the path needs on top of hidden states and weights. Time is the median of --repeats runs after
one warm-up. Configurations whose full logits would exceed --max-logits-gib are skipped for naive/trl.
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


def run_one(method: str, vocab: int, tokens: int, hidden: int, chunk: int, repeats: int) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from common.loss import chunked_logprobs

    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden) * 0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    adv = torch.randn(tokens)
    if method == "trl":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def step():
        if method == "ours":
            logps, entropy = chunked_logprobs(h, w, targets, 1.0, chunk)
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

    base = peak_rss_mib()
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"time_s": statistics.median(times), "peak_extra_mib": peak_rss_mib() - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B's hidden size")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["naive", "trl", "ours"])
    p.add_argument("--max-logits-gib", type=float, default=4.0)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        method, vocab, tokens = a.one.split(",")
        print(json.dumps(run_one(method, int(vocab), int(tokens), a.hidden, a.chunk, a.repeats)))
        return
    rows = []
    for vocab in a.vocab:
        for tokens in a.tokens:
            res = {}
            for m in a.methods:
                if m != "ours" and tokens * vocab * 4 / 2**30 > a.max_logits_gib:
                    res[m] = None
                    continue
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
                out = subprocess.run([sys.executable, __file__, "--one", f"{m},{vocab},{tokens}", "--hidden", str(a.hidden),
                                      "--chunk", str(a.chunk), "--repeats", str(a.repeats)], capture_output=True, text=True, env=env)
                res[m] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
                if out.returncode != 0:
                    print(f"{m} V={vocab} T={tokens} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            rows.append((vocab, tokens, res))
            print(vocab, tokens, res, file=sys.stderr)
    fmt = lambda r, k, f: "skipped" if r is None else f.format(r[k])  # noqa: E731
    lines = ["| vocab | tokens | " + " | ".join(f"{m} time (s)" for m in a.methods) + " | " + " | ".join(f"{m} peak extra (MiB)" for m in a.methods) + " | ours / naive memory |",
             "|---" * (2 + 2 * len(a.methods) + 1) + "|"]
    for vocab, tokens, res in rows:
        ratio = "-" if not res.get("naive") or not res.get("ours") else f"{res['ours']['peak_extra_mib'] / res['naive']['peak_extra_mib']:.3f}"
        lines.append(f"| {vocab} | {tokens} | " + " | ".join(fmt(res.get(m), "time_s", "{:.3f}") for m in a.methods) + " | "
                     + " | ".join(fmt(res.get(m), "peak_extra_mib", "{:.0f}") for m in a.methods) + f" | {ratio} |")
    table = "\n".join(lines)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    header = f"hidden {a.hidden}, chunk {a.chunk}, fp32, {os.cpu_count()} CPU threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n\n"
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = f"logprob_{device}_V{'_'.join(str(v) for v in a.vocab)}_chunk{a.chunk}.md"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
