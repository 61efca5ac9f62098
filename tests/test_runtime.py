"""The mesh runtime through its Python API, on real rank processes with gloo."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
import torch

import meshbook
from meshbook import (
    Display,
    MeshError,
    Output,
    RankValues,
    RemoteError,
    Result,
    SelectionError,
)


def test_all_reduce_and_collapsed_repr(mesh4: meshbook.Mesh) -> None:
    vals = mesh4.run("x = torch.full((2,), float(rank)); dist.all_reduce(x); x.sum().item()").result()
    assert dict(vals) == {0: 12.0, 1: 12.0, 2: 12.0, 3: 12.0}
    assert repr(vals) == "[0-3] 12.0"


def test_namespace_persists_and_ranks_select(mesh4: meshbook.Mesh) -> None:
    mesh4.run("y = rank * 10").result()
    vals = mesh4.run("y + 1", ranks=[0, 2]).result()
    assert dict(vals) == {0: 1, 2: 21}
    assert dict(mesh4.run("y", ranks="1-3").result()) == {1: 10, 2: 20, 3: 30}


def test_namespace_is_seeded(mesh4: meshbook.Mesh) -> None:
    code = ("(rank, world_size, local_rank, coords, str(device), dist.is_initialized(),"
            " device_mesh.mesh_dim_names, tuple(device_mesh.shape), torch.__name__)")
    vals = mesh4.run(code).result()
    assert vals[3] == (3, 4, 3, {"dp": 1, "tp": 1}, "cpu", True, ("dp", "tp"), (2, 2), "torch")
    assert vals[1][3] == {"dp": 0, "tp": 1}


def test_device_mesh_groups_follow_coords(mesh4: meshbook.Mesh) -> None:
    code = ("t = torch.tensor([float(rank)]); dist.all_reduce(t, group=device_mesh.get_group('tp'));"
            " t.item()")
    assert dict(mesh4.run(code).result()) == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}


def test_apply_runs_notebook_function_in_rank_namespace(mesh4: meshbook.Mesh) -> None:
    offset = 100

    def helper(a: int) -> int:
        return a + offset  # a notebook name carried along

    assert dict(mesh4.apply(lambda a: rank + a, 10).result())  # noqa: F821 - a rank name == {0: 10, 1: 11, 2: 12, 3: 13}
    assert dict(mesh4.apply(helper, 1, ranks=[1]).result()) == {1: 101}
    assert dict(mesh4.apply(torch.add, 1, 2, ranks=[0]).result()) == {0: torch.tensor(3)}


def test_a_script_function_and_the_helpers_it_calls_see_the_rank_and_keep_their_lines(
        mesh4: meshbook.Mesh, tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text("def helper():\n    return rank * 10\n\n\ndef outer():\n    return helper() + 1\n\n\n"
                      "def fails():\n    return 1 / (rank - 1)\n")
    functions: dict = {"__name__": "__main__"}  # as a script's own: they travel by value
    exec(compile(script.read_text(), str(script), "exec"), functions)
    assert dict(mesh4.apply(functions["outer"]).result()) == {0: 1, 1: 11, 2: 21, 3: 31}
    with pytest.raises(RemoteError) as info:
        mesh4.apply(functions["fails"], ranks=[1]).result()
    frame = info.value.failures[1].frames[-1]
    assert (frame.filename, frame.lineno, frame.line) == (str(script), 10, "return 1 / (rank - 1)")


def test_slice_is_a_view_on_the_same_namespaces(mesh4: meshbook.Mesh) -> None:
    half = mesh4.slice(dp=0)
    assert half.ranks == [0, 1]
    half.run("z = 'set by the slice'").result()
    assert dict(mesh4.run("z", ranks=[1]).result()) == {1: "set by the slice"}
    assert mesh4.slice(dp=1, tp=0).ranks == [2]
    assert half.slice(tp=1).ranks == [1]


def test_rank_values_select_by_dimension(mesh4: meshbook.Mesh) -> None:
    vals = mesh4.run("rank").result()
    assert vals.where(tp=1).ranks == [1, 3]
    assert isinstance(vals.where(dp=0), RankValues)
    assert mesh4.run("7").result().unique() == 7
    with pytest.raises(ValueError):
        vals.unique()


def test_errors_are_grouped_with_cell_line_numbers(mesh4: meshbook.Mesh) -> None:
    code = "a = 1\nb = 1 / (rank % 2)\nb"
    with pytest.raises(RemoteError) as info:
        mesh4.run(code).result()
    err = info.value
    assert err.ranks == [0, 2]
    assert err.summary_lines() == ["[0,2] ZeroDivisionError: division by zero"]
    assert dict(err.partial) == {1: 1.0, 3: 1.0}
    frame = err.failures[0].frames[-1]
    assert (frame.in_cell, frame.lineno, frame.line) == (True, 2, "b = 1 / (rank % 2)")
    rendered = err.render()
    assert "cell line 2" in rendered and "worker.py" not in rendered


@pytest.mark.parametrize("code, torch_frame", [
    ("t = torch.ones(2)\ndist.all_reduce(t, group=123)", "distributed_c10d.py:{}, in get_backend"),
    ("t = torch.ones(2)\ndist.broadcast(t, src=7)", "distributed_c10d.py:{}, in broadcast"),
    ("def f():\n    return torch.nn.Linear(2, 3)(torch.ones(4))\nf()", "linear.py:{}, in forward"),
])
def test_tracebacks_keep_the_cell_and_where_torch_raised_not_torch_wrappers(
        mesh4: meshbook.Mesh, code: str, torch_frame: str) -> None:
    with pytest.raises(RemoteError) as info:
        mesh4.run(code, ranks=[0]).result()
    frames = info.value.failures[0].frames
    assert all(f.in_cell for f in frames[:-1]) and frames[0].line == code.splitlines()[-1]
    innermost = frames[-1].format().splitlines()[0].strip().rsplit("/", 1)[-1]
    assert re.fullmatch(torch_frame.format(r"\d+"), innermost), frames
    assert "c10d_logger" not in info.value.render() and "_call_impl" not in info.value.render()


CHAINED = [
    ("def inner():\n    return {}['k']\ntry:\n    inner()\nexcept KeyError as e:\n    raise ValueError('outer') from e",
     "[0] ValueError: outer\n    cell line 6, in <module>\n      raise ValueError('outer') from e\n"
     "  Raised from this exception (its direct cause):\n    KeyError: 'k'\n      cell line 4, in <module>\n"
     "        inner()\n      cell line 2, in inner\n        return {}['k']"),
    ("try:\n    1/0\nexcept Exception:\n    undefined",
     "[0] NameError: name 'undefined' is not defined\n    cell line 4, in <module>\n      undefined\n"
     "  Raised while handling this exception:\n    ZeroDivisionError: division by zero\n"
     "      cell line 2, in <module>\n        1/0"),
    ("try:\n    1/0\nexcept Exception:\n    raise KeyError('x') from None",
     "[0] KeyError: 'x'\n    cell line 4, in <module>\n      raise KeyError('x') from None"),
    ("e = ValueError('v')\ne.add_note('checked twice')\nraise e",
     "[0] ValueError: v\n    cell line 3, in <module>\n      raise e\n  checked twice"),
    ("def f(n):\n    return f(n + 1)\nf(0)",
     "[0] RecursionError: maximum recursion depth exceeded\n    cell line 3, in <module>\n      f(0)\n"
     + "    cell line 2, in f\n      return f(n + 1)\n" * 3 + "    [Previous line repeated {n} more times]"),
]


@pytest.mark.parametrize("code, told", CHAINED)
def test_an_error_tells_what_python_tells_of_it(mesh4: meshbook.Mesh, code: str, told: str) -> None:
    """Its cause, or the error it was raised while handling; its notes; a recursion counted."""
    with pytest.raises(RemoteError) as info:
        mesh4.run(code, ranks=[0]).result(echo=False)
    assert re.fullmatch(re.escape(told).replace(re.escape("{n}"), r"\d+"), info.value.render()), info.value.render()


def test_a_clean_exit_ends_a_cell_as_it_ends_a_script_under_torchrun(mesh4: meshbook.Mesh) -> None:
    """``sys.exit(main())`` ending a pasted script (main returns None), ``exit()``,
    ``sys.exit(0)``: the cell ends there, cleanly; the rank stays up with its variables. Another
    exit status is the failure it is under torchrun."""
    script = ("import sys\ndef main():\n    global reached\n    reached = 1\n"
              "if __name__ == '__main__':\n    sys.exit(main())\nreached = 2")
    assert mesh4.run(script).result(echo=False) == {r: None for r in range(4)}
    assert mesh4.run("exit()\nreached = 3").result(echo=False) == {r: None for r in range(4)}
    assert mesh4.apply(sys.exit, 0).result(echo=False) == {r: None for r in range(4)}
    with pytest.raises(RemoteError) as info:
        mesh4.run("import sys\nsys.exit(rank + 1)", ranks=[0, 1]).result(echo=False)
    assert {r: f"{f.type_name}: {f.message}" for r, f in info.value.failures.items()} == {
        0: "SystemExit: 1", 1: "SystemExit: 2"}
    assert mesh4.run("reached").result(echo=False).unique() == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11's")
def test_an_exception_group_tells_each_exception_it_holds(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError) as info:
        mesh4.run("def fail():\n    raise TypeError('t1')\nerrors = []\ntry:\n    fail()\n"
                  "except TypeError as e:\n    errors.append(e)\n"
                  "raise ExceptionGroup('many', [ValueError('v1'), *errors])", ranks=[0]).result(echo=False)
    assert info.value.render().endswith("  Sub-exception 1 of 2:\n    ValueError: v1\n  Sub-exception 2 of 2:\n"
                                        "    TypeError: t1\n      cell line 5, in <module>\n        fail()\n"
                                        "      cell line 2, in fail\n        raise TypeError('t1')")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python prints an exception's notes from 3.11")
def test_an_error_a_script_does_not_catch_shows_each_rank_s_report() -> None:
    """Python prints str(error) and its notes: the notes hold what render() shows in a notebook."""
    import subprocess
    from pathlib import Path

    script = ("import meshbook\nwith meshbook.start(2) as mesh:\n"
              "    mesh.run('def helper(v):\\n    return 1 / v\\nhelper(rank - 1)').result()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    told = done.stderr[done.stderr.index("Traceback"):]
    assert told.endswith("RemoteError: 1 rank failed; first: [1] ZeroDivisionError: division by zero\n"
                         "[1] ZeroDivisionError: division by zero\n    cell line 3, in <module>\n"
                         "      helper(rank - 1)\n    cell line 2, in helper\n      return 1 / v\n"
                         "[0] finished: its value is this error's .partial\n"), told
    assert "follow.py" not in told  # meshbook's own frames end where the script called it


def test_a_frame_of_an_earlier_cell_names_its_cell(mesh4: meshbook.Mesh) -> None:
    """As IPython's ``Cell In[3], line 12``: "cell line 2" read as line 2 of the cell that ran."""
    mesh4.run("def helper(v):\n    return 1 / v", ranks=[0], name=3).result()
    with pytest.raises(RemoteError) as info:
        mesh4.run("x = 0\nhelper(x)", ranks=[0], name=4).result(echo=False)
    assert info.value.render() == ("[0] ZeroDivisionError: division by zero\n    cell line 2, in <module>\n"
                                   "      helper(x)\n    cell [3] line 2, in helper\n      return 1 / v")


