"""Lightning accelerator for Intel Gaudi (HPU) devices, importable on machines without Gaudi software, and its
registration under the name ``"hpu"`` in Lightning's registry, with the ``hpu`` device runtime (``HPURuntime``) in
lightning-fsdp's (lightning_fsdp/engine/devices.py)."""

import logging
from typing import Any

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_fsdp.engine.devices import register_device_runtime

from .hpu_runtime import (
    HPURuntime,
    _require_hpu_module,
    check_eager_mode,
    hpu_device_count,
    hpu_memory_stats,
    is_hpu_available,
)

__all__ = ["HPUAccelerator", "register_hpu_accelerator"]

_log = logging.getLogger(__name__)

_DevicesSpec = int | str | list[int] | tuple[int, ...]

_VALID_DEVICES = (
    "a positive int N (the first N HPUs), -1 or 'auto' (all HPUs), a string such as '2' or '0,1', "
    "or a non-empty list of distinct device indices such as [0, 1]"
)


class HPUAccelerator(Accelerator):
    """Accelerator for Intel Gaudi (HPU) devices, for this project's FSDP strategy (docs/hpu.md). FSDP needs eager
    mode (``PT_HPU_LAZY_MODE=0``). ``habana_frameworks`` is imported only inside methods, so the class can be
    registered anywhere; without it, asking for devices raises saying how to install it or pick another accelerator.
    """

    @override
    def setup_device(self, device: torch.device) -> None:
        """Check that ``device`` is a visible HPU and that the bridge runs in eager mode (the bridge binds each
        process to its device itself)."""
        if device.type != "hpu":
            raise MisconfigurationException(f"HPUAccelerator needs an 'hpu' device, got {device} instead.")
        _require_hpu_module(requested=str(device))
        check_eager_mode()
        count = hpu_device_count()
        if device.index is not None and not 0 <= device.index < count:
            raise ValueError(f"HPU index {device.index} is not visible: valid indices are 0..{count - 1}.")

    @override
    def teardown(self) -> None:
        """Nothing to release: the Gaudi bridge owns device memory and frees it at process exit."""

    @staticmethod
    @override
    def parse_devices(devices: _DevicesSpec) -> list[int]:
        """The HPU indices the Trainer's ``devices`` value names (``ValueError`` for an invalid or invisible one)."""
        return _parse_hpu_indices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: _DevicesSpec) -> list[torch.device]:
        """One ``torch.device("hpu", i)`` per process; accepts raw ``devices`` or the output of ``parse_devices``."""
        return [torch.device("hpu", index) for index in _parse_hpu_indices(devices)]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """Number of visible HPUs, 0 without Gaudi software."""
        return hpu_device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        """Whether Gaudi software is installed and sees at least one HPU."""
        return is_hpu_available()

    @staticmethod
    @override
    def name() -> str:
        return "hpu"

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """Memory statistics of ``device`` from ``habana_frameworks.torch.hpu.memory_stats()``, or ``{}``."""
        return hpu_memory_stats(device)

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


def _normalize_devices(devices: object) -> int | list[int]:
    """Check the form of ``devices`` without looking at hardware: returns -1 (all), a count N > 0, or an index list."""
    invalid = ValueError(f"Invalid HPU `devices={devices!r}`. Valid values are {_VALID_DEVICES}.")
    # bool is a subclass of int, and `devices=True` is almost certainly a mistake rather than "1 device".
    if isinstance(devices, bool):
        raise invalid
    if isinstance(devices, int):
        if devices == -1 or devices > 0:
            return devices
        raise invalid
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return -1
        try:
            if "," in text:
                # Lightning's convention: a comma makes it a list of indices, so "1," means "HPU 1", not "1 HPU".
                return _normalize_devices([int(part) for part in text.split(",") if part.strip()])
            return _normalize_devices(int(text))
        except ValueError:
            raise invalid from None
    if isinstance(devices, (list, tuple)):
        indices = list(devices)
        if (
            not indices
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices)
            or len(set(indices)) != len(indices)
        ):
            raise invalid
        return indices
    raise invalid


def _parse_hpu_indices(devices: object) -> list[int]:
    spec = _normalize_devices(devices)
    _require_hpu_module(requested=devices)
    count = hpu_device_count()
    if count == 0:
        raise MisconfigurationException(
            f"You asked for HPU devices={devices!r}, but the Intel Gaudi software sees no HPU on this machine. "
            "Check `hl-smi` and HABANA_VISIBLE_MODULES, or choose another accelerator, e.g. "
            "`Trainer(accelerator='cpu')`."
        )
    if spec == -1:
        return list(range(count))
    if isinstance(spec, int):
        if spec > count:
            raise ValueError(
                f"HPU `devices={devices!r}` asks for {spec} HPUs but only {count} are visible. "
                f"Valid counts are 1..{count}, or -1 / 'auto' for all."
            )
        return list(range(spec))
    missing = [index for index in spec if index >= count]
    if missing:
        raise ValueError(
            f"HPU `devices={devices!r}` names HPU(s) {missing} that are not visible. Valid indices are 0..{count - 1}."
        )
    return spec


def register_hpu_accelerator(registry: _AcceleratorRegistry | None = None) -> bool:
    """Register :class:`HPUAccelerator` as ``"hpu"`` in ``registry`` (default: Lightning's) unless another package
    (``lightning-habana``) holds the name, which overriding would silently change for its users. Returns whether
    ``"hpu"`` now resolves to :class:`HPUAccelerator`."""
    if registry is None:
        from lightning.pytorch.accelerators import AcceleratorRegistry

        registry = AcceleratorRegistry
    name = HPUAccelerator.name()
    if name in registry:
        # Index the dict directly: the registry's `get` instantiates the accelerator instead of returning the entry.
        registered = registry[name]["accelerator"]
        if registered is HPUAccelerator:
            return True
        _log.debug("Leaving %r registered as %r in place; pass HPUAccelerator() explicitly.", registered, name)
        return False
    HPUAccelerator.register_accelerators(registry)
    return True


# Importing the accelerator registers it: lightning_fsdp's registration relies on this, as it may run while this
# module is still being imported (lightning_fsdp/registration.py, `_register`). The device runtime is registered
# whichever package's accelerator holds the name "hpu": the strategy asks it about every hpu device.
register_hpu_accelerator()
register_device_runtime(HPURuntime())
