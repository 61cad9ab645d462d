"""Waiting for a claim in progress to settle: ``begin(..., wait=seconds)``.

The begin is tried again and again while it is refused ``IN_PROGRESS``: woken by the
settlement's event when this journal granted the claim (``turns``), polling with
jittered, lengthening pauses when another process (or journal) holds it.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .._model.conflicts import ConflictError
from .._model.identity import Identity
from .faces import ASYNC
from .turns import FIRST_POLL, LAST_POLL, Turns

__all__ = ["wait_while_in_progress"]

T = TypeVar("T")


async def wait_while_in_progress(
    turns: Turns, identity: Identity, attempt: Callable[[], Awaitable[T]], limit: float
) -> T:
    """``attempt()``, again and again while it is refused ``IN_PROGRESS``, for at most
    ``limit`` seconds; then the last refusal goes on."""
    deadline = anyio.current_time() + limit
    delay = FIRST_POLL
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
        if settled is not None:
            if ASYNC:
                with anyio.move_on_after(min(remaining, LAST_POLL)):
                    await settled.wait()
            else:
                settled.wait(min(remaining, LAST_POLL))
        else:
            await anyio.sleep(min(remaining, delay * (0.5 + random.random() / 2)))
            delay = min(delay * 1.5, LAST_POLL)
