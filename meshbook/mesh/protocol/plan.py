"""What planning measures and predicts, and the pure arithmetic from one to the other.

A planner process traces a layout and returns a :class:`Trace` (bytes by kind at this rank's
peak, FLOPs, bytes sent by collective); the ranks return a :class:`Probe` (process overhead,
compute rate, bandwidth, memory budget). :func:`predict` turns the two into a :class:`Row` of
the report: per-rank peak by kind, step time by part, and a status with its reason. Everything
here is data and arithmetic, so the report is unit-tested without a process.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import cloudpickle

from .layout import Layout, bubble, in_flight
from .text import format_bytes

#: The kinds of memory a row splits its peak into, in the order the report shows them.
KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "overhead")
#: The share of a CUDA device's reserved memory the caching allocator loses to fragmentation.
CUDA_FRAGMENTATION = 0.05
#: What gloo allocates inside a collective, as a share of its full size (measured: an
#: all-gather stages its whole output, a reduce-scatter a third more than its input): memory a
#: fake process group never allocates, added to what is held as the collective starts.
GLOO_SCRATCH = {"all_gather": 1.0, "reduce_scatter": 4 / 3, "all_reduce": 0.13}
#: The share of a checkpointed step's FLOPs spent recomputing forwards (forward : backward is
#: 1 : 2, so all blocks recomputed add 1 to 3, and every other block 0.5 to 3).
RECOMPUTED = {"none": 0.0, "block": 1 / 4, "selective": 1 / 7}
#: How much of a rank's free memory a plan may fill by default.
BUDGET_SHARE = 0.9


@dataclass(frozen=True)
class StageTrace:
    """One pipeline stage (the only one without pipelining), traced on its first rank."""

    stage: int
    rank: int
    #: Bytes by kind at the traced peak (KINDS but overhead), and the peak's total.
    peak: dict[str, int]
    #: With pipelining: what one micro-batch holds for its backward (activations, the output
    #: and on the last stage the loss's graph), multiplied by those in flight.
    microbatch_activations: int = 0
    #: Bytes by kind between steps (the optimizer's state, without its step's temporaries).
    at_rest: dict[str, int] = field(default_factory=dict)
    flops: float = 0.0
    #: Bytes by collective: all_gather, reduce_scatter, all_reduce, p2p.
    comm: dict[str, int] = field(default_factory=dict)
    #: Bytes by kind as the collective starts at which they, with gloo's scratch for it
    #: (GLOO_SCRATCH, in temporaries), peak: a CPU rank's peak when above ``peak``.
    at_collective: dict[str, int] = field(default_factory=dict)
    #: gloo's scratch for the step's biggest collective: with pipelining, on top of the
    #: micro-batches in flight (their stage's collectives run while the others wait).
    scratch: int = 0
    #: How many collectives (and point-to-point messages) one step issues.
    collectives: int = 0


@dataclass(frozen=True)
class Trace:
    """A layout's trace, or why it has none (``untraceable``: the op that stopped it, and an
    analytic estimate of model state stands in)."""

    layout: Layout
    stages: tuple[StageTrace, ...]
    seconds: float
    untraceable: str = ""
    error: str = ""


@dataclass(frozen=True)
class Probe:
    """What the ranks measured of themselves: bytes each process holds besides the model
    (torch, its threads, the communicator), FLOP/s, bus bandwidth, the time of the smallest
    collective, and the memory budget."""

    overhead: int
    flops_per_s: float
    bandwidth: float
    budget: int
    latency: float = 0.0
    #: The bytes one more process group costs a rank (gloo: its buffers and threads); a layout
    #: makes one per mesh dimension.
    per_group: int = 0
    device: str = "cpu"
    calibrated: bool = True


@dataclass
class Row:
    """One candidate in the report."""

    layout: Layout
    memory: dict[str, int]
    worst_rank: int
    time: dict[str, float]
    status: str
    reason: str = ""
    traced_s: float = 0.0
    #: Each pipeline stage's predicted peak (stage 0 alone without pipelining).
    stage_peaks: dict[int, int] = field(default_factory=dict)
    #: The optimizer it was planned with (a name, or the notebook's function that makes one):
    #: what ``parallelize`` builds for it unless told otherwise.
    optimizer: Any = "adamw"

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    @property
    def summary(self) -> str:
        """The reason's first line: a traceback's error, in a table's cell."""
        return self.reason.splitlines()[0] if self.reason else ""

    @property
    def fits(self) -> bool:
        """Predicted to fit the budget (the fastest, a dominated one or an estimate)."""
        return self.status in ("OK", "DOMINATED", "UNTRACEABLE")


def stage_peak(stage: StageTrace, layout: Layout, gloo: bool = False) -> dict[str, int]:
    """A stage's peak by kind. With pipelining, the larger of the traced peak (one micro-batch:
    often the optimizer step) and the stage's state between steps, its gradients and what every
    micro-batch the schedule keeps in flight (:func:`in_flight`) holds for its backward (with
    ``gloo``, and gloo's scratch for the stage's biggest collective). On gloo, the moment
    a collective starts (``at_collective``) when higher still."""
    peak = {k: stage.peak.get(k, 0) for k in KINDS if k != "overhead"}
    if layout.pp > 1:
        flight = {k: stage.at_rest.get(k, peak[k]) for k in peak}
        flight["gradients"] = peak["gradients"]
        flight["activations"] = stage.microbatch_activations * in_flight(layout, stage.stage)
        flight["temporaries"] += stage.scratch if gloo else 0
        if sum(flight.values()) > sum(peak.values()):
            peak = flight
    if gloo and sum(stage.at_collective.values()) > sum(peak.values()):
        peak = {k: stage.at_collective.get(k, 0) for k in peak}
    return peak


