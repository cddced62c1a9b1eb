"""``FSDPStrategy``: the Lightning glue around the sharding engine. Registered as ``"fsdp_custom"``."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import cached_property, partial
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
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.activation_checkpointing import apply_activation_checkpointing, parse_checkpointing_policy
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
    parse_state_dict_type,
    prepare_save_as,
    read_checkpoint,
    remove_checkpoint_at,
    save_checkpoint_as,
    unwrapped_optimizer,
    with_atomic_default,
)
from lightning_fsdp.collective import Collective, all_reduce_tensor
from lightning_fsdp.engine import (
    MixedPrecision,
    ShardingEngine,
    ShardingOptions,
    ShardingStrategy,
    WrapPolicy,
    fully_shard,
    get_engine,
)
from lightning_fsdp.engine.devices import DeviceRuntime, device_runtime
from lightning_fsdp.engine.options import check_flag
from lightning_fsdp.engine.sharding import has_meta_tensors
from lightning_fsdp.even_batches import EvenBatches
from lightning_fsdp.launcher import check_start_method, choose_launcher, stop_launched_processes
from lightning_fsdp.options import (
    PipelineOptions,
    check_device_id,
    check_device_id_matches,
    check_lightning_arguments,
    check_optimizers,
    check_trainable,
    check_use_orig_params,
    engine_kwargs,
)
from lightning_fsdp.pipeline.role import SplitContext, pipeline_role
from lightning_fsdp.pipeline.runtime import PipelineRuntime
from lightning_fsdp.precision import FSDPPrecision, to_fsdp_precision
from lightning_fsdp.process_groups import GroupChoice
from lightning_fsdp.registration import register_strategies
from lightning_fsdp.rendezvous import check_launch_size, check_timeout, init_default_group
from lightning_fsdp.shutdown import settle_at_exit
from lightning_fsdp.stage_end import StageEnd, check_reusable
from lightning_fsdp.weight_averaging import gather_averages_for_save, shard_averaged_models, slice_loaded_averages

log = logging.getLogger(__name__)


class FSDPStrategy(ParallelStrategy):
    """Fully Sharded Data Parallel training with this project's own sharding engine.

    Works on CPU (gloo), CUDA (NCCL) and HPU (HCCL). Every option is a keyword argument, described with its default
    in docs/options.md; validated, they are ``strategy.options`` (a
    :class:`~lightning_fsdp.engine.options.ShardingOptions`). The sharded model's engine is ``strategy.engine``."""

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
        self._async_saves: AsyncCheckpointer | None = None
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
        return self._pipeline_role.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank)

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
        assert self.accelerator is not None
        self.accelerator.setup_device(self.device)
        # Before any collective (on Gaudi: the eager-mode check, and HCCL registers itself on import).
        self.device_runtime.before_process_group()
        self.setup_distributed()

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
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_device_id()
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
        )
        self._pipeline_role.split(self.lightning_module, run)
        self.engine = self._shard(self.lightning_module)
        self._pipeline_role.attach_engine(self.engine)
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

    def _shard(self, module: pl.LightningModule) -> ShardingEngine:
        engine = get_engine(module)
        if engine is not None:  # fit, then validate/test/predict on the same module
            return engine
        if not has_meta_tensors(module):
            module.to(self.root_device)
        if self.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        shard_group, replicate_group = self._pipeline_role.shard_groups(
            lambda: self._group_choice.resolve(self.world_size, self.num_processes, self.global_rank, self._timeout)
        )
        kwargs = engine_kwargs(self.options, module, self.mixed_precision_config, self._offloads)
        return fully_shard(
            module, process_group=shard_group, replicate_group=replicate_group, device=self.root_device, **kwargs
        )

    @property
    def _offloads(self) -> bool:
        """Whether shards, gradients and optimizer state move to host memory: cpu_offload, on an accelerator."""
        return self.cpu_offload and self.root_device.type != "cpu"

    def _check_device_id(self) -> None:
        check_device_id_matches(self.device_id, self.device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # Uneven batches end with an error on every rank, not a hang in a collective: lightning_fsdp/even_batches.py
    @cached_property
    def _even_batches(self) -> EvenBatches:
        # gloo's collectives take host tensors
        return EvenBatches(lambda: torch.device("cpu") if self._process_group_backend == "gloo" else self.root_device)

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
        self._even_batches.before_step(trainer)
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

    @property
    def _checkpoint_format(self) -> CheckpointFormat:
        return format_for_saving(self.state_dict_type)

    def _sharding_engine(self) -> ShardingEngine:
        assert self.engine is not None, "the model is sharded in setup"
        return self.engine

    @override
    def lightning_module_state_dict(self) -> StateDict:
        return self._pipeline_role.model_state_dict(self._checkpoint_format, self._sharding_engine())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool = True) -> None:
        load_model_state(self._sharding_engine(), checkpoint, strict, self._pipeline_role)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> StateDict:
        optimizer = unwrapped_optimizer(optimizer)
        return self._pipeline_role.optimizer_state(self._checkpoint_format, self._sharding_engine(), optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [unwrapped_optimizer(o) for o in self.optimizers]
        load_optimizer_states(self._sharding_engine(), checkpoint["optimizer_states"], optimizers, self._pipeline_role)

    @override
    def save_checkpoint(self, checkpoint: Checkpoint, filepath: _PATH, storage_options: object = None) -> None:
        gather_averages_for_save(self, checkpoint)  # SWA / EMA averages: full tensors, not rank 0's rows only
        fmt, role = self._checkpoint_format, self._pipeline_role
        run = CheckpointRun(self.engine, self.optimizers, writing_io(self.checkpoint_io))
        wanted = runs_async(self.async_checkpoint, self.checkpoint_io) and fitting_now(self._trainer())
        pins = lambda device: self.device_runtime.pins_host_memory(device)  # noqa: E731 - asked at the first copy
        saves = self._async_saves = background_writer(self._async_saves, wanted, pins)
        if saves is None or not wanted:
            save_checkpoint_as(fmt, checkpoint, filepath, storage_options, run, role)
            return
        prepare = partial(prepare_save_as, fmt, path=filepath, storage_options=storage_options, run=run, role=role)
        saves.submit(checkpoint, filepath, self.root_device, lambda staged: prepare(checkpoint=staged))

    @override
    def on_train_end(self) -> None:
        if self._async_saves is not None:  # the end of fit waits for the last save; its failure is raised here
            self._async_saves.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> Checkpoint:
        """Read rank 0's ``checkpoint_path`` on every rank, in the format on disk (optimizer state when fitting)."""
        if self._async_saves is not None:
            self._async_saves.wait()  # the checkpoint may be the one being written
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [unwrapped_optimizer(o) for o in self.optimizers] if fitting else None
        run = CheckpointRun(self.engine, optimizers, self.checkpoint_io)
        checkpoint = read_checkpoint(checkpoint_path, run, self._pipeline_role, weights_only)
        return slice_loaded_averages(self, checkpoint)  # each rank's rows of the SWA / EMA averages

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            # With a save in flight: after it, and only if it succeeded (the checkpoint it replaces stays till then).
            after_saves(self._async_saves, partial(remove_checkpoint_at, filepath, writing_io(self.checkpoint_io)))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_strategies(strategy_registry)  # lightning_fsdp/registration.py: "fsdp_custom" and its variants

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning stops the ranks rank 0 started only on KeyboardInterrupt; stop them when it exits after a failure.
        super().on_exception(exception)
        self._stage_end.failed = True  # teardown, which Lightning calls next, must not gather: ranks may be apart
        if not self._stop_at_exit:
            self._stop_at_exit = True
            atexit.register(stop_launched_processes, self._launcher, 5.0)

    @override
    def teardown(self) -> None:
        if self._async_saves is not None:  # after an error too: a failure not raised yet is only warned about
            self._async_saves.close(raise_errors=False)
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
