"""Per-identity turn-taking, and the events that wake a wait for a claim to settle.

Operations on one identity run one at a time within a journal; operations on different
identities run in parallel. A ``begin(..., wait=seconds)`` that meets a claim this
journal granted is woken by an event when it settles (``waiting``). Kept apart from the
operations because it is bookkeeping of tasks, not of records: nothing here reads or
writes the store. The blocking face's twin, for threads, is ``_sync/turns.py``.
"""

from __future__ import annotations

from collections import deque

import anyio

from .._model.identity import Identity

__all__ = ["FIRST_POLL", "LAST_POLL", "Turns"]

FIRST_POLL = 0.01  # seconds: the first pause of a waiter polling another process's claim
LAST_POLL = 1.0  # the longest pause (and how often a waiter on our own claim re-checks)


class Turns:
    """Who has each identity now, who waits for it, and which granted claims are open."""

    def __init__(self) -> None:
        # Identities in flight, each with the tasks waiting for it in arrival order. The
        # event loop runs this bookkeeping without awaiting, so it needs no lock.
        self.busy: dict[Identity, deque[anyio.Event]] = {}
        # Claims this journal granted that are still open: waiters (wait=...) on one of
        # them are woken when it settles, instead of polling. The event is made when the
        # first waiter asks for it (``settled_event``): most claims are never waited for.
        self.live: dict[Identity, anyio.Event | None] = {}

    def try_acquire(self, identity: Identity) -> bool:
        """Have ``identity`` to ourselves now if nobody has it (no await: the usual case);
        False when somebody has it, and then ``wait_turn``."""
        if identity in self.busy:
            return False
        self.busy[identity] = deque()
        return True

    async def wait_turn(self, identity: Identity) -> None:
        """Wait for ``identity``, which somebody has; waiters are served first come,
        first served.

        A release hands the identity straight to the oldest waiter (one wake-up, not a
        stampede of every waiter re-checking), so N calls on one identity cost O(N).
        """
        waiters = self.busy[identity]
        turn = anyio.Event()
        waiters.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed to us as the cancellation landed: pass it on
                self.release(identity)
            else:
                waiters.remove(turn)
            raise

    def release(self, identity: Identity) -> None:
        waiters = self.busy[identity]
        if waiters:
            waiters.popleft().set()  # the identity now belongs to that waiter
        else:
            del self.busy[identity]

    def granted(self, identity: Identity) -> None:
        """This journal granted a claim on ``identity``: waiters may wait for its event."""
        self.live[identity] = None

    def settled_event(self, identity: Identity) -> anyio.Event | None:
        """The event that the settlement of this journal's open claim on ``identity``
        sets; None when this journal holds no open claim on it."""
        if identity not in self.live:
            return None
        event = self.live[identity]
        if event is None:
            event = self.live[identity] = anyio.Event()
        return event

    def settled(self, identity: Identity) -> None:
        """Wake the waiters of a claim this journal granted: its record left ``started``."""
        event = self.live.pop(identity, None)
        if event is not None:
            event.set()
