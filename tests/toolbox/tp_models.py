"""Tiny real models for the tensor-parallel tests, and the full value of a tensor-parallel model's tensors.

The models are the libraries' own classes (transformers' Llama, Mistral, Qwen2 and Qwen3 causal LMs, litgpt's GPT)
at sizes that train in milliseconds; every tensor is perturbed from its library initialisation (norms start at 1,
biases at 0) so that a gradient or update landing on the wrong rows or heads shows. ``chain_lm`` is the Lightning TP
scripts' ChainLM. ``full_values`` gathers a model's parameters, DTensors or plain, into ordinary tensors by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.toolbox.models import Block, ChainLM

VOCAB, SEQ, BATCH = 64, 8, 2
CHAIN_VOCAB, CHAIN_DIM = 7, 6


def chain_lm() -> ChainLM:
    """The Lightning TP scripts' model: embedding, four blocks with even hidden widths (torch's row-wise layers take
    even pieces), a norm, a head (tests/scripts/tensor_parallel_run.py, tp_compose_run.py)."""
    return ChainLM(
        CHAIN_VOCAB,
        CHAIN_DIM,
        lambda: [Block(CHAIN_DIM, 4), Block(CHAIN_DIM, 6), Block(CHAIN_DIM, 8), Block(CHAIN_DIM, 2)],
    )


def perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with every parameter moved by a seeded random amount (distinct values everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def hf_causal_lm(family: str, **overrides: object) -> nn.Module:
    """A 2-layer transformers causal LM of ``family`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``,
    ``granite``, ``phi3``): hidden 32, 4 heads of 8, 2 key/value heads, intermediate 48, the vocabulary ``VOCAB``
    (padding token 0); ``overrides`` change the config."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }
    config_class, model_class = classes[family]
    settings: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4 * SEQ,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return perturbed(model_class(config_class(**settings)))


def litgpt_gpt(mlp: str = "LLaMAMLP", **overrides: object) -> nn.Module:
    """A 2-layer litgpt GPT: hidden 32, 4 heads, 2 query groups, intermediate 48, MLP class ``mlp``; the norm, bias
    and residual layout follow the MLP's family (RMSNorm for LLaMAMLP, LayerNorm with biases and parallel residual
    for GptNeoxMLP) unless ``overrides`` say otherwise."""
    from litgpt import Config
    from litgpt.model import GPT

    settings: dict[str, object] = dict(
        block_size=4 * SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_query_groups=2,
        intermediate_size=48,
        rotary_percentage=1.0,
        mlp_class_name=mlp,
    )
    if mlp == "GptNeoxMLP":
        settings.update(norm_class_name="LayerNorm", bias=True, parallel_residual=True)
    else:
        settings.update(norm_class_name="RMSNorm", bias=False, parallel_residual=False)
    settings.update(overrides)
    torch.manual_seed(0)
    return perturbed(GPT(Config(**settings)))


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s token ids and next-token labels, ``(BATCH, SEQ)`` each, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def full_values(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's full value (a DTensor gathered with ``full_tensor()``), detached and cloned."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in tensors.items()}


def parameters_and_grads(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full value of every parameter and of its gradient, by name."""
    params = dict(model.named_parameters())
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    assert len(grads) == len(params), f"parameters without a gradient: {sorted(set(params) - set(grads))}"
    return full_values(params), full_values(grads)
