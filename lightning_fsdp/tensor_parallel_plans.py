"""Built-in tensor-parallel plans: torch's tensor parallelism (``torch.distributed.tensor.parallel``) applied to the
model families whose module structure is known, as torchtitan's ``apply_tp`` does for its Llama.

:func:`apply_tensor_parallel_plan` recognises a model by its modules (not by its class name), checks that every
size the plan splits divides the tensor-parallel size, then calls ``parallelize_module`` with the family's plan:

- transformers' Llama family (``LlamaForCausalLM`` and every causal LM with its module names and no other
  parameters: Mistral, Qwen2, Gemma, Granite, ...): attention ``q_proj``/``k_proj``/``v_proj`` colwise and
  ``o_proj`` rowwise, MLP ``gate_proj``/``up_proj`` colwise and ``down_proj`` rowwise, the embedding rowwise
  (vocabulary rows), ``lm_head`` colwise, and with sequence parallelism the RMSNorms on sequence shards.
- litgpt's ``GPT`` (``CausalSelfAttention`` with its fused ``qkv``, ``LLaMAMLP``/``GemmaMLP`` or ``GptNeoxMLP``,
  RMSNorm or LayerNorm): the same split, ``qkv`` colwise with each rank taking its own heads out of the gathered
  ``[q | k | v]`` output (see :func:`take_local_heads`).

Every error is raised from what all ranks of the group share (the model's shapes, the mesh's size, the batch's
sequence length), before any collective, so every rank raises the same error at the same point.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

_WRITE_YOUR_OWN = (
    "Write the plan yourself: call torch.distributed.tensor.parallel.parallelize_module(model, "
    'self.device_mesh["tensor_parallel"], plan) in your LightningModule\'s configure_model (docs/parallelism.md).'
)


@dataclass
class _Plan:
    """What applying a family's plan takes: the styles by module name, the parameters it leaves plain on purpose
    (norms computed on replicated activations without sequence parallelism), the sizes it splits (``(module name,
    what, size)``), and the fix-ups to run once the parameters are DTensors."""

    family: str
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    plain: set[str] = field(default_factory=set)
    split_sizes: list[tuple[str, str, int]] = field(default_factory=list)
    after: list[Callable[[DeviceMesh], None]] = field(default_factory=list)


def apply_tensor_parallel_plan(
    module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> nn.Module:
    """Split the layers of ``module`` over ``tp_mesh`` (a 1-D mesh: the tensor-parallel group) with the built-in
    plan of its family; returns ``module``, parallelized in place (its parameters become DTensors).

    ``module`` is a supported model, or any module holding supported models (a LightningModule with the model as an
    attribute): each outermost supported submodule gets its family's plan, and a parameter outside them is refused.

    ``sequence_parallel``: the norms and the residual stream between layers hold ``1/T`` of the sequence (``T``
    must divide the sequence length, checked at each forward); otherwise they are replicated. ``loss_parallel``:
    the logits stay a DTensor sharded over the vocabulary; compute the loss and run backward inside
    ``torch.distributed.tensor.parallel.loss_parallel()``. Every rank must hold the same values before the call
    (seed them alike): the split weights are scattered from rank 0, the replicated norms are taken as they are.

    Raises ``TypeError`` for a model no built-in plan covers (naming what it lacks or the parameters the plan does
    not know), and ``ValueError`` naming the module and the size when a head count, the intermediate or the
    vocabulary size does not divide ``T``; both from shapes alone, before any collective, so on every rank.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh {tp_mesh}.")
    already = next((name for name, p in module.named_parameters() if isinstance(p, DTensor)), None)
    if already is not None:
        raise ValueError(
            f"{type(module).__name__} is already parallelized ({already} is a DTensor): apply one plan, either "
            'tensor_parallel_plan="auto" or your own parallelize_module call, not both.'
        )
    models = _supported_models(module)
    if not models:
        raise TypeError(
            f"No built-in tensor-parallel plan for {type(module).__name__}: neither it nor any of its submodules is "
            f"a transformers Llama-family causal LM ({_llama_family_mismatch(module)}) or a litgpt GPT "
            f"({_litgpt_mismatch(module)}). {_WRITE_YOUR_OWN}"
        )
    plans = [(prefix, model, _plan_for(model, sequence_parallel, loss_parallel)) for prefix, model in models]
    for prefix, _, plan in plans:
        _check_divisible(plan, prefix, tp_mesh.size())
    _check_covered(module, [(prefix, plan) for prefix, _, plan in plans])
    for _, model, plan in plans:
        tied = _tied_head(model)
        parallelize_module(model, tp_mesh, plan.styles)
        if tied is not None:
            # The embedding's style replaced its weight with a DTensor; lm_head's made a second one. Both are rows
            # of the vocabulary (Shard(0)), so the tie is restored on the embedding's.
            embedding, head = tied
            head.weight = embedding.weight
        for fix in plan.after:
            fix(tp_mesh)
        if sequence_parallel:
            model.register_forward_pre_hook(_sequence_divides(tp_mesh.size()), with_kwargs=True)
    return module


