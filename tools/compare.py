"""Compare the groups of an ablation sweep: each group's final and best metrics as mean ± 95% confidence interval
over its seeds, and each group's difference to a baseline group with its interval.

    for s in 1 2 3; do for c in 0.2 0.28; do
        python dapo.py --seed $s --clip-eps-high $c --exp-name clip$c
    done; done
    python tools/compare.py runs/clip* --baseline clip0.2 --plot clip.png

Groups (--group-by): `exp-name`, the <exp-name> of the run directories <exp-name>__<seed>__<unix time> (args.json's
exp_name); `args`, the flags that differ between the runs in their args.json (the seed and bookkeeping flags
aside, IGNORED), e.g. "clip_eps_high=0.28"; `auto` (default) is exp-name when the runs have several, else args.

Statistics, per group of n seeds: the mean and the half-width of its 95% interval, t(0.975, n-1) * s / sqrt(n)
(Student t, s the sample standard deviation); none for n = 1. The difference of two groups' means with Welch's
interval, t(0.975, df) * sqrt(s_a^2/n_a + s_b^2/n_b) with the Welch-Satterthwaite df; `*` marks an interval that
excludes 0. final: the mean of a key's values over the last --window steps up to its last one; best: the highest
such mean along the run (the last value and the highest value with --window 1).

A run directory without args.json or metrics.jsonl, with an empty metrics.jsonl or a cut-off line (killed while
writing), or whose last step is before its --total-steps (killed, or still running; --include-incomplete keeps
those) is reported in one line and left out.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

from plot import smooth

LEVEL = 0.95
# Flags that never define a setting: where a run is written, tracked and checkpointed, and the seed itself.
IGNORED = {
    "seed",
    "exp_name",
    "output_dir",
    "resume",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "save_every",
    "keep_checkpoints",
    "log_samples_every",
    "requested",
    "run",
}
DEFAULT_TRAIN_KEYS = ["train/accuracy", "train/reward_mean"]
ACCURACY_KEY = re.compile(r"^eval/.+/(avg|pass|maj)@\d+$")  # the default eval/ keys (no lengths, no standard errors)


# Student t quantiles without scipy ------------------------------------------------------------------------------


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz's method; Press et al.,
    Numerical Recipes, 3rd ed., section 6.4), relative error ~1e-14."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below this point: use the symmetry
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (0.5 < p < 1) of Student's t with df degrees of freedom, by bisection on t_cdf."""
    lo, hi = 0.0, 2.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def mean_ci(values: list[float], level: float = LEVEL) -> tuple[float, float]:
    """(mean, half-width of its `level` Student t interval); the half-width is nan for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def welch(a: list[float], b: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(mean(a) - mean(b), half-width of Welch's `level` interval, its Welch-Satterthwaite df). The half-width is
    nan when a group has one value, 0 when both groups are constant."""
    diff = sum(a) / len(a) - sum(b) / len(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = (sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1) / len(x) for x in (a, b))
    if va + vb == 0:
        return diff, 0.0, math.nan
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff, t_quantile(0.5 + level / 2, df) * math.sqrt(va + vb), df


# Runs -----------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    path: str
    args: dict
    rows: list[dict]

    @property
    def exp_name(self) -> str:
        return str(self.args.get("exp_name", os.path.basename(os.path.normpath(self.path)).split("__")[0]))

    def series(self, key: str) -> list[tuple[int, float]]:
        """[(step, value)] of `key`, finite values only."""
        return [
            (r["step"], float(r[key]))
            for r in self.rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
        ]


def load_run(path: str, include_incomplete: bool = False) -> Run | str:
    """The run in directory `path`, or why it is left out (one line)."""
    if not os.path.isdir(path):
        return "not a directory"
    try:
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
    except FileNotFoundError:
        return "no args.json (not a run directory, or killed before it was written)"
    except (json.JSONDecodeError, OSError) as e:
        return f"args.json unreadable ({e})"
    if not isinstance(args, dict):
        return "args.json does not hold the flags"
    try:
        with open(os.path.join(path, "metrics.jsonl")) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return "no metrics.jsonl (killed before its first step?)"
    except OSError as e:
        return f"metrics.jsonl unreadable ({e.strerror})"
    if not lines:
        return "metrics.jsonl is empty (killed before its first step?)"
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not line.endswith("\n") or not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError
            rows.append(row)
        except ValueError:
            where = "its last line is cut off (killed while writing)" if i == len(lines) - 1 else f"line {i + 1}"
            return f"metrics.jsonl: {where} is not a whole JSON row"
    last, total = rows[-1]["step"], args.get("total_steps")
    if not include_incomplete and isinstance(total, int) and total > 0 and last < total - 1:
        return f"stopped at step {last + 1} of {total} (killed, or still running: --include-incomplete keeps it)"
    return Run(path, args, rows)


