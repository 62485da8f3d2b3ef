"""common/reward.py: answer extraction, math-verify equivalences, and bounds against hostile completions."""

from __future__ import annotations

import os
import signal
import time

import pytest

from common import reward
from common.reward import extract_final_answer, find_unparseable_gold, math_reward, parse_gold, score
from tests.checks import reward_wall_bound

CORRECT = [
    (r"The answer is \boxed{42}.", "42"),
    (r"so \boxed{\frac{1}{2}}", "0.5"),
    (r"so \boxed{\frac{1}{2}}", "1/2"),
    (r"\boxed{\sqrt{18}}", r"3\sqrt{2}"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}"),
    (r"The correct option is \boxed{B}", "B"),
    ("Compute 3+4.\nAnswer: 7", "7"),
    ("Some work.\n**Answer:** $\\frac{3}{4}$", "0.75"),
    (r"First \boxed{3}, but wait, it is \boxed{5}", "5"),
    (r"\fbox{10}", "10"),
    (r"$\boxed{3/4}$", r"\frac{3}{4}"),
    (r"\boxed{\dfrac{1}{2}}", r"The solution ends with $x = \boxed{\frac12}$."),  # full MATH solution as gold
    ("x" * 2_000_000 + r" so \boxed{12}", "12"),  # a long completion with a normal answer still scores
]
WRONG = [
    (r"\boxed{41}", "42"),
    (r"\boxed{A}", "B"),
    (r"First \boxed{5}, but wait, it is \boxed{3}", "5"),
    ("I have no idea.", "42"),
    ("", "42"),
    (r"\boxed{}", "42"),
]


@pytest.mark.parametrize("completion,gold", CORRECT)
def test_correct(completion, gold):
    assert score([completion], [gold]) == ([1.0], {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0})


@pytest.mark.parametrize("completion,gold", WRONG)
def test_wrong(completion, gold):
    assert math_reward([completion], [gold]) == [0.0]


def test_no_answer_is_counted():
    _, counts = score(["I have no idea.", "", r"\boxed{}", r"\boxed{7}"], ["1", "1", "1", "7"])
    assert counts == {"timeouts": 0, "errors": 0, "no_answer": 3, "format_errors": 3}


def test_batch_matches_items():
    completions, golds = zip(*(CORRECT[:-1] + WRONG))
    assert math_reward(list(completions), list(golds)) == [1.0] * (len(CORRECT) - 1) + [0.0] * len(WRONG)


