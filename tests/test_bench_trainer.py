"""benchmarks/bench_trainer.py --shape tiny: the report's fields, and ours and TRL's full-logits path compute the same
loss and gradient on the same batch and model (fp32 on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_shape_reports_every_field_and_both_sides_compute_the_same_update(tmp_path):
    pytest.importorskip("trl")
    cmd = [sys.executable, "benchmarks/bench_trainer.py", "--shape", "tiny", "--sides", "ours", "trl"]
    subprocess.run(cmd + ["--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=300)
    report = json.loads((tmp_path / "trainer_cpu_tiny.json").read_text())
    meta, (ours, trl) = report["meta"], report["results"]
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
