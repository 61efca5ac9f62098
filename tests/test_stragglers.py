"""Straggler and memory reports: the scoring on its own, then on real ranks with gloo."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from workloads import slow_rank_loop

import meshbook
from meshbook.mesh.controller.core.book import RankState
from meshbook.mesh.controller.insight.memory import memory_report
from meshbook.mesh.controller.insight.metrics import MetricsHistory
from meshbook.mesh.controller.insight.stragglers import slow_by_duration, straggler_report
from meshbook.mesh.protocol.text import format_bytes
from meshbook.mesh.rank.sampling import MainThreadSampler, classify


def sampled(wait: float, n: int = 20, where: str = "cell line 8", request: int = 7) -> dict:
    """A heartbeat's sampling report: ``wait`` of ``n`` samples in a collective."""
    top = [[f"all_reduce at {where}", True, wait], [where, False, round(1 - wait, 3)]]
    return {"request": request, "n": n, "wait": wait, "top": sorted(top, key=lambda t: -t[2]),
            "window": 10.0}


def test_the_rank_that_waits_least_while_the_others_wait_is_the_straggler() -> None:
    report = straggler_report({0: sampled(0.95), 1: sampled(0.9), 2: sampled(0.05), 3: sampled(0.96)})
    assert report.stragglers == [2]
    scores = {t.rank: t.score for t in report.ranks}
    assert scores == {0: 0.0, 1: 0.05, 2: 0.9, 3: 0.0}, "waiting more than most is no score below 0"
    assert str(report) == (
        "straggler: rank 2 (score 0.90): it waits in collectives 5% of the time, the others 95%\n"
        "  rank 2 spends its time at: cell line 8 (95%), all_reduce at cell line 8 (5%)\n"
        "rank  samples  waiting  score  flag       most time at\n"
        "0     20       95%      0.00              all_reduce at cell line 8 (95%), cell line 8 (5%)\n"
        "1     20       90%      0.05              all_reduce at cell line 8 (90%), cell line 8 (10%)\n"
        "2     20       5%       0.90   straggler  cell line 8 (95%), all_reduce at cell line 8 (5%)\n"
        "3     20       96%      0.00              all_reduce at cell line 8 (96%), cell line 8 (4%)")


def test_two_ranks_and_two_stragglers() -> None:
    assert straggler_report({0: sampled(0.8), 1: sampled(0.1)}).stragglers == [1]
    # a slow host with two ranks: both flagged, the slower (waiting less) first
    report = straggler_report({0: sampled(0.9), 1: sampled(0.95), 2: sampled(0.3), 3: sampled(0.0)})
    assert report.stragglers == [3, 2]


def test_no_straggler_when_ranks_wait_alike_or_too_few_samples() -> None:
    alike = straggler_report({r: sampled(w) for r, w in enumerate([0.4, 0.5, 0.45, 0.35])})
    assert alike.stragglers == []
    assert alike.summary() == ["no straggler: the ranks wait alike (every score below 0.30)"]
    # A collective torch runs from C++ (DDP's all_reduce) with its flight recorder off: no rank
    # is ever seen waiting, which is no evidence that they wait alike ("no straggler" named
    # none while rank 1 slept every step)
    unseen = straggler_report({0: sampled(0.0, where="cell line 9"), 1: sampled(0.0, where="cell line 8")})
    assert unseen.stragglers == [] and unseen.summary()[0].startswith(
        "cannot tell: no collective was timed, and no rank was seen waiting in one (torch's flight recorder")
    few = straggler_report({0: sampled(0.9), 1: sampled(0.0, n=3), 2: {}})
    assert few.stragglers == [] and all(t.score is None for t in few.ranks)
    assert few.summary()[0].startswith("no straggler: fewer than two ranks ran code long enough "
                                       "in the last 10 s")


def test_ranks_are_compared_within_one_request() -> None:
    # rank 2's window still holds an earlier loop (request 7); the others run request 8
    report = straggler_report({0: sampled(0.9, request=8), 1: sampled(0.9, request=8),
                               2: sampled(0.05, request=7), 3: sampled(0.9, request=8)})
    assert report.stragglers == []
    assert [(t.rank, t.request, t.score) for t in report.ranks][2] == (2, 7, None)


