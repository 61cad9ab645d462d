"""Helpers for testing code that uses itemjournal.

``MemoryStore`` keeps a journal's records in memory, so a unit test needs no directory
and no database, and no ``await open``::

    from itemjournal import Journal
    from itemjournal.testing import MemoryStore

    journal = Journal(MemoryStore())

The journal behaves as over a durable store (the same records, read as strictly), but
nothing survives the process: use it for tests, never for work that must be remembered.
"""

from ._stores.memory import MemoryStore

__all__ = ["MemoryStore"]
