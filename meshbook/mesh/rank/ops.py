"""Every operation a rank runs on request: the rank's remote surface, in one place.

The controller sends these by reference (``Controller.call(op, *args, ranks=...)``; cloudpickle
names a module-level function, so nothing of the controller travels) and the rank runs
``op(worker, *args)``: on its main thread, in request order (``MAIN``, the default), or on its
control thread, answered while the main thread is busy (declared with
``@rank_op(channel=CONTROL)``). This module imports only the
protocol at load time, so the controller may import it to name the operations without
loading the rank's machinery.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ..protocol import messages as msg
from ..protocol.actors import ActorAddress, Peer
from ..protocol.cell import stack_frames
from ..protocol.namespaces import VarInfo, describe, inventory, local_shard
from ..protocol.payload import Overweight, Payload, Slot, pickled_for_pull
from ..protocol.reports import Collective, GroupPosition, Positions, RankSnapshot
from ..protocol.wire import TooBig
from .connections import listening_ports, shut_down
from .devices import on_device, walk
from .groups import replica_prints, stale_objects
from .torch_compat import (
    abort_process_groups,
    backends,
    devices_of,
    flight_records,
    group_ranks,
    is_default_group,
    issued,
    process_groups,
)

if TYPE_CHECKING:
    from .worker import Worker

Op = TypeVar("Op", bound=Callable[..., Any])


def rank_op(channel: str = msg.MAIN, collective: bool = False) -> Callable[[Op], Op]:
    """Declare an operation's channel once: ``CONTROL`` operations run on the rank's control
    thread and answer while its main thread is busy; ``MAIN`` ones run in request order.
    ``collective``: it issues collectives every rank must pair, as a cell's do, so it is kept
    in step as a cell is (``messages.pairs_collectives``), and every rank runs it to its end,
    interrupted or not (``Worker._call``)."""
    def declare(fn: Op) -> Op:
        fn.channel = channel  # type: ignore[attr-defined]
        fn.collective = collective  # type: ignore[attr-defined]
        return fn

    return declare


# -- debugging and interrupts ---------------------------------------------------------------


def post_mortem(worker: "Worker") -> str:
    """``%mesh debug RANK``: pdb on the rank's last exception (runs on its main thread)."""
    exc = worker.last_exception
    if exc is None or exc.__traceback__ is None:
        return f"rank {worker.rank} has no exception to debug"
    if not worker.stdin_available:
        return "post-mortem skipped: this frontend cannot answer a debugger prompt (no stdin)"
    print(f"post-mortem of rank {worker.rank}: {type(exc).__name__}: {exc}")
    from .debugger import RankPdb  # only when asked: pdb is no load for the controller

    debugger = RankPdb(worker)
    debugger.reset()
    debugger.interaction(None, exc.__traceback__)
    worker.emit(msg.DEBUG_END, worker.current_request(), None)
    return f"left the post-mortem of rank {worker.rank}"


@rank_op(channel=msg.CONTROL)
def interrupt_request(worker: "Worker", request: int) -> None:
    """Interrupt ``request`` only (control thread): ``KeyboardInterrupt`` if the rank runs it
    now (where its user code starts, if it has yet to), dropped unstarted if it still waits in
    the rank's queue, nothing otherwise."""
    worker.interrupt(request)


# -- where the rank is (control thread: answered while the rank is busy) ------------------------


@rank_op(channel=msg.CONTROL)
def ready_report(worker: "Worker") -> dict[str, Any]:
    """What this rank's READY said (control thread): for a kernel that attached a kept mesh,
    which never heard it."""
    return worker.ready_report()


@rank_op(channel=msg.CONTROL)
def heartbeat(worker: "Worker") -> dict[str, Any]:
    """What this rank's next heartbeat will say, now (control thread): for reports asked for
    before its first heartbeat arrived."""
    return worker.metrics()


@rank_op(channel=msg.CONTROL)
def snapshot(worker: "Worker") -> RankSnapshot:
    busy = worker.request is not None
    main = worker.main_frame() if busy else None
    frames = stack_frames(main) if busy else ()
    busy_s = time.monotonic() - worker.started_at if busy else 0.0
    # An idle rank waits in nothing: what it left open is its groups' to end (a recovery's).
    pending = pending_collectives() + (tuple(worker.clock.open_point_to_point(main)) if busy else ())
    return RankSnapshot(worker.rank, busy, worker.request, busy_s, frames, pending,
                        last="" if busy and worker.running_user_code else worker.last_outcome,
                        last_request=worker.last_user_request, knock_on=worker.last_knock_on)


