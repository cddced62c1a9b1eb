"""Built-in tensor-parallel plans: torch's tensor parallelism (``torch.distributed.tensor.parallel``) applied to the
model families whose module structure is known, as torchtitan's ``apply_tp`` does for its Llama.

:func:`apply_tensor_parallel_plan` recognises a model by its modules (not by its class name), checks that every
size the plan splits divides the tensor-parallel size, then calls ``parallelize_module`` with the family's plan:

- transformers' Llama family (``LlamaForCausalLM`` and every causal LM with its module names and no other
  parameters: Mistral, Qwen2, ...): attention ``q_proj``/``k_proj``/``v_proj`` colwise and ``o_proj`` rowwise, MLP
  ``gate_proj``/``up_proj`` colwise and ``down_proj`` rowwise, the embedding rowwise (vocabulary rows), ``lm_head``
  colwise, and with sequence parallelism the RMSNorms on sequence shards.
- litgpt's ``GPT`` (``CausalSelfAttention`` with its fused ``qkv``, ``LLaMAMLP``/``GemmaMLP`` or ``GptNeoxMLP``,
  RMSNorm or LayerNorm): the same split, ``qkv`` colwise with each rank taking its own heads out of the gathered
  ``[q | k | v]`` output (see :func:`_take_local_heads`).

Everything raised here is raised from the model's shapes and the mesh's size alone, before any collective, so
every rank raises the same error at the same point.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

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

WRITE_YOUR_OWN = (
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
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> nn.Module:
    """Split ``model``'s layers over ``tp_mesh`` (a 1-D mesh: the tensor-parallel group) with the built-in plan of
    its family; returns ``model``, parallelized in place (its parameters become DTensors).

    ``sequence_parallel``: the norms and the residual stream between layers hold ``1/T`` of the sequence (sequence
    length must divide ``T``); otherwise they are replicated. ``loss_parallel``: the logits stay a DTensor sharded
    over the vocabulary; compute the loss and run backward inside ``torch.distributed.tensor.parallel.
    loss_parallel()``. Every rank must hold the same values before the call (seed them alike).

    Raises ``TypeError`` for a model no built-in plan covers (and names what it lacks or has in excess), and
    ``ValueError`` naming the module and the size when a head count, hidden or vocabulary size does not divide
    ``T``; both before any collective.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh {tp_mesh}.")
    tp_size = tp_mesh.size()
    plan = _plan_for(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    _check_divisible(plan, tp_size)
    _check_covered(model, plan)
    tied = _tied_head(model)
    parallelize_module(model, tp_mesh, plan.styles)
    if tied is not None:
        # The embedding's style replaced its weight with a DTensor; lm_head's made a second one. Both are rows of
        # the vocabulary (Shard(0)), so the tie is restored on the embedding's.
        embedding, head = tied
        head.weight = embedding.weight
    for fix in plan.after:
        fix(tp_mesh)
    return model


def _plan_for(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    llama_reason = _llama_family_mismatch(model)
    if llama_reason is None:
        return _llama_family_plan(model, sequence_parallel, loss_parallel)
    litgpt_reason = _litgpt_mismatch(model)
    if litgpt_reason is None:
        return _litgpt_plan(model, sequence_parallel, loss_parallel)
    raise TypeError(
        f"No built-in tensor-parallel plan for {type(model).__name__}: it is neither a transformers Llama-family "
        f"causal LM ({llama_reason}) nor a litgpt GPT ({litgpt_reason}). {WRITE_YOUR_OWN}"
    )


def _check_divisible(plan: _Plan, tp_size: int) -> None:
    for module_name, what, size in plan.split_sizes:
        if size % tp_size != 0:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide {what} of {module_name} ({size}): the "
                f"{plan.family} plan splits it over the tensor-parallel ranks. Choose a tensor_parallel_size that "
                f"divides {size}."
            )


def _check_covered(model: nn.Module, plan: _Plan) -> None:
    """Every parameter is split or replicated by one of the plan's styles, or left plain on purpose: a parameter
    the plan does not know (a QK-norm, an adapter) would train on partial gradients without an error."""
    styled = tuple(f"{name}." for name, style in plan.styles.items() if not isinstance(style, PrepareModuleInput))
    unknown = [
        name
        for name, _ in model.named_parameters()
        if name not in plan.plain and not any(name.startswith(prefix) for prefix in styled)
    ]
    if unknown:
        raise TypeError(
            f"The {plan.family} tensor-parallel plan does not cover these parameters of {type(model).__name__}: "
            f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}. {WRITE_YOUR_OWN}"
        )


