"""The engine's controls for pipelining and gradient accumulation (torch FSDP2's names), against one process.

``no_sync`` / ``set_requires_gradient_sync``, ``set_reshard_after_backward``, ``reshard_after_forward`` as an int
(ZeRO++ hpZ), and ``unshard`` / ``reshard``. Expected values come from a single-process ToyLM trained on the whole
global batch (rank r of N takes samples r, r+N, ..., cut into M microbatches, each loss divided by M), with SGD and
momentum, which follows a wrong gradient scale where Adam would hide it. The byte counts expected are derived here
from the model's shapes and the chunking rule (see tests/engine/test_comm_volume.py), not read from the engine.

Each worker runs all its configurations in one process group (start-up is the expensive part on two cores).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.options import ShardingOptions
from lightning_fsdp.process_groups import node_groups
from tests.toolbox.compare import assert_all_close
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn
from tests.toolbox.one_device import toy_lm_on_step_batches

STEPS = 3
MICRO = 3  # microbatches per step: two held before the last (accumulation of held gradients, then the reduction)
SIZE = 12  # global batch: 6 samples per rank on 2 ranks (2 per microbatch), 3 on 4 (1 per microbatch)
FLOAT_BYTES = 4
PARAMS = 14  # ToyLM's parameters, the tied embedding/head once (tests/engine/test_comm_volume.py counts them by hand)
TOL = {"rtol": 1e-6, "atol": 1e-7}


# ---------------------------------------------------------------------------------------------- the training
def microbatches(step: int, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(step, size=SIZE)
    return list(zip(x[rank::world_size].chunk(MICRO), y[rank::world_size].chunk(MICRO)))


def train(model, rank, world_size, *, mode="sync", engine=None, freeze_midway=False, stats=None):
    """STEPS steps of MICRO microbatches. ``mode``: "sync" reduces every microbatch, "no_sync" all but the last.
    ``freeze_midway``: block1 is frozen for the last microbatch of each step and unfrozen after the step.
    ``stats``: Communicators whose reduction bytes are recorded per microbatch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reduced = []
    for step in range(STEPS):
        parts = microbatches(step, rank, world_size)
        for micro, (x, y) in enumerate(parts):
            last = micro == len(parts) - 1
            if freeze_midway and last:
                model.block1.requires_grad_(False)
            before = _reduction_bytes(stats)
            if mode == "no_sync" and not last:
                with engine.no_sync():
                    (loss_fn(model(x), y) / MICRO).backward()
            else:
                (loss_fn(model(x), y) / MICRO).backward()
            reduced.append(_reduction_bytes(stats) - before)
        optimizer.step()
        optimizer.zero_grad()
        if freeze_midway:
            model.block1.requires_grad_(True)
    return reduced


def _reduction_bytes(comms) -> int:
    return sum(c.stats.reduce_scatter_bytes + c.stats.all_reduce_bytes for c in comms or [])


