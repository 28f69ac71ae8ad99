"""The ``kvstore`` command line: ``main.py`` parses and dispatches, the ``demo`` modules are the
short end-to-end demonstrations, and the ``kvstore bench ...`` commands live in ``benchmarks/``
(imported lazily, only when asked for)."""

from kvstore.cli.main import main

__all__ = ["main"]
