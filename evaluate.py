"""Evaluate a checkpoint as the papers report it, without training it (docs/evaluation.md).

avg@k with its standard error over questions, unbiased pass@j for every j = 1..k, maj@k over
math-verify-equivalent answers, the lengths of correct and incorrect completions, truncation, format
errors and verifier timeouts: common/evaluation.py, the code in-training evaluation runs too, with
the training scripts' sampler (common.sampling.make_sampler: vLLM or HF generate), prompt templates
(common.data) and verifier (common.reward).

    python evaluate.py --model-name-or-path runs/grpo__1__1732000000 \\
        --datasets /tmp/smol/test.jsonl,prompt=question champ --samples 8 --temperature 0.7
    python evaluate.py --preset qwen-math --model-name-or-path Qwen/Qwen2.5-Math-1.5B-Instruct \\
        --datasets HuggingFaceH4/MATH-500
    python evaluate.py --preset r1 --model-name-or-path MODEL --datasets aime24.jsonl,k=64 math500.jsonl,k=4

The checkpoint: a Hugging Face directory, a run's checkpoints/step_<k> (or its model/, a LoRA run's
merged weights), a run directory (its last complete checkpoint) or a hub id. A dataset is
NAME[,key=value...]: a hub id, a local .jsonl/.json/.parquet file (any dataset common.data loads),
or `champ`, the champ-dataset package's problems with a numeric answer, offline. Keys override the
flags of the same meaning for that dataset: template (a project template, or a text file holding
{question}), format, prompt, answer, split, config, limit, k, name.

Writes <output-dir>/<exp-name>__<seed>__<unix time>/ (built under .tmp and renamed when complete):
results.json (every number, the flags, versions, the checkpoint's sha256), completions.jsonl (every
completion with its answer, class and verdict), results.md (the table printed on stdout), args.json
and metrics.jsonl (so tools/compare.py and tools/plot.py read it as a run), accuracy_length.png (--plot).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Literal

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.args import PromptTemplate
from common.data import STOP_STRINGS, encode_prompts, load_eval_rows
from common.evaluation import (
    check_samples,
    dataset_key,
    overall,
    score_completions,
    summarise,
)
from common.reward import ANSWER_FORMATS, TEMPLATE_ANSWER_FORMATS, set_workers
from common.run import complete_checkpoints, run_info
from common.sampling import make_sampler, resolve_sampler

# The protocols of the papers, as --preset: each sets the flags below unless they are given.
PRESETS = {
    "none": {},
    # DeepSeek-R1 (arXiv:2501.12948) "Evaluation Setup": 32,768 tokens at most, temperature 0.6,
    # top-p 0.95, k samples per question ("typically between 4 and 64"; 64 for AIME), pass@1 as
    # their mean (avg@k) and cons@64 (maj@k); the R1-Zero template (its Table 1) and its answer tags
    "r1": {
        "temperature": 0.6,
        "top_p": 0.95,
        "samples": 64,
        "max_new_tokens": 32768,
        "prompt_template": "r1",
        "reward_format": "answer-tag",
    },
    # Qwen2.5-Math's evaluation/ (QwenLM/Qwen2.5-Math@a45202b: sh/eval.sh, math_eval.py): greedy
    # (--temperature 0 --top_p 1 --n_sampling 1), max_tokens_per_call 2048, seed 0, the
    # "qwen25-math-cot" prompt (utils.py; the project's qwen-boxed) and the last \boxed{} answer
    "qwen-math": {
        "temperature": 0.0,
        "top_p": 1.0,
        "samples": 1,
        "max_new_tokens": 2048,
        "seed": 0,
        "prompt_template": "qwen-boxed",
        "reward_format": "boxed",
    },
}
SPEC_KEYS = ("template", "format", "prompt", "answer", "split", "config", "limit", "k", "name")


@dataclass
class Args:
    model_name_or_path: str
    """the checkpoint: a Hugging Face directory, a run's checkpoints/step_<k> (or its model/), a run
    directory (its last complete checkpoint) or a hub id"""
    datasets: list[str] = field(default_factory=lambda: ["HuggingFaceH4/MATH-500"])
    """NAME[,key=value...]: hub id, local .jsonl/.json/.parquet or champ; keys template, format,
    prompt, answer, split, config, limit, k, name (docs/evaluation.md)"""
    preset: Literal["none", "r1", "qwen-math"] = "none"
    """a paper's protocol (r1: DeepSeek-R1's; qwen-math: Qwen2.5-Math's evaluation/), its values the
    defaults of the flags below"""
    prompt_template: str = "qwen-boxed"
    """none, qwen-boxed, r1, dapo, torl (as in training), or a text file holding {question}"""
    reward_format: Literal[
        "auto", "any", "boxed", "answer-line", "answer-line-strict", "answer-tag"
    ] = "auto"
    """where the verifier reads the final answer; auto: the template's (a template file needs one)"""
    prompt_column: str = "problem"
    """question column"""
    answer_column: str = "answer"
    """reference answer column (bare, or a solution whose last \\boxed{} is the answer)"""
    split: str = "test"
    """split of a hub dataset"""
    limit: int = 0
    """the first this many questions of each dataset (0: all)"""
    samples: int = 1
    """k completions per question"""
    pass_k: list[int] = field(default_factory=list)
    """the pass@k columns of the table (default 1, 2, 4, ... and k); results.json has every k"""
    temperature: float = 0.0
    """sampling temperature (0: greedy, the k completions are then copies)"""
    top_p: float = 1.0
    """nucleus sampling (1 when greedy)"""
    max_new_tokens: int = 1024
    """generation budget per completion"""
    max_prompt_tokens: int = 1024
    """longer prompts are dropped (and counted)"""
    max_bad_answer_frac: float = 0.1
    """refuse a dataset with more than this fraction of unparseable answers (fewer: dropped)"""
    seed: int = 1
    """the sampler's seed (datasets are sampled in order, one sampler call each)"""
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """auto: vLLM with CUDA and vllm installed, else HF generate"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (CPU: of the memory, for its KV cache)"""
    reward_workers: int = -1
    """math-verify worker processes (-1: this process's cores; 0: none)"""
    output_dir: str = "evals"
    """where the result directory <exp-name>__<seed>__<unix time> is written"""
    exp_name: str = "eval"
    """the result directory's name (tools/compare.py groups by it)"""
    plot: bool = False
    """also draw accuracy against completion length (accuracy_length.png)"""


