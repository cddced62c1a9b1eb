"""Checks of the arguments only ``FSDPStrategy`` takes (Lightning's plugins, ``device_id``, ``use_orig_params``, the
optimizers) and the engine's options as the strategy hands them on at setup; the engine's own options are
``engine/options.py``'s ``ShardingOptions``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_fsdp.engine import MixedPrecision, ShardingEngine, ShardingOptions
from lightning_fsdp.engine.options import check_flag


def resolve_names(root: nn.Module, items: Iterable[Any]) -> list:
    """Strings name submodules or parameters of ``root`` (handy in YAML configs); objects pass through."""
    resolved = []
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
) -> dict[str, Any]:
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


def check_use_orig_params(value: Any) -> None:
    """Torch FSDP's ``use_orig_params``: accepted (Lightning users pass it), but only ``True`` is what this does."""
    check_flag(value, "use_orig_params")
    if not value:
        raise ValueError(
            "use_orig_params=False is not supported: this strategy always keeps the original parameters "
            "(named_parameters() gives the unwrapped model's names); pass use_orig_params=True."
        )


def check_device_id(value: Any) -> None:
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


def check_optimizers(engine: ShardingEngine, module: nn.Module, optimizers: Sequence[Any]) -> None:
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
    accelerator: Any,
    parallel_devices: Any,
    cluster_environment: Any,
    checkpoint_io: Any,
    precision_plugin: Any,
    process_group_backend: Any,
    timeout: Any,
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
