"""``run_in_thread``: a worker trip is waited for, even through native asyncio cancels;
``Trips``: a store's trips, counted, and with ``at_once`` taking turns.

No test here sleeps to order events: a worker thread tells the loop it has started
through ``anyio.from_thread`` (with the loop's token: the stores' worker threads are not
anyio's), and "the task is still waiting" is checked after the loop has run a fixed
number of rounds, not after some wall-clock time.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

from itemjournal import StorageFailed
from itemjournal._stores import workers
from itemjournal._stores.threads import Trips, run_in_thread

pytestmark = pytest.mark.anyio

ROUNDS = 50  # loop rounds given to a task to act on a cancel it has been sent
BOUND = 10.0  # seconds; only reached when a test is failing


async def let_the_loop_run(rounds: int = ROUNDS) -> None:
    """Give every ready task ``rounds`` turns (a task's reaction to a cancel needs two)."""
    for _ in range(rounds):
        await anyio.lowlevel.checkpoint()


@contextmanager
def one_worker() -> Iterator[None]:
    """A fresh pool of one thread at most for ``run_in_thread``, for the ``with`` block."""
    before = workers._POOL
    workers._POOL = workers._Pool()
    workers._POOL.limit = 1
    try:
        yield
    finally:
        workers._POOL = before


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
    loop = anyio.lowlevel.current_token()

    def slow() -> int:
        anyio.from_thread.run_sync(entered.set, token=loop)
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
    loop = anyio.lowlevel.current_token()

    def slow() -> None:
        anyio.from_thread.run_sync(entered.set, token=loop)
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
    call = None if frame is None else frame.f_locals.get("call")
    if call is not None:
        call.finished_event.set()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancel_before_the_trip_starts_skips_it(anyio_backend: str) -> None:
    """The trip waits for a worker thread (the only one is busy) when ``task.cancel()``
    lands."""
    holding = anyio.Event()
    release = threading.Event()
    ran: list[bool] = []
    loop = anyio.lowlevel.current_token()

    def hold_the_only_thread() -> None:
        anyio.from_thread.run_sync(holding.set, token=loop)
        release.wait(2 * BOUND)  # set in the ``finally`` below, however the test goes

    with one_worker():
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_in_thread, hold_the_only_thread)
            try:
                with anyio.fail_after(BOUND):
                    await holding.wait()
                assert workers._POOL.threads == 1 and not workers._POOL.idle
                task = asyncio.ensure_future(run_in_thread(lambda: ran.append(True)))
                for _ in range(ROUNDS):
                    if workers._POOL.queue:
                        break
                    await anyio.lowlevel.checkpoint()
                assert len(workers._POOL.queue) == 1  # the trip waits for a thread
                assert not task.done()

                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=BOUND)
                if not done:
                    _let_go(task)
                assert done, "a native cancel of a trip that never started was not taken"
                assert task.cancelled()
            finally:
                release.set()
        # One thread, taking the queue in order: had the trip still been due to run, it
        # would have run before this one.
        await run_in_thread(lambda: None)
    assert ran == []


# ---------------------------------------------------------------------- trips taking turns


class Gate:
    """Calls that wait (in their worker threads) until ``open`` is called; counts how
    many are inside at once, and the order they came in."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.entered: list[int] = []

    def call(self, n: int) -> int:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.entered.append(n)
        try:
            assert self._open.wait(BOUND)
        finally:
            with self._lock:
                self.inside -= 1
        return n

    def open(self) -> None:
        self._open.set()


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop (and the worker threads) run until ``condition`` holds."""
    with anyio.fail_after(BOUND):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)


@contextmanager
def fresh_pool() -> Iterator[workers._Pool]:
    """A pool of its own for the ``with`` block, whose threads can be counted."""
    before = workers._POOL
    workers._POOL = workers._Pool()
    try:
        yield workers._POOL
    finally:
        workers._POOL = before


async def test_trips_at_once_hold_the_others_back_on_the_loop(anyio_backend: str) -> None:
    trips = Trips("store", at_once=2)
    gate = Gate()
    answers: list[int] = []

    async def one(n: int) -> None:
        answers.append(await trips.run(gate.call, n))

    with fresh_pool() as pool:
        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(one, n)
            await until(lambda: len(gate.entered) == 2)
            await let_the_loop_run()
            # Only two calls were handed to the pool (it had room for 40): the other four
            # wait on the loop, where nothing of theirs has started.
            assert pool.threads == 2 and not pool.queue
            assert len(gate.entered) == 2
            gate.open()
    assert gate.most == 2
    assert sorted(answers) == list(range(6))


