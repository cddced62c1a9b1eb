"""The accelerator stream protocol of the engine (see [Note: collectives on their own streams]), checked on CPU.

No GPU is needed: the engine's ``CollectiveStreams`` is given a fake device module whose streams and events keep
vector clocks (one counter per stream; an event carries its stream's clock when recorded; ``wait_event`` and
``wait_stream`` merge clocks), and a ``TorchDispatchMode`` sees every kernel the training step runs, with the
stream that is current at that moment. From that, ``StreamChecker`` replays what a GPU would be allowed to do:

* every read of a tensor on a stream must be ordered after the last write to it on another stream, and every write
  after the other streams' reads and writes (a data race otherwise);
* the caching allocator's rule: a block freed into its allocation stream's pool may be handed to that stream's next
  allocation, so every other stream's use of it must be ordered before that allocation, unless ``record_stream``
  named that stream;
* the protocol itself: every all-gather issued on the all-gather stream and every reduce-scatter / all-reduce on the
  reduce-scatter stream; every unshard's event waited for by the compute stream before the modules see the full
  parameters; every reduction's event waited for before ``.grad`` is set; every event waited for in the end.

Training runs in 2 gloo processes (real collectives), in several configurations, and must equal the inactive (CPU)
path bit for bit. What was checked is counted, and the counts are asserted.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_fsdp import MixedPrecision
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.backends import FLAT
from lightning_fsdp.engine.reduction import used_flags
from lightning_fsdp.engine.streams import INACTIVE, CollectiveStreams, pins_host_memory, stream_module
from lightning_fsdp.engine.unit import FlatUnit
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

COMPUTE, ALL_GATHER, REDUCE_SCATTER = "compute", "all_gather", "reduce_scatter"
_ALLOCATING_ONLY = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}


# --------------------------------------------------------------------------------------------- the fake device
class FakeEvent:
    def __init__(self, checker: StreamChecker, stream: str) -> None:
        self.checker, self.stream = checker, stream
        self.clock = dict(checker.clock[stream])

    def synchronize(self) -> None:
        self.checker.counts["host syncs"] += 1


class FakeStream:
    def __init__(self, checker: StreamChecker, name: str) -> None:
        self.checker, self.name = checker, name
        checker.clock.setdefault(name, {name: 0})

    def wait_stream(self, other: FakeStream) -> None:
        self.checker.join(self.name, self.checker.clock[other.name])

    def wait_event(self, event: FakeEvent) -> None:
        self.checker.join(self.name, event.clock)

    def record_event(self) -> FakeEvent:
        return FakeEvent(self.checker, self.name)

    def synchronize(self) -> None:
        self.checker.counts["host syncs"] += 1

    def __repr__(self) -> str:
        return self.name


class FakeDeviceModule:
    """What ``CollectiveStreams`` uses of ``torch.cuda`` (it makes the all-gather stream first)."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker
        self._names = iter([ALL_GATHER, REDUCE_SCATTER])

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        assert priority == -1  # high priority, as FSDP2's
        return FakeStream(self.checker, next(self._names))

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.checker.stack[-1]

    @contextmanager
    def stream(self, stream: FakeStream):
        self.checker.stack.append(stream)
        try:
            yield
        finally:
            self.checker.stack.pop()


class RecordingStreams(CollectiveStreams):
    def __init__(self, checker: StreamChecker) -> None:
        super().__init__("cpu", device_module=FakeDeviceModule(checker))
        self.checker = checker

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.checker.record_stream(tensor, stream.name)


# ------------------------------------------------------------------------------------------------ the checker
class _Storage:
    """What the checker knows of one allocation: its stream, its last write, reads since, every foreign access."""

    def __init__(self, storage: torch.UntypedStorage, stream: str, label: str) -> None:
        self.ref = StorageWeakRef(storage)
        self.stream, self.label = stream, label
        self.last_write: tuple[str, int] | None = None
        self.reads: dict[str, int] = {}
        self.used_by: dict[str, int] = {}  # latest access per stream, since the allocation
        self.recorded: set[str] = set()