def _tied_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(embedding, lm_head) when the output head shares the input embedding's weight."""
    head = getattr(model, "lm_head", None)
    embedding = _embedding_of(model)
    if head is not None and embedding is not None and head.weight is embedding.weight:
        return embedding, head
    return None


def _embedding_of(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "embed_tokens", None), nn.Embedding):
        return inner.embed_tokens
    transformer = getattr(model, "transformer", None)
    if isinstance(transformer, nn.ModuleDict) and "wte" in transformer and isinstance(transformer["wte"], nn.Embedding):
        return transformer["wte"]
    return None


def _is_linear(module: object) -> bool:
    return isinstance(module, nn.Linear)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# --- transformers' Llama family -------------------------------------------------------------------------------

_LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def _llama_family_mismatch(model: nn.Module) -> str | None:
    """None if ``model`` has LlamaForCausalLM's module structure, else what it lacks."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return "no .model"
    if not _is_linear(getattr(model, "lm_head", None)):
        return "no .lm_head Linear"
    if not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding):
        return "no .model.embed_tokens Embedding"
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return "no .model.layers"
    if not isinstance(getattr(inner, "norm", None), nn.Module):
        return "no .model.norm"
    for index, layer in enumerate(layers):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or not all(_is_linear(getattr(attention, n, None)) for n in _LLAMA_ATTENTION):
            return f"model.layers.{index}.self_attn lacks {'/'.join(_LLAMA_ATTENTION)} Linears"
        if mlp is None or not all(_is_linear(getattr(mlp, n, None)) for n in _LLAMA_MLP):
            return f"model.layers.{index}.mlp lacks {'/'.join(_LLAMA_MLP)} Linears"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if not isinstance(getattr(layer, norm, None), nn.Module):
                return f"model.layers.{index} has no {norm}"
    return None


def _llama_head_dim(attention: nn.Module, model: nn.Module) -> int:
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    config = model.config  # type: ignore[union-attr]  # a transformers model: its config holds the head count
    return attention.q_proj.out_features // config.num_attention_heads


def _llama_family_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    """torchtitan's Llama plan on transformers' module names. With sequence parallelism the residual stream stays a
    DTensor (``use_local_output=False``): transformers builds positions and the causal mask from the embedding
    output's shape, which must be the global sequence length."""
    plan = _Plan("transformers Llama-family")
    inner = model.model  # type: ignore[union-attr]  # checked by _llama_family_mismatch
    sequence = Shard(1) if sequence_parallel else Replicate()
    keep_dtensor = not sequence_parallel  # local tensors when replicated, DTensors on sequence shards
    plan.styles["model.embed_tokens"] = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=sequence, use_local_output=keep_dtensor
    )
    plan.styles["lm_head"] = ColwiseParallel(
        input_layouts=sequence,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    plan.split_sizes += [
        ("model.embed_tokens", "the vocabulary size", inner.embed_tokens.num_embeddings),
        ("lm_head", "the vocabulary size", model.lm_head.out_features),  # type: ignore[union-attr]
    ]
    norms = ["model.norm"]
    for index, layer in enumerate(inner.layers):
        prefix = f"model.layers.{index}"
        attention = layer.self_attn
        head_dim = _llama_head_dim(attention, model)
        plan.split_sizes += [
            (f"{prefix}.self_attn", "the number of attention heads", attention.q_proj.out_features // head_dim),
            (f"{prefix}.self_attn", "the number of key/value heads", attention.k_proj.out_features // head_dim),
            (f"{prefix}.mlp", "the intermediate size", layer.mlp.gate_proj.out_features),
        ]
        for name in ("q_proj", "k_proj", "v_proj"):
            plan.styles[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.self_attn.o_proj"] = RowwiseParallel(
            output_layouts=sequence, use_local_output=keep_dtensor
        )
        for name in ("gate_proj", "up_proj"):
            plan.styles[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=sequence, use_local_output=keep_dtensor)
        norms += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
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


def _litgpt_mismatch(model: nn.Module) -> str | None:
    """None if ``model`` has litgpt GPT's module structure (with a plan for its attention and MLP), else what
    differs."""
    transformer = getattr(model, "transformer", None)
    if not isinstance(transformer, nn.ModuleDict) or not _is_linear(getattr(model, "lm_head", None)):
        return "no .transformer ModuleDict and .lm_head Linear"
    if not all(key in transformer for key in ("wte", "h", "ln_f")) or not isinstance(transformer["wte"], nn.Embedding):
        return "no transformer.wte Embedding, transformer.h and transformer.ln_f"
    for index, block in enumerate(transformer["h"]):
        attention = getattr(block, "attn", None)
        config = getattr(attention, "config", None)
        if not (_is_linear(getattr(attention, "qkv", None)) and _is_linear(getattr(attention, "proj", None))):
            return f"transformer.h.{index}.attn has no qkv and proj Linears (multi-head latent attention?)"
        if not all(isinstance(getattr(config, n, None), int) for n in ("n_head", "n_query_groups", "head_size")):
            return f"transformer.h.{index}.attn.config has no n_head, n_query_groups and head_size"
        if _litgpt_mlp_layout(block.mlp) is None:
            return f"transformer.h.{index}.mlp is {type(block.mlp).__name__}, not LLaMAMLP/GemmaMLP/GptNeoxMLP"
    return None


def _litgpt_mlp_layout(mlp: nn.Module) -> tuple[tuple[str, ...], str] | None:
    for colwise, rowwise in _LITGPT_MLPS.items():
        if all(_is_linear(getattr(mlp, n, None)) for n in (*colwise, rowwise)):
            return colwise, rowwise
    return None


def _litgpt_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> _Plan:
    """Megatron's split of litgpt's blocks; the residual stream between blocks holds local tensors (litgpt takes the
    sequence length from the token ids, not from the activations)."""
    plan = _Plan("litgpt GPT")
    transformer = model.transformer  # type: ignore[union-attr]  # checked by _litgpt_mismatch
    sequence = Shard(1) if sequence_parallel else Replicate()
    plan.styles["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
    plan.styles["lm_head"] = ColwiseParallel(
        input_layouts=sequence,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    plan.split_sizes += [
        ("transformer.wte", "the (padded) vocabulary size", transformer["wte"].num_embeddings),
        ("lm_head", "the (padded) vocabulary size", model.lm_head.out_features),  # type: ignore[union-attr]
    ]
    norms = ["transformer.ln_f"]
    for index, block in enumerate(transformer["h"]):
        prefix = f"transformer.h.{index}"
        config = block.attn.config
        plan.split_sizes += [
            (f"{prefix}.attn", "the number of attention heads (n_head)", config.n_head),
            (f"{prefix}.attn", "the number of key/value heads (n_query_groups)", config.n_query_groups),
        ]
        # qkv's output is taken apart by _take_local_heads, which needs it as a DTensor.
        plan.styles[f"{prefix}.attn.qkv"] = ColwiseParallel(use_local_output=False)
        plan.styles[f"{prefix}.attn.proj"] = RowwiseParallel(output_layouts=sequence)
        colwise, rowwise = _litgpt_mlp_layout(block.mlp)  # type: ignore[misc]  # checked by _litgpt_mismatch
        plan.split_sizes.append((f"{prefix}.mlp", "the intermediate size", getattr(block.mlp, colwise[0]).out_features))
        for name in colwise:
            plan.styles[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        plan.styles[f"{prefix}.mlp.{rowwise}"] = RowwiseParallel(output_layouts=sequence)
        norms += [f"{prefix}.{n}" for n in _LITGPT_NORMS if isinstance(getattr(block, n, None), nn.Module)]
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
        plan.after.append(_litgpt_local_heads(block.attn))
    _norm_styles(model, plan, norms, sequence_parallel, local_output=True)
    return plan


def _litgpt_local_heads(attention: nn.Module) -> Callable[[DeviceMesh], None]:
    """After the split: the attention reads its head counts from ``self.config`` (shared by the whole model), so it
    gets a copy holding this rank's counts, and its ``qkv`` output is narrowed to this rank's heads."""

    def fix(tp_mesh: DeviceMesh) -> None:
        tp_size = tp_mesh.size()
        config = attention.config
        q_size = config.n_head * config.head_size
        kv_size = config.n_query_groups * config.head_size
        local = copy.copy(config)
        local.n_head, local.n_query_groups = config.n_head // tp_size, config.n_query_groups // tp_size
        attention.config = local
        attention.qkv.register_forward_hook(_take_local_heads(q_size, kv_size, tp_mesh))

    return fix


def _take_local_heads(
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
