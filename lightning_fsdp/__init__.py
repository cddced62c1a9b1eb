"""lightning-fsdp: Fully Sharded Data Parallel for PyTorch Lightning, on CPU, CUDA and Intel Gaudi.

Importing the package registers the ``"fsdp_custom"`` strategy (and its variants) and the ``"hpu"`` accelerator.
"""

from lightning.pytorch.strategies import StrategyRegistry

from accelerators import HPUAccelerator, register_hpu_accelerator
from lightning_fsdp.checkpoint.export import export_safetensors
from lightning_fsdp.config import BackwardPrefetch, MixedPrecision, ShardingStrategy, StateDictType
from lightning_fsdp.engine import ShardingEngine, fully_shard, get_engine
from lightning_fsdp.estimate import MemoryEstimate, estimate_memory
from lightning_fsdp.even_batches import UnevenBatchesError
from lightning_fsdp.monitor import ShardingMonitor
from lightning_fsdp.pipeline import pipelined_loss
from lightning_fsdp.pretrained import LoadResult, load_pretrained
from lightning_fsdp.strategy import FSDPStrategy

__version__ = "0.1.0"
__all__ = [
    "BackwardPrefetch",
    "FSDPStrategy",
    "HPUAccelerator",
    "LoadResult",
    "MemoryEstimate",
    "MixedPrecision",
    "ShardingEngine",
    "ShardingMonitor",
    "ShardingStrategy",
    "StateDictType",
    "UnevenBatchesError",
    "estimate_memory",
    "export_safetensors",
    "fully_shard",
    "get_engine",
    "load_pretrained",
    "pipelined_loss",
]

FSDPStrategy.register_strategies(StrategyRegistry)
register_hpu_accelerator()
