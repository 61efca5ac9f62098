"""Trace one layout in a throwaway process: what each traced rank allocates, computes and sends.

A process has one default process group and tracing changes global state (a fake group,
fake tensors, patched storages), so the planner never traces in the kernel or on a rank: the
controller starts planner processes (``python -m meshbook.mesh.planner``) and sends them jobs.
Each trace joins a fake process group as the rank it plays (a pipeline stage's first rank),
runs :func:`meshbook.mesh.rank.parallel.build` exactly as ``mesh.parallelize`` will, allocates
under fake tensors, and steps twice: under the FLOP counter, then (with the optimizer state
the first step made) under torch's memory tracker and a collective counter.
What gloo allocates inside a collective, which a fake group never does, is added to what the
tracker holds as that collective starts: a big all-gather at the step's start and a big
forward's activations never meet, so adding it to the step's peak over-predicted.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..protocol.errors import MeshError
from ..protocol.layout import Layout, ModelFacts
from ..protocol.plan import GLOO_SCRATCH, StageTrace, Trace
from ..rank import parallel, torch_compat

#: A pipeline link's tensor: the shape and dtype of what a stage sends the next (its output).
Edge = tuple[tuple[int, ...], torch.dtype]
#: The tracker's kinds (both trackers' names) -> the report's.
KIND_OF = {"Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
           "Buffer": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients",
           "Unsharded Grad": "gradients", "Optstate": "optimizer", "OptState": "optimizer",
           "Activation": "activations", "Temp": "temporaries", "All Gather": "temporaries",
           "Reduce Scatter": "temporaries", "Inputs": "activations"}


def inspect(factory: Callable[[], nn.Module]) -> ModelFacts:
    return parallel.inspect(parallel.make(factory))


def trace(factory: Callable[[], nn.Module], layout: Layout, facts: ModelFacts, batch: tuple[int, ...],
          optimizer: Any, device_type: str = "cpu") -> Trace:
    """Trace every pipeline stage of ``layout`` (one without pipelining) for ranks on
    ``device_type`` (traced on the CPU all the same: it picks the optimizer's implementation)."""
    started = time.perf_counter()
    stages = []
    try:
        inputs = None
        for stage in range(layout.pp):
            rank = stage * (layout.world // layout.pp)
            traced, inputs = trace_stage(factory, layout, facts, batch, optimizer, rank, inputs, device_type)
            stages.append(traced)
    except torch_compat.untraceable_errors() as exc:
        return Trace(layout, (analytic(facts, layout, optimizer),), time.perf_counter() - started,
                     untraceable=f"{exc.func}")  # type: ignore[attr-defined]
    except MeshError:
        raise
    except Exception as exc:
        return Trace(layout, (), time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}"[:300])
    return Trace(layout, tuple(stages), time.perf_counter() - started)


def analytic(facts: ModelFacts, layout: Layout, optimizer: Any) -> StageTrace:
    """Model state from the parameter count, where fake tensors cannot run the model (an op
    whose output shape depends on the data): parameters and gradients split over the ranks
    that shard them, and AdamW's two moments (none for plain SGD). Activations are unknown."""
    share = facts.param_bytes // (layout.dp_shard * layout.tp * layout.pp)
    moments = 0 if str(optimizer).lower() == "sgd" else 2
    state = {"parameters": share, "gradients": share, "optimizer": moments * share}
    return StageTrace(stage=0, rank=0, peak=state)


def trace_stage(factory: Callable[[], nn.Module], layout: Layout, facts: ModelFacts, batch: tuple[int, ...],
                optimizer: Any, rank: int, inputs: Edge | None, device_type: str) -> tuple[StageTrace, Edge]:
    """Trace the stage ``rank`` plays. ``inputs``: the shape and dtype of the previous stage's
    output (None for the first); returns this stage's, for the next."""
    torch_compat.init_fake_group(rank, layout.world)
    mesh = parallel.layout_mesh(layout, "cpu")
    mode = torch_compat.fake_tensors()

    def materialize(model: nn.Module) -> None:
        with mode:
            parallel.allocate(model, "cpu")

    built = parallel.build(factory, layout, mesh, rank, optimizer=optimizer, materialize=materialize,
                           step_device=device_type)
    with mode:
        x, y = parallel.example_batch(facts, batch, layout)
        if layout.pp > 1:
            micro = x.shape[0] // layout.microbatches
            if built.stage == 0 or inputs is None:
                x = x[:micro]
            else:
                x = torch.empty(inputs[0], dtype=inputs[1], requires_grad=True)
            y = y[:micro] if y is not None else None
        # The first step counts FLOPs, without the memory tracker: the FLOP counter's module
        # hooks hold a step's outputs longer (a peak up to 2x the activations on a big batch).
        flops = torch_compat.local_flop_counter()
        with flops:
            _, out = built.local_step(x, y)
        # The second, with the optimizer state the first made, is tracked from a tracker made
        # now (it takes the state as it finds it), with its collectives counted.
        tracker = torch_compat.memory_tracker(built.model, built.optimizer, fsdp=layout.dp_shard > 1)
        held: list[int] = []  # activations held for backward, read after the forward
        at_collective: dict[str, int] = {}
        scratch = 0  # gloo's, for the biggest collective

        def after_forward() -> None:
            now = _by_kind(tracker.get_tracker_snapshot("current"))
            held.append(now.get("activations", 0) + now.get("temporaries", 0))  # the loss is no module's

        def collective(kind: str, size: int) -> None:
            nonlocal scratch
            extra = int(GLOO_SCRATCH.get(kind, 0) * size)
            if not extra:  # what is held then is no more than the tracker's own peak
                return
            scratch = max(scratch, extra)
            now = _by_kind(tracker.get_tracker_snapshot("current"))
            now["temporaries"] = now.get("temporaries", 0) + extra
            if sum(now.values()) > sum(at_collective.values()):
                at_collective.clear()
                at_collective.update(now)

        comm = torch_compat.collective_counter(collective)
        with tracker, comm:  # micro-batches in flight only matter to a pipeline
            built.local_step(x, y, after_forward if layout.pp > 1 else None)
        at_rest = _by_kind(tracker.get_tracker_snapshot("current"))  # the optimizer's state, no step's
        peak = _by_kind(tracker.get_tracker_snapshot("peak"))
    traced = StageTrace(stage=built.stage, rank=rank, peak=peak, at_rest=at_rest,
                        microbatch_activations=max(held, default=0),
                        at_collective=at_collective, scratch=scratch, flops=float(flops.get_total_flops()),
                        comm=dict(comm.bytes), collectives=comm.calls)
    return (_pipelined(traced, inputs, out, layout, built.last) if layout.pp > 1 else traced), out


def _pipelined(traced: StageTrace, inputs: Edge | None, out: Edge, layout: Layout, last: bool) -> StageTrace:
    """A micro-batch's trace scaled to the step: every micro-batch computes, and for each a
    stage receives its input and sends back its gradient (but the first stage), and sends its
    output and receives back its gradient (but the last). Both ends of a link spend its time:
    counted on the sending stage only, the last stage (often the one with the most FLOPs: the
    head and the loss) was priced with no traffic at all."""
    comm, calls = dict(traced.comm), traced.collectives * layout.microbatches
    for shape, dtype in [*([inputs] if inputs is not None else []), *([out] if not last else [])]:
        comm["p2p"] = comm.get("p2p", 0) + 2 * math.prod(shape) * dtype.itemsize * layout.microbatches
        calls += 2 * layout.microbatches
    return replace(traced, flops=traced.flops * layout.microbatches, comm=comm, collectives=calls)


def _by_kind(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for per_device in snapshot.values():
        for kind, n in per_device.items():
            name = KIND_OF.get(getattr(kind, "value", str(kind)))
            if name is not None:
                out[name] += n
    return dict(out)
