"""``PipelineRole``: everything ``FSDPStrategy`` does differently under pipeline parallelism, behind one object. The
null role (``pipeline_parallel_size=1``) does what a plain run does; ``StageRole`` runs this rank's stages."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import StateDict
from lightning_fsdp.checkpoint.common import CheckpointFormat
from lightning_fsdp.engine import MixedPrecision, ShardingEngine, ShardingOptions
from lightning_fsdp.options import PipelineOptions, check_pipeline_composition, check_pipeline_precision
from lightning_fsdp.parallel_dims import ParallelGroups
from lightning_fsdp.pipeline.checkpoint import (
    PipelineCheckpoint,
    check_pipeline_format,
    pipeline_model_state_dict,
    pipeline_optimizer_state,
)
from lightning_fsdp.pipeline.runtime import PipelineRuntime, pipeline_layout, pipeline_layout_on
from lightning_fsdp.pipeline.split import plan_stages
from lightning_fsdp.process_groups import ShardGroups

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PipelineRole", "SplitContext", "StageRole", "pipeline_role"]


class SplitContext(NamedTuple):
    """What cutting the model into stages needs to know about the run (``PipelineRole.split``)."""

    world_size: int
    rank: int
    device: torch.device  # where the stages compute
    timeout: timedelta | None  # the strategy's, for the pipeline's groups
    precision: str  # the Trainer's precision flag
    mixed_precision: MixedPrecision | None  # the engine's: the stages' shapes are worked out in its compute dtype
    parallel: ParallelGroups | None = None  # under tensor parallelism, the layout's groups (parallel_dims.py)


def pipeline_role(
    options: PipelineOptions,
    sharding: ShardingOptions,
    process_group: object,
    device_mesh: object,
    state_dict_type: str,
) -> PipelineRole:
    """The role for these options, checked against the strategy's others (on every rank, before any group)."""
    check_pipeline_composition(options, sharding, process_group, device_mesh)
    if not options.enabled:
        return PipelineRole(options)
    check_pipeline_format(state_dict_type)
    return StageRole(options)


class PipelineRole:
    """The whole model on this rank: no stages, and every method what a plain run does."""

    runtime: PipelineRuntime | None = None  # this rank's stages (``strategy.pipeline``), once set up

    def __init__(self, options: PipelineOptions) -> None:
        self.options = options

    def sampler_kwargs(self, world_size: int, rank: int) -> dict[str, int]:
        return {"num_replicas": world_size, "rank": rank}

    def split(self, module: pl.LightningModule, run: SplitContext) -> None:
        """Cut the model into stages and keep this rank's, before the model is sharded."""

    def shard_groups(self, default: Callable[[], ShardGroups]) -> ShardGroups:
        """The (shard, replicate) groups to shard the model over; ``default()`` resolves the strategy's own."""
        return default()

    def attach_engine(self, engine: ShardingEngine) -> None:
        """The engine of the sharded model: which of its units belong to which of this rank's stages."""

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The group over which gradient clipping combines the norms of the other stages' parameters."""
        return None

    @contextmanager
    def training_step(self, trainer: pl.Trainer | None, module: pl.LightningModule) -> Generator[None, None, None]:
        """Around the user's ``training_step``."""
        yield

    def backward_ran(self, loss: object) -> bool:
        """Whether the loss's backward has run already (inside ``pipelined_loss``): only Lightning's hooks remain."""
        return False

    def restore_gradients(self) -> None:
        """Put back the gradients the step set aside across Lightning's zeroing."""

    def check_format(self, kind: str) -> None:
        """Refuse a checkpoint format this layout cannot load."""

    def checkpoint_info(
        self, engine: ShardingEngine | None, optimizers: Sequence[Optimizer] | None = None
    ) -> PipelineCheckpoint | None:
        """The other stages' keys and the unsplit optimizers for a checkpoint format (a collective when pipelined)."""
        return None

    def model_state_dict(self, fmt: CheckpointFormat, engine: ShardingEngine) -> StateDict:
        return fmt.model_state_dict(engine)

    def optimizer_state(self, fmt: CheckpointFormat, engine: ShardingEngine, optimizer: Optimizer) -> StateDict:
        return fmt.optimizer_state(engine, optimizer)


