"""``mesh.plan`` and ``mesh.parallelize``: one interface for DP, FSDP, HSDP, TP and PP.

``plan`` answers "which layout fits, and which is fastest" before anything is allocated: it
measures the ranks once (process overhead, FLOP/s, bandwidth, memory; see
:func:`meshbook.mesh.rank.probe.probe`), enumerates every layout of the mesh and drops the
impossible ones with their reasons (:mod:`meshbook.mesh.protocol.layout`), traces the rest in
throwaway planner processes (:mod:`meshbook.mesh.planner`, forked by :mod:`.planners`) and turns traces into predictions
(:mod:`meshbook.mesh.protocol.plan`). ``parallelize`` then builds the chosen layout on every
rank with the very code the planner traced.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...protocol.errors import MeshError, check_bytes
from ...protocol.layout import (
    CHECKPOINTING,
    Layout,
    ModelFacts,
    Rejected,
    candidates,
    warm_up_layouts,
    why_not_optimizer,
)
from ...protocol.plan import (
    BUDGET_SHARE,
    KINDS,
    Probe,
    Row,
    Trace,
    largest_part,
    mark_dominated,
    predict,
)
from ...protocol.proc import usable_cores
from ...protocol.text import format_bytes, status_table
from ...protocol.values import RankValues
from ...rank import ops
from ..core.run import interrupted_run
from .planners import PLAN_TIMEOUT_S, Planners
from .view import MeshView

#: Seconds the ranks have to measure themselves, or to build a layout.
RANK_TIMEOUT_S = 300.0
#: Planner processes at once: tracing is CPU-bound, one per core (at most this many).
MAX_PLANNERS = 4
#: Variables the ranks hold as they are measured, from which the report says they count.
RESIDENT_NOTE_BYTES = 16 << 20
#: The report's column for each part of a peak (bytes) and of a step (milliseconds).
SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "activations": "activ",
         "temporaries": "temps", "overhead": "process", "compute": "compute", "communication": "comm",
         "bubble": "bubble", "recompute": "recomp"}


#: What a DDP row predicts (torch's ``DistributedDataParallel`` built by hand is another program).
DDP_NOTE = ("DDP rows are torch's FSDP-style replicate, what parallelize applies; DistributedDataParallel "
            "built by hand keeps its own gradient buckets (bench/: within 10% of these rows)")


def parse_batch(text: str | int | Sequence[int]) -> tuple[int, ...]:
    """``"8x2048"`` or ``(8, 2048)`` -> ``(8, 2048)``: the global batch, then its other dims
    (``8`` or ``"8"``: the batch alone, as ``--batch 8`` says it)."""
    parts = text.lower().split("x") if isinstance(text, str) else (text,) if isinstance(text, int) else text
    try:
        shape = () if isinstance(text, bool) else tuple(int(x) for x in parts)
    except (TypeError, ValueError):
        shape = ()
    if not shape or any(n <= 0 for n in shape):
        raise MeshError(f"batch {text!r}: give the global batch shape, e.g. batch=(8, 2048) or --batch 8x2048")
    return shape


# -- the report ---------------------------------------------------------------------------


@dataclass
class PlanReport:
    """Every candidate layout, predicted: ``report.best`` is the fastest that fits."""

    rows: list[Row]
    rejected: list[Rejected]
    facts: ModelFacts
    probe: Probe
    budget: int
    batch: tuple[int, ...]
    seconds: float
    notes: list[str] = field(default_factory=list)
    budget_given: bool = False

    @property
    def best(self) -> Row:
        """The fastest row not beaten by another (rows come fastest first)."""
        chosen = next((r for r in self.rows if r.status in ("OK", "UNTRACEABLE")), None)
        if chosen is None:
            raise MeshError(self.nothing_fits())
        return chosen

    def _fed(self) -> str:
        """What the traces fed the model, where a batch of the wrong shape is the likely cause."""
        shape = "x".join(map(str, self.batch))
        if self.facts.vocab is not None:
            return f" (it was fed token ids of the global shape {shape}: --batch is the batch, then a sample's shape)"
        if self.facts.in_features is not None:
            return (f" (it was fed floats of the global shape {shape}x{self.facts.in_features}: --batch {shape} is "
                    f"the batch, then a sample's shape before the first Linear's {self.facts.in_features} "
                    f"features, which are added; --batch {self.batch[0]} feeds it {self.batch[0]} samples of "
                    f"{self.facts.in_features} features)")
        return ""

    def nothing_fits(self) -> str:
        sized = [r for r in self.rows if r.status == "OOM"]
        if not sized:
            return ("no layout could be traced: " + "; ".join(sorted({r.reason for r in self.rows}))[:500]
                    + self._fed())
        overhead = self.probe.overhead
        if self.budget <= overhead:  # no lever below helps: the process alone is over the budget
            return (f"no plan fits in {format_bytes(self.budget)} per rank: a rank takes {format_bytes(overhead)} "
                    f"before it holds any of the model (Python, torch and its process group, measured on "
                    f"the ranks); give a budget above that (budget=\"8G\"; --budget 8G in %mesh plan), or "
                    f"none for {BUDGET_SHARE:.0%} of what each rank has")
        small = min(sized, key=lambda r: r.peak)
        big = largest_part(small.memory)
        if big in ("activations", "temporaries"):
            levers = (["checkpointing"] if small.layout.checkpointing != "block" else []) + [
                "more ranks", "a smaller batch"]
        else:  # the model's own state: only sharding it, or more ranks to shard it over, helps
            levers = (["sharding it (FSDP: dp_shard)"] if small.layout.dp_shard == 1 else []) + ["more ranks"] + (
                ["an optimizer with less state (sgd)"] if big == "optimizer" else [])
        if len(levers) == 1:
            return (f"no plan fits in {format_bytes(self.budget)} per rank: the smallest ({small.layout.describe()}) "
                    f"needs {format_bytes(small.peak)} on rank {small.worst_rank}, {big} "
                    f"{format_bytes(small.memory[big])}; try {levers[0]}")
        return (f"no plan fits in {format_bytes(self.budget)} per rank: the smallest ({small.layout.describe()}) "
                f"needs {format_bytes(small.peak)} on rank {small.worst_rank}, {big} "
                f"{format_bytes(small.memory[big])}; try {', '.join(levers[:-1])} or {levers[-1]}")

    def assumptions(self) -> list[str]:
        p = self.probe
        return [f"{self.facts.cls}: {self.facts.params:,} parameters, batch {'x'.join(map(str, self.batch))}",
                f"budget {format_bytes(self.budget)} per rank "
                f"({'given' if self.budget_given else f'{BUDGET_SHARE:.0%} of what each rank has'})",
                f"process overhead {format_bytes(p.overhead)} per rank, and {format_bytes(p.per_group)} per process "
                f"group a layout makes (measured on the ranks)",
                f"compute {p.flops_per_s / 1e9:.1f} GFLOP/s per rank (a training step, measured), all-reduce bus "
                f"bandwidth "
                f"{p.bandwidth / 1e9:.2f} GB/s, {p.latency * 1e6:.0f} us per collective "
                f"(measured on the ranks, {p.device})",
                f"{len(self.rows)} layouts traced in {self.seconds:.1f} s, {len(self.rejected)} dropped before tracing",
                *([DDP_NOTE] if any(r.layout.family.startswith("DDP") for r in self.rows) else []),
                *self.notes]

    def table(self) -> list[dict[str, Any]]:
        out = []
        for i, row in enumerate(self.rows, 1):
            cells: dict[str, Any] = {"#": i, "layout": row.layout.family, "degrees": row.layout.start_dims(),
                                     "ac": row.layout.checkpointing,
                                     "reshard": ("yes" if row.layout.reshard else "no") if row.layout.dp_shard > 1
                                     else "-",
                                     "mb": row.layout.microbatches if row.layout.pp > 1 else "-",
                                     "peak": format_bytes(row.peak),
                                     "budget": f"{row.peak / self.budget:.0%}" if self.budget else "-"}
            cells.update({SHORT[k]: format_bytes(row.memory[k]) for k in KINDS})
            cells["step ms"] = f"{row.step_s * 1e3:.1f}"
            cells.update({SHORT[k]: f"{v * 1e3:.1f}" for k, v in row.time.items()})
            cells["status"] = f"{row.status} {row.summary}" if row.status == "DOMINATED" else (
                f"{row.status} ({row.summary})" if row.reason else row.status)
            out.append(cells)
        return out

    def __repr__(self) -> str:
        lines = ["Plan: " + a for a in self.assumptions()[:1]] + ["  " + a for a in self.assumptions()[1:]]
        lines += ["", status_table(self.table())]
        if self.rejected:
            lines += ["", "Dropped before tracing:"]
            lines += [f"  {self._dropped(r)}" for r in self.rejected]
        return "\n".join(lines)

    @staticmethod
    def _dropped(rejected: Rejected) -> str:
        """``PP-1F1B pp=4, 16 micro-batches: ...``: a pipeline's by its micro-batches too (the same
        degrees with fewer may be in the table)."""
        lay = rejected.layout
        micro = f", {lay.microbatches} micro-batches" if lay.pp > 1 else ""
        return f"{lay.family} {lay.start_dims()}{micro}: {rejected.reason}"

    def _repr_html_(self) -> str:
        import html

        rows = self.table()
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in rows[0]) if rows else ""
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
        notes = "".join(f"<li>{html.escape(a)}</li>" for a in self.assumptions())
        dropped = "".join(f"<li>{html.escape(self._dropped(r))}</li>" for r in self.rejected)
        return (f"<div><b>Plan</b><ul>{notes}</ul><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
                f"</table>" + (f"<details><summary>Dropped before tracing ({len(self.rejected)})</summary>"
                               f"<ul>{dropped}</ul></details>" if self.rejected else "") + "</div>")


def probe(mesh: MeshView, build: Callable[[], Any], ranks_on_host: dict[int, int],
          warm: tuple[Layout, ...]) -> Probe:
    """The ranks' measurements with ``build``'s imports loaded and a step of each of ``warm``
    run, the worst rank's of each; the memory budget is each rank's share of its host's (or
    container's) memory, from the heartbeats, or its GPU's free memory."""
    values = list(_to_the_end(mesh, "plan: measuring the ranks", False, ops.plan_probe, build, warm).values())
    device = values[0]["device"]
    if device == "cuda":
        memory = min(v["memory"] for v in values)
    else:
        host_of = mesh.controller.host_of
        shares = [row.pool_limit // ranks_on_host[host_of[row.rank]] for row in mesh.memory().rows
                  if row.rank in mesh.ranks and row.pool_limit]
        if not shares:
            raise MeshError("the ranks have not reported their hosts' memory yet: give plan(..., budget=\"8G\")")
        memory = min(shares)
    return Probe(overhead=max(v["overhead"] for v in values), flops_per_s=min(v["flops_per_s"] for v in values),
                 bandwidth=min(v["bandwidth"] for v in values), latency=max(v["latency"] for v in values),
                 per_group=max(v["per_group"] for v in values), budget=int(memory * BUDGET_SHARE), device=device)


def _to_the_end(mesh: MeshView, what: str, echo: bool, fn: Callable[..., Any], *args: Any) -> RankValues:
    """``fn`` on every rank of ``mesh``, one of the operations every rank runs to its end (they
    make process groups as they go), and its values. Interrupted, it returns once the ranks
    have stopped (the step check of their failure is queued by then): what the notebook sends
    next would otherwise reach them first, and be held back behind that failure. So it waits
    after a Ctrl-C that came as the request was sent, and one that came while ``result()``
    waited without ``echo`` (which returns at once); with ``echo``, ``result()`` waits itself,
    and a Ctrl-C that gets out of it was a second one. A second Ctrl-C ends this wait too."""
    run = None
    try:
        run = mesh.controller.call(fn, *args, ranks=mesh.ranks, what=what)
        return run.result(RANK_TIMEOUT_S, echo=echo)
    except KeyboardInterrupt as exc:
        stopping = interrupted_run(exc) or (None if echo else run)
        if stopping is not None:
            with contextlib.suppress(KeyboardInterrupt):
                stopping.wait(RANK_TIMEOUT_S)
        raise


def _order(row: Row) -> tuple[int, float, int, str]:
    """Fitting rows by step time (to 0.1%), then memory; the others by memory; ties by name."""
    rank = {"OK": 0, "UNTRACEABLE": 1, "OOM": 2, "INVALID": 3}.get(row.status, 4)
    time = float(f"{row.step_s:.3g}") if rank < 2 else float(row.peak)
    return rank, time, row.peak, row.layout.describe()


# -- mesh.plan and mesh.parallelize ----------------------------------------------------------


def _check_row(row: Row) -> None:
    """A row the plan found INVALID is refused with its reason; one over its budget is built
    with a warning (on a GPU it would run out of memory)."""
    name = f"{row.layout.describe()}"
    if row.status == "INVALID":
        raise MeshError(f"the plan found {name} INVALID: {row.summary or 'no reason'}; "
                        f"apply a row that fits (report.best)")
    if row.status == "OOM":
        warnings.warn(f"the plan predicts {name} does not fit its budget ({row.reason}): it is built all the same",
                      stacklevel=3)


def _check_arguments(build: Any, optimizer: Any, caller: str) -> None:
    """Refuse now, not once the ranks were probed: ``build`` must be a function that makes the
    model (a model, an ``nn.Module``, is callable too, and would be called with no input; its
    class, made with no arguments, is such a function), and
    ``optimizer`` must name one."""
    problem = why_not_optimizer(optimizer)
    if problem:
        raise MeshError(problem)
    a_model = not isinstance(build, type) and hasattr(build, "parameters") and hasattr(build, "forward")
    if not callable(build) or a_model:
        got = "a model" if callable(build) else "a"
        raise MeshError(f"{caller}() needs a function that builds the model, got {got} {type(build).__name__}: "
                        f"pass the function (or a lambda) that makes it, which {caller} calls on the "
                        f"{'meta device' if caller == 'plan' else 'ranks'}")


def _resident(mesh: MeshView) -> str:
    """A note where the ranks hold large variables as they are measured (a model parallelize
    built before, planning again): their memory is in the process overhead, and so in every
    row's peak (a fresh mesh measured 288 MiB where one holding a model measured 610)."""
    variables = mesh.who()
    totals = dict(variables.totals())
    rank = max(totals, key=lambda r: totals[r], default=None)
    if rank is None or totals[rank] < RESIDENT_NOTE_BYTES:
        return ""
    largest = sorted(variables.variables[rank].values(), key=lambda v: v.adds, reverse=True)[:3]
    return (f"the ranks hold {format_bytes(totals[rank])} of variables as they are measured ("
            f"{', '.join(v.name for v in largest)} on rank {rank}): it counts in the process overhead, and so in "
            f"every row; del them (or plan on a fresh mesh) for a layout's own figures")


