"""Where a rank's main thread spends its time: waiting in a collective, or computing.

A training loop runs as one long request, so per-request durations cannot say which rank holds
the others back. Instead the rank's control thread looks at its main thread's stack a few
times a second (``sys._current_frames()``: no signal, no tracing hook, the main thread is not
stopped) and classifies each look, a *sample*:

* **waiting**: the main thread is inside a torch.distributed collective (a frame of
  ``distributed_c10d.py``, its logging wrapper or the functional collectives), or blocked in a
  ``.wait()`` on a work handle or future, which happens in C below the calling line;
* **computing**: anything else it does while it runs a request. An idle rank is not sampled.

:class:`MainThreadSampler` keeps the samples of a sliding window (``WINDOW_S``) and its
:meth:`~MainThreadSampler.report` rides in every heartbeat: the request it describes (the
latest one sampled: evidence from an earlier cell never speaks for the current one), how many
samples, the fraction spent waiting, and the few places the rank spends most of its time
(``"cell line 5"``, ``"all_reduce at cell line 6"``). The controller compares the ranks that
run the same request (:mod:`meshbook.mesh.controller.insight.stragglers`): the rank that waits least while the
others wait is the one they wait for.

The window slides with the samples, not with the clock: an idle rank takes none, so the last
request's window stays as it was until the next request is sampled, and ``%mesh stragglers``
right after a training loop still names the straggler. Two more figures ride along: the
fraction of the *whole* request spent waiting (a cell's end splits each rank's time into
computing and waiting), and how long the main thread has been inside the *same* collective
call (``stuck_s``: the same call from one sample to the next, so a loop that waits in a new
all_reduce each step never adds up). A cell explains a hang from the latter without waiting
for any rank to finish. A call is known by its number from the collective clock
(:mod:`.collectives` numbers every call it wraps), else by its frame's address and code: never
by the frame itself, whose locals (and its callers', FSDP's gradient buffers among them) a
held frame would keep alive into the next step, a peak no plan predicts. A ``.wait()`` on a
work handle runs in the same frame step after step, so it never counts as stuck.

A sample walks only the user's frames (it stops at meshbook's own machinery) and classifies
each code object once, so it costs microseconds; at five samples a second that is far below
1% of a core. Collectives issued from C++ (DDP's gradient all-reduce inside ``backward()``)
have no Python frame and count as computing.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from ..protocol.cell import CELL_PREFIX, is_internal
from ..protocol.config import WINDOW_S

#: Minimum gap between samples, however often the control loop wakes (it wakes every 0.2 s).
SAMPLE_GAP_S = 0.1
#: How many of a rank's busiest places a report names.
TOP_PLACES = 3

_COLLECTIVE_FILES = tuple(os.path.join("torch", "distributed", name) for name in
                          ("distributed_c10d.py", "c10d_logger.py", "_functional_collectives.py"))
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "purelib", "platlib")})
# Kinds of code, cached per code object (the walk then costs a dict lookup per frame).
_MACHINERY, _COLLECTIVE, _LIBRARY, _USER = range(4)
_CACHE_LIMIT = 4096  # cell code is compiled anew per cell: bound what the caches keep alive


@dataclass(frozen=True)
class Sample:
    t: float
    request: int
    waiting: bool
    where: str


class MainThreadSampler:
    """Samples the main thread from the control thread; reports a sliding window.

    ``frame`` returns the main thread's current frame, ``request`` the request it runs
    (``None`` when idle). Used from the control thread only (sampling and heartbeats both
    happen there).
    """

    def __init__(self, frame: Callable[[], FrameType | None], request: Callable[[], int | None],
                 window: float = WINDOW_S, gap: float = SAMPLE_GAP_S,
                 device_wait: Callable[[], tuple[str, float] | None] | None = None,
                 call: Callable[[], int | None] = lambda: None) -> None:
        self._frame = frame
        self._request = request
        #: The number of the wrapped collective call the main thread is in (see collectives.py).
        self._call = call
        #: On NCCL: the oldest collective still running on the GPU and its age (see
        #: ``torch_compat.oldest_nccl_pending``): the main thread waits for it outside any
        #: collective's frame (``.item()``, ``synchronize()``).
        self._device_wait = device_wait
        self._device_stuck = 0.0
        self.window = window
        self.gap = gap
        #: Sampling can be paused (e.g. to measure what it costs); reports then age out.
        self.enabled = True
        #: Why sampling stopped, if it failed (reported in every heartbeat from then on).
        self.error: str | None = None
        self._samples: deque[Sample] = deque()
        self._next = 0.0
        # (request, samples, waiting samples) over the whole request
        self._total: tuple[int | None, int, int] = (None, 0, 0)
        self._stuck: tuple[tuple[Any, ...], float, float] | None = None  # (the call's identity, first, last)

    def tick(self, now: float) -> None:
        """Take a sample if one is due and the main thread is busy; drop the samples older
        than the window before the latest one (an idle rank keeps its last window)."""
        if self.enabled and self.error is None and now >= self._next:
            self._next = now + self.gap
            try:
                self._sample(now)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the control thread
                self.error = f"{type(exc).__name__}: {exc}"
                self._stuck = None
        latest = self._samples[-1].t if self._samples else now
        while self._samples and self._samples[0].t < latest - self.window:
            self._samples.popleft()

    def _sample(self, now: float) -> None:
        request = self._request()
        frame = self._frame() if request is not None else None
        found = _classify(frame) if frame is not None else None
        if request is None or found is None:
            self._stuck = None
            self._device_stuck = 0.0
            return
        waiting, where, call = found
        device = self._device_wait() if self._device_wait is not None else None
        self._device_stuck = device[1] if device is not None else 0.0
        if device is not None and not waiting and device[1] >= self.gap:
            waiting, where = True, f"{device[0]} on the GPU, from {where}"
        self._samples.append(Sample(now, request, waiting, where))
        same, samples, waits = self._total
        self._total = (request, samples + 1, waits + waiting) if same == request else (request, 1, int(waiting))
        stuck, identity = self._stuck, self._identity(call)
        if identity is None:
            self._stuck = None
        elif stuck is not None and stuck[0] == identity:
            self._stuck = (identity, stuck[1], now)
        else:
            self._stuck = (identity, now, now)

    def _identity(self, call: FrameType | None) -> tuple[Any, ...] | None:
        """What tells this collective call from the next (see the module's docstring)."""
        if call is None:
            return None
        number = self._call()
        return ("wrapped", number) if number is not None else (id(call), call.f_code)

    def report(self) -> dict[str, Any]:
        """The window's samples of the latest request sampled, for a heartbeat:
        ``{"request", "n", "wait", "top": [[where, waiting, fraction]], "window",
        "total_n", "total_wait", "stuck_s"}``: ``total_*`` cover the whole request,
        ``stuck_s`` the current collective call (0 when not in one)."""
        samples = list(self._samples)
        if not samples:
            return {"request": None, "n": 0, "wait": 0.0, "top": [], "window": self.window,
                    "error": self.error, "total_n": 0, "total_wait": 0.0, "stuck_s": 0.0}
        request = samples[-1].request
        samples = [s for s in samples if s.request == request]
        n = len(samples)
        places = Counter((s.where, s.waiting) for s in samples)
        top = [[where, waiting, round(count / n, 3)]
               for (where, waiting), count in places.most_common(TOP_PLACES)]
        waiting = sum(s.waiting for s in samples)
        _, total, total_waits = self._total
        stuck = self._stuck
        return {"request": request, "n": n, "wait": round(waiting / n, 3), "top": top,
                "window": self.window, "error": self.error, "total_n": total,
                "total_wait": round(total_waits / total, 3) if total else 0.0,
                "stuck_s": round(max(stuck[2] - stuck[1] if stuck else 0.0, self._device_stuck), 1)}


def classify(frame: FrameType) -> tuple[bool, str] | None:
    """Is this stack waiting in a collective, and where is the user's code (innermost first)?

    ``None`` when the stack holds no frame outside meshbook's own machinery.
    """
    found = _classify(frame)
    return None if found is None else found[:2]


def _classify(frame: FrameType) -> tuple[bool, str, FrameType | None] | None:
    """:func:`classify`, plus the frame of the collective call the user made (``None``
    when not in a torch.distributed collective)."""
    collective: FrameType | None = None
    user: FrameType | None = None
    innermost: FrameType | None = None
    f: FrameType | None = frame
    while f is not None:
        kind = _kind(f.f_code)
        if kind == _MACHINERY:
            break  # everything further out is the worker's request loop
        innermost = innermost or f
        if kind == _COLLECTIVE and f.f_code.co_name != "wrapper":
            collective = f  # the outermost one: the call the user made
        elif kind == _USER and user is None:
            user = f
        f = f.f_back
    if innermost is None:
        return None
    place = _describe(user or innermost)
    if collective is not None:
        return True, f"{collective.f_code.co_name} at {place}", collective
    if _blocks_in_wait(innermost):
        return True, f"wait at {place}", None
    return False, place, None


def see_through(codes: set[CodeType]) -> None:
    """Frames of these code objects are neither the user's nor meshbook's request loop: the
    walk goes on past them (the thin wrappers that time collectives, see ``collectives.py``)."""
    _see_through.update(codes)


def _kind(code: CodeType) -> int:
    if code in _see_through:
        return _LIBRARY
    kind = _kinds.get(code)
    if kind is None:
        if len(_kinds) >= _CACHE_LIMIT:
            _kinds.clear()
        name = code.co_filename
        if name.startswith(CELL_PREFIX):
            kind = _USER
        elif is_internal(name):
            kind = _MACHINERY
        elif name.endswith(_COLLECTIVE_FILES):
            kind = _COLLECTIVE
        elif name.startswith(_LIBRARY_DIRS) or name.startswith("<frozen"):
            kind = _LIBRARY
        else:
            kind = _USER
        _kinds[code] = kind
    return kind


def _blocks_in_wait(frame: FrameType) -> bool:
    """The innermost Python frame is on a ``x.wait(...)`` line: ``Work.wait()``, a future's
    ``wait()``, ``torch.cuda.Event.wait``... block in C, below any Python frame."""
    lineno = frame.f_lineno
    if lineno is None:  # between lines (e.g. entering a function): not blocked in a call
        return False
    key = (frame.f_code, lineno)
    found = _waits.get(key)
    if found is None:
        if len(_waits) >= _CACHE_LIMIT:
            _waits.clear()
        found = _waits[key] = ".wait(" in linecache.getline(frame.f_code.co_filename, lineno)
    return found


def _describe(frame: FrameType) -> str:
    name = frame.f_code.co_filename
    lineno = frame.f_lineno or frame.f_code.co_firstlineno  # None while entering a function
    if name.startswith(CELL_PREFIX):
        return f"cell line {lineno}"
    return f"{os.path.basename(name)}:{lineno} in {frame.f_code.co_name}"


_kinds: dict[CodeType, int] = {}
_see_through: set[CodeType] = set()
_waits: dict[tuple[CodeType, int], bool] = {}
