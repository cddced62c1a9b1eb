"""Soak run for tests/reliability/test_soak.py: a long 2-rank fsdp_custom Lightning fit with periodic checkpoints,
optionally killed hard in the middle, or resumed from a checkpoint; records what each rank holds every few steps.

Training: ToyLM (units per Block), SGD with momentum, ``--steps`` optimizer steps (``max_steps``), epochs of
``STEPS_PER_EPOCH`` steps over a fixed data set; each epoch visits it in the order of a permutation seeded by the
epoch number (so the order is fixed across runs, and differs between epochs). The loader is resumable the way
Lightning expects (``state_dict``/``load_state_dict``, i.e. ``_Stateful``): a run resumed from a checkpoint taken in
the middle of an epoch continues with the next unseen batch of that epoch, so a killed-and-resumed run sees exactly
the batches an uninterrupted run sees.

- ``--ckpt-dir D --ckpt-every N --state-dict-type T``: ``ModelCheckpoint(dirpath=D, every_n_train_steps=N,
  save_top_k=-1)``, files ``step=S.ckpt`` (a directory for sharded/local).
- ``--kill-at K``: at ``on_train_batch_end`` of global step K (before any checkpoint of that step is written) rank 0
  SIGKILLs its whole process group (itself and the rank it started), as an out-of-memory killer or a lost node
  would. It must lead its group (the test starts it in a session of its own); otherwise every rank ``os._exit``s.
- ``--resume PATH``: ``fit(ckpt_path=PATH)``.

Every ``--record-every`` steps each rank records, at ``on_train_batch_end`` (after the optimizer step, before a
checkpoint save), after ``gc.collect()``:

- ``alloc_bytes``: live bytes of torch's CPU allocator (c10's running total, switched on at start-up with
  ``FLAGS_caffe2_report_cpu_memory_usage`` and read through one profiler event; every tensor the process holds,
  including those only C++ references: autograd, gloo buffers);
- ``tensor_bytes``: bytes of the distinct storages of all Python-reachable tensors (``gc.get_objects()``);
- ``tensors``: number of live ``torch.Tensor`` Python objects; ``objects``: all gc-tracked objects;
- ``hooks``: hooks registered on the model's modules (forward/backward/state-dict) and parameters, plus torch's
  global module hooks; ``rss``: resident set size (information only: glibc keeps freed memory).

Outputs (``torch.save``): ``--out`` + ``.rank{r}`` per rank with the records and per-step losses; rank 0 also writes
``--out`` with the final full parameters and optimizer state (gathered) and the per-step losses.
"""

import argparse
import gc
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.memory import c10_report_flag, quiet_stderr  # noqa: E402

# Count every allocation from here on, on every thread (see benchmarks/memory.py).
_FLAG = c10_report_flag()
if _FLAG is not None:
    _FLAG.value = True

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict, full_optimizer_state_dict  # noqa: E402
from lightning_fsdp.shutdown import settle_collective_threads  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 12
SAMPLES = GLOBAL_BATCH * STEPS_PER_EPOCH


class ResumableLoader:
    """This rank's share of each global batch, in a per-epoch permutation; resumable mid-epoch (Lightning's
    ``_Stateful``). Sized, so Lightning's fetcher does not prefetch: batches served == batches trained on."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.data = samples(SAMPLES).tensors
        self.rank, self.world_size = rank, world_size
        self.sampler = self  # Lightning calls dataloader.sampler.set_epoch(epoch) before each epoch
        self.epoch = 0
        self.served = 0  # batches of the current epoch handed out
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return STEPS_PER_EPOCH

    def __iter__(self):
        start, self._resume_at = (self._resume_at if self._resume_at < STEPS_PER_EPOCH else 0), 0
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(10_000 + self.epoch))
        self.served = start
        for b in range(start, STEPS_PER_EPOCH):
            rows = order[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH][self.rank :: self.world_size]
            self.served = b + 1
            yield tuple(t[rows] for t in self.data)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state["served"]


class Module(ToyLMModule):
    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}  # global step -> this rank's loss

    def training_step(self, b, i):
        x, y = b
        loss = loss_fn(self.model(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def allocator_live_bytes() -> int:
    """c10's running total of live CPU allocator bytes, read from one profiler allocation event."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if _FLAG is None:
        return -1
    with quiet_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            probe = torch.empty(8)
            del probe
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.alloc_size > 0:
            return int(node.extra_fields.total_allocated) - int(node.extra_fields.alloc_size)
    return -1


