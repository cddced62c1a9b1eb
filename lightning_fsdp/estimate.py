"""``estimate_memory``: the bytes each rank will hold under sharding, from shapes and dtypes alone (a meta model
works), by the engine's own rules; what each figure counts: docs/monitoring.md. Communication is the steady state
from the second step on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.options import (
    ShardingStrategy,
    parse_auto_wrap_policy,
    parse_mixed_precision,
    parse_sharding_strategy,
)
from lightning_fsdp.engine.unit import is_embedding_lookup
from lightning_fsdp.engine.wrap import assign_owners, enclosing_units, select_unit_modules

__all__ = ["MemoryEstimate", "estimate_memory"]

# Optimizer name -> (state tensors shaped like the parameter, bytes of scalar state), per parameter.
_OPTIMIZERS: dict[str, tuple[int, int]] = {
    "adamw": (2, 4),
    "adam": (2, 4),
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
    "none": (0, 0),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes one rank holds, by component: parameter shards, their gradients, optimizer state, the peak of
    gathered full parameters, and the bytes one step puts into each kind of collective (docs/monitoring.md)."""

    params: int
    grads: int
    optimizer_state: int
    gathered_params: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    unsharded_params: int
    world_size: int
    rank: int
    sharding_strategy: str
    num_units: int
    # Full-size gradients before their reduction: the unit reducing and the one in flight (added field, last so that
    # positional construction keeps working).
    unsharded_grads: int = 0
    # The peak of gathered full parameters once backward has begun, where the root is freed as soon as the gradients
    # its backward reads are in (None: as ``gathered_params``).
    gathered_in_backward: int | None = None

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer state held between steps."""
        return self.params + self.grads + self.optimizer_state

    @property
    def peak(self) -> int:
        """Model state plus the peak of gathered full parameters: the model's share of peak memory."""
        return self.model_state + self.gathered_params

    @property
    def training_peak(self) -> int:
        """``peak`` plus the full-size gradients alive before their reduce-scatter: what a training step holds for
        the model at most, activations aside (docs/monitoring.md)."""
        return self.peak + self.unsharded_grads

    def step_peak(self, activation_bytes: int, *, gradients_in_forward: bool = False) -> int:
        """A training step's peak with ``activation_bytes`` of activations (one forward's saved tensors): the larger
        of the end of the forward (parameter shards, optimizer state, gathered units, the activations) and the end of
        the backward (model state, the units gathered in backward, the full-size gradients reducing; autograd has
        freed the activations by then). ``gradients_in_forward``: the gradient shards are alive through the forward,
        as when gradients accumulate over batches or are zeroed after the forward; the strategy's automatic
        optimization zeroes them before it (docs/how-it-works.md, "A training step")."""
        if isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int) or activation_bytes < 0:
            raise ValueError(f"activation_bytes={activation_bytes!r} is not valid; expected an int >= 0.")
        if not isinstance(gradients_in_forward, bool):
            raise ValueError(f"gradients_in_forward={gradients_in_forward!r} is not valid; expected True or False.")
        held = self.params + self.optimizer_state + (self.grads if gradients_in_forward else 0)
        end_of_forward = held + self.gathered_params + activation_bytes
        in_backward = self.gathered_params if self.gathered_in_backward is None else self.gathered_in_backward
        end_of_backward = self.model_state + in_backward + self.unsharded_grads
        return max(end_of_forward, end_of_backward)

    def __str__(self) -> str:
        rows = [
            ("parameter shards", self.params),
            ("gradient shards", self.grads),
            ("optimizer state", self.optimizer_state),
            ("gathered full parameters (peak)", self.gathered_params),
            ("total (model's share of peak)", self.peak),
            ("full-size gradients before reduction", self.unsharded_grads),
            ("training peak (activations aside)", self.training_peak),
        ]
        width = max(len(name) for name, _ in rows)
        head = (
            f"{self.sharding_strategy}, rank {self.rank} of {self.world_size}, {self.num_units} units; "
            f"unsharded parameters: {_fmt(self.unsharded_params)}"
        )
        return "\n".join([head] + [f"  {name:<{width}}  {_fmt(value)}" for name, value in rows])


def _fmt(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / 2**20:.2f} MiB)"


