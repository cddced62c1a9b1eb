"""Checkpoints from elsewhere, resumed on 2 ranks: a malicious pickle planted in each file of each format, and the
same checkpoints intact, all in one launch (used by tests/reliability/test_untrusted_checkpoints.py).

Usage: ``untrusted_run.py --work DIR``. Saves one fitted step in the three formats (``good.ckpt``, ``good_sharded``,
``good_local``); rank 0 plants a payload in a copy of each file (:func:`plant_all`, ``PLANTED``); then every rank
resumes from each case in ``RESUMES`` in turn and writes ``DIR/result.rank{N}.json``: ``{case: {"error": [type,
message]} | {"ok": {...}}, "ran": [markers it left]}``. The payload of a planted file runs ``touch`` on a
marker file (``DIR/ran-{case}``) when unpickled unrestricted; no marker may exist after any case. The process-group
timeout is short, so a rank left waiting in a collective shows up as an error instead of a hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import io
import json
import os
import pickle
import shlex
import shutil
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp.checkpoint.routing import parse_state_dict_type  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, one_step_trainer  # noqa: E402
from tests.toolbox.models import batch, loss_fn  # noqa: E402

GOOD = {"full": "good.ckpt", "sharded": "good_sharded", "local": "good_local"}

# case -> (the good checkpoint it is a copy of, the planted file inside it or "" for the full file itself). The
# copy is DIR/{case} (DIR/{case}.ckpt for the full file); its payload's marker is DIR/ran-{case}.
PLANTED = {
    "full_file": ("full", ""),
    "sharded_metadata": ("sharded", ".metadata"),  # DCP's metadata pickle
    "sharded_metadata_escape": ("sharded", ".metadata"),  # no payload: a storage path outside the directory
    "sharded_meta": ("sharded", "meta.pt"),
    "sharded_distcp_tensor": ("sharded", "distcp"),  # a model tensor's bytes in a .distcp file
    "sharded_distcp_bytes": ("sharded", "distcp"),  # an optimizer hyper-parameter's bytes in a .distcp file
    "local_meta": ("local", "meta.pt"),
    "local_rank0": ("local", "rank-0.pt"),
    "local_rank1": ("local", "rank-1.pt"),
}
INTACT = {f"intact_{kind}": kind for kind in GOOD}


def checkpoint_name(case: str) -> str:
    """The checkpoint of ``case`` (a planted copy or a good one), relative to DIR."""
    if case in INTACT:
        return GOOD[INTACT[case]]
    return f"{case}.ckpt" if PLANTED[case][0] == "full" else case


# name -> (checkpoint under DIR, weights_only passed to trainer.fit); "unset" passes none.
RESUMES: dict[str, tuple[str, bool | str]] = {
    **{case: (checkpoint_name(case), True) for case in PLANTED},
    # weights_only unset: restricted as torch.load's default is (the DCP reads are this package's own).
    "sharded_metadata_unset": (checkpoint_name("sharded_metadata"), "unset"),
    "sharded_distcp_bytes_unset": (checkpoint_name("sharded_distcp_bytes"), "unset"),
    **{case: (checkpoint_name(case), True) for case in INTACT},
}


class Payload:
    """Unpickled without restriction, runs ``touch MARKER`` (the class itself is not in the pickle: only
    ``os.system`` and its argument are)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def marker(work: str, case: str) -> str:
    return os.path.join(work, f"ran-{case}")


def markers(work: str) -> list[str]:
    return sorted(os.path.basename(m) for m in glob.glob(os.path.join(work, "ran-*")))


# ===================================================================================================== planting
def _distcp_entry(metadata, flat: str):
    """(storage index, storage info) of the first chunk of the DCP entry ``flat``."""
    for index, info in metadata.storage_data.items():
        if index.fqn == flat:
            return index, info
    raise KeyError(flat)


def _replace_slice(folder: str, flat: str, blob: bytes) -> str:
    """Put ``blob`` in place of the stored bytes of ``flat`` in its .distcp file, the other entries of that file
    moved to keep it contiguous, and rewrite .metadata (the offsets) as DCP writes it. Returns the .distcp file."""
    meta_file = os.path.join(folder, ".metadata")
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # our own, intact file
    target, info = _distcp_entry(metadata, flat)
    file = os.path.join(folder, info.relative_path)
    with open(file, "rb") as f:
        data = f.read()
    entries = sorted(
        ((i, s) for i, s in metadata.storage_data.items() if s.relative_path == info.relative_path),
        key=lambda item: item[1].offset,
    )
    assert sum(s.length for _, s in entries) == len(data), "a .distcp file is its entries, back to back"
    out = bytearray()
    for index, storage in entries:
        piece = blob if index == target else data[storage.offset : storage.offset + storage.length]
        metadata.storage_data[index] = dataclasses.replace(storage, offset=len(out), length=len(piece))
        out += piece
    with open(file, "wb") as f:
        f.write(out)
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    return file


