"""Starting, stopping, dying: the mesh never wedges and never leaves a process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest
import zmq
from jupyter_kernels import running, wait_gone

import meshbook
from meshbook import MeshError, MeshStoppedError, MeshTimeout, RemoteError
from meshbook.mesh.protocol.events import Error
from meshbook.mesh.protocol.proc import Liveness


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, r"^n=0: the number of ranks is a positive integer$"),  # not a dimension world
    ({"n": 3, "dims": {"dp": 2, "tp": 2}}, "n=3 but dims dp=2 x tp=2 make 4 ranks"),
    ({"dims": {"dp": 0}}, "sizes are positive integers"),
    ({"dims": {"not a name": 2}}, "must be a Python identifier"),
    ({}, "give the number of ranks"),
    ({"n": 2, "backend": "mpi-ish"}, "backend 'mpi-ish'"),
    ({"n": 2, "launcher": "teleport"}, "unknown launcher 'teleport'"),
    ({"n": 2, "timeout": -1}, r"timeout=-1: give a number of seconds above 0"),
    ({"n": 2, "collective_timeout": 0}, r"collective_timeout=0: give a number of seconds above 0"),
    ({"n": 2, "collective_timeout": float("nan")}, r"collective_timeout=nan"),
    ({"n": 2, "timeout": "soon"}, r"timeout='soon'"),
    ({"n": 2, "max_result_bytes": 0}, r"max_result_bytes=0: give a number of bytes above 0"),
])
def test_bad_start_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        meshbook.start(**kwargs)


def test_context_manager_stops_and_stopped_mesh_refuses_work() -> None:
    with meshbook.start(2) as mesh:
        assert dict(mesh.run("rank").result()) == {0: 0, 1: 1}
        pids = [s.pid for s in mesh.status()]
    assert mesh.stopped
    assert not any(running(p) for p in pids)
    with pytest.raises(MeshStoppedError, match="start a new one"):
        mesh.run("1")


def test_a_wait_of_less_than_no_time_is_refused_and_the_run_goes_on(mesh2: meshbook.Mesh) -> None:
    run = mesh2.run("import time\ntime.sleep(1)\nrank")
    with pytest.raises(MeshTimeout):
        run.result(timeout=0)  # look now: not done yet
    for bad in (-1, float("nan"), 1e300):
        with pytest.raises(MeshError, match=re.escape(f"timeout={bad}: give a number of seconds 0 or more")):
            run.result(timeout=bad)
    assert dict(run.result(timeout=30)) == {0: 0, 1: 1}


def test_rank_killed_mid_request_fails_the_run_and_keeps_other_results(mesh2: meshbook.Mesh) -> None:
    run = mesh2.run("import os, time\nif rank == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(0.3)\nrank")
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        run.result(timeout=30)
    assert time.monotonic() - started < 5
    err = info.value
    assert err.failures[1].message == "rank 1 died: SIGKILL"
    assert dict(err.partial) == {0: 0}
    with pytest.raises(MeshError, match=r"degraded \(rank 1: SIGKILL\).*mesh.restart\(\[1\]\)"):
        mesh2.run("1")
    assert dict(mesh2.run("'alive'", ranks=[0]).result()) == {0: "alive"}


class _Meanwhile:
    """An argument whose pickling does ``act`` first: what happens while a big argument of a
    request is pickled, between the mesh's first check and the run being booked."""

    def __init__(self, act) -> None:
        self.act = act

    def __reduce__(self):
        self.act()
        return (int, (0,))


def test_a_rank_that_dies_while_a_request_is_pickled_fails_the_request(mesh2: meshbook.Mesh) -> None:
    victim = [s.pid for s in mesh2.status()][1]

    def die() -> None:
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while mesh2.status()[1].state != "dead" and time.monotonic() < deadline:
            time.sleep(0.05)

    with pytest.raises(MeshError, match=r"degraded \(rank 1: SIGKILL\)"):
        mesh2.apply(lambda x: x, _Meanwhile(die)).result(timeout=30)


def test_a_stop_while_a_request_is_pickled_fails_the_request() -> None:
    mesh = meshbook.start(2)
    with pytest.raises(MeshStoppedError, match="stopped"):
        mesh.apply(lambda x: x, _Meanwhile(mesh.stop)).result(timeout=30)


def test_rank_that_exits_reports_its_exit_code_and_last_words(mesh2: meshbook.Mesh) -> None:
    """The line printed right before an abrupt exit arrives, before the death: it still sat in
    ZeroMQ's queue when the rank died (lost 14 times in 15 before its agent sent it on)."""
    for attempt in range(3):
        run = mesh2.run(f"import os\nprint('goodbye {attempt}', flush=True)\nos._exit(3)", ranks=[0])
        with pytest.raises(RemoteError) as info:
            run.result(timeout=30, echo=False)
        assert info.value.failures[0].died == "exit code 3"
        events = list(run.events())
        said = [i for i, e in enumerate(events) if isinstance(e, meshbook.Output) and f"goodbye {attempt}\n" in e.text]
        died = [i for i, e in enumerate(events) if isinstance(e, Error)]
        assert len(said) == 1 and said[0] < died[0], events
        mesh2.restart([0])


