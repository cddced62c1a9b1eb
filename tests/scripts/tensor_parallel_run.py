"""Train a chain model with tensor parallelism under Lightning, as a user's script would, and record the result.

    python tests/scripts/tensor_parallel_run.py --out DIR --devices 4 --tp 2 [--pp 2] [--sharding HYBRID_SHARD]
    python tests/scripts/tensor_parallel_run.py --out DIR --devices 1          # the one-device reference
    python tests/scripts/tensor_parallel_run.py --out DIR --devices 4 --tp 2 --model llama

The LightningModule is the same in both: ``configure_model`` parallelizes each block with torch's
``parallelize_module`` on ``self.device_mesh["tensor_parallel"]`` when the strategy gives a mesh (not on one device),
and its steps call ``pipelined_loss`` (the plain loss without pipelining). The data loader takes the data-parallel
rank and size from ``trainer.distributed_sampler_kwargs`` (``use_distributed_sampler=False``), so every step's global
batch is the reference's. ``--model llama`` trains a tiny transformers ``LlamaForCausalLM`` instead
(tests/toolbox/tp_models.py) on fixed token sequences, split by the strategy's ``tensor_parallel_plan="auto"`` (the
built-in plan, with sequence parallelism), not by ``configure_model``; the reference records each step's gradient norm
before clipping (so the test can check that clipping binds) and each rank the layout of the final norm's output.
``--save`` writes a checkpoint at the end, ``--resume`` starts from one (any layout). Each rank writes DIR/rank<r>.pt:
the step losses, the full state dict, the mesh it saw and its sampler arguments.
"""

import argparse
import os
import sys

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy, pipelined_loss  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402
from tests.toolbox.tp_models import SEQ, chain_lm, hf_causal_lm  # noqa: E402
from tests.toolbox.tp_models import VOCAB as LLAMA_VOCAB  # noqa: E402

GLOBAL_BATCH = 8
SAMPLES = 48


def token_samples(count: int) -> TensorDataset:
    """``count`` fixed token sequences of length ``SEQ`` (a multiple of the TP size, as sequence parallelism needs)."""
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, LLAMA_VOCAB, (count, SEQ), generator=generator))


class Module(L.LightningModule):
    def __init__(self, optimizer: str, model: str, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.is_llama = model == "llama"
        self.model = hf_causal_lm("llama", attn_implementation="eager") if self.is_llama else chain_lm()
        self.optimizer_name = optimizer
        self.lr = lr
        self.step_losses: list[float] = []
        self.grad_norms: list[float] = []
        self.final_norm_output: tuple[str, tuple[int, ...]] | None = None  # how the plan laid out the residual stream
        self.mesh_dims: tuple[str, ...] | None = None

    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by the strategy under tensor parallelism, as ModelParallelStrategy does
        if mesh is None or self.mesh_dims is not None:
            return
        self.mesh_dims = tuple(mesh.mesh_dim_names or ())
        if self.is_llama:  # tensor_parallel_plan="auto" splits it
            self.model.model.norm.register_forward_hook(self._record_final_norm_output)
            return
        for block in self.model.blocks:
            parallelize_module(block, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def _record_final_norm_output(self, norm: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, DTensor):
            self.final_norm_output = (str(output.placements), tuple(output.to_local().shape))

    def training_step(self, batch, batch_idx):
        if self.is_llama:
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
            self.step_losses.append(loss.item())
            return loss
        x, y = batch
        loss = pipelined_loss(self.model, x, y, loss_fn)
        self.step_losses.append(loss.item())
        return loss

    def train_dataloader(self):
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        self.sampler_kwargs = kwargs
        data = token_samples(SAMPLES) if self.is_llama else samples(SAMPLES)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler)

    def on_before_optimizer_step(self, optimizer):
        # Lightning calls this before it clips; on one device the parameters are plain tensors
        if self.trainer.world_size == 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--format", default="sharded")  # state_dict_type of --save
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--model", default="chain", choices=["chain", "llama"])
    parser.add_argument("--lr", type=float, default=0.1)  # SGD's
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.devices == 1:
        strategy = "auto"
    else:
        strategy = FSDPStrategy(
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            pipeline_microbatches=2 if args.pp > 1 else None,
            tensor_parallel_plan="auto" if args.model == "llama" else None,
            auto_wrap_policy={LlamaDecoderLayer} if args.model == "llama" else {Block},
            sharding_strategy=args.sharding,
            state_dict_type=args.format,
            weights_after_stage="sharded",
        )
    clip = {"gradient_clip_val": args.clip, "gradient_clip_algorithm": "norm"} if args.clip else {}
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        use_distributed_sampler=False,
        **clip,
    )
    module = Module(args.optimizer, args.model, args.lr)
    trainer.fit(module, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.devices == 1:
        state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    else:
        full = full_model_state_dict(trainer.strategy.engine, rank0_only=False)
        state = {k.removeprefix("model."): v for k, v in full.items()}
    result = {
        "losses": module.step_losses,
        "state": state,
        "mesh_dims": module.mesh_dims,
        "sampler": module.sampler_kwargs,
        "grad_norms": module.grad_norms,
        "final_norm_output": module.final_norm_output,
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
