"""The host agent process: one per host; it forks that host's ranks and supervises them.

Started by a launcher as ``python -m meshbook.mesh.agent`` (see :mod:`.host`). It imports the
protocol and the rank's entry point (:mod:`meshbook.mesh.rank.worker`: the agent forks ranks),
never the controller.
"""
