"""``itemjournal.faststream``: the middleware on a real RabbitMQ, in this process. FastStream
runs on asyncio only, so these tests do too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import aio_pika
import anyio
import nats
import pytest
from _brokers import AMQP_URL, NATS_URL, Jet, Rabbit, body, require, unique
from faststream import BaseMiddleware
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.rabbit import RabbitBroker, RabbitQueue

from itemjournal import InvalidArgument, Journal
from itemjournal.faststream import (
    DeadLetter,
    Header,
    JournalMiddleware,
    MessageId,
    Refusal,
    current_claim,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def ident(order: str) -> tuple[str, str, str, str]:
    return ("shop", "billing", "charge", order)


@pytest.fixture
def queue() -> Any:
    require("rabbit")
    rabbit = Rabbit(unique("ij-unit"))
    yield rabbit
    rabbit.delete()


def middleware(journal: Journal, **options: Any) -> JournalMiddleware:
    return JournalMiddleware(
        journal,
        scope="shop",
        program="billing",
        job="charge",
        item=options.pop("item", lambda b: b["order"]),
        inputs=lambda b: {"amount_cents": b["amount_cents"]},
        definition="charge-v1",
        **options,
    )


async def publish(name: str, *bodies: bytes, **properties: Any) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for data in bodies:
            message = aio_pika.Message(data, content_type="application/json", **properties)
            await channel.default_exchange.publish(message, routing_key=name)


async def settled(journal: Journal, order: str, status: str) -> None:
    with anyio.fail_after(10):
        while (await journal.inspect(ident(order))).status != status:  # noqa: ASYNC110 - another process
            await anyio.sleep(0.02)


async def test_claims_then_acks_and_reuses_without_running(tmp_path: Path, queue: Rabbit) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:
        keys: list[str] = []
        broker = RabbitBroker(AMQP_URL, middlewares=[middleware(journal)], logger=None)

        @broker.subscriber(RabbitQueue(queue.name, durable=True))
        async def charge(b: dict[str, Any]) -> str:
            claim = current_claim()
            view = await journal.inspect(ident(b["order"]))
            assert view.status == "started"  # claimed before the handler
            keys.append(claim.key)
            return f"ch-{b['order']}"

        async with broker:
            await broker.start()
            await publish(queue.name, body("o1"))
            await settled(journal, "o1", "succeeded")
            await publish(queue.name, body("o1"), body("o1"))
            with anyio.fail_after(10):
                while await anyio.to_thread.run_sync(queue.waiting):  # noqa: ASYNC110 - the broker
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)
        view = await journal.inspect(ident("o1"))
    assert keys == [view.key]  # three deliveries, one run
    assert view.receipt == "ch-o1"
    assert await anyio.to_thread.run_sync(queue.waiting) == 0  # all acknowledged


async def test_a_review_is_rejected_into_the_dead_letter_queue(
    tmp_path: Path, queue: Rabbit
) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:
        claim = await journal.begin(ident("o2"), {"amount_cents": 100}, "charge-v1")
        await journal.mark_review(claim.identity, "unknown outcome")
        broker = RabbitBroker(AMQP_URL, middlewares=[middleware(journal)], logger=None)
        ran: list[str] = []
        work = RabbitQueue(
            queue.name,
            durable=True,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue.review},
        )

        @broker.subscriber(work)
        async def charge(b: dict[str, Any]) -> str:
            ran.append(b["order"])
            return "never"

        async with broker:
            await broker.start()
            await broker.declare_queue(RabbitQueue(queue.review, durable=True))
            await publish(queue.name, body("o2"))
            with anyio.fail_after(10):
                while not await anyio.to_thread.run_sync(queue.peek_review):  # noqa: ASYNC110 - the broker
                    await anyio.sleep(0.05)
        taken = await anyio.to_thread.run_sync(queue.take_review)
    assert ran == []
    assert [message for message, _ in taken] == [{"order": "o2", "amount_cents": 100}]
    assert taken[0][1]["x-death"][0]["reason"] == "rejected"


async def test_a_failing_handler_is_dead_lettered_with_the_reason(
    tmp_path: Path, queue: Rabbit
) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:

        async def to_review(data: bytes, headers: dict[str, str]) -> object:
            return await broker.publish(data, queue.review, headers=headers)

        refusals: list[Refusal] = []
        dead_letter = DeadLetter(to_review)

        async def policy(message: Any, refusal: Refusal) -> None:
            refusals.append(refusal)
            await dead_letter(message, refusal)

        broker = RabbitBroker(
            AMQP_URL,
            middlewares=[middleware(journal, item=Header("x-order"), on_refused=policy)],
            logger=None,
        )

        @broker.subscriber(RabbitQueue(queue.name, durable=True))
        async def charge(b: dict[str, Any]) -> str:
            raise RuntimeError("provider timed out")

        async with broker:
            await broker.start()
            await broker.declare_queue(RabbitQueue(queue.review, durable=True))
            await publish(queue.name, body("o3"), headers={"x-order": "o3"})
            with anyio.fail_after(10):
                while not await anyio.to_thread.run_sync(queue.peek_review):  # noqa: ASYNC110 - the broker
                    await anyio.sleep(0.05)
        view = await journal.inspect(ident("o3"))
        taken = await anyio.to_thread.run_sync(queue.take_review)
    assert view.status == "needs_review"
    assert len(taken) == 1
    headers = taken[0][1]
    assert headers["x-itemjournal-code"] == "HANDLER_FAILED"
    assert "provider timed out" in headers["x-itemjournal-reason"]
    assert headers["x-itemjournal-key"] == view.key
    assert headers["x-itemjournal-identity"] == "shop/billing/charge/o3"
    assert refusals[0].identity == ident("o3")
    assert await anyio.to_thread.run_sync(queue.waiting) == 0


async def test_the_message_id_names_the_item(tmp_path: Path, queue: Rabbit) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:
        broker = RabbitBroker(
            AMQP_URL, middlewares=[middleware(journal, item=MessageId())], logger=None
        )

        @broker.subscriber(RabbitQueue(queue.name, durable=True))
        async def charge(b: dict[str, Any]) -> str:
            return json.dumps(b)

        async with broker:
            await broker.start()
            await publish(queue.name, body("ignored"), message_id="msg-41")
            await settled(journal, "msg-41", "succeeded")


def test_current_claim_outside_a_handler() -> None:
    with pytest.raises(InvalidArgument) as caught:
        current_claim()
    assert caught.value.code == "INVALID_CLAIM"


async def test_arguments_are_checked(tmp_path: Path) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:
        with pytest.raises(InvalidArgument):
            JournalMiddleware(
                "journal", scope="s", program="p", job="j", item=MessageId(), definition="v1"
            )  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            JournalMiddleware(
                journal, scope="bad label", program="p", job="j", item=MessageId(), definition="v1"
            )
        with pytest.raises(InvalidArgument):
            JournalMiddleware(
                journal,
                scope="s",
                program="p",
                job="j",
                item=42,  # type: ignore[arg-type]
                definition="v1",
            )


def test_the_core_imports_no_broker_client() -> None:
    script = (
        "import sys, itemjournal\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert set(done.stdout.split()).isdisjoint({"faststream", "aio_pika", "aiormq", "nats"})


async def test_a_policy_that_fails_gives_the_message_back(tmp_path: Path, queue: Rabbit) -> None:
    async with await Journal.open(str(tmp_path / "j")) as journal:
        claim = await journal.begin(ident("o4"), {"amount_cents": 100}, "charge-v1")
        await journal.mark_review(claim.identity, "unknown outcome")
        tries: list[int] = []

        async def broken(message: Any, refusal: Refusal) -> None:
            tries.append(1)
            raise ConnectionError("the review queue is unreachable")

        broker = RabbitBroker(
            AMQP_URL, middlewares=[middleware(journal, on_refused=broken)], logger=None
        )

        @broker.subscriber(RabbitQueue(queue.name, durable=True))
        async def charge(b: dict[str, Any]) -> str:
            raise AssertionError("never runs")

        async with broker:
            await broker.start()
            await publish(queue.name, body("o4"))
            with anyio.fail_after(10):
                while len(tries) < 3:  # noqa: ASYNC110 - the broker redelivers
                    await anyio.sleep(0.02)
        assert await anyio.to_thread.run_sync(queue.waiting) == 1  # kept, not dropped


class Recorder(BaseMiddleware):
    """An outer middleware: what the journal's middleware raises to FastStream."""

    raised: ClassVar[list[BaseException]] = []

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        try:
            return await call_next(msg)
        except Exception as error:
            Recorder.raised.append(error)
            raise


