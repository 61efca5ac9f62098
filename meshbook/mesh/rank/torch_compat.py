"""Every private torch API meshbook uses, in one place, each tested (tests/test_torch_compat.py).

torch's public API cannot tell which collectives a rank enqueued and never completed, how many
collectives a group issued on each backend, or abort a hung NCCL communicator; its private
API can. These names may change in any torch release, so they are used here only, against the
torch CI tests (see ``TORCH`` in ``dev``), and a test per function fails when one moves.
Nothing here imports torch at load time: the controller imports :mod:`.ops`, which imports us.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

#: The flight recorders' size (entries per process, per recorder): a hang shows in the newest
#: few, and a dump of a full 2,000-entry recorder costs ~130 ms of a rank's GIL.
FLIGHT_RECORDER_ENTRIES = "256"
#: The two recorders: gloo and other CPU backends write one, NCCL its own (NCCL builds only).
_RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_PICKLED_RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")


def flight_records(done_too: bool = False) -> list[dict[str, Any]]:
    """Entries of every flight recorder of this process that are not completed, oldest first:
    collectives enqueued and not done. gloo marks an entry ``retired`` when it finishes; NCCL's
    watchdog marks it ``completed`` when its CUDA event fires (an NCCL collective returns to
    Python at once: only its recorder knows it still runs on the GPU). ``done_too``: the
    finished ones the recorder still keeps as well (what a rank that went on had called)."""
    entries = _dumped(_RECORDERS, lambda dump: json.loads(dump(includeCollectives=True, onlyActive=not done_too)))
    out = [e for e in entries if done_too or (not e.get("retired") and e.get("state") != "completed")]
    return sorted(out, key=lambda e: e.get("time_created_ns", 0))


def _dumped(recorders: tuple[str, ...], read: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of each of the flight ``recorders`` this torch has, as ``read(dump)`` reads
    its dump (none from one with no process group yet, or a build without it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    c10d = torch._C._distributed_c10d
    out: list[dict[str, Any]] = []
    for name in recorders:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            out += read(dump).get("entries", [])
        except Exception:  # no process group yet, or a build without this recorder
            continue
    return out


def oldest_nccl_pending() -> tuple[str, float] | None:
    """The oldest NCCL collective enqueued and not completed, and its age in seconds (None:
    none). NCCL collectives return to Python at once, so a rank blocked on one sits in
    ``.item()`` or ``synchronize()``, not in a collective's frame: only this says it waits."""
    torch = sys.modules.get("torch")
    dump = getattr(torch._C._distributed_c10d, _RECORDERS[1], None) if torch is not None else None
    if dump is None:
        return None
    try:
        entries = json.loads(dump(includeCollectives=True, onlyActive=True)).get("entries", [])
    except Exception:
        return None
    pending = [e for e in entries if not e.get("retired") and e.get("state") != "completed"
               and not e.get("is_p2p") and e.get("time_created_ns")]
    if not pending:
        return None
    oldest = min(pending, key=lambda e: e["time_created_ns"])
    op = str(oldest.get("profiling_name", "?")).split(":")[-1]
    return op, max(0.0, time.time() - oldest["time_created_ns"] / 1e9)


def process_groups() -> list[tuple[str, Any]]:
    """``(name, group)`` of every process group this rank belongs to."""
    from torch.distributed import distributed_c10d as c10d

    return [(c10d._get_process_group_name(pg), pg) for pg in list(c10d._world.pg_map)]


def group_ranks() -> dict[str, tuple[int, ...]]:
    """The global ranks of each process group this rank belongs to, by the name its flight
    records give it: a group of the rank's own (a stand-in DeviceMesh's) has no name the
    controller could look up."""
    import torch.distributed as dist

    return {name: tuple(dist.get_process_group_ranks(pg)) for name, pg in process_groups()}


def group_name(pg: Any) -> str:
    """A process group's name, the same on every member (torch names groups in creation order)."""
    from torch.distributed import distributed_c10d as c10d

    return str(c10d._get_process_group_name(pg))


def group_description(pg: Any) -> str:
    """How the flight recorder tells a process group (``mesh_pp``: a DeviceMesh's; ``default_pg``),
    as the hang diagnosis reads it; its name where it has no description."""
    return str(getattr(pg, "group_desc", "") or group_name(pg))


def is_default_group(pg: Any) -> bool:
    from torch.distributed import distributed_c10d as c10d

    return pg is c10d.GroupMember.WORLD


