"""A real model in a real multi-turn environment on a CPU: SmolLM2-135M-Instruct (tools/smollm2.py) playing one of
GEM's games (docs/environments.md), the held-out success rate before and after grpo.py, over several seeds, and the
time each step spends in the environment against generation.

    python tools/smollm2.py /tmp/smol
    python benchmarks/env_real_model.py /tmp/smol --seeds 1,2,3          # --env gem:game:GuessTheNumber-v0-easy

Every run: the qwen-boxed chat template (its system prompt asks for a \\boxed{} answer, the form GEM's games read),
G = --group-size episodes of at most --new-tokens tokens (the model's turns and the game's observations together) for
--prompts tasks per step at temperature --temperature, lr --lr, no KL, --steps steps, vLLM's CPU build as the sampler;
then avg@--eval-k (the share of won episodes) on --eval-tasks held-out tasks (seeds from 1,000,000 on) at the same
temperature and budget. "Before" is the same evaluation of the untrained model, once per seed (its sampler's seed).
Run directories land in OUT/env_bench/ and a rerun reuses the finished ones; the table goes to
benchmarks/results/env_real_model.md (--results). The defaults fit a shared 2-core CPU: 8 episodes a step (at 32
episodes of 256 tokens one step took 355 s there, 300 of them in the update).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags(a, model: str, out: str, seed: int, steps: int) -> list[str]:
    f = {
        "model-name-or-path": model,
        "env": a.env,
        "group-size": a.group_size,
        "prompts-per-step": a.prompts,
        "max-new-tokens": a.new_tokens,
        "max-prompt-tokens": 256,
        "temperature": a.temperature,
        "learning-rate": a.lr,
        "beta": 0,
        "total-steps": steps,
        "sampler": "vllm",
        "vllm-gpu-memory-utilization": 0.05,
        "save-every": 0,
        "eval-every": max(steps, 1),
        "env-eval-tasks": a.eval_tasks,
        "eval-samples": a.eval_k,
        "eval-temperature": a.temperature,
        "eval-max-new-tokens": a.new_tokens,
        "seed": seed,
        "output-dir": out,
        "log-samples-every": 5,
    }
    return [x for k, v in f.items() for x in (f"--{k}", str(v))]


def metrics(out: str) -> list[dict] | None:
    runs = glob.glob(os.path.join(out, "*__*", "metrics.jsonl"))
    if not runs:
        return None
    with open(runs[0]) as f:
        return [json.loads(line) for line in f]


def run(cmd: list[str], out: str, steps: int) -> list[dict]:
    rows = metrics(out)
    if rows and (steps == 0 or sum("train/accuracy" in r for r in rows) == steps):
        return rows
    subprocess.run(["rm", "-rf", out], check=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return metrics(out)


def interval(xs: list[float]) -> str:
    """mean ± the 95% t-interval's half width (n - 1 degrees of freedom)."""
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}.get(len(xs), 2.0)
    half = t * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{statistics.mean(xs):.3f} ± {half:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("smol", help="tools/smollm2.py's output directory")
    p.add_argument("--env", default="gem:game:GuessTheNumber-v0-easy")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-tasks", type=int, default=16)
    p.add_argument("--eval-k", type=int, default=2)
    p.add_argument("--results", default="env_real_model.md")
    a = p.parse_args()
    model, key = os.path.join(a.smol, "model"), f"eval/{a.env.split(':')[-1]}/avg@{a.eval_k}"
    table, before, after, env_s, gen_s = [], [], [], [], []
    for seed in map(int, a.seeds.split(",")):
        base = os.path.join(a.smol, "env_bench", f"seed{seed}")
        script = [sys.executable, "grpo.py"]
        b = run(script + flags(a, model, f"{base}/before", seed, 0), f"{base}/before", 0)
        t = run(script + flags(a, model, f"{base}/after", seed, a.steps), f"{base}/after", a.steps)
        before.append(b[-1][key])
        after.append(t[-1][key])
        steps = [r for r in t if "train/accuracy" in r]
        env_s.append(sum(r["time/env"] for r in steps) / len(steps))
        gen_s.append(sum(r["time/generate"] for r in steps) / len(steps))
        train = [r["env/success_frac"] for r in steps]
        table.append(
            f"| {seed} | {before[-1]:.3f} | {after[-1]:.3f} | {train[0]:.3f} -> {train[-1]:.3f} | "
            f"{statistics.mean(r['env/turns_mean'] for r in steps):.2f} | "
            f"{statistics.mean(r['env/reward_mean'] for r in steps):.3f} | {env_s[-1]:.3f} | {gen_s[-1]:.1f} |"
        )
    lines = [
        f"# SmolLM2-135M-Instruct on {a.env}, grpo.py, {a.steps} steps",
        "",
        f"`python benchmarks/env_real_model.py SMOL --seeds {a.seeds}` (G {a.group_size}, {a.prompts} tasks a step, "
        f"{a.new_tokens} tokens, T {a.temperature}, lr {a.lr}; held-out: avg@{a.eval_k} on {a.eval_tasks} tasks)",
        "",
        "| seed | held-out success before | after | training success, step 1 -> last | turns / episode | "
        "return / episode | time/env (s/step) | time/generate (s/step) |",
        "|---|---|---|---|---|---|---|---|",
        *table,
        "",
        f"Mean ± 95% interval over seeds: before {interval(before)}, after {interval(after)}, "
        f"after - before {interval([y - x for x, y in zip(before, after)])}; the environment's share of "
        f"generation time {statistics.mean(e / g for e, g in zip(env_s, gen_s)):.2e}.",
    ]
    path = os.path.join(ROOT, "benchmarks", "results", a.results)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
