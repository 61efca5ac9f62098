"""Merging of rank output lines (pure logic, driven by a fake clock), and a rank's streams."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshbook.mesh.controller.core.output import LineMerger, OrderedCollector
from meshbook.mesh.controller.core.render import LateOutput
from meshbook.mesh.protocol.events import Display, Output, Result
from meshbook.mesh.rank.streams import RankStream


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def collect() -> tuple[list[tuple[str, str]], object]:
    written: list[tuple[str, str]] = []
    return written, lambda stream, text: written.append((stream, text))


def test_identical_lines_merge_once_every_rank_printed_them() -> None:
    written, write = collect()
    merger = LineMerger([0, 1, 2, 3], write, clock=Clock())
    for rank in range(3):
        merger.feed_event(Output(rank, "stdout", "epoch 1\n"))
        merger.poll()
    assert written == []  # rank 3 has not printed it yet, and the window is open
    merger.feed_event(Output(3, "stdout", "epoch 1\n"))
    merger.poll()
    assert written == [("stdout", "[0-3] epoch 1\n")]


def test_a_line_only_some_ranks_print_waits_for_the_window() -> None:
    written, write = collect()
    clock = Clock()
    merger = LineMerger([0, 1], write, window=0.2, clock=clock)
    merger.feed_event(Output(0, "stdout", "only me\n"))
    merger.poll()
    assert written == [] and merger.next_deadline() == 0.2
    clock.now = 0.25
    merger.poll()
    assert written == [("stdout", "[0] only me\n")]


def test_finished_ranks_are_not_waited_for_and_order_is_kept() -> None:
    written, write = collect()
    merger = LineMerger([0, 1], write, clock=Clock())
    merger.feed_event(Result(1, None, 0.0))
    merger.feed_event(Output(0, "stdout", "a\nb\n"))
    merger.poll()
    assert written == [("stdout", "[0] a\n[0] b\n")]


def test_repeated_lines_stay_separate_and_partial_lines_wait() -> None:
    written, write = collect()
    merger = LineMerger([0, 1], write, clock=Clock())
    merger.feed_event(Output(0, "stdout", "x\nx\npart"))
    merger.feed_event(Output(1, "stdout", "x\n"))
    merger.poll()
    assert written == [("stdout", "[0,1] x\n")]
    merger.close()
    assert written[1:] == [("stdout", "[0] x\n[0] part\n")]


def test_streams_are_kept_apart() -> None:
    written, write = collect()
    merger = LineMerger([0], write, clock=Clock())
    merger.feed_event(Output(0, "stderr", "warn\n"))
    merger.feed_event(Output(0, "stdout", "out\n"))
    merger.poll()
    assert written == [("stderr", "[0] warn\n"), ("stdout", "[0] out\n")]


def test_ordered_collector_prints_in_rank_order_grouping_identical_output() -> None:
    written, write = collect()
    ordered = OrderedCollector([0, 1, 2], write)
    ordered.feed_event(Output(2, "stdout", "rank two\n"))
    ordered.feed_event(Output(1, "stdout", "same\n"))
    ordered.feed_event(Output(0, "stdout", "same\n"))
    ordered.close()
    assert written == [("stdout", "[0,1] same\n[2] rank two\n")]


def test_a_line_merges_with_the_same_line_a_moment_later() -> None:
    written, write = collect()
    clock = Clock()
    merger = LineMerger([0, 1], write, clock=clock)
    merger.feed_event(Output(0, "stdout", "epoch 1\n"))
    clock.now = 0.6  # a busy machine ran rank 1 a moment later
    merger.poll()
    merger.feed_event(Output(1, "stdout", "epoch 1\n"))
    merger.poll()
    assert written == [("stdout", "[0,1] epoch 1\n")]


def test_per_rank_lines_come_out_in_rank_order_once_every_rank_printed_its_own() -> None:
    written, write = collect()
    merger = LineMerger([0, 1, 2], write, clock=Clock())
    for rank in (2, 0, 1):
        merger.feed_event(Output(rank, "stdout", "epoch 1\n"))
    for rank in (2, 0):
        merger.feed_event(Output(rank, "stdout", f"loss of rank {rank}\nnext {rank}\n"))
    merger.poll()
    assert written == [("stdout", "[0-2] epoch 1\n")], "rank 1 has not printed its second line"
    merger.feed_event(Output(1, "stdout", "loss of rank 1\n"))
    merger.poll()
    assert written[1:] == [("stdout", "[0] loss of rank 0\n[1] loss of rank 1\n[2] loss of rank 2\n")]
    merger.close()
    assert written[2:] == [("stdout", "[0] next 0\n[2] next 2\n")]


def test_a_partial_line_the_control_thread_flushes_leaves_before_the_result() -> None:
    """The control thread flushes a partial line every tick; the main thread flushes before it
    sends its result. The main thread's flush must not find the line gone and send the result
    while the control thread is still sending that line."""
    sent: list[str] = []
    finished = threading.Event()

    def main_thread_finishes() -> None:  # what Worker._finish does
        stream.flush()
        sent.append("result")
        finished.set()

    def sink(request: int | None, name: str, text: str) -> None:
        threading.Thread(target=main_thread_finishes).start()  # while this flush still sends the line
        finished.wait(0.5)  # it must wait for the line: the timeout is the passing case
        sent.append(text)

    stream = RankStream("stdout", 1, sink, lambda: 7)
    stream.write("no newline yet")
    stream.flush()  # the control thread's tick
    assert finished.wait(10)
    assert sent == ["no newline yet", "result"]


def test_a_progress_line_shows_at_once_and_each_update_overwrites_it() -> None:
    """tqdm's way (``\\r`` then the bar, no newline until it ends): labelled, live, in place."""
    written, write = collect()
    merger = LineMerger([0, 1], write, clock=Clock())
    merger.feed_event(Output(1, "stdout", "\rstep 8/30"))  # alone: its bar shows
    merger.feed_event(Output(0, "stdout", "\rstep 10/30"))
    merger.feed_event(Output(1, "stdout", "\rstep 9/30"))  # rank 0's bar is the one shown now
    merger.feed_event(Output(0, "stdout", "\rstep 11/30"))
    assert [text for _, text in written] == ["[1] step 8/30", "\r[0] step 10/30", "\r[0] step 11/30"]
    merger.feed_event(Output(0, "stdout", "\rdone\n"))  # the line ends: what it shows in the end
    merger.feed_event(Output(1, "stdout", "\rstep 30/30\rdone\r\n"))
    merger.poll()
    assert written[3:] == [("stdout", "\r[0,1] done    \n")]  # merged; blanks what the bar left
    merger.feed_event(Output(0, "stdout", "next\n"))
    merger.feed_event(Output(1, "stdout", "next\n"))
    merger.poll()
    assert written[4:] == [("stdout", "[0,1] next\n")]  # nothing to overwrite any more


