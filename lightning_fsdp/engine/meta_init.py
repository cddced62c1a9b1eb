"""Meta-device initialisation: parameters without memory, buffers computed for real, and a record of the tensors
that were given memory but no values, so that nothing ever computes from them. Why each part is as it is:
docs/how-it-works.md, "Meta-device initialisation". Beyond it: a parameter exists for real only between its creation
and its registration, one at a time, and a partial write (one row) counts as initialising a tensor."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch._ops import OpOverload
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

PARAMETER, BUFFER = "parameter", "buffer"
_EMPTY_FACTORIES = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
)
_NAMES_SHOWN = 20


class UninitialisedTensorError(RuntimeError):
    """A model built on the meta device was about to compute from tensors that were never given values."""


@contextmanager
def parameters_on_meta(enabled: bool = True) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and everything else (buffers, plain tensors)
    where tensors are created now (``nn.Module.register_parameter`` is patched). Not thread-safe: the patch is
    process-wide while the context is open."""
    if not enabled:
        yield
        return
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, _to_meta(param) if param is not None and not param.is_meta else param)

    # Patching the method of every module is the point (modules built inside call it from their constructors).
    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]  # restored, as above


def _to_meta(param: nn.Parameter) -> nn.Parameter:
    # A parameter already on the meta device is registered as it is (a tie made in the constructor stays one object).
    if type(param) is nn.Parameter:
        meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        for name, value in vars(param).items():  # attributes set on the parameter (e.g. no-weight-decay flags)
            setattr(meta, name, value)
        return meta
    # A subclass takes its attributes as keyword arguments, as accelerate rebuilds it.
    return type(param)(param.detach().to("meta"), **{**vars(param), "requires_grad": param.requires_grad})


def _storage_ptr(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (shared by its views), 0 where it has none to speak of."""
    if tensor.is_meta or tensor.numel() == 0:
        return 0
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without an accessible storage (e.g. functional ones)
        return 0


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class InitWatch(TorchDispatchMode):
    """While active: the storages allocated empty and not written since. Every aten op passes through here (``.data``
    writes too): an argument its schema marks as written stops being empty; an empty factory's new result is empty."""

    def __init__(self) -> None:
        super().__init__()
        self._empty: set[int] = set()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                for tensor in _tensors(value):
                    self._empty.discard(_storage_ptr(tensor))
        empty = func.overloadpacket.__name__ in _EMPTY_FACTORIES
        results = out if isinstance(out, (tuple, list)) else (out,)
        for returned, value in zip(schema.returns, results):
            if returned.alias_info is None:  # new memory, not a view of an argument
                for tensor in _tensors(value):
                    ptr = _storage_ptr(tensor)
                    if empty and ptr:
                        self._empty.add(ptr)
                    else:
                        self._empty.discard(ptr)
        return out

    def is_empty(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory was allocated empty while watching and never written since."""
        ptr = _storage_ptr(tensor)
        return ptr != 0 and ptr in self._empty


def own_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``module``'s own parameters and buffers (not its children's) as (kind, attribute name, tensor)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield PARAMETER, name, param
    for name, buf in module._buffers.items():
        if buf is not None:
            yield BUFFER, name, buf


class _Entry:
    __slots__ = ("kind", "name", "owner", "ref")

    def __init__(self, name: str, kind: str, owner: str, tensor: torch.Tensor) -> None:
        self.name = name
        self.kind = kind
        self.owner = owner  # the class of the module holding it
        self.ref = weakref.ref(tensor)


# torch has only process-wide optimizer hooks: one, never removed (it may be running), checks the live records.
_LIVE: weakref.WeakSet[Uninitialised] = weakref.WeakSet()
_optimizer_hook: list[RemovableHandle] = []


class Uninitialised:
    """The tensors of one model that have memory but no values yet. Guards the model while it is not empty; ``len``
    is the number of tensors still recorded."""

    def __init__(self, root: nn.Module, entries: list[tuple[str, str, nn.Module, torch.Tensor]]) -> None:
        self.root_name = type(root).__name__
        self.root = weakref.ref(root)
        self._entries: dict[int, _Entry] = {}
        for name, kind, owner, tensor in entries:
            self._entries.setdefault(id(tensor), _Entry(name, kind, type(owner).__name__, tensor))
        self._handles: list[RemovableHandle] = []
        if not self._entries:
            return
        self._param_ids = {id(p) for p in root.parameters()}
        # Each module guards only its tree's recorded tensors: called alone it raises only if it could use one.
        modules = dict(root.named_modules(remove_duplicate=False))
        within: dict[str, set[int]] = {}
        for path, module in modules.items():
            held = {id(t) for _k, _n, t in own_tensors(module) if id(t) in self._entries}
            if held:
                parts = path.split(".") if path else []
                for depth in range(len(parts) + 1):
                    within.setdefault(".".join(parts[:depth]), set()).update(held)
        guarded: dict[int, tuple[nn.Module, str, set[int]]] = {}
        for path, ids in within.items():
            module = modules[path]
            if id(module) in guarded:
                guarded[id(module)][2].update(ids)
            else:
                guarded[id(module)] = (module, path, ids)
        for module, path, ids in guarded.values():
            # Outside dynamo: a compiled module's hooks run eagerly (see [Note: compiled modules] in state.py).
            hook = torch.compiler.disable(functools.partial(self._before_forward, path=path, ids=frozenset(ids)))
            self._handles.append(module.register_forward_pre_hook(hook, prepend=True))
        _LIVE.add(self)
        if not _optimizer_hook:
            _optimizer_hook.append(register_optimizer_step_pre_hook(_before_optimizer_step))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """The recorded tensors' names (as in the root's ``state_dict``), in the order ``fully_shard`` met them."""
        return [entry.name for entry in self._entries.values()]

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` have values now; once none is left, the model is no longer guarded."""
        for tensor in tensors:
            entry = self._entries.get(id(tensor))
            if entry is not None and entry.ref() is tensor:
                del self._entries[id(tensor)]
        if not self._entries:
            self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _LIVE.discard(self)

    def stepped_by(self, optimizer: Optimizer) -> bool:
        return any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])

    def prune(self) -> bool:
        """Drop tensors that no longer exist (a buffer the user replaced); whether any recorded one is left."""
        for key in [key for key, entry in self._entries.items() if entry.ref() is None]:
            del self._entries[key]
        if not self._entries:
            self.close()
        return bool(self._entries)

    def _before_forward(self, module: nn.Module, _args: tuple[object, ...], *, path: str, ids: frozenset[int]) -> None:
        if self.prune() and not ids.isdisjoint(self._entries):
            where = f" ({path!r})" if path else ""
            self.raise_error(f"the forward of {type(module).__name__}{where}", ids)

    def raise_error(self, what: str, ids: Iterable[int] | None = None) -> None:
        """Raise the error naming the recorded tensors (those of ``ids``, if given, that are still recorded)."""
        entries = [entry for key, entry in self._entries.items() if ids is None or key in ids]
        shown = [f"{e.name!r} ({e.kind} of {e.owner})" for e in entries[:_NAMES_SHOWN]]
        more = f" and {len(entries) - _NAMES_SHOWN} more" if len(entries) > _NAMES_SHOWN else ""
        buffers = any(e.kind == BUFFER for e in entries)
        raise UninitialisedTensorError(
            f"{what} would compute from {len(entries)} tensor(s) of {self.root_name} that were built on the meta "
            f"device and never given values: {', '.join(shown)}{more}. Give them values before the first forward "
            "or optimizer step: load them with load_pretrained (on every rank, after the model is sharded, e.g. in "
            "on_fit_start), or pass param_init_fn to FSDPStrategy / fully_shard, or define reset_parameters() on "
            "their modules."
            + (
                " A buffer is listed when it was created on the meta device (a model built under "
                "torch.device('meta'); trainer.init_module(empty_init=True) computes buffers for real) or emptied "
                "by param_init_fn (to_empty): compute it in param_init_fn."
                if buffers
                else ""
            )
        )


