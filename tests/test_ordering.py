"""A link's numbering on its own: in order, gaps held and filled, nothing twice, and what is
no longer kept reported as lost (protocol/ordering.py)."""

from __future__ import annotations

from meshbook.mesh.protocol.ordering import ASK_AGAIN_S, Incoming, Outgoing


def test_in_order_messages_are_delivered_at_once() -> None:
    incoming = Incoming()
    assert incoming.take(1, [b"a"], 0.0) == [[b"a"]]
    assert incoming.take(2, [b"b"], 0.0) == [[b"b"]]
    assert incoming.acknowledged == 2 and incoming.ask(10.0) is None


def test_a_gap_holds_what_follows_until_it_is_filled() -> None:
    incoming = Incoming()
    incoming.take(1, [b"1"], 0.0)
    assert incoming.take(4, [b"4"], 1.0) == [] and incoming.take(3, [b"3"], 1.0) == []
    assert incoming.ask(1.0) == 2, "the first missing number is asked for"
    assert incoming.ask(1.0 + ASK_AGAIN_S / 2) is None, "not again at once"
    assert incoming.ask(1.0 + ASK_AGAIN_S) == 2, "asked again when the answer is late"
    assert incoming.take(2, [b"2"], 2.0) == [[b"2"], [b"3"], [b"4"]]
    assert incoming.take(3, [b"3"], 2.0) == [], "sent again but already here: dropped"
    assert incoming.acknowledged == 4 and incoming.ask(9.0) is None


def test_what_the_sender_no_longer_keeps_is_lost_and_the_rest_goes_on() -> None:
    out = Outgoing(keep_messages=3)
    sent = [out.number([bytes([n])]) for n in range(1, 6)]
    assert sent == [1, 2, 3, 4, 5] and out.kept == 3 and out.let_go == 2
    assert out.since(2) is None, "message 2 is gone"
    assert [n for n, _ in out.since(3) or []] == [3, 4, 5]
    out.acknowledged(4)
    assert [n for n, _ in out.since(5) or []] == [5]
    incoming = Incoming(expected=2)
    incoming.take(5, [b"5"], 0.0)
    assert incoming.give_up(out.let_go) == [] and incoming.lost == [(2, 2)]
    assert incoming.take(3, [b"3"], 0.0) == [[b"3"]] and incoming.take(4, [b"4"], 0.0) == [[b"4"], [b"5"]]


def test_a_message_too_big_to_keep_is_sent_but_not_kept() -> None:
    out = Outgoing(keep_bytes=10)
    assert out.number([b"x" * 11]) == 1 and out.kept == 0 and out.let_go == 1
    assert out.number([b"small"]) == 2 and out.since(2) is not None and out.since(1) is None
