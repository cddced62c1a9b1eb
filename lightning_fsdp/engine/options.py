"""The engine's options: the public option types with the parser of each value (the type itself or its YAML spelling,
a string or a dict; a bad value raises naming it and the valid choices), and ``ShardingOptions``, all of them
validated in one place for ``FSDPStrategy`` and ``fully_shard``.

[Note: validate before the first collective]
Every option is checked on every rank before any process group exists or before the first collective, so a bad
value raises the same error everywhere. Parsing a parsed value returns it unchanged."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across the shard group (docs/options.md)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward."""

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


def parse_enum(value: object, enum_cls: type[E], option: str, *, none_ok: bool = False) -> E | None:
    """A member of ``enum_cls`` from itself, its name (any case) or its value; also None with ``none_ok``."""
    if none_ok and value is None:
        return None
    return _parse_member(value, enum_cls, option, " or None" if none_ok else "")


def _parse_member(value: object, enum_cls: type[E], option: str, also_valid: str = "") -> E:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        for member in enum_cls:
            if value.upper() == member.name or value == member.value:
                return member
    choices = ", ".join(repr(m.value) for m in enum_cls) + also_valid
    raise ValueError(f"{option}={value!r} is not valid; choose one of {choices}.")


def parse_sharding_strategy(value: object) -> ShardingStrategy:
    return _parse_member(value, ShardingStrategy, "sharding_strategy")


# Selects a module when it returns something true (torch FSDP's lambda policies return booleans).
WrapPolicyCallable = Callable[[nn.Module, bool, int], object]


@dataclass(frozen=True)
class WrapPolicy:
    """A normalised auto-wrap policy: modules of ``classes``, those ``fn(module, recurse, nonwrapped_numel)`` selects
    (torch FSDP's meaning), and those with at least ``min_num_params`` parameters not already in a unit."""

    classes: tuple[type[nn.Module], ...] = ()
    fn: WrapPolicyCallable | None = None
    min_num_params: int | None = None


def parse_module_classes(value: object, option: str) -> tuple[type[nn.Module], ...]:
    """Accepts a set/list/tuple of ``nn.Module`` subclasses, or their import paths as strings."""
    if isinstance(value, (str, type)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{option}={value!r} is not valid; expected a set of nn.Module subclasses (or their import paths)."
        )
    classes = []
    for item in value:
        named = item if isinstance(item, str) else None
        if named is not None:
            item = _import_class(named, option)
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            what = f"names {named!r}, which is {item!r}," if named is not None else f"contains {item!r}, which is"
            raise TypeError(f"{option} {what} not an nn.Module subclass.")
        classes.append(item)
    return tuple(classes)


def _import_class(path: str, option: str) -> type:
    import importlib

    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{option} names {path!r}, which cannot be imported: {err}") from err


def parse_auto_wrap_policy(value: object) -> WrapPolicy:
    """Normalises ``auto_wrap_policy``: a set of module classes, a callable, an int minimum parameter count or None."""
    if value is None:
        return WrapPolicy()
    if isinstance(value, WrapPolicy):
        return value
    if isinstance(value, bool):
        raise TypeError(_wrap_policy_error(value))
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"auto_wrap_policy={value!r}: a minimum parameter count must be a positive int.")
        return WrapPolicy(min_num_params=value)
    if isinstance(value, type) and issubclass(value, nn.Module):
        return WrapPolicy(classes=(value,))
    if isinstance(value, (set, frozenset, list, tuple)):
        return WrapPolicy(classes=parse_module_classes(value, "auto_wrap_policy"))
    if callable(value):
        check_call_signature(value, "auto_wrap_policy", "(module, recurse, nonwrapped_numel)")
        return WrapPolicy(fn=value)
    raise TypeError(_wrap_policy_error(value))