class StageRole(PipelineRole):
    """This rank's stages of a pipeline, each sharded over the rank's data-parallel group."""

    def __init__(self, options: PipelineOptions) -> None:
        super().__init__(options)
        self._held: list[tuple[nn.Parameter, Tensor]] = []  # this step's gradients, set aside (training_step)

    def sampler_kwargs(self, world_size: int, rank: int) -> dict[str, int]:
        # The ranks of one pipeline take the same samples: the data-parallel index picks them.
        data = self.options.check_world(world_size)
        return {"num_replicas": data, "rank": rank % data}

    def split(self, module: pl.LightningModule, run: SplitContext) -> None:
        if self.runtime is not None:  # fit, then validate/test on the same module
            return
        options = self.options
        model = getattr(module, options.module, None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"pipeline_module={options.module!r}: {type(module).__name__}.{options.module} is "
                f"{type(model).__name__}, not an nn.Module; name the LightningModule attribute that holds the model."
            )
        options.check_world(run.world_size)
        check_pipeline_precision(options, run.precision)
        plan_stages(model, options.num_stages, options.split)  # a bad cut raises here, before the groups exist
        if run.parallel is not None:  # tensor parallelism: the stages' groups are the layout's
            layout = pipeline_layout_on(run.parallel)
        else:
            layout = pipeline_layout(options.size, run.world_size, run.rank, run.device.type, run.timeout)
        dtype = run.mixed_precision.param_dtype if run.mixed_precision is not None else None
        self.runtime = PipelineRuntime(model, options, layout, run.device, compute_dtype=dtype)
        self.runtime.accumulation = lambda: _loss_divisor(module)

    def shard_groups(self, default: Callable[[], ShardGroups]) -> ShardGroups:
        assert self.runtime is not None
        return self.runtime.layout.dp_group, None

    def attach_engine(self, engine: ShardingEngine) -> None:
        assert self.runtime is not None
        self.runtime.attach_engine(engine)

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        return self.runtime.layout.pp_group if self.runtime is not None else None

    @contextmanager
    def training_step(self, trainer: pl.Trainer | None, module: pl.LightningModule) -> Generator[None, None, None]:
        # Lightning's automatic optimization zeroes gradients *after* training_step, which under pipelining has run its
        # backward already: the previous step's gradients are dropped before the first training_step of an
        # accumulation cycle, and the new ones set aside after it, for the strategy's backward to put back.
        automatic = self.runtime is not None and module.automatic_optimization
        if automatic and (
            trainer is None or trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        ):
            for param in module.parameters():
                param.grad = None
        yield
        if automatic:
            self._held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
            for param, _ in self._held:
                param.grad = None

    def backward_ran(self, loss: object) -> bool:
        if self.runtime is None:
            return False
        if isinstance(loss, Tensor) and loss.grad_fn is None:
            return True
        raise RuntimeError(
            "With pipeline_parallel_size > 1 the loss to backpropagate must be the one pipelined_loss returned, "
            "unchanged: backward runs inside it, stage by stage. This loss has an autograd graph of its own "
            "(a term added outside the pipeline?), which would not reach the stages' parameters."
        )

    def restore_gradients(self) -> None:
        for param, grad in self._held:
            param.grad = grad
        self._held = []

    # Every format describes the unsplit model: [Note: checkpoints across pipeline layouts] in checkpoint.py.
    def check_format(self, kind: str) -> None:
        check_pipeline_format(kind)

    def checkpoint_info(
        self, engine: ShardingEngine | None, optimizers: Sequence[Optimizer] | None = None
    ) -> PipelineCheckpoint | None:
        if self.runtime is None:
            return None
        assert engine is not None
        return PipelineCheckpoint.gather(self.runtime, engine, optimizers or [])

    def model_state_dict(self, fmt: CheckpointFormat, engine: ShardingEngine) -> StateDict:
        assert self.runtime is not None  # split in setup, before any checkpoint
        return pipeline_model_state_dict(fmt.kind, self.runtime, engine)

    def optimizer_state(self, fmt: CheckpointFormat, engine: ShardingEngine, optimizer: Optimizer) -> StateDict:
        assert self.runtime is not None
        return pipeline_optimizer_state(fmt.kind, self.runtime, engine, optimizer)


def _loss_divisor(module: pl.LightningModule) -> int:
    """What Lightning divides a plain step's loss by: ``accumulate_grad_batches`` under automatic optimization."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not module.automatic_optimization:
        return 1
    return trainer.accumulate_grad_batches
