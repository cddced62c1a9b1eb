"""``FSDPStrategy``: the Lightning glue around the sharding engine. Registered as ``"fsdp_custom"``."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
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
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from accelerators.hpu_runtime import check_eager_mode, compute_device, register_hccl_backend
from lightning_fsdp.activation_checkpointing import apply_activation_checkpointing, parse_checkpointing_policy
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, is_local_path
from lightning_fsdp.checkpoint.common import (
    CheckpointFormat,
    CheckpointMismatchError,
    CheckpointRun,
    ShardedOptimizerState,
    ShardedStateDict,
    load_sharded_model_state_dict,
    to_index_keyed,
)
from lightning_fsdp.checkpoint.formats import FULL_FORMAT, format_for_saving, format_on_disk, parse_state_dict_type
from lightning_fsdp.checkpoint.full import load_full_model_state_dict, load_full_optimizer_state_dict
from lightning_fsdp.checkpoint.paths import remove_checkpoint_path
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine, fully_shard, get_engine
from lightning_fsdp.engine.config import MixedPrecision, ShardingStrategy, WrapPolicy
from lightning_fsdp.engine.options import ShardingOptions, check_flag
from lightning_fsdp.engine.sharding import has_meta_tensors
from lightning_fsdp.even_batches import EvenBatches
from lightning_fsdp.launcher import check_start_method, choose_launcher, stop_launched_processes
from lightning_fsdp.options import check_device_id, check_lightning_arguments, check_use_orig_params, resolve_names
from lightning_fsdp.pipeline.checkpoint import (
    PipelineCheckpoint,
    check_pipeline_format,
    pipeline_model_state_dict,
    pipeline_optimizer_state,
)
from lightning_fsdp.pipeline.options import PipelineOptions, check_pipeline_composition, check_pipeline_precision
from lightning_fsdp.pipeline.runtime import PipelineGradients, PipelineRuntime, pipeline_layout
from lightning_fsdp.pipeline.split import plan_stages
from lightning_fsdp.precision import FSDPPrecision, to_fsdp_precision
from lightning_fsdp.process_groups import GroupChoice
from lightning_fsdp.registration import register_with_lightning
from lightning_fsdp.shutdown import settle_at_exit
from lightning_fsdp.weight_averaging import (
    gather_averages_for_save,
    restore_averaged_models,
    shard_averaged_models,
    slice_loaded_averages,
)

log = logging.getLogger(__name__)

_BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}


class FSDPStrategy(ParallelStrategy):
    """Fully Sharded Data Parallel training with this project's own sharding engine.

    Each rank keeps only its rows of every parameter, gradient and optimizer state; a unit's full parameters exist
    only while it computes. Works on CPU (gloo), CUDA (NCCL) and HPU (HCCL).

    Args:
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"`` or
            ``"HYBRID_SHARD_ZERO2"`` (shard within a node, replicate across nodes).
        device_mesh: for the hybrid strategies, a 2-D DeviceMesh with dims (replicate, shard), instead of the
            default node layout; or pass ``process_group=(shard_group, replicate_group)``.
        auto_wrap_policy: which modules become units: a set of module classes (or their import paths), a callable
            ``(module, recurse, nonwrapped_numel) -> bool``, or an int minimum parameter count. The root takes the rest.
        activation_checkpointing_policy: modules whose forward is recomputed in backward instead of keeping their
            activations: a set of module classes (or import paths) or a callable ``(module) -> bool``.
        mixed_precision: a :class:`~lightning_fsdp.MixedPrecision`; or let ``Trainer(precision=...)`` imply one.
        state_dict_type: checkpoint format: ``"full"`` (one file in Lightning's usual layout), ``"sharded"`` (a
            torch.distributed.checkpoint directory that loads at any world size) or ``"local"`` (a file per rank).
        sync_module_states: broadcast rank 0's initial parameters and buffers before sharding.
        param_init_fn: called on each meta-device module to materialise it (default: its ``reset_parameters``).
        backward_prefetch: ``"BACKWARD_PRE"`` (default: gather the next unit of backward when the current one's
            backward starts), ``"BACKWARD_POST"`` (after its gradients are reduced) or ``None``.
        forward_prefetch: gather the next unit (in the order recorded on the first step) before the current computes.
        limit_all_gathers: at most two units' full parameters (besides the root's) gathered or in flight.
        cpu_offload: keep shards, gradients and optimizer state in host memory (``True`` or torch's
            ``CPUOffload(offload_params=True)``); on a CPU run it is accepted and changes nothing.
        ignored_modules, ignored_states: modules / parameters (objects, or their names in the LightningModule) that
            stay whole on every rank; their gradients are averaged across ranks as they arrive.
        process_group: the shard group (or a callable returning it once the default group exists); collectives of
            the engine run on it only.
        device_id: an int or ``torch.device`` (HPU needs a device object); must name this rank's device.
        process_group_backend: overrides the backend chosen from the accelerator (gloo/nccl/hccl).
        start_method: ``"popen"`` (re-run the script per rank, the default; forks in a notebook), ``"spawn"``,
            ``"fork"`` or ``"forkserver"``.
        pipeline_parallel_size: P > 1 cuts the LightningModule's ``pipeline_module`` into stages over P pipeline
            ranks, each stage sharded over the other ``world_size / P`` ranks (docs/pipeline.md); the training and
            validation steps then call :func:`~lightning_fsdp.pipelined_loss`.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"`` (default) or ``"Interleaved1F1B"`` (torch.distributed.pipelining).
        pipeline_microbatches: microbatches per rank's batch (default: one per stage).
        pipeline_stages_per_rank: stages on each pipeline rank (2 or more for the interleaved schedule; default 2).
        pipeline_split: piece names (``"blocks.4"``) where stages 1, 2, ... start; default: balanced by parameters.
        pipeline_module: the LightningModule's attribute holding the model to cut (default ``"model"``).
        reshard_after_forward: ``None`` (the sharding strategy's choice), ``True``, ``False``, or an int N that keeps
            1/N of each unit after forward so backward gathers within N consecutive ranks (ZeRO++ hpZ).
        sync_gradients_while_accumulating: ``False`` reduces gradients only on the batch before each optimizer step
            under ``accumulate_grad_batches`` (and where manual optimization asks for it with
            ``toggle_model(sync_grad=False)``): the other batches add full-size gradients locally, so each unit
            holds its full gradient until then (memory) and the reduce-scatters of those batches are saved.

    The engine's options, validated, are ``strategy.options`` (a
    :class:`~lightning_fsdp.engine.options.ShardingOptions`); the sharded model's engine is ``strategy.engine`` after
    setup.
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
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
        pipeline_split: list[str] | None = None,
        pipeline_module: str = "model",
        sync_gradients_while_accumulating: bool = True,
        reshard_after_forward: bool | int | None = None,
    ) -> None:
        # Validate everything first: this runs on every rank before any process group exists, so a bad value
        # raises the same error everywhere instead of leaving a rank waiting in a collective (options.py).
        self.options = ShardingOptions.from_arguments(locals(), names=True)
        self.activation_checkpointing_policy = parse_checkpointing_policy(activation_checkpointing_policy)
        self.state_dict_type = parse_state_dict_type(state_dict_type)  # full, sharded or local
        check_use_orig_params(use_orig_params)
        check_device_id(device_id)
        self.device_id = device_id
        self._group_choice = GroupChoice(self.options.sharding_strategy, process_group, device_mesh)
        self.pipeline_options = PipelineOptions.parse(
            pipeline_parallel_size,
            pipeline_schedule,
            pipeline_microbatches,
            pipeline_stages_per_rank,
            pipeline_split,
            pipeline_module,
        )
        check_pipeline_composition(self.pipeline_options, self.options, process_group, device_mesh)
        if self.pipeline_options.enabled:
            check_pipeline_format(self.state_dict_type.value)
        check_flag(sync_gradients_while_accumulating, "sync_gradients_while_accumulating")
        self.sync_gradients_while_accumulating = sync_gradients_while_accumulating
        check_start_method(start_method)
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
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._stop_at_exit = False  # stop_launched_processes registered to run when this process exits
        self._stage_failed = False  # on_exception ran: teardown must not gather (the ranks may be apart)
        self._start_method = start_method
        self.engine: ShardingEngine | None = None
        self.pipeline: PipelineRuntime | None = None  # this rank's stages, with pipeline_parallel_size > 1

    # --------------------------------------------------------------------------------------------- properties
    # The sharding options are ``self.options`` (a ShardingOptions); these are the ones read by name elsewhere.
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
    def device(self) -> torch.device:
        """This rank's device as the accelerator names it (``hpu:3`` on Gaudi)."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def root_device(self) -> torch.device:
        # Where this rank's tensors live: the device itself, except under the Gaudi test double (see accelerators/).
        return compute_device(self.device)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's accelerator connector for strategies it does not know (the batch-size finder, the
        # data connector's sampler choice).
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.pipeline_options.enabled:
            # The ranks of one pipeline take the same samples: the data-parallel index picks them.
            data = self.pipeline_options.check_world(self.num_nodes * self.num_processes)
            return {"num_replicas": data, "rank": self.global_rank % data}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> FSDPPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else FSDPPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        plugin = to_fsdp_precision(plugin)
        if self.mixed_precision is not None and plugin.precision != "32-true":
            raise ValueError(
                f"Trainer(precision={plugin.precision!r}) and FSDPStrategy(mixed_precision=...) both set the "
                "precision; pass only one of them (precision='32-true' with an explicit MixedPrecision)."
            )
        self._precision_plugin = plugin

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The engine's mixed precision: the explicit option, else what the Trainer's precision flag implies."""
        return self.mixed_precision or self.precision_plugin.mixed_precision_config

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Atomic writes by default: a process killed mid-save leaves the previous checkpoint intact. Set lazily,
        # not in __init__, so a user's plugins=[SomeCheckpointIO()] still takes precedence without a conflict.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # fills the wrapper only if it is empty
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
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------ processes, groups
    @override
    def _configure_launcher(self) -> None:
        # A script re-run per rank by default; forks in a notebook (refused where fork is unsafe).
        assert self.cluster_environment is not None
        self._launcher = choose_launcher(
            self, self._start_method, self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.device)
        if self.device.type == "hpu":
            # Before any collective: FSDP cannot run in lazy mode, and HCCL registers itself on import.
            check_eager_mode()
            register_hccl_backend()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        # A script that ends right after a collective could otherwise die with SIGABRT at exit (see shutdown.py).
        settle_at_exit()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or _BACKEND_FOR_DEVICE.get(self.device.type, "gloo")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------------------------------ model setup
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init the model is created on the meta device and materialised unit by unit when sharded,
        # so no rank ever holds the whole model.
        device_context = torch.device("meta") if empty_init else self.root_device
        with device_context, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_device_id()
        if fitting and not any(p.requires_grad for p in self.lightning_module.parameters()):
            raise ValueError(
                f"{type(self.lightning_module).__name__} has no trainable parameters (all have requires_grad=False); "
                "trainer.fit needs at least one. validate, test and predict work with a frozen model."
            )
        self.model = self.precision_plugin.convert_module(self.model)
        shard_group = self._split_pipeline(self.lightning_module) if self.pipeline_options.enabled else None
        self.engine = self._shard(self.lightning_module, shard_group)
        if self.pipeline is not None:
            self.pipeline.attach_engine(self.engine)
        # SWA / EMA callbacks copied the model in their setup, full size: their average now keeps only this rank's rows.
        shard_averaged_models(trainer, self.engine)
        self.precision_plugin.engine = self.engine
        self.precision_plugin.stage_group = self.pipeline.layout.pp_group if self.pipeline is not None else None
        self.precision_plugin.set_device_type(self.root_device.type)
        if fitting:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if fitting:
            # With CPU offload the optimizer state belongs beside the shards, in host memory.
            _optimizers_to_device(self.optimizers, torch.device("cpu") if self._offloads else self.root_device)

    def _split_pipeline(self, module: pl.LightningModule) -> Any:
        """Cut the model into stages, keep this rank's, and return the data-parallel group to shard them over."""
        if self.pipeline is not None:  # fit, then validate/test on the same module
            return self.pipeline.layout.dp_group
        options = self.pipeline_options
        model = getattr(module, options.module, None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"pipeline_module={options.module!r}: {type(module).__name__}.{options.module} is "
                f"{type(model).__name__}, not an nn.Module; name the LightningModule attribute that holds the model."
            )
        options.check_world(self.world_size)
        check_pipeline_precision(options, self.precision_plugin.precision)
        plan_stages(model, options.num_stages, options.split)  # a bad cut raises here, before the groups exist
        mp = self.mixed_precision_config
        layout = pipeline_layout(options.size, self.world_size, self.global_rank, self.root_device.type, self._timeout)
        self.pipeline = PipelineRuntime(
            model, options, layout, self.root_device, compute_dtype=mp.param_dtype if mp is not None else None
        )
        self.pipeline.accumulation = self._loss_divisor
        return layout.dp_group

    def _loss_divisor(self) -> int:
        trainer = self._trainer()
        if trainer is None or not self.lightning_module.automatic_optimization:
            return 1
        return trainer.accumulate_grad_batches

    def _shard(self, module: pl.LightningModule, shard_group: Any = None) -> ShardingEngine:
        engine = get_engine(module)
        if engine is not None:  # fit, then validate/test/predict on the same module
            return engine
        if not has_meta_tensors(module):
            module.to(self.root_device)
        if self.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        if shard_group is not None:
            replicate_group = None
        else:
            shard_group, replicate_group = self._group_choice.resolve(
                self.world_size, self.num_processes, self.global_rank, self._timeout
            )
        # What the engine gets differs from the options as given in three ways known only now: names become the
        # modules / parameters they name, the Trainer's precision flag may imply the mixed precision, and there is
        # nothing to offload on a CPU run.
        options = dataclasses.replace(
            self.options,
            mixed_precision=self.mixed_precision_config,
            cpu_offload=self._offloads,
            ignored_modules=tuple(resolve_names(module, self.options.ignored_modules)),
            ignored_states=tuple(resolve_names(module, self.options.ignored_states)),
        )
        return fully_shard(
            module,
            process_group=shard_group,
            replicate_group=replicate_group,
            device=self.root_device,
            **options.as_kwargs(),
        )

    @property
    def _offloads(self) -> bool:
        """Whether shards, gradients and optimizer state move to host memory: cpu_offload, on an accelerator."""
        return self.cpu_offload and self.root_device.type != "cpu"

    def _check_device_id(self) -> None:
        if self.device_id is None:
            return
        wanted = self.device_id
        if isinstance(wanted, int):
            wanted = torch.device(self.device.type, wanted)
        root = self.device  # as the accelerator names it (hpu:0 even where the test double computes on CPU)
        if wanted.type != root.type or (
            wanted.index is not None and root.index is not None and wanted.index != root.index
        ):
            raise ValueError(
                f"device_id={self.device_id!r} does not match this rank's device {root}; the accelerator and "
                "devices chosen in the Trainer decide the device, so leave device_id unset or pass that device."
            )

    def _check_optimizers(self) -> None:
        assert self.engine is not None and self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not self.engine.is_managed(param):
                        raise ValueError(
                            f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} "
                            f"({names.get(id(param), 'not a parameter of the LightningModule')}) that the "
                            "fsdp_custom strategy does not manage. Build the optimizer in configure_optimizers "
                            "from self.parameters() or self.named_parameters()."
                        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------- the steps
    # Uneven inputs (a rank with fewer batches) must end with an error on every rank, not a hang in the next
    # collective: the loops' batch counts are compared when each loop starts, and loaders without a length are
    # checked before each step, ahead of the engine's collectives (lightning_fsdp/even_batches.py).
    @cached_property
    def _pipeline_gradients(self) -> PipelineGradients:
        return PipelineGradients()

    @cached_property
    def _even_batches(self) -> EvenBatches:
        return EvenBatches(self._collective_device)

    def _collective_device(self) -> torch.device:
        """Where the default group's collectives take tensors: host memory for gloo, this rank's device else."""
        return torch.device("cpu") if self._process_group_backend == "gloo" else self.root_device

    def _trainer(self) -> pl.Trainer | None:
        return getattr(self.lightning_module, "_trainer", None)

    def _check_loop_start(self) -> None:
        if (trainer := self._trainer()) is not None:
            self._even_batches.loop_started(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._check_loop_start()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._check_loop_start()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_loop_start()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        # Not under NO_SHARD, whose forward makes no collective: uneven predict batches then work as under DDP
        # (Lightning's own predict sampler does not repeat samples to even them out).
        if (trainer := self._trainer()) is not None and self.sharding_strategy is not ShardingStrategy.NO_SHARD:
            self._even_batches.loop_started(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        if trainer is not None:
            self._even_batches.before_step(trainer)
        pipelined = self.pipeline is not None and self.lightning_module.automatic_optimization
        if pipelined:
            self._pipeline_gradients.before_step(trainer, self.lightning_module)
        # Route through the LightningModule's __call__ so the root unit's hooks see the step.
        with self.precision_plugin.train_step_context():
            out = self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)
        if pipelined:
            self._pipeline_gradients.after_step(self.lightning_module)
        if trainer is not None:
            self._even_batches.after_step(trainer)  # manual optimization: its optimizer steps are known now
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context(), args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context(), args, kwargs)

    def _evaluation_step(self, name: str, context: AbstractContextManager, args: tuple, kwargs: dict) -> Any:
        """A validation, test or predict step: checked for even batches, then routed through the LightningModule's
        ``__call__`` like the training step."""
        if (trainer := self._trainer()) is not None:
            self._even_batches.before_step(trainer)
        with context:
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return Collective().broadcast(obj, src)  # over the default group; the object itself without one

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is not None and isinstance(closure_loss, Tensor) and closure_loss.grad_fn is None:
            # pipelined_loss ran every microbatch's backward already (lightning_fsdp/pipeline/runtime.py): only
            # Lightning's hooks around backward remain.
            module = self.lightning_module
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline_gradients.restore()
            return self.precision_plugin.post_backward(closure_loss, module)
        if self.pipeline is not None:
            raise RuntimeError(
                "With pipeline_parallel_size > 1 the loss to backpropagate must be the one pipelined_loss returned, "
                "unchanged: backward runs inside it, stage by stage. This loss has an autograd graph of its own "
                "(a term added outside the pipeline?), which would not reach the stages' parameters."
            )
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            # Trainer(detect_anomaly=True): torch's own NaN check would raise on the rank that produced the NaN only,
            # leaving the others blocked in their next collective. The engine checks every gradient instead and
            # names the parameter on every rank (anomaly mode itself, with its forward traces, stays on).
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
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        # SUM then an explicit division for means: ReduceOp.AVG is missing on gloo and on some HCCL releases
        # (Lightning's helper only works around gloo by its backend name).
        mean = (
            reduce_op is None
            or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
            or (reduce_op == ReduceOp.AVG)
        )
        if mean:
            op = ReduceOp.SUM
        elif isinstance(reduce_op, str):
            op = getattr(ReduceOp, reduce_op.upper())
        else:
            op = reduce_op
        group = _group.WORLD if group is None else group
        torch.distributed.all_reduce(tensor, op=op, group=group)
        if mean:
            world_size = torch.distributed.get_world_size(group)
            if tensor.is_floating_point():
                tensor.div_(world_size)
            else:
                tensor.copy_(tensor / world_size)
        return tensor

    # ------------------------------------------------------------------------------------------ checkpoints
    # The format a save writes is the one state_dict_type names; a load reads the one on disk, whatever
    # state_dict_type is (a full file or a sharded directory at any world size, a local one at its own). See
    # [Note: checkpoint formats] in lightning_fsdp/checkpoint/common.py. With pipeline parallelism every format
    # describes the unsplit model: [Note: checkpoints across pipeline layouts] in lightning_fsdp/pipeline/checkpoint.py.
    @property
    def _checkpoint_format(self) -> CheckpointFormat:
        return format_for_saving(self.state_dict_type)

    def _pipeline_checkpoint(self, optimizers: list[Optimizer] | None = None) -> PipelineCheckpoint | None:
        """Under pipeline parallelism, the other stages' keys and the unsplit optimizers (a collective)."""
        if self.pipeline is None:
            return None
        assert self.engine is not None
        return PipelineCheckpoint.gather(self.pipeline, self.engine, optimizers or [])

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        if self.pipeline is not None:
            return pipeline_model_state_dict(self._checkpoint_format.kind, self.pipeline, self.engine)
        return self._checkpoint_format.model_state_dict(self.engine)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        state = checkpoint.get("state_dict")
        if not isinstance(state, Mapping):  # the same file on every rank: every rank raises here
            what = "no 'state_dict' entry" if state is None else f"a {type(state).__name__} as 'state_dict'"
            raise CheckpointMismatchError(
                f"The checkpoint holds {what} (its entries: {sorted(map(str, checkpoint))}); a Lightning checkpoint "
                "keeps the model's weights there."
            )
        if self.pipeline is not None:
            # Each stage finds its own missing keys: every rank raises if one does.
            info = self._pipeline_checkpoint()
            Collective().run_agreed(lambda: self._load_model_state(state, strict, info))
        else:
            self._load_model_state(state, strict, None)

    def _load_model_state(self, state: Mapping[str, Any], strict: bool, info: PipelineCheckpoint | None) -> None:
        assert self.engine is not None
        if isinstance(state, ShardedStateDict):  # read from a sharded/local directory: already this rank's rows
            load_sharded_model_state_dict(self.engine, state, strict=strict)
        else:  # a full state dict; under pipeline parallelism the unsplit model's, of which this rank takes its part
            state = info.local_model_state(state) if info is not None else state
            load_full_model_state_dict(self.engine, state, strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        assert self.engine is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.pipeline is not None:
            return pipeline_optimizer_state(self._checkpoint_format.kind, self.pipeline, self.engine, optimizer)
        return self._checkpoint_format.optimizer_state(self.engine, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        assert self.engine is not None
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):  # zip() would silently skip the difference
            raise CheckpointMismatchError(
                f"The checkpoint holds the state of {len(states)} optimizer(s), but this run configured "
                f"{len(self.optimizers)}; resume with the same optimizers."
            )
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        info = self._pipeline_checkpoint(optimizers)
        for index, (optimizer, state) in enumerate(zip(optimizers, states)):
            if info is None:
                self._load_optimizer_state(optimizer, state, None, index)
            else:  # a problem one stage finds raises on every rank
                Collective().run_agreed(lambda o=optimizer, s=state, i=index: self._load_optimizer_state(o, s, info, i))

    def _load_optimizer_state(
        self, optimizer: Optimizer, state: Any, info: PipelineCheckpoint | None, index: int
    ) -> None:
        assert self.engine is not None
        if isinstance(state, ShardedOptimizerState):  # from a sharded/local directory: already this rank's rows
            optimizer.load_state_dict(state)
            return
        state = to_index_keyed(state)  # plain torch.optim layout, or keyed by parameter name (consolidate_checkpoint)
        if info is not None:  # the unsplit optimizer's state: this rank's positions of it
            state = info.local_optimizer_state(index, state, optimizer, "The checkpoint")
        load_full_optimizer_state_dict(self.engine, optimizer, state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        gather_averages_for_save(self, checkpoint)  # SWA / EMA averages: full tensors, not rank 0's rows only
        pipeline = self._pipeline_checkpoint() if self._checkpoint_format.kind != FULL_FORMAT.kind else None
        run = CheckpointRun(self.engine, self.optimizers, self.checkpoint_io, pipeline)
        self._checkpoint_format.save(checkpoint, filepath, run, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        coll = Collective()
        if not is_local_path(path) or not os.path.exists(path) or os.path.isfile(path):
            fmt = FULL_FORMAT  # a file, or a path only the CheckpointIO can tell about (remote, missing)
        else:
            # A directory (sharded or local checkpoint), or a special file that must not be opened (a FIFO would
            # block): every rank checks it, and all raise, before any other collective, if one finds a problem.
            path = os.fspath(path)
            fmt = coll.run_agreed(lambda: self._directory_format(path))
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else None
        pipeline = self._pipeline_checkpoint(optimizers) if fmt is not FULL_FORMAT else None
        run = CheckpointRun(self.engine, optimizers, self.checkpoint_io, pipeline)
        checkpoint = fmt.load(path, run, weights_only=weights_only, coll=coll)
        # Each rank takes its rows of the SWA / EMA averages before the callbacks load them.
        return slice_loaded_averages(self, checkpoint)

    def _directory_format(self, path: str) -> CheckpointFormat:
        fmt = format_on_disk(path)
        if self.engine is None:
            raise RuntimeError(
                f"Cannot load the {fmt.kind} checkpoint directory {path!r} before the model is sharded; the Trainer "
                "loads it after setup (ckpt_path=...)."
            )
        if self.pipeline is not None:
            check_pipeline_format(fmt.kind)
        return fmt

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        if is_local_path(filepath) and os.path.isdir(filepath):  # a sharded/local checkpoint directory
            remove_checkpoint_path(os.fspath(filepath))
        else:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ------------------------------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (
            ("fsdp_custom", "popen", {}),
            ("fsdp_custom_spawn", "spawn", {}),
            ("fsdp_custom_fork", "fork", {}),
            ("fsdp_custom_shard_grad_op", "popen", {"sharding_strategy": "SHARD_GRAD_OP"}),
            ("fsdp_custom_no_shard", "popen", {"sharding_strategy": "NO_SHARD"}),
        )
        for name, start_method, extra in entries:
            if name in strategy_registry:
                continue
            strategy_registry.register(
                name, cls, description=f"lightning-fsdp's FSDP strategy ({name})", start_method=start_method, **extra
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A failing rank 0 must not leave the ranks it started behind, blocked in a collective (Lightning stops
        # them only on KeyboardInterrupt); see stop_launched_processes. Only once rank 0 exits, though: a script
        # that catches the error and carries on (an error every rank raised, such as a checkpoint that does not
        # match) keeps its ranks.
        super().on_exception(exception)
        self._stage_failed = True  # read by teardown, which Lightning calls next
        if not self._stop_at_exit:
            self._stop_at_exit = True
            atexit.register(stop_launched_processes, self._launcher, 5.0)

    @override
    def teardown(self) -> None:
        # A stage that ended normally hands back an ordinary module holding the trained weights in full, on the host
        # as Lightning's other strategies leave it: usable for inference on one rank, or by another Trainer (which
        # shards it afresh), with none of the engine's hooks left on it. Every rank gets here together then, as the
        # gathers need.
        module = self.lightning_module
        engine = get_engine(module) if module is not None else None
        failed, self._stage_failed = self._stage_failed, False
        if engine is not None and not failed:
            restore_averaged_models(getattr(module, "_trainer", None), engine)  # SWA / EMA averages: whole again too
            engine.restore_unsharded(torch.device("cpu"))
            engine = None
        if engine is None and not (module is not None and has_meta_tensors(module)):
            super().teardown()
            return
        # After an exception the ranks may not all get here, so nothing is gathered: the module stays sharded with
        # its engine, ready for a retry. Lightning's teardown moves the module to the host, which would detach the
        # parameters from the engine's flat buffers (or fail on a module still on the meta device, when the stage
        # failed before sharding), so the module is kept out of that step.
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module


# The other half of [Note: registration without importing Lightning]: this module may be what imported Lightning.
register_with_lightning()
