"""Weight-averaging callbacks (SWA, EMA, a hand-written EMA) under fsdp_custom against one device.

tests/scripts/weight_averaging_run.py runs every case in one process: once on one device (``strategy="auto"``, the
reference) and once on 2 CPU ranks under fsdp_custom with ``auto_wrap_policy={Block}`` (both launches at once), on the
same global batches (SGD with momentum, fp32). The averages stay sharded on the 2-rank side and end with the rows one
device computes; checkpoints hold them complete, and resuming from them (full, local and sharded formats) continues as
on one device.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import in_background, script_output


def _launch(folder, devices: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    args = ["--dir", folder, "--devices", str(devices)]
    return script_output("weight_averaging_run.py", folder / "out.pt", *args, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # The reference and the 2-rank run at once: each launch has its own folder.
    ref = partial(_launch, tmp_path_factory.mktemp("wa_ref"), 1)
    got = partial(_launch, tmp_path_factory.mktemp("wa_fsdp"), 2)
    running = in_background({"ref": ref, "got": got})
    return running["ref"].result(), running["got"].result()


def _check_run(got: dict, ref: dict, case: str) -> int:
    count = assert_all_close(got["state"], ref["state"], f"{case} final weights")
    count += assert_all_close(got["average"], ref["average"], f"{case} average")
    # The average is kept sharded: each rank holds its rows of it, like the model's own parameters.
    assert got["average_shapes"] == got["local_shapes"], case
    assert got["average_shapes"] != ref["average_shapes"], case
    assert got.get("n_averaged") == ref.get("n_averaged"), case
    if ref["val_loss"] is not None:  # validation ran on the average (the callback swaps it in)
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5), case
    return count


def test_stochastic_weight_averaging_matches_single_device(runs):
    ref, got = runs
    assert ref["swa"]["n_averaged"] == 3  # epochs 1, 2 and 3 of 4 averaged
    assert _check_run(got["swa"], ref["swa"], "swa") > 0


def test_ema_weight_averaging_matches_single_device(runs):
    ref, got = runs
    assert ref["ema"]["n_averaged"] == 8  # every step of 2 epochs
    assert _check_run(got["ema"], ref["ema"], "ema") > 0
    # trainer.validate after fit: the average, whole after fit, is sharded again and swapped in for validation.
    assert got["ema_validate"] == pytest.approx(ref["ema_validate"], rel=1e-5)


def test_hand_written_ema_with_shard_copies_matches_single_device(runs):
    ref, got = runs
    assert _check_run(got["user_ema"], ref["user_ema"], "user_ema") > 0


def test_full_checkpoint_holds_the_complete_average(runs):
    ref, got = runs
    files, ref_files = got["files"], ref["files"]
    count = 0
    swa, ref_swa = files["swa"], ref_files["swa"]
    key = "StochasticWeightAveraging"
    assert swa["callbacks"][key]["n_averaged"] == ref_swa["callbacks"][key]["n_averaged"] == 2
    count += assert_all_close(
        swa["callbacks"][key]["average_model_state"],
        ref_swa["callbacks"][key]["average_model_state"],
        "SWA checkpoint average",
    )
    count += assert_all_close(swa["state_dict"], ref_swa["state_dict"], "SWA checkpoint model")
    ema, ref_ema = files["ema"], ref_files["ema"]
    # WeightAveraging keeps the average in state_dict and the trained weights in current_model_state.
    count += assert_all_close(ema["state_dict"], ref_ema["state_dict"], "EMA checkpoint average")
    count += assert_all_close(
        ema["current_model_state"], ref_ema["current_model_state"], "EMA checkpoint current model"
    )
    assert int(ema["averaging_state"]["n_averaged"]) == int(ref_ema["averaging_state"]["n_averaged"]) == 4
    user, ref_user = files["user"]["callbacks"]["UserEMA"]["ema"], ref_files["user"]["callbacks"]["UserEMA"]["ema"]
    count += assert_all_close(dict(enumerate(user)), dict(enumerate(ref_user)), "hand-written EMA checkpoint")
    assert count > 0
    # The averages really differ from the weights they were saved beside (the comparison is not vacuous).
    average = ref_swa["callbacks"][key]["average_model_state"]
    assert not torch.allclose(average["model.emb.weight"], ref_swa["state_dict"]["model.emb.weight"])
    assert not torch.allclose(
        ref_ema["state_dict"]["model.emb.weight"], ref_ema["current_model_state"]["model.emb.weight"]
    )


def test_resuming_from_a_full_checkpoint_matches_single_device(runs):
    ref, got = runs
    count = _check_run(got["swa_resume"], ref["swa_resume"], "swa_resume")
    count += _check_run(got["ema_resume"], ref["ema_resume"], "ema_resume")
    assert count > 0
    # On one device, resuming ends exactly where the uninterrupted run ends.
    for case in ("swa", "ema"):
        assert_all_close(ref[f"{case}_resume"]["state"], ref[case]["state"], f"{case} resumed vs uninterrupted")


def test_local_and_sharded_checkpoints_keep_the_average(runs):
    ref, got = runs
    # Local format, SWA: the callback state (in meta.pt) holds the full average; resuming matches one device.
    meta = got["files"]["swa_local_meta"]
    key = "StochasticWeightAveraging"
    count = assert_all_close(
        meta["callbacks"][key]["average_model_state"],
        ref["files"]["swa"]["callbacks"][key]["average_model_state"],
        "local meta.pt average",
    )
    count += _check_run(got["swa_local"], ref["swa"], "swa_local")
    count += _check_run(got["swa_local_resume"], ref["swa_resume"], "swa_local_resume")
    # Sharded format, EMA: the average is the DCP model state, the current weights go whole into meta.pt.
    meta = got["files"]["ema_sharded_meta"]
    count += assert_all_close(
        meta["current_model_state"], ref["files"]["ema"]["current_model_state"], "sharded meta.pt model"
    )
    count += _check_run(got["ema_sharded_resume"], ref["ema_resume"], "ema_sharded_resume")
    assert count > 0


def test_copies_taken_in_setup_are_refused_before_training(runs):
    _, got = runs
    message = got["user_ema_setup"]["error"]
    assert "UserEMA" in message and "`ema`" in message
    assert "on_fit_start" in message and "full_tensors" in message


def test_helpers_without_a_sharding_engine_pass_tensors_through():
    from lightning_fsdp.weight_averaging import full_tensors, local_tensors

    tensors = [torch.ones(3, 2), torch.zeros(4)]
    full = full_tensors(object(), tensors)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(full, tensors))
    assert local_tensors(object(), tensors) == tensors
