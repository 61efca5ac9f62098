"""%mesh who / push / pull end to end: a real kernel, driven through jupyter_client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jupyter_kernels import Kernel, Reply, kernel_with_mesh


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    yield from kernel_with_mesh()


def usage_error(reply: Reply) -> str:
    assert reply.status == "error" and reply.content["ename"] == "UsageError", reply.error_text
    message = reply.content["evalue"]
    assert "\n" not in message.strip(), "a usage error is one line"
    return message


def test_help_lists_the_data_commands(kernel: Kernel) -> None:
    page = kernel.ok("%mesh?").content["payload"][0]["data"]["text/plain"]
    for command in ("who", "push", "pull"):
        assert f"\n  {command} " in page
    assert "--max-bytes" in kernel.ok("%mesh help pull").stream()


def test_who_shows_a_dtensor_once_for_all_ranks(kernel: Kernel) -> None:
    kernel.ok("%%mesh\nfrom torch.distributed.tensor import Shard, Replicate, distribute_tensor\n"
              "w = distribute_tensor(torch.ones(8, 4), device_mesh, [Shard(0), Replicate()])\n"
              "step = 3")
    table = kernel.ok("%mesh who").stream()
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert rows["w"].split() == ["w", "DTensor", "(8,", "4)", "float32", "cpu", "64", "B",
                                 "dp:Shard(0)", "tp:Replicate()", "(4,", "4)", "0-3"]
    assert rows["step"].split() == ["step", "int", "0-3"]
    assert "total per rank: [0-3] 64 B" in table
    assert "0,1" in kernel.ok("%mesh who --where dp=0").stream()
    pulled = kernel.ok("%mesh pull w --ranks 0 --out shard")  # a note of the cell's, not a line of meshbook's
    assert pulled.stream("stderr") == ("note: 'w' is a DTensor: each rank's value is its local shard, not the whole "
                                       "tensor; mesh.ref('w').full_tensor() gives the whole\n"), pulled.stream("stderr")


def test_push_reads_the_notebook_and_pull_brings_values_back(kernel: Kernel) -> None:
    kernel.ok("a = torch.randn(3, 5).to(torch.bfloat16)\nb = {'lr': 0.5}")
    assert kernel.ok("%mesh push a b --ranks 0,1").stream() == "pushed a, b to ranks 0,1\n"
    (result,) = kernel.ok("%mesh pull a --ranks 0,1").of_type("execute_result")
    assert result["content"]["data"]["text/plain"].startswith("[0,1] tensor([[")
    assert kernel.ok("%mesh pull a --ranks 0,1 --out pulled").stream() == "pulled a from ranks 0,1 into pulled\n"
    assert kernel.value("sorted(pulled)") == [0, 1]
    assert kernel.value("all(torch.equal(v, a) and v.dtype == torch.bfloat16 for v in pulled.values())")
    assert kernel.value("dict(meshbook.current().pull('b', ranks=[1]))") == {1: {"lr": 0.5}}
    kernel.ok("%mesh push b --where tp=1")
    assert kernel.value("sorted(meshbook.current().pull('b', where={'tp': 1}))") == [1, 3]


def test_bad_requests_are_one_line_usage_errors(kernel: Kernel) -> None:
    assert "no variable 'nope' in the notebook" in usage_error(kernel.execute("%mesh push nope"))
    kernel.ok("%%mesh --ranks 0\nhalf = 1")
    assert "'half' is not defined on rank(s) 1-3 (it is on rank(s) 0" in usage_error(
        kernel.execute("%mesh pull half"))
    kernel.ok("big = torch.zeros(1 << 20)\n%mesh push big")
    message = usage_error(kernel.execute("%mesh pull big --max-bytes 1M"))
    assert "would move 16.0 MiB ([0-3] 4.0 MiB), over the 1.0 MiB limit" in message
    assert "--max-bytes 16M" in message
    assert kernel.value("meshbook.current().pull('big', ranks=[0])[0].numel()") == 1 << 20
    assert kernel.ok("%mesh pull big --ranks 2 --max-bytes 4MiB --out one").status == "ok"
    assert "write a size like" in usage_error(kernel.execute("%mesh pull big --max-bytes lots"))
    kernel.ok("import threading\nlock = threading.Lock()")
    assert "value 'lock' (a _thread.lock) cannot be pickled" in usage_error(
        kernel.execute("%mesh push lock"))


def test_pull_out_stores_the_values_only_there(kernel: Kernel) -> None:
    """IPython keeps what a cell returns (``Out[n]``, ``_``): values pulled ``--out`` a name are
    not returned as well, so ``del`` of that name lets their memory go."""
    maps = "open('/proc/self/maps').read().count('meshbook-pull')"
    kernel.ok("%%mesh\nheld = torch.ones(1 << 18)")  # 1 MiB a rank: mapped from shared memory
    kernel.ok("import gc\ngc.collect()")
    before = kernel.value(maps)
    reply = kernel.ok("%mesh pull held --out kept")
    assert not reply.of_type("execute_result")
    assert kernel.value(maps) > before
    kernel.ok("del kept\ngc.collect()")
    assert kernel.value(maps) == before
    assert "--out takes a variable name" in usage_error(kernel.execute("%mesh pull held --out kept;"))
    assert "--out takes a variable name" in usage_error(kernel.execute("%mesh pull held --out class"))
