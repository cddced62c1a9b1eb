"""Two simulated nodes x two processes on localhost, launched by torchrun, against a single-process reference.

Each "node" is its own ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2`` joined through a c10d
rendezvous on 127.0.0.1, exactly as two machines would be; the training script (tests/scripts/multinode_run.py)
builds ``Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=FSDPStrategy(...))`` and Lightning picks up
torchrun's environment (``TorchElasticEnvironment``). Checked per sharding strategy:

- per-step global mean losses and final full parameters equal the single-process run on the same global batches;
- each rank's parameter bytes between steps: HYBRID_SHARD shards over one node's 2 processes (each rank holds ~1/2
  of the model, its replica on the other node the same), FULL_SHARD over all 4 ranks (~1/4), following the engine's
  ``torch.chunk`` layout exactly.

The same HYBRID_SHARD run is also started the way ``srun`` starts an sbatch job's tasks (4 plain processes with
SLURM's variables), so Lightning's ``SLURMEnvironment`` path is covered without a SLURM installation; that run takes
its groups from the user (``process_group=`` a callable returning ``(shard_group, replicate_group)``). The three runs
go two at a time (a module fixture).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import clean_env, free_port
from tests.toolbox.launch import SCRIPTS, in_background, start_logged
from tests.toolbox.models import ToyLM
from tests.toolbox.one_device import toy_lm_on_samples

SCRIPT = SCRIPTS / "multinode_run.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TIMEOUT_S = 240


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc): torchrun starts each worker in a session of its own."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every launcher still running and everything it started.

    Each launcher leads its own session. torchrun puts each worker in yet another session, so workers are found as
    descendants: SIGTERM first (torchrun then stops its workers itself), SIGKILL to whatever is left.
    """
    running = [p for p in procs if p.poll() is None]
    if running:
        tree = {p.pid: _descendants(p.pid) for p in running}
        for p in running:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in running):
            time.sleep(0.2)
        for p in running:
            for pid in [p.pid, *tree[p.pid]]:
                _signal_group(pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def _run_together(folder: Path, commands: list[tuple[list[str], dict]], what: str) -> None:
    """Start every command at once, each in its own session, and wait for all; kill all on failure or timeout."""
    procs, logs = [], []
    try:
        for i, (cmd, env) in enumerate(commands):
            log = folder / f"proc{i}.log"
            logs.append(log)
            procs.append(start_logged(cmd, log, env=env, cwd=folder))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break  # one failed process leaves the others waiting in a collective: stop them all
            time.sleep(0.5)
    finally:
        _stop(procs)
    report = "\n".join(
        f"--- process {i} (rc={p.returncode}):\n{_tail(log)}" for i, (p, log) in enumerate(zip(procs, logs))
    )
    assert all(p.returncode == 0 for p in procs), f"{what} failed:\n{report}"


def _script_args(out: Path, sharding: str, layout: str = "default") -> list[str]:
    return [
        str(SCRIPT),
        "--out",
        str(out),
        "--sharding",
        sharding,
        "--nodes",
        str(NODES),
        "--devices",
        str(PER_NODE),
        "--layout",
        layout,
    ]


def launch_two_nodes(folder: Path, sharding: str) -> dict:
    """One torchrun per simulated node, started together, joined by a c10d rendezvous; returns rank 0's record."""
    out = folder / "result.pt"
    port = free_port()
    run_id = f"multinode-{uuid.uuid4().hex[:12]}"
    commands = []
    for node_rank in range(NODES):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(PER_NODE),
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "0",
            *_script_args(out, sharding),
        ]
        commands.append((cmd, clean_env()))
    _run_together(folder, commands, f"torchrun: {sharding} on {NODES} nodes x {PER_NODE}")
    return torch.load(out, weights_only=False)


def launch_as_slurm_tasks(folder: Path, sharding: str, layout: str = "default") -> dict:
    """The 4 tasks ``srun`` would start for ``--nodes=2 --ntasks-per-node=2``, with the variables srun sets."""
    out = folder / "result.pt"
    common = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": str(WORLD),
        "SLURM_NTASKS_PER_NODE": str(PER_NODE),
        "SLURM_NNODES": str(NODES),
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    commands = []
    for rank in range(WORLD):
        env = {
            **clean_env(),
            **common,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % PER_NODE),
            "SLURM_NODEID": str(rank // PER_NODE),
        }
        commands.append(([sys.executable, *_script_args(out, sharding, layout)], env))
    _run_together(folder, commands, f"SLURM tasks: {sharding} on {NODES} nodes x {PER_NODE}")
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_device() -> dict:
    """One process, no Lightning, no sharding: the same model, optimizer and global batches as the script.

    Bit for bit what the script's ``--reference`` run (Lightning, one device, ``strategy="auto"``) gives, without
    starting a Lightning process. Keys as the LightningModule names them (the script's module holds the model as
    ``self.model``).
    """
    from tests.scripts.multinode_run import GLOBAL_BATCH, SAMPLES, STEPS

    run = toy_lm_on_samples(STEPS, GLOBAL_BATCH, SAMPLES)
    return {"losses": run.losses, "state": run.lightning_state()}


def _model_params() -> list[torch.Tensor]:
    return [p for _, p in ToyLM().named_parameters()]  # tied weight counted once, frozen layer included