def check_call_signature(fn: Callable[..., object], option: str, call: str) -> None:
    """Raise a ``TypeError`` naming ``option`` if ``fn`` cannot take the positional arguments ``call`` lists (e.g.
    ``"(module)"``), on every rank, before sharding starts. Signatures Python cannot inspect pass."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    count = len(call.strip("()").split(","))
    try:
        signature.bind(*([None] * count))
    except TypeError as err:
        raise TypeError(f"{option}={fn!r} cannot be called as {option}{call}: {err}.") from None


def _wrap_policy_error(value: object) -> str:
    return (
        f"auto_wrap_policy={value!r} ({type(value).__name__}) is not valid; expected a set of nn.Module "
        "classes, a callable (module, recurse, nonwrapped_numel) -> bool, a positive int minimum parameter "
        "count, or None."
    )


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute, full-precision master shards; the fields: docs/options.md ("Mixed precision")."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    reduce_wire_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "reduce_wire_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(
                    f"MixedPrecision({name}={value!r}) is not valid; expected a floating torch.dtype or None."
                )
        for name in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MixedPrecision({name}={getattr(self, name)!r}) is not valid; expected True or False.")
        if self.keep_low_precision_grads:
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) is not supported: the full-precision shards are the "
                "optimizer's master weights and a parameter's .grad must have its dtype, so reduced gradients are "
                "always converted to the shards' dtype. Use keep_low_precision_grads=False."
            )
        if self.reduce_wire_dtype is not None and self.reduce_wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"MixedPrecision(reduce_wire_dtype={self.reduce_wire_dtype!r}) is not valid; expected one of "
                f"{', '.join(map(str, WIRE_DTYPES))} or None."
            )
        summed_in = self.effective_reduce_dtype
        if self.reduce_wire_dtype is not None and summed_in is not None:
            check_wire_narrower(self.reduce_wire_dtype, summed_in)

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


WIRE_DTYPES = (torch.bfloat16, torch.float16)


def check_wire_narrower(wire: torch.dtype, summed_in: torch.dtype) -> None:
    """A wire dtype only helps when it is narrower than the dtype the reduction sums in."""
    if torch.finfo(wire).bits >= torch.finfo(summed_in).bits:
        raise ValueError(
            f"MixedPrecision(reduce_wire_dtype={wire}) must be narrower than the dtype gradients are reduced in "
            f"({summed_in}: reduce_dtype, else param_dtype, else the parameters' dtype); it would move the same bytes "
            "and round the same way. Set reduce_dtype=torch.float32 to send bfloat16 and sum in float32, or drop "
            "reduce_wire_dtype."
        )


def parse_mixed_precision(value: object) -> MixedPrecision | None:
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, dict):
        fields = list(MixedPrecision.__dataclass_fields__)
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ValueError(
                f"mixed_precision={value!r} has unknown field(s) {', '.join(map(repr, unknown))}; the fields of "
                f"MixedPrecision are {', '.join(fields)}."
            )
        # The values as the user gave them, dtypes spelled as strings parsed: MixedPrecision checks every field.
        given: dict[str, Any] = {k: _parse_dtype(v, k) if k.endswith("_dtype") else v for k, v in value.items()}
        return MixedPrecision(**given)
    raise TypeError(f"mixed_precision={value!r} is not valid; expected lightning_fsdp.MixedPrecision, a dict or None.")


def _parse_dtype(value: object, field: str) -> object:
    # YAML configs spell dtypes as strings: "bfloat16", "torch.float16".
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"MixedPrecision({field}={value!r}) is not a torch dtype; use e.g. 'bfloat16', 'float16' or 'float32'."
            )
        return dtype
    return value


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
    param_init_fn: Callable[[nn.Module], object] | None = None
    # Modules (or, for the strategy, names of them); ``ignored_states`` also parameters (or their names).
    ignored_modules: tuple[object, ...] = ()
    ignored_states: tuple[object, ...] = ()
    reshard_after_forward: bool | int | None = None  # None: the sharding strategy's default

    @classmethod
    def parse(
        cls,
        *,
        sharding_strategy: object = ShardingStrategy.FULL_SHARD,
        auto_wrap_policy: object = None,
        mixed_precision: object = None,
        backward_prefetch: object = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: object = False,
        limit_all_gathers: object = True,
        sync_module_states: object = False,
        cpu_offload: object = False,
        param_init_fn: object = None,
        ignored_modules: object = None,
        ignored_states: object = None,
        reshard_after_forward: object = None,
        names: bool = False,
    ) -> ShardingOptions:
        """Check and normalise the user's values; raises ``TypeError`` / ``ValueError`` naming the bad one. ``names``:
        the ignored entries may be strings (YAML), which the strategy resolves once the model exists."""
        cpu_offload = getattr(cpu_offload, "offload_params", cpu_offload)  # torch's CPUOffload(offload_params=...)
        flags = {
            option: check_flag(flag, option)
            for option, flag in (
                ("forward_prefetch", forward_prefetch),
                ("limit_all_gathers", limit_all_gathers),
                ("sync_module_states", sync_module_states),
                ("cpu_offload", cpu_offload),
            )
        }
        if param_init_fn is not None:
            if not callable(param_init_fn):
                raise TypeError(f"param_init_fn={param_init_fn!r} is not callable.")
            check_call_signature(param_init_fn, "param_init_fn", "(module)")
        checked_reshard_after_forward = check_reshard_after_forward(reshard_after_forward)
        name_kind = (str,) if names else ()
        return cls(
            sharding_strategy=parse_sharding_strategy(sharding_strategy),
            auto_wrap_policy=parse_auto_wrap_policy(auto_wrap_policy),
            mixed_precision=parse_mixed_precision(mixed_precision),
            backward_prefetch=parse_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch", none_ok=True),
            forward_prefetch=flags["forward_prefetch"],
            limit_all_gathers=flags["limit_all_gathers"],
            sync_module_states=flags["sync_module_states"],
            cpu_offload=flags["cpu_offload"],
            param_init_fn=param_init_fn,
            ignored_modules=item_list(ignored_modules, "ignored_modules", (nn.Module, *name_kind)),
            ignored_states=item_list(ignored_states, "ignored_states", (nn.Parameter, nn.Module, *name_kind)),
            reshard_after_forward=checked_reshard_after_forward,
        )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, object], *, names: bool = False) -> ShardingOptions:
        """``parse`` over the entries of ``arguments`` named like the fields (callers pass their ``locals()``, so the
        list of options is written once, here; a caller missing one raises ``KeyError``)."""
        fields = [field.name for field in dataclasses.fields(cls)]
        return cls.parse(**{name: arguments[name] for name in fields}, names=names)

    def as_kwargs(self) -> dict[str, Any]:
        """The options as ``fully_shard`` keyword arguments."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def check_flag(value: object, option: str) -> bool:
    """A boolean option: ``True`` or ``False`` only (not 1, "yes" or None, which YAML configs produce by mistake).
    Returns it."""
    if not isinstance(value, bool):
        raise TypeError(f"{option}={value!r} is not valid; expected True or False.")
    return value


