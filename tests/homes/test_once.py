"""``@once(journal, identity=...)``: the function runs at most once per identity, its
receipt (and result) come back on every later call, and every way out of the function
leaves the record as the claim block would."""

from __future__ import annotations

import hashlib
from typing import Any, NewType, cast

import anyio
import anyio.lowlevel
import pytest

from itemjournal import (
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    definition_digest,
    once,
)

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "A-1")


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "charge", item)


class Calls:
    """Counts how often a decorated function really ran."""

    def __init__(self) -> None:
        self.count = 0


# ---------------------------------------------------------------- reuse


async def test_runs_once_then_returns_the_stored_receipt(journal: Journal) -> None:
    calls = Calls()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        calls.count += 1
        return f"ch-{calls.count}"

    assert await charge() == "ch-1"
    first = await journal.inspect(IDENTITY)
    assert first.status == "succeeded"
    assert first.receipt == "ch-1"
    assert first.result is None

    assert await charge() == "ch-1"
    assert await charge() == "ch-1"
    assert calls.count == 1
    again = await journal.inspect(IDENTITY)
    assert again.updated_at == first.updated_at  # a reuse writes nothing


async def test_the_decorated_function_keeps_its_name_and_doc(journal: Journal) -> None:
    async def charge(order: str) -> str:
        """Charge one order."""
        return order

    decorated = once(journal, identity=IDENTITY)(charge)
    assert decorated.__name__ == "charge"
    assert decorated.__doc__ == "Charge one order."
    assert decorated.__wrapped__ is charge  # type: ignore[attr-defined]
    assert repr(once(journal, identity=IDENTITY, definition="v1")).startswith("once(identity=")


async def test_identity_and_inputs_from_the_call_arguments(journal: Journal) -> None:
    ran: list[tuple[str, int]] = []

    @once(
        journal,
        identity=lambda order, *, cents, gift=False: ("shop", "billing", "charge", order),
        inputs=lambda order, *, cents, gift=False: {"cents": cents, "gift": gift},
        definition="billing-v1",
    )
    async def charge(order: str, *, cents: int, gift: bool = False) -> str:
        ran.append((order, cents))
        return f"ch-{order}"

    assert await charge("A-1", cents=1250) == "ch-A-1"
    assert await charge("A-2", cents=990) == "ch-A-2"
    assert await charge(order="A-1", cents=1250) == "ch-A-1"  # keywords: the same call
    assert await charge("A-2", cents=990, gift=False) == "ch-A-2"
    assert ran == [("A-1", 1250), ("A-2", 990)]
    assert (await journal.inspect(ident("A-1"))).receipt == "ch-A-1"
    assert (await journal.inspect(ident("A-2"))).receipt == "ch-A-2"


async def test_fixed_inputs_are_copied_when_decorating(journal: Journal) -> None:
    inputs: dict[str, str | int | bool | None] = {"cents": 1250}
    calls = Calls()

    @once(journal, identity=IDENTITY, inputs=inputs, definition="billing-v1")
    async def charge() -> str:
        calls.count += 1
        return "ch-1"

    await charge()
    inputs["cents"] = 1  # too late: the decorator kept what it was given
    assert await charge() == "ch-1"
    assert calls.count == 1


# ---------------------------------------------------------------- changes refused


async def test_changed_inputs_are_refused_before_the_function_runs(journal: Journal) -> None:
    ran: list[int] = []

    @once(
        journal,
        identity=lambda order, cents: ident(order),
        inputs=lambda order, cents: {"cents": cents},
        definition="billing-v1",
    )
    async def charge(order: str, cents: int) -> str:
        ran.append(cents)
        return f"ch-{order}"

    await charge("A-1", 1250)
    with pytest.raises(ConflictError) as caught:
        await charge("A-1", 1300)
    assert caught.value.code == "INPUT_CHANGED"
    assert caught.value.view is not None
    assert caught.value.view.receipt == "ch-A-1"
    assert ran == [1250]


