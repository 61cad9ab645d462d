"""The brokers the FastStream tests run on: RabbitMQ and NATS JetStream on this machine,
driven through their own clients (aio-pika, nats-py). A broker that does not answer
skips its tests with the reason; with ITEMJOURNAL_REQUIRE_BROKERS=1 (as in CI) they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import Iterable
from typing import Any

import aio_pika
import nats
import pytest
from nats.js.errors import NotFoundError

AMQP_URL = os.environ.get("ITEMJOURNAL_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("ITEMJOURNAL_TEST_NATS", "nats://127.0.0.1:4222")


def _problem(kind: str) -> str | None:
    async def probe() -> None:
        if kind == "rabbit":
            connection = await aio_pika.connect(AMQP_URL, timeout=3)
            await connection.close()
        else:
            client = await nats.connect(NATS_URL, connect_timeout=3, max_reconnect_attempts=0)
            try:
                await client.jetstream().account_info()
            finally:
                await client.close()

    try:
        asyncio.run(probe())
    except Exception as error:
        where = AMQP_URL if kind == "rabbit" else NATS_URL
        return f"{kind} does not answer at {where}: {error!r}"
    return None


def require(kind: str) -> None:
    """Skip (or, under ITEMJOURNAL_REQUIRE_BROKERS=1, fail) when the broker is down."""
    problem = _problem(kind)
    if problem is None:
        return
    if os.environ.get("ITEMJOURNAL_REQUIRE_BROKERS") == "1":
        pytest.fail(problem)
    pytest.skip(problem)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def body(order: str, amount_cents: int = 100) -> bytes:
    return json.dumps({"order": order, "amount_cents": amount_cents}).encode()


class Rabbit:
    """A work queue ``name`` and its review queue ``name.review``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.review = name + ".review"

    def publish(self, bodies: Iterable[bytes]) -> None:
        async def go() -> None:
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel(publisher_confirms=True)
                await channel.declare_queue(self.name, durable=True)
                await channel.declare_queue(self.review, durable=True)
                for data in bodies:
                    message = aio_pika.Message(
                        data,
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    )
                    await channel.default_exchange.publish(message, routing_key=self.name)

        asyncio.run(go())

    def waiting(self) -> int:
        """Messages not yet acknowledged in the work queue (ready and unacknowledged)."""

        async def go() -> int:
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel()
                queue = await channel.declare_queue(self.name, durable=True)
                ready = queue.declaration_result.message_count
                return int(ready or 0)

        return asyncio.run(go())

    def take_review(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every message of the review queue (removed), as (body, headers)."""

        async def go() -> list[tuple[dict[str, Any], dict[str, Any]]]:
            taken = []
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel()
                queue = await channel.declare_queue(self.review, durable=True)
                while (message := await queue.get(no_ack=True, fail=False)) is not None:
                    taken.append((json.loads(message.body), dict(message.headers)))
            return taken

        return asyncio.run(go())

    def peek_review(self) -> int:
        async def go() -> int:
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel()
                queue = await channel.declare_queue(self.review, durable=True)
                return int(queue.declaration_result.message_count or 0)

        return asyncio.run(go())

    def delete(self) -> None:
        async def go() -> None:
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel()
                for name in (self.name, self.review):
                    await channel.queue_delete(name)

        asyncio.run(go())


class Jet:
    """A JetStream stream ``<subject>-stream`` with the durable consumer ``workers``, and
    the review stream ``<subject>-review`` on ``<subject>.review``."""

    def __init__(self, subject: str) -> None:
        self.name = subject
        self.stream = f"{subject}-stream"
        self.review_stream = f"{subject}-review"

    async def _client(self) -> Any:
        return await nats.connect(NATS_URL)

    def publish(self, bodies: Iterable[bytes]) -> None:
        async def go() -> None:
            client = await self._client()
            try:
                js = client.jetstream()
                await js.add_stream(name=self.stream, subjects=[self.name])
                await js.add_stream(name=self.review_stream, subjects=[f"{self.name}.review"])
                for data in bodies:
                    await js.publish(self.name, data)
            finally:
                await client.close()

        asyncio.run(go())

    def waiting(self) -> int:
        """Messages the consumer has not had acknowledged (pending and in flight)."""

        async def go() -> int:
            client = await self._client()
            try:
                js = client.jetstream()
                try:
                    info = await js.consumer_info(self.stream, "workers")
                except NotFoundError:
                    return (await js.stream_info(self.stream)).state.messages
                return int(info.num_pending + info.num_ack_pending + info.num_redelivered * 0)
            finally:
                await client.close()

        return asyncio.run(go())

    def peek_review(self) -> int:
        async def go() -> int:
            client = await self._client()
            try:
                info = await client.jetstream().stream_info(self.review_stream)
                return int(info.state.messages)
            finally:
                await client.close()

        return asyncio.run(go())

    def take_review(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        async def go() -> list[tuple[dict[str, Any], dict[str, Any]]]:
            client = await self._client()
            taken = []
            try:
                js = client.jetstream()
                count = (await js.stream_info(self.review_stream)).state.messages
                if count:
                    sub = await js.pull_subscribe(f"{self.name}.review", stream=self.review_stream)
                    while len(taken) < count:
                        for message in await sub.fetch(min(100, count - len(taken)), timeout=5):
                            taken.append((json.loads(message.data), dict(message.headers or {})))
                            await message.ack()
                    await sub.unsubscribe()
                await js.purge_stream(self.review_stream)
            finally:
                await client.close()
            return taken

        return asyncio.run(go())

    def delete(self) -> None:
        async def go() -> None:
            client = await self._client()
            try:
                js = client.jetstream()
                for name in (self.stream, self.review_stream):
                    with contextlib.suppress(NotFoundError):
                        await js.delete_stream(name)
            finally:
                await client.close()

        asyncio.run(go())


class JetWork(Jet):
    """The streams of ``examples/broker_worker.py --broker nats://…`` for the work subject
    ``subject``: the stream ``subject`` (a unique name holds no ``.``), the durable pull
    consumer ``workers``, the review stream ``<subject>-review`` on ``<subject>.review``."""

    def __init__(self, subject: str) -> None:
        super().__init__(subject)
        self.stream = subject


def read_review(place: Rabbit | Jet) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every message of the review queue or stream, as (body, headers), left in place."""

    async def rabbit(queue_name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        read = []
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:  # closed unacknowledged: every message goes back
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, durable=True)
            while (message := await queue.get(no_ack=False, fail=False)) is not None:
                read.append((json.loads(message.body), dict(message.headers)))
        return read

    async def jet(stream: str, subject: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        read = []
        client = await nats.connect(NATS_URL)
        try:
            js = client.jetstream()
            seq = (await js.stream_info(stream)).state.first_seq
            while True:
                try:
                    message = await js.get_msg(stream, seq=seq, subject=subject, next=True)
                except NotFoundError:
                    return read
                read.append((json.loads(message.data or b""), dict(message.headers or {})))
                seq = (message.seq or seq) + 1
        finally:
            await client.close()

    if isinstance(place, Rabbit):
        return asyncio.run(rabbit(place.review))
    return asyncio.run(jet(place.review_stream, f"{place.name}.review"))
