"""Running a LightningModule's model as pipeline stages: the (pipeline, data) layout, the schedules, the loss. How
one step runs, and why (static shapes from the meta copy, each microbatch's loss divided before its backward):
docs/pipeline.md, "How a step runs"."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.utils._pytree import tree_map

from lightning_fsdp.options import SCHEDULES, PipelineOptions
from lightning_fsdp.parallel_dims import ParallelGroups
from lightning_fsdp.pipeline.contract import BrokenChainError, chain_checked, tensors_in
from lightning_fsdp.pipeline.split import keep_only, meta_copy, plan_stages, stage_view

if TYPE_CHECKING:
    from lightning_fsdp.engine import ShardingEngine
    from lightning_fsdp.engine.unit import FlatUnit

# The user's loss: (the model's output, the target) -> the mean loss over the samples it is given.
LossFn = Callable[[Any, Any], torch.Tensor]

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, PipelineRuntime] = weakref.WeakKeyDictionary()


class PipelineLayout(NamedTuple):
    """Where this rank sits in the (pipeline, data) mesh: global rank = pp_rank * data_size + dp_rank (times T plus
    the TP rank under tensor parallelism)."""

    size: int
    data_size: int
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mesh: DeviceMesh


def pipeline_layout(
    size: int, world_size: int, rank: int, device_type: str, timeout: timedelta | None = None
) -> PipelineLayout:
    """Create the groups of the (pipeline, data) layout (every rank creates every group, in one order) and the
    DeviceMesh over them. A stage's data-parallel ranks are consecutive (one node's when D divides the processes per
    node), so the engine's all-gathers and reduce-scatters stay within a node and only P2P activations cross."""
    data = world_size // size
    pp_rank, dp_rank = divmod(rank, data)
    dp_groups = [dist.new_group([p * data + d for d in range(data)], timeout=timeout) for p in range(size)]
    pp_groups = [dist.new_group([p * data + d for p in range(size)], timeout=timeout) for d in range(data)]
    dp_group, pp_group = dp_groups[pp_rank], pp_groups[dp_rank]
    mesh = DeviceMesh.from_group(
        [pp_group, dp_group], device_type, mesh=torch.arange(world_size).view(size, data), mesh_dim_names=("pp", "dp")
    )
    return PipelineLayout(size, data, pp_rank, dp_rank, pp_group, dp_group, mesh)


def pipeline_layout_on(groups: ParallelGroups) -> PipelineLayout:
    """The (pipeline, data) layout within the groups ``ParallelDims`` built under tensor parallelism (the pipeline
    and data-parallel ranks of one TP rank; [Note: the layout of the ranks] in parallel_dims.py)."""
    assert groups.pp_group is not None, "built with pipeline_parallel_size > 1"
    pp, dp = groups.pp_group, groups.dp_group
    return PipelineLayout(pp.size(), dp.size(), pp.rank(), dp.rank(), pp, dp, groups.mesh)


class _Schedule(NamedTuple):
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    first: bool  # this rank holds stage 0 (takes the inputs)
    last: bool  # this rank holds the last stage (computes the losses)


