"""Lightning user patterns under fsdp_custom (issue 12): 2 ranks must end where one device ends, or refuse up front.

Every pattern (tests/scripts/patterns_run.py: BackboneFinetuning, add_param_group, a GAN with toggle_optimizer,
manual optimization, several forwards per backward, no-grad forwards in another order under every prefetch option,
LoRA, requires_grad flipped mid-training, the model used after fit, the model called from callbacks and hooks outside
the steps, between accumulation steps, by rank 0 alone inside ``engine.unsharded()`` and through transformers'
``generate()``) runs as a user's script runs it, on 2 ranks and
on one device, on the same global batches (rank r takes samples r, r+N, ...). Both sides run all their patterns in
one launch each, the two sides at once, cached for the module; each test compares one pattern: final weights (every
state entry, fp32, rtol 1e-5, atol 1e-6), per-step losses and the pattern's own probes, snapshots and flags. A
pattern may instead be refused: an error on every rank before the first optimizer step, whose message names it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import kill_group
from tests.scripts.patterns_run import CLIP, OPTIONS, PATTERNS
from tests.toolbox.launch import SCRIPTS, in_background, start_logged

SCRIPT = SCRIPTS / "patterns_run.py"
RTOL, ATOL = 1e-5, 1e-6
LAUNCH_TIMEOUT_S = 400  # one launch of the script (its own watchdog stops a hung pattern after 90 s)
SIDE_BUDGET_S = 500  # all launches of one side, reruns after a hung pattern included
EXIT = "<exit>"  # run_side's entry for how its last launch ended

# A refusal must name the pattern: one of these words (case-insensitive) in the error message.
REFUSAL_WORDS = {
    "backbone_finetuning": ("BackboneFinetuning", "requires_grad"),
    "add_param_group": ("add_param_group",),
    "gan_toggle": ("toggle_optimizer", "requires_grad"),
    "lora": ("requires_grad",),
    "flip_requires_grad": ("requires_grad",),
    "frozen_from_start": ("requires_grad",),
}


# ------------------------------------------------------------------------------------------------ running
def _launch(devices: int, names: list[str], out: Path, timeout: float) -> tuple[int | None, str]:
    log_path = out.with_suffix(".log")
    argv = [sys.executable, SCRIPT, "--devices", str(devices), "--out", out, "--patterns", ",".join(names)]
    proc = start_logged(argv, log_path, cwd=out.parent)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc.pid)  # the rank it started, if still there
        proc.wait()
    return rc, log_path.read_text(errors="replace")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False) if path.exists() else {}


def run_side(devices: int, folder: Path) -> dict:
    """{pattern: {"ranks": {rank: result}} | {"crash": text}} for one side, rerunning the patterns after one that
    killed its launch (a hang stopped by the watchdog, or a crash)."""
    names = list(PATTERNS) if devices > 1 else list(dict.fromkeys(n.partition("@")[0] for n in PATTERNS))
    results: dict = {}
    deadline = time.monotonic() + SIDE_BUDGET_S
    attempt = 0
    while names:
        left = deadline - time.monotonic()
        if left <= 0:
            for name in names:
                results[name] = {"crash": f"not run: the {SIDE_BUDGET_S} s budget of this side was spent"}
            break
        out = folder / f"side{devices}-{attempt}.pt"
        attempt += 1
        rc, log = _launch(devices, names, out, min(LAUNCH_TIMEOUT_S, left))
        ranks = {r: _load(Path(f"{out}.rank{r}")) for r in range(devices)}
        done = [n for n in names if n in ranks[0]]
        for name in done:
            results[name] = {"ranks": {r: got[name] for r, got in ranks.items() if name in got}}
        rest = [n for n in names if n not in ranks[0]]
        if not rest:
            # Every pattern finished; how the launch then ended is checked on its own (test_launches_end_cleanly).
            results[EXIT] = {"rc": rc, "log": log[-3000:]}
            break
        what = "timed out" if rc is None else f"ended with exit code {rc}"
        results[rest[0]] = {
            "crash": f"the {devices}-process launch {what} in this pattern (a hang stopped by the "
            f"watchdog prints every thread's stack); log tail:\n{log[-6000:]}"
        }
        names = rest[1:]
    return results


_sides: dict = {}


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    if not _sides:
        # The sides are independent (their own files): both run at once, one process next to two.
        folder = tmp_path_factory.mktemp("patterns")
        running = in_background(
            {"ref": functools.partial(run_side, 1, folder), "fsdp": functools.partial(run_side, 2, folder)}
        )
        _sides.update({side: future.result() for side, future in running.items()})
    return _sides


# ------------------------------------------------------------------------------------------------ comparing
def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).abs()
    return float((diff / ref.double().abs().clamp_min(ATOL)).max()) if diff.numel() else 0.0


def compare_states(got: dict, ref: dict, what: str) -> tuple[int, list[str]]:
    """(tensors compared, problems)."""
    problems = []
    if got.keys() != ref.keys():
        problems.append(
            f"{what}: entries differ: only 2-rank {sorted(got.keys() - ref.keys())}, only one-device "
            f"{sorted(ref.keys() - got.keys())}"
        )
    compared = 0
    worst = (0.0, None)
    for key in sorted(ref.keys() & got.keys()):
        g, r = got[key], ref[key]
        if not isinstance(r, torch.Tensor):
            continue
        compared += 1
        if g.shape != r.shape:
            problems.append(f"{what}[{key}]: shape {tuple(g.shape)} != {tuple(r.shape)}")
            continue
        if not torch.allclose(g.double(), r.double(), rtol=RTOL, atol=ATOL):
            rel = _max_rel(g, r)
            worst = max(worst, (rel, key), key=lambda t: t[0])
            problems.append(
                f"{what}[{key}]: max relative difference {rel:.3g}, max abs "
                f"{float((g.double() - r.double()).abs().max()):.3g}"
            )
    if worst[1] is not None:
        problems.insert(0, f"{what}: worst max relative difference {worst[0]:.3g} ({worst[1]})")
    tensors = sum(isinstance(v, torch.Tensor) for v in ref.values())
    assert compared == tensors == len(ref) > 0, (what, compared, tensors, len(ref))
    return compared, problems


def compare_series(got, ref, what: str) -> list[str]:
    got_t, ref_t = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    if got_t.shape != ref_t.shape:
        return [f"{what}: {tuple(got_t.shape)} values on 2 ranks, {tuple(ref_t.shape)} on one device"]
    if not torch.allclose(got_t, ref_t, rtol=RTOL, atol=ATOL):
        bad = (~torch.isclose(got_t, ref_t, rtol=RTOL, atol=ATOL)).nonzero()
        return [
            f"{what}: max relative difference {_max_rel(got_t, ref_t):.3g}, first mismatch at index "
            f"{bad[0].tolist()} ({len(bad)} of {got_t.numel()} values differ)"
        ]
    return []


def _error_text(rank: int, error: dict) -> str:
    return (
        f"rank {rank} raised {error['type']} after {error['steps']} optimizer step(s): {error['message']}\n"
        f"{error['traceback']}"
    )


def _refused_up_front(name: str, ranks: dict, devices: int) -> bool:
    words = REFUSAL_WORDS.get(name.partition("@")[0], ())
    errors = [r.get("error") for r in ranks.values()]
    return (
        len(errors) == devices
        and all(e is not None for e in errors)
        and all(e["steps"] == 0 for e in errors)
        and all(any(w.lower() in e["message"].lower() for w in words) for e in errors)
    )


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_matches_one_device(sides, name):
    ref_entry = sides["ref"][name.partition("@")[0]]
    assert "crash" not in ref_entry, f"the one-device reference died: {ref_entry['crash']}"
    ref = ref_entry["ranks"][0]
    if "error" in ref:
        pytest.fail("the one-device reference failed (a defect of the test):\n" + _error_text(0, ref["error"]))
    entry = sides["fsdp"][name]
    if "crash" in entry:
        pytest.fail(f"{name}: {entry['crash']}")
    ranks = entry["ranks"]
    errors = {r: res["error"] for r, res in ranks.items() if "error" in res}
    if errors:
        if _refused_up_front(name, ranks, 2):
            return
        pytest.fail(
            f"{name} failed on 2 ranks (not a refusal before the first step naming the pattern):\n"
            + "\n".join(_error_text(r, e) for r, e in errors.items())
        )
    assert set(ranks) == {0, 1}, f"{name}: results from ranks {sorted(ranks)} only"
    got = ranks[0]
    problems = []
    if got["steps"] != ref["steps"]:
        problems.append(f"optimizer steps: {got['steps']} on 2 ranks, {ref['steps']} on one device")
    count, state_problems = compare_states(got["state"], ref["state"], "final weights")
    problems += state_problems
    assert count == len(ref["state"]) > 0
    assert len(ref["losses"]) > 0
    problems += compare_series(got["losses"], ref["losses"], "per-step losses")
    assert got.get("values", {}).keys() == ref.get("values", {}).keys()
    for key, value in ref.get("values", {}).items():
        problems += compare_series(got["values"][key], value, key)
    assert got.get("snapshots", {}).keys() == ref.get("snapshots", {}).keys()
    for key, state in ref.get("snapshots", {}).items():
        problems += compare_states(got["snapshots"][key], state, f"snapshot {key}")[1]
    if got.get("flags") != ref.get("flags"):
        wrong = {k: v for k, v in (got.get("flags") or {}).items() if (ref.get("flags") or {}).get(k) != v}
        problems.append(f"flags differ from the one-device run's (True there): {wrong or got.get('flags')}")
    assert not problems, f"{name}: 2 ranks differ from one device:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------- the reference's own guards
def _changed(before: dict, after: dict, prefix: str) -> bool:
    keys = [k for k in before if k.startswith(prefix)]
    assert keys, prefix
    return any(not torch.equal(before[k], after[k]) for k in keys)


def test_reference_exercises_the_patterns(sides):
    """Guards the comparison against patterns that test nothing: on one device each does what it claims."""
    ref = {name: entry["ranks"][0] for name, entry in sides["ref"].items() if name != EXIT}
    for name, result in ref.items():
        assert "error" not in result, (name, result.get("error"))
        losses = torch.as_tensor(result["losses"], dtype=torch.float64)
        assert losses.numel() > 1 and losses.std() > 0, name  # training moved the model
        assert all((result.get("flags") or {}).values()), (name, result.get("flags"))
    # Gradient clipping is active: the norm before clipping is above the clip value at every step.
    assert min(ref["manual_clip"]["ref_only"]["norms"]) > CLIP
    # The critic's weight clipping clipped something (after its steps, inside training_step).
    assert ref["gan_weight_clip"]["ref_only"]["clipped_values"] > 0
    # Frozen means no update; unfrozen means training.
    flip = ref["flip_requires_grad"]
    assert not _changed(flip["snapshots"]["epoch0_end"], flip["snapshots"]["epoch1_end"], "net.blocks.0.")
    assert _changed(flip["snapshots"]["epoch1_end"], flip["state"], "net.blocks.0.")
    start = ref["frozen_from_start"]
    assert not _changed(start["ref_only"]["initial"], start["snapshots"]["epoch0_end"], "net.blocks.0.")
    assert _changed(start["snapshots"]["epoch0_end"], start["state"], "net.blocks.0.")
    # Parameters frozen before fit and unfrozen later were trained; LoRA's base weights never were.
    for name, prefix in (("backbone_finetuning", "backbone."), ("add_param_group", "net.blocks.1.")):
        assert _changed(ref[name]["ref_only"]["initial"], ref[name]["state"], prefix), name
    lora, initial = ref["lora"]["state"], ref["lora"]["ref_only"]["initial"]
    base = [k for k in lora if ".base." in k]
    assert base and all(torch.equal(lora[k], initial[k]) for k in base)
    assert _changed(initial, lora, "net.blocks.0.fc1.lora_a")
    # The model after fit: the second Trainer trained it further; rank 0's forward gives one output per sample.
    second = ref["second_trainer"]
    assert _changed(second["snapshots"]["after_first_fit"], second["state"], "net.")
    assert ref["rank0_inference"]["values"]["inference"].shape[0] == 24
    # Calls from outside the steps: every call site gave its output (fit start 1, batch ends 8, two epoch ends 5
    # each, two validation epoch ends; two per accumulation window; rank 0's three calls per epoch; two generated
    # sequences of 3 + 4 tokens per epoch).
    assert len(ref["calls_from_callbacks"]["values"]["probes"]) == 1 + 8 + 2 * 5 + 2
    for name in ("calls_between_accumulation", "calls_between_held_accumulation"):
        assert len(ref[name]["values"]["probes"]) == 2 * 2 * 2, name
    assert len(ref["rank0_in_full_weights"]["values"]["probes"]) == 2 * 3
    assert len(ref["hf_generate"]["values"]["probes"]) == 2 * 2 * (3 + 4)
    # The Llama with activation checkpointing: 8 steps of 2 decoder layers, and generate() (its cache on) still works.
    checkpointed = ref["hf_activation_checkpointing"]
    assert checkpointed["training_mlp_calls"] == 8 * 2 and checkpointed["steps"] == 8
    assert len(checkpointed["values"]["probes"]) == 2 * 2 * (3 + 4)
    assert set(OPTIONS) >= {
        "default",
        "forward_prefetch",
        "backward_post",
        "no_backward_prefetch",
        "no_limit_all_gathers",
    }


def test_hf_activation_checkpointing_recomputes_each_layer(sides):
    """The 2-rank Llama run ran each decoder layer twice per step on every rank (forward and recompute: the policy was
    applied) where the one-device run ran it once; test_pattern_matches_one_device compares their weights."""
    ref = sides["ref"]["hf_activation_checkpointing"]["ranks"][0]
    entry = sides["fsdp"]["hf_activation_checkpointing"]
    assert "crash" not in entry, entry.get("crash")
    ranks = entry["ranks"]
    assert set(ranks) == {0, 1} and all("error" not in r for r in ranks.values()), ranks
    assert [r["training_mlp_calls"] for r in ranks.values()] == [2 * ref["training_mlp_calls"]] * 2


def test_launches_end_cleanly(sides):
    """After the last pattern both launches end with exit code 0 (barrier, then the shutdown helpers' destroy)."""
    for side, results in sides.items():
        if EXIT in results:  # absent when a pattern killed the last launch: that pattern's test fails instead
            assert results[EXIT]["rc"] == 0, (side, results[EXIT])


def test_refusal_rule():
    """A refusal counts only on every rank, before the first optimizer step, with a message naming the pattern."""

    def ranks(*errors):
        return {
            r: {"error": {"type": "ValueError", "message": m, "steps": s, "traceback": ""}} if m else {"ok": True}
            for r, (m, s) in enumerate(errors)
        }

    named = "BackboneFinetuning changes requires_grad after sharding: not supported"
    assert _refused_up_front("backbone_finetuning", ranks((named, 0), (named, 0)), 2)
    assert not _refused_up_front("backbone_finetuning", ranks((named, 1), (named, 1)), 2)  # after a step
    assert not _refused_up_front("backbone_finetuning", ranks((named, 0), (None, 0)), 2)  # one rank only
    assert not _refused_up_front("backbone_finetuning", ranks(("shapes differ", 0), ("shapes differ", 0)), 2)
    assert not _refused_up_front("siamese@default", ranks((named, 0), (named, 0)), 2)  # must work, not refuse
