"""``FSDPStrategy``: the Lightning glue around the sharding engine. Registered as ``"fsdp_custom"``."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import cached_property
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.activation_checkpointing import parse_checkpointing_policy
from lightning_fsdp.checkpoint import Checkpoint, StateDict
from lightning_fsdp.checkpoint.checkpointer import Checkpointer
from lightning_fsdp.checkpoint.routing import parse_state_dict_type, with_atomic_default
from lightning_fsdp.collective import Collective, all_reduce_tensor
from lightning_fsdp.engine import MixedPrecision, ShardingEngine, ShardingOptions, ShardingStrategy, WrapPolicy
from lightning_fsdp.engine.devices import DeviceRuntime, device_runtime
from lightning_fsdp.engine.options import check_flag
from lightning_fsdp.even_batches import EvenBatches
from lightning_fsdp.launcher import check_start_method, choose_launcher, stop_launched_processes
from lightning_fsdp.options import (
    PipelineOptions,
    check_device_id,
    check_device_id_matches,
    check_lightning_arguments,
    check_optimizers,
    check_tensor_parallel,
    check_trainable,
    check_use_orig_params,
)
from lightning_fsdp.parallel_dims import ParallelLayout
from lightning_fsdp.parallelize import Techniques, parallelize
from lightning_fsdp.pipeline.role import SplitContext, pipeline_role
from lightning_fsdp.pipeline.runtime import PipelineRuntime
from lightning_fsdp.precision import FSDPPrecision, to_fsdp_precision
from lightning_fsdp.preemption import PreemptionSignals, install_preemption
from lightning_fsdp.process_groups import GroupChoice
from lightning_fsdp.registration import register_strategies
from lightning_fsdp.rendezvous import check_launch_size, check_timeout, init_default_group
from lightning_fsdp.shutdown import settle_at_exit
from lightning_fsdp.stage_end import StageEnd, check_reusable
from lightning_fsdp.stale_gradients import release_stale_gradients
from lightning_fsdp.weight_averaging import shard_averaged_models

log = logging.getLogger(__name__)


class FSDPStrategy(ParallelStrategy):
    """Fully Sharded Data Parallel training with this project's own sharding engine.

    Works on CPU (gloo), CUDA (NCCL) and HPU (HCCL). Every option is a keyword argument, validated on every rank when
    the strategy is built, so a bad value raises the same error everywhere before any collective. Validated, they are
    ``strategy.options`` (a :class:`~lightning_fsdp.engine.options.ShardingOptions`); the sharded model's engine is
    ``strategy.engine``. The arguments below say what docs/options.md says (tests/docs/test_docs_reference.py checks
    it), which adds examples, the registered names and the measurements.

    Args:
        accelerator: filled in by the Trainer (its `accelerator`); by hand, a Lightning `Accelerator`.
        parallel_devices: filled in by the Trainer (one device per local process); by hand, a list of `torch.device`.
        cluster_environment: filled in by the Trainer (torchrun, SLURM, MPI or Lightning's own launcher); by hand, a
            Lightning `ClusterEnvironment`.
        checkpoint_io: filled in by the Trainer; by hand, a Lightning `CheckpointIO` (used by the full format).
        precision_plugin: filled in by the Trainer from `Trainer(precision=...)`; by hand, a Lightning `Precision`.
        process_group_backend: `gloo` on CPU, `nccl` on CUDA, `hccl` on HPU; a non-empty string. `"mpi"` only where
            torch was built with MPI (`torch.distributed.is_mpi_available()`), else refused at construction; under an
            `mpirun` launch the default backends work (see multi-node). Default: from the accelerator.
        timeout: how long a collective waits for the other ranks before it fails: the fault-detection bound (a hung or
            dead rank ends the job after it). A positive `datetime.timedelta`, or `None` (torch's default: 30 minutes,
            10 for NCCL). It governs every collective after start-up, on the default group and on the groups the
            strategy creates (hybrid, pipeline). It does not bound start-up. Default: Lightning's default (30 minutes).
        start_method: `"popen"` re-runs your script per rank; `"spawn"`, `"fork"`, `"forkserver"` start processes from
            Python. Default: `"popen"`.
        sharding_strategy: `"FULL_SHARD"`: gather for forward, free, gather again for backward. `"SHARD_GRAD_OP"`: keep
            a unit's full parameters from its forward to its backward. `"NO_SHARD"`: every rank holds the whole model;
            gradients are all-reduced (like DDP). `"HYBRID_SHARD"` / `"HYBRID_SHARD_ZERO2"`: FULL_SHARD / SHARD_GRAD_OP
            within a node's processes, replicated across nodes (see multi-node). Default: `"FULL_SHARD"`.
        auto_wrap_policy: a set of module classes (or their import paths), a callable `(module, recurse,
            nonwrapped_numel) -> bool` as in torch FSDP (torch's `size_based_auto_wrap_policy` partials work), or an
            int: a module with at least that many parameters not already in a unit becomes one. Default: `None` (the
            root is the only unit).
        activation_checkpointing_policy: a set of module classes (or import paths) or a callable `(module) -> bool`; see
            activation checkpointing. Default: `None`.
        state_dict_type: checkpoint format: `"full"`, `"sharded"` or `"local"`; see checkpoints. Default: `"full"`.
        mixed_precision: a `lightning_fsdp.MixedPrecision`; or let `Trainer(precision=...)` imply one (below). Giving
            both a non-default flag and this option is an error. Default: `None`.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding, so ranks that initialised
            differently train identically. Default: `False`.
        param_init_fn: called as `param_init_fn(module)` for each module with meta-device tensors, instead of
            `module.reset_parameters()`; materialisation goes unit by unit. Default: `None`.
        backward_prefetch: `"BACKWARD_PRE"`: when a unit's backward starts, issue the all-gather of the next unit of
            backward asynchronously; `"BACKWARD_POST"`: issue it once the current unit's gradients are reduced; `None`:
            gather each unit only when its backward starts. Default: `"BACKWARD_PRE"`.
        forward_prefetch: issue the next unit's all-gather (in the order recorded on the first training step) before the
            current unit computes. Default: `False`.
        limit_all_gathers: at most two units' full parameters (besides the root's) gathered or in flight: a prefetch
            waits when two are alive, and a prefetch the order no longer needs is dropped before a needed gather.
            Default: `True`.
        cpu_offload: `True` or torch's `CPUOffload(offload_params=True)`: shards, gradients and so optimizer state live
            in host memory; a unit's shard is copied to the device only to be gathered, reduced gradients are copied
            back. On a CPU run it is accepted and changes nothing. On an accelerator the host shards and gradients are
            pinned and the copies run asynchronously on the collectives' streams; the host waits for them at the end of
            backward (how it works). The accelerator path has not been run on a GPU yet. Default: `False`.
        ignored_modules: modules (objects, or their names in the LightningModule) whose parameters stay whole on every
            rank and are not sharded. Default: `None`.
        ignored_states: parameters or modules (objects or names), same meaning for single parameters. Default: `None`.
        process_group: the shard group: every engine collective runs on it only (sharding and gradient averaging are
            restricted to it), or a callable returning it, called once the default group exists. Default: `None` (all
            ranks).
        device_mesh: for the hybrid strategies: a 2-D `DeviceMesh` with dims (replicate, shard) instead of the default
            node layout; or pass `process_group=(shard_group, replicate_group)`. Default: `None`.
        device_id: an int or a `torch.device` (HPU needs a device object). Lightning's accelerator and `devices` already
            choose each rank's device; `device_id` must name that device, else a `ValueError` names both. Default:
            `None`.
        use_orig_params: original parameters are always kept (`named_parameters()` gives the unwrapped model's names);
            `False` raises `ValueError`, since a flattened-parameter view is not offered. Default: `True`.
        tensor_parallel_size: T > 1: tensor parallelism composed with sharding. The ranks form a (pipeline x) data x
            tensor mesh, TP innermost (T consecutive ranks, inside one node: T must divide the processes per node and,
            with `pipeline_parallel_size` P, T x P must divide the world); you parallelize the model with torch's
            `parallelize_module` on `self.device_mesh["tensor_parallel"]` in `configure_model`, the engine shards each
            parameter's TP piece over the D = world / (T x P) data-parallel ranks. `process_group` / `device_mesh` must
            then be unset. See tensor parallelism. Default: `1`.
        tensor_parallel_plan: `None`: you parallelize the model in `configure_model`; `"auto"`: the built-in plan of a
            transformers Llama-family model or a litgpt GPT is applied on the tensor-parallel mesh before sharding
            (needs `tensor_parallel_size > 1`). See tensor parallelism. Default: `None`.
        pipeline_parallel_size: P, the number of pipeline ranks; must divide `devices x num_nodes`. Default: `1`.
        pipeline_schedule: `"GPipe"`, `"1F1B"` or `"Interleaved1F1B"` (torch.distributed.pipelining). Default: `"1F1B"`.
        pipeline_microbatches: M, microbatches per rank's batch (1F1B needs M >= stages). Default: stages.
        pipeline_stages_per_rank: stages on each pipeline rank (stage s on pipeline rank s % P). Default: 1, or 2
            interleaved.
        pipeline_split: the pieces where stages 1, 2, ... start, e.g. `["blocks.2"]`. Default: balanced.
        pipeline_module: the LightningModule attribute holding the model to cut. Default: `"model"`.
        sync_gradients_while_accumulating: `False`: under `accumulate_grad_batches`, batches that accumulate add
            full-size gradients locally and the batch before the optimizer step reduces the sum once (memory for
            communication; measured in pipeline parallelism). Default: `True`.
        reshard_after_forward: `None`: as the sharding strategy says (`FULL_SHARD` frees after forward, `SHARD_GRAD_OP`
            keeps); `True` / `False` override it; an int N (dividing the shard group, 1 < N < its size) keeps 1/N of
            each unit after forward, so backward gathers within N consecutive ranks only (ZeRO++ hpZ). Default: `None`.
        startup_timeout: how long after the first rank the others may reach the rendezvous: process start, imports, the
            TCP store, the process group's connections and a first barrier. A positive `datetime.timedelta`, or `None`
            (torch's default). Independent of `timeout`, so `timeout=timedelta(seconds=30)` does not make a slow start
            fail. See Timeouts. Default: Lightning's default (30 minutes).
        weights_after_stage: what the module holds when `fit`, `validate`, `test` or `predict` ends normally: `"full"`
            (every rank: the full weights on the host, the engine removed), `"rank0"` (rank 0: the full weights on the
            host; the other ranks: meta-device parameters, no engine), `"sharded"` (the module keeps its shards and
            engine; later stages on it work), `"auto"` (`"full"` if it fits in the node's free host memory, else
            `"sharded"` with a warning). See After a stage. Default: `"auto"`.
        async_checkpoint: `True`: a save during `fit` returns once this rank's state is copied to host memory (pinned
            on CUDA); a background thread writes it while training goes on; the next save, a load, the end of `fit`
            and teardown wait for it, and a failed write is raised there on every rank. `plugins=[AsyncCheckpointIO()]`
            means the same. Every format; see asynchronous saves. Default: `False`.
    """

    strategy_name = "fsdp_custom"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        sharding_strategy: str = "FULL_SHARD",
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        state_dict_type: str = "full",
        mixed_precision: MixedPrecision | None = None,
        sync_module_states: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        backward_prefetch: str | None = "BACKWARD_PRE",
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        cpu_offload: Any = False,
        ignored_modules: Any | None = None,
        ignored_states: Any | None = None,
        process_group: Any | None = None,
        device_mesh: Any | None = None,
        device_id: int | torch.device | None = None,
        use_orig_params: bool = True,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: str | None = None,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
        pipeline_split: list[str] | None = None,
        pipeline_module: str = "model",
        sync_gradients_while_accumulating: bool = True,
        reshard_after_forward: bool | int | None = None,
        startup_timeout: timedelta | None = default_pg_timeout,
        weights_after_stage: str = "auto",
        async_checkpoint: bool = False,
    ) -> None:
        # Before any process group: see [Note: validate before the first collective] in engine/options.py.
        self.options = ShardingOptions.from_arguments(locals(), names=True)
        self.activation_checkpointing_policy = parse_checkpointing_policy(activation_checkpointing_policy)
        self.state_dict_type = parse_state_dict_type(state_dict_type)  # full, sharded or local
        check_use_orig_params(use_orig_params)
        check_device_id(device_id)
        self.device_id = device_id
        self._group_choice = GroupChoice(self.options.sharding_strategy, process_group, device_mesh)
        # The ranks' layout over pipeline x data x tensor parallelism (lightning_fsdp/parallel_dims.py).
        tp_size = check_tensor_parallel(tensor_parallel_size, tensor_parallel_plan, process_group, device_mesh)
        self._layout = ParallelLayout(tp_size, tensor_parallel_plan)
        self.pipeline_options = PipelineOptions.parse(
            pipeline_parallel_size,
            pipeline_schedule,
            pipeline_microbatches,
            pipeline_stages_per_rank,
            pipeline_split,
            pipeline_module,
        )
        # Everything a pipelined run does differently (a null role without pipelining): lightning_fsdp/pipeline/role.py
        self._pipeline_role = pipeline_role(
            self.pipeline_options, self.options, process_group, device_mesh, self.state_dict_type.value
        )
        check_flag(sync_gradients_while_accumulating, "sync_gradients_while_accumulating")
        self.sync_gradients_while_accumulating = sync_gradients_while_accumulating
        # What the module holds when a stage ends: lightning_fsdp/stage_end.py
        self._stage_end = StageEnd(weights_after_stage, self.pipeline_options.size)
        check_start_method(start_method)
        check_flag(async_checkpoint, "async_checkpoint")
        self.async_checkpoint = async_checkpoint  # or plugins=[AsyncCheckpointIO()]: checkpoint/async_save.py
        # Lightning's checkpoint calls, each routed to its format, saves in the background where asked: checkpointer.py
        self._checkpoints = Checkpointer(self)
        check_lightning_arguments(
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
            process_group_backend,
            timeout,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1  # set by Lightning's accelerator connector
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        check_timeout(startup_timeout, "startup_timeout")
        self._startup_timeout = startup_timeout
        self._stop_at_exit = False  # stop_launched_processes registered to run when this process exits
        self._start_method = start_method
        self.engine: ShardingEngine | None = None
        self._preemption: PreemptionSignals | None = None  # the Trainer's signal connector, from setup on

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.options.sharding_strategy

    @property
    def auto_wrap_policy(self) -> WrapPolicy:
        return self.options.auto_wrap_policy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """The explicit ``mixed_precision`` option (``None``: ``Trainer(precision=...)`` decides)."""
        return self.options.mixed_precision

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def ignored_modules(self) -> list:
        """As given: modules, or names of the LightningModule's submodules (resolved when the model is sharded)."""
        return list(self.options.ignored_modules)

    @property
    def pipeline(self) -> PipelineRuntime | None:
        """This rank's stages, with ``pipeline_parallel_size > 1`` (after setup)."""
        return self._pipeline_role.runtime

    @property
    def device(self) -> torch.device:
        """This rank's device as the accelerator names it (``hpu:3`` on Gaudi)."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def device_runtime(self) -> DeviceRuntime:
        """What the strategy asks about this rank's device (backend, compute device, start-up): engine/devices.py."""
        return device_runtime(self.device)

    @property
    @override
    def root_device(self) -> torch.device:
        # Where this rank's tensors live: the device itself, except under the Gaudi test double (see accelerators/).
        return self.device_runtime.compute_device(self.device)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning for strategies it does not know (batch-size finder, sampler choice).
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Under tensor parallelism the data-parallel rank and size: a TP group reads the same samples.
        layout = self._layout.sampler_kwargs(self.global_rank)
        return layout or self._pipeline_role.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """With ``tensor_parallel_size > 1`` the run's mesh (docs/parallelism.md), also ``LightningModule.device_mesh``
        in ``configure_model``; None otherwise."""
        return self._layout.mesh

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> FSDPPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            return FSDPPrecision()
        assert isinstance(plugin, FSDPPrecision)  # the setter converts every plugin
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else to_fsdp_precision(plugin, self.mixed_precision)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The engine's mixed precision: the explicit option, else what the Trainer's precision flag implies."""
        return self.mixed_precision or self.precision_plugin.mixed_precision_config

    @override
    def _configure_launcher(self) -> None:
        # A script re-run per rank by default; forks in a notebook (refused where fork is unsafe).
        assert self.cluster_environment is not None
        self._launcher = choose_launcher(
            self, self._start_method, self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        check_launch_size(self.cluster_environment, self.num_nodes, self.num_processes)
        pipeline, hybrid = self.pipeline_options.size, self.sharding_strategy.is_hybrid
        self._layout.check(self.num_nodes * self.num_processes, self.num_processes, pipeline=pipeline, hybrid=hybrid)
        assert self.accelerator is not None
        self.accelerator.setup_device(self.device)
        # Before any collective (on Gaudi: the eager-mode check, and HCCL registers itself on import).
        self.device_runtime.before_process_group()
        self.setup_distributed()
        mesh = self._layout.build(self.global_rank, self.root_device.type, self._timeout)
        if mesh is not None and self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh  # as Lightning's ModelParallelStrategy does

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.device_runtime.binds_device_id else None
        # The rendezvous within startup_timeout, every later collective within timeout (rendezvous.py).
        init_default_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self._startup_timeout, device_id
        )
        # A script that ends right after a collective could otherwise die with SIGABRT at exit (see shutdown.py).
        settle_at_exit()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or self.device_runtime.process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # As Lightning's DDPStrategy: the rank is an attribute kept on the function object, absent from its stub.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # docs/how-it-works.md, "Meta-device initialisation".
        from lightning_fsdp.engine.meta_init import parameters_on_meta

        with (
            self.root_device,
            parameters_on_meta(enabled=bool(empty_init)),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None and self.model is not None
        self.accelerator.setup(trainer)
        # Signals recorded by their handlers, agreed on at step boundaries: lightning_fsdp/preemption.py
        self._preemption = install_preemption(trainer, self._world_device)
        fitting = trainer.state.fn == TrainerFn.FITTING
        check_device_id_matches(self.device_id, self.device)
        check_reusable(self.lightning_module)
        if fitting:
            check_trainable(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        run = SplitContext(
            world_size=self.world_size,
            rank=self.global_rank,
            device=self.root_device,
            timeout=self._timeout,
            precision=self.precision_plugin.precision,
            mixed_precision=self.mixed_precision_config,
            parallel=self._layout.groups,
        )
        techniques = Techniques(
            self._layout, self._pipeline_role, self.activation_checkpointing_policy, self.options, self._group_choice
        )
        # Tensor parallelism, pipeline stages, activation checkpointing, sharding: lightning_fsdp/parallelize.py
        self.engine = parallelize(self.lightning_module, techniques, run, self.num_processes, self._offloads)
        # SWA / EMA callbacks copied the model in their setup, full size: their average now keeps only this rank's rows.
        shard_averaged_models(trainer, self.engine)
        self.precision_plugin.attach(self.engine, self._pipeline_role.stage_group, self.root_device.type)
        if fitting:
            self.setup_optimizers(trainer)
            check_optimizers(self.engine, self.lightning_module, self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            # With CPU offload the optimizer state belongs beside the shards, in host memory.
            _optimizers_to_device(self.optimizers, torch.device("cpu") if self._offloads else self.root_device)

    @property
    def _offloads(self) -> bool:
        """Whether shards, gradients and optimizer state move to host memory: cpu_offload, on an accelerator."""
        return self.cpu_offload and self.root_device.type != "cpu"

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # Uneven batches end with an error on every rank, not a hang in a collective: lightning_fsdp/even_batches.py
    @cached_property
    def _even_batches(self) -> EvenBatches:
        return EvenBatches(self._world_device)

    def _world_device(self) -> torch.device:
        # Where the world group's collectives take tensors: gloo's take host tensors.
        return torch.device("cpu") if self._process_group_backend == "gloo" else self.root_device

    def _step_boundary(self, trainer: pl.Trainer | None) -> None:
        if self._preemption is not None and trainer is not None:
            self._preemption.at_step_boundary(trainer)  # every rank agrees whether a signal stops the run here

    def _trainer(self) -> pl.Trainer | None:
        return getattr(self.lightning_module, "_trainer", None)

    @override
    def on_train_start(self) -> None:  # Lightning's own hooks of this kind do nothing
        self._even_batches.loop_started(self._trainer())

    on_validation_start = on_test_start = on_train_start

    @override
    def on_predict_start(self) -> None:
        # Not under NO_SHARD, whose forward makes no collective: uneven predict batches then work as under DDP.
        if self.sharding_strategy is not ShardingStrategy.NO_SHARD:
            self._even_batches.loop_started(self._trainer())

    def _connected(self) -> tuple[nn.Module, pl.LightningModule]:
        """The model (as wrapped by the precision plugin) and the LightningModule, connected by the Trainer."""
        assert self.model is not None and self.lightning_module is not None
        return self.model, self.lightning_module

    @override
    def training_step(self, *args: object, **kwargs: object) -> STEP_OUTPUT:
        trainer, (model, module) = self._trainer(), self._connected()
        self._step_boundary(trainer)
        self._even_batches.before_step(trainer)
        if self.pipeline is None:  # a pipeline's schedule runs the backward inside this step
            release_stale_gradients(trainer, module)  # [Note: Lightning's order keeps the last step's gradients ...]
        # Through the LightningModule's __call__, so that the root unit's hooks see the step.
        with self._pipeline_role.training_step(trainer, module), self.precision_plugin.train_step_context():
            out = self._forward_redirection(model, module, "training_step", *args, **kwargs)
        self._even_batches.after_step(trainer)  # manual optimization: its optimizer steps are known now
        return out

    @override
    def validation_step(self, *args: object, **kwargs: object) -> STEP_OUTPUT:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: object, **kwargs: object) -> STEP_OUTPUT:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: object, **kwargs: object) -> STEP_OUTPUT:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    def _evaluation_step(
        self, name: str, context: AbstractContextManager[object], *args: object, **kwargs: object
    ) -> STEP_OUTPUT:
        self._step_boundary(self._trainer())
        self._even_batches.before_step(self._trainer())
        model, module = self._connected()
        with context:
            return self._forward_redirection(model, module, name, *args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return Collective().broadcast(obj, src)  # over the default group; the object itself without one

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: object, **kwargs: object) -> Tensor:
        if self._pipeline_role.backward_ran(closure_loss):  # inside pipelined_loss: only Lightning's hooks remain
            _, module = self._connected()
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline_role.restore_gradients()
            return self.precision_plugin.post_backward(closure_loss, module)
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            # torch's NaN check would raise on the NaN's rank only, the others then hang: the engine checks instead,
            # on every rank (anomaly mode itself stays on).
            with torch.autograd.set_detect_anomaly(True, check_nan=False):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for the batches that accumulate (and for toggle_model(sync_grad=False)).
        if self.sync_gradients_while_accumulating or self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    @override
    def reduce(
        self, tensor: Tensor, group: ProcessGroup | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        return all_reduce_tensor(tensor, group, reduce_op)

    # Checkpoints: each method routed to one format object (lightning_fsdp/checkpoint/routing.py).
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Set lazily, not in __init__, so a user's plugins=[SomeCheckpointIO()] takes precedence without a conflict.
        self._checkpoint_io = with_atomic_default(self._checkpoint_io)
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

    @override
    def lightning_module_state_dict(self) -> StateDict:
        return self._checkpoints.model_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool = True) -> None:
        self._checkpoints.load_model_state_dict(checkpoint, strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> StateDict:
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: Checkpoint, filepath: _PATH, storage_options: object = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def on_train_end(self) -> None:
        self._checkpoints.wait()  # the end of fit waits for the last asynchronous save; its failure is raised here

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> Checkpoint:
        """Read rank 0's ``checkpoint_path`` on every rank, in the format on disk (optimizer state when fitting)."""
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self._checkpoints.remove(filepath)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_strategies(strategy_registry)  # lightning_fsdp/registration.py: "fsdp_custom" and its variants

    @override
    def on_exception(self, exception: BaseException) -> None:
        trainer = self._trainer()
        if self._preemption is not None and trainer is not None:
            self._preemption.on_exception(trainer, exception)  # an agreed preemption's saves, requeue, exit status
        # Lightning stops the ranks rank 0 started only on KeyboardInterrupt; stop them when it exits after a failure.
        super().on_exception(exception)
        self._stage_end.failed = True  # teardown, which Lightning calls next, must not gather: ranks may be apart
        if not self._stop_at_exit:
            self._stop_at_exit = True
            atexit.register(stop_launched_processes, self._launcher, 5.0)

    @override
    def teardown(self) -> None:
        self._checkpoints.close()
        module = self.lightning_module
        if self._stage_end.finish(module, self.num_processes, self.global_rank):
            super().teardown()
            return
        # Moving a sharded module would detach its parameters from the flat buffers (or fail on meta tensors).
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module
