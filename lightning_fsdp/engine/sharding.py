"""``fully_shard``: turn a module into a sharded model in place and return the engine that drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.groups import check_engine_groups
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.meta_init import InitWatch, own_tensors, record_uninitialised
from lightning_fsdp.engine.options import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingOptions,
    ShardingStrategy,
    check_reshard_after_forward,
    check_wire_narrower,
    split_ignored,
)
from lightning_fsdp.engine.records import ParamSlot
from lightning_fsdp.engine.registry import attach_engine, get_engine
from lightning_fsdp.engine.sharding_engine import ShardingEngine
from lightning_fsdp.engine.tensor_parallel import TensorParallelSpec, local_parameter, tensor_parallel_spec
from lightning_fsdp.engine.unit import FlatUnit
from lightning_fsdp.engine.wrap import (
    ParamOwner,
    assign_owners,
    enclosing_units,
    ignored_module_set,
    select_unit_modules,
)


def fully_shard(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    auto_wrap_policy: object = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    ignored_states: Iterable[nn.Parameter | nn.Module] | None = None,
    cpu_offload: bool = False,
    device: torch.device | str = "cpu",
    sync_module_states: bool = False,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    mixed_precision: MixedPrecision | None = None,
    forward_prefetch: bool = False,
    backward_prefetch: BackwardPrefetch | str | None = "BACKWARD_PRE",
    limit_all_gathers: bool = True,
    reshard_after_forward: bool | int | None = None,
) -> ShardingEngine:
    """Shard ``module``'s parameters in place across ``process_group`` (default: the whole world).

    Each ``nn.Parameter`` keeps its identity and name and holds this rank's rows; meta modules are materialised one
    unit at a time (docs/how-it-works.md). Call it on every rank of the group, after
    ``torch.distributed.init_process_group``, then build the optimizer from ``module.parameters()``. The options
    shared with ``FSDPStrategy`` mean what docs/options.md says; every value is checked before the first collective.
    With an int ``reshard_after_forward``, call on every rank of the world (it creates process groups).

    Args:
        module: the model to shard, in place; its submodules chosen by ``auto_wrap_policy`` become units.
        process_group: the shard group: every collective of the engine runs on it. Default: the default group.
        replicate_group: for the hybrid strategies, the group of ranks holding the same shard (one per node
            position); gradients are averaged over it after the reduce-scatter. Required with ``HYBRID_SHARD`` and
            ``HYBRID_SHARD_ZERO2``. Default: None.
        sharding_strategy: a ``ShardingStrategy`` or its name: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``,
            ``"NO_SHARD"``, ``"HYBRID_SHARD"``, ``"HYBRID_SHARD_ZERO2"``. Default: ``"FULL_SHARD"``.
        auto_wrap_policy: which submodules become units: a set of module classes (or import paths), a callable
            ``(module, recurse, nonwrapped_numel) -> bool`` as in torch FSDP, or an int (a module with at least that
            many parameters not already in a unit). Default: None (the root is the only unit).
        ignored_modules: modules whose parameters stay whole on every rank and are not sharded. Default: None.
        ignored_states: parameters or modules kept whole, as ``ignored_modules``. Default: None.
        cpu_offload: keep shards, gradients and so optimizer state in host memory, copied to ``device`` only to be
            gathered. Default: False.
        device: where units are gathered, computed and reduced, and where meta-device modules are materialised: a
            ``torch.device`` or a string such as ``"cpu"`` or ``"cuda:0"``; with ``cpu_offload`` the shards stay on
            the host. It must be the device the process group's backend communicates on (CPU for gloo, this rank's
            GPU for NCCL). ``FSDPStrategy`` passes the rank's root device. Default: ``"cpu"``.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding. Default: False.
        param_init_fn: called as ``param_init_fn(module)`` for each module with meta-device tensors, instead of
            ``module.reset_parameters()``. Default: None.
        mixed_precision: a ``MixedPrecision``: the dtypes of gathered parameters, of the reduction and of buffers.
            Default: None (everything in the parameters' dtype).
        forward_prefetch: gather the next unit of the forward (in the order recorded on the first step) before the
            current one computes. Default: False.
        backward_prefetch: ``"BACKWARD_PRE"``, ``"BACKWARD_POST"`` (or the ``BackwardPrefetch`` member) or None:
            when the next unit of the backward is gathered. Default: ``"BACKWARD_PRE"``.
        limit_all_gathers: at most two units' full parameters (besides the root's) gathered or in flight.
            Default: True.
        reshard_after_forward: None (as the sharding strategy says), True / False, or an int N keeping 1/N of each
            unit after the forward (ZeRO++ hpZ). Default: None.

    Returns:
        The ``ShardingEngine`` holding the units; ``get_engine(module)`` returns it too. Its methods are the
        controls torch FSDP2 puts on the module (``unsharded``, ``no_sync``, ``clip_grad_norm_``, ...).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an option has the wrong type.
        ValueError: an option has an invalid value (the message names it and the valid choices), the module is
            already sharded, or ``device`` is not a device.
    """
    # See [Note: validate before the first collective] in engine/options.py.
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard(module={module!r}) is not valid; expected an nn.Module.")
    options = ShardingOptions.from_arguments(locals())
    strategy = options.sharding_strategy
    check_engine_groups(strategy, process_group, replicate_group)
    mixed_precision = options.mixed_precision or MixedPrecision()
    if get_engine(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded; call fully_shard once per module.")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        reason = str(err).splitlines()[0] if isinstance(err, RuntimeError) else f"a {type(device).__name__}"
        raise ValueError(
            f"device={device!r} is not valid ({reason}); expected a torch.device or a device string "
            "such as 'cpu' or 'cuda:0'."
        ) from None
    ignored, ignored_param_objs = split_ignored(module, options)
    ignored_ids = ignored_module_set(module, ignored)
    ignored_param_ids = frozenset(id(p) for p in ignored_param_objs)

    shard_comm = Communicator(process_group, device)
    replicate_comm = Communicator(replicate_group, device) if replicate_group is not None else None
    sharded = strategy is not ShardingStrategy.NO_SHARD
    world, rank = (shard_comm.world_size, shard_comm.rank) if sharded else (1, 0)
    check_reshard_after_forward(options.reshard_after_forward, world)  # needs the group's size; before any collective
    if mixed_precision.reduce_wire_dtype is not None and not sharded:
        raise ValueError(
            f"MixedPrecision(reduce_wire_dtype={mixed_precision.reduce_wire_dtype}) needs sharded gradients: it "
            "replaces the reduce-scatter, and sharding_strategy=NO_SHARD all-reduces. Use FULL_SHARD, SHARD_GRAD_OP "
            "or a HYBRID_* strategy, or drop reduce_wire_dtype."
        )
    if mixed_precision.reduce_wire_dtype is not None and mixed_precision.effective_reduce_dtype is None:
        # Gradients are then reduced in the parameters' own dtype: check it now, before any collective.
        for dtype in {p.dtype for p in module.parameters() if p.is_floating_point()}:
            check_wire_narrower(mixed_precision.reduce_wire_dtype, dtype)

    if sharded:
        shard_comm.use_shared_memory()  # collective: after every check above, which all ranks pass or fail alike
    unit_modules = select_unit_modules(module, options.auto_wrap_policy, ignored)
    owners = assign_owners(module, unit_modules, ignored_ids, ignored_param_ids)
    owned: dict[int, list[int]] = {id(m): [] for m in unit_modules}
    params_by_id = {id(p): p for p in module.parameters()}
    for pid, (owner, _uses, _name) in owners.items():
        owned[id(owner)].append(pid)
    # For every module not ignored: the innermost unit enclosing it, whose buffer its tensors go to.
    unit_of_module = {mid: chain[-1] for mid, chain in enclosing_units(module, unit_modules, ignored_ids).items()}

    units = []
    uninitialised: list[tuple[nn.Module, str, str]] = []
    for unit_module in unit_modules:
        own_modules = [m for m in unit_module.modules() if unit_of_module.get(id(m)) is unit_module]
        uninitialised += _materialize(own_modules, device, options.param_init_fn)
        # DTensor parameters become plain ones holding their local tensor (the optimizer steps plain tensors).
        tensor_parallel = {pid: _to_local_parameter(params_by_id, pid, owners[pid]) for pid in owned[id(unit_module)]}
        if options.sync_module_states:
            _broadcast_from_first_rank(
                own_modules, [params_by_id[pid] for pid in owned[id(unit_module)]], shard_comm, replicate_comm
            )
        if mixed_precision.buffer_dtype is not None:
            _cast_buffers(own_modules, mixed_precision.buffer_dtype)
        slots = []
        for pid in owned[id(unit_module)]:
            _owner, uses, name = owners[pid]
            param = params_by_id[pid]
            layout = ShardLayout(param.shape, world, rank)
            slots.append(ParamSlot(name, param, uses, layout, tensor_parallel=tensor_parallel[pid]))
        units.append(
            FlatUnit(
                name=_module_name(module, unit_module),
                module=unit_module,
                slots=slots,
                shard_comm=shard_comm,
                replicate_comm=replicate_comm,
                sharded=sharded,
                reshard_after_forward=strategy.reshard_after_forward,
                param_dtype=mixed_precision.param_dtype,
                reduce_dtype=mixed_precision.effective_reduce_dtype,
                reduce_wire_dtype=mixed_precision.reduce_wire_dtype,
                shard_device=torch.device("cpu") if options.cpu_offload else None,
            )
        )
    _materialize_leftovers(module, device)
    managed = {id(s.param) for u in units for s in u.slots}
    ignored_params = [p for p in module.parameters() if id(p) not in managed]
    engine = ShardingEngine(
        module,
        units,
        shard_comm,
        replicate_comm,
        strategy,
        mixed_precision=mixed_precision,
        ignored_params=ignored_params,
        forward_prefetch=options.forward_prefetch,
        backward_prefetch=options.backward_prefetch,
        limit_all_gathers=options.limit_all_gathers,
    )
    engine.set_reshard_after_forward(options.reshard_after_forward)
    attach_engine(module, engine)
    # Its hooks run before the engine's: a forward that would compute from them raises before any collective.
    record_uninitialised(module, uninitialised)
    return engine


def _to_local_parameter(
    params_by_id: dict[int, nn.Parameter], pid: int, owner: ParamOwner
) -> TensorParallelSpec | None:
    """Replace a DTensor parameter by a plain one holding its local tensor, in every module using it; returns its
    spec (None, and nothing changed, for a plain parameter)."""
    _owner, uses, name = owner
    param = params_by_id[pid]
    spec = tensor_parallel_spec(param, name)
    if spec is None:
        return None
    local = local_parameter(param)
    for module, attr in uses:
        module._parameters[attr] = local
    params_by_id[pid] = local
    return spec


def _module_name(root: nn.Module, target: nn.Module) -> str:
    if target is root:
        return "<root>"
    return next(name for name, m in root.named_modules() if m is target)


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether anything in ``module``'s tree is still on the meta device (it is then materialised when sharded)."""
    return any(_has_meta(m) or any(t.is_meta for t in _attribute_tensors(m)) for m in module.modules())


