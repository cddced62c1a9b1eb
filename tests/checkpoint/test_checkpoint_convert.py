"""``lightning-fsdp convert``: sharded directory -> one full file (plain Lightning resumes it on one device), full
file -> sharded directory (fsdp_custom resumes it bit for bit), Lightning's own ``consolidate_checkpoint`` on our
directories, and the command's errors. Conversion runs in the test process itself: no process group.

"sh_6" (tests/checkpoint/checkpoint_runs.py) trains 6 steps on 2 ranks and saves a sharded directory at step 3 together
with the full state it held then (``saved``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from benchmarks.ranks import ROOT
from lightning_fsdp.checkpoint.common import to_index_keyed
from lightning_fsdp.checkpoint.convert import convert, load_as_full, main
from tests.checkpoint.checkpoint_runs import Runs
from tests.toolbox.compare import assert_optimizer_equal, assert_tensors_equal
from tests.toolbox.launch import run_command
from tests.toolbox.models import ToyLM


@pytest.fixture(scope="module")
def runs() -> Runs:
    return Runs.shared()


def _full_file(runs: Runs) -> str:
    """sh_3.ckpt converted to one file with the command's entry point (once)."""
    out = runs.path("cv_full.ckpt")
    if not os.path.exists(out):
        runs.train("sh_6")
        assert main([runs.path("sh_3.ckpt"), out]) == 0
    return out


