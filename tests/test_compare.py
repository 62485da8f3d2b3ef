"""tools/compare.py on fixture run directories: the mean, the 95% Student t interval and Welch's interval of a
difference against a hand computation, grouping by exp-name and by the flags that differ, and killed runs (missing
or half-written run directories) reported in one line each and left out."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import compare  # noqa: E402

ARGS = {"exp_name": "dapo", "seed": 1, "clip_eps_high": 0.28, "learning_rate": 3e-3, "total_steps": 5}


def fake_run(root, name: str, finals: float, args: dict | None = None, steps: int = 5) -> str:
    """A run directory whose train/accuracy is 0.1 before its last step and `finals` at it (so best = max of both),
    and whose eval/test/avg@4 is logged at the last step only."""
    run = root / name
    run.mkdir()
    exp, seed = name.split("__")[:2]
    with open(run / "args.json", "w") as f:
        json.dump({**ARGS, "exp_name": exp, "seed": int(seed), "output_dir": str(root), **(args or {})}, f)
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(steps):
            row = {"step": s, "train/accuracy": finals if s == steps - 1 else 0.1, "time/step": 0.1 * s}
            if s == steps - 1:
                row["eval/test/avg@4"] = finals / 2
            f.write(json.dumps(row) + "\n")
    return str(run)


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "compare.py"), *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def csv_rows(proc) -> dict[tuple[str, str, str], dict]:
    assert proc.returncode == 0, proc.stderr
    return {(r["metric"], r["stat"], r["group"]): r for r in csv.DictReader(io.StringIO(proc.stdout))}


def test_t_quantiles_match_closed_forms_and_tables():
    for p in (0.6, 0.9, 0.975, 0.995):
        assert compare.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
        assert compare.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    # two-sided 95% critical values as printed in tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2)
    for df, value in ((3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042), (100, 1.984), (10**7, 1.960)):
        assert compare.t_quantile(0.975, df) == pytest.approx(value, abs=6e-4)
    for df in (1.5, 3.99, 7.3):  # Welch's df is not whole: the quantile inverts the CDF
        assert compare.t_cdf(compare.t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-12)
        assert (
            compare.t_quantile(0.975, math.floor(df))
            > compare.t_quantile(0.975, df)
            > compare.t_quantile(0.975, math.ceil(df))
        )


def test_window_means_against_brute_force():
    rng = random.Random(0)
    points = sorted((s, rng.random()) for s in rng.sample(range(200), 60))  # uneven steps, as eval rows are
    for window in (1, 3, 10, 500):
        brute = [
            sum(v for t, v in points if s - window < t <= s) / sum(1 for t, _ in points if s - window < t <= s)
            for s, _ in points
        ]
        assert compare.window_means(points, window) == pytest.approx(brute, rel=1e-12)


def test_mean_interval_and_welch_difference_against_a_hand_computation(tmp_path):
    a = [0.2, 0.4, 0.6]  # baseline: mean 0.4, s = 0.2
    b = [0.5, 0.6, 0.7, 0.9]  # mean 0.675, s^2 = 0.0875 / 3
    runs = [fake_run(tmp_path, f"base__{i + 1}__{i}", v) for i, v in enumerate(a)]
    runs += [fake_run(tmp_path, f"high__{i + 1}__{i + 10}", v) for i, v in enumerate(b)]
    rows = csv_rows(cli(*runs, "--csv"))
    base, high = (rows[("train/accuracy", "final", "base")], rows[("train/accuracy", "final", "high")])
    # by hand: 0.4 ± t(0.975, 2) * 0.2 / sqrt(3), t(0.975, 2) = 4.302653 (0.95 / sqrt(2 * 0.975 * 0.025))
    assert (int(base["n"]), base["seeds"]) == (3, "1 2 3")
    assert float(base["mean"]) == pytest.approx(0.4, abs=1e-12)
    assert float(base["ci95"]) == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-6)
    assert base["diff"] == "nan"  # the baseline itself
    # Welch: se^2 = 0.04/3 + 0.0875/3/4 = 0.020625; df = se^4 / ((0.04/3)^2/2 + (0.0875/12)^2/3) = 3.99009
    va, vb = 0.04 / 3, 0.0875 / 3 / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert df == pytest.approx(3.99009, abs=1e-5) and float(high["diff_df"]) == pytest.approx(df, rel=1e-9)
    assert float(high["diff"]) == pytest.approx(0.275, abs=1e-12)
    # t(0.975, 3.99009) = 2.77919 (between the tables' 2.776 at 4 df and 3.182 at 3 df)
    assert float(high["diff_ci95"]) == pytest.approx(2.77919 * math.sqrt(va + vb), rel=1e-5)
    # best: the highest value along each run (the last, or the earlier 0.1); eval: logged once, at the end
    assert float(rows[("train/accuracy", "best", "base")]["mean"]) == pytest.approx((0.2 + 0.4 + 0.6) / 3)
    assert float(rows[("eval/test/avg@4", "final", "high")]["mean"]) == pytest.approx(0.675 / 2)
    # --window 2: final = mean of the last two steps' values, (0.1 + v) / 2
    rows = csv_rows(cli(*runs, "--csv", "--window", "2", "--baseline", "high"))
    assert float(rows[("train/accuracy", "final", "base")]["mean"]) == pytest.approx((0.1 + 0.4) / 2)
    assert float(rows[("train/accuracy", "final", "base")]["diff"]) == pytest.approx(-0.275 / 2)


def test_the_text_and_markdown_tables_show_the_intervals(tmp_path):
    runs = [fake_run(tmp_path, f"base__{i + 1}__{i}", v) for i, v in enumerate([0.2, 0.4, 0.6])]
    runs += [fake_run(tmp_path, f"high__{i + 1}__{i + 10}", v) for i, v in enumerate([0.9, 0.95, 1.0])]
    text = cli(*runs).stdout
    assert "Student t" in text and "Welch" in text
    (line,) = [x for x in text.splitlines() if x.startswith("train/accuracy")]
    assert "base" in line and "0.40 ± 0.50" in line and "baseline" in line  # 0.4 ± 0.497
    (line,) = [x for x in text.splitlines() if " high " in x and "0.95 ± 0.12" in x]  # 0.95 ± 0.124
    assert re.search(r"\+0\.55 ± 0\.4\d \*", line), line  # Welch: 0.55 ± 0.47 (2.2 df) excludes 0: starred
    md = cli(*runs, "--markdown").stdout
    assert "| train/accuracy | base | 3 | 0.40 ± 0.50 | baseline |" in md


def test_grouping_by_the_flags_that_differ(tmp_path):
    """One exp-name, two settings of --clip-eps-high, three seeds each, written to different output dirs by
    different commits: two groups named by the one flag that differs."""
    runs = []
    for seed in (1, 2, 3):
        for i, high in enumerate((0.2, 0.28)):
            extra = {"clip_eps_high": high, "run": {"git_commit": f"c{seed}"}}
            runs.append(fake_run(tmp_path, f"dapo__{seed}__{seed * 10 + i}", 0.1 * seed + high, extra))
    groups, notes = compare.group_runs([compare.load_run(r) for r in runs])
    assert list(groups) == ["clip_eps_high=0.2", "clip_eps_high=0.28"]
    assert [sorted(m.args["seed"] for m in g) for g in groups.values()] == [[1, 2, 3], [1, 2, 3]]
    assert notes == ['the runs differ in git_commit: "c1", "c2", "c3"']
    # with several exp-names they name the groups, and a group that mixes settings is pointed out
    runs.append(fake_run(tmp_path, "other__1__99", 0.5, {"learning_rate": 1e-3}))
    loaded = [compare.load_run(r) for r in runs]
    groups, notes = compare.group_runs(loaded)
    assert {k: len(v) for k, v in groups.items()} == {"dapo": 6, "other": 1}
    assert any("'dapo' mixes settings: clip_eps_high differ" in n for n in notes)
    groups, _ = compare.group_runs(loaded, "args")
    assert set(groups) == {
        "clip_eps_high=0.2, learning_rate=0.003",
        "clip_eps_high=0.28, learning_rate=0.003",
        "clip_eps_high=0.28, learning_rate=0.001",
    }
    proc = cli(*runs, "--csv", "--group-by", "args", "--baseline", "clip_eps_high=0.2, learning_rate=0.003")
    rows = csv_rows(proc)
    high = rows[("train/accuracy", "final", "clip_eps_high=0.28, learning_rate=0.003")]
    assert int(high["n"]) == 3 and float(high["diff"]) == pytest.approx(0.08)


def test_killed_runs_are_reported_in_one_line_and_left_out(tmp_path):
    good = [fake_run(tmp_path, f"a__{s}__{s}", 0.1 * s) for s in (1, 2)]
    no_args = fake_run(tmp_path, "a__3__3", 0.3)
    os.remove(os.path.join(no_args, "args.json"))
    empty = fake_run(tmp_path, "a__4__4", 0.4)
    open(os.path.join(empty, "metrics.jsonl"), "w").close()
    no_metrics = fake_run(tmp_path, "a__5__5", 0.5)
    os.remove(os.path.join(no_metrics, "metrics.jsonl"))
    cut = fake_run(tmp_path, "a__6__6", 0.6)
    with open(os.path.join(cut, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "train/accura')  # killed mid-write
    early = fake_run(tmp_path, "a__7__7", 0.7, steps=3)  # of --total-steps 5
    missing = str(tmp_path / "a__8__8")
    bad = [no_args, empty, no_metrics, cut, early, missing]
    proc = cli(*good, *bad, "--csv")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    for path in bad:
        assert len([x for x in lines if x.startswith(f"left out {path}:")]) == 1, (path, lines)
    assert "cut off" in proc.stderr and "stopped at step 3 of 5" in proc.stderr
    assert {int(r["n"]) for r in csv_rows(proc).values()} == {2}  # the two complete runs only
    rows = csv_rows(cli(*good, early, "--csv", "--include-incomplete"))
    assert int(rows[("train/accuracy", "final", "a")]["n"]) == 3
    proc = cli(*bad)  # nothing left: one line, no traceback
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("no complete run")
    assert "Traceback" not in proc.stderr


def test_bad_flags_are_one_line(tmp_path):
    runs = [fake_run(tmp_path, f"a__{s}__{s}", 0.1 * s) for s in (1, 2)]
    for argv, message in (
        (["--baseline", "nope"], "--baseline 'nope' is not a group"),
        (["--keys", "train/nope"], "--keys: no run logged train/nope"),
    ):
        proc = cli(*runs, *argv)
        assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_plot_draws_mean_curves_with_bands(tmp_path):
    runs = [fake_run(tmp_path, f"{e}__{s}__{s}", 0.1 * s + (e == "b")) for e in "ab" for s in (1, 2, 3)]
    out = tmp_path / "c.png"
    proc = cli(*runs, "--plot", out, "--smooth", "2")
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