class StreamChecker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.clock: dict[str, dict[str, int]] = {}
        self.stack = [FakeStream(self, COMPUTE)]
        self.storages: dict[int, _Storage] = {}
        self.freed: dict[str, list[tuple[str, dict[str, int]]]] = {}
        self.violations: list[str] = []
        self.counts: Counter = Counter()

    # -- clocks
    @property
    def current(self) -> str:
        return self.stack[-1].name

    def join(self, stream: str, clock: dict[str, int]) -> None:
        mine = self.clock[stream]
        for other, tick in clock.items():
            mine[other] = max(mine.get(other, 0), tick)

    def ordered(self, stream: str, other: str, tick: int) -> bool:
        """Whether ``other``'s work up to ``tick`` is done before what ``stream`` queues next."""
        return other == stream or self.clock[stream].get(other, 0) >= tick

    def event_waited(self, event: FakeEvent) -> bool:
        return self.ordered(self.current, event.stream, event.clock[event.stream])

    def _tick(self) -> int:
        clock = self.clock[self.current]
        clock[self.current] += 1
        return clock[self.current]

    # -- memory
    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Tensors made before the check (the model, the shards): allocated on the compute stream."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                self.storages[storage._cdata] = _Storage(storage, COMPUTE, "adopted")

    def _poll_frees(self) -> None:
        for key, info in list(self.storages.items()):
            if info.ref.expired():
                del self.storages[key]
                self._free(info)

    def _free(self, info: _Storage) -> None:
        foreign = {s: t for s, t in info.used_by.items() if s != info.stream and s not in info.recorded}
        if foreign:
            self.freed.setdefault(info.stream, []).append((info.label, foreign))

    def _allocating(self) -> None:
        """An allocation on the current stream may get any block freed into its pool: every other stream's use of
        those blocks must be ordered before it."""
        self._poll_frees()
        stream = self.current
        for label, foreign in self.freed.pop(stream, []):
            late = {s: t for s, t in foreign.items() if not self.ordered(stream, s, t)}
            if late:
                self.violations.append(f"{label}: freed into {stream}'s pool and reallocated before {late} were done")
            else:
                self.counts["frees ordered by waits"] += 1

    def _new(self, storage: torch.UntypedStorage, label: str) -> _Storage:
        key = storage._cdata
        old = self.storages.pop(key, None)
        if old is not None:
            self._free(old)
        self._allocating()
        info = self.storages[key] = _Storage(storage, self.current, label)
        return info

    def _info(self, tensor: torch.Tensor, label: str) -> _Storage | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        info = self.storages.get(storage._cdata)
        if info is None or info.ref.expired():
            info = self._new(storage, label)
        return info

    def allocated(self, tensor: torch.Tensor, label: str) -> None:
        """A storage (re)allocated outside any kernel (``untyped_storage().resize_``) on the current stream."""
        self._new(tensor.untyped_storage(), label)

    def freeing(self, tensor: torch.Tensor) -> None:
        """A storage about to be freed outside the garbage collector (``untyped_storage().resize_(0)``)."""
        info = self.storages.pop(tensor.untyped_storage()._cdata, None)
        if info is not None:
            self._free(info)

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.counts["record_stream"] += 1
        info = self._info(tensor, "recorded")
        if info is not None:
            info.recorded.add(stream)

    # -- accesses
    def read(self, tensor: torch.Tensor, tick: int, label: str) -> None:
        info = self._info(tensor, label)
        if info is None:
            return
        stream = self.current
        if info.last_write is not None:
            writer, at = info.last_write
            if writer != stream:
                if self.ordered(stream, writer, at):
                    self.counts["cross-stream reads ordered"] += 1
                else:
                    self.violations.append(f"{label}: read on {stream}, written on {writer} and not waited for")
        info.reads[stream] = tick
        info.used_by[stream] = tick

    def write(self, tensor: torch.Tensor, tick: int, label: str) -> None:
        info = self._info(tensor, label)
        if info is None:
            return
        stream = self.current
        earlier = dict(info.reads)
        if info.last_write is not None:
            earlier.setdefault(info.last_write[0], info.last_write[1])
        for other, at in earlier.items():
            if other != stream:
                if self.ordered(stream, other, at):
                    self.counts["cross-stream writes ordered"] += 1
                else:
                    self.violations.append(f"{label}: written on {stream} while {other}'s use was not waited for")
        info.last_write, info.reads = (stream, tick), {}
        info.used_by[stream] = tick

    def grad_use(self, tensor: torch.Tensor) -> None:
        """A gradient the engine just set: from now on the compute stream (the optimizer, the user) may read it."""
        self.read(tensor, self._tick(), ".grad")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        label = f"{schema.name}"
        tick = self._tick()
        if schema.name.startswith("c10d::"):  # the collectives write their first argument, read the rest
            written, read = _tensors(args[:1]), _tensors((args[1:], kwargs))
        else:
            written, read = [], []
            for i, argument in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                mutable = argument.alias_info is not None and argument.alias_info.is_write
                (written if mutable else read).extend(_tensors(value))
        for tensor in _tensors(out):  # new storages: allocated on the current stream
            storage = tensor.untyped_storage()
            known = self.storages.get(storage._cdata)
            if storage.nbytes() and (known is None or known.ref.expired()):
                self._new(storage, label)
                if schema.name not in _ALLOCATING_ONLY:
                    written.append(tensor)
        for tensor in read:
            self.read(tensor, tick, label)
        for tensor in written:
            self.write(tensor, tick, label)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------------ the protocol, per unit
