"""Meta-device initialisation (issue 22, item 3): parameters on the meta device, buffers computed for real, and
every tensor left uninitialised refused, named, at the first forward or optimizer step.

The engine-level cases run in this process (``fully_shard`` without a process group: one rank). The Lightning cases
run tests/scripts/meta_init_run.py once on 2 CPU ranks (every case in one launch): docs/pretrained.md's
walk-through as written, a tiny transformers Llama saved with ``save_pretrained`` and loaded with no
``param_init_fn`` and with one that ignores buffers, compared with ``LlamaForCausalLM.from_pretrained`` in this
process, and a parameter nothing initialises, refused on every rank before any step.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.meta_init import (
    UninitialisedTensorError,
    mark_initialised,
    parameters_on_meta,
    uninitialised_names,
)
from lightning_fsdp.pretrained import load_pretrained
from tests.toolbox.launch import rank_outputs, run_script


# ------------------------------------------------------------------------------------------------ engine level
class Scale(nn.Module):
    """A parameter and no ``reset_parameters``: nothing initialises it when built on the meta device."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Rotary(nn.Module):
    """A buffer its constructor computes and no state dict holds (``persistent=False``), as a rotary embedding's."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inv_freq.repeat(2)


class RotaryScaleNet(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.rotary = Rotary(dim)
        self.scale = Scale(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.scale(self.rotary(self.inp(x))))


def test_parameters_on_meta_keeps_buffers_real_and_ties():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM(config)
    reference = transformers.LlamaForCausalLM(config)
    params = list(model.named_parameters())
    assert len(params) == len(list(reference.named_parameters())) > 0
    assert all(p.is_meta for _n, p in params)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie made in the constructor holds
    buffers, expected = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == expected.keys() and "model.rotary_emb.inv_freq" in buffers
    for name, value in expected.items():
        assert not buffers[name].is_meta and torch.equal(buffers[name], value), name
    # The patch is undone on leaving, also when the body raised.
    with pytest.raises(KeyError), parameters_on_meta():
        raise KeyError
    assert not nn.Linear(2, 2).weight.is_meta
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    frozen.no_decay = True
    holder = nn.Module()
    with parameters_on_meta():
        holder.p = frozen
    assert holder.p.is_meta and not holder.p.requires_grad and holder.p.no_decay


def _values(dim: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: torch.randn_like(v) for k, v in RotaryScaleNet(dim).state_dict().items()}


def test_parameter_nothing_initialises_is_refused_until_loaded(tmp_path):
    with parameters_on_meta():
        model = RotaryScaleNet()
    engine = fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The Linears initialised themselves (reset_parameters); Scale could not; the rotary buffer was computed.
    assert uninitialised_names(model) == ["scale.weight"]
    assert uninitialised_names(model.scale) == ["scale.weight"] and uninitialised_names(model.inp) == []
    x = torch.randn(3, 4)
    with pytest.raises(UninitialisedTensorError, match=r"'scale\.weight' \(parameter of Scale\).*load_pretrained"):
        model(x)
    with pytest.raises(UninitialisedTensorError, match=r"forward of Scale \('scale'\).*'scale\.weight'"):
        model.scale(x)  # a submodule called on its own
    assert model.inp(x).shape == (3, 4)  # one that holds no uninitialised tensor computes
    with pytest.raises(UninitialisedTensorError, match=r"optimizer\.step\(\) of SGD.*'scale\.weight'"):
        optimizer.step()
    other = nn.Parameter(torch.ones(2))
    torch.optim.SGD([other], lr=0.1).step()  # an optimizer over another model steps
    assert engine.training_state.name == "IDLE"  # the refused forwards left no unit open

    values = _values()
    save_file(values, tmp_path / "net.safetensors")
    load_pretrained(model, tmp_path / "net.safetensors")
    assert uninitialised_names(model) == []
    reference = RotaryScaleNet()
    reference.load_state_dict(values)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    optimizer.step()


def test_a_loaded_checkpoint_initialises_what_it_fills():
    """Resuming (``fit(ckpt_path=...)``) loads the model state through the checkpoint routing: what it filled is
    no longer recorded, and the model computes the checkpoint's values."""
    from lightning_fsdp.checkpoint import routing
    from lightning_fsdp.options import PipelineOptions
    from lightning_fsdp.pipeline.role import PipelineRole

    with parameters_on_meta():
        model = RotaryScaleNet()
    engine = fully_shard(model)
    assert uninitialised_names(model) == ["scale.weight"]
    values = _values()
    no_pipeline = PipelineRole(PipelineOptions.parse(1, "1F1B", None, None, None, "model"))
    routing.load_model_state(engine, {"state_dict": values}, strict=True, role=no_pipeline)
    assert uninitialised_names(model) == []
    reference = RotaryScaleNet()
    reference.load_state_dict(values)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def _zero_params(module: nn.Module) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.zero_()


def _data_writes(module: nn.Module) -> None:
    # Writes through .data (not seen by the version counter) initialise too, and so does a computed buffer.
    for param in module.parameters(recurse=False):
        param.data.normal_()
    if isinstance(module, Rotary):
        module.inv_freq.data.copy_(Rotary(module.inv_freq.numel() * 2).inv_freq)


def _to_empty(module: nn.Module) -> None:
    module.to_empty(device="cpu", recurse=False)


def _to_empty_then_reset(module: nn.Module) -> None:
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _replace_buffer(module: nn.Module) -> None:
    _zero_params(module)
    if isinstance(module, Rotary):
        module.register_buffer("inv_freq", torch.linspace(0, 1, 2), persistent=False)


def _replace_buffer_with_empty(module: nn.Module) -> None:
    _zero_params(module)
    if isinstance(module, Rotary):
        module.register_buffer("inv_freq", torch.empty(2), persistent=False)


