"""Probes of the Intel Gaudi software stack, safe on any machine: each imports the bridge on demand and treats an
``ImportError`` as "no Gaudi software"; other errors of a broken installation propagate instead of silently falling
back to another device. ``HPURuntime``: what the strategy and the engine ask about an ``hpu`` device.
"""

import importlib
import os
from types import ModuleType

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_fsdp.engine.devices import DeviceRuntime

__all__ = [
    "HPURuntime",
    "check_eager_mode",
    "hpu_device_count",
    "hpu_memory_stats",
    "is_hpu_available",
    "is_test_double",
]

_HPU_MODULE = "habana_frameworks.torch.hpu"
_LAZY_MODE_VARIABLE = "PT_HPU_LAZY_MODE"

_INSTALL_HINT = (
    "Install the Intel Gaudi software stack and its PyTorch bridge (see "
    "https://docs.habana.ai/en/latest/Installation_Guide/index.html), or choose another accelerator, "
    "e.g. `Trainer(accelerator='cpu')` or `Trainer(accelerator='cuda')`."
)


def _import_hpu_module() -> ModuleType | None:
    """Return ``habana_frameworks.torch.hpu``, or ``None`` when the Gaudi software is not installed."""
    # Deliberately not cached: `sys.modules` already makes repeated imports cheap, and a cache would freeze the
    # first answer even after a test double is put on `sys.path`.
    try:
        return importlib.import_module(_HPU_MODULE)
    except ImportError:
        return None


def _require_hpu_module(*, requested: object = None) -> ModuleType:
    """Return ``habana_frameworks.torch.hpu`` or raise a clear error saying how to get it or avoid it."""
    module = _import_hpu_module()
    if module is None:
        asked = "" if requested is None else f"You asked for HPU devices={requested!r}, but "
        raise MisconfigurationException(
            f"{asked}Intel Gaudi software was not found: `{_HPU_MODULE}` cannot be imported, so HPU devices "
            f"cannot be used. {_INSTALL_HINT}"
        )
    return module


def is_hpu_available() -> bool:
    """Whether the Gaudi software is installed and reports at least one usable HPU."""
    module = _import_hpu_module()
    return module is not None and bool(module.is_available())


def hpu_device_count() -> int:
    """Number of HPUs visible to this process; 0 without Gaudi software."""
    module = _import_hpu_module()
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


def hpu_memory_stats(device: torch.device | str | int | None = None) -> dict[str, object]:
    """Memory statistics of one HPU, the bridge's own keys (``InUse``, ``MaxInUse``, ...); ``{}`` when unavailable."""
    module = _import_hpu_module()
    if module is None:
        return {}
    memory_stats = getattr(module, "memory_stats", None)
    if memory_stats is None:
        # Older bridges lack memory_stats; device stats are optional telemetry, never a reason to fail training.
        return {}
    return dict(memory_stats(device))


def is_test_double() -> bool:
    """Whether the importable ``habana_frameworks`` is this project's CPU test double (``tests/fakes``), which sets
    ``IS_TEST_DOUBLE = True``."""
    try:
        package = importlib.import_module("habana_frameworks")
    except ImportError:
        return False
    return getattr(package, "IS_TEST_DOUBLE", False) is True


def check_eager_mode() -> None:
    """Raise unless the Gaudi bridge is configured for eager mode (``PT_HPU_LAZY_MODE=0``; unset counts as lazy, the
    default of many releases): the engine frees parameters and issues collectives from hooks as it goes, which lazy
    mode's deferred graphs break (docs/hpu.md). Called by ``setup_device`` and, before any collective, by
    ``HPURuntime.before_process_group``."""
    value = os.environ.get(_LAZY_MODE_VARIABLE)
    if value is not None and value.strip() == "0":
        return
    shown = "unset (lazy mode on many Gaudi releases)" if value is None else f"{value!r}"
    raise MisconfigurationException(
        f"FSDP cannot run in Intel Gaudi lazy mode, but {_LAZY_MODE_VARIABLE} is {shown}. Lazy mode defers operations "
        "to graph boundaries, while FSDP frees gathered parameters and runs collectives as it goes. Set "
        f"`{_LAZY_MODE_VARIABLE}=0` in the environment before the process starts (before `habana_frameworks` is "
        f"imported), e.g. `{_LAZY_MODE_VARIABLE}=0 python train.py`. If eager mode then shows stability problems, "
        "also set `PT_HPU_EAGER_PIPELINE_ENABLE=0`."
    )


class HPURuntime(DeviceRuntime):
    """Intel Gaudi's specifics for the strategy and the engine (lightning_fsdp/engine/devices.py): HCCL, eager mode
    checked and HCCL registered before the process group starts, compute on CPU under the test double. Registered
    by accelerators/hpu.py, beside the Lightning accelerator; streams and memory statistics come from ``torch.hpu``
    (the bridge's), as the default runtime finds them."""

    device_type = "hpu"
    process_group_backend = "hccl"

    def compute_device(self, device: torch.device) -> torch.device:
        """Where tensors for ``device`` are allocated: itself, except under the CPU test double, where the compute
        runs on CPU (torch's CPU build holds no HPU tensors) while the rest follows the HPU path."""
        if is_test_double():
            return torch.device("cpu")
        return device

    def before_process_group(self) -> None:
        """Before any collective: FSDP cannot run in lazy mode (``check_eager_mode``), and importing Gaudi's
        distributed module registers the ``hccl`` process-group backend with torch."""
        check_eager_mode()
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
