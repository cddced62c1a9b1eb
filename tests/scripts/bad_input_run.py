"""Misuse the strategy on 2 ranks; each rank writes the error it raised (or 'ok') to --out.rank{N}.

Modes: frozen-fit (fit with no trainable parameters), frozen-eval (validate/test/predict a frozen model: must
work), foreign-optimizer (an optimizer over a parameter the strategy does not manage).
"""

import argparse
import os
import sys
import traceback

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401
from tests.models import ToyLM, batch, loss_fn  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, frozen: bool, foreign: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM()
        if frozen:
            self.model.requires_grad_(False)
        self.foreign = foreign

    def training_step(self, b, i):
        return loss_fn(self.model(b[0]), b[1])

    def validation_step(self, b, i):
        self.log("val_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def test_step(self, b, i):
        self.log("test_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def predict_step(self, b, i):
        return self.model(b[0]).argmax(-1)

    def configure_optimizers(self):
        params = list(self.parameters())
        if self.foreign:
            params.append(torch.nn.Parameter(torch.zeros(3)))
        return torch.optim.SGD(params, lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp_custom", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1)
    x, y = batch(0, size=8)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    module = Module(frozen=args.mode.startswith("frozen"), foreign=args.mode == "foreign-optimizer")
    try:
        if args.mode == "frozen-eval":
            trainer.validate(module, loader, verbose=False)
            trainer.test(module, loader, verbose=False)
            preds = trainer.predict(module, loader)
            result = f"ok {len(preds)} predictions"
        else:
            trainer.fit(module, loader)
            result = "ok"
    except Exception as err:  # noqa: BLE001 - the test reads it
        result = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    with open(f"{args.out}.rank{trainer.global_rank}", "w") as f:
        f.write(result)


if __name__ == "__main__":
    main()
