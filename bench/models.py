"""The models planning is measured and tested on: an MLP, a small GPT, an embedding-heavy
GPT and one with tied weights. Plain ``nn.Sequential`` pieces with Llama's linear names, so
every family (DDP, FSDP, HSDP, TP, PP) applies; each factory is module-level, so ranks and
planner processes import it by name."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Residual(nn.Module):
    """An MLP block: up, GELU, down, added to its input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, 4 * dim)
        self.down_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections; heads from the shapes, so a
    tensor-parallel shard runs its share of heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), Residual(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return self.mlp(self.ln2(x))


def mlp(dim: int = 256, layers: int = 4, features: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, dim), *[Residual(dim) for _ in range(layers)], nn.Linear(dim, features))


def gpt(vocab: int = 512, dim: int = 128, layers: int = 4, heads: int = 4, tied: bool = False) -> nn.Sequential:
    model = nn.Sequential(nn.Embedding(vocab, dim), *[Block(dim, heads) for _ in range(layers)],
                          nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False))
    if tied:
        model[-1].weight = model[0].weight
    return model


def embedding_heavy() -> nn.Sequential:
    return gpt(vocab=8192, dim=128, layers=2)


def tied() -> nn.Sequential:
    return gpt(tied=True)
