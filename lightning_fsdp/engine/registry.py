"""Which engine sharded which module, the live engines (held weakly), and one pair of process-wide optimizer-step
hooks for all of them: before a step an engine refuses held gradients, after it it reshards what the step made stale.

[Note: the module-to-engine map]
As torch FSDP2's ``_module_state_mapping``: a ``WeakKeyDictionary`` owned here, from a module to a weak reference to
its engine, so that the registry keeps neither alive (an engine holds its module, so a strong value would keep its
key, and both, alive for good). The module keeps its engine alive instead, through the hooks the engine put on it,
which stay until ``ShardingEngine.restore_unsharded`` detaches the engine."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:  # sharding_engine.py imports this module
    from lightning_fsdp.engine.sharding_engine import ShardingEngine

_ENGINE_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardingEngine]] = weakref.WeakKeyDictionary()
_LIVE_ENGINES: weakref.WeakSet[ShardingEngine] = weakref.WeakSet()
_optimizer_hook_handles: list[RemovableHandle] = []


def get_engine(module: nn.Module) -> ShardingEngine | None:
    """The engine that sharded ``module``, if any."""
    ref = _ENGINE_OF.get(module)
    return ref() if ref is not None else None


def find_engine(module: nn.Module) -> ShardingEngine | None:
    """The live engine that sharded ``module`` or a module containing it (``self.model`` of a LightningModule)."""
    engine = get_engine(module)
    if engine is not None and not engine.closed:
        return engine
    return next((e for e in live_engines() if any(m is module for m in e.root.modules())), None)


def attach_engine(module: nn.Module, engine: ShardingEngine) -> None:
    """Record that ``engine`` sharded ``module`` (see [Note: the module-to-engine map])."""
    _ENGINE_OF[module] = weakref.ref(engine)


def detach_engine(module: nn.Module) -> None:
    """Forget the engine of ``module`` (after ``ShardingEngine.restore_unsharded``): it may be sharded again."""
    _ENGINE_OF.pop(module, None)


def live_engines() -> list[ShardingEngine]:
    """Every engine not yet closed (``restore_unsharded``), in no particular order."""
    return [engine for engine in list(_LIVE_ENGINES) if not engine.closed]


def watch_optimizer_steps(engine: ShardingEngine) -> None:
    _LIVE_ENGINES.add(engine)
    if not _optimizer_hook_handles:
        _optimizer_hook_handles.append(register_optimizer_step_pre_hook(_before_any_optimizer_step))
        _optimizer_hook_handles.append(register_optimizer_step_post_hook(_after_any_optimizer_step))


def unwatch_optimizer_steps(engine: ShardingEngine) -> None:
    _LIVE_ENGINES.discard(engine)


def _before_any_optimizer_step(optimizer: Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    # A closure (Lightning's) runs forward and backward after this hook: its gradients are checked after the step.
    if args or kwargs.get("closure") is not None:
        return
    for engine in list(_LIVE_ENGINES):
        engine._check_held_gradients(optimizer, late=False)


def _after_any_optimizer_step(optimizer: Optimizer, _args: tuple[object, ...], _kwargs: dict[str, object]) -> None:
    for engine in list(_LIVE_ENGINES):
        engine._check_held_gradients(optimizer, late=True)
    for engine in list(_LIVE_ENGINES):
        engine._after_optimizer_step()
