"""How the strategy starts its processes: re-running the script per rank (``"popen"``, as Lightning's DDP), or, in a
notebook, forking from the kernel (``spawn`` cannot find classes defined there), refused with the reason where it
would hang or crash. The fork launcher sends the main process the *full* state dict at the end of ``fit``, so the
notebook's model holds the trained weights.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from typing import Any, Literal

import lightning.fabric.utilities.imports as _fabric_imports
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = [
    "FSDPMultiProcessingLauncher",
    "check_start_method",
    "choose_launcher",
    "is_interactive",
    "stop_launched_processes",
]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[StartMethod, ...] = ("popen", "spawn", "fork", "forkserver")

log = logging.getLogger(__name__)


def is_interactive() -> bool:
    """True in a notebook kernel or an interactive interpreter: Lightning's own test, read at call time."""
    return bool(_fabric_imports._IS_INTERACTIVE)


def check_start_method(start_method: object) -> None:
    """``FSDPStrategy(start_method=...)``: checked when the strategy is constructed, long before it launches."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not valid; choose one of {START_METHODS}.")


def choose_launcher(
    strategy: pl.strategies.ParallelStrategy,
    start_method: StartMethod,
    cluster_environment: ClusterEnvironment,
    num_processes: int,
    num_nodes: int,
) -> _Launcher:
    """The launcher ``FSDPStrategy._configure_launcher`` installs: none for processes started by someone else
    (torchrun, SLURM), the script re-run per rank for ``"popen"`` (forking in a notebook), else fork or spawn after
    checking it is safe here (``RuntimeError`` saying why not)."""
    check_start_method(start_method)
    if cluster_environment.creates_processes_externally:
        return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)
    interactive = is_interactive()
    if start_method == "popen":
        if not interactive:
            return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)
        start_method = "fork"  # there is no script to re-run
    elif start_method == "spawn" and interactive:
        raise RuntimeError(
            "start_method='spawn' cannot run in a notebook or interactive session: the new processes cannot import "
            "classes defined in the notebook. Use the default start_method='popen' (it forks in a notebook) or "
            "'fork', or run your code as a script."
        )
    if start_method in ("fork", "forkserver"):
        _check_fork_is_safe(start_method, interactive)
    return FSDPMultiProcessingLauncher(strategy, start_method=start_method)


def stop_launched_processes(launcher: _Launcher | None, grace_s: float = 2.0) -> list[int]:
    """Stop the ranks this process re-ran the script for, at the exit of a rank 0 whose fit failed; returns the pids
    signalled. Lightning kills them only on ``KeyboardInterrupt``: on any other failure of rank 0 they are left
    blocked in a collective. Each gets ``grace_s`` seconds to end (and print its own traceback), then SIGKILL."""
    script = launcher if isinstance(launcher, _SubprocessScriptLauncher) else None
    procs = list(getattr(script, "procs", None) or [])
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = []
    sig = signal.SIGTERM if sys.platform == "win32" else signal.SIGKILL
    if script is not None and procs and any(p.poll() is None for p in procs):
        # Lightning's observer thread watches this same list and SIGKILLs this process as soon as it sees a child
        # that ended with an error, which would cut rank 0 short before it reports its own exception: take the
        # children out of its sight first (with an empty list it sees nothing left to watch and stops).
        script.procs[:] = []
    for proc in procs:
        if proc.poll() is None:
            log.warning(f"Rank 0 failed: stopping the rank it started (pid {proc.pid}) so it is not left behind.")
            try:
                proc.send_signal(sig)
            except OSError:  # it ended in the meantime
                continue
            killed.append(proc.pid)
    for proc in procs:
        if proc.pid in killed:
            try:
                proc.wait(timeout=10)  # reap it
            except Exception:  # noqa: BLE001 - stuck in the kernel; nothing more to do from here
                pass
    return killed


def _check_fork_is_safe(start_method: str, interactive: bool) -> None:
    where = "in a notebook or interactive session" if interactive else "here"
    if start_method not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            f"The fsdp_custom strategy needs to start its processes with {start_method!r} {where}, and this platform "
            f"has no {start_method!r} (available: {', '.join(multiprocessing.get_all_start_methods())}). Run your "
            "code as a script (python train.py) with the default start_method='popen'."
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # A forked child cannot use a CUDA context created by its parent: it fails or hangs in its first CUDA call.
        raise RuntimeError(
            f"The fsdp_custom strategy starts its processes with {start_method!r} {where}, which is unsafe now: CUDA "
            "is already initialised in this process (a tensor or model was moved to a GPU, or a torch.cuda function "
            "was called). Restart the kernel and create the Trainer before anything touches CUDA (keep models on "
            "the CPU until trainer.fit moves them), or run your code as a script."
        )


class FSDPMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, returning the full trained weights to the main process (Lightning's
    sends rank 0's ``state_dict()``: only its shards here)."""

    @property
    def start_method(self) -> str:
        return self._start_method

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        if fitting:
            # Every rank takes part: the full state dict is gathered unit by unit (collectives); rank 0 keeps it.
            state_dict = self._strategy.lightning_module_state_dict()
        else:
            # Lightning computes the state dict on every rank even when it is not sent (torchmetrics may sync).
            trainer.lightning_module.state_dict()
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if fitting:
            # A fresh temporary folder per run: the file system may be shared between nodes.
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
