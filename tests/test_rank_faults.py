"""A rank's control side under faults, on real ranks: what keeps it answering, and stopping.

The helpers below run on the ranks and travel by value (this module is registered with
cloudpickle: the ranks cannot import it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import meshbook
from meshbook.mesh.rank.ops import interrupt_request

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def _wait_for_writer(path: str) -> int:
    """On a rank: block until the test writes to the FIFO ``path``."""
    with open(path) as gate:
        gate.read()
    return 0


def _release(fifo: Path) -> None:
    with open(fifo, "w") as gate:
        gate.write("go")


class _Gated:
    """An argument whose unpickling on the rank waits at ``fifo``: a request the rank has taken
    but whose user code has not started (as while a big argument unpickles)."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = str(fifo)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_wait_for_writer, (self.fifo,))


def _wait_until_running(mesh: meshbook.Mesh, request: int) -> None:
    """Until rank 0's main thread has taken ``request`` (its control thread answers meanwhile)."""
    deadline = time.monotonic() + 30
    while mesh.call(lambda worker: worker.request, ranks=[0], control=True).result(timeout=10)[0] != request:
        assert time.monotonic() < deadline, f"rank 0 never took request {request}"
        time.sleep(0.02)


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def test_an_interrupt_while_the_arguments_unpickle_stops_the_request_before_its_code(
        mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    """The rank took the request and unpickles its big argument when the interrupt's SIGINT
    lands: no user code runs yet, so the handler raises nothing. The interrupt must still
    stop the request where its user code starts (it was lost: the request ran in full)."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    run = mesh2.apply(lambda arrived: "ran", _Gated(gate), ranks=[0])
    _wait_until_running(mesh2, run.id)
    mesh2.call(interrupt_request, run.id, ranks=[0]).result(timeout=10)  # the SIGINT is sent
    _release(gate)
    with pytest.raises(meshbook.RemoteError) as info:
        run.result(timeout=30, echo=False)
    failure = info.value.failures[0]
    assert (failure.type_name, failure.message) == ("KeyboardInterrupt", "interrupted before it started: nothing ran")
    assert mesh2.run("'next'", ranks=[0]).result(timeout=30)[0] == "next"


def test_an_interrupt_kept_for_a_request_that_finished_never_stops_the_next(
        mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    """An interrupt that lands in meshbook's own shielded work is kept for that request's user
    code; the request finishes without reaching any, and the next request runs in full."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)

    def shielded_wait(worker: Any, path: str) -> str:  # on the main thread, as a step check's wait
        with worker.shielded():
            _wait_for_writer(path)
        return "finished"

    run = mesh2.call(shielded_wait, str(gate), ranks=[0])
    _wait_until_running(mesh2, run.id)
    mesh2.call(interrupt_request, run.id, ranks=[0]).result(timeout=10)
    _release(gate)
    assert run.result(timeout=30)[0] == "finished"
    assert mesh2.run("'next'", ranks=[0]).result(timeout=30)[0] == "next"
    assert mesh2.call(lambda worker: sorted(worker.cancelled), ranks=[0], control=True).result(timeout=10)[0] == []


def _hold_the_cancellation(worker: Any, request: int, decided: str) -> None:
    """On rank 0's control thread: its cancellation of ``request`` (the interrupt decided the
    request still waits) is held until the main thread, come to take the request, has looked
    for it; or for a second, should the main thread wait for the decision to be carried out."""
    import threading

    arrived, looked = threading.Event(), threading.Event()
    check_alive = worker.check_alive

    def arrives() -> None:  # the main thread calls it first thing in each request
        if threading.current_thread() is threading.main_thread():
            arrived.set()
        check_alive()

    class Watched(set):
        def __contains__(self, item: object) -> bool:
            if item == request:
                looked.set()
            return super().__contains__(item)

        def add(self, item: int) -> None:
            if item == request and threading.current_thread() is not threading.main_thread():
                open(decided, "w").close()
                arrived.wait(60)
                looked.wait(1)
            super().add(item)

    worker.check_alive = arrives
    worker.cancelled = Watched(worker.cancelled)


def test_an_interrupt_that_finds_its_request_waiting_is_not_lost_as_the_rank_takes_it(
        mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    """The control thread sees the request still waiting and cancels it, while the main thread
    takes it and looks for a cancellation: the cancellation landed after the look, and the
    request ran to its end though interrupted."""
    gate, decided = tmp_path / "gate", tmp_path / "decided"
    os.mkfifo(gate)
    busy = mesh2.run(f"open({str(gate)!r}).read()", ranks=[0])
    queued = mesh2.run("ran = True", ranks=[0])
    _wait_until_running(mesh2, busy.id)
    mesh2.call(_hold_the_cancellation, queued.id, str(decided), ranks=[0], control=True).result(timeout=10)
    interrupt = mesh2.call(interrupt_request, queued.id, ranks=[0])  # answered once the hold is over
    _wait_for_file(decided)
    _release(gate)
    assert busy.result(timeout=30)[0] == "go"
    with pytest.raises(meshbook.RemoteError) as info:
        queued.result(timeout=30, echo=False)
    assert info.value.failures[0].message == "interrupted before it started: nothing ran"
    interrupt.result(timeout=30)
    assert mesh2.run("'ran' in globals()", ranks=[0]).result(timeout=30)[0] is False


def _fail_every_tick(worker: Any) -> None:
    """On rank 0's control thread: each tick from now on fails once it answered what came."""
    worker.failed_ticks = 0

    def fails(now: float) -> None:
        worker.failed_ticks += 1
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    worker.lent.expire = fails


def test_a_control_thread_failing_every_tick_logs_the_traceback_once_then_counts(mesh2: meshbook.Mesh) -> None:
    """A persistent error fails five ticks a second: its traceback is logged once, and then a line
    now and then says how many more failed (each tick logged its traceback, without end). The
    notebook shows the rank's log as it comes, each line marked with the rank."""
    def failed_ticks() -> int:  # also: what the rank logged before this answer has been shown
        return mesh2.call(lambda worker: worker.failed_ticks, ranks=[0], control=True).result(timeout=10)[0]

    with contextlib.redirect_stderr(io.StringIO()) as shown:
        def log() -> str:
            return "".join(line.removeprefix("[0] ") for line in shown.getvalue().splitlines(keepends=True))

        mesh2.call(_fail_every_tick, ranks=[0], control=True).result(timeout=10)
        while failed_ticks() < 10:
            pass
        first = log()
        assert first.count("Traceback") == 1 and first.count("meshbook: rank 0 failed a tick") == 1, first
        assert first.startswith("meshbook: rank 0 failed a tick of its control thread:\nTraceback"), first

        def report_every_tick(worker: Any) -> None:  # the next failing tick says how many failed since
            from meshbook.mesh.rank import worker as module

            module.TICK_ERRORS_EVERY_S = 0.0

        mesh2.call(report_every_tick, ranks=[0], control=True).result(timeout=10)
        failed_ticks()  # answered a tick later: the one that answered report_every_tick has logged
        later = log()
    assert later.startswith(first) and later.count("Traceback") == 1, later
    counted = re.match(r"meshbook: rank 0 failed (\d+) more ticks of its control thread in the last \d+ s "
                       r"\(the same error as before\)$", later[len(first):].splitlines()[0])
    assert counted and int(counted[1]) >= 9, later[len(first):]

    def recover(worker: Any) -> None:
        del worker.lent.expire

    mesh2.call(recover, ranks=[0], control=True).result(timeout=10)


def test_ranks_that_die_one_after_the_other_are_told_in_one_note(capfd: pytest.CaptureFixture[str]) -> None:
    """Every rank of the cell exits: the first death said rank 1 "ran beside it" and would be
    freed, the freeing said it could not, and each death gave its own restart command."""
    with meshbook.start(2) as mesh:
        with pytest.raises(meshbook.RemoteError) as info:
            mesh.run("import os, time\nif rank == 1:\n    time.sleep(0.3)\nos._exit(0)").result(timeout=30, echo=False)
        assert info.value.hint == ("ranks 0,1 died (exit code 0). %mesh restart 0,1 (mesh.restart([0, 1])) brings "
                                   "them back and re-creates the process group."), info.value.hint
        time.sleep(0.5)  # what a freeing thread would have printed
        assert "could not free" not in capfd.readouterr().err


def test_an_idle_interrupt_under_python_s_own_handler_stops_nothing() -> None:
    """A cell installed signal.default_int_handler (as scripts do): an interrupt while the rank
    waited for its next request raised KeyboardInterrupt there, and the rank died of it."""
    with meshbook.start(2) as mesh:
        mesh.run("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nkept = rank").result()
        # Put back once the cell ended: an interrupt that came as rank 1 sent its answer (under
        # load) raised there, after the notebook had the answer, and the rank died.
        handler = mesh.run("signal.getsignal(signal.SIGINT) is signal.default_int_handler").result(echo=False)
        assert handler == {0: False, 1: False}, handler
        mesh.interrupt()
        time.sleep(1.0)
        assert [s.state for s in mesh.status()] == ["idle", "idle"]
        assert mesh.run("kept").result(timeout=30) == {0: 0, 1: 1}
