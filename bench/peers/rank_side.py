"""What the peers' rank processes run: small functions every system calls the same way.

Kept free of heavy imports (torch is imported inside the functions that need it), because
each system's ranks import this module by name, and a rank that only answers no-ops should
not pay for importing torch.
"""

from __future__ import annotations

import os
from typing import Any

#: Tensors a rank was sent by ``keep`` (a rank's stand-in for a namespace variable).
_kept: dict[str, Any] = {}


def noop() -> None:
    return None


def pid() -> int:
    return os.getpid()


def keep(tensor: Any) -> None:
    _kept["t"] = tensor


def kept() -> Any:
    return _kept["t"]


def init_gloo(rank: int, world_size: int, port: int) -> int:
    """Join a gloo process group on this host (what meshbook's ranks have from the start)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    return rank
