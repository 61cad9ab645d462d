"""Typical user code, checked by ``mypy --strict`` (``make lint``) and never run.

``assert_type`` pins what a caller sees; each ``type: ignore[...]`` marks a mistake that
mypy must keep catching (strict mode reports an ignore that is no longer needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, assert_type

import anyio
import anyio.lowlevel

from itemjournal import (
    Claim,
    ConflictError,
    EachReport,
    Identity,
    Journal,
    JournalStatistics,
    RecordView,
    Reuse,
    definition_digest,
    once,
    run_each,
)
from itemjournal.otel import instrument, uninstrument

Receipt = NewType("Receipt", str)


@dataclass(frozen=True)
class Order:
    id: str
    amount_cents: int
    gift: bool = False


async def open_journal() -> Journal:
    return await Journal.open("/var/lib/shop/journal")


async def typical(journal: Journal) -> None:
    @once(
        journal,
        identity=lambda order: ("shop", "billing", "charge", order.id),
        inputs=lambda order: {"amount_cents": order.amount_cents, "gift": order.gift},
        definition="billing-v3",
    )
    async def charge(order: Order) -> str:
        """Charge one order; the provider's charge id is the receipt."""
        await anyio.lowlevel.checkpoint()
        return f"ch_{order.id}"

    assert_type(await charge(Order("A-1", 1250)), str)
    await charge(order=Order("A-2", 990))
    await charge("A-3")  # type: ignore[arg-type]
    await charge(Order("A-4", 100), 2)  # type: ignore[call-arg]
    assert charge.__name__ == "charge"

    @once(
        journal,
        identity=Identity("shop", "web", "checkout", "basket-7"),
        inputs={"basket": "basket-7", "total": 4200, "note": None},
        definition=definition_digest("checkout-v1"),
        wait=5.0,
    )
    async def checkout(basket: str, *, coupon: str | None = None) -> tuple[str, str]:
        return f"order-{basket}", '{"status": "paid"}'

    receipt, body = await checkout("basket-7", coupon="SPRING")
    assert_type(receipt, str)
    assert_type(body, str | None)  # None when the record holds no result
    await checkout("basket-7", "SPRING")  # type: ignore[call-arg]

    # The journal may be a function that finds it at call time (opened at startup).
    @once(open_journal, identity=["shop", "mail", "welcome", "user-1"])
    async def send_welcome() -> Receipt:
        return Receipt("msg-1")

    assert_type(await send_welcome(), str)

    started: dict[str, Journal] = {"journal": journal}

    @once(lambda: started["journal"], identity=lambda user, text: ("shop", "sms", "otp", user))
    async def send_sms(user: str, text: str) -> tuple[str, str | None]:
        return "sms-1", None

    assert_type(await send_sms("u-1", "123456"), tuple[str, str | None])

    # A decorated function returns a coroutine: it runs in a task group like any other.
    async with anyio.create_task_group() as group:
        group.start_soon(charge, Order("A-5", 10))
        group.start_soon(send_sms, "u-2", "654321")

    # Only a receipt can come back: other return types are refused by the decorator.
    @once(journal, identity=("shop", "billing", "charge", "bad"))  # type: ignore[arg-type]
    async def wrong(order: Order) -> int:
        return order.amount_cents

    def not_async(order: Order) -> str:
        return order.id

    once(journal, identity=("a", "b", "c", "d"))(not_async)  # type: ignore[arg-type]


async def with_the_claim_block(journal: Journal, order: Order) -> str:
    identity = ("shop", "billing", "charge", order.id)
    definition = definition_digest("billing-v3")
    try:
        async with journal.claim(
            identity, {"amount_cents": order.amount_cents}, definition, wait=2.0
        ) as attempt:
            if attempt.reused:
                assert attempt.receipt is not None
                return attempt.receipt
            view = await attempt.complete(f"ch_{order.id}", result="{}")
            assert_type(view, RecordView)
            return f"ch_{order.id}"
    except ConflictError as error:
        assert_type(error.code, str)
        assert_type(error.view, RecordView | None)
        raise


async def with_begin(journal: Journal) -> None:
    outcome = await journal.begin(("s", "p", "j", "i"), {}, definition_digest("v1"))
    if isinstance(outcome, Reuse):
        assert_type(outcome.receipt, str)
        assert_type(outcome.result, str | None)
        assert_type(outcome.executed_here, bool)
    else:
        await journal.complete(outcome, "done", result=None)
    view = await journal.inspect(Identity("s", "p", "j", "i"))
    assert_type(view.status, str)
    assert_type(view.result, str | None)


async def observed(location: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    journal = instrument(await Journal.open(location))  # the global tracer provider
    assert_type(journal, Journal)
    instrument(journal, tracer_provider=TracerProvider())
    instrument(journal, TracerProvider())  # type: ignore[call-arg]
    statistics = journal.statistics()
    assert_type(statistics, JournalStatistics)
    assert_type(statistics.claims, int)
    assert_type(statistics.in_flight, int)
    statistics.refusals = 0  # type: ignore[misc]
    uninstrument(journal)


async def charge_v2(order: Order) -> str:
    return f"ch_{order.id}"


async def after_a_deploy(journal: Journal, order: Order) -> None:
    identity = ("shop", "billing", "charge", order.id)
    inputs = {"amount_cents": order.amount_cents}
    # Every form of a definition, everywhere one is taken: a digest, a version, a callable.
    earlier = ("billing-v3", definition_digest("billing-v2"), charge_v2)
    outcome = await journal.begin(identity, inputs, "billing-v4", compatible=earlier)
    assert_type(outcome, Claim | Reuse)
    await journal.begin(identity, inputs, charge_v2, compatible=["billing-v1"], wait=1.0)
    await journal.begin(identity, inputs, "billing-v4", compatible=(3,))  # type: ignore[arg-type]
    await journal.begin(identity, inputs, 4)  # type: ignore[arg-type]
    async with journal.claim(identity, inputs, "billing-v4", compatible=earlier) as attempt:
        if attempt.reused:
            assert attempt.receipt is not None

    @once(journal, identity=identity, definition=charge_v2, compatible=("billing-v3",))
    async def charge() -> str:
        return "ch_1"

    assert_type(await charge(), str)

    async def refund(item: Order, claim: Claim) -> str:
        return f"re_{item.id}"

    report = await run_each(
        journal,
        [order],
        refund,
        identity=lambda item: ("shop", "billing", "refund", item.id),
        definition="refund-v2",
        compatible=frozenset({"refund-v1"}),
        limit=4,
    )
    assert_type(report, EachReport[Order])
