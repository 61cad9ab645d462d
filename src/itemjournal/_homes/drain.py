"""A graceful drain for worker loops and ``run_each``: on a signal (or ``stop()``), take no
new item, give those in flight a grace period to finish, then cancel what remains."""

from __future__ import annotations

import inspect
import math
import signal
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from types import TracebackType
from typing import TypeVar

import anyio
from anyio.abc import TaskGroup

from .._model.errors import InvalidArgument

__all__ = ["Drain", "drain_on_signals"]

T = TypeVar("T")

_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """``async with Drain(grace=10) as drain:`` around a worker loop or ``run_each``.

    ::

        async with itemjournal.drain_on_signals(grace=10) as drain:
            report = await itemjournal.run_each(journal, drain.items(orders), charge, ...)

    Once ``stop()`` is called (by a signal in ``signals``, or by the code itself),
    ``items(source)`` takes no further item from ``source`` (a wait for the next one is
    cut short, so nothing is taken and lost), and the items in flight have ``grace``
    seconds to finish. A loop that takes work otherwise checks ``drain.stopping``. When
    the grace period runs out, the body of the ``async with`` is cancelled: each claim
    block in flight marks its record ``needs_review``, as any cancellation does, and
    ``cancelled`` is then True; the ``async with`` ends without an error (what follows it
    should look at ``cancelled``). A body that finishes within the grace period is not
    cancelled. ``signals`` are watched with anyio's ``open_signal_receiver``, on asyncio
    and trio, in the main thread only; ``signals=()`` watches none.
    """

    def __init__(
        self, grace: float, *, signals: Iterable[signal.Signals] = _DEFAULT_SIGNALS
    ) -> None:
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not math.isfinite(grace)
            or grace < 0
        ):
            raise InvalidArgument(
                f"grace is a number of seconds, finite and not negative, not {grace!r}",
                code="INVALID_ARGUMENT",
            )
        self.grace = float(grace)
        self.signals = tuple(signals)
        self.signal: signal.Signals | None = None
        self.cancelled = False
        self._stopping = anyio.Event()
        self._waits: set[anyio.CancelScope] = set()
        self._group: TaskGroup | None = None

    @property
    def stopping(self) -> bool:
        """True once the drain has begun."""
        return self._stopping.is_set()

    async def wait(self) -> None:
        """Return once the drain has begun."""
        await self._stopping.wait()

    def stop(self) -> None:
        """Begin the drain (a second call changes nothing): no new item, and the grace
        period starts."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for scope in tuple(self._waits):
            scope.cancel()
        if self._group is not None:
            self._group.start_soon(self._deadline, name="itemjournal drain deadline")

    async def items(self, source: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
        """The items of ``source``, until the drain begins."""
        if isinstance(source, AsyncIterable):
            iterator: AsyncIterator[T] | None = aiter(source)
            plain = None
        else:
            iterator, plain = None, iter(source)
        try:
            while not self._stopping.is_set():
                if plain is not None:
                    try:
                        item = next(plain)
                    except StopIteration:
                        return
                else:
                    assert iterator is not None
                    with anyio.CancelScope() as scope:
                        self._waits.add(scope)
                        try:
                            item = await iterator.__anext__()
                        except StopAsyncIteration:
                            return
                        finally:
                            self._waits.discard(scope)
                    if scope.cancelled_caught:
                        return
                yield item
        finally:
            if inspect.isasyncgen(iterator):  # a generator is closed; a stream stays open
                await iterator.aclose()

    async def _deadline(self) -> None:
        await anyio.sleep(self.grace)
        self.cancelled = True
        assert self._group is not None
        self._group.cancel_scope.cancel("the drain's grace period ran out")

    async def _watch(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(*self.signals) as received:
            task_status.started()
            async for signum in received:
                self.signal = signal.Signals(signum)
                self.stop()

    async def __aenter__(self) -> Drain:
        if self._group is not None:
            raise InvalidArgument("a Drain is entered once", code="INVALID_ARGUMENT")
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        if self.signals:
            await group.start(self._watch, name="itemjournal drain signals")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._group is not None
        if not self.cancelled:
            self._group.cancel_scope.cancel()  # the watcher and a pending deadline
        return await self._group.__aexit__(exc_type, exc, tb)


def drain_on_signals(grace: float, signals: Iterable[signal.Signals] = _DEFAULT_SIGNALS) -> Drain:
    """A ``Drain`` begun by SIGTERM or SIGINT (or ``signals``): ``async with
    drain_on_signals(grace=10) as drain:``."""
    return Drain(grace, signals=signals)
