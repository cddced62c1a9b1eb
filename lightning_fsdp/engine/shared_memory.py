"""All-gathers and reduce-scatters between CPU ranks of one host through a shared-memory arena instead of gloo.

[Note: the shared-memory exchange]
gloo moves a CPU rank's bytes through the loopback TCP stack: every byte is copied into the kernel and out again, on
the same cores that compute, by gloo's worker threads. Ranks of one host can read each other's memory instead. The
ranks of a group map one file of ``/dev/shm`` (the arena): one counter per rank, each on a cache line of its own,
then ``BUFFERS`` buffers, each with one slot per rank (``slot_bytes``: ``ARENA_BYTES`` shared out, at most 8 MiB).
Issuing exchange ``j`` writes this rank's part into its slot of buffer ``j % BUFFERS`` and then sets its counter to
``j + 1``; waiting for it waits until every counter is past ``j``, then reads: an all-gather copies every slot into
the output, a reduce-scatter sums every slot's copy of this rank's rows in rank order. Tensors larger than a slot go
in chunks, one exchange each. Between issue and wait the rank computes on; a prefetched gather or a reduction in
flight thus absorbs the ranks' drift instead of stopping the faster one at every unit.

The counters are the barrier. A first version used a one-element gloo all-reduce per exchange instead: it cost
as much as the bytes it replaced (gloo's worker threads have to be scheduled on cores busy computing, twice per
exchange; about 80 ms per step of the 19M-parameter benchmark). A counter costs a store, and a wait whose peers are
already there a load. It relies on the processor's memory order: a rank's slot bytes must become visible to the
others before its counter does, and a reader's loads of the slot must not run ahead of its load of the counter.
x86-64 (total store order) promises both for plain loads and stores; Python has no portable fence for the weaker
orders of Arm or POWER, so there the group keeps gloo (``ORDERED_MACHINES``).

Why ``MAX_IN_FLIGHT + 2`` buffers: before issuing exchange ``j`` a rank reads every exchange up to
``j - MAX_IN_FLIGHT`` (the oldest first, whatever order the handles were waited in), and waits until every rank has
issued ``j - 2``, and so has read up to ``j - 2 - MAX_IN_FLIGHT``: the exchange that last used ``j``'s buffer. So no
write reaches a slot another rank has still to read, provided every rank issues the same exchanges in the same order,
which the engine already requires of its collectives ([Note: which collectives] in comm.py). Exchanges are issued and
read only from the thread that made the arena; other threads (the asynchronous checkpoint writer) keep gloo.

A wait spins (yielding the core) for a moment, then naps, and gives up like the group's gloo collectives would: past
the process group's timeout, naming it, or as soon as a rank it waits for has exited. Each rank holds a lock on one
byte of the arena's file (released by the kernel however the process ends, SIGKILL included) and a long wait tests
the late ranks' bytes.

Setting up is collective and proves the arena is shared: group rank 0 creates the file, reserves its pages (so a
full ``/dev/shm`` is an error now, not a SIGBUS later) and writes a random token; every other rank opens the file
without creating it and compares the token. Ranks in different containers of one host (their own ``/dev/shm``), or
a host without ``/dev/shm``, fail the check, and the whole group keeps gloo. The file is unlinked once every rank has
mapped it, so nothing is left behind when the processes end."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

try:
    import fcntl
except ImportError:  # not a POSIX system: no /dev/shm either
    fcntl = None  # type: ignore[assignment]

# The arena: at most 64 MiB of slots per group, once per host, resident in every rank (each reads every slot); a slot
# of at most 8 MiB per rank and buffer (2 ranks: 8 MiB; 8 ranks: 2 MiB). MAX_IN_FLIGHT exchanges issued and not yet
# read per rank, BUFFERS = MAX_IN_FLIGHT + 2 (see the Note).
ARENA_BYTES = 64 * 2**20
MAX_SLOT_BYTES = 8 * 2**20
MAX_IN_FLIGHT = 2
BUFFERS = MAX_IN_FLIGHT + 2
SHARED_MEMORY_DIR = "/dev/shm"
# "0" keeps gloo for every collective (a comparison, or a host whose /dev/shm is too small to share).
SWITCH_VARIABLE = "LIGHTNING_FSDP_SHARED_MEMORY"
# Processors whose memory order makes a counter stored after the slot bytes a barrier (see the Note).
ORDERED_MACHINES = frozenset({"x86_64", "amd64"})
_LINE = 64  # one cache line: the token, then one per rank's counter (no two ranks store to one line)
_PER_LINE = _LINE // 8  # int64s
_TOKEN_BYTES = 16
# A wait first yields the core up to _YIELDS times (about a microsecond each where no other process wants it), then
# naps, each nap twice the last up to the longest; while napping it checks every LIVENESS_S that the late ranks live.
_YIELDS = 200
_FIRST_NAP_S, _LONGEST_NAP_S = 50e-6, 1e-3
LIVENESS_S = 0.1

log = logging.getLogger(__name__)


def slot_bytes(world_size: int) -> int:
    """Bytes of one rank's slot in one buffer: the arena shared out, a multiple of 64 (any dtype's alignment)."""
    return min(MAX_SLOT_BYTES, ARENA_BYTES // (BUFFERS * world_size) // 64 * 64)


def arena_bytes(world_size: int) -> int:
    """The arena's file: the token's line, one counter line per rank, the buffers."""
    return _LINE * (1 + world_size) + BUFFERS * world_size * slot_bytes(world_size)


def shared_memory_wanted() -> bool:
    return os.environ.get(SWITCH_VARIABLE, "1") != "0"


def why_not_here() -> str | None:
    """Why this process cannot take part in an exchange, or None where it can: the counters need a processor that
    orders plain stores and loads (see the Note), the liveness check POSIX file locks."""
    if platform.machine().lower() not in ORDERED_MACHINES:
        return f"the processor ({platform.machine()}) does not order memory as the exchange's counters need"
    if fcntl is None:
        return "the system has no POSIX file locks (fcntl)"
    return None


@dataclass(eq=False)
class Exchange:
    """One exchange issued, and the copy out of the arena to run once every rank has issued it. A ``Waitable``:
    ``comm.Pending`` waits for a collective's exchanges as for gloo's work handles."""

    owner: SharedMemoryExchange
    number: int
    read: Callable[[torch.Tensor], object]

    def wait(self) -> None:
        self.owner._complete(self)


class SharedMemoryExchange:
    """The arena of one process group ([Note: the shared-memory exchange]); ``for_group`` makes it on every rank."""

    def __init__(
        self, arena: torch.Tensor, lock_fd: int, rank: int, global_ranks: list[int], timeout_ms: int | None
    ) -> None:
        world_size = len(global_ranks)
        self.slot_bytes = slot_bytes(world_size)
        self.world_size, self.rank = world_size, rank
        head = _LINE * (1 + world_size)
        self._buffers = arena[head:].view(BUFFERS, world_size, self.slot_bytes)  # keeps the mapping alive
        # Each rank's count of the exchanges it has written, at the start of its own line: plain 8-byte loads and
        # stores of the mapping through ctypes (a torch op per poll would cost microseconds).
        self._lines = (ctypes.c_int64 * (world_size * _PER_LINE)).from_address(arena.data_ptr() + _LINE)
        self._mine = rank * _PER_LINE
        self._lock_fd = lock_fd  # holds this rank's byte locked while open (see the Note)
        self._release = weakref.finalize(self, os.close, lock_fd)
        self._global_ranks = global_ranks
        self._timeout_ms = timeout_ms if timeout_ms is not None else int(default_pg_timeout.total_seconds() * 1000)
        self._issued = 0
        self._in_flight: list[Exchange] = []  # issued, not yet read, in issue order
        self._thread = threading.get_ident()

    @classmethod
    def for_group(
        cls, group: dist.ProcessGroup | None, rank: int, global_ranks: list[int], timeout_ms: int | None
    ) -> SharedMemoryExchange | None:
        """The group's exchange, or None on every rank where any rank cannot share the arena. Collective.
        ``global_ranks`` name the group's ranks in errors; past ``timeout_ms`` (torch's default where None) a wait
        gives up."""
        world_size = len(global_ranks)
        size = arena_bytes(world_size)
        # Each rank looks for the name in its own /dev/shm: the same file only where the ranks share one.
        name, token = f"lightning_fsdp_{uuid.uuid4().hex}", os.urandom(_TOKEN_BYTES)
        unsupported = why_not_here()
        created = unsupported is None and rank == 0 and _create_arena(name, size, token)
        offers: list[tuple[str, bytes] | None] = [None] * world_size
        dist.all_gather_object(offers, (name, token) if created else None, group=group)
        offer = offers[0]
        opened = _open_arena(*offer, size, rank) if offer is not None else None
        mapped: list[bool] = [False] * world_size
        dist.all_gather_object(mapped, opened is not None, group=group)
        if created:
            os.unlink(os.path.join(SHARED_MEMORY_DIR, name))  # all have mapped it or given up; mappings outlive it
        if not all(mapped):
            if opened is not None:
                os.close(opened[1])
            if rank == 0:
                reason = unsupported or f"its ranks do not share {SHARED_MEMORY_DIR}"
                log.info("A %d-rank group keeps gloo's TCP for its collectives: %s.", world_size, reason)
            return None
        assert opened is not None
        return cls(opened[0], opened[1], rank, global_ranks, timeout_ms)

    def close(self) -> None:
        """Release this rank's lock now (the object going, or the process ending, does it otherwise): the other
        ranks' waits for this one then fail at once. For a rank that stops taking part."""
        self._release()

    def usable_here(self) -> bool:
        """Only the thread that made the exchange issues its collectives (others would interleave slots)."""
        return threading.get_ident() == self._thread

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> list[Exchange]:
        """``output`` (N * shard.numel(),) receives every rank's ``shard`` in rank order (any dtype: moved as bytes)
        once the exchanges are waited for; ``shard`` may change as soon as this returns."""
        mine = _bytes_of(shard)
        rows = _bytes_of(output).view(self.world_size, -1)
        exchanges = []
        for start in range(0, mine.numel(), self.slot_bytes):
            end = min(start + self.slot_bytes, mine.numel())

            def write(slots: torch.Tensor, start: int = start, end: int = end) -> None:
                slots[self.rank, : end - start].copy_(mine[start:end])

            def read(slots: torch.Tensor, start: int = start, end: int = end) -> None:
                rows[:, start:end].copy_(slots[:, : end - start])

            exchanges.append(self._issue(write, read))
        return exchanges

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> list[Exchange]:
        """SUM of every rank's ``full`` (N * output.numel(),) over this rank's rows into ``output``, in rank order,
        once the exchanges are waited for; ``full`` may be freed as soon as this returns."""
        n, dtype = output.numel(), output.dtype
        regions = full.reshape(self.world_size, n)
        out = output.view(-1)
        per_region = self.slot_bytes // (self.world_size * full.element_size())
        exchanges = []
        for start in range(0, n, per_region):
            width = min(per_region, n - start)

            def write(slots: torch.Tensor, start: int = start, width: int = width) -> None:
                mine = slots.view(dtype)[self.rank, : self.world_size * width].view(self.world_size, width)
                mine.copy_(regions[:, start : start + width])

            def read(slots: torch.Tensor, start: int = start, width: int = width) -> None:
                every = slots.view(dtype)[:, : self.world_size * width].view(self.world_size, self.world_size, width)
                torch.sum(every[:, self.rank], dim=0, out=out[start : start + width])

            exchanges.append(self._issue(write, read))
        return exchanges

    def _issue(self, write: Callable[[torch.Tensor], object], read: Callable[[torch.Tensor], object]) -> Exchange:
        index = self._issued
        # Every exchange up to index - MAX_IN_FLIGHT is read before this one is issued, whatever order the handles
        # were waited in (a prefetched gather is often waited before the reduction issued ahead of it).
        while self._in_flight and self._in_flight[0].number <= index - MAX_IN_FLIGHT:
            self._complete(self._in_flight[0])
        # This buffer last served exchange index - BUFFERS, which every rank has read once all have issued
        # exchange index - 2 (each reads up to j - MAX_IN_FLIGHT before issuing j).
        self._wait_until_issued(index - 1)
        write(self._buffers[index % BUFFERS])
        self._lines[self._mine] = index + 1  # after the bytes: the others read them once they see this
        self._issued += 1
        exchange = Exchange(self, index, read)
        self._in_flight.append(exchange)
        return exchange

    def _complete(self, exchange: Exchange) -> None:
        if exchange not in self._in_flight:
            return  # read already, to make room for a later exchange
        self._wait_until_issued(exchange.number + 1)
        exchange.read(self._buffers[exchange.number % BUFFERS])
        self._in_flight.remove(exchange)

    def _wait_until_issued(self, count: int) -> None:
        """Until every rank has issued ``count`` exchanges: spins, then naps; raises where a rank it waits for has
        exited or the group's timeout has passed (see the Note)."""
        for _ in range(_YIELDS):
            if self._least() >= count:
                return
            os.sched_yield()
        started = last_check = time.monotonic()
        nap = _FIRST_NAP_S
        while self._least() < count:
            time.sleep(nap)
            nap = min(2 * nap, _LONGEST_NAP_S)
            now = time.monotonic()
            if now - last_check >= LIVENESS_S:
                last_check = now
                late = [r for r in range(self.world_size) if self._lines[r * _PER_LINE] < count]
                self._raise_if_exited(late, count)
                if (now - started) * 1000 > self._timeout_ms:
                    raise RuntimeError(
                        f"A shared-memory exchange of the sharding engine waited past its process group's timeout "
                        f"({self._timeout_ms} ms) for rank(s) {self._named(late)} to issue collective "
                        f"#{count - 1}; another rank stopped, hung, or did not issue the same collective"
                    )

    def _least(self) -> int:
        lines = self._lines
        return min(lines[r * _PER_LINE] for r in range(self.world_size))

    def _raise_if_exited(self, late: list[int], count: int) -> None:
        assert fcntl is not None
        exited = []
        for r in late:
            try:
                # Succeeds only where no process holds rank r's byte any more: rank r has exited.
                fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, r)
            except OSError:
                continue
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, r)
            exited.append(r)
        if exited:
            raise RuntimeError(
                f"Rank(s) {self._named(exited)} exited while this rank waited for them in a shared-memory exchange "
                f"of the sharding engine (collective #{count - 1})"
            )

    def _named(self, group_ranks: list[int]) -> list[int]:
        return [self._global_ranks[r] for r in group_ranks]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    # A view, never a copy: the output is written through it (``view`` raises where a tensor is not contiguous).
    return tensor.view(-1).view(torch.uint8)


def _create_arena(name: str, size: int, token: bytes) -> bool:
    """Rank 0: the arena's file with its pages reserved (zeros: every counter at 0) and ``token`` at its start; False
    where that fails."""
    path = os.path.join(SHARED_MEMORY_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # no /dev/shm, or not writable
        return False
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError:  # /dev/shm too small for the arena
        os.unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def _open_arena(name: str, token: bytes, size: int, rank: int) -> tuple[torch.Tensor, int] | None:
    """The arena mapped into this process, where ``name`` is the very file rank 0 made (its token), and a descriptor
    of it holding this rank's byte locked; else None."""
    assert fcntl is not None
    path = os.path.join(SHARED_MEMORY_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)  # not O_CREAT: another /dev/shm would otherwise get a file of its own
    except OSError:
        return None
    try:
        if os.pread(fd, _TOKEN_BYTES, 0) != token or os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        arena = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        # After the mapping: a POSIX lock goes when the process closes any descriptor of the file, as from_file
        # does with its own. This one stays open as long as the exchange.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
    except (OSError, RuntimeError):
        os.close(fd)
        return None
    return arena, fd
