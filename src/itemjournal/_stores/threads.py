"""One worker-thread trip that is never abandoned half-way.

A trip runs in one of the stores' worker threads (``workers``). Its caller waits on an
event that the thread sets through the caller's event loop. Cancelled (by an anyio
cancel scope, or natively: ``task.cancel()``, ``asyncio.timeout``, ``wait_for``, which
anyio's shield does not stop), a caller whose trip has not started yet makes sure it
never will; one whose trip is under way keeps waiting, shielded, until it has finished,
and only then lets the cancellation go on: a durable write must not outlive the task
that waits for it unseen.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.lowlevel

from .._model.errors import StorageFailed
from .workers import Call, submit

__all__ = ["Trips", "run_in_thread"]

T = TypeVar("T")
Args = TypeVarTuple("Args")

_PENDING, _RUNNING, _ABANDONED = 0, 1, 2


class _Trip(Generic[T]):
    __slots__ = ("_args", "_error", "_function", "_lock", "_state", "_value", "finished")

    def __init__(self, function: Callable[..., T], args: tuple[object, ...]) -> None:
        self._function = function
        self._args = args
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: T | None = None
        self._error: BaseException | None = None
        self.finished = False

    def run(self) -> None:
        with self._lock:
            if self._state == _ABANDONED:
                return
            self._state = _RUNNING
        try:
            self._value = self._function(*self._args)
        except BaseException as error:
            self._error = error
        finally:
            self.finished = True

    def abandon(self) -> bool:
        """Make sure the trip never starts; False when it already has."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _ABANDONED
                return True
            return False

    def result(self) -> T:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value  # type: ignore[return-value]


async def run_in_thread(
    function: Callable[[Unpack[Args]], T],
    *args: *Args,
    on_cancel: Callable[[], None] | None = None,
) -> T:
    """Run ``function(*args)`` in a worker thread; wait for it even through a native cancel.

    ``on_cancel``, when given, is called (on the event loop, once, and it must not block)
    when the caller is cancelled while the trip runs: it may ask the trip to end early.
    """
    await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller starts no trip
    trip: _Trip[T] = _Trip(function, args)
    call = Call(trip.run)
    submit(call)
    try:
        # Without ``on_cancel``, an anyio cancel waits for the trip and its answer is
        # returned (the cancellation comes at the caller's next checkpoint), as
        # ``anyio.to_thread.run_sync`` does; a native cancel is not held by a shield.
        with anyio.CancelScope(shield=on_cancel is None):
            await call.finished_event.wait()
    except BaseException:
        if not trip.abandon():
            if on_cancel is not None and not trip.finished:
                on_cancel()
            with anyio.CancelScope(shield=True):
                while not call.finished_event.is_set():
                    try:
                        await call.finished_event.wait()
                    except anyio.get_cancelled_exc_class():
                        continue  # another native cancel: the trip still has to end first
        raise
    return trip.result()


