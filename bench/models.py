"""The models planning is measured and tested on: an MLP, a small GPT, an embedding-heavy
GPT and one with tied weights. Plain ``nn.Sequential`` pieces with Llama's linear names (the
planner's own stand-in's, :mod:`meshbook.mesh.rank.probe`), so every family (DDP, FSDP,
HSDP, TP, PP) applies; each factory is module-level, so ranks and planner processes import it
by name. And nanoGPT's blocks, whose fused ``c_attn`` tensor parallelism cannot split."""

from __future__ import annotations

import torch
from torch import nn

from meshbook.mesh.rank.probe import Residual, gpt


def mlp(dim: int = 256, layers: int = 4, features: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, dim), *[Residual(dim) for _ in range(layers)], nn.Linear(dim, features))


def embedding_heavy() -> nn.Sequential:
    return gpt(vocab=8192, dim=128, layers=2)


def tied() -> nn.Sequential:
    return gpt(tied=True)


class FusedAttention(nn.Module):
    """nanoGPT's attention: one linear (``c_attn``) makes queries, keys and values."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p.view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in self.c_attn(x).split(d, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class FusedBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = FusedAttention(dim, heads)
        self.mlp = nn.Sequential()
        self.mlp.c_fc, self.mlp.act, self.mlp.c_proj = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def fused_qkv(vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab, dim), *[FusedBlock(dim, heads) for _ in range(layers)],
                         nn.Linear(dim, vocab))
