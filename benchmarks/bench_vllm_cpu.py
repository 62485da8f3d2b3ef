"""Tokens per second of the project's vLLM sampler against a standalone vLLM engine on the same model and requests
(CPU, vLLM's CPU build), of the sampler with vLLM's packed GEMMs turned off (F.linear on the live weights,
this project's CPU route before it repacked after each push), and of HF generate (`--sampler hf`).

    python tools/smollm2.py /tmp/smol && python benchmarks/bench_vllm_cpu.py /tmp/smol/model --rounds 3

Each side builds its engine in its own process (an in-process engine joins torch.distributed and patches torch),
then generates --prompts chat prompts x --n samples of at most --new-tokens at temperature 1, once to
warm up and --steps times measured (both stop at EOS: the same model at the same temperature, so the same length
distribution; tokens/s counts the tokens each produced); ours pushes its weights between steps, as training does, and
the push is timed apart. Sides alternate for --rounds so load on a shared machine hits all of them. Writes
benchmarks/results/vllm_cpu_<model>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    "Tom has 7 apples and gets 5 more. How many apples does Tom have now?",
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "Ana has 20 coins and gives away 8. How many coins does Ana have left?",
]


def worker(side: str, model: str, a) -> dict:
    """Runs in a subprocess: builds one engine, returns generation seconds per step and tokens per step."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(a.prompts)]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    times, tokens, pushes = [], [], []
    if side == "standalone":
        import psutil
        from vllm import LLM, SamplingParams

        kv = int(0.05 * psutil.virtual_memory().total)  # the KV cache ours gets (gpu_memory_utilization 0.05)
        llm = LLM(
            model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024, gpu_memory_utilization=0.3,
            kv_cache_memory_bytes=kv,
        )  # fmt: skip
        params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.new_tokens, logprobs=0)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        for step in range(a.steps + 1):
            t = time.perf_counter()
            out = llm.generate(reqs, params, use_tqdm=False)
            if step:
                times.append(time.perf_counter() - t)
                tokens.append(sum(len(c.token_ids) for o in out for c in o.outputs))
    elif side == "hf":  # HF generate on the live policy (what --sampler auto picks on a CPU)
        from common.sampling import HFSampler

        s = HFSampler(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), tok, seed=0)
        for step in range(a.steps + 1):
            t = time.perf_counter()
            out = s.generate(prompts, a.n, 1.0, 1.0, a.new_tokens)
            if step:
                times.append(time.perf_counter() - t)
                tokens.append(sum(len(c.token_ids) for c in out))
    else:
        from common import sampling

        if side == "ours-unpacked":  # the former CPU route: F.linear on the live weights, no packed GEMMs
            from vllm.model_executor.layers import utils as layer_utils

            original = layer_utils.dispatch_cpu_unquantized_gemm

            def plain(layer, remove_weight):
                if layer.weight.is_meta or layer.weight.ndim != 2:
                    return original(layer, remove_weight)
                layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

            sampling._keep_cpu_linear_weights = lambda: setattr(layer_utils, "dispatch_cpu_unquantized_gemm", plain)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        s = sampling.VLLMSampler(model, seed=0, gpu_memory_utilization=0.05, max_model_len=1024)
        s.stop = []
        for step in range(a.steps + 1):
            t = time.perf_counter()
            out = s.generate(prompts, a.n, 1.0, 1.0, a.new_tokens)
            dt = time.perf_counter() - t
            t = time.perf_counter()
            s.update_weights(policy)
            if step:
                times.append(dt)
                tokens.append(sum(len(c.token_ids) for c in out))
                pushes.append(time.perf_counter() - t)
    return {"tok_per_s": statistics.median(n / t for n, t in zip(tokens, times)), "tokens": tokens, "push": pushes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a Hugging Face checkpoint directory (e.g. tools/smollm2.py's OUT_DIR/model)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sides", default="standalone,ours,ours-unpacked,hf")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.model, a)))
        return
    sides = a.sides.split(",")
    results: dict[str, list[dict]] = {s: [] for s in sides}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for r in range(a.rounds):
        for side in sides:
            cmd = [sys.executable, os.path.abspath(__file__), a.model, "--worker", side]
            cmd += ["--prompts", str(a.prompts), "--n", str(a.n), "--new-tokens", str(a.new_tokens)]
            cmd += ["--steps", str(a.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            results[side].append(json.loads(line[0][7:]))
            print(f"round {r + 1} {side}: {results[side][-1]['tok_per_s']:.1f} tokens/s", flush=True)
    import torch
    import vllm

    med = {s: statistics.median(x["tok_per_s"] for x in results[s]) for s in sides}
    base = med.get("standalone")
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads, torch {torch.__version__}, vllm {vllm.__version__}"
        f" (CPU build); {os.path.basename(a.model.rstrip('/'))}, fp32, {a.prompts} prompts x n={a.n}, "
        f"{a.new_tokens} new tokens, temperature 1, {a.steps} measured steps x {a.rounds} rounds",
        "",
        "| side | tokens/s per round | median | / standalone | weight push (s, median) |",
        "|---|---|---|---|---|",
    ]
    for s in sides:
        per = ", ".join(f"{x['tok_per_s']:.1f}" for x in results[s])
        pushes = [t for x in results[s] for t in x["push"]]
        ratio = f"{med[s] / base:.2f}" if base else "-"
        push = f"{statistics.median(pushes):.2f}" if pushes else "-"
        lines.append(f"| {s} | {per} | {med[s]:.1f} | {ratio} | {push} |")
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = f"vllm_cpu_{os.path.basename(os.path.dirname(os.path.abspath(a.model)))}.md"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