def test_a_line_left_unfinished_shows_live_after_a_moment() -> None:
    """Dots printed with ``end=''`` while a rank works show as they come (after PARTIAL_S:
    a line written in pieces a moment apart does not flicker), then the whole line over them."""
    written, write = collect()
    clock = Clock()
    merger = LineMerger([0, 1], write, clock=clock)
    merger.feed_event(Output(0, "stdout", "epoch 1: "))
    merger.poll()
    assert written == [] and merger.next_deadline() == pytest.approx(0.5)
    clock.now = 0.5
    merger.poll()
    assert written == [("stdout", "[0] epoch 1: ")]
    merger.feed_event(Output(0, "stdout", "."))  # showing already: at once
    merger.poll()
    assert written[1:] == [("stdout", "\r[0] epoch 1: .")]
    assert merger.next_deadline() is None  # nothing to wake up for
    merger.feed_event(Output(0, "stdout", " done\n"))
    merger.feed_event(Output(1, "stdout", "epoch 1: . done\n"))
    merger.poll()
    assert written[2:] == [("stdout", "\r[0,1] epoch 1: . done\n")]


def test_the_same_display_of_several_ranks_shows_once_in_its_place_among_the_lines() -> None:
    written, write = collect()
    shown: list[tuple[list[int], dict]] = []
    merger = LineMerger([0, 1], write, clock=Clock(), show=lambda ranks, data: shown.append((ranks, data)) or
                        written.append(("display", str(ranks))))
    steps = [lambda r: Output(r, "stdout", "before\n"),
             lambda r: Display(r, {"text/plain": "plot", "text/html": "<b>plot</b>"}),
             lambda r: Display(r, {"text/plain": f"mine {r}"}),
             lambda r: Output(r, "stdout", "after\n")]
    for step in steps:  # the ranks run side by side
        for rank in (0, 1):
            merger.feed_event(step(rank))
    merger.poll()
    assert written == [("stdout", "[0,1] before\n"), ("display", "[0, 1]"), ("display", "[0]"), ("display", "[1]"),
                       ("stdout", "[0,1] after\n")]
    assert shown[0] == ([0, 1], {"text/plain": "plot", "text/html": "<b>plot</b>"})


def test_a_script_shows_a_display_as_its_labelled_text() -> None:
    written, write = collect()
    merger = LineMerger([0, 1], write, clock=Clock())
    for rank in (0, 1):
        merger.feed_event(Display(rank, {"text/plain": "<Figure>", "image/png": "..."}))
    merger.poll()
    assert written == [("stdout", "[0,1] <Figure>\n")]


def test_the_ordered_collector_keeps_what_a_progress_line_shows_in_the_end() -> None:
    written, write = collect()
    collector = OrderedCollector([0], write)
    collector.feed_event(Output(0, "stdout", "\r1/2\r2/2\nafter\n"))
    collector.close()
    assert written == [("stdout", "[0] 2/2\n[0] after\n")]


