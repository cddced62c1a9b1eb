"""Local checkpoints (state_dict_type="local"): exact resume, a rank killed mid-save, the per-rank layout, conversion
to a full file, and errors naming the mismatch (world size, shapes, shard layout) or the damaged file, on every rank.

Lightning-level scenarios run tests/scripts/checkpoint_run.py / checkpoint_cases.py as users run scripts (see
tests/checkpoint/checkpoint_runs.py). "lo_6" trains 6 steps and saves a local directory at step 3 together with the full
state it held then (``saved``).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from lightning_fsdp.checkpoint.convert import load_as_full
from lightning_fsdp.checkpoint.convert import main as convert_main
from lightning_fsdp.checkpoint.paths import checkpoint_kind
from tests.checkpoint.checkpoint_runs import Runs
from tests.toolbox.compare import assert_optimizer_equal, assert_tensors_equal
from tests.toolbox.fault_jobs import PEER_GONE


@pytest.fixture(scope="module")
def runs() -> Runs:
    shared = Runs.shared()
    # lo_resumed saves over the checkpoint the kill left, which the first test inspects: it runs when asked.
    shared.prefetch(["lo_6", "lo_kill"])
    return shared


def test_resume_parity_after_a_rank_is_killed_mid_save(runs):
    full = runs.train("lo_6")
    path = runs.path("lo_killed.ckpt")
    # lo_kill: 3 steps, a local save to `path` at step 3, then a second save to `path` during which rank 1
    # SIGKILLs itself after 1 KiB of its rank file.
    killed = runs.train("lo_kill")
    found = re.search(r"pid (\d+): killing myself after (\d+) bytes", killed.stdout)
    assert found, killed.stdout[-3000:]
    # Rank 0 saw rank 1 vanish, failed, and removed the unfinished temporary directory.
    assert re.search(PEER_GONE, killed.stderr), killed.stderr[-3000:]
    assert [n for n in os.listdir(runs.dir) if n.startswith(".lo_killed")] == []
    # The directory at the path is the first save, complete: exactly the state at step 3.
    assert sorted(os.listdir(path)) == ["meta.pt", "rank-0.pt", "rank-1.pt"]
    before = load_as_full(path)
    assert before["global_step"] == 3
    assert_tensors_equal(before["state_dict"], full["saved"]["params"], "surviving checkpoint params")
    assert_optimizer_equal(before["optimizer_states"][0], full["saved"]["optimizer_states"][0], "surviving optim")

    resumed = runs.train("lo_resumed")
    assert resumed["records"] == full["records"][3:]  # steps 4-6: same losses and lr, bit for bit
    assert_tensors_equal(resumed["start"]["params"], full["saved"]["params"], "restored params")
    assert_optimizer_equal(
        resumed["start"]["optimizer_states"][0], full["saved"]["optimizer_states"][0], "restored optim"
    )
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")
    assert_optimizer_equal(resumed["end"]["optimizer_states"][0], full["end"]["optimizer_states"][0], "final optim")
    after = load_as_full(path)  # replaced by the resumed run's save after fit
    assert after["global_step"] == 6
    assert_tensors_equal(after["state_dict"], resumed["end"]["params"], "replaced checkpoint params")


def test_layout_one_file_per_rank_with_its_raw_shards(runs):
    full = runs.train("lo_6")
    path = runs.path("lo_3.ckpt")
    assert checkpoint_kind(path) == "local"
    assert sorted(os.listdir(path)) == ["meta.pt", "rank-0.pt", "rank-1.pt"]
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
    info = meta["lightning_fsdp"]
    assert (info["format"], info["version"], info["world_size"]) == ("local", 1, 2)
    assert "state_dict" not in meta and meta["global_step"] == 3 and "loops" in meta
    emb = info["entries"]["model.emb.weight"]
    assert emb["shape"] == (7, 5) and emb["rows"] == [(0, 4), (4, 7)] and emb["dtype"] == "torch.float32"
    assert info["entries"]["model.tiny"]["rows"] == [(0, 1), (1, 1)]
    assert info["entries"]["model.frozen.weight"]["rows"] == [(0, 3), (3, 5)]
    decay = [n for n in full["saved"]["params"] if not n.endswith("bias") and n != "model.head.weight"]
    assert info["optimizers"][0][0] == [n for n in decay if n != "model.frozen.weight"]
    files = [torch.load(os.path.join(path, f"rank-{r}.pt"), weights_only=True) for r in (0, 1)]
    for rank, data in enumerate(files):
        assert (data["rank"], data["world_size"]) == (rank, 2)
        assert data["state_dict"]["model.emb.weight"].shape == ((4, 5), (3, 5))[rank]
        assert data["state_dict"]["model.tiny"].shape == ((1, 5), (0, 5))[rank]
        state = data["optimizer_states"][0]["state"]
        assert state[1]["momentum_buffer"].shape == ((4, 5), (3, 5))[rank]  # index 1: model.emb.weight
        # Raw shards: a unit's parameters are views of its one flat shard buffer, written once, as it is.
        fc1_w, fc1_b = data["state_dict"]["model.block1.fc1.weight"], data["state_dict"]["model.block1.fc1.bias"]
        assert fc1_w.untyped_storage().data_ptr() == fc1_b.untyped_storage().data_ptr()
        # The rows of rank r are rows_of(r) of the full tensor saved at step 3.
        start, end = emb["rows"][rank]
        assert torch.equal(
            data["state_dict"]["model.emb.weight"], full["saved"]["params"]["model.emb.weight"][start:end]
        )


def test_convert_local_to_full(runs, tmp_path):
    full = runs.train("lo_6")
    out = str(tmp_path / "full.ckpt")
    assert convert_main([runs.path("lo_3.ckpt"), out]) == 0
    ckpt = torch.load(out, weights_only=False)
    assert ckpt["global_step"] == 3 and "lightning_fsdp" not in ckpt
    assert_tensors_equal(ckpt["state_dict"], full["saved"]["params"], "converted params")
    assert_optimizer_equal(ckpt["optimizer_states"][0], full["saved"]["optimizer_states"][0], "converted optim")
    weights = load_as_full(runs.path("lo_wo.ckpt"))
    assert "optimizer_states" not in weights and weights["global_step"] == 6
    assert_tensors_equal(weights["state_dict"], full["end"]["params"], "weights-only params")


def _cases(runs: Runs) -> list[dict]:
    runs.train("lo_6")
    good = runs.path("lo_3.ckpt")
    truncated = runs.path("lo_truncated.ckpt")
    if not os.path.exists(truncated):
        shutil.copytree(good, truncated)
        file = os.path.join(truncated, "rank-1.pt")
        with open(file, "rb") as f:
            data = f.read()
        with open(file, "wb") as f:
            f.write(data[: len(data) // 2])
    missing = runs.path("lo_missing.ckpt")
    if not os.path.exists(missing):
        shutil.copytree(good, missing)
        os.remove(os.path.join(missing, "rank-1.pt"))
    cases = [
        {"name": "other_model", "ckpt": good, "dim": 6},
        {"name": "no_shard", "ckpt": good, "sharding": "NO_SHARD"},
        {"name": "truncated", "ckpt": truncated},
        {"name": "missing", "ckpt": missing},
        {"name": "extra_strict", "ckpt": good, "extra": True, "fn": "validate"},
        {"name": "extra_non_strict", "ckpt": good, "extra": True, "strict": False, "fn": "validate"},
        {"name": "weights_only_fit", "ckpt": runs.path("lo_wo.ckpt")},
        {"name": "weights_only_validate", "ckpt": runs.path("lo_wo.ckpt"), "fn": "validate"},
        {"name": "good", "ckpt": good},
    ]
    return runs.cases("lo_cases", cases)


def _error(outcome: dict, name: str, kind: str, *needles: str) -> str:
    assert "error" in outcome[name], f"{name} loaded: {outcome[name]}"
    got, message = outcome[name]["error"]
    assert got == kind, f"{name}: {got}: {message}"
    for needle in needles:
        assert needle in message, f"{name}: {needle!r} not in {message!r}"
    return message


def test_mismatch_and_damage_errors_on_every_rank(runs):
    outcomes = _cases(runs)
    for outcome in outcomes:
        _error(
            outcome,
            "other_model",
            "CheckpointMismatchError",
            "parameter 'model.tiny' has shape (1, 5) in the checkpoint but (1, 6) in the model",
        )
        _error(
            outcome,
            "no_shard",
            "CheckpointMismatchError",
            "'model.tiny' is split into rows [(0, 1), (1, 1)] across ranks in the checkpoint but [(0, 1)] in this run",
        )
        _error(outcome, "missing", "CheckpointLoadError", "'rank-1.pt' is missing")
        _error(outcome, "extra_strict", "CheckpointMismatchError", "missing keys ['extra']")
        _error(outcome, "weights_only_fit", "KeyError", "contains only the model")
    # Only rank 1 reads rank-1.pt; it finds the damage, and rank 0 raises the same error instead of waiting.
    rank0, rank1 = outcomes
    file = os.path.join(runs.path("lo_truncated.ckpt"), "rank-1.pt")
    own = _error(rank1, "truncated", "CheckpointLoadError", file, "truncated or corrupt")
    relayed = _error(rank0, "truncated", "CheckpointLoadError", file, "truncated or corrupt")
    assert relayed == own + " [raised on rank 1]"


def test_non_strict_weights_only_and_exact_restore(runs):
    full = runs.train("lo_6")
    rank0, rank1 = _cases(runs)
    for name in ("extra_non_strict", "weights_only_validate", "good"):
        assert rank0[name].get("ok") and rank1[name].get("ok"), (rank0[name], rank1[name])
    params = dict(rank0["extra_non_strict"]["params"])
    assert torch.equal(params.pop("extra"), torch.full((3, 2), 0.5))  # not in the checkpoint: left as initialised
    assert_tensors_equal(params, full["saved"]["params"], "non-strict params")
    assert_tensors_equal(rank0["weights_only_validate"]["params"], full["end"]["params"], "weights-only params")
    assert_tensors_equal(rank0["good"]["params"], full["saved"]["params"], "restored params")
    assert_optimizer_equal(rank0["good"]["optimizer"][0], full["saved"]["optimizer_states"][0], "restored optim")


def test_another_world_size_is_refused(runs):
    runs.train("lo_6")
    (outcome,) = runs.cases("lo_world1", [{"name": "world1", "ckpt": runs.path("lo_3.ckpt")}], devices=1)
    _error(
        outcome, "world1", "CheckpointMismatchError", "was written by 2 ranks, this run has 1", "lightning-fsdp convert"
    )
