"""benchmarks/bench_trainer.py --shape tiny: the report's fields, and ours and TRL's full-logits path compute the same
loss and gradient on the same batch and model (fp32 on a CPU); the Liger sides refuse on a CPU in one line, and the
hidden states trl-liger-loss hands Liger's fused GRPO loss give TRL's loss and gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_shape_reports_every_field_and_both_sides_compute_the_same_update(tmp_path):
    pytest.importorskip("trl")
    sides = ["ours", "trl", "trl-liger", "trl-liger-loss"]
    cmd = [sys.executable, "benchmarks/bench_trainer.py", "--shape", "tiny", "--sides", *sides]
    subprocess.run(cmd + ["--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=300)
    report = json.loads((tmp_path / "trainer_cpu_tiny.json").read_text())
    meta, (ours, trl, *liger) = report["meta"], report["results"]
    for side, r in zip(sides[2:], liger):  # Liger's layer kernels are Triton: the side's row says why it did not run
        assert (
            r == {"side": side, "shape": "tiny", "error": r["error"]}
            and "--liger-kernel needs a CUDA GPU" in r["error"]
        )
    assert meta["date"] and meta["device"] and meta["versions"]["torch"] and meta["versions"]["trl"] == "1.16.0"
    assert meta["real_tokens"] == 1215  # 16 prompts of 16 tokens, completions of 16-118
    for side, r in (("ours", ours), ("trl", trl)):
        assert r["side"] == side and "error" not in r, r
        assert r["tokens_per_s"] == pytest.approx(r["real_tokens"] / r["update_s"])
        assert r["mfu"] is None and r["peak_gib"] is None and r["peak_rss_mib"] > 0  # a CPU: no peak FLOP/s, no CUDA
        split = r["split_s"]
        assert set(split) == {"decoder_fwd", "logprob_fwd", "logprob_bwd", "decoder_bwd", "optimizer"}
        # The phases are disjoint intervals of one more update: they sum to at most its own wall time (a bound that
        # does not depend on how busy the machine is, unlike the timed updates' median).
        assert all(t > 0 for t in split.values()) and sum(split.values()) <= r["split_update_s"]
    # Same model, batch and GRPO loss (old = current log-probs: -mean advantage, aggregated per sequence then over
    # sequences, TRL's over 4 accumulated micro-batches): equal to fp32 rounding. The gradient norm checks the
    # log-prob paths: a sum over ~1e5 squared fp32 entries, each ~10 fp32 sums deep (bound ~1e-5 relative).
    assert ours["loss"] == pytest.approx(trl["loss"], rel=1e-6, abs=1e-7)
    assert ours["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4)
    assert "| ours |" in (tmp_path / "trainer_cpu_tiny.md").read_text()


def test_trl_liger_loss_hands_the_fused_loss_the_hidden_states_of_trls_log_probs():
    """trl-liger-loss's update with a stand-in for Liger's LigerFusedLinearGRPOLoss (its loss_type="grpo" formula, beta
    0, written from the hidden states and the output weight in plain torch: Liger's kernel is not needed for what is
    checked here) gives the trl side's loss and gradients: the hidden states it slices sit before each completion
    token, as TRL's log-probs from full logits do."""
    import contextlib

    import torch

    sys.path.insert(0, ROOT)
    from benchmarks import bench_trainer as bt

    def grpo_loss(hidden, weight, ids, mask, advantages):  # liger_kernel.chunked_loss.grpo_loss, loss_type="grpo"
        logps = torch.log_softmax(hidden @ weight.T / bt.TEMPERATURE, -1).gather(-1, ids[..., None])[..., 0]
        ratio = torch.exp(logps - logps.detach())
        per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), {}

    results = []
    for liger_loss in (None, grpo_loss):
        model = bt.build("tiny", torch.device("cpu"))
        batch = bt.rollout("tiny", model.config.vocab_size, torch.device("cpu"))
        split = bt.Split(model, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        grads = {}
        for name, param in model.named_parameters():
            param.register_hook(lambda g, name=name, grads=grads: grads.__setitem__(name, grads.get(name, 0) + g))
        loss, norm = bt.trl_update(model, optimizer, batch, split, contextlib.nullcontext, False, liger_loss)
        results.append((float(loss), float(norm), grads))
    (want_loss, want_norm, want), (got_loss, got_norm, got) = results
    assert got_loss == pytest.approx(want_loss, rel=1e-6, abs=1e-7) and got_norm == pytest.approx(want_norm, rel=1e-5)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=name)
