"""Train ToyLM under ``Trainer(precision=...)`` and record the dtypes and bytes of what each rank holds.

Run by tests/strategy/test_true_precision.py, with ``--devices 2 --strategy fsdp_custom_blocks`` (the launcher re-runs
this
script per rank) or ``--devices 1 --strategy auto`` (plain Lightning on one device: the reference), once per flag of
``--precision`` (comma-separated; a fresh Trainer each, the process group stays up). The model is
built under ``trainer.init_module()``, the data and optimizer are tests/scripts/lightning_parity.py's (SGD with
momentum, weight decay, a step schedule; rank r takes samples r, r+N, ... of the same global batches).

Each rank writes ``{flag: {...}}`` to ``--out.rank{N}``: ``losses`` (the global batch's mean per step), ``state``
(the module's state dict after ``fit``), and, recorded in ``on_train_end`` (before the stage ends): the dtypes of
the optimizer's parameters, their gradients and its state tensors, and the bytes of each on this rank.
"""

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy  # noqa: E402
from tests.scripts.lightning_parity import GLOBAL_BATCH, SAMPLES, Module  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer, save_rank_results  # noqa: E402
from tests.toolbox.models import Block, samples  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Recorded(Module):
    def __init__(self) -> None:
        super().__init__("sgd", meta=False)
        self.held = {}

    def on_train_end(self) -> None:
        optimizer = self.trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        states = [t for p in params for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
        self.held = {
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "grad_dtypes": sorted({str(g.dtype) for g in grads}),
            "state_dtypes": sorted({str(t.dtype) for t in states}),
            "counts": (len(params), len(grads), len(states)),
            "param_bytes": nbytes(params),
            "grad_bytes": nbytes(grads),
            "state_bytes": nbytes(states),
        }


def train(devices: int, strategy_name: str, precision: str) -> tuple[dict, int]:
    strategy = FSDPStrategy(auto_wrap_policy={Block}) if strategy_name == "fsdp_custom_blocks" else strategy_name
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=6,
        use_distributed_sampler=False,
        precision=precision,
    )
    torch.manual_seed(0)
    with trainer.init_module():
        module = Recorded()
    built = sorted({str(p.dtype) for p in module.parameters()})
    sampler = DistributedSampler(samples(SAMPLES), trainer.world_size, trainer.global_rank, shuffle=False)
    trainer.fit(module, DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // devices, sampler=sampler))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": module.step_losses, "state": state, "built_dtypes": built, **module.held}, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp_custom_blocks")
    parser.add_argument("--precision", default="bf16-true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, rank = {}, 0
    for precision in args.precision.split(","):
        results[precision], rank = train(args.devices, args.strategy, precision)
    save_rank_results(results, args.out, rank)


if __name__ == "__main__":
    main()
