"""``python -m meshbook.mesh.agent``: run this host's agent (see :mod:`.host`)."""

from .host import main

main()
