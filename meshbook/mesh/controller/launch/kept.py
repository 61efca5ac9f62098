"""Meshes that outlive the kernel: ``keep=`` leases, the mesh file, and finding a mesh again.

A notebook kernel dies or restarts far more often than a loaded model should be lost, so a
mesh started with ``keep="8h"`` (``%mesh start -n 4 --keep 8h``) runs its agents the way an
agent on another host runs, even on this host: a *listening* agent (TCP + CurveZMQ, admitting
only the controller's Curve key) started detached, with no parent-death signal and no watch on
its stdin (its launcher's ``keep``). Its grace before it stops its ranks is the lease, renewed
by every ping: the mesh ends ``keep`` after a controller was last heard.

The *mesh file* (``~/.meshbook/meshes/<id>.json``, 0600 in a 0700 directory: the home
directory no other user can write, shared with a cluster's nodes) records how to reach and
authenticate to the mesh: its id, launcher (and what the launcher needs, ``launcher_state``),
hosts and addresses, the mesh key and Curve keys, ranks, dims, the epoch, start time, lease and
the versions it runs. Its modification time is when a controller last renewed the lease (the
controller touches it when a ping is answered), so "lease left" needs no process to ask. The
agent removes it when the mesh stops or its lease runs out; :func:`list_meshes` also drops the
files of meshes that are surely over (the lease ran out, or Slurm says the job ended).

Attaching (``%mesh attach ID``) takes the record's next *epoch* (:func:`next_epoch`, under a
lock) and builds its launcher's :meth:`~.base.Launcher.from_record`, which dials the recorded
agents with the file's keys. Every message to an agent carries its sender's epoch, and an agent
refuses (and answers ``FENCED`` to) one older than the newest it has seen, or a second
controller at the same epoch, so a kernel that was attached over can no longer drive the mesh
and its next cell says so. Without ``keep``, nothing changes: the ranks die with the kernel.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import threading
import time

from ...protocol.errors import MeshError
from .record import MeshRecord, mesh_dir
from .slurm import ACTIVE, query

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: A mesh whose lease ran out this long ago is surely over (its agent ended itself).
LEASE_MARGIN_S = 60.0


def parse_duration(keep: str | float) -> float:
    """``8h``, ``30m``, ``1h30m``, ``90s``, ``2d`` or a number of seconds."""
    text = str(keep).strip().lower()
    if isinstance(keep, bool) or not (re.fullmatch(r"\d+(\.\d+)?", text) or
                                      re.fullmatch(r"(\d+(\.\d+)?[smhd])+", text)):
        raise MeshError(f"keep={keep!r}: give a duration such as 8h, 30m, 1h30m or 90s")
    seconds = sum(float(n) * _UNITS[unit or "s"] for n, unit in re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", text))
    if seconds <= 0:
        raise MeshError(f"keep={keep!r}: the lease must be longer than 0 s")
    return seconds


def new_mesh_file() -> tuple[str, str]:
    """An id and mesh file path for a mesh about to be kept (the directory is checked first:
    a refused start must leave no agent running)."""
    mesh_id = secrets.token_hex(4)
    return mesh_id, os.path.join(mesh_dir(), f"{mesh_id}.json")


class Lease:
    """A controller's hold on a kept mesh: renews the mesh file's time as pings are answered.

    The touching is done by a thread of its own: the file lives in the home directory, which
    on a cluster is often a network file system, and a hung one must stall no more than the
    renewal (the receiver thread, which hears the pings, would stall every answer)."""

    #: At most one renewal in this many seconds (pings come every second, per host).
    EVERY_S = 0.5

    def __init__(self, record: MeshRecord) -> None:
        self.record = record
        self.id = record.id
        self._due = threading.Event()
        self._closed = False
        threading.Thread(target=self._renew, name=f"meshbook-lease-{record.id}", daemon=True).start()

    def renewed(self) -> None:
        """A ping was answered: the lease runs from now (never waits)."""
        self._due.set()

    def close(self) -> None:
        """This controller lets go: no renewal from now on (the thread ends)."""
        self._closed = True
        self._due.set()

    def _renew(self) -> None:
        while True:
            self._due.wait()
            if self._closed:
                return
            self._due.clear()
            try:
                os.utime(self.record.path)
            except OSError:
                pass  # the mesh ended (or was stopped from elsewhere)
            time.sleep(self.EVERY_S)


def ended(record: MeshRecord) -> bool:
    """Is the mesh surely over? Its lease ran out (the agent ends itself then; a margin for
    the last renewal), or Slurm says its job ended. Nothing else decides it: a pid may mean
    another process, or none on this host, and only the agent removes a live mesh's file."""
    if record.problem and not record.hosts:
        return False
    if record.job:
        state = query(record.job)
        record.job_state = state.state if state is not None else "gone"
        if record.job_state not in ACTIVE:
            return True
    return record.lease_left() < -LEASE_MARGIN_S


def list_meshes() -> list[MeshRecord]:
    """The kept meshes this user can attach, oldest first, with files that cannot be used (each
    saying why). The files of meshes that are surely over (see :func:`ended`) are removed."""
    records = []
    directory = mesh_dir()
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".json"):
            continue  # a file being written (*.tmp), a lock, or not a mesh file
        record = MeshRecord.load(os.path.join(directory, entry))
        if ended(record):
            record.drop()
        else:
            records.append(record)
    return sorted(records, key=lambda r: r.started)


def find(mesh_id: str) -> MeshRecord:
    """The kept mesh ``mesh_id``, sound enough to attach; a clear ``MeshError`` otherwise."""
    found = list_meshes()
    record = next((r for r in found if r.id == mesh_id), None)
    if record is None:
        ids = ", ".join(r.id for r in found if not r.problem) or "none"
        raise MeshError(f"no kept mesh {mesh_id!r} (meshes that can be attached: {ids}): it was stopped, "
                        f"or its lease ran out. %mesh list (meshbook.list_meshes()) shows them")
    if record.problem:
        raise MeshError(f"kept mesh {mesh_id}: {record.problem}. The mesh may still run (its agent "
                        f"removes the file when it ends); it cannot be attached without a sound file")
    return record


def next_epoch(record: MeshRecord) -> MeshRecord:
    """Take the next epoch, under a lock on the mesh file: two kernels attaching at the same
    moment get two epochs, and the agents fence off the older (on a file system without locks,
    the agents' own rule still lets one controller per epoch through)."""
    with open(record.path + ".lock", "a") as handle:  # not the file itself: saving replaces it
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            fresh = MeshRecord.load(record.path)
            if fresh.problem:
                raise MeshError(f"kept mesh {record.id}: {fresh.problem}")
            fresh.epoch += 1
            fresh.save()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return fresh
