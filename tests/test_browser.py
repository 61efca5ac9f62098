"""What users see in JupyterLab, in a real browser: live widgets, static outputs in saved
notebooks, the stop button on a hung collective, and no process left after a restart.

Slow (a JupyterLab server and Chromium): marked ``browser`` and left out of ``./dev test``;
``./dev browser`` installs what they need and runs them. They skip, saying why, where
JupyterLab, Playwright or Chromium is missing (in CI they fail instead).
``MESHBOOK_SCREENSHOTS=DIR`` also keeps the tutorials' widgets as PNGs in DIR (the README
shows those in docs/screenshots).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from lab import CHROMIUM, Lab, NotebookPage, missing

# Skipped where something is missing, except in CI: there that is a failure, not a pass.
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(missing() is not None and not os.environ.get("CI"), reason=missing() or "")]

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
WIDGET_ERROR = "Error displaying widget"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
START = "%load_ext meshbook\n%mesh start -n 2"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("lab-root")
    for tutorial in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(tutorial, root)
    server = Lab(root, tmp_path_factory.mktemp("lab-state"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


def notebook(lab: Lab, name: str, *cells: str) -> str:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / name)
    return name


def saved_outputs(lab: Lab, name: str, index: int) -> list[dict[str, Any]]:
    return json.loads((lab.root / name).read_text())["cells"][index]["outputs"]


def kernel_meshbook_processes(lab: Lab) -> list[int]:
    """Host agents and ranks under the lab's kernels."""
    found = []
    for proc in lab.processes():
        try:
            if "meshbook.mesh.agent" in proc.cmdline():
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_live_status_then_static_output_that_survives_a_kernel_restart(lab: Lab, browser: Any) -> None:
    name = notebook(lab, "status.ipynb", START, "%%mesh\nimport time\ntime.sleep(4 if rank else 1.5)\nrank")
    page = NotebookPage(browser, lab, name)
    try:
        page.run(0)
        page.start(1)
        live = page.output(1).locator(".widget-html", has_text="%%mesh running")
        live.wait_for(timeout=20_000)  # the live widget renders while the cell runs
        assert WIDGET_ERROR not in page.output_text(1)
        text = page.wait(1)
        assert "per-rank durations" in text and "[0,1]" not in text and "[1] 1" in text, text
        assert page.output(1).locator(".widget-html").count() == 0, "the status stayed a widget"
        assert kernel_meshbook_processes(lab), "no mesh ran under the notebook's kernel"
        page.save()
        stored = saved_outputs(lab, name, 1)
        status = [o for o in stored if o["output_type"] == "display_data"]
        assert len(status) == 1 and sorted(status[0]["data"]) == ["text/html", "text/plain"], stored
        assert "".join(status[0]["data"]["text/plain"]) == "cell status: [0,1] done"
        page.restart_kernel()
        deadline = time.monotonic() + 15
        while left := kernel_meshbook_processes(lab):
            assert time.monotonic() < deadline, f"meshbook processes outlived the kernel: {left}"
            time.sleep(0.2)
        page.open()  # reopened after the restart: the saved outputs, no kernel state behind them
        text = page.output_text(1)
        assert "per-rank durations" in text and WIDGET_ERROR not in text, text
    finally:
        page.close()


def test_dashboard_updates_live_and_a_closed_one_leaves_a_snapshot(lab: Lab, browser: Any) -> None:
    name = notebook(lab, "dashboard.ipynb", START,
                    "from meshbook.widgets import Dashboard\ndashboard = Dashboard()\ndashboard",
                    "%%mesh\nimport time\nx = torch.ones(4_000_000)\ntime.sleep(2)",
                    "dashboard.close()\n%mesh stop")
    page = NotebookPage(browser, lab, name)
    try:
        page.run(0)
        page.run(1)
        table = page.output(1).locator(".widget-html table")
        table.wait_for(timeout=20_000)
        first = table.inner_text()
        page.run(2)  # the ranks grow by 16 MB each, and their heartbeats go on
        deadline = time.monotonic() + 10
        while table.inner_text() == first:
            assert time.monotonic() < deadline, "the dashboard did not update"
            time.sleep(0.2)
        assert WIDGET_ERROR not in page.output_text(1)
        page.run(3)
        snapshot = page.output(1)
        assert snapshot.locator(".widget-html").count() == 0, "the closed dashboard stayed a widget"
        assert "host RAM" in snapshot.inner_text() and "rank" in snapshot.inner_text()
        page.save()
        shown = [o for o in saved_outputs(lab, name, 1) if o["output_type"] == "display_data"]
        assert len(shown) == 1 and WIDGET_VIEW not in shown[0]["data"], shown
        page.restart_kernel()
        page.open()
        assert WIDGET_ERROR not in page.output_text(1) and "host RAM" in page.output_text(1)
    finally:
        page.close()


def test_two_clicks_on_stop_free_a_hung_collective(lab: Lab, browser: Any) -> None:
    # rank 1 blocks SIGINT, so the first click cannot stop it (a rank that did stop would free
    # the ranks waiting on it by itself); the second click frees everyone
    hang = ("%%mesh\nimport signal, time\nt = torch.ones(1)\nif rank == 1:\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n    time.sleep(600)\n"
            "dist.all_reduce(t)")
    name = notebook(lab, "hang.ipynb", START, "%%mesh\nkeep = rank * 100", hang,
                    "%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(globals().get('keep'), t.item())",
                    "%mesh stop")
    page = NotebookPage(browser, lab, name)
    try:
        page.run(0)
        page.run(1)
        page.start(2)
        page.wait_for_text(2, "rank 1 never reached it", 30)  # explained before anyone pressed stop
        page.interrupt()
        page.wait_for_text(2, "Interrupt again", 30)  # the first click is explained too
        page.interrupt()
        text = page.wait(2, timeout=60)
        assert "rank 1 restarted" in text and "rank 0 kept its variables" in text, text
        assert "[0] (0, 2.0)\n[1] (None, 2.0)" in page.run(3), page.output_text(3)
        page.run(4)
    finally:
        page.close()


#: meshbook's panels, live (a widget) or static (their HTML, whose frame is monospace).
PANELS = ".jp-OutputArea-output:has(div[style^='font-family:monospace'])"


#: The tutorial whose panels must show (the test below checks it has one).
DASHBOARD = NOTEBOOKS / "05_dashboard.ipynb"


def test_the_tutorials_checked_include_the_dashboard() -> None:
    """The test below takes the tutorials it finds: one renamed away must not pass unseen."""
    assert DASHBOARD.exists(), f"{DASHBOARD.name} is gone: point DASHBOARD at the tutorial with the dashboard"


@pytest.mark.parametrize("tutorial", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda path: path.stem)
def test_tutorials_show_their_widgets_without_errors(lab: Lab, browser: Any, tmp_path: Path, tutorial: Path) -> None:
    # one test per tutorial: each has the whole timeout, and a failure names its notebook
    shots = Path(os.environ.get("MESHBOOK_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    page = NotebookPage(browser, lab, tutorial.name)
    try:
        page.js("return jupyterapp.commands.execute('notebook:clear-all-cell-outputs');")
        page.run_all()
        assert WIDGET_ERROR not in page.panel.inner_text()
        widgets = page.panel.locator(PANELS)
        for i in range(min(widgets.count(), 2)):
            widgets.nth(i).screenshot(path=str(shots / f"{tutorial.stem}-{i + 1}.png"))
        if tutorial == DASHBOARD:
            assert widgets.count() > 0, "the dashboard tutorial shows no panel"
    finally:
        page.close()
