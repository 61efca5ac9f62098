"""The controller's book of collectives, on its own: batches in, waiting and lateness out; and
the rank's clock that fills the batches."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from meshbook.mesh.controller.insight.clock import CollectiveTimes
from meshbook.mesh.controller.insight.stragglers import straggler_report
from meshbook.mesh.rank.collectives import CollectiveClock

S = 1_000_000_000  # nanoseconds in a second
WORLD = (0, "0", (0, 1, 2))


def batch(rank: int, entries: list[tuple[int, int, float, float]], request: int = 5,
          called: tuple | None = ("all_reduce", 8, "Float", (8,))) -> dict:
    """A rank's batch: (group key, n, entered s, left s or 0 for an async call), each a
    ``called`` collective."""
    return {"keys": {0: WORLD},
            "entries": [(request, key, n, int(t0 * S), int(t1 * S), called) for key, n, t0, t1 in entries]}


def loop(times: CollectiveTimes, steps: int = 10, slow: int = 2, offsets: dict[int, float] = {}) -> None:
    """Three ranks; ``slow`` computes 0.2 s a step, the others 0.05 s, then an all_reduce."""
    for rank in range(3):
        entries = []
        for step in range(1, steps + 1):
            start = 100.0 + 0.2 * step  # when the slow rank arrives: the collective completes then
            entered = start if rank == slow else start - 0.15
            entries.append((0, step, entered + offsets.get(rank, 0.0), start + 0.001 + offsets.get(rank, 0.0)))
        times.add(rank, batch(rank, entries), offset_ns=int(offsets.get(rank, 0.0) * S))


def test_waiting_is_the_time_inside_each_collective() -> None:
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    loop(times)
    waiting = times.waiting(5)
    assert waiting is not None
    assert abs(waiting[0] - 10 * 0.151) < 1e-6 and abs(waiting[1] - 10 * 0.151) < 1e-6
    assert abs(waiting[2] - 10 * 0.001) < 1e-6


def test_the_rank_that_arrives_last_is_the_straggler() -> None:
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    loop(times)
    arrivals = times.lateness(5)
    assert arrivals is not None and arrivals.complete == 10 and arrivals.last == {2: 10}
    assert round(arrivals.score(2), 3) == 1.0 and arrivals.score(0) == 0.0
    report = straggler_report({}, arrivals=arrivals)
    assert report.stragglers == [2]
    assert report.summary()[0] == ("straggler: rank 2 (score 1.00): it arrived last at 10 of 10 collectives, "
                                   "150 ms late on average: the others waited 1.5 s for it")


def test_other_hosts_clocks_are_corrected() -> None:
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    loop(times, offsets={1: 3.0, 2: -2.5})  # rank 1's host runs 3 s ahead, rank 2's behind
    arrivals = times.lateness(5)
    assert arrivals is not None and arrivals.last == {2: 10}
    assert abs(arrivals.late_s[2] - 1.5) < 1e-6 and abs(arrivals.late_s[1]) < 1e-6


def test_ranks_arriving_together_name_no_straggler() -> None:
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    for rank in range(3):  # jitter of a millisecond or two, the last one changing each step
        times.add(rank, batch(rank, [(0, n, 100 + n * 0.1 + ((rank + n) % 3) * 0.001, 100 + n * 0.1 + 0.003)
                                     for n in range(1, 21)]))
    report = straggler_report({}, arrivals=times.lateness(5))
    assert report.stragglers == []
    assert report.summary()[0].startswith("no straggler: the ranks reach their collectives together")


def stalled_loop(times: CollectiveTimes, late: float, stall: float = 2.5, steps: int = 12,
                 period: float = 0.2) -> None:
    """Three ranks, ``steps`` collectives ``period`` apart: rank 1 arrives ``stall`` s after the
    others at the first (one stall: a first DDP's imports did this on a loaded machine), rank 2
    ``late`` s after them at each of the others."""
    for rank in range(3):
        entries = []
        for n in range(1, steps + 1):
            start = 100.0 + (stall + 0.5) * (n > 1) + period * n
            entered = start + (stall if rank == 1 and n == 1 else late if rank == 2 and n > 1 else 0.0)
            entries.append((0, n, entered, start + (stall if n == 1 else late) + 0.001))
        times.add(rank, batch(rank, entries))


def test_one_stall_does_not_make_a_straggler_nor_hide_one() -> None:
    """Scored over the whole spread, rank 1's one stall made it the straggler (score 0.69) and
    hid rank 2, last at the eleven others (0.31): the scores leave the longest spread out, and
    the stall is told on its own line."""
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    stalled_loop(times, late=0.1)
    report = straggler_report({}, arrivals=times.lateness(5))
    assert report.stragglers == [2], str(report)
    assert report.summary() == [
        "straggler: rank 2 (score 1.00): it arrived last at 11 of 12 collectives, 92 ms late on average: "
        "the others waited 1.1 s for it",
        "stall: rank 1 arrived 2.50 s after the first at one collective (a single stall, left out of the scores)"]
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    stalled_loop(times, late=0.0)
    report = straggler_report({}, arrivals=times.lateness(5))
    assert report.stragglers == [], str(report)
    assert report.summary()[0].startswith("no straggler: the ranks reach their collectives together (0%")
    assert report.summary()[1].startswith("stall: rank 1 arrived 2.50 s"), str(report)


def test_a_long_stall_does_not_make_a_straggler_immaterial() -> None:
    """The spread must be a tenth of the time to matter: of the time without the stall, or a
    5 s stall made ten 50 ms arrivals "no straggler"."""
    times = CollectiveTimes(now_ns=lambda: 110 * S)
    stalled_loop(times, late=0.05, stall=5.0, steps=11, period=0.25)
    report = straggler_report({}, arrivals=times.lateness(5))
    assert report.stragglers == [2], str(report)


def test_a_steady_stragglers_longest_arrival_is_no_stall() -> None:
    """Over four collectives, a rank 150 ms late at each: its longest arrival is one like the
    others, not a stall to tell."""
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    loop(times, steps=4)
    report = straggler_report({}, arrivals=times.lateness(5))
    assert report.stragglers == [2] and not any(line.startswith("stall:") for line in report.summary()), \
        str(report)


def test_an_async_collective_waits_until_the_last_member_came() -> None:
    times = CollectiveTimes(now_ns=lambda: 101 * S)
    times.add(0, batch(0, [(0, 1, 100.0, 0)]))  # async_op=True: no exit seen
    times.add(1, batch(1, [(0, 1, 100.3, 100.31)]))
    assert times.waiting(5)[0] == 0.0 and times.incomplete == 1  # rank 2 has not come yet
    times.add(2, batch(2, [(0, 1, 100.5, 100.51)]))
    waiting = times.waiting(5)
    assert abs(waiting[0] - 0.5) < 1e-6 and abs(waiting[1] - 0.01) < 1e-6


def test_a_collective_a_member_never_joined_is_dropped_in_time() -> None:
    now = [101 * S]
    times = CollectiveTimes(now_ns=lambda: now[0])
    times.add(0, batch(0, [(0, 1, 100.0, 100.5)]))
    times.add(1, batch(1, [(0, 1, 100.0, 100.5)]))  # rank 2 failed before joining
    assert times.lateness(5) is None and times.waiting(5) == {0: 0.5, 1: 0.5}
    now[0] = 400 * S
    times.add(0, {"entries": []})
    assert times.incomplete == 0  # the book keeps nothing for ever


def test_a_collective_whose_members_issued_it_in_different_requests_is_told() -> None:
    """Rank 0 issued the group's first collective in request 7 (a cell on rank 0 only), ranks
    1 and 2 in request 8 (a later cell on all three): it paired all the same. Both requests
    hear of it; the second collective, issued in 8 by all, is in order."""
    times = CollectiveTimes(now_ns=lambda: 101 * S)
    times.add(0, batch(0, [(0, 1, 100.0, 100.5)], request=7))
    times.add(0, batch(0, [(0, 2, 100.6, 100.7)], request=8))
    for rank in (1, 2):
        times.add(rank, batch(rank, [(0, 1, 100.4, 100.5), (0, 2, 100.6, 100.7)], request=8))
    [found] = times.mispaired(8)
    assert (found.group, found.n, found.members, found.requests) == ("0", 1, (0, 1, 2), {0: 7, 1: 8, 2: 8})
    assert times.mispaired(7) == [found] and times.mispaired(9) == []


def test_a_collective_called_with_other_tensors_or_as_another_op_is_told() -> None:
    """torch checks neither: gloo completes a broadcast into a bigger tensor. Only the elements
    and dtype count (a [2, 3] tensor all-reduced with a [6] one is fine); the recorder's
    entries (None) and calls across requests (mispaired) are not compared."""
    times = CollectiveTimes(now_ns=lambda: 101 * S)
    calls = {0: ("broadcast", 3, "Float", (3,)), 1: ("broadcast", 4, "Float", (4,)), 2: ("broadcast", 3, "Float", (3,))}
    for rank, called in calls.items():
        times.add(rank, batch(rank, [(0, 1, 100.0, 100.5)], called=called))
    [found] = times.mismatched(5)
    assert (found.n, found.members, found.calls) == (1, (0, 1, 2), calls) and times.mispaired(5) == []
    for rank, called in {0: ("all_reduce", 6, "Float", (6,)), 1: ("all_reduce", 6, "Float", (2, 3)),
                         2: None}.items():
        times.add(rank, batch(rank, [(0, 2, 100.6, 100.7)], called=called))
    for rank, called in {0: ("barrier",), 1: ("barrier",), 2: ("all_reduce", 1, "Float", ())}.items():
        times.add(rank, batch(rank, [(0, 3, 100.8, 100.9)], called=called))
    assert [f.n for f in times.mismatched(5)] == [1, 3]
    for rank in range(3):
        times.add(rank, batch(rank, [(0, 4, 101.0, 101.1)], request=7 if rank else 6,
                              called=("all_reduce", rank + 1, "Float", (rank + 1,))))
    assert times.mismatched(6) == times.mismatched(7) == [] and len(times.mispaired(7)) == 1


def test_a_request_is_unsettled_until_every_member_said_where_it_issued_what_completed() -> None:
    """Ranks 1 and 2 completed the group's first collective in request 8 (a run on them
    alone); rank 0, outside it, has not reported its part yet: whether it paired across
    requests is unknown until it does. An async call (no exit seen) or a rank that failed
    the run (not among those asked about) leaves nothing to wait for."""
    times = CollectiveTimes(now_ns=lambda: 101 * S)
    for rank in (1, 2):
        times.add(rank, batch(rank, [(0, 1, 100.4, 100.5)], request=8))
    assert times.unsettled(8, {1, 2}) and not times.unsettled(8, {0}) and not times.unsettled(9, {1, 2})
    times.add(0, batch(0, [(0, 1, 100.0, 100.5)], request=7))
    assert not times.unsettled(8, {1, 2}) and [f.requests for f in times.mispaired(8)] == [{0: 7, 1: 8, 2: 8}]
    times.add(1, batch(1, [(0, 2, 100.6, 0)], request=8))  # async_op=True
    assert not times.unsettled(8, {1, 2})


def test_the_window_shows_the_newest_request() -> None:
    times = CollectiveTimes(now_ns=lambda: 105 * S)
    loop(times)
    request, arrivals = times.recent() or (None, None)
    assert request == 5 and arrivals is not None and arrivals.last == {2: 10}
    assert abs(arrivals.waiting_s[0] - 1.51) < 1e-6


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A process group of this process alone: the rank's clock names the groups it meets."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_collective_an_interrupt_cuts_short_keeps_its_number(world_of_one: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT that arrives while a collective runs is raised once it returns, maybe in the
    clock's own code after it. The collective ran all the same: this rank's next one pairs with
    the other members' second, so it must be numbered 2, whatever became of the first's entry."""
    clock = CollectiveClock(lambda: 5)
    ran: list[int] = []
    pending = [KeyboardInterrupt()]  # the SIGINT, raised at the first call after the collective
    real = time.time_ns

    def time_ns() -> int:
        if ran and pending:
            raise pending.pop()
        return real()

    def barrier(group: object = None, async_op: bool = False) -> None:
        ran.append(1)

    monkeypatch.setattr(time, "time_ns", time_ns)
    timed = clock.wrap(barrier)
    with pytest.raises(KeyboardInterrupt):
        timed()
    timed()
    taken = clock.take()
    assert taken is not None and [entry[2] for entry in taken["entries"]][-1:] == [2]


