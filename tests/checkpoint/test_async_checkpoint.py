"""Asynchronous saves (``async_checkpoint=True`` for the sharded format, Lightning's ``AsyncCheckpointIO`` plugin
for the full and local formats): one 2-rank launch (tests/scripts/async_checkpoint_run.py) per module, every format.
What a save wrote must be the state of its step although training went on while it was written (each checkpoint is
compared with one device at that step), training ends on the weights of one device, ``save_top_k`` keeps the newest,
and a write that fails in the background is raised at the next save or at the end of ``fit`` on every rank, the
previous checkpoint intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp.checkpoint.convert import load_as_full
from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import SCRIPTS, rank_outputs, run_command
from tests.toolbox.one_device import toy_lm_on_samples

FORMATS = ("full", "sharded", "local")
ENTRIES = 15  # ToyLM's state-dict entries under the LightningModule (the tied embedding and head both named)
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("async")
    cmd = [sys.executable, SCRIPTS / "async_checkpoint_run.py", "--out", work / "out", "--dir", work / "ckpt"]
    run_command(cmd, timeout=LAUNCH_TIMEOUT_S)
    ranks = rank_outputs(work / "out", 2)
    return {"dir": work / "ckpt", "ranks": ranks}


def _one_device(steps: int) -> dict[str, torch.Tensor]:
    return toy_lm_on_samples(steps, 6, 36).lightning_state()


@pytest.mark.parametrize("fmt", FORMATS)
def test_async_saves_hold_their_step_and_training_matches_one_device(runs: dict, fmt: str) -> None:
    res = runs["ranks"][0][fmt]
    assert assert_all_close(res["end"], _one_device(6), f"{fmt}: after 6 steps saving asynchronously") == ENTRIES
    # save_top_k=2: the checkpoints of steps 5 and 6 stay; each holds the weights of its step, although the
    # training thread went on updating them while they were written.
    assert res["listing"] == ["epoch=0-step=5.ckpt", "epoch=0-step=6.ckpt"], res["listing"]
    for step in (5, 6):
        saved = load_as_full(str(Path(runs["dir"], fmt, "ok", f"epoch=0-step={step}.ckpt")))
        assert saved["global_step"] == step
        assert assert_all_close(saved["state_dict"], _one_device(step), f"{fmt}: checkpoint of step {step}") == ENTRIES
    if fmt != "full":  # staging: one host copy of this rank's shards and optimizer state, reused between saves
        assert res["staging_bytes"] > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_background_write_surfaces_and_keeps_the_previous_checkpoint(runs: dict, fmt: str) -> None:
    for rank, res in enumerate(r[fmt] for r in runs["ranks"]):
        # The write of step 3's checkpoint failed in the writer thread; the save of step 4 raised it, on every rank.
        failure = res["fail_next"]
        assert failure is not None and failure[2], (rank, failure)
        assert res["fail_next_step"] == 4, res["fail_next_step"]
        # The last save's failure: raised at the end of fit, on every rank.
        failure = res["fail_last"]
        assert failure is not None and failure[2], (rank, failure)
        assert res["fail_last_step"] == 3
    writer = runs["ranks"][0 if fmt == "full" else 1][fmt]
    assert writer["fail_next_threads"] == ["lightning-fsdp-checkpoint_0"], writer["fail_next_threads"]
    # save_top_k=1 removes step 2's checkpoint only once step 3's is written: it never was, so step 2's stays.
    assert runs["ranks"][0][fmt]["fail_next_listing"] == ["epoch=0-step=2.ckpt"]
    kept = load_as_full(str(Path(runs["dir"], fmt, "fail_next", "epoch=0-step=2.ckpt")))
    assert (
        assert_all_close(kept["state_dict"], _one_device(2), f"{fmt}: checkpoint kept after a failed write") == ENTRIES
    )
