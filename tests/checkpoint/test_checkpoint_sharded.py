"""Sharded checkpoints (state_dict_type="sharded"): exact resume, resharding 2->1, 1->2, 2->3, 3->2, a rank killed
mid-save, ModelCheckpoint and weights-only directories, and load errors raised on every rank.

Lightning-level scenarios run tests/scripts/checkpoint_run.py / checkpoint_cases.py as users run scripts (see
tests/checkpoint/checkpoint_runs.py). The uninterrupted run "sh_6" trains 6 steps and saves a sharded directory at the
end of its first epoch (step 3), together with the full parameters and optimizer state it held at that moment
(``saved``); everything restored from that directory, at any world size, must equal ``saved`` bit for bit.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_fsdp.checkpoint.convert import load_as_full
from lightning_fsdp.checkpoint.paths import (
    checkpoint_kind,
    commit_directory,
    remove_checkpoint_path,
    remove_stale_temps,
)
from tests.checkpoint.checkpoint_runs import Runs
from tests.toolbox.compare import assert_optimizer_equal, assert_tensors_equal, max_diff


@pytest.fixture(scope="module")
def runs() -> Runs:
    shared = Runs.shared()
    # sh_resumed saves over the directory the kill left, which the first test inspects: it runs when asked.
    shared.prefetch(["sh_6", "sh_kill", "sh_2to1", "sh_2to3"])
    return shared


def _assert_restored(start: dict, saved: dict, what: str) -> None:
    assert_tensors_equal(start["params"], saved["params"], f"{what} params")
    assert len(start["optimizer_states"]) == 1
    assert_optimizer_equal(start["optimizer_states"][0], saved["optimizer_states"][0], f"{what} optimizer")


# ------------------------------------------------------------------------------- resume and a kill mid-save
def test_resume_parity_after_a_rank_is_killed_mid_save(runs):
    full = runs.train("sh_6")
    path = runs.path("sh_killed.ckpt")
    # sh_kill: 3 steps, a sharded save to `path` at step 3, then a second save to `path` during which rank 0
    # SIGKILLs itself after writing the first tensor of its shard file.
    killed = runs.train("sh_kill")
    found = re.search(r"pid (\d+): killing myself in the middle of writing a DCP shard file", killed.stdout)
    assert found, killed.stdout[-3000:]
    temp = runs.path(f".sh_killed.ckpt.tmp-{found.group(1)}")
    leftover = sorted(os.listdir(temp))  # the interrupted save: shard files, no .metadata, no meta.pt
    assert "__0_0.distcp" in leftover and ".metadata" not in leftover and "meta.pt" not in leftover, leftover
    # The directory at the path is the first save, complete: it reads back as exactly the state at step 3.
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    before = load_as_full(path)
    assert before["global_step"] == 3
    assert_tensors_equal(before["state_dict"], full["saved"]["params"], "surviving checkpoint params")
    assert_optimizer_equal(before["optimizer_states"][0], full["saved"]["optimizer_states"][0], "surviving optim")

    # fit(ckpt_path=path) in fresh processes: steps 4-6 equal the uninterrupted run's, bit for bit.
    resumed = runs.train("sh_resumed")
    assert [r[0] for r in full["records"]] == [0, 1, 2, 3, 4, 5]
    assert resumed["records"] == full["records"][3:]
    _assert_restored(resumed["start"], full["saved"], "sharded resume")
    assert resumed["start"]["global_step"] == 3
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")
    assert_optimizer_equal(resumed["end"]["optimizer_states"][0], full["end"]["optimizer_states"][0], "final optim")
    # Its save after fit replaced the directory and removed the killed save's leftover.
    assert not os.path.exists(temp)
    assert [n for n in os.listdir(runs.dir) if n.startswith(".sh_killed")] == []
    after = load_as_full(path)
    assert after["global_step"] == 6
    assert_tensors_equal(after["state_dict"], resumed["end"]["params"], "replaced checkpoint params")


# ------------------------------------------------------------------------------------------- the layout
def test_directory_layout_each_rank_writes_its_rows(runs):
    full = runs.train("sh_6")
    path = runs.path("sh_3.ckpt")
    assert checkpoint_kind(path) == "sharded"
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    md = FileSystemReader(path).read_metadata()

    def chunks(key):
        return [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks]

    # 7 embedding rows over 2 ranks: rows 0-3 from rank 0, rows 4-6 from rank 1 (torch.chunk, as the engine).
    assert md.state_dict_metadata["model.model.emb.weight"].size == (7, 5)
    assert chunks("model.model.emb.weight") == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    assert chunks("model.model.tiny") == [((0, 0), (1, 5)), ((1, 0), (0, 5))]  # rank 1 holds no row
    # Optimizer state keyed by parameter name, sharded the same way.
    assert chunks("optimizer_0.state.model.emb.weight.momentum_buffer") == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    files = {info.relative_path for info in md.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    # meta.pt: the rest of Lightning's checkpoint; no tensors of the model or the optimizer.
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert meta["global_step"] == 3 and meta["epoch"] == 0 and "loops" in meta and "callbacks" in meta
    assert meta["lightning_fsdp"] == {
        "format": "sharded",
        "version": 1,
        "world_size": 2,
        "num_optimizers": 1,
        "optimizer_keys": "fqn",
    }
    # Read back in one process: the full state at step 3.
    ckpt = load_as_full(path)
    assert_tensors_equal(ckpt["state_dict"], full["saved"]["params"], "read-back params")
    assert_optimizer_equal(ckpt["optimizer_states"][0], full["saved"]["optimizer_states"][0], "read-back optim")


def test_model_checkpoint_and_weights_only(runs):
    full = runs.train("sh_6")
    # ModelCheckpoint(save_top_k=1, save_last=True): epoch=0's directory was removed when epoch=1's was written.
    folder = runs.path("sh_mc")
    assert sorted(os.listdir(folder)) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    for name in ("epoch=1-step=6.ckpt", "last.ckpt"):
        ckpt = load_as_full(os.path.join(folder, name))
        assert ckpt["global_step"] == 6
        assert_tensors_equal(ckpt["state_dict"], full["end"]["params"], f"{name} params")
        assert_optimizer_equal(ckpt["optimizer_states"][0], full["end"]["optimizer_states"][0], f"{name} optim")
    # trainer.save_checkpoint(weights_only=True): the model and the loops only.
    weights = runs.path("sh_wo.ckpt")
    meta = torch.load(os.path.join(weights, "meta.pt"), weights_only=False)
    assert meta["lightning_fsdp"]["num_optimizers"] is None
    assert not any(k.startswith("optimizer") for k in FileSystemReader(weights).read_metadata().state_dict_metadata)
    ckpt = load_as_full(weights)
    assert "optimizer_states" not in ckpt and "lr_schedulers" not in ckpt and "callbacks" not in ckpt
    assert_tensors_equal(ckpt["state_dict"], full["end"]["params"], "weights-only params")


# ------------------------------------------------------------------------------------------- resharding
def test_resharding_2_to_1_and_2_to_3(runs):
    full = runs.train("sh_6")
    for name, world in (("sh_2to1", 1), ("sh_2to3", 3)):
        resumed = runs.train(name)
        assert resumed["world_size"] == world and resumed["strategy"] == "FSDPStrategy"
        # What the run held right after the restore: the step-3 state, bit for bit, in its own layout.
        _assert_restored(resumed["start"], full["saved"], f"2 -> {world}")
        # It trains on: the same steps; losses and parameters as the 2-rank run up to fp32 reduction order
        # (measured: 2.4e-7 and 6e-8).
        assert [r[0] for r in resumed["records"]] == [3, 4, 5]
        for (_, got, _), (_, want, _) in zip(resumed["records"], full["records"][3:]):
            assert abs(got - want) <= 2e-6, (got, want)
        assert max_diff(resumed["end"]["params"], full["end"]["params"]) <= 1e-6
    # The directories they re-saved right after restoring hold one shard file per rank of their world size.
    assert sorted(n for n in os.listdir(runs.path("sh_w1.ckpt")) if n.endswith(".distcp")) == ["__0_0.distcp"]
    assert len([n for n in os.listdir(runs.path("sh_w3.ckpt")) if n.endswith(".distcp")]) == 3
    md = FileSystemReader(runs.path("sh_w3.ckpt")).read_metadata()
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["model.model.emb.weight"].chunks]
    assert chunks == [((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 0), (1, 5))]


def _bad_copies(runs: Runs) -> dict[str, str]:
    """Damaged copies of sh_3.ckpt, a directory that is no checkpoint, a FIFO, and the step-3 state as a full file."""
    import shutil

    from lightning_fsdp.checkpoint.convert import convert

    src = runs.path("sh_3.ckpt")
    out = {}
    out["missing"] = runs.path("sh_missing.ckpt")
    if not os.path.exists(out["missing"]):
        shutil.copytree(src, out["missing"])
        os.remove(os.path.join(out["missing"], "__1_0.distcp"))
    out["truncated"] = runs.path("sh_truncated.ckpt")
    if not os.path.exists(out["truncated"]):
        shutil.copytree(src, out["truncated"])
        shard = os.path.join(out["truncated"], "__0_0.distcp")
        with open(shard, "rb") as f:
            data = f.read()
        with open(shard, "wb") as f:
            f.write(data[: len(data) // 2])
    out["bad_meta"] = runs.path("sh_bad_meta.ckpt")
    if not os.path.exists(out["bad_meta"]):
        shutil.copytree(src, out["bad_meta"])
        meta = os.path.join(out["bad_meta"], "meta.pt")
        with open(meta, "rb") as f:
            data = f.read()
        with open(meta, "wb") as f:
            f.write(data[:100])
    out["not_ckpt"] = runs.path("not_a_checkpoint")
    os.makedirs(out["not_ckpt"], exist_ok=True)
    with open(os.path.join(out["not_ckpt"], "notes.txt"), "w") as f:
        f.write("not a checkpoint\n")
    out["fifo"] = runs.path("a_fifo")
    if not os.path.exists(out["fifo"]):
        os.mkfifo(out["fifo"])
    out["full"] = runs.path("sh_3_full.ckpt")
    if not os.path.exists(out["full"]):
        convert(src, out["full"])
    out["consolidated"] = runs.path("sh_3_lightning.ckpt")
    if not os.path.exists(out["consolidated"]):
        # What `python -m lightning.pytorch.utilities.consolidate_checkpoint` writes (optimizer keyed by name).
        from pathlib import Path

        from lightning.fabric.utilities.load import _load_distributed_checkpoint
        from lightning.pytorch.utilities.consolidate_checkpoint import (
            _format_checkpoint,
        )

        torch.save(_format_checkpoint(_load_distributed_checkpoint(Path(src))), out["consolidated"])
    return out


def _cases(runs: Runs) -> list[dict]:
    runs.train("sh_2to1")
    runs.train("sh_2to3")
    bad = _bad_copies(runs)
    good = runs.path("sh_3.ckpt")
    cases = [
        # 1 -> 2 and 3 -> 2: directories written by 1 and 3 ranks, read back at 2.
        {"name": "from_1", "ckpt": runs.path("sh_w1.ckpt")},
        {"name": "from_3", "ckpt": runs.path("sh_w3.ckpt")},
        # Lightning's consolidation of sh_3.ckpt (a full file whose optimizer state is keyed by name).
        {"name": "consolidated", "ckpt": bad["consolidated"]},
        # HYBRID_SHARD (one node: shard over its 2 processes, replicate groups of one).
        {"name": "hybrid", "ckpt": good, "sharding": "HYBRID_SHARD"},
        {"name": "missing", "ckpt": bad["missing"]},
        {"name": "truncated", "ckpt": bad["truncated"]},
        {"name": "bad_meta", "ckpt": bad["bad_meta"]},
        {"name": "not_ckpt", "ckpt": bad["not_ckpt"]},
        {"name": "fifo", "ckpt": bad["fifo"]},
        {"name": "other_model", "ckpt": good, "dim": 6},
        {"name": "extra_strict", "ckpt": good, "extra": True, "fn": "validate"},
        {"name": "extra_non_strict", "ckpt": good, "extra": True, "strict": False, "fn": "validate"},
        {"name": "full_non_strict", "ckpt": bad["full"], "extra": True, "strict": False, "fn": "validate"},
        {"name": "weights_only_fit", "ckpt": runs.path("sh_wo.ckpt")},
        {"name": "weights_only_validate", "ckpt": runs.path("sh_wo.ckpt"), "fn": "validate"},
    ]
    return runs.cases("sh_cases", cases)


def test_resharding_1_to_2_and_3_to_2_lightning_consolidated_and_hybrid(runs):
    full = runs.train("sh_6")
    rank0, rank1 = _cases(runs)
    for name in ("from_1", "from_3", "consolidated", "hybrid"):
        assert rank0[name].get("ok") and rank1[name].get("ok"), (rank0[name], rank1[name])
        assert_tensors_equal(rank0[name]["params"], full["saved"]["params"], f"{name} params")
        assert_optimizer_equal(rank0[name]["optimizer"][0], full["saved"]["optimizer_states"][0], f"{name} optim")


# ------------------------------------------------------------------------------------------- load errors
def _error_on_every_rank(outcomes: list[dict], name: str, kind: str, *needles: str) -> str:
    messages = []
    for rank, outcome in enumerate(outcomes):
        assert "error" in outcome[name], f"{name}: rank {rank} loaded it: {outcome[name]}"
        got_kind, message = outcome[name]["error"]
        assert got_kind == kind, f"{name}: rank {rank} raised {got_kind}: {message}"
        for needle in needles:
            assert needle in message, f"{name}: rank {rank}: {needle!r} not in {message!r}"
        messages.append(message)
    return messages[0]


def test_load_errors_name_the_file_and_the_problem_on_every_rank(runs):
    outcomes = _cases(runs)
    bad = _bad_copies(runs)
    _error_on_every_rank(outcomes, "missing", "CheckpointLoadError", bad["missing"], "'__1_0.distcp' is missing")
    _error_on_every_rank(outcomes, "truncated", "CheckpointLoadError", "'__0_0.distcp' is truncated", "needs at least")
    _error_on_every_rank(
        outcomes, "bad_meta", "CheckpointLoadError", os.path.join(bad["bad_meta"], "meta.pt"), "truncated or corrupt"
    )
    _error_on_every_rank(
        outcomes,
        "not_ckpt",
        "CheckpointIsDirectoryError",
        bad["not_ckpt"],
        "is a directory but not a checkpoint",
        "'notes.txt'",
    )
    _error_on_every_rank(
        outcomes, "fifo", "CheckpointLoadError", bad["fifo"], "neither a checkpoint file nor a checkpoint directory"
    )
    _error_on_every_rank(
        outcomes,
        "other_model",
        "CheckpointMismatchError",
        "parameter 'model.tiny' has shape (1, 5) in the checkpoint but (1, 6) in the model",
    )
    _error_on_every_rank(outcomes, "extra_strict", "CheckpointMismatchError", "missing keys ['extra']", "strict=False")
    # A weights-only checkpoint cannot resume training (Lightning's own message), but validate loads it.
    _error_on_every_rank(outcomes, "weights_only_fit", "KeyError", "contains only the model")


def test_non_strict_and_weights_only_loading(runs):
    full = runs.train("sh_6")
    rank0, rank1 = _cases(runs)
    for name, expected in (
        ("extra_non_strict", full["saved"]["params"]),
        ("full_non_strict", full["saved"]["params"]),
        ("weights_only_validate", full["end"]["params"]),
    ):
        assert rank0[name].get("ok") and rank1[name].get("ok"), (rank0[name], rank1[name])
        params = dict(rank0[name]["params"])
        if name != "weights_only_validate":
            # strict=False: the parameter the checkpoint lacks keeps its initial value; the rest is loaded.
            assert torch.equal(params.pop("extra"), torch.full((3, 2), 0.5))
        assert_tensors_equal(params, expected, f"{name} params")


# ------------------------------------------------------------------------------------------- in-process units
def test_strategy_refuses_storage_options():
    # Remote paths are accepted (tests/checkpoint/test_checkpoint_s3.py); storage options are a CheckpointIO's.
    from lightning_fsdp import FSDPStrategy

    strategy = FSDPStrategy(state_dict_type="sharded")
    with pytest.raises(TypeError, match="storage_options"):
        strategy.save_checkpoint({}, "/tmp/x.ckpt", storage_options={"a": 1})
    assert FSDPStrategy(state_dict_type="local").state_dict_type.value == "local"


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
@pytest.mark.parametrize("previous", ["directory", "file", "link", "nothing"])
def test_commit_directory_replaces_whatever_was_there(tmp_path, monkeypatch, exchange, previous):
    from lightning_fsdp.checkpoint import paths

    if not exchange:
        monkeypatch.setattr(paths, "_exchange", lambda a, b: False)
    path = tmp_path / "last.ckpt"
    if previous == "directory":
        path.mkdir()
        (path / "old").write_text("old")
    elif previous == "file":
        path.write_text("old")
    elif previous == "link":
        (tmp_path / "target").mkdir()
        (tmp_path / "target" / "keep").write_text("keep")
        path.symlink_to(tmp_path / "target")
    tmp = paths.prepare_temp_dir(str(path))
    with open(os.path.join(tmp, "new"), "w") as f:
        f.write("new")
    commit_directory(tmp, str(path))
    assert path.is_dir() and not path.is_symlink() and sorted(os.listdir(path)) == ["new"]
    leftovers = sorted(n for n in os.listdir(tmp_path) if n not in ("last.ckpt", "target"))
    assert leftovers == []
    if previous == "link":  # the link was replaced, its target left alone
        assert (tmp_path / "target" / "keep").read_text() == "keep"


def test_stale_temp_directories_and_removal(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".ckpt.tmp-{dead_pid}"
    stale.mkdir()
    alive = tmp_path / f".ckpt.tmp-{os.getppid()}"  # a running process's save in progress: kept
    alive.mkdir()
    remove_stale_temps(path)
    assert not stale.exists() and alive.exists()
    remove_checkpoint_path(path)
    assert not os.path.exists(path)
    assert sorted(os.listdir(tmp_path)) == [alive.name]


def test_zero_dim_parameter_ignored_module_and_buffer_reshard_2_1_2(tmp_path):
    """Engine level, AdamW: a 0-dim parameter (its row on rank 0 only), an ignored module and a buffer survive
    2-way -> 1-way -> 2-way sharded checkpoints exactly (tests/scripts/checkpoint_engine_run.py)."""
    from tests.toolbox.launch import script_output

    results = script_output("checkpoint_engine_run.py", tmp_path / "out.pt", "--dir", tmp_path, timeout=180)
    reference = results["a"]
    assert reference["optimizer"][0]["exp_avg"].shape == ()  # the 0-dim parameter's AdamW state
    for stage in ("b", "c"):  # after loading into 1-way shards, and back into 2-way shards
        assert_tensors_equal(results[stage]["params"], reference["params"], f"{stage} params")
        for index, entry in reference["optimizer"].items():
            for name, value in entry.items():
                got = results[stage]["optimizer"][index][name]
                assert got.shape == value.shape and torch.equal(got, value), (stage, index, name)
    assert results["b_scale_shard"] == (1,) and results["c_scale_shard"] == (1,)
    for name in ("two_way.ckpt", "one_way.ckpt"):
        ckpt = load_as_full(str(tmp_path / name))
        assert ckpt["state_dict"]["scale"].shape == () and ckpt["state_dict"]["buf"].shape == (4,)
        assert ckpt["optimizer_states"][0]["state"][0]["exp_avg"].shape == ()
        assert ckpt["optimizer_states"][0]["state"][0]["step"].shape == ()
        assert_tensors_equal(ckpt["state_dict"], reference["params"], f"{name} read back")
