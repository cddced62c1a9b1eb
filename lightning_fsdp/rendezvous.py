"""Start-up of the default process group under a bound of its own: ``FSDPStrategy(startup_timeout=...)``.

[Note: two timeouts]
torch's ``init_process_group(timeout=...)`` would bound the rendezvous and every collective by one value; what each
timeout bounds, and how each backend gets both: docs/options.md ("Timeouts"). The caveats: on torch 2.13 gloo's
``Backend.set_timeout`` reaches every later collective but not point-to-point on the default group (its transport
copied the timeout; the strategy's own point-to-point runs on groups created with ``timeout``); NCCL's
``_set_default_timeout`` reaches every later work.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_warn

# Backends whose process-group timeout torch can change after the group exists (see the Note above).
ADJUSTABLE_BACKENDS = frozenset({"gloo", "nccl"})
_JOINED_KEY = "lightning_fsdp/startup/joined"
_ALL_JOINED_KEY = "lightning_fsdp/startup/all-joined"


def check_launch_size(environment: ClusterEnvironment | None, num_nodes: int, devices: int) -> None:
    """An external launcher (``mpirun -np``, torchrun, SLURM) must start the processes the Trainer expects, else a
    rank would index past its devices or wait for ranks that never come. Raised on every rank, before any collective.
    """
    # Lightning's own environment learns the world size from the strategy (set_world_ranks), also in the ranks its
    # launcher starts: only the environments that read it from the launcher can disagree with the Trainer.
    if environment is None or isinstance(environment, LightningEnvironment):
        return
    if not environment.creates_processes_externally:
        return
    started, expected = environment.world_size(), num_nodes * devices
    if started != expected:
        raise ValueError(
            f"{type(environment).__name__} reports {started} processes, but the Trainer expects num_nodes={num_nodes}"
            f" x devices={devices} = {expected}: make them agree (e.g. `mpirun -np {expected}`, or "
            f"Trainer(devices=..., num_nodes=...) whose product is {started})."
        )


def check_timeout(value: object, option: str) -> None:
    """``FSDPStrategy(timeout=...)`` or ``(startup_timeout=...)``: a positive ``timedelta``, or ``None`` for torch's
    default."""
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(
            f"{option}={value!r} is not valid; expected a positive datetime.timedelta (e.g. timedelta(minutes=30), "
            "'0:30:00' in YAML) or None (torch's default process-group timeout)."
        )
    if value is not None and value.total_seconds() <= 0:
        raise ValueError(
            f"{option}={value!r} is not valid; it must be positive (e.g. timedelta(minutes=30)), or None (torch's "
            "default process-group timeout)."
        )


def backend_names(backend: str) -> set[str]:
    """The backends a backend string names: ``"gloo"`` -> {gloo}; ``"cpu:gloo,cuda:nccl"`` -> {gloo, nccl}."""
    return {part.rsplit(":", 1)[-1].strip().lower() for part in backend.split(",") if part.strip()}


def resolve_timeout(timeout: timedelta | None, backend: str) -> timedelta:
    """``None`` is torch's default for the backend (10 minutes for NCCL, 30 for the others), as in torch."""
    if timeout is not None:
        return timeout
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    if backend_names(backend) == {"nccl"} and default_pg_nccl_timeout is not None:
        return default_pg_nccl_timeout
    return default_pg_timeout


def init_default_group(
    cluster_environment: ClusterEnvironment,
    backend: str,
    timeout: timedelta | None,
    startup_timeout: timedelta | None,
    device_id: torch.device | None = None,
) -> None:
    """Create the default process group: the rendezvous within ``startup_timeout``, every later collective within
    ``timeout`` (see [Note: two timeouts]). Does nothing if the default group exists already (as Lightning)."""
    if dist.is_initialized():
        return
    collective = resolve_timeout(timeout, backend)
    startup = resolve_timeout(startup_timeout, backend)
    if startup == collective:
        _init_dist_connection(cluster_environment, backend, timeout=collective, device_id=device_id)
    elif backend_names(backend) <= ADJUSTABLE_BACKENDS:
        _init_dist_connection(cluster_environment, backend, timeout=startup, device_id=device_id)
        # Every rank connected (NCCL: its communicator exists) and arrived, still under the start-up bound.
        dist.barrier()
        set_group_timeout(collective)
    else:
        store = join_store(cluster_environment, startup)
        store.set_timeout(collective)  # as torch leaves the store it makes: the group's timeout
        store = dist.PrefixStore("default_pg", store)  # torch's own prefix for the default group's keys
        _init_dist_connection(cluster_environment, backend, timeout=collective, store=store, device_id=device_id)


def set_group_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Set ``group``'s (default: the default group's) timeout for every later collective, and for the default group
    its store's default timeout too. Warns where a backend cannot change it."""
    group = dist.group.WORLD if group is None else group
    assert group is not None
    backends: dict[int, object] = {}  # the group's backend objects, each once
    for device in group._device_types:  # gloo serves cpu and cuda with one backend object
        backend = group._get_backend(device)
        while hasattr(backend, "wrapped_pg"):  # TORCH_DISTRIBUTED_DEBUG=DETAIL's _ProcessGroupWrapper
            backend = backend.wrapped_pg
        backends[id(backend)] = backend
    refused = [type(b).__name__ for b in backends.values() if not _set_backend_timeout(b, timeout)]
    if refused:
        rank_zero_warn(
            f"The process-group backend ({', '.join(refused)}) cannot change its timeout after creation: the "
            f"default group's collectives keep the start-up timeout instead of timeout={timeout}. Pass "
            "startup_timeout equal to timeout to get that timeout (at the cost of the longer rendezvous bound)."
        )
    if group is dist.group.WORLD:
        from torch.distributed.distributed_c10d import _get_default_store

        _get_default_store().set_timeout(timeout)


def _set_backend_timeout(backend: Any, timeout: timedelta) -> bool:  # any torch Backend (its methods vary)
    try:
        backend.set_timeout(timeout)  # gloo: the options' timeout and every connection context's
        return True
    except (AttributeError, RuntimeError):  # the base Backend's setTimeout raises "does not support"
        pass
    if hasattr(backend, "_set_default_timeout"):  # NCCL: the options' timeout, which every later work copies
        backend._set_default_timeout(timeout)
        return True
    return False


def join_store(cluster_environment: ClusterEnvironment, startup_timeout: timedelta) -> dist.Store:
    """The rendezvous store (torch's ``env://``, made with ``startup_timeout``), returned once every rank has
    counted itself in: the process group created on it next finds all ranks there."""
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=startup_timeout))
    store.set_timeout(startup_timeout)
    if store.add(_JOINED_KEY, 1) == world_size:
        store.set(_ALL_JOINED_KEY, "1")
    store.wait([_ALL_JOINED_KEY], startup_timeout)
    return store
