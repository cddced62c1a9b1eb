"""Preemption under ``fsdp_custom``: a signal is only recorded by its handler; every rank agrees on it at the next step
boundary (one small all-reduce), stops there at the same batch, and the checkpoints of that step are written on every
rank together. The recipe, the bound from signal to exit and what is not handled: docs/preemption.md.

Lightning's own connector (``_SignalConnector``) runs a ``dist.broadcast`` inside its SIGTERM handler, which pairs with
whatever collective another rank is in (both hang), and its SLURM requeue handler saves a checkpoint from inside the
handler, in the middle of a step. :class:`PreemptionSignals` replaces it on the Trainer when the strategy is set up,
before Lightning registers the handlers.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fsdp.collective import Collective

log = logging.getLogger(__name__)

_CHILD_GRACE_S = 30.0  # how long rank 0 waits at exit for the ranks it started, which are saving or exiting too
_STOP, _REQUEUE = 0, 1  # positions in the recorded flags: stop the run; save for SLURM and requeue the job
# The stages whose loops stop on the agreed flag (Lightning raises SIGTERMException after their batches); predict
# does not look at it.
_CHECKED = (RunningStage.TRAINING, RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING)


class PreemptionSignals(_SignalConnector):
    """The Trainer's signal connector under ``fsdp_custom``.

    The handlers (SIGTERM; with ``SLURMEnvironment(auto_requeue=True)`` also its requeue signal, SIGUSR1 by default)
    only set a flag and note the time: no collective, no save, no logging. :meth:`agree` runs at step boundaries on
    every rank; ``trainer.received_sigterm`` reports only what the ranks agreed on, so Lightning's loops raise
    ``SIGTERMException`` at the same batch on every rank. :meth:`on_exception` then writes what a preemption writes
    beyond the user's ``OnExceptionCheckpoint``: ``last`` of each ``ModelCheckpoint(save_last=...)`` and, on the
    requeue signal, Lightning's ``hpc_ckpt_N.ckpt``, after which rank 0 requeues the job."""

    def __init__(self, trainer: pl.Trainer, device: Callable[[], torch.device]) -> None:
        self._agreed = [0, 0]  # before super().__init__, whose `received_sigterm = False` goes through the setter
        super().__init__(trainer)
        self._device = device  # where the world group's collectives take tensors
        self._recorded = [0, 0]  # set by the handlers: [stop, requeue]
        self._first_signal: tuple[int, float] | None = None  # (signal number, time.monotonic()) of the first one
        self._registered = False

    @property  # an attribute in Lightning's connector
    def received_sigterm(self) -> bool:
        """Whether the ranks agreed to stop (never one rank's own signal: its loops must not leave the others)."""
        return bool(self._agreed[_STOP])

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:
        self._agreed[_STOP] = int(value)

    @property
    def requeue_agreed(self) -> bool:
        return bool(self._agreed[_REQUEUE])

    def register_signal_handlers(self) -> None:
        self._recorded = [0, 0]
        self._agreed = [0, 0]
        self._first_signal = None
        self._original_handlers = self._get_current_signal_handlers()
        self._register_signal(signal.SIGTERM, self._record_stop)
        requeue = _requeue_signal(self.trainer)
        if requeue is not None:
            self._register_signal(requeue, self._record_requeue)
        self._registered = True

    def _record(self, signum: int, requeue: bool) -> None:
        # A signal handler: a flag and a timestamp, nothing that takes a lock, allocates much or communicates.
        if self._first_signal is None:
            self._first_signal = (signum, time.monotonic())
        self._recorded[_STOP] = 1
        if requeue:
            self._recorded[_REQUEUE] = 1

    def _record_stop(self, signum: int, _frame: FrameType | None) -> None:
        self._record(signum, requeue=False)

    def _record_requeue(self, signum: int, _frame: FrameType | None) -> None:
        self._record(signum, requeue=True)

    def at_step_boundary(self, trainer: pl.Trainer) -> None:
        """Called by the strategy before each step on every rank: agree where the loop may stop. A training batch
        that accumulates gradients is not a boundary (stopping there would lose the micro-batches before it): the
        batch that steps the optimizer is. Every validation, sanity-check and test batch is."""
        if not self._registered or self._agreed[_STOP] or trainer.state.stage not in _CHECKED:
            return
        if trainer.state.stage is RunningStage.TRAINING and trainer.lightning_module.automatic_optimization:
            if trainer.fit_loop.epoch_loop._should_accumulate():
                return
        self.agree()

    def agree(self) -> None:
        """Every rank's recorded flags summed in one all-reduce (SUM exists on every backend); from then on
        ``received_sigterm`` is true on every rank if any rank received a signal."""
        flags = torch.tensor(self._recorded, dtype=torch.int32, device=self._device())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags)
        stop, requeue = (int(v > 0) for v in flags.tolist())
        if not stop:
            return
        self._agreed = [stop, requeue]
        if self.trainer.is_global_zero:
            what = "the SLURM requeue signal" if requeue else "SIGTERM"
            log.warning(
                f"Preemption: {what} received by {int(flags[_STOP])} of {self.trainer.world_size} ranks; every rank "
                f"stops after this batch (global step {self.trainer.global_step}) and saves its checkpoints."
            )

    def on_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """Called by the strategy's ``on_exception`` on every rank, after the callbacks' (``OnExceptionCheckpoint``
        has saved). On an agreed stop: save ``last`` and, on the requeue signal, the HPC checkpoint; requeue the
        job on rank 0; exit with 128 + the first signal's number, as a process killed by it would report, not 0."""
        if not (isinstance(exception, SIGTERMException) and self.received_sigterm):
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                _save_last(callback, trainer)
        if self.requeue_agreed:
            path = Collective().broadcast(_CheckpointConnector.hpc_save_path(trainer.default_root_dir))
            trainer.save_checkpoint(path)
            if trainer.is_global_zero:
                _requeue_slurm_job()
        signum = self._first_signal[0] if self._first_signal is not None else signal.SIGTERM
        exception.code = 128 + int(signum)
        _outlive_started_ranks(trainer)
        if trainer.is_global_zero and self._first_signal is not None:
            waited = time.monotonic() - self._first_signal[1]
            log.warning(f"Preemption: checkpoints written {waited:.1f} s after rank 0's signal; exiting.")

    def teardown(self) -> None:
        if self._recorded[_STOP] and not self._agreed[_STOP]:
            log.warning(
                "A preemption signal arrived after the last step boundary of this run: the run ended normally "
                "without acting on it."
            )
        self._registered = False
        super().teardown()


