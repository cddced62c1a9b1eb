"""All-gathers and reduce-scatters between CPU ranks of one host through a shared-memory arena instead of gloo.

[Note: the shared-memory exchange]
gloo moves a CPU rank's bytes through the loopback TCP stack: every byte is copied into the kernel and out again, on
the same cores that compute, by gloo's worker threads. Ranks of one host can read each other's memory instead. The
ranks of a group map one file of ``/dev/shm`` (the arena): two buffers, each with one slot of ``SLOT_BYTES`` per
rank. An exchange writes this rank's part into its slot of the next buffer, waits until every rank has written (a
one-element gloo all-reduce: the barrier, which keeps the group's timeout and its error when a rank is gone), then
reads: an all-gather copies every slot into the output, a reduce-scatter sums every slot's copy of this rank's rows
in rank order. Tensors larger than a slot go in chunks, one barrier each.

Why two buffers and one barrier: a rank writes buffer ``b`` again at exchange ``k + 2`` only after passing exchange
``k + 1``'s barrier, which no rank reaches before it has finished reading exchange ``k`` from ``b``. So the reads of
one exchange never race the writes of the next, provided every rank issues the same exchanges in the same order,
which the engine already requires of its collectives ([Note: which collectives] in comm.py).

An exchange completes before it returns: nothing is left in flight, and no background thread competes with the
compute for the cores (the 2-rank timings are in docs/decisions.md, "Same-host ranks through shared memory"). It is
used only from the thread that made it; other threads (the asynchronous checkpoint writer) keep gloo.

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

import torch
import torch.distributed as dist

# Bytes per rank per buffer: the arena is 2 * SLOT_BYTES per rank of the group (16 MiB per rank, mapped once per host).
SLOT_BYTES = 8 * 2**20
SHARED_MEMORY_DIR = "/dev/shm"
# "0" keeps gloo for every collective (a comparison, or a host whose /dev/shm is too small to share).
SWITCH_VARIABLE = "LIGHTNING_FSDP_SHARED_MEMORY"
_TOKEN_BYTES = 16

log = logging.getLogger(__name__)


def shared_memory_wanted() -> bool:
    return os.environ.get(SWITCH_VARIABLE, "1") != "0"


class SharedMemoryExchange:
    """The arena of one process group ([Note: the shared-memory exchange]); ``for_group`` makes it on every rank."""

    def __init__(self, arena: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, rank: int) -> None:
        self._buffers = arena.view(2, world_size, SLOT_BYTES)
        self.group, self.world_size, self.rank = group, world_size, rank
        self._exchanges = 0
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._thread = threading.get_ident()

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, world_size: int, rank: int) -> SharedMemoryExchange | None:
        """The group's exchange, or None on every rank where any rank cannot share the arena. Collective."""
        size = 2 * world_size * SLOT_BYTES
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

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """``output`` (N * shard.numel(),) receives every rank's ``shard`` in rank order (any dtype: moved as bytes)."""
        mine = _bytes_of(shard)
        rows = _bytes_of(output).view(self.world_size, -1)
        for start in range(0, mine.numel(), SLOT_BYTES):
            end = min(start + SLOT_BYTES, mine.numel())
            slots = self._next_buffer()
            slots[self.rank, : end - start].copy_(mine[start:end])
            self._barrier()
            rows[:, start:end].copy_(slots[:, : end - start])

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """SUM of every rank's ``full`` (N * output.numel(),) over this rank's rows into ``output``, in rank order."""
        n, dtype = output.numel(), output.dtype
        regions = full.reshape(self.world_size, n)
        per_region = SLOT_BYTES // (self.world_size * full.element_size())
        for start in range(0, n, per_region):
            end = min(start + per_region, n)
            width = end - start
            slots = self._next_buffer().view(dtype)  # (N, SLOT_BYTES // itemsize)
            slots[self.rank, : self.world_size * width].view(self.world_size, width).copy_(regions[:, start:end])
            self._barrier()
            theirs = slots[:, : self.world_size * width].view(self.world_size, self.world_size, width)[:, self.rank]
            torch.sum(theirs, dim=0, out=output.view(-1)[start:end])

    def _next_buffer(self) -> torch.Tensor:
        buffer = self._buffers[self._exchanges % 2]
        self._exchanges += 1
        return buffer

    def _barrier(self) -> None:
        dist.all_reduce(self._flag, group=self.group)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        raise ValueError("the shared-memory exchange moves contiguous tensors only")
    return flat.view(torch.uint8)


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
