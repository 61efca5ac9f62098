"""The notebook face end to end: a real kernel, driven through jupyter_client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest
from jupyter_kernels import Kernel, kernel_with_mesh, wait_gone


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    yield from kernel_with_mesh()


def test_a_mesh_error_from_the_python_api_shows_the_cell_and_the_message_only(kernel: Kernel) -> None:
    """Not a traceback through meshbook's own frames: the cell's line, then what to do."""
    reply = kernel.execute("import meshbook\nmesh = meshbook.current()\nmesh.run('rank', ranks=[9])")
    shown = "\n".join(reply.content["traceback"])
    assert reply.status == "error" and reply.content["ename"] == "SelectionError", reply.content
    assert "meshbook/mesh" not in shown and "IPython" not in shown, shown
    assert "line 3" in shown and "mesh.run('rank', ranks=[9])" in shown, shown
    assert shown.splitlines()[-1].startswith("SelectionError: "), shown
    assert kernel.ok("%%mesh\nrank").of_type("execute_result")  # nothing wedged
    # nor the frames of what meshbook called (contextlib's, as a push packs its values)
    reply = kernel.execute("import threading\nmesh.push(lock=threading.Lock())")
    shown = "\n".join(reply.content["traceback"])
    assert reply.content["ename"] == "SendError" and "contextlib" not in shown, shown
    assert "mesh.push(lock=threading.Lock())" in shown, shown


def test_help_is_real(kernel: Kernel) -> None:
    reply = kernel.ok("%mesh?")
    page = reply.content["payload"][0]["data"]["text/plain"]
    for expected in ("--ranks", "--where", "--ordered", "Commands", "start", "status"):
        assert expected in page
    assert "--collective-timeout" in kernel.ok("%mesh help start").stream()
    assert kernel.ok("%mesh help").stream().startswith("  %%mesh [--mesh MESH_NAME]"), "no reST marker first"
    # --help as a shell command takes it: the help, and nothing run on the ranks
    assert kernel.ok("%%mesh --help\nraise SystemExit('ran')").stream() == kernel.ok("%mesh help").stream()
    assert kernel.ok("%mesh --help").stream() == kernel.ok("%mesh help").stream()
    assert kernel.ok("%mesh start -h").stream() == kernel.ok("%mesh help start").stream()


def test_output_streams_live_into_its_own_cell_merged(kernel: Kernel) -> None:
    code = ("%%mesh\nimport time\nprint('epoch 1')\ntime.sleep(1.5)\nprint(f'done {rank}')")
    reply = kernel.ok(code)
    assert reply.stream().count("[0-3] epoch 1\n") == 1
    for rank in range(4):
        assert f"[{rank}] done {rank}\n" in reply.stream()
    first = min(t for t, m in reply.outputs if m["msg_type"] == "stream")
    assert reply.replied_at - first > 1.0, "output was not streamed while the cell ran"


def test_a_progress_line_updates_in_place_and_labelled(kernel: Kernel) -> None:
    reply = kernel.ok("%%mesh --ranks 0,1\nimport time\nfor i in range(3):\n"
                      "    print(f'\\rstep {i}/3', end='', flush=True)\n    time.sleep(0.3)\nprint(' done')")
    text = reply.stream()
    assert text.startswith("[") and "\r[" in text, repr(text)  # each update labelled, over the last
    assert "\n[" not in text.split("done")[0], f"an update took a line of its own: {text!r}"
    assert text.endswith("] step 2/3 done\n") and text.count("\n") == 1, repr(text)


def test_a_line_printed_in_pieces_shows_while_the_rank_works(kernel: Kernel) -> None:
    """``print('.', end='', flush=True)`` while working: the dots show as they come, as in a
    local cell, not all at once when the line ends."""
    reply = kernel.ok("%%mesh --ranks 0\nimport time\nprint('working', end='', flush=True)\n"
                      "for i in range(4):\n    time.sleep(0.6)\n    print('.', end='', flush=True)\nprint(' done')")
    streams = [(t, m["content"]["text"]) for t, m in reply.outputs if m["msg_type"] == "stream"]
    assert len(streams) >= 3 and reply.replied_at - streams[0][0] > 1.0, streams  # streamed while it ran
    assert streams[0][1].startswith("[0] working"), streams
    assert reply.stream().endswith("[0] working.... done\n"), repr(reply.stream())  # each over the last


def test_cells_read_like_ipython_cells(kernel: Kernel) -> None:
    """A trailing ; hides the value; a top-level await runs on the rank's event loop (kept from
    cell to cell); a magic or shell command says it runs in the notebook, not on the ranks."""
    assert kernel.ok("%%mesh\nhidden = rank\nhidden;").of_type("execute_result") == []
    reply = kernel.ok("%%mesh --ranks 1\nimport asyncio\nq = asyncio.Queue()\nawait q.put(rank * 10)\nawait q.get()")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[1] 10"
    reply = kernel.ok("%%mesh --ranks 1\nawait q.put(3)\nawait q.get()")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[1] 3"
    refused = kernel.execute("%%mesh\n%time x = 1")
    assert refused.status == "error" and "magics (%...) and shell commands (!...) run in the notebook, not on the " \
        "ranks" in refused.error_text and "nothing was sent" in refused.error_text


def test_ordered_output_is_deterministic(kernel: Kernel) -> None:
    code = "%%mesh --ordered\nimport random, time\ntime.sleep(random.random() / 5)\nprint('rank', rank)\nprint('same')"
    expected = "[0] rank 0\n[0] same\n[1] rank 1\n[1] same\n[2] rank 2\n[2] same\n[3] rank 3\n[3] same\n"
    for _ in range(2):
        assert kernel.ok(code).stream() == expected


def test_results_display_collapsed_and_out_stores_them(kernel: Kernel) -> None:
    reply = kernel.ok("%%mesh --out res\nx = torch.full((2,), float(rank))\ndist.all_reduce(x)\nx.sum().item()")
    (result,) = reply.of_type("execute_result")
    assert result["content"]["data"]["text/plain"] == "[0-3] 12.0"
    assert kernel.value("dict(res)") == {0: 12.0, 1: 12.0, 2: 12.0, 3: 12.0}
    quiet = kernel.ok("%%mesh --quiet\nrank")
    assert quiet.of_type("execute_result") == []
    assert kernel.execute("%%mesh --out part\nif rank == 1:\n    raise ValueError('no')\nrank").status == "error"
    assert kernel.value("dict(part)") == {0: 0, 2: 2, 3: 3}  # what the other ranks gave is kept


def test_selection_options(kernel: Kernel) -> None:
    reply = kernel.ok("%%mesh --ranks 0,2\nrank")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[0] 0\n[2] 2"
    reply = kernel.ok("%%mesh --where tp=1\nrank")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[1] 1\n[3] 3"
    # Given twice: the ranks add up, and both conditions hold (the last alone picked others).
    reply = kernel.ok("%%mesh --where dp=0 --where tp=1\nrank")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[1] 1"
    reply = kernel.ok("%%mesh --ranks 0 --ranks 3\nrank")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[0] 0\n[3] 3"
    reply = kernel.ok("%%mesh --ranks '0,2' --where \"dp=1\"\nrank")  # quoted as in a shell (the quotes were kept)
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[2] 2"


def test_errors_are_grouped_with_cell_line_numbers_and_the_cell_fails(kernel: Kernel) -> None:
    reply = kernel.execute("%%mesh\na = 1\nb = a / (rank % 2)\nb")
    assert reply.status == "error"
    text = reply.error_text
    assert "[0,2] ZeroDivisionError: division by zero" in text
    assert "cell line 3" in text and "b = a / (rank % 2)" in text
    assert "[1,3] finished: their values are this error's .partial (%%mesh --out NAME keeps them)" in text
    assert "meshbook/" not in text, "internal frames leaked into the traceback"


def test_syntax_error_is_shown_before_anything_is_sent(kernel: Kernel) -> None:
    reply = kernel.execute("%%mesh\nsent_before_error = 1\nx = (")
    assert reply.status == "error"
    assert "cell line 3" in reply.error_text and "SyntaxError" in reply.error_text
    assert kernel.ok("%%mesh --ranks 0\n'sent_before_error' in globals()").of_type(
        "execute_result")[0]["content"]["data"]["text/plain"] == "[0] False"


@pytest.mark.parametrize("cell, message", [
    ("%%mesh --bogus\n1", "unrecognized arguments: --bogus"),
    ("%%mesh --ranks 9\n1", "rank 9 does not exist: this mesh has ranks 0-3"),
    ("%%mesh --where tp=5\n1", "tp=5 is out of range"),
    ("%%mesh --where nope=1\n1", "no dimension 'nope'"),
    ("%mesh start --dims dp=2,tp", "cannot read --dims"),
    ("%mesh start -n 2", "a mesh is already running"),
    ("%mesh start 2", "a mesh is already running"),  # the count as -n gives it, as meshbook.start(2)
    ("%mesh start 2 -n 3", "%mesh start 2 -n 3: give the number of ranks once"),
    ("%mesh help frobnicate", "unknown command 'frobnicate'; commands: attach, "),
    ("%mesh frobnicate", "unknown command %mesh frobnicate"),
    ("%%mesh --ranks '0,2\n1", "No closing quotation (close the quote, or escape it with a backslash)"),
    ("%%mesh --where tp=0 --where tp=1\n1", "names 'tp' twice"),
    ("%%mesh --timeout -1\nkept = -1", "argument --timeout/-t: give a number of seconds above 0, e.g. 30 (got '-1')"),
    ("%%mesh --timeout 0\nkept = -1", "give a number of seconds above 0"),
    ("%%mesh --out 1x\nkept = -1", "--out takes a variable name (letters, digits and _), not '1x'"),
    ("%mesh start -n 2 --collective-timeout -1", "argument --collective-timeout: give a number of seconds"),
    ("%mesh start -n 2 --timeout 0", "argument --timeout: give a number of seconds above 0"),
])
def test_bad_input_is_one_line_and_leaves_the_mesh_alone(kernel: Kernel, cell: str, message: str) -> None:
    kernel.ok("%%mesh\nkept = rank")
    reply = kernel.execute(cell)
    assert reply.status == "error"
    assert reply.content["ename"] == "UsageError"
    assert message in reply.content["evalue"]
    assert "\n" not in reply.content["evalue"].strip()
    assert kernel.ok("%%mesh\nkept").of_type("execute_result")[0]["content"]["data"][
        "text/plain"] == "[0] 0\n[1] 1\n[2] 2\n[3] 3"


def test_restart_of_a_mesh_started_from_python_says_how(kernel: Kernel) -> None:
    kernel.ok("import meshbook\napi = meshbook.start(2, name='api')")
    try:
        kernel.ok("%mesh use api")
        reply = kernel.execute("%mesh restart")
        assert reply.content["ename"] == "UsageError"
        assert ("mesh 'api': 2 ranks (world=2, cpu) was not started by %mesh start in this kernel (but from "
                "Python, or attached): restart its ranks instead (fresh namespaces), %mesh restart 0-1"
                ) in reply.content["evalue"]
        assert kernel.ok("%mesh restart 0-1").stream().startswith("ranks 0,1 restarted: their variables are lost")
    finally:
        kernel.ok("%mesh use mesh\napi.stop()")


def test_a_whole_mesh_restart_says_where_the_new_mesh_is(kernel: Kernel) -> None:
    """A handle taken before (``mesh = meshbook.current()``, as the tutorials do) said "stopped
    by the user; start a new one", and a kept mesh's new id went unsaid."""
    kernel.ok("%mesh start -n 1 --name again --keep 5m\nbefore = meshbook.current()")
    try:
        old_id = kernel.value("before.kept_id")
        assert kernel.value("repr(before)") == f"<Mesh 'again' world=1, kept as {old_id}: running>"
        out = kernel.ok("%mesh restart").stream()
        new_id = kernel.value("meshbook.current().kept_id")
        assert new_id != old_id
        assert out == (f"restarted mesh 'again': 1 ranks (world=1, cpu); kept as {new_id} (not {old_id} any more): "
                       f"after a kernel restart, %mesh attach {new_id}. Handles to the old mesh stopped with it: "
                       f"mesh = meshbook.current() takes the new one\n"), out
        stale = kernel.execute("before.run('1').result()")
        assert stale.content["ename"] == "MeshStoppedError"
        assert stale.content["evalue"] == ("the mesh is stopped (replaced by a new mesh (%mesh restart)); take the "
                                           "new one: mesh = meshbook.current()")
    finally:
        kernel.ok("%mesh stop again\n%mesh use mesh")


