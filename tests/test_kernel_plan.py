"""%mesh plan and %mesh parallelize end to end: a model defined in a notebook cell, planned in
planner processes and applied on the ranks, through a real kernel driven by jupyter_client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jupyter_kernels import Kernel, kernel_with_mesh

MODEL = '''
from torch import nn

class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(x)))

def build():
    return nn.Sequential(nn.Linear(16, 32), *[Block(32) for _ in range(3)], nn.Linear(32, 16))
'''


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    yield from kernel_with_mesh("%mesh start -n 2")


def test_plan_a_notebook_model_then_apply_the_best(kernel: Kernel) -> None:
    kernel.ok(MODEL)
    reply = kernel.ok("%mesh plan --build build --batch 8 --checkpointing none --no-pp --out report", timeout=300)
    (result,) = reply.of_type("execute_result")
    assert "text/html" in result["content"]["data"]
    assert "process overhead" in result["content"]["data"]["text/plain"]
    assert kernel.value("sorted({r.layout.family for r in report.rows})") == ["DDP", "FSDP", "TP"]
    (applied,) = kernel.ok("%mesh parallelize --build build --row 1").of_type("execute_result")
    assert "model, optimizer, step: its part of" in applied["content"]["data"]["text/plain"]
    # DDP and FSDP make every parameter a DTensor, TP the blocks' linears: whichever row was best
    distributed = "any(type(p).__name__ == 'DTensor' for p in model.parameters())"
    assert kernel.value(f"meshbook.current().run({distributed!r}).result(echo=False).unique()") is True
    out = kernel.ok("%%mesh\nx = torch.randn(4, 16)\nfor _ in range(3): loss = step(x)").stream()
    note, *steps = out.splitlines()
    assert note.startswith("[0,1] note: step() got no targets: its loss is the mean square"), note  # once
    assert sorted(line.split(":")[0] for line in steps) == sorted(
        f"[{r}] rank {r} step {s}" for s in (1, 2, 3) for r in (0, 1))
    assert out.count("(predicted") == 12  # peak and time, 3 steps x 2 ranks


def test_bad_plan_requests_are_usage_errors(kernel: Kernel) -> None:
    reply = kernel.execute("%mesh plan --build nothing_here --batch 8")
    assert reply.content["ename"] == "UsageError" and "no variable 'nothing_here'" in reply.content["evalue"]
    reply = kernel.execute("%mesh plan --build build --batch 8 --checkpointing sometimes")
    assert reply.content["ename"] == "UsageError" and "choose from none, block, selective" in reply.content["evalue"]
    reply = kernel.execute("%mesh plan --build build --batch eight")
    assert reply.content["ename"] == "UsageError" and "give the global batch shape" in reply.content["evalue"]
    # Nothing fits: the error, and still the table of what each layout needs, kept in --out
    reply = kernel.execute("%mesh plan --build build --batch 8 --budget 1M --no-pp --checkpointing none --out small",
                           timeout=300)
    assert reply.content["ename"] == "UsageError" and "no plan fits in 1.0 MiB" in reply.content["evalue"]
    assert "--budget 8G in %mesh plan" in reply.content["evalue"]
    (table,) = reply.of_type("display_data")
    assert "OOM" in table["content"]["data"]["text/plain"]
    assert kernel.value("all(r.status == 'OOM' for r in small.rows)") is True
    assert kernel.value("1 + 1") == 2


def test_a_model_class_made_with_no_arguments_is_a_build(kernel: Kernel) -> None:
    """A notebook's nn.Module class is a function that builds the model: it was refused as
    'a model type'."""
    kernel.ok(MODEL + "\nclass Tiny(nn.Sequential):\n    def __init__(self):\n"
              "        super().__init__(nn.Linear(16, 32), Block(32), nn.Linear(32, 16))\n")
    kernel.ok("import meshbook\nmeshbook.current().parallelize(Tiny, meshbook.Layout(dp_shard=2))")
    out = kernel.ok("%%mesh\nloss = step(torch.randn(4, 16))\ntype(model).__name__").stream()
    assert "rank 0 step 1" in out, out
    assert kernel.value("meshbook.current().run('type(model).__name__').result(echo=False).unique()") == "FSDPTiny"
