"""Benchmarks of meshbook side by side with the systems a user would pick instead.

Run them from the repository root::

    ./dev bench                          # sets up .venv with the peers, then runs everything
    python -m bench                      # everything (half an hour on 2 cores), writes bench/RESULTS.md
    python -m bench --quick              # fewer sizes and repeats (a few minutes)
    python -m bench --only dispatch,data # some workloads; add --out FILE to keep a report

The peers come with ``pip install -e ".[bench]"``: ipyparallel and PyTorch Monarch
(``torchmonarch``), at the versions pinned in pyproject.toml.

Layout:

* ``workloads/`` one module per question (dispatch, startup, data movement, fan-out, across
  hosts, memory, training overhead); each returns tables and checks its issue's targets. A
  new workload is one new file there (see :mod:`bench.harness`);
* ``peers/`` each system behind one small interface: start ``n`` ranks, no-op, push, pull,
  pids, stop; ``peers/cells.py`` drives the systems' magics through a real Jupyter kernel;
* ``remote.py`` meshes "across hosts" on one machine: stand-in agents on 127.0.0.N
  (``standin_host.py``, for fan-out to 1,024 ranks) and the ssh launcher run locally;
* ``timing.py`` budgets and percentiles, ``report.py`` tables and number formats,
  ``procs.py`` reaping and memory, ``machine.py`` what the numbers were taken on.

Nothing here is part of the test suite: tests never assert timings.
"""
