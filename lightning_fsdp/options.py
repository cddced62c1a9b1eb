"""The strategy's arguments: checks of the arguments only ``FSDPStrategy`` takes (Lightning's plugins, ``device_id``,
``use_orig_params``, the optimizers), ``PipelineOptions`` (the pipeline-parallel options, docs/pipeline.md "Options",
validated on every rank before any group), and the engine's options as the strategy hands them on at setup; the
engine's own options are ``engine/options.py``'s ``ShardingOptions``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.engine import MixedPrecision, ShardingEngine, ShardingOptions
from lightning_fsdp.engine.options import check_flag


def resolve_names(root: nn.Module, items: Iterable[object]) -> list[object]:
    """Strings name submodules or parameters of ``root`` (handy in YAML configs); objects pass through."""
    resolved: list[object] = []
    for item in items:
        if isinstance(item, str):
            try:
                resolved.append(root.get_submodule(item))
            except AttributeError:
                try:
                    resolved.append(root.get_parameter(item))
                except AttributeError as err:
                    raise ValueError(f"{item!r} names no submodule or parameter of {type(root).__name__}.") from err
        else:
            resolved.append(item)
    return resolved


def engine_kwargs(
    options: ShardingOptions, module: nn.Module, mixed_precision: MixedPrecision | None, cpu_offload: bool
) -> dict[str, Any]:  # fully_shard's keyword arguments, each of its own type
    """``fully_shard``'s options. They differ from the options as given in three ways known only at setup: names
    become the modules / parameters they name, the Trainer's precision flag may imply the mixed precision, and there
    is nothing to offload on a CPU run."""
    return dataclasses.replace(
        options,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        ignored_modules=tuple(resolve_names(module, options.ignored_modules)),
        ignored_states=tuple(resolve_names(module, options.ignored_states)),
    ).as_kwargs()


def check_use_orig_params(value: object) -> None:
    """Torch FSDP's ``use_orig_params``: accepted (Lightning users pass it), but only ``True`` is what this does."""
    check_flag(value, "use_orig_params")
    if not value:
        raise ValueError(
            "use_orig_params=False is not supported: this strategy always keeps the original parameters "
            "(named_parameters() gives the unwrapped model's names); pass use_orig_params=True."
        )


def check_device_id(value: object) -> None:
    """The type of ``device_id``; whether it names this rank's device is checked at setup, once that is known."""
    if value is not None and not (
        isinstance(value, torch.device) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    ):
        raise TypeError(f"device_id={value!r} is not valid; expected a non-negative int or a torch.device.")


def check_device_id_matches(device_id: int | torch.device | None, device: torch.device) -> None:
    """``device_id`` must name this rank's ``device`` as the accelerator names it (hpu:0 under the test double)."""
    if device_id is None:
        return
    wanted = torch.device(device.type, device_id) if isinstance(device_id, int) else device_id
    if wanted.type != device.type or (
        wanted.index is not None and device.index is not None and wanted.index != device.index
    ):
        raise ValueError(
            f"device_id={device_id!r} does not match this rank's device {device}; the accelerator and "
            "devices chosen in the Trainer decide the device, so leave device_id unset or pass that device."
        )


def check_trainable(module: nn.Module) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no trainable parameters (all have requires_grad=False); "
            "trainer.fit needs at least one. validate, test and predict work with a frozen model."
        )


