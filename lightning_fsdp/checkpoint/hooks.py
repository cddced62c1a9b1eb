"""The strategy's checkpoint methods (``FSDPStrategy`` inherits them): saved in the format ``state_dict_type``
names, loaded in the one on disk, each call routed by checkpoint/routing.py."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.checkpoint import routing
from lightning_fsdp.checkpoint.common import CheckpointFormat, CheckpointRun
from lightning_fsdp.weight_averaging import gather_averages_for_save, slice_loaded_averages


class CheckpointHooks:
    """Mixed into ``FSDPStrategy`` ahead of Lightning's ``ParallelStrategy``, whose methods these replace. Reads the
    strategy's ``engine``, ``state_dict_type``, ``optimizers`` and pipeline role."""

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Set lazily, not in __init__, so a user's plugins=[SomeCheckpointIO()] takes precedence without a conflict.
        self._checkpoint_io = routing.atomic_by_default(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints hold full tensors; they can only be split into shards once the model is sharded.
        return True

    @property
    def _checkpoint_format(self) -> CheckpointFormat:
        return routing.format_for_saving(self.state_dict_type)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        return self._pipeline_role.model_state_dict(self._checkpoint_format, self.engine)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        routing.load_model_state(self.engine, checkpoint, strict, self._pipeline_role)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        assert self.engine is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._pipeline_role.optimizer_state(self._checkpoint_format, self.engine, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        assert self.engine is not None
        routing.load_optimizer_states(self.engine, self.optimizers, checkpoint, self._pipeline_role)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        gather_averages_for_save(self, checkpoint)  # SWA / EMA averages: full tensors, not rank 0's rows only
        run = CheckpointRun(self.engine, self.optimizers, self.checkpoint_io)
        routing.save_checkpoint(
            self._checkpoint_format, checkpoint, filepath, run, self._pipeline_role, storage_options
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else None
        role = self._pipeline_role
        checkpoint = routing.load_checkpoint(path, self.engine, optimizers, self.checkpoint_io, role, weights_only)
        return slice_loaded_averages(self, checkpoint)  # each rank's rows of the SWA / EMA averages

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            routing.remove_checkpoint(filepath, self.checkpoint_io)
