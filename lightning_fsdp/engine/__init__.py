"""The sharding engine: usable without Lightning (it imports nothing from the rest of the package or from Lightning).

>>> engine = fully_shard(model, auto_wrap_policy={Block})   # doctest: +SKIP
>>> loss = model(x).sum(); loss.backward(); optimizer.step()  # doctest: +SKIP

docs/how-it-works.md maps its modules and follows a parameter through them.
"""

from lightning_fsdp.engine.comm import CommStats, Communicator, gather_rows
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.options import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingOptions,
    ShardingStrategy,
    WrapPolicy,
)
from lightning_fsdp.engine.records import ParamSlot
from lightning_fsdp.engine.registry import get_engine
from lightning_fsdp.engine.sharding import fully_shard
from lightning_fsdp.engine.sharding_engine import ShardingEngine
from lightning_fsdp.engine.unit import FlatUnit

__all__ = [
    "BackwardPrefetch",
    "CommStats",
    "Communicator",
    "FlatUnit",
    "MixedPrecision",
    "ParamSlot",
    "ShardLayout",
    "ShardingEngine",
    "ShardingOptions",
    "ShardingStrategy",
    "WrapPolicy",
    "fully_shard",
    "gather_rows",
    "get_engine",
]
