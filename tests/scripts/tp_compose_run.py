"""Tensor parallelism composed with the rest of the strategy under Lightning, every case's ``Trainer.fit`` in sequence
in one launch (the process group stays up between them), as a user's script would run them.

    python tests/scripts/tp_compose_run.py --out DIR --devices 4 --cases accumulate,checkpointing,...   # TP=2 x DP=2
    python tests/scripts/tp_compose_run.py --out DIR --devices 1 --cases sgd,adamw,...                  # one device
    python tests/scripts/tp_compose_run.py --out DIR --devices 4 --cases fault --fault-rank 1 --timeout 10

The model is tests/toolbox/tp_models.py's ChainLM (four Blocks, each parallelized in ``configure_model``
on ``self.device_mesh["tensor_parallel"]``: ``fc1`` column-wise, ``fc2`` row-wise; not on one device). Rank r's
loader takes the data-parallel rank and size from ``trainer.distributed_sampler_kwargs`` with
``use_distributed_sampler=False``, so every step's global batch is the one-device run's. Every case clips by norm at
``CLIP`` (below the gradients' norm: the reference records it). The cases (``CASES``):

- ``sgd``, ``adamw``: plain training (the one-device references of the cases that change nothing numerically);
- ``accumulate``: ``accumulate_grad_batches=2`` (SGD with momentum);
- ``checkpointing``: the strategy's ``activation_checkpointing_policy={Block}`` (AdamW); each rank counts the
  forwards of the first block's ``fc1`` (twice per step when its forward is recomputed in backward);
- ``full``: ``weights_after_stage="full"`` (SGD): the state is read from the module itself after ``fit``;
- ``compile``: each block ``block.compile(backend="aot_eager")`` after it is parallelized (AdamW), with dynamo's
  counters;
- ``bf16``: ``Trainer(precision="bf16-mixed")`` (SGD), with the dtype of the first ``fc1``'s weight in forward;
- ``pretrained``: the model built under ``trainer.init_module(empty_init=True)`` (parallelized on the meta device),
  filled by ``load_pretrained(self.model, --pretrained)`` in ``on_fit_start`` (SGD), each tensor the loader
  materialises from the file recorded by name and shape, beside each parameter's local shape; at the end a ``local``
  checkpoint is saved to DIR/local.ckpt (with ``--devices 1``: the same load into the whole model, and the optimizer's
  state dict recorded);
- ``fault``: rank ``--fault-rank`` ``os._exit``s from a gradient hook in the middle of step 1's backward
  (tests/scripts/fault_run.py's fault), under ``FSDPStrategy(timeout=--timeout s)``; progress lines as fault_run's.

Each rank writes DIR/rank<r>.pt after every case: ``{case: {...}}`` with the losses of each forward, the full state,
the gradient norms (one device) and what the case records.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy, load_pretrained  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from lightning_fsdp.engine import get_engine  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from tests.scripts.fault_run import inject, say  # noqa: E402
from tests.scripts.tensor_parallel_run import GLOBAL_BATCH, SAMPLES  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402
from tests.toolbox.safetensors_reads import FileReads  # noqa: E402
from tests.toolbox.tp_models import chain_lm  # noqa: E402

CLIP = 0.05
STEPS = 3
CASES = ("sgd", "adamw", "accumulate", "checkpointing", "full", "compile", "bf16", "pretrained")
OPTIMIZER = {"adamw": "adamw", "checkpointing": "adamw", "compile": "adamw"}  # the others: SGD with momentum


class Module(L.LightningModule):
    def __init__(self, case: str, pretrained: str | None, fault_rank: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.model = chain_lm()
        self.pretrained = pretrained
        self.fault_rank = fault_rank
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.recorded: dict[str, Any] = {"fc1_forwards": 0}
        self.parallelized = False

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is not None and not self.parallelized:
            for block in self.model.blocks:
                parallelize_module(block, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if self.case == "compile" and not self.parallelized:
            for block in self.model.blocks:
                block.compile(backend="aot_eager")
        if not self.parallelized:
            self.model.blocks[0].fc1.register_forward_pre_hook(self._record_fc1)
        self.parallelized = True

    def _record_fc1(self, module: torch.nn.Module, args: tuple) -> None:
        self.recorded["fc1_forwards"] += 1
        self.recorded["fc1_weight_dtype"] = str(module.weight.dtype)

    def on_fit_start(self) -> None:
        if self.case == "pretrained":
            with FileReads() as reads:
                load_pretrained(self.model, self.pretrained)
            self.recorded["reads"] = reads.reads
            self.recorded["local_shapes"] = {k: tuple(v.shape) for k, v in self.model.named_parameters()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        if self.case == "fault" and self.global_rank == self.fault_rank and self.global_step == 1:

            def die(grad: torch.Tensor) -> torch.Tensor:
                inject("exit", self.global_rank, self.global_step)
                return grad

            logits.register_hook(die)  # mid-backward: the TP peer waits in a DTensor collective
        loss = loss_fn(logits, y)
        self.losses.append(loss.item())
        return loss

    def on_train_start(self) -> None:
        if self.case == "fault":
            say(self.global_rank, "train-start")

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        data = samples(SAMPLES)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer.world_size == 1:  # plain tensors: the norm clipping will compare with
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if OPTIMIZER.get(self.case) == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def trainer_for(case: str, devices: int, timeout: float) -> L.Trainer:
    options: dict[str, Any] = {}
    if devices == 1:
        strategy: Any = "auto"
    else:
        strategy = FSDPStrategy(
            tensor_parallel_size=2,
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if case == "checkpointing" else None,
            weights_after_stage="full" if case == "full" else "sharded",
            state_dict_type="local" if case == "pretrained" else "sharded",
            timeout=timedelta(seconds=timeout),
        )
    if case == "accumulate":
        options["accumulate_grad_batches"] = 2
    if case == "bf16":
        options["precision"] = "bf16-mixed"
    return quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        use_distributed_sampler=False,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        **options,
    )


def full_state(trainer: L.Trainer, module: Module) -> dict[str, torch.Tensor]:
    """The unsplit model's state: gathered from the engine, or read from the module where it holds it whole (one
    device; ``weights_after_stage="full"``, whose DTensor parameters give their full value)."""
    if trainer.world_size > 1 and get_engine(module) is not None:
        full = full_model_state_dict(trainer.strategy.engine, rank0_only=False)
        return {k.removeprefix("model."): v for k, v in full.items()}
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.model.state_dict().items()
    }


def run_case(case: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    trainer = trainer_for(case, args.devices, args.timeout)
    if case == "pretrained" and args.devices > 1:
        with trainer.init_module(empty_init=True):
            module = Module(case, args.pretrained, args.fault_rank)
    else:
        module = Module(case, args.pretrained, args.fault_rank)
    initial = {k: v.detach().clone() for k, v in module.model.state_dict().items()} if args.devices == 1 else None
    if case == "compile":
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    if case == "fault":
        say(trainer.global_rank, "fit-start")
    trainer.fit(module)
    result: dict[str, Any] = {
        "losses": module.losses,
        "grad_norms": module.grad_norms,
        "state": full_state(trainer, module),
        "sampler": trainer.distributed_sampler_kwargs,
        "initial": initial,  # one device: the model before training (what the updates are measured from)
        **module.recorded,
    }
    if case == "full":
        result["engine_left"] = get_engine(module) is not None
        result["dtensor_params"] = sum(isinstance(p, DTensor) for p in module.parameters())
    if case == "compile":
        counters = torch._dynamo.utils.counters
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["frames_compiled"] = counters["stats"]["unique_graphs"]
    if case == "pretrained" and args.devices > 1:
        trainer.save_checkpoint(os.path.join(out, "local.ckpt"))
    if case == "pretrained" and args.devices == 1:
        result["optimizer"] = trainer.optimizers[0].state_dict()
    if case == "fault":
        say(trainer.global_rank, "train-end")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--pretrained", default=None)
    parser.add_argument("--fault-rank", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0)  # the strategy's collective timeout, seconds
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {}
    rank = 0
    for case in args.cases.split(","):
        started = time.monotonic()
        try:
            results[case] = run_case(case, args, args.out)
        except Exception:  # recorded for the test, which names the case; the next case runs
            if case == "fault":
                raise  # the run must end
            results[case] = {"failed": traceback.format_exc()[-6000:]}
        results[case]["seconds"] = time.monotonic() - started
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
        print(f"[rank {rank}] {case}: {results[case]['seconds']:.1f} s", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main()
