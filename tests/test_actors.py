"""Actor meshes and several meshes in one process: real ranks, real rank-to-rank calls.

The actor classes below are module-level, as in a notebook, and travel by value (this module
is registered with cloudpickle: the ranks cannot import it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

import meshbook
from meshbook import MeshError, RemoteError

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Policy(meshbook.Actor):
    def __init__(self, hidden: int) -> None:
        torch.manual_seed(1000 + self.rank)  # every rank starts with other weights
        self.model = torch.nn.Linear(hidden, hidden)
        self.loads = 0

    @meshbook.endpoint
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)

    @meshbook.endpoint
    def load(self, state: dict[str, torch.Tensor]) -> int:
        self.model.load_state_dict(state)
        self.loads += 1
        return self.loads

    @meshbook.endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @meshbook.endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @meshbook.endpoint
    def where(self) -> tuple[int, dict[str, int]]:
        return self.rank, self.coords


class Riddle:
    """A value that pickles but does not unpickle where it lands, as an instance of a class
    only the answering rank can import does."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _import_missing, ()


def _import_missing() -> None:
    raise ModuleNotFoundError("No module named 'only_on_the_answering_rank'")


class Odd(Policy):
    """A policy with endpoints that misbehave on purpose."""

    @meshbook.endpoint
    def hold(self, started: str) -> None:
        """Say it runs (a file per rank), then wait until interrupted or killed."""
        Path(f"{started}.{self.rank}").touch()
        while True:
            time.sleep(0.05)

    @meshbook.endpoint
    def riddle(self) -> Riddle:
        return Riddle()


class Prober(meshbook.Actor):
    """Calls other actors from its rank and says what it saw, for the notebook to check."""

    @meshbook.endpoint
    def read_twice(self, odd: Any) -> tuple[str, str, list[int]]:
        """Wait twice for rank 0's unreadable answer, then let choose() pick twice."""
        future = odd.slice(rank=0).riddle.call_one()
        first, again = (future.exception(timeout=60).render() for _ in range(2))
        return first, again, sorted(odd.where.choose().result(timeout=60)[0] for _ in range(2))

    @meshbook.endpoint
    def reloads_in_place(self, policy: Any, hidden: int) -> bool:
        """Load the same weights twice: does the second call write over the first one's shared
        segment (every target let go of it)? A segment is told by its inode."""
        state = torch.nn.Linear(hidden, hidden).state_dict()
        first = policy.load.call(state)
        inode = os.fstat(first.segment).st_ino  # open until every target answered
        first.result(timeout=60)
        second = policy.load.call(state)
        reused = os.fstat(second.segment).st_ino == inode
        second.result(timeout=60)
        return reused


class Trainer(meshbook.Actor):
    """Trains its replica (data parallel over its mesh) and pushes the weights to the generators."""

    def __init__(self, hidden: int) -> None:
        torch.manual_seed(0)  # the same start on every trainer rank
        self.model = torch.nn.Linear(hidden, hidden)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    @meshbook.endpoint
    def step(self, rollouts: list[torch.Tensor]) -> float:
        import torch.distributed as dist

        batch = torch.cat(rollouts)[self.rank::self.world_size]
        loss = self.model(batch).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.opt.step()
        return loss.item()

    @meshbook.endpoint
    def sync(self, generators: object) -> list[int]:
        """Push the weights to every generator, rank to rank (never through the notebook)."""
        return sorted(generators.load.call(self.model.state_dict()).result().values())  # type: ignore[attr-defined]

    @meshbook.endpoint
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)

    @meshbook.endpoint
    def ask(self, generators: object, seconds: float) -> object:
        return generators.nap.call(seconds).result()  # type: ignore[attr-defined]


class Supervisor(meshbook.Actor):
    def __init__(self) -> None:
        self.events: list[str] = []

    @meshbook.endpoint
    def __supervise__(self, event: meshbook.SupervisionEvent) -> None:
        self.events.append(str(event))

    @meshbook.endpoint
    def seen(self) -> list[str]:
        return self.events


@pytest.fixture(scope="module")
def two() -> Iterator[tuple[meshbook.Mesh, meshbook.Mesh]]:
    trainers = meshbook.start(dims={"dp": 2}, name="trainers")
    generators = meshbook.start(2, name="generators")
    yield trainers, generators
    trainers.stop()
    generators.stop()


