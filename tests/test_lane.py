"""The datagram lane between the controller and its ranks on this host (protocol/lane.py):
used both ways, never reordering a rank's requests or its messages, and left for ZeroMQ
whenever the kernel refuses a datagram."""

from __future__ import annotations

import os
import socket

import pytest

import meshbook
from meshbook.mesh.protocol.events import Output
from meshbook.mesh.protocol.lane import LANE_MAX, Burst, Lane, lane_path


def lane_use(mesh: meshbook.Mesh) -> dict[int, tuple[int, int]]:
    return dict(mesh.controller.call(lambda worker: worker.lane_use(), ranks=mesh.ranks).result())


def output(run: meshbook.Run, rank: int) -> str:
    return "".join(e.text for e in run.events() if isinstance(e, Output) and e.rank == rank)


def test_the_lane_carries_requests_to_idle_ranks_and_what_they_send(mesh2: meshbook.Mesh) -> None:
    before = lane_use(mesh2)
    for i in range(5):
        assert dict(mesh2.run(f"print('line', {i}); {i}").result(echo=False)) == {0: i, 1: i}
    after = lane_use(mesh2)
    for rank in (0, 1):
        assert after[rank][0] - before[rank][0] >= 5  # the five cells, and the lane_use call
        assert after[rank][1] - before[rank][1] >= 10  # each cell's line and its result


def test_a_ranks_messages_keep_their_order_across_the_lane_and_zeromq(mesh2: meshbook.Mesh) -> None:
    # Lines over LANE_MAX go through ZeroMQ, the short ones between them by the lane.
    code = ("for i in range(20):\n"
            "    print(str(i) * (LANE + 1) if i % 3 == 0 else f'short {i}')\n"
            "'done'")
    run = mesh2.run(f"LANE = {LANE_MAX}\n" + code)
    assert dict(run.result(echo=False)) == {0: "done", 1: "done"}
    expected = "".join((str(i) * (LANE_MAX + 1) if i % 3 == 0 else f"short {i}") + "\n" for i in range(20))
    assert output(run, 0) == expected
    assert output(run, 1) == expected


def test_requests_keep_their_order_across_the_lane_and_zeromq(mesh2: meshbook.Mesh) -> None:
    mesh2.run("order = []").result(echo=False)
    first = mesh2.run("import time; time.sleep(0.3); order.append('first')")  # idle ranks: the lane
    big = mesh2.run("order.append('big')  # " + "x" * (LANE_MAX + 1))  # too big for it: ZeroMQ
    last = mesh2.run("order.append('last'); order")  # busy ranks: ZeroMQ, behind the others
    first.result(echo=False)
    big.result(echo=False)
    assert dict(last.result(echo=False)) == {0: ["first", "big", "last"], 1: ["first", "big", "last"]}
    # A big request to idle ranks goes through ZeroMQ; the next one, by the lane, comes after it.
    mesh2.run("order = []; order.append('big')  # " + "x" * (LANE_MAX + 1)).result(echo=False)
    assert dict(mesh2.run("order.append('small'); order").result(echo=False)) == {0: ["big", "small"],
                                                                                  1: ["big", "small"]}


def test_a_refused_datagram_goes_through_zeromq(mesh2: meshbook.Mesh) -> None:
    # Rank 0's lane gone: its requests go through ZeroMQ. The controller's gone: every rank's
    # messages do.
    mesh2.controller.call(lambda worker: os.unlink(lane_path(worker.cfg.request_addr)), ranks=[0]).result()
    os.unlink(lane_path(mesh2.controller.transport.events_address))
    before = lane_use(mesh2)
    for i in range(3):
        run = mesh2.run(f"print('still here', {i}); rank + {i}")
        assert dict(run.result(echo=False)) == {0: i, 1: 1 + i}
        assert output(run, 0) == f"still here {i}\n"
    after = lane_use(mesh2)
    assert after[0][0] == before[0][0]  # none of rank 0's requests came by the lane
    assert after[1][0] >= before[1][0] + 3  # rank 1 still takes its requests by it
    assert after[0][1] == before[0][1] and after[1][1] == before[1][1]  # nothing went up by it


@pytest.mark.skipif(not Burst.available(), reason="sendmmsg is Linux's")
def test_one_burst_reaches_every_rank_that_takes_it_and_names_the_others(tmp_path) -> None:
    """A request to many idle ranks leaves in one system call; a rank whose lane is gone, or
    whose queue is full, is named (its request goes through ZeroMQ), and the ranks after it
    still get theirs."""
    lane, receivers = Lane(), {}
    for rank in range(5):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(tmp_path / f"r{rank}l"))
        sock.setblocking(False)
        receivers[rank] = sock
        lane.point(rank, f"ipc://{tmp_path}/r{rank}")
    os.unlink(tmp_path / "r1l")  # gone
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    try:
        while True:
            filler.sendto(b"x" * 1024, str(tmp_path / "r3l"))
    except BlockingIOError:
        pass  # rank 3's queue is full
    lane.point(4, None)  # no longer a rank: not sent to
    lane.point(5, f"ipc://{tmp_path}/{'x' * 120}")  # longer than a socket address holds
    try:
        assert sorted(lane.send([0, 1, 2, 3, 4, 5], [b"request"])) == [1, 3, 4, 5]
        for rank in (0, 2):
            assert receivers[rank].recv(100) == b"request"
        assert lane.send([0, 2], [b"x" * (LANE_MAX + 1)]) == [0, 2]  # too big: ZeroMQ's
        assert lane.send([2], [b"alone"]) == [] and receivers[2].recv(100) == b"alone"
    finally:
        lane.close()
        filler.close()
        for sock in receivers.values():
            sock.close()
