"""Writes docs/flags.md from the scripts' Args: every flag with its default and its help (the field's docstring, what
`--help` prints), grouped as grpo.py's Args groups them, then each script's defaults and flags that differ from
grpo.py's. NOTES adds what a two-line help leaves out (definitions, provenance, links); tests/test_docs.py checks that
docs/flags.md is this script's output.

    python tools/flags_doc.py            # rewrites docs/flags.md
    python tools/flags_doc.py --check    # exit 1 if docs/flags.md is not current
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = ["grpo", "dapo", "dr_grpo", "lite_ppo", "gspo", "cispo", "daro", "sapo", "gmpo", "dppo", "clip_cov", "m2po"]
SCRIPTS += ["reinforce_pp", "rloo"]
OUT = os.path.join(ROOT, "docs", "flags.md")

# What a help line leaves out, appended to the flag's meaning (every script's flag of that name).
NOTES = {
    "track": "see [Tracking](gpu.md#tracking-with-weights--biases)",
    "resume": "restores model, optimizer, scheduler, RNG, step, data stream and strategies; with `--total-steps 0` "
    "the last checkpoint's `model/` is evaluated in a new run directory and RUN_DIR is left as it is",
    "prompt_template": "the fallback for a model without a chat template is the messages' text joined by blank "
    "lines (a run says so in one line); raw text (`none`, `r1`, the fallback) gets the tokenizer's BOS, chat "
    "templates write their own",
    "reward_format": "answer-line-strict: verl math_dapo's verdict exactly; auto: none → any, qwen-boxed → boxed, "
    "dapo → answer-line, r1 → answer-tag; see [Answer formats](algorithms.md#answer-formats)",
    "vllm_gpu_memory_utilization": "on CPU the fraction of the machine's memory for the KV cache alone; "
    "`VLLM_CPU_KVCACHE_SPACE`, in GiB, overrides",
    "vllm_tensor_parallel_size": "see [Multi-GPU](gpu.md#multi-gpu)",
    "vllm_enable_sleep_mode": "vLLM's CPU backend cannot sleep",
    "prompt_sampling": "medium weights a prompt by s(p) = 1 − p^G − (1 − p)^G, the chance that a group of G "
    "completions at its estimated pass rate p has a signal; curriculum by s(p) · exp(−(p − τ)² / (2 · 0.2²)), "
    "τ going from 1 to `--curriculum-min-target`; see [Data strategies](data_strategies.md)",
    "difficulty_file": "one JSON line per prompt with at least `pass_rate` (and `samples`)",
    "micro_batch_tokens": "8192 = 4 sequences of 1024 + 1024 tokens, grpo.py's worst case; see "
    "[Micro-batches](benchmarks.md#micro-batches)",
    "rollout_correction": "`token-truncate`, `token-mask`, `sequence-truncate`, `sequence-mask`; see "
    "[Rollout correction](algorithms.md#rollout-correction)",
    "rollout_correction_cap": "2 with token-truncate is verl's and oat's TIS; TRL 1.16's default is sequence-mask "
    "with 3; must be ≥ 1",
    "reward_workers": "see [Reward scoring](benchmarks.md#reward-scoring)",
}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (what tyro shows as the help), whitespace folded."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    pairs = zip(body, body[1:])
    docs = {a.target.id: b.value.value for a, b in pairs if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}
    return {name: " ".join(doc.split()) for name, doc in docs.items()}


def sections(cls) -> list[tuple[str, list[str]]]:
    """The `# Section` comments of an Args class and the fields under each."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    fields = [(n.lineno, n.target.id) for n in ast.parse(source).body[0].body if isinstance(n, ast.AnnAssign)]
    out = []
    for i, line in enumerate(lines, 1):
        if line.strip().startswith("# "):
            out.append((line.strip()[2:], []))
        for lineno, name in fields:
            if lineno == i:
                out[-1][1].append(name)
    return out


def flag(name: str) -> str:
    return f"`--{name.replace('_', '-')}`"


def default(value) -> str:
    return f"`{value}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    mods = {s: importlib.import_module(s) for s in SCRIPTS}
    grpo = mods["grpo"].Args
    docs, defaults = field_docs(grpo), grpo()
    out = [
        "# Flags",
        "",
        "<!-- written by tools/flags_doc.py from the scripts' Args: edit those (or its NOTES), then rerun it -->",
        "",
        "Every script takes the same scaffolding flags; `python X.py --help` lists all of them with their",
        "documentation and the script's defaults.",
    ]
    for title, names in sections(grpo):
        out += ["", f"**{title}**", "", "| flag | default (grpo.py) | `--help` | more |", "|---|---|---|---|"]
        for n in names:
            out.append(f"| {flag(n)} | {default(getattr(defaults, n))} | {cell(docs[n])} | {cell(NOTES.get(n, ''))} |")
    out += [
        "",
        "**Per-script defaults that differ from grpo.py, and each script's own flags**",
        "",
        "| script | flag | default | `--help` |",
        "|---|---|---|---|",
    ]
    grpo_fields = [f.name for f in dataclasses.fields(grpo)]
    for script in SCRIPTS[1:]:
        args, its_docs = mods[script].Args, field_docs(mods[script].Args)
        values = args()
        for f in dataclasses.fields(args):
            n = f.name
            if n in grpo_fields and getattr(values, n) == getattr(defaults, n) and its_docs[n] == docs[n]:
                continue
            if n == "exp_name":
                continue
            out.append(f"| {script}.py | {flag(n)} | {default(getattr(values, n))} | {cell(its_docs[n])} |")
        removed = [n for n in grpo_fields if n not in {f.name for f in dataclasses.fields(args)}]
        if removed:
            gone = ", ".join(flag(n) for n in removed)
            out.append(f"| {script}.py | (removed) {gone} | | not part of this algorithm |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        with open(OUT) as f:
            sys.exit(0 if f.read() == text else "docs/flags.md is not current: python tools/flags_doc.py")
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
