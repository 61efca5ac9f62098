"""Parallel layouts: what a plan is, which ones exist for a model, and why the others do not.

A :class:`Layout` is one way to run a model on a mesh: degrees of data parallelism (replicated
and sharded), tensor parallelism and pipeline stages, activation checkpointing, micro-batches
and FSDP's reshard-after-forward. The controller enumerates them, the planner processes trace
them and the ranks apply them, so the type lives here, pure (no torch): :func:`candidates` is
unit-tested without a process, and a layout is dropped before any tracing with the reason a
user can act on (``tp 4 > 2 GPUs per host``, ``24 heads not divisible by tp 5``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from .errors import MeshError, whole

#: Activation checkpointing: none, every block, or every other block (torchtitan's "selective
#: layer" policy: half the recompute for part of the saving).
CHECKPOINTING = ("none", "block", "selective")
#: Pipeline schedules, by the names ``torch.distributed.pipelining`` gives them.
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
#: The optimizers named by a string (else a function ``params -> Optimizer``).
OPTIMIZERS = ("adamw", "adam", "sgd")
#: The mesh dimensions a layout uses, outermost first (torchtitan's order: pipeline stages
#: furthest apart, tensor parallelism within a host).
DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """One candidate: degrees, checkpointing, micro-batches and resharding."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    checkpointing: str = "none"
    #: Micro-batches per step; 0 (not given): one per pipeline stage, the fewest 1F1B takes.
    microbatches: int = 0
    schedule: str = "1f1b"
    reshard: bool = True

    def __post_init__(self) -> None:
        if self.microbatches == 0:
            object.__setattr__(self, "microbatches", self.pp)
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "microbatches"):
            value = getattr(self, name)
            degree = whole(value)
            if degree < 1:
                raise MeshError(f"Layout({name}={value!r}): give a whole number of 1 or more")
            object.__setattr__(self, name, degree)  # a plain int: a layout is hashed and compared
        if self.checkpointing not in CHECKPOINTING:
            raise MeshError(f"Layout(checkpointing={self.checkpointing!r}): choose from {', '.join(CHECKPOINTING)}")
        if self.schedule not in SCHEDULES:
            raise MeshError(f"Layout(schedule={self.schedule!r}): choose from {', '.join(SCHEDULES)}")

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dims(self) -> dict[str, int]:
        """The named mesh dimensions this layout runs on (degree 1 left out; at least one)."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        named = {name: sizes[name] for name in DIM_ORDER if sizes[name] > 1}
        return named or {"dp_shard": 1}

    @property
    def family(self) -> str:
        """What a user calls it: DDP, FSDP, HSDP, TP, PP or a mix (``FSDP+TP``)."""
        parts = []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append("HSDP")
        elif self.dp_shard > 1:
            parts.append("FSDP")
        elif self.dp_replicate > 1:
            parts.append("DDP")
        if self.tp > 1:
            parts.append("TP")
        if self.pp > 1:
            parts.append(f"PP-{self.schedule.upper()}")
        return "+".join(parts) or "1 rank"

    def describe(self) -> str:
        degrees = " ".join(f"{k}={v}" for k, v in self.dims.items())
        extra = [f"ac={self.checkpointing}"]
        if self.pp > 1:
            extra.append(f"{self.microbatches} micro-batches")
        if self.dp_shard > 1 and not self.reshard:
            extra.append("no reshard")
        return f"{self.family} ({degrees}; {', '.join(extra)})"

    def start_dims(self) -> str:
        """The ``%mesh start --dims`` that lays a mesh out for this layout."""
        return ",".join(f"{k}={v}" for k, v in self.dims.items())


@dataclass(frozen=True)
class ModelFacts:
    """What the planner read off the model (built on the meta device) to judge layouts."""

    cls: str
    params: int
    param_bytes: int
    #: The repeated blocks (a ``ModuleList`` of one class): their path, count and class.
    blocks: str | None = None
    n_blocks: int = 0
    #: The model is a sequence of its children (``nn.Sequential``): stages are slices of it;
    #: else (or weights tied across pieces) why pipelining cannot cut it.
    stages: int = 0
    #: How many parameters each of those pieces holds (a stage of none has nothing to train).
    piece_params: tuple[int, ...] = ()
    pp_reason: str = ""
    #: Tensor parallelism: why not ("" when it can), and the sizes tp must divide.
    tp_reason: str = "repeated blocks (a ModuleList of one class); none found"
    tp_divides: tuple[tuple[str, int], ...] = ()
    #: The input is token ids below ``vocab`` (the first module is an embedding), else floats.
    vocab: int | None = None
    #: The features of the first layer (a float input's last dimension).
    in_features: int | None = None


@dataclass(frozen=True)
class Rejected:
    """A layout dropped before tracing, and why."""

    layout: Layout
    reason: str


@dataclass
class Candidates:
    """The layouts worth tracing, and the ones dropped with their reasons."""

    valid: list[Layout] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


def factorisations(world: int) -> Iterator[tuple[int, int, int, int]]:
    """Every (pp, dp_replicate, dp_shard, tp) whose product is ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for pp in divisors:
        for dpr in divisors:
            for dps in divisors:
                rest = pp * dpr * dps
                if world % rest == 0:
                    yield pp, dpr, dps, world // rest


