"""ShardLayout follows torch.chunk on dim 0, and the reduce-scatter packing matches the all-gather layout."""

import pytest
import torch

from lightning_fsdp.engine.shard import ShardLayout


@pytest.mark.parametrize("shape", [(7, 5), (5,), (1, 3), (4, 4), (3, 2, 2), ()])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_local_rows_follow_torch_chunk(shape, world_size):
    full = torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float32).reshape(shape)
    flat_rows = full.reshape(1, 1) if full.dim() == 0 else full
    chunks = list(torch.chunk(flat_rows, world_size, dim=0))
    pieces = []
    for rank in range(world_size):
        layout = ShardLayout(torch.Size(shape), world_size, rank)
        local = layout.local_slice(full)
        expected = chunks[rank] if rank < len(chunks) else flat_rows[:0]
        assert local.numel() == expected.numel()
        assert torch.equal(local.reshape(-1), expected.reshape(-1))
        assert layout.local_numel <= layout.padded_numel
        pieces.append(local.reshape(-1))
    # The shards tile the parameter exactly: no element lost, none duplicated.
    assert torch.equal(torch.cat(pieces), full.reshape(-1))


@pytest.mark.parametrize("rows,world_size", [(5, 4), (3, 4), (1, 3), (7, 3), (4, 4), (9, 2)])
def test_chunk_cat_packs_like_the_gather_layout(rows, world_size):
    grad = torch.randn(rows, 3)
    packed = torch._chunk_cat([grad], dim=0, num_chunks=world_size).view(world_size, -1)
    for rank in range(world_size):
        layout = ShardLayout(grad.shape, world_size, rank)
        expected = torch.zeros(layout.padded_numel)
        expected[: layout.local_numel] = layout.local_slice(grad).reshape(-1)
        assert torch.equal(packed[rank], expected)