@dataclass
class Spec:
    """One dataset to evaluate, its options resolved."""

    name: str
    label: str
    template: str  # a project template's name, or a template file's path
    answer_format: str
    prompt_column: str
    answer_column: str
    split: str
    config: str | None
    limit: int
    k: int


def parse(argv: list[str] | None = None) -> Args:
    """The flags, with --preset's values as the defaults of the flags not given."""
    argv = sys.argv[1:] if argv is None else argv
    preset = "none"
    for i, a in enumerate(argv):  # read --preset first: it decides the other flags' defaults
        if a.startswith("--preset="):
            preset = a.split("=", 1)[1]
        elif a == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
    if preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    default = Args(model_name_or_path=tyro.MISSING, preset=preset, **PRESETS[preset])
    return tyro.cli(Args, args=argv, default=default)


def parse_spec(spec: str, args: Args) -> Spec:
    """A --datasets entry, NAME[,key=value...], with the flags as the defaults of its keys."""
    name, *options = spec.split(",")
    given = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise SystemExit(
                f"--datasets {spec!r}: {option!r} is not key=value with a key of {', '.join(SPEC_KEYS)}"
            )
        given[key] = value
    template = given.get("template", args.prompt_template)
    if template not in PromptTemplate.__args__:
        if not os.path.isfile(template):
            raise SystemExit(
                f"--datasets {spec!r}: template {template!r} is neither one of "
                f"{', '.join(PromptTemplate.__args__)} nor a file"
            )
        with open(template) as f:
            if "{question}" not in f.read():
                raise SystemExit(
                    f"--datasets {spec!r}: template file {template!r} holds no {{question}}"
                )
    answer_format = given.get("format", args.reward_format)
    if answer_format == "auto":
        if template not in TEMPLATE_ANSWER_FORMATS:
            raise SystemExit(
                f"--datasets {spec!r}: template {template!r} has no answer format: give format= "
                f"(or --reward-format), one of {', '.join(ANSWER_FORMATS)}"
            )
        answer_format = TEMPLATE_ANSWER_FORMATS[template]
    if answer_format not in ANSWER_FORMATS:
        raise SystemExit(f"--datasets {spec!r}: format must be one of {', '.join(ANSWER_FORMATS)}")
    try:
        k, limit = int(given.get("k", args.samples)), int(given.get("limit", args.limit))
    except ValueError:
        raise SystemExit(f"--datasets {spec!r}: k and limit must be integers") from None
    check_samples(k, args.pass_k, f"--datasets {spec!r}: k (or --samples)", "--pass-k")
    return Spec(
        name=name,
        label=given.get("name", dataset_key(name)),
        template=template,
        answer_format=answer_format,
        prompt_column=given.get("prompt", args.prompt_column),
        answer_column=given.get("answer", args.answer_column),
        split=given.get("split", args.split),
        config=given.get("config"),
        limit=limit,
        k=k,
    )


