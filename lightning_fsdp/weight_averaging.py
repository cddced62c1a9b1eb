"""Weight-averaging callbacks on a sharded model: the average is kept sharded too (docs/patterns.md, docs/decisions.md).
An elementwise average of shards is the shard of the average, so the callbacks' copies become this rank's rows right
after sharding and their own code runs unchanged. :func:`full_tensors` and :func:`local_tensors` checkpoint copies a
callback of your own takes after sharding."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from lightning_fsdp.checkpoint import Checkpoint, StateDict
from lightning_fsdp.checkpoint.common import ShardedStateDict, managed_keys
from lightning_fsdp.checkpoint.full import full_model_state_dict, global_rank
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.comm import gather_rows
from lightning_fsdp.engine.records import ParamSlot

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Averaged copies holding this rank's rows (with their engine), and averages handed back whole after a stage.
_SHARDED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardingEngine]] = weakref.WeakKeyDictionary()
_RESTORED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _callback_classes() -> tuple[type, type | None]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging  # Lightning >= 2.6
    except ImportError:  # pragma: no cover
        WeightAveraging = None  # type: ignore[assignment,misc]
    return StochasticWeightAveraging, WeightAveraging


class _Average(NamedTuple):
    """An averaging callback that holds an average: which kind ("swa" or "wa") and its averaged module."""

    callback: pl.Callback
    kind: str
    module: nn.Module


def _engine_of(strategy_or_engine: object, helper: str) -> ShardingEngine | None:
    engine = (
        strategy_or_engine
        if isinstance(strategy_or_engine, ShardingEngine)
        else getattr(strategy_or_engine, "engine", None)
    )
    if engine is not None and getattr(engine, "closed", False):
        raise RuntimeError(
            f"{helper} was called after the Trainer stage ended: the fsdp_custom strategy has given the model its "
            "full parameters back and its sharding engine is closed, so shard copies can no longer be gathered. "
            "Call it while the stage runs (e.g. in on_train_end, or in the callback's state_dict)."
        )
    return engine


def _live_engine_and_trainer(strategy: object) -> tuple[ShardingEngine | None, pl.Trainer | None]:
    engine = getattr(strategy, "engine", None)
    trainer = getattr(getattr(strategy, "lightning_module", None), "_trainer", None)
    return (None if engine is None or getattr(engine, "closed", False) else engine), trainer


def _gather(local: Tensor, slot: ParamSlot, engine: ShardingEngine) -> Tensor:
    """The full tensor whose rows ``local`` holds on this rank (a collective over the shard group)."""
    layout = slot.layout
    local = local.detach()
    if layout.world_size == 1:
        return local.reshape(layout.shape)
    # On the device the engine's collectives run on (the compute device; with CPU offload shards live on the host).
    device = engine.units[0].device if engine.units else torch.device("cpu")
    return gather_rows(local.to(device), layout, engine.shard_comm)


def _callbacks(trainer: pl.Trainer | None) -> list[pl.Callback]:
    return getattr(trainer, "callbacks", None) or []  # set by the Trainer's callback connector


def _averages(trainer: pl.Trainer | None) -> list[_Average]:
    """The averaging callbacks of ``trainer`` that hold an average."""
    swa_cls, wa_cls = _callback_classes()
    found = []
    for callback in _callbacks(trainer):
        if isinstance(callback, swa_cls):
            module = getattr(callback, "_average_model", None)
            if isinstance(module, nn.Module):
                found.append(_Average(callback, "swa", module))
        elif wa_cls is not None and isinstance(callback, wa_cls):
            averaged = getattr(callback, "_average_model", None)
            module = getattr(averaged, "module", None)
            if isinstance(module, nn.Module):
                found.append(_Average(callback, "wa", module))
    return found


def _is_sharded_average(module: nn.Module, engine: ShardingEngine) -> bool:
    ref = _SHARDED.get(module)
    return ref is not None and ref() is engine


def _sharded_averages(trainer: pl.Trainer | None, engine: ShardingEngine) -> list[_Average]:
    """``_averages`` whose copy holds this rank's rows of ``engine``'s layout."""
    return [entry for entry in _averages(trainer) if _is_sharded_average(entry.module, engine)]


@torch.no_grad()
def shard_averaged_models(trainer: pl.Trainer, engine: ShardingEngine) -> None:
    """Give the averaged copy of every known averaging callback this rank's rows of the model's parameters, on every
    rank right after sharding; refuse (on every rank alike) another callback's full-size copies taken before."""
    known = _averages(trainer)
    for callback, _kind, module in known:
        if not _is_sharded_average(module, engine):
            # A fresh copy takes the model's rows; an average handed back after an earlier stage keeps its values.
            _shard_copy(module, engine, type(callback).__name__, own_values=module in _RESTORED)
            _SHARDED[module] = weakref.ref(engine)
            _RESTORED.discard(module)
    swa_cls, wa_cls = _callback_classes()
    for callback in _callbacks(trainer):
        if any(c is not None and isinstance(callback, c) for c in (swa_cls, wa_cls)):  # the known ones among them
            continue
        _check_no_full_copies(callback, engine)