def test_a_rank_that_dies_right_after_much_output_loses_none_of_it(mesh2: meshbook.Mesh) -> None:
    """Hundreds of lines may still wait in ZeroMQ's queue when the rank dies (its I/O thread
    need not run while the main thread prints): none is lost, none comes twice, in order."""
    code = "import os\nfor i in range(500):\n    print(f'line {i}', flush=True)\nos._exit(3)"
    run = mesh2.run(code, ranks=[0])
    with pytest.raises(RemoteError):
        run.result(timeout=60, echo=False)
    said = "".join(e.text for e in run.events() if isinstance(e, meshbook.Output))
    assert [line for line in said.splitlines() if line.startswith("line ")] == [f"line {i}" for i in range(500)]


def test_segfault_is_reported_with_its_signal_and_stack(mesh2: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError) as info:
        mesh2.run("import ctypes\nctypes.string_at(0)", ranks=[1]).result(timeout=30)
    failure = info.value.failures[1]
    assert failure.died == "SIGSEGV"
    # The crashing thread's own frames, as a traceback tells them: not every thread's stack,
    # meshbook's own included, nor the list of extension modules.
    assert re.fullmatch(r"Fatal Python error: Segmentation fault\nThe thread that crashed \(most recent call last\):\n"
                        r"  cell line 2, in <module>\n  \S*ctypes/__init__.py:\d+, in string_at\n    .*",
                        failure.detail), failure.detail


def test_an_abort_in_the_collective_library_says_why_and_where_the_rank_was(mesh2: meshbook.Mesh) -> None:
    """gloo aborts the process on a size mismatch, in a thread of its own: the error said
    SIGABRT over 54 lines of every thread's stack, and gloo's reason came apart, as output."""
    with pytest.raises(RemoteError) as info:
        mesh2.run("x = torch.ones(4 + rank)\ndist.all_reduce(x)").result(timeout=60, echo=False)
    died = info.value.failures[0]
    assert died.died == "SIGABRT"
    assert died.message.startswith("rank 0 died: SIGABRT, of an uncaught C++ exception: gloo::EnforceNotMet: ")
    assert "Received data size doesn't match expected size" in died.message, died.message
    assert re.fullmatch(r"Fatal Python error: Aborted\nWhere the rank's code was \(most recent call last\):\n"
                        r"  cell line 2, in <module>\n  \S*distributed_c10d.py:\d+, in all_reduce\n    .*",
                        died.detail), died.detail
    mesh2.restart([0])
    assert dict(mesh2.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()) == {0: 2.0, 1: 2.0}


def test_a_rank_that_dies_takes_what_it_forked_with_it(mesh2: meshbook.Mesh, tmp_path) -> None:
    """A child the rank forked (a DataLoader worker, the user's own fork) kept its gloo
    connections open after it died: the rank waiting on it in a collective never heard, and
    waited out the collective timeout, while the child lived on. Under torchrun, what a dead
    worker started dies with it; here too (its agent kills the group the rank leads)."""
    pid_file = tmp_path / "child"
    code = textwrap.dedent(f"""
        import os, time
        if rank == 0:
            child = os.fork()
            if child == 0:
                time.sleep(120)
                os._exit(0)
            open({str(pid_file)!r}, "w").write(str(child))
            time.sleep(0.5)
            os.abort()
        else:
            x = torch.zeros(1)
            dist.recv(x, src=0)
    """)
    with pytest.raises(RemoteError) as info:
        mesh2.run(code).result(timeout=30, echo=False)
    assert set(info.value.failures) == {0, 1}, info.value
    assert info.value.failures[0].died == "SIGABRT"
    assert wait_gone([int(pid_file.read_text())], 10) == []
    mesh2.restart([0])
    assert dict(mesh2.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()) == {0: 2.0, 1: 2.0}


