"""The zygote planners are forked from: torch imported once, each plan's planners fresh forks,
in the notebook's directory; a changed environment gets a new zygote, and none outlives the
last mesh that planned, nor the process that started it. A module of its own:
tests/test_planner.py keeps one planner for all its tests, which a zygote replaced here would
leave without its zygote."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial

import psutil
import pytest

import meshbook
from bench import models
from meshbook import MeshError
from meshbook.mesh.controller.api import planners
from meshbook.mesh.controller.api.planners import PLANNER_MODULE, Planners
from meshbook.mesh.protocol.plan import FORK, KILL

BUILD = partial(models.gpt, vocab=512, dim=128, layers=4, heads=4)


def _planner_pids(pool: Planners) -> list[int]:
    return [proc.pid for proc in pool.procs]


def test_each_plans_planners_are_fresh_forks_of_one_zygote_and_none_outlives_its_plan(tmp_path) -> None:
    """The zygote imported torch once: a second plan's planners are new processes (none ran the
    first plan's code), forked from the same zygote, in the directory the notebook is in now."""
    def where():  # type: ignore[no-untyped-def]
        import here_only  # a module of the notebook's directory, imported as a planner started there would

        raise ValueError(f"cwd={os.getcwd()} {here_only.SAID}")

    with Planners(2) as first:
        pids = _planner_pids(first)
        zygote = first.procs[0].zygote
        assert {psutil.Process(pid).ppid() for pid in pids} == {zygote.proc.pid}
    assert not psutil.Process(zygote.proc.pid).children(), "the plan's planners outlived it"
    (tmp_path / "here_only.py").write_text("SAID = 'imported'\n")
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        with Planners(1) as second:
            assert second.procs[0].zygote is zygote and second.procs[0].pid not in pids
            with pytest.raises(MeshError, match=f"cwd={tmp_path} imported"):
                second.ask(0, "inspect", where)
    finally:
        os.chdir(here)


def test_a_planner_that_dies_says_how_and_a_changed_environment_gets_a_new_zygote(monkeypatch) -> None:
    def killed():  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGKILL)

    def exits():  # type: ignore[no-untyped-def]
        sys.exit("build says: no config")

    with Planners(2) as pool:
        old = pool.procs[0].zygote
        with pytest.raises(MeshError, match=r"a planner process died \(signal 9\)"):
            pool.ask(0, "inspect", killed)
        with pytest.raises(MeshError, match=r"a planner process died \(exit 1: build says: no config\)"):
            pool.ask(1, "inspect", exits)
    monkeypatch.setenv("MESHBOOK_TEST_PLANNER_ENV", "changed")  # what a zygote started before would not see
    with Planners(1) as pool:
        assert pool.procs[0].zygote is not old
        assert pool.ask(0, "inspect", BUILD).blocks == "Block"
    assert _gone(old.proc.pid)


