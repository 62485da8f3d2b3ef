"""Step time of cppo.py against grpo.py at P = 0.5 and P = 0.75, as ratios within one invocation, with the held-out
accuracy beside it, on SmolLM2-135M-Instruct (vLLM's CPU build as the sampler).

    python tools/smollm2.py /tmp/smol
    python benchmarks/bench_cppo.py /tmp/smol --seeds 1,2,3                  # ~1 hour on 2 busy cores
    python benchmarks/bench_cppo.py /tmp/smol --seeds 1 --allocation        # also cppo.py with --allocation

Every side runs benchmarks/real_model.py's setting (G = 8, 4 prompts a step, 64 new tokens, T = 0.7, lr 1e-5, 10
steps, vLLM, avg@2 on 48 held-out questions after the last step) with CPPO's training recipe on both sides, so that
the passes pruning removes are there: 2 updates per rollout (`--ppo-epochs 2`, the official num_iterations: old
log-probs are computed) and the KL to a reference model (β = 0.04: reference log-probs). cppo.py runs without
--allocation (the same rollout as grpo.py, so the ratio is the pruning's alone); --allocation adds cppo.py at
P = 0.5 with it (twice the prompts sampled, GRPO's batch kept). For each seed the sides run back to back in an order
rotated by the seed, so that load on a shared machine falls on all of them.

Reported per side: the median over a run's steps 2-10 of time/step, of time/old_logprobs + time/train (what pruning
shrinks) and of time/generate (what it does not), each as a ratio to grpo.py's run of the same seed, mean ± 95%
interval over the seeds (tools/compare.py's mean_ci); the held-out avg@2 per seed. Run directories land in
OUT/bench_cppo/ and finished ones are reused; the table goes to benchmarks/results/ (--results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
RECIPE = ["--beta", "0.04", "--ppo-epochs", "2"]  # lzhxmu/CPPO's recipes: beta 0.04, num_iterations 2


def phase_medians(run_dir: str) -> dict[str, float]:
    """Median seconds over the steps after the first (its first step builds caches) of the whole step, of the phases
    pruning shrinks and of generation."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
    return {
        "step": statistics.median(r["time/step"] for r in rows),
        "train": statistics.median(r["time/old_logprobs"] + r["time/train"] for r in rows),
        "generate": statistics.median(r["time/generate"] for r in rows),
    }


def main() -> None:
    from compare import mean_ci
    from real_model import common_flags, final_eval, run

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", help="tools/smollm2.py's OUT_DIR (model/, train.jsonl, test.jsonl)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-limit", type=int, default=48)
    p.add_argument("--eval-k", type=int, default=2)
    p.add_argument("--sampler", default="vllm")
    p.add_argument("--allocation", action="store_true", help="also cppo.py --pruning 0.5 with --allocation")
    p.add_argument("--results", default="cppo_step.md", help="the table's file in benchmarks/results/")
    a = p.parse_args()
    sides = [
        ("grpo", "grpo", []),
        ("cppo P=0.5", "cppo", ["--pruning", "0.5", "--no-allocation"]),
        ("cppo P=0.75", "cppo", ["--pruning", "0.75", "--no-allocation"]),
    ]
    sides += [("cppo P=0.5 --allocation", "cppo", ["--pruning", "0.5", "--allocation"])] if a.allocation else []
    out = os.path.join(a.data, "bench_cppo")
    base = [*common_flags(a.data, a), *RECIPE, "--model-name-or-path", os.path.join(a.data, "model")]
    base += ["--total-steps", str(a.steps), "--eval-every", str(a.steps), "--output-dir", out]
    seeds, t0 = [int(s) for s in a.seeds.split(",")], time.time()
    results: dict[str, list[tuple[dict, float]]] = {name: [] for name, _, _ in sides}
    for seed in seeds:
        order = sides[seed % len(sides) :] + sides[: seed % len(sides)]
        for name, script, extra in order:
            exp = name.replace(" ", "_").replace("=", "").replace("--", "")
            run_dir = run(script, [*base, *extra, "--seed", str(seed), "--exp-name", exp])
            results[name].append((phase_medians(run_dir), final_eval(run_dir)[0]))
            print(f"{name}, seed {seed}: {results[name][-1]}", flush=True)

    def ratio(name: str, key: str) -> str:
        m, h = mean_ci([r[key] / g[key] for (r, _), (g, _) in zip(results[name], results["grpo"])])
        return f"{m:.2f}" + (f" ± {h:.2f}" if len(seeds) > 1 else "")

    import torch

    lines = [
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads, torch {torch.__version__}; "
        f"benchmarks/bench_cppo.py {a.data} --seeds {a.seeds}{' --allocation' if a.allocation else ''}: "
        f"SmolLM2-135M-Instruct, {a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, T={a.temperature}, "
        f"lr {a.lr}, {a.steps} steps, sampler {a.sampler}, beta 0.04, 2 updates per rollout; eval avg@{a.eval_k} on "
        f"{a.eval_limit} held-out questions; this invocation {(time.time() - t0) / 60:.0f} min (finished runs reused)",
        "",
        "| side | s/step | ratio | old log-probs + train, s | ratio | generate, s | ratio | eval avg@2 per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, _, _ in sides:
        med = {k: statistics.median(r[k] for r, _ in results[name]) for k in ("step", "train", "generate")}
        accs = ", ".join(f"{acc:.3f}" for _, acc in results[name])
        cells = [f"{med[k]:.1f} | {ratio(name, k)}" for k in ("step", "train", "generate")]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {accs} |")
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", a.results), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
