"""Per-identity turn-taking, and waiting for a claim to settle (``wait=``).

Operations on one identity run one at a time within a journal; operations on different
identities run in parallel. A ``begin(..., wait=seconds)`` that meets a claim in progress
waits for it to leave ``started``: woken by an event when this journal granted the claim,
polling with lengthening pauses when another process (or journal) holds it. Kept apart
from the operations because it is bookkeeping of tasks, not of records: nothing here
reads or writes the store.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .._model.conflicts import ConflictError
from .._model.identity import Identity

__all__ = ["Turns", "wait_while_in_progress"]

T = TypeVar("T")

_FIRST_POLL = 0.01  # seconds: the first pause of a waiter polling another process's claim
_LAST_POLL = 1.0  # the longest pause (and how often a waiter on our own claim re-checks)


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


async def wait_while_in_progress(
    turns: Turns, identity: Identity, attempt: Callable[[], Awaitable[T]], limit: float
) -> T:
    """``attempt()``, again and again while it is refused ``IN_PROGRESS``, for at most
    ``limit`` seconds; then the last refusal goes on."""
    deadline = anyio.current_time() + limit
    delay = _FIRST_POLL
    while True:
        try:
            return await attempt()
        except ConflictError as refusal:
            if refusal.code != "IN_PROGRESS":
                raise
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                raise
        # Our own claim: its settlement sets an event. Another process's (or another
        # journal's): poll, with jittered, lengthening pauses.
        settled = turns.settled_event(identity)
        pause = min(remaining, delay * (0.5 + random.random() / 2))
        if settled is not None:
            with anyio.move_on_after(min(remaining, _LAST_POLL)):
                await settled.wait()
        else:
            await anyio.sleep(pause)
            delay = min(delay * 1.5, _LAST_POLL)
