"""Topology, selections and RankValues (pure logic)."""

from __future__ import annotations

import re

import numpy
import pytest

from meshbook import MeshError, RankValues, SelectionError, Topology
from meshbook.mesh.protocol.errors import check_bytes, check_seconds
from meshbook.mesh.protocol.text import format_ranks
from meshbook.mesh.protocol.topology import parse_dims, parse_index_list, parse_where, resolve


def test_coords_are_row_major_like_device_mesh() -> None:
    topo = Topology.create(dims={"pp": 2, "dp": 2, "tp": 2})
    assert topo.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert topo.where(dp=1) == [2, 3, 6, 7]
    assert topo.where(pp=0, tp=[0, 1]) == [0, 1, 2, 3]


def test_parsers() -> None:
    assert parse_index_list("0,2,4-6") == [0, 2, 4, 5, 6]
    assert parse_dims("dp=2,tp=4") == {"dp": 2, "tp": 4}
    assert parse_where("dp=0,tp=0-1") == {"dp": [0], "tp": [0, 1]}
    for bad, parser in [("3-1", parse_index_list), ("dp", parse_dims), ("dp=x", parse_dims),
                        ("dp=1,dp=2", parse_dims), ("=1", parse_where)]:
        with pytest.raises(SelectionError):
            parser(bad)


def test_resolve_stays_within_the_view() -> None:
    topo = Topology.create(dims={"dp": 2, "tp": 2})
    assert resolve(topo, None, {"tp": 1}, [0, 1, 2, 3]) == [1, 3]
    with pytest.raises(SelectionError, match="not in this view"):
        resolve(topo, [3], None, [0, 1])
    with pytest.raises(SelectionError) as caught:
        resolve(topo, None, {"dp": 1}, [0, 1])
    # said as the user writes it (not a dict), with where the ranks asked among are
    assert str(caught.value) == ("no rank matches dp=1 among rank(s) 0,1 (rank 0 is at dp=0,tp=0; "
                                 "rank 1 is at dp=0,tp=1)")
    with pytest.raises(SelectionError, match=r"matches dp=0,tp=0,1 among rank\(s\) 3 \(rank 3 is at dp=1,tp=1\)$"):
        resolve(topo, [3], {"dp": 0, "tp": "0-1"}, [0, 1, 2, 3])
    wide = Topology.create(dims={"dp": 8, "tp": 1})
    with pytest.raises(SelectionError, match=r"rank 3 is at dp=3,tp=0; and 2 more\)$"):
        resolve(wide, "0-5", {"dp": 7}, list(range(8)))


def test_ranks_of_any_whole_numbers_and_nothing_else() -> None:
    topo, every = Topology.create(4), [0, 1, 2, 3]
    assert resolve(topo, numpy.array([2, 0]), None, every) == [0, 2]
    assert resolve(topo, numpy.int64(3), None, every) == [3]
    assert resolve(topo, range(2), None, every) == [0, 1]
    for bad in (1.5, [0, 1.0], True, [True], object()):
        with pytest.raises(SelectionError, match=r"ranks=.*: give a rank \(2\), a list of ranks \(\[0, 2\]\)"):
            resolve(topo, bad, None, every)


def test_where_takes_what_ranks_take_and_says_what_to_give_otherwise() -> None:
    topo, every = Topology.create(dims={"dp": 2, "tp": 2}), [0, 1, 2, 3]
    assert resolve(topo, None, {"tp": "0-1", "dp": numpy.int64(1)}, every) == [2, 3]  # as --where tp=0-1 reads
    for bad in (1.0, None, True, [0, 0.5]):
        with pytest.raises(SelectionError, match=r"tp=.*: give an index \(0\), a list of them \(\[0, 1\]\)"):
            resolve(topo, None, {"tp": bad}, every)
    with pytest.raises(SelectionError, match=r"where='dp=0': give a mapping of dimension names to indices"):
        resolve(topo, None, "dp=0", every)  # type: ignore[arg-type]


def test_limits_are_numbers_above_0_or_sizes() -> None:
    assert check_bytes("1M", "max_bytes") == 1 << 20 and check_bytes(5, "max_bytes") == 5
    assert check_bytes(numpy.int64(7), "max_bytes") == 7 and check_bytes(4e9, "max_bytes") == 4_000_000_000
    assert check_seconds(0.5, "timeout") == 0.5 and check_seconds("2", "timeout") == 2.0
    for bad in (0, -1, 1.5, "lots", True, None):
        with pytest.raises(MeshError, match="max_bytes[= ]"):
            check_bytes(bad, "max_bytes")
    for bad in (0, -1, float("nan"), float("inf"), 1e300, "soon", True, None):
        with pytest.raises(MeshError, match="timeout="):
            check_seconds(bad, "timeout")
    assert check_seconds(0, "timeout", now=True) == 0.0


def test_format_ranks() -> None:
    assert format_ranks([0, 1, 2, 3]) == "0-3"
    assert format_ranks([3, 1]) == "1,3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7,8"


def test_rank_values_repr_groups_identical_values() -> None:
    topo = Topology.create(dims={"dp": 2, "tp": 2})
    vals = RankValues({3: "b", 0: "a", 1: "a", 2: "a"}, topo)
    assert list(vals) == [0, 1, 2, 3]
    assert repr(vals) == "[0-2] 'a'\n[3] 'b'"
    assert repr(vals.where(tp=1)) == "[1] 'a'\n[3] 'b'"
    assert repr(RankValues({0: "x\ny"})) == "[0] 'x\\ny'"
    with pytest.raises(KeyError, match="ranks here: 0-3"):
        vals[7]


class Html:
    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_html_(self) -> str:
        return f"<i>{self.text}</i>"


def test_rank_values_render_html_values_grouped_and_the_rest_as_escaped_text() -> None:
    vals = RankValues({0: Html("a"), 1: Html("a"), 2: Html("b"), 3: "x<y"})
    assert vals._repr_html_() == ("<div><b>[0,1]</b><i>a</i></div><div><b>[2]</b><i>b</i></div>"
                                  "<div><b>[3]</b><pre>&#x27;x&lt;y&#x27;</pre></div>")
    assert RankValues({0: 1.5, 1: "x"})._repr_html_() is None, "no value has HTML: text alone"
    assert RankValues({0: Html})._repr_html_() is None, "a class is not rendered through its method"
    huge = RankValues({0: Html("z" * 10 ** 6), 1: Html("a")})._repr_html_()  # markup cannot be cut
    assert huge is not None and len(huge) < 1000, "a megabyte of HTML gives way to the value's (cut) text"
    assert "<b>[0]</b><pre>&lt;test_topology.Html object" in huge and "<b>[1]</b><i>a</i>" in huge


def test_selecting_a_dimension_named_rank_points_at_selecting_by_number() -> None:
    with pytest.raises(SelectionError, match=re.escape("the mesh has no dimension 'rank'; its dimensions are "
                                                       "dp=2, tp=2 (ranks by number: mesh.narrow([0]), or ranks=[0])")):
        Topology.create(4, {"dp": 2, "tp": 2}).where(rank=0)
