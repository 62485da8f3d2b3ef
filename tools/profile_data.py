"""Profile a dataset under a model (what --difficulty-file reads): per-prompt pass rate and response lengths.

Uses the training scripts' own data loading (common/data.py's load_rows / encode_prompts: the same filtering,
prompt template and special tokens), sampler (common.sampling.make_sampler: vLLM on GPU, HF generate on CPU) and
verifier (common.reward.score, in the run's answer format: --reward-format auto picks it from --prompt-template as the
scripts do, so a profile for a qwen-boxed run counts only \\boxed{} answers). Writes one JSON line per prompt:

    {"index": i, "prompt": <the templated prompt, decoded>, "answer": ..., "samples": K, "pass_rate": ...,
     "length_mean": ..., "length_std": ..., "truncated_frac": ..., "no_reasoning_frac": ...}

`no_reasoning_frac`: the fraction of completions that answer without reasoning: the completion has a final
answer (common.reward.extract_final_answer) and, once that answer is removed, fewer than 5 words
(\\w+ runs of letters, LaTeX commands excluded) remain. Then prints a summary table and writes a PNG
histogram of pass rates next to the output (<output>.png). Any script reads the output with --difficulty-file.

    python tools/profile_data.py --model-name-or-path Qwen/Qwen2.5-Math-1.5B --samples 8 --limit 500 --output math.jsonl

Pass the flags of the run the profile is for (--prompt-template, --reward-format, --max-new-tokens): a completion
cut short by a smaller budget, or scored in another format, gives another pass rate. On the toy task (README
"Data strategies") it takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field, make_dataclass
from typing import Annotated, get_type_hints

import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.args import SharedArgs, field_docs  # noqa: E402

NO_REASONING_WORDS = 5  # a final answer with fewer words than this around it "answers without reasoning"
_WORDS = re.compile(r"(?<![\\A-Za-z])[A-Za-z]+")


# The run's flags, taken from the scripts' shared flags (common/args.py) with their types, defaults and help (some
# scripts have other defaults): pass the values of the run the profile is for, so that it loads, templates, samples
# and scores the data as that run will.
RUN_FLAGS = """model_name_or_path dataset_name dataset_config dataset_split prompt_column answer_column prompt_template
reward_format max_prompt_tokens max_bad_answer_frac sampler max_new_tokens temperature top_p seed""".split()

_types, _docs, _defaults = get_type_hints(SharedArgs), field_docs(SharedArgs), SharedArgs(exp_name="profile")
RunFlags = make_dataclass(
    "RunFlags",
    [(n, Annotated[_types[n], tyro.conf.arg(help=_docs[n])], field(default=getattr(_defaults, n))) for n in RUN_FLAGS],
)


@dataclass
class Args(RunFlags):
    samples: int = 8
    """K, completions per prompt"""
    limit: int = 256
    """profile at most this many prompts, the first of the dataset (0: all); only they get a prior in the run"""
    batch_prompts: int = 64
    """prompts per generate call"""
    output: str = "profile.jsonl"
    """where the per-prompt JSON lines go (the histogram goes to the same name with .png)"""


def answers_without_reasoning(text: str, answer_format: str = "any") -> bool:
    """A final answer with fewer than NO_REASONING_WORDS words (letters only, LaTeX commands excluded) besides it."""
    from common.reward import extract_final_answer

    answer = extract_final_answer(text, answer_format)
    if answer is None:
        return False
    return len(_WORDS.findall(text.replace(answer, " "))) < NO_REASONING_WORDS


def profile_rows(indices, outs, golds, k: int, answer_format: str, decode, prompts) -> list[dict]:
    """One row per prompt of a generate call: `outs` holds k completions per index, `golds` one answer per index."""
    from common.reward import score

    correct, _ = score([o.text for o in outs], [g for g in golds for _ in range(k)], answer_format=answer_format)
    rows = []
    for j, i in enumerate(indices):
        group, c = outs[j * k : (j + 1) * k], correct[j * k : (j + 1) * k]
        lengths = [len(o.token_ids) for o in group]
        rows.append(
            {
                "index": i,
                "prompt": decode(prompts[i]),
                "answer": golds[j],
                "samples": k,
                "pass_rate": float(np.mean(c)),
                "length_mean": float(np.mean(lengths)),
                "length_std": float(np.std(lengths)),
                "truncated_frac": float(np.mean([o.truncated for o in group])),
                "no_reasoning_frac": float(np.mean([answers_without_reasoning(o.text, answer_format) for o in group])),
            }
        )
    return rows


def summary_table(rows: list[dict]) -> str:
    """A markdown table: prompts, pass-rate quantiles and buckets, lengths, no-reasoning fraction."""
    p = np.array([r["pass_rate"] for r in rows])
    lines = ["| statistic | value |", "|-|-|", f"| prompts | {len(rows)} |", f"| mean pass rate | {p.mean():.3f} |"]
    lines += [f"| pass rate p{q} | {np.percentile(p, q):.3f} |" for q in (10, 50, 90)]
    lines += [
        f"| all wrong (p = 0) | {(p == 0).mean():.3f} |",
        f"| all correct (p = 1) | {(p == 1).mean():.3f} |",
        f"| medium (0.2 <= p <= 0.8) | {((p >= 0.2) & (p <= 0.8)).mean():.3f} |",
        f"| mean response length | {np.mean([r['length_mean'] for r in rows]):.1f} |",
        f"| truncated | {np.mean([r['truncated_frac'] for r in rows]):.3f} |",
        f"| answers without reasoning | {np.mean([r['no_reasoning_frac'] for r in rows]):.3f} |",
    ]
    return "\n".join(lines)


def main(args: Args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.data import STOP_STRINGS, chat_template_note, encode_prompts, load_rows
    from common.reward import answer_format_for
    from common.sampling import make_sampler

    if args.samples < 1 or args.limit < 0 or args.batch_prompts < 1:
        raise SystemExit("--samples and --batch-prompts must be >= 1, --limit >= 0")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise SystemExit(f"--output: no directory for {args.output!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"--model-name-or-path: cannot load {args.model_name_or_path!r}: {type(e).__name__}") from None
    tokenizer.padding_side = "left"
    questions, answers = load_rows(
        args.dataset_name,
        args.dataset_config,
        args.dataset_split,
        args.prompt_column,
        args.answer_column,
        "--dataset-name",
    )
    prompts, golds = encode_prompts(questions, answers, tokenizer, args, "--dataset-name")
    if note := chat_template_note(args.prompt_template, tokenizer, args.model_name_or_path):
        print(note)  # as the training scripts say it
    n = min(len(prompts), args.limit) if args.limit else len(prompts)
    sampler = make_sampler(
        args.sampler,
        model=model,
        tokenizer=tokenizer,
        model_name_or_path=args.model_name_or_path,
        seed=args.seed,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens,
        stop=STOP_STRINGS.get(args.prompt_template, []),
    )
    k, rows, fmt = args.samples, [], answer_format_for(args.prompt_template, args.reward_format)
    for start in range(0, n, args.batch_prompts):
        batch = list(range(start, min(n, start + args.batch_prompts)))
        outs = sampler.generate([prompts[i] for i in batch], k, args.temperature, args.top_p, args.max_new_tokens)
        rows += profile_rows(batch, outs, [golds[i] for i in batch], k, fmt, tokenizer.decode, prompts)
        print(f"profiled {len(rows)}/{n} prompts ({fmt} answers)", flush=True)
    with open(args.output, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table = summary_table(rows)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist([r["pass_rate"] for r in rows], bins=np.linspace(0, 1, k + 2) if k < 20 else 20, edgecolor="black")
    ax.set(xlabel=f"pass rate ({k} samples per prompt)", ylabel="prompts", title=os.path.basename(args.dataset_name))
    fig.tight_layout()
    png = os.path.splitext(args.output)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {args.output} and {png}")


if __name__ == "__main__":
    main(tyro.cli(Args))