def check_args(args: Args) -> list[Spec]:
    """One line for each bad flag, before anything is loaded or written; the datasets' specs."""
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.max_new_tokens < 1 or args.max_prompt_tokens < 1 or args.limit < 0:
        raise SystemExit("--max-new-tokens and --max-prompt-tokens must be >= 1, --limit >= 0")
    if not args.datasets:
        raise SystemExit("--datasets: give at least one dataset")
    specs = [parse_spec(s, args) for s in args.datasets]
    labels = [s.label for s in specs]
    if len(set(labels)) < len(labels):
        raise SystemExit(f"--datasets: two datasets are named alike ({labels}): give each a name=")
    return specs


def resolve_model(path: str) -> tuple[str, int | None]:
    """(the Hugging Face directory to load, the training step it was saved at if known), or one line."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            model_dir = path
        elif os.path.isfile(os.path.join(path, "model", "config.json")):  # checkpoints/step_<k>
            model_dir = os.path.join(path, "model")
        elif complete_checkpoints(path):  # a run directory
            model_dir = os.path.join(complete_checkpoints(path)[-1], "model")
        else:
            raise SystemExit(
                f"--model-name-or-path: {path!r} holds no config.json, model/ or complete checkpoint"
            )
        trainer = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "trainer.json")
        step = None
        if os.path.isfile(trainer):
            with open(trainer) as f:
                step = json.load(f).get("step")
        return model_dir, step
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise SystemExit(f"--model-name-or-path: no such checkpoint {path!r}")
    try:  # a hub id: the cached snapshot (offline), or a download
        from huggingface_hub import snapshot_download

        return snapshot_download(path), None
    except Exception as e:  # noqa: BLE001 - any failure becomes one line
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(
            f"--model-name-or-path: {path!r} is no local checkpoint and cannot be fetched from the hub: "
            f"{type(e).__name__}: {first}"
        ) from None


def checkpoint_hash(model_dir: str) -> str:
    """sha256 over the directory's files (relative path and content, in sorted order)."""
    total = hashlib.sha256()
    for top, dirs, files in sorted(os.walk(model_dir, followlinks=True)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            total.update(f"{os.path.relpath(path, model_dir)}\0{digest.hexdigest()}\n".encode())
    return total.hexdigest()


def result_dir(args: Args) -> str:
    """<output-dir>/<exp-name>__<seed>__<unix time>; refused if it exists or cannot be written."""
    out = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}")
    if os.path.exists(out):
        raise SystemExit(f"--output-dir: {out!r} already exists")
    parent = os.path.abspath(args.output_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a probe: root passes os.access everywhere
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as e:
        raise SystemExit(
            f"--output-dir: {args.output_dir!r} is not writable ({e.strerror})"
        ) from None
    return out


def load_set(spec: Spec, tokenizer, args: Args):
    """(prompt ids, golds, rows read) of a dataset: common.data's loading and prompt encoding."""
    questions, answers = load_eval_rows(
        spec.name, spec.config, spec.split, spec.prompt_column, spec.answer_column, "--datasets"
    )
    rows = len(questions)
    questions, answers = questions[: spec.limit or rows], answers[: spec.limit or rows]
    template = spec.template
    if template not in PromptTemplate.__args__:  # a template file: its text, then raw text
        with open(template) as f:
            text = f.read()
        questions, template = [text.replace("{question}", q) for q in questions], "none"
    encoding = SimpleNamespace(
        prompt_template=template,
        max_prompt_tokens=args.max_prompt_tokens,
        max_bad_answer_frac=args.max_bad_answer_frac,
    )
    log = lambda line: print(f"{spec.label}: {line}", file=sys.stderr)  # noqa: E731
    prompts, golds = encode_prompts(questions, answers, tokenizer, encoding, "--datasets", log)
    return prompts, golds, rows


def make_eval_sampler(kind: str, args: Args, model_dir: str, tokenizer, max_len: int):
    """The training scripts' sampler on the checkpoint (HF generate loads the model; vLLM its own)."""
    model = None
    if kind == "hf":
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    sampler = make_sampler(
        kind,
        model=model,
        tokenizer=tokenizer,
        model_name_or_path=model_dir,
        seed=args.seed,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=max_len,
    )
    return sampler


def cell(mean: float, se: float | None = None, digits: int = 3) -> str:
    """ "0.412 ± 0.051" (no ± without a standard error, "-" for NaN)."""
    if mean != mean:
        return "-"
    return f"{mean:.{digits}f}" + ("" if se is None or se != se else f" ± {se:.{digits}f}")


def table(rows: list[tuple[str, int, dict]], pass_ks: list[int]) -> str:
    """The markdown table: one row per dataset and the overall row (k = 0: every dataset's own k)."""
    head = ["dataset", "questions", "k", "avg@k", *(f"pass@{j}" for j in pass_ks), "maj@k"]
    head += ["length (correct / incorrect)", "truncated", "format errors", "verifier timeouts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, k, s in rows:
        avg, maj = (f"avg@{k}", f"maj@{k}") if k else ("avg", "maj")
        cells = [
            label,
            str(int(s["questions"])),
            str(k) if k else "-",
            cell(s[avg], s[f"{avg}_stderr"]),
        ]
        cells += [
            cell(s[f"pass@{j}"], s[f"pass@{j}_stderr"]) if f"pass@{j}" in s else "-"
            for j in pass_ks
        ]
        cells.append(cell(s[maj], s[f"{maj}_stderr"]))
        right, wrong = s["response_length_correct"], s["response_length_incorrect"]
        lengths = f"{cell(right, digits=1)} / {cell(wrong, digits=1)}"
        cells += [lengths, cell(s["truncated_frac"]), cell(s["format_error_frac"])]
        cells.append(str(int(s["reward_timeouts"])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    """Accuracy against completion length: each dataset's completions in 10 equal-width length bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for label, scored in results.items():
        lengths, correct = scored.lengths.ravel(), scored.correct.ravel()
        edges = np.linspace(0, max(lengths.max(), 1), 11)
        which = np.clip(np.digitize(lengths, edges[1:-1]), 0, 9)
        kept = [b for b in range(10) if (which == b).any()]
        centres = [(edges[b] + edges[b + 1]) / 2 for b in kept]
        ax.plot(centres, [correct[which == b].mean() for b in kept], marker="o", label=label)
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def sampler_kind(args: Args, model_dir: str) -> str:
    """--sampler resolved; with vLLM, refused in one line beyond the model's positions."""
    try:
        kind = resolve_sampler(args.sampler)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    length = args.max_prompt_tokens + args.max_new_tokens
    positions = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    if kind == "vllm" and positions is not None and length > positions:
        raise SystemExit(
            f"--max-prompt-tokens + --max-new-tokens = {length} exceeds the model's {positions} "
            "positions, which vLLM refuses: lower them"
        )
    return kind


def run_datasets(sampler, specs: list[Spec], sets: dict, args: Args) -> tuple[dict, dict]:
    """({label: Scored}, {label: {"generate": s, "score": s}}): each dataset in one sampler call, in order."""
    results, seconds = {}, {}
    top_p = args.top_p if args.temperature > 0 else 1.0  # greedy: top-p 1, as in training
    for spec in specs:
        prompts, golds, _ = sets[spec.label]
        sampler.stop = STOP_STRINGS.get(spec.template, [])  # the template's stop (r1: </answer>)
        t0 = time.time()
        completions = sampler.generate(
            prompts, spec.k, args.temperature, top_p, args.max_new_tokens
        )
        t1 = time.time()
        results[spec.label] = score_completions(completions, golds, spec.k, spec.answer_format)
        seconds[spec.label] = {"generate": t1 - t0, "score": time.time() - t1}
        print(
            f"{spec.label}: {len(prompts)} x {spec.k} generated in {t1 - t0:.1f}s, "
            f"scored in {seconds[spec.label]['score']:.1f}s",
            file=sys.stderr,
        )
    return results, seconds


def completion_rows(specs: list[Spec], sets: dict, results: dict, tokenizer):
    """completions.jsonl's rows: every completion with its prompt, answer, class and verdict."""
    for s in specs:
        prompts, golds, _ = sets[s.label]
        r = results[s.label]
        for q, prompt in enumerate(prompts):
            shown = tokenizer.decode(prompt)
            for i in range(s.k):
                yield {
                    "dataset": s.label,
                    "question": q,
                    "sample": i,
                    "prompt": shown,
                    "gold": golds[q],
                    "completion": r.texts[q][i],
                    "answer": r.answers[q][i],
                    "answer_class": r.classes[q][i],
                    "correct": bool(r.correct[q, i]),
                    "tokens": int(r.lengths[q, i]),
                    "truncated": bool(r.truncated[q, i]),
                }


def write_results(out: str, files: dict[str, str], results: dict, draw: bool) -> None:
    """The result directory: `files` ({name: text}) and the plot, written under out.tmp and renamed when
    complete; removed if anything fails."""
    tmp = out + ".tmp"
    try:
        os.makedirs(tmp)
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        if draw:
            plot(results, os.path.join(tmp, "accuracy_length.png"))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(args: Args) -> str:
    """Evaluates, writes the result directory and prints the table; returns the directory."""
    started = time.time()
    specs = check_args(args)
    model_dir, step = resolve_model(args.model_name_or_path)
    out = result_dir(args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"--model-name-or-path: no tokenizer in {model_dir!r}: {first}") from None
    sets = {s.label: load_set(s, tokenizer, args) for s in specs}
    kind = sampler_kind(args, model_dir)
    set_workers(args.reward_workers)
    model = {"path": model_dir, "requested": args.model_name_or_path, "step": step}
    model["sha256"] = checkpoint_hash(model_dir)
    max_len = args.max_prompt_tokens + args.max_new_tokens
    sampler = make_eval_sampler(kind, args, model_dir, tokenizer, max_len)
    try:
        results, seconds = run_datasets(sampler, specs, sets, args)
    finally:
        sampler.close()
    summaries = {label: summarise(r) for label, r in results.items()}
    total = overall(list(summaries.values()))
    kmax = max(s.k for s in specs)
    powers = {2**i for i in range(kmax.bit_length()) if 2**i <= kmax}
    rows = [(s.label, s.k, summaries[s.label]) for s in specs]
    rows += [("overall", 0, total)] if len(specs) > 1 else []
    text = table(rows, args.pass_k or sorted(powers | {kmax}))
    info, flags = run_info("cuda" if torch.cuda.is_available() else "cpu", 1), asdict(args)
    datasets = {
        s.label: {
            **dataclasses.asdict(s),
            "rows": sets[s.label][2],
            "kept": len(sets[s.label][0]),
            **summaries[s.label],
            "verifier": results[s.label].info,
            "vote_verifier": results[s.label].vote_info,
            "seconds": seconds[s.label],
        }
        for s in specs
    }
    record = {"model": model, "sampler": kind, "flags": flags, "run": info, "datasets": datasets}
    record.update(overall=total, seconds=time.time() - started)
    metrics = {  # every number under in-training evaluation's keys, at the checkpoint's step
        f"eval/{label}/{key}": v
        for label, s in summaries.items()
        for key, v in s.items()
        if key not in ("questions", "samples")
    }
    row = {"step": step or 0, **metrics, "time/eval": record["seconds"]}
    files = {
        "completions.jsonl": "".join(
            json.dumps(r) + "\n" for r in completion_rows(specs, sets, results, tokenizer)
        ),
        "results.json": json.dumps(record, indent=1),
        "results.md": text,
        "args.json": json.dumps({**flags, "run": info, "evaluated_model": model_dir}, indent=2),
        "metrics.jsonl": json.dumps(row) + "\n",
    }
    write_results(out, files, results, args.plot)
    print(text, end="")
    print(f"results: {out}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main(parse())