def backends(pg: Any) -> list[Any]:
    """The distinct backends of a process group (one may serve several device types: a gloo
    group answers for both ``cpu`` and ``cuda``; ``cuda:nccl,cpu:gloo`` has two)."""
    found: dict[int, Any] = {}
    for device in pg._device_types:
        try:
            backend = pg._get_backend(device)
        except Exception:
            continue
        found.setdefault(id(backend), backend)
    return list(found.values())


def devices_of(pg: Any, backend: Any) -> list[str]:
    """The device types ``pg`` serves with ``backend`` (a gloo group: ``cpu`` and ``cuda``)."""
    found = []
    for device in pg._device_types:
        try:
            if pg._get_backend(device) is backend:
                found.append(device.type if hasattr(device, "type") else str(device))
        except Exception:
            continue
    return found


def issued(backend: Any) -> int:
    """How many collectives ``backend`` has issued in its group (each backend counts its own)."""
    return int(backend._get_sequence_number_for_group())


def issued_by_groups() -> int:
    """How many collectives every process group of this rank has issued, together: cheap (no
    recorder is read; the backends are looked up again only when the groups change), to tell
    whether some were issued that torch.distributed's Python functions never saw
    (DistributedDataParallel's, from C++). Read at every request's end: about 1 us."""
    from torch.distributed import distributed_c10d as c10d

    global _counted
    groups = tuple(c10d._world.pg_map)
    if _counted[0] != groups:
        _counted = (groups, [b._get_sequence_number_for_group for pg in groups for b in backends(pg)])
    total = 0
    for count in _counted[1]:  # the bound methods: looked up once, not at every request
        total += count()
    return total


#: The process groups last counted by :func:`issued_by_groups`, and their backends' counters.
_counted: tuple[tuple[Any, ...], list[Callable[[], int]]] = ((), [])


def finished_and_pending_collectives() -> list[dict[str, Any]]:
    """Every collective entry the flight recorders keep (finished or not, without stack
    traces), oldest first: about 2.5 ms for a full recorder, a quarter of what its JSON takes."""
    import pickle

    entries = _dumped(_PICKLED_RECORDERS, lambda dump: pickle.loads(
        dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)))
    return sorted((e for e in entries if not e.get("is_p2p")), key=lambda e: e.get("time_created_ns", 0))


def set_default_group_timeout(timeout: Any) -> None:
    """Collectives of the default group time out after ``timeout`` (a ``timedelta``) from now on:
    what ``init_process_group(timeout=)`` would have set, for a group that already exists."""
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timeout)