def _shard_copy(copy: nn.Module, engine: ShardingEngine, owner: str, own_values: bool = False) -> None:
    root = engine.root
    model_params = dict(root.named_parameters(remove_duplicate=False))
    copy_names = [n for n, _ in copy.named_parameters(remove_duplicate=False)]
    missing = [n for n in model_params if n not in set(copy_names)]
    extra = [n for n in copy_names if n not in model_params]
    if missing or extra:
        raise ValueError(
            f"{owner}'s averaged copy of {type(root).__name__} does not have the model's parameters (missing "
            f"{missing[:5]}, extra {extra[:5]}): the callback copied the model in its setup hook, before "
            "configure_model created or changed layers. Create the layers in __init__ (or under "
            "trainer.init_module(empty_init=True)) so the copy matches the model the fsdp_custom strategy shards."
        )
    model_buffers = dict(root.named_buffers(remove_duplicate=False))
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in copy.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in replaced:  # tied: already handled under its first name
                module._parameters[name] = replaced[id(param)]
                continue
            source = model_params[prefix + name]
            device = source.device if param.is_meta else param.device
            slot = engine.slot_of(source)
            if own_values and slot is not None and not param.is_meta:
                if tuple(param.shape) != tuple(slot.layout.shape):
                    raise ValueError(
                        f"{owner}'s average of {prefix + name!r} has shape {tuple(param.shape)}, the model's "
                        f"parameter {tuple(slot.layout.shape)}; the average belongs to another model."
                    )
                value = slot.layout.local_slice(param.detach()).clone()
            else:
                value = source.detach().to(device=device, dtype=param.dtype, copy=True)
            if param.is_meta:  # meta-device init: a meta tensor cannot take real data in place
                new = nn.Parameter(value, requires_grad=param.requires_grad)
                module._parameters[name] = new
                replaced[id(param)] = new
            else:
                param.data = value
                replaced[id(param)] = param
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta and prefix + name in model_buffers:
                module._buffers[name] = model_buffers[prefix + name].detach().clone()


@torch.no_grad()
def restore_averaged_models(trainer: pl.Trainer | None, engine: ShardingEngine) -> None:
    """Give the sharded averages their full values back (every rank; before the engine restores the model at the
    end of a stage): after the stage they are whole, as on one device, and a later stage shards them again."""
    slots = managed_keys(engine)
    for _callback, _kind, module in _sharded_averages(trainer, engine):
        for name, param in module.named_parameters():  # the same order on every rank
            slot = slots.get(name)
            if slot is not None:
                param.data = _gather(param.data, slot, engine).to(param.device)
        del _SHARDED[module]
        _RESTORED.add(module)


def _tensor_lists(value: object) -> list[Tensor] | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Tensor) for v in value):
        return list(value)
    if isinstance(value, Mapping) and value and all(isinstance(v, Tensor) for v in value.values()):
        return list(value.values())
    return None


