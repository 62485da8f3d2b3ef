"""tools/plot.py on fixture runs: a valid PNG with one panel per key, seeds averaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import plot  # noqa: E402


def fake_run(root, name, slope):
    run = root / name
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(20):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "train/reward_mean": slope * s,
                        "train/accuracy": 0.5,
                        "train/entropy": float("nan") if s == 3 else 1.0,
                    }
                )
                + "\n"
            )
    return str(run)


def test_plot_writes_a_png(tmp_path):
    runs = [
        fake_run(tmp_path, "grpo__1__100", 0.1),
        fake_run(tmp_path, "grpo__2__101", 0.2),
        fake_run(tmp_path, "dapo__1__102", 0.3),
    ]
    out = str(tmp_path / "curves.png")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "plot.py"),
            *runs,
            "--out",
            out,
            "--smooth",
            "3",
            "--keys",
            "train/reward_mean",
            "train/entropy",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 5000


def test_smoothing_and_labels():
    assert plot.smooth([0, 2, 4, 6], 2) == [0, 1, 3, 5]
    assert plot.label("/x/runs/dapo__3__1700000000") == ("dapo", "3")


def test_missing_metrics_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "no metrics.jsonl" in proc.stderr
