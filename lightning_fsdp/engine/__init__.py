"""The sharding engine: usable without Lightning.

>>> engine = fully_shard(model, auto_wrap_policy={Block})   # doctest: +SKIP
>>> loss = model(x).sum(); loss.backward(); optimizer.step()  # doctest: +SKIP
"""

from lightning_fsdp.engine.comm import CommStats, Communicator
from lightning_fsdp.engine.shard import ShardLayout
from lightning_fsdp.engine.sharding import fully_shard, get_engine
from lightning_fsdp.engine.state import ShardingEngine
from lightning_fsdp.engine.unit import FlatUnit

__all__ = ["CommStats", "Communicator", "FlatUnit", "ShardLayout", "ShardingEngine", "fully_shard", "get_engine"]