def test_first_line_shifts_reported_lines(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError) as info:
        mesh4.run("x = 1\nraise ValueError(rank)", ranks=[0], first_line=2).result()
    assert info.value.failures[0].frames[-1].lineno == 3


def test_syntax_error_is_caught_before_anything_is_sent(mesh4: meshbook.Mesh) -> None:
    before = mesh4.controller.book.request_ids
    peek = next(before)
    with pytest.raises(meshbook.CellSyntaxError) as info:
        mesh4.run("x = (")
    assert isinstance(info.value, MeshError) and info.value.lineno == 1
    assert "was never closed" in str(info.value)
    assert next(mesh4.controller.book.request_ids) == peek + 1  # no request id was used in between


@pytest.mark.parametrize("kwargs, message", [
    ({"ranks": [9]}, "rank 9 does not exist: this mesh has ranks 0-3"),
    ({"ranks": "0,x"}, "cannot read ranks"),
    ({"where": {"tp": 5}}, "tp=5 is out of range: tp has size 2"),
    ({"where": {"pp": 0}}, "the mesh has no dimension 'pp'"),
    ({"ranks": []}, "the selection is empty"),
])
def test_bad_selections_say_what_is_wrong(mesh4: meshbook.Mesh, kwargs: dict, message: str) -> None:
    with pytest.raises(SelectionError, match=message):
        mesh4.run("1", **kwargs)
    assert mesh4.run("1", ranks=[0]).result()[0] == 1


