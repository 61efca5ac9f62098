"""The planner's traces, one per family, in real planner processes (fake process group, fake
tensors, torch's memory tracker): each shows the memory and traffic its family is known for.

These pin the private torch APIs the planner stands on (FakeTensorMode over FSDP2, the fake
process group, MemTracker/FSDPMemTracker, replicate): a torch release that moves one fails here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from bench import models
from meshbook.mesh.controller.api.planners import Planners
from meshbook.mesh.protocol.layout import Layout, ModelFacts
from meshbook.mesh.protocol.plan import Trace

BUILD = partial(models.gpt, vocab=512, dim=128, layers=4, heads=4)
BATCH = (8, 32)


@pytest.fixture(scope="module")
def planner() -> Iterator[Planners]:
    with Planners(1) as pool:
        yield pool


@pytest.fixture(scope="module")
def facts(planner: Planners) -> ModelFacts:
    return planner.ask(0, "inspect", BUILD)


def trace(planner: Planners, facts: ModelFacts, layout: Layout) -> Trace:
    found = planner.ask(0, "trace", BUILD, layout, facts, BATCH, "adamw")
    assert not found.error and not found.untraceable, found
    return found


def kind(t: Trace, name: str, stage: int = 0) -> int:
    return t.stages[stage].peak.get(name, 0)


def test_inspect_reads_blocks_heads_stages_and_the_input(facts: ModelFacts) -> None:
    assert facts.blocks == "Block" and facts.n_blocks == 4 and facts.stages == 7
    assert facts.vocab == 512 and facts.tp_reason == ""
    assert ("num heads", 4) in facts.tp_divides
    assert facts.params == sum(p.numel() for p in BUILD().parameters())


def test_a_fused_qkv_projection_is_no_tensor_parallel_block(planner: Planners) -> None:
    """nanoGPT's c_attn makes q, k and v in one linear, which tensor parallelism does not split,
    while its c_proj is split by rows: planned, the layouts were INVALID with a shape error."""
    fused = planner.ask(0, "inspect", models.fused_qkv)
    assert fused.tp_reason == ("the linears that feed attn.c_proj split by columns, as q_proj/k_proj/v_proj are; "
                               "attn.c_attn beside it is not (a fused projection, such as c_attn or wqkv, is not "
                               "split)"), fused.tp_reason
    assert models.fused_qkv()(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 512)


def test_one_rank_holds_every_parameter_and_adam_state_twice_over(planner: Planners, facts: ModelFacts) -> None:
    one = trace(planner, facts, Layout())
    assert kind(one, "parameters") == facts.param_bytes
    steps = 4 * len(list(BUILD().parameters()))  # AdamW's step count, a float32 per parameter
    assert kind(one, "optimizer") == 2 * facts.param_bytes + steps  # exp_avg and exp_avg_sq
    assert one.stages[0].flops > 0 and one.stages[0].comm == {}


def test_ranks_on_cuda_are_traced_with_the_multi_tensor_step(planner: Planners) -> None:
    """On CUDA, torch's AdamW steps all parameters at once, holding temporaries the size of the
    parameters: where model state outweighs activations, that is the peak (the CPU's loop holds
    one parameter's). The planner traces on the CPU, so it must ask for the CUDA step."""
    build = partial(models.gpt, vocab=512, dim=256, layers=2, heads=4)
    facts = planner.ask(0, "inspect", build)
    on = {device: planner.ask(0, "trace", build, Layout(), facts, (1, 8), "adamw", device).stages[0].peak
          for device in ("cpu", "cuda")}
    assert on["cuda"]["optimizer"] - on["cpu"]["optimizer"] >= facts.param_bytes // 2, on
    # Tensor parallelism alone leaves the embeddings and norms plain beside DTensors, which the
    # multi-tensor step refuses ("got mixed torch.Tensor and DTensor"): those step in a loop.
    tp = planner.ask(0, "trace", build, Layout(tp=2), facts, (1, 8), "adamw", "cuda")
    assert not tp.error, tp.error


def test_fsdp_shards_state_and_gathers_it(planner: Planners, facts: ModelFacts) -> None:
    fsdp = trace(planner, facts, Layout(dp_shard=4))
    assert kind(fsdp, "optimizer") <= facts.param_bytes * 2 / 4 * 1.05
    assert fsdp.stages[0].comm["all_gather"] > 0 and fsdp.stages[0].comm["reduce_scatter"] > 0
    held = fsdp.stages[0]  # gloo's scratch, at the moment its biggest collective starts
    assert 0 < held.scratch <= 4 / 3 * held.comm["reduce_scatter"] and held.at_collective["temporaries"] >= held.scratch
    hsdp = trace(planner, facts, Layout(dp_replicate=2, dp_shard=2))
    assert kind(hsdp, "optimizer") > kind(fsdp, "optimizer")  # sharded over 2, not 4
    assert hsdp.stages[0].comm.get("all_reduce", 0) > 0  # gradients across replicas


def test_replicate_keeps_a_full_copy_and_all_reduces(planner: Planners, facts: ModelFacts) -> None:
    ddp = trace(planner, facts, Layout(dp_replicate=4))
    assert kind(ddp, "optimizer") >= 2 * facts.param_bytes
    assert ddp.stages[0].comm["all_reduce"] >= facts.param_bytes  # every gradient, once


def test_tensor_parallel_splits_the_blocks(planner: Planners, facts: ModelFacts) -> None:
    one, tp = trace(planner, facts, Layout()), trace(planner, facts, Layout(tp=2))
    assert kind(tp, "parameters") < kind(one, "parameters") * 0.8
    assert tp.stages[0].comm["all_reduce"] > 0  # row-wise outputs summed
    assert tp.stages[0].flops < one.stages[0].flops


def test_checkpointing_trades_activations_for_recompute(planner: Planners, facts: ModelFacts) -> None:
    none, block = trace(planner, facts, Layout()), trace(planner, facts, Layout(checkpointing="block"))
    assert kind(block, "activations") < kind(none, "activations") / 2
    assert block.stages[0].flops > none.stages[0].flops  # forwards run again


def test_pipeline_stages_are_traced_each_on_their_rank(planner: Planners, facts: ModelFacts) -> None:
    pp = trace(planner, facts, Layout(pp=2, microbatches=4))
    assert [s.rank for s in pp.stages] == [0, 1]  # pp is the outermost dimension
    assert sum(kind(pp, "parameters", s) for s in (0, 1)) == facts.param_bytes
    # Both ends of the one link send and receive: activations on, gradients back.
    assert pp.stages[0].comm["p2p"] == pp.stages[1].comm["p2p"] > 0
    assert pp.stages[0].collectives == pp.stages[1].collectives == 2 * 4
    assert all(s.microbatch_activations > 0 for s in pp.stages)


def test_a_data_dependent_op_is_untraceable_and_named(planner: Planners, facts: ModelFacts) -> None:
    found = planner.ask(0, "trace", partial(models.gpt, layers=2), Layout(), facts, (2, 8), "adamw")
    assert found.stages  # the same model traces
    bad = planner.ask(0, "inspect", NonzeroNet)
    result = planner.ask(0, "trace", NonzeroNet, Layout(dp_shard=2), bad, (4,), "adamw")
    assert "nonzero" in result.untraceable
    (estimate,) = result.stages  # the model state from its parameter count, sharded two ways
    assert estimate.peak == {"parameters": bad.param_bytes // 2, "gradients": bad.param_bytes // 2,
                             "optimizer": bad.param_bytes}


def test_tracing_a_candidate_takes_seconds_not_minutes(planner: Planners, facts: ModelFacts) -> None:
    """Not a timing assertion on a loaded machine: a bound 15x the ~1 s it takes."""
    started = time.monotonic()
    trace(planner, facts, Layout(dp_shard=2, tp=2))
    assert time.monotonic() - started < 15


class NonzeroNet(models.Residual):
    """A block whose output shape depends on the data."""

    def __init__(self) -> None:
        super().__init__(64)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return super().forward(x)[x[:, 0].nonzero()]
