"""An agent's bundle of its ranks' messages: what it gathers, in what order, and what it drops.

The agent checks every rank message before it gathers it (the controller then checks the
bundle only), so a forged or replayed rank message must die at the agent; and results may be
grouped only where no rank's messages change order.
"""

from __future__ import annotations

import pickle

from meshbook.mesh.agent.link import Gatherer
from meshbook.mesh.protocol import bundle
from meshbook.mesh.protocol import messages as msg
from meshbook.mesh.protocol.wire import Wire

KEY = b"k" * 32


def result(rank_wire: Wire, request: int, rank: int, value: object = None, group: bool = True) -> list:
    return rank_wire.pack({msg.KIND: msg.RESULT, msg.ID: request, msg.RANK: rank, msg.DURATION: 0.25 * rank,
                           msg.HAS_GROUP: group, msg.TYPE: f"{type(value).__module__}.{type(value).__qualname__}"},
                          value)


def output(rank_wire: Wire, request: int, rank: int, text: str) -> list:
    return rank_wire.pack({msg.KIND: msg.OUTPUT, msg.ID: request, msg.RANK: rank}, {"stream": "stdout", "text": text})


def gathered(gatherer: Gatherer) -> list:
    frames = gatherer.take()
    assert frames is not None
    message = Wire(KEY).unpack(frames)  # the controller checks the bundle's signature
    assert message.kind == msg.BUNDLE and message.header[msg.HOST] == 3
    return message.body()


def test_identical_consecutive_results_become_one_entry_and_order_is_kept() -> None:
    ranks = {r: Wire(KEY) for r in range(4)}
    g = Gatherer(KEY, host=3)
    for frames in (result(ranks[0], 7, 0), output(ranks[1], 7, 1, "hi\n"), result(ranks[1], 7, 1),
                   result(ranks[2], 7, 2), result(ranks[3], 7, 3, value=5), result(ranks[3], 8, 3)):
        g.add(frames)
    entries = gathered(g)
    kinds = [e[0] for e in entries]
    assert kinds == [bundle.RESULTS, bundle.MESSAGE, bundle.RESULTS, bundle.RESULTS, bundle.RESULTS]
    assert entries[0][1:4] == [7, [0], [0.0]]
    assert entries[1][1][msg.RANK] == 1 and pickle.loads(entries[1][2])["text"] == "hi\n"
    assert entries[2][1:4] == [7, [1, 2], [0.25, 0.5]], "rank 1's output stays before its result"
    assert pickle.loads(entries[3][6]) == 5, "another value: another entry"
    assert entries[4][1] == 8, "another request: another entry"
    assert g.take() is None, "taken: the bundle starts empty"


def test_results_that_differ_in_process_group_are_not_grouped() -> None:
    ranks = {r: Wire(KEY) for r in range(2)}
    g = Gatherer(KEY, host=3)
    g.add(result(ranks[0], 1, 0, group=True))
    g.add(result(ranks[1], 1, 1, group=False))
    assert [e[4] for e in gathered(g)] == [True, False]


def test_forged_and_replayed_rank_messages_are_dropped_at_the_agent() -> None:
    rank = Wire(KEY)
    g = Gatherer(KEY, host=3)
    good = result(rank, 1, 0)
    g.add(result(Wire(b"x" * 32), 1, 1))  # another mesh's key
    g.add(good)
    g.add(good)  # the same message again
    assert [e[2] for e in gathered(g)] == [[0]]
    assert g.wire.dropped == 2 and g.wire.replayed == 1