def _named_dims(mesh: MeshView) -> dict[str, int] | None:
    """The mesh's dimensions where it was started with ``dims`` (None: without, ``world``)."""
    dims = dict(mesh.topology.dims)
    return None if list(dims) == ["world"] else dims


def _shape(dims: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in dims.items())


def _relaid(dims: dict[str, int], ranks: int) -> str:
    """How to lay the mesh out so that it plans: without dimensions; for a plain ``dp`` (the
    README's ``dp=2,tp=2``), also under the names a layout gives the same ranks."""
    anywhere = f"without --dims (meshbook.start({ranks})), where any layout fits"
    if "dp" not in dims:
        return f"start the mesh {anywhere}"
    sharded = _shape({("dp_shard" if k == "dp" else k): v for k, v in dims.items()})
    replicated = _shape({("dp_replicate" if k == "dp" else k): v for k, v in dims.items()})
    return f"start it as --dims {sharded} (FSDP) or --dims {replicated} (DDP) to plan those, or {anywhere}"


class PlanOps:
    """What :class:`~meshbook.Mesh` can do to lay a model out: plan, then parallelize."""

    def plan(self: MeshView, build: Callable[[], Any], batch: str | int | Sequence[int], *, optimizer: Any = "adamw",
             budget: str | int | None = None, only: Callable[[Layout], bool] | None = None,
             checkpointing: Sequence[str] = CHECKPOINTING, planners: int | None = None) -> PlanReport:
        """Predict per-rank peak memory and step time of every way to lay ``build()`` out on
        this mesh (DP, FSDP, HSDP, TP, PP; checkpointing, micro-batches, resharding), without
        allocating anything: a :class:`PlanReport`, fastest fitting layout first.

        ``build`` makes the model (it runs on the meta device); ``batch`` is the global batch
        shape, ``(8, 2048)`` or ``"8x2048"``; ``budget`` bytes per rank (``"70G"``; default:
        90% of what each rank has); ``only`` keeps the layouts it returns True for; ``optimizer``
        is ``"adamw"``, ``"adam"``, ``"sgd"`` or a function ``params -> Optimizer``. Nothing fits:
        a :class:`MeshError` saying what the smallest needs (its ``report`` has every row).
        """
        _check_arguments(build, optimizer, "plan")
        shape = parse_batch(batch)
        if sorted(self.ranks) != sorted(self.controller.ranks):
            raise MeshError("plan the whole mesh (a layout spans every rank), not a selection of it")
        if isinstance(checkpointing, str):
            checkpointing = (checkpointing,)
        unknown = set(checkpointing) - set(CHECKPOINTING)
        if unknown:
            raise MeshError(f"checkpointing {sorted(unknown)}: choose from {', '.join(CHECKPOINTING)}")
        started = time.monotonic()
        deadline = started + PLAN_TIMEOUT_S
        limit = None if budget is None else check_bytes(budget, "budget")
        ranks_on_host = Counter(self.controller.host_of.values())
        with Planners(max(1, min(planners or MAX_PLANNERS, usable_cores())), self.controller) as pool:
            facts = pool.ask(0, "inspect", build)  # first, where a failing build harms nothing
            found = candidates(len(self.ranks), facts, shape[0], min(ranks_on_host.values()))
            dims = _named_dims(self)

            def asked(lay: Layout) -> bool:
                return lay.checkpointing in checkpointing and (only is None or only(lay))

            layouts = [lay for lay in found.valid if asked(lay) and (dims is None or lay.dims == dims)]
            # What this mesh could not run anyway (laid out with other dimensions) is not news.
            found.rejected = [r for r in found.rejected
                              if (only is None or only(r.layout)) and (dims is None or r.layout.dims == dims)]
            if not layouts and dims is not None and any(asked(lay) for lay in found.valid):
                raise MeshError(f"the mesh is laid out as {_shape(dims)}, and no layout of this model has those "
                                f"dimensions (a layout's are dp_replicate, dp_shard, tp, pp): "
                                f"{_relaid(dims, len(self.ranks))}")
            if not layouts:
                reasons = "; ".join(sorted({r.reason for r in found.rejected}))[:600]
                raise MeshError(f"no layout of {len(self.ranks)} ranks is possible for this model: "
                                f"{reasons or 'only= left none'}")
            resident = _resident(self)
            measured = probe(self, build, ranks_on_host, warm_up_layouts(layouts))
            jobs = [(build, lay, facts, shape, optimizer, measured.device) for lay in layouts]
            traces: list[Trace] = pool.map("trace", jobs, deadline)
        limit = measured.budget if limit is None else limit
        rows = sorted((predict(t, measured, limit) for t in traces), key=_order)
        for row in rows:
            row.optimizer = optimizer
        mark_dominated(rows)
        notes = [resident] if resident else []
        if measured.device == "cpu" and len(self.ranks) > 1:
            notes.append("times on CPU ranks that share cores rank layouts only roughly")
        if not facts.blocks:
            notes.append(f"{facts.cls} has no repeated blocks: data parallelism of the whole model only")
        report = PlanReport(rows, found.rejected, facts, measured, limit, shape, time.monotonic() - started, notes,
                            budget_given=budget is not None)
        try:
            report.best  # raises, saying what the smallest layout needs, when nothing fits
        except MeshError as error:
            error.report = report  # type: ignore[attr-defined]
            raise
        return report

    def parallelize(self: MeshView, build: Callable[[], Any], layout: Row | Layout, *,
                    names: tuple[str, str, str] = ("model", "optimizer", "step"), optimizer: Any = None,
                    lr: float = 1e-3, seed: int = 0, init: Callable[[Any], None] | None = None,
                    loss_fn: Callable[[Any, Any], Any] | None = None) -> RankValues:
        """Build ``layout`` (a plan's row, e.g. ``report.best``, or a :class:`Layout`) on every
        rank with torch's own APIs, exactly as the planner traced it, and bind ``model``,
        ``optimizer`` and ``step`` in each rank's namespace (``names`` renames them).

        ``step(inputs, targets=None)`` runs forward, loss, backward and the optimizer step
        (the pipeline schedule when pp > 1) and returns the loss where it is computed; its
        first three calls print each rank's measured peak memory and time beside the
        prediction. Parameters start as the plain model's, whatever the layout: what
        ``torch.manual_seed(seed); build()`` gives (then ``init(model)`` if given), each rank
        holding its piece; the ranks' own random state is left as it was. A layout ``plan``
        would drop for this model (tensor parallelism without repeated blocks, a pipeline stage
        without parameters) is refused with the same reason, and so is a row the plan found
        INVALID; a row predicted not to fit its budget (OOM) is built, with a warning.
        ``optimizer``: a row's is the one it was planned with; a Layout's, AdamW.
        """
        row = layout if isinstance(layout, Row) else None
        chosen = row.layout if row is not None else layout
        if not isinstance(chosen, Layout):
            raise MeshError(f"parallelize() needs a plan row (report.best) or a Layout, got a {type(layout).__name__}")
        if row is not None:
            _check_row(row)
        optimizer = optimizer if optimizer is not None else row.optimizer if row is not None else "adamw"
        _check_arguments(build, optimizer, "parallelize")
        if len(names) != 3 or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise MeshError(f"names={names!r}: give three variable names, for the model, the optimizer and the step")
        if sorted(self.ranks) != sorted(self.controller.ranks):
            raise MeshError("parallelize on the whole mesh (a layout spans every rank), not a selection of it")
        if chosen.world != len(self.ranks):
            raise MeshError(f"this layout is for {chosen.world} ranks and the mesh has {len(self.ranks)}: "
                            f"plan again on this mesh, or %mesh start -n {chosen.world}")
        dims = _named_dims(self)
        if dims is not None and dims != chosen.dims:
            raise MeshError(f"the mesh is laid out as {_shape(dims)} and the plan as {chosen.start_dims()}: "
                            f"%mesh start --dims {chosen.start_dims()} (or start without --dims and any plan fits)")
        predicted = row.stage_peaks if row is not None else {}
        step_s = row.step_s if row is not None else 0.0
        options = {"optimizer": optimizer, "lr": lr, "seed": seed, "init": init, "loss_fn": loss_fn}
        return _to_the_end(self, f"parallelize({chosen.describe()})", True, ops.parallelize, build, chosen,
                           predicted, step_s, tuple(names), options)
