"""A rank's control side under faults, on real ranks: what keeps it answering, and stopping."""

from __future__ import annotations

import errno
import os

import pytest

import meshbook


def test_the_control_thread_outlives_an_error_in_one_tick(mesh2: meshbook.Mesh) -> None:
    """Heartbeats, interrupts and the rank's answers while it is busy all live on its control
    thread: one error there (a message that does not unpickle, a file already closed) must not
    end it."""
    def fail_this_tick(worker: object) -> None:  # the tick that answers this goes on to expire lent files
        lent = worker.lent  # type: ignore[attr-defined]
        expire = lent.expire

        def fails_once(now: float) -> None:
            lent.expire = expire
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))

        lent.expire = fails_once

    mesh2.call(fail_this_tick, ranks=[0], control=True).result(timeout=10)
    assert mesh2.call(lambda worker: worker.rank, ranks=[0], control=True).result(timeout=10)[0] == 0


def test_a_rank_stops_itself_when_its_host_is_lost_while_a_send_is_stuck(mesh2: meshbook.Mesh) -> None:
    """With its agent stopped, a rank's send can block holding the send lock (a big result, output
    past the high-water mark), and the control thread's next heartbeat blocks behind it. The
    rank must still stop itself before the controller declares its host lost: two copies of it
    may act once the host is formed again."""
    def stuck_as_the_host_is_lost(worker: object) -> None:  # on the main thread
        import threading
        import time
        from dataclasses import replace

        from meshbook.mesh.protocol.proc import Liveness

        def lost() -> None:  # read for the next heartbeat, which then waits for the send lock
            silent = Liveness()
            silent.beat(time.monotonic() - 10 * worker.cfg.lost_s)  # type: ignore[attr-defined]
            worker.cfg = replace(worker.cfg, liveness=silent)  # type: ignore[attr-defined]

        def stuck() -> None:  # under the send lock, as a send to a stopped agent
            del clock.take
            worker.heartbeat_extras["lost"] = lost  # type: ignore[attr-defined]
            threading.Event().wait(30)

        clock = worker.clock  # type: ignore[attr-defined]
        clock.take = stuck
        worker.send_collectives()  # type: ignore[attr-defined]

    run = mesh2.call(stuck_as_the_host_is_lost, ranks=[0])
    with pytest.raises(meshbook.RemoteError) as info:
        run.result(timeout=20, echo=False)
    assert "stopped itself" in info.value.failures[0].detail
