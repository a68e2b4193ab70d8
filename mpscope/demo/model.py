"""A small GPT-style character-level transformer built from PyTorch's own modules.

It is the embedded default model of ``mpscope demo`` and the "small GPT" of
``benchmarks/overhead.py``. Every numeric step a profiler should see is its own module, so that the
recorder's forward hooks name it: the q/k/v projections are separate ``nn.Linear`` layers, the
masked attention softmax is a :class:`CausalSoftmax` module and the MLP's activation an ``nn.GELU``.

Shapes: input ``idx`` is ``(batch, seq)`` int64 token ids with ``seq <= config.seq_len``; the model
returns logits ``(batch, seq, vocab_size)`` (float32 outside autocast, the autocast dtype inside it)
and, when ``targets`` (``(batch, seq)`` int64) is given, also the mean cross-entropy loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Size of a :class:`GPT`.

    ``vocab_size``: number of distinct tokens (characters). ``d_model``: width of the residual
    stream, must be divisible by ``n_head``. ``n_layer``: transformer blocks. ``n_head``: attention
    heads per block. ``seq_len``: longest sequence (size of the position embedding and of the causal
    mask). ``mlp_ratio``: hidden width of the MLP as a multiple of ``d_model`` (4 as in GPT-2).
    ``dropout``: dropout probability after the attention softmax and the residual branches (0 turns
    dropout off, which keeps runs bitwise reproducible).
    """

    vocab_size: int
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"pick e.g. n_head={math.gcd(self.d_model, self.n_head)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSoftmax(nn.Module):
    """Softmax over the last dimension of attention scores with future positions masked.

    Input ``(..., t, t)`` raw scores (finite), output the attention probabilities of the same shape;
    position ``j > i`` is set to -inf before the softmax, so its probability is exactly 0. The mask
    lives inside the module so that the module's input and output are both finite (tools that hook
    module inputs, like ``transformers.debug_utils.DebugUnderflowOverflow``, abort on an inf input).
    """

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future", mask, persistent=False)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        t = scores.shape[-1]
        return torch.softmax(scores.masked_fill(self.future[:t, :t], float("-inf")), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with explicit q/k/v projections.

    scores = q kᵀ / sqrt(head_dim), future positions set to -inf (so the softmax gives them exactly
    0), softmax over the last dimension, optional dropout, weighted sum of v, output projection.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.q = nn.Linear(config.d_model, config.d_model)
        self.k = nn.Linear(config.d_model, config.d_model)
        self.v = nn.Linear(config.d_model, config.d_model)
        self.softmax = CausalSoftmax(config.seq_len)
        self.attn_drop = nn.Dropout(config.dropout)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, c) -> (b, n_head, t, head_dim)
        q = self.q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = self.attn_drop(self.softmax(scores))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    """Linear(d, r·d) → GELU → Linear(r·d, d) (→ dropout)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.resid_drop = nn.Dropout(config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, ``n_layer`` :class:`Block` s, final LayerNorm, LM head.

    Weights are initialised as in GPT-2 (normal, std 0.02; biases 0; the residual output
    projections scaled by 1/sqrt(2·n_layer)), so the logits start near uniform and the first loss is
    close to ln(vocab_size).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.out.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits ``(batch, seq, vocab)``, or ``(logits, loss)`` when ``targets`` is given.

        Raises ``ValueError`` if ``idx`` is not 2-D or longer than ``config.seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, seq), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence length {t} exceeds GPTConfig.seq_len={self.config.seq_len}; "
                "build the model with a larger seq_len or feed shorter sequences"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss
