"""The blocking face seen through the async face's methods, so one suite tests both.

``AsyncView(sync_journal)`` answers every call the async ``Journal`` answers, by making
the blocking journal's call of the same name in a worker thread (a real thread, as a
Flask view or a Celery task would call it) and awaiting it. Claims, attempts and the
listing are seen the same way. Nothing is decided here: the answers, the errors and the
records are the blocking journal's own, exactly as it gave them.

A test module opts in by setting ``FACES = ("async", "sync")``: its tests that take
``make_journal`` or ``journal`` then run on both faces (the blocking one on one anyio
backend only: its calls do not run on the event loop).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import anyio.to_thread

import itemjournal
from itemjournal import sync


async def _in_thread(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Not abandoned on cancellation: a blocking call cannot be cancelled, and the test
    # must see what it did (as a caller's thread would go on with it). A thread of its
    # own for every call, beyond anyio's 40: fifty callers waiting for one claim must not
    # take the thread its holder needs to complete it.
    return await anyio.to_thread.run_sync(
        functools.partial(call, *args, **kwargs), limiter=anyio.CapacityLimiter(1)
    )


class AttemptView:
    """A blocking ``Attempt``, seen through the async one's methods.

    ``isinstance`` sees it as the async face's class of the same name (a blocking
    ``ClaimedAttempt`` is an ``itemjournal.ClaimedAttempt`` here), so that the suite's
    checks of which attempt came back hold for both faces."""

    def __init__(self, attempt: sync.Attempt) -> None:
        self.sync_attempt = attempt

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return getattr(itemjournal, type(self.sync_attempt).__name__)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync_attempt, name)

    async def complete(self, receipt: str, result: str | None = None) -> Any:
        return await _in_thread(self.sync_attempt.complete, receipt, result)

    async def mark_review(self, reason: str | None = None) -> Any:
        return await _in_thread(self.sync_attempt.mark_review, reason)

    async def withdraw(self, reason: str) -> Any:
        return await _in_thread(self.sync_attempt.withdraw, reason)

    @contextlib.asynccontextmanager
    async def preparing(self) -> AsyncIterator[None]:
        async with _ContextView(self.sync_attempt.preparing()):
            yield


class _ContextView:
    """A blocking context manager, entered and left in worker threads."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def __aenter__(self) -> Any:
        return await _in_thread(self._context.__enter__)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        return bool(await _in_thread(self._context.__exit__, exc_type, exc, traceback))


class ClaimView(_ContextView):
    async def __aenter__(self) -> Any:
        return AttemptView(await super().__aenter__())


class AsyncView:
    """A blocking ``itemjournal.sync.Journal``, seen through the async one's methods."""

    face = "sync"

    def __init__(self, journal: sync.Journal) -> None:
        self.sync_journal = journal

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.sync_journal, name)
        if name.startswith("_") and callable(value):
            return functools.partial(_in_thread, value)  # the claim block's helpers
        return value

    def __repr__(self) -> str:
        return repr(self.sync_journal)

    async def aclose(self) -> None:
        await _in_thread(self.sync_journal.close)

    async def __aenter__(self) -> AsyncView:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def begin(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.begin, *args, **kwargs)

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.complete, *args, **kwargs)

    async def mark_review(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.mark_review, *args, **kwargs)

    async def withdraw(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.withdraw, *args, **kwargs)

    async def resolve(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.resolve, *args, **kwargs)

    async def inspect(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.inspect, *args, **kwargs)

    async def counts(self) -> Any:
        return await _in_thread(self.sync_journal.counts)

    async def sweep(self) -> Any:
        return await _in_thread(self.sync_journal.sweep)

    async def prune(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.prune, *args, **kwargs)

    async def verify(self) -> Any:
        return await _in_thread(self.sync_journal.verify)

    async def reconcile(self, *args: Any, **kwargs: Any) -> Any:
        return await _in_thread(self.sync_journal.reconcile, *args, **kwargs)

    def claim(self, *args: Any, **kwargs: Any) -> ClaimView:
        return ClaimView(self.sync_journal.claim(*args, **kwargs))

    async def records(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        listing = self.sync_journal.records(*args, **kwargs)
        done = object()
        try:
            while True:
                item = await _in_thread(next, listing, done)
                if item is done:
                    return
                yield item
        finally:
            await _in_thread(listing.close)
