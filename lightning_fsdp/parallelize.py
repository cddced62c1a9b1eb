"""``parallelize``: the parallelism techniques applied to the LightningModule in the strategy's ``setup``, one
``apply_*`` step each, always in this order:

1. ``apply_tensor_parallel``: the built-in plan on the tensor-parallel mesh (``tensor_parallel_plan="auto"``; a
   user's own ``parallelize_module`` call in ``configure_model`` has run already);
2. ``apply_pipeline_split``: the model cut into stages, this rank's kept (``pipeline_parallel_size > 1``);
3. ``apply_activation_checkpointing``: the modules the policy names recompute their forward in backward;
4. ``apply_sharding``: the engine's units over the data-parallel group(s).

The order is forced. Sharding takes the parameters the module holds, so tensor parallelism's DTensors must exist and
the other stages' layers must be gone before step 4; the plan is written against the unsplit model's module names, so
it comes before the cut; checkpointing wraps modules, and the engine's units are formed around the wrapped ones.
A module sharded already (``fit``, then ``validate`` on the same module) keeps its engine: nothing is applied twice."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch import nn

from lightning_fsdp.activation_checkpointing import CheckpointPolicy, apply_activation_checkpointing
from lightning_fsdp.engine import ShardingEngine, ShardingOptions, fully_shard, get_engine
from lightning_fsdp.engine.sharding import has_meta_tensors
from lightning_fsdp.options import engine_kwargs
from lightning_fsdp.parallel_dims import ParallelLayout
from lightning_fsdp.pipeline.role import PipelineRole, SplitContext
from lightning_fsdp.process_groups import GroupChoice, ShardGroups

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Techniques", "parallelize"]


class Techniques(NamedTuple):
    """The strategy's parallelism choices, validated when it was built."""

    layout: ParallelLayout  # pipeline x data x tensor ranks (parallel_dims.py)
    pipeline: PipelineRole  # this rank's part of a pipeline (pipeline/role.py), a null role without one
    activation_checkpointing: CheckpointPolicy | None
    sharding: ShardingOptions
    groups: GroupChoice  # the user's process_group / device_mesh, or the default (hybrid: per node)


def parallelize(
    module: pl.LightningModule, techniques: Techniques, run: SplitContext, processes_per_node: int, offload: bool
) -> ShardingEngine:
    """Apply ``techniques`` to ``module`` in place, in the order above; returns the engine of the sharded module."""
    engine = get_engine(module)
    if engine is None:
        apply_tensor_parallel(module, techniques.layout)
    apply_pipeline_split(module, techniques.pipeline, run)
    if engine is None:
        if not has_meta_tensors(module):
            module.to(run.device)
        if techniques.activation_checkpointing is not None:
            apply_activation_checkpointing(module, techniques.activation_checkpointing)
        engine = apply_sharding(module, techniques, run, processes_per_node, offload)
    techniques.pipeline.attach_engine(engine)
    return engine


def apply_tensor_parallel(module: nn.Module, layout: ParallelLayout) -> None:
    layout.apply_plan(module)  # only with tensor_parallel_plan="auto"


def apply_pipeline_split(module: pl.LightningModule, role: PipelineRole, run: SplitContext) -> None:
    role.split(module, run)  # a no-op without pipelining, and once the stages exist


def apply_sharding(
    module: nn.Module, techniques: Techniques, run: SplitContext, processes_per_node: int, offload: bool
) -> ShardingEngine:
    def default_groups() -> ShardGroups:
        return techniques.layout.shard_groups() or techniques.groups.resolve(
            run.world_size, processes_per_node, run.rank, run.timeout
        )

    shard_group, replicate_group = techniques.pipeline.shard_groups(default_groups)
    kwargs = engine_kwargs(techniques.sharding, module, run.mixed_precision, offload)
    return fully_shard(module, process_group=shard_group, replicate_group=replicate_group, device=run.device, **kwargs)
