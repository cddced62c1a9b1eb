"""Activation checkpointing that composes with sharding (docs/activation-checkpointing.md): a chosen module's forward
runs under non-reentrant ``torch.utils.checkpoint``, and its unit's pre-backward hook gathers the parameters for the
recompute. Models whose forward takes ``use_cache`` (transformers' models) are called with ``use_cache=False`` while
training with gradients, since a layer that appends to a key/value cache appends again when it is recomputed."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp.engine.options import check_call_signature, parse_module_classes

CheckpointPolicy = Callable[[nn.Module], bool]
_MARK = "_lightning_fsdp_checkpointed"
_CACHE_OFF_MARK = "_lightning_fsdp_cache_off_in_training"


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
    """Checkpoint every submodule of ``root`` the policy selects (outermost wins); returns them. Every module above a
    chosen one whose forward takes ``use_cache`` gets it as ``False`` in training (``_turn_off_cache_in_training``)."""
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
    if chosen:
        chosen_ids = {id(module) for module in chosen}
        for module in root.modules():
            if id(module) not in chosen_ids and any(id(m) in chosen_ids for m in module.modules()):
                _turn_off_cache_in_training(module)
    return chosen


def _turn_off_cache_in_training(module: nn.Module) -> None:
    """If ``module.forward`` takes ``use_cache``, call it with ``use_cache=False`` whenever the module is training with
    gradients enabled; evaluation, ``generate()`` and ``torch.no_grad()`` keep the caller's (or the config's) choice.

    transformers' models default ``use_cache`` to ``config.use_cache`` (True for causal LMs), so each decoder layer
    appends its keys and values to a cache during the forward, and again when checkpointing recomputes it: the
    recomputed tensors then differ in shape and backward fails. transformers' own ``gradient_checkpointing_enable``
    turns the cache off under the same condition; this does the same for our policy, in every transformers version,
    without changing the model's config."""
    if getattr(module, _CACHE_OFF_MARK, False):
        return
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C-implemented forward: no use_cache to turn off
        return
    if "use_cache" not in signature.parameters:
        return

    def pre_hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not (mod.training and torch.is_grad_enabled()):
            return args, kwargs
        bound = signature.bind_partial(*args, **kwargs)
        if bound.arguments.get("use_cache"):
            warnings.warn(
                f"{type(mod).__name__} was called with use_cache=True while training with activation checkpointing; "
                "it runs with use_cache=False (a recomputed layer would append to the cache twice).",
                stacklevel=2,
            )
        if "use_cache" in bound.arguments and "use_cache" not in kwargs:  # given by position
            position = list(signature.parameters).index("use_cache")
            args = (*args[:position], False, *args[position + 1 :])
        else:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    setattr(module, _CACHE_OFF_MARK, True)