async def test_another_version_string_is_another_definition(journal: Journal) -> None:
    ran: list[str] = []

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge_v1() -> str:
        ran.append("v1")
        return "ch-v1"

    @once(journal, identity=IDENTITY, definition="billing-v2")
    async def charge_v2() -> str:
        ran.append("v2")
        return "ch-v2"

    assert await charge_v1() == "ch-v1"
    with pytest.raises(ConflictError) as caught:
        await charge_v2()
    assert caught.value.code == "DEFINITION_CHANGED"
    assert ran == ["v1"]


async def test_a_digest_is_used_as_it_is_and_a_version_is_hashed(journal: Journal) -> None:
    """``definition_digest("billing-v1")`` and ``"billing-v1"`` name the same definition."""
    ran: list[str] = []

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def by_version() -> str:
        ran.append("version")
        return "ch-1"

    @once(journal, identity=IDENTITY, definition=definition_digest("billing-v1"))
    async def by_digest() -> str:
        ran.append("digest")
        return "ch-2"

    raw = hashlib.sha256(b"some build id").hexdigest()

    @once(journal, identity=ident("raw"), definition=raw)
    async def by_raw_digest() -> str:
        return "ch-raw"

    assert await by_version() == "ch-1"
    assert await by_digest() == "ch-1"
    assert ran == ["version"]
    await by_raw_digest()
    outcome = await journal.begin(ident("raw"), {}, raw)  # the digest itself, not its hash
    assert outcome.receipt == "ch-raw"  # type: ignore[union-attr]


async def test_without_a_definition_the_source_is_the_definition(journal: Journal) -> None:
    async def charge() -> str:
        return "ch-1"

    async def charge_edited() -> str:
        return "ch-1"  # an edit of the function's text

    await once(journal, identity=IDENTITY)(charge)()
    assert await once(journal, identity=IDENTITY)(charge)() == "ch-1"
    with pytest.raises(ConflictError) as caught:
        await once(journal, identity=IDENTITY)(charge_edited)()
    assert caught.value.code == "DEFINITION_CHANGED"


# ---------------------------------------------------------------- exits


async def test_an_exception_needs_review_and_propagates(journal: Journal) -> None:
    calls = Calls()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        calls.count += 1
        raise TimeoutError("provider timed out after sending")

    with pytest.raises(TimeoutError, match="provider timed out after sending"):
        await charge()
    record = await journal.inspect(IDENTITY)
    assert record.status == "needs_review"
    assert record.review_reason is not None
    assert "TimeoutError" in record.review_reason
    assert "provider timed out after sending" in record.review_reason
    assert record.receipt is None

    with pytest.raises(ConflictError) as caught:
        await charge()
    assert caught.value.code == "REVIEW_REQUIRED"
    assert calls.count == 1


async def test_a_cancelled_call_needs_review(journal: Journal) -> None:
    inside = anyio.Event()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        inside.set()
        await anyio.sleep_forever()
        raise AssertionError("never reached")

    async with anyio.create_task_group() as group:
        group.start_soon(charge)
        await inside.wait()
        group.cancel_scope.cancel()

    record = await journal.inspect(IDENTITY)
    assert record.status == "needs_review"
    assert record.review_reason is not None
    assert record.review_reason == "block cancelled"  # on asyncio and trio alike


