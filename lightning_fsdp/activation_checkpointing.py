"""Activation checkpointing that composes with sharding (docs/activation-checkpointing.md): a chosen module's forward
runs under non-reentrant ``torch.utils.checkpoint``, and its unit's pre-backward hook gathers the parameters for the
recompute."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp.engine.options import check_call_signature, parse_module_classes

CheckpointPolicy = Callable[[nn.Module], bool]
_MARK = "_lightning_fsdp_checkpointed"


def parse_checkpointing_policy(value: object) -> CheckpointPolicy | None:
    """``None``, a set/list of module classes (or import paths), or a callable ``(module) -> bool``."""
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, nn.Module):
        value = {value}
    if isinstance(value, (set, frozenset, list, tuple)):
        classes = parse_module_classes(value, "activation_checkpointing_policy")
        return lambda module: isinstance(module, classes)
    if callable(value):
        check_call_signature(value, "activation_checkpointing_policy", "(module)")
        return value
    raise TypeError(
        f"activation_checkpointing_policy={value!r} is not valid; expected a set of nn.Module classes (or their "
        "import paths), a callable (module) -> bool, or None."
    )


def apply_activation_checkpointing(root: nn.Module, policy: CheckpointPolicy) -> list[nn.Module]:
    """Checkpoint every submodule of ``root`` the policy selects (outermost wins); returns them."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if policy(child):
                chosen.append(child)
            else:
                visit(child)

    visit(root)
    for module in chosen:
        if getattr(module, _MARK, False):
            continue
        original = module.forward

        @functools.wraps(original)
        def forward(*args: object, __original: Callable[..., object] = original, **kwargs: Any) -> object:
            return checkpoint(__original, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        setattr(module, _MARK, True)
    return chosen
