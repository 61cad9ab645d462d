"""One batch of the SQLite store's writer: one transaction, one commit, every answer.

A batch runs in the store's writer thread on the writer connection. Each operation reads its row,
its step decides, and its write joins the transaction; nothing is answered until the
commit returned. What goes wrong is answered here too: a refusal or an unreadable row is
that operation's alone; a failure before the commit rolls the transaction back and every
caller whose write was lost hears that nothing was written; a failed ``COMMIT`` leaves
the writers' outcome unknown (the write-ahead log may hold the transaction), and they
hear that. The queue that gathers the operations of a batch is ``writer.BatchWriter``.
"""

from __future__ import annotations

import abc
import contextlib
import sqlite3
from typing import Any

from ..._model.codec import encode_record
from ..._model.errors import StorageFailed
from ..._model.records import Record
from ..kernelclock import kernel_time
from ..seam import Step
from .connection import _TRANSACTION_ERRORS, _busy, _failure, _primary_code
from .operation import _Operation
from .schema import _ROW, setting_text

__all__ = ["BatchTransaction"]


class BatchTransaction(abc.ABC):
    """The writer connection and the batches run on it (the thread half of the
    writer). The store gives it the database's names, tells it when the store is closed,
    and says how a connection is made and how a row is read."""

    path: str
    location: str
    _closed: bool

    def __init__(self) -> None:
        self.commits = 0  # committed write transactions, for tests and benchmarks
        self._stamp: float | None = None  # the kernel's time as the batch under way began
        self._writer: sqlite3.Connection | None = None
        self._writer_lost = False  # discarded after a failed rollback; reopened on demand

    @abc.abstractmethod
    def _connect(self, *, busy_timeout: float | None = None) -> sqlite3.Connection:
        """A new connection to the database (the writer's is made with busy timeout 0)."""

    @abc.abstractmethod
    def _read_row(self, digest: object, status: object, document: object) -> Record:
        """The row's record; ``RECORD_INVALID`` or ``STORAGE_FAILED`` about this row."""

    def _writer_for(self, batch: list[_Operation[Any]]) -> sqlite3.Connection | None:
        """The writer connection; reopened if a failed rollback made us discard it."""
        if self._writer is not None:
            return self._writer
        if not self._writer_lost or self._closed:
            for operation in batch:
                operation.fail(StorageFailed(f"{self!r} is closed"))
            return None
        try:
            connection = self._connect(busy_timeout=0)
        except sqlite3.Error as error:
            for operation in batch:
                operation.fail(
                    _failure(
                        f"cannot reopen {self.path} for writing, so nothing was written", error
                    )
                )
            return None
        self._writer, self._writer_lost = connection, False
        return connection

    def _run_batch(self, batch: list[_Operation[Any]]) -> bool:
        """One transaction, one commit, for every operation of the batch; every member is
        settled when it returns or raises (a ``BaseException`` that no step raised).

        Returns True, having done nothing, when another process holds the write lock.
        """
        for operation in batch:
            operation.reset()
        connection = self._writer_for(batch)
        if connection is None:
            return False
        try:
            connection.execute("BEGIN IMMEDIATE")
            self._stamp = kernel_time()  # one kernel time per batch, for ``written_at``
        except BaseException as error:
            if _busy(error):
                return True
            self._abandon(
                connection, batch, error, f"cannot start a write transaction on {self.path}"
            )
            return False
        written: set[str] = set()
        try:
            for operation in batch:
                self._run_one(connection, operation, written)
        except BaseException as error:
            self._abandon(connection, batch, error, f"the write transaction on {self.path} failed")
            return False
        try:
            connection.execute("COMMIT")
        except BaseException as error:
            self._commit_failed(connection, batch, error)
            return False
        self.commits += 1
        for operation in batch:
            operation.publish()
        return False

    def _run_one(
        self, connection: sqlite3.Connection, operation: _Operation[Any], written: set[str]
    ) -> None:
        """Read, decide, write one operation inside the batch.

        The step decides before anything of its own is written, so a refusal (an
        ``Exception`` from the step) or a row that cannot be read leaves nothing to undo
        and the batch's other operations stand. A failing write statement, or a
        ``BaseException`` from a step, raises: the whole transaction is given up (see
        ``_abandon``).
        """
        operation.depends = operation.key in written
        if operation.setting is not None:
            self._run_setting(connection, operation, written)
            return
        assert operation.step is not None
        try:
            row = connection.execute(_ROW, (operation.key,)).fetchone()
        except sqlite3.Error as error:
            if not connection.in_transaction or _primary_code(error) in _TRANSACTION_ERRORS:
                raise
            operation.pending = (
                True,
                _failure(
                    f"cannot read the record of {list(operation.identity or ())} in "
                    f"{self.path}, so nothing was written for this call",
                    error,
                ),
            )
            return
        try:
            current = None if row is None else self._read_row(operation.key, row[0], row[1])
            decision: Step[Any] = operation.step(current)
            data = None if decision.write is None else encode_record(decision.write)
        except Exception as error:  # a refusal, or a record that cannot be read
            operation.pending = (True, error)
            return
        except BaseException:
            operation.culprit = True
            raise
        if decision.delete:
            operation.wrote = True
            connection.execute("DELETE FROM itemjournal_records WHERE digest = ?", (operation.key,))
        elif decision.write is not None:
            operation.wrote = True
            connection.execute(
                "INSERT INTO itemjournal_records (digest, status, document, written_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (digest) DO UPDATE SET "
                "status = excluded.status, document = excluded.document, "
                "written_at = excluded.written_at",
                (operation.key, decision.write.status, data, self._stamp),
            )
        if operation.wrote:
            written.add(operation.key)
        operation.pending = (False, decision.answer)

    def _run_setting(
        self, connection: sqlite3.Connection, operation: _Operation[Any], written: set[str]
    ) -> None:
        assert operation.setting is not None
        key, value = operation.setting
        cursor = connection.execute(
            "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
            (key, value),
        )
        operation.wrote = cursor.rowcount != 0
        if operation.wrote:
            written.add(key)
        row = connection.execute("SELECT value FROM itemjournal_meta WHERE key = ?", (key,))
        found = row.fetchone()
        try:
            operation.pending = (
                False,
                setting_text(key, None if found is None else found[0], self.location),
            )
        except StorageFailed as error:
            operation.pending = (True, error)

    def _roll_back(self, connection: sqlite3.Connection) -> BaseException | None:
        """End a failed transaction so that the writer is usable again; if that cannot be
        done, discard the connection (closing it rolls back), to be reopened on demand.
        Returns what the rollback raised, if anything."""
        try:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if not connection.in_transaction:
                return None
            failure: BaseException | None = None
        except BaseException as error:
            failure = error
        self._writer, self._writer_lost = None, True
        with contextlib.suppress(Exception):
            connection.close()
        return failure

    def _abandon(
        self,
        connection: sqlite3.Connection,
        batch: list[_Operation[Any]],
        error: BaseException,
        what: str,
    ) -> None:
        """The transaction failed before its commit: roll it back; every member whose
        write (or whose read of a write) was lost, or that had not run, fails, and hears
        that nothing was written (true: no commit was ever asked for). Members that were
        refused, or that only read, keep their answers.

        A ``BaseException`` that a step raised goes to that step's caller alone; one from
        SQLite's side is raised again, to the writer thread, once every member is
        settled (each member's answer says what failed).
        """
        rollback_error = self._roll_back(connection)
        culprit = next((member for member in batch if member.culprit), None)
        for operation in batch:
            if operation is culprit:
                operation.fail(error)
            elif operation.pending is None or operation.wrote or operation.depends:
                if culprit is not None:
                    failure = StorageFailed(
                        f"another call in the same write transaction on {self.path} raised "
                        f"{type(error).__name__}, so the transaction was rolled back and "
                        f"nothing was written"
                    )
                    failure.__cause__ = error
                else:
                    failure = _failure(f"{what}, so nothing was written", error)
                operation.fail(failure)
            else:
                operation.publish()
        if culprit is None and not isinstance(error, Exception):
            raise error
        if rollback_error is not None and not isinstance(rollback_error, Exception):
            raise rollback_error

    def _commit_failed(
        self, connection: sqlite3.Connection, batch: list[_Operation[Any]], error: BaseException
    ) -> None:
        """``COMMIT`` failed: the write-ahead log may hold the transaction (it would then
        be replayed), so the writers' outcome is unknown, and said to be."""
        rollback_error = self._roll_back(connection)
        for operation in batch:
            if operation.wrote or operation.depends:
                operation.fail(
                    _failure(
                        f"the commit to {self.path} failed, so whether this call's write was "
                        f"saved is unknown (the write-ahead log may hold it)",
                        error,
                    )
                )
            else:
                operation.publish()
        if not isinstance(error, Exception):
            raise error
        if rollback_error is not None and not isinstance(rollback_error, Exception):
            raise rollback_error