def why_not_optimizer(optimizer: object) -> str:
    """Why ``optimizer`` names no optimizer ("" when it does, or is a function making one)."""
    if (callable(optimizer) and not isinstance(optimizer, str)) or str(optimizer).lower() in OPTIMIZERS:
        return ""
    return (f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)} or a function "
            f"params -> torch.optim.Optimizer")


def why_unbuildable(layout: Layout, facts: ModelFacts) -> str:
    """Why ``layout`` cannot be applied to this model at all ("" when it can): what
    ``parallelize`` refuses, and the first thing ``plan`` checks."""
    if layout.tp > 1:
        if facts.tp_reason:
            return f"tp needs {facts.tp_reason}"
        for what, size in facts.tp_divides:
            if size % layout.tp:
                return f"{what} {size} not divisible by tp {layout.tp}"
    if layout.pp > 1:
        if facts.pp_reason:
            return f"pp needs {facts.pp_reason}"
        if layout.pp > facts.stages:
            return f"pp {layout.pp} > {facts.stages} pieces to split into stages"
        for stage, (start, stop) in enumerate(split_points(facts.stages, layout.pp)):
            if facts.piece_params and not sum(facts.piece_params[start:stop]):
                return (f"pp {layout.pp} makes stage {stage} (pieces {start}-{stop - 1}) one without "
                        f"parameters: nothing to train there")
        if layout.schedule == "1f1b" and layout.microbatches < layout.pp:
            return (f"pp {layout.pp} with {layout.microbatches} micro-batches: torch's 1F1B schedule needs at "
                    f"least one per stage (microbatches={layout.pp} or more, or schedule='gpipe')")
    if layout.checkpointing != "none" and not facts.blocks:
        return "activation checkpointing needs repeated blocks (a ModuleList of one class)"
    return ""


def why_invalid(layout: Layout, facts: ModelFacts, batch: int, per_host: int) -> str:
    """Why ``layout`` cannot run this model on this mesh ("" when it can)."""
    reason = why_unbuildable(layout, facts)
    if reason:
        return reason
    if layout.tp > per_host:
        return f"tp {layout.tp} > {per_host} ranks per host (tensor parallelism stays within a host)"
    if batch % layout.dp:
        return f"batch {batch} not divisible by dp {layout.dp}"
    local = batch // layout.dp
    if local % layout.microbatches:
        return f"batch per data-parallel rank {local} not divisible by {layout.microbatches} micro-batches"
    return ""