def test_extract_final_answer():
    assert extract_final_answer(r"\boxed{1} and \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_final_answer(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert extract_final_answer(r"\boxed{\left\{x\right.}") == r"\left\{x\right."  # escaped braces are text
    assert extract_final_answer(r"\boxed{2} then truncated \boxed{\frac{1") == "2"
    assert extract_final_answer("blah\nAnswer: $5$\n") == "5"
    assert extract_final_answer("Answer: 3\nmore\nFinal Answer: \\(4\\).") == "4"
    assert extract_final_answer(r"\boxed{1}" + "\nAnswer: 2") == "1"  # a box beats the answer line
    assert extract_final_answer("no answer here") is None
    assert extract_final_answer("") is None


def test_extract_answer_tags_and_bare_numbers():
    assert extract_final_answer("<think>2+2</think> <answer> $4$ </answer>") == "4"  # R1 template
    assert extract_final_answer(r"<answer>so \boxed{3}</answer>") == "3"
    assert extract_final_answer("3+1=4") == "4"  # no marker: last number of the last line
    assert extract_final_answer("12\nno number on the last line") is None
    assert math_reward(["<answer>1/2</answer>", "4", "7"], ["0.5", "4", "4"]) == [1.0, 1.0, 0.0]


def test_parse_gold_bare_strings_and_cache():
    for gold in [r"\sqrt{18}", "(x+1)^2", r"\{3,2,1\}", "B", "3/4", "10", r"\frac{1}{2}", r"Thus $\boxed{7}$."]:
        assert any(not isinstance(p, str) for p in parse_gold(gold)), gold
    hits = parse_gold.cache_info().hits
    parse_gold("10")
    assert parse_gold.cache_info().hits == hits + 1


def test_find_unparseable_gold():
    assert find_unparseable_gold(["42", "", "???", r"\frac{1}{2}", r"\boxed{5}", "B", "  "]) == [1, 2, 6]


def test_length_mismatch():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        score(["a", "b"], ["1"])
    with pytest.raises(ValueError):
        math_reward(["a"], [])


HOSTILE = {
    "tower": r"\boxed{9^{9^{9^{9^{9}}}}}",
    "nested_parens_6000": r"\boxed{" + "(" * 6000 + "1" + ")" * 6000 + "}",
    "nested_braces_6000": r"\boxed{" + "{" * 6000 + "1" + "}" * 6000 + "}",
    "nested_parens_300": r"\boxed{" + "(" * 300 + "1" + ")" * 300 + "}",  # under the length cap: parsed, slowly
    "two_megabytes": r"\boxed{" + "9" * 2_000_000 + "}",
    "answer_line_2mb": "Answer: " + "1+" * 1_000_000,
    "lone_surrogate": "\\boxed{\ud800}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_is_bounded_and_counted(name):
    start = time.monotonic()
    scores, counts = score([HOSTILE[name]], ["1"], timeout_s=1.0)
    assert time.monotonic() - start < reward_wall_bound(1, 1.0, num_kills=1)
    assert scores == [0.0]
    assert counts["timeouts"] + counts["errors"] + counts["no_answer"] == 1, counts  # cut off, or parsed to nothing


def test_no_code_execution(tmp_path):
    target = tmp_path / "pwned"
    attacks = [
        rf"\boxed{{__import__('os').system('touch {target}')}}",
        f"Answer: eval(\"open('{target}', 'w')\")",
        rf"\boxed{{exec(\"import os; os.system('touch {target}')\")}}",
    ]
    scores, _ = score(attacks, ["0"] * len(attacks), timeout_s=1.0)
    assert scores == [0.0] * len(attacks)
    assert not target.exists()


def test_hostile_neighbours_keep_their_scores():
    good = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{\sqrt{18}}", r"3\sqrt{2}"), (r"\boxed{41}", "42")] * 3
    batch = good[:4] + [(HOSTILE["tower"], "1"), (HOSTILE["nested_parens_300"], "1")] + good[4:]
    start = time.monotonic()
    scores, counts = score([c for c, _ in batch], [g for _, g in batch], timeout_s=2.0)
    assert time.monotonic() - start < reward_wall_bound(len(batch), 2.0, num_kills=2)
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    # each hostile item is cut off (timeout, error) or parsed to nothing (no_answer, e.g. the parser's recursion
    # limit), which of them depends on the machine's speed; the good ones all have an answer
    assert counts["timeouts"] + counts["errors"] + counts["no_answer"] == 2, counts
    assert math_reward([r"\boxed{42}", r"\boxed{2^{10}}"], ["42", "1024"]) == [1.0, 1.0]  # the pool still works


def test_hung_worker_is_killed_and_replaced():
    """A worker stuck where its own alarm cannot fire (C code) is killed by the parent; simulated with SIGSTOP."""
    math_reward([r"\boxed{1}"], ["1.0"])  # make sure the pool exists
    stuck = reward._POOL.workers[0]
    os.kill(stuck.proc.pid, signal.SIGSTOP)
    completions, golds = [rf"\boxed{{{k}/2}}" for k in range(8)], [str(k / 2) for k in range(8)]
    start = time.monotonic()
    scores, counts = score(completions, golds, timeout_s=2.0)
    assert time.monotonic() - start < reward_wall_bound(len(completions), 2.0, num_kills=1)
    assert stuck not in reward._POOL.workers and stuck.proc.poll() is not None
    assert counts["timeouts"] == 1 and sum(scores) == 7.0  # only the item it was on is lost
    assert math_reward(completions, golds) == [1.0] * 8


def test_dead_worker_is_replaced():
    math_reward([r"\boxed{1}"], ["1.0"])
    dead = reward._POOL.workers[-1]
    dead.proc.kill()
    dead.proc.wait()
    assert score([r"\boxed{2/4}"] * 6, ["0.5"] * 6) == (
        [1.0] * 6,
        {"timeouts": 0, "errors": 0, "no_answer": 0, "format_errors": 0},
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_workers_do_not_load_torch():
    math_reward([r"\boxed{1}"], ["1.0"])
    for w in reward._POOL.workers:
        with open(f"/proc/{w.proc.pid}/maps") as f:
            assert "torch" not in f.read()


# Answer formats (math_reward): each paper's verifier reads the answer only where its template puts it.
# (completion, gold, {format: expected score}); a missing format is scored by "any".
FORMAT_CASES = [
    ("First 20 + 22 = 42", "42", {"any": 1, "boxed": 0, "answer-line": 0, "answer-tag": 0}),  # cut off, no marker
    (r"so the sum is \boxed{42}.", "42", {"any": 1, "boxed": 1, "answer-line": 0, "answer-tag": 0}),
    (r"\boxed{41} no, wait: \boxed{42}", "42", {"boxed": 1}),
    (r"\boxed{42} then \boxed{\frac{1", "42", {"boxed": 1}),  # a truncated last box falls back to the one before
    ("Work.\nAnswer: 42", "42", {"any": 1, "boxed": 0, "answer-line": 1, "answer-tag": 0}),
    ("Work.\n**Answer:** $\\frac{3}{4}$.", "0.75", {"answer-line": 1}),
    ("Work.\nanswer : \\boxed{7}", "7", {"answer-line": 1, "boxed": 1}),  # case-insensitive; a box on the line wins
    ("So the final answer: 5, I think", "5, I think", {"answer-line": 1}),  # math_dapo's pattern: anywhere on a line
    ("Answer: 42\n" + "x" * 300, "42", {"any": 1, "answer-line": 0}),  # beyond math_dapo's last 300 characters
    ("Answer: 41\nAnswer: 42", "42", {"answer-line": 1}),  # the last one
    ("<think>2+2</think> <answer> $4$ </answer>", "4", {"any": 1, "boxed": 0, "answer-line": 0, "answer-tag": 1}),
    (r"<think>x</think> <answer>so \boxed{3}</answer>", "3", {"answer-tag": 1, "boxed": 1}),
    ("<think>the answer is 4</think> 4", "4", {"any": 1, "answer-tag": 0}),  # no tags
    ("<answer>4", "4", {"answer-tag": 0}),  # unclosed tag
    ("<answer>3</answer> <answer>4</answer>", "4", {"answer-tag": 1}),
    # a box opening on the answer line that never closes (cut off by the budget) is no answer (math_dapo: -1)
    ("Work.\nAnswer: \\boxed{5", "5", {"answer-line": 0, "answer-line-strict": 0}),
    ("Work.\nAnswer: \\boxed{3} or \\boxed{5", "3", {"answer-line": 0}),
    ("Work.\nAnswer: \\boxed{5}", "5", {"answer-line": 1, "answer-line-strict": 1}),
    # what answer-line strips and math_dapo does not (docs/algorithms.md); answer-line-strict: math_dapo's verdict
    ("Work.\n**Answer:** 5", "5", {"answer-line": 1, "answer-line-strict": 0}),
    ("Work.\nAnswer: 5.", "5", {"answer-line": 1, "answer-line-strict": 0}),
    ("Work.\nAnswer: \\(5\\)", "5", {"answer-line": 1, "answer-line-strict": 0}),
    ("Work.\nAnswer: 5", "5", {"answer-line-strict": 1}),
    ("Work.\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}", {"answer-line": 1, "answer-line-strict": 1}),
    ("Work.\nAnswer: 0.5", "\\frac{1}{2}", {"answer-line": 1, "answer-line-strict": 0}),  # strings, no math-verify
    ("Work.\nAnswer: x = 2,125 dollars", "2125", {"answer-line-strict": 1}),  # after '=', units and commas go
    ("Work.\nAnswer: \\text{(B)}", "(B)", {"answer-line-strict": 1}),
    ("Answer: 42\n" + "x" * 300, "42", {"answer-line-strict": 0}),  # the last 300 characters only
    ("Work.\nAnswer: 41\nAnswer: 42", "42", {"answer-line-strict": 1}),
    ("Work.\nno answer line", "no answer line", {"answer-line-strict": 0}),
    # scientific notation: math-verify alone reads e as Euler's number
    ("Answer: 3.83e35", "3.83 \\times 10^{35}", {"answer-line": 1, "any": 1}),
    (r"\boxed{3.83 \times 10^{35}}", "3.83e35", {"boxed": 1}),
    (r"\boxed{6.6E-34}", r"6.6 \times 10^{-34}", {"boxed": 1}),
    (r"\boxed{3.83 e 35}", r"383 \times 10^{33}", {"boxed": 1}),
    (r"\boxed{3.83e35}", r"3.83 \times 10^{34}", {"boxed": 0}),
    (r"\boxed{e \cdot 2}", "2e", {"boxed": 1}),  # Euler's number stays Euler's number
    (r"\boxed{2e - 1}", "-1 + 2e", {"boxed": 1}),
    (r"\boxed{2e}", "2 \\times 10", {"boxed": 0}),
    # the last-number fallback keeps thousands separators (GSM8K's "#### 2,125")
    ("So she pays 2,000 + 125.\n#### 2,125", "2125", {"any": 1}),
    ("The total is 1,234,567.5", "1234567.5", {"any": 1}),
    ("The numbers are 1, 2, 3", "123", {"any": 0}),
]


@pytest.mark.parametrize("completion,gold,expected", FORMAT_CASES)
def test_answer_formats(completion, gold, expected):
    for fmt, want in expected.items():
        assert math_reward([completion], [gold], answer_format=fmt) == [float(want)], fmt


def test_format_errors_are_counted():
    texts = ["First 20 + 22 = 42", r"\boxed{42}", r"\boxed{41}", "Answer: 42"]
    scores, counts = score(texts, ["42"] * 4, answer_format="boxed")
    assert scores == [0.0, 1.0, 0.0, 0.0] and counts["format_errors"] == 2 and counts["no_answer"] == 2
    assert score(texts, ["42"] * 4)[1]["format_errors"] == 0  # "any" finds an answer in all four


def test_answer_format_for_templates_and_bad_format():
    from common.reward import answer_format_for

    assert [answer_format_for(t) for t in ("none", "qwen-boxed", "dapo", "r1", "torl")] == [
        "any",
        "boxed",
        "answer-line",
        "answer-tag",
        "boxed",
    ]
    assert answer_format_for("r1", "boxed") == "boxed"
    with pytest.raises(ValueError, match="answer_format"):
        score(["4"], ["4"], answer_format="latex")


def test_scientific_notation_rewrite_leaves_euler_and_words_alone():
    from common.reward import sci_to_latex

    assert sci_to_latex("3.83e35") == sci_to_latex("3.83 E 35") == r"3.83 \times 10^{35}"
    assert sci_to_latex("6.6e-34") == r"6.6 \times 10^{-34}" and sci_to_latex(".5e+2") == r".5 \times 10^{+2}"
    for text in ("2e", "e", "e^{2}", "x e 5", "2e - 1", "x2e5", "0x1e5", "1.5e-3x", "1.2.3e5", r"\frac{1}{2}e^{3}"):
        assert sci_to_latex(text) == text, text


def test_thousands_separators_in_the_last_number():
    assert extract_final_answer("#### 2,125") == "2125"
    assert extract_final_answer("The numbers are 1, 2, 3") == "3"  # a list, not 123
    assert extract_final_answer("pairs 1,2,3") == "3"  # groups of exactly 3 digits only
    assert extract_final_answer("about -12,345,678.25 in all") == "-12345678.25"


def test_answer_line_strict_is_math_dapos_prediction():
    """extract_final_answer in answer-line-strict is math_dapo's normalised prediction (what maj@k votes on)."""
    assert extract_final_answer("Answer: $\\frac{1}{2}$", "answer-line-strict") == "\\frac{1}{2}"
    assert extract_final_answer("**Answer:** 5", "answer-line-strict") == "**5"
    assert extract_final_answer("Answer: \\boxed{5", "answer-line-strict") == "\\boxed{5"
    assert extract_final_answer("Answer: \\fracab", "answer-line-strict") == "\\frac{a}{b}"
    assert extract_final_answer("Answer: 90^\\circ", "answer-line-strict") == "90"


@pytest.mark.parametrize("script", ["grpo", "dapo", "dr_grpo", "lite_ppo", "gspo", "cispo", "daro"])
def test_every_script_offers_every_answer_format(script):
    import importlib
    import typing

    hint = typing.get_type_hints(importlib.import_module(script).Args)["reward_format"]
    assert typing.get_args(hint) == ("auto", *reward.ANSWER_FORMATS)
