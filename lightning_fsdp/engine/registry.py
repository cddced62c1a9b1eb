"""Which engine sharded which module, the live engines (held weakly), and one pair of process-wide optimizer-step
hooks for all of them: before a step an engine refuses held gradients, after it it reshards what the step made stale."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# A ShardingEngine (state.py, which imports this module): named, not imported, so the two form no import cycle.
ShardingEngine = Any

_ENGINE_ATTR = "_lightning_fsdp_engine"
_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()
_optimizer_hook_handles: list[Any] = []


def get_engine(module: nn.Module) -> ShardingEngine | None:
    """The engine that sharded ``module``, if any."""
    return module.__dict__.get(_ENGINE_ATTR)


def find_engine(module: nn.Module) -> ShardingEngine | None:
    """The live engine that sharded ``module`` or a module containing it (``self.model`` of a LightningModule)."""
    engine = get_engine(module)
    if engine is not None and not engine.closed:
        return engine
    return next((e for e in live_engines() if any(m is module for m in e.root.modules())), None)


def attach_engine(module: nn.Module, engine: ShardingEngine) -> None:
    module.__dict__[_ENGINE_ATTR] = engine


def detach_engine(module: nn.Module) -> None:
    """Forget the engine of ``module`` (after ``ShardingEngine.restore_unsharded``): it may be sharded again."""
    module.__dict__.pop(_ENGINE_ATTR, None)


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


def _before_any_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # A closure (Lightning's) runs forward and backward after this hook: its gradients are checked after the step.
    if args or kwargs.get("closure") is not None:
        return
    for engine in list(_LIVE_ENGINES):
        engine._check_held_gradients(optimizer, late=False)


def _after_any_optimizer_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    for engine in list(_LIVE_ENGINES):
        engine._check_held_gradients(optimizer, late=True)
    for engine in list(_LIVE_ENGINES):
        engine._after_optimizer_step()
