"""All-gathers and reduce-scatters between CPU ranks of one host through a shared-memory arena instead of gloo.

[Note: the shared-memory exchange]
gloo moves a CPU rank's bytes through the loopback TCP stack: every byte is copied into the kernel and out again, on
the same cores that compute, by gloo's worker threads. Ranks of one host can read each other's memory instead. The
ranks of a group map one file of ``/dev/shm`` (the arena): ``BUFFERS`` buffers, each with one slot per rank
(``slot_bytes``: ``ARENA_BYTES`` shared out, at most 8 MiB). Issuing an exchange writes this rank's part into its
slot of the next buffer and starts a one-element gloo all-reduce, the barrier (it keeps the group's timeout and its
error when a rank is gone, and its sends and receives are system calls, which order the memory); waiting for it
waits for the barrier, then reads: an all-gather copies every slot into the output, a reduce-scatter sums every
slot's copy of this rank's rows in rank order. Tensors larger than a slot go in chunks, one exchange each.
Between issue and wait the rank computes on; a prefetched gather or a reduction in flight thus absorbs the ranks'
drift instead of stopping the faster one at every unit.

Why ``MAX_IN_FLIGHT + 2`` buffers: before issuing exchange ``j`` a rank reads every exchange up to
``j - MAX_IN_FLIGHT`` (the oldest first, whatever order the handles were waited in), and waits for the barrier of
``j - 2``, i.e. until every rank has issued ``j - 2`` and so has read up to ``j - 2 - MAX_IN_FLIGHT``: the exchange
that last used ``j``'s buffer. So no write reaches a slot another rank has still to read, provided every rank issues
the same exchanges in the same order, which the engine already requires of its collectives ([Note: which
collectives] in comm.py). Exchanges are issued and read only from the thread that made the arena; other threads
(the asynchronous checkpoint writer) keep gloo.

Setting up is collective and proves the arena is shared: group rank 0 creates the file, reserves its pages (so a
full ``/dev/shm`` is an error now, not a SIGBUS later) and writes a random token; every other rank opens the file
without creating it and compares the token. Ranks in different containers of one host (their own ``/dev/shm``), or
a host without ``/dev/shm``, fail the check, and the whole group keeps gloo. The file is unlinked once every rank has
mapped it, so nothing is left behind when the processes end."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The arena: at most 64 MiB per group, once per host, resident in every rank (each reads every slot); a slot of at
# most 8 MiB per rank and buffer (2 ranks: 8 MiB; 8 ranks: 2 MiB). MAX_IN_FLIGHT exchanges issued and not yet read
# per rank, BUFFERS = MAX_IN_FLIGHT + 2 (see the Note).
ARENA_BYTES = 64 * 2**20
MAX_SLOT_BYTES = 8 * 2**20
MAX_IN_FLIGHT = 2
BUFFERS = MAX_IN_FLIGHT + 2
SHARED_MEMORY_DIR = "/dev/shm"
# "0" keeps gloo for every collective (a comparison, or a host whose /dev/shm is too small to share).
SWITCH_VARIABLE = "LIGHTNING_FSDP_SHARED_MEMORY"
_TOKEN_BYTES = 16

log = logging.getLogger(__name__)


def slot_bytes(world_size: int) -> int:
    """Bytes of one rank's slot in one buffer: the arena shared out, a multiple of 64 (any dtype's alignment)."""
    return min(MAX_SLOT_BYTES, ARENA_BYTES // (BUFFERS * world_size) // 64 * 64)


def shared_memory_wanted() -> bool:
    return os.environ.get(SWITCH_VARIABLE, "1") != "0"


@dataclass(eq=False)
class Exchange:
    """One exchange issued: its barrier in flight, and the copy out of the arena to run once it is passed. A
    ``Waitable``: ``comm.Pending`` waits for a collective's exchanges as for gloo's work handles."""

    owner: SharedMemoryExchange
    number: int
    barrier: dist.Work
    read: Callable[[torch.Tensor], object]

    def wait(self) -> None:
        self.owner._complete(self)


class SharedMemoryExchange:
    """The arena of one process group ([Note: the shared-memory exchange]); ``for_group`` makes it on every rank."""

    def __init__(self, arena: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, rank: int) -> None:
        self.slot_bytes = slot_bytes(world_size)
        self._buffers = arena.view(BUFFERS, world_size, self.slot_bytes)
        self.group, self.world_size, self.rank = group, world_size, rank
        self._issued = 0
        self._in_flight: list[Exchange] = []  # issued, not yet read, in issue order
        self._last_barriers: deque[dist.Work] = deque(maxlen=2)  # of the last two exchanges issued (see the Note)
        self._flags = [torch.zeros(1, dtype=torch.int32) for _ in range(BUFFERS)]
        self._thread = threading.get_ident()

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, world_size: int, rank: int) -> SharedMemoryExchange | None:
        """The group's exchange, or None on every rank where any rank cannot share the arena. Collective."""
        size = BUFFERS * world_size * slot_bytes(world_size)
        # Each rank looks for the name in its own /dev/shm: the same file only where the ranks share one.
        name, token = f"lightning_fsdp_{uuid.uuid4().hex}", os.urandom(_TOKEN_BYTES)
        created = rank == 0 and _create_arena(name, size, token)
        offers: list[tuple[str, bytes] | None] = [None] * world_size
        dist.all_gather_object(offers, (name, token) if created else None, group=group)
        offer = offers[0]
        arena = _open_arena(*offer, size) if offer is not None else None
        mapped: list[bool] = [False] * world_size
        dist.all_gather_object(mapped, arena is not None, group=group)
        if created:
            os.unlink(os.path.join(SHARED_MEMORY_DIR, name))  # all have mapped it or given up; mappings outlive it
        if not all(mapped):
            if rank == 0:
                log.info(
                    "The ranks of a %d-rank group do not share %s: its collectives stay on gloo's TCP.",
                    world_size,
                    SHARED_MEMORY_DIR,
                )
            return None
        assert arena is not None
        return cls(arena, group, world_size, rank)

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
        # exchange index - 2 (each reads up to j - MAX_IN_FLIGHT before issuing j): the older of the last two barriers.
        if len(self._last_barriers) == 2:
            self._last_barriers[0].wait()
        slots = self._buffers[index % BUFFERS]
        write(slots)
        barrier = dist.all_reduce(self._flags[index % BUFFERS], group=self.group, async_op=True)
        assert barrier is not None
        self._last_barriers.append(barrier)
        self._issued += 1
        exchange = Exchange(self, index, barrier, read)
        self._in_flight.append(exchange)
        return exchange

    def _complete(self, exchange: Exchange) -> None:
        if exchange not in self._in_flight:
            return  # read already, to make room for a later exchange
        exchange.barrier.wait()
        exchange.read(self._buffers[exchange.number % BUFFERS])
        self._in_flight.remove(exchange)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    # A view, never a copy: the output is written through it (``view`` raises where a tensor is not contiguous).
    return tensor.view(-1).view(torch.uint8)


def _create_arena(name: str, size: int, token: bytes) -> bool:
    """Rank 0: the arena's file with its pages reserved and ``token`` at its start; False where that fails."""
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


def _open_arena(name: str, token: bytes, size: int) -> torch.Tensor | None:
    """The arena mapped into this process, where ``name`` is the very file rank 0 made (its token); else None."""
    path = os.path.join(SHARED_MEMORY_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)  # not O_CREAT: another /dev/shm would otherwise get a file of its own
    except OSError:
        return None
    try:
        if os.pread(fd, _TOKEN_BYTES, 0) != token or os.fstat(fd).st_size != size:
            return None
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    finally:
        os.close(fd)
