"""Actors and several meshes from notebook cells, through a real kernel."""

from __future__ import annotations

from typing import Iterator

import pytest
from jupyter_kernels import Kernel

POLICY = '''class Policy(meshbook.Actor):
    def __init__(self, hidden):
        self.model = torch.nn.Linear(hidden, hidden)

    @meshbook.endpoint
    def generate(self, x):
        return tuple(self.model(x).shape)

    @meshbook.endpoint
    def fail(self):
        raise ValueError("no rollout")

    @meshbook.endpoint
    def nap(self, seconds):
        import time
        time.sleep(seconds)
        return self.rank'''


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    try:
        kernel.ok("import meshbook, torch\n%load_ext meshbook\n%mesh start -n 2 --name trainers\n"
                  "%mesh start -n 2 --name generators")
        yield kernel
        kernel.ok("%mesh stop --all")
    finally:
        kernel.close()


def result_text(reply: object) -> str:
    (result,) = reply.of_type("execute_result")  # type: ignore[attr-defined]
    return result["content"]["data"]["text/plain"]


def test_cells_pick_their_mesh(kernel: Kernel) -> None:
    assert result_text(kernel.ok("%%mesh --mesh trainers\nrole = 'trainer'\nrole")) == "[0,1] 'trainer'"
    assert "now using mesh 'trainers'" in kernel.ok("%mesh use trainers").stream()
    assert result_text(kernel.ok("%%mesh\nrole")) == "[0,1] 'trainer'"
    reply = kernel.execute("%%mesh --mesh generators\nrole")
    assert reply.status == "error" and "NameError" in reply.error_text
    reply = kernel.execute("%%mesh --mesh nope\nrank")
    assert reply.status == "error" and "no mesh named 'nope' is running" in reply.content["evalue"]
    status = kernel.ok("%mesh status").stream()
    assert "mesh 'trainers': 2 ranks" in status and "(current)" in status
    assert "mesh 'generators': 2 ranks" in status


def test_actor_from_a_cell(kernel: Kernel) -> None:
    kernel.ok(POLICY)
    kernel.ok("gens = meshbook.mesh_named('generators')\npolicy = gens.spawn('policy', Policy, 4)")
    assert kernel.value("dict(policy.generate.call(torch.ones(2, 4)).result())") == {0: (2, 4), 1: (2, 4)}
    # The failing endpoint: grouped like a cell's error, with the lines of the cell that defined it.
    reply = kernel.execute("policy.fail.call().result()")
    assert reply.status == "error"
    assert "[0,1] ValueError: no rollout" in reply.error_text
    assert "cell line 11, in fail" in reply.error_text and 'raise ValueError("no rollout")' in reply.error_text
    # A %%mesh cell on that mesh sees the actor; %mesh who and status list it.
    assert result_text(kernel.ok("%%mesh --mesh generators\ntype(policy).__name__")) == "[0,1] 'Policy'"
    kernel.ok("%mesh use generators")
    assert "policy" in kernel.ok("%mesh who").stream()
    assert "actors: policy (Policy)" in kernel.ok("%mesh status").stream()
    # A stuck endpoint shows in %mesh stacks like a stuck cell.
    kernel.ok("slow = policy.nap.call(60)")
    stacks = kernel.ok("import time\ntime.sleep(1)\n%mesh stacks").stream()
    assert "cell line 16, in nap" in stacks and "time.sleep(seconds)" in stacks
    kernel.ok("slow.run.interrupt()")
    reply = kernel.execute("slow.result(timeout=30)")
    assert reply.status == "error" and "KeyboardInterrupt" in reply.error_text
    assert kernel.value("policy.nap.choose(0).result()") in (0, 1)


def test_await_in_an_async_cell(kernel: Kernel) -> None:
    reply = kernel.ok("await policy.slice(rank=1).nap.call_one(0)")
    assert result_text(reply) == "1"
