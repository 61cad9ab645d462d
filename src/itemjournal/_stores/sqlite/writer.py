"""The SQLite store's batching writer: the queue of operations and its leader.

Operations that arrive while a commit is in flight wait in a queue; the next batch takes
all of them into ONE transaction with ONE commit (one WAL sync, see ``batch``). The first
caller to find no batch under way leads: it runs batches in a worker thread until its own
operation is done, then hands the lead to the first operation still queued. A lone
operation runs at once: there is no timer waiting for company.

While another process holds SQLite's write lock, the leader sleeps on the event loop
(short, jittered, cancellable sleeps) before it tries again; SQLite's own busy handler,
whose sleeps lengthen to 100 ms, would let a busy process starve a waiting one and could
not be cancelled. An operation cancelled while queued leaves the queue and never runs;
one cancelled while its batch runs waits for the batch, so its outcome is settled.
"""

from __future__ import annotations

import errno
import random
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from ..._model.errors import StorageFailed
from ..threads import run_in_thread
from .batch import BatchTransaction
from .operation import _DONE, _PENDING, _TAKEN, _Operation

__all__ = ["BatchWriter"]

T = TypeVar("T")


class BatchWriter(BatchTransaction):
    """The queue of operations waiting for a batch, and the leader that runs the batches
    (the event-loop half of the writer). ``busy_timeout`` (seconds) bounds how long a
    leader waits for another process's write lock."""

    busy_timeout: float

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[_Operation[Any]] = []
        self._leading = False

    async def _submit(self, operation: _Operation[T]) -> T:
        await anyio.lowlevel.checkpoint_if_cancelled()  # the only cancel point before queueing
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")
        self._queue.append(operation)
        if not self._leading:
            self._leading = True
            operation.leads = True
        else:
            await self._wait(operation)
            if operation.state == _DONE:
                return operation.result()
        await self._lead(operation)
        return operation.result()

    async def _lead(self, operation: _Operation[Any]) -> None:
        """Run batches until the leader's own operation is done, then hand over.

        While another process holds SQLite's write lock, the batch goes back to the
        queue and the leader sleeps on the event loop (cancellable) before it tries
        again, for at most ``busy_timeout`` seconds.
        """
        deadline = anyio.current_time() + self.busy_timeout
        delay = 0.0002
        try:
            while operation.state != _DONE:
                batch, self._queue = self._queue, []
                for member in batch:
                    member.state = _TAKEN
                busy = False
                try:
                    busy = await run_in_thread(self._run_batch, batch)
                finally:
                    if any(member.settled for member in batch):
                        for member in batch:
                            if not member.settled:  # pragma: no cover - the batch settles all
                                member.fail(StorageFailed("the batch holding this call failed"))
                            member.state = _DONE
                            member.wake()
                    elif not busy:  # the trip never ran (cancelled first): give the rest back
                        self._give_back([m for m in batch if m is not operation])
                if not busy:
                    continue
                if anyio.current_time() >= deadline:
                    for member in batch:
                        member.fail(
                            StorageFailed(
                                f"another process held the write lock of {self.path} for "
                                f"{self.busy_timeout:g} s",
                                errno=errno.ETIMEDOUT,
                            )
                        )
                        member.state = _DONE
                        member.wake()
                    continue
                self._give_back(batch)
                try:
                    await anyio.sleep(delay * (0.5 + random.random()))
                except BaseException:
                    self._queue.remove(operation)
                    raise
                delay = min(delay * 2, 0.005)
        finally:
            self._hand_over()

    def _give_back(self, members: list[_Operation[Any]]) -> None:
        for member in members:
            member.state = _PENDING
        self._queue[:0] = members

    async def _wait(self, operation: _Operation[Any]) -> None:
        """Wait until the operation was done by a batch, or was made the leader.

        Cancelled while queued, it leaves the queue and never runs. Cancelled while a
        batch holding it runs, it waits for that batch (shielded) so that its outcome is
        settled before the cancellation goes on.
        """
        try:
            await operation.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                while operation.state == _TAKEN:
                    try:
                        await operation.done.wait()
                    except anyio.get_cancelled_exc_class():  # a second, native cancel
                        continue
            if operation.state == _PENDING:
                self._queue.remove(operation)
                if operation.leads:
                    self._hand_over()
            raise

    def _hand_over(self) -> None:
        if self._queue:
            successor = self._queue[0]
            successor.leads = True
            successor.done.set()  # wakes it (or, not yet waiting, it finds it set); it leads
        else:
            self._leading = False