def count_hooks(module: torch.nn.Module) -> int:
    import torch.nn.modules.module as mm

    total = 0
    for m in module.modules():
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_state_dict_pre_hooks",
            "_load_state_dict_pre_hooks",
            "_load_state_dict_post_hooks",
        ):
            total += len(getattr(m, name, None) or {})
        for p in m.parameters(recurse=False):
            total += len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    for name in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
        "_global_parameter_registration_hooks",
        "_global_module_registration_hooks",
        "_global_buffer_registration_hooks",
    ):
        total += len(getattr(mm, name, None) or {})
    return total


def measure(module: torch.nn.Module) -> dict:
    import warnings

    with warnings.catch_warnings():  # isinstance() on a deprecated torch.distributed alias warns
        warnings.simplefilter("ignore")
        return _measure(module)


def _measure(module: torch.nn.Module) -> dict:
    # A gloo worker thread may still hold the last reference to the step's last collective's buffers, waiting for the
    # GIL to free them (lightning_fsdp/shutdown.py): let it, so that a free in flight does not read as a leak. Seen
    # once in a full suite run: 560 bytes (a small unit's all-to-all buffers) alive at one of six records.
    settle_collective_threads()
    gc.collect()
    objects = gc.get_objects()
    storages: dict[int, int] = {}
    tensors = 0
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except Exception:  # noqa: BLE001 - objects with odd __class__
            continue
        tensors += 1
        try:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # noqa: BLE001 - meta or sparse tensors: no storage to count
            pass
    del objects
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "alloc_bytes": allocator_live_bytes(),
        "tensor_bytes": sum(storages.values()),
        "tensors": tensors,
        "objects": len(gc.get_objects()),
        "hooks": count_hooks(module),
        "rss": rss,
    }


class Soak(L.Callback):
    def __init__(self, args) -> None:
        self.args = args
        self.records: list[tuple[int, dict]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step  # optimizer steps done
        if step % self.args.record_every == 0:
            self.records.append((step, measure(module)))
        if self.args.kill_at is not None and step == self.args.kill_at:
            sys.stdout.write(f"SOAK rank={trainer.global_rank} killing the job at step {step}\n")
            sys.stdout.flush()
            if trainer.global_rank == 0 and os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)  # this process and the rank it started, at once
            os._exit(9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--state-dict-type", default="sharded", choices=["full", "sharded", "local"])
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--ckpt-every", type=int, default=8)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--record-every", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    callback = Soak(args)
    callbacks = [callback]
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="{step}",
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
                save_last=False,
            )
        )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type),
        max_steps=args.steps,
        max_epochs=-1,
        enable_checkpointing=bool(args.ckpt_dir),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    with trainer.init_module():
        module = Module()
    loader = ResumableLoader(trainer.global_rank, trainer.world_size)
    trainer.fit(module, loader, ckpt_path=args.resume)
    engine = trainer.strategy.engine
    params = full_model_state_dict(engine)  # collective: every rank takes part, rank 0 keeps the result
    optim = full_optimizer_state_dict(engine, trainer.optimizers[0])
    rank = trainer.global_rank
    torch.save(
        {
            "records": callback.records,
            "losses": module.losses,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        },
        f"{args.out}.rank{rank}",
    )
    if rank == 0:
        torch.save(
            {"params": params, "optimizer": optim, "losses": module.losses, "global_step": trainer.global_step},
            args.out,
        )


if __name__ == "__main__":
    main()
