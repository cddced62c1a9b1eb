"""Soak: a long 2-rank fsdp_custom Lightning run with periodic checkpoints, killed hard in the middle and resumed.

tests/scripts/soak_run.py trains ToyLM with SGD + momentum for ``STEPS`` steps (epochs of 12 steps, a fixed
per-epoch data order, a loader Lightning can resume mid-epoch), with ``ModelCheckpoint(every_n_train_steps=8,
save_top_k=-1)`` in the checkpoint format under test. Three runs:

1. reference: the whole run, uninterrupted (it saves checkpoints too, in ``REFERENCE_MODE``);
2. killed: the same run with its own checkpoint folder; at step ``KILL_AT`` (never a checkpoint step) rank 0
   SIGKILLs the job's process group, both ranks at once;
3. resumed: fresh processes, ``fit(ckpt_path=<latest checkpoint of run 2>)``, to ``STEPS``.

Run 1 and, for each format, runs 2 then 3 go at once (a module fixture; each in a folder of its own).

Checked:

- the resumed run ends with exactly (bitwise) the reference's parameters and momentum buffers, and its loss at every
  step it ran equals the reference's at that step (so it resumed at the right batch of the right epoch);
- nothing grows from step to step, on either rank: every 4 steps, after the first checkpoint save and the first
  epoch change (warm-up: imports, cached device meshes, one-off Lightning state), the live bytes of torch's CPU
  allocator (every tensor of the process, C++-only ones included), the bytes of the storages of Python-reachable
  tensors, the number of ``torch.Tensor`` objects and of hooks on the model's modules and parameters are *equal* at
  every record (the model, gradients and momentum have fixed sizes, so any growth at the same point of a step is a
  leak), and the number of gc-tracked objects grows by at most ``OBJECT_SLACK`` (beyond the soak's own records):
  one object leaked per step would exceed it (48 steps after warm-up in the default run, several hundred in the
  long one). RSS is printed, not checked (glibc keeps freed memory).

``LIGHTNING_FSDP_SOAK_STEPS`` sets the number of steps (default 64: about a minute and a half on 2 shared cores;
several hundred for a real soak), ``LIGHTNING_FSDP_SOAK_REFERENCE_MODE`` the format the reference run saves in
(default ``full``), ``LIGHTNING_FSDP_SOAK_MODES`` the formats killed and resumed (default ``sharded``; any of
``sharded,full,local``). By default the resume is from the middle of an epoch (step 32 of epochs of 12); 480 steps
resume from an epoch's end (240).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import group_members, kill_group
from tests.toolbox.launch import SCRIPTS, in_background, start_logged

SCRIPT = SCRIPTS / "soak_run.py"

STEPS = int(os.environ.get("LIGHTNING_FSDP_SOAK_STEPS", "64"))
REFERENCE_MODE = os.environ.get("LIGHTNING_FSDP_SOAK_REFERENCE_MODE", "full")
MODES = os.environ.get("LIGHTNING_FSDP_SOAK_MODES", "sharded").split(",")
CKPT_EVERY = 8
STEPS_PER_EPOCH = 12  # soak_run.STEPS_PER_EPOCH
RECORD_EVERY = 4
# Mid-run, never on a checkpoint step: 64 -> 37 (last checkpoint 32, in the middle of an epoch), 400 -> 205 (200,
# mid-epoch), 480 -> 245 (240, an epoch's end).
KILL_AT = (STEPS // 2 // CKPT_EVERY) * CKPT_EVERY + CKPT_EVERY // 2 + 1
RESUME_FROM = (KILL_AT // CKPT_EVERY) * CKPT_EVERY
OBJECT_SLACK = 16
RUN_TIMEOUT_S = 120 + STEPS * 2


def run_soak(folder: Path, name: str, *args: str, expect_kill: bool = False) -> tuple[dict, list[dict], str]:
    """Run the script in a session of its own (killed as a group whatever happens); returns rank 0's result, each
    rank's records and the output."""
    out = folder / f"{name}.pt"
    log = folder / f"{name}.log"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--record-every",
        str(RECORD_EVERY),
        "--ckpt-every",
        str(CKPT_EVERY),
        *args,
    ]
    started = time.monotonic()
    proc = start_logged(cmd, log, cwd=folder)
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
        deadline = time.monotonic() + 10
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = group_members(proc.pid)
    except subprocess.TimeoutExpired:
        left = None
    finally:
        kill_group(proc.pid)
        proc.wait()
    output = log.read_text(errors="replace")
    assert left is not None, f"{name} timed out after {RUN_TIMEOUT_S}s:\n{output[-6000:]}"
    assert left == [], f"{name} left processes behind: {left}\n{output[-3000:]}"
    print(f"\n[soak] {name}: {time.monotonic() - started:.1f}s, rc={proc.returncode}")
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, f"{name}: rc={proc.returncode}\n{output[-6000:]}"
        assert f"SOAK rank=0 killing the job at step {KILL_AT}" in output, output[-6000:]
        return {}, [], output
    assert proc.returncode == 0, f"{name}: rc={proc.returncode}\n{output[-6000:]}"
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    return torch.load(out, weights_only=False), ranks, output


