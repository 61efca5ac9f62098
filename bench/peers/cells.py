"""Notebook cells as a frontend sees them: from execute_request to execute_reply.

A real Jupyter kernel is started and driven through jupyter_client with the same driver the
tests use (``tests/jupyter_kernels.py``), so a cell's time here is what JupyterLab waits for. Two
kernels, one per system under test:

* :func:`meshbook_kernel`: ``%load_ext meshbook`` and ``%mesh start -n N``; it runs
  ``%%mesh pass`` cells and plain local ``pass`` cells (the baseline);
* :func:`ipyparallel_kernel`: a ``Cluster`` started inside the kernel with its magics
  activated; it runs ``%%px pass`` cells and local ``pass`` cells.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..procs import reaped
from ..timing import Sample

_TESTS = Path(__file__).resolve().parents[2] / "tests"


def _kernel_class() -> Any:
    # The tests' kernel driver, loaded from its file: tests/ is not a package.
    name = "meshbook_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TESTS / "jupyter_kernels.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the kernel driver from {_TESTS / 'jupyter_kernels.py'}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up while being defined
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # not half a module for the next caller
            raise
    return sys.modules[name].Kernel


def cell(kernel: Any, code: str) -> Sample:
    """A sample: run ``code`` as a cell; its time from request to reply."""

    def sample() -> float:
        reply = kernel.ok(code)
        return float(reply.replied_at - reply.sent_at)

    return sample


def _start_kernel(setup: str, teardown: str) -> Any:
    kernel = _kernel_class()()
    try:
        kernel.ok(setup, timeout=600)
    except BaseException:
        try:
            kernel.execute(teardown, timeout=120)  # whatever setup got to start, stop it
        finally:
            kernel.close()
        raise
    return kernel


def _stop_kernel(kernel: Any, teardown: str) -> None:
    try:
        kernel.ok(teardown, timeout=120)
    finally:
        kernel.close()


@contextmanager
def meshbook_kernel(n: int) -> Iterator[dict[str, Sample]]:
    """Samples ``local`` and ``%%mesh`` from a kernel with an ``n``-rank mesh."""
    setup, teardown = f"%load_ext meshbook\n%mesh start -n {n}", "%mesh stop"
    with reaped(f"meshbook kernel with {n} ranks", lambda: _start_kernel(setup, teardown),
                lambda k: _stop_kernel(k, teardown)) as kernel:
        yield {"local": cell(kernel, "pass"), "%%mesh": cell(kernel, "%%mesh\npass")}


@contextmanager
def ipyparallel_kernel(n: int) -> Iterator[dict[str, Sample]]:
    """Samples ``local`` and ``%%px`` from a kernel with an ``n``-engine cluster."""
    setup = ("import logging, ipyparallel\n"
             f"cluster = ipyparallel.Cluster(n={n}, log_level=logging.ERROR)\n"
             "rc = cluster.start_and_connect_sync(activate=True)\n"
             f"rc.wait_for_engines({n}, timeout=600)")
    teardown = "rc.close()\ncluster.stop_cluster_sync()"
    with reaped(f"ipyparallel kernel with {n} engines", lambda: _start_kernel(setup, teardown),
                lambda k: _stop_kernel(k, teardown)) as kernel:
        yield {"local": cell(kernel, "pass"), "%%px": cell(kernel, "%%px\npass")}
