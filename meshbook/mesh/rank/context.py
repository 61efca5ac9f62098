"""What a rank's parts know of the rank: its configuration, and the face of its worker.

A rank's helpers (its actors, its debugger, torchrun's emulation, the operations it runs on
request) act on the rank's :class:`~.worker.Worker`, which builds them in turn; they are typed
against :class:`RankContext`, the part of the worker they use, so none imports the worker
(no import circle). :class:`RankConfig` is what the agent hands a rank it forks.
"""

from __future__ import annotations

import queue
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol import proc, wire
from ..protocol.lastwords import LastWords
from ..protocol.topology import Topology


@dataclass
class RankConfig:
    """Everything a forked rank needs; handed over in memory by the fork, never pickled."""

    rank: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the host's index (torchrun's GROUP_RANK)
    group_world_size: int  # how many hosts
    topology: Topology
    backend: str  # "gloo", or "cuda:nccl,cpu:gloo" on GPUs
    device_type: str  # "cpu" or "cuda"
    listen_addr: str  # this host's address: its interface is the one torch.distributed listens on
    #: The TCPStore of a mesh across hosts (its host 0's agent keeps it); None: a FileStore in
    #: the private runtime directory, on one host.
    store_addr: tuple[str, int] | None
    rundir: str  # the private runtime directory of this host's part of the mesh
    master_port: int  # torchrun's MASTER_PORT for scripts that read it
    generation: int
    collective_timeout: float
    key: bytes
    agent_pid: int
    request_addr: str
    control_addr: str
    events_addr: str
    pipes: dict[str, tuple[int, int]]
    crash_path: str
    threads: int | None  # torch's intra-op threads (None: torch's default)
    threads_note: str  # how that was decided, for the start line
    #: When the agent last heard the controller (a page shared with it), and how long this rank
    #: may go on without: past that its host counts as lost, and the rank stops itself.
    liveness: proc.Liveness
    lost_s: float
    #: Where this rank keeps its last messages for its agent (should it die before they left).
    last_words: LastWords


class RankContext(Protocol):
    """The worker as its helpers see it."""

    rank: int
    cfg: RankConfig
    wire: wire.Wire
    namespace: dict[str, Any]
    #: This rank's device (a ``torch.device``), where arguments and pushed values land: the
    #: namespace's ``device`` is the user's to rebind in a cell.
    device: Any
    #: The request the main thread runs now (None: idle).
    request: int | None
    stdin_available: bool
    #: Lines typed in the notebook for this rank's ``input()`` or pdb, with the number of the
    #: question each answers; None: the end of input.
    input_replies: "queue.Queue[tuple[int, str | None]]"
    stdout: Any
    stderr: Any
    actors: Any
    #: The debugger session open on the main thread (None: none), ended with its request.
    debugger: Any

    def emit(self, kind: str, request: int | None, body: Any = None, wait: bool = False, **header: Any) -> None: ...

    def current_request(self) -> int | None: ...

    def user_code(self) -> AbstractContextManager[Any]: ...

    def run_awaitable(self, coroutine: Any) -> Any: ...

    def note_once(self, key: str, text: str) -> None: ...

    def note_unknown(self, kind: str, channel: str) -> None: ...
