"""Test double of ``habana_frameworks.torch.distributed.hccl``: importing it registers an ``"hccl"`` backend.

The backend is gloo underneath, so ``torch.distributed.init_process_group("hccl", ...)`` and every collective
work on CPU tensors exactly as the engine issues them on Gaudi.
"""

from datetime import timedelta

import torch.distributed as dist


def _create_hccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    # Torch calls this once per process group with a store already prefixed for that group, so sub-groups
    # (e.g. HYBRID_SHARD's shard and replicate groups) each get their own gloo context.
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


# Only "cpu": the double's "hpu" compute runs on CPU tensors, and listing "cpu" keeps gloo the default for plain
# CPU groups (torch does not remap a device that already has a backend). Re-registering on a re-import is harmless:
# torch just replaces the creator with an identical one.
dist.Backend.register_backend("hccl", _create_hccl_backend, devices=["cpu"])
