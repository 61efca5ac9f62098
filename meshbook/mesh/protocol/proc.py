"""Process plumbing shared by the host agent and the ranks: death signals, exit causes,
which interface torch.distributed listens on, and taking every descendant down."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import select
import signal
import sys
import tempfile
import time
import weakref
from typing import Any, Iterator

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: Linux's C library, for what Python has no call for (prctl, fflush, sendmmsg); None elsewhere.
LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True) if sys.platform.startswith("linux") else None


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the system has one (a login node
    or a container may cap a user to a few of the machine's), else every core."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has.

    Linux ties PDEATHSIG to the *thread* that forked us, so callers only use it where that
    thread lives as long as the process (the agent's main thread, which forks the ranks).
    The check after the call closes the race where the parent died before we asked.
    """
    if LIBC is not None:
        LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(1)


def listen_only_on(address: str) -> None:
    """Make gloo and NCCL's bootstrap listen on the interface that holds ``address`` only.

    Left alone, gloo binds the address the host name resolves to, which other machines can
    reach; a local mesh (``address`` is loopback) needs no listener outside the machine. A
    site's own choice (set in the environment) wins: clusters name the fabric NCCL must use.
    """
    import psutil

    for interface, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
            return


class Liveness:
    """When a host agent last heard its controller, in a page it shares with its ranks (an
    anonymous shared mapping, made before it forks them): a rank reads it without asking
    anyone, so it can stop itself when its agent can no longer stop it (a stopped or hung
    agent, a host cut off). ``time.monotonic()`` is one clock for every process of a host.

    The time is one aligned 8-byte word, written and read whole through a memoryview (a
    single store and load). Not ``struct.pack_into``: it zero-fills the field before it
    writes it, and a rank that read in between saw silence since boot and stopped itself."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE)
        self._heard = memoryview(self._page).cast("d")
        self.beat(time.monotonic())

    def beat(self, heard: float) -> None:
        """The agent: its controller was last heard at ``heard`` (monotonic seconds)."""
        self._heard[0] = heard

    def silence(self) -> float:
        """A rank: seconds since its agent last heard the controller."""
        return time.monotonic() - self._heard[0]


def exited(pid: int) -> bool:
    """Has process ``pid`` (on this host) exited: gone, or a zombie whose files are closed and
    whose parent has yet to reap it?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` still there (on this host; another user's counts)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def readable(fd: int, timeout: float) -> bool:
    """Has ``fd`` something to read (or its end), within ``timeout`` seconds? ``poll``, not
    ``select``: a notebook holding many pulled values has descriptors past 1024, which
    ``select`` refuses ("filedescriptor out of range")."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def owned_prefix(kind: str) -> str:
    """``kind-<pid>-<host>-``: the start of a name for a file or directory this process owns,
    so that whoever finds it later can tell whether its owner still lives (see
    :func:`remove_stale`). The host is a short hash of its name: a runtime directory may be
    shared by several hosts, where a pid means nothing."""
    return f"{kind}-{os.getpid()}-{_host_tag()}-"


def remove_stale(directory: str, kinds: tuple[str, ...]) -> list[str]:
    """Remove what processes of this host and user left in ``directory`` when they were
    killed (a SIGKILLed kernel cannot clean up): entries named by :func:`owned_prefix` whose
    pid is dead. Returns what was removed."""
    import re
    import shutil

    pattern = re.compile(rf"^({'|'.join(map(re.escape, kinds))})-(\d+)-{_host_tag()}-")
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        try:
            if match is None or entry.stat(follow_symlinks=False).st_uid != os.getuid() \
                    or pid_alive(int(match.group(2))):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
    return removed


def _host_tag() -> str:
    import hashlib
    import socket

    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:4]


def runtime_base() -> str:
    """Where a process makes its private runtime directory: ``ipc://`` paths must stay under
    ~100 bytes, and ``XDG_RUNTIME_DIR`` is private and short."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK) and len(base) < 60:
        return base
    return tempfile.gettempdir()


def become_subreaper() -> None:
    """Adopt our orphaned descendants: what a rank's child starts and leaves behind
    (``setsid``, a double fork) stays in our tree, so :func:`kill_descendants` finds it."""
    if LIBC is not None:
        LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_descendants(timeout: float = 3.0) -> None:
    """SIGKILL every process below this one, however it detached, and reap what we adopted.

    Repeated until none is left, since a descendant may fork while the others die.
    """
    import psutil

    me = psutil.Process()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = me.children(recursive=True)
        if not found:
            return
        for child in found:
            try:
                child.kill()
            except psutil.Error:
                pass
        for _ in exited_children():
            pass  # reaped
        time.sleep(0.01)


def exited_children() -> Iterator[tuple[int, int]]:
    """``(pid, waitpid status)`` of each child of ours that has exited (adopted orphans
    included), reaping it; never blocks."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def flush_c_stdio() -> None:
    """Flush C ``stdio`` buffers, so C-level prints reach the pipe before a result is sent."""
    if LIBC is not None:
        LIBC.fflush(None)


def describe_status(status: int) -> str:
    """A waitpid status as people say it: ``"SIGKILL"``, ``"exit code 3"``."""
    if os.WIFSIGNALED(status):
        return signal_name(os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"status {status}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: What stands for this process only, and the method that lets it go in a child this process
#: forks (weakly held: a flag cleared at the fork, not a ``getpid()`` on every message).
_LET_GO_IN_CHILDREN: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def let_go_in_children(obj: Any, method: str) -> None:
    """Call ``obj.<method>()`` in every child this process forks from now on: a rank's ring of
    last words and its lane up are the rank's, never a child's (:mod:`.lastwords`, :mod:`.lane`)."""
    _LET_GO_IN_CHILDREN[obj] = method


def _let_go_all() -> None:
    for obj, method in list(_LET_GO_IN_CHILDREN.items()):
        getattr(obj, method)()


os.register_at_fork(after_in_child=_let_go_all)
