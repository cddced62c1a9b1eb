"""One launch of the tensor-parallel benchmark (:mod:`benchmarks.tensor_parallel`), run as a user runs a Lightning
script:

    python -m benchmarks.tensor_parallel_rank SPEC.json     # the repository on PYTHONPATH

Lightning's launcher re-runs this module once per extra rank. The model is the pipeline benchmark's GPT
(:class:`~lightning_fsdp.demo.gpt.PipelineGPT`: the demo GPT as a chain, untied head), built in ``configure_model``
on the host from the spec's seed, so every variant and the one-device reference start from the same weights. Under
tensor parallelism :func:`parallelize_gpt` splits each Block with torch's ``parallelize_module`` on
``self.device_mesh["tensor_parallel"]``, the same call for fsdp_custom and for Lightning's ``ModelParallelStrategy``
(which then also applies FSDP2's ``fully_shard`` over ``self.device_mesh["data_parallel"]`` to each Block and the
model, as its docs do). Each rank writes ``{out}/rank{r}.json`` (:class:`TensorParallelProbe`) and, with
``"state": true``, ``{out}/rank{r}.pt``: the full values of the parameters it holds.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from benchmarks.collective_bytes import CollectiveBytes
from benchmarks.memory import status_bytes
from lightning_fsdp.demo.gpt import Block, CausalSelfAttention, GPTConfig, PipelineGPT, next_token_loss

__all__ = ["LAUNCHES", "parallelize_gpt", "token_windows"]

# What each launch runs: processes, tensor- and pipeline-parallel sizes, and the strategy.
LAUNCHES: dict[str, dict[str, Any]] = {
    "fsdp_x4": {"world": 4, "tp": 1, "pp": 1, "strategy": "fsdp_custom"},
    "tp2_dp2": {"world": 4, "tp": 2, "pp": 1, "strategy": "fsdp_custom"},
    "p2_tp2": {"world": 4, "tp": 2, "pp": 2, "strategy": "fsdp_custom"},
    "mps_tp2_dp2": {"world": 4, "tp": 2, "pp": 1, "strategy": "model_parallel"},
    "p2_tp2_dp2": {"world": 8, "tp": 2, "pp": 2, "strategy": "fsdp_custom"},
    "one_device": {"world": 1, "tp": 1, "pp": 1, "strategy": "auto"},
}


# ----------------------------------------------------------------------------------------------------- plan
class LocalHeadsAttention(CausalSelfAttention):
    """``CausalSelfAttention`` computing the heads whose ``q``, ``k``, ``v`` columns this rank holds: the same
    arithmetic per head, with the number of heads read from the tensors instead of from the whole model's."""

    head_dim: int  # set by parallelize_gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


def parallelize_gpt(model: PipelineGPT, tp_mesh: DeviceMesh) -> None:
    """Megatron's split of each Block on ``tp_mesh`` (no sequence parallelism): ``c_attn`` and ``mlp.c_fc``
    column-wise, ``attn.c_proj`` and ``mlp.c_proj`` row-wise (their outputs all-reduced); the LayerNorms, embeddings
    and head stay whole on every TP rank (sharded over data-parallel ranks only)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_fsdp.tensor_parallel_plans import take_local_heads

    plan = {
        "attn.c_attn": ColwiseParallel(use_local_output=False),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.blocks:
        assert isinstance(block, Block)
        parallelize_module(block, tp_mesh, plan)
        block.attn.__class__ = LocalHeadsAttention
        block.attn.head_dim = model.config.n_embd // model.config.n_head
        width = model.config.n_embd  # q, k and v each as wide as the model (no grouped-query attention)
        # c_attn's rows are [q | k | v]: each rank keeps its own heads of each, as the built-in litgpt plan does.
        block.attn.c_attn.register_forward_hook(take_local_heads(width, width, tp_mesh))


# ----------------------------------------------------------------------------------------------------- data
def token_windows(spec: dict[str, Any]) -> TensorDataset:
    """``global_batch x total steps`` windows of the bundled text (inputs and next-token targets), drawn from the
    spec's seed: the same samples in every launch."""
    from benchmarks import _token_stream

    seq = spec["model"]["block_size"]
    tokens = _token_stream(spec["model"]["vocab_size"])
    count = spec["global_batch"] * (spec["warmup"] + spec["steps"] + spec["count_steps"])
    starts = torch.randint(0, len(tokens) - seq - 1, (count,), generator=torch.Generator().manual_seed(spec["seed"]))
    windows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return TensorDataset(windows[:, :-1], windows[:, 1:])


# --------------------------------------------------------------------------------------------------- module
class TensorParallelGPT(L.LightningModule):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.launch = LAUNCHES[spec["launch"]]
        self.model: PipelineGPT | None = None
        self.losses: list[float] = []
        self.sampler_kwargs: dict[str, int] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(self.spec["seed"])
        self.model = PipelineGPT(GPTConfig(**self.spec["model"]))
        if self.launch["tp"] > 1:
            parallelize_gpt(self.model, self.device_mesh["tensor_parallel"])
        if self.launch["strategy"] == "model_parallel":
            from torch.distributed.fsdp import fully_shard

            dp_mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from lightning_fsdp import pipelined_loss

        assert self.model is not None
        x, y = batch
        loss = pipelined_loss(self.model, x, y, next_token_loss)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        self.sampler_kwargs = dict(kwargs)
        data = token_windows(self.spec)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=self.spec["global_batch"] // kwargs["num_replicas"], sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.spec["optimizer"] == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.spec["lr"], momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.spec["lr"])


