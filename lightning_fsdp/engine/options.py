"""``ShardingOptions``: the engine's options, validated in one place for ``FSDPStrategy`` and ``fully_shard``.

[Note: validate before the first collective]
Every option is checked on every rank before any process group exists or before the first collective, so a bad
value raises the same error everywhere. Parsing a parsed value returns it unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_fsdp.engine.config import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    WrapPolicy,
    check_call_signature,
    parse_auto_wrap_policy,
    parse_enum,
    parse_mixed_precision,
    parse_sharding_strategy,
)


@dataclass(frozen=True)
class ShardingOptions:
    """The validated options of the sharding engine; build it with ``parse``, where every value is checked.
    ``mixed_precision`` is None when not given (the strategy then takes it from ``Trainer(precision=...)``)."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_policy: WrapPolicy = WrapPolicy()
    mixed_precision: MixedPrecision | None = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    sync_module_states: bool = False
    cpu_offload: bool = False
    param_init_fn: Callable[[nn.Module], None] | None = None
    ignored_modules: tuple[Any, ...] = ()
    ignored_states: tuple[Any, ...] = ()
    reshard_after_forward: bool | int | None = None  # None: the sharding strategy's default

    @classmethod
    def parse(
        cls,
        *,
        sharding_strategy: Any = ShardingStrategy.FULL_SHARD,
        auto_wrap_policy: Any = None,
        mixed_precision: Any = None,
        backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: Any = False,
        limit_all_gathers: Any = True,
        sync_module_states: Any = False,
        cpu_offload: Any = False,
        param_init_fn: Any = None,
        ignored_modules: Any = None,
        ignored_states: Any = None,
        reshard_after_forward: Any = None,
        names: bool = False,
    ) -> ShardingOptions:
        """Check and normalise the user's values; raises ``TypeError`` / ``ValueError`` naming the bad one. ``names``:
        the ignored entries may be strings (YAML), which the strategy resolves once the model exists."""
        cpu_offload = getattr(cpu_offload, "offload_params", cpu_offload)  # torch's CPUOffload(offload_params=...)
        for option, flag in (
            ("forward_prefetch", forward_prefetch),
            ("limit_all_gathers", limit_all_gathers),
            ("sync_module_states", sync_module_states),
            ("cpu_offload", cpu_offload),
        ):
            check_flag(flag, option)
        if param_init_fn is not None:
            if not callable(param_init_fn):
                raise TypeError(f"param_init_fn={param_init_fn!r} is not callable.")
            check_call_signature(param_init_fn, "param_init_fn", "(module)")
        check_reshard_after_forward(reshard_after_forward)
        name_kind = (str,) if names else ()
        return cls(
            sharding_strategy=parse_sharding_strategy(sharding_strategy),
            auto_wrap_policy=parse_auto_wrap_policy(auto_wrap_policy),
            mixed_precision=parse_mixed_precision(mixed_precision),
            backward_prefetch=parse_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch", none_ok=True),
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            sync_module_states=sync_module_states,
            cpu_offload=cpu_offload,
            param_init_fn=param_init_fn,
            ignored_modules=item_list(ignored_modules, "ignored_modules", (nn.Module, *name_kind)),
            ignored_states=item_list(ignored_states, "ignored_states", (nn.Parameter, nn.Module, *name_kind)),
            reshard_after_forward=reshard_after_forward,
        )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], *, names: bool = False) -> ShardingOptions:
        """``parse`` over the entries of ``arguments`` named like the fields (callers pass their ``locals()``, so the
        list of options is written once, here; a caller missing one raises ``KeyError``)."""
        fields = [field.name for field in dataclasses.fields(cls)]
        return cls.parse(**{name: arguments[name] for name in fields}, names=names)

    def as_kwargs(self) -> dict[str, Any]:
        """The options as ``fully_shard`` keyword arguments."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def check_flag(value: Any, option: str) -> None:
    """A boolean option: ``True`` or ``False`` only (not 1, "yes" or None, which YAML configs produce by mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{option}={value!r} is not valid; expected True or False.")


def check_reshard_after_forward(value: Any, shard_group_size: int | None = None) -> None:
    """None, True, False, or an int N with 1 < N < ``shard_group_size`` dividing it (ZeRO++ hpZ). Without
    ``shard_group_size`` (no process group yet) only what does not depend on it is checked."""
    if value is None or isinstance(value, bool):
        return
    expected = "True, False, None (the sharding strategy decides) or an int N"
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward={value!r} is not valid; expected {expected}.")
    if shard_group_size is None:
        if value < 2:
            raise ValueError(
                f"reshard_after_forward={value!r} is not valid; expected {expected} with 1 < N < the shard group's "
                "size, dividing it (the size of the smaller group each unit reshards to after forward)."
            )
        return
    valid = [n for n in range(2, shard_group_size) if shard_group_size % n == 0]
    if value not in valid:
        choices = ", ".join(map(str, valid)) if valid else f"none for a shard group of {shard_group_size}"
        raise ValueError(
            f"reshard_after_forward={value!r} is not valid for a shard group of {shard_group_size} rank(s); expected "
            f"{expected} with 1 < N < {shard_group_size} dividing {shard_group_size} (valid ints: {choices})."
        )


def item_list(value: Any, option: str, kinds: tuple[type, ...]) -> tuple:
    """An iterable of entries, or one entry (a module, even an ``nn.ModuleList``, a tensor, a string, a mapping), as a
    tuple whose entries are all instances of ``kinds``."""
    if value is None:
        return ()
    names = [_KIND_NAMES.get(kind, kind.__name__) for kind in kinds]
    spelled = " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
    if isinstance(value, str) and str not in kinds:
        raise TypeError(
            f"{option}={value!r} is not valid; expected an iterable of {spelled} objects (names of "
            "submodules are resolved by FSDPStrategy, not by fully_shard)."
        )
    single = isinstance(value, (nn.Module, torch.Tensor, str, bytes, Mapping)) or not isinstance(value, Iterable)
    items = (value,) if single else tuple(value)
    for item in items:
        if not isinstance(item, kinds):
            hint = " (a string names a submodule or parameter of the LightningModule)" if str in kinds else ""
            raise TypeError(f"{option} contains {item!r}; expected {spelled} objects{hint}.")
    return items


_KIND_NAMES = {nn.Module: "nn.Module", nn.Parameter: "nn.Parameter"}


def split_ignored(root: nn.Module, options: ShardingOptions) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The ignored modules and the ignored parameters of ``root`` (``ignored_states`` holds both kinds)."""
    modules = list(options.ignored_modules)
    params = []
    for item in options.ignored_states:
        (modules if isinstance(item, nn.Module) else params).append(item)
    _refuse_foreign("ignored_modules", modules, root.modules(), root, "submodule", lambda m: f"a {type(m).__name__}")
    _refuse_foreign(
        "ignored_states",
        params,
        root.parameters(),
        root,
        "parameter",
        lambda p: f"a parameter of shape {tuple(p.shape)}",
    )
    return modules, params


def _refuse_foreign(
    option: str, items: list, own: Iterable[Any], root: nn.Module, kind: str, describe: Callable[[Any], str]
) -> None:
    """Raise for an entry that is not ``root``'s own (a module of another model instance would be silently sharded)."""
    own_ids = {id(x) for x in own}
    for item in items:
        if id(item) not in own_ids:
            raise ValueError(
                f"{option} contains {describe(item)} that is not a {kind} of {type(root).__name__} (a "
                f"{kind.removeprefix('sub')} of another model instance?)."
            )
