"""``run_each``: items run concurrently, each through the claim block; one item's failure
marks only that item for review, never cancels a sibling, and comes back in the report."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from itemjournal import (
    Claim,
    ConflictError,
    EachDone,
    EachFailure,
    EachReport,
    Identity,
    InvalidArgument,
    Journal,
    definition_digest,
    run_each,
)

pytestmark = pytest.mark.anyio

DEFINITION = "send-v1"


def ident(item: int | str) -> Identity:
    return Identity("shop", "mail", "send", f"item-{item}")


class ProviderError(Exception):
    """The simulated provider's failure."""


class Provider:
    """Counts calls, completions, cancellations and the most items in flight at once."""

    def __init__(self, fail_every: int | None = None, pause: float = 0.0) -> None:
        self.fail_every = fail_every
        self.pause = pause
        self.calls = 0
        self.completed = 0
        self.cancelled = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.keys: set[str] = set()

    async def send(self, item: int, claim: Claim) -> str:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.keys.add(claim.key)
            await anyio.lowlevel.checkpoint()
            if self.pause:
                await anyio.sleep(self.pause)
            if self.fail_every is not None and item % self.fail_every == self.fail_every - 1:
                raise ProviderError(f"provider refused item {item}")
            await anyio.lowlevel.checkpoint()
            self.completed += 1
            return f"msg-{item}"
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


def failing(count: int, every: int) -> list[int]:
    return [item for item in range(count) if item % every == every - 1]


# ---------------------------------------------------------------- failures stay with their item


async def test_one_failure_in_a_hundred_marks_only_that_item(journal: Journal) -> None:
    count = 1000
    provider = Provider(fail_every=100)
    started = time.perf_counter()
    report = await run_each(
        journal, range(count), provider.send, identity=ident, definition=DEFINITION, limit=64
    )
    first_run = time.perf_counter() - started
    bad = failing(count, 100)

    assert [failure.item for failure in report.failed] == bad
    assert report.counts() == {"succeeded": count - 10, "reused": 0, "failed": 10, "refused": 0}
    assert provider.calls == count
    assert provider.completed == count - 10  # every sibling ran to its end
    assert provider.cancelled == 0  # and none saw a cancellation
    assert provider.most_in_flight <= 64
    assert len(provider.keys) == count
    for failure in report.failed:
        assert isinstance(failure.error, ProviderError)
        assert str(failure.error) == f"provider refused item {failure.item}"
        assert failure.identity == ident(failure.item)
        assert failure.code is None
        assert failure.view is not None
        assert failure.view.status == "needs_review"
    assert [done.item for done in report.succeeded] == [i for i in range(count) if i not in bad]
    assert all(done.receipt == f"msg-{done.item}" for done in report.succeeded)

    for item in range(count):  # exactly the failing items need review
        view = await journal.inspect(ident(item))
        if item in bad:
            assert view.status == "needs_review"
            assert view.review_reason == f"block raised ProviderError: provider refused item {item}"
        else:
            assert view.status == "succeeded"
            assert view.receipt == f"msg-{item}"

    again = Provider()
    started = time.perf_counter()
    rerun = await run_each(
        journal, range(count), again.send, identity=ident, definition=DEFINITION, limit=64
    )
    second_run = time.perf_counter() - started
    assert again.calls == 0  # nothing runs twice, nothing uncertain is replayed
    assert rerun.counts() == {"succeeded": 0, "reused": count - 10, "failed": 0, "refused": 10}
    assert [done.receipt for done in rerun.reused] == [done.receipt for done in report.succeeded]
    assert [refusal.item for refusal in rerun.refused] == bad
    for refusal in rerun.refused:
        assert isinstance(refusal.error, ConflictError)
        assert refusal.code == "REVIEW_REQUIRED"
        assert refusal.view is not None and refusal.view.status == "needs_review"
    print(f"1,000 items, limit 64: first run {first_run:.2f} s, rerun {second_run:.2f} s")


