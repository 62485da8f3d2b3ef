"""Writes docs/flags.md from common/args.py and the scripts' Args: every shared flag with its default and its help (the
field's docstring, what `--help` prints), grouped as SharedArgs groups them, grpo.py's own flags, then each script's
defaults and flags that differ from grpo.py's, with the source the script gives in a comment. NOTES adds what a two-line
help leaves out (definitions, provenance, links); tests/test_docs.py checks that docs/flags.md is this script's output.

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
from common.args import SharedArgs, field_docs  # noqa: E402

SCRIPTS = ["grpo", "dapo", "dr_grpo", "lite_ppo", "gspo", "cispo", "daro", "sapo", "gmpo", "dppo", "clip_cov", "m2po"]
SCRIPTS += ["reinforce_pp", "rloo", "ppo", "vapo", "kimi_k15", "long_cot", "l1", "cppo"]
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
    "τ going from 1 to `--curriculum-min-target`; prioritized by 1 − p (Kimi k1.5 §2.3.4); hard-after-warmup "
    "uniformly for `--hard-warmup-steps`, then only prompts with p < `--hard-pass-rate`; every mode but uniform "
    "with the `--uniform-floor` share; see [Data strategies](data_strategies.md)",
    "difficulty_file": "one JSON line per prompt with at least `pass_rate` (and `samples`)",
    "micro_batch_tokens": "8192 = 4 sequences of 1024 + 1024 tokens, grpo.py's worst case; see "
    "[Micro-batches](benchmarks.md#micro-batches)",
    "rollout_correction": "`token-truncate`, `token-mask`, `sequence-truncate`, `sequence-mask`; see "
    "[Rollout correction](algorithms.md#rollout-correction)",
    "rollout_correction_cap": "must be ≥ 1",
    "reward_workers": "see [Reward scoring](benchmarks.md#reward-scoring)",
}


def sections(cls) -> list[tuple[str, list[str]]]:
    """The `# Section` comments of a dataclass's own body and the fields under each (a field before any comment goes
    under "")."""
    source = textwrap.dedent(inspect.getsource(cls))
    fields = {n.lineno: n.target.id for n in ast.parse(source).body[0].body if isinstance(n, ast.AnnAssign)}
    out: list[tuple[str, list[str]]] = [("", [])]
    for i, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("# "):
            out.append((line.strip()[2:], []))
        if i in fields:
            out[-1][1].append(fields[i])
    init = {f.name for f in dataclasses.fields(cls) if f.init}  # `requested` is no flag
    return [(title, [n for n in names if n in init]) for title, names in out if set(names) & init]


def sources(cls) -> dict[str, str]:
    """The comment at the end of each field's line in a dataclass's own body: where a script's default comes from."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    out = {}
    for n in ast.parse("\n".join(lines)).body[0].body:
        if isinstance(n, ast.AnnAssign) and n.end_lineno == n.lineno:
            code, _, comment = lines[n.lineno - 1].partition("  # ")
            if comment and n.end_col_offset <= len(code):
                out[n.target.id] = comment.strip()
    return out


def flag(name: str) -> str:
    return f"`--{name.replace('_', '-')}`"


def default(value) -> str:
    return f"`{value}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(names: list[str], docs: dict[str, str], defaults) -> list[str]:
    out = ["| flag | default (grpo.py) | `--help` | more |", "|---|---|---|---|"]
    for n in names:
        out.append(f"| {flag(n)} | {default(getattr(defaults, n))} | {cell(docs[n])} | {cell(NOTES.get(n, ''))} |")
    return out


def render() -> str:
    mods = {s: importlib.import_module(s) for s in SCRIPTS}
    grpo = mods["grpo"].Args
    docs, defaults = field_docs(grpo), grpo()
    out = [
        "# Flags",
        "",
        "<!-- written by tools/flags_doc.py from common/args.py and the scripts' Args: edit those (or its NOTES), "
        "then rerun it -->",
        "",
        "Every script takes the shared flags of `common/args.py:SharedArgs`; its own `Args` adds its algorithm's",
        "flags and overrides the defaults its paper changes. `python X.py --help` lists all of them, flat, with their",
        "documentation and the script's defaults.",
    ]
    for title, names in sections(SharedArgs):
        out += ["", f"**{title}**", "", *table(names, docs, defaults)]
    shared = {f.name for f in dataclasses.fields(SharedArgs)}
    own = [f.name for f in dataclasses.fields(grpo) if f.name not in shared]
    out += ["", "**Algorithm specific arguments (grpo.py)**", "", *table(own, docs, defaults)]
    out += [
        "",
        "**Per-script defaults that differ from grpo.py (with the source the script gives), and each script's own "
        "flags**",
        "",
        "| script | flag | default | `--help` | source |",
        "|---|---|---|---|---|",
    ]
    grpo_fields = [f.name for f in dataclasses.fields(grpo) if f.init]
    for script in SCRIPTS[1:]:
        args, its_docs, its_sources = mods[script].Args, field_docs(mods[script].Args), sources(mods[script].Args)
        values = args()
        for f in dataclasses.fields(args):
            n = f.name
            if not f.init or n == "exp_name":
                continue
            same = n in grpo_fields and getattr(values, n) == getattr(defaults, n) and its_docs[n] == docs[n]
            if same and n not in its_sources:
                continue
            src = cell(its_sources.get(n, ""))
            out.append(f"| {script}.py | {flag(n)} | {default(getattr(values, n))} | {cell(its_docs[n])} | {src} |")
        removed = [n for n in grpo_fields if n not in {f.name for f in dataclasses.fields(args)}]
        if removed:
            gone = ", ".join(flag(n) for n in removed)
            out.append(f"| {script}.py | (removed) {gone} | | not part of this algorithm | |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        with open(OUT) as f:
            sys.exit(0 if f.read() == text else "docs/flags.md is not current: python tools/flags_doc.py")
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