async def test_a_call_cancelled_by_a_deadline_needs_review(journal: Journal) -> None:
    began = anyio.Event()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        began.set()
        await anyio.sleep_forever()
        raise AssertionError("never reached")

    async def deadline_once_running(scope: anyio.CancelScope) -> None:
        # The deadline is set once the effect runs: on a loaded machine a fixed 50 ms could
        # expire inside begin, which is another case (no record left behind).
        await began.wait()
        scope.deadline = anyio.current_time() + 0.05

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:
            tg.start_soon(deadline_once_running, scope)
            await charge()
    assert scope.cancelled_caught
    assert (await journal.inspect(IDENTITY)).status == "needs_review"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (42, "charge returned an int, not a receipt str or a (receipt, result) pair"),
        (None, "charge returned None, not a receipt str or a (receipt, result) pair"),
        (
            ["ch-1", "{}"],
            "charge returned a list, not a receipt str or a (receipt, result) pair",
        ),
        (
            ("ch-1", "{}", "extra"),
            "charge returned a tuple of 3 items, not a (receipt, result) pair",
        ),
        ("", "charge returned a receipt that is refused: a receipt must not be blank"),
        (
            "x" * 201,
            "charge returned a receipt that is refused: "
            "a receipt has at most 200 characters, got 201",
        ),
        (
            (7, "{}"),
            "charge returned a receipt that is refused: a receipt is a str, not int",
        ),
        (
            ("ch-1", b"{}"),
            "charge returned a result that is refused: a result is a str, not bytes",
        ),
        (
            ("ch-1", "x" * (64 * 1024 + 1)),
            "charge returned a result that is refused: "
            "a result has at most 65536 bytes of UTF-8, got 65537",
        ),
        (
            ("ch-1", "\udcff"),
            "charge returned a result that is refused: "
            "a result must be valid Unicode (no lone surrogates)",
        ),
    ],
    ids=[
        "int",
        "none",
        "list",
        "triple",
        "blank",
        "long-receipt",
        "int-receipt",
        "bytes-result",
        "big-result",
        "surrogate-result",
    ],
)
async def test_a_bad_return_value_needs_review_and_raises(
    journal: Journal, value: object, reason: str
) -> None:
    calls = Calls()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> Any:
        calls.count += 1
        return value

    with pytest.raises(InvalidArgument) as caught:
        await charge()
    assert caught.value.code == "INVALID_RECEIPT"
    assert reason in str(caught.value)
    assert "needs review" in str(caught.value)
    record = await journal.inspect(IDENTITY)
    assert record.status == "needs_review"
    assert record.review_reason == reason
    assert record.receipt is None

    with pytest.raises(ConflictError) as refused:
        await charge()
    assert refused.value.code == "REVIEW_REQUIRED"
    assert calls.count == 1


async def test_a_result_of_exactly_64_kib_is_stored(journal: Journal) -> None:
    body = "x" * (64 * 1024 - 2) + "\u00e9"  # two bytes in UTF-8: 65536 bytes in all

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> tuple[str, str]:
        return "ch-1", body

    assert await charge() == ("ch-1", body)
    assert (await journal.inspect(IDENTITY)).result == body


async def test_a_return_value_that_breaks_the_annotation_needs_review(
    journal: Journal,
) -> None:
    @once(journal, identity=ident("str"), definition="billing-v1")
    async def says_str() -> str:
        return cast(str, ("ch-1", "{}"))

    @once(journal, identity=ident("pair"), definition="billing-v1")
    async def says_pair() -> tuple[str, str]:
        return cast(tuple[str, str], "ch-1")

    with pytest.raises(InvalidArgument) as caught:
        await says_str()
    assert caught.value.code == "INVALID_RECEIPT"
    view = await journal.inspect(ident("str"))
    assert view.status == "needs_review"
    assert view.review_reason is not None
    assert view.review_reason.endswith("says_str returned a tuple, not a receipt str")

    with pytest.raises(InvalidArgument):
        await says_pair()
    view = await journal.inspect(ident("pair"))
    assert view.review_reason is not None
    assert view.review_reason.endswith("says_pair returned a str, not a (receipt, result) pair")


# ---------------------------------------------------------------- (receipt, result) pairs


