"""The graceful drain: on ``stop()`` or a signal no new item is taken, the items in flight
get the grace period to finish, and only what is still running then is cancelled."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from itemjournal import Claim, Drain, Identity, InvalidArgument, Journal, drain_on_signals, run_each

pytestmark = pytest.mark.anyio


def ident(item: int) -> Identity:
    return Identity("shop", "mail", "send", f"item-{item}")


async def _queue_of(
    count: int,
) -> tuple[
    anyio.streams.memory.MemoryObjectSendStream[int],
    anyio.streams.memory.MemoryObjectReceiveStream[int],
]:
    send, receive = anyio.create_memory_object_stream[int](count)
    for item in range(count):
        await send.send(item)
    return send, receive


async def test_stop_lets_the_items_in_flight_finish_and_takes_no_new_one(journal: Journal) -> None:
    send, receive = await _queue_of(20)
    started = 0
    eight_running = anyio.Event()

    async def slow(item: int, claim: Claim) -> str:
        nonlocal started
        started += 1
        if started == 8:
            eight_running.set()
        await anyio.sleep(0.2)
        return f"sent-{item}"

    async with Drain(grace=5, signals=()) as drain:

        async def stop_when_eight_run() -> None:
            await eight_running.wait()
            drain.stop()

        async with anyio.create_task_group() as group:
            group.start_soon(stop_when_eight_run)
            report = await run_each(
                journal, drain.items(receive), slow, identity=ident, definition="v1", limit=8
            )
    assert drain.stopping
    assert not drain.cancelled
    assert report.counts() == {"succeeded": 8, "reused": 0, "failed": 0, "refused": 0}
    assert (await journal.counts()).get("needs_review", 0) == 0
    left = [receive.receive_nowait() for _ in range(12)]  # the rest stayed in the queue
    assert left == list(range(8, 20))
    send.close()
    receive.close()


async def test_the_grace_period_ends_in_a_cancellation_and_reviews(journal: Journal) -> None:
    send, receive = await _queue_of(4)
    running = 0
    all_running = anyio.Event()

    async def hangs(item: int, claim: Claim) -> str:
        nonlocal running
        running += 1
        if running == 4:
            all_running.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    finished = False
    with anyio.fail_after(5):
        async with Drain(grace=0.2, signals=()) as drain:
            async with anyio.create_task_group() as group:

                async def stop_soon() -> None:
                    await all_running.wait()
                    drain.stop()

                group.start_soon(stop_soon)
                await run_each(
                    journal, drain.items(receive), hangs, identity=ident, definition="v1", limit=4
                )
            finished = True
    assert drain.cancelled
    assert not finished
    counts = await journal.counts()
    assert counts.get("needs_review") == 4
    for item in range(4):
        view = await journal.inspect(ident(item))
        assert view.review_reason is not None
        assert "cancelled" in view.review_reason
    send.close()
    receive.close()


async def test_sigterm_begins_the_drain(journal: Journal) -> None:
    done: list[int] = []

    async def quick(item: int, claim: Claim) -> str:
        if item == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(0.5)  # the signal arrives while this one is in flight
        done.append(item)
        return f"sent-{item}"

    async def numbers() -> object:
        item = 0
        while True:
            yield item
            item += 1
            await anyio.sleep(0.01)

    with anyio.fail_after(5):
        async with drain_on_signals(grace=5) as drain:
            report = await run_each(
                journal, drain.items(numbers()), quick, identity=ident, definition="v1", limit=1
            )
    assert drain.signal == signal.SIGTERM
    assert not drain.cancelled
    assert 3 in done
    assert report.ok
    assert max(done) == 3  # nothing after the signal was taken


async def test_a_wait_for_the_next_item_is_cut_short(journal: Journal) -> None:
    send, receive = anyio.create_memory_object_stream[int](1)
    taken: list[int] = []
    with anyio.fail_after(5):
        async with Drain(grace=1, signals=()) as drain, anyio.create_task_group() as group:

            async def stop_later() -> None:
                await anyio.sleep(0.1)
                drain.stop()

            group.start_soon(stop_later)
            async for item in drain.items(receive):
                taken.append(item)
    assert taken == []
    assert not drain.cancelled
    send.close()
    receive.close()


@pytest.mark.parametrize("grace", [-1, float("nan"), float("inf"), "5", True])
def test_grace_is_checked(grace: object) -> None:
    with pytest.raises(InvalidArgument):
        Drain(grace, signals=())  # type: ignore[arg-type]
