"""The widgets in a real kernel: their model state (traitlets), live updates, stragglers,
a killed rank, deterministic fallbacks, and no thread outliving its widget or its mesh.

The tests share one kernel and mesh and run in file order: the last two break the mesh.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_kernels import Kernel, Reply, kernel_with_mesh
from workloads import slow_rank_loop

from meshbook.widgets import html

DASHBOARD_TEXT = ("meshbook dashboard: 4 ranks (dp=2, tp=2); %mesh memory and %mesh stragglers "
                  "print the same as text")


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    yield from kernel_with_mesh("%mesh start --dims dp=2,tp=2\nimport threading, time\n"
                                "import meshbook.widgets\nd = meshbook.widgets.Dashboard(meshbook.current())")


def poll(kernel: Kernel, expr: str, ready: Callable[[Any], bool], timeout: float) -> Any:
    """Evaluate ``expr`` in the kernel until ``ready(value)``; the value."""
    deadline = time.monotonic() + timeout
    while True:
        value = kernel.value(expr)
        if ready(value):
            return value
        assert time.monotonic() < deadline, f"{expr} still {value!r} after {timeout:g} s"
        time.sleep(0.2)


def watched(kernel: Kernel, code: str) -> Reply:
    """Run a cell as an interactive frontend does (stdin allowed): live status is shown."""
    msg_id, sent = kernel.submit(code, allow_stdin=True)
    reply = kernel.wait(msg_id, sent)
    assert reply.status == "ok", reply.error_text
    return reply


def cell_status_states(kernel: Kernel, reply: Reply) -> list[dict[str, Any]]:
    """The CellStatus model's state as the frontend received it: its opening state, then
    every update merged in, one snapshot per update."""
    model, snapshots = None, []
    for msg in kernel.messages_of(reply.msg_id):
        data = msg["content"].get("data", {})
        if msg["msg_type"] == "comm_open" and "ranks" in data.get("state", {}):
            model = msg["content"]["comm_id"]
            snapshots.append(dict(data["state"]))
        elif msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == model:
            snapshots.append({**snapshots[-1], **data.get("state", {})})
    return snapshots


def displays(reply: Reply) -> list[dict[str, Any]]:
    return [m["content"]["data"] for _, m in reply.outputs if m["msg_type"] == "display_data"]


def replaced(kernel: Kernel, reply: Reply) -> list[dict[str, Any]]:
    """What replaced the displays of ``reply``'s cell (sent under that cell's header, so a
    frontend routes it to that cell's outputs), each checked to name a display it showed."""
    shown = {m["content"]["transient"]["display_id"] for m in kernel.messages_of(reply.msg_id)
             if m["msg_type"] == "display_data"}
    updates = [m["content"] for m in kernel.messages_of(reply.msg_id)
               if m["msg_type"] == "update_display_data"]
    assert all(u["transient"]["display_id"] in shown for u in updates), (shown, updates)
    return [u["data"] for u in updates]


STATIC = ["text/html", "text/plain"]  # what a saved notebook shows without a kernel


def test_dashboard_rows_are_live(kernel: Kernel) -> None:
    rows = poll(kernel, "d.rows", lambda rows: all(r["rss"] for r in rows), 10)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["rss"] > 50 << 20 and r["cpu"] is not None and r["pid"] > 0, r
        assert r["state"] == "idle" and r["device"] == "cpu" and r["host"], r
        assert r["pool"] in ("host", "container") and 0 < r["pool_used"] < r["pool_limit"], r
        assert 0 <= r["heartbeat_age"] < 5 and not r["dead"] and not r["straggler"], r
    assert kernel.value("(d.live, d.thread.is_alive())") == (True, True)
    poll(kernel, "d.html_view.value.count('<svg')", lambda n: n == 4, 10)  # one sparkline per rank
    # the panel keeps updating while another cell runs
    changed = kernel.ok("before = d.rows\ntime.sleep(1.5)\nprint(before != d.rows)").stream()
    assert changed == "True\n", "the dashboard did not update while a cell ran"


