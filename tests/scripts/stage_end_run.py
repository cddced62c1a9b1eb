"""What the module holds after ``fit`` under each ``weights_after_stage`` choice, several cases in one launch.

Run by tests/strategy/test_stage_end.py on 2 CPU ranks. Every case trains the same ToyLM (plus a buffer) from the same
seed for 3 SGD-with-momentum steps with a fresh Trainer (the process group stays up between cases), then records, per
rank: whether an engine is still attached, the parameters' devices, shapes and values, the buffer's device and
the ``weights_after_stage`` warnings seen during ``fit``.

- ``full``, ``rank0``, ``sharded``: the choice given explicitly; after ``rank0``, ``trainer.validate`` is refused.
  ``sharded`` also records the full weights gathered from the still-sharded module, then runs ``trainer.validate``
  and a second ``fit`` (a new Trainer, ``weights_after_stage="full"``) on the same module; ``full`` does the same
  validate and second fit (re-sharding).
- ``auto_short`` / ``auto_ample``: the default, with the free host memory given as 1 byte / 1 PB through
  ``LIGHTNING_FSDP_FREE_HOST_MEMORY``.
- ``full`` also saves a checkpoint in each format after the stage ended, overwrites the weights, the buffer and the
  optimizer state, and loads each back through the strategy, recording what the module and optimizer hold then.
- ``failed``: ``weights_after_stage="full"``, but ``training_step`` raises on every rank at the second step; the
  error is caught and a second ``fit`` (a new Trainer) retries on the same module.

Each rank writes ``{case: {...}}`` to ``--out.rank{N}``.
"""

import argparse
import os
import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from lightning_fsdp.checkpoint.routing import StateDictType  # noqa: E402
from lightning_fsdp.engine import get_engine  # noqa: E402
from lightning_fsdp.stage_end import FREE_MEMORY_VARIABLE  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer, save_rank_results  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402


class Module(ToyLMModule):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.register_buffer("offset", torch.full((5,), 0.5))

    def training_step(self, batch, _index):
        if self.fail and self.global_step == 1:
            raise RuntimeError("planned failure")
        x, y = batch
        return loss_fn(self.model(x) + self.offset.sum(), y)

    def validation_step(self, batch, _index):
        x, y = batch
        self.log("val_loss", loss_fn(self.model(x), y), sync_dist=True)


def trainer_for(choice: str | None) -> L.Trainer:
    options = {} if choice is None else {"weights_after_stage": choice}
    return quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, **options),
        max_steps=3,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def loader(trainer: L.Trainer) -> DataLoader:
    sampler = DistributedSampler(samples(24), trainer.world_size, trainer.global_rank, shuffle=False)
    return DataLoader(samples(24), batch_size=3, sampler=sampler)


def held(module: Module) -> dict:
    return {
        "engine": get_engine(module) is not None,
        "param_devices": sorted({str(p.device) for p in module.parameters()}),
        "shapes": {n: tuple(p.shape) for n, p in module.named_parameters()},
        "values": {n: p.detach().clone() for n, p in module.named_parameters() if not p.is_meta},
        "buffer": (str(module.offset.device), module.offset.clone() if not module.offset.is_meta else None),
    }


def reload_each_format(trainer: L.Trainer, module: Module, base: str) -> dict:
    """{format: what the module and optimizer hold after loading that format's checkpoint}, every checkpoint saved
    after the stage ended and loaded into weights, buffer and optimizer state overwritten with -1."""
    strategy, optimizer = trainer.strategy, trainer.optimizers[0]
    kinds = ("full", "sharded", "local")
    for kind in kinds:
        strategy.state_dict_type = StateDictType(kind)
        trainer.save_checkpoint(f"{base}.{kind}")
    reloaded = {}
    for kind in kinds:
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                tensor.fill_(-1.0)
            for state in optimizer.state.values():
                state["momentum_buffer"].fill_(-1.0)
        checkpoint = strategy.load_checkpoint(f"{base}.{kind}")
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)
        names = {id(p): n for n, p in module.named_parameters()}
        reloaded[kind] = {
            **held(module),
            "momentum": {names[id(p)]: s["momentum_buffer"].clone() for p, s in optimizer.state.items()},
        }
    return reloaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        # name: (weights_after_stage, free host memory to report, validate and fit again, fail)
        "full": ("full", None, True, False),
        "rank0": ("rank0", None, False, False),
        "sharded": ("sharded", None, True, False),
        "auto_short": (None, "1", False, False),
        "auto_ample": (None, str(10**15), False, False),
        "failed": ("full", None, True, True),
    }
    results, rank = {}, 0
    for name, (choice, free, again, fail) in cases.items():
        if free is not None:
            os.environ[FREE_MEMORY_VARIABLE] = free
        trainer = trainer_for(choice)
        module = Module(fail)
        error = None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                trainer.fit(module, loader(trainer))
            except RuntimeError as exc:
                error = str(exc)
        os.environ.pop(FREE_MEMORY_VARIABLE, None)
        rank = trainer.global_rank
        result = held(module)
        result["error"] = error
        result["warnings"] = [str(w.message) for w in seen if "weights_after_stage" in str(w.message)]
        engine = get_engine(module)
        if engine is not None and not fail:
            result["gathered"] = {k: v.clone() for k, v in full_model_state_dict(engine).items()}  # rank 0 only
        if engine is not None:
            result["local_numel"] = sum(p.numel() for p in module.parameters())
        if name == "full":
            result["reloaded"] = reload_each_format(trainer, module, args.out)
        if again:
            module.fail = False
            if not fail:
                result["val_loss"] = trainer.validate(module, loader(trainer), verbose=False)[0]["val_loss"]
            second = trainer_for("full")
            second.fit(module, loader(second))
            result["second_fit"] = held(module)
        if choice == "rank0":  # refused on every rank: the other ranks would shard freshly initialised values
            try:
                trainer.validate(module, loader(trainer), verbose=False)
            except ValueError as exc:
                result["validate_error"] = str(exc)
        results[name] = result
    save_rank_results(results, args.out, rank)


if __name__ == "__main__":
    main()
