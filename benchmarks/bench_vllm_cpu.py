"""Tokens per second of the project's vLLM sampler against a standalone vLLM engine on the same model and prompts
(CPU, vLLM's CPU build), with the difference split into its factors.

    python tools/smollm2.py /tmp/smol && python benchmarks/bench_vllm_cpu.py /tmp/smol/model --rounds 3

Sides, each in its own process (an in-process engine joins torch.distributed and patches torch), each with variants
that alternate step by step inside that process (so their ratio is measured under the same load):

- standalone: `LLM(model, dtype="float32", enforce_eager=True)`, vLLM's CPU defaults (engine core and worker in
  their own processes, chunked prefill on), KV cache as large as ours. Variants: `bare`, `SamplingParams(n,
  temperature, max_tokens)` only; `same work`, the SamplingParams `VLLMSampler` sends (a seed per request, the
  sampled token's log-prob, `top_k=0`, detokenised text).
- standalone-cfg: the same multi-process engine with `VLLMSampler`'s engine settings (chunked prefill off,
  `max_num_batched_tokens`, `logprobs_mode="processed_logprobs"`), `same work` requests.
- ours: `VLLMSampler` (in-process, `external_launcher`; vLLM's packed CPU GEMMs packed again after each push),
  pushing the policy's weights after every generate, as training does; the push is timed apart. Variants: its
  default generation threads (`cpu_threads=None`) and the trainer's thread count (the former behaviour).
- ours-unpacked (not run by default): F.linear on the live weights, the CPU route before the repacking.
- hf (not run by default): HF generate on the live policy (`--sampler hf`).

Each variant generates --prompts chat prompts x --n samples of at most --new-tokens at temperature 1, once to
warm up and --steps times measured; all stop at EOS (same model, same temperature: the same length
distribution; tokens/s counts the tokens each produced). Sides alternate for --rounds. Writes
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
SIDES = {  # side: (variants, what it is)
    "standalone": (["bare", "same work"], "standalone `LLM(...)`, vLLM's CPU defaults (multi-process)"),
    "standalone-cfg": (["same work"], "standalone, multi-process, with `VLLMSampler`'s engine settings"),
    "ours": (["default", "trainer's threads"], "`VLLMSampler` (in-process), weights pushed after every step"),
    "ours-unpacked": (["default"], "`VLLMSampler` with F.linear on the live weights (former CPU route)"),
    "hf": (["default"], "HF generate on the live policy (`--sampler hf`)"),
}
MAX_MODEL_LEN = 1024
KV_FRACTION = 0.05  # the KV cache every side gets: this fraction of the machine's memory


def worker(side: str, model: str, a) -> dict:
    """Runs in a subprocess: builds one engine, returns per variant the seconds and tokens of each measured step."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common import vllm_sampler as sampling
    from common.hf_sampler import HFSampler

    tok = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(a.prompts)]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    variants = SIDES[side][0]
    pushes: dict[str, list[float]] = {v: [] for v in variants}  # seconds per weight push (ours), per variant
    if side.startswith("standalone"):
        from vllm import LLM, SamplingParams

        kwargs = dict(model=model, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.3)
        kwargs.update(sampling.cpu_engine_defaults(MAX_MODEL_LEN, KV_FRACTION))  # enforce_eager, KV cache bytes
        if side == "standalone":  # vLLM's own scheduling defaults
            del kwargs["enable_chunked_prefill"], kwargs["max_num_batched_tokens"]
        else:
            kwargs.update(enable_prefix_caching=True, logprobs_mode="processed_logprobs")
        llm = LLM(**kwargs)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        bare = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.new_tokens)
        calls = {v: 0 for v in variants}

        def generate(variant: str) -> tuple[int, float]:
            if variant == "bare":
                params = bare
            else:  # what VLLMSampler.generate sends for its call number calls[variant]
                params = sampling.sampling_params(0, calls[variant], len(prompts), a.n, 1.0, 1.0, a.new_tokens, [])
            calls[variant] += 1
            t = time.perf_counter()
            out = llm.generate(reqs, params, use_tqdm=False)
            dt = time.perf_counter() - t
            llm.reset_prefix_cache()  # as ours after each push: no prompt KV carried over from the last step
            return sum(len(c.token_ids) for o in out for c in o.outputs), dt

    elif side == "hf":
        s = HFSampler(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), tok, seed=0)

        def generate(variant: str) -> tuple[int, float]:
            t = time.perf_counter()
            out = s.generate(prompts, a.n, 1.0, 1.0, a.new_tokens)
            return sum(len(c.token_ids) for c in out), time.perf_counter() - t

    else:
        if side == "ours-unpacked":  # the former CPU route: F.linear on the live weights, no packed GEMMs
            from vllm.model_executor.layers import utils as layer_utils

            original = layer_utils.dispatch_cpu_unquantized_gemm

            def plain(layer, remove_weight):
                if layer.weight.is_meta or layer.weight.ndim != 2:
                    return original(layer, remove_weight)
                layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

            sampling.keep_cpu_linear_weights = lambda: setattr(layer_utils, "dispatch_cpu_unquantized_gemm", plain)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        s = sampling.VLLMSampler(model, seed=0, gpu_memory_utilization=KV_FRACTION, max_model_len=MAX_MODEL_LEN)
        threads = torch.get_num_threads()

        def generate(variant: str) -> tuple[int, float]:
            s.cpu_threads = threads if variant == "trainer's threads" else None  # None: the sampler's own choice
            t = time.perf_counter()
            out = s.generate(prompts, a.n, 1.0, 1.0, a.new_tokens)
            dt = time.perf_counter() - t
            t = time.perf_counter()
            s.update_weights(policy)  # as training does after every step; timed apart
            pushes[variant].append(time.perf_counter() - t)
            return sum(len(c.token_ids) for c in out), dt

    times: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {v: [] for v in variants}
    for step in range(a.steps + 1):  # step 0 warms up every variant
        for v in variants:
            n_tokens, dt = generate(v)
            if step:
                times[v].append(dt)
                tokens[v].append(n_tokens)
    threads = (torch.get_num_threads(), sampling.generation_threads(None))  # the trainer's, ours' generate's
    push = {v: x[1:] for v, x in pushes.items()}  # without the warm-up step's
    return {"times": times, "tokens": tokens, "push": push, "threads": threads}


