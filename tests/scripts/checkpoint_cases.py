"""Load scenarios for the sharded/local checkpoint tests, several per launch (one process group, a fresh Trainer and
module per case), the way users run scripts.

``--cases JSON``: a list of ``{"name", "ckpt", "fn": "fit"|"validate", "dim": 5, "extra": false, "strict": true,
"sharding": "FULL_SHARD"}``. The module is tests/scripts/checkpoint_run.py's (ToyLM, SGD with momentum, two parameter
groups); ``dim`` changes the model's width, ``extra`` adds a parameter the checkpoint lacks, ``strict`` sets
``LightningModule.strict_loading``. Each rank writes ``{name: {"error": (type, message)} | {"ok": True, "params",
"optimizer"}}`` to ``--out.rank{N}``: the exception the case raised on that rank, or (rank 0) the full parameters and
optimizer state right after the checkpoint was restored.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

GLOBAL_BATCH = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_fsdp  # noqa: F401
    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.full import (
        full_model_state_dict,
        full_optimizer_state_dict,
    )
    from tests.toolbox.lightning_scripts import quiet_trainer
    from tests.toolbox.models import Block, ToyLM, batch, loss_fn

    class Module(L.LightningModule):
        def __init__(self, dim: int, extra: bool, strict: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ToyLM(dim=dim)
            if extra:
                self.extra = torch.nn.Parameter(torch.full((3, 2), 0.5))
            self.strict_loading = strict

        def training_step(self, b, i):
            return loss_fn(self.model(b[0]), b[1])

        def validation_step(self, b, i):
            self.log("val_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.requires_grad and not n.endswith("bias")]
            no_decay = [p for n, p in self.named_parameters() if p.requires_grad and n.endswith("bias")]
            groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    class Restored(L.Callback):
        state = None

        def on_train_start(self, trainer, module):
            engine = trainer.strategy.engine
            self.state = {
                "params": full_model_state_dict(engine),
                "optimizer": [full_optimizer_state_dict(engine, o) for o in trainer.optimizers],
            }

    torch.set_num_threads(1)
    results = {}
    rank = 0
    x, y = batch(0, size=12)
    for case in json.loads(args.cases):
        callback = Restored()
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=case.get("sharding", "FULL_SHARD")),
            max_epochs=2,
            limit_train_batches=1,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            callbacks=[callback],
        )
        loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // trainer.world_size)
        with trainer.init_module():
            module = Module(case.get("dim", 5), case.get("extra", False), case.get("strict", True))
        try:
            if case.get("fn", "fit") == "fit":
                trainer.fit(module, loader, ckpt_path=case["ckpt"])
                state = callback.state
            else:
                trainer.validate(module, loader, ckpt_path=case["ckpt"], verbose=False)
                state = {"params": full_model_state_dict(trainer.strategy.engine), "optimizer": None}
            rank = trainer.global_rank
            results[case["name"]] = {"ok": True, **(state if rank == 0 else {})}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            rank = trainer.global_rank
            results[case["name"]] = {"error": (type(exc).__name__, str(exc))}
    torch.save(results, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
