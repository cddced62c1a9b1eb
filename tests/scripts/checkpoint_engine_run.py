"""Sharded checkpoints of a model with a 0-dim parameter, an ignored (whole) module and a buffer, on 2 processes
without Lightning: save sharded 2 ways, load into a copy sharded 1 way (a shard group of one rank per process), save
that, and load it back into a copy sharded 2 ways. Rank 0 writes the states it saw to ``--out``.

``python tests/scripts/checkpoint_engine_run.py --out FILE --dir DIR`` (spawns its 2 processes itself).
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: one row, held by rank 0 only
        self.lin = nn.Linear(5, 7)
        self.ign = nn.Linear(5, 5)  # ignored: whole on every rank
        self.register_buffer("buf", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(self.ign(x)) * self.scale).square().mean()


def _gathered_optimizer(engine, optimizer) -> dict:
    """Full optimizer state (0-dim parameters' state as 0-dim tensors at any layout)."""
    from lightning_fsdp.engine import gather_rows

    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, param in enumerate(params):
        slot = engine.slot_of(param)
        entry = {}
        for name, value in sorted(optimizer.state[param].items()):
            if slot is not None and value.dim() > 0 and tuple(value.shape) == tuple(slot.layout.local_shape):
                value = (
                    gather_rows(value, slot.layout, engine.shard_comm)
                    if slot.layout.world_size > 1
                    else value.reshape(slot.layout.shape)
                )
            entry[name] = value.detach().clone()
        out[index] = entry
    return out


def worker(rank: int, port: int, folder: str, out: str) -> None:
    from lightning_fsdp.checkpoint.common import CheckpointRun, load_sharded_model_state_dict
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.checkpoint.sharded import (
        load_sharded_checkpoint,
        save_sharded_checkpoint,
        sharded_model_state_dict,
        sharded_optimizer_state_dict,
    )
    from lightning_fsdp.engine import fully_shard
    from lightning_fsdp.shutdown import destroy_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    singles = [dist.new_group([0]), dist.new_group([1])]

    def build(group):
        model = Model()
        engine = fully_shard(model, process_group=group, ignored_modules=[model.ign])
        return model, engine, torch.optim.AdamW(model.parameters(), lr=0.1)

    def save(engine, optimizer, path):
        save_sharded_checkpoint(
            {
                "state_dict": sharded_model_state_dict(engine),
                "optimizer_states": [sharded_optimizer_state_dict(engine, optimizer)],
                "global_step": 2,
            },
            path,
        )

    def load(engine, optimizer, path):
        checkpoint = load_sharded_checkpoint(path, CheckpointRun(engine, [optimizer]))
        load_sharded_model_state_dict(engine, checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])

    def snapshot(engine, optimizer):
        return {
            "params": full_model_state_dict(engine, rank0_only=False),
            "optimizer": _gathered_optimizer(engine, optimizer),
        }

    # A: 2-way, two AdamW steps, saved.
    model, engine, optimizer = build(None)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(3, 5, generator=g)).backward()
        optimizer.step()
        optimizer.zero_grad()
    two_way = os.path.join(folder, "two_way.ckpt")
    save(engine, optimizer, two_way)
    results = {"a": snapshot(engine, optimizer)}
    # B: 1-way (each process its own shard group), loaded from A, saved.
    model_b, engine_b, optimizer_b = build(singles[rank])
    load(engine_b, optimizer_b, two_way)
    results["b"] = snapshot(engine_b, optimizer_b)
    results["b_scale_shard"] = tuple(model_b.scale.shape)
    one_way = os.path.join(folder, "one_way.ckpt")
    save(engine_b, optimizer_b, one_way)
    # C: 2-way again, loaded from B.
    model_c, engine_c, optimizer_c = build(None)
    load(engine_c, optimizer_c, one_way)
    results["c"] = snapshot(engine_c, optimizer_c)
    results["c_scale_shard"] = tuple(model_c.scale.shape)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.dir, args.out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