def candidates(world: int, facts: ModelFacts, batch: int, per_host: int) -> Candidates:
    """Every layout of ``world`` ranks for this model, split into valid and rejected.

    Checkpointing is tried only where there are blocks to checkpoint; micro-batches
    {pp, 2pp, 4pp} and both schedules only with pipeline stages; reshard-after-forward off
    only where parameters are sharded.
    """
    out = Candidates()
    for pp, dpr, dps, tp in factorisations(world):
        base = Layout(dp_replicate=dpr, dp_shard=dps, tp=tp, pp=pp)
        for layout in _variants(base, facts):
            reason = why_invalid(layout, facts, batch, per_host)
            if reason:
                out.rejected.append(Rejected(layout, reason))
            else:
                out.valid.append(layout)
    # One reason per family and degrees is enough to read: drop variants of a rejected base.
    seen: set[tuple[int, int, int, int, str]] = set()
    kept = []
    for r in out.rejected:
        key = (r.layout.pp, r.layout.dp_replicate, r.layout.dp_shard, r.layout.tp, r.reason)
        if key not in seen:
            seen.add(key)
            kept.append(r)
    out.rejected = kept
    return out


def _variants(base: Layout, facts: ModelFacts) -> Iterator[Layout]:
    checkpointing = CHECKPOINTING if facts.blocks else ("none",)
    micro = [base.pp * k for k in (1, 2, 4)] if base.pp > 1 else [1]
    schedules = tuple(SCHEDULES) if base.pp > 1 else ("1f1b",)
    reshard = (True, False) if base.dp_shard > 1 else (True,)
    for ac in checkpointing:
        for m in micro:
            for schedule in schedules:
                for r in reshard:
                    yield replace(base, checkpointing=ac, microbatches=m, schedule=schedule, reshard=r)


def warm_up_layouts(layouts: list[Layout]) -> tuple[Layout, ...]:
    """A few of ``layouts`` that between them use every parallelism any of them uses
    (replicas, shards, both at once, tensor parallelism and each kind of data parallelism
    under it, each pipeline schedule), the widest first; one rank's left out: what the
    ranks run once before they are measured (:mod:`meshbook.mesh.rank.probe`). A pipeline
    stage is parallelized as a whole model is, so pipelining pairs with nothing. One layout
    of each family took ~0.4 s a family on 4 ranks of a small machine, 14 families for a
    4-rank GPT."""
    def uses(layout: Layout) -> frozenset[str]:
        replicate, shard, tp = layout.dp_replicate > 1, layout.dp_shard > 1, layout.tp > 1
        found = {"replicate": replicate, "shard": shard, "tp": tp, "hsdp": replicate and shard,
                 "replicate tp": replicate and tp, "shard tp": shard and tp, f"pp {layout.schedule}": layout.pp > 1}
        return frozenset(name for name, used in found.items() if used)

    chosen: list[Layout] = []
    left = frozenset().union(*(uses(layout) for layout in layouts))
    while left:
        best = max(layouts, key=lambda layout: len(uses(layout) & left))  # the first of the widest
        chosen.append(best)
        left -= uses(best)
    return tuple(chosen)


def bubble(layout: Layout) -> float:
    """The pipeline bubble's share of a step: (pp - 1) / (m + pp - 1)."""
    return (layout.pp - 1) / (layout.microbatches + layout.pp - 1) if layout.pp > 1 else 0.0


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe, and
    ``pp - stage`` under 1F1B (the first stage holds the most)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.microbatches
    return min(layout.microbatches, layout.pp - stage)


def stage_of(layout: Layout, rank: int) -> int:
    """The pipeline stage of ``rank`` (ranks laid out row-major over :data:`DIM_ORDER`)."""
    return rank // (layout.world // layout.pp)


def split_points(n: int, pp: int) -> list[tuple[int, int]]:
    """``n`` pieces into ``pp`` contiguous stages, as even as they go: [(start, stop), ...]."""
    base, extra = divmod(n, pp)
    out, start = [], 0
    for s in range(pp):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out
