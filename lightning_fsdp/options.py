"""Checks of the arguments only ``FSDPStrategy`` takes (Lightning's plugins, ``device_id``, ``use_orig_params``) and
the resolution of option values given by name; the engine's own options are ``engine/options.py``'s
``ShardingOptions``."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

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
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout={timeout!r} is not valid; expected a datetime.timedelta (e.g. timedelta(minutes=30)) or None."
        )
    if timeout is not None and timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} is not valid; a process-group timeout must be positive.")