ALL = ["inp.weight", "inp.bias", "rotary.inv_freq", "scale.weight", "out.weight", "out.bias"]


@pytest.mark.parametrize(
    "init_fn,built_under,expected",
    [
        # torch.device("meta") puts buffers there too: a param_init_fn that ignores them leaves them recorded.
        (_zero_params, "meta_device", ["rotary.inv_freq"]),
        (_zero_params, "parameters_on_meta", []),
        (_data_writes, "meta_device", []),
        (_to_empty, "meta_device", ALL),
        (_to_empty_then_reset, "meta_device", ["rotary.inv_freq", "scale.weight"]),
        (_replace_buffer, "meta_device", []),
        (_replace_buffer_with_empty, "meta_device", ["rotary.inv_freq"]),
        (None, "meta_device", ["rotary.inv_freq", "scale.weight"]),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)) if not isinstance(v, list) else f"{len(v)}-left",
)
def test_what_param_init_fn_or_reset_parameters_wrote_is_initialised(init_fn, built_under, expected):
    context = torch.device("meta") if built_under == "meta_device" else parameters_on_meta()
    with context:
        model = RotaryScaleNet()
    fully_shard(model, param_init_fn=init_fn)
    assert sorted(uninitialised_names(model)) == sorted(expected)
    if expected:
        with pytest.raises(UninitialisedTensorError) as raised:
            model(torch.randn(2, 4))
        assert all(repr(name) in str(raised.value) for name in expected)
        mark_initialised(t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in expected)
    assert uninitialised_names(model) == []
    model(torch.randn(2, 4))  # guarded no more


# ------------------------------------------------------------------------------------------------ Lightning, 2 ranks
_launch: dict = {}


def meta_init_run(tmp_path_factory) -> dict:
    """tests/scripts/meta_init_run.py on 2 ranks (once per pytest process): {case: [rank 0's, rank 1's result]}."""
    if not _launch:
        from tests.scripts.pretrained_run import tiny_llama

        folder = tmp_path_factory.mktemp("meta_init")
        tiny_llama(tie=True).save_pretrained(folder / "tied")
        tiny_llama(tie=False).save_pretrained(folder / "untied")
        out = folder / "out.pt"
        args = ["--pretrained-tied", folder / "tied", "--pretrained-untied", folder / "untied", "--out", out]
        run_script("meta_init_run.py", *args, cwd=folder, timeout=300)
        ranks = rank_outputs(out, 2)
        _launch.update({case: [ranks[0][case], ranks[1][case]] for case in ranks[0]})
        _launch["folder"] = folder
    return _launch


def test_walkthrough_runs_as_written(tmp_path_factory):
    pytest.importorskip("transformers")
    run = meta_init_run(tmp_path_factory)
    for rank, result in enumerate(run["walkthrough"]):
        assert result.get("ok"), (rank, result)
        assert result["global_step"] == 2
    assert (run["folder"] / "finetuned.ckpt").exists()


def _norm_weights(layers: int = 2) -> list[str]:
    names = ["model.model.norm.weight"]
    for i in range(layers):
        names += [
            f"model.model.layers.{i}.input_layernorm.weight",
            f"model.model.layers.{i}.post_attention_layernorm.weight",
        ]
    return sorted(names)


@pytest.mark.parametrize(
    "case,tied,left_after_sharding",
    [
        ("no_init_fn", True, _norm_weights()),
        ("init_fn_ignores_buffers", False, []),
        ("configure_model", False, _norm_weights()),
    ],
)
def test_loaded_llama_gives_transformers_logits(tmp_path_factory, case, tied, left_after_sharding):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from tests.scripts.pretrained_run import fixed_batch

    run = meta_init_run(tmp_path_factory)
    reference = LlamaForCausalLM.from_pretrained(run["folder"] / ("tied" if tied else "untied")).eval()
    with torch.no_grad():
        expected = reference(input_ids=fixed_batch()).logits
    assert expected.shape == (2, 8, 128)
    for rank, result in enumerate(run[case]):
        assert result.get("ok"), (rank, result)
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-6)
        # Built with its parameters on the meta device and every buffer real (rotary inv_freq included).
        assert result["params_on_meta"] and result["buffers_on_meta"] == []
        # Without param_init_fn the RMSNorm weights (no reset_parameters) wait for load_pretrained, which fills them.
        assert sorted(result["after_sharding"]) == left_after_sharding
        assert result["after_load"] == []
        assert result["global_step"] == 1 and result["training_steps"] == 1  # the optimizer step ran


@pytest.mark.parametrize(
    "case,where",
    [
        ("refused_at_step", "optimizer.step() of SGD would compute"),
        ("refused_at_forward", "the forward of FineTune would"),
    ],
)
def test_parameter_nothing_initialises_is_refused_on_every_rank(tmp_path_factory, case, where):
    pytest.importorskip("transformers")
    run = meta_init_run(tmp_path_factory)
    for rank, result in enumerate(run[case]):
        assert "error" in result, (rank, result)
        kind, message = result["error"]
        assert kind == "UninitialisedTensorError", (rank, message)
        assert message.startswith(where) and "'scale' (parameter of FineTune)" in message, message
        assert all(word in message for word in ("load_pretrained", "param_init_fn", "reset_parameters")), message
        assert result["after_load"] == ["scale"]  # everything else came from the files
        assert result["training_steps"] == 0 and result["global_step"] == 0  # before any step
        assert "logits" not in result  # the forward in on_fit_start (refused_at_forward) did not compute
        assert result["seconds"] < 30, result["seconds"]  # refused where it stands: no collective, no hang