@pytest.fixture(params=["rabbit", "nats"])
def place(request: pytest.FixtureRequest) -> Any:
    """A RabbitMQ queue or a JetStream stream (consumer ``workers``), each with its review
    queue or stream, made before the test."""
    require(request.param)
    where = Rabbit(unique("ij-unit")) if request.param == "rabbit" else Jet(unique("ij-unit"))
    where.publish([])
    yield where
    where.delete()


def broker_on(where: Rabbit | Jet, *middlewares: Any) -> tuple[RabbitBroker | NatsBroker, Any]:
    """A broker for ``where`` and the decorator of its subscriber (on JetStream, a durable
    pull consumer)."""
    if isinstance(where, Rabbit):
        rabbit = RabbitBroker(AMQP_URL, middlewares=middlewares, logger=None)
        return rabbit, rabbit.subscriber(RabbitQueue(where.name, durable=True))
    jet = NatsBroker(NATS_URL, middlewares=middlewares, logger=None)
    subscriber = jet.subscriber(
        where.name,
        stream=JStream(where.stream, declare=False),
        durable="workers",
        pull_sub=PullSub(batch_size=4, timeout=0.5),
    )
    return jet, subscriber


def to_review_of(broker: RabbitBroker | NatsBroker, where: Rabbit | Jet) -> DeadLetter:
    async def publish(data: bytes, headers: dict[str, Any]) -> object:
        if isinstance(broker, RabbitBroker):
            return await broker.publish(data, where.review, headers=headers)
        assert isinstance(where, Jet)
        return await broker.publish(
            data, f"{where.name}.review", headers=headers, stream=where.review_stream
        )

    return DeadLetter(publish)


