"""``trainer.fit(torch.compile(module))`` under fsdp_custom.

Lightning unwraps a compiled LightningModule (its ``forward`` and ``*_step`` methods stay compiled) and then refuses it
unless the strategy is one of its own three (``_verify_strategy_supports_compile`` checks ``isinstance``). fsdp_custom
runs compiled modules as those do (its hooks stay out of dynamo: [Note: compiled modules] in engine/state.py), so the
Trainer's check is wrapped to let it through and to ask Lightning's own check for every other strategy. The wrap is
done where the strategy is registered, so it needs no import of the strategy module (see registration.py's note).
"""

from __future__ import annotations

from typing import Any

_MARK = "_lightning_fsdp_accepts_compiled"


def accept_compiled_lightning_modules() -> None:
    """Let the Trainer accept a compiled LightningModule under fsdp_custom (idempotent)."""
    from lightning.pytorch.trainer import trainer as trainer_module

    lightning_check = getattr(trainer_module, "_verify_strategy_supports_compile", None)
    if lightning_check is None or getattr(lightning_check, _MARK, False):
        return  # a Lightning without this check (nothing to extend), or extended already

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        from lightning_fsdp.strategy import FSDPStrategy

        if not isinstance(strategy, FSDPStrategy):
            lightning_check(model, strategy)

    setattr(verify_strategy_supports_compile, _MARK, True)
    trainer_module._verify_strategy_supports_compile = verify_strategy_supports_compile