async def test_a_pair_is_stored_and_replayed(journal: Journal) -> None:
    calls = Calls()
    body = '{"status": "paid", "order": "A-1"}'

    @once(journal, identity=IDENTITY, definition="checkout-v1")
    async def checkout() -> tuple[str, str]:
        calls.count += 1
        return "order-A-1", body

    assert await checkout() == ("order-A-1", body)
    record = await journal.inspect(IDENTITY)
    assert (record.receipt, record.result) == ("order-A-1", body)
    assert await checkout() == ("order-A-1", body)
    assert calls.count == 1


async def test_a_pair_without_a_result_replays_none(journal: Journal) -> None:
    calls = Calls()

    @once(journal, identity=IDENTITY, definition="checkout-v1")
    async def checkout() -> tuple[str, str | None]:
        calls.count += 1
        return "order-A-1", None

    assert await checkout() == ("order-A-1", None)
    assert await checkout() == ("order-A-1", None)
    assert calls.count == 1


async def test_a_pair_function_reused_on_a_resolved_record_gets_none(journal: Journal) -> None:
    """An operator's resolution stores a receipt only: the pair's result is None."""

    @once(journal, identity=IDENTITY, definition="checkout-v1")
    async def checkout() -> tuple[str, str]:
        raise ConnectionError("reset while reading the answer")

    with pytest.raises(ConnectionError):
        await checkout()
    await journal.resolve(IDENTITY, receipt="order-A-1", note="found in the provider's dashboard")
    assert await checkout() == ("order-A-1", None)


async def test_the_annotation_decides_the_shape_on_reuse(journal: Journal) -> None:
    """A ``-> str`` function gets the receipt even when a result is stored."""

    @once(journal, identity=IDENTITY, definition="checkout-v1")
    async def with_body() -> tuple[str, str]:
        return "order-A-1", "{}"

    @once(journal, identity=IDENTITY, definition="checkout-v1")
    async def receipt_only() -> str:
        raise AssertionError("never runs: the record succeeded")

    await with_body()
    assert await receipt_only() == "order-A-1"


Receipt = NewType("Receipt", str)


async def test_a_newtype_of_str_is_a_receipt(journal: Journal) -> None:
    """``-> Receipt`` (a NewType of str) returns the receipt alone, also when reused."""

    @once(journal, identity=IDENTITY, definition="mail-v1")
    async def send_with_body() -> tuple[str, str]:
        return "msg-1", "{}"

    @once(journal, identity=IDENTITY, definition="mail-v1")
    async def send() -> Receipt:
        raise AssertionError("never runs: the record succeeded")

    @once(journal, identity=ident("newtype"), definition="mail-v1")
    async def send_pair_by_mistake() -> Receipt:
        return cast(Receipt, ("msg-2", "{}"))

    await send_with_body()
    assert await send() == "msg-1"
    with pytest.raises(InvalidArgument) as caught:
        await send_pair_by_mistake()
    assert caught.value.code == "INVALID_RECEIPT"


async def test_without_an_annotation_a_call_returns_what_was_stored(journal: Journal) -> None:
    async def plain():  # type: ignore[no-untyped-def]
        return "ch-1"

    async def pair():  # type: ignore[no-untyped-def]
        return "ch-2", "{}"

    assert await once(journal, identity=ident("plain"), definition="v1")(plain)() == "ch-1"
    assert await once(journal, identity=ident("plain"), definition="v1")(plain)() == "ch-1"
    assert await once(journal, identity=ident("pair"), definition="v1")(pair)() == ("ch-2", "{}")
    assert await once(journal, identity=ident("pair"), definition="v1")(pair)() == ("ch-2", "{}")


async def test_an_unresolvable_annotation_returns_what_was_stored(journal: Journal) -> None:
    async def pair() -> NotDefinedAnywhere:  # type: ignore[name-defined]  # noqa: F821
        return "ch-1", "{}"

    decorated = once(journal, identity=IDENTITY, definition="v1")(pair)
    assert await decorated() == ("ch-1", "{}")
    assert await decorated() == ("ch-1", "{}")


