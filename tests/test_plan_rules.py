"""Planning's pure parts, without processes: which layouts exist, why the others are dropped,
and how a trace and the ranks' measurements become a row of the report.

Every rule here decides what a user is told ("tp 4 > 2 ranks per host", "OOM (+1 GiB on rank
3: activations ...)"), so each is checked on its own; :mod:`hypothesis` checks the
enumeration for any world size.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from meshbook.mesh.protocol.layout import (
    Layout,
    ModelFacts,
    bubble,
    candidates,
    factorisations,
    in_flight,
    split_points,
    stage_of,
    warm_up_layouts,
    why_invalid,
)
from meshbook.mesh.protocol.plan import Probe, StageTrace, Trace, mark_dominated, predict

GPT = ModelFacts(cls="Sequential", params=10, param_bytes=40, blocks="Block", n_blocks=4, stages=7,
                 tp_reason="", tp_divides=(("num heads", 4), ("mlp.up_proj outputs", 512)), vocab=512)
MLP_NO_BLOCKS = ModelFacts(cls="Net", params=10, param_bytes=40, pp_reason="a model that is a sequence of stages")
PROBE = Probe(overhead=100, flops_per_s=1e9, bandwidth=1e9, budget=10_000)


@given(st.integers(min_value=1, max_value=64))
def test_factorisations_are_every_ordered_split_of_the_world_once(world: int) -> None:
    found = list(factorisations(world))
    assert len(found) == len(set(found))
    assert all(math.prod(f) == world for f in found)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    brute = {(a, b, c, world // (a * b * c)) for a in divisors for b in divisors for c in divisors
             if world % (a * b * c) == 0}
    assert set(found) == brute


def test_tp_is_dropped_with_the_reason_a_user_can_act_on() -> None:
    assert why_invalid(Layout(tp=4), GPT, 8, per_host=2) == (
        "tp 4 > 2 ranks per host (tensor parallelism stays within a host)")
    three = ModelFacts(**{**GPT.__dict__, "tp_divides": (("num heads", 6),)})
    assert why_invalid(Layout(tp=4), three, 8, per_host=8) == "num heads 6 not divisible by tp 4"
    assert why_invalid(Layout(tp=2), MLP_NO_BLOCKS, 8, per_host=8).startswith("tp needs repeated blocks")


def test_pp_batch_and_checkpointing_are_checked_before_tracing() -> None:
    assert why_invalid(Layout(pp=2), MLP_NO_BLOCKS, 8, 8).startswith("pp needs a model that is a sequence")
    assert why_invalid(Layout(pp=8), GPT, 8, 8) == "pp 8 > 7 pieces to split into stages"
    assert why_invalid(Layout(dp_shard=3), GPT, 8, 8) == "batch 8 not divisible by dp 3"
    assert why_invalid(Layout(pp=2, microbatches=8), GPT, 4, 8) == (
        "batch per data-parallel rank 4 not divisible by 8 micro-batches")
    assert why_invalid(Layout(checkpointing="block"), MLP_NO_BLOCKS, 8, 8).startswith("activation checkpointing")
    assert why_invalid(Layout(dp_shard=2, tp=2), GPT, 8, 8) == ""


def test_candidates_vary_only_what_applies() -> None:
    found = candidates(4, GPT, 8, per_host=4)
    assert all(lay.world == 4 for lay in found.valid)
    assert not [lay for lay in found.valid if lay.pp == 1 and lay.microbatches != 1]
    assert not [lay for lay in found.valid if lay.dp_shard == 1 and not lay.reshard]
    assert {lay.checkpointing for lay in found.valid} == {"none", "block", "selective"}
    assert {lay.schedule for lay in found.valid if lay.pp > 1} == {"1f1b", "gpipe"}
    none = candidates(4, MLP_NO_BLOCKS, 8, per_host=4)
    assert {(lay.tp, lay.pp, lay.checkpointing) for lay in none.valid} == {(1, 1, "none")}
    assert {r.reason.split(" ")[0] for r in none.rejected} == {"tp", "pp"}


def test_pipeline_arithmetic() -> None:
    assert split_points(7, 3) == [(0, 3), (3, 5), (5, 7)]
    one_f = Layout(pp=4, microbatches=8, schedule="1f1b")
    gpipe = Layout(pp=4, microbatches=8, schedule="gpipe")
    assert [in_flight(one_f, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(gpipe, s) for s in range(4)] == [8, 8, 8, 8]
    assert bubble(one_f) == 3 / 11 and bubble(Layout()) == 0
    assert [stage_of(Layout(pp=2, dp_shard=2), r) for r in range(4)] == [0, 0, 1, 1]
    assert Layout(pp=2, dp_shard=2, tp=2).dims == {"pp": 2, "dp_shard": 2, "tp": 2}
    assert Layout().dims == {"dp_shard": 1} and Layout().family == "1 rank"
    assert Layout(dp_replicate=2, dp_shard=2, tp=2).family == "HSDP+TP"


def stage(rank: int, activations: int, flops: float = 1e9, **comm: int) -> StageTrace:
    peak = {"parameters": 1000, "gradients": 1000, "optimizer": 2000, "activations": activations, "temporaries": 0}
    return StageTrace(stage=rank, rank=rank, peak=peak, microbatch_activations=activations,
                      flops=flops, comm=comm)


def test_a_row_adds_the_process_overhead_and_says_what_does_not_fit() -> None:
    row = predict(Trace(Layout(), (stage(0, 1000),), 0.1), PROBE)
    assert row.peak == 5100 and row.status == "OK" and row.memory["overhead"] == 100
    oom = predict(Trace(Layout(), (stage(0, 9000),), 0.1), PROBE)
    assert oom.status == "OOM" and oom.reason == "+3.0 KiB on rank 0: activations 8.8 KiB"


def test_pipelined_stages_hold_their_micro_batches_in_flight() -> None:
    layout = Layout(pp=2, microbatches=4, schedule="1f1b")
    row = predict(Trace(layout, (stage(0, 500), stage(1, 500)), 0.1), PROBE)
    assert row.stage_peaks == {0: 4000 + 2 * 500 + 100, 1: 4000 + 500 + 100}
    assert row.worst_rank == 0
    gpipe = predict(Trace(Layout(pp=2, microbatches=4, schedule="gpipe"), (stage(0, 500), stage(1, 500)), 0.1), PROBE)
    assert gpipe.stage_peaks == {0: 6100, 1: 6100}


def test_step_time_prices_flops_exposed_traffic_and_the_bubble() -> None:
    fsdp = predict(Trace(Layout(dp_shard=2), (stage(0, 0, 1e9, all_gather=10**8, reduce_scatter=10**8),), 0.1),
                   PROBE)
    assert fsdp.time["compute"] == 1.0 and fsdp.time["communication"] == 0.0  # hidden behind compute
    ddp = predict(Trace(Layout(dp_replicate=2), (stage(0, 0, 1e9, all_reduce=10**9),), 0.1), PROBE)
    assert ddp.time["communication"] == 1.0
    pp = predict(Trace(Layout(pp=2, microbatches=2), (stage(0, 0, 1e9), stage(1, 0, 1e9)), 0.1), PROBE)
    assert abs(pp.time["bubble"] - 1.0 * (1 / 3) / (2 / 3)) < 1e-9
    # The pace is the slowest stage's, traffic included: a first stage with few FLOPs but a
    # link's worth of traffic is slower than a last one with more FLOPs (head and loss).
    link = predict(Trace(Layout(pp=2, microbatches=2), (stage(0, 0, 1e9, p2p=2 * 10**9), stage(1, 0, 2e9)), 0.1),
                   PROBE)
    assert (link.time["compute"], link.time["communication"]) == (1.0, 2.0)
    ac = predict(Trace(Layout(checkpointing="block"), (stage(0, 0, 4e9),), 0.1), PROBE)
    assert ac.time["recompute"] == 1.0 and ac.time["compute"] == 3.0


def test_an_invalid_row_shows_its_error_on_one_line() -> None:
    """A trace's error is a traceback: its many lines broke the report's text table."""
    from meshbook.mesh.controller.api.plan import PlanReport

    error = "RuntimeError: shapes differ\n  at line 3\n"
    row = predict(Trace(Layout(tp=2), (stage(0, 1000),), 0.1, error=error), PROBE)
    assert (row.status, row.summary, row.reason) == ("INVALID", "RuntimeError: shapes differ", error)
    table = repr(PlanReport([row], [], GPT, PROBE, PROBE.budget, (8, 16), 0.1, []))
    assert "INVALID (RuntimeError: shapes differ)" in table and "line 3" not in table, table


def test_a_row_beaten_in_memory_and_time_is_dominated() -> None:
    fast_small = predict(Trace(Layout(dp_shard=2), (stage(0, 100, 1e9),), 0.1), PROBE)
    slow_big = predict(Trace(Layout(dp_replicate=2), (stage(0, 900, 2e9),), 0.1), PROBE)
    slow_small = predict(Trace(Layout(pp=2, microbatches=2), (stage(0, 0, 3e9),), 0.1), PROBE)
    rows = [fast_small, slow_big, slow_small]
    mark_dominated(rows)
    assert [r.status for r in rows] == ["OK", "DOMINATED", "OK"]
    assert slow_big.reason == "by #1 (2.0x slower)"


def test_an_untraceable_model_gets_an_estimate_labelled_so() -> None:
    estimate = StageTrace(stage=0, rank=0, peak={"parameters": 100, "gradients": 100, "optimizer": 200})
    row = predict(Trace(Layout(), (estimate,), 0.1, untraceable="aten.nonzero.default"), PROBE)
    assert (row.status, row.reason) == ("UNTRACEABLE", "aten.nonzero.default: analytic estimate, "
                                                       "activations not counted")
    assert row.peak == 500
    too_big = predict(Trace(Layout(), (estimate,), 0.1, untraceable="aten.nonzero.default"),
                      Probe(overhead=100, flops_per_s=1e9, bandwidth=1e9, budget=300))
    assert too_big.status == "OOM"  # even the model state alone does not fit


def test_a_stage_peaks_with_its_micro_batches_in_flight_or_where_the_trace_peaked() -> None:
    layout = Layout(pp=2, microbatches=4, schedule="1f1b")
    first, last = (StageTrace(stage=s, rank=s, peak={"parameters": 1000, "activations": 300},
                              microbatch_activations=200) for s in (0, 1))
    row = predict(Trace(layout, (first, last), 0.1), PROBE)
    assert row.stage_peaks == {0: 1000 + 2 * 200 + 100, 1: 1000 + 300 + 100}  # 2 in flight; the traced peak


def test_micro_batches_in_flight_sit_on_the_state_between_steps_not_on_the_optimizer_step() -> None:
    """GPipe's last stage holds every micro-batch's output and loss graph at once, on top of
    the optimizer's state as it is between steps: the optimizer step's own temporaries (in the
    traced peak) never coincide with a forward."""
    layout = Layout(pp=2, microbatches=8, schedule="gpipe")
    peak = {"parameters": 1000, "gradients": 1000, "optimizer": 4000, "activations": 0, "temporaries": 0}
    rest = {"parameters": 1000, "optimizer": 2000}
    last = StageTrace(stage=1, rank=1, peak=peak, at_rest=rest, microbatch_activations=600)
    row = predict(Trace(layout, (last,), 0.1), PROBE)
    assert row.stage_peaks == {1: 1000 + 2000 + 1000 + 8 * 600 + 100}
    few = StageTrace(stage=1, rank=1, peak=peak, at_rest=rest, microbatch_activations=100)
    assert predict(Trace(layout, (few,), 0.1), PROBE).stage_peaks == {1: 6000 + 100}  # the step's peak is higher


def test_times_within_one_percent_are_a_tie_not_a_ranking() -> None:
    a = predict(Trace(Layout(dp_shard=2), (stage(0, 100, 1e9),), 0.1), PROBE)
    b = predict(Trace(Layout(dp_shard=2, checkpointing="block"), (stage(0, 100, 1.004e9),), 0.1), PROBE)
    mark_dominated([a, b])
    assert a.status == b.status == "OK"


def test_cpu_rows_take_the_peak_at_a_collective_with_gloos_scratch_and_the_layouts_process_groups() -> None:
    probe = Probe(overhead=100, flops_per_s=1e9, bandwidth=1e9, budget=10**9, per_group=10)
    at = {"parameters": 600, "temporaries": 300 + 400}  # a 300-byte reduce-scatter's input and 4/3 of it
    traced = StageTrace(stage=0, rank=0, peak={"parameters": 1000, "activations": 200}, at_collective=at)
    row = predict(Trace(Layout(dp_replicate=2, dp_shard=2), (traced,), 0.1), probe)
    assert row.memory["temporaries"] == 700 and row.memory["activations"] == 0  # the collective's moment
    assert row.memory["overhead"] == 100 + 2 * 10  # two mesh dimensions, a group each
    below = StageTrace(stage=0, rank=0, peak={"parameters": 1000, "activations": 500}, at_collective=at)
    assert predict(Trace(Layout(dp_shard=4), (below,), 0.1), probe).memory["activations"] == 500
    gpu = predict(Trace(Layout(dp_shard=4), (traced,), 0.1), Probe(0, 1e9, 1e9, 10**9, device="cuda", per_group=10))
    assert gpu.memory["temporaries"] == 0 and gpu.memory["overhead"] == 10 + int(1200 * 0.05)  # no gloo
    stages = Layout(pp=2, dp_shard=2, microbatches=4)  # FSDP inside each stage, 2 micro-batches in flight
    piped = StageTrace(stage=0, rank=0, peak={"parameters": 1000}, at_rest={"parameters": 1000},
                       microbatch_activations=300, scratch=400)
    assert predict(Trace(stages, (piped,), 0.1), probe).memory["temporaries"] == 400  # on top of 2 x 300 in flight
    assert predict(Trace(stages, (piped,), 0.1), Probe(0, 1e9, 1e9, 10**9, device="cuda")).memory["temporaries"] == 0


def test_the_ranks_warm_up_on_a_few_layouts_that_use_every_parallelism_the_candidates_use() -> None:
    layouts = [Layout(), Layout(dp_shard=4), Layout(dp_shard=4, checkpointing="block"), Layout(dp_shard=2, tp=2),
               Layout(dp_replicate=2, dp_shard=2), Layout(pp=2, dp_shard=2, microbatches=2),
               Layout(pp=2, dp_shard=2, microbatches=4), Layout(pp=4, microbatches=4, schedule="gpipe")]
    assert warm_up_layouts(layouts) == (layouts[3], layouts[4], layouts[5], layouts[7])
    assert warm_up_layouts(layouts[:3]) == (layouts[1],)
    assert warm_up_layouts([Layout()]) == ()  # one rank's layout runs no mesh