def install_preemption(trainer: pl.Trainer, device: Callable[[], torch.device]) -> PreemptionSignals:
    """The Trainer's connector replaced by :class:`PreemptionSignals` (once per Trainer): called from the strategy's
    ``setup``, which Lightning runs before it registers the handlers."""
    connector = trainer._signal_connector
    if not isinstance(connector, PreemptionSignals):
        connector = PreemptionSignals(trainer, device)
        trainer._signal_connector = connector
    return connector


def _outlive_started_ranks(trainer: pl.Trainer) -> None:
    """On rank 0 of a plain launch: the ranks Lightning's launcher started stop by themselves, with the same non-zero
    status, which its observer thread would take for a crash and SIGKILL rank 0 for. Take them out of its sight (it
    watches the launcher's list) and wait for them at exit, SIGKILLing any still running after a grace period."""
    launcher = trainer.strategy.launcher
    if not isinstance(launcher, _SubprocessScriptLauncher) or not launcher.procs:
        return
    children = list(launcher.procs)
    launcher.procs[:] = []
    atexit.register(_wait_for, children, _CHILD_GRACE_S)


def _wait_for(children: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning(f"Preemption: the rank with pid {child.pid} did not stop within {grace_s} s; killing it.")
            child.kill()
            child.wait()


def _requeue_signal(trainer: pl.Trainer) -> int | None:
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def _save_last(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """``last`` of a ``ModelCheckpoint(save_last=...)``, unless it saved at this very step already (its periodic save
    or ``save_on_exception``) or nothing is being trained. ModelCheckpoint has no public call for this: see
    docs/decisions.md ("Preemption saves `last`")."""
    if not callback.save_last or callback._should_skip_saving_checkpoint(trainer):
        return
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def _requeue_slurm_job() -> None:
    """``scontrol requeue <job>`` for this SLURM job (an array task as ``<array job>_<task>``), as Lightning does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.error(f"Preemption: cannot requeue: SLURM_JOB_ID is {job!r}, not a job number.")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False).returncode
    except OSError as error:
        log.error(f"Preemption: `scontrol requeue {job}` could not run: {error}")
        return
    if result == 0:
        log.warning(f"Preemption: requeued SLURM job {job}.")
    else:
        log.error(f"Preemption: `scontrol requeue {job}` failed with exit status {result}.")