def _add_payload(file: str, payload: Payload) -> None:
    """Re-save a ``torch.save`` file of this package with the payload as one more entry."""
    data = torch.load(file, weights_only=False)  # our own, intact file
    data["extra"] = payload
    torch.save(data, file)


def plant(work: str, case: str, into: str | None = None) -> str:
    """Copy the good checkpoint of ``case`` from ``work`` to ``into`` (default ``work``) and plant its payload (its
    marker in ``into`` too). Returns the file planted (for the escape case: ``.metadata``)."""
    into = into or work
    kind, inside = PLANTED[case]
    payload = Payload(marker(into, case))
    src, dst = os.path.join(work, GOOD[kind]), os.path.join(into, checkpoint_name(case))
    if kind == "full":
        shutil.copyfile(src, dst)
        _add_payload(dst, payload)
        return dst
    shutil.copytree(src, dst)
    if case == "sharded_metadata":
        file = os.path.join(dst, ".metadata")
        with open(file, "rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data["extra"] = payload  # a valid metadata object, with the payload inside
        with open(file, "wb") as f:
            pickle.dump(metadata, f)
        return file
    if case == "sharded_metadata_escape":
        # The file of one entry moved out of the directory (a legitimate copy of it, so that a reader following the
        # path would load it without complaint): the metadata names it as ../{case}-outside.distcp.
        file = os.path.join(dst, ".metadata")
        with open(file, "rb") as f:
            metadata = pickle.load(f)
        relative = metadata.storage_data[_distcp_entry(metadata, "model.model.emb.weight")[0]].relative_path
        outside = f"{case}-outside.distcp"
        shutil.copyfile(os.path.join(dst, relative), os.path.join(into, outside))
        for index, storage in metadata.storage_data.items():
            if storage.relative_path == relative:
                metadata.storage_data[index] = dataclasses.replace(storage, relative_path=os.path.join("..", outside))
        with open(file, "wb") as f:
            pickle.dump(metadata, f)
        return file
    if inside == "distcp":
        blob = io.BytesIO()
        torch.save(payload, blob)
        flat = "model.model.emb.weight" if case == "sharded_distcp_tensor" else "optimizer_0.param_groups.0.lr"
        return _replace_slice(dst, flat, blob.getvalue())
    file = os.path.join(dst, inside)
    _add_payload(file, payload)
    return file


def plant_all(work: str) -> dict[str, str]:
    """Every case of ``PLANTED``, in ``work``: case -> the planted file."""
    return {case: plant(work, case) for case in PLANTED}


# ===================================================================================================== the run
class Module(ToyLMModule):
    def __init__(self) -> None:
        super().__init__()
        self.steps_run = 0  # 0 after a resume that loaded the saved step (max_steps=1 is then reached)

    def training_step(self, b, i):
        self.steps_run += 1
        return loss_fn(self.model(b[0]), b[1])

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() > 1]
        rest = [p for p in self.parameters() if p.dim() <= 1]
        return torch.optim.SGD([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    x, y = batch(0, size=8)
    return DataLoader(TensorDataset(x, y), batch_size=2)


def local_sum(module: L.LightningModule) -> float:
    """This rank's parameters (its shards), summed in float64: equal after a load of the saved step."""
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def save_good(work: str) -> tuple[int, float]:
    """One fitted step, saved in all three formats; (rank, this rank's parameter sum at the save)."""
    trainer = one_step_trainer()
    module = Module()
    trainer.fit(module, loader())
    trainer.save_checkpoint(os.path.join(work, GOOD["full"]))
    for kind in ("sharded", "local"):
        trainer.strategy.state_dict_type = parse_state_dict_type(kind)
        trainer.save_checkpoint(os.path.join(work, GOOD[kind]))
    return trainer.global_rank, local_sum(module)


def resume(work: str, name: str) -> dict:
    path, weights_only = RESUMES[name]
    trainer = one_step_trainer()
    module = Module()
    kwargs = {} if weights_only == "unset" else {"weights_only": weights_only}
    before = markers(work)
    try:
        trainer.fit(module, loader(), ckpt_path=os.path.join(work, path), **kwargs)
        result = {"ok": {"global_step": trainer.global_step, "steps_run": module.steps_run, "sum": local_sum(module)}}
    except Exception as exc:  # noqa: BLE001 - the test reads it
        result = {"error": [type(exc).__name__, str(exc)]}
    result["ran"] = [m for m in markers(work) if m not in before]  # markers this case left
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, saved_sum = save_good(args.work)
    if rank == 0:
        plant_all(args.work)
    dist.barrier()
    results: dict = {"saved_sum": saved_sum}
    for name in RESUMES:
        results[name] = resume(args.work, name)
    with open(os.path.join(args.work, f"result.rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main()