def test_a_forced_start_says_which_mesh_it_stopped(kernel: Kernel) -> None:
    kernel.ok("%mesh start -n 1 --name side")
    try:
        out = kernel.ok("%mesh start -n 1 --name side --force").stream()
        assert out.startswith("stopped mesh 'side': 1 ranks (world=1, cpu) (--force)\nstarted mesh 'side'"), out
    finally:
        kernel.ok("%mesh use mesh\nimport meshbook\nmeshbook.mesh_named('side').stop()")


def test_a_stopped_current_mesh_says_which_runs_still(kernel: Kernel) -> None:
    kernel.ok("%mesh start -n 1 --name gen")  # the current mesh from now on
    try:
        assert kernel.ok("%mesh stop gen").stream() == "stopped gen; still running: mesh (%mesh use NAME picks one)\n"
        status = kernel.ok("%mesh status").stream()
        assert status.startswith("the current mesh is stopped; running: mesh (%mesh use NAME picks one)\n4 ranks")
        reply = kernel.execute("%%mesh\nrank")
        assert reply.content["ename"] == "UsageError"
        assert "the current mesh 'gen' is stopped; running: mesh. Pick one with" in reply.content["evalue"]
        refused = kernel.execute("%mesh start -n 1")  # unnamed: one at a time, and mesh runs
        assert refused.status == "error" and "a mesh is already running" in refused.content["evalue"]
    finally:
        kernel.ok("%mesh use mesh")
    assert kernel.ok("%%mesh\nrank").of_type("execute_result")[0]["content"]["data"]["text/plain"].startswith("[0] 0")


