"""Shared fixtures: the offline toy model, tokenizer and arithmetic data (built once per test session)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton reads TRITON_INTERPRET when triton.language is first imported, and transformers imports triton at its own
# import: set it before any test module imports transformers, so tests/test_triton_logprobs.py runs its kernels in
# Triton's CPU interpreter whatever ran first. Subprocesses that build a vLLM engine drop it (tests/test_vllm.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.toy import build_all, build_model, build_tool_model, tool_rows, write_rows  # noqa: E402


@pytest.fixture(scope="session")
def toy_assets(tmp_path_factory) -> dict[str, str]:
    """{"model": dir, "train": jsonl, "test": jsonl} of the tiny random Qwen2 and the a+b task."""
    return build_all(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture(scope="session")
def vllm_assets(toy_assets, tmp_path_factory) -> dict[str, str]:
    """The toy task with models vLLM's CPU attention accepts (hidden 128, 2 heads of 64): {"model" (tied output
    layer), "tied", "untied", "train", "test"}."""
    root = tmp_path_factory.mktemp("vllm_toy")
    tied = build_model(str(root / "tied"), hidden_size=128, heads=2)
    untied = build_model(str(root / "untied"), hidden_size=128, heads=2, tied=False)
    return {**toy_assets, "model": tied, "tied": tied, "untied": untied}


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    """The vLLM-sized toy model trained to call the Python tool on cue (tests/toy.py TOOL_SCRIPTS)."""
    return build_tool_model(str(tmp_path_factory.mktemp("tool_model")))


@pytest.fixture(scope="session")
def tool_assets(tool_model, tmp_path_factory) -> dict[str, str]:
    """The tool model and its prompts as a dataset ({"model", "train"}: tests/toy.py tool_rows), for the scripts."""
    train = write_rows(str(tmp_path_factory.mktemp("tool_data") / "train.jsonl"), tool_rows())
    return {"model": tool_model, "train": train}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (and vLLM where it says so); skipped on CPU")
    config.addinivalue_line("markers", "slow: end-to-end runs of whole scripts")
