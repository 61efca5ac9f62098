"""Inside a rank: the worker loop, its streams and sampling, its debugger hook, and the
operations the controller may ask of it (:mod:`.ops`, the rank's remote surface).

A rank imports only :mod:`meshbook.mesh.protocol` and this package, never the controller.
"""
