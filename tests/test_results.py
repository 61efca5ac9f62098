"""Results over the size limit stay on their rank; long reprs are cut before the notebook."""

from __future__ import annotations

from typing import Iterator

import numpy
import pytest
import torch
from jupyter_kernels import Kernel

import meshbook
from meshbook.mesh.protocol.limits import REPR_CHARS, KeptOnRank

MiB = 1 << 20


@pytest.fixture(scope="module")
def small_limit() -> Iterator[meshbook.Mesh]:
    """Two ranks whose results may weigh 1 MiB."""
    mesh = meshbook.start(2, max_result_bytes=MiB)
    yield mesh
    mesh.stop()


def test_a_result_over_the_limit_stays_on_the_rank_as_underscore(small_limit: meshbook.Mesh) -> None:
    values = small_limit.run("torch.arange(2 ** 19, dtype=torch.float32) + rank").result()
    kept = values[0]
    assert isinstance(kept, KeptOnRank) and kept.type == "torch.Tensor" and kept.limit == MiB
    assert kept.nbytes > 2 * MiB - 1024
    assert "kept on the rank as `_`" in repr(values) and "mesh.pull('_', max_bytes=...)" in repr(values)
    pulled = small_limit.pull("_")  # pull's own limit (2 GiB) lets it come
    assert torch.equal(pulled[1], torch.arange(2 ** 19, dtype=torch.float32) + 1)


def test_the_limit_can_be_raised_per_run_and_covers_apply(small_limit: meshbook.Mesh) -> None:
    assert small_limit.run("torch.ones(2 ** 19)", max_bytes=4 * MiB).result()[0].shape == (2 ** 19,)
    assert isinstance(small_limit.apply(lambda: b"x" * (2 * MiB)).result()[1], KeptOnRank)
    assert small_limit.run("len(_)").result()[1] == 2 * MiB, "apply's result stayed as `_` too"
    assert small_limit.run("'small'").result()[0] == "small"


def test_a_result_is_weighed_before_it_is_copied_off_its_device(small_limit: meshbook.Mesh) -> None:
    """A 40 GB CUDA result must not be copied to host memory to find out it is too big. The
    meta device stands in for the GPU here: copying a meta tensor raises, so the result can
    only be kept if it was weighed first."""
    values = small_limit.run("[torch.empty(2 ** 40, device='meta')]").result()
    kept = values[0]
    assert isinstance(kept, KeptOnRank) and kept.type == "builtins.list" and kept.nbytes == 2 ** 42
    assert small_limit.run("_[0].shape").result()[1] == (2 ** 40,)


UNREADABLE = """
import operator
class Unreadable:
    def __reduce__(self):  # unpickling it raises, as a CUDA storage does in a CPU-only kernel
        return (operator.truediv, (1, 0))
Unreadable() if rank == 1 else 'fine'
"""


def test_a_result_the_notebook_cannot_unpickle_is_that_ranks_error(small_limit: meshbook.Mesh) -> None:
    with pytest.raises(meshbook.RemoteError) as info:
        small_limit.run(UNREADABLE).result(timeout=30)
    (failure,) = info.value.failures.values()
    assert failure.rank == 1 and failure.type_name == "UnreadableResult"
    assert "the result (a __main__.Unreadable) cannot be unpickled in the notebook: ZeroDivisionError" \
        in failure.message
    assert "It stays on the rank as `_`" in failure.message and info.value.partial[0] == "fine"
    assert small_limit.run("type(_).__name__").result()[1] == "Unreadable"
    assert small_limit.run("1 + 1").result().unique() == 2  # nothing is left waiting


def test_tensors_that_print_alike_but_differ_are_not_shown_as_one_value() -> None:
    """A tensor prints 4 decimals: ranks 1-3 holding 1.000001, 1.000002 and 1.000003 all print
    ``tensor(1.0000)``, which read as replicas in sync. Each shows apart, with a note, and
    unique() refuses them; equal tensors (NaN included) still group."""
    values = meshbook.RankValues({r: torch.tensor(1.0) + r * 1e-6 for r in range(4)})
    assert repr(values).splitlines() == ["[0] tensor(1.)", "[1] tensor(1.0000)", "[2] tensor(1.0000)",
                                         "[3] tensor(1.0000)", "(ranks shown apart with the same text hold "
                                         "different numbers, beyond the digits shown)"]
    with pytest.raises(ValueError, match="ranks returned 4 different values"):
        values.unique()
    same = meshbook.RankValues({r: torch.tensor([1.0, float("nan")]) for r in range(3)})
    assert repr(same) == "[0-2] tensor([1., nan])" and same.unique().shape == (2,)