def predict(trace: Trace, probe: Probe, budget: int | None = None) -> Row:
    """The report's row for ``trace`` on ranks measured by ``probe``."""
    layout = trace.layout
    budget = probe.budget if budget is None else budget
    worst, memory, stage_peaks = 0, {k: 0 for k in KINDS}, {}
    groups = len(layout.dims) if layout.world > 1 else 0
    for stage in trace.stages:
        peak = stage_peak(stage, layout, gloo=probe.device == "cpu")
        peak["overhead"] = probe.overhead + groups * probe.per_group + (
            int(sum(peak.values()) * CUDA_FRAGMENTATION) if probe.device == "cuda" else 0)
        stage_peaks[stage.stage] = sum(peak.values())
        if sum(peak.values()) > sum(memory.values()):
            worst, memory = stage.rank, peak
    row = Row(layout, memory, worst, step_time(trace, probe), "OK", traced_s=trace.seconds,
              stage_peaks=stage_peaks)
    if trace.error:
        row.status, row.reason = "INVALID", trace.error
    elif row.peak > budget:
        big = largest_part(memory)
        row.status = "OOM"
        row.reason = (f"+{format_bytes(row.peak - budget)} on rank {worst}: "
                      f"{big} {format_bytes(memory[big])}")
    elif trace.untraceable:
        row.status, row.reason = "UNTRACEABLE", f"{trace.untraceable}: analytic estimate, activations not counted"
    return row


def largest_part(memory: dict[str, int]) -> str:
    """The kind of model memory that weighs most (the process overhead is no lever)."""
    return max((k for k in KINDS if k != "overhead"), key=lambda k: memory[k])


def step_time(trace: Trace, probe: Probe) -> dict[str, float]:
    """Seconds per step by part: compute (FLOPs / rate), exposed communication (tensor
    parallel and all-reduce traffic; FSDP's all-gathers and reduce-scatters overlap compute
    and only their excess shows), the pipeline bubble, and recompute (the forwards run again
    for checkpointed blocks, already in the traced FLOPs: :data:`RECOMPUTED`)."""
    layout = trace.layout
    if not trace.stages:
        return {"compute": 0.0, "communication": 0.0, "bubble": 0.0, "recompute": 0.0}
    # A pipeline runs at its slowest stage's pace, compute and traffic together.
    compute, exposed = max((_stage_time(stage, probe) for stage in trace.stages), key=sum)
    recompute = compute * RECOMPUTED[layout.checkpointing]
    busy = compute + exposed
    return {"compute": compute - recompute, "communication": exposed,
            "bubble": busy * bubble(layout) / (1 - bubble(layout)) if layout.pp > 1 else 0.0,
            "recompute": recompute}


def _stage_time(stage: StageTrace, probe: Probe) -> tuple[float, float]:
    """A stage's compute and exposed communication, in seconds per step."""
    compute = stage.flops / probe.flops_per_s if probe.flops_per_s else 0.0
    comm = stage.comm
    overlapped = (comm.get("all_gather", 0) + comm.get("reduce_scatter", 0)) / probe.bandwidth
    exposed = ((comm.get("all_reduce", 0) + comm.get("p2p", 0)) / probe.bandwidth + max(0.0, overlapped - compute)
               + stage.collectives * probe.latency)
    return compute, exposed


def mark_dominated(rows: list[Row]) -> None:
    """A fitting row that another is no bigger and no slower than, and beats in one of the two
    (by over 1% in time: closer is a tie, not a ranking), is DOMINATED by it."""
    fitting = [r for r in rows if r.status == "OK"]
    for row in fitting:
        for other in fitting:
            if other is row or other.status != "OK" or other.peak > row.peak or other.step_s > row.step_s:
                continue
            if other.peak < row.peak or other.step_s < row.step_s * 0.99:
                row.status = "DOMINATED"
                row.reason = f"by #{rows.index(other) + 1} ({row.step_s / max(other.step_s, 1e-12):.1f}x slower)"
                break


def write_frame(stream: BinaryIO, value: Any) -> None:
    """A planner job or answer: 4 bytes of length, then a cloudpickle (a notebook-defined
    model factory travels by value)."""
    data = cloudpickle.dumps(value)
    stream.write(struct.pack("!I", len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next frame from ``stream``, or None at its end."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("!I", head)
    return cloudpickle.loads(stream.read(size))


#: The planner zygote's notes to the controller, on its socket: a planner forked (its pid and
#: the request's number), or one exited (its pid and exit code, negative for a signal, as
#: subprocess says it).
FORKED, EXITED = b"F", b"X"
ZYGOTE_NOTE = struct.Struct("<cii")
#: What the controller asks of the zygote, a message each: ``FORK\nnumber\ncwd`` (with the
#: planner's three file descriptors), ``KILL\npid\n``.
FORK, KILL = b"fork", b"kill"