def _check_no_full_copies(callback: object, engine: ShardingEngine) -> None:
    """Refuse a callback attribute holding full-size copies of the model's parameters, one per parameter in order
    (the usual hand-written EMA taken in ``setup``): after sharding they would be combined with shards. The decision
    uses full shapes only, so every rank takes it alike."""
    params = list(engine.root.parameters())
    trainable = [p for p in params if p.requires_grad]
    for attr, value in list(getattr(callback, "__dict__", {}).items()):
        tensors = _tensor_lists(value)
        if tensors is None:
            continue
        for group in (params, trainable):
            if len(group) != len(tensors) or not group:
                continue
            slots = [engine.slot_of(p) for p in group]
            full_shapes = [tuple(s.layout.shape) if s is not None else tuple(p.shape) for s, p in zip(slots, group)]
            if [tuple(t.shape) for t in tensors] != full_shapes:
                continue
            if not any(s is not None and s.layout.world_size > 1 and s.layout.rows > 1 for s in slots):
                continue
            raise ValueError(
                f"Callback {type(callback).__name__} keeps full-size copies of the model's {len(group)} parameters "
                f"in `{attr}`, taken before the fsdp_custom strategy sharded the model (in setup). After sharding, "
                "each parameter of pl_module.parameters() holds only this rank's rows, so combining them with these "
                "copies would fail. Take the copies in on_fit_start or on_train_start instead (they are then this "
                "rank's rows, and an elementwise average of them is this rank's rows of the average); to checkpoint "
                "them, gather with lightning_fsdp.weight_averaging.full_tensors(trainer.strategy, tensors)."
            )


@torch.no_grad()
def full_tensors(
    strategy: object,
    tensors: Sequence[Tensor],
    params: Sequence[nn.Parameter] | None = None,
    *,
    rank0_only: bool = False,
) -> list[Tensor]:
    """Full tensors (on CPU) from per-rank ``tensors`` aligned with ``params`` (default: the LightningModule's
    ``parameters()``), e.g. an EMA kept as shard copies. Call on every rank: sharded entries are all-gathered.
    Without a sharding engine the tensors are returned as they are (copied to CPU). ``rank0_only``: other ranks get
    an empty list."""
    engine, tensors, slots = _aligned(strategy, tensors, params, "full_tensors")
    if engine is None:
        return [t.detach().cpu().clone() for t in tensors]
    keep = not rank0_only or global_rank() == 0
    out = []
    for slot, tensor in zip(slots, tensors):
        full = _gather(tensor, slot, engine) if slot is not None else tensor.detach()
        if keep:
            out.append(full.cpu().clone())
    return out


@torch.no_grad()
def local_tensors(
    strategy: object, tensors: Sequence[Tensor], params: Sequence[nn.Parameter] | None = None
) -> list[Tensor]:
    """This rank's rows of full ``tensors`` aligned with ``params`` (default: the LightningModule's parameters()),
    the inverse of :func:`full_tensors`; entries that are not full-shaped pass through. No collectives."""
    _engine, tensors, slots = _aligned(strategy, tensors, params, "local_tensors")
    return [_local_rows(tensor, slot) for slot, tensor in zip(slots, tensors)]


def _aligned(
    strategy: object, tensors: Sequence[Tensor], params: Sequence[nn.Parameter] | None, helper: str
) -> tuple[ShardingEngine | None, list[Tensor], list[ParamSlot | None]]:
    """(engine or None, ``tensors``, the slots of the parameters they align with: None where not sharded), their
    numbers checked."""
    engine = _engine_of(strategy, helper)
    tensor_list = list(tensors)
    if engine is None:
        return None, tensor_list, [None] * len(tensor_list)
    aligned = list(engine.root.parameters()) if params is None else list(params)
    if len(aligned) != len(tensor_list):
        raise ValueError(
            f"{helper} got {len(tensor_list)} tensors for {len(aligned)} parameters; pass one per parameter, in the "
            "order of params (default: pl_module.parameters())."
        )
    return engine, tensor_list, [engine.slot_of(p) for p in aligned]


def _local_rows(value: Tensor, slot: ParamSlot | None) -> Tensor:
    # The type check too: a caller of local_tensors may pass what is not a tensor, which passes through.
    if slot is not None and isinstance(value, Tensor) and tuple(value.shape) == tuple(slot.layout.shape):
        return slot.layout.local_slice(value).clone()
    return value


