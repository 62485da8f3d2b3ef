"""Length control on a toy task whose length the policy chooses: kimi_k15.py's length penalty against grpo.py.

    python benchmarks/length_toy.py /tmp/length_toy --seeds 1,2,3,4,5      # ~4 min a run on 2 busy cores

The task: tests/toy.py's sums ("3+1=", a, b in 0..4) and a base model that answers "\\boxed{4}", then 0 to
--max-filler filler words (" step") and EOS, the count drawn uniformly: tests/toy.py's tiny Qwen2 trained for
--sft-steps batches of 16 such completions (AdamW 3e-3), so that it adds imperfectly and stops at every length. The
verifier (--reward-format boxed) reads the last box, which the filler never opens, so a completion's length does not
decide its verdict (with `any`, the last number, a stray digit in a long completion did, and grpo.py shortened its
answers too): only a length reward makes shorter answers better. Each seed runs
the quickstart's flags with --max-new-tokens --max-filler + 8 for --steps steps:

- grpo.py --beta 0 (no length term);
- kimi_k15.py at its defaults but a --warmup (default 20) step warm-up of the length penalty (weight 1);
- kimi_k15.py --length-penalty-weight 0 (the same loss and optimizer reset, no penalty: what the penalty adds);
- kimi_k15.py with the penalty and --no-reset-optimizer (AdamW's moments kept across steps, as grpo.py's).

Then tools/compare.py's table (final: the mean of the last --window steps, mean ± 95% interval over seeds, and each
group's difference to grpo.py with Welch's interval) of train accuracy and length, into benchmarks/results/ (--results).
Run directories land in OUT/runs/ and a rerun reuses finished ones.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FILLER = " step"  # a word of tests/toy.py's tokenizer corpus


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
            prompts = [tok(f"{a}+{b}=").input_ids for a, b, _ in rows]
            seqs = [
                p + tok(f"\\boxed{{{a + b}}}" + FILLER * k).input_ids + [tok.eos_token_id]
                for p, (a, b, k) in zip(prompts, rows)
            ]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            labels = ids.clone()
            for i, (p, s) in enumerate(zip(prompts, seqs)):
                labels[i, : len(p)], labels[i, len(s) :] = -100, -100  # the completion only
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(paths["model"])
    with open(os.path.join(paths["model"], "sft.json"), "w") as f:
        json.dump({"sft_steps": sft_steps, "max_filler": max_filler, "filler": FILLER, "seed": seed}, f)
    return paths


def finished(out: str, name: str, seed: int) -> bool:
    for run_dir in glob.glob(os.path.join(out, f"{name}__{seed}__*")):
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path) and os.path.exists(os.path.join(run_dir, "checkpoints")):
            return True
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="where the task and the runs go")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20, help="kimi_k15.py's --length-penalty-warmup-steps")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--max-filler", type=int, default=8)
    p.add_argument("--window", type=int, default=20, help="compare.py's final window")
    p.add_argument("--results", default="length_toy.md", help="the table's file in benchmarks/results/")
    a = p.parse_args()
    task = build_task(a.out, a.sft_steps, a.max_filler)
    runs = os.path.join(a.out, "runs")
    flags = ["--model-name-or-path", task["model"], "--dataset-name", task["train"], "--prompt-column", "question"]
    flags += ["--answer-column", "answer", "--prompt-template", "none", "--reward-format", "boxed", "--group-size", "8"]
    flags += ["--prompts-per-step", "16", "--max-new-tokens", str(a.max_filler + 8), "--max-prompt-tokens", "32"]
    flags += ["--learning-rate", str(a.lr), "--micro-batch-size", "128", "--total-steps", str(a.steps)]
    flags += ["--sampler", "hf", "--save-every", "0", "--log-samples-every", "0", "--output-dir", runs]
    settings = [
        ("grpo", "grpo", ["--beta", "0"]),
        ("kimi_k15", "kimi", ["--length-penalty-warmup-steps", str(a.warmup)]),
        ("kimi_k15", "kimi_no_penalty", ["--length-penalty-weight", "0"]),
        ("kimi_k15", "kimi_no_reset", ["--length-penalty-warmup-steps", str(a.warmup), "--no-reset-optimizer"]),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for script, name, extra in settings:
            if finished(runs, name, seed):
                continue
            cmd = [sys.executable, os.path.join(ROOT, f"{script}.py"), *flags, *extra, "--exp-name", name]
            proc = subprocess.run([*cmd, "--seed", str(seed)], env=env, capture_output=True, text=True)
            if proc.returncode or not finished(runs, name, seed):
                raise SystemExit(f"{name} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            print(f"{name}, seed {seed}: done", flush=True)
    keys = ["train/accuracy", "train/response_length_mean", "train/response_length_correct"]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare.py"), *sorted(glob.glob(os.path.join(runs, "*")))]
    cmd += ["--baseline", "grpo", "--window", str(a.window), "--markdown", "--keys", *keys]
    table = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    head = (
        f"benchmarks/length_toy.py {a.out} --seeds {a.seeds} --steps {a.steps} --warmup {a.warmup} --sft-steps "
        f"{a.sft_steps} --max-filler {a.max_filler} --window {a.window}"
    )
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", a.results), "w") as f:
        f.write(head + "\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
