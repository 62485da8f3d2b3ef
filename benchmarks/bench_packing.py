"""Training-phase time of one rollout with long-tailed completion lengths: padded micro-batches vs micro-batches cut to
their own padding vs packed by tokens (longest first).

    python benchmarks/bench_packing.py   # CPU: a small random Qwen2, writes benchmarks/results/packing_<device>.md

One call of grpo.py's `update_policy` (forward, loss, backward, optimizer step) on the same synthetic rollout:
--rollout sequences with --prompt-tokens prompt tokens and completion lengths drawn from a log-normal with median
--median-tokens, clipped to [1, --max-new-tokens] (RL rollouts have a long tail of long answers). Three settings:
  padded   every micro-batch of --micro-batch-size rows padded to the rollout's longest completion (before cutting)
  cut      the same rows, each micro-batch cut to its own longest completion (grpo.py's default)
  packed   --micro-batch-tokens = micro-batch-size x (prompt + max-new-tokens): the padded setting's token count per
           micro-batch, so no micro-batch is bigger than before; rows sorted longest first, packed to the budget
All three give the same gradient (tests/test_distributed.py); the table reports the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rollout", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--median-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import grpo
    from common.logprobs import TokenLogProbs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    lengths = (
        (torch.randn(a.rollout, generator=g) * 0.8).exp().mul(a.median_tokens).round().clamp(1, a.max_new_tokens).long()
    )
    n, P, C = a.rollout, a.prompt_tokens, int(lengths.max())
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    ids = torch.randint(3, a.vocab, (n, P + C), generator=g)
    attn = torch.cat([torch.ones(n, P, dtype=torch.long), mask], 1)
    batch = {
        "ids": ids.to(device),
        "attn": attn.to(device),
        "mask": mask.to(device),
        "p_len": P,
        "advantages": torch.randn(n, generator=g).to(device),
    }
    real = [(P, int(k)) for k in lengths]
    budget = a.micro_batch_size * (P + a.max_new_tokens)
    settings = {
        "padded": ({"micro_batch_size": a.micro_batch_size}, [(P, C)] * n),
        "cut": ({"micro_batch_size": a.micro_batch_size}, real),
        "packed": ({"micro_batch_size": a.micro_batch_size, "micro_batch_tokens": budget}, real),
    }
    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64),
        num_key_value_heads=max(1, a.hidden // 128),
        max_position_embeddings=P + a.max_new_tokens,
        tie_word_embeddings=True,
    )
    accelerator = Accelerator(cpu=device == "cpu")
    rows = []
    for name, (flags, lens) in settings.items():
        torch.manual_seed(0)
        policy = TokenLogProbs(Qwen2ForCausalLM(cfg))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
        args = grpo.Args(beta=0.0, num_mini_batches=1, ppo_epochs=1, **flags)
        plan = grpo.micro_batches(list(range(n)), lens, args)
        tokens = sum(len(r) * (pw + cw) for r, pw, cw in plan)
        times = []
        for i in range(a.repeats + 1):
            t = time.perf_counter()
            grpo.update_policy(policy, optimizer, scheduler, accelerator, {**batch, "lens": lens}, args, i)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rows.append((name, len(plan), tokens, statistics.median(times[1:])))
    base = rows[0][3]
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {device}, {os.cpu_count()} CPU threads, torch {torch.__version__}; "
        f"Qwen2 hidden {a.hidden} x "
        f"{a.layers} layers, vocab {a.vocab}; {n} sequences, prompt {P}, completions median {int(lengths.median())} / "
        f"mean {lengths.float().mean():.0f} / max {C} tokens; micro-batch {a.micro_batch_size} rows or {budget} tokens",
        "",
        "| setting | micro-batches | tokens computed | s per update | vs padded |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {mbs} | {tok} | {s:.3f} | {s / base:.2f} |" for name, mbs, tok, s in rows]
    table = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", f"packing_{device}.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
