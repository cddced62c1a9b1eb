"""Accelerators of lightning-fsdp: an Intel Gaudi (HPU) accelerator for Lightning. Importing it never imports the
Gaudi software (``habana_frameworks``), which is loaded on demand."""

from .hpu import HPUAccelerator, register_hpu_accelerator
from .hpu_runtime import check_eager_mode

__all__ = ["HPUAccelerator", "check_eager_mode", "register_hpu_accelerator"]
