"""Train ToyLM with fsdp_custom under ``mpirun``, as a user's script would: ``mpirun -np N python mpi_run.py ...``.

Nothing here starts processes or sets ranks: Lightning detects the launch through ``MPIEnvironment`` (mpi4py) and
reads the world size and global rank from ``MPI.COMM_WORLD``, the node of each rank from the host names every rank
reports (``socket.gethostname()``, gathered over MPI) and the main address from rank 0's host name.

``--simulate-nodes``: every rank reports the host name ``127.0.0.<1 + rank // devices>``, as ranks on
``--nodes`` machines of ``--devices`` processes each would report their machines' names, so Lightning gives
them node ranks 0, 0, 1, 1, ... and HYBRID_SHARD its per-node groups; the names are loopback addresses, so rank
0's name is a main address the others reach. Only the name Lightning reads changes, the processes stay on this host.

After ``--record-step`` optimizer steps every rank takes part in gathering the full model state, and rank 0 writes
it atomically to ``--out`` with the run's layout: the cluster environment Lightning chose, world size, node count,
``[global rank, node rank, local rank]`` per rank and each rank's parameter bytes. Then, with ``--fault``, rank
``--fault-rank`` fails at the start of step ``--fault-step`` (tests/scripts/fault_run.py's faults: ``kill``
SIGKILLs it, ``hang`` sleeps forever). Each rank prints ``FAULT-RUN rank=R event=... pid=P t=<time.time()>`` lines
(fault_run.py's format).
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from tests.scripts.fault_run import inject, say  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 8  # divisible by 2 and by 4 ranks


class Module(ToyLMModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args

    def training_step(self, b, i):
        if self.global_rank == self.args.fault_rank and self.global_step == self.args.fault_step:
            inject(self.args.fault, self.global_rank, self.global_step)
        x, y = b
        return loss_fn(self.model(x), y)


class Record(L.Callback):
    def __init__(self, step: int, out: str) -> None:
        self.step, self.out = step, out

    def on_train_start(self, trainer, module):
        say(trainer.global_rank, "train-start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        strategy = trainer.strategy
        engine = strategy.engine
        state = full_model_state_dict(engine)  # collective: every rank calls it
        mine = torch.tensor(
            [trainer.global_rank, trainer.node_rank, trainer.local_rank, engine.local_param_bytes()], dtype=torch.int64
        )
        every = strategy.all_gather(mine).reshape(-1, 4).tolist()
        if trainer.is_global_zero:
            record = {
                "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                "cluster_environment": type(strategy.cluster_environment).__name__,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "process_group_size": torch.distributed.get_world_size(),
                "placements": [row[:3] for row in every],
                "param_bytes": [row[3] for row in every],
                "full_param_bytes": engine.full_param_bytes(),
            }
            partial = self.out + ".partial"
            torch.save(record, partial)
            os.replace(partial, self.out)
        say(trainer.global_rank, "recorded")


def simulate_host_name(devices: int) -> None:
    from mpi4py import MPI

    name = f"127.0.0.{1 + MPI.COMM_WORLD.Get_rank() // devices}"
    socket.gethostname = lambda: name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--simulate-nodes", action="store_true", help="rank r reports host 127.0.0.<1 + r//devices>")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--record-step", type=int, default=3)
    parser.add_argument("--fault", choices=["none", "kill", "exit", "hang"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=10.0, help="FSDPStrategy(timeout=...) in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.simulate_nodes:
        simulate_host_name(args.devices)

    strategy = FSDPStrategy(
        sharding_strategy=args.sharding, auto_wrap_policy={Block}, timeout=timedelta(seconds=args.timeout)
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[Record(args.record_step, args.out)],
    )
    module = Module(args)
    data = samples(GLOBAL_BATCH * args.steps)
    # Rank r takes samples r, r + W, ...: step s's samples over all ranks are exactly [s * G, (s + 1) * G).
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    say(trainer.global_rank, "fit-start")
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler))
    say(trainer.global_rank, "train-end")


if __name__ == "__main__":
    main()
