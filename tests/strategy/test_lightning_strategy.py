"""Trainer(strategy="fsdp_custom") run as a user's script: fit, validate, test and predict against one device.

The script (tests/scripts/lightning_parity.py) is started exactly as users start theirs; Lightning's launcher
re-runs it once per extra rank. Each configuration is compared with a single-device run on the same global batches.
The runs on the same number of processes share launches (tests/toolbox/launch.py's ``run_together``); a module
fixture starts them all, and each test waits for the ones it compares.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import argument_groups, run_together
from tests.toolbox.one_device import lightning_parity_runs

ACCUMULATION = ("--optimizer", "sgd", "--accumulate", "2")
WATCHED = ("--optimizer", "sgd", "--watch-zero-grad")  # a callback with on_before_zero_grad


def _strategy_label(devices: int, strategy: tuple[str, ...]) -> str:
    return "-".join((str(devices), *strategy))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of the module: ``{("ref", training flags) | (devices-strategy, training flags): its output, when
    waited for}``. Runs on the same number of processes share launches (tests/toolbox/launch.py's ``run_together``)."""
    folder = tmp_path_factory.mktemp("lightning_parity")
    by_devices: dict[int, dict] = {}
    for devices, strategy, training in CASES:
        by_devices.setdefault(devices, {})[_strategy_label(devices, strategy), training] = (*strategy, *training)
    for name in ("fsdp_custom_blocks", "fsdp_custom_deferred_sync"):
        by_devices[2][name, ACCUMULATION] = ("--strategy", name, *ACCUMULATION)
    by_devices[2]["fsdp_custom_blocks", WATCHED] = ("--strategy", "fsdp_custom_blocks", *WATCHED)
    for training in dict.fromkeys([*(training for _, _, training in CASES), ACCUMULATION, ("--optimizer", "sgd")]):
        by_devices.setdefault(1, {})["ref", training] = ("--strategy", "auto", *training)
    futures: dict = {}
    for devices, configs in by_devices.items():
        launch = partial(_parity_runs, folder, devices)
        futures.update(run_together(launch, configs, launches=2 if devices == 2 else 1))
    return futures


def _parity_runs(folder: Path, devices: int, args: list[str]) -> list[dict]:
    return lightning_parity_runs(folder, devices, argument_groups(args))


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


def test_last_steps_gradients_are_freed_before_the_forward(runs):
    # [Note: Lightning's order keeps the last step's gradients through the forward]: the strategy zeroes them before
    # training_step where Lightning would zero them right after it. Counted at the start of each of the 6 batches.
    ref = runs["ref", ("--optimizer", "sgd")].result()
    n = ref["grads_at_step"][1]
    assert 0 < n <= len(ref["names"])  # ToyLM has parameters the loss does not reach
    assert ref["grads_at_step"] == [0] + [n] * 5  # Lightning's order, one device: the counting sees them
    sharded = runs[_strategy_label(2, ("--strategy", "fsdp_custom_blocks")), ("--optimizer", "sgd")].result()
    assert sharded["grads_at_step"] == [0] * 6
    # Accumulating batches (the 2nd of each window of 2) keep the gradients they add to.
    assert runs["ref", ACCUMULATION].result()["grads_at_step"] == [0] + [n] * 5
    # (Under sharding a rank counts the parameters whose shard on it is not empty.)
    accumulated = runs["fsdp_custom_blocks", ACCUMULATION].result()["grads_at_step"]
    assert accumulated[0::2] == [0] * 3 and min(accumulated[1::2]) > 0, accumulated


def test_on_before_zero_grad_keeps_lightnings_order(runs):
    # A callback with on_before_zero_grad is called with the gradients there: the strategy then leaves the zeroing
    # to Lightning, and training is the same.
    ref = runs["ref", ("--optimizer", "sgd")].result()
    got = runs["fsdp_custom_blocks", WATCHED].result()
    # (Under sharding a rank counts the parameters whose shard on it is not empty.)
    for counts in (got["grads_at_step"], got["grads_before_zero"]):
        assert len(counts) == 6 and counts[0] == 0 and min(counts[1:]) > 0, counts
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert assert_all_close(got["state"], ref["state"], "watched") == len(ref["state"]) > 0