def test_the_recorders_collectives_count_but_are_never_judged_for_pairing() -> None:
    """DDP's all_reduce (numbered below 0, from the flight recorder): rank 2 arrives last at
    each, as at a wrapped call; a request placed by time may be wrong, so a collective of them
    that paired across requests is not told as mispaired."""
    times = CollectiveTimes(now_ns=lambda: 101 * S)
    for rank in range(3):
        late = 0.1 if rank == 2 else 0.0
        times.add(rank, batch(rank, [(0, -n, 100.0 + 0.2 * n + late, 0) for n in (1, 2, 3)],
                              request=8 if rank == 2 else 9))
    arrivals = times.lateness(8)
    assert arrivals is not None and arrivals.last == {2: 3} and round(arrivals.score(2), 3) == 1.0
    assert times.mispaired(8) == [] and times.mispaired(9) == []


def test_collectives_no_wrapped_call_issued_are_read_from_the_recorder(world_of_one: None) -> None:
    """Two all_reduces torch issues without its Python function (as DDP does, from C++), and
    one wrapped barrier: the barrier once, by its call; the all_reduces from the recorder,
    numbered by its sequence below 0, with the request that ran then and no end."""
    clock = CollectiveClock(lambda: 7)
    barrier = clock.wrap(dist.barrier)
    clock.began(6)
    work = dist.distributed_c10d._get_default_group().allreduce([torch.ones(2)])
    work.wait()
    clock.began(7)
    barrier()
    dist.distributed_c10d._get_default_group().allreduce([torch.ones(2)]).wait()
    taken = clock.take()
    assert taken is not None
    entries = [(request, n, left == 0, called) for request, _, n, _, left, called in taken["entries"]]
    assert sorted(entries, key=str) == sorted([(7, 1, False, ("barrier",)), (6, -1, True, None),
                                               (7, -3, True, None)], key=str), entries
    dist.distributed_c10d._get_default_group().allreduce([torch.ones(2)]).wait()
    again = clock.take()
    assert again is not None and [(r, n) for r, _, n, *_ in again["entries"]] == [(7, -4)]
    barrier()
    assert [n for _, _, n, *_ in (clock.take() or {"entries": []})["entries"]] == [2], "nothing read twice"
