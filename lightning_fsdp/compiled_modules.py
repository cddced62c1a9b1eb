"""``trainer.fit(torch.compile(module))`` under fsdp_custom.
Lightning's ``_verify_strategy_supports_compile`` accepts only its own strategies (``isinstance``); it is wrapped to
let fsdp_custom through (docs/decisions.md, "torch.compile"). Done at registration, so the strategy is not imported."""

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
