"""Resident variables and data movement: who, ref, push, pull, scatter, on real ranks (gloo)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import resource
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import meshbook
from meshbook import (
    MeshError,
    MissingNameError,
    RemoteError,
    SelectionError,
    SendError,
    ShapeError,
    TooLargeError,
)
from meshbook.mesh.protocol.namespaces import Layout, Namespaces, VarInfo
from meshbook.mesh.protocol.payload import (
    SHARE_MIN,
    FreeFiles,
    Landing,
    Lent,
    Payload,
    Segments,
    Slot,
    WriterExited,
    pack,
    pickled,
    pickled_for_pull,
)
from meshbook.mesh.protocol.text import format_ranks
from meshbook.mesh.rank import ops

DTENSOR_SETUP = """
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
g = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
w = distribute_tensor(g, device_mesh, [Shard(0), Replicate()])
"""


@pytest.fixture(scope="module")
def dtensors(mesh4: meshbook.Mesh) -> meshbook.Mesh:
    mesh4.run(DTENSOR_SETUP).result()
    return mesh4


def test_who_describes_a_dtensor_on_every_rank(dtensors: meshbook.Mesh) -> None:
    ns = dtensors.who()
    assert ns.ranks == [0, 1, 2, 3]
    for rank, info in ns["w"].items():
        assert (info.type, info.shape, info.dtype, info.device) == ("DTensor", (8, 6), "float32", "cpu")
        assert info.layout.mesh_dims == ("dp", "tp")
        assert info.layout.placements == (("Shard", 0), ("Replicate", None))
        assert info.layout.local_shape == (4, 6), rank
        assert info.layout.mesh_ranks == (0, 1, 2, 3)
        assert info.nbytes == 4 * 6 * 4  # the local shard, not the global tensor
    plain = ns["g"][2]
    assert (plain.type, plain.shape, plain.nbytes, plain.layout) == ("Tensor", (8, 6), 192, None)
    assert "torch" not in ns and "device_mesh" not in ns and "DTensor" not in ns
    row = next(line for line in repr(ns).splitlines() if line.startswith("w "))
    assert "dp:Shard(0) tp:Replicate()" in row and "(4, 6)" in row and row.endswith("0-3")


def test_who_collapses_identical_rows_and_totals_per_rank(mesh4: meshbook.Mesh) -> None:
    mesh4.run("model = torch.nn.Linear(4, 3)\nv = torch.zeros(rank + 1)\nsteps = 10").result()
    ns = mesh4.who()
    model = ns["model"][0]
    assert (model.type, model.params, model.nbytes, model.dtype) == ("Linear", 15, 60, "float32")
    text = repr(ns)
    rows = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert rows["model"].endswith("0-3") and "15" in rows["model"]
    assert rows["steps"].split()[1:] == ["int", "0-3"]
    v_rows = [line for line in text.splitlines() if line.startswith("v ")]
    assert len(v_rows) == 4, "a row per distinct shape, identical ones collapsed"
    assert [ns["v"][r].shape for r in range(4)] == [(1,), (2,), (3,), (4,)]
    assert mesh4.who(where={"dp": 1}).ranks == [2, 3]


def test_who_counts_memory_held_under_two_names_once(mesh2: meshbook.Mesh) -> None:
    mesh2.run("a = torch.ones(1000)\nb = a\nview = a[:10]\nbatch = [a, torch.zeros(5)]\n"
              "model = torch.nn.Linear(100, 100)\nsharded_model = model\n"
              "wrapped = torch.nn.Sequential(model)\nx = 1\ny = 1").result()
    ns = mesh2.who()
    rows = {line.split()[0]: line for line in repr(ns).splitlines()[1:-1]}
    assert "same as a" in rows["b"] and "memory of a" in rows["view"]
    assert "same as model" in rows["sharded_model"] and "memory of model" in rows["wrapped"]
    assert "same as" not in rows["y"], "small ints are shared objects, not shared memory"
    model_bytes = (100 * 100 + 100) * 4
    assert dict(ns.totals()) == {0: 4000 + 5 * 4 + model_bytes, 1: 4000 + 5 * 4 + model_bytes}
    assert ns["b"][0].nbytes == 4000, "the row keeps its own size for pull limits"


def test_who_counts_an_optimizers_state(mesh2: meshbook.Mesh) -> None:
    """Adam's two moments are twice the model: a rank's total without them misleads."""
    mesh2.run("net = torch.nn.Linear(64, 64)\nadam = torch.optim.Adam(net.parameters())\n"
              "net(torch.ones(2, 64)).sum().backward()\nadam.step()").result()
    ns = mesh2.who()
    params = (64 * 64 + 64) * 4
    assert ns["adam"][0].nbytes == 2 * params + 2 * 4, "two moments and a step count per parameter"
    assert (ns["adam"][0].type, ns["adam"][0].dtype, ns["adam"][0].device) == ("Adam", "float32", "cpu")
    mesh2.run("half = torch.nn.Linear(8, 8).to(torch.bfloat16)\nopt = torch.optim.AdamW(half.parameters())\n"
              "half(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()\nopt.step()").result()
    assert mesh2.who()["opt"][0].dtype == "bfloat16", "its step count (a float32 scalar) aside"
    mesh2.run("del net, adam, half, opt").result()


def test_the_who_table_groups_ranks_and_totals_each_rank() -> None:
    layout = Layout(("dp", "tp"), (2, 1), (0, 1), (("Shard", 0), ("Replicate", None)), (2, 3))
    w = VarInfo("w", "DTensor", (4, 3), "bfloat16", "cpu", 12, layout=layout)
    ns = Namespaces({0: {"w": w, "n": VarInfo("n", "int")},
                     1: {"w": w, "n": VarInfo("n", "int"), "big": VarInfo("big", "Tensor", (3 << 20,),
                                                                            "int8", "cpu", 3 << 20)}},
                    lost={1: ("old",)})
    pad = " " * 38
    assert repr(ns).splitlines() == [
        "name  type                   shape       dtype     device  bytes    placements" + " " * 18
        + "local   ranks",
        "big   Tensor                 (3145728,)  int8      cpu     3.0 MiB" + pad + "1",
        "n     int" + " " * 95 + "0,1",
        "old   lost (rank restarted)" + " " * 77 + "1",
        ("w     DTensor                (4, 3)      bfloat16  cpu     12 B     "
         "dp:Shard(0) tp:Replicate()  (2, 3)  0,1"),
        "total per rank: [0] 12 B  [1] 3.0 MiB",
        ("rank(s) 1 were restarted: their variables marked lost are gone; run the cells that "
         "made them again, or push them"),
    ]


def test_who_answers_while_a_rank_is_busy(mesh4: meshbook.Mesh) -> None:
    mesh4.run("busy_marker = 1").result()
    run = mesh4.run("import time; time.sleep(3)", ranks=[0])
    try:
        assert "busy_marker" in mesh4.who(ranks=[0])
        assert not run.done(), "who() waited for the busy rank"
    finally:
        run.result()


def test_ref_repr_shows_metadata_without_data(dtensors: meshbook.Mesh) -> None:
    ref = dtensors.ref("w")
    assert repr(ref) == ("<RemoteRef 'w' on ranks 0-3: DTensor (8, 6) float32 cpu, 96 B, "
                         "dp:Shard(0) tp:Replicate(), local (4, 6)>")
    dtensors.run("u = torch.ones(rank % 2 + 1)").result()
    assert repr(dtensors.ref("u")) == ("<RemoteRef 'u':\n  [0,2] Tensor (1,) float32 cpu, 4 B\n"
                                       "  [1,3] Tensor (2,) float32 cpu, 8 B\n>")


@pytest.mark.parametrize("placements", [
    "[Shard(0), Replicate()]",
    "[Replicate(), Shard(1)]",
    "[Shard(0), Shard(1)]",
    "[Shard(1), Shard(1)]",  # both mesh dims split the same tensor dim
    "[Shard(0), Shard(0)]",
])
@pytest.mark.parametrize("shape", ["(8, 6)", "(7, 5)"])  # even, and uneven shards
def test_full_tensor_equals_the_original(dtensors: meshbook.Mesh, placements: str, shape: str) -> None:
    dtensors.run(f"orig = torch.randn({shape}, generator=torch.Generator().manual_seed(7))\n"
                 f"dt = distribute_tensor(orig, device_mesh, {placements})").result()
    original = dtensors.pull("orig", ranks=[0])[0]
    assert torch.equal(dtensors.ref("dt").full_tensor(), original)


@pytest.mark.parametrize("shape", ["(8, 6)", "(16, 3)"])  # torch distributes no uneven strided shard
def test_full_tensor_of_fsdp2_over_tensor_parallel(dtensors: meshbook.Mesh, shape: str) -> None:
    """FSDP2 sharding a tensor-parallel parameter on the same dimension: dp:_StridedShard(dim=0,
    sf=2) tp:Shard(0), the README's 2-D layout (it was refused as not supported)."""
    dtensors.run("from torch.distributed.tensor.placement_types import _StridedShard\n"
                 f"orig = torch.randn({shape}, generator=torch.Generator().manual_seed(7))\n"
                 "strided = distribute_tensor(orig, device_mesh, [_StridedShard(0, split_factor=2), Shard(0)])\n"
                 "whole = strided.full_tensor()").result()
    assert torch.equal(dtensors.ref("strided").full_tensor(), dtensors.pull("whole", ranks=[0])[0])
    assert torch.equal(dtensors.pull("whole", ranks=[0])[0], dtensors.pull("orig", ranks=[0])[0])