def test_two_named_meshes_and_the_current_one(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    trainers, generators = two
    assert list(meshbook.meshes()) == ["trainers", "generators"]
    assert meshbook.current().name == "generators"  # the last started
    assert meshbook.use("trainers").controller is trainers.controller
    assert meshbook.current().name == "trainers"
    assert trainers.controller.rundir != generators.controller.rundir
    trainers.run("x = 'trainer'").result()
    generators.run("x = 'generator'").result()
    assert dict(trainers.run("x").result()) == {0: "trainer", 1: "trainer"}
    with pytest.raises(MeshError, match="a mesh named 'trainers' is already running"):
        meshbook.start(1, name="trainers")
    with pytest.raises(MeshError, match="no mesh named 'nope' is running.*trainers, generators"):
        meshbook.use("nope")
    assert dict(generators.run("x").result()) == {0: "generator", 1: "generator"}
    first, second = meshbook.start(1), meshbook.start(1)  # unnamed: mesh, mesh2
    try:
        assert (first.name, second.name) == ("mesh", "mesh2") and meshbook.current() is second
        second.stop()
        with pytest.raises(MeshError, match="the current mesh 'mesh2' is stopped; running: trainers, generators, mesh"):
            meshbook.current()
    finally:
        first.stop()
        second.stop()


def test_endpoints_every_way(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    _, generators = two
    policy = generators.spawn("policy", Policy, 4)
    try:
        x = torch.ones(2, 4)
        values = policy.generate.call(x).result(timeout=60)
        assert values.ranks == [0, 1] and not torch.equal(values[0], values[1])
        assert torch.equal(policy.slice(rank=1).generate.call_one(x).result(), values[1])
        assert any(torch.equal(policy.generate.choose(x).result(), v) for v in values.values())
        streamed = dict(policy.generate.stream(x))
        assert streamed.keys() == {0, 1} and torch.equal(streamed[0], values[0])
        assert dict(policy.where.call().result()) == {0: (0, {"world": 0}), 1: (1, {"world": 1})}
        assert policy.generate.broadcast(x) is None
        # The actor is a variable of the rank's namespace, and who() lists it.
        assert dict(generators.run("type(policy).__name__").result()) == {0: "Policy", 1: "Policy"}
        assert "policy" in repr(generators.who())
        assert generators.actors()["policy"].ranks == [0, 1]
        assert asyncio.run(_awaited(policy.slice(rank=0).where.call_one())) == (0, {"world": 0})
    finally:
        generators.run("del policy").result()


async def _awaited(future: meshbook.ActorFuture) -> object:
    return await future


class Waiter(meshbook.Actor):
    """``async def`` endpoints, as Monarch's actors are written."""

    @meshbook.endpoint
    async def later(self, x: int) -> int:
        await asyncio.sleep(0.05)
        return x * 10 + self.rank

    @meshbook.endpoint
    async def ask(self, other: Any) -> object:
        return await other.slice(rank=0).later.call_one(7)  # another actor's, from this rank's loop


def test_an_async_endpoint_is_awaited_on_its_rank(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    trainers, generators = two
    waiter = generators.spawn("waiter", Waiter)
    try:
        assert dict(waiter.later.call(3).result(timeout=60)) == {0: 30, 1: 31}
        asker = trainers.spawn("asker_async", Waiter)
        assert dict(asker.ask.call(waiter).result(timeout=60)) == {0: 70, 1: 70}
        trainers.run("del asker_async").result()
    finally:
        generators.run("del waiter").result()


def test_a_generator_cannot_be_an_endpoint() -> None:
    with pytest.raises(TypeError, match=r"Bad.items' is a generator: a call answers with one value"):
        class Bad(meshbook.Actor):
            @meshbook.endpoint
            def items(self) -> Any:
                yield 1


def test_choose_picks_the_least_busy_rank(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    _, generators = two
    napper = generators.spawn("napper", Policy, 2)
    busy = napper.slice(rank=0).nap.call_one(3.0)  # rank 0 is busy for a while
    picked = {napper.nap.choose(0.0).result() for _ in range(4)}
    assert picked == {1}
    assert busy.result() == 0


def test_endpoint_error_fails_that_call_only_with_its_own_lines(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    _, generators = two
    failing = generators.spawn("failing", Policy, 2)
    with pytest.raises(RemoteError) as info:
        failing.fail.call("bad batch").result()
    line = inspect.getsourcelines(Policy.fail)[1] + 2  # the raise, in this file
    text = info.value.render()
    assert text.startswith("[0,1] ValueError: bad batch")
    assert f"{__file__}:{line}, in fail" in text and "raise ValueError(message)" in text
    assert failing.where.call().result().ranks == [0, 1]  # the actors live on


def test_bad_input_is_a_clear_error_and_leaves_the_meshes_alone(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    _, generators = two

    class Locked(meshbook.Actor):
        lock = threading.Lock()

        @meshbook.endpoint
        def ping(self) -> int:
            return 1

    with pytest.raises(MeshError, match="the actor class .*Locked cannot be sent.*lock"):
        generators.spawn("locked", Locked)
    with pytest.raises(MeshError, match="needs a subclass of meshbook.Actor"):
        generators.spawn("plain", dict)
    with pytest.raises(MeshError, match="give a Python identifier"):
        generators.spawn("not a name", Policy, 2)
    bad = generators.spawn("bad", Policy, 2)
    with pytest.raises(MeshError, match="a mesh named|already lives on this mesh"):
        generators.spawn("bad", Policy, 2)
    with pytest.raises(MeshError, match="has no endpoint 'train'; its endpoints: fail, generate, load"):
        bad.train.call()
    assert not hasattr(bad, "train")
    with pytest.raises(MeshError, match="argument 1 .*cannot be pickled"):
        bad.generate.call(threading.Lock())
    with pytest.raises(MeshError, match="call_one\\(\\) needs a single actor"):
        bad.generate.call_one(torch.ones(2))
    assert dict(bad.where.call().result()) == {0: (0, {"world": 0}), 1: (1, {"world": 1})}


def test_a_spawn_waiting_for_ranks_outside_it_is_explained_and_freed(two: tuple[meshbook.Mesh, meshbook.Mesh],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, generators = two

    class Joins(meshbook.Actor):
        def __init__(self) -> None:
            import torch.distributed as dist

            dist.barrier()  # rank 1, outside the spawn, never joins

        @meshbook.endpoint
        def ping(self) -> int:
            return 1

    said: list[str] = []

    def free_once_explained() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "has not joined" not in "".join(said):
            said.append(capsys.readouterr().err)
            time.sleep(0.2)
        generators.recover()

    rescue = threading.Thread(target=free_once_explained)
    rescue.start()
    with pytest.raises(RemoteError) as info:
        generators.narrow([0]).spawn("joins", Joins)
    rescue.join()
    text = "".join(said)
    assert "rank 0 waits in a collective (for over 5 s) that a rank of its group has not joined: without it" in text
    assert "rank 1 took no part in this spawn (idle)" in text
    assert info.value.failures[0].type_name == "CollectiveAborted"
    assert generators.narrow([0]).spawn("joins", Policy, 2).where.call().result()[0][0] == 0  # nothing half-built


class Reducer(meshbook.Actor):
    """Endpoints that all_reduce over the default group, as a data-parallel trainer would."""

    @meshbook.endpoint
    def total(self, value: float, fail_on: int = -1) -> float:
        import torch.distributed as dist

        if self.rank == fail_on:
            raise ValueError(f"bad batch on rank {self.rank}")
        t = torch.full((1,), value)
        dist.all_reduce(t)
        return t.item()


def test_an_endpoint_failing_before_its_collective_frees_the_others_at_once(
        two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """As a cell's: the rank left waiting for the failed one is freed (not after the
    collective's timeout), the call raises both, and the next call computes right."""
    _, generators = two
    reducer = generators.spawn("reducer", Reducer)
    with pytest.raises(RemoteError) as info:
        reducer.total.call(1.0, fail_on=1).result(timeout=120)
    failures = info.value.failures
    assert failures[1].type_name == "ValueError"
    assert failures[0].type_name == "CollectiveAborted"
    assert "rank 1 failed the call without joining it" in failures[0].message
    assert "out of step after the failed call" in str(info.value)
    assert dict(reducer.total.call(2.0).result(timeout=120)) == {0: 4.0, 1: 4.0}


def test_an_endpoint_collective_paired_with_a_cells_fails_both(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """An endpoint called on rank 1 alone all_reduces over both ranks; the cell sent next to
    both reaches rank 0 first, and its all_reduce pairs with the endpoint's: each side's
    number is wrong, and each fails as CollectiveMispaired rather than return it."""
    _, generators = two
    reducer = generators.spawn("pairs", Reducer)
    alone = reducer.slice(rank=1).total.call_one(1.0)
    cell = generators.run("x = torch.full((1,), 10.0); dist.all_reduce(x); x.item()")
    with pytest.raises(RemoteError) as info:
        alone.result(timeout=120)
    assert info.value.failures[1].type_name == "CollectiveMispaired"
    assert "paired with the one rank(s) 0 in run('x = torch.full" in info.value.failures[1].message
    with pytest.raises(RemoteError) as info:
        cell.result(timeout=120)
    assert info.value.failures[0].type_name == "CollectiveMispaired"
    assert "paired with the one rank(s) 1 in pairs.total issued" in info.value.failures[0].message
    assert dict(reducer.total.call(3.0).result(timeout=120)) == {0: 6.0, 1: 6.0}


def test_an_actor_cannot_take_a_name_meshbook_sets_on_the_ranks(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """It would replace ``device`` (or ``rank``, ``torch``...) in the ranks' namespaces, which
    cells use; and a cell that rebinds ``device`` does not move actors' arguments elsewhere."""
    _, generators = two
    for name in ("device", "rank", "torch", "device_mesh"):
        with pytest.raises(MeshError, match=f"actor name '{name}': meshbook sets it on every rank.*pick another name"):
            generators.spawn(name, Policy, 2)
    assert dict(generators.run("str(device)").result()) == {0: "cpu", 1: "cpu"}
    generators.run("mine = 'precious'").result()
    with pytest.raises(RemoteError, match=r"\[0,1\] ValueError: this rank has a variable 'mine' \(a builtins.str\), "
                                          r"which the actor would replace: pick another actor name"):
        generators.spawn("mine", Policy, 2)
    assert dict(generators.run("mine").result()) == {0: "precious", 1: "precious"}
    named = generators.spawn("named", Policy, 2)
    generators.run("saved, device = device, 'rebound by a cell'").result()
    try:
        assert named.generate.call(torch.ones(1, 2)).result().ranks == [0, 1]
    finally:
        generators.run("device = saved; del saved").result()


def test_broadcast_failure_is_raised_by_the_next_call(two: tuple[meshbook.Mesh, meshbook.Mesh],
                                                      tmp_path: Path) -> None:
    """Each failed broadcast is raised once, by a later call, in order: two that failed before
    a call are not one raised and one lost. The second, queued behind the first's failure, is
    held back as a cell would be (it could pair its collectives with the ones the other ranks
    still issue in the failed call)."""
    _, generators = two
    caster = generators.spawn("caster", Policy, 2)
    go = tmp_path / "go"
    busy = generators.run(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)")
    caster.fail.broadcast("lost update")
    caster.fail.broadcast("second loss")  # both queued on every rank before the first runs
    go.touch()
    busy.result()
    with contextlib.suppress(RemoteError):  # a sync point: sent before the step check, it is held back too
        generators.run("None").result()
    with pytest.raises(RemoteError, match="lost update") as info:
        caster.where.call().result()
    assert "earlier caster.fail.broadcast" in str(info.value)
    with pytest.raises(RemoteError, match=r"\[0,1\] NotRun: not run: this rank failed a call of caster.fail before"):
        caster.where.call().result()
    assert caster.where.call().result().ranks == [0, 1]  # each said once


def test_respawn_drops_the_broadcasts_only_the_deaths_failed(tmp_path: Path) -> None:
    """After restart and respawn the next call goes through: a broadcast its rank's death
    failed is not raised again (the death failed the actor mesh, and was answered), while one
    that failed otherwise still is, once."""
    mesh = meshbook.start(2, name="phoenix")
    try:
        odd = mesh.spawn("odd", Odd, 2)
        odd.slice(rank=1).hold.broadcast(str(tmp_path / "started"))
        odd.slice(rank=0).fail.broadcast("said once")
        after = mesh.run("None", ranks=[0])
        # The failure on rank 0 is in once the run after it ended there (failed, if it was sent
        # before the step check of that failure), or waits behind that check: the check asks
        # rank 1 too, so it waits for the hold there, until the kill.
        _until(lambda: after.done() or "step check" in mesh.queued(after).get(0, ""))
        _until(lambda: (tmp_path / "started.1").exists())
        mesh.kill([1])
        with contextlib.suppress(RemoteError):
            after.result()
        _until(lambda: odd.failed)
        mesh.restart([1])
        odd.respawn()
        with pytest.raises(RemoteError, match=r"\[0\] ValueError: said once") as info:
            odd.where.call()
        assert "RankDied" not in info.value.render()
        assert dict(odd.where.call().result()) == {0: (0, {"world": 0}), 1: (1, {"world": 1})}
    finally:
        mesh.stop()


def test_ctrl_c_while_streaming_stops_the_endpoint(two: tuple[meshbook.Mesh, meshbook.Mesh], tmp_path: Path) -> None:
    """As in result(): the endpoint is interrupted on the ranks, then KeyboardInterrupt."""
    _, generators = two
    streamer = generators.spawn("streamer", Odd, 2)
    future = streamer.hold.call(str(tmp_path / "started"))
    try:
        pressed = _ctrl_c_when(tmp_path / "started", [0, 1], waiting_in="events_since")  # in the stream's wait
        with pytest.raises(KeyboardInterrupt):
            list(future.stream())
        _until(lambda: pressed)
        assert pressed == [True]
        with pytest.raises(RemoteError, match=r"\[0,1\] KeyboardInterrupt"):
            future.result(timeout=120)
    finally:
        future.run.interrupt()  # the endpoint never ends on its own


class Relay(meshbook.Actor):
    @meshbook.endpoint
    def pass_on(self, target: Any, seconds: float) -> Any:
        return target.nap.call(seconds).result(timeout=120)

    @meshbook.endpoint
    def fail_through(self, target: Any, message: str) -> Any:
        return target.fail.call(message).result(timeout=120)


def test_a_failure_in_a_call_an_endpoint_made_shows_where_it_ran(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    trainers, generators = two
    relay = trainers.narrow([0]).spawn("fail_relay", Relay)
    target = generators.spawn("fail_target", Policy, 2)
    with pytest.raises(RemoteError) as info:
        relay.fail_through.call_one(target, "bad batch").result(timeout=120)
    text = info.value.render()
    assert text.startswith("[0] meshbook.RemoteError: 2 ranks failed; first: [0,1] ValueError: bad batch"), text
    relayed = inspect.getsourcelines(Relay.fail_through)[1] + 2
    raised = inspect.getsourcelines(Policy.fail)[1] + 2
    assert f"{__file__}:{relayed}, in fail_through" in text, "where the endpoint made the call"
    assert "The call failed where it ran:\n    [0,1] ValueError: bad batch" in text, text
    assert f"{__file__}:{raised}, in fail" in text and "raise ValueError(message)" in text, "where it failed"


def test_interrupting_an_endpoint_stops_the_calls_it_made_to_other_ranks(two: tuple[meshbook.Mesh,
                                                                                      meshbook.Mesh]) -> None:
    """A call nested in an interrupted endpoint (an actor of one mesh calling another's) is
    interrupted too: it used to run on to its end, holding the other rank for a minute."""
    trainers, generators = two
    relay = trainers.narrow([0]).spawn("relay", Relay)
    napper = generators.narrow([1]).spawn("sleeper", Policy, 2)
    future = relay.pass_on.call_one(napper, 60)
    time.sleep(1.0)  # the nap has started, or still waits there: either way it must stop
    future.run.interrupt()
    with pytest.raises(RemoteError, match=r"\[0\] KeyboardInterrupt"):
        future.result(timeout=60)
    assert dict(generators.run("rank", ranks=[1]).result(timeout=30, echo=False)) == {1: 1}, "the nap went on"


def test_ctrl_c_while_awaiting_stops_the_endpoint(two: tuple[meshbook.Mesh, meshbook.Mesh], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio.run cancels the awaiting task on Ctrl-C: the endpoint is interrupted on the
    ranks, and the thread that waited for it finds the loop closed, quietly."""
    _, generators = two
    awaited = generators.spawn("awaited", Odd, 2)
    futures: list[Any] = []
    uncaught: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)

    async def wait_for_it() -> None:
        futures.append(awaited.hold.call(str(tmp_path / "started")))
        await futures[0]  # called and awaited in one step: the task waits once the ranks run it

    try:
        # Pressed once the loop waits (in select): the task is then at its one await. Pressed
        # before it got there (a loaded machine runs the ranks first), the Ctrl-C stopped the
        # code that was about to await, and nobody owned the call to stop it.
        pressed = _ctrl_c_when(tmp_path / "started", [0, 1], waiting_in="select")
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(wait_for_it())
        _until(lambda: pressed)
        assert pressed == [True]
        with pytest.raises(RemoteError, match=r"\[0,1\] KeyboardInterrupt"):
            futures[0].result(timeout=120)
        for thread in threading.enumerate():
            if thread.name == "meshbook-await":
                thread.join(60)
        assert uncaught == []
    finally:
        if futures:
            futures[0].run.interrupt()  # the endpoint never ends on its own


def _ctrl_c_when(started: Path, ranks: list[int], waiting_in: str | None = None) -> list[bool]:
    """Press Ctrl-C (SIGINT to the main thread) once every one of ``ranks`` runs the endpoint
    (touched ``started.RANK``) and the main thread is in function ``waiting_in``. The list
    returned gets True once pressed, or False if that never came (pressed anyway after two
    minutes, so that no wait hangs)."""
    pressed: list[bool] = []
    main = threading.main_thread()

    def ready() -> bool:
        if not all(Path(f"{started}.{r}").exists() for r in ranks):
            return False
        frame = sys._current_frames().get(main.ident)
        while waiting_in is not None and frame is not None and frame.f_code.co_name != waiting_in:
            frame = frame.f_back
        return frame is not None

    def press() -> None:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        was_ready = ready()
        signal.pthread_kill(main.ident, signal.SIGINT)
        pressed.append(was_ready)

    threading.Thread(target=press, name="ctrl-c", daemon=True).start()
    return pressed


def test_an_answer_the_calling_rank_cannot_read_fails_that_call_once(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """It is the target's error (as a result the notebook cannot read is), and the call is over:
    a second wait says the same, and choose() counts the target free again."""
    trainers, generators = two
    riddler = generators.spawn("riddler", Odd, 2)
    prober = trainers.spawn("prober", Prober)
    first, again, picked = prober.slice(rank=0).read_twice.call_one(riddler).result(timeout=120)
    assert first == again
    assert first.startswith("[0] UnreadableResult: the result (a ")
    assert "cannot be unpickled on rank 0, which called it: ModuleNotFoundError: No module named" in first
    assert picked == [0, 1]


def test_rank_to_rank_arguments_reuse_their_shared_segment(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """A target that let go of the arguments says so before answering, and the next call of
    that size writes over the same shared memory (no new memfd to fault in)."""
    trainers, generators = two
    reloaded = generators.spawn("reloaded", Policy, 1000)  # 4 MB of weights: shared, not sent
    prober = trainers.spawn("reloader", Prober)
    assert prober.slice(rank=0).reloads_in_place.call_one(reloaded, 1000).result(timeout=120)


def test_rl_weight_sync_rank_to_rank(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """Trainers push weights to the generators each step, rollouts come back to the notebook."""
    trainers, generators = two
    gens = generators.spawn("gens", Policy, 8)
    trainer = trainers.spawn("trainer", Trainer, 8)
    probe = torch.randn(3, 8)
    for step in range(3):
        rollouts = [gens.generate.choose(torch.randn(4, 8)).result() for _ in range(4)]
        assert trainer.step.call(rollouts).result().ranks == [0, 1]
        replicas = trainer.reference.call(probe).result()
        assert torch.equal(replicas[0], replicas[1])  # one replicated model, data parallel
        assert trainer.slice(rank=0).sync.call_one(gens).result() == [step + 1, step + 1]
        for out in gens.generate.call(probe).result().values():
            assert torch.equal(out, replicas[0])


def test_large_tensors_travel_rank_to_rank_through_shared_memory(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    """16 MiB arguments go through a shared segment, written over by the next call only once
    every target let go of it: a tensor an actor keeps is never overwritten."""
    trainers, generators = two

    class Summer(meshbook.Actor):
        @meshbook.endpoint
        def total(self, t: torch.Tensor) -> float:
            return float(t.sum())

        @meshbook.endpoint
        def keep(self, t: torch.Tensor) -> float:
            self.kept = t
            return float(t.sum())

        @meshbook.endpoint
        def kept_total(self) -> float:
            return float(self.kept.sum())

    summer = generators.spawn("summer", Summer)
    trainers.push(summer=summer)
    n = 1 << 22
    code = ("sums = [summer.total.call(torch.full((N,), float(i))).result()[1] for i in (1, 2, 3)]\n"
            "sums.append(summer.keep.call(torch.ones(N)).result()[0])\n"
            "sums.append(summer.total.call(torch.full((N,), 5.0)).result()[0])\n"
            "sums + [summer.kept_total.call().result()[0]]")
    trainers.push(N=n)
    sums = trainers.run(code, ranks=[1]).result()[1]
    assert sums == [float(n), 2.0 * n, 3.0 * n, float(n), 5.0 * n, float(n)]


def test_supervision_rank_death_respawn(two: tuple[meshbook.Mesh, meshbook.Mesh]) -> None:
    trainers, _ = two
    spare = meshbook.start(2, name="spare")
    try:
        events: list[meshbook.SupervisionEvent] = []
        watcher = trainers.spawn("watcher", Supervisor)
        sleepy = spare.spawn("sleepy", Policy, 2, supervisor=events.append)
        spare.spawn("watched", Policy, 2, supervisor=watcher)
        pending = sleepy.slice(rank=1).nap.call(30)  # rank 0 free: the death alone ends the call
        asked = trainers.spawn("asker", Trainer, 2).slice(rank=0).ask.call_one(sleepy.slice(rank=1), 30)
        time.sleep(1.0)
        spare.kill([1])
        with pytest.raises(RemoteError, match="rank 1 died: SIGKILL"):
            pending.result(timeout=30)
        with pytest.raises(RemoteError, match="rank 1 of mesh 'spare' died"):
            asked.result(timeout=30)  # the rank-to-rank call failed too
        with pytest.raises(MeshError, match=r"actor 'sleepy' failed: rank 1 died \(SIGKILL\).*respawn"):
            sleepy.where.call()
        _until(lambda: events and watcher.seen.call().result()[0])
        assert [(e.mesh, e.actor, e.rank) for e in events] == [("spare", "sleepy", 1)]
        assert "actor 'watched' on mesh 'spare' failed: rank 1 died" in watcher.seen.call().result()[0][0]
        with pytest.raises(MeshError, match="still dead: restart them first"):
            sleepy.respawn()
        spare.restart([1])
        with pytest.raises(MeshError, match=r"The rank\(s\) were restarted: sleepy.respawn\(\) builds it there again"):
            sleepy.where.call()
        assert "failed: rank 1 died" in repr(sleepy)
        sleepy.respawn()
        assert dict(sleepy.where.call().result()) == {0: (0, {"world": 0}), 1: (1, {"world": 1})}
    finally:
        spare.stop()
    with pytest.raises(MeshError, match="stopped"):
        sleepy.where.call()
    assert repr(sleepy).endswith(": its mesh is stopped>")
    # The whole mesh stopped: each supervisor hears it once, for each actor mesh it watches.
    _until(lambda: len(events) == 2 and len(watcher.seen.call().result()[0]) == 2)
    assert [(e.mesh, e.actor, e.rank) for e in events] == [("spare", "sleepy", 1), ("spare", "sleepy", None)]
    assert str(events[1]) == "actor 'sleepy' on mesh 'spare' failed: its mesh stopped (stopped by the user)"
    assert watcher.seen.call().result()[0][1] == ("actor 'watched' on mesh 'spare' failed: its mesh stopped "
                                                  "(stopped by the user)")


def _until(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
