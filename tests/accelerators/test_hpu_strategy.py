"""The whole strategy on accelerator="hpu", through the Gaudi test double in tests/fakes (hpu compute on CPU,
an "hccl" backend that is gloo underneath): backend choice, device handling and the eager-mode check run for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.strategy.test_lightning_strategy import one_device_reference

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "lightning_parity.py"


def run_hpu(out: Path, lazy_mode: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PT_HPU_LAZY_MODE": lazy_mode,
        "FAKE_HPU_DEVICES": "2",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fakes")]),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--accelerator", "hpu", *args],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hpu_strategy_trains_like_one_cpu_process(tmp_path, tmp_path_factory):
    ref = one_device_reference(tmp_path_factory, "--optimizer", "sgd")
    proc = run_hpu(tmp_path / "hpu.pt", "0", "--devices", "2", "--strategy", "fsdp_custom_blocks", "--optimizer", "sgd")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "hpu.pt", weights_only=False)
    assert got["placement"] == {"backend": "hccl", "device": "hpu:0"}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_lazy_mode_is_refused_before_any_collective(tmp_path):
    proc = run_hpu(tmp_path / "lazy.pt", "1", "--devices", "1", "--strategy", "fsdp_custom")
    assert proc.returncode != 0
    assert "PT_HPU_LAZY_MODE" in proc.stderr and "eager" in proc.stderr.lower()
