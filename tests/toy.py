"""Offline test assets: a tiny Qwen2 model with random weights, a byte-level BPE tokenizer trained on the
fly, and a synthetic arithmetic dataset (docs/design.md "Tests"). Nothing is downloaded. `build_gemma3` builds a
second family, a tiny Gemma-3 whose tokenizer adds BOS and has no chat template (a base model's).

    python -m tests.toy /tmp/toy        # writes /tmp/toy/model and /tmp/toy/{train,test}.jsonl
    python -m tests.toy /tmp/toy_product --product    # the Python tool's product task (build_product_task)

It also writes a graded task (graded_train.jsonl; test_easy, test_medium, test_hard.jsonl): easy, toy-sized and
two-digit sums in equal shares, on which the data strategies' choice of prompts has something to choose from.

The task is small on purpose: "a+b=" with a, b in 0..4, so a randomly initialised model gets a few
answers right by chance and RL has a signal to amplify within a minute on a CPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

# Qwen-style chat template, so the `qwen-boxed` and `r1` prompt templates go through apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# Operand ranges: "medium" is the toy task's own (a, b in 0..4); the graded task adds sums the model masters early
# and two-digit sums whose answers (100..198, three tokens) do not fit in the 2 new tokens of the quickstart, i.e.
# never solved.
LEVELS = {"easy": (0, 1), "medium": (0, 4), "hard": (50, 99)}


def sum_rows(n: int, seed: int, levels: tuple[str, ...] = ("medium",)) -> list[dict[str, str]]:
    """`n` rows {"question": "3+1=", "answer": "4"} cycling through `levels` (LEVELS' operand ranges, drawn
    uniformly). The default is the toy task; all three levels make the graded task, whose prompts range from
    trivial to hopeless for the toy model, as a real dataset's do for a real one."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        low, high = LEVELS[levels[i % len(levels)]]
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def write_rows(path: str, rows: list[dict[str, str]]) -> str:
    """Writes `rows` as JSON lines to `path` and returns it."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_dataset(path: str, n: int = 256, seed: int = 0) -> str:
    """Writes the arithmetic rows as JSON lines to `path` and returns it."""
    return write_rows(path, sum_rows(n, seed))


def build_tokenizer(out_dir: str):
    """Trains a small byte-level BPE on arithmetic text and wraps it as a Qwen2Tokenizer (which is what
    AutoTokenizer rebuilds for model_type qwen2, from vocab + merges)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen2Tokenizer

    corpus = [f"{r['question']}{r['answer']}" for r in sum_rows(2000, seed=123)]
    corpus += ["The answer is \\boxed{7}. Answer: 3", "Solve the problem step by step. user assistant system"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=SPECIAL_TOKENS)
    os.makedirs(out_dir, exist_ok=True)
    bpe.save_model(out_dir)  # vocab.json + merges.txt
    tok = Qwen2Tokenizer(
        vocab=os.path.join(out_dir, "vocab.json"),
        merges=os.path.join(out_dir, "merges.txt"),
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


def build_model(out_dir: str, seed: int = 0, hidden_size: int = 64, heads: int = 4, tied: bool = True) -> str:
    """Writes a tiny random Qwen2ForCausalLM (2 layers, hidden 64, 4 heads of 16) and its tokenizer to `out_dir`.
    vLLM's CPU attention needs head_dim 64 or more: `hidden_size=128, heads=2` builds such a model (VLLM_MODEL)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def build_bos_tokenizer(out_dir: str):
    """A byte-level BPE that puts <bos> before every text it encodes, as Gemma's, Llama's or OLMo's tokenizers do,
    with <eos> and <pad> and no chat template (a base model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{r['question']}{r['answer']}" for r in sum_rows(2000, seed=123)]
    corpus += ["The answer is \\boxed{7}. Answer: 3", "Solve the problem step by step."]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>"], initial_alphabet=alphabet)
    bpe.train_from_iterator(corpus, trainer)
    bos = [("<bos>", bpe.token_to_id("<bos>"))]
    bpe.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=bos)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.save_pretrained(out_dir)
    return tok


def build_gemma3(out_dir: str, seed: int = 0, softcap: float | None = 30.0) -> str:
    """A tiny random Gemma3ForCausalLM (a family unlike Qwen2 and Llama: sliding-window and global attention layers,
    embeddings scaled by sqrt(hidden) and tied to the output layer, a soft cap c tanh(z / c) on the logits) with a
    tokenizer that adds BOS and has no chat template: what a user's own base model brings. hidden 128, 2 heads of 64
    (vLLM's CPU attention), an 8-token window, which prompt plus completion cross (5 + 8 tokens in the tests)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = build_bos_tokenizer(out_dir)
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=softcap,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Gemma3ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def tool_block(shown: str) -> str:
    """The output block the tool appends (common.tool.output_block), as a script's piece."""
    return f"```output\n{shown}\n```\n"


# Tool-use scripts the tool model memorises: prompt -> the completion's pieces, the model's text and the tool's output
# blocks in turn (each tokenised on its own, as a rollout splices them). C calls nothing; B fails, then calls again;
# D closes a block that is not python before its program.
TOOL_SCRIPTS = {
    "A: ": ["Compute.\n```python\nprint(6 * 7)\n```\n", tool_block("42"), "So \\boxed{42}."],
    "B: ": [
        "```python\nprint(1 / 0)\n```\n",
        tool_block("ZeroDivisionError: division by zero"),
        "Again.\n```python\nprint(2 ** 10)\n```\n",
        tool_block("1024"),
        "\\boxed{1024}",
    ],
    "C: ": ["No code: \\boxed{3}."],
    "D: ": ["```text\nnot code\n```\n", "```python\nprint(3 + 4)\n```\n", tool_block("7"), "\\boxed{7}"],
}


def tool_rows() -> list[dict[str, str]]:
    """TOOL_SCRIPTS as a dataset for the scripts' --tool runs: each prompt and the answer its script boxes."""
    return [{"question": p, "answer": re.findall(r"\\boxed\{(\d+)\}", "".join(s))[-1]} for p, s in TOOL_SCRIPTS.items()]


def script_ids(tok, pieces: list[str]) -> tuple[list[int], list[int]]:
    """A script's completion as the tool model writes it (EOS included) and its mask: the model's text one token per
    character, which is not how the tokenizer splits it (it merges some), and each output block as the tool encodes
    it (the tokenizer's split of the block alone, mask 0)."""
    ids, mask = [], []
    for piece in pieces:
        block = piece.startswith("```output")
        piece_ids = tok(piece, add_special_tokens=False).input_ids if block else [tok(ch).input_ids[0] for ch in piece]
        ids += piece_ids
        mask += [0 if block else 1] * len(piece_ids)
    return ids + [tok.eos_token_id], mask + [1]


def build_tool_model(out_dir: str, steps: int = 400, seed: int = 0) -> str:
    """The vLLM-sized toy model (hidden 128, 2 heads of 64) trained to reproduce TOOL_SCRIPTS (`script_ids`): greedy,
    it writes each script's programs and, once the tool's output is appended, goes on as the script does. A model
    that calls the tool on cue, for testing the rollouts (a random model never writes a python block)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_model(out_dir, seed=seed, hidden_size=128, heads=2)
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    seqs = [tok(prompt).input_ids + script_ids(tok, pieces)[0] for prompt, pieces in TOOL_SCRIPTS.items()]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    labels = ids.masked_fill(attn == 0, -100)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is ~20x faster than an OpenMP team on busy cores
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    return out_dir


# The product task (docs/tools.md "Measured on the toy"): a*b with 3-digit operands, which the toy model cannot compute
# (it barely learns a+b with a, b <= 4), and worked solutions whose program computes it. Its base model writes each
# question's program as a ```cython block, which the tool does not run (common.tool.closed_program runs ```python
# blocks only): it copies the operands into a program as a pretrained model would, and has never seen a program run,
# an output block or an answer. ```cython is as many tokens as ```python, so its copying serves a python block as is;
# a randomly initialised toy model needs ~300-600 supervised steps to learn to copy the operands at all (measured),
# longer than a CPU run.
def product_program(a: int, b: int, lang: str = "python") -> str:
    return f"```{lang}\nprint('Answer:',{a}*{b})\n```\n"


def product_rows(n: int, seed: int) -> list[dict[str, str]]:
    """`n` rows {"question": "347*912", "answer": "316464", "solution": the program and its output block}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        solution = product_program(a, b) + tool_block(f"Answer: {a * b}")
        rows.append({"question": f"{a}*{b}", "answer": str(a * b), "solution": solution})
    return rows


def build_code_model(out_dir: str, steps: int = 1000, seed: int = 0) -> tuple[str, float]:
    """The product task's base model (above): the toy model trained on `steps` batches of 16 fresh questions, each
    followed by its ```cython program and EOS. Returns the directory and the share of 64 new questions whose greedy
    completion is exactly their program."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_model(out_dir, seed=seed)
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    rng = random.Random(seed)
    draw = lambda: (rng.randint(100, 999), rng.randint(100, 999))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is ~20x faster than an OpenMP team on busy cores
    try:
        for _ in range(steps):
            rows = [draw() for _ in range(16)]
            prompts = [tok(f"{a}*{b}").input_ids for a, b in rows]
            seqs = [
                p + tok(product_program(a, b, "cython")).input_ids + [tok.eos_token_id]
                for p, (a, b) in zip(prompts, rows)
            ]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            labels = ids.clone()
            for i, (p, s) in enumerate(zip(prompts, seqs)):
                labels[i, : len(p)], labels[i, len(s) :] = -100, -100  # the completion only
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        rows = [draw() for _ in range(64)]
        tok.padding_side = "left"
        enc = tok([f"{a}*{b}" for a, b in rows], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        exact = sum(t == product_program(a, b, "cython") for t, (a, b) in zip(texts, rows)) / len(rows)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    return out_dir, exact


def build_product_task(root: str) -> dict[str, str]:
    """The product task under `root`: the base model (model/), train.jsonl (4096 rows) and test.jsonl (64 rows)."""
    os.makedirs(root, exist_ok=True)
    model, exact = build_code_model(os.path.join(root, "model"))
    paths = {"model": model, "copy_exact": exact}
    paths["train"] = write_rows(os.path.join(root, "train.jsonl"), product_rows(4096, seed=0))
    paths["test"] = write_rows(os.path.join(root, "test.jsonl"), product_rows(64, seed=1))
    return paths


def build_all(root: str) -> dict[str, str]:
    """Model dir, train and test jsonl under `root`; returns their paths."""
    os.makedirs(root, exist_ok=True)
    paths = {
        "model": build_model(os.path.join(root, "model")),
        "train": write_dataset(os.path.join(root, "train.jsonl"), n=512, seed=0),
        "test": write_dataset(os.path.join(root, "test.jsonl"), n=64, seed=1),
        "graded_train": write_rows(os.path.join(root, "graded_train.jsonl"), sum_rows(96, 2, tuple(LEVELS))),
    }
    for level in LEVELS:  # one test file per level, so each level has its own eval metrics
        paths[f"test_{level}"] = write_rows(os.path.join(root, f"test_{level}.jsonl"), sum_rows(32, 3, (level,)))
    return paths


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--product":  # python -m tests.toy DIR --product
        print(json.dumps(build_product_task(sys.argv[1]), indent=1))
    else:
        print(json.dumps(build_all(sys.argv[1] if len(sys.argv) > 1 else "/tmp/toy"), indent=1))