async def test_a_failure_never_cancels_a_slow_sibling(journal: Journal) -> None:
    """The failing item ends while its siblings still wait on the provider."""
    siblings_waiting = anyio.Event()
    seen: list[str] = []

    async def send(item: int, claim: Claim) -> str:
        if item == 0:
            await siblings_waiting.wait()
            raise ProviderError("connection reset")
        if item == 3:
            siblings_waiting.set()
        try:
            await anyio.sleep(0.05)
        except anyio.get_cancelled_exc_class():
            seen.append(f"cancelled {item}")
            raise
        seen.append(f"done {item}")
        return f"msg-{item}"

    report = await run_each(journal, range(4), send, identity=ident, definition=DEFINITION, limit=4)
    assert sorted(seen) == ["done 1", "done 2", "done 3"]
    assert [failure.item for failure in report.failed] == [0]
    assert [done.item for done in report.succeeded] == [1, 2, 3]
    assert (await journal.inspect(ident(0))).status == "needs_review"


async def test_every_kind_of_exception_is_that_items_failure(journal: Journal) -> None:
    errors: dict[int, Exception] = {
        0: ProviderError("declined"),
        1: TimeoutError(),
        2: ExceptionGroup("several", [ValueError("a"), KeyError("b")]),
        3: ConflictError("the provider's own conflict", code="REVIEW_REQUIRED"),
    }

    async def send(item: int, claim: Claim) -> str:
        if item in errors:
            raise errors[item]
        return f"msg-{item}"

    report = await run_each(journal, range(6), send, identity=ident, definition=DEFINITION, limit=6)
    assert [(failure.item, failure.error) for failure in report.failed] == list(errors.items())
    assert report.refused == ()  # raised by fn under a claim: a failure, not a refusal
    assert [done.item for done in report.succeeded] == [4, 5]
    reasons = [(await journal.inspect(ident(item))).review_reason for item in errors]
    assert reasons == [
        "block raised ProviderError: declined",
        "block raised TimeoutError",
        "block raised ExceptionGroup: several (2 sub-exceptions)",
        "block raised ConflictError: REVIEW_REQUIRED: the provider's own conflict",
    ]


async def test_a_bad_receipt_needs_review_and_is_a_failure(journal: Journal) -> None:
    async def send(item: int, claim: Claim) -> Any:
        return {0: 42, 1: "  ", 2: ("r", "s", "t")}.get(item, f"msg-{item}")

    report = await run_each(journal, range(4), send, identity=ident, definition=DEFINITION, limit=2)
    assert [failure.item for failure in report.failed] == [0, 1, 2]
    assert {failure.code for failure in report.failed} == {"INVALID_RECEIPT"}
    view = await journal.inspect(ident(0))
    assert view.status == "needs_review"
    assert view.review_reason is not None
    assert "returned an int, not a receipt str or a (receipt, result) pair" in view.review_reason
    assert report.failed[0].view is not None
    assert report.failed[0].view.status == "needs_review"
    assert [done.item for done in report.succeeded] == [3]


async def test_a_receipt_and_result_pair_is_stored_and_replayed(journal: Journal) -> None:
    async def send(item: int, claim: Claim) -> tuple[str, str | None]:
        return f"msg-{item}", f'{{"id": {item}}}'

    report = await run_each(journal, range(3), send, identity=ident, definition=DEFINITION, limit=3)
    assert [(done.receipt, done.result) for done in report.succeeded] == [
        ("msg-0", '{"id": 0}'),
        ("msg-1", '{"id": 1}'),
        ("msg-2", '{"id": 2}'),
    ]
    assert (await journal.inspect(ident(1))).result == '{"id": 1}'
    rerun = await run_each(journal, range(3), send, identity=ident, definition=DEFINITION, limit=3)
    assert rerun.reused == report.succeeded


# ---------------------------------------------------------------- refusals


async def test_refusals_are_kept_apart_from_failures(journal: Journal) -> None:
    provider = Provider()
    first = await run_each(
        journal,
        range(3),
        provider.send,
        identity=ident,
        inputs=lambda item: {"to": f"user-{item}@example.com"},
        definition=DEFINITION,
        limit=3,
    )
    assert len(first.succeeded) == 3

    def identity(item: int) -> Identity:
        if item == 5:
            raise LookupError("no such customer")
        return ident(item) if item != 4 else Identity("shop", "mail", "send", "bad label")

    second = await run_each(
        journal,
        range(6),
        provider.send,
        identity=identity,
        inputs=lambda item: {"to": f"user-{item}@example.com" if item != 1 else "other"},
        definition=DEFINITION,
        limit=6,
    )
    assert provider.calls == 3 + 1  # only item 3 ran: the others were refused or reused
    assert [done.item for done in second.reused] == [0, 2]
    assert [done.item for done in second.succeeded] == [3]
    assert second.failed == ()
    assert [(r.item, r.code) for r in second.refused] == [
        (1, "INPUT_CHANGED"),
        (4, "INVALID_LABEL"),
        (5, None),
    ]
    changed, bad_label, lookup = second.refused
    assert changed.identity == ident(1)
    assert changed.view is not None and changed.view.status == "succeeded"
    assert bad_label.identity is None and bad_label.view is None
    assert isinstance(lookup.error, LookupError)
    assert (await journal.inspect(ident(1))).receipt == "msg-1"  # untouched


