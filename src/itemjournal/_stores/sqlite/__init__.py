"""The SQLite store: one database, a writer that commits many operations at once.

``store`` is the seam; ``opening`` and ``schema`` make and check the database; ``writer``
(the queue and its thread) and ``batch`` (one transaction per batch, ``operation`` its
members) write; ``reads`` scans and counts; ``connection`` makes connections and reads
SQLite's errors.
"""
