"""Accelerators of lightning-fsdp: an Intel Gaudi (HPU) accelerator for Lightning.

Importing this package never imports the Gaudi software (``habana_frameworks``); it is loaded on demand, so the
package works on machines without it. ``lightning_fsdp`` calls :func:`register_hpu_accelerator` on import.
"""

from .hpu import HPUAccelerator
from .hpu_runtime import check_eager_mode
from .registration import register_hpu_accelerator

__all__ = ["HPUAccelerator", "check_eager_mode", "register_hpu_accelerator"]
