"""When this rank enters and leaves each collective, exactly: the clock behind the computing /
waiting split and the straggler verdict.

Sampling the main thread a few times a second cannot split an 8 s cell exactly (one run read
"0.00 s computing" for ranks that each slept 2 s). So ``torch.distributed``'s collectives are
wrapped, thinly: each call of the main thread records its group, its number in that group (the
n-th collective a rank issues in a group pairs with every member's n-th), when it was entered
and, for a blocking call, when it returned (wall-clock nanoseconds: the controller lines ranks
up by them, correcting other hosts' clocks). A nested call (``all_gather_object`` calls
``all_gather``) counts once, as the call the user made.

The controller (:mod:`meshbook.mesh.controller.insight.clock`) pairs each collective's entries across
its members: a rank's waiting is its time inside blocking calls, and its *lateness* is how long
after the group's first member it arrived; the rank that keeps arriving last is the straggler.
An async call (``async_op=True``) has no end here (its ``wait()`` runs in C): its waiting is
counted as the time from its entry to the last member's. So is an NCCL collective on GPU
tensors: it returns as soon as it is enqueued, and the rank waits for it later, in a sync; its
arrival (when the rank's Python enqueued it) is what lines the ranks up.

What is not wrapped is not timed: collectives issued from C++ (DDP's gradient all-reduce in
``backward()``) and the functional collectives DTensor uses. For those the sampler
(:mod:`.sampling`) remains the evidence.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

#: The collectives timed (point-to-point ``send``/``recv`` pair two ranks, not a group).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "gather", "scatter", "gather_object",
               "scatter_object_list", "monitored_barrier", "all_reduce_coalesced")

#: One record: (request, group key, number in its group, entered, left or 0 for an async call).
Entry = tuple[int | None, int, int, int, int]


class CollectiveClock:
    """This rank's record of its collectives, taken in batches for the controller.

    ``request`` says what the main thread runs. :meth:`take` hands over what was recorded
    since it was last called (with the groups met meanwhile), from any thread.
    """

    def __init__(self, request: Callable[[], int | None], enqueues_gpu_work: bool = False) -> None:
        self._request = request
        #: An NCCL mesh: a collective on GPU tensors returns once enqueued (see above).
        self._enqueues = enqueues_gpu_work
        self._main = threading.main_thread().ident
        #: Outermost collective calls the main thread has entered, and the number of the one
        #: it is in now (``None`` outside; a nested call counts as the outer one): how the
        #: sampler tells one call from the next.
        self._entered = 0
        self.call: int | None = None
        self._generation = 0
        self._groups: dict[int, tuple[Any, int]] = {}  # id(group) -> (group, key): kept alive
        self._counts: list[int] = []  # per key: collectives issued so far
        self._entries: list[Entry] = []
        self._new_keys: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        #: The wrappers' code objects: the sampler walks through them (see sampling.py).
        self.codes: set[Any] = set()

    def install(self) -> None:
        """Wrap the collectives of ``torch.distributed`` (and of ``distributed_c10d``, where
        torch's own modules call them)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            timed = self.wrap(fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, timed)

    def new_generation(self, generation: int) -> None:
        """The process groups were re-created: numbering starts again in the new ones."""
        self._generation = generation
        self._groups = {}

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call: ``{"keys": {key: (generation, group name,
        members)}, "entries": [Entry...]}``, or None if nothing was."""
        entries, self._entries = self._entries, []
        keys, self._new_keys = self._new_keys, {}
        if not entries and not keys:
            return None
        return {"keys": keys, "entries": entries}

    # -- recording (main thread) -------------------------------------------------------------

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, a collective of ``torch.distributed``, timed when the main thread calls it."""
        params = list(inspect.signature(fn).parameters)
        group_at = params.index("group") if "group" in params else None
        async_at = params.index("async_op") if "async_op" in params else None

        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.call is not None or threading.get_ident() != self._main:
                return fn(*args, **kwargs)
            waits = not _argument(args, kwargs, "async_op", async_at) and not (self._enqueues and _on_gpu(args))
            # Numbered first: a SIGINT that came during the call is raised once it returns, maybe
            # in the finally below; the call counts all the same, or the next pairs with the
            # members' one after it. Its entry is what such an interrupt may lose.
            number = self._number(_argument(args, kwargs, "group", group_at))
            self._entered += 1
            entered = time.time_ns()
            try:  # set inside: an interrupt can never leave the clock thinking it is in a call
                self.call = self._entered
                return fn(*args, **kwargs)
            finally:
                self.call = None
                if number is not None:
                    self._entries.append((self._request(), *number, entered, time.time_ns() if waits else 0))

        self.codes.add(collective.__code__)
        return functools.wraps(fn)(collective)

    def _number(self, group: Any) -> tuple[int, int] | None:
        """The key of ``group`` and this call's number in it; None for a group torch does not know."""
        try:
            key = self._key(group)
        except Exception:  # noqa: BLE001 - a group torch does not know: leave it untimed
            return None
        self._counts[key] += 1
        return key, self._counts[key]

    def _key(self, group: Any) -> int:
        import torch.distributed as dist

        from .torch_compat import group_name

        pg = group if group is not None else dist.group.WORLD
        found = self._groups.get(id(pg))
        if found is not None and found[0] is pg:
            return found[1]
        key = len(self._counts)
        self._counts.append(0)
        self._groups[id(pg)] = (pg, key)
        self._new_keys[key] = (self._generation, group_name(pg), tuple(dist.get_process_group_ranks(pg)))
        return key


def _on_gpu(args: tuple[Any, ...]) -> bool:
    """Is the call's first argument a GPU tensor (or a list of them)?"""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return bool(getattr(first, "is_cuda", False))


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and len(args) > at else None
