"""The whole strategy on accelerator="hpu", through the Gaudi test double in tests/fakes (hpu compute on CPU,
an "hccl" backend that is gloo underneath): backend choice, device handling and the eager-mode check run for real."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from tests.toolbox.launch import run_script, with_fakes_on_path
from tests.toolbox.one_device import lightning_parity_one_device


def run_hpu(out: Path, lazy_mode: str, *args: str) -> subprocess.CompletedProcess:
    """tests/scripts/lightning_parity.py on ``accelerator="hpu"``, 2 fake Gaudi devices; its completed process."""
    env = with_fakes_on_path(PT_HPU_LAZY_MODE=lazy_mode, FAKE_HPU_DEVICES="2")
    argv = ("--out", str(out), "--accelerator", "hpu", *args)
    return run_script("lightning_parity.py", *argv, env=env, cwd=out.parent, timeout=300, check=False)


def test_hpu_strategy_trains_like_one_cpu_process(tmp_path, tmp_path_factory):
    ref = lightning_parity_one_device(tmp_path_factory, "--optimizer", "sgd")
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
