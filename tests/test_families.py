"""Models a user brings: tiny random models of several families, built from their configs, give the trainer the
log-probs their own forward gives (logit scales and soft caps included, or a one-line refusal); a Gemma-3 base model (a
tokenizer that adds BOS, no chat template, sliding-window layers, tied scaled embeddings, a logit soft cap) runs
through one script of each path it takes differently, on both samplers, with the log-prob canary below 1e-4;
prompts get the tokenizer's BOS exactly when they are raw text."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from common.data import chat_template_note, encode_prompt, load_data
from common.logprobs import TokenLogProbs
from tests.checks import case_run, run_selected_cases
from tests.test_scripts import LEARN_FLAGS, ROOT, read_metrics, toy_flags
from tests.toy import build_gemma3

LOGPROB_ATOL = 1e-4  # the canary's bound (tests/test_vllm.py explains it)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
SMALL.update(num_key_value_heads=1)
FAMILIES = {  # config class, its settings: what each family does differently at the output layer or in attention
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 20.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "final_logit_softcapping": 5.0, "sliding_window": 4}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5}),
    "cohere": ("CohereConfig", {"logit_scale": 0.25}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


def tiny(family: str):
    import transformers

    name, settings = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**SMALL, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():  # random, larger output weights: logits of a few units, where a cap or a scale matters
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_are_the_models_own(family, temperature):
    """TokenLogProbs on left-padded prompts and right-padded completions equals log_softmax(model(...).logits / T) of
    the model's own forward, values and gradients, in float64."""
    model = tiny(family)
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :2] = attn[1, :1] = attn[2, 8:] = 0  # left-padded prompts (width 4), a right-padded completion
    policy = TokenLogProbs(model)
    logps, _ = policy(ids, attn, 4, temperature)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits[:, 3:-1]
    want = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, 4:, None])[..., 0]
    mask = attn[:, 4:].bool()
    torch.testing.assert_close(logps[mask], want[mask], rtol=1e-10, atol=1e-10)
    weights = torch.rand(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * mask
    head = model.get_output_embeddings().weight
    (mine,) = torch.autograd.grad((logps * weights).sum(), head)
    (theirs,) = torch.autograd.grad((want * weights).sum(), head)
    torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)


def test_a_head_it_cannot_read_is_refused_in_one_line():
    model = tiny("qwen2")
    model.lm_head = torch.nn.Linear(32, 64, bias=True)
    with pytest.raises(ValueError, match="bias-free linear output layer"):
        TokenLogProbs(model)


# Prompt encoding: BOS on raw text, exactly as the tokenizer adds it ---------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return build_gemma3(str(tmp_path_factory.mktemp("gemma3")))


def test_raw_text_prompts_get_bos_once_and_chat_prompts_keep_their_own(gemma, toy_assets):
    from transformers import AutoTokenizer

    bos_tok, plain_tok = AutoTokenizer.from_pretrained(gemma), AutoTokenizer.from_pretrained(toy_assets["model"])
    bos = bos_tok.bos_token_id
    for template in ("none", "r1", "torl", "qwen-boxed", "dapo"):  # gemma has no chat template: all are raw text
        ids = encode_prompt("3+4=", template, bos_tok)
        assert ids[0] == bos and ids.count(bos) == 1, template
        assert ids[1:] == bos_tok(ids and bos_tok.decode(ids[1:]), add_special_tokens=False).input_ids
    assert encode_prompt("<bos>3+4=", "none", bos_tok) == encode_prompt("3+4=", "none", bos_tok)  # not twice
    assert encode_prompt("3+4=", "none", bos_tok)[-1] != bos_tok.eos_token_id
    for template in ("none", "r1", "torl"):  # a tokenizer that adds nothing: the text's own tokens
        assert (
            encode_prompt("3+4=", template, plain_tok)
            == plain_tok(
                plain_tok.decode(encode_prompt("3+4=", template, plain_tok)), add_special_tokens=False
            ).input_ids
        )
    chat = encode_prompt("3+4=", "qwen-boxed", plain_tok)  # its chat template writes the special tokens itself
    assert plain_tok.decode(chat).startswith("<|im_start|>system") and chat.count(plain_tok.eos_token_id) == 2


