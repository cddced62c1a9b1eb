"""Bad input on 2 ranks, many cases in one launch: each rank records what every case raised (or 'ok').

Usage: ``bad_input_run.py --work DIR``. Writes ``DIR/result.rank{N}.json``: ``{case: {"error": [type, message]} |
{"ok": detail}}``, and leaves the good checkpoints it saved (``good.ckpt``, ``good_sharded``, ``good_local``) and the
damaged copies made from them in ``DIR`` for the in-process tests (readers, ``convert``) to reuse.

Misuse cases (``MISUSE``): fit with no trainable parameters, validate/test/predict a frozen model (must work), an
optimizer over a parameter the strategy does not manage. Loader cases (``LOADS``): ``trainer.fit(ckpt_path=...)``
with a damaged, foreign or mismatched checkpoint of each format. Every case must fail on *both* ranks with an error
naming the problem; the process-group timeout is short, so a rank left waiting in a collective shows up as a timeout
error instead of a hang.
"""

import argparse
import json
import os
import shutil
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401
from tests.toolbox.lightning_scripts import one_step_trainer  # noqa: E402
from tests.toolbox.models import ToyLM, batch, loss_fn  # noqa: E402

MISUSE = ["frozen_fit", "frozen_eval", "foreign_optimizer"]

# name -> (checkpoint made by damage() under --work, model options). Each must raise on both ranks.
LOADS = {
    # full (one file)
    "full_missing": ("no_such_dir/missing.ckpt", {}),
    "full_random_bytes": ("random.ckpt", {}),
    "full_not_a_dict": ("tensor.ckpt", {}),
    "full_no_state_dict": ("no_state_dict.ckpt", {}),
    "full_state_not_tensor": ("state_not_tensor.ckpt", {}),
    "full_other_model": ("good.ckpt", {"dim": 6}),
    "full_extra_param_strict": ("good.ckpt", {"extra": True}),
    "full_other_optimizer": ("good.ckpt", {"one_group": True}),
    "full_two_optimizers": ("two_optimizers.ckpt", {}),
    "full_bad_optimizer_state": ("bad_optimizer_state.ckpt", {}),
    # sharded (DCP directory + meta.pt)
    "sharded_no_meta": ("sharded_no_meta", {}),
    "sharded_corrupt_metadata": ("sharded_corrupt_metadata", {}),
    "sharded_corrupt_shard": ("sharded_corrupt_shard", {}),
    "sharded_other_optimizer": ("good_sharded", {"one_group": True}),
    # local (meta.pt + rank-N.pt)
    "local_rank0_random": ("local_rank0_random", {}),
    "local_rank1_empty": ("local_rank1_empty", {}),
    "local_rank_files_swapped": ("local_rank_files_swapped", {}),
    "local_meta_truncated": ("local_meta_truncated", {}),
    "local_meta_foreign": ("local_meta_foreign", {}),
    "local_other_optimizer": ("good_local", {"one_group": True}),
    # directories that are no checkpoint
    "dir_only_meta": ("dir_only_meta", {}),
    "dir_rank_files_no_meta": ("dir_rank_files_no_meta", {}),
}


