"""Length control on a toy task whose length the policy chooses: l1.py's mean |n_y - N| over training, and its
completions' lengths at several budgets before and after, against l1.py with --alpha 0 (the same prompts, the
reward without its length term).

    python benchmarks/l1_toy.py /tmp/l1_toy --seeds 1,2,3          # ~3 min a run on 2 busy cores

The task: tests/toy.py's sums with a target, "3+1= Think for 12 tokens.", N uniform on 8..22, and a base model that
answers "\\boxed{4}" then 0 to --max-filler filler words (" step", one token each) and EOS, the count drawn uniformly
and independently of N: tests/toy.py's tiny Qwen2 trained for --sft-steps batches of 16 such completions (AdamW
3e-3), so that it adds imperfectly, stops at every length, and has read the prompt's targets without their meaning.
Its completions are 7 to 24 tokens long. The verifier (--reward-format boxed) reads the last box, which the filler
never opens, so a completion's length does not decide its verdict. Each seed runs the quickstart's flags with
--max-new-tokens 28 and N's range and the evaluation budgets (8, 12, 16, 20) as fractions of it, for --steps steps:

- l1.py at --alpha 0.0003 x 4096 / 28 (the paper's weight of the whole range, alpha x n_max ~ 1.2, at this budget);
- l1.py --alpha 0 (the control: correctness alone).

The untrained model and each run's last policy are evaluated at the budgets (--eval-k samples of 64 held-out sums at
temperature 1, the sampling temperature). Reported, mean ± 95% interval over seeds (tools/compare.py's mean_ci and
welch): train/target_error (mean |n_y - N|) over the first 10 steps and the last --window, and their difference
per seed; the accuracy likewise; the mean length at each budget before and after. Run directories land in OUT/runs/,
finished ones are reused; the table goes to benchmarks/results/ (--results).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
FILLER = " step"  # a word of tests/toy.py's tokenizer corpus: one token
NEW_TOKENS, TARGETS, BUDGETS = 28, (8, 22), (8, 12, 16, 20)


def build_task(out: str, sft_steps: int, max_filler: int, seed: int = 0) -> dict[str, str]:
    """OUT/model (the base model above), OUT/train.jsonl (512 sums) and OUT/test.jsonl (64), built once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.toy import build_model, write_dataset

    paths = {"model": os.path.join(out, "model"), "train": os.path.join(out, "train.jsonl")}
    paths["test"] = os.path.join(out, "test.jsonl")
    if os.path.exists(os.path.join(paths["model"], "sft.json")):
        return paths
    os.makedirs(out, exist_ok=True)
    write_dataset(paths["train"], n=512, seed=0)
    write_dataset(paths["test"], n=64, seed=1)
    build_model(paths["model"], seed=seed)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster than an OpenMP team on busy cores
    try:
        for _ in range(sft_steps):
            rows = [(rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, max_filler)) for _ in range(16)]
            prompts = [tok(f"{a}+{b}= Think for {rng.randint(*TARGETS)} tokens.").input_ids for a, b, _ in rows]
            seqs = [
                p + tok(f"\\boxed{{{a + b}}}" + FILLER * k).input_ids + [tok.eos_token_id]
                for p, (a, b, k) in zip(prompts, rows)
            ]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            labels = ids.clone()
            for i, (p, s) in enumerate(zip(prompts, seqs)):
                labels[i, : len(p)], labels[i, len(s) :] = -100, -100  # the completion only
            attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(paths["model"])
    with open(os.path.join(paths["model"], "sft.json"), "w") as f:
        json.dump({"sft_steps": sft_steps, "max_filler": max_filler, "filler": FILLER, "seed": seed}, f)
    return paths


def finished(out: str, name: str, seed: int) -> str | None:
    """A run directory of this name and seed whose last row holds the evaluation at the budgets."""
    for run_dir in glob.glob(os.path.join(out, f"{name}__{seed}__*")):
        try:
            if f"eval/test/n{BUDGETS[0]}/length_mean" in rows_of(run_dir)[-1]:
                return run_dir
        except (OSError, ValueError, IndexError):
            continue
    return None


