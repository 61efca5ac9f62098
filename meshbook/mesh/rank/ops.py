"""Every operation a rank runs on request: the rank's remote surface, in one place.

The controller sends these by reference (``Controller.call(op, *args, ranks=..., channel=...)``;
cloudpickle names a module-level function, so nothing of the controller travels) and the rank
runs ``op(worker, *args)``: on its main thread, in request order (``MAIN``), or on its control
thread, answered while the main thread is busy (``CONTROL``). This module imports only the
protocol at load time, so the controller may import it to name the operations without
loading the rank's machinery.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..protocol import messages as msg
from ..protocol.actors import ActorAddress
from ..protocol.cell import stack_frames
from ..protocol.namespaces import VarInfo, describe, inventory, local_shard
from ..protocol.payload import Payload
from ..protocol.reports import Collective, GroupPosition, Positions, RankSnapshot

if TYPE_CHECKING:
    from .worker import Worker


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


def interrupt_request(worker: "Worker", request: int) -> None:
    """Interrupt ``request`` only (control thread): ``KeyboardInterrupt`` if the rank runs it
    now, dropped unstarted if it still waits in the rank's queue, nothing otherwise."""
    if worker.request == request:
        worker.interrupt_target = request
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler on the main thread
    elif worker.last_request is None or request > worker.last_request:
        worker.cancelled.add(request)


# -- where the rank is (control thread: answered while the rank is busy) ------------------------


def heartbeat(worker: "Worker") -> dict[str, Any]:
    """What this rank's next heartbeat will say, now (control thread): for reports asked for
    before its first heartbeat arrived."""
    return worker.metrics()


def snapshot(worker: "Worker") -> RankSnapshot:
    busy = worker.request is not None
    frames = stack_frames(worker.main_frame()) if busy else ()
    busy_s = time.monotonic() - worker.started_at if busy else 0.0
    return RankSnapshot(worker.rank, busy, worker.request, busy_s, frames, pending_collectives(),
                        last="" if busy else worker.last_outcome)


def pending_collectives() -> tuple[Collective, ...]:
    """Collectives enqueued but not completed, per torch's Flight Recorder (cheap: ~1 ms)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    try:
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
    except Exception:
        return ()  # no Flight Recorder in this torch build, or no process group yet
    out = []
    for entry in trace.get("entries", []):
        if entry.get("retired") or entry.get("is_p2p"):
            continue
        group = entry.get("process_group", ["", ""])
        out.append(Collective(
            op=str(entry.get("profiling_name", "?")).split(":")[-1],
            seq=int(entry.get("collective_seq_id", 0)),
            group=group[1] if len(group) > 1 and group[1] else str(group[0]),
            sizes=tuple(tuple(s) for s in entry.get("input_sizes", [])),
            dtypes=tuple(entry.get("input_dtypes", []))))
    return tuple(out)


# -- recovery (mesh/controller/recovery.py) -----------------------------------------------------


def reinit(worker: "Worker", generation: int, store: tuple[str, int] | None = None) -> None:
    """Leave the old process group and join generation ``generation``'s (exec thread), at
    ``store`` when a mesh across hosts has its store somewhere new (its host was re-formed)."""
    if store is not None:
        worker.move_store(tuple(store))
    with worker.shielded():
        worker.reinit(generation)


def prepare_abort(worker: "Worker", stuck_in: dict[int, int], reasons: dict[int, str]) -> list[int]:
    """The first round of an abort (control thread): a rank about to have its collective
    aborted learns why, so its error says so even if a peer's shut-down connection fails the
    collective first; every rank answers the ports it listens on."""
    if worker.rank in reasons and worker.request == stuck_in.get(worker.rank):
        worker.abort_reasons[worker.request] = reasons[worker.rank]
    return listening_ports(worker)


def listening_ports(worker: "Worker") -> list[int]:
    """TCP ports this rank listens on (its gloo/NCCL endpoints; control thread)."""
    import psutil

    return sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN})


def abort_collectives(worker: "Worker", stuck_in: dict[int, int], peer_ports: list[int],
                      lost_hosts: list[str] = []) -> int:  # noqa: B006 - never mutated
    """Shut down this rank's connections to other ranks' endpoints (control thread), and
    every connection to ``lost_hosts`` (hosts whose ranks can no longer list their ports).

    A collective blocked on such a connection fails at once ("Connection closed by peer");
    the rank's other connections (the notebook's, the user's own) are left alone. Only done
    while the rank is still stuck in the request ``stuck_in[rank]``: once it moved on it may
    be building the new process group, whose connections must live.
    """
    import psutil

    if worker.request != stuck_in.get(worker.rank):
        return 0
    own = set(listening_ports(worker))
    peers = set(peer_ports)
    closed = 0
    for conn in psutil.Process().net_connections("tcp"):
        if worker.request != stuck_in.get(worker.rank):
            break  # freed meanwhile: it may be building the new group's connections now
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.fd < 0:
            continue
        if conn.raddr.port in peers or conn.laddr.port in own or conn.raddr.ip in lost_hosts:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    # The main thread may have closed that fd and reused its number for a new
                    # socket since the listing: only shut down the connection we listed.
                    if sock.getsockname()[:2] == tuple(conn.laddr) and \
                            sock.getpeername()[:2] == tuple(conn.raddr):
                        sock.shutdown(socket.SHUT_RDWR)
                        closed += 1
            except OSError:
                pass
    return closed


# -- step checks (mesh/controller/step.py): in request order, on the main thread -----------------


def positions(worker: "Worker") -> Positions:
    """This rank's position in each of its process groups (main thread, in request order)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return Positions(worker.rank, initialized=False)
    from torch.distributed import distributed_c10d as c10d

    groups = {}
    for pg in list(c10d._world.pg_map):
        name = c10d._get_process_group_name(pg)
        try:
            issued = int(pg._get_sequence_number_for_group())
        except Exception:  # a backend without sequence numbers: nothing to compare
            continue
        desc = getattr(pg, "group_desc", "") or name
        groups[name] = GroupPosition(issued, "the default group" if pg is c10d.GroupMember.WORLD else f"group {desc}")
    return Positions(worker.rank, groups)