async def until_reviewed(where: Rabbit | Jet, count: int) -> None:
    with anyio.fail_after(20):
        while await anyio.to_thread.run_sync(where.peek_review) < count:  # noqa: ASYNC110 - the broker
            await anyio.sleep(0.05)
    await anyio.sleep(0.5)  # time for a second refusal, were there one


INVALID_ITEMS = [
    ({"order": "o-float", "amount_cents": 12.5}, "INVALID_INPUTS"),
    ({"order": "o-long", "amount_cents": "x" * 20_001}, "INVALID_INPUTS"),
    ({"order": "an order", "amount_cents": 100}, "INVALID_LABEL"),
    ({"order": "o" * 81, "amount_cents": 100}, "INVALID_LABEL"),
]


async def test_an_invalid_item_is_a_plain_refusal(tmp_path: Path, place: Rabbit | Jet) -> None:
    """A message whose identity or inputs are refused (a float, a text too long, a label
    that is not one) goes to ``on_refused`` once, is kept with its reason, and is not
    raised to FastStream as a handler failure."""
    Recorder.raised = []
    refusals: list[Refusal] = []
    ran: list[str] = []
    async with await Journal.open(str(tmp_path / "j")) as journal:

        async def policy(message: Any, refusal: Refusal) -> None:
            refusals.append(refusal)
            await dead_letter(message, refusal)

        broker, subscriber = broker_on(place, Recorder, middleware(journal, on_refused=policy))
        dead_letter = to_review_of(broker, place)

        @subscriber
        async def charge(b: dict[str, Any]) -> str:
            ran.append(b["order"])
            return "never"

        async with broker:
            await broker.start()
            bodies = [json.dumps(b).encode() for b, _ in INVALID_ITEMS]
            await anyio.to_thread.run_sync(place.publish, bodies)
            await until_reviewed(place, len(bodies))
        taken = await anyio.to_thread.run_sync(place.take_review)
        waiting = await anyio.to_thread.run_sync(place.waiting)
        records = [view async for view in journal.records()]
    assert Recorder.raised == []  # never a handler failure
    assert ran == [] and records == []  # nothing ran, nothing was recorded
    expected = {b["order"]: code for b, code in INVALID_ITEMS}
    assert sorted(r.code for r in refusals) == sorted(expected.values())  # once each
    assert len(taken) == len(expected) and waiting == 0  # kept, and acknowledged
    for message, headers in taken:
        assert headers["x-itemjournal-code"] == expected[message["order"]]
        assert headers["x-itemjournal-reason"]
    inputs_refused = [r for r in refusals if r.code == "INVALID_INPUTS"]
    assert all(r.identity is not None for r in inputs_refused)  # the identity was made
    assert any("is a float" in r.reason for r in inputs_refused)