class Work:
    """Stands for a torch Work handle: its wait() blocks below the caller's line."""

    def wait(self) -> object:
        return classify(sys._getframe(1))  # sampled from the caller's frame, as if in C


def test_classify_a_live_stack() -> None:
    here = sys._getframe()
    assert classify(here) == (False, f"test_stragglers.py:{here.f_lineno} in test_classify_a_live_stack")
    waiting, where = Work().wait()  # type: ignore[misc]
    assert waiting and where.startswith("wait at test_stragglers.py:")


def test_an_idle_rank_keeps_its_last_window_until_the_next_request() -> None:
    request: list[int | None] = [7]
    here = sys._getframe()
    sampler = MainThreadSampler(lambda: here, lambda: request[0])
    for t in range(1, 6):  # five samples of request 7
        sampler.tick(float(t))
    request[0] = None
    sampler.tick(100.0)  # long after the loop ended, with nothing running
    report = sampler.report()
    assert (report["request"], report["n"], report["total_n"], report["stuck_s"]) == (7, 5, 5, 0.0)
    request[0] = 8
    for t in (101.0, 112.0):  # the next request: the old window goes, its own slides
        sampler.tick(t)
    report = sampler.report()
    assert (report["request"], report["n"], report["total_n"]) == (8, 1, 2)


def test_a_failing_sample_stops_sampling_and_says_why() -> None:
    def no_stack() -> None:
        raise RuntimeError("no stack")

    sampler = MainThreadSampler(no_stack, lambda: 1)
    sampler.tick(1.0)
    assert sampler.report()["error"] == "RuntimeError: no stack"
    report = straggler_report({0: sampler.report(), 1: sampled(0.5)})
    assert report.summary()[-1] == ("sampling stopped on rank 0 (RuntimeError: no stack): where "
                                    "it spends its time is unknown")


def test_slow_by_duration_against_the_median_of_the_others() -> None:
    assert [s.rank for s in slow_by_duration({0: 1.0, 1: 1.1, 2: 5.0, 3: 0.9})] == [2]
    assert slow_by_duration({0: 1.0, 1: 10.0})[0].factor == 10.0
    assert slow_by_duration({0: 0.001, 1: 0.004}) == ()  # 4x, but 3 ms is not news
    assert slow_by_duration({0: 1.0, 1: 1.8}) == ()  # under the default factor 2
    assert [s.rank for s in slow_by_duration({0: 1.0, 1: 1.8}, factor=1.5, min_excess=0.5)] == [1]
    report = straggler_report({}, {0: 1.0, 1: 1.1, 2: 5.0})
    assert report.slow_ranks == [2]
    assert report.summary() == ["slow: rank 2 took 5.00 s, 4.8x the median of the others (1.05 s)"]


def test_memory_report_rows_and_limits() -> None:
    now = 100.0
    healthy = RankState(0, 0, pid=11, hostname="h", device="cpu", state="idle", last_seen=99.5,
                        metrics={"rss": 3 << 30, "cpu": 12.0,
                                 "memory": {"pool": "host", "limit": 100, "used": 95}})
    dead = RankState(1, 0, hostname="h", device="cpu", state="dead", cause="SIGKILL",
                     metrics={"rss": 1 << 30})
    report = memory_report([healthy, dead], now)
    assert report.near_limit() == [0]
    assert report.rows[1].rss is None, "a dead rank's last numbers describe no process"
    cells = [re.split(r"\s{2,}", line) for line in str(report).splitlines()]  # columns: 2+ spaces
    assert cells == [
        ["rank", "host", "pid", "device", "state", "cpu", "rss", "memory pool", "heartbeat"],
        ["0", "h", "11", "cpu", "idle", "12%", "3.0 GiB", "host RAM 95 B / 100 B (95%, near its limit)", "0.5 s ago"],
        ["1", "h", "-", "cpu", "dead (SIGKILL)", "-", "-", "-", "-"]]
    gpu = RankState(0, 0, state="busy", last_seen=now,
                    metrics={"rss": 1, "cuda_allocated": 2 << 20, "cuda_reserved": 4 << 20,
                             "cuda_peak": 3 << 20})
    assert "cuda alloc  reserved  peak" in str(memory_report([gpu], now))
    assert [format_bytes(n) for n in (None, 512, 1536, 5 << 40)] == ["-", "512 B", "1.5 KiB", "5.0 TiB"]


