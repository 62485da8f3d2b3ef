"""Bad input: a one-line error naming the flag, and nothing written to the output directory (SPEC §8).
In-process (grpo.main), so each case costs a model load, not an interpreter start; the subprocess form of
the same guarantee (the last stderr line) is in tests/test_scripts.py."""

from __future__ import annotations

import json
import os

import pytest

import grpo


def toy_args(assets, out, **kw):
    base = dict(model_name_or_path=assets["model"], dataset_name=assets["train"], prompt_column="question", answer_column="answer",
                prompt_template="none", group_size=4, prompts_per_step=4, max_new_tokens=2, max_prompt_tokens=32,
                total_steps=1, micro_batch_size=64, sampler="hf", output_dir=str(out), save_every=0, log_samples_every=0)
    return grpo.Args(**{**base, **kw})


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def refuse(args, flag):
    with pytest.raises(SystemExit) as e:
        grpo.main(args)
    message = str(e.value.code)
    assert flag in message and "\n" not in message, message
    assert not os.path.exists(args.output_dir) or os.listdir(args.output_dir) == []
    return message


def test_missing_column_lists_the_available_ones(toy_assets, tmp_path):
    message = refuse(toy_args(toy_assets, tmp_path / "out", answer_column="solution"), "--answer-column")
    assert "['question', 'answer']" in message


def test_empty_dataset(toy_assets, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refuse(toy_args(toy_assets, tmp_path / "out", dataset_name=str(empty)), "--dataset-name")


def test_unparseable_answers_above_the_threshold(toy_assets, tmp_path):
    rows = [{"question": f"{i}+1=", "answer": "???" if i % 2 else str(i + 1)} for i in range(20)]
    message = refuse(toy_args(toy_assets, tmp_path / "out", dataset_name=write_jsonl(tmp_path / "bad.jsonl", rows)), "--max-bad-answer-frac")
    assert "10 of 20" in message and "???" in message


def test_unparseable_answers_below_the_threshold_are_dropped_and_reported(toy_assets, tmp_path, capsys):
    questions, answers = [f"{i}+1=" for i in range(20)], [str(i + 1) for i in range(19)] + ["???"]
    prompts, golds = grpo.encode_prompts(questions, answers, __import__("transformers").AutoTokenizer.from_pretrained(toy_assets["model"]),
                                         toy_args(toy_assets, tmp_path / "out"), "--dataset-name")
    assert len(prompts) == 19 and "???" not in golds
    assert "dropped 1 rows whose answer cannot be parsed" in capsys.readouterr().out


def test_prompts_longer_than_the_limit(toy_assets, tmp_path, capsys):
    refuse(toy_args(toy_assets, tmp_path / "out", max_prompt_tokens=2), "--max-prompt-tokens")
    tok = __import__("transformers").AutoTokenizer.from_pretrained(toy_assets["model"])
    prompts, _ = grpo.encode_prompts(["1+1=", "1+1=" * 20], ["2", "2"], tok, toy_args(toy_assets, tmp_path / "o", max_prompt_tokens=10), "--dataset-name")
    assert len(prompts) == 1 and "dropped 1 prompts longer than --max-prompt-tokens 10" in capsys.readouterr().out


@pytest.mark.parametrize("kw,flag", [
    ({"group_size": 1}, "--group-size"),
    ({"num_mini_batches": 3}, "--num-mini-batches"),
    ({"temperature": 0.0}, "--temperature"),
    ({"model_name_or_path": "/nonexistent/model"}, "--model-name-or-path"),
    ({"dataset_name": "/nonexistent/data.jsonl"}, "--dataset-name"),
    ({"total_steps": 0}, "--total-steps"),
    ({"vllm_enable_sleep_mode": True}, "--vllm-enable-sleep-mode"),
])
def test_invalid_flags(kw, flag, toy_assets, tmp_path):
    refuse(toy_args(toy_assets, tmp_path / "out", **kw), flag)


def test_resume_needs_a_run_directory_with_a_complete_checkpoint(toy_assets, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2.tmp").mkdir(parents=True)  # a save that was killed half-way
    refuse(toy_args(toy_assets, tmp_path / "out", resume=str(run)), "--resume")


def test_unwritable_output_directory(toy_assets, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = toy_args(toy_assets, blocker / "runs")  # under a regular file: not creatable, even by root
    with pytest.raises(SystemExit) as e:
        grpo.main(args)
    assert "--output-dir" in str(e.value.code)


def test_existing_run_directory_without_resume(toy_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo.time, "time", lambda: 1234567890.0)
    (tmp_path / "out" / "grpo__1__1234567890").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        grpo.main(toy_args(toy_assets, tmp_path / "out"))
    assert "--output-dir" in str(e.value.code) and "--resume" in str(e.value.code)
    assert os.listdir(tmp_path / "out" / "grpo__1__1234567890") == []