class Module(L.LightningModule):
    def __init__(
        self, dim: int = 5, extra: bool = False, frozen: bool = False, foreign: bool = False, one_group: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM(dim=dim)
        if extra:
            self.extra = torch.nn.Parameter(torch.full((3, 2), 0.5))
        if frozen:
            self.model.requires_grad_(False)
        self.foreign = foreign
        self.one_group = one_group

    def training_step(self, b, i):
        return loss_fn(self.model(b[0]), b[1])

    def validation_step(self, b, i):
        self.log("val_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def test_step(self, b, i):
        self.log("test_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def predict_step(self, b, i):
        return self.model(b[0]).argmax(-1)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad] or list(self.parameters())
        if self.foreign:
            params.append(torch.nn.Parameter(torch.zeros(3)))
        if self.one_group:
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        return torch.optim.SGD([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    x, y = batch(0, size=8)
    return DataLoader(TensorDataset(x, y), batch_size=2)


def misuse(name: str) -> tuple[int, dict]:
    trainer = one_step_trainer()
    module = Module(frozen=name.startswith("frozen"), foreign=name == "foreign_optimizer")
    try:
        if name == "frozen_eval":
            trainer.validate(module, loader(), verbose=False)
            trainer.test(module, loader(), verbose=False)
            return trainer.global_rank, {"ok": f"{len(trainer.predict(module, loader()))} predictions"}
        trainer.fit(module, loader())
        return trainer.global_rank, {"ok": "fit"}
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return trainer.global_rank, {"error": [type(exc).__name__, str(exc)]}


def save_good(work: str) -> int:
    """One fitted step, saved in all three formats."""
    trainer = one_step_trainer()
    trainer.fit(Module(), loader())
    trainer.save_checkpoint(os.path.join(work, "good.ckpt"))
    for kind in ("sharded", "local"):
        trainer.strategy.state_dict_type = lightning_fsdp.checkpoint.routing.parse_state_dict_type(kind)
        trainer.save_checkpoint(os.path.join(work, f"good_{kind}"))
    return trainer.global_rank


def _copy(work: str, src: str, dst: str) -> str:
    shutil.copytree(os.path.join(work, src), os.path.join(work, dst))
    return os.path.join(work, dst)


def damage(work: str) -> None:
    """The bad checkpoints of ``LOADS``, made from the good ones (rank 0 only)."""
    join = os.path.join
    rng = torch.Generator().manual_seed(0)

    def noise(n: int) -> bytes:
        return bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())

    with open(join(work, "random.ckpt"), "wb") as f:
        f.write(noise(4096))
    torch.save(torch.zeros(3), join(work, "tensor.ckpt"))
    good = torch.load(join(work, "good.ckpt"), weights_only=False)
    torch.save({k: v for k, v in good.items() if k != "state_dict"}, join(work, "no_state_dict.ckpt"))
    torch.save(
        {**good, "state_dict": {**good["state_dict"], "model.tiny": "not a tensor"}},
        join(work, "state_not_tensor.ckpt"),
    )
    torch.save({**good, "optimizer_states": good["optimizer_states"] * 2}, join(work, "two_optimizers.ckpt"))
    torch.save({**good, "optimizer_states": [{"momentum_buffer": 1}]}, join(work, "bad_optimizer_state.ckpt"))

    os.remove(join(_copy(work, "good_sharded", "sharded_no_meta"), "meta.pt"))
    with open(join(_copy(work, "good_sharded", "sharded_corrupt_metadata"), ".metadata"), "wb") as f:
        f.write(noise(300))
    shard = join(_copy(work, "good_sharded", "sharded_corrupt_shard"), "__0_0.distcp")
    size = os.path.getsize(shard)
    with open(shard, "wb") as f:  # same length as the metadata says, garbage content
        f.write(noise(size))

    with open(join(_copy(work, "good_local", "local_rank0_random"), "rank-0.pt"), "wb") as f:
        f.write(noise(2048))
    open(join(_copy(work, "good_local", "local_rank1_empty"), "rank-1.pt"), "wb").close()
    swapped = _copy(work, "good_local", "local_rank_files_swapped")
    shutil.copyfile(join(swapped, "rank-0.pt"), join(swapped, "rank-1.pt"))
    meta = join(_copy(work, "good_local", "local_meta_truncated"), "meta.pt")
    data = open(meta, "rb").read()
    with open(meta, "wb") as f:
        f.write(data[: len(data) // 2])
    shutil.copyfile(join(work, "good.ckpt"), join(_copy(work, "good_local", "local_meta_foreign"), "meta.pt"))

    only_meta = join(work, "dir_only_meta")
    os.makedirs(only_meta)
    shutil.copyfile(join(work, "good_local", "meta.pt"), join(only_meta, "meta.pt"))
    no_meta = _copy(work, "good_local", "dir_rank_files_no_meta")
    os.remove(join(no_meta, "meta.pt"))


def load_case(work: str, name: str) -> tuple[int, dict]:
    path, options = LOADS[name]
    trainer = one_step_trainer()
    with trainer.init_module():
        module = Module(**options)
    try:
        trainer.fit(module, loader(), ckpt_path=os.path.join(work, path))
        return trainer.global_rank, {"ok": "fit"}
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return trainer.global_rank, {"error": [type(exc).__name__, str(exc)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for name in MISUSE:
        rank, results[name] = misuse(name)
    rank = save_good(args.work)
    if rank == 0:
        damage(args.work)
    dist.barrier()
    for name in LOADS:
        rank, results[name] = load_case(args.work, name)
    with open(os.path.join(args.work, f"result.rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