def test_full_tensor_reduces_partial_placements(dtensors: meshbook.Mesh) -> None:
    dtensors.run("part = DTensor.from_local(torch.full((2, 3), float(rank)), device_mesh,"
                 " [Partial(), Shard(1)], run_check=False)").result()
    local = torch.full((2, 3), 0.0)
    expected = torch.cat([local + 0 + 2, local + 1 + 3], dim=1)  # sum over dp, tp shards dim 1
    assert torch.equal(dtensors.ref("part").full_tensor(), expected)


def test_full_tensor_on_a_sub_mesh_needs_one_mesh(dtensors: meshbook.Mesh) -> None:
    dtensors.run("sub = distribute_tensor(torch.arange(4.0) + 10 * coords['dp'],"
                 " device_mesh['tp'], [Shard(0)])").result()
    with pytest.raises(ShapeError, match="2 different DeviceMeshes.*'0,1' or '2,3'"):
        dtensors.ref("sub").full_tensor()
    assert torch.equal(dtensors.ref("sub", ranks="2,3").full_tensor(), torch.arange(4.0) + 10)
    with pytest.raises(SelectionError, match="needs rank\\(s\\) 1 of its DeviceMesh"):
        dtensors.ref("sub", ranks=[0]).full_tensor()


def test_pull_of_a_dtensor_gives_local_shards(dtensors: meshbook.Mesh) -> None:
    with pytest.warns(UserWarning, match=r"'w' is a DTensor: each rank's value is its local shard"):
        shards = dtensors.pull("w")
    assert torch.equal(shards[0], shards[1])
    assert torch.equal(shards[2], torch.arange(24.0, 48).reshape(4, 6))


def bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.view(torch.uint8).numpy().tobytes()


