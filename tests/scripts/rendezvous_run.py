"""One rank of a start-up through ``lightning_fsdp.rendezvous.init_default_group``, started torchrun style
(``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` in the environment; the test starts one rank late).

Used by tests/reliability/test_startup_timeout.py. ``--hold FILE``: the rank imports everything, prints ``holding``,
and calls ``init_default_group`` only once FILE exists (the test creates it to make this rank late). Each rank prints
``RENDEZVOUS rank=R key=value`` lines (flushed):

- ``init-start`` / ``joined``: ``time.time()`` when it called ``init_default_group`` and when that returned;
- ``group-timeout-ms`` / ``store-timeout-ms``: the default group's backend timeout and its store's, after start-up;
- ``sum``: an all-reduce of ``rank + 1`` over all ranks (the group works);
- then the other ranks withhold the next all-reduce: rank 0 prints ``withheld-error`` (the message) and
  ``withheld-elapsed`` (seconds from its call to the error), then lets them go through the store; all end with
  ``done``.

``--backend hccl`` uses the Gaudi test double (tests/fakes on PYTHONPATH): an "hccl" backend that is gloo
underneath, whose name puts it on the path for backends torch cannot change the timeout of.
"""

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp.rendezvous import init_default_group  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group, settle_at_exit  # noqa: E402


def say(rank: int, key: str, value: object) -> None:
    sys.stdout.write(f"RENDEZVOUS rank={rank} {key}={value}\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--startup-timeout", type=float, required=True, help="seconds")
    parser.add_argument("--hold", default=None, help="call init_default_group only once this file exists")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.backend == "hccl":
        import habana_frameworks.torch.distributed.hccl  # noqa: F401  registers the backend

    environment = TorchElasticEnvironment()
    rank = environment.global_rank()
    if args.hold is not None:
        say(rank, "holding", f"{time.time():.3f}")
        while not os.path.exists(args.hold):
            time.sleep(0.05)
    say(rank, "init-start", f"{time.time():.3f}")
    init_default_group(
        environment, args.backend, timedelta(seconds=args.timeout), timedelta(seconds=args.startup_timeout)
    )
    settle_at_exit()
    say(rank, "joined", f"{time.time():.3f}")
    from torch.distributed.distributed_c10d import _get_default_store

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    say(rank, "group-timeout-ms", int(backend.options._timeout.total_seconds() * 1000))
    store = _get_default_store()
    say(rank, "store-timeout-ms", int(store.timeout.total_seconds() * 1000))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    say(rank, "sum", int(total.item()))

    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            say(rank, "withheld-error", "none")
        except Exception as error:  # the timeout this checks
            say(rank, "withheld-elapsed", f"{time.monotonic() - started:.2f}")
            say(rank, "withheld-error", " ".join(str(error).split())[:300])
        # Rank 0 holds the store: it waits for the others to have seen the key before it ends.
        store.set("rendezvous-run/released", "1")
        others = [f"rendezvous-run/left{r}" for r in range(1, dist.get_world_size())]
        store.wait(others, timedelta(seconds=300))
    else:
        store.wait(["rendezvous-run/released"], timedelta(seconds=300))
        store.set(f"rendezvous-run/left{rank}", "1")
    destroy_process_group()
    say(rank, "done", f"{time.time():.3f}")


if __name__ == "__main__":
    main()