def test_history_keeps_only_its_window() -> None:
    history = MetricsHistory(keep=0.2)
    history.record(0, {"rss": 1})
    time.sleep(0.3)
    history.record(0, {"rss": 2, "cuda_allocated": 7})
    assert [p.used for p in history.memory(0)] == [7]
    assert history.memory(5) == []


def test_memory_of_real_ranks(mesh4: meshbook.Mesh) -> None:
    deadline = time.monotonic() + 10
    while any(r.rss is None for r in mesh4.memory().rows):
        assert time.monotonic() < deadline, "no heartbeat with memory in 10 s"
        time.sleep(0.1)
    rows = mesh4.memory().rows
    assert [r.rank for r in rows] == [0, 1, 2, 3]
    assert all(r.rss > 50 << 20 and r.pool in ("host", "container") and r.pool_fraction for r in rows)
    assert len(mesh4.history.memory(0)) >= 1
    assert [r.rank for r in mesh4.slice(dp=1).memory().rows] == [2, 3]


def test_memory_right_after_start_measures_every_rank(mesh2: meshbook.Mesh) -> None:
    """Before the first heartbeat arrived, the report asks the ranks instead of showing '-'."""
    rows = mesh2.memory().rows
    assert all(r.rss and r.rss > 50 << 20 and r.pool_fraction for r in rows), str(mesh2.memory())


