"""Bad input raises a clear error naming the value and the valid choices, on every rank, before any collective."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_fsdp  # noqa: F401
from lightning_fsdp import FSDPStrategy

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "bad_input_run.py"


@pytest.mark.parametrize(
    "kwargs,error,fragments",
    [
        ({"sharding_strategy": "FULL"}, ValueError, ["'FULL'", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
        ({"sharding_strategy": 3}, ValueError, ["3", "FULL_SHARD"]),
        ({"auto_wrap_policy": "Block"}, TypeError, ["'Block'", "set of nn.Module classes", "callable"]),
        ({"auto_wrap_policy": {int}}, TypeError, ["not an nn.Module subclass"]),
        ({"auto_wrap_policy": 0}, ValueError, ["positive int"]),
        ({"auto_wrap_policy": True}, TypeError, ["True"]),
        ({"auto_wrap_policy": {"no.such.Module"}}, ValueError, ["no.such.Module", "cannot be imported"]),
        ({"state_dict_type": "zip"}, ValueError, ["'zip'", "'full'", "'sharded'", "'local'"]),
        ({"backward_prefetch": "EARLY"}, ValueError, ["'EARLY'", "BACKWARD_PRE", "BACKWARD_POST"]),
        ({"use_orig_params": False}, ValueError, ["use_orig_params=False"]),
        ({"forward_prefetch": "yes"}, TypeError, ["forward_prefetch='yes'"]),
        ({"start_method": "thread"}, ValueError, ["'thread'", "popen"]),
        ({"param_init_fn": 3}, TypeError, ["param_init_fn=3"]),
    ],
)
def test_constructor_rejects_bad_options(kwargs, error, fragments):
    with pytest.raises(error) as info:
        FSDPStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_class_paths_are_accepted_as_wrap_policy():
    strategy = FSDPStrategy(auto_wrap_policy={"torch.nn.Linear"})
    import torch

    assert strategy.auto_wrap_policy.classes == (torch.nn.Linear,)


def run_two_ranks(tmp_path: Path, mode: str) -> list[str]:
    out = tmp_path / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # A hang would show up as a timeout here: the error must be raised on both ranks before any collective.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--mode", mode], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [Path(f"{out}.rank{r}").read_text() for r in range(2)]


def test_fit_on_frozen_model_fails_on_every_rank(tmp_path):
    for text in run_two_ranks(tmp_path, "frozen-fit"):
        assert text.startswith("ValueError"), text
        assert "no trainable parameters" in text


def test_frozen_model_validates_tests_and_predicts(tmp_path):
    for text in run_two_ranks(tmp_path, "frozen-eval"):
        assert text.startswith("ok 1 predictions"), text


def test_optimizer_over_unmanaged_parameter_fails_on_every_rank(tmp_path):
    for text in run_two_ranks(tmp_path, "foreign-optimizer"):
        assert text.startswith("ValueError"), text
        assert "does not manage" in text and "(3,)" in text


@pytest.mark.parametrize(
    "device,override,expected",
    [("cpu", None, "gloo"), ("cuda:0", None, "nccl"), ("hpu:0", None, "hccl"), ("cpu", "mpi", "mpi")],
)
def test_backend_follows_the_accelerator_unless_overridden(device, override, expected):
    import torch

    strategy = FSDPStrategy(parallel_devices=[torch.device(device)], process_group_backend=override)
    assert strategy._get_process_group_backend() == expected