def test_tensors_inside_lists_and_dicts_that_print_alike_but_differ_are_shown_apart() -> None:
    """``[p.data for p in model.parameters()]`` on each replica: a list of tensors prints its
    tensors cut short, so replicas apart read as one; unique() must refuse them too."""
    weights = torch.zeros(2000)
    apart = weights.clone()
    apart[1000] = 1.0
    values = meshbook.RankValues({0: [weights], 1: [weights.clone()], 2: [apart], 3: {"w": weights}})
    assert [ranks for ranks, _ in values.groups()] == [[0, 1], [2], [3]]
    with pytest.raises(ValueError, match="ranks returned 3 different values"):
        values.unique()
    near = meshbook.RankValues({r: {"w": (torch.tensor([1.0 + r * 1e-6]), numpy.zeros(2) + r * 1e-9)}
                                for r in range(3)})
    assert [ranks for ranks, _ in near.groups()] == [[0], [1], [2]]
    same = meshbook.RankValues({r: {"w": [torch.tensor([1.0, float("nan")])], "step": 3} for r in range(3)})
    assert [ranks for ranks, _ in same.groups()] == [[0, 1, 2]]
    assert same.unique()["step"] == 3
    # compared as a whole, as a dict of them would be if a tensor's == were not elementwise
    assert values == meshbook.RankValues({0: [weights], 1: [weights], 2: [apart], 3: {"w": weights}})
    assert values != {0: [weights], 1: [weights], 2: [weights], 3: {"w": weights}}
    assert same != {r: {"w": [torch.tensor([1.0, float("nan")])], "step": 4} for r in range(3)}


def test_equal_dicts_in_another_order_are_one_value() -> None:
    """A dict built in another order on another rank (keys met in another order) is the same
    value; shown as the lowest rank's prints."""
    values = meshbook.RankValues({0: {"loss": 1.5, "step": 3}, 1: {"step": 3, "loss": 1.5},
                                  2: [{"b": {"y": 1, "x": 2}}], 3: [{"b": {"x": 2, "y": 1}}], 4: {"step": 3}})
    assert repr(values) == ("[0,1] {'loss': 1.5, 'step': 3}\n[2,3] [{'b': {'y': 1, 'x': 2}}]\n"
                            "[4] {'step': 3}")
    assert values[0:2].unique() == {"loss": 1.5, "step": 3}
    # what prints alike is still told apart by type and contents
    assert [ranks for ranks, _ in meshbook.RankValues({0: 1, 1: 1.0, 2: {1, 2}, 3: [1, 2]}).groups()] == [
        [0], [1], [2], [3]]


def test_values_are_sliced_by_rank_number() -> None:
    values = meshbook.RankValues({r: r * 10 for r in range(4)})
    assert values[1:3] == {1: 10, 2: 20} and isinstance(values[1:3], meshbook.RankValues)
    assert values[-1:] == {3: 30} and values[::2] == {0: 0, 2: 20}
    assert meshbook.RankValues({0: 0, 2: 20})[1:] == {2: 20}  # ranks that answered, by number
    with pytest.raises(TypeError, match=r"by one rank \(vals\[2\]\) or a slice"):
        values[[0, 1]]  # type: ignore[call-overload]


def test_a_long_repr_is_cut_with_a_note() -> None:
    values = meshbook.RankValues({0: "y" * 50_000, 1: "y" * 50_000 + "z"})
    lines = repr(values).splitlines()
    assert len(lines) == 2, "values that differ only past the cut stay apart"
    assert all(len(line) < REPR_CHARS + 200 for line in lines)
    assert lines[0].endswith("[cut: the repr is 50,002 characters, the first 20,000 are shown]")


def test_the_cell_shows_the_note_and_takes_max_bytes() -> None:
    k = Kernel()
    try:
        k.ok("import meshbook\n%load_ext meshbook\n%mesh start -n 2")
        big = "%%mesh {}\ntorch.ones(2 ** 20)"
        shown = k.ok(big.format("--max-bytes 1M")).of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert "kept on the rank as `_` (over the 1.0 MiB result limit)" in shown
        shown = k.ok(big.format("--max-bytes 8M")).of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert "tensor([1., 1., 1.,  ..., 1., 1., 1.])" in shown
        shown = k.ok("%%mesh\n'y' * 100_000").of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert len(shown) < 2 * REPR_CHARS and "[cut: the repr is 100,002 characters" in shown
        bad = k.execute("%%mesh --max-bytes lots\n1")
        assert bad.status == "error" and "write a size like" in bad.content["evalue"]
        unreadable = k.execute("%%mesh" + UNREADABLE, timeout=60)  # it used to hang the kernel
        assert unreadable.status == "error" and "cannot be unpickled in the notebook" in unreadable.error_text
        assert k.value("1 + 1") == 2
        assert k.ok("%%mesh\nrank").status == "ok"
        k.ok("%mesh stop")
    finally:
        k.close()


def test_a_second_result_prints_only_what_is_new(mesh2: meshbook.Mesh, capfd: pytest.CaptureFixture[str]) -> None:
    run = mesh2.run("print('before', flush=True)\nimport time\ntime.sleep(2)\nprint('after')")
    with pytest.raises(meshbook.MeshTimeout):
        run.result(timeout=1)
    run.result()
    out = capfd.readouterr().out
    assert out.count("before") == 1 and out.count("after") == 1, out
