"""What a script written for torchrun expects to find on its rank, so it runs pasted as it is.

A torchrun script reads its place from the environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ...), calls ``init_process_group()`` at the top, ``destroy_process_group()``
at the end, and relies on every process starting with its own random state. On a mesh the
process group already exists and must outlive the script: the objects built on it (DDP and
FSDP modules, DTensors) are what the next cells work with. So, on each rank:

* :func:`environment` gives the variables torchrun sets (kept right after a rank restarts or
  the group is re-created, where ``MASTER_PORT`` changes);
* :func:`install` makes ``init_process_group`` a no-op that says once that the mesh owns the
  group (and fails clearly if the script asks for a backend the mesh does not run); its
  ``timeout=`` still bounds the group's collectives, as under torchrun (a script that asks for
  30 s expects a hang to fail in 30 s, not in the mesh's 5 minutes), until the group is
  re-created. It makes
  ``destroy_process_group`` of the default group keep it, saying so: destroying it would leave
  every model in the namespace bound to a dead group. Subgroups are destroyed as asked;
* :func:`reseed` gives a forked rank fresh random state, as a new process would have.
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING, Any, Callable

from . import torch_compat

if TYPE_CHECKING:
    from .context import RankContext

GroupOp = Callable[..., Any]


def environment(rank: int, world_size: int, local_rank: int, local_world_size: int,
                group_rank: int, group_world_size: int, master: tuple[str, int]) -> dict[str, str]:
    """The variables torchrun sets for a worker process."""
    values = {
        "RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_world_size, "GROUP_RANK": group_rank,
        "GROUP_WORLD_SIZE": group_world_size, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": "default", "MASTER_ADDR": master[0], "MASTER_PORT": master[1],
        "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
        "TORCHELASTIC_RUN_ID": "meshbook", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    return {name: str(value) for name, value in values.items()}


def install(worker: "RankContext") -> tuple[GroupOp, GroupOp]:
    """Replace ``init_process_group``/``destroy_process_group`` in ``torch.distributed`` for
    user code; returns the originals, which meshbook itself keeps using."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    real_init, real_destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the mesh's process group is gone; %mesh restart (mesh.restart(...)) "
                               "re-creates it")
        _check_backend(backend, dist.get_backend())
        _check_place(world_size, rank, dist.get_world_size(), dist.get_rank())
        worker.note_once("init", f"meshbook: the mesh already initialised the process group "
                                 f"({dist.get_backend()}, world size {dist.get_world_size()}); "
                                 f"init_process_group() does nothing here")
        if timeout is not None:
            _set_timeout(worker, timeout)

    def destroy_process_group(group: Any = None) -> None:
        if group is not None and group is not c10d.GroupMember.WORLD:
            real_destroy(group)
            return
        worker.note_once("destroy", "meshbook: destroy_process_group() keeps the mesh's process "
                                    "group, so the next cells can go on using what was built on it "
                                    "(DDP/FSDP modules, DTensors); %mesh restart gives a fresh one")

    for module in (dist, c10d):  # both names: code may have imported either
        setattr(module, "init_process_group", init_process_group)
        setattr(module, "destroy_process_group", destroy_process_group)
    return real_init, real_destroy


def _check_backend(asked: Any, running: str) -> None:
    """``asked`` must name only backends the mesh's group runs (``nccl`` on a CPU mesh: no)."""
    if asked is None:
        return
    have = {part.split(":")[-1].strip().lower() for part in str(running).split(",")}
    want = {part.split(":")[-1].strip().lower() for part in str(asked).split(",") if part.strip()}
    if not want <= have:
        raise RuntimeError(
            f"init_process_group(backend={str(asked)!r}): this mesh's process group runs {running}. "
            f"Start the mesh with that backend (%mesh start --backend {asked}; nccl needs GPUs), "
            f"or leave the backend out")


def _set_timeout(worker: "RankContext", timeout: Any) -> None:
    """Bound the mesh's group's collectives by ``timeout``, as the script asked."""
    from datetime import timedelta

    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise TypeError(f"init_process_group(timeout={timeout!r}): give a datetime.timedelta above zero, "
                        f"e.g. timedelta(seconds=30)")
    torch_compat.set_default_group_timeout(timeout)
    worker.note_once("timeout", f"meshbook: collectives of the mesh's process group now time out after "
                                f"{timeout.total_seconds():g} s, until the group is re-created "
                                f"(%mesh start --collective-timeout sets it for the whole mesh)")


def _check_place(world_size: int, rank: int, mesh_world: int, mesh_rank: int) -> None:
    if world_size not in (-1, None, mesh_world) or rank not in (-1, None, mesh_rank):
        raise RuntimeError(
            f"init_process_group(world_size={world_size}, rank={rank}): this rank is rank {mesh_rank} "
            f"of a mesh of {mesh_world}; read RANK and WORLD_SIZE from os.environ as under torchrun")


def reseed() -> None:
    """Fresh random state for a forked rank: Python's, numpy's and torch's (all devices)."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
