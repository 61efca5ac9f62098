"""The models planning is measured and tested on: an MLP, a small GPT, an embedding-heavy
GPT and one with tied weights. Plain ``nn.Sequential`` pieces with Llama's linear names (the
planner's own stand-in's, :mod:`meshbook.mesh.rank.probe`), so every family (DDP, FSDP,
HSDP, TP, PP) applies; each factory is module-level, so ranks and planner processes import it
by name."""

from __future__ import annotations

from torch import nn

from meshbook.mesh.rank.probe import Residual, gpt


def mlp(dim: int = 256, layers: int = 4, features: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, dim), *[Residual(dim) for _ in range(layers)], nn.Linear(dim, features))


def embedding_heavy() -> nn.Sequential:
    return gpt(vocab=8192, dim=128, layers=2)


def tied() -> nn.Sequential:
    return gpt(tied=True)
