"""Every rank's collectives lined up: exact waiting per rank, and who arrives last.

Ranks send when they entered and left each collective (:mod:`meshbook.mesh.rank.collectives`):
per process group, the n-th collective of every member is the same collective. Once every
member's n-th has arrived, the collective is *complete* here, and:

* each rank's **waiting** is its time inside the call (for an async call, whose ``wait()`` is
  not seen: from its entry until the last member's), so its **computing** is the rest of its
  duration, exactly, where sampling a few times a second could not split an 8 s cell;
* each rank's **lateness** is its entry minus the group's earliest entry: the rank the others
  wait for is the one that arrives last, collective after collective. A rank's share of a run's
  lateness (its lateness over the summed spread, first to last arrival, of the collectives) is
  its straggler score: about 1 for the rank that is always last, about 0 for the others. The
  score leaves out the collective with the longest spread: one stall is not a straggler. (A
  first DDP imports 800 modules; on a loaded machine one rank finished that 2.5 s after
  another, and that one collective outweighed twelve steps of a rank 0.1 s late.)

Collectives issued outside torch.distributed's Python functions (DDP's, from C++) come from
the ranks' flight recorders, numbered below 0 in their own sequence: they count for the figures
above, never for the pairing check (their request is placed by time, not known by the call).

Ranks on other hosts stamp with their own clocks: each host's offset, measured from the agents'
pings (``HostLink.clock_offset_ns``), is taken off before anything is compared. This module is
pure state: batches in, figures out, tested without processes (tests/test_clock.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ...protocol.config import WINDOW_S

#: How many requests keep their figures (the cell status reads a run's once it ended).
KEPT_REQUESTS = 64
#: How many collectives found wrong (paired across requests, or called with other tensors) are
#: kept per request (each names its ranks).
WRONG_KEPT = 16
#: A collective still missing members after this long is dropped (a member died, or failed
#: before joining: it will never be complete).
OPEN_FOR_S = 120.0


@dataclass
class RequestTimes:
    """One request's collectives, summed per rank."""

    waiting_ns: dict[int, int] = field(default_factory=dict)
    late_ns: dict[int, int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # collectives at which the rank came last
    collectives: dict[int, int] = field(default_factory=dict)
    spread_ns: int = 0  # summed over complete collectives: last arrival minus first
    longest_spread_ns: int = 0  # the collective with the longest spread, and its {rank: (late, waiting)}
    longest: dict[int, tuple[int, int]] = field(default_factory=dict)
    complete: int = 0
    first_ns: int = 0  # the earliest entry seen, and the latest exit or entry
    last_ns: int = 0


@dataclass(frozen=True)
class Mispaired:
    """A collective whose members issued it in different requests: the n-th call of each
    member paired, but they came from different cells (one ran on some members while a later
    cell reached the others first). Each member's request, by rank."""

    group: str
    n: int
    members: tuple[int, ...]
    requests: dict[int, int]


@dataclass(frozen=True)
class Lateness:
    """Per rank, how late it arrived at a request's complete collectives (or a window's)."""

    late_s: dict[int, float]
    last: dict[int, int]
    spread_s: float  # summed over the collectives: first arrival to last
    complete: int
    span_s: float  # from the first entry to the last exit
    waiting_s: dict[int, float]  # inside these collectives
    longest_spread_s: float  # the longest spread of one collective
    longest_late_s: dict[int, float]  # each rank's lateness at that collective

    @property
    def steady_spread_s(self) -> float:
        """The summed spread without the longest one: what a straggler's score is a share of."""
        return self.spread_s - self.longest_spread_s

    @property
    def steady_span_s(self) -> float:
        """The time from the first entry to the last exit, without the longest spread."""
        return self.span_s - self.longest_spread_s

    def score(self, rank: int) -> float:
        """``rank``'s share of the waiting its lateness caused, 0 (never late) to 1 (always
        the last to arrive, by the whole spread), leaving out the collective with the longest
        spread: a single stall, however long, scores nothing."""
        steady = self.steady_spread_s
        late = self.late_s.get(rank, 0.0) - self.longest_late_s.get(rank, 0.0)
        return min(1.0, max(0.0, late) / steady) if steady > 0 else 0.0


@dataclass(frozen=True)
class Mismatched:
    """A collective whose members called it with tensors of other sizes or dtypes, or called
    other collectives as its number: what each called, by rank (``(op, elements, dtype, shape)``,
    or ``(op,)`` for a collective whose tensors may differ)."""

    group: str
    n: int
    members: tuple[int, ...]
    calls: dict[int, tuple[Any, ...]]


#: A member's part of a collective: (request, entered, left or 0, what it called or None).
Arrival = tuple[int, int, int, tuple[Any, ...] | None]


class CollectiveTimes:
    """The controller's book of collectives, fed by the ranks' ``COLLECTIVES`` batches."""

    def __init__(self, now_ns: Any = time.time_ns) -> None:
        self._now_ns = now_ns
        #: (rank, the rank's own key) -> (generation, group name, members)
        self._groups: dict[tuple[int, int], tuple[int, str, tuple[int, ...]]] = {}
        #: (generation, group name, n) -> {rank: (request, entered, left, called)}, until complete
        self._open: dict[tuple[int, str, int], dict[int, Arrival]] = {}
        self._requests: OrderedDict[int, RequestTimes] = OrderedDict()
        #: Complete collectives, newest last: (first entry, request, {rank: (late, waiting)},
        #: spread, the rank that came last, the last exit).
        self._recent: deque[tuple[int, int, dict[int, tuple[int, int]], int, int, int]] = deque()
        #: Collectives paired across requests, by each request they involve (see ``mispaired``),
        #: and those whose members called them with different tensors (see ``mismatched``).
        self._mispaired: OrderedDict[int, list[Mispaired]] = OrderedDict()
        self._mismatched: OrderedDict[int, list[Mismatched]] = OrderedDict()

    def add(self, rank: int, batch: dict[str, Any], offset_ns: int = 0) -> None:
        """A rank's batch; ``offset_ns`` is how far its host's clock runs ahead of ours."""
        for key, group in batch.get("keys", {}).items():
            generation, name, members = group
            self._groups[(rank, int(key))] = (int(generation), str(name), tuple(members))
        for request, key, n, entered, left, called in batch.get("entries", ()):
            group = self._groups.get((rank, key))
            if group is None or request is None:
                continue  # meshbook's own set-up, or a group it never described
            entered -= offset_ns
            left = left - offset_ns if left else 0
            times = self._times(request)
            times.first_ns = min(times.first_ns or entered, entered)
            times.last_ns = max(times.last_ns, left or entered)
            times.collectives[rank] = times.collectives.get(rank, 0) + 1
            if left:
                times.waiting_ns[rank] = times.waiting_ns.get(rank, 0) + left - entered
            generation, name, members = group
            arrived = self._open.setdefault((generation, name, n), {})
            arrived[rank] = (request, entered, left, called)
            if set(arrived) >= set(members):
                del self._open[(generation, name, n)]
                self._complete(arrived)
                if n > 0:  # below 0: the flight recorder's, placed in a request by time only
                    self._check_pairing(name, n, members, arrived)
        self._prune()

    def _check_pairing(self, name: str, n: int, members: tuple[int, ...], arrived: dict[int, Arrival]) -> None:
        """Book ``arrived`` if its members issued it in different requests, or called it with
        different tensors (every complete collective passes here, on the receiver thread: the
        usual answer is two loops, no dict)."""
        first, _, _, called = next(iter(arrived.values()))
        if all(request == first for request, _, _, _ in arrived.values()):
            if called is not None and any(c is not None and c[:3] != called[:3] for _, _, _, c in arrived.values()):
                calls = {rank: c for rank, (_, _, _, c) in arrived.items() if c is not None}
                _keep(self._mismatched, [first], Mismatched(name, n, members, calls))
            return
        found = Mispaired(name, n, members, {rank: request for rank, (request, _, _, _) in arrived.items()})
        _keep(self._mispaired, set(found.requests.values()), found)

    def _complete(self, arrived: dict[int, Arrival]) -> None:
        first = min(e for _, e, _, _ in arrived.values())
        last_at = max(e for _, e, _, _ in arrived.values())
        latest = max(arrived, key=lambda r: arrived[r][1])
        ranks: dict[int, tuple[int, int]] = {}
        for rank, (request, entered, left, _) in arrived.items():
            times = self._times(request)
            times.late_ns[rank] = times.late_ns.get(rank, 0) + entered - first
            if not left:  # async: its wait() is not seen; it waited until the last member came
                times.waiting_ns[rank] = times.waiting_ns.get(rank, 0) + last_at - entered
            ranks[rank] = (entered - first, (left or last_at) - entered)
        request = arrived[latest][0]
        times = self._times(request)
        times.spread_ns += last_at - first
        if last_at - first > times.longest_spread_ns:
            times.longest_spread_ns, times.longest = last_at - first, ranks
        times.complete += 1
        if last_at > first:
            times.last[latest] = times.last.get(latest, 0) + 1
        exit_at = max(left or last_at for _, _, left, _ in arrived.values())
        self._recent.append((first, request, ranks, last_at - first, latest, exit_at))

    def _times(self, request: int) -> RequestTimes:
        times = self._requests.get(request)
        if times is None:
            times = self._requests[request] = RequestTimes()
            while len(self._requests) > KEPT_REQUESTS:
                self._requests.popitem(last=False)
        return times

    def _prune(self) -> None:
        now = self._now_ns()
        stale = now - int(OPEN_FOR_S * 1e9)
        for key in [k for k, arrived in self._open.items() if min(e for _, e, _, _ in arrived.values()) < stale]:
            del self._open[key]
        horizon = now - int(2 * WINDOW_S * 1e9)
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    # -- figures -------------------------------------------------------------------------------

    def mispaired(self, request: int) -> list[Mispaired]:
        """The collectives ``request`` issued that paired with another request's on some
        member. Whether that is wrong is the caller's to say: a cell on rank 0 that sends, and
        a later cell on rank 1 that receives, pair across cells on purpose."""
        return list(self._mispaired.get(request, ()))

    def mismatched(self, request: int) -> list[Mismatched]:
        """The collectives ``request`` issued whose members called them with tensors of other
        sizes or dtypes (or called other collectives as the same one): what they computed is wrong."""
        return list(self._mismatched.get(request, ()))

    def unsettled(self, request: int, ranks: Collection[int]) -> bool:
        """Whether a collective that one of ``ranks`` (those that ran ``request`` to its end)
        issued there and left waits for another member's report: it completed, so every
        member issued it, but in which request is unknown until that member says. Usually
        nothing is open."""
        return any(req == request and left and rank in ranks
                   for arrived in self._open.values() for rank, (req, _, left, _) in arrived.items())

    @property
    def incomplete(self) -> int:
        """Collectives some member has not reported yet."""
        return len(self._open)

    def waiting(self, request: int) -> dict[int, float] | None:
        """Seconds each rank of ``request`` spent waiting in collectives (None: it recorded
        none, the figures must come from elsewhere)."""
        times = self._requests.get(request)
        if times is None or not times.collectives:
            return None
        return {r: times.waiting_ns.get(r, 0) / 1e9 for r in times.collectives}

    def lateness(self, request: int) -> Lateness | None:
        """How late each rank arrived at ``request``'s complete collectives."""
        times = self._requests.get(request)
        if times is None or not times.complete:
            return None
        return Lateness({r: ns / 1e9 for r, ns in times.late_ns.items()}, dict(times.last),
                        times.spread_ns / 1e9, times.complete, (times.last_ns - times.first_ns) / 1e9,
                        {r: ns / 1e9 for r, ns in times.waiting_ns.items()},
                        times.longest_spread_ns / 1e9, {r: ns / 1e9 for r, (ns, _) in times.longest.items()})

    def recent(self, window_s: float = WINDOW_S) -> tuple[int, Lateness] | None:
        """The last ``window_s`` seconds of the newest request's complete collectives (the live
        view of a loop still running), and that request."""
        if not self._recent:
            return None
        request = self._recent[-1][1]
        newest, end = self._recent[-1][0], self._recent[-1][5]
        late: dict[int, int] = {}
        longest: dict[int, tuple[int, int]] = {}
        waiting: dict[int, int] = {}
        last: dict[int, int] = {}
        spread = count = longest_spread = 0
        first = newest
        for at, req, ranks, gap, latest, _ in reversed(self._recent):
            if at < newest - window_s * 1e9:
                break
            if req != request:
                continue
            first = at
            count += 1
            spread += gap
            if gap > longest_spread:
                longest_spread, longest = gap, ranks
            if gap:
                last[latest] = last.get(latest, 0) + 1
            for rank, (ns, waited) in ranks.items():
                late[rank] = late.get(rank, 0) + ns
                waiting[rank] = waiting.get(rank, 0) + waited
        return request, Lateness({r: ns / 1e9 for r, ns in late.items()}, last, spread / 1e9, count,
                                 (end - first) / 1e9, {r: ns / 1e9 for r, ns in waiting.items()},
                                 longest_spread / 1e9, {r: ns / 1e9 for r, (ns, _) in longest.items()})


def _keep(book: "OrderedDict[int, list[Any]]", requests: Collection[int], found: Any) -> None:
    """Book ``found`` under each of ``requests``: the first few of each request (a loop of them
    says no more), for the newest requests."""
    for request in requests:
        kept = book.setdefault(request, [])
        if len(kept) < WRONG_KEPT:
            kept.append(found)
        book.move_to_end(request)
    while len(book) > KEPT_REQUESTS:
        book.popitem(last=False)
