"""A link's numbering on its own: in order, gaps held and filled, nothing twice, and what is
no longer kept reported as lost (protocol/ordering.py); and big messages cut into fragments
and put together again (protocol/fragments.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshbook.mesh.protocol.fragments import Assembly, split
from meshbook.mesh.protocol.ordering import ASK_AGAIN_MAX_S, ASK_AGAIN_S, Incoming, Outgoing


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


def test_a_gap_that_asking_does_not_fill_is_asked_for_less_and_less_often() -> None:
    """Each ask has the sender send everything from the gap on again: a resend still on its way
    behind a big transfer is not asked for every second. Once it comes, asking is prompt again."""
    incoming = Incoming()
    incoming.take(2, [b"2"], 100.0)
    asks = [t / 2 - 100 for t in range(200, 280) if incoming.ask(t / 2) is not None]
    assert asks == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]
    assert max(b - a for a, b in zip(asks, asks[1:])) == ASK_AGAIN_MAX_S
    assert incoming.take(1, [b"1"], 140.0) == [[b"1"], [b"2"]]
    incoming.take(4, [b"4"], 141.0)
    assert incoming.ask(141.0) == 3 and incoming.ask(141.0 + ASK_AGAIN_S) == 3, "a new gap is asked for promptly"


def test_what_the_sender_no_longer_keeps_is_lost_and_the_rest_goes_on() -> None:
    out = Outgoing(keep_messages=3)
    sent = [out.number([bytes([n])]) for n in range(1, 6)]
    assert sent == [1, 2, 3, 4, 5] and out.kept == 3
    assert out.gone(2) == [(2, 2)] and [n for n, _ in out.since(2)] == [3, 4, 5], "message 2 is gone"
    assert out.gone(3) == []
    incoming = Incoming(expected=2)
    incoming.take(5, [b"5"], 0.0)
    assert incoming.give_up(out.gone(2)) == [] and incoming.newest_lost == 2
    assert incoming.take(3, [b"3"], 0.0) == [[b"3"]] and incoming.take(4, [b"4"], 0.0) == [[b"4"], [b"5"]]
    out.acknowledged(4)
    assert [n for n, _ in out.since(5)] == [5]


def test_a_message_too_big_to_keep_is_sent_but_not_kept() -> None:
    out = Outgoing(keep_bytes=10)
    assert out.number([b"x" * 11]) == 1 and out.kept == 0
    assert out.number([b"small"]) == 2 and out.gone(2) == [] and out.gone(1) == [(1, 1)]


def test_what_came_is_delivered_although_its_sender_let_it_go() -> None:
    """A pull's result too big to keep arrived after a gap (an output line lost in a reset):
    the line is still kept, so it comes again, and the result is not thrown away."""
    out = Outgoing(keep_bytes=10)
    line, result, after = out.number([b"line"]), out.number([b"x" * 11]), out.number([b"exit"])
    incoming = Incoming()
    assert incoming.take(result, [b"result"], 0.0) == [] and incoming.take(after, [b"exit"], 0.0) == []
    asked = incoming.ask(ASK_AGAIN_S)
    assert asked == line and out.gone(asked) == [(result, result)], "only the result is not kept"
    assert [n for n, _ in out.since(asked)] == [line, after], "what is kept comes again"
    assert incoming.give_up(out.gone(asked)) == [] and incoming.newest_lost == 0, "the result came: nothing lost"
    assert incoming.take(line, [b"line"], 1.0) == [[b"line"], [b"result"], [b"exit"]]


def test_a_loss_skips_what_never_came_and_delivers_what_did_in_its_place() -> None:
    """The sender no longer keeps 2, 5 and 6; 3 and 5 came after the gap at 1, which is sent
    again, and so is 4. Told twice (each side asks again while a gap waits), it is no news."""
    incoming = Incoming()
    incoming.take(3, [b"3"], 0.0)
    incoming.take(5, [b"5"], 0.0)
    assert incoming.give_up([(2, 2), (5, 6)]) == [] and incoming.newest_lost == 6, "1 is still to come"
    assert incoming.give_up([[2, 2], [5, 6]]) == [] and incoming.newest_lost == 6, "no news"
    assert incoming.take(1, [b"1"], 1.0) == [[b"1"], [b"3"]], "2 skipped, 3 in its place"
    assert incoming.take(4, [b"4"], 1.0) == [[b"4"], [b"5"]], "5 came: delivered, and 6 skipped"
    assert incoming.acknowledged == 6 and incoming.ask(9.0) is None
    assert incoming.give_up([(5, 6)]) == [] and incoming.newest_lost == 6, "told again, late: no news"


def test_an_ask_that_crossed_an_acknowledgement_names_nothing_lost() -> None:
    """A resend asked from a number the other side acknowledged since (the ask and the ping
    crossed) must not report what it has as lost."""
    out = Outgoing()
    for n in range(1, 7):
        out.number([bytes([n])])
    out.acknowledged(6)
    assert out.gone(3) == [] and out.since(3) == []


# -- a big message in fragments (protocol/fragments.py) -------------------------------------------

frame_sizes = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=6)


@given(sizes=frame_sizes, piece=st.integers(min_value=1, max_value=16), at=st.integers(min_value=0, max_value=2))
def test_a_message_in_fragments_comes_out_whole(sizes: list[int], piece: int, at: int) -> None:
    """Any frames, any piece size: the fragments and what is left put the message together
    again, byte for byte, and none carries much more than a piece."""
    frames = [b"envelope", *(bytes(range(n)) for n in sizes)]
    pieces, rest = split(frames, at=at, piece=piece)
    route = [b"r"] * at
    if sum(map(len, frames)) < 2 * piece:
        assert pieces == [] and rest == frames, "a small message travels as it is"
    assert all(sum(memoryview(p).nbytes for p in fragment[2:]) <= piece for fragment in pieces)
    assembly = Assembly()
    assert all(assembly.take(fragment) is None for fragment in pieces)
    whole = assembly.take([*route, *rest])
    assert whole is not None and [bytes(f) for f in whole] == [*route, *frames]


def test_a_message_whose_fragment_was_lost_is_dropped_and_the_next_comes_whole() -> None:
    first = [b"envelope", bytes(100), bytes(range(50))]
    second = [b"envelope", bytes(range(60))]
    pieces, rest = split(first, piece=16)
    assembly = Assembly()
    for fragment in pieces[:2] + pieces[3:]:  # the third never came (a reset lost it)
        assembly.take(fragment)
    assert assembly.take(rest) is None and assembly.dropped == 1
    pieces, rest = split(second, piece=16)
    for fragment in pieces[:-1]:
        assembly.take(fragment)
    # The message after the second's fragments was lost, and a third message starts: the
    # second's fragments go, and the third's come whole.
    pieces, rest = split(first, piece=16)
    for fragment in pieces:
        assembly.take(fragment)
    whole = assembly.take(rest)
    assert whole is not None and [bytes(f) for f in whole] == first and assembly.dropped == 1


def test_a_small_message_between_messages_passes_as_it_is() -> None:
    assembly = Assembly()
    assert assembly.take([b"", b"op"]) == [b"", b"op"], "an empty route (an operation) is no fragment"
    assert assembly.take([b"x\x01\x00\x00\x00", b"a"]) == [b"x\x01\x00\x00\x00", b"a"]