async def test_trips_take_their_turns_in_the_order_they_came(anyio_backend: str) -> None:
    trips = Trips("store", at_once=1)
    gate = Gate()

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(trips.run, gate.call, n)
            await until(lambda n=n: trips._in_flight == n + 1)  # n waits, or runs (0)
        gate.open()
    assert gate.entered == list(range(5))


async def test_a_call_cancelled_while_it_waits_its_turn_ends_at_once_and_never_runs(
    anyio_backend: str,
) -> None:
    trips = Trips("store", at_once=1)
    gate = Gate()
    ran: list[str] = []
    ended = anyio.Event()
    scope = anyio.CancelScope()

    async def waiting() -> None:
        with scope:
            await trips.run(ran.append, "late")
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(trips.run, gate.call, 0)
        await until(lambda: gate.entered == [0])
        tg.start_soon(waiting)
        await until(lambda: trips._in_flight == 2)
        cancelled_at = time.monotonic()
        scope.cancel()
        with anyio.fail_after(BOUND):
            await ended.wait()  # while the first call still holds the only turn
        assert time.monotonic() - cancelled_at < 1.0  # at once, not when a turn came
        assert gate.inside == 1
        gate.open()
    assert ran == []
    assert await trips.run(ran.append, "after") is None  # its turn was not kept
    assert ran == ["after"]


async def test_a_turn_that_comes_after_close_began_is_refused(anyio_backend: str) -> None:
    trips = Trips("store", at_once=1)
    gate = Gate()
    ran: list[str] = []
    refused: list[BaseException] = []

    async def waiting() -> None:
        try:
            await trips.run(ran.append, "late")
        except StorageFailed as error:
            refused.append(error)

    async with anyio.create_task_group() as tg:
        tg.start_soon(trips.run, gate.call, 0)
        await until(lambda: gate.entered == [0])
        tg.start_soon(waiting)
        await until(lambda: trips._in_flight == 2)
        tg.start_soon(trips.close)
        await until(lambda: trips.closed)
        gate.open()
    assert ran == []
    assert len(refused) == 1 and "closed" in str(refused[0])


def test_trips_at_once_must_allow_one() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Trips("store", at_once=0)


async def test_a_turn_that_does_not_come_within_the_timeout_fails_and_never_runs(
    anyio_backend: str,
) -> None:
    trips = Trips("store", at_once=1, turn_timeout=0.05)
    gate = Gate()
    ran: list[str] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(trips.run, gate.call, 0)
        await until(lambda: gate.entered == [0])
        asked_at = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            await trips.run(ran.append, "late")
        waited = time.monotonic() - asked_at
        gate.open()
    assert 0.05 <= waited < 1.0  # the timeout, not sooner, and not much later
    assert caught.value.errno == errno.ETIMEDOUT
    assert "never started" in str(caught.value)
    assert ran == []
    assert await trips.run(ran.append, "after") is None  # the turns are all free again
    assert ran == ["after"]


def test_trips_take_turns_on_one_event_loop_after_another() -> None:
    """A store outlives an event loop (a test, a command run after another): its turns
    belong to no loop, and work under asyncio and then trio."""
    trips = Trips("store", at_once=1)
    answers: list[int] = []

    async def contended() -> None:
        gate = Gate()
        async with anyio.create_task_group() as tg:
            tg.start_soon(trips.run, gate.call, 0)
            await until(lambda: gate.entered == [0])

            async def second() -> None:
                answers.append(await trips.run(lambda: 1))

            tg.start_soon(second)
            await until(lambda: trips._in_flight == 2)  # the second waits its turn
            gate.open()

    anyio.run(contended, backend="asyncio")
    anyio.run(contended, backend="trio")
    assert answers == [1, 1]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_turn_handed_to_a_caller_cancelled_before_it_woke_goes_to_the_next(
    anyio_backend: str,
) -> None:
    """A native cancel (``task.cancel()``) landing after the turn was handed over, before
    the task woke up to take it. (An anyio cancel then comes at the trip's checkpoint,
    which gives the turn back too.)"""
    trips = Trips("store", at_once=1)
    gate = Gate()
    ran: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    async def first() -> None:
        await trips.run(gate.call, 0)  # gives its turn to the second caller...
        tasks[0].cancel()  # ...cancelled before it could wake up and take it

    async def waiting() -> None:
        await trips.run(ran.append, "second")

    with anyio.fail_after(BOUND):  # a turn lost with the cancelled task: the third waits
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await until(lambda: gate.entered == [0])
            tasks.append(asyncio.ensure_future(waiting()))
            await until(lambda: trips._in_flight == 2)
            tg.start_soon(trips.run, ran.append, "third")
            await until(lambda: trips._in_flight == 3)
            gate.open()
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert ran == ["third"]
    assert trips._turns is not None and trips._turns.free == 1 and not trips._turns.waiting