def test_late_output_goes_to_the_cell_that_started_it_merged_across_ranks(kernel: Kernel) -> None:
    """A background thread's prints land in the cell that started it, the same line from
    every rank once, as a running cell's; a line only one rank prints is marked with it."""
    first = kernel.ok("%%mesh --ranks 1,2\nimport threading, time\n"
                      "def later():\n    time.sleep(1)\n    print('late line')\n"
                      "    print(f'only rank {rank}') if rank == 2 else None\n"
                      "threading.Thread(target=later).start()")
    second = kernel.ok("import time\ntime.sleep(2.5)\nprint('local')")
    assert second.stream() == "local\n"
    deadline = time.monotonic() + 10
    while "only rank" not in (seen := "".join(m["content"].get("text", "")
                                              for _, m in kernel.outputs_of(first.msg_id))):
        assert time.monotonic() < deadline, f"late output never reached its cell: {seen!r}"
        time.sleep(0.1)
    assert seen == "[1,2] late line\n[2] only rank 2\n", seen


def test_a_cell_that_timed_out_still_shows_its_output_and_how_it_ended(kernel: Kernel) -> None:
    cell = ("%%mesh --timeout 1 --out late\nimport time\ntime.sleep(3)\nprint('slept', rank)\n"
            "if rank == 1:\n    1 / 0\n'value'")
    reply = kernel.execute(cell)
    assert reply.status == "error" and "still running on rank(s) 0-3 after 1 s" in reply.content["evalue"]
    assert "how the cell ends, still comes here" in reply.content["evalue"]
    assert "The values of the ranks that finish go to `late` when the cell ends." in reply.content["evalue"]
    deadline = time.monotonic() + 30
    while "ended after the wait" not in (seen := "".join(
            m["content"].get("text", "") for _, m in kernel.outputs_of(reply.msg_id))):
        assert time.monotonic() < deadline, f"the timed-out cell's end never reached it: {seen!r}"
        time.sleep(0.1)
    assert all(f"[{r}] slept {r}" in seen for r in range(4)), seen
    # Named as the notebook shows it (In [N]); IPython 9 counts a cell before it runs it, 8 after.
    assert (f"meshbook: cell [{reply.content['execution_count']}] ended after the wait for it timed out: "
            "[0,2,3] finished: 'value'; [1] "
            "ZeroDivisionError: division by zero (%mesh debug 1 shows where); the values of the ranks that "
            "finished are in `late`") in seen, seen
    assert kernel.value("dict(late)") == {0: "value", 2: "value", 3: "value"}
    assert kernel.ok("%%mesh\nrank").of_type("execute_result")[0]["content"]["data"]["text/plain"] == (
        "[0] 0\n[1] 1\n[2] 2\n[3] 3")