def pending_collectives() -> tuple[Collective, ...]:
    """Collectives enqueued but not completed, per torch's flight recorders (gloo's and
    NCCL's, merged; point-to-point operations left out), oldest first."""
    entries = [e for e in flight_records() if not e.get("is_p2p")]
    members = group_ranks() if entries else {}
    return tuple(_collective(e, members) for e in entries)


@rank_op(channel=msg.CONTROL)
def collective_called(worker: "Worker", group: str, seq: int) -> Collective | None:
    """The collective this rank called as number ``seq`` of ``group``, done or not (None: it
    called none, or its recorder no longer keeps it): what a rank that went on had called. Of
    the process groups it is in now: one re-created by a recovery numbers from 1 again, and
    keeps its name, while the recorder keeps the old group's calls too."""
    since = worker.group_since_ns
    calls = [e for e in flight_records(done_too=True) if e.get("time_created_ns", 0) >= since and not e.get("is_p2p")]
    return next((c for c in map(_collective, calls) if c.group == group and c.seq == seq), None)


def _collective(entry: dict[str, Any], members: dict[str, tuple[int, ...]] | None = None) -> Collective:
    group = entry.get("process_group", ["", ""])
    return Collective(
        op=str(entry.get("profiling_name", "?")).split(":")[-1],
        seq=int(entry.get("collective_seq_id", 0)),
        group=group[1] if len(group) > 1 and group[1] else str(group[0]),
        sizes=tuple(tuple(s) for s in entry.get("input_sizes", [])),
        dtypes=tuple(entry.get("input_dtypes", [])),
        members=(members or {}).get(str(group[0]), ()))


# -- recovery (mesh/controller/recovery.py) -----------------------------------------------------


def reinit(worker: "Worker", generation: int, store: tuple[str, int] | None = None,
           lost_hosts: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Leave the old process group and join generation ``generation``'s (exec thread), at
    ``store`` when a mesh across hosts has its store somewhere new (its host was re-formed).
    ``lost_hosts``: addresses of hosts found lost, whose connections the rank shuts if it
    leaves with work pending (see :mod:`meshbook.mesh.rank.connections`). Returns the
    variables still bound to the old groups, as :func:`hold` does."""
    if store is not None:
        worker.move_store((store[0], store[1]))  # a tuple, whatever sequence crossed the wire
    with worker.shielded():
        worker.reinit(generation, lost_hosts)
    return stale_objects(worker.namespace)


@rank_op(channel=msg.CONTROL)
def prepare_abort(worker: "Worker", stuck_in: dict[int, int], reasons: dict[int, str],
                  if_waiting: bool = False) -> tuple[list[int], bool]:
    """The first round of an abort (control thread): a rank about to have its collective
    aborted learns why, so its error says so even if a peer's shut-down connection fails the
    collective first; every rank answers the ports it listens on, and whether it waits in a
    collective now (a ``send``/``recv`` too: an abort frees it as well). ``if_waiting``: only a
    rank waiting in one learns why (a recovery, before the ranks it does not abort leave the
    old group and so close their connections)."""
    request = worker.request
    waiting = bool(flight_records())
    if worker.rank in reasons and request is not None and request == stuck_in.get(worker.rank) \
            and (waiting or not if_waiting):
        _, waited = worker.abort_reasons.get(request, ("", False))
        worker.abort_reasons[request] = (reasons[worker.rank], waited or waiting)
    return listening_ports(), waiting


@rank_op(channel=msg.CONTROL)
def abort_collectives(worker: "Worker", stuck_in: dict[int, int], peer_ports: list[int],
                      lost_hosts: list[str] = []) -> int:  # noqa: B006 - never mutated
    """Shut down this rank's connections to other ranks' endpoints (control thread), and
    every connection to ``lost_hosts`` (hosts whose ranks can no longer list their ports).

    A gloo collective blocked on such a connection fails at once ("Connection closed by
    peer"); the rank's other connections (the notebook's, the user's own outgoing ones) are left
    alone, but a server of the user's in the rank loses its clients too (see
    :mod:`.connections`). An
    NCCL one may wait on NVLink or shared memory, which no socket closes: its communicators
    are aborted instead (a CUDA sync waiting on it returns, and the next process group is made
    without destroying this one, which would wait for the unpaired kernel). Only done while
    the rank is still stuck in the request ``stuck_in[rank]``: once it moved on it may be
    building the new process group, whose connections must live.
    """
    if worker.request != stuck_in.get(worker.rank):
        return 0
    if "nccl" in worker.cfg.backend:
        abort_process_groups()
    # Stopped once freed meanwhile: it may be building the new group's connections now.
    return shut_down(listening_ports(), peer_ports, lost_hosts,
                     still=lambda: worker.request == stuck_in.get(worker.rank))


# -- step checks (mesh/controller/step.py): in request order, on the main thread -----------------


def positions(worker: "Worker") -> Positions:
    """This rank's position in each of its process groups, per backend (main thread, in
    request order). A GPU mesh's group runs NCCL for CUDA tensors and gloo for CPU ones, each
    counting its own collectives: the group's own count is its default backend's (NCCL), so a
    CPU ``all_reduce`` would never be compared. Point-to-point operations, which the backends
    count too, are taken off: a pipeline's stages run different numbers of them."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return Positions(worker.rank, initialized=False)
    groups = {}
    for name, pg in process_groups():
        desc = getattr(pg, "group_desc", "") or name
        label = "the default group" if is_default_group(pg) else f"group {desc}"
        found = backends(pg)
        for backend in found:
            try:
                count = issued(backend) - worker.clock.point_to_point(pg, devices_of(pg, backend))
            except Exception:  # a backend without sequence numbers: nothing to compare
                continue
            kind = backend.name()
            groups[f"{name}/{kind}"] = GroupPosition(count, f"{label} ({kind})" if len(found) > 1 else label)
    return Positions(worker.rank, groups, replicas=replica_prints(worker.namespace))