def unwrapped_model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The unwrapped model with the optimizer configure_optimizers builds (two groups, SGD with momentum)."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ToyLM()

    module = Wrapped()
    decay = [p for n, p in module.named_parameters() if p.requires_grad and not n.endswith("bias")]
    no_decay = [p for n, p in module.named_parameters() if p.requires_grad and n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return module, torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def test_sharded_to_full_is_a_plain_lightning_checkpoint(runs):
    full = runs.train("sh_6")
    ckpt = torch.load(_full_file(runs), weights_only=False)
    saved = full["saved"]
    assert ckpt["global_step"] == 3 and ckpt["epoch"] == 0 and "loops" in ckpt and "callbacks" in ckpt
    assert "lightning_fsdp" not in ckpt
    assert_tensors_equal(ckpt["state_dict"], saved["params"], "converted params")
    # Plain torch.optim layout: integer parameter ids, full-shape state.
    state = ckpt["optimizer_states"][0]
    assert [g["params"] for g in state["param_groups"]] == [list(range(7)), list(range(7, 12))]
    assert_optimizer_equal(state, saved["optimizer_states"][0], "converted optim")
    # The unwrapped model and a plain optimizer load it as they are.
    module, optimizer = unwrapped_model_and_optimizer()
    module.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(state)
    assert torch.equal(
        optimizer.state[module.model.emb.weight]["momentum_buffer"],
        saved["optimizer_states"][0]["state"][1]["momentum_buffer"],
    )
    # `python -m lightning_fsdp.checkpoint.convert` writes the same checkpoint.
    out = runs.path("cv_module.ckpt")
    proc = run_command(
        [sys.executable, "-m", "lightning_fsdp.checkpoint.convert", runs.path("sh_3.ckpt"), out], cwd=ROOT, timeout=180
    )
    assert "Wrote a full checkpoint" in proc.stdout
    again = torch.load(out, weights_only=False)
    assert_tensors_equal(again["state_dict"], ckpt["state_dict"], "python -m params")
    assert_optimizer_equal(again["optimizer_states"][0], state, "python -m optim")


def test_lightning_consolidate_checkpoint_reads_our_directories(runs):
    full = runs.train("sh_6")
    out = runs.path("cv_lightning.ckpt")
    if not os.path.exists(out):
        consolidate = "lightning.pytorch.utilities.consolidate_checkpoint"
        run_command(
            [sys.executable, "-m", consolidate, runs.path("sh_3.ckpt"), "--output_file", out], cwd=ROOT, timeout=180
        )
    ckpt = torch.load(out, weights_only=False)
    saved = full["saved"]
    assert ckpt["global_step"] == 3
    assert_tensors_equal(ckpt["state_dict"], saved["params"], "consolidated params")
    # Lightning keeps the optimizer state keyed by parameter name (as for its own FSDP checkpoints) ...
    state = ckpt["optimizer_states"][0]
    assert list(state["state"])[:2] == ["model.tiny", "model.emb.weight"]
    assert state["param_groups"][0]["params"][:2] == ["model.tiny", "model.emb.weight"]
    assert_optimizer_equal(to_index_keyed(state), saved["optimizer_states"][0], "consolidated optim")
    # ... which a plain torch optimizer loads as it is (its ids only have to match between state and groups), and
    # which fsdp_custom re-keys when it loads a full file.
    _module, optimizer = unwrapped_model_and_optimizer()
    optimizer.load_state_dict(state)
    for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        assert torch.equal(
            optimizer.state[param]["momentum_buffer"], saved["optimizer_states"][0]["state"][index]["momentum_buffer"]
        )


def test_converted_file_resumes_under_plain_lightning_on_one_device(runs):
    full = runs.train("sh_6")
    _full_file(runs)
    resumed = runs.train("cv_single")
    assert resumed["strategy"] == "SingleDeviceStrategy" and resumed["world_size"] == 1
    assert_tensors_equal(resumed["start"]["params"], full["saved"]["params"], "restored params")
    assert_optimizer_equal(
        resumed["start"]["optimizer_states"][0], full["saved"]["optimizer_states"][0], "restored optim"
    )
    assert resumed["start"]["global_step"] == 3
    # One process averages over 24 tokens at once, two over 12 each: equal up to fp32 rounding.
    assert [r[0] for r in resumed["records"]] == [3, 4, 5]
    for (_, got, _), (_, want, _) in zip(resumed["records"], full["records"][3:]):
        assert abs(got - want) <= 2e-6, (got, want)


def test_full_to_sharded_round_trip_and_resume(runs):
    full = runs.train("sh_6")
    source = _full_file(runs)
    sharded = runs.path("cv_sharded.ckpt")
    if not os.path.exists(sharded):
        assert main([source, sharded, "--to", "sharded"]) == 0
    assert sorted(os.listdir(sharded)) == [".metadata", "__0_0.distcp", "meta.pt"]
    meta = torch.load(os.path.join(sharded, "meta.pt"), weights_only=False)
    assert meta["lightning_fsdp"]["optimizer_keys"] == "index"  # a full file does not name the parameters
    back = load_as_full(sharded)
    original = torch.load(source, weights_only=False)
    assert_tensors_equal(back["state_dict"], original["state_dict"], "round-trip params")
    assert_optimizer_equal(back["optimizer_states"][0], original["optimizer_states"][0], "round-trip optim")
    assert back["loops"] == original["loops"] and back["callbacks"] == original["callbacks"]
    # fsdp_custom (state_dict_type="full") resumes the converted directory on 2 ranks: bit for bit.
    resumed = runs.train("cv_sharded")
    assert resumed["records"] == full["records"][3:]
    assert_tensors_equal(resumed["start"]["params"], full["saved"]["params"], "restored params")
    assert_optimizer_equal(
        resumed["start"]["optimizer_states"][0], full["saved"]["optimizer_states"][0], "restored optim"
    )
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")


def test_command_errors(runs, tmp_path, capsys):
    source = _full_file(runs)
    missing = str(tmp_path / "nope.ckpt")
    assert main([missing, str(tmp_path / "out.ckpt")]) == 1
    assert f"Checkpoint not found: {missing!r}" in capsys.readouterr().err
    assert main([source, source + ".copy", "--to", "full"]) == 1
    assert "is already a full checkpoint" in capsys.readouterr().err
    existing = tmp_path / "exists.ckpt"
    existing.write_text("x")
    assert main([runs.path("sh_3.ckpt"), str(existing)]) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main([runs.path("sh_3.ckpt"), str(existing), "--overwrite"]) == 0
    assert torch.load(existing, weights_only=False)["global_step"] == 3
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert main([str(empty), str(tmp_path / "x.ckpt")]) == 1
    assert "is a directory but not a checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([source, str(tmp_path / "y"), "--to", "local"])
    with pytest.raises(ValueError, match="same path"):
        convert(source, source, "sharded", overwrite=True)