def test_display_on_a_rank_reaches_the_cell(kernel: Kernel) -> None:
    reply = kernel.ok("%%mesh --ranks 2\nclass R:\n    def _repr_html_(self):\n"
                      "        return '<i>hi</i>'\ndisplay(R())")
    (shown,) = reply.of_type("display_data")
    assert shown["content"]["data"]["text/html"] == "<div><b>[2]</b><i>hi</i></div>"  # labelled as lines are
    assert shown["content"]["metadata"]["meshbook"]["ranks"] == [2]
    # A final expression with an HTML form renders so, per group of ranks; the text stays beside it
    result = kernel.ok("%%mesh --ranks 1,2\nfrom IPython.display import HTML\nHTML(f'<b>{rank % 2}</b>')")
    (data,) = [m["content"]["data"] for m in result.of_type("execute_result")]
    assert data["text/html"] == "<div><b>[1]</b><b>1</b></div><div><b>[2]</b><b>0</b></div>"
    assert data["text/plain"] == "[1,2] <IPython.core.display.HTML object>"
    # IPython's own display(), imported as users do, reaches the notebook too (it printed a repr)
    reply = kernel.ok("%%mesh --ranks 1,3\nfrom IPython.display import display, HTML\ndisplay(HTML(f'<b>{rank}</b>'))")
    assert [m["content"]["data"]["text/html"] for m in reply.of_type("display_data")] == [
        "<div><b>[1]</b><b>1</b></div>", "<div><b>[3]</b><b>3</b></div>"]
    assert reply.stream() == ""
    # the same display of several ranks shows once, between the lines printed around it
    reply = kernel.ok("%%mesh\nfrom IPython.display import display, HTML, Image\nprint('before')\n"
                      "display(HTML('<b>same</b>'))\nprint('after')")
    (shown,) = reply.of_type("display_data")
    assert shown["content"]["data"]["text/html"] == "<div><b>[0-3]</b><b>same</b></div>"
    kinds = [m["msg_type"] for _, m in reply.outputs if m["msg_type"] in ("stream", "display_data")]
    assert kinds == ["stream", "display_data", "stream"] and reply.stream() == "[0-3] before\n[0-3] after\n", \
        (kinds, reply.stream())
    # a bundle shown as neither HTML nor text (an image) gets its label as a line before it
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")
    reply = kernel.ok(f"%%mesh --ranks 0,1\nimport base64\nfrom IPython.display import display, Image\n"
                      f"display(Image(base64.b64decode('{png}')))")
    assert reply.stream() == "[0,1]\n" and len(reply.of_type("display_data")) == 1, reply.stream()


