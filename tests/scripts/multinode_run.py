"""Train ToyLM with Lightning across several (simulated) nodes, as a user's torchrun script would.

Started by ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ...`` (one torchrun per node): Lightning
detects torchrun (``TorchElasticEnvironment``), so no process is started here. With ``--reference`` it runs alone
as one process (``strategy="auto"``, one device) on the same global batches.

``--layout`` picks where HYBRID_SHARD's groups come from: the strategy's default (one node's processes shard,
the same local rank across nodes replicates), ``groups`` (``process_group=`` a callable returning the pair) or
``mesh`` (a ``device_mesh`` made with ``init_device_mesh`` before the Trainer, which needs torchrun's variables).

Written by global rank 0 to ``--out`` (``torch.save``): per-step global mean losses, the final full parameters,
and every rank's parameter bytes between steps (``engine.local_param_bytes()``), indexed by global rank.
"""

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 8  # divisible by 4 ranks (2 nodes x 2 processes) and by 2
STEPS = 4
SAMPLES = GLOBAL_BATCH * STEPS


class Module(ToyLMModule):
    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []

    def training_step(self, b, i):
        x, y = b
        loss = loss_fn(self.model(x), y)
        # Every rank has the same number of tokens, so the mean of the ranks' means is the global batch's mean.
        self.step_losses.append(self.all_gather(loss.detach()).mean().item())
        return loss


def node_groups(nodes: int, devices: int):
    """(shard, replicate) groups as a user would build them: shard within a node, replicate across nodes."""
    rank = torch.distributed.get_rank()
    shard = replicate = None
    for node in range(nodes):  # every rank creates every group, in the same order
        group = torch.distributed.new_group(list(range(node * devices, (node + 1) * devices)))
        shard = group if rank // devices == node else shard
    for local in range(devices):
        group = torch.distributed.new_group(list(range(local, nodes * devices, devices)))
        replicate = group if rank % devices == local else replicate
    return shard, replicate


def layout(args) -> dict:
    if args.layout == "groups":
        # A callable: the strategy calls it once the default process group exists.
        return {"process_group": lambda: node_groups(args.nodes, args.devices)}
    if args.layout == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        # Creates the default process group from torchrun's variables, before the Trainer does.
        mesh = init_device_mesh("cpu", (args.nodes, args.devices), mesh_dim_names=("replicate", "shard"))
        return {"device_mesh": mesh}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--layout",
        choices=("default", "groups", "mesh"),
        default="default",
        help="hybrid groups: the strategy's node layout, process_group=callable returning "
        "(shard, replicate) groups, or a device_mesh made before the Trainer (needs torchrun)",
    )
    parser.add_argument("--reference", action="store_true", help="one process, strategy='auto', same batches")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.reference:
        hardware = {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "strategy": "auto"}
    else:
        strategy = FSDPStrategy(sharding_strategy=args.sharding, auto_wrap_policy={Block}, **layout(args))
        hardware = {"accelerator": "cpu", "devices": args.devices, "num_nodes": args.nodes, "strategy": strategy}
    trainer = quiet_trainer(
        **hardware,
        max_steps=STEPS,
        max_epochs=1,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    module = Module()
    assert GLOBAL_BATCH % trainer.world_size == 0, (GLOBAL_BATCH, trainer.world_size)
    # Rank r takes samples r, r+W, r+2W, ...: step s's samples over all ranks are exactly [s*G, (s+1)*G), the
    # reference's batch for that step.
    sampler = DistributedSampler(
        samples(SAMPLES), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
    )
    loader = DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)
    trainer.fit(module, loader)

    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        state = full_model_state_dict(engine)  # collective: every rank calls it
        local = torch.tensor([engine.local_param_bytes()], dtype=torch.int64)
        param_bytes = trainer.strategy.all_gather(local).flatten().tolist()
        full_bytes = engine.full_param_bytes()
    else:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        param_bytes = [sum(p.numel() * p.element_size() for p in module.parameters())]
        full_bytes = param_bytes[0]
    env = getattr(trainer.strategy, "cluster_environment", None)
    placement = torch.tensor([trainer.global_rank, trainer.node_rank, trainer.local_rank], dtype=torch.int64)
    if engine is not None:
        placements = trainer.strategy.all_gather(placement).reshape(-1, 3).tolist()
    else:
        placements = [placement.tolist()]
    if trainer.is_global_zero:
        torch.save(
            {
                "losses": module.step_losses,
                "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                "param_bytes": param_bytes,
                "full_param_bytes": full_bytes,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "cluster_environment": type(env).__name__ if env is not None else None,
                "placements": placements,  # [global_rank, node_rank, local_rank] per rank
                "sharding_strategy": str(getattr(trainer.strategy, "sharding_strategy", None)),
            },
            args.out,
        )


if __name__ == "__main__":
    main()
