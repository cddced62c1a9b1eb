"""ShardLayout follows torch.chunk on dim 0, and the reduce-scatter packing matches the all-gather layout.

The chunking rule, written out here so the expected values do not come from the code under test: a parameter of
shape ``(d0, ...)`` (a 0-dim one counts as one row of one element) is split on dim 0 over N ranks with
``c = ceil(d0 / N)`` rows per chunk; rank ``r`` holds rows ``[min(r*c, d0), min((r+1)*c, d0))`` and every rank's
slot in a flat collective buffer is ``c`` rows long, the missing rows zero.
"""

import math

import pytest
import torch

from lightning_fsdp.engine import ShardLayout

SHAPES = [(7, 5), (5,), (1, 3), (4, 4), (3, 2, 2), ()]
WORLD_SIZES = [1, 2, 3, 4]


def expected_rows(shape: tuple, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """(first row, end row, chunk rows c, elements per row) of ``rank`` under the rule above."""
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    c = -(-rows // world_size)
    start = min(rank * c, rows)
    return start, min(start + c, rows), c, row_numel


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_local_rows_follow_torch_chunk(shape, world_size):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    flat_rows = full.reshape(1, 1) if full.dim() == 0 else full
    chunks = list(torch.chunk(flat_rows, world_size, dim=0))
    pieces = []
    for rank in range(world_size):
        layout = ShardLayout(torch.Size(shape), world_size, rank)
        local = layout.local_slice(full)
        expected = chunks[rank] if rank < len(chunks) else flat_rows[:0]
        assert local.numel() == expected.numel()
        assert torch.equal(local.reshape(-1), expected.reshape(-1))
        start, end, c, row_numel = expected_rows(shape, world_size, rank)
        assert torch.equal(local.reshape(-1), flat_rows[start:end].reshape(-1))
        assert layout.local_numel == (end - start) * row_numel
        assert layout.padded_numel == c * row_numel
        assert tuple(layout.local_shape) == ((end - start, *shape[1:]) if shape else (end - start,))
        pieces.append(local.reshape(-1))
    # The shards tile the parameter exactly: no element lost, none duplicated.
    assert torch.equal(torch.cat(pieces), full.reshape(-1))
    assert len(pieces) == world_size


@pytest.mark.parametrize("rows,world_size", [(5, 4), (3, 4), (1, 3), (7, 3), (4, 4), (9, 2)])
def test_chunk_cat_packs_like_the_gather_layout(rows, world_size):
    grad = torch.randn(rows, 3)
    packed = torch._chunk_cat([grad], dim=0, num_chunks=world_size).view(world_size, -1)
    compared = 0
    for rank in range(world_size):
        start, end, c, row_numel = expected_rows((rows, 3), world_size, rank)
        expected = torch.zeros(c * row_numel)  # rank's slot: c rows, the missing ones zero
        expected[: (end - start) * row_numel] = grad[start:end].reshape(-1)
        assert torch.equal(packed[rank], expected)
        # The engine's layout agrees with the packing it feeds the reduce-scatter.
        layout = ShardLayout(grad.shape, world_size, rank)
        assert layout.padded_numel == packed.shape[1]
        assert torch.equal(layout.local_slice(grad).reshape(-1), packed[rank][: layout.local_numel])
        compared += 1
    assert compared == world_size


def test_the_rule_leaves_trailing_ranks_empty():
    # 3 rows over 4 ranks: c = 1, ranks 0-2 one row each, rank 3 none (torch.chunk returns only 3 chunks).
    assert [expected_rows((3, 2), 4, r)[:2] for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [ShardLayout(torch.Size((3, 2)), 4, r).local_numel for r in range(4)] == [2, 2, 2, 0]
    # 5 rows over 4 ranks: c = 2, so rank 2 holds one row and rank 3 none (not 2, 1, 1, 1).
    assert [ShardLayout(torch.Size((5,)), 4, r).local_numel for r in range(4)] == [2, 2, 1, 0]
