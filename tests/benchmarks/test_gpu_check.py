"""The GPU check's own code, run on CPU (``--device cpu --tiny``): every check runs and passes, the table has its three
rows. On a GPU machine ``make gpu-check`` runs the same code on CUDA; here CUDA is not touched."""

from __future__ import annotations

import json
import sys

import pytest

from tests.toolbox.launch import run_command


def test_gpu_check_dry_run_on_cpu(tmp_path):
    run_command(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--tiny", "--out", tmp_path],
        cwd=tmp_path,
        timeout=240,
    )
    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report["checks"]) == ["engine", "bf16", "checkpointing", "cpu_offload", "sharded_checkpoint", "streams"]
    assert all(check["status"] == "passed" for check in report["checks"].values()), report["checks"]
    # The parameter comparisons covered the whole model (GPT 2 x 32: 29 state entries).
    assert report["checks"]["engine"]["compared"] == report["checks"]["sharded_checkpoint"]["compared"] == 29
    assert [row["variant"] for row in report["table"]] == ["plain", "torch FSDP2", "fsdp_custom"]
    assert report["checks"]["streams"]["streams_active"] is False  # on CPU; the training part still ran
    assert report["checks"]["streams"]["compared"] == 29
    assert (tmp_path / "results.md").read_text().count("| passed |") == 6


def test_gpu_check_refuses_to_pretend_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the refusal cannot be shown")
    proc = run_command(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", tmp_path], cwd=tmp_path, timeout=120, check=False
    )
    assert proc.returncode == 2 and "no CUDA device here" in proc.stdout