def _lines_of(rank: int, written: list[tuple[str, str]]) -> list[str]:
    """The lines ``rank`` shows in what a merger wrote (stdout), in the order they show."""
    out = []
    for _, text in written:
        for line in text.splitlines():
            label, _, body = line.partition("] ")
            ranks: set[int] = set()
            for part in label.lstrip("[").split(","):
                first, _, last = part.partition("-")
                ranks.update(range(int(first), int(last or first) + 1))
            if rank in ranks:
                out.append(body)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from("ABC"), max_size=5), min_size=2, max_size=4), st.data())
def test_every_rank_shows_its_lines_in_the_order_it_printed_them(printed: list[list[str]],
                                                                 data: st.DataObject) -> None:
    """Whatever the ranks print and however their lines interleave on the way (each rank's in
    its own order), each rank's lines show in that order: merging never moves one of them
    before a line the rank printed earlier (ranks 0,1 print A B, rank 2 prints B A)."""
    written, write = collect()
    clock = Clock()
    merger = LineMerger(range(len(printed)), write, clock=clock)
    left = {rank: list(lines) for rank, lines in enumerate(printed)}
    while any(left.values()):
        rank = data.draw(st.sampled_from(sorted(r for r, lines in left.items() if lines)))
        merger.feed_event(Output(rank, "stdout", left[rank].pop(0) + "\n"))
        clock.now += data.draw(st.sampled_from([0.0, 0.5, 2.0]))
        merger.poll()
    merger.close()
    for rank, lines in enumerate(printed):
        assert _lines_of(rank, written) == lines, written


def test_ranks_that_print_the_same_lines_in_another_order_merge_only_where_the_order_allows() -> None:
    written, write = collect()
    merger = LineMerger([0, 1, 2], write, clock=Clock())
    for rank, line in ((0, "A"), (1, "A"), (2, "B"), (0, "B"), (1, "B"), (2, "A")):
        merger.feed_event(Output(rank, "stdout", line + "\n"))  # all waiting, then written
    merger.close()
    assert "".join(text for _, text in written) == "[0,1] A\n[0-2] B\n[2] A\n"


def ten_lines_from_rank_0() -> tuple[list[tuple[str, str]], LineMerger, Clock]:
    """A merger of ranks 0 and 1 where rank 0 printed ten lines at once, at time 0."""
    written, write = collect()
    clock = Clock()
    merger = LineMerger([0, 1], write, clock=clock)
    merger.feed_event(Output(0, "stdout", "".join(f"line {i}\n" for i in range(10))))
    return written, merger, clock


def test_a_line_waits_past_the_window_for_a_rank_that_is_catching_up_on_it() -> None:
    """Rank 0 printed ten lines at once; rank 1 prints the same ten, one every 0.6 s (a long
    output, a rank the machine runs later): each line waits for it as long as it keeps
    catching up, so all ten merge, though rank 1's last comes 5.4 s after rank 0's."""
    written, merger, clock = ten_lines_from_rank_0()
    for i in range(10):
        clock.now = 0.6 * i
        merger.poll()
        merger.feed_event(Output(1, "stdout", f"line {i}\n"))
        merger.poll()
    assert written == [("stdout", f"[0,1] line {i}\n") for i in range(10)]


def test_a_rank_printing_other_lines_does_not_hold_back_a_line_it_never_prints() -> None:
    """Rank 1 prints its own heartbeat every 0.5 s, never rank 0's ten lines: it is behind on
    them but not catching up, so they go a window after they came, as without it."""
    written, merger, clock = ten_lines_from_rank_0()
    for tick in range(3):
        clock.now = 0.5 * tick
        merger.feed_event(Output(1, "stdout", f"beat {tick}\n"))
        merger.poll()
    shown = "".join(text for _, text in written)
    assert "[0] line 9" in shown and "[0,1]" not in shown, shown


def test_late_output_its_route_refuses_is_logged_not_raised_in_the_timer(capfd: pytest.CaptureFixture[str]) -> None:
    """The timer writes a line that waited out the window; a route that fails then (the
    kernel's socket gone at exit) costs that output, logged, and no thread dies of it."""
    died: list[object] = []
    before, threading.excepthook = threading.excepthook, died.append

    def refuse(stream: str, text: str) -> None:
        raise OSError("socket closed")

    try:
        late = LateOutput([0, 1], refuse)
        late(Output(0, "stdout", "only rank 0\n"))  # waits for rank 1, then the timer writes it
        deadline = time.monotonic() + 30
        while "late output was lost" not in (said := capfd.readouterr().err):
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
    finally:
        threading.excepthook = before
    assert "late output was lost: OSError: socket closed" in said and died == []
