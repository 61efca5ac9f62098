"""How many GPUs this host's ranks will see, counted in a short-lived subprocess.

The agent forks every rank, so it must never touch CUDA: a process that initialised CUDA
cannot hand a usable CUDA to its forks ("Cannot re-initialize CUDA in forked subprocess"), and
torch's NVML-based count, the one way to count without initialising CUDA, leaves NVML's handles
open in the agent, which every rank inherits and then closes among its stray descriptors. NVML
also cannot answer for MIG devices in ``CUDA_VISIBLE_DEVICES``, and torch then falls back to
``cudaGetDeviceCount``, initialising CUDA. So the count runs in a child process that exits
(started as soon as the agent starts, beside its own torch import: it costs no wall time), with
the environment the ranks will have. A CPU-only build of torch cannot see a GPU: no child then.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

#: What the child runs: torch's own count (CUDA_VISIBLE_DEVICES, MIG and all).
_COUNT = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


class GpuCount:
    """A count under way (:meth:`result` waits for it)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        if _gpu_build():
            self._proc = subprocess.Popen([sys.executable, "-c", _COUNT], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float = 120.0) -> int:
        """The number of GPUs, or 0 if there are none or the count failed (it says why on stderr)."""
        if self._proc is None:
            return 0
        try:
            out, err = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            print(f"meshbook agent: counting GPUs took over {timeout:g} s; running without them",
                  file=sys.stderr, flush=True)
            return 0
        if self._proc.returncode != 0 or not out.strip().isdigit():
            print(f"meshbook agent: could not count GPUs ({err.strip()[-500:]}); running without them",
                  file=sys.stderr, flush=True)
            return 0
        return int(out.strip())


def _gpu_build() -> bool:
    """Does the installed torch have a GPU runtime (CUDA or ROCm)? Read from its files, so
    that nothing is imported."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    return any(os.path.exists(os.path.join(lib, name)) for name in ("libtorch_cuda.so", "libtorch_hip.so"))