def tok_per_s(r: dict, v: str) -> float:
    return sum(r["tokens"][v]) / sum(r["times"][v])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a Hugging Face checkpoint directory (e.g. tools/smollm2.py's OUT_DIR/model)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sides", default="standalone,standalone-cfg,ours", help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--out", help="the results file (default: benchmarks/results/vllm_cpu_<parent dir of model>.md)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.model, a)))
        return
    sides = a.sides.split(",")
    if unknown := [s for s in sides if s not in SIDES]:
        raise SystemExit(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
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
            res = results[side]
            res.append(json.loads(line[0][7:]))
            per = ", ".join(f"{v} {tok_per_s(res[-1], v):.1f}" for v in SIDES[side][0])
            print(f"round {r + 1} {side}: {per} tokens/s", flush=True)
    table = report(a, sides, results)
    write(a.out or default_out(a.model), table)
    print(table)


def report(a, sides: list[str], results: dict[str, list[dict]]) -> str:
    import torch
    import vllm

    def med(side: str, v: str) -> float:
        return statistics.median(tok_per_s(x, v) for x in results[side])

    def ratios(side: str, v: str, ref_side: str, ref: str) -> list[float]:  # round by round; inside one process
        return [tok_per_s(x, v) / tok_per_s(y, ref) for x, y in zip(results[side], results[ref_side])]

    def factor(side: str, v: str, ref_side: str, ref: str) -> str:
        r = ratios(side, v, ref_side, ref)
        return f"**{statistics.median(r):.2f}** (rounds: {', '.join(f'{x:.2f}' for x in r)})"

    has = set(sides).__contains__
    base = ("standalone", "bare") if has("standalone") else None
    same = ("standalone", "same work") if has("standalone") else None
    train, gen = results["ours"][0]["threads"] if has("ours") else ("?", "?")
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores (torch threads: {train} the trainer's, {gen} ours' "
        f"generate's by default), torch "
        f"{torch.__version__}, vllm {vllm.__version__} (CPU build); {a.model}, fp32, "
        f"{a.prompts} chat prompts x n={a.n}, at most {a.new_tokens} new tokens, temperature 1; "
        f"{a.steps} measured steps per variant x {a.rounds} rounds (variants alternate step by step in one process, "
        "sides alternate round by round)",
        "",
        "| side | variant | tokens/s per round | median | / standalone bare | / standalone same work | push (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sides:
        for v in SIDES[s][0]:
            pushes = [t for x in results[s] for t in x["push"][v]]
            push = f"{statistics.median(pushes):.2f}" if pushes else "-"
            per = ", ".join(f"{tok_per_s(x, v):.1f}" for x in results[s])
            r1 = f"{statistics.median(ratios(s, v, *base)):.2f}" if base else "-"
            r2 = f"{statistics.median(ratios(s, v, *same)):.2f}" if same else "-"
            lines.append(f"| {s} | {v} | {per} | {med(s, v):.1f} | {r1} | {r2} | {push} |")
    lines += ["", "Sides: " + "; ".join(f"{s}: {SIDES[s][1]}" for s in sides) + ".", ""]
    lines += ["Factors (tokens/s ratios, median and round by round):"]
    if has("standalone"):
        r = factor("standalone", "same work", "standalone", "bare")
        lines.append(f"- per-request work (seeds, log-prob, text; and these seeds' lengths), standalone: {r}")
    if has("standalone") and has("standalone-cfg"):
        r = factor("standalone-cfg", "same work", "standalone", "same work")
        lines.append(f"- `VLLMSampler`'s engine settings (no chunked prefill, processed log-probs): {r}")
    if has("standalone-cfg") and has("ours"):
        r = factor("ours", "default", "standalone-cfg", "same work")
        lines.append(f"- in-process engine (`VLLMSampler`, its default threads) against multi-process: {r}")
    if has("ours"):
        r = factor("ours", "trainer's threads", "ours", "default")
        lines.append(f"- generating with the trainer's {train} threads instead of {gen} (the former behaviour): {r}")
    if has("standalone") and has("ours"):
        lines.append(f"- ours against standalone bare, all factors: {factor('ours', 'default', 'standalone', 'bare')}")
    return "\n".join(lines)


def default_out(model: str) -> str:
    name = f"vllm_cpu_{os.path.basename(os.path.dirname(os.path.abspath(model)))}.md"
    return os.path.join(ROOT, "benchmarks", "results", name)


def write(path: str, table: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