def test_a_chat_template_the_model_lacks_is_said_once(gemma, toy_assets, tmp_path):
    from transformers import AutoTokenizer

    import grpo

    tok = AutoTokenizer.from_pretrained(gemma)
    note = chat_template_note("qwen-boxed", tok, gemma)
    assert "no chat template" in note and "<bos>" in note and "\n" not in note
    assert chat_template_note("none", tok, gemma) is None
    assert chat_template_note("qwen-boxed", AutoTokenizer.from_pretrained(toy_assets["model"]), "x") is None
    lines = []
    args = grpo.Args(model_name_or_path=gemma, dataset_name=toy_assets["train"], prompt_column="question")
    args.answer_column, args.max_prompt_tokens = "answer", 64
    data, _ = load_data(args, tok, lines.append)
    assert lines == [note] and all(p[0] == tok.bos_token_id for p in data.prompts)
    profile = [sys.executable, os.path.join(ROOT, "tools", "profile_data.py"), "--model-name-or-path", gemma]
    profile += ["--dataset-name", toy_assets["train"], "--prompt-column", "question", "--answer-column", "answer"]
    profile += ["--prompt-template", "qwen-boxed", "--sampler", "hf", "--samples", "2", "--limit", "2"]
    profile += ["--max-new-tokens", "2", "--output", str(tmp_path / "profile.jsonl")]
    proc = subprocess.run(profile, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines().count(note) == 1, proc.stdout + proc.stderr[-2000:]


# Every script on a Gemma-3 base model, both samplers -------------------------------------------------------------


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a vLLM engine's process
    return {**base, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}


# One script per path a Gemma-3 model takes differently, on vLLM; HF generate with grpo.py only. Every script samples
# through common/'s rollout and engine and scores through common/'s log-probs, so the soft cap and scaled embeddings
# reach the engine and the trainer by the same code in all of them, and every script pushes its weights where grpo.py
# does (tests/test_vllm.py reads each one). Here: grpo.py (the plain path), dppo.py (the sampler's log-probs are its
# ratio, no correction), daro.py (a second correction of its own), ppo.py (a Gemma-3 critic, as vapo.py and
# long_cot.py build theirs: common/critic.py), l1.py (its budget's text in every prompt, after the BOS), cppo.py
# (pruned completions skip the log-prob pass). tests/test_vllm.py runs dapo.py and lite_ppo.py's rollouts on vLLM.
GEMMA_SCRIPTS = ("grpo", "dppo", "daro", "ppo", "l1", "cppo")
GEMMA_CASES = [(s, "vllm") for s in GEMMA_SCRIPTS] + [("grpo", "hf")]


GEMMA_TEST = "test_the_scripts_train_a_gemma3_base_model"


@pytest.fixture(scope="module")
def gemma_runs(request, gemma, toy_assets, tmp_path_factory):
    """The cases of the test below that this session runs, in one process (tests.checks.run_selected_cases)."""
    have_vllm = importlib.util.find_spec("vllm") is not None

    def make_run(case, out):
        script, sampler = case["script"], case["sampler"]
        if sampler == "vllm" and not have_vllm:
            return None
        extra = {**LEARN_FLAGS[script], "model-name-or-path": gemma, "sampler": sampler, "max-new-tokens": 8}
        extra.update({"vllm-gpu-memory-utilization": 0.02, "learning-rate": 1e-3, "prompts-per-step": 8})
        extra["top-p"] = 1.0  # lite_ppo's 0.99 renormalises the sampled log-probs over the nucleus: no canary
        extra.update({"max-gen-batches": 1} if script in ("dapo", "cispo") else {})
        return script, toy_flags(toy_assets, out, 2, **extra)

    return run_selected_cases(request, {GEMMA_TEST: make_run}, str(tmp_path_factory.mktemp("gemma")), env())


@pytest.mark.slow
@pytest.mark.parametrize("script,sampler", GEMMA_CASES)
def test_the_scripts_train_a_gemma3_base_model(script, sampler, gemma_runs, request):
    """Two steps on the toy task with the raw-text template: the prompts start with the tokenizer's BOS (the ids
    vLLM samples from are the trainer's: the canary would show any other), every step's canary is below 1e-4 (HF
    generate's processed log-probs too: the trainer applies the model's soft cap), the rollout correction's weights
    are 1 on vLLM, and the runs end without a traceback."""
    if sampler == "vllm":
        pytest.importorskip("vllm")
    out_dir = case_run(request, gemma_runs)
    (run_dir,) = glob.glob(os.path.join(out_dir, f"{script}__*"))
    rows = read_metrics(run_dir)
    diffs = [r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [0, 1] and diffs and max(diffs) < LOGPROB_ATOL, diffs
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        assert json.loads(f.readline())["prompt"].startswith("<bos>")
    if sampler == "vllm" and script not in ("dppo", "m2po"):  # theirs is the sampler's ratio, no correction on top
        # --rollout-correction auto is token-truncate with vLLM: in fp32 its weights exp(old - sampler) are 1
        weights = [r[f"train/rollout_corr_weight_{k}"] for r in rows for k in ("min", "max") if "train/loss" in r]
        assert weights and all(abs(w - 1) < LOGPROB_ATOL for w in weights), weights
