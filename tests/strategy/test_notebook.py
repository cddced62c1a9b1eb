"""Notebooks: the strategy forks its processes in an interactive session, and examples/notebook.ipynb runs in a real
Jupyter kernel (nbclient) and trains, checkpoints and plots.

The launcher choice is tested in this process with Lightning's interactive flag patched; the notebook itself runs in
a kernel, where Lightning detects the interactive session on its own.
"""

from __future__ import annotations

import os
import re

import lightning as L
import lightning.fabric.utilities.imports as fabric_imports
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors import accelerator_connector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_fsdp  # noqa: F401  registers "fsdp_custom"
from benchmarks.ranks import ROOT
from lightning_fsdp import launcher as launcher_module
from lightning_fsdp.launcher import FSDPMultiProcessingLauncher, choose_launcher
from lightning_fsdp.strategy import FSDPStrategy
from tests.toolbox.lightning_scripts import quiet_trainer

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


@pytest.fixture
def interactive(monkeypatch):
    """Make this process look like a notebook kernel to Lightning and to the launcher choice."""
    monkeypatch.setattr(fabric_imports, "_IS_INTERACTIVE", True)
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)


def _choose(start_method: str = "popen", environment=None):
    strategy = FSDPStrategy()
    return choose_launcher(strategy, start_method, environment or LightningEnvironment(), 2, 1)


def test_script_keeps_rerunning_itself(monkeypatch):
    monkeypatch.setattr(fabric_imports, "_IS_INTERACTIVE", False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    launcher = _choose("popen")
    assert type(launcher) is _SubprocessScriptLauncher
    assert not launcher.is_interactive_compatible


def test_interactive_session_forks(interactive, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for start_method in ("popen", "fork"):
        launcher = _choose(start_method)
        assert isinstance(launcher, FSDPMultiProcessingLauncher)
        assert launcher.start_method == "fork"
        assert launcher.is_interactive_compatible


def test_processes_started_externally_are_not_started_again(interactive, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun or a previous launch leaves it
    assert type(_choose("popen")) is _SubprocessScriptLauncher


def test_spawn_is_refused_in_a_notebook(interactive, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="start_method='spawn' cannot run in a notebook"):
        _choose("spawn")


def test_fork_is_refused_after_cuda_was_initialised(interactive, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*Restart the kernel"):
        _choose("popen")


def test_fork_is_refused_where_the_platform_has_none(interactive, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(launcher_module.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(RuntimeError, match="this platform has no 'fork' \\(available: spawn\\)"):
        _choose("popen")


def test_unknown_start_method_names_the_choices():
    with pytest.raises(ValueError, match="start_method='thread' is not valid; choose one of"):
        _choose("thread")


def _strategy_forks_in_notebooks() -> bool:
    """Whether FSDPStrategy._configure_launcher goes through choose_launcher (checked with a patched flag)."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(fabric_imports, "_IS_INTERACTIVE", True)
        mp.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
        mp.delenv("LOCAL_RANK", raising=False)
        trainer = L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=2, logger=False)
        return isinstance(trainer.strategy.launcher, FSDPMultiProcessingLauncher)
    except MisconfigurationException:
        return False  # Lightning refused the script launcher in an interactive session
    finally:
        mp.undo()


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(5, 3)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_strategy_forks_in_notebooks():
    assert _strategy_forks_in_notebooks()


def test_forked_ranks_send_the_full_trained_weights_back(monkeypatch):
    # Lightning's own fork/spawn launcher sends rank 0's state_dict(), which under sharding holds rank 0's rows
    # only (here a (2, 5) weight for a (3, 5) model) and fails to load into the main process's model.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    torch.manual_seed(0)
    model = _Linear()
    before = model.net.weight.detach().clone()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 5)), batch_size=2)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy="fsdp_custom_fork",
        max_steps=2,
    )
    trainer.fit(model, data)
    assert isinstance(trainer.strategy.launcher, FSDPMultiProcessingLauncher)
    assert model.net.weight.shape == (3, 5)
    assert not torch.equal(model.net.weight, before)  # trained in the children, received here
    assert trainer.state.finished


def test_notebook_trains_checkpoints_and_plots_in_a_real_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")

    # The kernel is a fresh process: it finds the package through PYTHONPATH and runs one thread per process.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for cell in code for o in cell.outputs if o.output_type == "stream")

    assert "processes started by: FSDPMultiProcessingLauncher with fork" in text
    # Training lowered the loss, logged at every step by rank 0 (4 epochs x 512 samples / (2 ranks x 16)).
    match = re.search(r"steps: (\d+), first loss: ([\d.]+), last loss: ([\d.]+)", text)
    assert match, text[-2000:]
    steps, first, last = int(match[1]), float(match[2]), float(match[3])
    assert steps == 64
    assert last < first / 5, (first, last)
    # The checkpoint is a full one (unwrapped names and shapes) and equals the weights returned to the kernel.
    checkpoint = tmp_path / "checkpoints" / "regressor.ckpt"
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "net.0.weight": (64, 16),
        "net.0.bias": (64,),
        "net.2.weight": (64, 64),
        "net.2.bias": (64,),
        "net.4.weight": (1, 64),
        "net.4.bias": (1,),
    }
    assert "checkpoint equals the notebook's model: True" in text
    # The plot was saved and shown inline.
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    assert any("image/png" in o.get("data", {}) for o in code[-1].outputs)
