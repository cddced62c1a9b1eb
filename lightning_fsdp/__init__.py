"""lightning-fsdp: Fully Sharded Data Parallel for PyTorch Lightning, on CPU, CUDA and Intel Gaudi.

Importing the package registers the ``"fsdp_custom"`` strategy (and its variants) and the ``"hpu"`` accelerator with
Lightning. The public names load on first use, so that ``lightning_fsdp.engine`` can be imported without Lightning
(see [Note: registration without importing Lightning] in ``registration.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_fsdp.registration import register_with_lightning

__version__ = "0.1.0"

# Public name -> the module defining it.
_PUBLIC = {
    "BackwardPrefetch": "lightning_fsdp.engine.options",
    "FSDPStrategy": "lightning_fsdp.strategy",
    "HPUAccelerator": "accelerators",
    "LoadResult": "lightning_fsdp.pretrained",
    "MemoryEstimate": "lightning_fsdp.estimate",
    "MixedPrecision": "lightning_fsdp.engine.options",
    "ShardingEngine": "lightning_fsdp.engine.sharding_engine",
    "ShardingMonitor": "lightning_fsdp.monitor",
    "ShardingStrategy": "lightning_fsdp.engine.options",
    "StateDictType": "lightning_fsdp.checkpoint.routing",
    "UnevenBatchesError": "lightning_fsdp.even_batches",
    "estimate_memory": "lightning_fsdp.estimate",
    "export_safetensors": "lightning_fsdp.checkpoint.export",
    "fully_shard": "lightning_fsdp.engine.sharding",
    "get_engine": "lightning_fsdp.engine.registry",
    "load_pretrained": "lightning_fsdp.pretrained",
    "pipelined_loss": "lightning_fsdp.pipeline.runtime",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from accelerators import HPUAccelerator  # noqa: F401
    from lightning_fsdp.checkpoint.export import export_safetensors  # noqa: F401
    from lightning_fsdp.checkpoint.routing import StateDictType  # noqa: F401
    from lightning_fsdp.engine import ShardingEngine, fully_shard, get_engine  # noqa: F401
    from lightning_fsdp.engine.options import BackwardPrefetch, MixedPrecision, ShardingStrategy  # noqa: F401
    from lightning_fsdp.estimate import MemoryEstimate, estimate_memory  # noqa: F401
    from lightning_fsdp.even_batches import UnevenBatchesError  # noqa: F401
    from lightning_fsdp.monitor import ShardingMonitor  # noqa: F401
    from lightning_fsdp.pipeline import pipelined_loss  # noqa: F401
    from lightning_fsdp.pretrained import LoadResult, load_pretrained  # noqa: F401
    from lightning_fsdp.strategy import FSDPStrategy  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_fsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register_with_lightning()