async def test_a_changed_definition_is_refused(journal: Journal) -> None:
    provider = Provider()
    await run_each(journal, range(2), provider.send, identity=ident, definition="v1", limit=2)
    report = await run_each(
        journal, range(2), provider.send, identity=ident, definition="v2", limit=2
    )
    assert [r.code for r in report.refused] == ["DEFINITION_CHANGED", "DEFINITION_CHANGED"]
    assert provider.calls == 2


async def test_an_item_twice_in_one_run_is_refused_in_progress_or_waited_for(
    journal: Journal,
) -> None:
    calls: list[str] = []

    async def send(item: str, claim: Claim) -> str:
        calls.append(item)
        await anyio.sleep(0.3)
        return f"msg-{item}"

    report = await run_each(
        journal, ["a", "a"], send, identity=ident, definition=DEFINITION, limit=2
    )
    assert [done.item for done in report.succeeded] == ["a"]
    assert [r.code for r in report.refused] == ["IN_PROGRESS"]

    waited = await run_each(
        journal, ["b", "b"], send, identity=ident, definition=DEFINITION, limit=2, wait=10
    )
    assert [done.receipt for done in waited.succeeded] == ["msg-b"]
    assert [done.receipt for done in waited.reused] == ["msg-b"]
    assert calls == ["a", "b"]


# ---------------------------------------------------------------- capacity and sources


async def test_limit_is_respected(journal: Journal) -> None:
    limit = 5
    in_flight: list[int] = []
    most: list[int] = [0]
    full = anyio.Event()

    async def send(item: int, claim: Claim) -> str:
        in_flight.append(item)
        most[0] = max(most[0], len(in_flight))
        if len(in_flight) == limit:
            full.set()
        try:
            if item < limit:  # the first items wait until all places are taken
                with anyio.fail_after(10):
                    await full.wait()
            await anyio.sleep(0.001)
        finally:
            in_flight.remove(item)
        return f"msg-{item}"

    report = await run_each(
        journal, range(40), send, identity=ident, definition=DEFINITION, limit=limit
    )
    assert len(report.succeeded) == 40
    assert most[0] == limit


async def test_limit_one_runs_items_one_after_another_in_order(journal: Journal) -> None:
    order: list[int] = []

    async def send(item: int, claim: Claim) -> str:
        order.append(item)
        await anyio.sleep(0.001 * (5 - item))
        return f"msg-{item}"

    report = await run_each(journal, range(5), send, identity=ident, definition=DEFINITION, limit=1)
    assert order == [0, 1, 2, 3, 4]
    assert [done.item for done in report.succeeded] == [0, 1, 2, 3, 4]


async def test_the_report_keeps_the_items_order(journal: Journal) -> None:
    async def send(item: int, claim: Claim) -> str:
        await anyio.sleep(0.001 * (10 - item))  # later items finish first
        if item % 3 == 0:
            raise ProviderError(str(item))
        return f"msg-{item}"

    report = await run_each(
        journal, range(10), send, identity=ident, definition=DEFINITION, limit=10
    )
    assert [done.item for done in report.succeeded] == [1, 2, 4, 5, 7, 8]
    assert [failure.item for failure in report.failed] == [0, 3, 6, 9]
    assert report.summary() == "10 items: 6 succeeded, 0 reused, 4 failed, 0 refused"
    assert not report.ok
    assert report.total == 10


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_source_is_taken_from_lazily(journal: Journal, kind: str) -> None:
    limit = 4
    provider = Provider(pause=0.001)
    pulled: list[int] = []
    ahead: list[int] = []  # items taken but not yet finished by fn, at each take

    def take(item: int) -> int:
        pulled.append(item)
        ahead.append(len(pulled) - provider.completed)
        return item

    async def async_items() -> AsyncIterator[int]:
        for item in range(50):
            await anyio.lowlevel.checkpoint()
            yield take(item)

    def sync_items() -> Iterator[int]:
        for item in range(50):
            yield take(item)

    source = async_items() if kind == "async" else sync_items()
    report = await run_each(
        journal, source, provider.send, identity=ident, definition=DEFINITION, limit=limit
    )
    assert len(report.succeeded) == 50
    assert pulled == list(range(50))
    assert max(ahead) == limit  # never more than the places free