def test_the_slow_rank_is_named_inside_a_loop_with_where_it_spends_its_time(mesh4: meshbook.Mesh,
                                                                            tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    started = time.monotonic()
    run = mesh4.run(slow_rank_loop(str(stop), slow_rank=2))
    try:  # the verdict comes from the arrivals at once; where each rank is, from a few samples
        while not (report := mesh4.stragglers()).stragglers or any(t.samples < 5 for t in report.ranks):
            assert time.monotonic() - started < 10, f"no straggler found in 10 s:\n{report}"
            time.sleep(0.2)
        assert report.stragglers == [2], str(report)
        slow = report.get(2)
        assert slow is not None and slow.places[0].where == "cell line 8", str(report)
        for rank in (0, 1, 3):
            t = report.get(rank)
            assert t is not None and not t.straggler and t.places[0].where == "all_reduce at cell line 10"
        time.sleep(1.0)
        assert all(s < 1.0 for s in mesh4.stuck(run).values()), \
            f"a new all_reduce every step is no hang: {mesh4.stuck(run)}"
    finally:
        stop.touch()
    steps = run.result(timeout=60)
    assert len(set(steps.values())) == 1, "every rank leaves the loop after the same step"
    time.sleep(1.0)  # heartbeats from the idle ranks
    assert mesh4.stragglers().stragglers == [2], "the verdict outlives the loop until the next cell"


def test_a_ddp_straggler_is_named_from_the_flight_recorder(mesh4: meshbook.Mesh) -> None:
    """DDP issues its all_reduce from C++ during backward(): no wrapper sees it, and sampling
    saw no rank waiting ("cannot tell"). The flight recorder does: rank 2, which sleeps before
    each step, arrives last at its all_reduces, and the others' waiting is told.

    The first run may construct the mesh's first DDP, which imports 800 modules: on a loaded
    machine one rank finished that 2.5 s after another, a stall at DDP's first collective that
    once named that rank the straggler and hid rank 2. The verdict must hold all the same; the
    waiting split is checked on the second run, where no rank waits for another's imports."""
    loop = ("import time\nddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))\n"
            "for step in range(12):\n"
            "    time.sleep(0.1 if rank == 2 else 0.0)\n"
            "    ddp(torch.ones(4, 32)).sum().backward()\n"
            "del ddp")
    run = mesh4.run(loop)
    run.result(timeout=120, echo=False)
    report = mesh4.stragglers(run)
    assert report.stragglers == [2], str(report)
    assert re.match(r"straggler: rank 2 \(score \d\.\d\d\): it arrived last at (1[2-9]|2\d) of (1[2-9]|2\d) "
                    r"collectives", str(report)), str(report)
    run = mesh4.run(loop)
    run.result(timeout=120, echo=False)
    assert mesh4.stragglers(run).stragglers == [2], str(mesh4.stragglers(run))
    waiting = mesh4.waiting(run)
    assert waiting is not None and all(waiting[r] > 0.8 for r in (0, 1, 3)) and waiting[2] < 0.6, waiting


def test_sampling_a_rank_in_a_collective_keeps_none_of_its_memory(mesh2: meshbook.Mesh) -> None:
    """A held frame keeps its locals and its callers' alive: a tensor of the function that
    waited in the collective must go the moment the function returns (FSDP's gradient buffers
    once outlived their step this way, into the next step's peak)."""
    run = mesh2.run(
        "import weakref\n"
        "def wait_in_a_collective():\n"
        "    big = torch.ones(1 << 20)\n"
        "    if rank == 1:\n"
        "        time.sleep(1.5)  # rank 0 waits in the all_reduce meanwhile: sampled there\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    return weakref.ref(big)\n"
        "import time\n"
        "ref = wait_in_a_collective()\n"
        "ref() is None")
    assert run.result(timeout=60) == {0: True, 1: True}, "the sampler kept the waiting frame's tensor alive"


def test_slow_rank_by_cell_duration(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("import time\ntime.sleep(1.5 if rank == 1 else 0.1)")
    run.result()
    assert mesh4.stragglers(run).slow_ranks == [1]
    assert mesh4.stragglers(run, factor=100).slow_ranks == []


def uneven_loop(steps: int) -> str:
    """The loop where sampling misread the split: rank 2 computes 0.2 s a step, the others 0.05 s."""
    return (f"import time\nx = torch.ones(4)\nfor _ in range({steps}):\n"
            f"    time.sleep(0.2 if rank == 2 else 0.05)\n    dist.all_reduce(x)")


def test_the_split_and_the_straggler_are_exact() -> None:
    """Each rank's computing time within 10% of the truth, and rank 2 named alone, every run
    (sampling read 0.00 s of computing for ranks that each slept 2 s, and once flagged rank 0)."""
    with meshbook.start(4) as mesh:
        run = mesh.run(uneven_loop(40))
        run.result(timeout=120)
        waiting = mesh.waiting(run)
        assert waiting is not None
        computing = {r: run.durations[r] - waiting[r] for r in range(4)}
        for rank, truth in {0: 2.0, 1: 2.0, 2: 8.0, 3: 2.0}.items():
            assert abs(computing[rank] - truth) <= 0.1 * truth, (rank, computing, waiting)
        report = mesh.stragglers(run)
        assert report.stragglers == [2], str(report)
        assert str(report).startswith("straggler: rank 2 (score 1.00): it arrived last at 40 of 40 collectives")
        verdicts = []
        for _ in range(5):
            short = mesh.run(uneven_loop(6))
            short.result(timeout=60)
            verdicts.append(mesh.stragglers(short).stragglers)
        assert verdicts == [[2]] * 5, verdicts
        live = mesh.stragglers()  # the last seconds of the latest cell: the same verdict
        assert live.stragglers == [2]


def test_a_rank_waiting_in_recv_is_placed_at_its_cell_line(mesh4: meshbook.Mesh) -> None:
    """The wrapper that counts point-to-point operations is walked through, as the collectives'
    are: the place read 'recv at distributed_c10d.py:2799 in recv', not the cell's line."""
    run = mesh4.run("import time\nt = torch.ones(2)\nif rank == 0:\n    dist.recv(t, 1)\n"
                    "elif rank == 1:\n    time.sleep(3)\n    dist.send(t, 0)")
    started = time.monotonic()
    while not (report := mesh4.stragglers()).get(0) or not report.get(0).places:  # type: ignore[union-attr]
        assert time.monotonic() - started < 10, str(report)
        time.sleep(0.2)
    time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
    waiting = mesh4.stragglers().get(0)
    assert waiting is not None and str(waiting.places[0]).startswith("recv at cell line 4"), waiting.places
    run.result(timeout=30, echo=False)
