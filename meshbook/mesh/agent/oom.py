"""Telling a rank the OOM killer took from one that was merely SIGKILLed.

A process the kernel kills for memory dies of SIGKILL like any other, so the agent reads the
evidence around it: its memory cgroup's OOM-kill count before the rank started and after it
died (cgroup v2's ``memory.events``; cgroup v1's ``memory.oom_control``, or on kernels older
than 4.13, which lack its ``oom_kill`` line, ``memory.failcnt``: how often the limit was hit),
and the kernel log's "Killed process <pid>" line where it is readable (``/dev/kmsg``, root or
``kernel.dmesg_restrict=0``), which also catches a machine-wide OOM outside any limit.

Every reader takes its paths as arguments, so the parsing is tested on directories laid out
like either cgroup version.
"""

from __future__ import annotations

import os
import re

CGROUP_ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"
KERNEL_LOG = "/dev/kmsg"


def oom_kills(root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> int | None:
    """The OOM-kill count of our memory cgroup, or None where none can be read."""
    v1, v2 = memory_cgroups(membership)
    if v2 is not None:
        found = _field(os.path.join(root + v2, "memory.events"), "oom_kill")
        if found is not None:
            return found
    if v1 is not None:
        directory = os.path.join(root, "memory") + v1
        found = _field(os.path.join(directory, "memory.oom_control"), "oom_kill")
        return found if found is not None else _number(os.path.join(directory, "memory.failcnt"))
    return None


def in_kernel_log(pid: int, since: float, path: str = KERNEL_LOG) -> bool:
    """Does the kernel log say the OOM killer killed ``pid`` after ``since`` (seconds since
    boot, ``time.monotonic()``; an earlier process may have had the same pid)? False where the
    log is unreadable."""
    killed = re.compile(rf"Killed process {pid}\b")
    for line in _read_all(path).splitlines():
        record = _RECORD.match(line)  # "6,1234,5678901,-;Out of memory: Killed process 42 (python) ..."
        if record and int(record["usec"]) >= since * 1e6 and killed.search(record["text"]):
            return True
    return False


_RECORD = re.compile(r"\d+,\d+,(?P<usec>\d+),[^;]*;(?P<text>.*)")


def killed_by_oom(pid: int, kills_before: int | None, since: float) -> bool:
    """Was ``pid``, dead of SIGKILL, killed by the OOM killer? ``kills_before`` is
    :func:`oom_kills` from when it started, at ``since``."""
    kills_now = oom_kills()
    if kills_before is not None and kills_now is not None and kills_now > kills_before:
        return True
    return in_kernel_log(pid, since)


def memory_cgroups(membership: str) -> tuple[str | None, str | None]:
    """Our cgroup in the v1 ``memory`` hierarchy and in the v2 one, from ``/proc/self/cgroup``
    (lines ``4:memory:/path`` and ``0::/path``)."""
    v1 = v2 = None
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _field(path: str, name: str) -> int | None:
    """The value of line ``name N`` of a flat-keyed cgroup file."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _number(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _read_all(path: str) -> str:
    """A whole file, or every record ``/dev/kmsg`` holds now (one per read, never blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break  # /dev/kmsg: no more records
            except BrokenPipeError:
                continue  # /dev/kmsg: records were overwritten while we read; it skips them
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")
