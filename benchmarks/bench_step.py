"""Step time of grpo.py against TRL's GRPOTrainer on the same model, batch, lengths and loss, back to back.

    pip install -r benchmarks/requirements.txt
    python benchmarks/bench_step.py                  # CPU: a small random Qwen2; writes benchmarks/results/step_*.md
    OMP_NUM_THREADS=1 python benchmarks/bench_step.py --hidden 64 --layers 2 --new-tokens 16 --rounds 3  # toy-sized
    python benchmarks/bench_step.py --baseline /tmp/old/grpo.py   # also an older checkout (git archive), same flags

Both sides: the same randomly initialised Qwen2 (built here, --hidden/--layers), the toy a+b prompts,
G = --group-size completions for --prompts prompts per step, at most --new-tokens new tokens per completion
(the random model rarely samples EOS, so most completions use the whole budget on both sides), Hugging Face
generate, GRPO's per-sequence loss (TRL loss_type="grpo"), beta = --beta, one update per
rollout, lr 1e-6, fp32, gradient checkpointing off unless --gradient-checkpointing (TRL defaults it on). grpo.py runs
at its own defaults otherwise (token-budget micro-batches) unless --micro-batch sets --micro-batch-size. Reported:
median seconds per training step over the steps after --warmup (per round, and the median over rounds), and our
per-phase breakdown from metrics.jsonl. With --rounds the sides alternate, so that load on a shared machine hits all
of them; OMP_NUM_THREADS=1 keeps torch's threads from spinning against other processes there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_model(root: str, hidden: int, layers: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.toy import build_tokenizer

    out = os.path.join(root, "model")
    tok = build_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def ours(model: str, data: str, a, script: str = os.path.join(ROOT, "grpo.py")) -> tuple[float, dict]:
    out = tempfile.mkdtemp()
    cmd = [
        sys.executable,
        script,
        "--model-name-or-path",
        model,
        "--dataset-name",
        data,
        "--prompt-column",
        "question",
        "--answer-column",
        "answer",
        "--prompt-template",
        "none",
        "--group-size",
        str(a.group_size),
        "--prompts-per-step",
        str(a.prompts),
        "--max-new-tokens",
        str(a.new_tokens),
        "--learning-rate",
        "1e-6",
        "--beta",
        str(a.beta),
        "--total-steps",
        str(a.steps),
        "--sampler",
        "hf",
        "--output-dir",
        out,
        "--save-every",
        "0",
        "--log-samples-every",
        "0",
    ]
    cmd += ["--gradient-checkpointing"] * a.gradient_checkpointing
    cmd += ["--micro-batch-size", str(a.micro_batch)] * (a.micro_batch > 0)
    path = [os.path.dirname(os.path.abspath(script)), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{os.path.basename(script)} failed:\n{proc.stderr[-4000:]}")
    (run,) = os.listdir(out)
    rows = [json.loads(line) for line in open(os.path.join(out, run, "metrics.jsonl"))][a.warmup :]
    phases = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/")}
    return statistics.median(r["time/step"] for r in rows), phases


def trl(model: str, data: str, a) -> float:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.reward import math_reward

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    ds = datasets.load_dataset("json", data_files=data, split="train").rename_column("question", "prompt")

    def reward(completions, answer, **_):
        return math_reward(completions, answer)

    times = []

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
        learning_rate=1e-6,
        beta=a.beta,
        loss_type="grpo",
        epsilon=0.2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=a.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),  # grpo.py's --mixed-precision auto: bf16 autocast on CUDA
        save_strategy="no",
        gradient_accumulation_steps=1,
        disable_dropout=True,
        seed=1,
        dataloader_num_workers=0,
        gradient_checkpointing=a.gradient_checkpointing,
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
    return statistics.median(times[a.warmup :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=0, help="grpo.py --micro-batch-size (0: grpo.py's default)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="on both sides (TRL's default is on, ours off)"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="alternate the sides this many times")
    p.add_argument("--baseline", help="another checkout's grpo.py, run the same way (e.g. the code before a change)")
    a = p.parse_args()
    from tests.toy import write_dataset

    root = tempfile.mkdtemp()
    model = build_model(root, a.hidden, a.layers)
    data = write_dataset(os.path.join(root, "train.jsonl"), n=512)
    rows, phases = [], {}
    for _ in range(a.rounds):
        ours_s, phases = ours(model, data, a)
        row = [ours_s, trl(model, data, a)]
        rows.append(row + ([ours(model, data, a, a.baseline)[0]] if a.baseline else []))
        print(rows[-1], flush=True)
    import torch
    import trl as trl_pkg

    med = [statistics.median(r[k] for r in rows) for k in range(len(rows[0]))]
    head = "| | grpo.py | TRL GRPOTrainer | ours / TRL |" + (" baseline | baseline / TRL |" if a.baseline else "")
    cuda = torch.cuda.is_available()
    where = f"{torch.cuda.get_device_name()}, bf16 autocast" if cuda else f"{os.cpu_count()} CPU threads, fp32"
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, "
        f"trl {trl_pkg.__version__}; Qwen2 hidden {a.hidden} x {a.layers} layers, "
        f"{a.prompts} prompts x G={a.group_size}, {a.new_tokens} new tokens, beta {a.beta}, "
        f"gradient checkpointing: {'on' if a.gradient_checkpointing else 'off'} (both sides), "
        f"grpo.py micro-batches: {f'--micro-batch-size {a.micro_batch}' if a.micro_batch else 'its defaults'}",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for name, r in [*((f"round {k + 1}", r) for k, r in enumerate(rows)), ("**median s/step**", med)]:
        extra = f" {r[2]:.3f} | {r[2] / r[1]:.2f} |" if a.baseline else ""
        lines.append(f"| {name} | {r[0]:.3f} | {r[1]:.3f} | {r[0] / r[1]:.2f} |" + extra)
    shown = ", ".join(f"{k[5:]} {v:.3f}" for k, v in phases.items() if k != "time/tokens_per_s")
    lines += ["", "grpo.py phases, last round (median s): " + shown]
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    gc = "_gc" if a.gradient_checkpointing else ""
    name = f"step_{'cuda' if cuda else 'cpu'}_h{a.hidden}x{a.layers}_{a.new_tokens}tok{gc}.md"
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