def test_sampling_flags_the_slow_rank_within_10_s(kernel: Kernel, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    kernel.ok(f"loop = meshbook.current().run({slow_rank_loop(str(stop), slow_rank=2)!r})")
    try:
        # Ranks' heartbeats are not in phase: wait until every rank has enough samples to score.
        scored = "d.stragglers if all(r['score'] is not None for r in d.rows) else []"
        assert poll(kernel, scored, bool, timeout=10) == [2]
        flags = kernel.value("[(r['rank'], r['straggler'], r['score'] > 0.3) for r in d.rows]")
        assert flags == [(0, False, False), (1, False, False), (2, True, True), (3, False, False)]
        assert html.FLAG in kernel.value("d.html_view.value")
        text = kernel.ok("%mesh stragglers").stream()
        assert "straggler: rank 2 (score" in text
        # Where it spends its time, from its samples: the time.sleep line once they are a few
        # (on a loaded machine the first ones may all fall on the loop's start).
        deadline = time.monotonic() + 10
        while "rank 2 spends its time at: cell line 8" not in text:
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
            text = kernel.ok("%mesh stragglers").stream()
    finally:
        stop.touch()
    kernel.ok("loop.result(timeout=60)")


def test_cell_status_follows_the_ranks_and_ends_with_durations(kernel: Kernel) -> None:
    reply = watched(kernel, "%%mesh\nimport time\ntime.sleep(3.0 if rank == 1 else 1.3)\nrank")
    states = cell_status_states(kernel, reply)
    first, last = states[0], states[-1]
    assert [r["state"] for r in first["ranks"]] == ["running"] * 4
    assert all(r["line"] == 3 for r in first["ranks"]), first  # the time.sleep line
    assert any([r["state"] for r in s["ranks"]] == ["done", "running", "done", "done"]
               for s in states), "rank 1 never shown running alone"
    assert last["state"] == "done" and [r["state"] for r in last["ranks"]] == ["done"] * 4
    assert [r["rank"] for r in last["ranks"] if r["straggler"]] == [1], last
    assert max(last["ranks"], key=lambda r: r["elapsed"])["rank"] == 1
    shown, = displays(reply)
    assert shown["text/plain"] == "cell status: [0-3] running"
    assert "application/vnd.jupyter.widget-view+json" in shown
    final, = replaced(kernel, reply)
    assert sorted(final) == STATIC, "a saved notebook would show 'Error displaying widget'"
    assert final["text/plain"] == "cell status: [0-3] done"
    assert "per-rank durations" in final["text/html"] and html.FLAG in final["text/html"]
    closed = [m for m in kernel.messages_of(reply.msg_id) if m["msg_type"] == "comm_close"]
    assert closed, "the status widget's models outlive their cell"


def test_durations_split_computing_from_waiting_in_collectives(kernel: Kernel) -> None:
    # every rank ends at the same all_reduce, so all take the same time; rank 1 computed it
    reply = watched(kernel, "%%mesh\nimport time\nt = torch.ones(1)\n"
                            "time.sleep(3.0 if rank == 1 else 0.2)\ndist.all_reduce(t)")
    last = cell_status_states(kernel, reply)[-1]["ranks"]
    assert all(r["waiting"] is not None for r in last), last
    assert last[1]["waiting"] < 1.0 and all(last[r]["waiting"] > 1.5 for r in (0, 2, 3)), last
    assert [r["rank"] for r in last if r["straggler"]] == [1], last
    final, = replaced(kernel, reply)
    assert "s computing" in final["text/html"] and "waiting in collectives" in final["text/html"]


def test_fallbacks_are_deterministic_and_batch_runs_store_no_status(kernel: Kernel) -> None:
    long_cell = "%%mesh\nimport time\ntime.sleep(1.6)"
    finals = [[data["text/plain"] for data in replaced(kernel, watched(kernel, long_cell))] for _ in range(2)]
    assert finals == [["cell status: [0-3] done"]] * 2
    batch = kernel.ok(long_cell)  # as nbconvert / nbval run it: allow_stdin=False
    assert displays(batch) == [] and cell_status_states(kernel, batch) == []
    assert displays(watched(kernel, "%%mesh --no-status\nimport time\ntime.sleep(1.6)")) == []
    assert displays(watched(kernel, "%%mesh\n1")) == [], "a quick cell shows no status"
    bundles = [kernel.value("sorted(d._repr_mimebundle_().items())[-1]") for _ in range(2)]
    assert bundles == [("text/plain", DASHBOARD_TEXT)] * 2
    assert kernel.value("sorted(d._repr_mimebundle_())") == [
        "application/vnd.jupyter.widget-view+json", "text/html", "text/plain"]
    assert kernel.value("repr(d)") == DASHBOARD_TEXT


def test_a_killed_rank_shows_dead(kernel: Kernel) -> None:
    code = "%%mesh\nimport os, time\ntime.sleep(1.5)\nif rank == 3:\n    os.kill(os.getpid(), 9)\ntime.sleep(0.5)"
    msg_id, sent = kernel.submit(code, allow_stdin=True)
    reply = kernel.wait(msg_id, sent)
    assert reply.status == "error" and "rank 3 died: SIGKILL" in reply.error_text
    states = cell_status_states(kernel, reply)
    rank3 = [s["ranks"][3]["state"] for s in states]
    assert rank3[0] == "running" and rank3[-1] == "dead"
    assert [r["state"] for r in states[-1]["ranks"]] == ["done", "done", "done", "dead"]
    assert states[-1]["state"] == "dead"
    assert [data["text/plain"] for data in replaced(kernel, reply)] == ["cell status: [0-2] done, [3] dead"]
    row = poll(kernel, "d.rows[3]", lambda r: r["dead"], 10)
    assert row["state"] == "dead (SIGKILL)" and row["rss"] is None and row["pid"] is None
    assert html.DEAD_BG in kernel.value("d.html_view.value")


def test_closing_or_stopping_ends_the_updates_and_leaves_a_snapshot(kernel: Kernel) -> None:
    listeners = "[len(c.heartbeat_listeners), len(c.death_listeners)]"
    kernel.ok(f"c = meshbook.current().controller\nbefore = {listeners}")
    shown = kernel.ok("%mesh dashboard")
    assert "application/vnd.jupyter.widget-view+json" in displays(shown)[0]
    kernel.ok("d2 = meshbook.widgets.Dashboard(meshbook.current())")
    assert kernel.value("d2.thread.is_alive()") is True
    shown_d = kernel.ok("d")
    kernel.ok("d.close()")
    assert kernel.value("(d.thread.is_alive(), d.live, d.comm)") == (False, False, None)
    snapshot, = replaced(kernel, shown_d)  # the closing cell replaced the display in its own cell
    assert sorted(snapshot) == STATIC and "<table" in snapshot["text/html"]
    assert snapshot["text/plain"] == DASHBOARD_TEXT
    stopped = kernel.ok("%mesh stop")
    # Frozen in the cell that stopped the mesh, before it ended (nbconvert leaves after it).
    assert kernel.value("(d2.thread.is_alive(), d2.live)") == (False, False)
    assert "mesh stopped" in kernel.value("d2.html_view.value")
    frozen = {m["content"]["transient"]["display_id"] for m in kernel.messages_of(stopped.msg_id)
              if m["msg_type"] == "update_display_data"}
    shown_ids = {m["content"]["transient"]["display_id"] for m in kernel.messages_of(shown.msg_id)
                 if m["msg_type"] == "display_data"}
    assert shown_ids and shown_ids <= frozen, "the panel froze after the stopping cell ended"
    snapshot, = replaced(kernel, shown)
    assert sorted(snapshot) == STATIC and "mesh stopped" in snapshot["text/html"]
    assert kernel.value(f"{listeners} == before") is True
    assert kernel.value("[t.name for t in threading.enumerate() if 'dashboard' in t.name]") == []