def _before_optimizer_step(optimizer: Optimizer, _args: tuple[object, ...], _kwargs: dict[str, object]) -> None:
    for record in list(_LIVE):
        if record.stepped_by(optimizer) and record.prune():
            record.raise_error(f"optimizer.step() of {type(optimizer).__name__}")


def record_uninitialised(root: nn.Module, pending: list[tuple[nn.Module, str, str]]) -> Uninitialised:
    """The record of ``root``'s tensors left uninitialised, from (module, kind, attribute name) as ``fully_shard``
    found them; resolved to the tensors the modules hold now (buffers cast since are recorded as cast)."""
    prefixes: dict[int, str] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), prefix)
    entries = []
    for module, kind, attr in pending:
        tensor = (module._parameters if kind == PARAMETER else module._buffers).get(attr)
        if tensor is not None:
            prefix = prefixes.get(id(module), "")
            entries.append((f"{prefix}.{attr}" if prefix else attr, kind, module, tensor))
    return Uninitialised(root, entries)


def mark_initialised(tensors: Iterable[torch.Tensor]) -> None:
    """``tensors`` (parameters or buffers of a model built on the meta device) now hold values: drop them from
    their model's record. ``load_pretrained`` calls it for what it loaded; call it on every rank after filling
    tensors by other means."""
    tensors = list(tensors)
    for record in list(_LIVE):
        record.forget(tensors)


def uninitialised_names(module: nn.Module) -> list[str]:
    """Names (in the sharded model's ``state_dict``) of the tensors in ``module``'s tree still recorded as
    uninitialised; ``module`` is the sharded model, a submodule of it or a module holding it. Empty when none are."""
    names = []
    for record in list(_LIVE):
        root = record.root()
        if root is None:
            continue
        path = next((p for p, m in root.named_modules(remove_duplicate=False) if m is module), None)
        if path is None and not any(m is root for m in module.modules()):
            continue  # another model
        prefix = f"{path}." if path else ""
        names += [name for name in record.names() if name.startswith(prefix)]
    return names
