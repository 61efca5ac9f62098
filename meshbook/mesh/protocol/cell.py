"""Cell code: compile it like IPython does, and turn tracebacks into cell-relative frames.

A cell is compiled as a module whose last statement, if it is an expression not ended by a
``;`` (IPython's way to hide a value), is compiled separately in ``eval`` mode: its value is
the cell's result. Top-level ``await`` is allowed, as in IPython: such code compiles to a
coroutine, which the rank runs on its event loop (:func:`is_async`). Line numbers are shifted by
``first_line - 1`` so they match what the user sees (a ``%%mesh`` body starts on line 2 of its
cell), and the source is registered in :mod:`linecache` under the cell's file name so
tracebacks show the cell's own lines.

The controller compiles first, to report a ``SyntaxError`` before anything is sent; ranks
compile again from the same source (code objects do not travel).

Tracebacks leave out meshbook's own frames, and most of torch's: the cell line that called
torch says what the user did, and torch's innermost frame where the error left it (the check
that raised, the gloo call that failed). The frames in between (``c10d_logger`` wrappers, its
``_get_msg_dict``, ``Module._call_impl`` on the way to a forward defined in the notebook) are
torch's business, as meshbook's are its own.
"""

from __future__ import annotations

import ast
import bdb
import builtins
import functools
import inspect
import io
import itertools
import linecache
import os
import re
import sys
import tokenize
import traceback
from collections.abc import Iterable
from dataclasses import replace
from types import CodeType, FunctionType, TracebackType
from typing import Any, cast

from .errors import CELL_PREFIX, CellSyntaxError, Frame, RankFailure, RemoteError, home_of, short_path


def cell_filename(request_id: int | str) -> str:
    return f"{CELL_PREFIX}{request_id}>"


#: Where a cell's final expression leaves its value, for the worker to take out at once.
VALUE_NAME = "__meshbook_value__"


@functools.lru_cache(maxsize=64)
def compile_cell(source: str, filename: str, first_line: int = 1) -> CodeType:
    """Compile ``source`` into one code object; the value of a final expression statement
    becomes the result, left at :data:`VALUE_NAME` (one code object, not the body and the
    expression apart: a debugger steps from the body onto the expression as from line to line,
    where two, run one after the other, put the worker between).

    Cached (code objects are immutable): the same code run again, as in a loop of
    ``mesh.run(...)`` calls, is parsed once on the controller and once on each rank.
    """
    padded = "\n" * (first_line - 1) + source  # keeps line numbers (and SyntaxError's) right
    try:
        tree = ast.parse(padded, filename, "exec")
        tail = tree.body[-1] if tree.body else None
        if isinstance(tail, ast.Expr) and not _ends_with_semicolon(padded):
            keep = ast.Assign(targets=[ast.Name(VALUE_NAME, ast.Store())], value=tail.value)
            tree.body[-1] = ast.fix_missing_locations(ast.copy_location(keep, tail))
        return compile(tree, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:  # from the parse, or from the compile ('return' outside a function)
        raise CellSyntaxError(exc.msg + _not_python(exc.text), exc.lineno, exc.offset, exc.text) from None


def is_async(code: CodeType) -> bool:
    """Does ``code`` (a cell) ``await`` at the top level? Evaluated,
    it gives a coroutine to run on an event loop."""
    return bool(code.co_flags & inspect.CO_COROUTINE)


def _ends_with_semicolon(source: str) -> bool:
    """Is the last token of ``source`` (comments and blank lines aside) a ``;``?"""
    last = None
    skip = {tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in skip:
                last = token
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def _not_python(text: str | None) -> str:
    """A hint when the offending line is IPython syntax, which the ranks (plain Python) lack."""
    line = (text or "").lstrip()
    if line.startswith(("%", "!")):
        return (": IPython's magics (%...) and shell commands (!...) run in the notebook, not on the "
                "ranks; there, use Python (time.perf_counter(), subprocess.run)")
    return ""


#: Where each function of something sent by value comes from, by qualified name: its file,
#: or a cell name and the cell's source (see :func:`code_places`).
CodePlaces = dict[str, tuple[str, str]]


def code_places(functions: Iterable[tuple[str, Any]]) -> CodePlaces:
    """Where each ``(key, function)`` comes from, for the process that receives them by value
    (cloudpickle names their code ``<dynamic-code>``): its file, or for a notebook cell (a
    file only this process can read) a cell name with the cell's source, so tracebacks there
    read ``cell line 5, in generate`` with the line, as for ``%%mesh`` cells."""
    places = {}
    for key, function in functions:
        filename = function.__code__.co_filename
        if os.path.exists(filename):
            places[key] = (filename, "")
        else:
            places[key] = (cell_filename(key.rsplit(".", 1)[0]), "".join(linecache.getlines(filename)))
    return places


def module_functions(function: FunctionType) -> list[tuple[str, FunctionType]]:
    """``function`` and the functions of its module it calls by name (theirs too), by
    qualified name: what travels by value with it, each to be given its place back."""
    found: dict[str, FunctionType] = {}
    todo = [function]
    while todo:
        current = todo.pop()
        if found.setdefault(current.__qualname__, current) is not current:
            continue
        for name in _names(current.__code__):
            called = current.__globals__.get(name)
            if isinstance(called, FunctionType) and called.__globals__ is function.__globals__:
                todo.append(called)
    return list(found.items())


def _names(code: CodeType) -> set[str]:
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, CodeType)))