def test_status_and_auto_mode(kernel: Kernel) -> None:
    status = kernel.ok("%mesh status").stream()
    assert "rank" in status and "state" in status and status.count("idle") == 4
    kernel.ok("%mesh on")
    reply = kernel.ok("rank * 10")
    assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"].startswith("[0] 0\n[1] 10")
    kernel.ok("%mesh off")
    assert kernel.execute("rank").status == "error"  # back to local: no `rank` here


def test_interrupt_ends_the_cell_with_keyboard_interrupt(kernel: Kernel) -> None:
    msg_id, sent = kernel.submit("%%mesh\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    deadline = time.monotonic() + 30
    while "sleeping" not in "".join(m["content"].get("text", "") for _, m in kernel.outputs_of(msg_id)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()
    reply = kernel.wait(msg_id, sent, timeout=30)
    assert reply.replied_at - interrupted < 2.0
    assert reply.status == "error"
    assert "[0-3] KeyboardInterrupt" in reply.error_text
    assert "cell line 4" in reply.error_text
    assert kernel.ok("%%mesh\nrank").status == "ok"


def test_no_mesh_says_how_to_start_one() -> None:
    k = Kernel()
    try:
        k.ok("%load_ext meshbook")
        reply = k.execute("%%mesh\n1")
        assert reply.status == "error" and "%mesh start -n 4" in reply.content["evalue"]
        # The ssh launcher's own example: hosts x --per-host is the count (no -n needed); these
        # hosts do not exist, so the start fails where ssh does, not on the count.
        reply = k.execute("%mesh start --hosts no-such-host-a,no-such-host-b --per-host 2 --timeout 30")
        assert reply.status == "error" and "could not start the agent on no-such-host-a" in reply.content["evalue"]
        # Set after %load_ext prewarmed the agent: the ranks see the notebook's environment as
        # it is at %mesh start, as a subprocess started then would.
        k.ok("import os\nos.environ['MESHBOOK_TEST_SETTING'] = 'set in a cell'\n"
             "os.environ.pop('OMP_NUM_THREADS', None)")
        started = k.ok("%mesh start -n 2").stream()
        assert "started 2 ranks" in started and "OMP_NUM_THREADS=1 per rank, as torchrun sets it" in started
        reply = k.ok("%%mesh\nimport os\nos.environ.get('MESHBOOK_TEST_SETTING')")
        assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[0,1] 'set in a cell'"
        k.ok("%mesh on")
        assert k.ok("%mesh stop").stream() == "mesh stopped\ncells run locally again\n", "%mesh on ends with it"
        assert k.ok("1 + 1").of_type("execute_result")[0]["content"]["data"]["text/plain"] == "2"
    finally:
        k.close()


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_kernel_end_leaves_no_process(how: str) -> None:
    k = Kernel()
    try:
        k.ok("import meshbook\n%load_ext meshbook\n%mesh start -n 2")
        pids = k.mesh_pids()
        if how == "shutdown":
            k.manager.shutdown_kernel(now=False)
        elif how == "restart":
            k.manager.restart_kernel(now=False)
        else:
            os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids) == []
    finally:
        k.close()


def test_kernelspec_installs_and_loads_the_extension(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "meshbook.kernel", "install", "--prefix", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    assert "installed kernelspec 'meshbook'" in done.stdout
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    assert ksm.get_kernel_spec("meshbook").display_name == "Python 3 (meshbook)"
    k = Kernel("meshbook", kernel_spec_manager=ksm)
    try:
        assert "Commands" in k.ok("%mesh help").stream()
    finally:
        k.close()
