"""Debugging stuck ranks from a real notebook kernel: interrupts, timeouts, stacks, pdb."""

from __future__ import annotations

import re
import time
from typing import Iterator

import pytest
from jupyter_kernels import Kernel, kernel_with_mesh

SKIP_ALL_REDUCE = ("%%mesh\nimport time\nt = torch.ones(8)\nif rank == 1:\n    time.sleep(60)\n"
                   "else:\n    dist.all_reduce(t)\nt.sum().item()")


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    yield from kernel_with_mesh()


def result_text(reply) -> str:
    return reply.of_type("execute_result")[0]["content"]["data"]["text/plain"]


def stderr_of(kernel: Kernel, msg_id: str) -> str:
    return "".join(m["content"]["text"] for _, m in kernel.outputs_of(msg_id)
                   if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")


def test_one_interrupt_frees_ranks_waiting_for_a_rank_that_stopped(kernel: Kernel) -> None:
    kernel.ok("%%mesh\nkeep = rank * 100")
    msg_id, sent = kernel.submit(SKIP_ALL_REDUCE)
    time.sleep(1.5)
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()  # rank 1 stops; 0, 2, 3 wait in an all_reduce it never joins
    reply = kernel.wait(msg_id, sent, timeout=60)
    assert reply.replied_at - interrupted < 20  # about 1-2 s; generous on a loaded machine
    assert reply.status == "error"
    text = reply.error_text
    assert "[1] KeyboardInterrupt" in text
    assert ("[0,2,3] CollectiveAborted: interrupted: meshbook aborted its all_reduce" in text and
            ": rank 1 stopped before joining, and would never join it" in text), text
    assert text.count("re-created the process groups") == 1, text  # the report appears once
    assert "ranks 0,2,3 had their collective aborted" in text
    assert "ranks 0-3 kept their variables" in text
    vals = kernel.ok("%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(keep, t.item())")
    assert result_text(vals) == "[0] (0, 4.0)\n[1] (100, 4.0)\n[2] (200, 4.0)\n[3] (300, 4.0)"


def test_two_interrupts_free_ranks_that_ignore_the_first(kernel: Kernel) -> None:
    kernel.ok("%%mesh\nkeep = rank * 100")
    # rank 1 blocks SIGINT, so the first interrupt cannot stop it; 0, 2, 3 wait on it
    code = SKIP_ALL_REDUCE.replace("    time.sleep(60)", "    import signal\n"
                                   "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
                                   "    time.sleep(60)")
    msg_id, sent = kernel.submit(code)
    deadline = time.monotonic() + 60
    while "rank 1 never reached it" not in stderr_of(kernel, msg_id):  # the automatic hang hint
        assert time.monotonic() < deadline, "the hang was never explained"
        time.sleep(0.1)
    kernel.manager.interrupt_kernel()  # the first interrupt after the hint is explained too
    deadline = time.monotonic() + 30
    while "did not stop within 3 s" not in stderr_of(kernel, msg_id):
        assert time.monotonic() < deadline, "the stuck ranks were never explained"
        time.sleep(0.1)
    explained = stderr_of(kernel, msg_id)
    assert "ranks 0,2,3 wait in all_reduce" in explained
    assert explained.count("rank 1 never reached it: at cell line 7 (time.sleep(60))") == 2
    assert "Interrupt again" in explained
    second = time.monotonic()
    kernel.manager.interrupt_kernel()
    reply = kernel.wait(msg_id, sent, timeout=60)
    assert reply.replied_at - second < 15  # target < 3 s; generous on a loaded machine
    assert reply.status == "error"
    text = reply.error_text
    assert text.count("The process group was re-created") == 1, text
    assert "rank 1 restarted: its variables are lost" in text
    assert "ranks 0,2,3 had their collective aborted" in text and "ranks 0,2,3 kept their variables" in text
    assert "What an aborted collective wrote into may hold partial results on ranks 0,2,3" in text
    # Said as what happened, where it said rank 1 died and %mesh restart 1 would bring it back.
    assert "[1] RankRestarted: rank 1 was re-forked to free the mesh (mesh.recover()): it did not stop" in text
    assert "%mesh restart 1" not in text and "died" not in text, text
    assert "c10d_logger" not in text, "the interrupt that landed in torch's logging wrapper showed its frame"
    vals = kernel.ok("%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(globals().get('keep'), t.item())")
    assert result_text(vals) == "[0] (0, 4.0)\n[1] (None, 4.0)\n[2] (200, 4.0)\n[3] (300, 4.0)"


def test_an_interrupt_leaves_a_background_run_alone(kernel: Kernel) -> None:
    kernel.ok("bg = meshbook.current().run('import time\\ntime.sleep(4)\\n\"background done\"')")
    msg_id, sent = kernel.submit("meshbook.current().push(big=torch.ones(1 << 20))")  # queued behind bg
    time.sleep(1.5)
    kernel.manager.interrupt_kernel()
    reply = kernel.wait(msg_id, sent, timeout=60)
    assert reply.status == "error" and reply.content["ename"] == "KeyboardInterrupt"
    assert kernel.value("sorted(set(bg.result(timeout=30, echo=False).values()))") == ["background done"]
    assert result_text(kernel.ok("%%mesh\n'big' in globals()")) == "[0-3] False"


def test_timeout_ends_the_cell_with_a_diagnosis_then_restart_one_rank(kernel: Kernel) -> None:
    kernel.ok("%%mesh\nkeep = rank * 100")
    reply = kernel.execute(SKIP_ALL_REDUCE.replace("%%mesh", "%%mesh --timeout 3"))
    assert reply.status == "error"
    assert "still running on rank(s) 0-3 after 3 s" in reply.content["evalue"]
    assert "rank 1 never reached it: at cell line 5 (time.sleep(60))" in reply.content["evalue"]
    stacks = kernel.ok("%mesh stacks").stream()
    assert "[0,2,3] cell line 7, in <module>" in stacks and "[1] cell line 5" in stacks
    one = kernel.ok("%mesh stacks --where dp=0,tp=1").stream()  # rank 1, selected as %%mesh selects
    assert "[1] cell line 5" in one and "[0,2,3]" not in one, one
    verdict = kernel.ok("%mesh diagnose").stream()
    assert verdict.startswith("ranks 0,2,3 wait in all_reduce")
    restarted = kernel.ok("%mesh restart 1").stream()
    assert "rank 1 restarted: its variables are lost." in restarted
    assert "ranks 0,2,3 kept their variables." in restarted
    vals = kernel.ok("%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(globals().get('keep'), t.item())")
    assert result_text(vals) == "[0] (0, 4.0)\n[1] (None, 4.0)\n[2] (200, 4.0)\n[3] (300, 4.0)"
    assert "idle" in kernel.ok("%mesh status").stream()


def test_kill_then_degraded_message_then_restart(kernel: Kernel) -> None:
    kernel.ok("%mesh kill 3")
    reply = kernel.execute("%%mesh\n1")
    assert reply.status == "error" and "degraded" in reply.content["evalue"]
    assert "%mesh restart 3" in reply.content["evalue"]
    for command in ("kill", "interrupt"):  # a dead rank is not said to be signalled
        again = kernel.execute(f"%mesh {command} 3")
        assert again.content.get("evalue") == (f"rank(s) 3 are dead: nothing to {command}; mesh.restart([3]) "
                                               f"(%mesh restart 3) brings them back"), again.content
    assert kernel.ok("%mesh interrupt 2-3").stream() == "interrupted rank(s) 2-3 (rank(s) 3 dead already)\n"
    kernel.ok("%mesh restart 3")
    assert kernel.ok("%%mesh\nrank").status == "ok"


def test_breakpoint_opens_pdb_for_the_rank_in_the_notebook(kernel: Kernel) -> None:
    reply, prompts = kernel.execute_with_input(
        "%%mesh --ranks 2\nx = 41\nbreakpoint()\ny = x + 1\ny", ["p x", "n", "p y", "c"])
    assert reply.status == "ok", reply.error_text
    assert prompts == ["(Pdb rank 2) "] * 4
    out = reply.stream()
    assert "[2] 41\n" in out and "[2] 42\n" in out
    assert result_text(reply) == "[2] 42"


def test_a_rank_paused_in_the_debugger_is_told_the_others_wait_for_it_and_until_when(kernel: Kernel) -> None:
    """Rank 0 stops at a breakpoint before an all_reduce the others wait in: their collective's
    timeout runs while the user reads variables, and nothing said so. The note comes once, at
    the first prompt after they are seen waiting (the answer keeps rank 0 in pdb 1.5 s: a
    heartbeat comes meanwhile)."""
    reply, prompts = kernel.execute_with_input(
        "%%mesh\nt = torch.ones(1)\nif rank == 0:\n    breakpoint()\ndist.all_reduce(t)\nt.item()",
        ["import time; time.sleep(1.5)", "p 1", "p 2", "c"])
    assert reply.status == "ok", reply.error_text
    note = re.findall(r"ranks 1-3 wait in a collective while rank 0 is paused in the debugger: it fails with a "
                      r"timeout 300 s after entering it \(the mesh's collective timeout: about (\d+) s from now\) "
                      r"unless rank 0 joins it first \(c continues\)\.", reply.stream("stderr"))
    assert len(note) == 1 and 290 <= int(note[0]) <= 300, reply.stream("stderr")
    assert result_text(reply) == "[0-3] 4.0"


def test_several_ranks_at_breakpoints_are_served_one_after_another(kernel: Kernel) -> None:
    reply, prompts = kernel.execute_with_input(
        "%%mesh --ranks 0,1\nbreakpoint()\nrank", ["p rank", "c", "p rank", "c"])
    assert reply.status == "ok", reply.error_text
    first, second = prompts[0], prompts[2]
    assert prompts == [first, first, second, second] and first != second
    assert result_text(reply) == "[0] 0\n[1] 1"


def test_each_rank_s_debugger_shows_where_it_stopped_when_its_turn_comes(kernel: Kernel) -> None:
    """Not every rank's "> cell line 2" before the first prompt: rank 1's comes after rank 0's
    session, right above rank 1's first prompt."""
    reply, prompts = kernel.execute_with_input(
        "%%mesh --ranks 0,1\nbreakpoint()\nrank", ["p rank * 100", "c", "p rank * 100", "c"])
    assert reply.status == "ok", reply.error_text
    first = int(prompts[0].split()[-1].rstrip(")"))
    second = 1 - first
    out = reply.stream()
    assert out.index(f"[{first}] {first * 100}\n") < out.index(f"[{second}] -> rank") \
        < out.index(f"[{second}] {second * 100}\n"), out


def test_the_debugger_s_stack_starts_at_the_cell_and_q_stops_the_cell_there(kernel: Kernel) -> None:
    reply, _ = kernel.execute_with_input(
        "%%mesh --ranks 1\ndef step():\n    breakpoint()\n    return 1\nkept = 5\nstep()", ["where", "up", "up", "q"])
    out = reply.stream()
    assert "worker.py" not in out and "runpy" not in out, out
    assert "[1] *** Oldest frame" in out, out  # the cell's own frame is as far up as it goes
    assert reply.status == "error"
    assert "[1] bdb.BdbQuit: quit in the debugger (q, or an interrupt at its prompt)" in reply.content["evalue"], \
        reply.content["evalue"]
    assert "bdb.py" not in reply.error_text and "cell line 6, in <module>" in reply.error_text, reply.error_text
    assert result_text(kernel.ok("%%mesh --ranks 1\nkept")) == "[1] 5"


def test_input_on_ranks_asks_the_notebook_one_rank_after_another(kernel: Kernel) -> None:
    reply, prompts = kernel.execute_with_input("%%mesh --ranks 1,3\nname = input('name? ')\nname.upper()",
                                               ["ada", "grace"])
    assert reply.status == "ok", reply.error_text
    assert sorted(prompts) == ["[1] name? ", "[3] name? "]
    answers = dict(zip((int(p[1]) for p in prompts), ("ADA", "GRACE")))
    assert result_text(reply) == f"[1] {answers[1]!r}\n[3] {answers[3]!r}"
    # Where nobody can answer (a batch run: no stdin), input() says so at once.
    refused = kernel.execute("%%mesh --ranks 0,2\ninput('name? ')")
    assert refused.status == "error"
    assert "[0,2] EOFError: input(): nobody can answer it here" in refused.error_text, "one line for both ranks"
    assert "mesh.push(name=value)" in refused.error_text


def test_an_answer_to_an_earlier_question_is_never_taken_for_the_next(kernel: Kernel) -> None:
    """An answer still on its way when its question was given up (interrupted) names that
    question: the rank drops it, where draining its queue before asking could not."""
    kernel.ok("import threading, time, meshbook\nsent = []\ndef late_answer():\n    time.sleep(1.5)\n"
              "    meshbook.current().controller.send_input(0, 'stale', 0)  # to a question never asked\n"
              "    sent.append(True)\nthreading.Thread(target=late_answer).start()")
    msg_id, sent_at = kernel.submit("%%mesh --ranks 0\nx = input('x? ')\nx", allow_stdin=True)
    assert kernel.client.get_stdin_msg(timeout=60)["content"]["prompt"] == "[0] x? "
    time.sleep(3)  # the stale answer reaches the rank while it waits
    kernel.client.input("fresh")
    reply = kernel.wait(msg_id, sent_at)
    assert reply.status == "ok" and result_text(reply) == "[0] 'fresh'", reply.error_text
    assert kernel.value("sent") == [True]


def test_the_time_a_user_takes_to_answer_is_not_the_cells(kernel: Kernel) -> None:
    msg_id, _ = kernel.submit("%%mesh --ranks 0 --timeout 2\nx = input('x? ')\nx.upper()", allow_stdin=True)
    assert kernel.client.get_stdin_msg(timeout=60)["content"]["prompt"] == "[0] x? "
    time.sleep(3)  # longer than the cell's timeout
    kernel.client.input("ada")
    reply = kernel.client.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok", reply["content"]


def test_a_question_left_when_the_cell_stops_waiting_gets_an_end_of_input(kernel: Kernel) -> None:
    msg_id, _ = kernel.submit("%%mesh --ranks 0,1 --timeout 2\nimport time\nif rank == 0:\n    breakpoint()\n"
                              "else:\n    time.sleep(0.5)\nx = input('x? ')\nx", allow_stdin=True)
    assert kernel.client.get_stdin_msg(timeout=60)["content"]["prompt"] == "(Pdb rank 0) "
    time.sleep(3)  # the user's time at a prompt is not the cell's: the timeout has not come
    # rank 0 runs 3 s inside pdb: the cell's timeout comes while rank 1's question is queued
    kernel.client.input("time.sleep(3)")
    reply = kernel.client.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "error"
    other = 1
    deadline = time.monotonic() + 30
    while "ended after the wait" not in (seen := "".join(
            m["content"].get("text", "") for _, m in kernel.outputs_of(msg_id))):
        assert time.monotonic() < deadline, f"the rank left asking never ended: {seen!r}"
        time.sleep(0.1)
    assert f"[{other}] EOFError: input(): nobody in the notebook will answer it" in seen, seen
    assert kernel.ok("%%mesh\nrank").status == "ok"


def test_a_wait_that_shows_nothing_answers_a_question_with_an_end_of_input(kernel: Kernel) -> None:
    reply, prompts = kernel.execute_with_input(
        "import meshbook\nasked = meshbook.current().run(\"input('x? ')\", ranks=[0])\ntry:\n"
        "    asked.result(echo=False)\nexcept meshbook.RemoteError as exc:\n    print(exc)", [])
    assert reply.status == "ok" and prompts == [], prompts
    assert "EOFError: input(): nobody in the notebook will answer it" in reply.stream()


def test_a_debugger_session_keeps_the_cell_status_out_of_its_transcript(kernel: Kernel) -> None:
    # the prompt's answer keeps the rank busy 1.5 s inside pdb: a status would show by then
    at_once, _ = kernel.execute_with_input("%%mesh --ranks 0\nbreakpoint()\nrank",
                                           ["import time; time.sleep(1.5)", "c"])
    assert at_once.status == "ok" and at_once.of_type("display_data") == [], "status inside pdb"
    # a status already showing when pdb opens stays above it and ends without durations
    later, _ = kernel.execute_with_input("%%mesh --ranks 0\nimport time\ntime.sleep(1.5)\n"
                                         "breakpoint()\nrank", ["import time; time.sleep(1.5)", "c"])
    final = [m["content"]["data"] for m in kernel.messages_of(later.msg_id)
             if m["msg_type"] == "update_display_data"]
    assert len(later.of_type("display_data")) == 1 and len(final) == 1, final
    assert "durations not shown" in final[0]["text/html"] and " s " not in final[0]["text/html"]


def test_post_mortem_of_a_rank(kernel: Kernel) -> None:
    kernel.ok("%%mesh\nNone")
    refused = kernel.execute("%mesh debug")
    assert refused.status == "error" and "no rank's last code ended in an exception" in refused.content["evalue"]
    assert kernel.execute("%%mesh --ranks 1\nz = 5\n1 / 0").status == "error"
    assert "give one rank, e.g. %mesh debug 1" in kernel.execute("%mesh debug 0,1").content["evalue"]
    reply, prompts = kernel.execute_with_input("%mesh debug", ["p z", "q"])  # the rank that failed
    assert reply.status == "ok", reply.error_text
    assert prompts == ["(Pdb rank 1) "] * 2
    assert "[1] 5\n" in reply.stream() and "ZeroDivisionError" in reply.stream()
    # Rank 2's own KeyError, not rank 0's collective aborted for want of it (the lowest rank
    # that failed was opened, a bystander)
    failed = kernel.execute("%%mesh\nt = torch.ones(1)\nif rank == 2:\n    {'lr': 0.1}['learning_rate']\n"
                            "dist.all_reduce(t)")
    assert failed.status == "error" and "CollectiveAborted" in failed.error_text + failed.stream("stderr")
    reply, prompts = kernel.execute_with_input("%mesh debug", ["q"])
    assert prompts == ["(Pdb rank 2) "] and "KeyError" in reply.stream(), reply.stream()


def test_breakpoint_without_stdin_is_skipped_with_a_note(kernel: Kernel) -> None:
    reply = kernel.ok("%%mesh --ranks 0\nbreakpoint()\n'went on'")
    assert "breakpoint() at line 2 skipped" in reply.stream("stderr")
    assert result_text(reply) == "[0] 'went on'"


def test_interrupt_command_stops_work_a_timed_out_cell_left_running(kernel: Kernel) -> None:
    reply = kernel.execute("%%mesh --timeout 1\nimport time\ntime.sleep(60)")
    assert reply.status == "error" and "keep running" in reply.content["evalue"]
    assert "interrupted every rank" in kernel.ok("%mesh interrupt").stream()
    started = time.monotonic()
    assert result_text(kernel.ok("%%mesh\n'free again'")) == "[0-3] 'free again'"
    assert time.monotonic() - started < 30  # not the 60 s sleep


def test_a_cell_behind_one_that_timed_out_says_what_it_waits_for(kernel: Kernel) -> None:
    """A cell whose ranks still run a cell that outlived its wait starts there only once that
    ends: it says so, naming that cell and how to stop it, instead of sitting silent."""
    reply = kernel.execute("%%mesh --timeout 1 --ranks 0,1\nimport time\ntime.sleep(4)")
    assert reply.status == "error" and "keep running" in reply.content["evalue"]
    msg_id, sent = kernel.submit("%%mesh\nrank")
    reply = kernel.wait(msg_id, sent, timeout=60)
    assert reply.status == "ok" and result_text(reply) == "[0] 0\n[1] 1\n[2] 2\n[3] 3"
    said = stderr_of(kernel, msg_id)
    assert re.search(r"rank\(s\) 0,1 still run cell \[\d+\]: the cell starts there once that ends \(%mesh "
                     r"interrupt 0,1 stops it; interrupting this cell drops this cell instead\)\.", said), said


def test_pdb_steps_from_a_cells_body_onto_its_last_expression_and_ends_with_the_cell(kernel: Kernel) -> None:
    """``n`` at the body's last line goes on to the cell's final expression (never into
    meshbook's worker), and stepping past the cell's end ends the session with the cell: the
    rank's next cell runs untraced."""
    reply, prompts = kernel.execute_with_input(
        "%%mesh --ranks 2\nx = 41\nbreakpoint()\ny = x + 1\ny * 2", ["n", "p y", "n"])
    assert reply.status == "ok", reply.error_text
    assert prompts == ["(Pdb rank 2) "] * 3
    out = reply.stream()
    assert "[2] -> y * 2\n" in out and "[2] 42\n" in out, out
    assert "meshbook" not in out and "--Return--" not in out, out
    assert result_text(reply) == "[2] 84"
    after = kernel.ok("%%mesh --ranks 2\nimport sys\nsys.gettrace() is None, '__meshbook_value__' in globals()")
    assert result_text(after) == "[2] (True, False)"