def hold(worker: "Worker") -> list[tuple[str, str]]:
    """Wait for the controller's verdict on this check; join a new generation if it says so.

    Returns the variables still bound to the old groups when the groups were re-created. Shielded
    from interrupts, and a verdict names the check it is for: a verdict never lands on a
    later check. A check of a kernel that let the mesh go (a kept mesh attached by another:
    :func:`supersede`) gives no verdict: the rank then holds back what comes next, and the
    first cell that does not run there starts the new kernel's own check.
    """
    with worker.shielded():
        while True:
            if worker.request is not None and worker.request < worker.superseded_below:
                worker.failed_before = (worker.request, "was in a step check of the kernel before this one")
                return []
            check, generation = worker.verdicts.get()
            if check == worker.request:
                break
        # Every rank's position was read after what was queued before this check, the failed
        # cell included: what comes next may run.
        worker.failed_before = None
        if generation is None:
            return []
        worker.reinit(generation)
    return stale_objects(worker.namespace)


@rank_op(channel=msg.CONTROL)
def supersede(worker: "Worker", below: int) -> None:
    """A new kernel attached this kept mesh and numbers its requests from ``below`` (control
    thread): a step check of the kernel before, whose verdict will never come, lets go of this
    rank now or when it gets there."""
    worker.superseded_below = below
    worker.verdicts.put((-1, None))  # wakes a hold waiting now: it finds its check superseded


def resume(worker: "Worker", failed: int) -> None:
    """No step check comes for request ``failed``, which this rank failed (a rank died, and its
    restart re-creates the groups; or a recovery does): what was sent after this runs (main
    thread, in order). A later failure of its own still waits for its check."""
    if worker.failed_before is not None and worker.failed_before[0] <= failed:
        worker.failed_before = None


@rank_op(channel=msg.CONTROL)
def release(worker: "Worker", check: int, verdict: int | None) -> None:
    """The controller's verdict for the step check ``check`` (control thread): a rank may get
    it before it reaches :func:`hold`."""
    worker.verdicts.put((check, verdict))


# -- data (mesh/controller/data.py) ---------------------------------------------------------------


@rank_op(channel=msg.CONTROL)
def who(worker: Any) -> dict[str, VarInfo]:
    return inventory(worker.namespace)


@rank_op(channel=msg.CONTROL)
def info(worker: Any, name: str) -> VarInfo | None:
    namespace = worker.namespace
    return describe(name, namespace[name]) if name in namespace else None


def stage(worker: Any, token: bytes, index: int, offset: int, size: int, piece: Any) -> None:
    """A piece of a push that travels in pieces (main thread, in order before its ``store``)."""
    if token not in worker.staged:
        worker.staged.clear()  # an earlier push that never reached its store (interrupted)
    buffers = worker.staged.setdefault(token, {})
    if index not in buffers:
        buffers[index] = bytearray(size)
    view = memoryview(piece).cast("B")
    buffers[index][offset:offset + view.nbytes] = view


