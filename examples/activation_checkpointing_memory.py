"""Peak memory per rank with and without activation checkpointing, on a GPT under FULL_SHARD with 2 CPU ranks.

    python examples/activation_checkpointing_memory.py [--layers 4 --width 256 --seq 256 --batch 8]

Two measures per rank, both stated in the output:
- saved activations: bytes of the tensors autograd saves for backward during one forward
  (torch.autograd.graph.saved_tensors_hooks), i.e. the activation memory held between forward and backward;
- peak live tensor bytes over two training steps, from torch.profiler's allocator events
  (benchmarks.memory.LiveTensorBytes), which includes shards, gathered units, gradients,
  optimizer state, activations and communication buffers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# benchmarks/ is not installed with the package: it is imported from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory import LiveTensorBytes  # noqa: E402
from lightning_fsdp.activation_checkpointing import apply_activation_checkpointing, parse_checkpointing_policy  # noqa: E402
from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig  # noqa: E402
from lightning_fsdp.engine import fully_shard  # noqa: E402


def measure(rank: int, world_size: int, folder: str, args: argparse.Namespace, checkpointed: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rdzv-{checkpointed}", rank=rank, world_size=world_size
    )
    config = GPTConfig(vocab_size=65, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    generator = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 65, (args.batch, args.seq + 1), generator=generator)
    x, y = data[:, :-1], data[:, 1:]
    with LiveTensorBytes() as live:
        torch.manual_seed(0)
        model = GPT(config)
        if checkpointed:
            apply_activation_checkpointing(model, parse_checkpointing_policy({Block}))
        fully_shard(model, auto_wrap_policy={Block})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        saved = []
        with live.window():
            for _step in range(2):
                hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t)
                with hooks:
                    _, loss = model(x, y)
                saved_bytes = sum(saved)
                saved.clear()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    result = torch.tensor([saved_bytes, live.peak, loss.item()], dtype=torch.float64)
    gathered = [torch.zeros_like(result) for _ in range(world_size)]
    dist.all_gather(gathered, result)
    if rank == 0:
        torch.save([g.tolist() for g in gathered], f"{folder}/result-{checkpointed}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for checkpointed in (False, True):
            mp.start_processes(measure, args=(2, folder, args, checkpointed), nprocs=2, start_method="spawn")
            rows.append((checkpointed, torch.load(f"{folder}/result-{checkpointed}.pt")))
    print(
        f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, batch {args.batch} per rank, "
        "FULL_SHARD, 2 CPU ranks, AdamW"
    )
    print("| activation checkpointing | rank | saved activations (MiB) | peak live tensor bytes (MiB) | loss |")
    print("| --- | --- | --- | --- | --- |")
    for checkpointed, per_rank in rows:
        for rank, (saved, peak, loss) in enumerate(per_rank):
            print(
                f"| {'on' if checkpointed else 'off'} | {rank} | {saved / 2**20:.1f} | {peak / 2**20:.1f} "
                f"| {loss:.4f} |"
            )


if __name__ == "__main__":
    main()
