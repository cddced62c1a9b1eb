"""Trainer(strategy="fsdp_custom") run as a user's script: fit, validate, test and predict against one device.

The script (tests/scripts/lightning_parity.py) is started exactly as users start theirs; Lightning's launcher
re-runs it once per extra rank. Each configuration is compared with a single-device run on the same global batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "lightning_parity.py"


def run_script(out: Path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


_references: dict = {}


def reference(tmp_path_factory, *args: str) -> dict:
    if args not in _references:
        out = tmp_path_factory.mktemp("ref") / "ref.pt"
        _references[args] = run_script(out, "--devices", "1", "--strategy", "auto", *args)
    return _references[args]


def test_deferred_gradient_sync_under_accumulation(tmp_path, tmp_path_factory):
    # sync_gradients_while_accumulating=False: the accumulating batch reduces nothing, the next one reduces the sum.
    ref = reference(tmp_path_factory, "--optimizer", "sgd", "--accumulate", "2")
    every = run_script(
        tmp_path / "every.pt",
        "--devices",
        "2",
        "--strategy",
        "fsdp_custom_blocks",
        "--optimizer",
        "sgd",
        "--accumulate",
        "2",
    )
    deferred = run_script(
        tmp_path / "deferred.pt",
        "--devices",
        "2",
        "--strategy",
        "fsdp_custom_deferred_sync",
        "--optimizer",
        "sgd",
        "--accumulate",
        "2",
    )
    assert got_all_close(deferred["state"], ref["state"]) == len(ref["state"]) > 0
    torch.testing.assert_close(torch.tensor(deferred["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    # 6 training batches, 3 optimizer steps: 3 of the 6 backwards reduce. Validation/test/predict reduce nothing.
    assert every["reduce_scatter_calls"] == 2 * deferred["reduce_scatter_calls"] > 0


def got_all_close(got: dict, ref: dict) -> int:
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    return len(ref)


CASES = [
    # (devices, strategy flags, training flags)
    (2, ("--strategy", "fsdp_custom_blocks"), ("--optimizer", "sgd")),
    (2, ("--strategy", "fsdp_custom", "--sharding", "SHARD_GRAD_OP"), ("--optimizer", "adamw", "--clip", "norm")),
    (2, ("--strategy", "fsdp_custom", "--sharding", "NO_SHARD"), ("--optimizer", "sgd", "--accumulate", "2")),
    (3, ("--strategy", "fsdp_custom_blocks"), ("--optimizer", "sgd", "--clip", "norm", "--accumulate", "2")),
    (2, ("--strategy", "fsdp_custom", "--meta"), ("--optimizer", "adamw", "--clip", "value")),
    (2, ("--strategy", "fsdp_custom_checkpointed"), ("--optimizer", "sgd")),
]


@pytest.mark.parametrize(
    "devices,strategy,training", CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v)
)
def test_fit_validate_test_predict_match_single_device(tmp_path, tmp_path_factory, devices, strategy, training):
    ref = reference(tmp_path_factory, *training)
    got = run_script(tmp_path / "fsdp.pt", "--devices", str(devices), *strategy, *training)

    assert got["names"] == ref["names"]  # named_parameters() keeps the unwrapped model's names
    assert len(got["losses"]) == len(ref["losses"]) > 0
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for phase in ("val", "test"):
        for name, value in ref[phase].items():
            assert got[phase][name] == pytest.approx(value, rel=1e-5), (phase, name)
    # predict ran on rank 0's share of every batch: its predictions are rows 0, N, 2N, ... of the reference's.
    assert torch.equal(got["preds"], ref["preds"][0::devices][: len(got["preds"])])
    # The strategy's own collectives (barrier ran before these).
    assert got["collectives"] == {
        "broadcast": "from rank 0",
        "reduce_sum": float(sum(range(1, devices + 1))),
        "reduce_mean": (devices + 1) / 2,
        "all_gather": [[r, 10 * r] for r in range(devices)],
    }


def test_training_changed_the_model(tmp_path_factory):
    # Guards the parity test above against a run where nothing trains: the loss must fall.
    ref = reference(tmp_path_factory, "--optimizer", "sgd")
    assert ref["losses"][-1] < ref["losses"][0] - 0.3