@pytest.mark.parametrize("forked", [False, True])
def test_the_zygote_ends_with_the_process_that_started_it(forked: bool) -> None:
    """Even one that ends without running its exit handlers (killed, or os._exit), and one
    whose fork lives on (a DataLoader worker, say), holding the zygote's socket open."""
    script = ("import os, time\nfrom meshbook.mesh.controller.api.planners import Planners\n"
              "with Planners(1) as pool:\n    zygote = pool.procs[0].zygote.proc.pid\n"
              f"child = os.fork() if {forked} else 1\n"
              "if child == 0:  # off the pipes the test reads to their end\n"
              "    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n    os.dup2(1, 2)\n"
              "    time.sleep(60)\n    os._exit(0)\n"
              "print(zygote, child, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    zygote, child = map(int, out.stdout.split())
    try:
        deadline = time.monotonic() + 10
        while not _gone(zygote) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(zygote), "the zygote outlived the process that started it"
    finally:
        if forked:
            os.kill(child, signal.SIGKILL)


def test_the_zygote_goes_with_the_last_mesh_that_planned_once_no_plan_is_under_way() -> None:
    """Kept while a mesh that planned runs (the next plan forks at once), and while a plan is
    under way: a mesh that stops during its plan leaves the zygote to the plan, which reaps its
    planners through it. Then stopped: nothing a mesh started outlives it."""
    def broken():  # type: ignore[no-untyped-def]
        raise ValueError("no config")  # a plan that fails at once: planned all the same

    with meshbook.start(1) as first, meshbook.start(1) as second:
        for mesh in (first, second):
            with pytest.raises(MeshError, match="no config"):
                mesh.plan(broken, (2, 64))
        zygotes = _zygotes()
        assert len(zygotes) == 1, zygotes
        first.stop()
        assert _zygotes() == zygotes, "the zygote stopped while a mesh that planned runs"
        with Planners(1, second.controller) as pool:  # a plan under way as its mesh stops
            second.stop()
            assert _zygotes() == zygotes and not _gone(pool.procs[0].pid), "the plan lost its zygote"
        planner = pool.procs[0].pid
    assert _gone(zygotes[0]) and _gone(planner), "the zygote outlived the meshes that planned"
    assert not _zygotes()


def test_a_plan_that_fails_before_its_planners_start_still_lets_the_zygote_go(tmp_path) -> None:
    """A plan started in a directory that is gone fails before it forks anything; it must not
    stay counted as under way, which would keep the zygote after the mesh stopped."""
    def broken():  # type: ignore[no-untyped-def]
        raise ValueError("no config")

    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    with meshbook.start(1) as mesh:
        with pytest.raises(MeshError, match="no config"):
            mesh.plan(broken, (2, 64))
        zygotes = _zygotes()
        os.chdir(gone)
        gone.rmdir()
        try:
            with pytest.raises(FileNotFoundError):
                mesh.plan(broken, (2, 64))
        finally:
            os.chdir(here)
    assert len(zygotes) == 1 and _gone(zygotes[0]), "the failed plan kept the zygote"


def _zygotes() -> list[int]:
    """This process's zygotes (their planners are the zygote's children, not this process's)."""
    return [proc.pid for proc in psutil.Process().children() if PLANNER_MODULE in " ".join(proc.cmdline())]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited; its parent has yet to reap it
    except psutil.NoSuchProcess:
        return True


def test_a_fork_whose_note_was_never_read_leaves_no_planner_and_misleads_no_later_fork() -> None:
    """As a Ctrl-C between asking for a planner and hearing its pid leaves things: that planner's
    stdin is closed (it exits), and the next fork is given its own pid, not that one's."""
    zygote = planners.zygote()
    jobs_in, jobs_out = os.pipe()
    answers_in, answers_out = os.pipe()
    with tempfile.TemporaryFile() as log:
        request = b"\n".join([FORK, b"999999", os.fsencode(os.getcwd())])
        socket.send_fds(zygote.sock, [request], [jobs_in, answers_out, log.fileno()])
    for fd in (jobs_in, jobs_out, answers_in, answers_out):
        os.close(fd)
    with Planners(1) as pool:
        assert pool.ask(0, "inspect", BUILD).blocks == "Block"
        assert pool.procs[0].pid in {p.pid for p in psutil.Process(zygote.proc.pid).children()}
    deadline = time.monotonic() + 10
    while psutil.Process(zygote.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.Process(zygote.proc.pid).children(), "the unheard planner was left waiting"


def test_a_request_the_zygote_cannot_read_is_dropped_with_its_files_and_it_serves_on() -> None:
    """A request of another version (or garbage), and a kill that brought files: the files are
    closed (a pipe's reader sees its end), and the next plan's planners are forked as ever."""
    with Planners(1) as pool:  # the zygote has imported torch: the wait below is for the requests only
        assert pool.ask(0, "inspect", BUILD).blocks == "Block"
    zygote = planners.zygote()
    reader, writer = os.pipe()
    for request in (b"bogus\n1\n", FORK + b"\nnot-a-number\n", KILL + b"\n1\n"):
        socket.send_fds(zygote.sock, [request], [writer])
    os.close(writer)
    try:
        os.set_blocking(reader, False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                assert os.read(reader, 1) == b"", "nothing writes to this pipe"
                break  # every writer closed it
            except BlockingIOError:
                time.sleep(0.05)
        else:
            pytest.fail("the zygote kept a file of a request it dropped")
    finally:
        os.close(reader)
    with Planners(1) as pool:
        assert pool.ask(0, "inspect", BUILD).blocks == "Block"
    assert zygote is planners.zygote() and zygote.proc.poll() is None
