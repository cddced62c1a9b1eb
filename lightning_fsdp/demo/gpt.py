"""A small GPT-style character language model in plain PyTorch, written so that a sharding engine meets what a real
model has: ``Block`` is the natural wrap unit, ``lm_head.weight`` *is* ``wte.weight`` when ``tie_weights`` (as in
GPT-2), and GPT-2's initialisation lives in each leaf's ``reset_parameters()``, so a meta-device model materialised
module by module equals a normal construction under the same seed.

Parameters (``tie_weights=True``, ``bias=True``; V = vocab_size, T = block_size, d = n_embd, L = n_layer):
``V*d + T*d + L * (12*d*d + 13*d) + 2*d``; with ``bias=False`` a block has ``12*d*d + 2*d`` and the final LayerNorm
``d``; untied, add ``V*d``. The demo's default (4 x 128, V=65, T=64) has 809,856; the benchmark's (6 x 512, T=128)
about 19M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "Embeddings", "PipelineGPT", "next_token_loss"]

# GPT-2's initialisation scale for linear and embedding weights.
_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: number of distinct tokens (characters).
        block_size: longest sequence the model accepts (size of the position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: dropout probability on attention weights and residual branches.
        bias: whether Linear and LayerNorm layers have biases.
        tie_weights: share the token embedding with the output projection (GPT-2 style).
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class _Linear(nn.Linear):
    """``nn.Linear`` with GPT-2's init (N(0, std) weight, zero bias) in its own ``reset_parameters``, so that no
    parent's init can overwrite it, whatever order a strategy walks the modules in."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float = _INIT_STD) -> None:
        # Set before nn.Linear.__init__, which calls reset_parameters().
        self.init_std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02) (GPT-2) instead of torch's N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = _Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = _Linear(config.n_embd, config.n_embd, bias=config.bias, std=_residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: n_embd -> 4*n_embd -> GELU -> n_embd."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = _Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = _Linear(4 * config.n_embd, config.n_embd, bias=config.bias, std=_residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``: the unit to wrap."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT language model: embeddings, ``n_layer`` :class:`Block` s, final LayerNorm, output projection.

    Submodules (and so parameter names): ``wte``, ``wpe``, ``drop``, ``blocks.<i>``, ``ln_f``,
    ``lm_head``. With ``tie_weights`` the shared parameter is listed once by ``named_parameters()``, as
    ``wte.weight``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # Registration order = construction order = the order reset_parameters() draws random numbers in
        # when the modules are walked, which keeps meta-device materialisation equal to a normal init.
        self.config = config
        self.wte, self.wpe, self.drop = _embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # No bias on the output projection: it would be the one untied piece of a tied head.
        self.lm_head = _Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``wte.weight`` the very Parameter of ``lm_head.weight`` (no-op unless ``tie_weights``). In this
        direction, as lm_head is reset last, the shared weight ends with its draw however the model was built."""
        if self.config.tie_weights:
            self.wte.weight = self.lm_head.weight

    def reset_parameters(self) -> None:
        """Restore the weight tie, which ``Module.to_empty()`` undoes; like torch's modules, it does not recurse."""
        self.tie_weights()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, loss)`` for token ids ``idx`` (B, T): logits (B, T, vocab_size) and the mean cross entropy
        against ``targets`` in float32, or ``None`` without targets."""
        x = _embed(self, idx)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, (next_token_loss(logits, targets) if targets is not None else None)

    def num_parameters(self) -> int:
        """Number of parameter elements, counting a tied weight once (see the module docstring)."""
        return sum(p.numel() for p in self.parameters())


def _residual_std(config: GPTConfig) -> float:
    # Two residual branches (attention, MLP) per block add to the stream: GPT-2 scales their output
    # projections by 1/sqrt(2 * n_layer).
    return _INIT_STD / math.sqrt(2 * config.n_layer)


class Embeddings(nn.Module):
    """Token plus position embeddings and dropout, as one module: the first piece of :class:`PipelineGPT`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte, self.wpe, self.drop = _embeddings(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self, idx)


def _embeddings(config: GPTConfig) -> tuple[_Embedding, _Embedding, nn.Dropout]:
    """``wte``, ``wpe`` and ``drop`` of a module that embeds (built in this order: see ``GPT.__init__``)."""
    return (
        _Embedding(config.vocab_size, config.n_embd),
        _Embedding(config.block_size, config.n_embd),
        nn.Dropout(config.dropout),
    )


def _embed(module: GPT | Embeddings, idx: torch.Tensor) -> torch.Tensor:
    T = idx.shape[1]
    if T > module.config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {module.config.block_size}")
    return module.drop(module.wte(idx) + module.wpe(torch.arange(T, device=idx.device)))


class PipelineGPT(nn.Module):
    """:class:`GPT` written as a chain over its pieces (``embed``, ``blocks.<i>``, ``ln_f``, ``lm_head``), so that
    pipeline parallelism can cut it anywhere (docs/pipeline.md): ``GPT.forward`` adds two pieces' outputs
    (``wte(idx) + wpe(pos)``), which only one module may do. Returns the logits only; ``tie_weights`` is refused,
    since stages on different ranks cannot share the embedding with the head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.tie_weights:
            raise ValueError(
                "PipelineGPT needs GPTConfig(tie_weights=False): the embedding and head are on two stages."
            )
        self.config = config
        self.embed = Embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = _Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position, in float32: under a low-precision param dtype a bf16 log-softmax
    loses too much."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
