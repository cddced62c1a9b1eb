"""Checkpoints on object storage, run as users run scripts, for tests/checkpoint/test_checkpoint_s3.py: 2 CPU ranks
(Lightning's launcher), every path an ``s3://`` URL on the test's moto server (``AWS_ENDPOINT_URL``).

For each ``--formats`` entry (``state_dict_type``), in one process group:

1. ``fit`` 3 steps of ToyLM with ``ModelCheckpoint(dirpath=URL/mc, save_top_k=1, every_n_train_steps=1,
   save_last=True)``: the bucket listing of ``mc`` after fit (older checkpoints removed there);
2. a new Trainer ``fit(ckpt_path=URL/mc/epoch=0-step=3.ckpt)`` to step 6, and one ``fit(ckpt_path=URL/mc/last.ckpt)``
   (``save_last``'s checkpoint on the bucket) to step 6: their full parameters;
3. (directory formats) a save over that checkpoint in which rank 1's upload fails: what each rank raised; then
   ``validate(ckpt_path=...)`` of it: the full parameters it restores (the previous checkpoint, intact);
4. (directory formats) a save to a new path in which rank 1's upload fails and what was uploaded is left there (as
   a killed job leaves it), then ``fit(ckpt_path=)`` of that path: what each rank raised.

Each rank saves its results in ``{--out}.rank{r}``.
"""

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

GLOBAL_BATCH = 6
SAMPLES = 18  # 3 steps per epoch: the checkpoint of step 3 ends an epoch, where a plain loader resumes


class InjectedUploadFailure(OSError):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--url", required=True, help="s3://bucket/prefix under which every checkpoint goes")
    parser.add_argument("--formats", default="full,sharded,local")
    args = parser.parse_args()

    from datetime import timedelta

    import fsspec
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import lightning_fsdp.checkpoint.remote as remote
    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.shutdown import destroy_process_group
    from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer
    from tests.toolbox.models import Block, loss_fn, samples

    class Module(ToyLMModule):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", loss_fn(self.model(x), y), sync_dist=True)

    torch.set_num_threads(1)
    results: dict = {}
    rank = 0

    def trainer_for(fmt: str, max_steps: int, callbacks: list | None = None):
        strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=fmt, timeout=timedelta(seconds=60))
        return quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=max_steps,
            num_sanity_val_steps=0,
            limit_val_batches=1,
            enable_checkpointing=bool(callbacks),
            callbacks=callbacks or [],
            use_distributed_sampler=False,
        )

    def loader_for(trainer):
        # Rank r takes samples r, r+N, ...: each step's global batch is samples [6k, 6k+6), as on one device.
        data = samples(SAMPLES)
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)

    def outcome(work) -> tuple[str, str] | None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            return type(exc).__name__, str(exc)
        return None

    def failing_upload_on_rank1(work) -> tuple[str, str] | None:
        """``work`` with rank 1's upload cut after its first file (as a rank dying mid-upload leaves it)."""
        original = remote.upload_directory

        def cut(local: str, url: str) -> dict:
            names = sorted(os.listdir(local))
            fs, path = fsspec.core.url_to_fs(url)
            fs.put_file(os.path.join(local, names[0]), f"{path}/{names[0]}")
            raise InjectedUploadFailure(f"injected: rank 1's upload to {url} cut after {names[0]!r}")

        if trainer.global_rank == 1:
            remote.upload_directory = cut
        try:
            return outcome(work)
        finally:
            remote.upload_directory = original

    for fmt in args.formats.split(","):
        base = f"{args.url}/{fmt}"
        res: dict = {}
        checkpointing = ModelCheckpoint(dirpath=f"{base}/mc", save_top_k=1, every_n_train_steps=1, save_last=True)
        trainer = trainer_for(fmt, 3, [checkpointing])
        trainer.fit(Module(), loader_for(trainer))
        rank = trainer.global_rank
        fs, mc_path = fsspec.core.url_to_fs(f"{base}/mc")
        fs.invalidate_cache()
        res["listing"] = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(mc_path, detail=False))
        res["best"] = checkpointing.best_model_path
        step3 = f"{base}/mc/epoch=0-step=3.ckpt"

        trainer = trainer_for(fmt, 6)
        module = Module()
        trainer.fit(module, loader_for(trainer), ckpt_path=step3)
        res["resumed"] = full_model_state_dict(trainer.strategy.engine)
        # The documented recipe for resuming from the bucket's last.ckpt: its URL. (Lightning 2.6's ckpt_path="last"
        # looks for it with the protocol stripped, on the local disk: Lightning-AI/pytorch-lightning#18261.)
        resumer = trainer_for(fmt, 6)
        resumer.fit(Module(), loader_for(resumer), ckpt_path=f"{base}/mc/last.ckpt")
        res["resumed_last"] = full_model_state_dict(resumer.strategy.engine)
        res["last_path"] = resumer.ckpt_path

        if fmt != "full":
            res["failed_over_existing"] = failing_upload_on_rank1(partial(trainer.save_checkpoint, step3))
            checker = trainer_for(fmt, 6)
            checker.validate(Module(), loader_for(checker), ckpt_path=step3, verbose=False)
            res["after_failed_save"] = full_model_state_dict(checker.strategy.engine)
            interrupted = f"{base}/interrupted.ckpt"
            # A save killed mid-upload: rank 1 stops after one file, and nobody deletes what was uploaded (a killed
            # job cannot), so the files stay without a commit object.
            cleanup, remote._remove_version = remote._remove_version, lambda *a: None
            res["failed_new"] = failing_upload_on_rank1(partial(trainer.save_checkpoint, interrupted))
            remote._remove_version = cleanup
            fs.invalidate_cache()
            res["versions_after_failures"] = (
                sum(os.path.basename(p).startswith("v-") for p in fs.ls(step3, detail=False)),
                sorted(os.path.basename(p) for p in fs.find(interrupted)),
            )
            resumer = trainer_for(fmt, 6)
            res["resume_interrupted"] = outcome(
                partial(resumer.fit, Module(), loader_for(resumer), ckpt_path=interrupted)
            )
        results[fmt] = res

    torch.save(results, f"{args.out}.rank{rank}")
    torch.distributed.barrier()
    destroy_process_group()


if __name__ == "__main__":
    main()
