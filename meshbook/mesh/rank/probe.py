"""What planning measures on a rank (:func:`probe`): the process's overhead, its training
FLOP/s, the collectives' bandwidth and latency, after each kind of layout the plan may apply
has run once on a tiny stand-in model (:func:`warm_up`).

A layout's first step pages in torch's code for it: about 10 MiB of ``libtorch`` for a
tensor-parallel step (DTensor's dispatch and sharding rules), a few MiB for FSDP or a
pipeline. On a CPU rank those pages count in the RSS a budget is checked against, they stay,
and no memory tracker sees them: a plan measured its overhead before they were there and fell
short by them (4-5% on a small FSDP+TP model). Measured after this warm-up, the overhead holds
them, as does every rank that then runs the layout. Only on CPU: on CUDA the budget is free
device memory, which pages do not touch, and NCCL would keep a communicator (device memory)
for every mesh warmed. The stand-in has every kind of layer a
plan shards: an embedding, attention and an MLP with Llama's projection names, norms and a
head, as a sequence of pieces a pipeline splits. The benchmark's models are built of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..protocol.errors import MeshError
from ..protocol.layout import Layout
from . import parallel

#: The stand-in's vocabulary, tokens per sample and width per attention head.
VOCAB, TOKENS, HEAD_DIM = 64, 8, 16


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


def gpt(vocab: int = 512, dim: int = 128, layers: int = 4, heads: int = 4, tied: bool = False) -> nn.Sequential:
    """Embedding, ``layers`` blocks, a norm and the head (sharing the embedding's weight when
    ``tied``), as one sequence."""
    model = nn.Sequential(nn.Embedding(vocab, dim), *[Block(dim, heads) for _ in range(layers)],
                          nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False))
    if tied:
        model[-1].weight = model[0].weight
    return model


def standin(layout: Layout) -> nn.Sequential:
    """The smallest stand-in ``layout`` applies to: a head per tensor-parallel rank, a block
    per pipeline stage (two at least)."""
    return gpt(VOCAB, HEAD_DIM * layout.tp, max(2, layout.pp), layout.tp)


def warm_up(device: Any, layouts: Iterable[Layout], meshes: Callable[[Layout, str], Any]) -> None:
    """Two steps of each layout on :func:`standin`, on the mesh ``parallelize`` will use for
    it (``meshes``: :func:`meshbook.mesh.rank.parallel.mesh_for`, whose process groups are
    made once). Building seeds the rank's random state (:func:`probe` restores it)."""
    import gc

    import torch.distributed as dist

    device = torch.device(device)
    rank = dist.get_rank()
    for layout in layouts:
        try:
            built = parallel.build(partial(standin, layout), layout, meshes(layout, device.type), rank, device=device)
            tokens = torch.randint(0, VOCAB, (layout.microbatches if layout.pp > 1 else 1, TOKENS)).to(device)
            for _ in range(2):
                built.step(tokens, tokens)
        except Exception as exc:
            raise MeshError(f"plan: running {layout.describe()} on a {VOCAB}-token stand-in before measuring "
                            f"the ranks failed: {type(exc).__name__}: {exc}") from exc
        del built
        gc.collect()


def probe(device: Any, factory: Callable[[], nn.Module], layouts: tuple[Layout, ...],
          meshes: Callable[[Layout, str], Any]) -> dict[str, Any]:
    """What planning needs to know of this rank, measured on it, under the allocator its
    steps will run with (``parallel.settle_allocator``): the bytes the process holds after
    building the model on the meta device (what it imports: transformers alone is ~60 MiB), a
    small training step, an all-reduce and ``layouts`` run on a stand-in (:func:`warm_up`, on
    ``meshes(layout, device_type)``): torch, autograd's threads, the communicator and the
    code each layout pages in, what no tracker sees; what one more process group costs it; the
    FLOP/s a training step of a small MLP block reaches (its norm, activation and optimizer
    included: a matmul's peak rate would promise too much); the all-reduce bus bandwidth and
    the time of the smallest all-reduce; on CUDA, the free device memory (the host's share
    comes from the heartbeats)."""
    import gc

    import psutil
    import torch.distributed as dist

    device = torch.device(device)
    parallel.settle_allocator(device)
    parallel.make(factory)  # dropped at once: what stays is what its imports hold
    gc.collect()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # planning draws nothing
        flops = training_rate(device)
        if device.type == "cpu":  # code pages count in RSS only; on CUDA, NCCL would keep a communicator each
            warm_up(device, layouts, meshes)
    world = dist.get_world_size()
    payload = torch.ones(1 << 18, device=device)  # 1 MiB
    dist.all_reduce(payload)
    bandwidth = 2 * (world - 1) / world * payload.numel() * 4 / _timed(lambda: dist.all_reduce(payload), 4)
    small = torch.ones(1, device=device)
    latency = _timed(lambda: dist.all_reduce(small), 8) if world > 1 else 0.0
    before = psutil.Process().memory_info().rss
    group = dist.new_group()
    dist.all_reduce(small, group=group)
    per_group = max(0, psutil.Process().memory_info().rss - before)
    dist.destroy_process_group(group)  # measured, not kept: a plan a minute would pile them up
    found = {"flops_per_s": flops, "bandwidth": bandwidth if world > 1 else float("inf"), "latency": latency,
             "device": device.type}
    if device.type == "cuda":
        return {**found, "overhead": 0, "per_group": 0, "memory": int(torch.cuda.mem_get_info(device)[0])}
    return {**found, "overhead": psutil.Process().memory_info().rss, "per_group": per_group}


def training_rate(device: Any) -> float:
    """FLOP/s of training steps of a pre-norm MLP block with AdamW, FLOPs as the planner
    counts them (torch's FLOP counter), time the median of a few steps after a warm-up. A GPU
    is measured on a block wide enough to keep it busy: at CPU sizes its steps wait on kernel
    launches, and an H100 read 17x slower than it trains a 50M-parameter model."""
    from torch.utils.flop_counter import FlopCounterMode

    dim, tokens = (1024, 2048) if device.type == "cuda" else (256, 512)
    block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).to(device)
    opt = torch.optim.AdamW(block.parameters())
    x = torch.randn(tokens, dim, device=device)

    def step() -> None:
        block(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    times = sorted(_timed(step, 1) for _ in range(7))
    return counter.get_total_flops() / times[len(times) // 2]


def _timed(fn: Callable[[], Any], n: int) -> float:
    import time

    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n