def hold(worker: "Worker") -> list[str]:
    """Wait for the controller's verdict on this check; join a new generation if it says so.

    Returns the variables bound to the old groups when the groups were re-created. Shielded
    from interrupts, and a verdict names the check it is for: a verdict never lands on a
    later check.
    """
    with worker.shielded():
        while True:
            check, generation = worker.verdicts.get()
            if check == worker.request:
                break
        if generation is None:
            return []
        worker.reinit(generation)
    return bound_objects(worker.namespace)


def release(worker: "Worker", check: int, verdict: int | None) -> None:
    """The controller's verdict for the step check ``check`` (control thread): a rank may get
    it before it reaches :func:`hold`."""
    worker.verdicts.put((check, verdict))


def bound_objects(namespace: Mapping[str, Any]) -> list[str]:
    """Variables that hold on to process groups: they must be re-created after new groups.

    ``device_mesh`` is meshbook's own and is rebuilt with the groups, so it is not listed.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for name, value in namespace.items():
        if name.startswith("_") or name == "device_mesh":
            continue
        kind = _bound_kind(torch, value)
        if kind:
            found.append(f"{name} ({kind})")
    return sorted(found)


def _bound_kind(torch: Any, value: Any) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if isinstance(value, DeviceMesh):
        return "DeviceMesh"
    if isinstance(value, torch.distributed.ProcessGroup):
        return "process group"
    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return "DDP module"
    if isinstance(value, torch.nn.Module):
        if type(value).__name__.startswith("FSDP"):
            return "FSDP module"
        if any(isinstance(p, DTensor) for p in value.parameters()):
            return "module with DTensor parameters (FSDP2 / tensor parallel)"
    if isinstance(value, torch.optim.Optimizer):
        if any(isinstance(p, DTensor) for g in value.param_groups for p in g["params"]):
            return "optimizer over DTensor parameters"
    return ""


# -- data (mesh/controller/data.py) ---------------------------------------------------------------


def who(worker: Any) -> dict[str, VarInfo]:
    return inventory(worker.namespace)


def info(worker: Any, name: str) -> VarInfo | None:
    namespace = worker.namespace
    return describe(name, namespace[name]) if name in namespace else None


def store(worker: Any, payload: Payload) -> None:
    values = payload.load()
    device = worker.namespace["device"]
    if device.type != "cpu":
        onto = functools.partial(_onto, device)
        values = {name: _walk(value, onto) for name, value in values.items()}
    worker.namespace.update(values)  # only once every value arrived: all of them or none


def fetch(worker: Any, name: str) -> Any:
    return _walk(worker.namespace[name], local_shard)


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``leaf`` applied inside lists, tuples and dicts (a state_dict, a batch)."""
    if type(value) in (list, tuple):
        return type(value)(_walk(v, leaf) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = _walk(item, leaf)
        return out
    return leaf(value)


def _onto(device: Any, value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        moved = value.detach().to(device)
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(moved, requires_grad=value.requires_grad)
        return moved.requires_grad_(value.requires_grad)
    if isinstance(value, torch.nn.Module):
        return value.to(device)
    return value


# -- actors (mesh/controller/actors.py) -------------------------------------------------------


def drop_actor(worker: "Worker", name: str) -> bool:
    """Forget actor ``name`` on this rank (a spawn that failed on other ranks is undone)."""
    return worker.actors.drop(name)


def actor_handle(address: ActorAddress) -> Any:
    """Rebuild an actor handle that arrived in a rank's arguments: the notebook's handle
    pickles to this function (by reference) and its address, and the rank's handle calls the
    actors straight from this rank."""
    from .actors import RemoteActor  # only on a rank that receives a handle

    return RemoteActor(address)
