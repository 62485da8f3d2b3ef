"""--track: a Weights & Biases run, offline (WANDB_MODE=offline), with the flags as config, the run directory's name,
and the TensorBoard scalars synced; without --track wandb is never imported."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.test_scripts import ROOT, read_metrics, run_script, toy_flags


def wandb_records(path: str):
    """The protobuf records of an offline run file (run-<id>.wandb): a 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks (crc32, length, type) carry the records, FULL or split FIRST/MIDDLE/LAST."""
    from wandb.proto import wandb_internal_pb2

    data, pos, buf = open(path, "rb").read(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            break
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


@pytest.mark.slow
def test_track_writes_an_offline_wandb_run_named_after_the_run_directory(toy_assets, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to ~/.config or ~/.cache
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    flags = toy_flags(toy_assets, str(tmp_path), 2, **{"exp-name": "tracked", "wandb-project-name": "proj"})
    run_script("grpo", flags + ["--track"])
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracked__1__*"))
    (run_file,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))  # inside the run dir
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == os.path.basename(run_dir) and run.project == "proj"
    assert run.run_group == "tracked"  # --exp-name: a sweep's seeds of one setting land in one wandb group
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    with open(os.path.join(run_dir, "args.json")) as f:
        assert {k: v for k, v in config.items() if not k.startswith("_")} == json.load(f)  # config = every flag
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    synced = {i.key or "/".join(i.nested_key) for h in history for i in h.item}
    assert {"train/accuracy", "train/reward_mean"} <= synced  # the TensorBoard scalars (sync_tensorboard)
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # the run was closed, not cut off


@pytest.mark.slow
def test_without_track_wandb_is_never_imported(toy_assets, tmp_path):
    flags = toy_flags(toy_assets, str(tmp_path), 1, **{"exp-name": "plain"})
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "assert 'wandb' not in sys.modules, 'wandb was imported'"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "grpo.py"), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = glob.glob(os.path.join(tmp_path, "plain__1__*"))
    assert not os.path.exists(os.path.join(run_dir, "wandb"))