def place_code(functions: Iterable[tuple[str, Any]], places: CodePlaces) -> None:
    """Give functions received by value their file names back (and register a cell's
    source), their nested functions' and lambdas' code too."""
    for key, function in functions:
        if key in places:
            filename, source = places[key]
            function.__code__ = _renamed(function.__code__, filename)
            if source:
                register_source(filename, source)


def _renamed(code: CodeType, filename: str) -> CodeType:
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def register_source(filename: str, source: str, first_line: int = 1) -> None:
    """Make ``filename``'s lines visible to tracebacks, pdb and stack dumps."""
    text = "\n" * (first_line - 1) + source
    lines = [line + "\n" for line in text.splitlines()]
    linecache.cache[filename] = (len(text), None, lines, filename)


#: meshbook's own package and its folder, found from this module's name so that moving a
#: module inside the package changes nothing.
PACKAGE = __name__.partition(".")[0]
PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[PACKAGE].__file__ or "")) + os.sep


def is_internal(filename: str) -> bool:
    """Frames of meshbook's own machinery, hidden from users' tracebacks. ``filename`` may be
    absolute or, as py-spy shortens it, relative to the folder the package sits in."""
    return filename.startswith((PACKAGE_DIR, PACKAGE + os.sep))


def frames_of(tb: TracebackType | None) -> tuple[Frame, ...]:
    """User-facing frames of a traceback: meshbook's own rank machinery is left out, and so
    are torch's frames, except the innermost frame when the error was raised inside torch."""
    frames = [_frame(f.filename, f.lineno or 0, f.name, f.line or "")
              for f in traceback.extract_tb(tb) if not is_internal(f.filename)]
    # Not even innermost: c10d's logging wrapper, where an interrupt held back during the
    # collective lands as it logs the collective's failure (its def line says nothing).
    frames = [f for f in frames if not short_path(f.filename).startswith(_LOGGER)]
    return _collapsed(tuple(f for i, f in enumerate(frames) if not f.in_torch or (i == len(frames) - 1)))


