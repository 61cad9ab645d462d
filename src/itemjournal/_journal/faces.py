"""The journal's two faces: what marks their differences, and what keeps a ``Journal`` on
one event loop.

The journal layer is written once, async; ``tools/async_to_sync.py`` writes the blocking
face (``itemjournal.sync``) from it. ``ASYNC`` marks the few places where the two truly
differ: ``if ASYNC:`` code is the async face's, its ``else`` branch the blocking face's.

An async ``Journal`` keeps per-identity turns and wakes waiters with events, and its
store hands worker trips back through the caller's event loop: all of it belongs to the
event loop that uses it. ``LoopGuard`` makes that a rule instead of a hang: a journal
belongs to the thread whose event loop first used it (several loops run one after another
in one thread, ``asyncio.run`` then ``trio.run``, share it), and a call from an event loop
in another thread is refused at once, before it touches anything, unless that thread has
ended. Threads that each want to use one journal use ``itemjournal.sync``.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable
from typing import Final, TypeVar, cast

from .._model.errors import InvalidArgument
from .._stores.seam import BlockingStore, Store

__all__ = ["ASYNC", "LoopGuard", "awaited", "blocking", "require_blocking"]

T = TypeVar("T")

ASYNC: Final = True


async def awaited(value: Awaitable[T]) -> T:
    """``value``'s result: for the blocking face, which runs an awaitable a caller handed it
    (an ``async def`` check) with ``anyio.run(awaited, value)``."""
    return await value


def blocking(store: Store) -> BlockingStore:
    """``store``, which the blocking face can use (``require_blocking``)."""
    require_blocking(store)
    return cast(BlockingStore, store)


def require_blocking(store: object) -> None:
    """Refuse, for the blocking face, a store without blocking calls (``BlockingStore``)."""
    if not callable(getattr(store, "apply_blocking", None)):
        raise InvalidArgument(
            f"{type(store).__name__} has no blocking calls (apply_blocking, ...), so "
            "itemjournal.sync cannot use it; use itemjournal.Journal with it",
            code="INVALID_ARGUMENT",
        )


class LoopGuard:
    """Which thread's event loop a journal belongs to; ``check`` refuses the others."""

    __slots__ = ("_lock", "_thread")

    def __init__(self) -> None:
        self._thread: int | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Refuse a call from an event loop in another thread than the journal's.

        The usual call costs one comparison of thread ids; only the first call, and a
        call from another thread, takes the lock."""
        if threading.get_ident() != self._thread:
            self._claim()

    def _claim(self) -> None:
        me = threading.get_ident()
        with self._lock:
            owner = self._thread
            if owner is not None and owner != me and _alive(owner):
                # A code of the contract's list (SPEC section 4): the journal was used
                # where it cannot be; the message says why and what to use instead.
                raise InvalidArgument(
                    "this Journal belongs to the event loop that first used it, in another "
                    "thread (OTHER_EVENT_LOOP); an async Journal serves one event loop (any "
                    "number of its tasks). Open a Journal per event loop, or share one "
                    "itemjournal.sync.Journal between threads",
                    code="INVALID_ARGUMENT",
                )
            self._thread = me


def _alive(ident: int) -> bool:
    return any(thread.ident == ident for thread in threading.enumerate())