def differing_args(runs: list[Run]) -> list[str]:
    """The flags, outside IGNORED, whose value is not the same in every run (missing counts as a value)."""
    keys = sorted({k for r in runs for k in r.args} - IGNORED)
    return [k for k in keys if len({json.dumps(r.args.get(k, "<missing>"), sort_keys=True) for r in runs}) > 1]


def group_runs(runs: list[Run], by: str = "auto") -> tuple[dict[str, list[Run]], list[str]]:
    """({label: runs}, notes) with the groups sorted by label; notes are one-line warnings: a group
    that mixes settings, a seed twice in a group, runs from several commits, package versions, devices, world
    sizes or thread counts (args.json's "run")."""
    if by == "auto":
        by = "exp-name" if len({r.exp_name for r in runs}) > 1 else "args"
    groups: dict[str, list[Run]] = {}
    differ = differing_args(runs)
    for r in runs:
        if by == "exp-name":
            label = r.exp_name
        else:
            label = ", ".join(f"{k}={r.args[k]}" for k in differ if k in r.args) or r.exp_name
        groups.setdefault(label, []).append(r)
    notes = []
    for label, members in groups.items():
        mixed = differing_args(members)
        if mixed:
            notes.append(f"group {label!r} mixes settings: {', '.join(mixed)} differ (--group-by args splits them)")
        seeds = [m.args.get("seed") for m in members]
        if len(set(seeds)) < len(seeds):
            notes.append(f"group {label!r} has a seed more than once ({seeds}): such runs are not independent")
    for what in ("git_commit", "git_dirty", "versions", "device", "world_size", "cpu_threads"):
        seen = {json.dumps(r.args.get("run", {}).get(what), sort_keys=True) for r in runs if "run" in r.args}
        if len(seen) > 1:
            notes.append(f"the runs differ in {what}: {', '.join(sorted(seen))}")
    return dict(sorted(groups.items())), notes


def window_means(points: list[tuple[int, float]], window: int) -> list[float]:
    """At each logged step s, the mean of the values logged at steps in (s - window, s]."""
    out, start, total = [], 0, 0.0
    for i, (s, v) in enumerate(points):  # steps ascend in metrics.jsonl
        total += v
        while points[start][0] <= s - window:
            total, start = total - points[start][1], start + 1
        out.append(total / (i + 1 - start))
    return out


def summarize(groups: dict[str, list[Run]], keys: list[str], baseline: str, window: int) -> list[dict]:
    """One row per (key, group, final/best): n, seeds, mean, ci, and the difference to the baseline group."""
    rows = []
    for key in keys:
        per_group = {}
        for label, members in groups.items():
            final, best, seeds = [], [], []
            for m in members:
                means = window_means(m.series(key), window)
                if means:
                    final.append(means[-1])
                    best.append(max(means))
                    seeds.append(m.args.get("seed"))
            if final:
                per_group[label] = {"final": final, "best": best, "seeds": seeds}
        for label, got in per_group.items():
            for stat in ("final", "best"):
                mean, ci = mean_ci(got[stat])
                row = {"metric": key, "stat": stat, "group": label, "n": len(got[stat]), "seeds": got["seeds"]}
                row.update(mean=mean, ci95=ci, diff=math.nan, diff_ci95=math.nan, diff_df=math.nan)
                if label != baseline and baseline in per_group:
                    row["diff"], row["diff_ci95"], row["diff_df"] = welch(got[stat], per_group[baseline][stat])
                rows.append(row)
    return rows


# Output ---------------------------------------------------------------------------------------------------------


def fmt(mean: float, ci: float, signed: bool = False) -> str:
    """ "0.412 ± 0.051": the interval to 2 significant digits, the mean to the same decimals."""
    if math.isnan(mean):
        return ""
    sign = "+" if signed else ""
    if math.isnan(ci) or ci == 0 or not math.isfinite(ci):
        return f"{mean:{sign}.4g}" + (" ± 0" if ci == 0 else "")
    decimals = max(0, 1 - math.floor(math.log10(ci)))
    return f"{mean:{sign}.{decimals}f} ± {ci:.{decimals}f}"


