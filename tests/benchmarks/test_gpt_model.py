"""Single-process tests of the workload model (lightning_fsdp.demo.gpt) and its data (lightning_fsdp.demo.data)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_fsdp.demo.data import CharDataModule, default_text_path
from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=24)


def _materialise(model: GPT) -> GPT:
    """What a strategy does with a meta-device model: allocate, then let each module initialise itself."""
    model.to_empty(device="cpu")
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    return model


def test_forward_shapes_and_loss():
    model = GPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, CONFIG.vocab_size)
    assert loss is None
    logits, loss = model(idx, idx)
    assert loss.shape == ()
    # A fresh model predicts nearly uniformly: loss close to log(vocab_size).
    assert abs(loss.item() - torch.log(torch.tensor(CONFIG.vocab_size)).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_sequence_longer_than_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        GPT(CONFIG)(torch.zeros(1, CONFIG.block_size + 1, dtype=torch.long))


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=5, n_embd=24)


def test_causal():
    # Changing a later token must not change earlier logits.
    model = GPT(CONFIG).eval()
    idx = torch.randint(0, CONFIG.vocab_size, (1, 8))
    other = idx.clone()
    other[0, 5] = (other[0, 5] + 1) % CONFIG.vocab_size
    torch.testing.assert_close(model(idx)[0][:, :5], model(other)[0][:, :5])


def test_tied_weights_are_one_parameter():
    model = GPT(CONFIG)
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    untied = GPT(dataclasses.replace(CONFIG, tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_num_parameters_formula(bias, tie):
    # The formula in the module docstring.
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=3, n_head=4, n_embd=32, bias=bias, tie_weights=tie)
    V, T, d, L = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    per_block = 12 * d * d + (13 * d if bias else 2 * d)
    expected = V * d + T * d + L * per_block + (2 * d if bias else d) + (0 if tie else V * d)
    assert GPT(cfg).num_parameters() == expected
    assert sum(p.numel() for p in Block(cfg).parameters()) == per_block


def test_every_parameter_owner_can_reset_itself():
    model = GPT(CONFIG)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert callable(getattr(module, "reset_parameters", None)), type(module)


def test_init_statistics():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    # Residual projections are scaled by 1/sqrt(2 * n_layer).
    assert abs(model.blocks[0].attn.c_proj.weight.std().item() - 0.02 / 8**0.5) < 0.001
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)


@pytest.mark.parametrize("tie", [True, False])
def test_meta_materialisation_matches_normal_init(tie):
    cfg = dataclasses.replace(CONFIG, tie_weights=tie)
    torch.manual_seed(1234)
    reference = GPT(cfg)

    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(1234)
    _materialise(model)

    assert (model.lm_head.weight is model.wte.weight) == tie
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ref_state, state = reference.state_dict(), model.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=0, atol=0, msg=name)
    # And the materialised model trains through the tie: one gradient for the shared weight.
    _, loss = model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    loss.backward()
    assert model.wte.weight.grad is not None


# ---------------------------------------------------------------------------------------------- data


def test_bundled_text_and_vocab():
    assert default_text_path().is_file()
    dm = CharDataModule()
    text = default_text_path().read_text(encoding="utf-8")
    assert dm.chars == sorted(set(text))
    assert dm.vocab_size == len(dm.chars)
    assert dm.decode(dm.encode("To be, or not")) == "To be, or not"
    assert len(dm.train_data) + len(dm.val_data) == len(text)
    assert len(dm.train_data) == int(0.9 * len(text))


def test_small_text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcabcabd" * 10, encoding="utf-8")
    dm = CharDataModule(path, block_size=4, batch_size=2, train_samples=6, val_samples=2)
    assert dm.chars == ["a", "b", "c", "d"]
    x, y = dm.train_dataset()[0]
    assert x.shape == y.shape == (4,) and x.dtype == torch.long
    torch.testing.assert_close(x[1:], y[:-1])


def test_batches_are_deterministic():
    def batches(seed):
        dm = CharDataModule(block_size=32, batch_size=4, train_samples=40, val_samples=8, seed=seed)
        return list(dm.train_dataloader()), list(dm.val_dataloader())

    (train_a, val_a), (train_b, val_b), (train_c, _) = batches(0), batches(0), batches(1)
    assert len(train_a) == 10 and len(val_a) == 2
    for (xa, ya), (xb, yb) in zip(train_a + val_a, train_b + val_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(train_a[0][0], train_c[0][0])
    x, y = train_a[0]
    assert x.shape == y.shape == (4, 32)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_test_and_predict_loaders():
    dm = CharDataModule(block_size=8, batch_size=4, val_samples=8)
    test_batches = list(dm.test_dataloader())
    predict_batches = list(dm.predict_dataloader())
    assert len(test_batches) == len(predict_batches) == 2
    # predict yields the test inputs, without targets
    for (x, _), p in zip(test_batches, predict_batches):
        assert isinstance(p, torch.Tensor) and torch.equal(x, p)
