"""The SQLite store's batching writer: a queue of operations and the thread that serves it.

Callers put their operations in a queue and wait, on the event loop or, blocking, in
their own thread (``itemjournal.sync``); both kinds share batches. One writer thread
per store takes everything queued into ONE transaction with ONE commit (one WAL sync,
see ``batch``), answers every caller of the batch at once through its event loop
(anyio's event-loop token: one callback per loop and batch, without waiting for it;
a blocking caller through its own waker), and takes the next batch straight away: the
operations that queued while a commit was in flight. A lone operation runs at once:
there is no timer waiting for company; a lone blocking one, outside the main thread, runs
in its caller's thread (``_run_alone``). The thread is started by the first operation,
and ends when the store closes or after ``_IDLE`` seconds without work (the next
operation starts it again).

While another process holds SQLite's write lock, the batch goes back to the queue and
the thread waits (short, jittered sleeps, growing to 5 ms) before it tries again; an
operation queued for ``busy_timeout`` seconds by then fails with ``ETIMEDOUT``.
SQLite's own busy handler, whose sleeps lengthen to 100 ms, would let a busy process
starve a waiting one. An operation cancelled (a blocking one: interrupted) while queued
(waiting for the lock included) leaves the queue at once and never runs; one cancelled
while its batch runs waits for the batch, so its outcome is settled.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel

from ..._model.errors import StorageFailed
from ..threads import run_in_thread
from ..workers import call_soon
from .batch import BatchTransaction
from .operation import _DONE, _PENDING, _TAKEN, _Operation

__all__ = ["BatchWriter"]

T = TypeVar("T")

_IDLE: Final = 5.0  # seconds without work before the writer thread ends
_FIRST_DELAY, _LONGEST_DELAY = 0.0002, 0.005  # retries while another process writes


class BatchWriter(BatchTransaction):
    """The queue of operations waiting for a batch (the event-loop half of the writer)
    and the thread that runs the batches. ``busy_timeout`` (seconds) bounds how long an
    operation waits for another process's write lock."""

    busy_timeout: float

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[_Operation[Any]] = []  # guarded by _lock, as are the two below
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # new work, or stop: for an idle thread
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for work (and wants to hear of it)
        self._stopping = False
        self._running = False  # the thread holds a batch (running it, or about to retry it)
        self._alone = False  # a blocking caller runs its own operation as a batch (below)
        # Held by the thread while a batch runs on the writer connection: a fork waits for
        # it (see ``forking``), so no transaction is ever half-way in a child.
        self._gate = threading.Lock()

    @property
    def _writing(self) -> bool:
        """Work is queued or under way (for closing and for tests)."""
        return bool(self._queue) or self._running or self._alone

    async def _submit(self, operation: _Operation[T]) -> T:
        await anyio.lowlevel.checkpoint_if_cancelled()  # the only cancel point before queueing
        operation.token = anyio.lowlevel.current_token()
        done = operation.done  # made here, on the event loop, before the thread can answer
        self._enqueue(operation)
        try:
            await done.wait()
        except anyio.get_cancelled_exc_class():
            await self._cancelled(operation)
            raise
        return operation.result()

    def _submit_blocking(self, operation: _Operation[T]) -> T:
        """``_submit`` for a caller without an event loop: its thread blocks until the
        writer thread sets the operation's own waker."""
        waker = operation.waker = threading.Event()
        if self._run_alone(operation):
            return operation.result()
        self._enqueue(operation)
        try:
            waker.wait()
        except BaseException:  # KeyboardInterrupt, or whatever a signal handler raised
            self._interrupted(operation, waker)
            raise
        return operation.result()

    def _run_alone(self, operation: _Operation[Any]) -> bool:
        """A blocking caller that finds nothing queued and no batch under way runs its
        operation as a batch of one in its own thread, as the writer thread would (under
        the same gate), sparing two hand-offs between threads; True when it did.

        Never in the main thread: Python runs signal handlers there, and an interrupt
        raised between a commit and its answer would leave the caller unsure of what was
        written; the writer thread never sees one. Another process holding the write
        lock sends the operation to the queue, whose thread waits for the lock."""
        if threading.current_thread() is threading.main_thread():
            return False
        with self._lock:
            if self._queue or self._running or self._alone or self._closed or self._stopping:
                return False
            operation.queued_at = time.monotonic()
            operation.state = _TAKEN
            self._alone = True
        try:
            try:
                with self._gate:
                    busy = self._run_batch([operation])
            except BaseException:  # settled, and its answer says what failed
                busy = False
            if busy:
                with self._lock:
                    operation.state = _PENDING
                    self._alone = False
                return False
            if not operation.settled:  # pragma: no cover - a batch settles its members
                operation.fail(StorageFailed("the batch holding this call failed"))
            operation.state = _DONE
            return True
        finally:
            self._alone = False

    def _enqueue(self, operation: _Operation[Any]) -> None:
        """Queue the operation, starting the writer thread if none serves the queue.

        Refused once closing has begun: checked under the queue's lock, which closing
        takes to stop the thread, so an operation is either refused or served before the
        thread ends, whichever thread or event loop its caller is on.
        """
        operation.queued_at = time.monotonic()
        with self._lock:
            if self._closed or self._stopping:
                raise StorageFailed(f"{self!r} is closed")
            self._queue.append(operation)
            thread = self._thread
            # Not started yet, ended when idle, or ended by an error.
            if thread is None or not thread.is_alive():
                try:
                    self._start()
                except BaseException as error:  # it must not run later, unawaited
                    self._queue.remove(operation)
                    if not isinstance(error, Exception):  # an interrupt: nothing started
                        raise
                    raise StorageFailed(
                        f"cannot start the writer thread of {self.path}, so nothing was "
                        f"written: {error}"
                    ) from error
            elif self._idle:
                self._work.notify()

    def _start(self) -> None:
        thread = threading.Thread(
            target=self._serve, name=f"itemjournal writer {self.path}", daemon=True
        )
        self._thread = thread
        thread.start()

    def _leave_queue(self, operation: _Operation[Any]) -> bool:
        """Its caller gives up waiting: True when the operation was still queued, and has
        left the queue (it never runs); otherwise the batch holding it is told (one that
        finds the write lock taken gives it up instead of back), and the caller must wait
        until the batch has settled it."""
        with self._lock:
            if operation.state == _PENDING:
                self._queue.remove(operation)
                return True
            operation.abandoned = True
            return False

    async def _cancelled(self, operation: _Operation[Any]) -> None:
        """The caller was cancelled: a queued operation leaves the queue and never runs;
        one in a batch under way is waited for (shielded), so its outcome is settled
        before the cancellation goes on."""
        if self._leave_queue(operation):
            return
        with anyio.CancelScope(shield=True):
            while not operation.done.is_set():  # set once the batch is done
                try:
                    await operation.done.wait()
                except anyio.get_cancelled_exc_class():  # a second, native cancel
                    continue

    def _interrupted(self, operation: _Operation[Any], waker: threading.Event) -> None:
        """A blocking caller was interrupted: as ``_cancelled``, with the wait for a batch
        under way deaf to further interrupts (the first is raised once it is over)."""
        if self._leave_queue(operation):
            return
        while True:
            try:
                waker.wait()
            except BaseException:  # a second interrupt: the outcome comes first
                continue
            return

    def _request_stop(self) -> threading.Thread | None:
        """Have the thread finish what is queued and end; the thread to wait for."""
        with self._lock:
            self._stopping = True
            self._work.notify()
            return self._thread

    async def _stop(self) -> None:
        """Let the thread finish what is queued, then end it (shielded)."""
        thread = self._request_stop()
        if thread is not None:
            with anyio.CancelScope(shield=True):
                await run_in_thread(thread.join)

    def _writer_after_fork(self) -> None:
        """In a forked child: the parent's thread is not here, and its locks may have been
        held at the fork; the calls it was serving are the parent's. Start empty."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._gate = threading.Lock()
        self._queue = []
        self._thread = None
        self._idle = self._running = self._alone = False

    # ------------------------------------------------------------------ the writer thread

    def _serve(self) -> None:
        """The writer thread: batch after batch, until stopped or idle."""
        delay = _FIRST_DELAY
        while True:
            with self._lock:
                while not self._queue:
                    if self._stopping or not self._wait_for_work():
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
            # The batch is taken once the gate is had: what queues while a caller runs
            # alone (or a fork is prepared) waits to join it.
            with self._gate:
                with self._lock:
                    batch, self._queue = self._queue, []
                    for member in batch:
                        member.state = _TAKEN
                    self._running = bool(batch)
                if not batch:  # its callers gave up while the gate was held
                    continue
                try:
                    busy = self._run_batch(batch)
                except BaseException:  # every member is settled; its answer says what failed
                    busy = False
            if not busy:
                delay = _FIRST_DELAY
                self._answer(batch)
                continue
            self._retry_later(batch, delay)
            delay = min(delay * 2, _LONGEST_DELAY)

    def _wait_for_work(self) -> bool:
        """Wait (holding the lock's condition) for work; False after ``_IDLE`` seconds."""
        self._idle = True
        try:
            return self._work.wait(_IDLE) or bool(self._queue)
        finally:
            self._idle = False

    def _retry_later(self, batch: list[_Operation[Any]], delay: float) -> None:
        """Another process holds the write lock: operations queued ``busy_timeout`` ago
        fail, as do those whose callers were cancelled meanwhile; the others go back to
        the front of the queue, to be tried after a short sleep (cut short by closing)."""
        now = time.monotonic()
        ended: list[_Operation[Any]] = []
        with self._lock:
            waiting = []
            for member in batch:
                if member.abandoned:  # its caller was cancelled meanwhile: it never runs
                    member.fail(
                        StorageFailed(f"cancelled while waiting for the write lock of {self.path}")
                    )
                    ended.append(member)
                elif now - member.queued_at >= self.busy_timeout:
                    member.fail(
                        StorageFailed(
                            f"another process held the write lock of {self.path} for "
                            f"{self.busy_timeout:g} s",
                            errno=errno.ETIMEDOUT,
                        )
                    )
                    ended.append(member)
                else:
                    member.state = _PENDING
                    waiting.append(member)
            self._queue[:0] = waiting
        self._answer(ended)
        with self._lock:
            if not self._stopping:
                self._work.wait(delay * (0.5 + random.random()))

    def _answer(self, batch: list[_Operation[Any]]) -> None:
        """Every member is done: wake each caller, with one callback per event loop, and
        each blocking caller directly."""
        # By the loop itself (hashed by identity), not by its token (a dataclass, hashed
        # field by field): a batch's members mostly share one loop.
        loops: dict[object, tuple[anyio.lowlevel.EventLoopToken, list[_Operation[Any]]]] = {}
        wakers: list[threading.Event] = []
        for member in batch:
            if not member.settled:  # pragma: no cover - a batch settles all its members
                member.fail(StorageFailed("the batch holding this call failed"))
            member.state = _DONE
            token = member.token
            if token is None:  # a blocking caller's: every queued operation has one or other
                assert member.waker is not None
                wakers.append(member.waker)
                continue
            known = loops.get(token.native_token)
            if known is None:
                loops[token.native_token] = (token, [member])
            else:
                known[1].append(member)
        self._running = False
        for token, members in loops.values():
            call_soon(token, _wake, members)
        for waker in wakers:
            waker.set()


def _wake(members: list[_Operation[Any]]) -> None:
    for member in members:
        member.done.set()