def test_unpicklable_argument_names_its_type(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(meshbook.SendError, match=r"^apply\(.*<lambda>\): argument 2 \(a _thread.lock\) cannot be "
                                                 r"pickled: .*; nothing was sent$"):
        mesh4.apply(lambda a, b: a, 1, threading.Lock())


def test_unpicklable_result_names_type_and_rank_stays_healthy(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError) as info:
        mesh4.run("import threading\nthreading.Lock()", ranks=[1]).result()
    failure = info.value.failures[1]
    assert failure.type_name == "SendError" and "_thread.lock" in failure.message
    assert "kept on the rank as `_`" in failure.message
    assert dict(mesh4.run("type(_).__name__", ranks=[1]).result()) == {1: "lock"}
    with pytest.raises(RemoteError, match="kept on the rank as `_`"):  # an apply's too, as it says
        mesh4.apply(threading.Lock, ranks=[2]).result()
    assert dict(mesh4.run("type(_).__name__", ranks=[2]).result()) == {2: "lock"}


def test_output_arrives_before_the_result(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("for i in range(3):\n    print(f'line {i} of {rank}')\nrank")
    seen: dict[int, list[str]] = {r: [] for r in range(4)}
    answered: set[int] = set()
    for event in run.events():
        if isinstance(event, Output):
            assert event.rank not in answered, "output arrived after its rank's result"
            seen[event.rank].append(event.text)
        elif isinstance(event, Result):
            answered.add(event.rank)
    for rank, texts in seen.items():
        assert "".join(texts) == "".join(f"line {i} of {rank}\n" for i in range(3))


def test_a_warning_shows_each_time_its_cell_runs(mesh4: meshbook.Mesh) -> None:
    """As in IPython: not once per line number for every cell a rank runs."""
    for _ in range(2):
        run = mesh4.run("import warnings\nwarnings.warn('lr too high')", ranks=[1])
        run.result(echo=False)
        assert "UserWarning: lr too high" in "".join(e.text for e in run.events() if isinstance(e, Output))


def test_a_dtensor_result_says_the_notebook_gets_local_shards(mesh4: meshbook.Mesh) -> None:
    """Each rank's value is its quarter of the tensor: the cell says so, not only the docs."""
    run = mesh4.run("from torch.distributed.tensor import Shard, distribute_tensor\n"
                    "d = distribute_tensor(torch.arange(8.0), device_mesh, [Shard(0), Shard(0)])\n{'w': d}")
    values = run.result(echo=False)
    assert [values[r]["w"].shape for r in range(4)] == [(2,)] * 4
    said = "".join(e.text for e in run.events() if isinstance(e, Output))
    assert said.count("meshbook: the result holds DTensors, and the notebook gets each rank's local shard") == 4
    assert "DTensors" not in "".join(e.text for e in mesh4.run("d.full_tensor()").events() if isinstance(e, Output))


def test_c_level_output_is_captured(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("import os, ctypes\nos.system('echo from a subprocess')\n"
                    "ctypes.CDLL(None).printf(b'from C printf\\n')\nNone", ranks=[2])
    run.result(echo=False)
    text = "".join(e.text for e in run.events() if isinstance(e, Output))
    assert "from a subprocess\n" in text and "from C printf\n" in text


def test_what_a_forked_child_prints_reaches_the_cell(mesh4: meshbook.Mesh) -> None:
    # A DataLoader worker and a bare fork: the rank's sockets are not theirs, its pipes are.
    run = mesh4.run("import os, sys, torch.utils.data as tud\n"
                    "class Items(tud.Dataset):\n"
                    "    def __len__(self): return 2\n"
                    "    def __getitem__(self, i):\n"
                    "        print(f'worker item {i}'); sys.stderr.write(f'worker warns {i}\\n'); return i\n"
                    "print('partial before the fork', end='')\n"
                    "seen = [int(b) for b in tud.DataLoader(Items(), num_workers=1)]\n"
                    "pid = os.fork()\n"
                    "if pid == 0:\n"
                    "    print('from the child', end='')\n"
                    "    sys.stdout.flush(); os._exit(0)\n"
                    "os.waitpid(pid, 0)\n"
                    "seen", ranks=[1, 2])
    assert run.result(echo=False).unique() == [0, 1]
    said = {stream: "".join(e.text for e in run.events() if isinstance(e, Output) and e.rank == 2 and
                            e.stream == stream) for stream in ("stdout", "stderr")}
    assert "worker item 0\nworker item 1\n" in said["stdout"] and "from the child" in said["stdout"]
    assert "worker warns 0\nworker warns 1\n" in said["stderr"]
    assert said["stdout"].count("partial before the fork") == 1  # the parent's partial line, not the child's too


def test_late_output_of_a_background_thread_stays_with_its_run(mesh4: meshbook.Mesh) -> None:
    late: list[tuple[int, str]] = []
    arrived = threading.Event()

    def attach(run: meshbook.Run) -> None:
        def on_late(event: object, run_id: int = run.id) -> None:
            late.append((run_id, event.text))  # type: ignore[attr-defined]
            arrived.set()
        run.on_late_output = on_late

    mesh4.controller.add_run_listener(attach)
    try:
        code = ("import threading, time\n"
                "def later():\n    time.sleep(0.5)\n    print('from the background')\n"
                "threading.Thread(target=later).start()")
        first = mesh4.run(code, ranks=[0])
        first.result()
        second = mesh4.run("import time\ntime.sleep(1.0)\nprint('second cell')", ranks=[0])
        second.result(echo=False)
    finally:
        mesh4.controller.remove_run_listener(attach)
    assert arrived.wait(10)
    assert late == [(first.id, "from the background\n")]
    assert [e.text for e in second.events() if isinstance(e, Output)] == ["second cell\n"]


def test_display_sends_rich_representations(mesh4: meshbook.Mesh) -> None:
    code = ("class Rich:\n    def _repr_html_(self):\n        return f'<b>{rank}</b>'\n"
            "display(Rich())")
    run = mesh4.run(code, ranks=[3])
    run.result(echo=False)
    (event,) = [e for e in run.events() if isinstance(e, Display)]
    assert event.data["text/html"] == "<b>3</b>" and "Rich" in event.data["text/plain"]


@pytest.mark.parametrize("expr, expected", [
    ("torch.arange(6, dtype=torch.float32).reshape(2, 3)", torch.arange(6.0).reshape(2, 3)),
    ("torch.arange(6).reshape(2, 3).t()", torch.arange(6).reshape(2, 3).t()),
    ("torch.ones(3, dtype=torch.bfloat16) * 1.5", torch.ones(3, dtype=torch.bfloat16) * 1.5),
    ("torch.zeros(0, 4)", torch.zeros(0, 4)),
    ("torch.tensor(3.5)", torch.tensor(3.5)),
])
def test_tensor_results_arrive_exactly(mesh4: meshbook.Mesh, expr: str, expected: torch.Tensor) -> None:
    value = mesh4.run(expr, ranks=[1]).result()[1]
    assert value.dtype == expected.dtype and value.shape == expected.shape
    assert torch.equal(value, expected)


def test_events_are_ordered_and_complete(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("print('a')\nrank")
    events = list(run.events())
    assert sorted(e.rank for e in events if isinstance(e, Result)) == [0, 1, 2, 3]
    assert run.done() and set(run.durations) == {0, 1, 2, 3}


def test_result_timeout_leaves_the_work_running(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("import time\ntime.sleep(1.5)\n'finished'", ranks=[0])
    with pytest.raises(meshbook.MeshTimeout, match="still running on rank"):
        run.result(timeout=0.2)
    assert run.result(timeout=30)[0] == "finished"


def test_interrupt_stops_python_code_with_keyboard_interrupt(mesh4: meshbook.Mesh) -> None:
    run = mesh4.run("import time\nstarted = True\ntime.sleep(60)", ranks=[0, 1])
    deadline = time.monotonic() + 30
    while not all(s.metrics.get("line") == 3 for s in mesh4.status()[:2]):
        assert time.monotonic() < deadline, "ranks never reached the sleep"
        time.sleep(0.05)
    run.interrupt()
    with pytest.raises(RemoteError) as info:
        run.result(timeout=10)
    assert info.value.summary_lines() == ["[0,1] KeyboardInterrupt"]
    assert info.value.failures[0].frames[-1].lineno == 3
    assert dict(mesh4.run("started", ranks=[0, 1]).result()) == {0: True, 1: True}


def test_ranks_that_failed_alike_but_for_their_peers_address_are_one_group(mesh4: meshbook.Mesh) -> None:
    """gloo names each rank's own peer ("Connection closed by peer [127.0.0.1]:57034"): four
    such errors are one group, told without the addresses. The ranks that finished are said
    too, with where their values are."""
    with pytest.raises(RemoteError) as info:
        mesh4.run("if rank:\n    raise RuntimeError(f'Connection closed by peer [127.0.0.1]:{5000 + rank}')\n"
                  "'fine'").result(echo=False)
    text = info.value.render()
    assert "[1-3] RuntimeError: Connection closed by peer [peer]\n" in text, text
    assert text.endswith("[0] finished: its value is this error's .partial"), text
    assert info.value.failures[2].message == "Connection closed by peer [127.0.0.1]:5002", "each rank's own, kept"


def test_the_headline_names_the_rank_whose_own_code_failed_and_its_text() -> None:
    """A pipeline stage raised; the stages waiting on it were aborted, or saw gloo's closed
    connection: the headline named rank 0's echo of it. torch's pipelining wraps the stage's
    error in a message that begins with a blank line and an indent: the headline was blank."""
    from meshbook.mesh.protocol.errors import RankFailure

    failed = RemoteError({0: RankFailure(0, "RuntimeError", "[gloo/pair.cc:553] Connection closed by peer"),
                          1: RankFailure(1, "CollectiveAborted", "meshbook aborted its recv #3 from rank 2"),
                          2: RankFailure(2, "RuntimeError", "\n            [Stage 2] failed to run forward:\n  x")})
    assert str(failed).startswith("3 ranks failed; first: [2] RuntimeError: [Stage 2] failed to run forward:\n")
    assert [ranks for ranks, _ in failed.groups] == [[2], [1], [0]]  # meshbook says whom it waited for; gloo not


def test_only_a_peers_address_is_left_out_when_failures_are_grouped() -> None:
    """A user's own text that looks like an index and a number ("row [3]:1") still tells ranks apart."""
    from meshbook.mesh.protocol.errors import RankFailure

    def failure(rank: int, text: str) -> RankFailure:
        return RankFailure(rank, "ValueError", text)

    own = RemoteError({1: failure(1, "row [3]:1"), 2: failure(2, "row [3]:2")})
    assert [ranks for ranks, _ in own.groups] == [[1], [2]]
    peers = RemoteError({1: failure(1, "peer [::1]:4001"), 2: failure(2, "peer [10.0.0.7]:4002")})
    assert [ranks for ranks, _ in peers.groups] == [[1, 2]] and "[1,2] ValueError: peer [peer]" in peers.render()