async def test_an_endless_source_is_fine_when_the_caller_stops_it(journal: Journal) -> None:
    provider = Provider()
    closed: list[bool] = []

    async def forever() -> AsyncIterator[int]:
        item = 0
        try:
            while True:
                yield item
                item += 1
        finally:
            closed.append(True)

    with anyio.move_on_after(0.5) as scope:
        await run_each(
            journal, forever(), provider.send, identity=ident, definition=DEFINITION, limit=8
        )
    assert scope.cancelled_caught
    assert provider.calls > 0
    assert closed == [True]  # the generator was closed, not left to the garbage collector


async def test_a_failing_source_stops_the_run_after_the_items_in_flight(
    journal: Journal,
) -> None:
    provider = Provider(pause=0.01)

    async def items() -> AsyncIterator[int]:
        for item in range(5):
            yield item
        raise OSError("the queue went away")

    with pytest.raises(OSError, match="the queue went away") as caught:
        await run_each(
            journal, items(), provider.send, identity=ident, definition=DEFINITION, limit=3
        )
    assert caught.value.__notes__ == [
        "run_each() stopped taking items after 5; those finished: "
        "5 items: 5 succeeded, 0 reused, 0 failed, 0 refused"
    ]
    assert provider.completed == 5 and provider.cancelled == 0
    for item in range(5):
        assert (await journal.inspect(ident(item))).status == "succeeded"


async def test_an_empty_source_reports_nothing(journal: Journal) -> None:
    provider = Provider()
    report: EachReport[int] = await run_each(
        journal, [], provider.send, identity=ident, definition=DEFINITION, limit=3
    )
    assert report == EachReport()
    assert report.ok
    assert report.summary() == "0 items: 0 succeeded, 0 reused, 0 failed, 0 refused"


# ---------------------------------------------------------------- cancelling the whole run


async def test_cancelling_the_run_marks_the_items_in_flight_and_starts_no_more(
    journal: Journal,
) -> None:
    limit = 4
    pulled: list[int] = []
    entered: list[int] = []
    all_in = anyio.Event()
    after_run: list[bool] = []

    def items() -> Iterator[int]:
        for item in range(30):
            pulled.append(item)
            yield item

    async def send(item: int, claim: Claim) -> str:
        entered.append(item)
        if len(entered) == limit:
            all_in.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with anyio.create_task_group() as group:

        async def run() -> None:
            await run_each(journal, items(), send, identity=ident, definition=DEFINITION, limit=4)
            after_run.append(True)

        group.start_soon(run)
        await all_in.wait()
        group.cancel_scope.cancel()

    assert after_run == []  # the cancellation went on through run_each
    assert sorted(entered) == [0, 1, 2, 3]
    assert pulled == [0, 1, 2, 3]
    for item in range(4):
        view = await journal.inspect(ident(item))
        assert view.status == "needs_review"
        assert view.review_reason is not None
        assert view.review_reason == "block cancelled"
    for item in range(4, 30):
        assert (await journal.inspect(ident(item))).status == "absent"


async def test_a_base_exception_is_never_swallowed(journal: Journal) -> None:
    class Stop(BaseException):
        pass

    waiting = anyio.Event()
    entered: list[int] = []

    async def send(item: int, claim: Claim) -> str:
        entered.append(item)
        if len(entered) == 3:
            waiting.set()
        if item == 2:
            await waiting.wait()
            raise Stop
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    with pytest.raises(BaseExceptionGroup) as caught, anyio.fail_after(10):
        await run_each(journal, range(10), send, identity=ident, definition=DEFINITION, limit=3)
    assert caught.group_contains(Stop)
    statuses = [(await journal.inspect(ident(item))).status for item in range(4)]
    assert statuses == ["needs_review", "needs_review", "needs_review", "absent"]
    reason = (await journal.inspect(ident(2))).review_reason
    assert reason == "block raised Stop"


