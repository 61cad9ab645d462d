"""A cancelled claim block's review reason: "block cancelled", and the reason the canceller
gave when it gave one (a deadline says so), never the backend's task reprs or addresses.

On every store, on asyncio and trio; a bare asyncio ``task.cancel()`` on asyncio only.
"""

from __future__ import annotations

import asyncio
import re

import anyio
import pytest

from itemjournal import Identity, Journal, definition_digest

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("cancel-reasons-v1")
# What the backends put in their messages: ``0x7f…`` and anyio's ``7f95…`` scope ids,
# ``<Task pending name=…>`` reprs.
NOISE = re.compile(r"0x[0-9a-f]+|[0-9a-f]{8,}|<Task|coro=|Cancelled via")


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "cancel", item)


async def reason_after(journal: Journal, identity: Identity) -> str:
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason is not None
    assert not NOISE.search(view.review_reason), view.review_reason
    return view.review_reason


async def cancel_from_outside(journal: Journal, identity: Identity, reason: str | None) -> None:
    in_body = anyio.Event()
    scope = anyio.CancelScope()

    async def worker() -> None:
        with scope:
            async with journal.claim(identity, {}, DEFINITION):
                in_body.set()
                await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(worker)
        await in_body.wait()
        if reason is None:
            scope.cancel()
        else:
            scope.cancel(reason)
    assert scope.cancelled_caught


async def test_a_cancel_scope_says_cancelled(journal: Journal) -> None:
    await cancel_from_outside(journal, ident("scope"), None)
    assert await reason_after(journal, ident("scope")) == "block cancelled"


async def test_a_cancel_scope_with_a_reason_says_it(journal: Journal) -> None:
    await cancel_from_outside(journal, ident("scope-reason"), "the operator stopped the run")
    reason = await reason_after(journal, ident("scope-reason"))
    assert reason == "block cancelled: the operator stopped the run"


async def test_a_scope_cancelled_from_inside_the_block(journal: Journal) -> None:
    with anyio.CancelScope() as scope:
        async with journal.claim(ident("inside"), {}, DEFINITION):
            scope.cancel("no longer wanted")
            await anyio.sleep_forever()
    assert await reason_after(journal, ident("inside")) == "block cancelled: no longer wanted"


async def test_fail_after_says_the_deadline_passed(journal: Journal) -> None:
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            async with journal.claim(ident("deadline"), {}, DEFINITION):
                await anyio.sleep_forever()
    assert await reason_after(journal, ident("deadline")) == "block cancelled: deadline exceeded"


async def test_a_long_reason_is_cut_to_fit(journal: Journal) -> None:
    with anyio.CancelScope() as scope:
        async with journal.claim(ident("long"), {}, DEFINITION):
            scope.cancel("x" * 2000)
            await anyio.sleep_forever()
    reason = (await journal.inspect(ident("long"))).review_reason
    assert reason is not None
    assert reason.startswith("block cancelled: xxx")
    assert len(reason) == 500 and reason.endswith("\u2026")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("message", "expected"),
    [(None, "block cancelled"), ("server shutting down", "block cancelled: server shutting down")],
)
async def test_a_native_task_cancel_says_cancelled(
    journal: Journal, message: str | None, expected: str
) -> None:
    identity = ident(f"native-{message is not None}")
    entered = asyncio.Event()

    async def worker() -> None:
        async with journal.claim(identity, {}, DEFINITION):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(worker())
    await entered.wait()
    task.cancel(message)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await reason_after(journal, identity) == expected
