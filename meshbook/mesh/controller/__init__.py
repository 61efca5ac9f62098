"""The notebook process: the Mesh API, the controller and its runs, the one event renderer,
launchers, data movement, debugging and the reports drawn from heartbeats.

Imports :mod:`meshbook.mesh.protocol`, and names rank operations from
:mod:`meshbook.mesh.rank.ops` (sent by reference, run on the ranks). It starts host agents as
processes, by module name; it never imports :mod:`meshbook.mesh.agent`. Nothing here imports
IPython.
"""