def check_reshard_after_forward(value: object, shard_group_size: int | None = None) -> bool | int | None:
    """None, True, False, or an int N with 1 < N < ``shard_group_size`` dividing it (ZeRO++ hpZ). Without
    ``shard_group_size`` (no process group yet) only what does not depend on it is checked. Returns it."""
    if value is None or isinstance(value, bool):
        return value
    expected = "True, False, None (the sharding strategy decides) or an int N"
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward={value!r} is not valid; expected {expected}.")
    if shard_group_size is None:
        if value < 2:
            raise ValueError(
                f"reshard_after_forward={value!r} is not valid; expected {expected} with 1 < N < the shard group's "
                "size, dividing it (the size of the smaller group each unit reshards to after forward)."
            )
        return value
    valid = [n for n in range(2, shard_group_size) if shard_group_size % n == 0]
    if value not in valid:
        choices = ", ".join(map(str, valid)) if valid else f"none for a shard group of {shard_group_size}"
        raise ValueError(
            f"reshard_after_forward={value!r} is not valid for a shard group of {shard_group_size} rank(s); expected "
            f"{expected} with 1 < N < {shard_group_size} dividing {shard_group_size} (valid ints: {choices})."
        )
    return value


def item_list(value: object, option: str, kinds: tuple[type, ...]) -> tuple[object, ...]:
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
    items: tuple[object, ...]
    if isinstance(value, (nn.Module, torch.Tensor, str, bytes, Mapping)) or not isinstance(value, Iterable):
        items = (value,)
    else:
        items = tuple(value)
    for item in items:
        if not isinstance(item, kinds):
            hint = " (a string names a submodule or parameter of the LightningModule)" if str in kinds else ""
            raise TypeError(f"{option} contains {item!r}; expected {spelled} objects{hint}.")
    return items


_KIND_NAMES = {nn.Module: "nn.Module", nn.Parameter: "nn.Parameter"}


def split_ignored(root: nn.Module, options: ShardingOptions) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The ignored modules and the ignored parameters of ``root`` (``ignored_states`` holds both kinds)."""
    modules = list(options.ignored_modules)
    params: list[object] = []
    for item in options.ignored_states:
        (modules if isinstance(item, nn.Module) else params).append(item)
    own_modules = _own_entries("ignored_modules", modules, root.modules(), root, "submodule")
    return own_modules, _own_entries("ignored_states", params, root.parameters(), root, "parameter")


def _own_entries(option: str, items: list[object], own: Iterable[T], root: nn.Module, kind: str) -> list[T]:
    """``items``, each one of ``own`` (``root``'s); raise for an entry that is not (a module of another model instance
    would be silently sharded)."""
    own_by_id = {id(x): x for x in own}
    for item in items:
        if id(item) not in own_by_id:
            raise ValueError(
                f"{option} contains {_describe(item)} that is not a {kind} of {type(root).__name__} (a "
                f"{kind.removeprefix('sub')} of another model instance?)."
            )
    return [own_by_id[id(item)] for item in items]


def _describe(item: object) -> str:
    if isinstance(item, torch.Tensor):
        return f"a parameter of shape {tuple(item.shape)}"
    return f"a {type(item).__name__}"
