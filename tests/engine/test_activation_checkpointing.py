"""Activation checkpointing composes with sharding: same losses, recomputed block forwards, fewer saved tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from lightning_fsdp.activation_checkpointing import apply_activation_checkpointing, parse_checkpointing_policy
from lightning_fsdp.demo.gpt import GPT, GPTConfig
from lightning_fsdp.demo.gpt import Block as GPTBlock
from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn


def train(rank, world_size, checkpointed, strategy):
    torch.manual_seed(0)
    model = ToyLM()
    if checkpointed:
        assert len(apply_activation_checkpointing(model, parse_checkpointing_policy({Block}))) == 2
    engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, gathers = [], []
    for step in range(3):
        x, y = batch(step, size=8)
        engine.shard_comm.stats.reset()
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        gathers.append(engine.shard_comm.stats.all_gather_calls)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    with engine.unsharded():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    alive = sum(u.full_flat.untyped_storage().nbytes() for u in engine.units)
    return torch.stack(losses), params, gathers, alive


def all_cases(rank, world_size):
    return {(ac, s): train(rank, world_size, ac, s) for ac in (False, True) for s in ("FULL_SHARD", "SHARD_GRAD_OP")}


def test_losses_and_parameters_equal_the_run_without_it():
    results = run_distributed(all_cases, 2)
    for rank_result in results:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            plain, checkpointed = rank_result[(False, strategy)], rank_result[(True, strategy)]
            torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
            for key in plain[1]:
                torch.testing.assert_close(checkpointed[1][key], plain[1][key], rtol=0, atol=0)
            # The recompute reuses the gather that backward does anyway: no extra all-gathers.
            assert checkpointed[2] == plain[2]
            assert checkpointed[3] == 0  # and every unit's full parameters are freed after the step


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _step_flops_and_saved(model):
    idx = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, idx)
        loss.backward()
    return counter.get_total_flops(), saved


def test_blocks_are_recomputed_and_their_activations_not_saved():
    plain_flops, plain_saved = _step_flops_and_saved(_gpt())
    model = _gpt()
    blocks = apply_activation_checkpointing(model, parse_checkpointing_policy({GPTBlock}))
    # Without early stopping the recompute runs each block's whole forward (with it, torch skips the block's last
    # matmul, whose output backward does not need), so the count below is exact.
    with set_checkpoint_early_stop(False):
        ac_flops, ac_saved = _step_flops_and_saved(model)
    # The extra work is exactly one more forward of each checkpointed block.
    x = torch.randn(2, 16, 32)
    with FlopCounterMode(display=False) as counter:
        for block in blocks:
            block.__class__.forward(block, x)
    assert ac_flops - plain_flops == counter.get_total_flops() > 0
    # Inner activations are not saved: only the blocks' inputs (and what lies outside them) are.
    plain_bytes = sum(t.numel() * t.element_size() for t in plain_saved)
    ac_bytes = sum(t.numel() * t.element_size() for t in ac_saved)
    assert ac_bytes < plain_bytes / 2, (ac_bytes, plain_bytes)


def test_policy_validation():
    with pytest.raises(TypeError, match="activation_checkpointing_policy='Block'"):
        parse_checkpointing_policy("Block")
    assert parse_checkpointing_policy({"torch.nn.Linear"})(nn.Linear(1, 1))
    assert parse_checkpointing_policy(lambda m: False)(nn.Linear(1, 1)) is False


class CachingModel(nn.Module):
    """A model whose forward takes ``use_cache`` as transformers' do, and records what it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(4, 4)
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        self.seen.append(use_cache)
        return self.block(x)


def test_use_cache_is_off_only_while_training_with_gradients():
    """transformers' rule: the cache is off in training with gradients (a recompute would append to it twice), and
    left as the caller gave it in evaluation and under no_grad (generate())."""
    model = CachingModel()
    assert apply_activation_checkpointing(model, parse_checkpointing_policy({Block})) == [model.block]
    x = torch.randn(2, 3, 4)
    model.train()
    model(x)  # the default (None: the config's, True for causal LMs) becomes False
    with pytest.warns(UserWarning, match="use_cache=True while training with activation checkpointing"):
        model(x, True)  # given by position, and explicitly True
    with torch.no_grad():
        model(x, use_cache=True)
    model.eval()
    model(x, use_cache=True)
    model(x)
    assert model.seen == [False, False, True, True, None]
    assert len(model._forward_pre_hooks) == 1  # one hook, on the module above the checkpointed one
    # A module whose forward takes no such argument gets no hook.
    plain = nn.Sequential(Block(4, 4))
    assert len(apply_activation_checkpointing(plain, parse_checkpointing_policy({Block}))) == 1
    assert not plain._forward_pre_hooks
