"""``%mesh plan`` and ``%mesh parallelize``: choose a layout by memory, then apply it.

A mixin of :class:`~meshbook.magics.mesh_magic.MeshMagics`; each command is a thin face over
:meth:`Mesh.plan <meshbook.Mesh.plan>` and :meth:`Mesh.parallelize <meshbook.Mesh.parallelize>`,
naming the notebook's own variables::

    %mesh plan --build build --batch 8x2048 --budget 70G --out report
    %mesh parallelize --build build          # the best row of the last %mesh plan
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from ..mesh import CHECKPOINTING, MeshError, PlanReport, parse_batch
from .base import command, notebook_values, out_name, parse_argstring, require_mesh, warnings_as_notes


class PlanCommands:
    """The ``%mesh`` commands that plan and apply parallel layouts."""

    shell: Any
    last_plan: PlanReport | None = None

    @magic_arguments(name="mesh plan")
    @argument("--build", "-b", required=True, help="the notebook's function that builds the model")
    @argument("--batch", required=True, help="the global batch shape, e.g. 8x2048 (batch x sequence)")
    @argument("--budget", help="bytes per rank, e.g. 70G (default: 90%% of what each rank has)")
    @argument("--optimizer", default="adamw", help="adamw (default), adam or sgd")
    @argument("--checkpointing", default=",".join(CHECKPOINTING),
              help="activation checkpointing to consider: none, block, selective (default: all)")
    @argument("--no-pp", action="store_true", help="leave out pipeline parallelism")
    @argument("--no-tp", action="store_true", help="leave out tensor parallelism")
    @argument("--out", "-o", help="also store the report (a PlanReport) in this variable")
    @command
    def plan(self, line: str) -> PlanReport:
        """Predict every layout's per-rank peak memory and step time; the best fitting first."""
        args = parse_argstring(self.plan, line)
        out = out_name(args)
        build = notebook_values(self.shell, [args.build], f"%mesh plan {line.strip()}")[args.build]
        try:
            shape = parse_batch(args.batch)
        except MeshError as exc:
            raise UsageError(str(exc)) from None
        checkpointing = tuple(c.strip() for c in args.checkpointing.split(",") if c.strip())
        bad = [c for c in checkpointing if c not in CHECKPOINTING]
        if bad or not checkpointing:
            raise UsageError(f"--checkpointing {args.checkpointing}: choose from {', '.join(CHECKPOINTING)}")

        def only(layout: Any) -> bool:
            return not (args.no_pp and layout.pp > 1) and not (args.no_tp and layout.tp > 1)

        try:
            report = require_mesh().plan(build, shape, optimizer=args.optimizer, budget=args.budget,
                                         only=only, checkpointing=checkpointing)
        except MeshError as exc:  # nothing fits: the table still says what each layout needs
            found = getattr(exc, "report", None)
            if found is None:
                raise
            self._keep(found, out)
            display(found)
            raise
        return self._keep(report, out)

    def _keep(self, report: PlanReport, out: str | None) -> PlanReport:
        self.last_plan = report
        if out:
            self.shell.user_ns[out] = report
        return report

    @magic_arguments(name="mesh parallelize")
    @argument("--build", "-b", required=True, help="the notebook's function that builds the model")
    @argument("--plan", "-p", help="a PlanReport variable (default: the last %%mesh plan) or a row of one")
    @argument("--row", type=int, help="the report's row number to apply (default: the best)")
    @command
    def parallelize(self, line: str) -> Any:
        """Build a planned layout on every rank: model, optimizer and step in each namespace."""
        args = parse_argstring(self.parallelize, line)
        retry = f"%mesh parallelize {line.strip()}"
        build = notebook_values(self.shell, [args.build], retry)[args.build]
        report = notebook_values(self.shell, [args.plan], retry)[args.plan] if args.plan else self.last_plan
        if report is None:
            raise UsageError("no plan yet: run %mesh plan --build NAME --batch 8x2048 first (or give --plan)")
        if isinstance(report, PlanReport):
            if args.row is not None and not 1 <= args.row <= len(report.rows):
                raise UsageError(f"--row {args.row}: the report has rows 1-{len(report.rows)}")
            row = report.rows[args.row - 1] if args.row is not None else report.best
        else:
            row = report
        with warnings_as_notes():
            return require_mesh().parallelize(build, row)