def estimate_memory(
    model: nn.Module,
    world_size: int,
    sharding_strategy: ShardingStrategy | str = "FULL_SHARD",
    mixed_precision: object = None,
    optimizer: str | None = "adamw",
    auto_wrap_policy: object = None,
    *,
    rank: int = 0,
) -> MemoryEstimate:
    """Predict the bytes rank ``rank`` of ``world_size`` holds when ``model`` is trained with this strategy.

    Args:
        model: the model as it will be sharded; may live on the meta device.
        world_size: ranks in the shard group (for the hybrid strategies one shard group).
        sharding_strategy: as for ``FSDPStrategy``; hybrid ones add the replicas' all-reduce to ``all_reduce_bytes``.
        mixed_precision: ``None``, a Lightning precision flag, or ``MixedPrecision`` (or a dict of its fields).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (no momentum), ``"sgd_momentum"`` or ``None``.
        auto_wrap_policy: as for ``FSDPStrategy``; ``None`` for a single root unit.
        rank: the rank to estimate; rank 0 holds the most rows.

    Returns:
        A :class:`MemoryEstimate`; ``print()`` it for a table.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} is not valid; expected an nn.Module (it may live on the meta device).")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid; expected a positive int.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is not valid; expected an int in [0, {world_size - 1}].")
    strategy = parse_sharding_strategy(sharding_strategy)
    policy = parse_auto_wrap_policy(auto_wrap_policy)
    tensors_per_param, scalar_bytes = _parse_optimizer(optimizer)
    storage_dtype, gather_dtype, reduce_dtype = _parse_mixed_precision(mixed_precision)

    sharded = strategy is not ShardingStrategy.NO_SHARD
    n, r = (world_size, rank) if sharded else (1, 0)

    unit_modules = select_unit_modules(model, policy)
    owners = assign_owners(model, unit_modules, ignored_ids=set())
    params_by_id = {id(p): p for p in model.parameters()}
    owned: dict[int, list[nn.Parameter]] = {id(m): [] for m in unit_modules}
    for pid, (owner, _uses, _name) in owners.items():
        owned[id(owner)].append(params_by_id[pid])

    params = grads = optimizer_state = unsharded = 0
    all_gather = reduce_scatter = all_reduce = 0
    full_bytes: dict[int, int] = {}  # per unit: its padded full buffer, the bytes a gather makes alive
    grad_bytes: dict[int, int] = {}  # per unit: its full-size gradients, alive until its reduction has read them
    # The unit whose forward starts last stays gathered into its backward (``ShardingEngine._next_up``).
    unit_ids = {id(u) for u in unit_modules}
    last = next((m for m in reversed(list(model.modules())) if id(m) in unit_ids and m is not model), None)
    for unit in unit_modules:
        unit_full = unit_shard_padded = unit_grad_padded = unit_grad_full = 0
        unit_flags = 0  # each reduction also carries one used-flag per trainable parameter (FlatUnit.reduce_grads)
        for param in owned[id(unit)]:
            layout = ShardLayout(param.shape, n, r)
            # A "-true" flag converts floating-point parameters before sharding: shards, gradients and state too.
            dtype = storage_dtype if storage_dtype is not None and param.is_floating_point() else param.dtype
            stored = dtype.itemsize
            gathered_size = (gather_dtype or dtype).itemsize
            reduced_size = (reduce_dtype or gather_dtype or dtype).itemsize
            local = layout.local_numel * stored
            params += local
            unsharded += param.numel() * stored
            unit_shard_padded += layout.padded_numel * gathered_size
            unit_full += n * layout.padded_numel * gathered_size
            if param.requires_grad:
                grads += local
                optimizer_state += tensors_per_param * local + scalar_bytes
                unit_grad_padded += layout.padded_numel * reduced_size
                unit_grad_full += param.numel() * gathered_size  # autograd's, in the dtype the unit computes in
                unit_flags += reduced_size
                if not sharded:  # NO_SHARD all-reduces full gradients instead of reduce-scattering them
                    all_reduce += (param.numel() + 1) * reduced_size
        # NO_SHARD computes on its own parameters unless in another dtype, then holds a full copy as sharding does.
        unit_dtype = (storage_dtype or owned[id(unit)][0].dtype) if owned[id(unit)] else None
        computes_on_own_params = not sharded and (gather_dtype is None or gather_dtype == unit_dtype)
        full_bytes[id(unit)] = 0 if computes_on_own_params else unit_full
        grad_bytes[id(unit)] = unit_grad_full
        if sharded:
            is_root = unit is model
            # FULL_SHARD frees every unit but the root and the last after forward and gathers it again for backward.
            regathers = strategy.reshard_after_forward and not is_root and unit is not last
            all_gather += unit_shard_padded * (2 if regathers else 1)
            reduce_scatter += n * (unit_grad_padded + unit_flags)
            if strategy.is_hybrid:  # the reduced gradient shard is then all-reduced across the replicas
                all_reduce += unit_grad_padded + unit_flags

    # [Note: the root freed inside backward]: once the gradients of the root's parameters its backward reads are in
    # (the head's, the final norm's), only the other units are gathered.
    root_reads = [
        params_by_id[pid]
        for pid, (owner, uses, _name) in owners.items()
        if owner is model and not is_embedding_lookup(uses, isinstance(params_by_id[pid], DTensor))
    ]
    root_freed = bool(root_reads) and all(p.requires_grad for p in root_reads)
    if strategy.reshard_after_forward:
        # Alive while a unit computes: itself and every unit enclosing it (the root included).
        chains = enclosing_units(model, unit_modules)
        gathered = max(sum(full_bytes[id(u)] for u in chains[id(m)]) for m in unit_modules)
        in_backward = max(sum(full_bytes[id(u)] for u in chains[id(m)] if u is not model) for m in unit_modules)
    else:
        # Every unit stays gathered from its forward to its backward.
        gathered = sum(full_bytes.values())
        in_backward = gathered - full_bytes[id(model)]
    gathered_in_backward = in_backward if root_freed else None

    # One reduction in flight: a unit's gradients are reduced while those of the unit before it in backward (after it
    # in forward) may still be read; the root's reduction comes last, after the first unit's.
    in_forward_order = [u for u in unit_modules if u is not model]
    pairs = (
        list(zip(in_forward_order, in_forward_order[1:])) + [(model, in_forward_order[0])] if in_forward_order else []
    )
    unsharded_grads = max(
        (grad_bytes[id(a)] + grad_bytes[id(b)] for a, b in pairs), default=grad_bytes.get(id(model), 0)
    )

    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer_state=optimizer_state,
        gathered_params=gathered,
        all_gather_bytes=all_gather,
        reduce_scatter_bytes=reduce_scatter,
        all_reduce_bytes=all_reduce,
        unsharded_params=unsharded,
        world_size=world_size,
        rank=rank,
        sharding_strategy=strategy.value,
        num_units=len(unit_modules),
        unsharded_grads=unsharded_grads,
        gathered_in_backward=gathered_in_backward,
    )


def _parse_optimizer(optimizer: str | None) -> tuple[int, int]:
    key = "none" if optimizer is None else str(optimizer).lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not valid; choose one of {sorted(_OPTIMIZERS)} or None.")
    return _OPTIMIZERS[key]


def _parse_mixed_precision(value: object) -> tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None]:
    """(dtype the parameters are converted to before sharding, dtype units are gathered in, dtype gradients are
    reduced in); None means the parameters' own dtype."""
    if value is None:
        return None, None, None
    if isinstance(value, (str, int)):
        # The mapping the strategy itself applies to Trainer(precision=...).
        from lightning_fsdp.precision import SUPPORTED_PRECISION, FSDPPrecision

        if str(value) not in SUPPORTED_PRECISION:
            raise ValueError(
                f"mixed_precision={value!r} is not a precision flag this strategy supports; choose one of "
                f"{', '.join(map(repr, SUPPORTED_PRECISION))}, a lightning_fsdp.MixedPrecision, or None."
            )
        plugin = FSDPPrecision(str(value))
        if plugin._true_dtype is not None:
            return plugin._true_dtype, None, None
        value = plugin.mixed_precision_config
        if value is None:
            return None, None, None
    if isinstance(value, dict):
        value = parse_mixed_precision(value)
    if hasattr(value, "param_dtype"):
        # As in torch FSDP: a reduce_dtype of None reduces in param_dtype.
        return None, value.param_dtype, getattr(value, "reduce_dtype", None) or value.param_dtype
    raise ValueError(
        f"mixed_precision={value!r} ({type(value).__name__}) is not valid; expected a Trainer precision flag such "
        "as 'bf16-mixed', a lightning_fsdp.MixedPrecision (or a dict of its fields), or None."
    )
