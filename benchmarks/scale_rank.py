"""One variant of the scale benchmark (:mod:`benchmarks.scale`), run the way a user runs a Lightning script:

    python -m benchmarks.scale_rank SPEC.json     # the repository on PYTHONPATH

Lightning's launcher re-runs this module once per extra rank (as a module: this folder's ``profile.py`` would shadow
the standard library's if it were run as a file). The model (the demo GPT of the spec's shape) is built on
the meta device in ``configure_model`` (DDP: on the host, as DDP needs), trained for ``steps`` steps with AdamW, then
saved as a sharded checkpoint and loaded back. Each rank writes what it measured to ``{out}/rank{r}.json``
(:class:`ScaleProbe`; every quantity and how it is measured: docs/benchmarks.md, "At scale").
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.memory import status_bytes
from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig
from lightning_fsdp.shutdown import destroy_process_group, settle_at_exit

FSDP_CUSTOM = {"fsdp_full": "FULL_SHARD", "fsdp_grad_op": "SHARD_GRAD_OP", "fsdp_hybrid": "HYBRID_SHARD"}


def hybrid_per_node(world: int) -> int:
    """Ranks per shard group of the hybrid variant: 2 shard groups of ``world / 2`` from 4 ranks on (so that it
    replicates), the whole world below (one shard group, the default layout of one node)."""
    return world // 2 if world >= 4 and world % 2 == 0 else world


def is_unit(vocab: int, ends: bool, module: torch.nn.Module, recurse: bool = False, nonwrapped_numel: int = 0) -> bool:
    """The units: each Block, and with ``ends`` also the token embedding and the output head (the modules whose
    weights have ``vocab`` rows), as torchtitan shards a Llama; else those stay in the root unit."""
    if recurse or isinstance(module, Block):  # recurse: asked whether to look inside (torch's policy convention)
        return True
    rows = getattr(module, "num_embeddings", None) or getattr(module, "out_features", None)
    return ends and rows == vocab


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


class ScaleModule(L.LightningModule):
    """The spec's GPT, built in ``configure_model``: on the meta device for the sharded variants (fsdp_custom
    materialises it unit by unit; for FSDP2 this module applies ``fully_shard`` per Block and to the root, then
    ``to_empty`` and each module's ``reset_parameters``, as Lightning's ModelParallelStrategy docs do)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is not None:
            return
        config = GPTConfig(**self.spec["model"])
        variant = self.spec["variant"]
        if variant == "ddp":
            self.gpt = GPT(config)
            return
        with torch.device("meta"):
            self.gpt = GPT(config)
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            vocab, ends = self.spec["model"]["vocab_size"], self.spec["units"] == "blocks+ends"
            for module in self.gpt.modules():
                if module is not self.gpt and is_unit(vocab, ends, module):
                    fully_shard(module, mesh=mesh)
            fully_shard(self.gpt, mesh=mesh)
            self.gpt.to_empty(device=self.device)
            for module in self.gpt.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.gpt is not None
        x, y = batch
        _, loss = self.gpt(x, y)
        assert loss is not None
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.spec["lr"])


