"""The runtime's folders are its processes: the import rules hold, and hold at run time.

``lint-imports`` checks the contracts of pyproject.toml (DESIGN.md, "Layout"); a mesh then
shows that a rank (a fork of its host agent, so it holds whatever the agent imported) never
loaded the controller; and each receiver counts and logs a message kind it has no handler for.
Lint and types are checked here too: ``ruff`` finds nothing, nor does ``mypy`` (both configured
in pyproject.toml).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grimp
import pytest
import zmq

import meshbook
from meshbook import Output
from meshbook.mesh.protocol import messages as msg
from meshbook.mesh.protocol.wire import Wire, rank_address

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_import_contracts_hold() -> None:
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_ruff_finds_nothing() -> None:
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    done = subprocess.run([ruff, "check", "meshbook", "tests", "bench", "conftest.py", "examples"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing() -> None:
    mypy = os.path.join(os.path.dirname(sys.executable), "mypy")
    done = subprocess.run([mypy], cwd=ROOT, capture_output=True, text=True, timeout=600)  # [tool.mypy]'s files
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_of_meshbook_imports_itself_back() -> None:
    graph = grimp.build_graph("meshbook", exclude_type_checking_imports=False)  # not even for annotations
    cycles = [(a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
              if a != b and graph.chain_exists(importer=b, imported=a)]
    assert cycles == []


def test_a_rank_never_loads_the_controller(mesh2: meshbook.Mesh) -> None:
    mesh2.push(x=1)  # a rank operation and a payload travelled: still nothing of the controller
    loaded = mesh2.run("import sys\nsorted(m for m in sys.modules if m.startswith('meshbook'))").result()
    for modules in loaded.values():
        assert "meshbook.mesh.rank.worker" in modules and "meshbook.mesh.agent.host" in modules
        assert [m for m in modules if m.startswith("meshbook.mesh.controller")] == []


def _send(address: str, frames: list) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    push.send_multipart([bytes(memoryview(f)) for f in frames])
    push.close(linger=2000)


def _eventually(check, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def test_the_controller_counts_and_logs_a_kind_it_has_no_handler_for(mesh2: meshbook.Mesh, capfd) -> None:
    controller = mesh2.controller
    _send(f"ipc://{controller.rundir}/ev", controller.wire.pack({msg.KIND: "bogus", msg.ID: None, msg.RANK: 1}))
    assert _eventually(lambda: controller.unknown_kinds["bogus"] == 1)
    # And it kept serving. Its receiver thread, which logs right after counting, has handled a
    # later message once this answer is in: the capture is read after its last write, not during.
    assert mesh2.run("rank").result() == {0: 0, 1: 1}
    assert "no handler for 'bogus' messages (from rank 1" in capfd.readouterr().err


@pytest.mark.parametrize("channel", [msg.MAIN, msg.CONTROL])
def test_a_rank_counts_and_logs_a_kind_it_has_no_handler_for(mesh2: meshbook.Mesh, channel: str,
                                                             tmp_path: Path) -> None:
    """The rank's line reaches the notebook at once, as output of no run: the controller's
    receiver thread prints it as is. On the control channel it comes while rank 0 runs a cell,
    whose output it is not (it was, through fd 2, and nobody showed it). Read from a stream
    nothing truncates: pytest's capture, read while that thread wrote, lost the line 3 in 26."""
    controller = mesh2.controller
    # A sender of its own: its sequence numbers do not race the controller's on the same thread.
    sender = Wire(controller.wire.key)
    started, busy = tmp_path / "started", None
    if channel == msg.CONTROL:
        busy = mesh2.run(f"import time, pathlib; pathlib.Path({str(started)!r}).touch(); time.sleep(1.5)", ranks=[0])
        assert _eventually(started.exists)
    with contextlib.redirect_stderr(io.StringIO()) as logged:
        _send(rank_address(controller.rundir, 0, 0, channel), sender.pack({msg.KIND: "bogus", msg.ID: 10**9}))

        def counted() -> int:
            return mesh2.call(lambda worker: worker.unknown_kinds["bogus"], ranks=[0], control=True).result()[0]

        assert _eventually(lambda: counted() == 1)
        name = "main" if channel == msg.MAIN else "control"
        line = f"[0] meshbook: rank 0 has no handler for 'bogus' messages on its {name} channel (1 so far)"
        assert _eventually(lambda: line in logged.getvalue()), logged.getvalue()
    if busy is not None:
        assert busy.result() == {0: None}
        assert not [e for e in busy.events() if isinstance(e, Output)], "the line is no output of the cell"
    assert mesh2.run("rank").result() == {0: 0, 1: 1}


def test_an_agent_counts_and_logs_an_operation_it_has_no_handler_for(mesh2: meshbook.Mesh) -> None:
    controller = mesh2.controller
    controller.agent_op("bogus", [0])
    log = controller.agents[0].logs[0]  # in the runtime directory once the agent is configured

    def logged() -> bool:
        with open(log) as f:
            return "no handler for 'op:bogus' messages (1 so far)" in f.read()

    assert _eventually(logged)
    assert mesh2.run("rank").result() == {0: 0, 1: 1}  # and it kept serving


def test_the_readme_lists_every_setting_meshbook_reads() -> None:
    """protocol/config.py's VARIABLES is the one list; README's "Settings" table shows it."""
    from meshbook.mesh.protocol.config import VARIABLES

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    settings = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(MESHBOOK_\w+)` \|", settings, re.MULTILINE))
    assert listed == set(VARIABLES)