class Protocol:
    """Wraps one engine's units and communicators to check the protocol's steps and count them."""

    def __init__(self, engine: Any, checker: StreamChecker) -> None:
        self.checker = checker
        self.gathers: dict[int, FakeEvent] = {}  # unit -> event of its unshard, until the modules see it
        self.reductions: dict[int, FakeEvent] = {}  # unit -> event of its reduction, until .grad is set
        for unit in engine.units:
            self._wrap_unit(unit)
        comms = {id(c): c for u in engine.units for c in (u.shard_comm, u.replicate_comm) if c is not None}
        for comm in comms.values():
            self._wrap_comm(comm)

    def _on(self, stream: str, what: str) -> None:
        if self.checker.current == stream:
            self.checker.counts[f"{what} on the {stream} stream"] += 1
        else:
            self.checker.violations.append(f"{what} issued on {self.checker.current}, not on {stream}")

    def _wrap_comm(self, comm: Any) -> None:
        for name, stream in (
            ("all_gather", ALL_GATHER),
            ("reduce_scatter", REDUCE_SCATTER),
            ("reduce_scatter_wide", REDUCE_SCATTER),
            ("all_reduce", REDUCE_SCATTER),
        ):
            method = getattr(comm, name, None)
            if method is not None:
                setattr(comm, name, self._checked_collective(method, name, stream))

    def _checked_collective(self, method: Any, name: str, stream: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            self._on(stream, name)
            return method(*args, **kwargs)

        return collective

    def _wrap_unit(self, unit: FlatUnit) -> None:
        checker = self.checker
        start_unshard, install = unit.start_unshard, unit._install
        allocate_full, free_full = unit._allocate_full, unit._free_full
        reduce_grads, finish_reduce = unit.reduce_grads, unit.finish_reduce

        def checked_start_unshard(*, async_op: bool = True) -> None:
            issued = not unit.is_alive
            start_unshard(async_op=async_op)
            pending = unit._pending_unshard
            if issued and pending is not None:
                assert pending.event is not None and not pending.works, unit.name
                self.gathers[id(unit)] = pending.event
                checker.counts["unshards issued"] += 1
                if async_op:
                    checker.counts["prefetches"] += 1

        def checked_install(*, full: bool) -> None:
            event = self.gathers.pop(id(unit), None) if full else None
            if event is not None:
                if checker.event_waited(event):
                    checker.counts["unshards waited for before use"] += 1
                else:
                    checker.violations.append(f"unit {unit.name!r} used before the compute stream waited")
            install(full=full)

        def checked_allocate_full() -> None:
            before = unit.full_flat.untyped_storage().nbytes()
            allocate_full()
            if before == 0 and unit.full_flat.untyped_storage().nbytes():
                checker.counts[f"full buffers allocated on the {checker.current} stream"] += 1
                checker.allocated(unit.full_flat, f"full buffer of {unit.name!r}")

        def checked_free_full() -> None:
            checker.freeing(unit.full_flat)
            free_full()

        def checked_reduce_grads() -> None:
            reduce_grads()
            pending = unit._pending_reduce
            if pending is not None:
                assert pending.event is not None and not pending.works and not pending.inputs, unit.name
                self.reductions[id(unit)] = pending.event
                checker.counts["reductions issued"] += 1

        def checked_finish_reduce() -> None:
            event = self.reductions.pop(id(unit), None)
            finish_reduce()
            if event is None:
                return
            if checker.event_waited(event):
                checker.counts["reductions waited for before .grad"] += 1
            else:
                checker.violations.append(f"unit {unit.name!r}: .grad set before the compute stream waited")
            for slot in unit._last_plan.slots:
                if slot.param.grad is not None:
                    checker.grad_use(slot.param.grad)
                    checker.counts["gradients checked"] += 1

        unit.start_unshard, unit._install = checked_start_unshard, checked_install
        unit._allocate_full, unit._free_full = checked_allocate_full, checked_free_full
        unit.reduce_grads, unit.finish_reduce = checked_reduce_grads, checked_finish_reduce

    def leftovers(self) -> list[str]:
        return [f"{len(self.gathers)} unshard events and {len(self.reductions)} reduction events never waited for"] * (
            bool(self.gathers) or bool(self.reductions)
        )


# ---------------------------------------------------------------------------------------------------- training
STEPS = 2
CONFIGS: dict[str, dict[str, Any]] = {
    # Every multi-parameter unit gathers and reduces its parameters one by one, in place; prefetching both ways.
    "fp32, in place": {"direct": 1, "options": {"forward_prefetch": True}},
    # One staged collective per unit; two micro-batches, the first with gradient sync off (held gradients).
    "fp32, staged, no_sync": {"micro": 2, "no_sync": True},
    # Two micro-batches, each reduced: the second adds to .grad.
    "SHARD_GRAD_OP, accumulating": {"micro": 2, "options": {"sharding_strategy": "SHARD_GRAD_OP"}},
    # bf16 compute, fp32 reduction sent as bf16 (the all-to-all reduction, whose wait() runs the sum).
    "bf16, wire dtype": {
        "direct": 30,
        "options": {
            "forward_prefetch": True,
            "mixed_precision": MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reduce_wire_dtype=torch.bfloat16
            ),
        },
    },
    # No collective to unshard (a cast on the compute stream), one all-reduce per reduction.
    "NO_SHARD, bf16": {
        "options": {"sharding_strategy": "NO_SHARD", "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
    },
}


def train(rank: int, world_size: int, config: dict[str, Any], checked: bool) -> dict[str, Any]:
    default_threshold = FlatUnit.direct_gather_min_numel
    FlatUnit.direct_gather_min_numel = config.get("direct", default_threshold)
    try:
        torch.manual_seed(0)
        model = ToyLM(dim=6)  # 6-row layers split evenly over 2 ranks: reduced in place too
        engine = fully_shard(model, auto_wrap_policy={Block}, **config.get("options", {}))
        # The fake device stands for an accelerator, whose backends (NCCL, HCCL) keep torch's all-gather and
        # reduce-scatter: not gloo's CPU forms (see [Note: collectives on gloo]), in both runs so they compare.
        engine.shard_comm.forms = FLAT
        checker = StreamChecker()
        if checked:
            engine._use_streams(RecordingStreams(checker))
            protocol = Protocol(engine, checker)
            checker.adopt([*model.parameters(), *model.buffers(), *(u.flat_shard for u in engine.units)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        micro = config.get("micro", 1)
        losses = []
        with checker if checked else _nothing():
            for step in range(STEPS):
                x, y = batch(step, size=4 * micro)
                for m in range(micro):
                    mx, my = x[m::micro][rank::world_size], y[m::micro][rank::world_size]
                    sync_off = config.get("no_sync") and m < micro - 1
                    with engine.no_sync() if sync_off else _nothing():
                        loss = loss_fn(model(mx), my) / micro
                        loss.backward()
                    losses.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
            with engine.unsharded():
                params = {k: v.detach().clone() for k, v in model.named_parameters()}
        stats = engine.shard_comm.stats
        result = {"losses": losses, "params": params}
        if checked:
            result.update(
                violations=checker.violations + protocol.leftovers(),
                counts=dict(checker.counts),
                collectives=stats.all_gather_calls + stats.reduce_scatter_calls + stats.all_reduce_calls,
                streams_active=engine.streams.active,
            )
        return result
    finally:
        FlatUnit.direct_gather_min_numel = default_threshold


@contextmanager
def _nothing():
    yield


def run_configs(rank: int, world_size: int) -> dict[str, tuple[dict, dict]]:
    torch.set_num_threads(1)
    return {
        name: (train(rank, world_size, config, checked=True), train(rank, world_size, config, checked=False))
        for name, config in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, tuple[dict, dict]]]:
    return run_distributed(run_configs, 2)


# ------------------------------------------------------------------------------------------------------- tests
def test_stream_protocol_has_no_race_and_equals_the_cpu_path(runs):
    for rank, per_config in enumerate(runs):
        for name, (checked, plain) in per_config.items():
            assert checked["violations"] == [], (rank, name, checked["violations"])
            assert checked["losses"] == plain["losses"], (rank, name)
            assert checked["params"].keys() == plain["params"].keys()
            for key, value in plain["params"].items():
                assert torch.equal(checked["params"][key], value), (rank, name, key)


def test_stream_protocol_counts(runs):
    """Every collective was seen on its side stream, every unshard and reduction issued was waited for before its
    result was used, every full buffer was allocated on the compute stream, and the race checks saw the cross-stream
    traffic they exist for. The same on both ranks."""
    for name, (checked, _plain) in runs[0].items():
        counts = checked["counts"]
        assert runs[1][name][0]["counts"] == counts, name
        assert checked["streams_active"]
        # Every collective CommStats counted was among those checked on their streams.
        assert sum(v for k, v in counts.items() if k.startswith(COLLECTIVES)) == checked["collectives"], name
        assert counts.get("unshards issued", 0) == counts.get(_UNSHARDS, 0), (name, counts)
        assert counts["reductions issued"] == counts[_REDUCED], (name, counts)
        assert not any(k.startswith("full buffers allocated on the all_gather") for k in counts), (name, counts)
        assert counts["cross-stream reads ordered"] >= 100 and counts["record_stream"] >= 30, (name, counts)
        assert {k: counts.get(k, 0) for k in EXPECTED[name]} == EXPECTED[name], (name, counts)
        assert counts.get("prefetches", 0) >= (STEPS - 1 if name in PREFETCHING else 0), (name, counts)


COLLECTIVES = ("all_gather on", "reduce_scatter on", "reduce_scatter_wide on", "all_reduce on")
_UNSHARDS, _REDUCED = "unshards waited for before use", "reductions waited for before .grad"
_GRADS, _AG = "gradients checked", "all_gather on the all_gather stream"
# Rank 0, STEPS steps. ToyLM(dim=6)'s units: the root (6 parameters, 4 trainable), block1 (fc1 6x6, fc2 6x6: all 4
# parameters reduced in place over 2 ranks) and block2 (fc1 3x6, fc2 6x3: 2 in place); 12 gradients in all. How many
# unshards a step needs depends on the engine's reshard policy (the last unit of the forward may stay for its
# backward), so those are counted against what was issued (above); the reductions are fixed: 3 per reduced
# micro-batch, each one's collectives as below.
EXPECTED: dict[str, dict[str, int]] = {
    # Reductions: root 2 in place + 1 staged, block1 4 + 1 (the flags), block2 2 + 1.
    "fp32, in place": {"reduce_scatter on the reduce_scatter stream": STEPS * 11, _REDUCED: STEPS * 3},
    # The first micro-batch holds its gradients (no reduction), the second reduces their sum.
    "fp32, staged, no_sync": {"reduce_scatter on the reduce_scatter stream": STEPS * 3, _REDUCED: STEPS * 3},
    # Both micro-batches reduce; the second adds to .grad.
    "SHARD_GRAD_OP, accumulating": {
        "reduce_scatter on the reduce_scatter stream": STEPS * 2 * 3,
        _REDUCED: STEPS * 2 * 3,
        _GRADS: STEPS * 2 * 12,
    },
    # Reductions through the wire dtype: root 1 (all staged: 7 rows), block1 2 + 1, block2 1.
    "bf16, wire dtype": {"reduce_scatter_wide on the reduce_scatter stream": STEPS * 5, _REDUCED: STEPS * 3},
    # Nothing to gather: the units cast their shards on the compute stream; one all-reduce per reduction.
    "NO_SHARD, bf16": {"all_reduce on the reduce_scatter stream": STEPS * 3, _REDUCED: STEPS * 3, _AG: 0},
}
for _expected in EXPECTED.values():
    _expected.setdefault(_GRADS, STEPS * 12)
# FULL_SHARD: from the second step on (the first records the order) block2 prefetches block1 in backward.
PREFETCHING = {"fp32, in place", "fp32, staged, no_sync", "bf16, wire dtype"}


def test_the_cpu_path_never_touches_the_streams(monkeypatch):
    """Inactive (CPU), a unit only reads ``streams.active``: any other use of the streams object would raise here."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the inactive path used the streams")

    for name in (
        "current_stream",
        "all_gather_side",
        "reduce_scatter_side",
        "record_event",
        "wait_event",
        "record_stream",
        "synchronize_event",
        "synchronize",
    ):
        monkeypatch.setattr(CollectiveStreams, name, refuse)
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block}, forward_prefetch=True, cpu_offload=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not engine.streams.active and all(unit.streams is engine.streams for unit in engine.units)
    assert not any(unit.pinned or unit.flat_shard.is_pinned() for unit in engine.units)


def test_used_flags_without_a_host_copy():
    """On the stream path the used-flags are filled on the device instead of copied from the host (a blocking copy
    would wait for the stream to drain): the same values as the CPU path's."""
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block})
    unit = engine.units[0]
    used = [True, False, True, False]
    plain = used_flags(used, unit.compute_dtype, unit.device, on_device=unit.streams.active)
    engine._use_streams(RecordingStreams(StreamChecker()))
    on_device = used_flags(used, unit.compute_dtype, unit.device, on_device=unit.streams.active)
    assert torch.equal(on_device, plain) and plain.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_inactive_on_cpu():
    """On CPU the stream machinery is off: no device module, nothing pinned, and units start with it off."""
    assert stream_module(torch.device("cpu")) is None
    assert not CollectiveStreams("cpu").active and not INACTIVE.active
    assert not pins_host_memory(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert stream_module(torch.device("cuda")) is None
        assert not pins_host_memory(torch.device("cuda"))
