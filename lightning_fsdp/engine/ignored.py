"""The parameters of a sharded model that no unit shards (``ignored_states``, and those of ``ignored_modules``): whole
on every rank, their gradients averaged across ranks as DDP does, so every rank steps them alike."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.diagnostics import TAG_IGNORED_GRAD


class IgnoredParams:
    """One engine's ignored parameters and their gradient hooks (``ShardingEngine`` owns one)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: dict[int, str],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
    ) -> None:
        self.params = params
        self._ids = {id(p) for p in params}
        self._names = {id(p): names.get(id(p), "?") for p in params}
        self._shard_comm = shard_comm
        self._replicate_comm = replicate_comm
        self._hooked: set[int] = set()
        self._handles: list[RemovableHandle] = []
        self.nonfinite: list[str] = []  # anomaly checking: those whose gradient of this backward was not finite

    def holds(self, param: nn.Parameter) -> bool:
        return id(param) in self._ids

    def hook_trainable(self) -> None:
        # Ignored parameters that become trainable later get their gradient averaging then.
        for param in self.params:
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked.add(id(param))
                name = self._names[id(param)]
                self._handles.append(param.register_hook(lambda grad, name=name: self._average_grad(grad, name)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def _average_grad(self, grad: torch.Tensor, name: str) -> torch.Tensor:
        # This backward's contribution, before accumulation into .grad, as DDP: micro-batch accumulation stays right.
        if torch.is_anomaly_enabled() and not bool(torch.isfinite(grad).all()):
            self.nonfinite.append(name)
        grad = grad.clone()
        ranks = self._shard_comm.world_size
        self._shard_comm.check_same_collective(TAG_IGNORED_GRAD)
        self._shard_comm.all_reduce(grad)
        if self._replicate_comm is not None and self._replicate_comm.world_size > 1:
            self._replicate_comm.check_same_collective(TAG_IGNORED_GRAD)
            self._replicate_comm.all_reduce(grad)
            ranks *= self._replicate_comm.world_size
        return grad.div_(ranks)
