"""What the numbers were taken on: machine, versions, date, and how busy the machine was.

:class:`CpuShare` tells a quiet machine from a shared one by measurement rather than by
guess: over the run it compares the CPU time the whole machine spent busy with the CPU time
this harness and the processes it started spent, and attributes the rest to others.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import psutil

#: Other processes using more than this share of the machine make the run "loaded".
LOADED_SHARE = 0.10

_ROOT = Path(__file__).resolve().parents[1]


def versions() -> dict[str, str]:
    out = {"Python": platform.python_version()}
    for dist in ("torch", "meshbook", "ipyparallel", "torchmonarch", "pyzmq", "ipykernel"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--", "meshbook") else ""
        out["meshbook"] += f" at {commit}{dirty}"
    return out


def machine() -> str:
    cpu = platform.processor() or _cpu_model()
    memory = psutil.virtual_memory().total / 2**30
    return (f"{cpu}, {os.cpu_count()} logical cores, {memory:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}")


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class CpuShare:
    """CPU use of the machine over a span, split into this harness and everyone else."""

    def __init__(self) -> None:
        self._machine = _busy()
        self._ours = _ours()
        self._wall = time.monotonic()

    def describe(self) -> tuple[str, bool]:
        """A sentence for the report, and whether other processes loaded the machine."""
        span = max(time.monotonic() - self._wall, 1e-9)
        cores = os.cpu_count() or 1
        machine = (_busy() - self._machine) / (span * cores)
        ours = (_ours() - self._ours) / (span * cores)
        others = max(0.0, machine - ours)
        loaded = others > LOADED_SHARE
        text = (f"The machine's {cores} cores were {machine:.0%} busy during the run: about "
                f"{ours:.0%} for this harness and the processes it started, {others:.0%} for "
                f"other processes.")
        if loaded:
            text += (" **The numbers were taken on a loaded machine** (other work shared the "
                     "cores), so absolute values are noisy; ratios within a table, measured in "
                     "the same minutes, are the meaningful part.")
        return text, loaded


def _busy() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.nice + times.system + getattr(times, "irq", 0.0)
                 + getattr(times, "softirq", 0.0))


def _ours() -> float:
    """CPU seconds of this process, its live descendants, and the children it has reaped
    (a reaped child carries the time of the grandchildren it reaped in turn)."""
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    for proc in psutil.Process().children(recursive=True):
        try:
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            continue
    return total


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
