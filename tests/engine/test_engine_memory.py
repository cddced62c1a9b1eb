"""What each rank holds: shards of parameters, gradients and optimizer state, measured from the tensors themselves;
meta-device models materialised one unit at a time; rank 0's initial values broadcast with sync_module_states."""

from __future__ import annotations

import gc

import torch
from torch import nn

from lightning_fsdp.checkpoint.full import full_model_state_dict
from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held_bytes(rank, world_size, strategy):
    torch.manual_seed(0)
    model = ToyLM(dim=16)
    engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch(0, size=4)
    loss_fn(model(x[rank::world_size]), y[rank::world_size]).backward()
    optimizer.step()  # between steps: shards, their gradients and AdamW's state
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    full_buffers_alive = sum(u.full_flat.untyped_storage().nbytes() for u in engine.units)
    held = {
        "params": _bytes(model.parameters()),
        "grads": _bytes(p.grad for p in model.parameters() if p.grad is not None),
        "state": _bytes(state),
        "full_buffers_alive": full_buffers_alive,
    }
    # zero_grad(set_to_none=True) must free the gradients' memory, not only drop the tensors: nothing in the engine
    # may keep the buffer they are views of.
    handles = [p.grad.untyped_storage()._weak_ref() for p in model.parameters() if p.grad is not None]
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    held["grad_buffers_alive_after_zero_grad"] = sum(not torch.UntypedStorage._expired(h) for h in handles)
    for handle in handles:
        torch.UntypedStorage._free_weak_ref(handle)
    return held


def test_each_rank_holds_one_nth_of_params_grads_and_optimizer_state():
    reference = ToyLM(dim=16)
    unique = list(reference.parameters())
    full_params = _bytes(unique)
    full_trainable = _bytes(p for p in unique if p.requires_grad)
    row_bytes = sum(p[0].numel() * p.element_size() if p.dim() else p.element_size() for p in unique)
    for world_size in (2, 3):
        per_rank = run_distributed(held_bytes, world_size, "FULL_SHARD")
        for held in per_rank:
            # One padding row per parameter at most; nothing else beyond 1/N.
            assert abs(held["params"] - full_params / world_size) <= row_bytes, (world_size, held)
            assert abs(held["grads"] - full_trainable / world_size) <= row_bytes, (world_size, held)
            assert abs(held["state"] - 2 * full_trainable / world_size) <= 2 * row_bytes, (world_size, held)
            assert held["full_buffers_alive"] == 0  # no unit's full parameters outlive the step
            assert held["grad_buffers_alive_after_zero_grad"] == 0, held
        # The shards tile the model: together they are exactly one copy.
        assert sum(h["params"] for h in per_rank) == full_params
        assert sum(h["grads"] for h in per_rank) == full_trainable


def test_no_shard_keeps_whole_model_on_each_rank():
    held = run_distributed(held_bytes, 2, "NO_SHARD")
    full = _bytes(ToyLM(dim=16).parameters())
    assert all(h["params"] == full for h in held)


class Stack(nn.Module):
    """Four equal blocks and a head: one unit is well under half of the model."""

    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, dim)
        self.blocks = nn.ModuleList(Block(dim, 2 * dim) for _ in range(depth))
        self.head = nn.Linear(dim, 7)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def meta_init(rank, world_size):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack()
    peaks = []
    original = nn.Linear.reset_parameters

    def recording_reset(self):
        original(self)
        # Real (non-meta) parameter elements on this rank right now: shards plus whatever is materialised.
        peaks.append(sum(p.numel() for p in model.parameters() if not p.is_meta))

    nn.Linear.reset_parameters = recording_reset
    try:
        engine = fully_shard(model, auto_wrap_policy={Block})
    finally:
        nn.Linear.reset_parameters = original
    init_state = full_model_state_dict(engine, rank0_only=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = batch(step, size=4)
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return max(peaks), init_state, torch.stack(losses)


def test_meta_device_model_is_materialised_one_unit_at_a_time():
    results = run_distributed(meta_init, 2)
    stack = Stack()
    total = sum(p.numel() for p in stack.parameters())
    # The units, from the wrap policy: each Block owns its parameters, the root the embedding and the head.
    block_numel = [sum(p.numel() for p in block.parameters()) for block in stack.blocks]
    root_numel = total - sum(block_numel)
    largest_unit = max(*block_numel, root_numel)
    assert (block_numel, root_numel) == ([280] * 4, 119)  # Block(8, 16): 8x16+16 + 16x8+8; emb 7x8 + head 8x7+7
    for peak, _, _ in results:
        # Never more than the shards of everything plus one unit in full, and never the whole model.
        assert peak <= total // 2 + largest_unit + 64
        assert peak < total
    init_state = results[0][1]
    for value in init_state.values():
        assert torch.isfinite(value).all() and value.abs().sum() > 0  # initialised, not left empty
    assert all(torch.equal(init_state[k], results[1][1][k]) for k in init_state)
    # Training from the materialised values matches an unsharded model loaded with them.
    reference = Stack()
    reference.load_state_dict(init_state)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(step, size=4)
        losses = [loss_fn(reference(x[r::2]), y[r::2]) for r in range(2)]
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        for r in range(2):
            torch.testing.assert_close(results[r][2][step], losses[r].detach(), rtol=1e-5, atol=1e-6)


def sync_states(rank, world_size):
    torch.manual_seed(rank)  # every rank initialises differently
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block}, sync_module_states=True)
    return full_model_state_dict(engine, rank0_only=False)


def test_sync_module_states_broadcasts_rank0_initial_values():
    results = run_distributed(sync_states, 2)
    torch.manual_seed(0)
    rank0_model = ToyLM()
    for state in results:
        for key, value in rank0_model.state_dict().items():
            assert torch.equal(state[key], value), key


def custom_init(rank, world_size):
    with torch.device("meta"):
        model = Stack()
    calls = []

    def init(module):
        calls.append(type(module).__name__)
        for param in module.parameters(recurse=False):
            torch.nn.init.constant_(param, 0.5)

    engine = fully_shard(model, auto_wrap_policy={Block}, param_init_fn=init)
    return calls, full_model_state_dict(engine, rank0_only=False)


def test_param_init_fn_materialises_each_module():
    calls, state = run_distributed(custom_init, 2)[0]
    assert sorted(calls) == sorted(type(m).__name__ for m in Stack().modules() if list(m.parameters(recurse=False)))
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in state.values())