# ---------------------------------------------------------------- duplicates in flight


async def test_a_duplicate_in_flight_is_in_progress_without_wait(journal: Journal) -> None:
    inside = anyio.Event()
    release = anyio.Event()

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        inside.set()
        await release.wait()
        return "ch-1"

    async with anyio.create_task_group() as group:
        group.start_soon(charge)
        await inside.wait()
        with pytest.raises(ConflictError) as caught:
            await charge()
        assert caught.value.code == "IN_PROGRESS"
        release.set()
    assert await charge() == "ch-1"


async def test_a_waiting_duplicate_gets_the_first_calls_answer(journal: Journal) -> None:
    inside = anyio.Event()
    release = anyio.Event()
    calls = Calls()
    answers: list[tuple[str, str]] = []

    async def checkout() -> tuple[str, str]:
        calls.count += 1
        inside.set()
        await release.wait()
        return "order-A-1", '{"status": "paid"}'

    first = once(journal, identity=IDENTITY, definition="checkout-v1")(checkout)
    waiting = once(journal, identity=IDENTITY, definition="checkout-v1", wait=30)(checkout)

    async def call(decorated: Any) -> None:
        answers.append(await decorated())

    async with anyio.create_task_group() as group:
        group.start_soon(call, first)
        await inside.wait()
        group.start_soon(call, waiting)
        await anyio.wait_all_tasks_blocked()
        # The record is still started: a caller that does not wait is told so.
        with pytest.raises(ConflictError) as caught:
            await first()
        assert caught.value.code == "IN_PROGRESS"
        assert answers == []
        release.set()

    assert answers == [("order-A-1", '{"status": "paid"}')] * 2
    assert calls.count == 1


async def test_twenty_concurrent_calls_run_the_function_once(journal: Journal) -> None:
    calls = Calls()
    answers: list[str] = []

    @once(journal, identity=IDENTITY, definition="billing-v1", wait=30)
    async def charge() -> str:
        calls.count += 1
        for _ in range(5):  # stay in flight while the others arrive
            await anyio.lowlevel.checkpoint()
        return f"ch-{calls.count}"

    async def call() -> None:
        answers.append(await charge())

    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(call)

    assert calls.count == 1
    assert answers == ["ch-1"] * 20


async def test_twenty_concurrent_calls_without_wait_never_run_twice(journal: Journal) -> None:
    calls = Calls()
    answers: list[str] = []
    in_progress: list[str] = []

    @once(journal, identity=IDENTITY, definition="billing-v1")
    async def charge() -> str:
        calls.count += 1
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        return f"ch-{calls.count}"

    async def call() -> None:
        try:
            answers.append(await charge())
        except ConflictError as error:
            in_progress.append(error.code)

    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(call)

    assert calls.count == 1
    assert len(answers) + len(in_progress) == 20
    assert set(answers) == {"ch-1"}
    assert set(in_progress) <= {"IN_PROGRESS"}


# ---------------------------------------------------------------- the journal argument


async def test_the_journal_may_be_found_at_call_time(journal: Journal) -> None:
    app_state: dict[str, Journal] = {}

    @once(lambda: app_state["journal"], identity=ident("sync"), definition="v1")
    async def from_a_function() -> str:
        return "ch-sync"

    async def current_journal() -> Journal:
        await anyio.lowlevel.checkpoint()
        return app_state["journal"]

    @once(current_journal, identity=ident("async"), definition="v1")
    async def from_a_coroutine() -> str:
        return "ch-async"

    app_state["journal"] = journal  # opened at startup, after the decorators ran
    assert await from_a_function() == "ch-sync"
    assert await from_a_coroutine() == "ch-async"
    assert (await journal.inspect(ident("sync"))).receipt == "ch-sync"
    assert (await journal.inspect(ident("async"))).receipt == "ch-async"