def _spawn_controller(tmp_path, body: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time, meshbook
        mesh = meshbook.start(3)
        print(" ".join(str(s.pid) for s in mesh.status()), flush=True)
        {body}
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip(), "controller did not start its mesh"
    return proc, [int(p) for p in line.split()]


def test_sigkilled_controller_leaves_no_process(tmp_path) -> None:
    proc, pids = _spawn_controller(tmp_path, "time.sleep(120)")
    agent_pids = [p.pid for p in psutil.Process(proc.pid).children()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_gone(pids + agent_pids, 5) == []


def test_interpreter_exit_without_stop_cleans_up(tmp_path) -> None:
    proc, pids = _spawn_controller(tmp_path, "print(mesh.run('rank').result(), flush=True)")
    assert proc.wait(60) == 0
    assert wait_gone(pids, 5) == []


def test_forged_and_garbled_messages_are_dropped(mesh2: meshbook.Mesh) -> None:
    controller = mesh2.controller
    run = mesh2.run("import time\ntime.sleep(1)\n'real'", ranks=[0])
    forger = meshbook.mesh.protocol.wire.Wire(b"not the mesh key, an attacker's")
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{controller.rundir}/ev")
    push.send_multipart(forger.pack({"k": "result", "id": run.id, "rank": 0, "t": 0.0}, "forged"))
    push.send_multipart([b"garbage"])
    push.send_multipart([b"x", b"y", b"z", b"w"])
    rogue = ctx.socket(zmq.DEALER)  # pretend to be rank 0 talking to its agent
    rogue.setsockopt(zmq.IDENTITY, f"0:{mesh2.status()[0].pid}".encode())
    rogue.connect(f"ipc://{controller.rundir}/a0x")
    rogue.send_multipart([b"exec", b"import os; os._exit(1)"])
    assert run.result(timeout=30)[0] == "real"
    deadline = time.monotonic() + 10
    while controller.wire.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert controller.wire.dropped == 3
    assert dict(mesh2.run("rank").result()) == {0: 0, 1: 1}
    for sock in (push, rogue):
        sock.close(linger=0)


def test_a_captured_request_sent_again_does_not_run_again(mesh2: meshbook.Mesh) -> None:
    """The frames the controller sent for a cell, pushed to the rank's socket twice more."""
    controller = mesh2.controller
    sent: list[list] = []
    pack = controller.wire.pack
    controller.wire.pack = lambda *a, **k: sent.append(pack(*a, **k)) or sent[-1]  # records, then sends
    try:
        mesh2.run("n = globals().get('n', 0) + 1", ranks=[0]).result()
    finally:
        del controller.wire.pack
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(meshbook.mesh.protocol.wire.rank_address(controller.rundir, 0, 0, "x"))
    for _ in range(2):
        push.send_multipart([bytes(memoryview(f)) for f in sent[-1]])
    push.close(linger=1000)
    refused = mesh2.call(lambda worker: worker.wire.replayed, ranks=[0], control=True)
    deadline = time.monotonic() + 10
    while refused.result()[0] < 2 and time.monotonic() < deadline:
        refused = mesh2.call(lambda worker: worker.wire.replayed, ranks=[0], control=True)
    assert refused.result()[0] == 2
    assert mesh2.run("n", ranks=[0]).result()[0] == 1


def test_a_refused_start_builds_nothing_that_could_hang_later() -> None:
    """A launcher that refuses the layout does so before any socket or directory exists: an
    unclosed ZeroMQ context, finalized by the garbage collector later, blocked the kernel
    for good (``1/0`` then ``gc.collect()`` hung, and so did the next start)."""
    import gc
    import threading

    from meshbook.mesh.protocol.proc import runtime_base

    before = set(os.listdir(runtime_base()))
    for launcher, message in ((meshbook.SSH(["a", "b"], per_host=0), "per_host=0"),
                              (meshbook.SSH(["a", "b", "c"], per_host=2), "need 2 host")):
        with pytest.raises(meshbook.MeshError, match=message):
            meshbook.start(4, launcher=launcher)
    collected = threading.Event()
    threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True).start()
    assert collected.wait(20), "collecting what a refused start built hung"
    assert set(os.listdir(runtime_base())) - before == set(), "a refused start left a directory"
    with meshbook.start(2) as mesh:
        assert dict(mesh.run("rank").result()) == {0: 0, 1: 1}


def test_a_rank_never_reads_a_heartbeat_half_written() -> None:
    """The agent beats its ranks' liveness page after every wake-up while they read it; a read
    between the two halves of a write once said "silent since boot", and the rank stopped
    itself in the middle of a cell (seen in a big push across hosts and in notebook 08)."""
    live = Liveness()
    readers = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # a rank: read for a second, exit 1 on any read that says silent
            end = time.monotonic() + 1.0
            silent = 0
            while time.monotonic() < end:
                silent += live.silence() > 1.0
            os._exit(1 if silent else 0)
        readers.append(pid)
    end = time.monotonic() + 1.2
    while time.monotonic() < end:  # the agent
        live.beat(time.monotonic())
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in readers]
    assert codes == [0, 0], "a rank read a heartbeat that was not there"


def test_requests_from_two_threads_reach_the_ranks_in_the_order_of_their_numbers(mesh2: meshbook.Mesh) -> None:
    """Two threads submit at once: each rank runs the requests in the order of their numbers
    (a rank decides by them whether an interrupt found its request not started yet), whatever
    the threads do between taking a number and sending."""
    import threading

    def note(worker: Any) -> None:  # on each rank, in the order its requests come
        worker.__dict__.setdefault("order", []).append(worker.request)

    def submit() -> None:
        for _ in range(300):
            mesh2.call(note)

    threads = [threading.Thread(target=submit) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    orders = mesh2.call(lambda worker: worker.order).result(timeout=120)
    for order in orders.values():
        assert len(order) == 900 and order == sorted(order)


def test_a_mesh_starts_in_a_process_holding_more_than_1024_descriptors() -> None:
    """A notebook holding many pulled values has descriptors past 1024 (a mesh lifts the soft
    limit for them): the next start must still read its agent's pipe (select() refused it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"this process may open {hard} files at most")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1400 if hard == resource.RLIM_INFINITY else hard, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with meshbook.start(1) as mesh:
            assert dict(mesh.run("rank").result()) == {0: 0}
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
