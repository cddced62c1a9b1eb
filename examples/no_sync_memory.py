"""What gradient accumulation with ``no_sync`` costs and saves, per rank, on a small GPT under FULL_SHARD, 2 CPU ranks.

    python examples/no_sync_memory.py [--layers 4 --width 128 --seq 64 --micro 4 --steps 2]

Each step accumulates gradients over ``--micro`` microbatches, in three ways:
- ``sync``: every microbatch's backward reduces (reduce-scatters) its gradients into the shards' ``.grad``;
- ``no_sync``: every microbatch but the last runs inside ``engine.no_sync()``: each unit keeps its full-size
  gradient, summed over the microbatches, and the last backward reduces the sum once;
- ``no_sync + reshard_after_backward=False``: also keeps every unit unsharded from its first backward to the
  optimizer step, so later microbatches gather nothing either.

Memory is the engine's own accounting (no allocator statistics exist on CPU), sampled right before and after every
unit's unshard, reduction and gradient hold (each unit's methods wrapped per instance, as ShardingMonitor does):
this rank's parameter shards, its shard gradients, the full-size gradients alive (autograd's, not yet reduced or
held, plus those held with sync off), and the gathered full parameters. Activations, optimizer state and
communication buffers are not in it. Bytes per step are this rank's collective inputs, as ``CommStats`` counts them.
The script also checks that the three ways end at the same parameters.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine import ShardingEngine, fully_shard

VARIANTS = ("sync", "no_sync", "no_sync + reshard_after_backward=False")
WORLD = 2


def tracked(engine: ShardingEngine) -> dict[str, int]:
    """The engine-tracked bytes of this rank right now (see the module docstring)."""
    autograd_full = sum(
        s.full.grad.numel() * s.full.grad.element_size()
        for u in engine.units
        for s in u.slots
        if s.full.grad is not None
    )
    values = {
        "shards": engine.local_param_bytes(),
        "shard_grads": engine.local_grad_bytes(),
        "full_grads": autograd_full + engine.held_grad_bytes(),
        "gathered": sum(u.full_flat.untyped_storage().nbytes() for u in engine.units),
    }
    values["total"] = sum(values.values())
    return values


def instrument(engine: ShardingEngine, peak: dict[str, int], on: list[bool]) -> None:
    def sample() -> None:
        if not on:
            return
        for key, value in tracked(engine).items():
            peak[key] = max(peak.get(key, 0), value)

    for unit in engine.units:
        for name in ("unshard", "reduce_grads", "hold_grads"):
            original = getattr(unit, name)

            def wrapped(*args, _original=original, **kwargs):
                sample()
                result = _original(*args, **kwargs)
                sample()
                return result

            setattr(unit, name, wrapped)


def run(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdzv", rank=rank, world_size=world_size)
    config = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    results = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = GPT(config)
        engine = fully_shard(model, auto_wrap_policy={Block})
        if "reshard_after_backward" in variant:
            engine.set_reshard_after_backward(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        peak: dict[str, int] = {}
        on = [True]  # sampling during training only, not during the final gather below
        instrument(engine, peak, on)
        per_step = []
        for step in range(args.steps):
            generator = torch.Generator().manual_seed(1000 * step + rank)  # this rank's samples of the global batch
            data = torch.randint(0, 65, (args.micro * args.batch, args.seq + 1), generator=generator)
            engine.shard_comm.stats.reset()
            for micro, part in enumerate(data.chunk(args.micro)):
                x, y = part[:, :-1], part[:, 1:]
                if variant != "sync" and micro < args.micro - 1:
                    with engine.no_sync():
                        (model(x, y)[1] / args.micro).backward()
                else:
                    (model(x, y)[1] / args.micro).backward()
            stats = engine.shard_comm.stats
            per_step.append((stats.reduce_scatter_bytes, stats.all_reduce_bytes, stats.all_gather_bytes))
            optimizer.step()
            optimizer.zero_grad()
        on.clear()
        with engine.unsharded():
            params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        results[variant] = {"peak": peak, "per_step": per_step, "params": params}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, f"{folder}/results.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="samples per microbatch and rank")
    parser.add_argument("--micro", type=int, default=4, help="microbatches per optimizer step")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(run, args=(WORLD, folder, args), nprocs=WORLD, start_method="spawn")
        ranks = torch.load(f"{folder}/results.pt", weights_only=False)

    config = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    model = GPT(config)
    numel = sum(p.numel() for p in model.parameters())
    print(
        f"GPT {args.layers} x {args.width} ({numel:,} parameters, {4 * numel / 2**20:.2f} MiB fp32), FULL_SHARD on "
        f"{WORLD} gloo ranks, {args.micro} microbatches per step, {args.steps} steps\n"
    )
    mib = 2**20
    print(
        "| variant | rank | peak tracked MiB | peak full-size grads MiB | peak gathered params MiB | "
        "reduce-scatter bytes/step | all-reduce bytes/step | all-gather bytes/step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        for rank, results in enumerate(ranks):
            result = results[variant]
            peak = result["peak"]
            steps = result["per_step"]
            assert all(s == steps[0] for s in steps), steps  # the same every step
            scatter, reduce, gather = steps[0]
            print(
                f"| {variant} | {rank} | {peak['total'] / mib:.2f} | {peak['full_grads'] / mib:.2f} | "
                f"{peak['gathered'] / mib:.2f} | {scatter:,} | {reduce:,} | {gather:,} |"
            )
    base = ranks[0]["sync"]["params"]
    for variant in VARIANTS[1:]:
        diff = (ranks[0][variant]["params"] - base).abs().max().item()
        print(f"\nmax |parameter difference| after {args.steps} steps, {variant} vs sync: {diff:.3g}", end="")
    print()


if __name__ == "__main__":
    main()
