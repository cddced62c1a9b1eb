"""The built-in tensor-parallel plans (``apply_tensor_parallel_plan``) against one device.

One launch of 2 gloo ranks, one tensor-parallel group of 2 (no data parallelism, no sharding engine), runs every
case: a tiny real model (transformers' Llama, Mistral, Qwen2, Gemma and Granite causal LMs, litgpt's GPT with
LLaMAMLP and with GptNeoxMLP) is split by the plan and trained 3 steps with SGD with momentum on batches both
ranks share. The reference is the same model, unsplit, trained in the test process on the same batches. Compared,
on each rank, in float32 at rtol 1e-5: the first step's logits, every step's loss, the first step's gradient of
every parameter (DTensors gathered with ``full_tensor()``) and every parameter after the 3 steps; and the split
itself (each projection's local rows or columns are half of the full ones), so that a plan that split nothing
cannot pass. The same launch checks the errors: sizes that 2 does not divide, and models without a built-in plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.toolbox.compare import assert_all_close
from tests.toolbox.distributed import run_distributed
from tests.toolbox.tp_models import full_values, hf_causal_lm, litgpt_gpt, parameters_and_grads, token_batch
from tests.toolbox.training import sgd_with_momentum

TP = 2
STEPS = 3
PAD = 2  # padded tokens at the start of the first sequence of the transformers cases


def _hf_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a user writes, with a left-padded first row: the padding mask, and labels ignoring the padding
    (transformers shifts them itself)."""
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return out.logits, out.loss


class Holder(nn.Module):
    """A module holding the model as an attribute, as a LightningModule does (``self.model``)."""

    def __init__(self, model: nn.Module, extra_head: bool = False) -> None:
        super().__init__()
        self.model = model
        if extra_head:
            self.value_head = nn.Linear(32, 1)


def _held_litgpt_loss(holder: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _litgpt_loss(holder.model, ids, labels)


def _litgpt_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids)
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# name: (model builder, loss, sequence_parallel, loss_parallel)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable, bool, bool]] = {
    "llama": (lambda: hf_causal_lm("llama"), _hf_loss, True, False),
    "mistral-loss-parallel": (lambda: hf_causal_lm("mistral"), _hf_loss, True, True),
    "qwen2-tied-replicated-norms": (
        lambda: hf_causal_lm("qwen2", tie_word_embeddings=True),
        _hf_loss,
        False,
        False,
    ),
    "gemma": (lambda: hf_causal_lm("gemma"), _hf_loss, True, False),
    "granite-replicated-norms": (lambda: hf_causal_lm("granite"), _hf_loss, False, False),
    "litgpt-llama": (lambda: litgpt_gpt("LLaMAMLP"), _litgpt_loss, True, False),
    "litgpt-neox-loss-parallel": (lambda: litgpt_gpt("GptNeoxMLP", n_query_groups=4), _litgpt_loss, True, True),
    "held-litgpt-llama-replicated-norms": (lambda: Holder(litgpt_gpt("LLaMAMLP")), _held_litgpt_loss, False, False),
}

# name: (model builder, error type, fragments the message must hold)
BAD_MODELS: dict[str, tuple[Callable[[], nn.Module], type, tuple[str, ...]]] = {
    "kv-heads": (
        lambda: hf_causal_lm("llama", num_key_value_heads=1),
        ValueError,
        ("model.layers.0.self_attn", "key/value heads", "(1)", "tensor_parallel_size=2"),
    ),
    "litgpt-intermediate": (
        lambda: litgpt_gpt("LLaMAMLP", intermediate_size=45),
        ValueError,
        ("transformer.h.0.mlp", "intermediate size", "(45)", "tensor_parallel_size=2"),
    ),
    "litgpt-heads": (
        lambda: litgpt_gpt("LLaMAMLP", n_head=3, n_query_groups=3, head_size=8),
        ValueError,
        ("transformer.h.0.attn", "attention heads", "(3)"),
    ),
    "phi3-fused-qkv": (
        lambda: hf_causal_lm("phi3"),
        TypeError,
        ("Phi3ForCausalLM", "model.layers.0 has no self_attn.q_proj Linear", "configure_model"),
    ),
    "qwen3-qk-norm": (lambda: hf_causal_lm("qwen3"), TypeError, ("q_norm", "parallelize_module", "configure_model")),
    "extra-head": (
        lambda: Holder(hf_causal_lm("llama"), extra_head=True),
        TypeError,
        ("value_head.weight", "value_head.bias", "parallelize_module"),
    ),
    "plain-module": (
        lambda: nn.Sequential(nn.Linear(4, 4)),
        TypeError,
        ("No built-in tensor-parallel plan for Sequential", "no lm_head Linear", "configure_model"),
    ),
}


