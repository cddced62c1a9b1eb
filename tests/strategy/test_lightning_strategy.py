"""Trainer(strategy="fsdp_custom") run as a user's script: fit, validate, test and predict against one device.

The script (tests/scripts/lightning_parity.py) is started exactly as users start theirs; Lightning's launcher
re-runs it once per extra rank. Each configuration is compared with a single-device run on the same global batches.
Every launch of the module is independent (its own output file and port), so a module fixture starts them all, a few
at a time (tests/toolbox/launch.py's ``in_background``), and each test waits for the ones it compares.
"""

from __future__ import annotations

import pytest
import torch

from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import in_background
from tests.toolbox.one_device import lightning_parity_run

ACCUMULATION = ("--optimizer", "sgd", "--accumulate", "2")


def _strategy_label(devices: int, strategy: tuple[str, ...]) -> str:
    return "-".join((str(devices), *strategy))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every launch of the module, started at once: ``{("ref", training flags) | (devices-strategy, training flags):
    Future of the script's output}``."""
    folder = tmp_path_factory.mktemp("lightning_parity")
    jobs: dict = {}

    def add(key: tuple, *args: str) -> None:
        out = folder / f"run{len(jobs)}.pt"
        jobs[key] = lambda: lightning_parity_run(out, *args)

    # The two-rank runs first: each takes longer than a one-process reference.
    for devices, strategy, training in CASES:
        add((_strategy_label(devices, strategy), training), "--devices", str(devices), *strategy, *training)
    for name in ("fsdp_custom_blocks", "fsdp_custom_deferred_sync"):
        add((name, ACCUMULATION), "--devices", "2", "--strategy", name, *ACCUMULATION)
    for training in dict.fromkeys([*(training for _, _, training in CASES), ACCUMULATION, ("--optimizer", "sgd")]):
        add(("ref", training), "--devices", "1", "--strategy", "auto", *training)
    return in_background(jobs)


def test_deferred_gradient_sync_under_accumulation(runs):
    # sync_gradients_while_accumulating=False: the accumulating batch reduces nothing, the next one reduces the sum.
    ref = runs["ref", ACCUMULATION].result()
    every = runs["fsdp_custom_blocks", ACCUMULATION].result()
    deferred = runs["fsdp_custom_deferred_sync", ACCUMULATION].result()
    assert assert_all_close(deferred["state"], ref["state"], "deferred sync") == len(ref["state"]) > 0
    torch.testing.assert_close(torch.tensor(deferred["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    # 6 training batches, 3 optimizer steps: 3 of the 6 backwards reduce. Validation/test/predict reduce nothing.
    assert every["reduce_scatter_calls"] == 2 * deferred["reduce_scatter_calls"] > 0


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
def test_fit_validate_test_predict_match_single_device(runs, devices, strategy, training):
    ref = runs["ref", training].result()
    got = runs[_strategy_label(devices, strategy), training].result()

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


def test_training_changed_the_model(runs):
    # Guards the parity test above against a run where nothing trains: the loss must fall.
    ref = runs["ref", ("--optimizer", "sgd")].result()
    assert ref["losses"][-1] < ref["losses"][0] - 0.3
