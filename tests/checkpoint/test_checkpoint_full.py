"""Full checkpoints: exact resume, interchange with DDP and single-device, crash-safe saves, clear load errors.

Lightning-level scenarios run tests/scripts/checkpoint_run.py as a user would (Lightning's launcher re-runs it per
rank). Every run uses the same global batches (6 samples per step, 3 steps per epoch), so a run of 2 epochs and a
run of 1 epoch + checkpoint + resume for 1 more see the same data; on CPU in fp32 they must agree bitwise. The runs
start when the module's first test asks for them, a few at a time, each once the run whose checkpoint it resumes from
has finished.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import re
import signal
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError, temp_path_for
from tests.toolbox.compare import assert_optimizer_equal, assert_tensors_equal, max_diff
from tests.toolbox.launch import in_background, join_configurations, run_configurations, run_script
from tests.toolbox.models import ToyLM

LAUNCH_TIMEOUT_S = 180


class Runs:
    """Every Lightning run once per test session, all started in the background (``in_background``, the runs a
    resume needs first); ``run(name)`` waits for it and returns rank 0's results."""

    SPECS = {
        # fsdp_custom, SGD with momentum: 6 steps, saving after step 3 (at the first epoch's end, where
        # ModelCheckpoint saves); then fresh processes resume from that file to step 6.
        "fsdp_sgd_6": ["--epochs", "2", "--save-in-fit", "{dir}/fsdp_sgd_3.ckpt"],
        "fsdp_sgd_resumed": [
            "--epochs",
            "2",
            "--resume",
            "{dir}/fsdp_sgd_3.ckpt",
            "--validate-ckpt",
            "{dir}/fsdp_sgd_3.ckpt",
        ],
        # fsdp_custom, AdamW + StepLR(step_size=2) stepped per step.
        "fsdp_adamw_6": ["--optimizer", "adamw", "--epochs", "2", "--save-in-fit", "{dir}/fsdp_adamw_3.ckpt"],
        "fsdp_adamw_resumed": ["--optimizer", "adamw", "--epochs", "2", "--resume", "{dir}/fsdp_adamw_3.ckpt"],
        # Interchange. DDP trains 3 steps and saves after fit; fsdp_custom resumes it and saves after fit too.
        "ddp_from_fsdp": ["--strategy", "ddp", "--epochs", "2", "--resume", "{dir}/fsdp_sgd_3.ckpt"],
        "single_from_fsdp": [
            "--strategy",
            "single",
            "--devices",
            "1",
            "--epochs",
            "2",
            "--resume",
            "{dir}/fsdp_sgd_3.ckpt",
        ],
        "ddp_sgd_3": ["--strategy", "ddp", "--epochs", "1", "--save", "{dir}/ddp_sgd_3.ckpt"],
        "fsdp_from_ddp": ["--epochs", "2", "--resume", "{dir}/ddp_sgd_3.ckpt", "--save", "{dir}/fsdp_final.ckpt"],
    }
    NEEDS = {
        "fsdp_sgd_resumed": "fsdp_sgd_6",
        "fsdp_adamw_resumed": "fsdp_adamw_6",
        "ddp_from_fsdp": "fsdp_sgd_6",
        "single_from_fsdp": "fsdp_sgd_6",
        "fsdp_from_ddp": "ddp_sgd_3",
    }

    # Each tuple one launch running its runs one after another (its processes import torch and Lightning once); a
    # launch that resumes waits for the launches whose checkpoints it needs, so resumes run in fresh processes.
    LAUNCHES = (
        ("fsdp_sgd_6", "fsdp_adamw_6", "ddp_sgd_3"),
        ("fsdp_sgd_resumed", "fsdp_adamw_resumed", "ddp_from_fsdp", "fsdp_from_ddp"),
        ("single_from_fsdp",),
    )

    def __init__(self, folder: str) -> None:
        self.dir = folder
        self._submitted = threading.Event()
        self._launch_of = {name: i for i, names in enumerate(self.LAUNCHES) for name in names}
        assert sorted(self._launch_of) == sorted(self.SPECS)
        self._futures: dict[int, Future] = in_background(
            {i: functools.partial(self._launch, names) for i, names in enumerate(self.LAUNCHES)}
        )
        self._submitted.set()

    def _launch(self, names: tuple[str, ...]) -> dict[str, dict]:
        self._submitted.wait()
        for name in names:
            if name in self.NEEDS:
                self.run(self.NEEDS[name])
        configs = [[a.format(dir=self.dir) for a in self.SPECS[name]] for name in names]
        outs = run_configurations("checkpoint_run.py", Path(self.dir), join_configurations(configs), LAUNCH_TIMEOUT_S)
        return {name: torch.load(out, weights_only=False) for name, out in zip(names, outs, strict=True)}

    def run(self, name: str) -> dict:
        return self._futures[self._launch_of[name]].result()[name]

    def checkpoint(self, name: str) -> dict:
        return torch.load(os.path.join(self.dir, f"{name}.ckpt"), weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(str(tmp_path_factory.mktemp("full_ckpt")))


# ------------------------------------------------------------------------------------------------ comparisons
def _assert_restored(run: dict, ckpt: dict, what: str) -> None:
    """What the resumed run held at on_train_start is exactly the checkpoint's content (atol=0)."""
    start = run["start"]
    assert_tensors_equal(start["params"], ckpt["state_dict"], f"{what} params")
    assert len(start["optimizer_states"]) == len(ckpt["optimizer_states"]) == 1
    assert_optimizer_equal(start["optimizer_states"][0], ckpt["optimizer_states"][0], f"{what} optimizer")
    assert start["lr_schedulers"] == ckpt["lr_schedulers"]
    assert start["global_step"] == ckpt["global_step"] == 3


def _tensors_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


class _Wrapped(nn.Module):
    """The unwrapped LightningModule's parameter/buffer structure (its only child is ``model``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM()


# ------------------------------------------------------------------------------------------ a. resume parity
def test_resume_parity_sgd_momentum(runs):
    full, resumed = runs.run("fsdp_sgd_6"), runs.run("fsdp_sgd_resumed")
    ckpt = runs.checkpoint("fsdp_sgd_3")
    assert [r[0] for r in full["records"]] == [0, 1, 2, 3, 4, 5]
    # Steps 4-6 after fit(ckpt_path=...) in fresh processes: same step numbers, losses and lr, bit for bit.
    assert resumed["records"] == full["records"][3:]
    _assert_restored(resumed, ckpt, "fsdp resume")
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")
    assert_optimizer_equal(resumed["end"]["optimizer_states"][0], full["end"]["optimizer_states"][0], "final optim")
    # validate(ckpt_path=...) after fit loads the model only, into the sharded module.
    assert_tensors_equal(resumed["validated"], ckpt["state_dict"], "validate(ckpt_path)")
    assert ckpt["state_dict"]["model.emb.weight"].shape == (7, 5)  # full shapes, not shards
    assert not _tensors_equal(ckpt["state_dict"], full["end"]["params"])  # training moved on after the save


def test_resume_parity_adamw_with_scheduler(runs):
    full, resumed = runs.run("fsdp_adamw_6"), runs.run("fsdp_adamw_resumed")
    ckpt = runs.checkpoint("fsdp_adamw_3")
    assert [r[2] for r in full["records"]] == [0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025]  # StepLR per step
    assert resumed["records"] == full["records"][3:]
    _assert_restored(resumed, ckpt, "fsdp adamw resume")
    entry = ckpt["optimizer_states"][0]["state"][0]
    assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"] and float(entry["step"]) == 3.0
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 3 and ckpt["lr_schedulers"][0]["_last_lr"] == [0.005, 0.005]
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")
    assert_optimizer_equal(resumed["end"]["optimizer_states"][0], full["end"]["optimizer_states"][0], "final optim")
    assert resumed["end"]["lr_schedulers"] == full["end"]["lr_schedulers"]


# ------------------------------------------------------------------------------------------ b. interchange
def test_checkpoint_layout_is_plain_lightning(runs):
    runs.run("fsdp_sgd_6")
    runs.run("ddp_sgd_3")
    ours, ddp = runs.checkpoint("fsdp_sgd_3"), runs.checkpoint("ddp_sgd_3")
    reference = _Wrapped()
    expected = reference.state_dict()
    assert list(ours["state_dict"]) == list(expected)  # includes both names of the tied embedding/head weight
    for key, value in expected.items():
        assert ours["state_dict"][key].shape == value.shape, key
        assert ours["state_dict"][key].device.type == "cpu"
    # Plain torch.optim layout: the same param_groups (with integer "params") and per-parameter full-shape state
    # as an optimizer over the unwrapped model built the way configure_optimizers builds it.
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    order = [n for n, _ in named if not n.endswith("bias")] + [n for n, _ in named if n.endswith("bias")]
    shapes = dict(named)
    state = ours["optimizer_states"][0]
    n_decay = sum(not n.endswith("bias") for n in order)
    assert [g["params"] for g in state["param_groups"]] == [list(range(n_decay)), list(range(n_decay, len(order)))]
    assert sorted(state["state"]) == list(range(len(order)))
    for index, name in enumerate(order):
        assert state["state"][index]["momentum_buffer"].shape == shapes[name].shape, name
    # The checkpoint DDP writes after the same 3 steps has the same layout and (gloo sums of 2 values commute)
    # the same values, bit for bit.
    assert_tensors_equal(ours["state_dict"], ddp["state_dict"], "fsdp vs ddp checkpoint params")
    assert_optimizer_equal(ours["optimizer_states"][0], ddp["optimizer_states"][0], "fsdp vs ddp checkpoint optim")


def test_fsdp_checkpoint_resumes_under_ddp(runs):
    resumed, full = runs.run("ddp_from_fsdp"), runs.run("fsdp_sgd_6")
    assert resumed["strategy"] == "DDPStrategy" and resumed["world_size"] == 2
    _assert_restored(resumed, runs.checkpoint("fsdp_sgd_3"), "ddp resume")
    assert resumed["records"] == full["records"][3:]
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")


def test_fsdp_checkpoint_resumes_on_single_device(runs):
    resumed, full = runs.run("single_from_fsdp"), runs.run("fsdp_sgd_6")
    assert resumed["strategy"] == "SingleDeviceStrategy" and resumed["world_size"] == 1
    _assert_restored(resumed, runs.checkpoint("fsdp_sgd_3"), "single-device resume")
    # One process averages the loss over 24 tokens at once, two processes over 12 each and then average: equal up
    # to fp32 rounding (measured: losses within 3.6e-7, parameters within 6e-8).
    assert [r[0] for r in resumed["records"]] == [3, 4, 5]
    for (_, got, _), (_, want, _) in zip(resumed["records"], full["records"][3:]):
        assert abs(got - want) <= 2e-6, (got, want)
    assert max_diff(resumed["end"]["params"], full["end"]["params"]) <= 1e-6


def test_ddp_checkpoint_resumes_under_fsdp(runs):
    resumed, ddp, full = runs.run("fsdp_from_ddp"), runs.run("ddp_sgd_3"), runs.run("fsdp_sgd_6")
    assert resumed["strategy"] == "FSDPStrategy" and ddp["strategy"] == "DDPStrategy"
    _assert_restored(resumed, runs.checkpoint("ddp_sgd_3"), "fsdp resume of a ddp checkpoint")
    # DDP's first 3 steps and fsdp_custom's last 3 together equal 6 uninterrupted steps, bit for bit.
    assert ddp["records"] + resumed["records"] == full["records"]
    assert_tensors_equal(resumed["end"]["params"], full["end"]["params"], "final params")
    assert_optimizer_equal(resumed["end"]["optimizer_states"][0], full["end"]["optimizer_states"][0], "final optim")
    # A checkpoint saved after fit (strategy torn down) holds exactly the trained state.
    final = runs.checkpoint("fsdp_final")
    assert final["global_step"] == 6
    assert_tensors_equal(final["state_dict"], resumed["end"]["params"], "after-fit checkpoint params")
    assert_optimizer_equal(final["optimizer_states"][0], resumed["end"]["optimizer_states"][0], "after-fit optim")


# ------------------------------------------------------------------------------------------ c. crash mid-save
def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _good_checkpoint() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"state_dict": {"w": torch.randn(64, 64, generator=g), "b": torch.arange(10)}, "epoch": 1, "global_step": 3}


def _kill_mid_save(path: str, *extra: str) -> int:
    """Save a 32 MiB checkpoint to ``path`` in a subprocess that SIGKILLs itself once 8 MiB are written; its pid."""
    args = ["--mode", "killsave", "--save", path, "--kill-after", str(8 << 20), *extra]
    proc = run_script("checkpoint_run.py", *args, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    found = re.search(r"pid (\d+): killing myself after (\d+) bytes", proc.stdout)
    assert found, proc.stdout
    pid = int(found.group(1))
    return pid


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "last.ckpt")
    io = AtomicCheckpointIO()
    good = _good_checkpoint()
    io.save_checkpoint(good, path)
    before = _sha(path)

    pid = _kill_mid_save(path)  # 32 MiB checkpoint, killed once 8 MiB reached the temporary file

    assert _sha(path) == before  # not a byte changed at the path
    loaded = io.load_checkpoint(path)
    assert loaded["epoch"] == 1 and loaded["global_step"] == 3
    assert_tensors_equal(loaded["state_dict"], good["state_dict"], "checkpoint after the killed save")
    # The kill really happened mid-write: the killed process's temporary file holds a partial, unloadable archive.
    tmp = temp_path_for(path, pid)
    assert os.path.exists(tmp)
    assert 8 << 20 <= os.path.getsize(tmp) < 32 << 20
    with pytest.raises(CheckpointLoadError, match="truncated or corrupt"):
        io.load_checkpoint(tmp)
    # The next save to the same path succeeds and replaces the checkpoint.
    io.save_checkpoint({**good, "epoch": 2}, path)
    assert io.load_checkpoint(path)["epoch"] == 2
    assert not os.path.exists(temp_path_for(path))


def test_sigkill_mid_plain_save_truncates_the_checkpoint(tmp_path):
    """Control: the same kill during a direct torch.save to the path destroys the previous checkpoint."""
    path = str(tmp_path / "last.ckpt")
    io = AtomicCheckpointIO()
    io.save_checkpoint(_good_checkpoint(), path)
    _kill_mid_save(path, "--no-atomic")
    assert 8 << 20 <= os.path.getsize(path) < 32 << 20
    with pytest.raises(CheckpointLoadError, match="truncated or corrupt") as info:
        io.load_checkpoint(path)
    assert path in str(info.value) and info.value.__cause__ is not None


def test_failed_save_removes_temp_file_and_keeps_previous(tmp_path):
    path = str(tmp_path / "last.ckpt")
    io = AtomicCheckpointIO()
    good = _good_checkpoint()
    io.save_checkpoint(good, path)
    before = _sha(path)
    # A local lambda: torch.save raises AttributeError ("Can't pickle local object"), a global one PicklingError.
    with pytest.raises((pickle.PicklingError, AttributeError)):
        io.save_checkpoint({"state_dict": good["state_dict"], "unpicklable": lambda: None}, path)
    assert _sha(path) == before
    assert os.listdir(tmp_path) == ["last.ckpt"]
    # A new folder is created, Path objects work, and nothing but the checkpoint is left behind.
    nested = tmp_path / "a" / "b" / "c.ckpt"
    io.save_checkpoint(good, nested)
    assert os.listdir(nested.parent) == ["c.ckpt"]
    assert_tensors_equal(io.load_checkpoint(nested)["state_dict"], good["state_dict"], "nested")


# ------------------------------------------------------------------------------------------ d. clear load errors
def test_load_errors_name_the_file_and_the_problem(tmp_path):
    io = AtomicCheckpointIO()
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match="not found") as info:
        io.load_checkpoint(missing)
    assert isinstance(info.value, CheckpointLoadError) and missing in str(info.value)

    with pytest.raises(IsADirectoryError, match="is a directory") as info:
        io.load_checkpoint(str(tmp_path))
    assert isinstance(info.value, CheckpointLoadError) and str(tmp_path) in str(info.value)

    good = str(tmp_path / "good.ckpt")
    io.save_checkpoint(_good_checkpoint(), good)
    data = open(good, "rb").read()
    cases = {"half": data[: len(data) // 2], "minus_one_byte": data[:-1], "head": data[:100]}
    for label, content in cases.items():
        bad = str(tmp_path / f"{label}.ckpt")
        with open(bad, "wb") as f:
            f.write(content)
        with pytest.raises(CheckpointLoadError, match="truncated or corrupt") as info:
            io.load_checkpoint(bad)
        assert bad in str(info.value), label
        assert info.value.__cause__ is not None and not isinstance(info.value.__cause__, CheckpointLoadError)
        assert info.value.path == bad

    empty = str(tmp_path / "empty.ckpt")
    open(empty, "wb").close()
    with pytest.raises(CheckpointLoadError, match="empty") as info:
        io.load_checkpoint(empty)
    assert empty in str(info.value)

    text = str(tmp_path / "notes.ckpt")
    with open(text, "w") as f:
        f.write("hello world, not a checkpoint\n")
    with pytest.raises(CheckpointLoadError) as info:
        io.load_checkpoint(text)
    assert text in str(info.value)

    # Through the strategy (what Trainer.fit(ckpt_path=...) calls on every rank).
    from lightning_fsdp import FSDPStrategy

    strategy = FSDPStrategy(checkpoint_io=io)
    with pytest.raises(CheckpointLoadError, match="truncated or corrupt"):
        strategy.load_checkpoint(str(tmp_path / "half.ckpt"))
    assert strategy.load_checkpoint(good)["global_step"] == 3


def test_strategy_writes_atomically_by_default_and_respects_user_io():
    import lightning as L
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO

    assert type(L.Trainer(strategy="fsdp_custom", devices=1, logger=False).strategy.checkpoint_io) is AtomicCheckpointIO
    user = TorchCheckpointIO()
    trainer = L.Trainer(strategy=FSDPStrategy(), devices=1, logger=False, plugins=[user])
    assert trainer.strategy.checkpoint_io is user
    wrapped = L.Trainer(strategy="fsdp_custom", devices=1, logger=False, plugins=[AsyncCheckpointIO()])
    assert type(wrapped.strategy.checkpoint_io.checkpoint_io) is AtomicCheckpointIO