def _train(model: nn.Module, loss_of: Callable, in_loss_parallel: bool) -> dict[str, Any]:
    """STEPS steps of SGD with momentum on ``token_batch(step)``: the first step's logits and gradients, each
    step's loss, the parameters at the end (all as full tensors)."""
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer = sgd_with_momentum(model.parameters())
    record: dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        ids, labels = token_batch(step)
        with loss_parallel() if in_loss_parallel else contextlib.nullcontext():
            logits, loss = loss_of(model, ids, labels)
            loss.backward()
        if step == 0:
            record["logits"] = full_values({"logits": logits})["logits"]
            _, record["grads"] = parameters_and_grads(model)
        record["losses"].append(full_values({"loss": loss})["loss"])
        optimizer.step()
        optimizer.zero_grad()
    record["params"] = full_values(dict(model.named_parameters()))
    return record


def _layout(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Each parameter's placements, local shape and full shape."""
    from torch.distributed.tensor import DTensor

    layout = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            layout[name] = (str(param.placements), tuple(param.to_local().shape), tuple(param.shape))
        else:
            layout[name] = ("plain", tuple(param.shape), tuple(param.shape))
    return layout


def _ranks_run(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_fsdp.tensor_parallel_plans import apply_tensor_parallel_plan

    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, Any] = {"runs": {}, "layouts": {}, "errors": {}}
    for name, (build, bad_type, _) in BAD_MODELS.items():
        model = build()
        try:
            apply_tensor_parallel_plan(model, mesh)
        except bad_type as error:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            results["errors"][name] = (str(error), untouched)
    results["misuse"] = _misuse(mesh)
    for name, (build, loss_of, sequence_parallel, loss_parallel) in CASES.items():
        model = apply_tensor_parallel_plan(
            build(), mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
        results["layouts"][name] = _layout(model)
        results["runs"][name] = _train(model, loss_of, loss_parallel)
    return results


def _misuse(mesh: Any) -> dict[str, str]:
    """The errors of a plan applied twice, and of a sequence length 2 does not divide under sequence parallelism
    (for transformers and litgpt); then the same models run a sequence of even length."""
    from lightning_fsdp.tensor_parallel_plans import apply_tensor_parallel_plan

    errors = {}
    llama = apply_tensor_parallel_plan(hf_causal_lm("llama"), mesh)
    gpt = apply_tensor_parallel_plan(litgpt_gpt(), mesh)
    with pytest.raises(ValueError) as twice:
        apply_tensor_parallel_plan(llama, mesh)
    errors["twice"] = str(twice.value)
    ids, _ = token_batch(0)
    for name, run in (("uneven-hf", lambda x: llama(input_ids=x)), ("uneven-litgpt", gpt)):
        with pytest.raises(ValueError) as uneven:
            run(ids[:, :-1])
        errors[name] = str(uneven.value)
        run(ids)  # the models still work
    return errors


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_ranks_run, TP)


@pytest.fixture(scope="module")
def one_device() -> dict[str, dict[str, Any]]:
    """Each case's model unsplit, trained in this process on the same batches."""
    return {name: _train(build(), loss_of, False) for name, (build, loss_of, _, _) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_trains_as_one_device(ranks: list[dict[str, Any]], one_device: dict[str, Any], case: str) -> None:
    want = one_device[case]
    for rank, result in enumerate(ranks):
        got = result["runs"][case]
        what = f"{case} rank {rank}"
        assert_all_close({"logits": got["logits"]}, {"logits": want["logits"]}, f"{what} logits")
        losses = {f"step {i}": loss for i, loss in enumerate(got["losses"])}
        assert_all_close(losses, {f"step {i}": loss for i, loss in enumerate(want["losses"])}, f"{what} losses")
        assert assert_all_close(got["grads"], want["grads"], f"{what} gradients") == len(want["params"])
        assert assert_all_close(got["params"], want["params"], f"{what} parameters") == len(want["params"])


ROWWISE = ("o_proj", "down_proj", "attn.proj", "mlp.proj")


@pytest.mark.parametrize("case", list(CASES))
def test_plan_splits_every_projection(ranks: list[dict[str, Any]], case: str) -> None:
    """Every projection, the embedding and the head hold half their rows (colwise weights and biases, the
    vocabulary) or half their columns (rowwise weights, whose biases are replicated) on each rank; norms are
    replicated DTensors on sequence shards, plain tensors otherwise. A plan that split nothing fails here."""
    _, _, sequence_parallel, _ = CASES[case]
    layout = ranks[0]["layouts"][case]
    kinds = {"split": 0, "norm": 0, "replicated bias": 0}
    for name, (placements, local, full) in layout.items():
        module, kind = name.rsplit(".", 1)
        if "norm" in module or module.endswith("ln_f"):
            assert placements == ("(Replicate(),)" if sequence_parallel else "plain"), f"{case} {name}: {placements}"
            kinds["norm"] += 1
        elif module.endswith(ROWWISE) and kind == "bias":
            assert placements == "(Replicate(),)", f"{case} {name}: {placements}"
            kinds["replicated bias"] += 1
        else:
            dim = 1 if module.endswith(ROWWISE) else 0
            assert placements == f"(Shard(dim={dim}),)", f"{case} {name}: {placements}"
            assert local[dim] * TP == full[dim], f"{case} {name}: local {local} of {full}"
            assert local[:dim] + local[dim + 1 :] == full[:dim] + full[dim + 1 :], f"{case} {name}: {local} {full}"
            kinds["split"] += 1
    assert sum(kinds.values()) == len(layout) and kinds["split"] >= 2 * 4 + 2 and kinds["norm"] >= 2 * 2 + 1, kinds


@pytest.mark.parametrize("bad", list(BAD_MODELS))
def test_refused_before_any_change(ranks: list[dict[str, Any]], bad: str) -> None:
    """Each rank raises the same error, naming the module and the size (or what the plan does not cover), and the
    model is left as it was (no parameter distributed, so no collective ran)."""
    _, _, fragments = BAD_MODELS[bad]
    messages = [result["errors"].get(bad) for result in ranks]
    assert all(m is not None for m in messages), f"{bad}: not refused on every rank: {messages}"
    assert messages[0] == messages[1], f"{bad}: ranks disagree: {messages}"
    message, untouched = messages[0]
    assert untouched, f"{bad}: the model was changed before the error"
    for fragment in fragments:
        assert fragment in message, f"{bad}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize("misuse", ["twice", "uneven-hf", "uneven-litgpt"])
def test_misuse_is_refused(ranks: list[dict[str, Any]], misuse: str) -> None:
    """A second plan on a parallelized model, and a sequence length the tensor-parallel size does not divide under
    sequence parallelism (which would otherwise abort gloo with mismatched collectives): clear errors on every rank."""
    expected = {
        "twice": ("LlamaForCausalLM is already parallelized", "model.embed_tokens.weight is a DTensor"),
        "uneven-hf": ("sequence length (7)", "sequence_parallel=False"),
        "uneven-litgpt": ("sequence length (7)", "multiple of 2"),
    }[misuse]
    for rank, result in enumerate(ranks):
        message = result["misuse"][misuse]
        for fragment in expected:
            assert fragment in message, f"rank {rank} {misuse}: {fragment!r} not in {message!r}"