def table(rows: list[dict], baseline: str, style: str = "text") -> str:
    """The rows as a plain-text, markdown or CSV table: one line per metric and group, final and best side by side."""
    if style == "csv":
        out = io.StringIO()
        fields = ["metric", "stat", "group", "n", "seeds", "mean", "ci95", "diff", "diff_ci95", "diff_df"]
        w = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "seeds": " ".join(str(s) for s in r["seeds"])})
        return out.getvalue()
    header = ["metric", "group", "n", "final", "Δ final", "best", "Δ best"]
    lines, pairs = [], defaultdict(dict)
    for r in rows:
        pairs[(r["metric"], r["group"])][r["stat"]] = r
    for (metric, group), stats in pairs.items():
        cells = [metric, group, str(stats["final"]["n"])]
        for s in ("final", "best"):
            r = stats[s]
            diff = fmt(r["diff"], r["diff_ci95"], signed=True)
            star = " *" if diff and r["diff_ci95"] >= 0 and abs(r["diff"]) > r["diff_ci95"] else ""
            cells += [fmt(r["mean"], r["ci95"]), "baseline" if group == baseline else diff + star]
        lines.append(cells)
    if style == "markdown":
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines]) + "\n"
    widths = [max(len(c[i]) for c in [header, *lines]) for i in range(len(header))]
    previous, out = None, []
    for cells in [header, *lines]:
        shown = ["" if cells[0] == previous and i == 0 else c for i, c in enumerate(cells)]
        previous = cells[0]
        out.append("  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip())
    return "\n".join(out) + "\n"


def plot(groups: dict[str, list[Run]], keys: list[str], out: str, window: int = 1, title: str | None = None) -> str:
    """One panel per key: each group's mean curve over its seeds (at the steps every seed logged, each seed's curve
    smoothed over `window` points first) with the 95% t interval of the mean as a band. A curve ends where a seed
    stops logging the key (e.g. a run whose groups are all solved trains no more and logs no loss or entropy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for label, members in groups.items():
            curves = [dict(m.series(key)) for m in members]
            curves = [c for c in curves if c]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            per_seed = [smooth([c[s] for s in steps], window) for c in curves]
            stats = [mean_ci(list(v)) for v in zip(*per_seed)]
            mean = [m for m, _ in stats]
            (line,) = ax.plot(steps, mean, label=f"{label} (n={len(curves)})", lw=1.2)
            if len(curves) > 1:
                lo, hi = [m - c for m, c in stats], [m + c for m, c in stats]
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or "mean over seeds, band: 95% t interval of the mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("runs", nargs="+", help="run directories (<exp-name>__<seed>__<unix time>)")
    p.add_argument(
        "--group-by",
        choices=["auto", "exp-name", "args"],
        default="auto",
        help="exp-name; args: the flags that differ; auto: exp-name if the runs have several",
    )
    p.add_argument("--baseline", default=None, help="the group the others are compared to (default: the first by name)")
    p.add_argument(
        "--keys", nargs="+", default=None, help="metric keys (default: eval/ accuracies, train accuracy and reward)"
    )
    p.add_argument("--window", type=int, default=1, help="final/best: mean over this many last steps")
    p.add_argument("--include-incomplete", action="store_true", help="keep runs that stopped before --total-steps")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--csv", action="store_true", help="print CSV (one row per metric, stat and group)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw mean curves with 95%% bands")
    p.add_argument("--plot-keys", nargs="+", default=None, help="keys to plot (default: --keys' train keys)")
    p.add_argument("--smooth", type=int, default=1, help="plot: moving-average window in steps, per seed")
    p.add_argument("--title", default=None, help="plot title")
    a = p.parse_args(argv)
    if a.window < 1 or a.smooth < 1:
        p.error("--window and --smooth must be >= 1")
    runs = []
    for path in a.runs:
        got = load_run(path, a.include_incomplete)
        if isinstance(got, str):
            print(f"left out {path}: {got}", file=sys.stderr)
        else:
            runs.append(got)
    if not runs:
        raise SystemExit("no complete run to compare (see the lines above)")
    groups, notes = group_runs(runs, a.group_by)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    baseline = a.baseline if a.baseline is not None else next(iter(groups))
    if baseline not in groups:
        raise SystemExit(f"--baseline {baseline!r} is not a group; the groups are: {', '.join(groups)}")
    present = {k for r in runs for row in r.rows for k in row}
    keys = a.keys or sorted(k for k in present if ACCURACY_KEY.match(k)) + [
        k for k in DEFAULT_TRAIN_KEYS if k in present
    ]
    missing = [k for k in keys if k not in present]
    if missing:
        raise SystemExit(f"--keys: no run logged {', '.join(missing)}")
    rows = summarize(groups, keys, baseline, a.window)
    style = "csv" if a.csv else "markdown" if a.markdown else "text"
    if style != "csv":
        print(
            f"{len(runs)} runs in {len(groups)} groups; mean ± {LEVEL:.0%} interval over seeds (Student t, n-1 df); "
            f"Δ: difference to {baseline!r} with Welch's interval, * when it excludes 0; "
            f"final: mean of the last {a.window} step(s), best: highest such mean\n"
        )
    print(table(rows, baseline, style), end="")
    if a.plot:
        plot_keys = a.plot_keys or [k for k in keys if not k.startswith("eval/")] or keys
        print(plot(groups, plot_keys, a.plot, a.smooth, a.title), file=sys.stderr)


if __name__ == "__main__":
    main()