def one_device_freezing_block1_in_the_last_microbatch() -> dict[str, torch.Tensor]:
    """One process, the whole global batch per step, block1 frozen for the samples of the ranks' last microbatch
    (one backward for all microbatches but the last, one for the last)."""
    torch.manual_seed(0)
    model = ToyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, size=SIZE)
        # block1 sees the gradient of every microbatch but the last: those samples, weighted as in the step.
        # On 2 ranks the last microbatch is the last third of every rank's samples.
        last = torch.zeros(SIZE, dtype=torch.bool)
        per_rank = SIZE // 2
        for r in range(2):
            last[torch.arange(r, SIZE, 2)[per_rank - per_rank // MICRO :]] = True
        (loss_fn(model(x[~last]), y[~last]) * (~last).sum() / SIZE).backward()
        model.block1.requires_grad_(False)
        (loss_fn(model(x[last]), y[last]) * last.sum() / SIZE).backward()
        model.block1.requires_grad_(True)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def full_params(engine) -> dict[str, torch.Tensor]:
    with engine.unsharded():
        return {k: v.detach().clone() for k, v in engine.root.named_parameters()}


def _sharded(engine) -> bool:
    return not any(u.is_alive for u in engine.units)


# ------------------------------------------------------------------------------------------------- 2 ranks
def two_rank_cases(rank, world_size):
    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for mode in ("sync", "no_sync"):
            torch.manual_seed(0)
            model = ToyLM()
            engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
            reduced = train(model, rank, world_size, mode=mode, engine=engine, stats=[engine.shard_comm])
            out[(strategy, mode)] = {"params": full_params(engine), "reduced": reduced}

    # Gradients held: their size, and what an optimizer step does with them.
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (x, y), (x2, y2) = microbatches(0, rank, world_size)[:2]
    with engine.no_sync():
        loss_fn(model(x), y).backward()
    held = engine.held_grad_bytes()
    shards = [p.detach().clone() for p in model.parameters()]
    try:
        optimizer.step()
        step_error = None
    except RuntimeError as err:
        step_error = str(err)
    unchanged = all(torch.equal(a, b) for a, b in zip(shards, model.parameters()))
    loss_fn(model(x2), y2).backward()
    held_after_sync = engine.held_grad_bytes()
    optimizer.step()  # gradients reduced now: steps
    moved = not all(torch.equal(a, b) for a, b in zip(shards, model.parameters()))
    # With a closure (as Lightning steps) the check waits for the step to end: a closure whose backward syncs the
    # held gradients steps normally; one whose backward keeps them held is refused once the step is over.
    optimizer.zero_grad()
    with engine.no_sync():
        loss_fn(model(x), y).backward()

    def synced_closure():
        loss = loss_fn(model(x2), y2)
        loss.backward()
        return loss

    optimizer.step(synced_closure)
    closure_synced = engine.held_grad_bytes() == 0

    def held_closure():
        with engine.no_sync():
            loss = loss_fn(model(x2), y2)
            loss.backward()
        return loss

    optimizer.zero_grad()
    try:
        optimizer.step(held_closure)
        closure_error = None
    except RuntimeError as err:
        closure_error = str(err)
    loss_fn(model(x2), y2).backward()  # reduce what the refused step left held, so the engine ends clean
    out["held"] = {
        "bytes": held,
        "after_sync": held_after_sync,
        "step_error": step_error,
        "unchanged": unchanged,
        "moved": moved,
        "closure_synced": closure_synced,
        "closure_error": closure_error,
    }

    # A parameter frozen after its gradient was held still gets it, as in one process.
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block})
    train(model, rank, world_size, mode="no_sync", engine=engine, freeze_midway=True)
    out["freeze_midway"] = full_params(engine)

    # reshard_after_backward=False (and with no_sync), against the default.
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for keep in (False, True):
            torch.manual_seed(0)
            model = ToyLM()
            engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
            engine.set_reshard_after_backward(not keep)
            gathered, sharded_after_step = _train_counting_gathers(model, engine, rank, world_size)
            out[("reshard_after_backward", strategy, keep)] = {
                "params": full_params(engine),
                "gathered": gathered,
                "sharded_after_step": sharded_after_step,
            }

    # Explicit unshard (async) and reshard.
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block})
    gathered, sharded_after_step, waited = _train_counting_gathers(model, engine, rank, world_size, explicit=True)
    engine.unshard()
    all_unsharded = all(u.is_unsharded for u in engine.units)
    engine.reshard()
    out["explicit"] = {
        "params": full_params(engine),
        "gathered": gathered,
        "sharded_after_step": sharded_after_step,
        "waited": waited,
        "unshard_then_reshard": (all_unsharded, _sharded(engine)),
    }
    return out


