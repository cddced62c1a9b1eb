"""Registering ``"fsdp_custom"`` (and its variants) and ``"hpu"`` with Lightning, and letting
``trainer.fit(torch.compile(module))`` through under fsdp_custom.

[Note: registration without importing Lightning]
``import lightning_fsdp.engine`` runs the package's ``__init__`` and must not import Lightning, so registration
happens at once if ``lightning.pytorch`` is imported, else right after it is, via a one-shot ``sys.meta_path`` finder
(importlib has no public post-import hook). The module importing Lightning may be one of ours, half-imported, so the
entry is ``build_strategy``, importing the strategy only when a Trainer asks. Failures are logged, never raised, so
``import lightning`` never breaks for code that does not use this package."""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry
    from lightning.pytorch.strategies import Strategy

    from lightning_fsdp.strategy import FSDPStrategy

_log = logging.getLogger(__name__)
_LIGHTNING = "lightning.pytorch"


def register_with_lightning() -> None:
    """Register the strategies and the accelerator now, or once ``lightning.pytorch`` is imported."""
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_LIGHTNING, _register_logging_failure))


# (name, start_method, other FSDPStrategy arguments) of each strategy registered.
STRATEGY_NAMES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("fsdp_custom", "popen", {}),
    ("fsdp_custom_spawn", "spawn", {}),
    ("fsdp_custom_fork", "fork", {}),
    ("fsdp_custom_shard_grad_op", "popen", {"sharding_strategy": "SHARD_GRAD_OP"}),
    ("fsdp_custom_no_shard", "popen", {"sharding_strategy": "NO_SHARD"}),
)


# Modules that, imported, register an accelerator with Lightning and its device runtime with the strategy and the
# engine (lightning_fsdp/engine/devices.py, [Note: adding an accelerator]): a new accelerator is one module plus its
# name here.
ACCELERATOR_MODULES = ("accelerators.hpu",)


def build_strategy(**options: Any) -> FSDPStrategy:  # FSDPStrategy's arguments, each of its own type
    """What Lightning's registry calls for ``Trainer(strategy="fsdp_custom")``: ``FSDPStrategy(**options)``, imported
    only then, so that registering never imports the strategy module (which may be mid-import at that moment)."""
    from lightning_fsdp.strategy import FSDPStrategy

    return FSDPStrategy(**options)


def register_strategies(registry: _StrategyRegistry) -> None:
    for name, start_method, extra in STRATEGY_NAMES:
        if name not in registry:
            description = f"lightning-fsdp's FSDP strategy ({name})"
            # Not overriding a strategy of that name (override=False); FSDPStrategy's arguments after it.
            registry.register(name, build_strategy, description, False, start_method=start_method, **extra)


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_strategies(StrategyRegistry)
    accept_compiled_lightning_modules()
    # Each registers its accelerator and device runtime when its own import finishes. That import may be the one in
    # progress: `import accelerators` before Lightning imports Lightning from accelerators/hpu.py, which runs this
    # half-way through that file.
    for module in ACCELERATOR_MODULES:
        importlib.import_module(module)


_MARK = "_lightning_fsdp_accepts_compiled"


def accept_compiled_lightning_modules() -> None:
    """Let the Trainer accept a compiled LightningModule under fsdp_custom (idempotent): Lightning's
    ``_verify_strategy_supports_compile`` accepts only its own strategies (``isinstance``), so it is wrapped to let
    fsdp_custom through (docs/decisions.md, "torch.compile")."""
    from lightning.pytorch.trainer import trainer as trainer_module

    lightning_check = getattr(trainer_module, "_verify_strategy_supports_compile", None)
    if lightning_check is None or getattr(lightning_check, _MARK, False):
        return  # a Lightning without this check (nothing to extend), or extended already

    def verify_strategy_supports_compile(model: pl.LightningModule, strategy: Strategy) -> None:
        from lightning_fsdp.strategy import FSDPStrategy

        if not isinstance(strategy, FSDPStrategy):
            lightning_check(model, strategy)

    setattr(verify_strategy_supports_compile, _MARK, True)
    trainer_module._verify_strategy_supports_compile = verify_strategy_supports_compile


def _register_logging_failure() -> None:
    try:
        _register()
    except Exception as error:  # noqa: BLE001 - see the Note: never break the user's import of Lightning
        _log.warning("lightning-fsdp could not register strategy 'fsdp_custom' with Lightning: %r", error)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after the module ``name`` has been executed by its own loader."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the finders below locate the module as they would have
        spec = _find_with(sys.meta_path, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, callback = spec.loader.exec_module, self.callback

        def exec_module(module: ModuleType) -> None:
            execute(module)
            callback()

        # This module's own loader object, not a shared one; the wrapper stands in for its method (importlib has no
        # post-import hook: see the Note), which mypy refuses as assigning to a method.
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find_with(
    finders: Sequence[object], fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in finders:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec is not None else None
        if spec is not None:
            return spec
    return None