def _full_state(module: nn.Module, engine: ShardingEngine, keep: bool) -> StateDict:
    """An averaged copy's state dict with shards gathered full on CPU (kept where ``keep``), alike on every rank."""
    slots = managed_keys(engine)
    state = module.state_dict()
    out: StateDict = {}
    for key, value in state.items():
        slot = slots.get(key)
        if slot is not None and isinstance(value, Tensor):
            value = _gather(value, slot, engine)
        if keep:
            out[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
    return out


@torch.no_grad()
def gather_averages_for_save(strategy: object, checkpoint: Checkpoint) -> None:
    """Make the averages in ``checkpoint`` complete before it is written, in place, on every rank: SWA's
    ``average_model_state`` full on rank 0; WeightAveraging's average (in ``state_dict``) full for the full format,
    else in the format's sharded form with the full current model in ``meta.pt``."""
    engine, trainer = _live_engine_and_trainer(strategy)
    if engine is None or trainer is None:
        return
    keep = global_rank() == 0
    kind_of_checkpoint = getattr(getattr(strategy, "state_dict_type", None), "value", "full")
    callbacks_state = checkpoint.get("callbacks")
    last_wa = None
    for callback, kind, module in _sharded_averages(trainer, engine):
        if kind == "swa":
            if not isinstance(callbacks_state, dict):
                continue
            key = callback.state_key  # the key dump_checkpoint stores the callback's state_dict() under
            state = callbacks_state.get(key)
            if isinstance(state, dict) and state.get("average_model_state") is not None:
                state = callbacks_state[key] = dict(state)
                state["average_model_state"] = _full_state(module, engine, keep)
        else:
            last_wa = module
    if last_wa is None or "current_model_state" not in checkpoint or "averaging_state" not in checkpoint:
        return
    # WeightAveraging.on_save_checkpoint ran (the last such callback's average is in "state_dict").
    if kind_of_checkpoint == "full":
        checkpoint["state_dict"] = _full_state(last_wa, engine, keep)
        return
    slots = managed_keys(engine)
    average = last_wa.state_dict()
    if kind_of_checkpoint == "sharded":
        from lightning_fsdp.checkpoint.sharded import to_global_tensor

        for key, value in average.items():  # the same order on every rank (0-dim parameters gather)
            slot = slots.get(key)
            if slot is not None and isinstance(value, Tensor):
                average[key] = to_global_tensor(value.detach().to(slot.param.device), slot.layout, engine)
    checkpoint["state_dict"] = average
    checkpoint["current_model_state"] = full_model_state_dict(engine)


@torch.no_grad()
def slice_loaded_averages(strategy: object, checkpoint: Checkpoint) -> Checkpoint:
    """Give each rank its rows of a loaded checkpoint's full averages, in place (returned); no collectives."""
    engine, trainer = _live_engine_and_trainer(strategy)
    if engine is None or trainer is None or not isinstance(checkpoint, dict):
        return checkpoint
    slots = managed_keys(engine)

    def local(state: Mapping[str, object]) -> dict[str, object]:
        return {k: _local_rows(v, slots.get(k)) if isinstance(v, Tensor) else v for k, v in state.items()}

    callbacks_state = checkpoint.get("callbacks")
    has_wa = False
    for callback, kind, _module in _sharded_averages(trainer, engine):
        if kind == "wa":
            has_wa = True
            continue
        if not isinstance(callbacks_state, dict):
            continue
        # The entry Lightning's _call_callbacks_load_state_dict hands to the callback.
        state = callbacks_state.get(callback.state_key, callbacks_state.get(callback._legacy_state_key))
        if not isinstance(state, dict):
            continue
        if isinstance(state.get("average_model_state"), Mapping):
            state["average_model_state"] = local(state["average_model_state"])
        fitting = getattr(getattr(trainer, "state", None), "fn", None) == "fit"
        if fitting and state.get("scheduler_state") is not None and hasattr(callback, "_clear_schedulers"):
            # SWA's on_fit_start does this on one device, where the restore precedes that hook; here it follows.
            callback._clear_schedulers(trainer)
    if has_wa:
        state = checkpoint.get("state_dict")
        if isinstance(state, Mapping) and not isinstance(state, ShardedStateDict):
            # The callback and the strategy's load_model_state_dict both load these rows (already this rank's).
            checkpoint["state_dict"] = ShardedStateDict(local(state), source="checkpoint")
        current = checkpoint.get("current_model_state")
        if isinstance(current, Mapping):
            checkpoint["current_model_state"] = local(current)
    return checkpoint