def _has_meta(module: nn.Module) -> bool:
    """Whether one of ``module``'s own parameters or buffers is on the meta device."""
    return any(t.is_meta for _kind, _name, t in own_tensors(module))


def _attribute_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors ``module`` keeps as plain attributes (torchmetrics states, and their ``_defaults``)."""
    tensors = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return tensors + [v for v in getattr(module, "_defaults", {}).values() if isinstance(v, torch.Tensor)]


def _materialize(
    modules: list[nn.Module], device: torch.device, param_init_fn: Callable[[nn.Module], object] | None
) -> list[tuple[nn.Module, str, str]]:
    """Allocate and initialise this unit's meta-device tensors on ``device``, keeping Parameter identity (ties);
    returns (module, kind, attribute name) of those no initialiser wrote (``meta_init.Uninitialised`` records them)."""
    meta_modules = [m for m in modules if _has_meta(m)]
    if not meta_modules:
        return []
    with InitWatch() as watch:
        for module in meta_modules:
            for param in module.parameters(recurse=False):
                if param.is_meta:
                    # Swap contents rather than replace the object: tied modules and optimizers keep their reference.
                    # A DTensor parameter gets only its local tensor, then is initialised as a DTensor.
                    empty = (
                        DTensor.from_local(
                            torch.empty_like(param.to_local(), device=device),
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                        if isinstance(param, DTensor)
                        else torch.empty_like(param, device=device)
                    )
                    real = nn.Parameter(empty, requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, real)
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device=device)
        for module in meta_modules:
            if param_init_fn is not None:
                param_init_fn(module)
            elif callable(reset_parameters := getattr(module, "reset_parameters", None)):
                reset_parameters()
    pending, seen = [], set()
    for module in meta_modules:
        for kind, name, tensor in own_tensors(module):
            if id(tensor) not in seen and watch.is_empty(tensor):
                seen.add(id(tensor))
                pending.append((module, kind, name))
    return pending


def _materialize_leftovers(root: nn.Module, device: torch.device) -> None:
    """Meta tensors that are neither parameters nor buffers (torchmetrics states): zero-filled (deterministic, unlike
    ``empty``), then the module's ``reset()`` or ``reset_parameters()`` may set its real defaults."""
    for module in root.modules():
        if not any(t.is_meta for t in _attribute_tensors(module)):
            continue
        module._apply(lambda t: torch.zeros_like(t, device=device) if t.is_meta else t)
        reset = getattr(module, "reset", None) or getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _cast_buffers(modules: list[nn.Module], dtype: torch.dtype) -> None:
    for module in modules:
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)


@torch.no_grad()
def _broadcast_from_first_rank(
    modules: list[nn.Module], params: list[nn.Parameter], shard_comm: Communicator, replicate_comm: Communicator | None
) -> None:
    """The first rank's values over the shard group, then its replicas (ranks outside may train something else)."""
    tensors = params + [b for m in modules for b in m.buffers(recurse=False)]
    for comm in (shard_comm, replicate_comm):
        if comm is not None and comm.world_size > 1:
            for tensor in tensors:
                comm.broadcast(tensor.data, src_rank=0)
