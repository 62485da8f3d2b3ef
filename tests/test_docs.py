"""The docs document every flag of every script (docs/flags.md) and every metric key a run writes
(docs/metrics.md); their links resolve; nothing points outside the repository."""

from __future__ import annotations

import dataclasses
import glob
import importlib
import os
import re

import pytest

from tests.test_scripts import ROOT, SCRIPTS


def doc(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_flags_doc_is_generated_from_the_scripts():
    """docs/flags.md is tools/flags_doc.py's output, so its defaults and help texts are the scripts' own."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "flags_doc.py"), "--check"], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-500:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_documented(script):
    text = doc("docs/flags.md")
    mod = importlib.import_module(script)
    flags = [f.name for f in dataclasses.fields(mod.Args) if f.init]  # `requested` is set by start(), not a flag
    missing = [n for n in flags if f"`--{n.replace('_', '-')}`" not in text]
    assert not missing, f"{script}.py flags missing from docs/flags.md: {missing}"


def documented_key(key: str) -> str:
    """The README's spelling of a metric key: bucket values and dataset names become placeholders."""
    key = re.sub(r"^(train/daro_[wLM]_)[0-9.]+$", r"\1<μ>", key)
    key = re.sub(r"^train/reflection/[a-z_]+_(frac|accuracy)$", r"train/reflection/<pattern>_\1", key)
    key = re.sub(r"^(train/adv_(mean|std)_pos)\d+$", r"\1<k>", key)
    key = re.sub(r"^eval/[^/]+/n\d+/avg@\d+$", "eval/<dataset>/n<N>/avg@k", key)  # l1.py's budgets
    key = re.sub(r"^eval/[^/]+/n\d+/", "eval/<dataset>/n<N>/", key)
    key = re.sub(r"^eval/[^/]+/", "eval/<dataset>/", key)
    return re.sub(r"^(eval/<dataset>/(avg|pass|maj))@\d+$", r"\1@k", key)


def undocumented_metric_keys(keys) -> list[str]:
    """The keys a run logged that docs/metrics.md does not name (in documented_key's spelling). Every script's
    end-to-end run (tests/test_scripts.py, with an evaluation at every step) checks its keys with it."""
    text = doc("docs/metrics.md")
    return sorted({documented_key(k) for k in keys if f"`{documented_key(k)}`" not in text})


def test_undocumented_metric_keys_are_found():
    assert undocumented_metric_keys(["train/accuracy", "eval/test/avg@2", "train/daro_w_0.5"]) == []
    assert undocumented_metric_keys(["train/adv_mean_pos16", "train/adv_std_pos4096", "train/value_loss"]) == []
    assert undocumented_metric_keys(["train/accuracy", "train/not_a_metric"]) == ["train/not_a_metric"]
    assert undocumented_metric_keys(["eval/test/n512/avg@16", "eval/math/n8/target_error"]) == []


# The repository stands alone: no pointer to a design document, notes or issue tracker outside it (docs/design.md
# holds the design). Spelt in pieces so this file does not match itself.
OUTSIDE = re.compile(
    "|".join([r"\bSP" + r"EC\b", r"\bseeds/0", r"\bshared/(seeds|research)", "/wo" + "rk/", r"\bissues? #?\d+"])
)
TEXT_FILES = (".py", ".md", ".sh", ".toml", ".txt", ".ini", ".yaml", ".yml", ".json", ".cfg")


def test_no_reference_outside_the_repository():
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__", "node_modules")]
        for name in files:
            if name.endswith(TEXT_FILES) or top == os.path.join(ROOT, ".ci"):
                path = os.path.join(top, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    found += [
                        f"{os.path.relpath(path, ROOT)}:{i}: {m.group(0)!r}"
                        for i, line in enumerate(f, 1)
                        if (m := OUTSIDE.search(line))
                    ]
    assert not found, "references to files or issues outside the repository:\n" + "\n".join(found)


def anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", doc(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_the_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists and, with #anchor, a heading in it."""
    broken = []
    for md in ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc(md)):
            path, _, anchor = target.partition("#")
            if target.startswith(("http://", "https://")):
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if not os.path.exists(os.path.join(ROOT, full)):
                broken.append(f"{md}: {target} (no file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                broken.append(f"{md}: {target} (no heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_the_way_in():
    """README stays short: set-up, quickstarts, the algorithms, forking, sweeps; the reference lives in docs/."""
    assert len(doc("README.md").splitlines()) <= 300


def test_the_readmes_shape_figures_are_grpos():
    """The README's "grpo.py is N lines, its `main()` M, of which setup is S" is measured, not remembered."""
    import ast

    text = " ".join(doc("README.md").split())
    quoted = re.search(r"grpo\.py is (\d+) lines, its `main\(\)` (\d+), of which setup is (\d+)", text)
    n, m, s = map(int, quoted.groups())
    source = doc("grpo.py")
    main = next(f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef) and f.name == "main")
    loop = next(node for node in main.body if isinstance(node, ast.For))
    setup = loop.lineno - main.lineno  # as tests/test_shape.py counts it
    assert (n, m, s) == (len(source.splitlines()), main.end_lineno - main.lineno + 1, setup)