class Trips:
    """The worker trips of one store: counted, so that closing can wait for them.

    ``run`` refuses once ``close`` has begun (``STORAGE_FAILED``, after a checkpoint: every
    call is one, a refused call too). ``close`` returns only after every trip under way has
    ended; its wait is shielded, and a native cancellation that arrives meanwhile is
    raised once the trips are done.

    With ``at_once``, at most that many of the trips are in worker threads at once; the
    others wait their turn on the event loop, in the order they came, for at most
    ``turn_timeout`` seconds (then ``STORAGE_FAILED``, ``ETIMEDOUT``: nothing started). A
    caller cancelled while it waits has started nothing and ends at once; one whose turn
    comes after ``close`` began is refused.
    """

    __slots__ = (
        "__weakref__",
        "_at_once",
        "_blocking",
        "_blocking_idle",
        "_idle",
        "_in_flight",
        "_owner",
        "_turn_timeout",
        "_turns",
        "closed",
    )

    def __init__(
        self, owner: object, *, at_once: int | None = None, turn_timeout: float | None = None
    ) -> None:
        if at_once is not None and at_once < 1:
            raise ValueError(f"at least one trip must be allowed at once, not {at_once}")
        self._owner = owner  # named in the "closed" error
        self.closed = False
        self._in_flight = 0
        self._idle: anyio.Event | None = None  # set when the last trip ends after close
        self._at_once = at_once
        self._turn_timeout = turn_timeout
        self._turns = None if at_once is None else _Turns(at_once)
        # Blocking calls (``itemjournal.sync``) under way, in their callers' threads.
        self._blocking = 0
        # Guards the count; held only to change it. Closing polls the count down to zero
        # rather than being notified: a notification would cost every call, closing is rare.
        self._blocking_idle = threading.Lock()
        _ALL.add(self)

    def _forked(self) -> None:  # pragma: no cover - runs in forked children (fork tests)
        """In a forked child: the calls under way were the parent's, in threads and on an
        event loop the child does not have; it starts with none, and with locks of its own
        (one held by a parent's thread at the fork would never be released here)."""
        self._blocking = 0
        self._blocking_idle = threading.Lock()
        self._in_flight = 0
        self._idle = None
        if self._at_once is not None:
            self._turns = _Turns(self._at_once)

    def check_open(self) -> None:
        if self.closed:
            raise StorageFailed(f"{self._owner!r} is closed")

    async def run(
        self,
        function: Callable[[Unpack[Args]], T],
        *args: *Args,
        on_cancel: Callable[[], None] | None = None,
    ) -> T:
        if self.closed:
            await anyio.lowlevel.checkpoint()
            self.check_open()
        self._in_flight += 1
        try:
            turns = self._turns
            if turns is None:
                return await run_in_thread(function, *args, on_cancel=on_cancel)
            if not turns.take_now():  # no checkpoint: run_in_thread makes one at once
                await self._wait_turn(turns)
            try:
                self.check_open()
                return await run_in_thread(function, *args, on_cancel=on_cancel)
            finally:
                turns.give()
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    async def _wait_turn(self, turns: _Turns) -> None:
        """Wait for a free turn, at most ``turn_timeout`` seconds."""
        if self._turn_timeout is None:
            await turns.take()
            return
        with anyio.move_on_after(self._turn_timeout) as waiting:
            await turns.take()
        if waiting.cancelled_caught:
            raise StorageFailed(
                f"{self._owner!r} had {self._at_once} calls under way for "
                f"{self._turn_timeout:g} s, and this one never started, so nothing was "
                f"written",
                errno=errno.ETIMEDOUT,
            )

    def blocking(self) -> _BlockingCall:
        """``with trips.blocking():`` counts one blocking call (made in its caller's
        thread) for as long as it runs; refused, like ``run``, once ``close`` has begun.
        An object, not a generator: it is entered on every blocking call."""
        return _BlockingCall(self)

    def close_blocking(self) -> None:
        """``close`` for a caller without an event loop: refuse new calls, then wait for
        the blocking calls under way, and for the awaited trips (which end by themselves:
        they are polled, as nothing of another event loop can wake this thread)."""
        with self._blocking_idle:
            self.closed = True
        _poll_down(lambda: self._blocking + self._in_flight)

    async def close(self) -> None:
        # Under the blocking calls' lock, so that a call counted from now on is refused;
        # taken without blocking the event loop (it is held only for a count's change).
        while not self._blocking_idle.acquire(blocking=False):
            await anyio.lowlevel.checkpoint()
        self.closed = True
        self._blocking_idle.release()
        if self._blocking:  # blocking calls under way, in other threads: wait in a thread
            with anyio.CancelScope(shield=True):
                await run_in_thread(self._wait_blocking)
        if not self._in_flight:
            await anyio.lowlevel.checkpoint()
            return
        if self._idle is None:
            self._idle = anyio.Event()
        idle = self._idle
        cancelled: BaseException | None = None
        with anyio.CancelScope(shield=True):
            while self._in_flight:
                try:
                    await idle.wait()
                except anyio.get_cancelled_exc_class() as error:  # a native cancel
                    cancelled = error
        if cancelled is not None:
            raise cancelled

    def _wait_blocking(self) -> None:
        _poll_down(lambda: self._blocking)


def _poll_down(count: Callable[[], int]) -> None:
    """Wait (blocking the thread, in short and then longer sleeps) until ``count()`` is 0."""
    delay = 0.0005
    while count():
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class _BlockingCall:
    """One blocking call, counted by its store's ``Trips`` while it runs."""

    __slots__ = ("_trips",)

    def __init__(self, trips: Trips) -> None:
        self._trips = trips

    def __enter__(self) -> None:
        trips = self._trips
        with trips._blocking_idle:
            trips.check_open()
            trips._blocking += 1

    def __exit__(self, *exc_info: object) -> None:
        trips = self._trips
        with trips._blocking_idle:
            trips._blocking -= 1


class _Turns:
    """``limit`` turns, each handed on to the longest waiter when it is given back.

    Not anyio's ``Semaphore``: that is made for the event loop of one backend, and a store
    may outlive its loop (a test, a command run after another, trio after asyncio). Only
    the event a caller waits on belongs to a loop, the caller's own, made as it waits.
    """

    __slots__ = ("free", "waiting")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.waiting: collections.deque[anyio.Event] = collections.deque()

    def take_now(self) -> bool:
        """Take a free turn if there is one (then nobody waits: a turn given back goes to
        a waiter before it is free)."""
        if self.free:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a turn, handed over in the order the callers came."""
        handed = anyio.Event()
        self.waiting.append(handed)
        try:
            await handed.wait()
        except BaseException:
            if handed.is_set():  # handed a turn as the cancel came: it goes on to the next
                self.give()
            else:
                self.waiting.remove(handed)
            raise

    def give(self) -> None:
        """Give a turn back: to the longest waiter, or free."""
        if self.waiting:
            self.waiting.popleft().set()
        else:
            self.free += 1


# Every store's trips, so that a forked child starts each with none under way.
_ALL: weakref.WeakSet[Trips] = weakref.WeakSet()


def _forked() -> None:  # pragma: no cover - runs in forked children (fork tests)
    for trips in list(_ALL):
        trips._forked()


os.register_at_fork(after_in_child=_forked)
