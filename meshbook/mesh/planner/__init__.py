"""The planner's processes: each traces layouts for ``mesh.plan`` and exits (see :mod:`.trace`)."""
