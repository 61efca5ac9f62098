"""The controller's book of ranks and runs, without processes or sockets: events in, decisions out.

What the book decides is what a mesh's correctness rests on (which runs a death fails, which
live ranks it strands, when a step check must start, where late output goes), so each rule is
checked here on its own, with :mod:`hypothesis` for the bookkeeping that must hold for any
order of answers.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshbook.mesh.controller.core.book import LATE_OUTPUT_RUNS, RankBook
from meshbook.mesh.controller.core.run import Run
from meshbook.mesh.protocol import messages as msg
from meshbook.mesh.protocol.errors import RankFailure
from meshbook.mesh.protocol.events import Error, Output, Result, Results
from meshbook.mesh.protocol.topology import Topology


def book(world: int = 4, per_host: int = 4) -> RankBook:
    return RankBook({r: r // per_host for r in range(world)})


def run_on(b: RankBook, ranks: list[int], kind: str = msg.EXEC, queued: bool = True) -> Run:
    run = Run(next(b.request_ids), ranks, Topology.create(len(b.ranks)), "test", lambda run: None,
              lambda rank, text: None, kind)
    b.open(run, queued)
    return run


def answer(b: RankBook, run: Run, rank: int, ok: bool = True, lost_group: bool = False):  # type: ignore[no-untyped-def]
    event = Result(rank, rank, 0.0) if ok else Error(rank, RankFailure(rank, "ValueError", "bad"), 0.0)
    decided = b.answered(run.id, (rank,), not ok, lost_group)
    run.add_event(event)
    b.settle(run.id)
    return decided


def answer_group(b: RankBook, run: Run, ranks: tuple[int, ...], lost_group: bool = False):  # type: ignore[no-untyped-def]
    """Results an agent bundled: one event for several ranks."""
    event = Results(ranks, (None,) * len(ranks), (0.5,) * len(ranks))
    decided = b.answered(run.id, ranks, False, lost_group)
    run.add_event(event)
    b.settle(run.id)
    return decided


def test_ranks_are_busy_while_a_queued_run_is_theirs_and_idle_after() -> None:
    b = book()
    for r in range(4):
        b.ready(r, 0, "cpu", 100 + r, "")
    run = run_on(b, [0, 1])
    assert [b.ranks[r].state for r in range(4)] == ["busy", "busy", "idle", "idle"]
    assert answer(b, run, 0).done is False
    assert b.ranks[0].state == "idle" and b.current_request(1) == run.id
    assert answer(b, run, 1).done is True
    assert run.id not in b.runs and b.queued(1) == 0


def test_a_control_run_queues_nothing() -> None:
    b = book()
    run = run_on(b, [0], kind=msg.CALL, queued=False)
    assert b.queued(0) == 0 and b.runs[run.id] is run


def test_a_failed_or_interrupted_user_run_asks_for_a_step_check_with_its_first_failure_or_last_answer() -> None:
    b = book()
    run = run_on(b, [0, 1, 2])
    assert answer(b, run, 0).check_step is False, "a rank that finished: nothing to check yet"
    assert answer(b, run, 1, ok=False).check_step is True, "a failure while rank 2 still runs it: at once"
    assert answer(b, run, 2).check_step is True, "the last answer of a run that went wrong"
    interrupted = run_on(b, [0, 1])
    interrupted.interrupted = True
    assert answer(b, interrupted, 0).check_step is False
    assert answer(b, interrupted, 1).check_step is True
    lost = run_on(b, [2])
    assert answer(b, lost, 2, lost_group=True).check_step is True, "a rank that lost its group"


def test_meshbooks_own_operations_are_never_step_checked() -> None:
    b = book()
    run = run_on(b, [0], kind=msg.CALL)
    assert answer(b, run, 0, ok=False).check_step is False


def test_a_death_fails_the_runs_waiting_on_it_and_strands_their_other_ranks() -> None:
    b = book()
    cell = run_on(b, [0, 1, 2, 3])
    elsewhere = run_on(b, [3])
    answer(b, cell, 0)
    death = b.died([1], "SIGKILL")
    assert death.running == {1: cell.id}
    assert death.waiting == [cell]
    assert death.stranded == [2, 3], "rank 0 finished; ranks 2 and 3 may wait in a collective with 1"
    assert b.ranks[1].state == "dead" and b.ranks[1].cause == "SIGKILL" and b.queued(1) == 0
    assert elsewhere not in death.waiting
    assert [s.rank for s in b.dead()] == [1]


_LIFE = st.lists(st.tuples(st.sampled_from(["died", "respawning", "ready", "failed", "adopt", "stopped"]),
                           st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)), max_size=12)


@given(_LIFE, st.lists(st.integers(0, 5), unique=True))
def test_the_dead_the_book_keeps_aside_are_the_ranks_whose_state_is_dead(life, asked) -> None:  # type: ignore[no-untyped-def]
    """Every request asks which of its ranks are dead, and the book answers from the ranks it
    keeps aside instead of looking at each of a thousand ranks: whatever the ranks went
    through, that answer is the one their states give."""
    b = book(world=6, per_host=3)
    for what, ranks in life:
        if what == "died":
            b.died(ranks, "SIGKILL")
        elif what == "respawning":
            b.respawning(ranks)
        elif what == "ready":
            for r in ranks:
                b.ready(r, b.generation, "cpu", 100 + r, "")
        elif what == "failed":
            for r in ranks:
                b.init_failed(r, b.generation, "refused")
        elif what == "adopt":
            b.adopt({str(r): 1 for r in ranks[1:]}, [str(ranks[0])], "node1")
        else:
            b.stopped("mesh stopped")
    dead = [r for r, s in b.ranks.items() if s.state == "dead"]
    assert [s.rank for s in b.dead()] == dead
    assert [s.rank for s in b.dead(asked)] == sorted(set(asked) & set(dead))
    assert b.live(asked) == [r for r in asked if r not in dead]


def test_a_lost_host_kills_its_ranks_together() -> None:
    b = book(world=4, per_host=2)
    cell = run_on(b, [0, 1, 2, 3])
    death = b.died([2, 3], "host lost")
    assert death.waiting == [cell] and death.stranded == [0, 1]
    assert b.startup([0, 1, 2, 3], 0) == (False, [b.ranks[2], b.ranks[3]])


def test_startup_waits_for_every_rank_of_the_generation_and_names_the_failed() -> None:
    b = book(world=2)
    assert b.startup([0, 1], 0) == (False, [])
    b.ready(0, 0, "cpu", 10, "")
    b.init_failed(1, 0, "connection refused")
    ready, failed = b.startup([0, 1], 0)
    assert failed == [b.ranks[1]] and "connection refused" in b.ranks[1].cause
    b.died([1], "exit code 1")  # the failed rank then exits: why it failed still shows
    assert b.ranks[1].cause == ("torch.distributed did not initialise: connection refused; then it exited "
                                "(exit code 1)")
    b.respawning([1])
    generation = b.new_generation()
    assert b.not_ready([0, 1], generation) == [0, 1]
    b.ready(1, generation, "cpu", 11, "")
    b.ready(0, generation, "cpu", 10, "")
    assert b.startup([0, 1], generation) == (True, []) and b.ranks[1].lost_namespace
    b.respawning([0])  # re-forked after it joined (a recovery gave up on it): of the generation, not ready
    assert b.not_ready([0, 1], generation) == [0] and b.startup([0, 1], generation) == (False, [])


def test_attaching_adopts_the_newest_generation_and_the_ranks_that_died_meanwhile() -> None:
    b = book()
    b.adopt({"0": 2, "1": 3, "2": 3}, ["3"], "node1")
    assert b.generation == 3
    assert [(s.state, s.generation) for s in b.ranks.values()][:3] == [("idle", 3)] * 3
    assert b.ranks[3].state == "dead" and "no kernel was attached" in b.ranks[3].cause


def test_late_output_goes_to_the_run_that_started_it_for_a_while() -> None:
    b = book()
    run = run_on(b, [0])
    late: list[Output] = []
    run.on_late_output = late.append
    assert b.route(run.id) is run
    answer(b, run, 0)
    route = b.route(run.id)
    assert route is not run and callable(route), "a retired run is reached through its late-output route"
    route(Output(0, "stdout", "from a thread the cell started\n"))
    assert [e.text for e in late] == ["from a thread the cell started\n"]
    for _ in range(LATE_OUTPUT_RUNS):
        answer(b, run_on(b, [0]), 0)
    assert b.route(run.id) is None, "only the most recent runs keep a route"


def test_what_a_run_was_is_known_in_flight_and_for_a_while_after() -> None:
    """A message that names another cell ("paired with the one rank 0 issued in cell [3]")
    finds it whether it still runs or has ended lately."""
    b = book()
    run = run_on(b, [0])
    assert b.what(run.id) == "test" and b.what(run.id + 1) is None
    answer(b, run, 0)
    assert b.what(run.id) == "test", "retired, still named"
    for _ in range(LATE_OUTPUT_RUNS):
        answer(b, run_on(b, [0]), 0)
    assert b.what(run.id) is None, "only as long as its late output is routed"


def test_results_found_wrong_after_they_were_booked_become_failures() -> None:
    """Revoked: the value goes, the failure is told after what came, the run still ends once."""
    b = book()
    run = run_on(b, [0, 1, 2])
    answer_group(b, run, (0, 1))
    run.revoke({1: RankFailure(1, "CollectiveMispaired", "paired with another request's")})
    answer(b, run, 2)
    assert run.done() and run.values().keys() == {0, 2} and run.failed_ranks() == {1}
    assert [type(e).__name__ for e in run.events()] == ["Result", "Result", "Error", "Result"]


def test_what_runs_where() -> None:
    b = book()
    first, second = run_on(b, [0]), run_on(b, [0])
    assert b.busy_with_other(0, second.id) and not b.busy_with_other(0, first.id)
    own = run_on(b, [1], kind=msg.CALL)
    assert b.own_work(own.id) == "test" and b.own_work(first.id) == ""
    assert b.pending_on([0]) == [first, second]


@given(st.permutations([(r, ok) for r, ok in zip(range(4), [True, False, True, True])]))
def test_any_order_of_answers_ends_the_run_once_and_frees_every_queue(order) -> None:  # type: ignore[no-untyped-def]
    b = book()
    run = run_on(b, [0, 1, 2, 3])
    done = [answer(b, run, rank, ok).done for rank, ok in order]
    assert done == [False, False, False, True]
    assert run.id not in b.runs and all(b.queued(r) == 0 for r in range(4))
    assert run.failed_ranks() == {1}


def test_a_group_of_results_is_booked_as_each_rank_answering() -> None:
    b = book(8, per_host=4)
    for r in range(8):
        b.ready(r, 0, "cpu", 100 + r, "")
    run = run_on(b, list(range(8)))
    first = answer_group(b, run, (0, 1, 2, 3))
    assert first.run is run and not first.done
    assert run.pending == [4, 5, 6, 7] and run.first_done_at is not None
    assert [b.ranks[r].state for r in range(8)] == ["idle"] * 4 + ["busy"] * 4
    last = answer_group(b, run, (4, 5, 6, 7))
    assert last.done and not last.check_step and run.done() and run.id not in b.runs
    assert dict(run.values()) == dict.fromkeys(range(8)) and run.durations == dict.fromkeys(range(8), 0.5)
    # Readers see one Result per rank, in the group's order.
    assert [(e.rank, e.value) for e in run.events()] == [(r, None) for r in range(8)]


def test_a_group_that_loses_its_process_group_ends_the_run_irregularly() -> None:
    b = book(4)
    run = run_on(b, [0, 1, 2, 3])
    answer(b, run, 0)
    assert answer_group(b, run, (1, 2, 3), lost_group=True).check_step


def test_a_group_keeps_only_the_ranks_that_had_not_answered() -> None:
    b = book(4)
    run = run_on(b, [0, 1, 2, 3])
    answer(b, run, 1, ok=False)  # e.g. its death came first
    answer_group(b, run, (0, 1, 2))
    assert run.pending == [3] and set(run.values()) == {0, 2} and run.failed_ranks() == {1}
    answer_group(b, run, (1, 2))  # nothing new: no event
    assert sum(1 for _ in run.events_since(0, 0)[0]) == 2
