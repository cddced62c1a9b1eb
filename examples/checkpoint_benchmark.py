"""Save and load time and peak memory per rank for each checkpoint format, on a GPT of about 100M parameters.

    python examples/checkpoint_benchmark.py --out /tmp/ckpt-bench [--layers 12 --width 840]

Two CPU ranks, FULL_SHARD with each Block a unit, after one AdamW step (so optimizer state exists). Per format:
- time: wall time of ``trainer.save_checkpoint`` (model + optimizer + Lightning state) and of loading it back
  (``strategy.load_checkpoint`` + model and optimizer state), each between barriers, the slower rank's;
- peak memory: the highest live tensor bytes above the level at the start of the save (or load), from torch's
  allocator events (``benchmarks.memory.LiveTensorBytes``), per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
# benchmarks/ is not installed with the package: it is imported from this checkout (for rank 1 too, which Lightning
# starts by running this script again).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fsdp  # noqa: E402,F401
from benchmarks.memory import LiveTensorBytes  # noqa: E402
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch, _):
        return self.model(batch[0], batch[1])[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=840)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=65, block_size=32, n_layer=args.layers, n_head=8, n_embd=args.width)
    data = torch.randint(0, 65, (4, 33))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)
    rows = []
    for mode in ("full", "sharded", "local"):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            # The model stays sharded after fit: the save and load below are those of a sharded model.
            strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=mode, weights_after_stage="sharded"),
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        torch.manual_seed(0)
        module = Module(config)
        params = sum(p.numel() for p in module.parameters())
        trainer.fit(module, loader)
        strategy = trainer.strategy
        path = os.path.join(args.out, f"ckpt-{mode}")
        with LiveTensorBytes() as live:
            strategy.barrier()
            start = time.perf_counter()
            with live.window():
                trainer.save_checkpoint(path)
                strategy.barrier()
            save_s = time.perf_counter() - start
        save_peak = live.peak - live.at_window_start
        with LiveTensorBytes() as live:
            strategy.barrier()
            start = time.perf_counter()
            with live.window():
                checkpoint = strategy.load_checkpoint(path)
                strategy.load_model_state_dict(checkpoint)
                strategy.load_optimizer_state_dict(checkpoint)
                del checkpoint
                strategy.barrier()
            load_s = time.perf_counter() - start
        load_peak = live.peak - live.at_window_start
        stats = strategy.all_gather(torch.tensor([save_s, load_s, save_peak, load_peak], dtype=torch.float64))
        size = (
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            if os.path.isdir(path)
            else os.path.getsize(path)
        )
        rows.append({"mode": mode, "params": params, "bytes_on_disk": size, "per_rank": stats.tolist()})
        strategy.barrier()
        if trainer.is_global_zero:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if trainer.is_global_zero:
        print(json.dumps(rows))
        mib = 2**20
        print(f"GPT {args.layers}x{args.width}: {rows[0]['params']:,} parameters; 2 CPU ranks, FULL_SHARD, AdamW")
        print(
            "| format | on disk (MiB) | save s (max rank) | load s (max rank) "
            "| save peak MiB r0 / r1 | load peak MiB r0 / r1 |"
        )
        print("| --- | ---: | ---: | ---: | --- | --- |")
        for row in rows:
            per = row["per_rank"]
            print(
                f"| {row['mode']} | {row['bytes_on_disk'] / mib:.0f} | {max(p[0] for p in per):.2f} | "
                f"{max(p[1] for p in per):.2f} | {per[0][2] / mib:.0f} / {per[1][2] / mib:.0f} | "
                f"{per[0][3] / mib:.0f} / {per[1][3] / mib:.0f} |"
            )


if __name__ == "__main__":
    main()
