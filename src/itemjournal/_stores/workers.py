"""The stores' worker threads: a pool whose hand-off costs a lock and a callback.

Every blocking sequence of a store (a save: write, flush, fsync, link or replace,
directory fsync; a read; a page of a scan) is one call in one of these threads, as with
``anyio.to_thread.run_sync``, but handed over more cheaply: the call goes straight to an
idle thread (or a new one, up to ``LIMIT``; beyond that it queues), and its caller is
woken through its event loop's token (``run_sync_soon``, which does not wait for the
loop). anyio's own trip takes the current task, a capacity limiter, a cancel scope and
the time on the event loop each time, about a third of the file store's CPU with the
GIL held in a profile (``benchmarks/README.md``). What waits, and how a cancelled
caller is held until its call has ended, is ``threads.run_in_thread``.

Threads end after ``IDLE`` seconds without work. The calls run in a copy of their
caller's context, as anyio's do. A forked child starts with an empty pool.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import threading
from collections.abc import Callable
from typing import Final, TypeVarTuple, Unpack

import anyio
import anyio.lowlevel

__all__ = ["IDLE", "LIMIT", "Call", "call_soon", "submit"]

Args = TypeVarTuple("Args")

LIMIT: Final = 40  # threads at most, as anyio's default thread limiter allows
IDLE: Final = 10.0  # seconds without work before a thread ends


class Call:
    """One call for a worker thread; ``run`` is called there, then ``finished``."""

    __slots__ = ("context", "finished_event", "run", "token")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.context = contextvars.copy_context()
        self.token = anyio.lowlevel.current_token()
        self.finished_event = anyio.Event()  # set on the caller's loop once ``run`` returned


class _Worker:
    __slots__ = ("call", "wake")

    def __init__(self, call: Call | None) -> None:
        self.call = call
        self.wake = threading.Lock()  # released to hand a call to this idle thread
        self.wake.acquire()


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.queue: collections.deque[Call] = collections.deque()
        self.threads = 0
        self.limit = LIMIT

    def submit(self, call: Call) -> None:
        with self.lock:
            if self.idle:
                worker = self.idle.pop()
                worker.call = call
                worker.wake.release()
                return
            if self.threads >= self.limit:
                self.queue.append(call)
                return
            self.threads += 1
        thread = threading.Thread(
            target=self._serve, args=(_Worker(call),), name="itemjournal worker", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            with self.lock:
                self.threads -= 1
            raise

    def _serve(self, worker: _Worker) -> None:
        while True:
            call = worker.call
            assert call is not None
            worker.call = None
            try:
                call.context.run(call.run)
            finally:
                _finished(call)
            with self.lock:
                if self.queue:
                    worker.call = self.queue.popleft()
                    continue
                self.idle.append(worker)
            if worker.wake.acquire(timeout=IDLE):
                continue
            with self.lock:
                if worker in self.idle:  # no call was handed over meanwhile: end
                    self.idle.remove(worker)
                    self.threads -= 1
                    return
            worker.wake.acquire()  # handed one as the wait timed out: already released

    def forked(self) -> None:
        """In a forked child: the parent's threads are not here."""
        self.lock = threading.Lock()
        self.idle.clear()
        self.queue.clear()
        self.threads = 0


def _finished(call: Call) -> None:
    call_soon(call.token, call.finished_event.set)


def call_soon(
    token: anyio.lowlevel.EventLoopToken, function: Callable[[Unpack[Args]], object], *args: *Args
) -> None:
    """From any thread, have ``function(*args)`` called on ``token``'s event loop, without
    waiting for it (``run_sync_soon`` of ``anyio.abc.AsyncBackend``, as
    ``anyio.from_thread`` uses it). A loop that has ended (RunFinishedError) has no one
    waiting; whatever else a loop refuses must not end the calling thread, which its
    owner counts on."""
    with contextlib.suppress(Exception):
        token.backend_class.run_sync_soon(function, args, token.native_token)


_POOL = _Pool()


def _forked() -> None:
    _POOL.forked()


os.register_at_fork(after_in_child=_forked)


def submit(call: Call) -> None:
    """Run ``call`` in a worker thread (queued while ``LIMIT`` threads are busy)."""
    _POOL.submit(call)
