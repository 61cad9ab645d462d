"""The stores' worker pool: calls beyond its limit queue, idle threads end, and a forked
child starts with no thread it does not have."""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import anyio.lowlevel
import pytest

from itemjournal._stores import workers
from itemjournal._stores.threads import run_in_thread

pytestmark = pytest.mark.anyio

BOUND = 10.0  # seconds; only reached when a test is failing


@contextmanager
def fresh_pool(limit: int) -> Iterator[workers._Pool]:
    before = workers._POOL
    workers._POOL = workers._Pool()
    workers._POOL.limit = limit
    try:
        yield workers._POOL
    finally:
        workers._POOL = before


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a state of the pool's threads (which set no event when they change it)."""
    with anyio.fail_after(BOUND):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.005)


def placed(pool: workers._Pool, count: int) -> bool:
    """``count`` calls are running or queued."""
    return pool.threads + len(pool.queue) == count


async def test_calls_beyond_the_limit_queue_and_all_run_in_order(anyio_backend: str) -> None:
    gate = threading.Event()
    ran: list[int] = []

    def call(n: int) -> int:
        assert gate.wait(BOUND)
        ran.append(n)
        return n

    answers: list[int] = []

    async def one(n: int) -> None:
        answers.append(await run_in_thread(call, n))

    with fresh_pool(1) as pool:
        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(one, n)
                await until(functools.partial(placed, pool, n + 1))
            assert pool.threads == 1 and len(pool.queue) == 5
            gate.set()
        assert pool.threads == 1  # never more than the limit
    assert ran == list(range(6))  # one thread: the queue, in the order it came
    assert sorted(answers) == ran


async def test_idle_threads_end_and_a_later_call_starts_one(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "IDLE", 0.05)
    with fresh_pool(4) as pool:
        names = await run_in_thread(lambda: threading.current_thread().name)
        assert names == "itemjournal worker"
        assert pool.threads == 1
        await until(lambda: pool.threads == 0)
        assert pool.idle == []
        assert await run_in_thread(lambda: 7) == 7
        assert pool.threads == 1


async def test_a_call_runs_in_its_callers_context(anyio_backend: str) -> None:
    import contextvars

    where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")
    where.set("caller")
    assert await run_in_thread(where.get) == "caller"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
async def test_a_forked_child_starts_with_an_empty_pool(anyio_backend: str) -> None:
    with fresh_pool(4) as pool:
        await run_in_thread(lambda: None)  # one idle thread, in this process only
        await until(lambda: len(pool.idle) == 1)  # it wakes its caller, then goes idle
        assert pool.threads == 1
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            ok = workers._POOL.threads == 0 and not workers._POOL.idle
            os.write(write, b"empty" if ok else b"stale")
            os._exit(0)
        os.close(write)
        try:
            answer = await anyio.to_thread.run_sync(os.read, read, 16)
        finally:
            os.close(read)
            await anyio.to_thread.run_sync(os.waitpid, child, 0)
    assert answer == b"empty"


async def test_a_thread_that_cannot_start_fails_its_call_which_never_runs(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "itemjournal worker":
            raise RuntimeError("can't start new thread")
        start(thread)

    with fresh_pool(4) as pool:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start"):
            await run_in_thread(ran.append, 1)
        assert pool.threads == 0 and pool.queue == collections.deque()
        monkeypatch.undo()
        await run_in_thread(ran.append, 2)
    assert ran == [2]