def fsdp2_groups(module: Any) -> list[Any]:
    """The process groups ``fully_shard`` keeps for ``module`` and the submodules it wrapped.
    Each wrapped module's parameter group holds its mesh's groups as objects, taken when it was
    wrapped (its mesh would find new groups by name; these do not): a module wrapped before
    meshbook re-created the groups calls destroyed ones. Empty for a module nothing wrapped."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapped = getattr(fsdp, "FSDPModule", None)
    if wrapped is None:
        return []
    import torch

    found: dict[int, Any] = {}
    for sub in module.modules():
        group = sub._get_fsdp_state()._fsdp_param_group if isinstance(sub, wrapped) else None
        for info in (group.mesh_info, group.post_forward_mesh_info) if group is not None else ():
            for held in vars(info).values() if info is not None else ():
                if isinstance(held, torch.distributed.ProcessGroup):
                    found.setdefault(id(held), held)
    return list(found.values())


def forget_device_meshes() -> None:
    """Empty DTensor's caches of sharding decisions (this thread's: they are per thread), which
    hold the device meshes they were made on. A DeviceMesh equals any other of the same ranks
    and names, whatever its groups: after meshbook re-created the groups (their names count up
    from 1 again), a new mesh found the old mesh's decisions, and its collectives ran on
    whichever new group took an old one's name (a tensor parallel step's all_reduce went to a
    group of the user's own and hung)."""
    propagator = sys.modules.get("torch.distributed.tensor._sharding_prop")
    if propagator is None:
        return  # DTensor never used: nothing cached
    from torch.distributed.tensor import DTensor

    clear_native = getattr(sys.modules["torch"]._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch's cache, which the Python one's stands behind
        clear_native()
    sharding = DTensor._op_dispatcher.sharding_propagator
    sharding.propagate_op_sharding.cache_clear()
    getattr(propagator.ShardingPropagator, "_propagate_tensor_meta_cached").cache_clear()
    topology = sys.modules.get("torch.distributed.tensor._collective_utils")
    if topology is not None:
        topology.MeshTopoInfo.build_from_mesh.cache_clear()


def pipeline_groups(schedule: Any) -> list[Any]:
    """The process groups the stages of a pipeline ``schedule`` send and receive on (none for
    None, or a stage on the default group, which it looks up each time)."""
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [stage.group for stage in stages if getattr(stage, "group", None) is not None]


def abort_process_groups() -> bool:
    """Abort every NCCL communicator of this process (any thread may call it): a collective
    or CUDA sync blocked on one fails at once, where ``destroy_process_group`` would wait for
    the unpaired kernel forever. gloo's abort does nothing (its blocked collective ends when its
    connection closes instead). False where torch has no such call."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


# -- what planning and applying a parallel layout use (rank/parallel.py, planner/; each tested in
# tests/test_planner.py, which traces every family through them) --------------------------------


def checkpoint_wrapper(module: Any) -> Any:
    """``module`` with activation checkpointing (recompute in backward, non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, preserve_rng_state=False)


def replicate(module: Any, mesh: Any) -> Any:
    """Data parallelism with a full copy per rank, FSDP2-style (DTensor parameters, so it
    composes with tensor parallelism and starts from the meta device like ``fully_shard``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as apply

    return apply(module, mesh=mesh)


def local_piece(shape: Any, mesh: Any, placements: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's piece of a tensor of ``shape`` laid out by ``placements`` on
    ``mesh``, and where it starts in the whole (what a sharded checkpoint's load reads)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def init_fake_group(rank: int, world_size: int) -> None:
    """A process group that communicates nothing (``backend="fake"``): one process plays
    ``rank`` of ``world_size`` to trace what that rank allocates and sends."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_tensors() -> Any:
    """A mode in which tensors have shapes and no storage (real modules and DeviceMeshes,
    built outside it, may be used inside it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def memory_tracker(model: Any, optimizer: Any, fsdp: bool) -> Any:
    """torch's own tracker of live tensor bytes by kind (parameters, gradients, optimizer
    state, activations, temporaries), FSDP-aware where ``fsdp``."""
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def local_flop_counter() -> Any:
    """torch's FLOP counter, counting what this rank computes: an op on DTensors (tensor
    parallel weights) is counted on their local shards, where torch's counts the global op."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    def local(value: Any) -> Any:
        return getattr(value, "_local_tensor", value)

    class LocalFlops(FlopCounterMode):
        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            super()._count_flops(func_packet, tree_map(local, out), tree_map(local, args), tree_map(local, kwargs))
            return out

    return LocalFlops(display=False)


#: torch's collective ops -> the planner's name, which argument holds the bytes that cross the
#: network (output of a gather, input of a reduce-scatter, the tensor of an all-reduce), and
#: whether that argument is one rank's part, to multiply by the group's size (the functional
#: all-gather's arguments are its input, the group's size and the group).
COLLECTIVES = {
    "_allgather_base_": ("all_gather", 0, False), "allgather_": ("all_gather", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False), "allreduce_": ("all_reduce", 0, False),
    "all_reduce": ("all_reduce", 0, False), "send": ("p2p", 0, False), "recv_": ("p2p", 0, False),
}


def collective_counter(observe: Callable[[str, int], None] | None = None) -> Any:
    """A dispatch mode counting the collectives torch dispatches (eager and functional): bytes
    by kind (``.bytes``) and how many (``.calls``); ``observe(kind, bytes)`` is called as each
    one starts. torch's CommDebugMode counts calls only. Every op passes through it, so what
    each op is gets looked up once."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def kind_of(func: Any) -> tuple[str, int, bool] | None:
        if func.namespace not in ("c10d", "_c10d_functional"):
            return None
        return COLLECTIVES.get(func.__name__.split(".")[0])

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kinds: dict[Any, tuple[str, int, bool] | None] = {}
            self.bytes: Counter[str] = Counter()
            self.calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func not in self.kinds:
                self.kinds[func] = kind_of(func)
            entry = self.kinds[func]
            if entry is not None and len(args) > entry[1]:
                kind, at, per_rank = entry
                size = sum(t.numel() * t.element_size() for t in tree_leaves(args[at]) if isinstance(t, torch.Tensor))
                size *= int(args[1]) if per_rank else 1
                self.bytes[kind] += size
                self.calls += 1
                if observe is not None:
                    observe(kind, size)
            return func(*args, **(kwargs or {}))

    return Collectives()


def untraceable_errors() -> tuple[type[BaseException], ...]:
    """What fake tensors raise on an op they cannot run (its output shape depends on the data,
    or it has no fake implementation); the exception's ``func`` names the op."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, UnsupportedOperatorException

    return DynamicOutputShapeException, UnsupportedOperatorException
