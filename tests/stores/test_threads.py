"""``run_in_thread``: a worker trip is waited for, even through native asyncio cancels.

No test here sleeps to order events: a worker thread tells the loop it has started
through ``anyio.from_thread``, and "the task is still waiting" is checked after the
loop has run a fixed number of rounds, not after some wall-clock time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

from itemjournal._stores.threads import run_in_thread

pytestmark = pytest.mark.anyio

ROUNDS = 50  # loop rounds given to a task to act on a cancel it has been sent
BOUND = 10.0  # seconds; only reached when a test is failing


async def let_the_loop_run(rounds: int = ROUNDS) -> None:
    """Give every ready task ``rounds`` turns (a task's reaction to a cancel needs two)."""
    for _ in range(rounds):
        await anyio.lowlevel.checkpoint()


@contextmanager
def one_worker_token() -> Iterator[anyio.CapacityLimiter]:
    """Make the default thread limiter (the one ``run_in_thread`` uses) one token wide."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    before = limiter.total_tokens
    limiter.total_tokens = 1
    try:
        yield limiter
    finally:
        limiter.total_tokens = before


async def test_result_and_error_pass_through(anyio_backend: str) -> None:
    assert await run_in_thread(lambda a, b: a + b, 2, 3) == 5

    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await run_in_thread(boom)


async def test_anyio_cancel_waits_for_the_trip(anyio_backend: str) -> None:
    entered = anyio.Event()
    release = threading.Event()
    finished: list[bool] = []

    def slow() -> int:
        anyio.from_thread.run_sync(entered.set)
        assert release.wait(BOUND)
        finished.append(True)
        return 1

    with anyio.CancelScope() as scope:
        scope.cancel()
        await run_in_thread(slow)  # cancelled at the checkpoint before the trip
    assert finished == []
    assert not entered.is_set()

    result: list[int] = []

    async def call() -> None:
        result.append(await run_in_thread(slow))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        with anyio.fail_after(BOUND):
            await entered.wait()  # the trip is under way in its thread
        tg.cancel_scope.cancel()
        release.set()
    assert finished == [True]
    assert result == [1]  # the shielded trip delivered its answer


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancel_is_held_until_the_trip_ends(anyio_backend: str) -> None:
    entered = anyio.Event()
    release = threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        anyio.from_thread.run_sync(entered.set)
        assert release.wait(BOUND)
        finished.append(True)

    task = asyncio.ensure_future(run_in_thread(slow))
    try:
        with anyio.fail_after(BOUND):
            await entered.wait()
        task.cancel()
        await let_the_loop_run()
        assert not task.done()  # still waiting for the thread
        task.cancel()
        await let_the_loop_run()
        assert not task.done()
        assert finished == []
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]


def _let_go(task: asyncio.Task[object]) -> None:
    """On failure only: end ``run_in_thread``'s wait for a trip that will never run.

    Otherwise that wait, shielded from every cancel, would keep the event loop (and the
    test run) from ever closing.
    """
    frame = task.get_coro().cr_frame  # type: ignore[union-attr]
    trip = None if frame is None else frame.f_locals.get("trip")
    if trip is not None:
        trip.finished = True


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancel_before_the_trip_starts_skips_it(anyio_backend: str) -> None:
    """The trip waits for a worker thread (every token is held) when ``task.cancel()`` lands."""
    holding = anyio.Event()
    release = threading.Event()
    ran: list[bool] = []

    def hold_the_only_token() -> None:
        anyio.from_thread.run_sync(holding.set)
        release.wait(2 * BOUND)  # set in the ``finally`` below, however the test goes

    with one_worker_token() as limiter:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, hold_the_only_token)
            try:
                with anyio.fail_after(BOUND):
                    await holding.wait()
                assert limiter.borrowed_tokens == limiter.total_tokens == 1

                task = asyncio.ensure_future(run_in_thread(lambda: ran.append(True)))
                for _ in range(ROUNDS):
                    if limiter.statistics().tasks_waiting:
                        break
                    await anyio.lowlevel.checkpoint()
                assert limiter.statistics().tasks_waiting == 1  # the trip waits for a thread
                assert not task.done()

                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=BOUND)
                if not done:
                    _let_go(task)
                assert done, "a native cancel of a trip that never started was not taken"
                assert task.cancelled()
                assert limiter.statistics().tasks_waiting == 0  # it left the queue
            finally:
                release.set()
        # One token, handed out in FIFO order: had the trip still been queued, it would
        # have run before this call got the token back.
        await anyio.to_thread.run_sync(lambda: None)
    assert ran == []