CASES = {
    "float32": lambda n: torch.randn(n),
    "bfloat16": lambda n: torch.randn(n).to(torch.bfloat16),
    "int64": lambda n: torch.randint(-2**62, 2**62, (n,), dtype=torch.int64),
    "non-contiguous": lambda n: torch.randn(n // 4, 8)[:, ::2].t(),
    "zero-size": lambda n: torch.zeros(0, 5),
}


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("elements", [16, SHARE_MIN // 2], ids=["frames", "shared-memory"])
def test_push_pull_roundtrip_is_bit_exact(mesh4: meshbook.Mesh, kind: str, elements: int) -> None:
    value = CASES[kind](elements)
    mesh4.push(value=value)
    for rank, back in mesh4.pull("value").items():
        assert back.dtype == value.dtype and back.shape == value.shape, rank
        assert bytes_of(back) == bytes_of(value.contiguous()), rank


def test_push_many_values_and_containers(mesh4: meshbook.Mesh) -> None:
    state = {"w": torch.randn(SHARE_MIN), "b": [torch.ones(3), 2.5], "name": "layer"}
    mesh4.push({"ranks_seen": [0, 1]}, state=state, lr=0.1, ranks="1-2")
    got = mesh4.run("(state['name'], state['b'][1], lr, ranks_seen, state['w'].sum().item())",
                    ranks=[1, 2]).result()
    # float32 sums of many elements differ in the last bits with the number of threads summing:
    # about 1e-4 of a million normal draws, whose sum may itself be near 0 (relative alone failed)
    assert got.unique() == ("layer", 2.5, 0.1, [0, 1], pytest.approx(state["w"].sum().item(), rel=1e-4, abs=1e-2))
    assert "lr" not in mesh4.who(ranks=[0, 3])


def test_pushed_tensor_is_private_to_each_rank(mesh4: meshbook.Mesh) -> None:
    big = torch.zeros(SHARE_MIN)  # 4 MiB: goes through shared memory
    mesh4.push(shared=big)
    mesh4.run("shared.add_(rank)").result()  # every rank writes its own copy
    sums = mesh4.run("shared.sum().item()").result()
    assert dict(sums) == {r: float(r * SHARE_MIN) for r in range(4)}
    assert big.sum().item() == 0.0


def test_a_push_whose_shared_memory_is_gone_fails_clearly() -> None:
    with pack({"t": torch.ones(SHARE_MIN)}, shared=True) as payload:
        assert payload.shared is not None and torch.equal(payload.load()["t"], torch.ones(SHARE_MIN))
    with pytest.raises(RuntimeError, match="shared memory for this push is gone"):
        payload.load()  # closed: what a rank meets after the push was interrupted
    number = payload.shared.fd
    other = os.open(__file__, os.O_RDONLY)  # the number now names another file of this process
    try:
        if other != number:
            with pytest.raises(OSError):
                os.fstat(number)  # still free: never put a file over one in use
            os.dup2(other, number)
        with pytest.raises(RuntimeError, match="shared memory for this push is gone"):
            payload.load()
    finally:
        os.close(other)
        if other != number:
            os.close(number)


def lent_files(pid: int) -> list[str]:
    """The shared-memory files of pulls process ``pid`` holds open."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:meshbook-pull"):
                found.append(fd)
    return found


def test_a_pull_from_local_ranks_maps_their_shared_memory(mesh4: meshbook.Mesh) -> None:
    mesh4.run(f"lent = torch.arange({SHARE_MIN}, dtype=torch.float32) + rank").result()
    pulled = mesh4.pull("lent")
    for rank, value in pulled.items():
        assert torch.equal(value, torch.arange(SHARE_MIN, dtype=torch.float32) + rank), rank
    assert "/memfd:meshbook-pull" in Path("/proc/self/maps").read_text(), "mapped, not received through a socket"
    pulled[0].add_(1)  # copy-on-write: the notebook's copy is its own
    assert mesh4.run("lent[0].item()", ranks=[0]).result()[0] == 0.0
    pids = [state.pid for state in mesh4.status()]
    deadline = time.monotonic() + 30
    while any(lent_files(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(lent_files(pid) for pid in pids), "each rank closes its file once the notebook mapped it"
    del pulled, value
    gc.collect()
    assert "/memfd:meshbook-pull" not in Path("/proc/self/maps").read_text(), "the mapping goes with the tensors"


def test_a_push_behind_earlier_work_says_what_it_waits_for(mesh2: meshbook.Mesh,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    earlier = mesh2.run("import time\ntime.sleep(3)", ranks=[1])  # a cell that outlived its wait
    mesh2.push(lr=0.5)
    assert ("rank(s) 1 still run run('import time'): the push is stored there once that ends "
            "(mesh.interrupt('1') stops it; Ctrl-C drops the push instead)") in capsys.readouterr().err
    assert earlier.done() and dict(mesh2.run("lr").result()) == {0: 0.5, 1: 0.5}


def test_a_small_tensor_kept_does_not_keep_its_push_or_pull_mapped(mesh2: meshbook.Mesh) -> None:
    mesh2.push({"big": torch.ones(SHARE_MIN), "small": torch.arange(3.0)})
    mapped = "'/memfd:meshbook-push' in open('/proc/self/maps').read()"
    assert all(mesh2.run(mapped).result().values()), "the push came through shared memory"
    after = mesh2.run(f"del big; import gc; gc.collect(); small.add_(rank); {mapped}").result()
    assert not any(after.values()), "the small tensor was copied out: the file went with the big one"
    assert mesh2.run("small.tolist()").result() == {0: [0.0, 1.0, 2.0], 1: [1.0, 2.0, 3.0]}
    mesh2.run(f"both = {{'big': torch.ones({SHARE_MIN}), 'small': torch.arange(3.0) + rank}}").result()
    pulled = mesh2.pull("both")
    assert "/memfd:meshbook-pull" in Path("/proc/self/maps").read_text(), "the pull came through shared memory"
    small = {rank: value["small"] for rank, value in pulled.items()}
    del pulled
    gc.collect()
    assert "/memfd:meshbook-pull" not in Path("/proc/self/maps").read_text(), "nothing maps the files now"
    assert {rank: t.tolist() for rank, t in small.items()} == {0: [0.0, 1.0, 2.0], 1: [1.0, 2.0, 3.0]}


def lend(lent: Lent, value: object, slot: Slot | None = None) -> Payload:
    """``value`` lent as a rank's ``fetch`` lends it."""
    return lent.lend(*pickled_for_pull("x", value, None), slot)


def test_a_lent_file_nobody_claims_is_closed_by_the_next_lend_or_tick() -> None:
    before = set(lent_files(os.getpid()))  # files a mesh of this process keeps for later pulls
    lent = Lent(keep_s=0.0)
    first = lend(lent, torch.ones(SHARE_MIN))
    assert first.shared is not None and torch.equal(first.load("pull")["value"], torch.ones(SHARE_MIN))
    time.sleep(0.01)
    second = lend(lent, torch.zeros(SHARE_MIN))  # the first pull was interrupted
    with pytest.raises(RuntimeError, match="shared memory for this pull is gone"):
        first.load("pull")
    assert second.shared is not None and set(lent_files(os.getpid())) - before == {str(second.shared.fd)}
    lent.release(second.shared.token)
    assert set(lent_files(os.getpid())) - before == set()
    assert lend(lent, 7).shared is None, "a small value goes inline"
    lend(lent, torch.ones(SHARE_MIN))  # never claimed, and no pull comes after it
    time.sleep(0.01)
    lent.expire(time.monotonic())  # the rank's control loop, a tick later
    assert set(lent_files(os.getpid())) - before == set()


def pull_files(pid: int) -> set[int]:
    """The inodes of the pulls' shared-memory files process ``pid`` holds open."""
    return {os.stat(f"/proc/{pid}/fd/{fd}").st_ino for fd in lent_files(pid)}


def test_a_later_pull_writes_over_the_files_of_values_nothing_maps_any_more(mesh4: meshbook.Mesh) -> None:
    landing = mesh4.controller.landing
    gc.collect()
    landing.expire(time.monotonic() + landing.idle_s + 1)  # what earlier tests pulled: closed
    before = pull_files(os.getpid())
    idle, landing.idle_s = landing.idle_s, 600.0  # a slow machine's pulls must not see them expire
    try:
        pull_three_times(mesh4, before)
    finally:
        landing.idle_s = idle


def pull_three_times(mesh4: meshbook.Mesh, before: set[int]) -> None:
    landing = mesh4.controller.landing
    mesh4.run(f"landed = torch.full(({SHARE_MIN},), float(rank))").result()
    kept = mesh4.pull("landed")  # still held below: its files must never be written over
    mesh4.run("landed += 10").result()
    dropped = mesh4.pull("landed")
    first_files = pull_files(os.getpid()) - before
    assert len(first_files) == 8, "the notebook keeps the file of every value it maps"
    del dropped
    gc.collect()  # nothing maps the second pull's files now: the third writes over them
    mesh4.run("landed += 10").result()
    third = mesh4.pull("landed")
    assert pull_files(os.getpid()) - before == first_files, "no new file: the freed ones were written over"
    for rank in range(4):
        assert torch.equal(kept[rank], torch.full((SHARE_MIN,), float(rank))), "a value held is never overwritten"
        assert torch.equal(third[rank], torch.full((SHARE_MIN,), rank + 20.0))
    pids = [state.pid for state in mesh4.status()]
    assert not any(lent_files(pid) for pid in pids), "a rank that wrote into the notebook's file lent none"
    del kept, third
    gc.collect()
    landing.expire(time.monotonic() + landing.idle_s + 1)
    assert pull_files(os.getpid()) - before == set(), "a file nothing maps is closed once idle"


def test_the_landing_offers_fitting_files_and_closes_what_an_interrupted_pull_offered() -> None:
    landing, lent = Landing(idle_s=60.0), Lent()  # SHARE_MIN bytes: float32 of a quarter as many
    try:
        value = landing.load(lend(lent, torch.ones(SHARE_MIN // 4)), "pull")["value"]
        assert torch.equal(value, torch.ones(SHARE_MIN // 4))
        assert landing.offer({0: SHARE_MIN}) == {}, "the file is mapped: nothing to offer"
        del value
        gc.collect()
        assert landing.offer({0: 8 * SHARE_MIN}) == {}, "too small for this value"
        assert landing.offer({0: SHARE_MIN // 4}) == {}, "below the size worth sharing"
        slots = landing.offer({0: SHARE_MIN, 1: SHARE_MIN})
        assert list(slots) == [0], "one free file, offered once"
        files = set(lent_files(os.getpid()))
        landed = lend(lent, torch.zeros(SHARE_MIN // 4), slots[0])
        assert landed.shared is not None and landed.shared.fd == slots[0].fd
        assert set(lent_files(os.getpid())) == files, "written into the offered file: no new one lent"
        assert torch.equal(landing.load(landed, "pull")["value"], torch.zeros(SHARE_MIN // 4))
        landing.settle(slots, True)
        gc.collect()
        slots = landing.offer({0: SHARE_MIN})
        landing.settle(slots, False)  # an interrupted pull: its rank may still write
        with pytest.raises(OSError):
            os.fstat(slots[0].fd)
        assert landing.offer({0: SHARE_MIN}) == {}
    finally:
        landing.close()
        lent.expire(time.monotonic() + lent.keep_s + 1)


def test_the_landing_keeps_no_more_files_than_it_may() -> None:
    landing, lent = Landing(keep=2), Lent()
    try:
        before = set(lent_files(os.getpid()))
        payloads = [lend(lent, torch.full((SHARE_MIN // 4,), float(i))) for i in range(3)]
        values = [landing.load(payload, "pull")["value"] for payload in payloads]
        assert [v[0].item() for v in values] == [0.0, 1.0, 2.0], "every value arrives"
        for payload in payloads:
            assert payload.shared is not None
            lent.release(payload.shared.token)
        del values
        gc.collect()
        assert len(set(lent_files(os.getpid())) - before) == 2, "the third file went with its mapping"
        assert len(landing.offer({i: SHARE_MIN for i in range(3)})) == 2
    finally:
        landing.close()


def test_free_files_give_the_smallest_fit_and_close_the_oldest_past_their_keep() -> None:
    """The pool behind both reuses (the landing's pulls, the actors' segments)."""
    free = FreeFiles(keep=2)
    fds = [os.memfd_create(f"free-{size}") for size in (300, 100, 200)]
    for fd, size in zip(fds, (300, 100, 200)):
        os.ftruncate(fd, size)
    try:
        free.put(fds[0], now=1.0)
        free.put(fds[1], now=2.0)
        free.put(fds[2], now=3.0)  # one past the keep: the one freed first (300 bytes) is closed
        with pytest.raises(OSError):
            os.fstat(fds[0])
        assert len(free) == 2 and free.take(250) is None, "nothing big enough"
        assert free.take(150, most=180) is None, "nothing small enough"
        assert free.take(50) == fds[1], "the smallest that fits"
        free.put(fds[1], now=10.0)
        free.expire(now=12.0, idle_s=5.0)  # freed at 3.0: idle long enough
        with pytest.raises(OSError):
            os.fstat(fds[2])
        assert free.take(50) == fds[1] and len(free) == 0
        free.put(fds[1], now=20.0)
    finally:
        free.close()
    with pytest.raises(OSError):
        os.fstat(fds[1])


def meshbook_files() -> set[str]:
    """The descriptors of meshbook's shared-memory files (pushes, pulls, calls) this process holds."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:meshbook-"):
                found.add(fd)
    return found


def test_a_write_cut_short_by_an_interrupt_leaves_no_file_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during a big push, or a targeted interrupt during a pull (the rank writes as user
    code), stops the write into a shared file before anyone else knows the file: nothing would
    ever close it then, so the writer must."""
    body, views, _ = pickled({"x": torch.ones(SHARE_MIN)}, "call")
    pool = Segments(keep=1)
    reused = pool.share(body, views)[1]
    pool.give_back(reused, True)  # written over by the next call
    before = meshbook_files()

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "pwrite", interrupted)
    with pytest.raises(KeyboardInterrupt), pack({"x": torch.ones(SHARE_MIN)}, shared=True):
        pass
    with pytest.raises(KeyboardInterrupt):
        lend(Lent(), torch.ones(SHARE_MIN))
    with pytest.raises(KeyboardInterrupt):
        Segments().share(body, views)  # a new segment
    monkeypatch.setattr(secrets, "token_bytes", interrupted)  # the free one is written through its mapping
    with pytest.raises(KeyboardInterrupt):
        pool.share(body, views)
    assert meshbook_files() == before - {str(reused)}
    assert call_mappings() == 0, "its mapping went with it"


def call_mappings() -> int:
    """How many mappings of actor-call segments this process holds."""
    with open("/proc/self/maps") as maps:
        return sum("/memfd:meshbook-call" in line for line in maps)


def test_a_segment_written_over_holds_the_new_values_and_its_mapping_goes_with_the_file() -> None:
    """A segment is written over through a mapping the writer keeps (a copy, where pwrite costs
    three): readers see the new values, and the mapping is let go of with the file."""
    pool = Segments(keep=1)
    payload, fd = pool.share(*pickled({"x": torch.arange(SHARE_MIN // 4, dtype=torch.float32)}, "call")[:2])
    value, release = payload.open("call")
    assert value["x"][5].item() == 5.0 and call_mappings() == 1, "a new segment: written, not mapped"
    del value
    assert release()
    pool.give_back(fd, True)
    again, reused = pool.share(*pickled({"x": torch.full((SHARE_MIN // 8,), 7.0)}, "call")[:2])
    assert reused == fd and call_mappings() == 1, "written over through the writer's mapping"
    value, release = again.open("call")
    assert torch.equal(value["x"], torch.full((SHARE_MIN // 8,), 7.0)) and call_mappings() == 2
    pool.give_back(reused, False)  # a reader still holds it: closed, the writer's mapping with it
    assert call_mappings() == 1 and str(fd) not in meshbook_files()
    del value
    assert release() and call_mappings() == 0


def test_a_pull_still_being_written_is_not_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control thread expires lent files every tick, while the main thread may still be
    writing a big pull into one: closed then, the write would go on into whatever file took
    its number next."""
    lent, pwrite = Lent(keep_s=0.0), os.pwrite

    def amid_a_tick(fd: int, data: memoryview, offset: int) -> int:
        lent.expire(time.monotonic() + 1)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", amid_a_tick)
    payload = lend(lent, torch.ones(SHARE_MIN))
    monkeypatch.undo()
    assert payload.shared is not None and torch.equal(payload.load("pull")["value"], torch.ones(SHARE_MIN))
    lent.release(payload.shared.token)


class CountsPickling:
    count = 0

    def __reduce__(self) -> tuple[object, ...]:
        CountsPickling.count += 1
        return (dict, ())


def test_a_push_serializes_each_value_once_for_all_ranks(mesh4: meshbook.Mesh) -> None:
    CountsPickling.count = 0
    mesh4.push(counted=CountsPickling(), payload=torch.ones(SHARE_MIN))
    assert CountsPickling.count == 1
    assert dict(mesh4.run("counted").result()) == {r: {} for r in range(4)}


@pytest.mark.parametrize("dim,mesh_dim", [(0, None), (1, None), (0, "dp"), (1, "tp"), (-1, "dp")])
def test_scatter_and_gather_are_inverses(mesh4: meshbook.Mesh, dim: int, mesh_dim: str | None) -> None:
    tensor = torch.randn(8, 12, 4)
    mesh4.scatter("piece", tensor, dim, mesh_dim=mesh_dim)
    parts = 4 if mesh_dim is None else 2
    pieces = mesh4.pull("piece")
    for rank, piece in pieces.items():
        index = rank if mesh_dim is None else mesh4.topology.coords(rank)[mesh_dim]
        assert torch.equal(piece, tensor.chunk(parts, dim)[index])
    assert torch.equal(mesh4.ref("piece").gather(dim, mesh_dim=mesh_dim), tensor)


def test_scatter_over_a_selection(mesh4: meshbook.Mesh) -> None:
    tensor = torch.arange(10.0)
    mesh4.scatter("part", tensor, where={"tp": 1})  # ranks 1 and 3, five elements each
    assert torch.equal(mesh4.pull("part", ranks=[3])[3], tensor[5:])
    assert torch.equal(mesh4.ref("part", where={"tp": 1}).gather(), tensor)


def test_scatter_of_an_empty_tensor_gives_every_rank_a_piece(mesh4: meshbook.Mesh) -> None:
    mesh4.scatter("empty", torch.zeros(0, 3))
    assert {rank: piece.shape for rank, piece in mesh4.pull("empty").items()} == {r: (0, 3) for r in range(4)}
    mesh4.scatter("empty", torch.zeros(2, 0), dim=1, mesh_dim="dp")
    assert {piece.shape for piece in mesh4.pull("empty").values()} == {(2, 0)}


def test_scatter_and_gather_take_numpy_arrays_as_tensors(mesh4: meshbook.Mesh) -> None:
    import numpy

    array = numpy.arange(8.0)
    mesh4.scatter("from_numpy", array)
    for rank, piece in mesh4.pull("from_numpy").items():
        assert torch.equal(piece, torch.from_numpy(array[2 * rank:2 * rank + 2])), rank
    mesh4.run("import numpy\narr = numpy.arange(4.0) + rank").result()
    expected = torch.cat([torch.arange(4.0, dtype=torch.float64) + r for r in range(4)])
    assert torch.equal(mesh4.ref("arr").gather(), expected)
    with pytest.raises(ShapeError, match="numpy array of dtype object .* make it a tensor first"):
        mesh4.scatter("objects", numpy.array([object()] * 4))


# -- bad input ----------------------------------------------------------------------------------


def test_a_name_missing_on_some_ranks_is_named(mesh4: meshbook.Mesh) -> None:
    mesh4.run("only_some = 1", ranks=[0, 1]).result()
    message = r"'only_some' is not defined on rank\(s\) 2,3 \(it is on rank\(s\) 0,1"
    with pytest.raises(MissingNameError, match=message):
        mesh4.pull("only_some")
    with pytest.raises(MissingNameError, match=message):
        mesh4.ref("only_some")
    for refused in (mesh4.pull, mesh4.ref):  # no variable can have it: not "not defined on rank(s) 0-3"
        with pytest.raises(MeshError, match=r"'not-a-name' is not a valid variable name \(letters, digits and _"):
            refused("not-a-name")
    with pytest.raises(MissingNameError, match="on rank\\(s\\) 0-3; define it there"):
        mesh4.pull("nowhere")
    assert dict(mesh4.pull("only_some", ranks=[0, 1])) == {0: 1, 1: 1}


def test_an_unpicklable_value_is_named_and_nothing_is_pushed(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(SendError, match="push: value 'lock' \\(a _thread.lock\\) cannot be pickled"):
        mesh4.push(fine=torch.ones(2), lock=threading.Lock())
    assert "fine" not in mesh4.who()


def test_a_pull_of_what_does_not_pickle_names_the_part_that_does_not(mesh4: meshbook.Mesh) -> None:
    mesh4.run("import threading, types\n_ = 'yours'\n"
              "small = {'t': torch.ones(4), 'lock': threading.Lock()}\n"
              f"big = {{'t': torch.ones({SHARE_MIN}), 'lock': threading.Lock()}}\n"
              "holder = types.SimpleNamespace(t=torch.ones(2), inner=[1, threading.Lock()])").result()
    for name, part in [("small", "small['lock']"), ("big", "big['lock']"), ("holder", "holder.inner[1]")]:
        with pytest.raises(RemoteError) as caught:
            mesh4.pull(name)
        assert f"pull('{name}'): {part} (a _thread.lock) cannot be pickled" in str(caught.value)
        assert "Pull a part of it that pickles" in str(caught.value) and "`_`" not in str(caught.value)
    assert mesh4.run("_", ranks=[0]).result()[0] == "yours", "a failed pull leaves the rank's _ alone"


def test_a_pull_over_the_limit_is_refused_on_the_ranks_where_metadata_cannot_size_it(
        mesh4: meshbook.Mesh) -> None:
    mesh4.run("import types\nt = torch.zeros(1 << 19)\nobj = types.SimpleNamespace(t=t)\n"
              "deep = [[[[[t]]]]]\nblob = bytes(2 << 20)\ntext = 'x' * (2 << 20)").result()
    weighed = r"would move at least 8.0 MiB \(\[0-3\] 2.0 MiB; weighed on rank\(s\) 0-3 .*over the 1.0 MiB limit"
    for name in ("obj", "deep", "text"):
        with pytest.raises(TooLargeError, match=f"pulling '{name}' {weighed}; nothing was kept"):
            mesh4.pull(name, max_bytes=1 << 20)
    with pytest.raises(TooLargeError, match="would move 8.0 MiB .*nothing was moved"):
        mesh4.pull("blob", max_bytes=1 << 20)  # bytes are sized before anything moves
    assert mesh4.pull("obj", ranks=[0], max_bytes=None)[0].t.numel() == 1 << 19, "None: no limit"
    assert len(mesh4.pull("obj", max_bytes=8 << 20)) == 4, "within the limit: every rank's share"
    mesh4.run("one = obj if rank == 0 else None").result()
    with pytest.raises(TooLargeError, match=r"max_bytes=8 \* 2\*\*20"):  # each rank gets a quarter
        mesh4.pull("one", max_bytes=1 << 20)
    assert mesh4.pull("one", max_bytes=8 << 20)[0].t.numel() == 1 << 19, "the limit it named lets it through"


def test_a_pulled_value_the_notebook_cannot_unpickle_names_its_rank(mesh2: meshbook.Mesh) -> None:
    mesh2.run("import operator\nclass Unreadable:\n    def __reduce__(self):\n"
              "        return (operator.truediv, (1, 0))\nu = Unreadable() if rank == 1 else 'fine'").result()
    with pytest.raises(meshbook.MeshError, match=r"the value of rank 1 cannot be unpickled in the notebook "
                                                 r"\(ZeroDivisionError"):
        mesh2.pull("u")
    assert mesh2.pull("u", ranks=[0])[0] == "fine"


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """``fn()`` started in a thread, and the list its outcome (value or exception) lands in."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Whether ``condition()`` came true within ``timeout`` (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def pull_behind(mesh: meshbook.Mesh, flag: Path, change: str, **pull: Any) -> object:
    """Pull ``x`` while the ranks' main threads wait for ``flag``, then run ``change``: the
    pull's checks (answered on the control threads) pass before the value changes under its
    fetch, which waits behind the cell. What the pull returned or raised."""
    busy = mesh.run(f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\n{change}")
    puller, outcome = in_thread(lambda: mesh.pull("x", **pull))
    assert wait_until(lambda: all(mesh.controller.book.queued(rank) == 2 for rank in mesh.ranks)), \
        "the pull's fetch never queued behind the cell"
    flag.touch()
    puller.join(60)
    busy.result()
    return outcome[0]


def test_a_value_changed_after_the_checks_is_refused_as_they_would(mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    mesh2.run("x = torch.zeros(4)").result()
    grown = pull_behind(mesh2, tmp_path / "grow", "x = torch.zeros(1 << 22)", max_bytes=1 << 20)
    assert isinstance(grown, TooLargeError) and "would move at least 32.0 MiB" in str(grown), grown
    deleted = pull_behind(mesh2, tmp_path / "delete", "del x")
    assert isinstance(deleted, MissingNameError), deleted
    assert str(deleted) == ("'x' is not defined on rank(s) 0,1; define it there in a %%mesh cell or "
                            "send it with mesh.push(); nothing was moved")


def test_a_pull_over_the_limit_is_refused_with_its_size(mesh4: meshbook.Mesh) -> None:
    mesh4.push(big=torch.zeros(1 << 20))  # 4 MiB per rank, 16 MiB in all
    with pytest.raises(TooLargeError, match=r"would move 16.0 MiB \(\[0-3\] 4.0 MiB\), over the "
                                            r"8.0 MiB limit; nothing was moved.*max_bytes=16 \* 2\*\*20"):
        mesh4.pull("big", max_bytes=8 << 20)
    assert len(mesh4.pull("big", ranks="0,1", max_bytes=8 << 20)) == 2
    mesh4.run("nested = {'a': [big, big]}").result()
    with pytest.raises(TooLargeError, match="32.0 MiB"):
        mesh4.ref("nested").fetch(max_bytes=8 << 20)


def test_scatter_refuses_what_does_not_split(mesh4: meshbook.Mesh) -> None:
    with pytest.raises(ShapeError, match="size 10 along dim 0 does not divide into 4 equal pieces"
                                         ".*multiple of 4 \\(e.g. 8 or 12\\)"):
        mesh4.scatter("x", torch.zeros(10))
    with pytest.raises(ShapeError, match="one per dp coordinate"):
        mesh4.scatter("x", torch.zeros(3, 4), mesh_dim="dp")
    with pytest.raises(ShapeError, match="dim 2 is out of range"):
        mesh4.scatter("x", torch.zeros(4, 4), dim=2)
    with pytest.raises(ShapeError, match="not a list"):
        mesh4.scatter("x", [1, 2, 3, 4])
    with pytest.raises(SelectionError, match="no dimension 'pp'"):
        mesh4.scatter("x", torch.zeros(4), mesh_dim="pp")
    assert "x" not in mesh4.who()


def test_an_interrupted_push_says_which_ranks_stored_it(mesh4: meshbook.Mesh) -> None:
    busy = mesh4.run("import time\ntime.sleep(3)", ranks=[1])  # the push waits behind it on rank 1
    threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGINT)).start()  # Ctrl-C while it waits
    with pytest.raises(KeyboardInterrupt, match=re.escape("push interrupted: cut_short stored on rank(s) 0,2,3; "
                                                          "rank(s) 1 kept their previous values")):
        mesh4.push(cut_short=torch.ones(3))
    assert dict(mesh4.run("'cut_short' in globals()").result()) == {0: True, 1: False, 2: True, 3: True}
    busy.result(timeout=30)


def test_other_bad_requests(dtensors: meshbook.Mesh) -> None:
    with pytest.raises(MeshError, match="'rank' is set by meshbook on every rank"):
        dtensors.push(rank=3)
    with pytest.raises(MeshError, match="needs values"):
        dtensors.push()
    with pytest.raises(MeshError, match=r"push\(\) takes a dict of names to values, or keywords.* not a list"):
        dtensors.push([("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(MeshError, match="'class' is a Python keyword"):
        dtensors.push({"class": 1})
    for name in ("__builtins__", "__name__"):
        with pytest.raises(MeshError, match=f"'{name}' is a special name"):
            dtensors.push({name: {}})
    assert dtensors.run("len([1]), __name__", ranks=[0]).result()[0] == (1, "__main__")
    with pytest.raises(ShapeError, match="full_tensor\\(\\) assembles DTensors; 'g' is a Tensor"):
        dtensors.ref("g").full_tensor()
    with pytest.raises(ShapeError, match="use .full_tensor\\(\\) for a DTensor"):
        dtensors.ref("w").gather()
    with pytest.raises(MeshError, match="max_bytes=0: give a number of bytes above 0"):
        dtensors.pull("g", max_bytes=0)
    with pytest.raises(MeshError, match=r"ranks=1.5: give a rank"):
        dtensors.pull("g", ranks=1.5)  # type: ignore[arg-type]
    assert dtensors.pull("g", ranks=[0], max_bytes="1M")[0].shape == dtensors.pull("g", ranks=[0])[0].shape
    dtensors.run("uneven = torch.zeros(2, 1 + rank % 2)").result()
    with pytest.raises(ShapeError, match=re.escape("gather() of 'uneven' along dim 0 joins pieces alike in every "
                                                   "other dimension, and they are [0,2] (2, 1), [1,3] (2, 2); "
                                                   "nothing was moved")):
        dtensors.ref("uneven").gather()
    assert dtensors.ref("uneven").gather(dim=1).shape == (2, 6)


# -- a broken mesh ------------------------------------------------------------------------------


def test_push_to_a_degraded_mesh_sends_nothing(mesh2: meshbook.Mesh) -> None:
    mesh2.run("import os; os.kill(os.getpid(), 9)", ranks=[1]).wait(30)
    with pytest.raises(MeshError, match="degraded"):
        mesh2.push(x=torch.ones(SHARE_MIN))
    assert "x" not in mesh2.who(ranks=[0])


def test_a_rank_dying_during_a_push_is_reported_with_what_was_stored(mesh2: meshbook.Mesh) -> None:
    blocker = mesh2.run("import time; time.sleep(120)", ranks=[1])  # the push queues behind it
    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            mesh2.push(x=torch.ones(SHARE_MIN))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    pusher = threading.Thread(target=push)
    pusher.start()
    deadline = time.monotonic() + 60
    while "x" not in mesh2.who(ranks=[0]):
        assert time.monotonic() < deadline, "rank 0 never stored x"
        time.sleep(0.05)
    os.kill(mesh2.status()[1].pid, signal.SIGKILL)
    pusher.join(60)
    blocker.wait(30)
    (error,) = outcome
    assert isinstance(error, RemoteError) and error.ranks == [1]
    assert "x stored on rank(s) 0; rank(s) 1 kept their previous values" in str(error)


def test_a_pull_maps_each_value_as_it_arrives_not_once_every_rank_answered(
        mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    """A rank closes a file it lent a minute after it answered (3 s here): a rank that
    answers later than that (busy with a cell) must not cost the other ranks' values."""
    def keep_lent_files(worker: Any, seconds: float) -> None:
        worker.lent.keep_s = seconds

    def rank_0_closes_what_it_lent() -> None:
        first = mesh2.status()[0].pid
        assert first is not None and wait_until(lambda: bool(lent_files(first))), "rank 0 never lent its value"
        assert wait_until(lambda: not lent_files(first)), "rank 0 never closed the file it lent"

    mesh2.call(keep_lent_files, 3.0).result()
    pulled = pull_while_busy(mesh2, 1, tmp_path, rank_0_closes_what_it_lent)
    assert [value[0].item() for value in pulled.values()] == [0.0, 1.0]


def pull_while_busy(mesh: meshbook.Mesh, busy: int, tmp_path: Path, meanwhile: Callable[[], None]) -> Any:
    """Pull ``x`` (a value per rank) while rank ``busy`` runs a cell, do ``meanwhile``, then let
    that cell end: what the pull returned."""
    mesh.run(f"x = torch.full(({SHARE_MIN},), float(rank))").result()
    flag = tmp_path / "go"
    cell = mesh.run(f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)", ranks=[busy])
    puller, outcome = in_thread(lambda: mesh.pull("x"))
    meanwhile()
    flag.touch()
    puller.join(60)
    cell.result()
    (pulled,) = outcome
    assert isinstance(pulled, meshbook.RankValues), pulled
    return pulled


def kill(mesh: meshbook.Mesh, rank: int) -> None:
    """SIGKILL ``rank``, and wait until the mesh knows it died."""
    pid = mesh.status()[rank].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: mesh.status()[rank].state == "dead"), f"rank {rank} never known dead"


def test_a_rank_that_dies_after_answering_a_pull_still_gives_its_value(
        mesh2: meshbook.Mesh, tmp_path: Path) -> None:
    before = pull_files(os.getpid())

    def rank_1_dies_once_read() -> None:
        assert wait_until(lambda: bool(pull_files(os.getpid()) - before), 30), "the notebook never took rank 1's file"
        kill(mesh2, 1)

    pulled = pull_while_busy(mesh2, 0, tmp_path, rank_1_dies_once_read)
    assert [value[0].item() for value in pulled.values()] == [0.0, 1.0]


def test_a_value_whose_rank_died_before_it_was_read_says_so(mesh2: meshbook.Mesh) -> None:
    mesh2.run(f"x = torch.ones({SHARE_MIN})").result()
    payload = mesh2.call(ops.fetch, "x", None, True, ranks=[1]).result(echo=False)[1]
    kill(mesh2, 1)
    with pytest.raises(WriterExited, match=r"process \d+, which wrote the shared memory for this pull, "
                                          r"exited before it was read"):
        mesh2.controller.landing.load(payload, "pull")


def test_a_mesh_lifts_the_limit_of_open_files_where_values_are_held() -> None:
    """Each value held from shared memory keeps a descriptor: a notebook holding hundreds of
    pulled values, or a rank hundreds of pushed ones, would run out at a soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 256  # room for this process's meshes meanwhile
    if low >= hard:
        pytest.skip(f"a hard limit of {hard} open files leaves no soft limit to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with meshbook.start(2) as mesh:
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard), "the notebook's"
            limits = mesh.run("import resource\nresource.getrlimit(resource.RLIMIT_NOFILE)").result()
            assert limits.unique() == (hard, hard), "the ranks'"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_running_out_of_files_says_what_to_do(mesh2: meshbook.Mesh) -> None:
    mesh2.run("import os, resource\nheld = []\nresource.setrlimit(resource.RLIMIT_NOFILE, "
              "(len(os.listdir('/proc/self/fd')) + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))").result()
    with pytest.raises(RemoteError) as caught:
        for _ in range(40):
            mesh2.push(batch=torch.ones(SHARE_MIN))
            mesh2.run("held.append(batch)").result()
    assert "may open no more files" in str(caught.value) and "ulimit -n" in str(caught.value)
    mesh2.run("held.clear()").result()


def test_who_reports_the_variables_a_restarted_rank_lost(mesh2: meshbook.Mesh) -> None:
    mesh2.run("weights = torch.ones(3)").result()
    mesh2.push(lr=0.1)
    assert "weights" in mesh2.who()
    mesh2.restart([1])
    ns = mesh2.who()
    assert ns.lost == {1: ("lr", "weights")}
    lost_rows = [line for line in repr(ns).splitlines() if "lost (rank restarted)" in line]
    assert [row.split()[0] for row in lost_rows] == ["lr", "weights"]
    assert all(row.endswith(" 1") for row in lost_rows)
    mesh2.push(lr=0.2, ranks=[1])
    mesh2.run("fresh = 1", ranks=[1]).result()
    assert mesh2.who().lost == {1: ("weights",)}
    mesh2.restart([1])  # what the restarted rank made since is lost again, with the rest
    assert mesh2.who().lost == {1: ("fresh", "lr", "weights")}


def test_a_push_lands_on_the_ranks_device_whatever_a_cell_named_device(mesh2: meshbook.Mesh) -> None:
    """``device`` is the user's to rebind in a cell; pushed values still land on the rank's."""
    mesh2.run("saved, device = device, 'rebound by a cell'").result()
    try:
        mesh2.push(pushed=torch.ones(3))
        assert set(mesh2.run("str(pushed.device)").result().values()) == {"cpu"}
    finally:
        mesh2.run("device = saved; del saved").result()


def test_a_ctrl_c_as_a_scatter_part_is_sent_stops_the_parts_before_it_and_says_where_it_landed(
        mesh4: meshbook.Mesh) -> None:
    """The Ctrl-C lands while the third of four parts is sent: that part is stopped as it was
    sent, the two before it are stopped too, and what is said matches where the values are
    (it was a bare KeyboardInterrupt, the earlier parts left to store, the fourth never sent)."""
    mesh4.run("globals().pop('piece', None)").result()
    booked: list[object] = []

    def interrupt_the_third(run: meshbook.Run) -> None:  # on the main thread, as it is booked
        if run.what == "scatter":
            booked.append(run)
            if len(booked) == 3:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    mesh4.controller.add_run_listener(interrupt_the_third)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            mesh4.scatter("piece", torch.arange(4.0))
    finally:
        mesh4.controller.remove_run_listener(interrupt_the_third)
    has = dict(mesh4.run("'piece' in globals()").result())
    assert has[3] is False  # its part was never sent
    stored, kept = [r for r, v in has.items() if v], [r for r, v in has.items() if not v]
    assert str(info.value) == (f"scatter interrupted: piece stored on rank(s) {format_ranks(stored) or 'none'}; "
                               f"rank(s) {format_ranks(kept)} kept their previous values"), (str(info.value), has)