async def test_message_id_is_the_id_the_message_carries(
    tmp_path: Path, place: Rabbit | Jet
) -> None:
    """``MessageId()`` names the id a message carries (RabbitMQ's property, JetStream's
    ``Nats-Msg-Id``); a message without one is refused, not named by an id FastStream makes
    up afresh for each delivery."""
    refusals: list[Refusal] = []
    async with await Journal.open(str(tmp_path / "j")) as journal:

        async def policy(message: Any, refusal: Refusal) -> None:
            refusals.append(refusal)
            await dead_letter(message, refusal)

        broker, subscriber = broker_on(
            place, middleware(journal, item=MessageId(), on_refused=policy)
        )
        dead_letter = to_review_of(broker, place)

        @subscriber
        async def charge(b: dict[str, Any]) -> str:
            return "charged"

        async with broker:
            await broker.start()
            if isinstance(place, Rabbit):  # aio-pika gives every message an id
                await publish(place.name, body("x"), message_id="msg-7")
            else:
                await jet_publish(place.name, body("x"), {"Nats-Msg-Id": "msg-7"})
                await jet_publish(place.name, body("y"), None)  # no id
                await until_reviewed(place, 1)
            await settled(journal, "msg-7", "succeeded")
        records = [view.identity.item async for view in journal.records()]
    assert records == ["msg-7"]
    if isinstance(place, Jet):
        assert [r.code for r in refusals] == ["INVALID_IDENTITY"]
        assert "carries no id" in refusals[0].reason
    else:
        assert refusals == []


async def jet_publish(subject: str, data: bytes, headers: dict[str, str] | None) -> None:
    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().publish(subject, data, headers=headers)
    finally:
        await client.close()


async def test_a_dead_letter_copy_on_jetstream_drops_what_jetstream_acts_on(
    tmp_path: Path,
) -> None:
    """A refused message published with JetStream's own headers (an expected last sequence,
    a de-duplication id) reaches the review stream: the copy carries none of them, and its
    ``Nats-Msg-Id`` as ``message_id``."""
    await anyio.to_thread.run_sync(require, "nats")
    where = Jet(unique("ij-unit"))
    await anyio.to_thread.run_sync(where.publish, [])
    try:
        async with await Journal.open(str(tmp_path / "j")) as journal:
            claim = await journal.begin(ident("o5"), {"amount_cents": 100}, "charge-v1")
            await journal.mark_review(claim.identity, "unknown outcome")

            async def policy(message: Any, refusal: Refusal) -> None:
                await dead_letter(message, refusal)

            broker, subscriber = broker_on(where, middleware(journal, on_refused=policy))
            dead_letter = to_review_of(broker, where)

            @subscriber
            async def charge(b: dict[str, Any]) -> str:
                assert b["order"] == "filler"  # o5 is in review: never runs
                return "charged"

            await jet_publish(where.name, body("filler"), None)  # sequence 1
            await jet_publish(
                where.name,
                body("o5"),
                {"Nats-Expected-Last-Sequence": "1", "Nats-Msg-Id": "publish-o5"},
            )
            async with broker:
                await broker.start()
                await until_reviewed(where, 1)
            taken = await anyio.to_thread.run_sync(where.take_review)
    finally:
        await anyio.to_thread.run_sync(where.delete)
    ((_, headers),) = taken
    assert headers["x-itemjournal-code"] == "REVIEW_REQUIRED"
    assert headers["message_id"] == "publish-o5"
    assert not [name for name in headers if name.startswith("Nats-Expected-Last")]