def expected_bytes(shard_size: int, shard_rank: int) -> int:
    """Bytes a rank holds under the chunking rule, computed here rather than by the engine's layout code: a
    parameter of ``d0`` rows is split on dim 0 into chunks of ``c = ceil(d0 / shard_size)`` rows (torch.chunk), and
    shard rank ``r`` keeps rows ``[min(r*c, d0), min((r+1)*c, d0))``; ranks past the end keep none."""
    total = 0
    for p in _model_params():
        rows = p.shape[0] if p.dim() else 1
        c = -(-rows // shard_size)
        start = min(shard_rank * c, rows)
        total += (min(start + c, rows) - start) * (p.numel() // rows) * p.element_size()
    return total


def check_parity(result: dict, reference: dict, environment: str = "TorchElasticEnvironment") -> None:
    assert len(result["losses"]) == len(reference["losses"]) > 0
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    assert sorted(result["state"]) == sorted(reference["state"])
    for name, want in reference["state"].items():
        torch.testing.assert_close(result["state"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    # The run really was 2 nodes x 2 processes under torchrun (or SLURM), ranks laid out node by node.
    assert result["cluster_environment"] == environment
    assert result["world_size"] == WORLD and result["num_nodes"] == NODES
    assert sorted(result["placements"]) == [[g, g // PER_NODE, g % PER_NODE] for g in range(WORLD)]


def check_bytes(result: dict, shard_size: int) -> None:
    params = _model_params()
    full = sum(p.numel() * p.element_size() for p in params)
    one_row_each = sum(p[0].numel() * p.element_size() for p in params)  # one (padding) row per parameter
    assert result["full_param_bytes"] == full
    per_rank = result["param_bytes"]
    assert len(per_rank) == WORLD
    for rank, held in enumerate(per_rank):
        shard_rank = rank % shard_size  # shard groups are consecutive ranks: one node's processes, or the world
        assert held == expected_bytes(shard_size, shard_rank), (rank, per_rank)
        assert held <= full / shard_size + one_row_each, (rank, held, full)
    for first in range(0, WORLD, shard_size):  # every shard group holds exactly one copy of the model
        assert sum(per_rank[first : first + shard_size]) == full, per_rank


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The module's three runs, two at a time (tests/toolbox/launch.py's ``in_background``), each in its own folder,
    on its own ports and rendezvous id."""
    return in_background(
        {
            "torchrun hybrid": partial(launch_two_nodes, tmp_path_factory.mktemp("hybrid"), "HYBRID_SHARD"),
            "torchrun full": partial(launch_two_nodes, tmp_path_factory.mktemp("full"), "FULL_SHARD"),
            "slurm groups": partial(
                launch_as_slurm_tasks, tmp_path_factory.mktemp("slurm"), "HYBRID_SHARD", layout="groups"
            ),
        },
        workers=2,
    )


def test_hybrid_shard_two_nodes(launched, one_device):
    result = launched["torchrun hybrid"].result()
    check_parity(result, one_device)
    check_bytes(result, shard_size=PER_NODE)
    full = result["full_param_bytes"]
    one_row_each = sum(p[0].numel() * p.element_size() for p in _model_params())
    per_rank = result["param_bytes"]
    # ~1/2 of the model per rank (within one row per parameter either way), and replicas across nodes agree.
    assert all(abs(b - full / PER_NODE) <= one_row_each for b in per_rank), per_rank
    assert per_rank[:PER_NODE] == per_rank[PER_NODE:], per_rank


def test_full_shard_two_nodes(launched, one_device):
    result = launched["torchrun full"].result()
    check_parity(result, one_device)
    check_bytes(result, shard_size=WORLD)


def test_hybrid_shard_under_slurm_environment_with_user_groups(launched, one_device):
    # No SLURM here: the tasks get the variables srun would give them, so Lightning's SLURMEnvironment is used. The
    # groups come from the user this time: process_group=callable returning (shard_group, replicate_group).
    result = launched["slurm groups"].result()
    check_parity(result, one_device, environment="SLURMEnvironment")
    check_bytes(result, shard_size=PER_NODE)


def test_expected_bytes_follow_the_chunking_rule_by_hand():
    # ToyLM() over 4 ranks: the 7-row embedding (tied head) splits 2+2+2+1 rows, so rank 3 keeps its last row (5
    # floats); every other parameter has at most 6 rows, which chunks of ceil(rows / 4) cover before rank 3.
    assert expected_bytes(4, 3) == 5 * 4
    # Over 2 ranks rank 1 keeps floor(rows / 2) rows: emb 3, tiny 0, fc1/bias of block1 3+3, fc2 2 (x6) + bias 2,
    # frozen 2 (x5) + bias 2, block2 fc1 1 (x5) + bias 1, fc2 2 (x3) + bias 2, norm 2 + 2.
    assert expected_bytes(2, 1) == 4 * (3 * 5 + 0 + 3 * 5 + 3 + 2 * 6 + 2 + 2 * 5 + 2 + 1 * 5 + 1 + 2 * 3 + 2 + 2 + 2)
    full = sum(p.numel() * p.element_size() for p in _model_params())
    for shard_size in (1, 2, 3, 4):
        assert sum(expected_bytes(shard_size, r) for r in range(shard_size)) == full, shard_size