def _sequence_divides(tp_size: int) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
    """A forward pre-hook refusing a sequence length ``T`` does not divide: sequence parallelism would otherwise send
    shards of different sizes (gloo aborts the process, NCCL hangs). The ranks of a tensor-parallel group share
    their batch, so every rank raises, before the forward's first collective."""

    def check(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        tokens = args[0] if args else next((kwargs[k] for k in _TOKEN_ARGUMENTS if kwargs.get(k) is not None), None)
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] % tp_size != 0:
            raise ValueError(
                f"sequence_parallel=True splits the sequence over the {tp_size} tensor-parallel ranks, and "
                f"{tp_size} does not divide this batch's sequence length ({tokens.shape[1]}). Pad the sequences to a "
                f"multiple of {tp_size}, or apply the plan with sequence_parallel=False."
            )

    return check


_TOKEN_ARGUMENTS = ("input_ids", "inputs_embeds", "idx")


def _supported_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``module`` (itself included, named ``""``) that a built-in plan covers."""
    found: list[tuple[str, nn.Module]] = []
    for name, submodule in module.named_modules():
        if any(prefix == "" or name.startswith(f"{prefix}.") for prefix, _ in found):
            continue
        if _llama_family_mismatch(submodule) is None or _litgpt_mismatch(submodule) is None:
            found.append((name, submodule))
    return found


def _plan_for(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    if _llama_family_mismatch(model) is None:
        return _llama_family_plan(model, sequence_parallel, loss_parallel)
    return _litgpt_plan(model, sequence_parallel, loss_parallel)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_divisible(plan: _Plan, prefix: str, tp_size: int) -> None:
    for module_name, what, size in plan.split_sizes:
        if size % tp_size != 0:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide {what} of {_qualified(prefix, module_name)} "
                f"({size}): the {plan.family} plan splits it over the tensor-parallel ranks. Choose a "
                f"tensor_parallel_size that divides {size}."
            )


def _check_covered(module: nn.Module, plans: list[tuple[str, _Plan]]) -> None:
    """Every parameter is split or replicated by one of the plans' styles, or left plain on purpose: a parameter
    no plan knows (a QK-norm, an adapter, a head outside the model) would train on partial gradients silently."""
    styled: list[str] = []
    plain: set[str] = set()
    for prefix, plan in plans:
        styled += [
            f"{_qualified(prefix, name)}."
            for name, style in plan.styles.items()
            if not isinstance(style, PrepareModuleInput)
        ]
        plain.update(_qualified(prefix, name) for name in plan.plain)
    unknown = [
        name
        for name, _ in module.named_parameters()
        if name not in plain and not any(name.startswith(prefix) for prefix in styled)
    ]
    if unknown:
        families = " and ".join(sorted({plan.family for _, plan in plans}))
        raise TypeError(
            f"The {families} tensor-parallel plan does not cover these parameters of {type(module).__name__}: "
            f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}. {_WRITE_YOUR_OWN}"
        )


def _tied_head(model: nn.Module) -> tuple[nn.Embedding, nn.Linear] | None:
    """(embedding, lm_head) when the output head shares the input embedding's weight."""
    head = _part(model, "lm_head", nn.Linear)
    for path in ("model.embed_tokens", "transformer.wte"):
        if _has(model, path, nn.Embedding):
            embedding = _part(model, path, nn.Embedding)
            return (embedding, head) if head.weight is embedding.weight else None
    return None