def store(worker: Any, payload: Payload) -> None:
    if payload.staged is not None:
        buffers = worker.staged.pop(payload.staged.token, {})
        if sorted(buffers) != list(range(len(payload.staged.sizes))):
            raise RuntimeError("pieces of this push went missing before it was stored; push again")
        payload = Payload(payload.body, [buffers[i] for i in range(len(buffers))])
    values = on_device(payload.load(), worker.device)
    worker.namespace.update(values)  # only once every value arrived: all of them or none


def fetch(worker: Any, name: str, limits: Mapping[int, int] | None, share: bool = False,
          slots: Mapping[int, Slot] | None = None) -> Payload | Overweight | None:
    """``name``'s value (a DTensor's local shard) as a payload, weighed against this rank's
    share of the pull's limit (``limits``; None: no limit) as it is pickled. With ``share``
    (the notebook runs on this machine), its big buffers are in shared memory: written into
    the file the notebook offers this rank in ``slots``, or into one this rank lends (see
    :class:`~meshbook.mesh.protocol.payload.Lent`; the notebook maps it, then ``unshare``).

    The notebook checked the name and the size first, but a cell may have run since: a name
    deleted meanwhile answers None, a value over the limit :class:`Overweight`, so the
    notebook refuses them in the words of its own checks."""
    if name not in worker.namespace:
        return None
    value = walk(worker.namespace[name], local_shard)
    try:
        body, views, buffers = pickled_for_pull(name, value, (limits or {}).get(worker.rank))
    except TooBig as exc:
        return Overweight(exc.nbytes)
    if not share:
        return Payload(body, buffers)
    return worker.lent.lend(body, views, buffers, (slots or {}).get(worker.rank))


@rank_op(channel=msg.CONTROL)
def unshare(worker: Any, tokens: dict[int, bytes]) -> None:
    """The notebook mapped what ``fetch`` lent (``tokens``: each rank's file): close ours."""
    worker.lent.release(tokens.get(worker.rank))


# -- actors (mesh/controller/actors.py) -------------------------------------------------------


@rank_op(channel=msg.CONTROL)
def actors_living(worker: "Worker") -> dict[str, tuple[type, Peer, list[int]]]:
    """The actors living on this rank, with their classes, peers and the ranks they were
    spawned on (control thread)."""
    return worker.actors.living()


def drop_actor(worker: "Worker", name: str) -> bool:
    """Forget actor ``name`` on this rank (a spawn that failed on other ranks is undone)."""
    return worker.actors.drop(name)


def actor_handle(address: ActorAddress) -> Any:
    """Rebuild an actor handle that arrived in a rank's arguments: the notebook's handle
    pickles to this function (by reference) and its address, and the rank's handle calls the
    actors straight from this rank."""
    from .actors import RemoteActor  # only on a rank that receives a handle

    return RemoteActor(address)


# -- planning and applying parallel layouts (mesh/controller/api/plan.py) --------------------


@rank_op(collective=True)
def plan_probe(worker: "Worker", factory: Callable[[], Any], layouts: tuple[Any, ...]) -> dict[str, Any]:
    """Measure this rank for ``mesh.plan`` of ``factory()``, after a step of each of ``layouts``
    on a stand-in (every rank at once: it all-reduces and makes process groups)."""
    from . import probe  # torch's parallel APIs: only on a rank that plans

    return probe.probe(worker.device, factory, layouts, _meshes(worker))


@rank_op(collective=True)
def parallelize(worker: "Worker", factory: Callable[[], Any], layout: Any, predicted: dict[int, int],
                predicted_s: float, names: tuple[str, str, str], options: dict[str, Any]) -> str:
    """Build a layout on this rank (every rank at once: it creates process groups)."""
    from . import parallel

    cfg = worker.cfg
    return parallel.apply(worker.namespace, worker.rank, _meshes(worker), factory, layout, predicted, predicted_s,
                          names, options, parallel.Host(cfg.group_rank, cfg.local_rank == 0))


def _meshes(worker: "Worker") -> Callable[[Any, str], Any]:
    """The DeviceMesh a layout runs on, on this rank (:func:`meshbook.mesh.rank.parallel.mesh_for`)."""
    from . import parallel

    return partial(parallel.mesh_for, worker.device_mesh, dict(worker.cfg.topology.dims))
