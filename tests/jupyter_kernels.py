"""Drive a real Jupyter kernel through jupyter_client, reading iopub directly."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from jupyter_client.manager import KernelManager


@dataclass
class Reply:
    msg_id: str
    status: str
    content: dict[str, Any]
    sent_at: float
    replied_at: float
    outputs: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def stream(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for _, m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == name)

    def of_type(self, msg_type: str) -> list[dict[str, Any]]:
        return [m for _, m in self.outputs if m["msg_type"] == msg_type]

    @property
    def error_text(self) -> str:
        return "\n".join(self.content.get("traceback", []))


class Kernel:
    """A kernel whose iopub messages are collected per cell (parent msg_id), in a thread."""

    def __init__(self, kernel_name: str = "python3", **manager_kwargs: Any) -> None:
        self.manager = KernelManager(kernel_name=kernel_name, **manager_kwargs)
        self.manager.start_kernel()
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self._by_parent: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_iopub, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def _read_iopub(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            except Exception:
                return
            parent = msg.get("parent_header", {}).get("msg_id", "")
            with self._lock:
                self._by_parent.setdefault(parent, []).append((time.monotonic(), msg))

    def outputs_of(self, msg_id: str) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return [(t, m) for t, m in self._by_parent.get(msg_id, [])
                    if m["msg_type"] in ("stream", "display_data", "execute_result", "error")]

    def messages_of(self, msg_id: str) -> list[dict[str, Any]]:
        """Every iopub message a request produced (widget comm messages too), in order."""
        with self._lock:
            return [m for _, m in self._by_parent.get(msg_id, [])]

    def submit(self, code: str, allow_stdin: bool = False) -> tuple[str, float]:
        return self.client.execute(code, allow_stdin=allow_stdin), time.monotonic()

    def wait(self, msg_id: str, sent_at: float, timeout: float = 120) -> Reply:
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        replied_at = time.monotonic()
        self._wait_idle(msg_id, deadline)
        return Reply(msg_id, reply["content"]["status"], reply["content"], sent_at, replied_at,
                     self.outputs_of(msg_id))

    def _wait_idle(self, msg_id: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            with self._lock:
                msgs = self._by_parent.get(msg_id, [])
                if any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                       for _, m in msgs):
                    return
            time.sleep(0.01)

    def execute_with_input(self, code: str, answers: list[str], timeout: float = 120) -> tuple[Reply, list[str]]:
        """Run ``code`` with stdin allowed, answering each input request with the next answer;
        returns the reply and the prompts that were shown."""
        msg_id, sent_at = self.submit(code, allow_stdin=True)
        prompts: list[str] = []
        pending = list(answers)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.client.get_shell_msg(timeout=0.05)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            except queue.Empty:
                pass
            try:
                request = self.client.get_stdin_msg(timeout=0.05)
            except queue.Empty:
                request = None
            if request is not None and request["msg_type"] == "input_request":
                prompts.append(request["content"]["prompt"])
                self.client.input(pending.pop(0) if pending else "c")
            assert time.monotonic() < deadline, f"no reply; prompts so far: {prompts}"
        replied_at = time.monotonic()
        self._wait_idle(msg_id, deadline)
        return Reply(msg_id, reply["content"]["status"], reply["content"], sent_at, replied_at,
                     self.outputs_of(msg_id)), prompts

    def execute(self, code: str, timeout: float = 120) -> Reply:
        msg_id, sent_at = self.submit(code)
        return self.wait(msg_id, sent_at, timeout)

    def ok(self, code: str, timeout: float = 120) -> Reply:
        reply = self.execute(code, timeout)
        assert reply.status == "ok", reply.error_text or reply.content
        return reply

    def value(self, expr: str) -> Any:
        """Evaluate ``expr`` in the kernel (a literal-valued expression) and return it."""
        import ast

        reply = self.ok(f"print(repr({expr}))")
        return ast.literal_eval(reply.stream().strip())

    def mesh_pids(self) -> list[int]:
        return self.value("[meshbook.current().controller.agents[0].proc.pid]"
                          " + [s.pid for s in meshbook.current().status()]")

    def close(self) -> None:
        self._stop.set()
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        self._reader.join(2)


def kernel_with_mesh(start: str = "%mesh start --dims dp=2,tp=2") -> Iterator[Kernel]:
    """A kernel with meshbook loaded and a mesh started, stopped and closed afterwards
    (the body of the kernel test modules' shared fixture)."""
    kernel = Kernel()
    try:
        kernel.ok(f"import meshbook, torch\n%load_ext meshbook\n{start}")
        yield kernel
        kernel.ok("%mesh stop")
    finally:
        kernel.close()


def running(pid: int) -> bool:
    """Is ``pid`` a live process (a zombie is not)? One that exits while asked is not either."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