def rows_of(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def budget_lengths(row: dict) -> dict[int, float]:
    return {n: row[f"eval/test/n{n}/length_mean"] for n in BUDGETS}


def main() -> None:
    from compare import mean_ci, welch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="where the task and the runs go")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--max-filler", type=int, default=16)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--window", type=int, default=20, help="the last steps averaged")
    p.add_argument("--results", default="l1_toy.md", help="the table's file in benchmarks/results/")
    a = p.parse_args()
    task = build_task(a.out, a.sft_steps, a.max_filler)
    runs = os.path.join(a.out, "runs")
    flags = ["--model-name-or-path", task["model"], "--dataset-name", task["train"], "--prompt-column", "question"]
    flags += ["--answer-column", "answer", "--prompt-template", "none", "--reward-format", "boxed"]
    flags += ["--group-size", "8", "--prompts-per-step", "16", "--max-new-tokens", str(NEW_TOKENS)]
    flags += ["--max-prompt-tokens", "48", "--learning-rate", str(a.lr), "--micro-batch-size", "128", "--beta", "0"]
    flags += ["--temperature", "1.0", "--sampler", "hf", "--save-every", "0", "--log-samples-every", "0"]
    flags += ["--target-frac", *(str(n / NEW_TOKENS) for n in TARGETS)]
    flags += ["--eval-budget-frac", *(str(n / NEW_TOKENS) for n in BUDGETS)]
    flags += ["--eval-datasets", task["test"], "--eval-prompt-column", "question", "--eval-answer-column", "answer"]
    flags += ["--eval-samples", str(a.eval_k), "--eval-temperature", "1.0", "--eval-max-new-tokens", str(NEW_TOKENS)]
    flags += ["--output-dir", runs]
    alpha = 0.0003 * 4096 / NEW_TOKENS
    settings = [
        ("before", ["--total-steps", "0", "--eval-every", "1"]),
        ("l1", ["--total-steps", str(a.steps), "--eval-every", str(a.steps), "--alpha", f"{alpha:.6f}"]),
        ("l1_alpha0", ["--total-steps", str(a.steps), "--eval-every", str(a.steps), "--alpha", "0"]),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    seeds = [int(s) for s in a.seeds.split(",")]
    dirs: dict[str, list[str]] = {name: [] for name, _ in settings}
    for seed in seeds:
        for name, extra in settings:
            run_dir = finished(runs, name, seed)
            if run_dir is None:
                cmd = [sys.executable, os.path.join(ROOT, "l1.py"), *flags, *extra, "--exp-name", name]
                proc = subprocess.run([*cmd, "--seed", str(seed)], env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
                run_dir = finished(runs, name, seed)
                print(f"{name}, seed {seed}: done", flush=True)
            dirs[name].append(run_dir)

    def ci(xs: list[float]) -> str:
        m, h = mean_ci(xs)
        return f"{m:.2f} ± {h:.2f}"

    lines = [f"benchmarks/l1_toy.py {a.out} --seeds {a.seeds} --steps {a.steps} --lr {a.lr} --sft-steps "
             f"{a.sft_steps} --max-filler {a.max_filler} --eval-k {a.eval_k} --window {a.window}; l1 at alpha "
             f"{alpha:.4f}; mean ± 95% interval over {len(seeds)} seeds", ""]  # fmt: skip
    lines += [
        "| run | metric | first 10 steps | last steps | change | per seed (first -> last) |",
        "|---|---|---|---|---|---|",
    ]
    changes = {}
    for name in ("l1", "l1_alpha0"):
        for key in ("train/target_error", "train/target_within_10pct", "train/accuracy"):
            first, last = [], []
            for run_dir in dirs[name]:
                values = [r[key] for r in rows_of(run_dir) if key in r]
                first.append(statistics.mean(values[:10])), last.append(statistics.mean(values[-a.window :]))
            change = [y - x for x, y in zip(first, last)]
            changes[name, key] = change
            per = ", ".join(f"{x:.2f} -> {y:.2f}" for x, y in zip(first, last))
            lines.append(f"| {name} | {key} | {ci(first)} | {ci(last)} | {ci(change)} | {per} |")
    d, h, _ = welch(changes["l1", "train/target_error"], changes["l1_alpha0", "train/target_error"])
    lines += ["", f"change of train/target_error, l1 - l1_alpha0 (Welch): {d:+.2f} ± {h:.2f}", ""]
    lines += [
        "Mean completion length (tokens) at each evaluation budget N, at the end (the untrained model: before):",
        "",
    ]
    lines += ["| run | " + " | ".join(f"N = {n}" for n in BUDGETS) + " | mean \\|n_y - N\\| over the budgets |"]
    lines.append("|---|" + "---|" * (len(BUDGETS) + 1))
    for name in ("before", "l1", "l1_alpha0"):
        finals = [[r for r in rows_of(d) if "eval/test/n8/length_mean" in r][-1] for d in dirs[name]]
        cells = [ci([budget_lengths(r)[n] for r in finals]) for n in BUDGETS]
        err = ci([statistics.mean(r[f"eval/test/n{n}/target_error"] for n in BUDGETS) for r in finals])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {err} |")
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", a.results), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