def check_flat(name: str, rank_results: list[dict], warm_step: int) -> None:
    for rank, result in enumerate(rank_results):
        records = result["records"]
        steps = [s for s, _ in records]
        assert steps == list(range(steps[0], result["global_step"] + 1, RECORD_EVERY)), steps
        hooks = {r["hooks"] for _, r in records}
        assert len(hooks) == 1, f"rank {rank}: hooks changed {[(s, r['hooks']) for s, r in records]}"
        warm = next(i for i, s in enumerate(steps) if s >= warm_step)
        first, last = dict(records[warm][1]), dict(records[-1][1])
        # The soak keeps one more record per measurement: not the library's.
        objects = [r["objects"] - i for i, (_, r) in enumerate(records)]
        first["objects"], last["objects"] = objects[warm], objects[-1]
        print(
            f"[soak] {name} rank {rank}: step {steps[warm]} -> {steps[-1]}: "
            + ", ".join(f"{k} {first[k]} -> {last[k]}" for k in first)
        )
        for key in ("alloc_bytes", "tensor_bytes", "tensors"):
            values = [(s, r[key]) for s, r in records[warm:]]
            assert all(v == first[key] for _, v in values), f"rank {rank}: {key} not flat after warm-up: {values}"
        assert first["alloc_bytes"] > 0  # the allocator total was readable
        grown = max(objects[warm:]) - objects[warm]
        assert grown <= OBJECT_SLACK, f"rank {rank}: {grown} more Python objects after warm-up: {objects[warm:]}"


def _reference_run(folder: Path) -> tuple[dict, list[dict]]:
    result, ranks, _ = run_soak(
        folder, "reference", "--ckpt-dir", str(folder / "ckpt"), "--state-dict-type", REFERENCE_MODE
    )
    assert result["global_step"] == STEPS and sorted(result["losses"]) == list(range(STEPS))
    return result, ranks


def _killed_then_resumed(folder: Path, mode: str) -> tuple[list[Path], tuple[dict, list[dict], str]]:
    """Run 2, then run 3 from the latest checkpoint run 2 left: (run 2's checkpoints by step, run 3's results)."""
    ckpt = folder / "ckpt"
    run_soak(
        folder,
        "killed",
        "--ckpt-dir",
        str(ckpt),
        "--state-dict-type",
        mode,
        "--kill-at",
        str(KILL_AT),
        expect_kill=True,
    )
    saved = sorted((p for p in ckpt.iterdir() if re.fullmatch(r"step=\d+\.ckpt", p.name)), key=_step_of)
    resumed = run_soak(
        folder, "resumed", "--ckpt-dir", str(ckpt), "--state-dict-type", mode, "--resume", str(saved[-1])
    )
    return saved, resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The reference and, for each mode, the killed run and its resume, at once: each in a folder of its own."""
    jobs = {"reference": partial(_reference_run, tmp_path_factory.mktemp("soak_reference"))}
    for mode in MODES:
        jobs[mode] = partial(_killed_then_resumed, tmp_path_factory.mktemp(f"soak_{mode}"), mode)
    return in_background(jobs)


@pytest.fixture(scope="module")
def reference(runs):
    return runs["reference"].result()


def test_reference_memory_hooks_and_tensors_are_flat(reference):
    _, ranks = reference
    check_flat("reference", ranks, warm_step=max(CKPT_EVERY, STEPS_PER_EPOCH) + RECORD_EVERY)
    # Training did something: the loss of the last epoch is below the first epoch's.
    losses = reference[0]["losses"]
    first = sum(losses[s] for s in range(STEPS_PER_EPOCH)) / STEPS_PER_EPOCH
    last = sum(losses[s] for s in range(STEPS - STEPS_PER_EPOCH, STEPS)) / STEPS_PER_EPOCH
    assert last < first - 0.05, (first, last)


def _step_of(path: Path) -> int:
    return int(re.fullmatch(r"step=(\d+)\.ckpt", path.name).group(1))


@pytest.mark.parametrize("mode", MODES)
def test_killed_and_resumed_run_matches_uninterrupted(runs, reference, mode):
    ref, ref_ranks = reference
    saved, (result, ranks, output) = runs[mode].result()
    assert [_step_of(p) for p in saved] == list(range(CKPT_EVERY, KILL_AT, CKPT_EVERY)), saved
    latest = saved[-1]
    assert _step_of(latest) == RESUME_FROM
    assert latest.is_dir() == (mode != "full")

    assert "not resumable" not in output  # Lightning saw a loader it can resume mid-epoch
    assert result["global_step"] == STEPS
    # It ran exactly the steps after the checkpoint, on the same batches: every loss as in the reference, bitwise.
    for rank in range(2):
        got, want = ranks[rank]["losses"], ref_ranks[rank]["losses"]
        assert sorted(got) == list(range(RESUME_FROM, STEPS)), sorted(got)
        mismatched = [(s, got[s], want[s]) for s in got if got[s] != want[s]]
        assert not mismatched, f"rank {rank}: losses differ from the uninterrupted run: {mismatched[:5]}"
    # And ends where the uninterrupted run ends, bitwise: parameters and momentum buffers.
    assert result["params"].keys() == ref["params"].keys()
    for key, want in ref["params"].items():
        assert torch.equal(result["params"][key], want), (key, (result["params"][key] - want).abs().max())
    got_state, want_state = result["optimizer"]["state"], ref["optimizer"]["state"]
    assert got_state.keys() == want_state.keys() and len(want_state) > 0
    for index, entry in want_state.items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                assert torch.equal(got_state[index][name], value), (index, name)
            else:
                assert got_state[index][name] == value, (index, name)
    # The resumed run does not grow either, from its own warm-up on (its first save and epoch change after resume).
    next_save = RESUME_FROM + CKPT_EVERY
    next_epoch = (RESUME_FROM // STEPS_PER_EPOCH + 1) * STEPS_PER_EPOCH
    check_flat(f"resumed ({mode})", ranks, warm_step=max(next_save, next_epoch) + RECORD_EVERY)
