"""The systems under test, behind one small interface, so a workload is written once.

Each module here starts one system's ranks and drives them the way a user of that system
would: meshbook through its Python API, ipyparallel through a ``Cluster`` and a
``DirectView``, PyTorch Monarch through a ``ProcMesh`` of actors. Each exposes
``start(n, dist) -> Handle``; ``dist=True`` also joins every rank to a gloo process group
(meshbook's ranks always have one, so startup and memory compare like for like).
:mod:`bench.peers.cells` drives the same systems through a real Jupyter kernel instead.

:func:`running` is how workloads use them: it starts a system, hands out the
:class:`Handle`, and on the way out stops it and reaps every process it started (see
:mod:`bench.procs`), whatever happened in between.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..procs import reaped


def tolerate_monarch_faults() -> None:
    """Monarch ends this process's main thread with a KeyboardInterrupt when a process of one
    of its meshes dies unsupervised, even a mesh stopped minutes before whose stragglers the
    reaper killed (see :mod:`bench.procs`): that interrupt once cut a full run short in the
    next workload. A fault is logged here instead; a measurement it breaks fails on its own."""
    import monarch.actor

    def log(failure: Any) -> None:
        print(f"[bench] Monarch reported a fault (logged, not raised): {failure}", file=sys.stderr, flush=True)

    monarch.actor.unhandled_fault_hook = log


class Handle(Protocol):
    """A running system with ``n`` ranks (engines, procs)."""

    def noop(self) -> None:
        """One no-op round trip to every rank."""

    def push(self, tensor: Any) -> None:
        """Send ``tensor`` to every rank, which keeps it."""

    def pull(self) -> list[Any]:
        """Fetch the kept tensor back from every rank."""

    def pids(self) -> list[int]:
        """The rank processes (not the system's helpers)."""

    def close(self) -> None: ...


#: name -> (module, what a user installs to get it); the name is what tables show.
SYSTEMS: dict[str, tuple[str, str]] = {
    "meshbook": ("bench.peers.meshbook_api", "meshbook"),
    "ipyparallel": ("bench.peers.ipyparallel_api", "ipyparallel"),
    "Monarch": ("bench.peers.monarch_api", "torchmonarch"),
}

PEERS = ("ipyparallel", "Monarch")


def module(name: str) -> Any:
    return importlib.import_module(SYSTEMS[name][0])


def missing(name: str) -> str | None:
    """Why ``name`` cannot run here (not installed), or None."""
    try:
        module(name)
    except ImportError as exc:
        return f"{SYSTEMS[name][1]} is not installed ({exc}); pip install -e \".[bench]\""
    return None


@contextmanager
def running(name: str, n: int, dist: bool = False) -> Iterator[Handle]:
    """Start ``name`` with ``n`` ranks; stop it and reap its processes on the way out."""
    with reaped(f"{name} with {n} ranks", lambda: module(name).start(n, dist=dist),
                lambda handle: handle.close()) as handle:
        yield handle