class RssTrace:
    """Private resident memory (``RssAnon``) sampled every ``interval`` seconds by a thread, with named events from
    the training loop's hooks, so that the peak can be placed in the step (``--trace``)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.events: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.perf_counter() - self._t0, status_bytes("RssAnon")))

    def event(self, name: str) -> None:
        self.events.append((time.perf_counter() - self._t0, name, status_bytes("RssAnon")))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"samples": self.samples, "events": self.events}


def _file_bytes() -> int:
    """Resident pages of files and shared memory: the part of ``VmRSS`` that is not private."""
    return status_bytes("RssFile") + status_bytes("RssShmem")


class ScaleProbe(L.Callback):
    """Measures one rank: resident memory over the base (``VmRSS`` when the process group is up and before the model
    exists), its peak (``VmHWM``, reset between phases) during init, training, save and load; the time of each."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.record: dict[str, Any] = {"step_s": []}
        self._t = 0.0

    def _phase_start(self) -> None:
        gc.collect()
        _reset_peak()
        self._t = time.perf_counter()

    def _phase_end(self, name: str) -> None:
        self.record[f"{name}_s"] = time.perf_counter() - self._t
        self.record[f"{name}_peak_bytes"] = status_bytes("VmHWM") - self.record["base_rss_bytes"]
        # Pages of files (shared libraries' code first touched in this phase) that VmHWM counts beside private memory.
        self.record[f"{name}_file_bytes"] = _file_bytes() - self.record["base_file_bytes"]

    def write(self, rank: int, **extra: Any) -> None:
        path = os.path.join(self.spec["out"], f"rank{rank}.json")
        with open(path + ".partial", "w") as f:
            json.dump({**self.record, "rank": rank, **extra}, f)
        os.replace(path + ".partial", path)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        gc.collect()
        self.record["base_rss_bytes"] = status_bytes("VmRSS")
        self.record["base_file_bytes"] = _file_bytes()
        self._phase_start()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase_end("init")  # configure_model, sharding and materialising, the optimizer's creation
        self.record["after_init_bytes"] = status_bytes("VmRSS") - self.record["base_rss_bytes"]
        if self.spec.get("pretrained"):
            self._load_pretrained(pl_module)
        self._phase_start()

    def _load_pretrained(self, pl_module: L.LightningModule) -> None:
        """``load_pretrained`` of the safetensors file the parent wrote, where the docs call it (``on_fit_start``):
        its time and its peak growth, resident (file pages mapped included) and private (``PeakGrowth``)."""
        from benchmarks.memory import PeakGrowth
        from lightning_fsdp import load_pretrained

        gc.collect()
        growth = PeakGrowth()
        growth.start()
        start = time.perf_counter()
        result = load_pretrained(pl_module.gpt, self.spec["pretrained"])  # type: ignore[arg-type]
        self.record["pretrained_s"] = time.perf_counter() - start
        peaks = growth.stop()
        self.record["pretrained_rss_bytes"] = peaks["rss"]
        self.record["pretrained_anon_bytes"] = peaks["anon"]
        self.record["pretrained_not_loaded"] = len(result.missing) + len(result.unexpected) + len(result.mismatched)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace = RssTrace() if self.spec.get("trace") else None

    def _event(self, name: str) -> None:
        if self.trace is not None:
            self.trace.event(name)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._event(f"step {idx} start")
        if self.spec.get("profile") and idx == 1:  # the steps after the first (which creates AdamW's state)
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        self._step_start = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._event("backward start")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._event("backward end")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._event("optimizer step start")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.record["step_s"].append(time.perf_counter() - self._step_start)
        self._event(f"step {idx} end")
        if self.spec.get("profile") and idx == self.spec["steps"] - 1:
            self.profiler.__exit__(None, None, None)
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
            with open(os.path.join(self.spec["out"], f"profile-rank{trainer.global_rank}.txt"), "w") as f:
                f.write(table)
        self.record.setdefault("losses", []).append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase_end("train")
        if self.trace is not None:
            self.record["trace"] = self.trace.stop()
        self.record["after_train_bytes"] = status_bytes("VmRSS") - self.record["base_rss_bytes"]
        for callback in trainer.callbacks:
            if type(callback).__name__ == "ShardingMonitor":
                mine = f"/rank{trainer.global_rank}/"
                last = callback.last  # type: ignore[attr-defined]
                self.record["monitor"] = {k.split("/")[-1]: v for k, v in last.items() if mine in k}
        if not self.spec.get("save", True):
            self._phase_start()
            return
        path = os.path.join(self.spec["out"], "checkpoint" + ("" if self.spec["variant"] != "ddp" else ".ckpt"))
        self._phase_start()
        trainer.save_checkpoint(path)
        trainer.strategy.barrier("scale-save")
        self._phase_end("save")
        self.write(trainer.global_rank)  # kept if what follows fails
        if not self.spec["load"]:
            self._phase_start()
            return
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)  # a resumed run holds no gradients while it loads
        self._phase_start()
        strategy = trainer.strategy
        checkpoint = strategy.load_checkpoint(path)
        # What Lightning's checkpoint connector does with it (a no-op where load_checkpoint loaded in place).
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)
        del checkpoint
        strategy.barrier("scale-load")
        self._phase_end("load")
        self._phase_start()  # what is left: the end of the stage (teardown_peak_bytes, measured after fit)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    settle_at_exit()
    torch.set_num_threads(spec["threads"])
    L.seed_everything(spec["seed"], verbose=False)
    world, variant = spec["world"], spec["variant"]
    timeout = timedelta(seconds=spec["collective_timeout"])
    callbacks: list[L.Callback] = [ScaleProbe(spec)]
    if variant in FSDP_CUSTOM:
        from lightning_fsdp import FSDPStrategy
        from lightning_fsdp.monitor import ShardingMonitor

        options: dict[str, Any] = dict(spec.get("fsdp_options") or {})
        if variant == "fsdp_hybrid" and hybrid_per_node(world) != world:
            from lightning_fsdp.process_groups import node_groups

            per_node = hybrid_per_node(world)
            options["process_group"] = lambda: node_groups(world, per_node, dist.get_rank(), timeout)
        strategy: Any = FSDPStrategy(
            sharding_strategy=FSDP_CUSTOM[variant],
            auto_wrap_policy=functools.partial(is_unit, spec["model"]["vocab_size"], spec["units"] == "blocks+ends"),
            state_dict_type="sharded",
            weights_after_stage="sharded",
            timeout=timeout,
            **options,
        )
        if spec.get("monitor", True):
            callbacks.append(ShardingMonitor(log_every_n_steps=1))
    elif variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
    elif variant == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(timeout=timeout)
    else:
        raise ValueError(f"variant={variant!r} is not valid; choose one of {[*FSDP_CUSTOM, 'fsdp2', 'ddp']}.")
    cfg = spec["model"]
    generator = torch.Generator().manual_seed(spec["seed"])
    samples = spec["batch"] * world * spec["steps"]
    tokens = torch.randint(0, cfg["vocab_size"], (samples, cfg["block_size"] + 1), generator=generator)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=spec["batch"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=spec["steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(ScaleModule(spec), train_dataloaders=data)
    probe = callbacks[0]
    assert isinstance(probe, ScaleProbe)
    probe._phase_end("teardown")
    probe.write(trainer.global_rank, complete=True)
    if dist.is_initialized():
        dist.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