def _collapsed(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """A run of the same frame (a runaway recursion) shown :data:`SHOWN_REPEATS` times and
    then counted, as Python's own traceback does, not a thousand times over."""
    out: list[Frame] = []
    for frame in frames:
        if len(out) >= SHOWN_REPEATS and all(replace(f, repeated=0) == frame for f in out[-SHOWN_REPEATS:]):
            out[-1] = replace(out[-1], repeated=out[-1].repeated + 1)
        else:
            out.append(frame)
    return tuple(out)


#: The standard library's debugger, whose frames a quit (``q``) is raised in.
_DEBUGGER_FILES = (os.sep + "bdb.py", os.sep + "pdb.py")
#: How often a repeated frame is shown before the rest are counted (Python's own number).
SHOWN_REPEATS = 3
#: ``BaseExceptionGroup`` where Python has it (3.11 on); nothing is one before.
_GROUP: Any = getattr(builtins, "BaseExceptionGroup", ())
#: How many earlier exceptions (``raise ... from``, or raised while handling) a failure tells.
CHAIN_SHOWN = 5


_LOGGER = "torch/distributed/c10d_logger.py"


_FAULT_FRAME = re.compile(r'  File "(.*)", line (\d+) in (.*)')


def crash_report(dump: str) -> str:
    """A rank's faulthandler dump as a user reads it: the fatal error, then the frames of the
    thread that crashed outside meshbook, most recent call last as in a traceback (a frame of
    a cell as ``cell line 3``). Every thread's stack, meshbook's own threads' included, and the
    list of extension modules buried the one line that said where (45 lines for one segfault).
    A crash in a thread Python does not run (a collective library's own: gloo aborts there on a
    size mismatch) has no such stack: the thread that runs the rank's code is told instead. A
    dump with neither is kept whole."""
    lines = dump.strip().splitlines()
    stacks = [i for i, line in enumerate(lines) if line.startswith(("Current thread ", "Thread "))]
    start = next((i for i in stacks if lines[i].startswith("Current thread ")), None)
    title = "The thread that crashed (most recent call last):"
    if start is None:  # the thread running a cell (or an applied function's), if one does
        start = next((i for i in stacks if any(CELL_PREFIX in line for line in _stack_lines(lines, i))), None)
        title = "Where the rank's code was (most recent call last):"
    if start is None:
        return dump.strip()
    head = [line for line in lines[:stacks[0]] if line.strip()]
    found = []
    for line in _stack_lines(lines, start):
        filename, lineno, name = cast(re.Match[str], _FAULT_FRAME.fullmatch(line)).groups()
        if not is_internal(filename) and not filename.startswith("<frozen ") \
                and not short_path(filename).startswith(_LOGGER):
            found.append(_frame(filename, int(lineno), name, linecache.getline(filename, int(lineno))))
    frames = _collapsed(tuple(reversed(found)))
    home = home_of(frames)
    told = [title, *(f.format(home) for f in frames)] if frames else []
    return "\n".join([*head, *told])


#: What the C++ runtime writes before it aborts on an exception nothing caught.
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'\n\s*what\(\):\s*(.+)")


def native_abort(stderr: str) -> str:
    """The C++ exception a process aborted on, from what the C++ runtime wrote to its stderr
    (``gloo::EnforceNotMet: ... Received data size doesn't match expected size ...``), or "":
    the reason a collective library's abort gives, which the crash dump lacks."""
    found = _TERMINATE.findall(stderr)
    return f"{found[-1][0]}: {found[-1][1].strip()}" if found else ""


def _stack_lines(lines: list[str], start: int) -> list[str]:
    """The frame lines of the thread whose stack begins at ``lines[start]``."""
    return list(itertools.takewhile(lambda line: _FAULT_FRAME.fullmatch(line) is not None, lines[start + 1:]))


def _frame(filename: str, lineno: int, name: str, line: str) -> Frame:
    return Frame(filename, lineno, name, line.strip(), filename.startswith(CELL_PREFIX))


def failure_from(rank: int, exc: BaseException) -> RankFailure:
    """Describe ``exc`` raised on ``rank`` for the controller (no pickling of the exception)."""
    message = _message(exc)
    frames = frames_of(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        # The error is *in* the code, not raised by it: point at the offending line.
        frames = frames + (_frame(exc.filename, exc.lineno, "<module>", exc.text or ""),)
        message = exc.msg
    if isinstance(exc, bdb.BdbQuit):  # q in the rank's debugger: where it was, not bdb's frames
        frames = tuple(f for f in frames if not f.filename.endswith(_DEBUGGER_FILES))
        message = ("quit in the debugger (q, or an interrupt at its prompt): the code stopped there; the rank is "
                   "idle, with its variables")
    detail = [] if isinstance(exc, RemoteError) else _notes(exc)  # its notes are its report, told below
    if isinstance(exc, RemoteError):  # a call this rank made failed where it ran (an actor's endpoint)
        message = message.split("\n", 1)[0]  # its hint is in the report below
        detail.extend(["The call failed where it ran:", *("  " + line for line in exc.render().splitlines())])
    detail.extend(_grouped(exc))
    detail.extend(_chain(exc))
    return RankFailure(rank, _public_name(type(exc)), message, frames, detail="\n".join(detail))


def _notes(exc: BaseException) -> list[str]:
    """What ``add_note()`` added, as Python prints it: after the message."""
    notes = getattr(exc, "__notes__", None)
    return [str(note) for note in notes] if isinstance(notes, (list, tuple)) else []


def _told(exc: BaseException) -> list[str]:
    """An exception inside another's report: its message, then its frames, each indented."""
    message = _message(exc)
    lines = [f"  {_public_name(type(exc))}" + (f": {message}" if message else "")]
    lines.extend("  " + line for f in frames_of(exc.__traceback__) for line in f.format().splitlines())
    lines.extend("  " + line for line in _notes(exc))
    return lines


def _grouped(exc: BaseException) -> list[str]:
    """The exceptions an ``ExceptionGroup`` holds, each told."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ()) if isinstance(exc, _GROUP) else ()
    lines = []
    for i, sub in enumerate(inner, 1):
        lines.append(f"Sub-exception {i} of {len(inner)}:")
        lines.extend(_told(sub))
        lines.extend("  " + line for line in _grouped(sub))
    return lines


def _chain(exc: BaseException) -> list[str]:
    """The exceptions before this one, nearest first, as Python tells them (its direct cause,
    or the one it was raised while handling, unless ``from None`` hid it)."""
    lines: list[str] = []
    seen = {id(exc)}
    while True:
        cause = exc.__cause__
        earlier = cause if cause is not None else (None if exc.__suppress_context__ else exc.__context__)
        if earlier is None or id(earlier) in seen:
            return lines
        if len(seen) > CHAIN_SHOWN:
            return [*lines, "(and earlier exceptions, left out)"]
        seen.add(id(earlier))
        lines.append("Raised from this exception (its direct cause):" if cause is not None else
                     "Raised while handling this exception:")
        lines.extend(_told(earlier))
        exc = earlier


def _public_name(cls: type) -> str:
    """How users name an exception class: ``ValueError``, ``meshbook.RemoteError``, ``torch.OutOfMemoryError``."""
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    if cls.__module__.startswith(PACKAGE + ".") and cls.__qualname__ in getattr(sys.modules[PACKAGE], "__all__", ()):
        return f"{PACKAGE}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def stack_frames(frame: object, skip_internal: bool = True) -> tuple[Frame, ...]:
    """Frames of a live stack (outermost first), as for a traceback."""
    summary = traceback.extract_stack(frame)  # type: ignore[arg-type]
    out = [_frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in summary
           if not f.filename.startswith("<frozen ")]  # the interpreter's own start-up
    if skip_internal:
        out = [f for f in out if not is_internal(f.filename)]
    return tuple(out)


def current_cell_line(frame: object) -> int | None:
    """The innermost cell line a live stack is on (cheap: no source lookups)."""
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith(CELL_PREFIX):  # type: ignore[attr-defined]
            return f.f_lineno  # type: ignore[attr-defined]
        f = f.f_back  # type: ignore[attr-defined]
    return None