def check_optimizers(engine: ShardingEngine, module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Every parameter the optimizers hold must be one the engine manages (a shard, not a full tensor)."""
    names = {id(p): n for n, p in module.named_parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not engine.is_managed(param):
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} "
                        f"({names.get(id(param), 'not a parameter of the LightningModule')}) that the "
                        "fsdp_custom strategy does not manage. Build the optimizer in configure_optimizers "
                        "from self.parameters() or self.named_parameters()."
                    )


def check_lightning_arguments(
    accelerator: object,
    parallel_devices: object,
    cluster_environment: object,
    checkpoint_io: object,
    precision_plugin: object,
    process_group_backend: object,
    timeout: object,
) -> None:
    """Type checks for the arguments Lightning's Trainer normally fills in, so a wrong one given by hand fails here,
    on every rank, instead of as an AttributeError deep inside setup or a process-group error on some ranks."""
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.plugins.precision import Precision

    for name, value, kind, expected in (
        (
            "accelerator",
            accelerator,
            Accelerator,
            "a lightning Accelerator instance (or pass accelerator= to the Trainer)",
        ),
        ("cluster_environment", cluster_environment, ClusterEnvironment, "a lightning ClusterEnvironment instance"),
        ("checkpoint_io", checkpoint_io, CheckpointIO, "a lightning CheckpointIO instance"),
        (
            "precision_plugin",
            precision_plugin,
            Precision,
            "a lightning Precision plugin (or pass precision= to the Trainer, e.g. 'bf16-mixed')",
        ),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}={value!r} is not valid; expected {expected} or None.")
    if parallel_devices is not None and not (
        isinstance(parallel_devices, (list, tuple)) and all(isinstance(d, torch.device) for d in parallel_devices)
    ):
        raise TypeError(f"parallel_devices={parallel_devices!r} is not valid; expected a list of torch.device or None.")
    if process_group_backend is not None and not (isinstance(process_group_backend, str) and process_group_backend):
        raise TypeError(
            f"process_group_backend={process_group_backend!r} is not valid; expected a backend name such as 'gloo', "
            "'nccl' or 'hccl', or None (chosen from the accelerator)."
        )
    # The package index's torch has no MPI backend; without this, torch refuses it inside Lightning's setup.
    from lightning_fsdp.rendezvous import backend_names, check_timeout

    if (
        process_group_backend is not None
        and "mpi" in backend_names(process_group_backend)
        and not torch.distributed.is_mpi_available()
    ):
        raise ValueError(
            f"process_group_backend={process_group_backend!r} is not available: this torch build has no MPI backend "
            "(torch.distributed.is_mpi_available() is False; torch must be built from source against an MPI "
            "library to have one). A job launched with mpirun does not need it: Lightning reads the ranks from "
            "mpirun (MPIEnvironment, with mpi4py installed) and the strategy runs on any backend, so pass "
            "process_group_backend='gloo' (CPU), 'nccl' (CUDA) or 'hccl' (Gaudi), or leave it None to have it "
            "chosen from the accelerator."
        )
    check_timeout(timeout, "timeout")


# Schedule name -> (torch class name, several stages per rank). Only schedules whose backward is one autograd call
# per microbatch: the zero-bubble ones split backward into input and weight parts, which the engine's per-unit
# reduction does not follow.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "GPipe": ("ScheduleGPipe", False),
    "1F1B": ("Schedule1F1B", False),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", True),
}


@dataclass(frozen=True)
class PipelineOptions:
    size: int = 1
    schedule: str = "1F1B"
    microbatches: int | None = None  # None: one per stage (the fewest every schedule accepts)
    stages_per_rank: int = 1
    split: tuple[str, ...] | None = None
    module: str = "model"

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def num_stages(self) -> int:
        return self.size * self.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages

    @classmethod
    def parse(
        cls,
        size: int = 1,
        schedule: str = "1F1B",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        split: Sequence[str] | None = None,
        module: str = "model",
    ) -> PipelineOptions:
        """The options as given (the strategy's ``pipeline_*`` arguments), each checked: a value of another type (from
        a YAML config, say) raises naming the argument."""
        size = _positive_int(size, "pipeline_parallel_size")
        if schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline_schedule={schedule!r} is not supported; choose one of {sorted(SCHEDULES)} (the zero-bubble "
                "schedules split backward in two, which the sharded gradient reduction does not follow)."
            )
        interleaved = SCHEDULES[schedule][1]
        if stages_per_rank is None:
            stages_per_rank = 2 if interleaved else 1
        stages_per_rank = _positive_int(stages_per_rank, "pipeline_stages_per_rank")
        if interleaved and stages_per_rank < 2:
            raise ValueError(
                f"pipeline_stages_per_rank={stages_per_rank} with pipeline_schedule={schedule!r}: an interleaved "
                "schedule places at least 2 stages on each pipeline rank; pass 2 or more, or use 'GPipe' / '1F1B'."
            )
        if not interleaved and stages_per_rank != 1:
            raise ValueError(
                f"pipeline_stages_per_rank={stages_per_rank} with pipeline_schedule={schedule!r}: this schedule runs "
                "one stage per pipeline rank; use 'Interleaved1F1B' for several."
            )
        if microbatches is not None:
            microbatches = _positive_int(microbatches, "pipeline_microbatches")
        if not isinstance(module, str) or not module:
            raise TypeError(f"pipeline_module={module!r} must be the name of the LightningModule's attribute to split.")
        if split is not None:
            if isinstance(split, str) or not all(isinstance(name, str) for name in split):
                raise TypeError(f"pipeline_split={split!r} must be a list of module names or None (balanced).")
            split = tuple(split)
        options = cls(size, schedule, microbatches, stages_per_rank, split, module)
        if size > 1:
            options._check_microbatches()
            if split is not None and len(split) != options.num_stages - 1:
                raise ValueError(
                    f"pipeline_split={list(split)} names {len(split)} cut points; {options.num_stages} stages "
                    f"(pipeline_parallel_size={size} x {stages_per_rank} per rank) need {options.num_stages - 1}."
                )
        return options

    def _check_microbatches(self) -> None:
        # torch's own rules, checked here so that they raise before any collective rather than when the schedule is
        # built at the first step.
        m, stages = self.num_microbatches, self.num_stages
        if self.schedule == "1F1B" and m < stages:
            raise ValueError(
                f"pipeline_microbatches={m} with pipeline_schedule='1F1B' and {stages} stages: 1F1B needs at least "
                f"one microbatch per stage ({stages} or more); GPipe accepts fewer."
            )
        if self.schedule == "Interleaved1F1B":
            rounds = max(1, m // self.size)
            if m % rounds:
                raise ValueError(
                    f"pipeline_microbatches={m} with pipeline_schedule='Interleaved1F1B' on {self.size} pipeline "
                    f"ranks: it must be a multiple of the number of rounds ({rounds} = {m} // {self.size}); "
                    f"for example {self.size * rounds}."
                )

    def check_world(self, world_size: int) -> int:
        """The data-parallel size D = world_size / P; a clear error when P does not divide the world."""
        if world_size % self.size:
            raise ValueError(
                f"pipeline_parallel_size={self.size} does not divide the {world_size} processes (devices x "
                f"num_nodes); choose a P that divides {world_size}, e.g. "
                f"{[p for p in range(1, world_size + 1) if world_size % p == 0]}."
            )
        return world_size // self.size


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int.")
    return value


def check_pipeline_composition(
    options: PipelineOptions, sharding: ShardingOptions, process_group: object, device_mesh: object
) -> None:
    """The strategy options that do not compose with pipeline parallelism, refused when the strategy is built."""
    if not options.enabled:
        return
    strategy = sharding.sharding_strategy
    if strategy.is_hybrid:
        raise ValueError(
            f"sharding_strategy={strategy.value!r} with pipeline_parallel_size={options.size}: each stage is sharded "
            "over its data-parallel group; hybrid sharding inside a stage is not supported. Use 'FULL_SHARD', "
            "'SHARD_GRAD_OP' or 'NO_SHARD'."
        )
    if process_group is not None or device_mesh is not None:
        raise ValueError(
            f"process_group / device_mesh with pipeline_parallel_size={options.size}: the strategy builds the "
            "(pipeline, data) mesh itself (strategy.pipeline.layout.mesh); leave both unset."
        )


def check_pipeline_precision(options: PipelineOptions, precision: str) -> None:
    """16-mixed scales the loss in Lightning's backward, which a pipelined step does not call: refused."""
    if options.enabled and precision.startswith("16"):
        raise ValueError(
            f"precision={precision!r} with pipeline_parallel_size={options.size}: the fp16 loss scaler scales the "
            "loss in Lightning's backward, but the pipeline runs each microbatch's backward itself. Use "
            "'bf16-mixed', 'bf16-true' or '32-true'."
        )


TENSOR_PARALLEL_PLANS = (None, "auto")


def check_tensor_parallel(size: object, plan: object, process_group: object, device_mesh: object) -> int:
    """``tensor_parallel_size`` and ``tensor_parallel_plan`` (docs/parallelism.md), checked when the strategy is built;
    whether the size fits the world is checked once that is known (``ParallelDims.check``)."""
    size = _positive_int(size, "tensor_parallel_size")
    if plan not in TENSOR_PARALLEL_PLANS:
        raise ValueError(
            f"tensor_parallel_plan={plan!r} is not valid; choose None (parallelize the model yourself in "
            "configure_model with self.device_mesh['tensor_parallel']) or 'auto' (the built-in plan of a "
            "transformers Llama-family model or a litgpt GPT)."
        )
    if plan is not None and size == 1:
        raise ValueError(f"tensor_parallel_plan={plan!r} needs tensor_parallel_size > 1 (got {size}).")
    if size > 1 and (process_group is not None or device_mesh is not None):
        raise ValueError(
            f"process_group / device_mesh with tensor_parallel_size={size}: the strategy builds the "
            "(data_parallel, tensor_parallel) mesh itself (strategy.device_mesh, and self.device_mesh in "
            "configure_model); leave both unset."
        )
    return size
