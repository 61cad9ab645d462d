"""Native asyncio cancellation (``task.cancel()``, ``asyncio.timeout``) of journal calls.

anyio's shield protects a worker-thread trip from anyio cancellation, not from a bare
``task.cancel()``: asyncio web frameworks cancel handlers that way. These tests use
asyncio directly because that is the behaviour under test; the library itself never
imports asyncio.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from itemjournal import Claim, FileStore, FileSystem, Journal, definition_digest

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("native-v1")
INPUTS = {"n": "1"}


class GatedSync(FileSystem):
    """Each fsync waits until the test lets it go, so a cancel can land mid-save."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.armed = False

    def fsync(self, fd: int) -> None:
        if self.armed:
            self.entered.set()
            self.proceed.wait(10)
        super().fsync(fd)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def gated_journal(root: Path) -> tuple[Journal, GatedSync]:
    fs = GatedSync()
    store = FileStore(str(root), fs=fs)
    await store.open()
    return Journal(store), fs


async def cancel_mid_save(journal: Journal, fs: GatedSync, identity: tuple[str, ...]) -> None:
    fs.armed, fs.entered, fs.proceed = True, threading.Event(), threading.Event()
    task = asyncio.ensure_future(journal.begin(identity, INPUTS, DEFINITION))
    while not fs.entered.is_set():  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.001)
    task.cancel()
    task.cancel()  # twice: the second must not cut the wait short either
    await asyncio.sleep(0.01)
    fs.armed = False
    fs.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_native_cancel_during_first_begin_leaves_no_record(root: Path) -> None:
    journal, fs = await gated_journal(root)
    identity = ("native", "cancel", "job", "first")
    await cancel_mid_save(journal, fs, identity)
    view = await journal.inspect(identity)
    assert view.status == "absent"
    assert not list(root.glob("??/*.tmp"))
    assert isinstance(await journal.begin(identity, INPUTS, DEFINITION), Claim)


async def test_native_cancel_of_a_retry_restores_the_released_record(root: Path) -> None:
    journal, fs = await gated_journal(root)
    identity = ("native", "cancel", "job", "retry")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.mark_review(identity, "timeout")
    released = await journal.resolve(identity, retry=True, note="verified not charged")
    await cancel_mid_save(journal, fs, identity)
    assert await journal.inspect(identity) == released
    second = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(second, Claim)
    assert second.attempt == 2


async def test_asyncio_timeout_around_begin(root: Path) -> None:
    journal, fs = await gated_journal(root)
    identity = ("native", "timeout", "job", "x")
    fs.armed = True
    threading.Timer(0.1, fs.proceed.set).start()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await journal.begin(identity, INPUTS, DEFINITION)
    fs.armed = False
    assert (await journal.inspect(identity)).status == "absent"


async def test_native_cancel_before_the_trip_starts_writes_nothing(root: Path) -> None:
    journal = await Journal.open(str(root))
    identity = ("native", "early", "job", "x")
    task = asyncio.ensure_future(journal.begin(identity, INPUTS, DEFINITION))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await journal.inspect(identity)).status == "absent"


async def cancel_repeatedly(task: asyncio.Future[object], times: int = 10) -> None:
    """Cancel ``task`` on each of ``times`` successive loop ticks (a timeout, then a task
    group's abort, then a shutdown...). A task cancelled on *every* tick forever cannot
    run any cleanup at all; a finite burst must not stop the journal's."""
    for _ in range(times):
        if task.done():
            return
        task.cancel()
        await asyncio.sleep(0)


async def test_repeated_cancels_still_mark_the_claim_block_for_review(root: Path) -> None:
    journal = await Journal.open(str(root))
    identity = ("native", "storm", "block", "x")
    entered = asyncio.Event()

    async def worker() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(worker())
    await entered.wait()
    await cancel_repeatedly(task)
    with pytest.raises(asyncio.CancelledError):
        await task
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason == "block cancelled"


async def test_repeated_cancels_still_take_back_an_undelivered_claim(root: Path) -> None:
    journal, fs = await gated_journal(root)
    identity = ("native", "storm", "begin", "x")
    fs.armed = True
    task = asyncio.ensure_future(journal.begin(identity, INPUTS, DEFINITION))
    while not fs.entered.is_set():  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.001)
    fs.armed = False
    await cancel_repeatedly(task)
    fs.proceed.set()  # the write ends; the take-back runs while cancels keep coming
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.1
    while not task.done() and loop.time() < until:
        task.cancel()
        await asyncio.sleep(0.0002)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await journal.inspect(identity)).status == "absent"


async def exit_cancelled_mid_mark(root: Path, identity: tuple[str, ...], raises: bool) -> None:
    """A claim block ends (normally, or by raising); while its exit marks the record, a
    native cancel lands; the interrupted write lands anyway, so the exit's retry finds
    the record already marked by itself."""
    journal, fs = await gated_journal(root)
    inside = asyncio.Event()

    async def worker() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION):
            fs.armed, fs.entered, fs.proceed = True, threading.Event(), threading.Event()
            inside.set()
            if raises:
                raise ValueError("declined after sending")

    task = asyncio.ensure_future(worker())
    await inside.wait()
    while not fs.entered.is_set():  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0.01)
    fs.armed = False
    fs.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert [event.event for event in view.history] == ["begin", "mark_review"]


async def test_a_cancel_during_the_exit_of_an_unsettled_block_stays_a_cancel(root: Path) -> None:
    await exit_cancelled_mid_mark(root, ("native", "exit", "plain", "x"), raises=False)


async def test_a_cancel_during_the_exit_of_a_raising_block_stays_a_cancel(root: Path) -> None:
    await exit_cancelled_mid_mark(root, ("native", "exit", "raised", "x"), raises=True)


async def test_notes_on_a_cancelled_exit_say_what_happened(root: Path) -> None:
    """The exception that leaves the block carries a note only when it is true: here the
    record was marked, so no note may say it was not."""
    journal, fs = await gated_journal(root)
    identity = ("native", "exit", "notes", "x")
    inside = asyncio.Event()
    seen: list[BaseException] = []

    async def worker() -> None:
        try:
            async with journal.claim(identity, INPUTS, DEFINITION):
                fs.armed, fs.entered, fs.proceed = True, threading.Event(), threading.Event()
                inside.set()
                raise ValueError("declined after sending")
        except BaseException as error:
            seen.append(error)
            raise

    task = asyncio.ensure_future(worker())
    await inside.wait()
    while not fs.entered.is_set():  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0.01)
    fs.armed = False
    fs.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seen) == 1
    assert isinstance(seen[0], asyncio.CancelledError)
    notes = getattr(seen[0], "__notes__", [])
    assert not any("did not mark" in note or "could not mark" in note for note in notes)
    assert any("marked" in note and "needs_review" in note for note in notes), notes
