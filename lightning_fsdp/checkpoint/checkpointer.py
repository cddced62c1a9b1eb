"""``Checkpointer``: what ``FSDPStrategy`` does when Lightning saves, loads or removes a checkpoint.

The strategy owns one and forwards Lightning's checkpoint calls to it. Each call is routed to one format object
(routing.py: the format ``state_dict_type`` names for saving, the one on disk for loading); the checkpointer adds what
lives between calls: the background writer of asynchronous saves (async_save.py), which the next save, a load, a
removal, the end of ``fit`` and teardown wait for, and the SWA / EMA averages, made whole before a save and sliced to
each rank's rows after a load (weight_averaging.py)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import Checkpoint, StateDict
from lightning_fsdp.checkpoint.async_save import (
    AsyncCheckpointer,
    after_saves,
    background_writer,
    fitting_now,
    runs_async,
    writing_io,
)
from lightning_fsdp.checkpoint.common import CheckpointFormat, CheckpointRun
from lightning_fsdp.checkpoint.routing import (
    format_for_saving,
    load_model_state,
    load_optimizer_states,
    prepare_save_as,
    read_checkpoint,
    remove_checkpoint_at,
    save_checkpoint_as,
    unwrapped_optimizer,
)
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.weight_averaging import gather_averages_for_save, slice_loaded_averages

if TYPE_CHECKING:
    from lightning_fsdp.strategy import FSDPStrategy

__all__ = ["Checkpointer"]


class Checkpointer:
    """The checkpoint calls of one ``FSDPStrategy``. It reads the strategy's settings at each call (``state_dict_type``
    and ``async_checkpoint`` may be changed between saves) and its run state (engine, optimizers, ``checkpoint_io``)."""

    def __init__(self, strategy: FSDPStrategy) -> None:
        self._strategy = strategy
        self.async_saves: AsyncCheckpointer | None = None  # made at the first asynchronous save

    @property
    def _format(self) -> CheckpointFormat:
        return format_for_saving(self._strategy.state_dict_type)

    def _engine(self) -> ShardingEngine:
        assert self._strategy.engine is not None, "the model is sharded in setup"
        return self._strategy.engine

    def model_state_dict(self) -> StateDict:
        return self._strategy._pipeline_role.model_state_dict(self._format, self._engine())

    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool) -> None:
        load_model_state(self._engine(), checkpoint, strict, self._strategy._pipeline_role)

    def optimizer_state(self, optimizer: Optimizer) -> StateDict:
        role = self._strategy._pipeline_role
        return role.optimizer_state(self._format, self._engine(), unwrapped_optimizer(optimizer))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [unwrapped_optimizer(o) for o in self._strategy.optimizers]
        role = self._strategy._pipeline_role
        load_optimizer_states(self._engine(), checkpoint["optimizer_states"], optimizers, role)

    def save(self, checkpoint: Checkpoint, filepath: _PATH, storage_options: object) -> None:
        strategy = self._strategy
        gather_averages_for_save(strategy, checkpoint)  # SWA / EMA averages: full tensors, not rank 0's rows only
        fmt, role, io = self._format, strategy._pipeline_role, strategy.checkpoint_io
        run = CheckpointRun(strategy.engine, strategy.optimizers, writing_io(io))
        wanted = runs_async(strategy.async_checkpoint, io) and fitting_now(strategy._trainer())
        pins = lambda device: strategy.device_runtime.pins_host_memory(device)  # noqa: E731 - asked at the first copy
        saves = self.async_saves = background_writer(self.async_saves, wanted, pins)
        if saves is None or not wanted:
            save_checkpoint_as(fmt, checkpoint, filepath, storage_options, run, role)
            return
        prepare = partial(prepare_save_as, fmt, path=filepath, storage_options=storage_options, run=run, role=role)
        saves.submit(checkpoint, filepath, strategy.root_device, lambda staged: prepare(checkpoint=staged))

    def wait(self) -> None:
        """Until the save in flight is written; its failure is raised here."""
        if self.async_saves is not None:
            self.async_saves.wait()

    def load(self, checkpoint_path: _PATH, weights_only: bool | None) -> Checkpoint:
        self.wait()  # the checkpoint may be the one being written
        strategy = self._strategy
        trainer = strategy._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [unwrapped_optimizer(o) for o in strategy.optimizers] if fitting else None
        run = CheckpointRun(strategy.engine, optimizers, strategy.checkpoint_io)
        checkpoint = read_checkpoint(checkpoint_path, run, strategy._pipeline_role, weights_only)
        return slice_loaded_averages(strategy, checkpoint)  # each rank's rows of the SWA / EMA averages

    def remove(self, filepath: _PATH) -> None:
        """On rank 0. With a save in flight: after it, and only if it succeeded (the checkpoint it replaces stays
        till then)."""
        io = writing_io(self._strategy.checkpoint_io)
        after_saves(self.async_saves, partial(remove_checkpoint_at, filepath, io))

    def close(self) -> None:
        """At teardown, after an error too: a failure not raised yet is only warned about."""
        if self.async_saves is not None:
            self.async_saves.close(raise_errors=False)
