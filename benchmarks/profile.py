"""Where an fsdp_custom training step spends its time: torch.profiler over a few steps of the benchmark's GPT.

``python -m benchmarks.profile [--strategy FULL_SHARD] [--steps 3] [--layers 6 --width 512 ...]``
runs 2 gloo processes (1 thread each), profiles the steps after one warm-up step, and prints rank 0's operators
by self CPU time, grouped into compute, collectives, the engine's copies and the rest, with the share of each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import defaultdict

import torch
import torch.distributed as dist

from benchmarks.ranks import join_gloo_group, spawn_ranks, wait_ranks
from lightning_fsdp.shutdown import destroy_process_group

# Operator name fragments -> group. Collectives on gloo run in its own threads: the profiler sees the time the
# training thread spends issuing and waiting for them.
_GROUPS = (
    ("collective", ("c10d::", "gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "wait")),
    (
        "engine copy",
        (
            "split_with_sizes_copy",
            "_chunk_cat",
            "aten::copy_",
            "aten::cat",
            "aten::div_",
            "resize_",
            "aten::zeros",
            "aten::empty",
        ),
    ),
    ("optimizer", ("_foreach_", "Optimizer.step", "adamw")),
    (
        "compute",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
            "softmax",
            "gelu",
            "layer_norm",
            "scaled_dot_product",
            "aten::mul",
            "aten::add",
            "embedding",
            "cross_entropy",
            "nll_loss",
            "log_softmax",
            "aten::tanh",
            "aten::sum",
            "aten::mean",
        ),
    ),
)


def _group(name: str) -> str:
    lowered = name.lower()
    for group, fragments in _GROUPS:
        if any(f.lower() in lowered for f in fragments):
            return group
    return "other"


def _worker(rank: int, world: int, folder: str, args: argparse.Namespace) -> None:
    from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig
    from lightning_fsdp.engine import fully_shard

    join_gloo_group(folder, rank, world)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    model = GPT(config)
    fully_shard(model, sharding_strategy=args.strategy, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        x = torch.randint(0, 65, (args.batch, args.seq), generator=g)
        _logits, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("train_step"):
                step()
    if rank == 0:
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        groups: dict[str, float] = defaultdict(float)
        for e in events:
            groups[_group(e.key)] += e.self_cpu_time_total
        steps = args.steps
        print(f"\n{args.strategy}, {steps} steps, rank 0: {total / 1e3 / steps:.0f} ms of operator self time per step")
        for name, value in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {name:12s} {value / 1e3 / steps:8.1f} ms/step  {100 * value / total:5.1f}%")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="FULL_SHARD")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25, help="operators in the printed table")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        problem = wait_ranks(spawn_ranks(_worker, (2, folder, args), 2))
    if problem is not None:
        raise SystemExit(problem)


if __name__ == "__main__":
    main()
