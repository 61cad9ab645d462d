"""``run_in_thread``: a worker trip is waited for, even through native asyncio cancels."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from itemjournal._threads import run_in_thread

pytestmark = pytest.mark.anyio


async def test_result_and_error_pass_through(anyio_backend: str) -> None:
    assert await run_in_thread(lambda a, b: a + b, 2, 3) == 5

    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await run_in_thread(boom)


async def test_anyio_cancel_waits_for_the_trip(anyio_backend: str) -> None:
    release = threading.Event()
    finished: list[bool] = []

    def slow() -> int:
        release.wait(5)
        finished.append(True)
        return 1

    with anyio.CancelScope() as scope:
        scope.cancel()
        await run_in_thread(slow)  # cancelled at the checkpoint before the trip
    assert finished == []
    async with anyio.create_task_group() as tg:
        result: list[int] = []

        async def call() -> None:
            result.append(await run_in_thread(slow))

        tg.start_soon(call)
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
        release.set()
    assert finished == [True]
    assert result == [1]  # the shielded trip delivered its answer


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancel_is_held_until_the_trip_ends(anyio_backend: str) -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        started.set()
        release.wait(5)
        finished.append(True)

    task = asyncio.ensure_future(run_in_thread(slow))
    while not started.is_set():  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0.02)
    assert not task.done()  # still waiting for the thread
    task.cancel()
    await asyncio.sleep(0.02)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancel_before_the_trip_starts_skips_it(anyio_backend: str) -> None:
    ran: list[bool] = []
    task = asyncio.ensure_future(run_in_thread(lambda: ran.append(True)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert ran == []
