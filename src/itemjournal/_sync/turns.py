"""Per-identity turns for threads, and the events that wake a wait for a claim to settle.

Written by hand: the blocking twin of ``_journal/turns.py``, the one part of the journal
layer where threads and tasks truly differ. A journal of the blocking face is shared by
any number of threads, so its bookkeeping is guarded by a lock (held only to change a
dict), and a thread waiting for an identity blocks on a lock of its own that the thread
ahead of it releases when it hands the identity on: first come, first served, one
wake-up per hand-over. Nothing here reads or writes the store.
"""

from __future__ import annotations

import threading
from collections import deque

from .._journal.turns import FIRST_POLL, LAST_POLL
from .._model.identity import Identity

__all__ = ["FIRST_POLL", "LAST_POLL", "Turns"]


class _Waiter:
    """A thread waiting for an identity: ``wake`` is released when it is handed over."""

    __slots__ = ("handed", "wake")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.handed = False


class Turns:
    """Who has each identity now, who waits for it, and which granted claims are open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Identities in flight, each with the threads waiting for it in arrival order.
        self.busy: dict[Identity, deque[_Waiter]] = {}
        # Claims this journal granted that are still open; the event is made when the
        # first waiter asks for it (``settled_event``): most claims are never waited for.
        self.live: dict[Identity, threading.Event | None] = {}

    def try_acquire(self, identity: Identity) -> bool:
        """Have ``identity`` now if nobody has it; False when somebody has it, and then
        ``wait_turn``."""
        with self._lock:
            if identity in self.busy:
                return False
            self.busy[identity] = deque()
            return True

    def wait_turn(self, identity: Identity) -> None:
        """Wait for ``identity`` (taken at once if it was let go meanwhile).

        A ``KeyboardInterrupt`` while waiting leaves the queue; if the identity was handed
        over as it landed, it goes on to the next waiter."""
        waiter = _Waiter()
        with self._lock:
            waiters = self.busy.get(identity)
            if waiters is None:  # released since ``try_acquire`` saw it busy
                self.busy[identity] = deque()
                return
            waiters.append(waiter)
        try:
            waiter.wake.acquire()
        except BaseException:
            with self._lock:
                handed = waiter.handed
                if not handed:
                    self.busy[identity].remove(waiter)
            if handed:
                self.release(identity)
            raise

    def release(self, identity: Identity) -> None:
        with self._lock:
            waiters = self.busy[identity]
            if not waiters:
                del self.busy[identity]
                return
            waiter = waiters.popleft()  # the identity now belongs to that waiter
            waiter.handed = True
        waiter.wake.release()

    def granted(self, identity: Identity) -> None:
        """This journal granted a claim on ``identity``: waiters may wait for its event."""
        with self._lock:
            self.live[identity] = None

    def settled_event(self, identity: Identity) -> threading.Event | None:
        """The event that the settlement of this journal's open claim on ``identity``
        sets; None when this journal holds no open claim on it."""
        with self._lock:
            if identity not in self.live:
                return None
            event = self.live[identity]
            if event is None:
                event = self.live[identity] = threading.Event()
            return event

    def settled(self, identity: Identity) -> None:
        """Wake the waiters of a claim this journal granted: its record left ``started``."""
        with self._lock:
            event = self.live.pop(identity, None)
        if event is not None:
            event.set()
