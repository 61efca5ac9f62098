"""A real JupyterLab driven by a real browser: what users see, tested as they see it.

:class:`Lab` starts JupyterLab 4 on a free loopback port with a random token, in its own
settings, workspace and runtime directories, and stops it (and every process it started,
kernels included) by pid. :class:`NotebookPage` opens a notebook in headless Chromium through
Playwright and drives it as a user does: runs cells, clicks the stop button, saves, restarts
the kernel, reloads. JupyterLab is started with ``expose_app_in_browser`` so the page can run
JupyterLab's own commands (the ones its menus and shortcuts run) instead of guessing at
keyboard focus.

Playwright's own browser download needs the network; Debian's ``chromium`` is used through
``executable_path`` (``MESHBOOK_CHROMIUM`` overrides where it is). :func:`missing` says what
is absent, for the tests to skip with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

CHROMIUM = os.environ.get("MESHBOOK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def missing() -> str | None:
    """Why the browser tests cannot run here, or ``None``."""
    for module in ("jupyterlab", "playwright"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[browser]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no chromium at {CHROMIUM} (apt-get install chromium, or set MESHBOOK_CHROMIUM)"
    return None


class Lab:
    """A JupyterLab server serving ``root``, stopped with every process it started."""

    def __init__(self, root: Path, state: Path) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(state / "config"),
               "JUPYTERLAB_SETTINGS_DIR": str(state / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
               "JUPYTER_RUNTIME_DIR": str(state / "runtime"), "PYTHONUNBUFFERED": "1"}
        # No "Would you like to get notified about Jupyter news?" toast over the screenshots.
        notification = state / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True, exist_ok=True)
        notification.write_text('{"fetchNews": "false"}')
        self.log = open(state / "jupyterlab.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
             "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--ServerApp.terminals_enabled=False",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root)
        self._wait_ready(120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"JupyterLab did not start: see {self.log.name}")
                time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """The server's descendants (its kernels, their meshes)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """Stop the server (it shuts its kernels down), then anything of it left, by pid."""
        started = self.processes()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        _, alive = psutil.wait_procs(started, timeout=10)
        for proc in alive:
            proc.kill()
        psutil.wait_procs(alive, timeout=10)
        self.log.close()


class NotebookPage:
    """One notebook open in a browser tab of ``lab``."""

    def __init__(self, browser: Any, lab: Lab, name: str) -> None:
        self.lab, self.name = lab, name
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.open()

    def open(self) -> None:
        """Open (or reload) the notebook and wait for its kernel to be idle."""
        # reset: only this notebook open, not what earlier pages left in the workspace
        self.page.goto(f"{self.lab.url}/lab/tree/{self.name}?reset&token={self.lab.token}")
        self.page.wait_for_function(
            "() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;"
            " return w && w.content && w.content.widgets.length > 0 &&"
            " w.sessionContext.session?.kernel?.status === 'idle'; }", timeout=120_000)
        self.js("jupyterapp.shell.collapseLeft(); return null;")  # the notebook takes the width
        #: This notebook's panel (a Playwright locator).
        self.panel = self.page.locator("#" + self.js("return nb.id;"))

    def js(self, body: str, arg: Any = None) -> Any:
        """Evaluate ``body`` with ``nb`` (the notebook panel) and ``arg`` in scope."""
        return self.page.evaluate(
            f"(arg) => {{ const nb = jupyterapp.shell.currentWidget; {body} }}", arg)

    def start(self, index: int) -> None:
        """Run cell ``index`` and return at once (as a user pressing Shift+Enter)."""
        self.js("window.meshbookRunning = window.meshbookRunning || {};"
                "window.meshbookRunning[arg] = true; nb.content.activeCellIndex = arg;"
                "jupyterapp.commands.execute('notebook:run-cell')"
                ".finally(() => { window.meshbookRunning[arg] = false; }); return null;", index)

    def wait(self, index: int, timeout: float = 120, answer: str = "c") -> str:
        """Wait for cell ``index`` to finish, answering any input box it opens (a debugger
        prompt) with ``answer``; the text of its outputs."""
        deadline = time.monotonic() + timeout
        stdin = self.output(index).locator("input.jp-Stdin-input")
        while self.js("return window.meshbookRunning[arg];", index):
            assert time.monotonic() < deadline, f"cell {index} still running after {timeout:g} s"
            if stdin.count():
                stdin.fill(answer)
                stdin.press("Enter")
            time.sleep(0.2)
        return self.output_text(index)

    def run(self, index: int, timeout: float = 120) -> str:
        self.start(index)
        return self.wait(index, timeout)

    def run_all(self, timeout: float = 600) -> None:
        for index in range(self.js("return nb.content.widgets.length;")):
            if self.js("return nb.content.widgets[arg].model.type;", index) == "code":
                self.run(index, timeout)

    def wait_for_text(self, index: int, text: str, timeout: float) -> str:
        """Wait until cell ``index``'s outputs show ``text``; all of their text."""
        deadline = time.monotonic() + timeout
        while text not in (shown := self.output_text(index)):
            assert time.monotonic() < deadline, f"{text!r} not shown in {timeout:g} s:\n{shown}"
            time.sleep(0.2)
        return shown

    def output(self, index: int) -> Any:
        """The output area of cell ``index`` (a Playwright locator)."""
        return self.panel.locator(".jp-Cell").nth(index).locator(".jp-OutputArea")

    def output_text(self, index: int) -> str:
        return self.js("return nb.content.widgets[arg].node.querySelector('.jp-OutputArea')"
                       "?.innerText ?? '';", index)

    def interrupt(self) -> None:
        """Click the toolbar's stop button."""
        self.panel.locator("jp-button[data-command='notebook:interrupt-kernel']").click()

    def save(self) -> None:
        self.js("return jupyterapp.commands.execute('docmanager:save');")
        self.page.wait_for_function("() => !jupyterapp.shell.currentWidget.context.model.dirty")

    def restart_kernel(self) -> None:
        """Restart the kernel as the Kernel menu does (without its confirmation dialog)."""
        self.js("return nb.sessionContext.restartKernel();")
        self.page.wait_for_function(
            "() => jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'",
            timeout=120_000)

    def close(self) -> None:
        self.page.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