async def test_a_journal_function_must_return_a_journal(journal: Journal) -> None:
    calls = Calls()

    @once(lambda: "not a journal", identity=IDENTITY, definition="v1")  # type: ignore[arg-type,return-value]
    async def charge() -> str:
        calls.count += 1
        return "ch-1"

    with pytest.raises(InvalidArgument) as caught:
        await charge()
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "returned str, not a Journal" in str(caught.value)
    assert calls.count == 0


# ---------------------------------------------------------------- refused when decorating


async def test_bad_arguments_are_refused_when_decorating(journal: Journal) -> None:
    def refused(code: str, **options: Any) -> None:
        with pytest.raises(InvalidArgument) as caught:
            once(**options)
        assert caught.value.code == code, options

    refused("INVALID_ARGUMENT", journal="/var/lib/journal", identity=IDENTITY)
    refused("INVALID_LABEL", journal=journal, identity=("shop", "bill ing", "charge", "A-1"))
    refused("INVALID_IDENTITY", journal=journal, identity=("shop", "billing"))
    refused("INVALID_INPUTS", journal=journal, identity=IDENTITY, inputs={"cents": 12.5})
    refused("INVALID_INPUTS", journal=journal, identity=IDENTITY, inputs=["cents"])
    refused("INVALID_HASH", journal=journal, identity=IDENTITY, definition=3)
    refused("INVALID_HASH", journal=journal, identity=IDENTITY, definition="  ")
    refused("INVALID_HASH", journal=journal, identity=IDENTITY, definition="AB" * 32)
    refused("INVALID_ARGUMENT", journal=journal, identity=IDENTITY, wait=-1)
    refused("INVALID_ARGUMENT", journal=journal, identity=IDENTITY, wait="5")


async def test_only_an_async_function_is_decorated(journal: Journal) -> None:
    def charge() -> str:
        return "ch-1"

    with pytest.raises(InvalidArgument, match="async def") as caught:
        once(journal, identity=IDENTITY)(charge)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_ARGUMENT"


async def test_an_object_with_an_async_call_is_decorated(journal: Journal) -> None:
    class Charger:
        async def __call__(self, order: str) -> str:
            return f"ch-{order}"

    decorated = once(journal, identity=IDENTITY, definition="v1")(Charger())
    assert await decorated("A-1") == "ch-A-1"
    assert await decorated("A-1") == "ch-A-1"


async def test_a_function_without_source_needs_a_version(journal: Journal) -> None:
    namespace: dict[str, Any] = {}
    exec("async def generated() -> str:\n    return 'ch-1'\n", namespace)
    without_source = once(journal, identity=IDENTITY)(namespace["generated"])
    with pytest.raises(InvalidArgument) as caught:
        await without_source()
    assert caught.value.code == "INVALID_HASH"
    assert "version string" in str(caught.value)
    assert (await journal.inspect(IDENTITY)).status == "absent"
    decorated = once(journal, identity=IDENTITY, definition="generated-v1")(namespace["generated"])
    assert await decorated() == "ch-1"


async def test_a_bad_identity_from_the_arguments_writes_nothing(journal: Journal) -> None:
    calls = Calls()

    @once(journal, identity=lambda order: ("shop", "billing", "charge", order))
    async def charge(order: str) -> str:
        calls.count += 1
        return "ch-1"

    with pytest.raises(InvalidArgument) as caught:
        await charge("not a label")
    assert caught.value.code == "INVALID_LABEL"
    assert calls.count == 0
    assert (await journal.inspect(ident("A-1"))).status == "absent"


async def test_an_error_in_the_identity_function_propagates(journal: Journal) -> None:
    calls = Calls()

    @once(journal, identity=lambda order: ident(order["id"]))
    async def charge(order: dict[str, str]) -> str:
        calls.count += 1
        return "ch-1"

    with pytest.raises(KeyError, match="id"):
        await charge({})
    assert calls.count == 0
