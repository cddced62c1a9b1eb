"""torch.compile under fsdp_custom, the ways users compile, all in one launch (compiled runs start slowly).

Run as a user's script: ``--devices 2`` (Lightning's launcher re-runs it per rank); ``hpu_per_block`` needs the
Gaudi test double on the path (``PYTHONPATH=tests/fakes``, ``PT_HPU_LAZY_MODE=0``), as tests/strategy/test_compile.py
runs
it. Every scenario trains the same tiny GPT-like model for ``STEPS`` optimizer steps (SGD with momentum) on the same
global batches as the one-device reference the test computes in eager mode (rank r takes samples r, r+N, ...). Each
rank writes ``{scenario: result}`` to ``--out.rank<r>``: the final full weights, per-step global losses, and
dynamo's own counters for the scenario (graph breaks and their reasons, graphs compiled by the end of the first step
and by the end of training).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import lightning as L
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy, pipelined_loss  # noqa: E402
from lightning_fsdp.engine import get_engine  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import ChainLM  # noqa: E402

VOCAB, DIM, HIDDEN, LENGTH = 11, 8, 16, 5
GLOBAL_BATCH = 4
STEPS = 3
LR = 0.1

# scenario: (how the model is compiled, strategy options, Trainer precision, backend)
SCENARIOS = {
    # torchtitan's way, fullgraph: each Block is one graph with no break and no recompilation.
    "per_block": ("per_block", {}, "32-true", "aot_eager"),
    # nn.Module.compile() per Block, composed with activation checkpointing and unsharded-after-forward Blocks.
    "module_compile_ac": (
        "module_compile",
        {"activation_checkpointing_policy": "block", "reshard_after_forward": False},
        "32-true",
        "aot_eager",
    ),
    # The whole model compiled in configure_model: graph breaks at the units' boundaries only.
    "whole_model": ("whole_model", {}, "32-true", "aot_eager"),
    # Lightning's convention: trainer.fit(torch.compile(module)).
    "fit_compiled": ("fit_compiled", {}, "32-true", "aot_eager"),
    # bf16-mixed with compiled Blocks, and the same run in eager mode to compare with.
    "per_block_bf16": ("per_block", {}, "bf16-mixed", "aot_eager"),
    "eager_bf16": ("eager", {}, "bf16-mixed", None),
    # Pipeline parallelism over 2 stages (one rank each), each stage's Blocks compiled.
    "pipeline_per_block": (
        "per_block",
        {"pipeline_parallel_size": 2, "pipeline_microbatches": 2},
        "32-true",
        "aot_eager",
    ),
    # Gaudi's way, eager mode with torch.compile: accelerator="hpu" through the test double (tests/fakes), whose
    # "hpu_backend" is aot_eager on the CPU.
    "hpu_per_block": ("per_block", {}, "32-true", "hpu_backend"),
    # inductor itself (generated C++ kernels), per Block.
    "per_block_inductor": ("per_block", {}, "32-true", "inductor"),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def initial_model() -> ChainLM:
    """The tiny GPT-like model of every scenario, from seed 0: an embedding, three Blocks, a norm and a head."""
    torch.manual_seed(0)
    return ChainLM(VOCAB, DIM, lambda: [Block() for _ in range(3)])


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, LENGTH), generator=g)
    return TensorDataset(ids, torch.roll(ids, -1, dims=1))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def compile_blocks(model: ChainLM, how: str, backend: str) -> None:
    for index, block in enumerate(model.blocks):
        if how == "per_block":
            model.blocks[index] = torch.compile(block, backend=backend, fullgraph=True)
        else:
            block.compile(backend=backend, fullgraph=True)


class Module(L.LightningModule):
    def __init__(self, how: str, backend: str | None, pipelined: bool) -> None:
        super().__init__()
        self.how, self.backend, self.pipelined = how, backend, pipelined
        self.model = initial_model()
        if how in ("per_block", "module_compile"):
            compile_blocks(self.model, how, backend)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.how == "whole_model" and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend=self.backend)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        if self.pipelined:
            return pipelined_loss(self.model, ids, targets, loss_of)
        return loss_of(self.model(ids), targets)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(self.all_gather(outputs["loss"].detach()).mean().item())
        if batch_idx == 0:
            self.graphs_after_first_step = counters["stats"]["unique_graphs"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def run(name: str, devices: int) -> dict:
    how, options, precision, backend = SCENARIOS[name]
    torch._dynamo.reset()
    counters.clear()
    if options.get("activation_checkpointing_policy") == "block":
        options = {**options, "activation_checkpointing_policy": {Block}}
    if backend == "hpu_backend":
        import habana_frameworks.torch  # noqa: F401  registers "hpu_backend", as a Gaudi user's script does
    trainer = quiet_trainer(
        accelerator="hpu" if name.startswith("hpu_") else "cpu",
        devices=devices,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, **options),
        max_steps=STEPS,
        precision=precision,
        use_distributed_sampler=False,
    )
    pipelined = options.get("pipeline_parallel_size", 1) > 1
    module = Module(how, backend, pipelined)
    data = dataset()
    # Data-parallel rank r takes samples r, r+N, ... (one data-parallel rank when the 2 ranks are pipeline stages).
    replicas, rank = (1, 0) if pipelined else (trainer.world_size, trainer.global_rank)
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // replicas, sampler=sampler)
    checkpointed = []
    if how == "fit_compiled":
        trainer.fit(torch.compile(module, backend=backend), loader)
    else:
        trainer.fit(module, loader)
    assert get_engine(module) is None  # the stage's end handed back an ordinary module
    checkpointed = sorted(n for n, m in module.named_modules() if getattr(m, "_lightning_fsdp_checkpointed", False))
    # A pipeline stage holds its own pieces only: the test joins the ranks' entries.
    state = {
        k.replace("_orig_mod.", ""): v.detach().float().clone()
        for k, v in module.model.state_dict().items()
        if not v.is_meta and v.numel() > 0
    }
    return {
        "state": state,
        "losses": module.losses,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted({reason.splitlines()[0] for reason in counters["graph_break"]}),
        "graphs_after_first_step": module.graphs_after_first_step,
        "graphs": counters["stats"]["unique_graphs"],
        "checkpointed": checkpointed,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name in args.scenarios.split(","):
        try:
            results[name] = run(name, args.devices)
        except Exception:  # noqa: BLE001 - recorded for the test to show
            results[name] = {"error": traceback.format_exc()}
        torch.save(results, f"{args.out}.rank{os.environ.get('LOCAL_RANK', '0')}")


if __name__ == "__main__":
    main()
