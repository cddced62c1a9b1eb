"""The sharding engine: usable without Lightning.

>>> engine = fully_shard(model, auto_wrap_policy={Block})   # doctest: +SKIP
>>> loss = model(x).sum(); loss.backward(); optimizer.step()  # doctest: +SKIP

One concept per module (as torch's ``torch/distributed/fsdp/_fully_shard``):

* ``sharding``: ``fully_shard``, which turns a module into units and the engine that drives them;
* ``wrap``: which modules become units, and which unit owns each parameter;
* ``layout``: the chunking rule, i.e. which rows of a parameter each rank holds (``ShardLayout``);
* ``unit``: one unit's flat buffers and its unshard / reshard / gradient reduction (``FlatUnit``);
* ``state``: the runtime that drives the units from module and autograd hooks (``ShardingEngine``);
* ``comm``: the collectives, behind one small interface that counts their bytes (``Communicator``).
"""

from lightning_fsdp.engine.comm import CommStats, Communicator
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.sharding import fully_shard, get_engine
from lightning_fsdp.engine.state import ShardingEngine
from lightning_fsdp.engine.unit import FlatUnit

__all__ = ["CommStats", "Communicator", "FlatUnit", "ShardLayout", "ShardingEngine", "fully_shard", "get_engine"]