class PipelineRuntime:
    """This rank's stages of one model and the schedules that run them."""

    def __init__(
        self,
        model: nn.Module,
        options: PipelineOptions,
        layout: PipelineLayout,
        device: torch.device,
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.options = options
        self.layout = layout
        self.device = device
        self.stages = plan_stages(model, options.num_stages, options.split)
        self._pieces = [piece for stage in self.stages for piece in stage]
        self.local_stages = [s for s in range(options.num_stages) if s % layout.size == layout.pp_rank]
        self._meta_views = [stage_view(_cast(meta_copy(model), compute_dtype), s) for s in self.stages]
        keep_only(model, [piece for s in self.local_stages for piece in self.stages[s]])
        self._views = [stage_view(model, self.stages[s]) for s in self.local_stages]
        # By the inputs' (shape, dtype) and whether training.
        self._schedules: dict[tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], bool], _Schedule] = {}
        self._loss_fn: LossFn | None = None
        self._loss_scale = 1.0
        self.engine: ShardingEngine | None = None  # attach_engine, once the model is sharded
        self._model = model
        self._stage_units: dict[int, list[FlatUnit]] = {}  # this rank's stages' units, by stage
        self._shared_units: list[
            FlatUnit
        ] = []  # units of no single stage (the root unit): reduced after the last backward
        self._stages_done = 0  # stages whose last microbatch's backward ran in this step
        # The divisor Lightning applies to a plain step's loss (accumulate_grad_batches under automatic optimization).
        self.accumulation: Callable[[], int] = lambda: 1
        # The global rank of the last stage's holder in this rank's pipeline group (the loss's source).
        self._last_rank = dist.get_global_rank(layout.pp_group, (options.num_stages - 1) % layout.size)
        _RUNTIMES[model] = self
        # On this rank the model is only its stages: called directly it would compute a part of the model, silently.
        name = type(model).__name__
        model.register_forward_pre_hook(lambda _m, _a: _refuse_direct_call(name))

    def attach_engine(self, engine: ShardingEngine) -> None:
        """The sharding engine of this rank's stages: which of its units belong to which stage (see
        [Note: gradient reduction per stage])."""
        self.engine = engine
        stage_of: dict[int, int] = {}
        for stage in self.local_stages:
            for piece in self.stages[stage]:
                for module in self._model.get_submodule(piece).modules():
                    stage_of[id(module)] = stage
        self._stage_units = {stage: [] for stage in self.local_stages}
        self._shared_units = []
        for unit in engine.units:
            owner = stage_of.get(id(unit.module))
            if owner is None:
                self._shared_units.append(unit)
            else:
                self._stage_units[owner].append(unit)
        # Backward prefetching follows the forward order recorded on the first step; with several stages on a rank
        # that order runs from one stage into the next, which the schedule does not follow.
        engine.set_prefetch_groups(list(self._stage_units.values()))
        # A stage's forwards of later micro-batches run before the backward of earlier ones: its last unit's backward
        # does not come next, so keeping that unit gathered would only hold its memory.
        engine.keep_last_unit_for_backward = False

    def _backward_units(self, stage: int, last_backward: bool) -> tuple[list[FlatUnit], list[FlatUnit]]:
        """``(scope, held)`` of a backward of ``stage``: the units it concerns, and those of them whose gradients it
        leaves unreduced: all but in the stage's last backward ([Note: gradient reduction per stage])."""
        own = self._stage_units.get(stage, [])
        if not last_backward:
            return own, own
        self._stages_done += 1
        return own + (self._shared_units if self._stages_done == len(self.local_stages) else []), []

    def _shapes(self, inputs: tuple[torch.Tensor, ...]) -> list[tuple[tuple[object, ...], object]]:
        """Each stage's (input, output) on the meta device for one microbatch of ``inputs``."""
        m = self.options.num_microbatches
        x: tuple[object, ...] = tuple(
            torch.empty((t.shape[0] // m, *t.shape[1:]), dtype=t.dtype, device="meta") for t in inputs
        )
        shapes = []
        with torch.no_grad():
            for index, view in enumerate(self._meta_views):
                try:
                    with chain_checked(view, self._pieces, index, x):
                        out = view(*x)
                except BrokenChainError:
                    raise
                except Exception as exc:
                    raise RuntimeError(
                        "Working out the pipeline stages' shapes on the meta device failed. Each stage's forward must "
                        "run on meta tensors (no .item(), no data-dependent shapes) and take the previous stage's "
                        f"output: {type(exc).__name__}: {exc}"
                    ) from exc
                shapes.append((x, out))
                x = out if isinstance(out, tuple) else (out,)
        return shapes

    def _schedule(self, inputs: tuple[torch.Tensor, ...], train: bool) -> _Schedule:
        key = (tuple((tuple(t.shape), t.dtype) for t in inputs), train)
        found = self._schedules.get(key)
        if found is not None:
            return found
        shapes = self._shapes(inputs)
        n = self.options.num_stages
        stages = []
        for index, view in zip(self.local_stages, self._views):
            example_in, example_out = shapes[index]
            stage = _ShardedStage(
                view,
                index,
                n,
                self.device,
                input_args=tree_map(lambda t, grad=index > 0: self._example(t, grad), example_in),
                output_args=tree_map(lambda t, grad=index < n - 1: self._example(t, grad), example_out),
                group=self.layout.pp_group,
            )
            stage.runtime = self
            stages.append(stage)
        name, several = SCHEDULES[self.options.schedule]
        schedule = getattr(torch_schedules, name)(
            stages if several else stages[0],
            n_microbatches=self.options.num_microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,
        )
        found = _Schedule(schedule, 0 in self.local_stages, n - 1 in self.local_stages)
        self._schedules[key] = found
        return found

    def _example(self, meta: object, needs_grad: bool) -> object:
        if not isinstance(meta, torch.Tensor):
            return meta
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return tensor.requires_grad_(needs_grad and tensor.is_floating_point())

    def _scaled_loss(self, output: object, target: object) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) * self._loss_scale

    def run(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        target: object,
        loss_fn: LossFn,
        *,
        train: bool,
        accumulation: int = 1,
    ) -> torch.Tensor:
        """One global batch through the pipeline (backward too when ``train``); returns the batch's loss."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        m = self.options.num_microbatches
        for tensor in [*args, *tensors_in(target)]:
            if tensor.shape[0] % m:
                raise ValueError(
                    f"This rank's batch has {tensor.shape[0]} samples, which pipeline_microbatches={m} does not "
                    f"divide; use a per-rank batch size that is a multiple of {m} (and drop_last=True)."
                )
        found = self._schedule(args, train)
        self._stages_done = 0
        self._loss_fn = loss_fn
        self._loss_scale = 1.0 / (m * accumulation)
        losses: list[torch.Tensor] = []
        first = args if found.first else ()
        if train:
            found.schedule.step(*first, target=target, losses=losses)
        else:
            found.schedule.eval(*first, target=target, losses=losses)
        return self._global_loss(losses if found.last else None)

    def _global_loss(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        device = self.device if dist.get_backend(self.layout.pp_group) != "gloo" else torch.device("cpu")
        if losses is not None:
            value = torch.stack([loss.detach().float() for loss in losses]).mean() / self._loss_scale
            value = value.to(device)
        else:
            value = torch.zeros((), device=device)
        dist.broadcast(value, src=self._last_rank, group=self.layout.pp_group)
        dist.all_reduce(value, group=self.layout.dp_group)
        return (value / self.layout.data_size).to(self.device)


class _ShardedStage(PipelineStage):
    """torch's stage, with the sharding engine's gradient reduction deferred to each stage's last microbatch.

    [Note: gradient reduction per stage]
    Every microbatch's backward but a stage's last runs with gradient sync off (as torch's stage does for FSDP2
    modules). The last reduces the sum once, for the stage's own units only: another stage on this rank may still
    have microbatches to come. Each backward is scoped to its stage's units (``ShardingEngine.backward_scope``), so
    its end leaves the other stage's alone. Units of no single stage (the root) enter the scope only in the step's
    last backward on this rank, accumulating in place, gathered once per step, until then.
    """

    runtime: PipelineRuntime | None = None

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        runtime = self.runtime
        if runtime is None or runtime.engine is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        engine = runtime.engine
        scope, held = runtime._backward_units(self.stage_index, last_backward)
        with engine.backward_scope(scope), engine.no_sync(held):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _cast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    if dtype is not None:
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    return model


def _refuse_direct_call(name: str) -> None:
    raise RuntimeError(
        f"{name} is cut into pipeline stages (pipeline_parallel_size > 1): this rank holds only some of its pieces, "
        f"so calling it directly would compute a part of the model. Call lightning_fsdp.pipelined_loss(model, "
        "inputs, target, loss_fn) in training_step / validation_step / test_step instead; predict_step is not "
        "supported with pipelining."
    )


def runtime_of(model: nn.Module) -> PipelineRuntime | None:
    return _RUNTIMES.get(model)


def pipelined_loss(
    model: nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    target: object,
    loss_fn: LossFn,
) -> torch.Tensor:
    """The loss of ``model`` on a batch, as ``training_step`` / ``validation_step`` return it.

    Without pipeline parallelism: ``loss_fn(model(*inputs), target)``, backpropagated as usual. With it, the whole
    batch runs through the pipeline, backward included when training, and the returned loss is the global batch's,
    without an autograd graph. ``loss_fn`` must return the mean over the samples it is given.
    """
    runtime = runtime_of(model)
    if runtime is None:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return loss_fn(model(*args), target)
    train = torch.is_grad_enabled() and model.training
    accumulation = runtime.accumulation() if train else 1
    return runtime.run(inputs, target, loss_fn, train=train, accumulation=accumulation)