# ---------------------------------------------------------------- definitions and arguments


async def test_an_omitted_definition_is_the_digest_of_fn(journal: Journal) -> None:
    provider = Provider()
    await run_each(journal, range(3), provider.send, identity=ident, limit=3)
    same = await anyio.to_thread.run_sync(definition_digest, Provider.send)
    report = await run_each(
        journal, range(3), provider.send, identity=ident, definition=same, limit=3
    )
    assert len(report.reused) == 3
    assert provider.calls == 3


async def test_a_fixed_inputs_mapping_is_copied(journal: Journal) -> None:
    provider = Provider()
    inputs: dict[str, str | int | bool | None] = {"campaign": "spring"}
    await run_each(
        journal, range(2), provider.send, identity=ident, inputs=inputs, definition="v", limit=2
    )
    inputs["campaign"] = "summer"
    report = await run_each(
        journal,
        range(2),
        provider.send,
        identity=ident,
        inputs={"campaign": "spring"},
        definition="v",
        limit=2,
    )
    assert len(report.reused) == 2
    changed = await run_each(
        journal, range(2), provider.send, identity=ident, inputs=inputs, definition="v", limit=2
    )
    assert [r.code for r in changed.refused] == ["INPUT_CHANGED", "INPUT_CHANGED"]
    bad = await run_each(
        journal,
        range(1),
        provider.send,
        identity=ident,
        inputs=lambda item: {"amount": 1.5},  # type: ignore[dict-item]
        definition="v",
        limit=1,
    )
    assert [r.code for r in bad.refused] == ["INVALID_INPUTS"]


async def test_a_digest_definition_is_used_as_is(journal: Journal) -> None:
    provider = Provider()
    digest = definition_digest("send-v9")
    await run_each(journal, range(2), provider.send, identity=ident, definition=digest, limit=2)
    report = await run_each(
        journal, range(2), provider.send, identity=ident, definition="send-v9", limit=2
    )
    assert len(report.reused) == 2


async def test_bad_arguments_are_refused_before_any_item(journal: Journal) -> None:
    provider = Provider()

    def plain(item: int, claim: Claim) -> str:
        return "r"

    cases: list[tuple[dict[str, Any], str]] = [
        ({"limit": 0}, "INVALID_ARGUMENT"),
        ({"limit": True}, "INVALID_ARGUMENT"),
        ({"limit": 2.0}, "INVALID_ARGUMENT"),
        ({"fn": plain}, "INVALID_ARGUMENT"),
        ({"identity": ident(1)}, "INVALID_IDENTITY"),
        ({"inputs": 3}, "INVALID_INPUTS"),
        ({"definition": "A" * 64}, "INVALID_HASH"),
        ({"definition": 7}, "INVALID_HASH"),
        ({"wait": -1}, "INVALID_ARGUMENT"),
        ({"items": 5}, "INVALID_ARGUMENT"),
        ({"journal": "/tmp/journal"}, "INVALID_ARGUMENT"),
    ]
    for change, code in cases:
        arguments: dict[str, Any] = {
            "journal": journal,
            "items": range(3),
            "fn": provider.send,
            "identity": ident,
            "definition": DEFINITION,
            "limit": 2,
        }
        arguments.update(change)
        with pytest.raises(InvalidArgument) as caught:
            await run_each(**arguments)
        assert caught.value.code == code, change
    assert provider.calls == 0
    assert (await journal.inspect(ident(0))).status == "absent"


async def test_failure_code_and_done_are_plain_frozen_values() -> None:
    done = EachDone(1, ident(1), "r")
    failure: EachFailure[int] = EachFailure(1, ident(1), ConflictError("x", code="IN_PROGRESS"))
    assert failure.code == "IN_PROGRESS"
    assert EachFailure(1, None, ValueError("x")).code is None
    with pytest.raises(AttributeError):
        done.receipt = "other"  # type: ignore[misc]
    assert EachReport(succeeded=(done,)).summary() == (
        "1 item: 1 succeeded, 0 reused, 0 failed, 0 refused"
    )