# ---------------------------------------------------------------------------------------------------- probe
def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


class TensorParallelProbe(L.Callback):
    """Per rank: each step's time (``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, optimizer
    step, perf_counter); the peak resident memory over the timed steps above the base (``VmHWM`` reset at
    ``on_train_start`` less ``VmRSS`` at ``setup``, when the process group is up and before the model exists); and,
    over the last ``count_steps`` steps (after the timed ones), the bytes of every collective under
    :class:`~benchmarks.collective_bytes.CollectiveBytes`."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.record: dict[str, Any] = {"step_s": []}
        self.counter: CollectiveBytes | None = None
        self._start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        gc.collect()
        self.record["base_rss_bytes"] = status_bytes("VmRSS")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gc.collect()
        _reset_peak()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.spec["warmup"] + self.spec["steps"]:  # the timed steps are over: count the rest
            self.record["peak_bytes"] = status_bytes("VmHWM") - self.record["base_rss_bytes"]
            self.counter = CollectiveBytes()
            self.counter.__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.record["step_s"].append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.record["collective_bytes"] = dict(self.counter.bytes)
            self.record["collective_calls"] = dict(self.counter.calls)
            self.record["collective_ops"] = dict(self.counter.ops)
        if "peak_bytes" not in self.record:
            self.record["peak_bytes"] = status_bytes("VmHWM") - self.record["base_rss_bytes"]


def _held_pieces(model: nn.Module) -> list[str]:
    from lightning_fsdp.pipeline.split import AbsentPiece, pipeline_pieces

    return [name for name in pipeline_pieces(model) if not isinstance(model.get_submodule(name), AbsentPiece)]


def _strategy(spec: dict[str, Any]) -> Any:
    launch = LAUNCHES[spec["launch"]]
    timeout = timedelta(seconds=spec["collective_timeout"])
    if launch["strategy"] == "auto":
        return "auto"
    if launch["strategy"] == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=launch["world"] // launch["tp"], tensor_parallel_size=launch["tp"], timeout=timeout
        )
    from lightning_fsdp import FSDPStrategy

    pipelined = launch["pp"] > 1
    return FSDPStrategy(
        auto_wrap_policy={Block},
        tensor_parallel_size=launch["tp"],
        pipeline_parallel_size=launch["pp"],
        pipeline_microbatches=spec["microbatches"] if pipelined else None,
        weights_after_stage="sharded",
        timeout=timeout,
    )


def _without_trimming() -> None:
    """The engine's CPU runtime without its host-memory trimming after each unit's backward
    (lightning_fsdp/engine/host_memory.py): ``--without-trimming``, to measure what trimming costs and saves."""
    import lightning_fsdp.engine.devices as devices

    devices.return_free_heap_memory = lambda *args, **kwargs: 0  # type: ignore[assignment]


def main(spec_path: str) -> None:
    from lightning_fsdp.engine.shared_memory import SWITCH_VARIABLE
    from lightning_fsdp.shutdown import destroy_process_group, settle_at_exit

    with open(spec_path) as f:
        spec = json.load(f)
    settle_at_exit()
    # Bytes per collective are counted on gloo's wire, as ranks on separate hosts send them: the same-host exchange,
    # which would move the engine's through /dev/shm instead, stays off (inherited by the ranks Lightning starts).
    os.environ[SWITCH_VARIABLE] = "0"
    torch.set_num_threads(spec["threads"])
    if not spec.get("trim", True):
        _without_trimming()
    launch = LAUNCHES[spec["launch"]]
    probe = TensorParallelProbe(spec)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=launch["world"],
        strategy=_strategy(spec),
        max_steps=spec["warmup"] + spec["steps"] + spec["count_steps"],
        use_distributed_sampler=False,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    module = TensorParallelGPT(spec)
    trainer.fit(module)
    assert module.model is not None
    rank = trainer.global_rank
    record = {
        **probe.record,
        "rank": rank,
        "losses": module.losses,
        "sampler": module.sampler_kwargs,
        "pieces": _held_pieces(module.model),
        "mesh_dims": list(module.device_mesh.mesh_dim_names or ()) if module.device_mesh is not None else [],
    }
    if spec.get("state"):
        torch.save(_full_state(trainer, module), os.path.join(spec["out"], f"rank{rank}.pt"))
    path = os.path.join(spec["out"], f"rank{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(record, f)
    os.replace(path + ".partial", path)
    if trainer.world_size > 1:
        trainer.strategy.barrier("tensor-parallel-benchmark-end")
        destroy_process_group()


def _full_state(trainer: L.Trainer, module: TensorParallelGPT) -> dict[str, torch.Tensor]:
    """The full (unsplit, unsharded) value of every parameter this rank's stages hold, by the model's names."""
    assert module.model is not None
    if LAUNCHES[module.spec["launch"]]["strategy"] == "auto":
        return {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    from lightning_fsdp.checkpoint.full import full_model_state_dict

    full = full_model_state_dict(trainer.strategy.engine, rank0_only=False)  # type: ignore[attr-defined]
    return {k.removeprefix("model."): v for k, v in full.items()}


if __name__ == "__main__":
    main(sys.argv[1])