M = TypeVar("M", bound=nn.Module)


def _part(module: nn.Module, path: str, kind: type[M]) -> M:
    """``module``'s submodule at ``path``, which the family's structure check found to be a ``kind``."""
    found = module.get_submodule(path)
    if not isinstance(found, kind):
        raise TypeError(f"{path} of {type(module).__name__} is a {type(found).__name__}, not a {kind.__name__}.")
    return found


def _has(module: nn.Module, path: str, kind: type[nn.Module]) -> bool:
    try:
        return isinstance(module.get_submodule(path), kind)
    except AttributeError:
        return False


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# --- transformers' Llama family -------------------------------------------------------------------------------

_LLAMA_LINEARS = (
    *("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
)
_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")


def _llama_family_mismatch(model: nn.Module) -> str | None:
    """None if ``model`` has LlamaForCausalLM's module structure, else what it lacks."""
    for path, kind in (("lm_head", nn.Linear), ("model.embed_tokens", nn.Embedding), ("model.layers", nn.ModuleList)):
        if not _has(model, path, kind):
            return f"no {path} {kind.__name__}"
    layers = _part(model, "model.layers", nn.ModuleList)
    if len(layers) == 0 or not _has(model, "model.norm", nn.Module):
        return "no model.layers or no model.norm"
    for index, layer in enumerate(layers):
        for path in _LLAMA_LINEARS:
            if not _has(layer, path, nn.Linear):
                return f"model.layers.{index} has no {path} Linear"
        for path in _LLAMA_NORMS:
            if not _has(layer, path, nn.Module):
                return f"model.layers.{index} has no {path}"
        if not isinstance(getattr(layer.get_submodule("self_attn"), "head_dim", None), int):
            return f"model.layers.{index}.self_attn has no head_dim"
    return None


def _llama_family_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    """torchtitan's Llama plan on transformers' module names. With sequence parallelism the residual stream stays a
    DTensor (``use_local_output=False``): transformers builds positions and the causal mask from the embedding
    output's shape, which must be the global sequence length."""
    plan = _Plan("transformers Llama-family")
    sequence = Shard(1) if sequence_parallel else Replicate()
    local_residual = not sequence_parallel  # local tensors when replicated, DTensors on sequence shards
    plan.styles["model.embed_tokens"] = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=sequence, use_local_output=local_residual
    )
    plan.styles["lm_head"] = ColwiseParallel(
        input_layouts=sequence,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    plan.split_sizes += [
        ("model.embed_tokens", "the vocabulary size", _part(model, "model.embed_tokens", nn.Embedding).num_embeddings),
        ("lm_head", "the vocabulary size", _part(model, "lm_head", nn.Linear).out_features),
    ]
    norms = ["model.norm"]
    for index, layer in enumerate(_part(model, "model.layers", nn.ModuleList)):
        prefix = f"model.layers.{index}"
        attention = layer.get_submodule("self_attn")
        head_dim: int = getattr(attention, "head_dim")  # noqa: B009 - an int, checked by _llama_family_mismatch
        plan.split_sizes += [
            (f"{prefix}.self_attn", "the number of attention heads", _out(layer, "self_attn.q_proj") // head_dim),
            (f"{prefix}.self_attn", "the number of key/value heads", _out(layer, "self_attn.k_proj") // head_dim),
            (f"{prefix}.mlp", "the intermediate size", _out(layer, "mlp.gate_proj")),
        ]
        for name in ("q_proj", "k_proj", "v_proj"):
            plan.styles[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.self_attn.o_proj"] = RowwiseParallel(
            output_layouts=sequence, use_local_output=local_residual
        )
        for name in ("gate_proj", "up_proj"):
            plan.styles[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.mlp.down_proj"] = RowwiseParallel(
            output_layouts=sequence, use_local_output=local_residual
        )
        norms += [f"{prefix}.{name}" for name in _LLAMA_NORMS]
        if sequence_parallel:
            # transformers passes the attention's input as the keyword hidden_states, the MLP's positionally.
            plan.styles[f"{prefix}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
            plan.styles[f"{prefix}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        plan.after.append(_local_head_counts(attention))
    _norm_styles(model, plan, norms, sequence_parallel, local_output=False)
    return plan


def _out(module: nn.Module, path: str) -> int:
    return _part(module, path, nn.Linear).out_features


def _local_head_counts(attention: nn.Module) -> Callable[[DeviceMesh], None]:
    """Head counts an attention module keeps as attributes, divided by ``T``. transformers 5 reshapes with ``-1``
    heads and reads only the ratio ``num_key_value_groups`` (unchanged); earlier versions read ``num_heads`` and
    ``num_key_value_heads`` in forward."""

    def fix(tp_mesh: DeviceMesh) -> None:
        for name in ("num_heads", "num_key_value_heads"):
            value = getattr(attention, name, None)
            if isinstance(value, int):
                setattr(attention, name, value // tp_mesh.size())

    return fix


def _norm_styles(model: nn.Module, plan: _Plan, names: list[str], sequence_parallel: bool, local_output: bool) -> None:
    """Norms on sequence shards (their weights replicated DTensors), or left plain: without sequence parallelism
    every rank normalises the same replicated activations, so their gradients agree with no communication."""
    for name in names:
        norm = model.get_submodule(name)
        if not _has_parameters(norm):
            continue
        if sequence_parallel:
            plan.styles[name] = SequenceParallel(use_local_output=local_output)
        else:
            plan.plain.update(f"{name}.{p}" for p, _ in norm.named_parameters())


# --- litgpt's GPT -----------------------------------------------------------------------------------------------

_LITGPT_MLPS = {("fc_1", "fc_2"): "proj", ("fc",): "proj"}
_LITGPT_NORMS = ("norm_1", "post_attention_norm", "norm_2", "post_mlp_norm")


class _HeadCounts(Protocol):
    """What litgpt's attention reads from its ``config`` to lay out its heads."""

    n_head: int
    n_query_groups: int
    head_size: int


def _litgpt_heads(attention: nn.Module) -> _HeadCounts | None:
    config = getattr(attention, "config", None)
    if all(isinstance(getattr(config, name, None), int) for name in ("n_head", "n_query_groups", "head_size")):
        return config
    return None


def _litgpt_mismatch(model: nn.Module) -> str | None:
    """None if ``model`` has litgpt GPT's module structure (with a plan for its attention and MLP), else what
    differs."""
    for path, kind in (("lm_head", nn.Linear), ("transformer.wte", nn.Embedding), ("transformer.h", nn.ModuleList)):
        if not _has(model, path, kind):
            return f"no {path} {kind.__name__}"
    if not _has(model, "transformer.ln_f", nn.Module):
        return "no transformer.ln_f"
    for index, block in enumerate(_part(model, "transformer.h", nn.ModuleList)):
        if not (_has(block, "attn.qkv", nn.Linear) and _has(block, "attn.proj", nn.Linear)):
            return f"transformer.h.{index}.attn has no qkv and proj Linears (multi-head latent attention?)"
        if _litgpt_heads(block.get_submodule("attn")) is None:
            return f"transformer.h.{index}.attn.config has no n_head, n_query_groups and head_size"
        if not _has(block, "mlp", nn.Module) or _litgpt_mlp_layout(block.get_submodule("mlp")) is None:
            return f"transformer.h.{index}.mlp is not an LLaMAMLP, GemmaMLP or GptNeoxMLP"
    return None


def _litgpt_mlp_layout(mlp: nn.Module) -> tuple[tuple[str, ...], str] | None:
    for colwise, rowwise in _LITGPT_MLPS.items():
        if all(_has(mlp, name, nn.Linear) for name in (*colwise, rowwise)):
            return colwise, rowwise
    return None


def _litgpt_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    """Megatron's split of litgpt's blocks; the residual stream between blocks holds local tensors (litgpt takes the
    sequence length from the token ids, not from the activations)."""
    plan = _Plan("litgpt GPT")
    sequence = Shard(1) if sequence_parallel else Replicate()
    plan.styles["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
    plan.styles["lm_head"] = ColwiseParallel(
        input_layouts=sequence,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    vocabulary = _part(model, "transformer.wte", nn.Embedding).num_embeddings
    plan.split_sizes += [
        ("transformer.wte", "the (padded) vocabulary size", vocabulary),
        ("lm_head", "the (padded) vocabulary size", _out(model, "lm_head")),
    ]
    norms = ["transformer.ln_f"]
    for index, block in enumerate(_part(model, "transformer.h", nn.ModuleList)):
        prefix = f"transformer.h.{index}"
        attention = block.get_submodule("attn")
        heads = _litgpt_heads(attention)
        assert heads is not None  # checked by _litgpt_mismatch
        plan.split_sizes += [
            (f"{prefix}.attn", "the number of attention heads (n_head)", heads.n_head),
            (f"{prefix}.attn", "the number of key/value heads (n_query_groups)", heads.n_query_groups),
        ]
        # qkv's output is taken apart by take_local_heads, which needs it as a DTensor.
        plan.styles[f"{prefix}.attn.qkv"] = ColwiseParallel(use_local_output=False)
        plan.styles[f"{prefix}.attn.proj"] = RowwiseParallel(output_layouts=sequence)
        mlp = block.get_submodule("mlp")
        layout = _litgpt_mlp_layout(mlp)
        assert layout is not None  # checked by _litgpt_mismatch
        colwise, rowwise = layout
        plan.split_sizes.append((f"{prefix}.mlp", "the intermediate size", _out(mlp, colwise[0])))
        for name in colwise:
            plan.styles[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.mlp.{rowwise}"] = RowwiseParallel(output_layouts=sequence)
        norms += [f"{prefix}.{name}" for name in _LITGPT_NORMS if _has(block, name, nn.Module)]
        if sequence_parallel:
            # The block calls attn(x, cos, sin, mask, input_pos, input_pos_maxp1): only x is sequence-sharded.
            plan.styles[f"{prefix}.attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None, None),
                use_local_output=True,
            )
            plan.styles[f"{prefix}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        plan.after.append(_litgpt_local_heads(attention, heads))
    _norm_styles(model, plan, norms, sequence_parallel, local_output=True)
    return plan


def _litgpt_local_heads(attention: nn.Module, heads: _HeadCounts) -> Callable[[DeviceMesh], None]:
    """After the split: the attention reads its head counts from ``self.config`` (shared by the whole model), so it
    gets a copy holding this rank's counts, and its ``qkv`` output is narrowed to this rank's heads."""

    def fix(tp_mesh: DeviceMesh) -> None:
        tp_size = tp_mesh.size()
        q_size = heads.n_head * heads.head_size
        kv_size = heads.n_query_groups * heads.head_size
        local = copy.copy(heads)
        local.n_head, local.n_query_groups = heads.n_head // tp_size, heads.n_query_groups // tp_size
        setattr(attention, "config", local)  # noqa: B010 - a plain attribute of litgpt's module
        attention.get_submodule("qkv").register_forward_hook(take_local_heads(q_size, kv_size, tp_mesh))

    return fix


def take_local_heads(
    q_size: int, kv_size: int, tp_mesh: DeviceMesh
) -> Callable[[nn.Module, tuple[torch.Tensor, ...], DTensor], torch.Tensor]:
    """litgpt fuses the projections into one weight whose rows are ``[q | k | v]``. A colwise split of that weight
    (``Shard(0)``, which keeps its full value litgpt's, for checkpoints) gives each rank a contiguous block of rows,
    not its own heads of each of q, k and v. So the output is all-gathered and each rank keeps ``[q_r | k_r | v_r]``,
    its heads (query heads ``r*H/T ...``, whose key/value groups are ``r*G/T ...``); in backward the kept columns'
    gradient is reduce-scattered back (``grad_placements=[Partial()]``: each column's gradient comes from the one
    rank that kept it). The cost against a split of separate q/k/v weights: one all-gather of the ``qkv`` output
    in forward and one reduce-scatter in backward per block."""
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: DTensor) -> torch.Tensor:
        full = output.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        q, k, v = full.split((q_size, kv_size, kv_size), dim=-1)
        return torch.cat([part.chunk(size, dim=-1)[rank] for part in (q, k, v)], dim=-1)

    return hook
