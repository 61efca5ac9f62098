"""What every meshbook process shares: the wire and the data that travels on it.

The controller, the host agents and the ranks all import this package, and it imports nothing
else of meshbook: the envelope and its signature (:mod:`.wire`), every message kind, channel and
header key (:mod:`.messages`), a run's events (:mod:`.events`), bulk buffers (:mod:`.payload`),
what rank operations answer (:mod:`.reports`), and the shared types: topology, values, cells,
errors, variables, limits, text.
"""