def _train_counting_gathers(model, engine, rank, world_size, *, explicit=False):
    """The no_sync schedule; all-gather bytes per step; whether every unit was sharded after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gathered, sharded_after_step, waited = [], [], []
    for step in range(STEPS):
        engine.shard_comm.stats.reset()
        if explicit:
            engine.unshard(async_op=True).wait()
            waited.append(all(u.is_unsharded for u in engine.units))
        parts = microbatches(step, rank, world_size)
        for micro, (x, y) in enumerate(parts):
            if micro < len(parts) - 1:
                with engine.no_sync():
                    (loss_fn(model(x), y) / MICRO).backward()
            else:
                (loss_fn(model(x), y) / MICRO).backward()
        gathered.append(engine.shard_comm.stats.all_gather_bytes)
        optimizer.step()
        optimizer.zero_grad()
        sharded_after_step.append(_sharded(engine))
    return (gathered, sharded_after_step, waited) if explicit else (gathered, sharded_after_step)


@pytest.fixture(scope="module")
def two():
    return run_distributed(two_rank_cases, 2)


def _gather_bytes(unit: str, n: int) -> int:
    """This rank's all-gather input for one unit of ToyLM: its padded chunk of every parameter (frozen too)."""
    total = 0
    for name, param in ToyLM().named_parameters():
        owner = name.split(".")[0] if name.startswith("block") else "<root>"
        if owner == unit:
            rows = param.shape[0] if param.dim() else 1
            total += -(-rows // n) * (param[0].numel() if param.dim() else 1)
    return FLOAT_BYTES * total


def test_no_sync_accumulation_matches_syncing_every_microbatch_and_one_process(two):
    want = toy_lm_on_step_batches(STEPS, SIZE).parameters()
    compared = 0
    for rank_result in two:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            synced = rank_result[(strategy, "sync")]["params"]
            accumulated = rank_result[(strategy, "no_sync")]["params"]
            compared += assert_all_close(accumulated, synced, f"{strategy} no_sync vs sync", **TOL)
            compared += assert_all_close(accumulated, want, f"{strategy} no_sync vs one process", **TOL)
    assert compared == 2 * 3 * 2 * PARAMS


def test_no_sync_microbatches_reduce_nothing_and_the_last_reduces_once(two):
    compared = 0
    for rank_result in two:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            synced = rank_result[(strategy, "sync")]["reduced"]
            accumulated = rank_result[(strategy, "no_sync")]["reduced"]
            assert len(synced) == len(accumulated) == STEPS * MICRO
            per_microbatch = synced[0]
            assert per_microbatch > 0 and synced == [per_microbatch] * (STEPS * MICRO), strategy
            # The last microbatch reduces the accumulated sum: one reduction of the same size, the others none.
            assert accumulated == ([0] * (MICRO - 1) + [per_microbatch]) * STEPS, strategy
            compared += 1
    assert compared == 2 * 3


def test_held_gradients_are_full_size_and_an_optimizer_step_refuses_them(two):
    trainable = sum(p.numel() for p in ToyLM().parameters() if p.requires_grad)
    for rank_result in two:
        held = rank_result["held"]
        assert held["bytes"] == FLOAT_BYTES * trainable  # one full gradient per trainable parameter, on every rank
        assert held["after_sync"] == 0
        assert held["step_error"] is not None and "gradient sync off" in held["step_error"]
        assert "no_sync()" in held["step_error"] and "'block1'" in held["step_error"]
        assert held["unchanged"]  # refused before stepping
        assert held["moved"]  # and steps once the last backward reduced them
        assert held["closure_synced"]  # a closure that syncs them inside step() is fine
        assert held["closure_error"] is not None and "optimizer.step() updated parameters" in held["closure_error"]


def test_parameter_frozen_after_its_gradient_was_held_still_gets_it(two):
    want = one_device_freezing_block1_in_the_last_microbatch()
    plain = toy_lm_on_step_batches(STEPS, SIZE).parameters()
    # The schedule differs from plain training where it should: block1 misses the last microbatch's gradient.
    assert not torch.allclose(want["block1.fc1.weight"], plain["block1.fc1.weight"])
    compared = sum(assert_all_close(r["freeze_midway"], want, "freeze midway", **TOL) for r in two)
    assert compared == 2 * PARAMS


def test_reshard_after_backward_off_gathers_once_per_step_and_stays_exact(two):
    want = toy_lm_on_step_batches(STEPS, SIZE).parameters()
    root, block1, block2 = (_gather_bytes(u, 2) for u in ("<root>", "block1", "block2"))
    # Default: every microbatch gathers each unit for forward, and the blocks again for backward (FULL_SHARD), except
    # block2 once the first microbatch has recorded the order: the last unit of the forward stays gathered into its
    # backward.
    per_microbatch = {"FULL_SHARD": root + 2 * (block1 + block2), "SHARD_GRAD_OP": root + block1 + block2}
    last_kept = {"FULL_SHARD": block2, "SHARD_GRAD_OP": 0}
    compared = 0
    for rank_result in two:
        for strategy, once in per_microbatch.items():
            default = rank_result[("reshard_after_backward", strategy, False)]
            kept = rank_result[("reshard_after_backward", strategy, True)]
            later = once - last_kept[strategy]
            assert default["gathered"] == [once + (MICRO - 1) * later] + [MICRO * later] * (STEPS - 1), strategy
            # Kept after its first backward, a unit is gathered by the first microbatch only (forward, and for
            # FULL_SHARD backward), never by the next microbatches.
            assert kept["gathered"] == [once] + [later] * (STEPS - 1), strategy
            assert kept["sharded_after_step"] == [True] * STEPS  # the optimizer step freed them
            compared += assert_all_close(
                kept["params"], default["params"], f"{strategy} kept vs default", rtol=0, atol=0
            )
            compared += assert_all_close(kept["params"], want, f"{strategy} kept vs one process", **TOL)
    assert compared == 2 * 2 * 2 * PARAMS


def test_explicit_unshard_holds_the_units_until_the_optimizer_step(two):
    want = toy_lm_on_step_batches(STEPS, SIZE).parameters()
    units = sum(_gather_bytes(u, 2) for u in ("<root>", "block1", "block2"))
    compared = 0
    for rank_result in two:
        explicit = rank_result["explicit"]
        assert explicit["gathered"] == [units] * STEPS  # the explicit unshard's gathers, nothing else
        assert explicit["sharded_after_step"] == [True] * STEPS
        assert explicit["waited"] == [True] * STEPS  # the handle's wait() completed every unit's gather
        assert explicit["unshard_then_reshard"] == (True, True)
        compared += assert_all_close(explicit["params"], want, "explicit unshard", **TOL)
    assert compared == 2 * PARAMS


# ------------------------------------------------------------------------------------------------- 4 ranks
def four_rank_cases(rank, world_size):
    out = {}
    # HYBRID_SHARD: shard over 2 ranks, replicate over 2.
    shard, replicate = node_groups(world_size, 2, rank)
    for mode in ("sync", "no_sync"):
        torch.manual_seed(0)
        model = ToyLM()
        engine = fully_shard(
            model,
            sharding_strategy="HYBRID_SHARD",
            auto_wrap_policy={Block},
            process_group=shard,
            replicate_group=replicate,
        )
        reduced = train(
            model, rank, world_size, mode=mode, engine=engine, stats=[engine.shard_comm, engine.replicate_comm]
        )
        out[("HYBRID_SHARD", mode)] = {"params": full_params(engine), "reduced": reduced}

    # A bad reshard_after_forward raises on every rank before any collective (sync_module_states broadcasts first,
    # an int creates groups first).
    calls = []
    real = {name: getattr(dist, name) for name in ("broadcast", "new_group", "all_gather_object")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: (calls.append(_name), _fn(*a, **k))[1])
    errors = {}
    try:
        for bad in (3, 4, 8):
            try:
                fully_shard(ToyLM(), auto_wrap_policy={Block}, sync_module_states=True, reshard_after_forward=bad)
            except ValueError as err:
                errors[bad] = str(err)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    out["invalid"] = (errors, calls)

    # reshard_after_forward=2 (hpZ over 4 ranks) against True, given to fully_shard or set afterwards.
    for how in ("True", "2", "set 2"):
        torch.manual_seed(0)
        model = ToyLM()
        engine = fully_shard(model, auto_wrap_policy={Block}, reshard_after_forward=2 if how == "2" else True)
        if how == "set 2":
            engine.set_reshard_after_forward(2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        comms = [engine.shard_comm] + ([engine.secondary_comm] if engine.secondary_comm is not None else [])
        phases = []
        for step in range(STEPS):
            x, y = batch(step, size=SIZE)
            for comm in comms:
                comm.stats.reset()
            loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
            forward = [c.stats.all_gather_bytes for c in comms]
            secondary = sum(u.secondary_numel() for u in engine.units)
            for comm in comms:
                comm.stats.reset()
            loss.backward()
            backward = [c.stats.all_gather_bytes for c in comms]
            phases.append((forward, backward, secondary, sum(u.secondary_numel() for u in engine.units)))
            optimizer.step()
            optimizer.zero_grad()
        secondary_size = engine.secondary_comm.world_size if engine.secondary_comm is not None else None
        out[("hpz", how)] = {"params": full_params(engine), "phases": phases, "group": secondary_size}

    # A forward whose backward never comes leaves secondary shards; the optimizer step after it makes them stale,
    # and the next forward must not use them.
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block}, reshard_after_forward=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    left, used_up = [], []
    for step in range(STEPS):
        x, y = batch(step, size=SIZE)
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        engine.units[1].unshard()  # by hand, before backward does: from the secondary shard, which it uses up
        used_up.append(engine.units[1].secondary_numel())
        loss.backward()
        model(x[rank::world_size])  # its backward never comes
        left.append(sum(u.secondary_numel() for u in engine.units) > 0)
        optimizer.step()
        optimizer.zero_grad()
    out[("hpz", "stale")] = {"params": full_params(engine), "left": left, "used_up": used_up}
    return out


@pytest.fixture(scope="module")
def four():
    return run_distributed(four_rank_cases, 4)


def test_no_sync_with_hybrid_sharding(four):
    want = toy_lm_on_step_batches(STEPS, SIZE).parameters()
    compared = 0
    for rank_result in four:
        synced = rank_result[("HYBRID_SHARD", "sync")]
        accumulated = rank_result[("HYBRID_SHARD", "no_sync")]
        compared += assert_all_close(accumulated["params"], synced["params"], "hybrid no_sync vs sync", **TOL)
        compared += assert_all_close(accumulated["params"], want, "hybrid no_sync vs one process", **TOL)
        # Neither the shard group's reduce-scatter nor the replicas' all-reduce runs before the last microbatch.
        per_microbatch = synced["reduced"][0]
        assert per_microbatch > 0
        assert accumulated["reduced"] == ([0] * (MICRO - 1) + [per_microbatch]) * STEPS
    assert compared == 4 * 2 * PARAMS


def test_reshard_after_forward_int_gathers_backward_within_the_subgroup(four):
    want = toy_lm_on_step_batches(STEPS, SIZE).parameters()  # one backward per step on 4 ranks: the same global batch
    root, block1, block2 = (_gather_bytes(u, 4) for u in ("<root>", "block1", "block2"))
    blocks = block1 + block2
    k = 4 // 2  # shard-group chunks per parameter each rank keeps after forward (1/2 of each block)
    compared = 0
    for rank_result in four:
        baseline = rank_result[("hpz", "True")]
        assert baseline["group"] is None
        # From the second step on, block2 (the last unit of the forward) stays gathered into its backward.
        regathered = [blocks] + [block1] * (STEPS - 1)
        assert baseline["phases"] == [([root + blocks], [b], 0, 0) for b in regathered]
        for how in ("2", "set 2"):
            hpz = rank_result[("hpz", how)]
            assert hpz["group"] == 2
            for (forward, backward, secondary, left), again in zip(hpz["phases"], regathered, strict=True):
                # Forward gathers over the shard group; backward only over this rank's 2-rank subgroup, each rank
                # sending its k chunks of every block parameter (half as many ranks, twice the bytes each).
                assert forward == [root + blocks, 0], how
                assert backward == [0, k * again], how
                assert FLOAT_BYTES * secondary == k * again  # 1/2 of each block kept between forward and backward
                assert left == 0  # and used up by backward's unshard
            compared += assert_all_close(hpz["params"], baseline["params"], f"hpz {how} vs True", rtol=0, atol=0)
            compared += assert_all_close(hpz["params"], want, f"hpz {how} vs one process", **TOL)
        stale = rank_result[("hpz", "stale")]
        assert stale["left"] == [True] * STEPS  # the unused forward did leave secondary shards before each step
        assert stale["used_up"] == [0] * STEPS
        compared += assert_all_close(stale["params"], want, "hpz forward without backward, then a step", **TOL)
    assert compared == 4 * (2 * 2 + 1) * PARAMS


def test_bad_reshard_after_forward_raises_on_every_rank_before_any_collective(four):
    for errors, calls in (r["invalid"] for r in four):
        assert sorted(errors) == [3, 4, 8]
        for bad, message in errors.items():
            assert f"reshard_after_forward={bad}" in message and "valid ints: 2" in message
        assert calls == []


# ------------------------------------------------------------------------------------------- one process
def test_reshard_after_forward_values_are_checked():
    for good in (None, True, False, 2, 16):
        assert ShardingOptions.parse(reshard_after_forward=good).reshard_after_forward == good
    for bad in (1, 0, -2):
        with pytest.raises(ValueError, match=rf"reshard_after_forward={bad} is not valid.*1 < N"):
            ShardingOptions.parse(reshard_after_forward=bad)
    for bad in (1.5, "2", "yes"):
        with pytest.raises(TypeError, match=r"expected True, False, None .* or an int N"):
            ShardingOptions.parse(reshard_after_forward=bad)
    # One process: a shard group of 1 rank has no smaller group.
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 is not valid for a shard group of 1.*none"):
        fully_shard(ToyLM(), auto_wrap_policy={Block}, reshard_after_forward=2)
    engine = fully_shard(ToyLM(), auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP")
    assert [u.reshard_after_forward for u in engine.units] == [False] * 3  # the strategy's default
    engine.set_reshard_after_forward(True)
    assert [u.reshard_after_forward for u in engine.units] == [True] * 3
    engine.set_reshard_after_forward(None)
    assert [u.reshard_after_forward for u in engine.units] == [False] * 3
    with pytest.raises(ValueError, match="valid ints: none"):
        engine.set_reshard_after_forward(2)
    with pytest.raises(TypeError, match="flag=1 is not valid"):
        engine.set_reshard_after_backward(1)
    with pytest.raises(TypeError, match="requires='no' is not valid"):
        engine.set_requires_gradient_sync("no")


def test_no_sync_restores_each_units_previous_value():
    engine = fully_shard(ToyLM(), auto_wrap_policy={Block})
    engine.units[1].requires_gradient_sync = False
    with pytest.raises(KeyError):
        with engine.no_sync():
            assert [u.requires_gradient_sync for u in engine.units] == [False] * 3
            raise KeyError("inside")
    assert [u.requires_gradient_sync for u in engine.units] == [True, False, True]


def test_every_rank_creates_every_subgroup_in_the_same_order(monkeypatch):
    # 8 ranks as 2 shard groups of 4 (hybrid sharding), seen from rank 5: subgroups of 2 consecutive ranks.
    from lightning_fsdp.engine.comm import Communicator
    from lightning_fsdp.engine.groups import consecutive_subgroup

    created = []
    comm = Communicator()
    comm.group, comm.world_size = "shard", 4
    monkeypatch.setattr(dist, "get_global_rank", lambda group, i: 4 + i)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(
        dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [(0, 1, 2, 3)] * 4 + [obj] * 4)
    )
    monkeypatch.setattr(dist, "new_group", lambda ranks: created.append(ranks) or f"group {ranks}")
    assert consecutive_subgroup(comm, 2) == "group [4, 5]"
    assert created == [[0, 1], [2, 3], [4, 5], [6, 7]]
