"""Checkpoints on object storage: every format through a real S3-compatible server (moto's ``moto_server``) that the
tests start on 127.0.0.1 and stop; no network beyond loopback. Skipped, saying why, only if moto or s3fs is missing.

One 2-rank launch (tests/scripts/object_storage_run.py) carries the Lightning scenarios of all three formats:
``ModelCheckpoint(dirpath="s3://...")`` with ``save_top_k=1``, ``fit(ckpt_path="s3://...")`` compared with one
device, a save whose rank-1 upload fails (the previous checkpoint must stay loadable, unchanged) and an interrupted
save to a new path (the resume must refuse it, naming the missing commit object). ``convert`` and ``export`` run in
the test process against the same server.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_fsdp.checkpoint.convert import convert, load_as_full
from lightning_fsdp.checkpoint.export import export_safetensors
from lightning_fsdp.checkpoint.remote import COMMIT_FILE, remote_kind
from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import SCRIPTS, rank_outputs, run_command
from tests.toolbox.one_device import toy_lm_on_samples
from tests.toolbox.s3 import S3Server, client_env, s3_server

FORMATS = ("full", "sharded", "local")
ENTRIES = 15  # ToyLM's state-dict entries under the LightningModule (the tied embedding and head both named)
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as server, client_env(server):
        yield server


@pytest.fixture(scope="module")
def runs(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("s3run") / "out"
    cmd = [sys.executable, SCRIPTS / "object_storage_run.py", "--out", out, "--url", s3.url("run")]
    run_command(cmd, timeout=LAUNCH_TIMEOUT_S, env=s3.env)
    ranks = rank_outputs(out, 2)
    assert sorted(ranks[0]) == sorted(FORMATS)
    return ranks[0] | {"every_rank": ranks}


def _one_device(steps: int) -> dict[str, torch.Tensor]:
    return toy_lm_on_samples(steps, 6, 18).lightning_state()


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_checkpoint_on_s3_resumes_as_one_device(runs: dict, fmt: str) -> None:
    res = runs[fmt]
    # save_top_k=1 saved at steps 1, 2 and 3 and removed the older two from the bucket; last.ckpt is step 3's too.
    assert res["listing"] == ["epoch=0-step=3.ckpt", "last.ckpt"], res["listing"]
    assert res["best"].endswith("/mc/epoch=0-step=3.ckpt")
    assert assert_all_close(res["resumed"], _one_device(6), f"{fmt}: resumed from s3 to step 6") == ENTRIES
    # save_last's checkpoint on the bucket resumes too (the path the trainer restored from says it was read: a fit
    # from step 0 would end on the same weights).
    assert str(res["last_path"]).startswith("s3://") and res["last_path"].endswith("/mc/last.ckpt"), res["last_path"]
    assert assert_all_close(res["resumed_last"], _one_device(6), f"{fmt}: resumed from s3's last.ckpt") == ENTRIES


@pytest.mark.parametrize("fmt", ["sharded", "local"])
def test_failed_upload_leaves_the_previous_checkpoint_and_refuses_an_uncommitted_one(runs: dict, fmt: str) -> None:
    for rank, res in enumerate(r[fmt] for r in runs["every_rank"]):
        # Rank 1's upload was cut: every rank raised (no rank left waiting), rank 1 its own error.
        for key in ("failed_over_existing", "failed_new"):
            failure = res[key]
            assert failure is not None, f"rank {rank}: {key} did not raise"
            assert "injected: rank 1's upload" in failure[1], failure
        # The interrupted save to a new path: the resume is refused, naming the missing commit object.
        refused = res["resume_interrupted"]
        assert refused is not None and refused[0] == "CheckpointLoadError", refused
        assert f"commit object {COMMIT_FILE!r} is missing" in refused[1] and "interrupted.ckpt" in refused[1]
    # The checkpoint the failed save was replacing still holds step 3, as on one device; the failed saves' uploads
    # was deleted (one version left under it); the "killed" one left its uploads and no commit object.
    versions, leftovers = runs[fmt]["versions_after_failures"]
    assert versions == 1 and leftovers and COMMIT_FILE not in leftovers, (versions, leftovers)
    after = runs[fmt]["after_failed_save"]
    assert assert_all_close(after, _one_device(3), f"{fmt}: checkpoint after a failed save over it") == ENTRIES


def test_convert_and_export_between_formats_on_s3(runs: dict, s3: S3Server, tmp_path: Path) -> None:
    sharded = s3.url("run", "sharded", "mc", "epoch=0-step=3.ckpt")
    local = s3.url("run", "local", "mc", "epoch=0-step=3.ckpt")
    full = s3.url("run", "full", "mc", "epoch=0-step=3.ckpt")
    assert [remote_kind(p) for p in (full, sharded, local)] == ["full", "sharded", "local"]
    expected = _one_device(3)
    # Every format read whole from the bucket holds the weights of step 3.
    for path in (full, sharded, local):
        assert assert_all_close(load_as_full(path)["state_dict"], expected, path) == ENTRIES
    # local (s3) -> full (s3) -> sharded (s3) -> full (local disk)
    assert convert(local, s3.url("cv", "full.ckpt")) == "full"
    assert convert(s3.url("cv", "full.ckpt"), s3.url("cv", "sharded.ckpt"), "sharded") == "sharded"
    assert remote_kind(s3.url("cv", "sharded.ckpt")) == "sharded"
    assert convert(s3.url("cv", "sharded.ckpt"), tmp_path / "back.ckpt") == "full"
    back = AtomicCheckpointIO().load_checkpoint(tmp_path / "back.ckpt")
    assert assert_all_close(back["state_dict"], expected, "s3 round trip") == ENTRIES
    assert back["optimizer_states"][0]["state"], "optimizer state lost on the way"
    with pytest.raises(FileExistsError, match="exists"):
        convert(local, s3.url("cv", "full.ckpt"))
    # export: a sharded checkpoint on s3 to a safetensors directory on s3, tensor by tensor.
    written = export_safetensors(sharded, s3.url("hf"), max_shard_size=200, prefix="model.")
    assert len(written) > 2 and written[-1].endswith("model.safetensors.index.json"), written
    fs = s3.filesystem()
    index = json.loads(fs.cat_file(s3.url("hf", "model.safetensors.index.json")))
    from safetensors.torch import load as load_safetensors

    exported: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        exported |= load_safetensors(fs.cat_file(s3.url("hf", name)))
    assert assert_all_close({f"model.{k}": v for k, v in exported.items()}, expected, "export from s3") == ENTRIES


def test_directory_without_commit_object_is_refused_naming_it(runs: dict, s3: S3Server) -> None:
    fs = s3.filesystem()
    source = s3.url("run", "sharded", "mc", "epoch=0-step=3.ckpt")
    copy = s3.url("uncommitted", "step3.ckpt")
    fs.copy(source, copy, recursive=True)
    assert remote_kind(copy) == "sharded"
    fs.rm_file(f"{copy}/{COMMIT_FILE}")
    missing = "uncommitted/step3.ckpt' is incomplete: its commit object 'commit.json' is missing"
    with pytest.raises(CheckpointLoadError, match=missing):
        load_as_full(copy)
    # A commit object listing a file that is not there: named.
    commit = {"format": "sharded", "version": "v-x", "files": {"a": 1}}
    fs.pipe_file(f"{copy}/{COMMIT_FILE}", json.dumps(commit).encode())
    with pytest.raises(CheckpointLoadError, match="the file 'a' its 'commit.json' lists is missing"):
        load_as_full(copy)
