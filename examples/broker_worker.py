"""A FastStream worker on RabbitMQ or NATS JetStream that charges orders through itemjournal.

Each message is a JSON body ``{"order": "<id>", "amount_cents": <int>}``. The worker
claims the order in the journal before it charges, charges the provider (here a ledger
file: one line ``<order id> <claim key>`` per charge, fsynced), records the receipt, and
only then acknowledges the message. Run as many workers as you like on one queue, kill
them (SIGKILL) at any moment: no order is charged twice.

* A redelivered message whose order succeeded is acknowledged without charging.
* A message whose record needs review (a worker died between claim and receipt, the
  charge raised) is moved to the queue ``<QUEUE>.review``, with the reason in its
  ``x-itemjournal-*`` headers; it is never charged again before an operator decides.
* On SIGTERM (or SIGINT) the worker takes no new message (those it had prefetched go
  back to the queue, for the other workers), lets the charges in flight finish within
  ``DRAIN_SECONDS`` (default 10), and exits 0.

Environment: ``AMQP_URL``, ``QUEUE``, ``LEDGER`` (the ledger file), ``ITEMJOURNAL_LOCATION``
(the journal, as the ``itemjournal`` command reads it), ``DRAIN_SECONDS``; and, to
try things, ``EFFECT_SECONDS`` (how long a charge takes, default 0) and ``PREFETCH``
(messages in flight per worker, default 8). With ``--broker URL`` the broker is that URL
instead of ``AMQP_URL`` (which is then not needed): ``amqp://`` or ``amqps://`` for
RabbitMQ, ``nats://`` or ``tls://`` for NATS JetStream.

    python examples/broker_worker.py             # a worker, until SIGTERM
    python examples/broker_worker.py --redrive   # move <QUEUE>.review back to <QUEUE>
    python examples/broker_worker.py --broker nats://127.0.0.1:4222             # JetStream
    python examples/broker_worker.py --broker nats://127.0.0.1:4222 --redrive

Re-driving: once an operator has settled the records in review (``itemjournal resolve
--retry`` for a charge that did not happen, ``--receipt`` for one that did), ``--redrive``
moves every message of ``<QUEUE>.review`` back to ``<QUEUE>``, each one acknowledged on
the review queue only after the broker has confirmed its copy on the work queue. The
next delivery claims a released order afresh, and acknowledges a settled one without
charging; a message whose record is still in review goes back to ``<QUEUE>.review``.

On NATS JetStream, ``QUEUE`` is the work subject, and the worker makes (if missing):

* the stream ``<S>`` on the subject ``<QUEUE>`` (``<S>`` is ``QUEUE`` with each character
  a stream name cannot hold, such as ``.``, written ``_``), file storage;
* the durable pull consumer ``workers`` on it, shared by every worker: each fetches up to
  ``PREFETCH`` messages at a time and handles them together. ``max_deliver`` stays
  unlimited: with a limit, JetStream would stop delivering a message that was never
  acknowledged, and nobody would be told;
* the review stream ``<S>-review`` on the subject ``<QUEUE>.review``: a refused message is
  published there, with the ``x-itemjournal-*`` headers, and acknowledged only once
  JetStream has confirmed that copy. ``nats stream view <S>-review`` shows them.

``ACK_WAIT`` (JetStream only; seconds, default 30) is the consumer's ``ack_wait``: how long
a delivered message may stay unacknowledged before JetStream delivers it again. It is the
time a killed worker's messages wait before another worker gets them, so seconds, not
hours; and it should exceed the longest charge, so that a redelivery stays the exception.
A charge that runs longer than ``ACK_WAIT`` is still neither charged twice nor lost:
JetStream delivers its message again while the first run lives, the journal answers that
delivery ``IN_PROGRESS``, and the middleware waits for the first run (up to its ``wait``,
30 s): once that run has succeeded, the copy is acknowledged without charging; if the
first worker dies instead (on this host, the journal proves its owner gone), the copy
finds the record in review and goes to the review stream. Only a first run still going
after ``ACK_WAIT`` plus ``wait`` leaves a copy in the review stream, with the code
``IN_PROGRESS``; its record succeeds when that run ends, and a redrive of the copy is then
acknowledged without charging.

``--redrive`` on JetStream takes the messages of ``<S>-review`` present when it starts, in
order: it publishes each one's copy to ``<QUEUE>`` (without its ``x-itemjournal-*`` and
``Nats-*`` headers; a ``Nats-Msg-Id`` travels as the ``message_id`` header, so that
JetStream's de-duplication window cannot drop the copy), waits for JetStream's
confirmation, and only then deletes the message from ``<S>-review``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

import aio_pika
import anyio
import nats
from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
from nats.js.api import StorageType
from nats.js.errors import NotFoundError

import itemjournal
from itemjournal import Journal
from itemjournal.faststream import DeadLetter, JournalMiddleware, current_claim

DEFINITION = "charge-v1"
DURABLE = "workers"  # the JetStream consumer every worker shares


def settings(broker: str | None = None) -> dict[str, str]:
    names: tuple[str, ...] = ("QUEUE", "LEDGER", "ITEMJOURNAL_LOCATION")
    if broker is None:
        names = ("AMQP_URL", *names)
    missing = [name for name in names if not os.environ.get(name)]
    if missing:
        sys.exit(f"broker_worker: set {', '.join(missing)}")
    env = {name: os.environ[name] for name in names}
    env["BROKER"] = broker if broker is not None else env["AMQP_URL"]
    scheme = env["BROKER"].split("://", 1)[0].lower()
    if scheme not in ("amqp", "amqps", "nats", "tls"):
        sys.exit(f"broker_worker: --broker is amqp://, amqps://, nats:// or tls://, not {scheme!r}")
    return env


def on_jetstream(env: dict[str, str]) -> bool:
    return env["BROKER"].split("://", 1)[0].lower() in ("nats", "tls")


def streams(queue: str) -> tuple[str, str]:
    """The JetStream stream of the subject ``queue``, and its review stream."""
    stream = re.sub(r"[^A-Za-z0-9_-]", "_", queue)
    return stream, f"{stream}-review"


def append_to_ledger(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


async def work(env: dict[str, str]) -> None:
    drain_seconds = float(os.environ.get("DRAIN_SECONDS", "10"))
    effect_seconds = float(os.environ.get("EFFECT_SECONDS", "0"))
    prefetch = int(os.environ.get("PREFETCH", "8"))
    queue, review = env["QUEUE"], env["QUEUE"] + ".review"
    stream, review_stream = streams(queue)  # on JetStream
    async with await Journal.open(env["ITEMJOURNAL_LOCATION"]) as journal:

        async def to_review(body: bytes, headers: dict[str, Any]) -> object:
            if isinstance(broker, NatsBroker):  # returns once JetStream has stored the copy
                return await broker.publish(body, review, headers=headers, stream=review_stream)
            return await broker.publish(body, review, headers=headers, persist=True)

        middleware = JournalMiddleware(
            journal,
            scope="shop",
            program="billing",
            job="charge",
            item=lambda body: body["order"],
            inputs=lambda body: {"amount_cents": body["amount_cents"]},
            definition=DEFINITION,
            on_refused=DeadLetter(to_review),
        )
        broker: RabbitBroker | NatsBroker
        subscriber: Any
        if on_jetstream(env):
            ack_wait = float(os.environ.get("ACK_WAIT", "30"))
            broker = NatsBroker(
                env["BROKER"],
                middlewares=[middleware],
                graceful_timeout=drain_seconds,
                logger=None,
            )
            subscriber = broker.subscriber(
                queue,
                stream=JStream(stream, declare=False),  # made below, if missing
                durable=DURABLE,
                pull_sub=PullSub(batch_size=prefetch, timeout=1.0),
                config=ConsumerConfig(ack_wait=ack_wait, max_deliver=-1),
            )
        else:
            broker = RabbitBroker(
                env["BROKER"],
                middlewares=[middleware],
                graceful_timeout=drain_seconds,
                default_channel=Channel(prefetch_count=prefetch),
                logger=None,
            )
            subscriber = broker.subscriber(RabbitQueue(queue, durable=True))

        async def charge(body: dict[str, Any]) -> str:
            key = current_claim().key
            await anyio.sleep(effect_seconds)
            line = f"{body['order']} {key}\n"
            await anyio.to_thread.run_sync(append_to_ledger, env["LEDGER"], line)
            return f"ledger:{body['order']}"

        subscriber(charge)
        async with itemjournal.drain_on_signals(grace=drain_seconds) as drain:
            await broker.connect()
            if isinstance(broker, NatsBroker):
                await declare_streams(broker.connection.jetstream(), queue)
            else:
                await broker.declare_queue(RabbitQueue(review, durable=True))
            await broker.start()
            print(f"worker {os.getpid()} consuming {queue}", flush=True)
            await drain.wait()
            middleware.stop_taking()  # prefetched messages go back, unclaimed
            await broker.stop()  # waits up to graceful_timeout for those in flight
        if drain.cancelled:
            print(f"worker {os.getpid()}: the drain ran out of time", flush=True)
        else:
            print(f"worker {os.getpid()} drained", flush=True)


async def declare_streams(js: Any, queue: str) -> None:
    """The work stream and the review stream, each made unless it exists."""
    for name, subject in zip(streams(queue), (queue, queue + ".review"), strict=True):
        try:
            await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(name=name, subjects=[subject], storage=StorageType.FILE)


async def redrive(env: dict[str, str]) -> int:
    """Move every message of ``<QUEUE>.review`` back to ``<QUEUE>``; return how many."""
    if on_jetstream(env):
        return await redrive_jetstream(env)
    moved = 0
    connection = await aio_pika.connect(env["BROKER"])
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        review = await channel.declare_queue(env["QUEUE"] + ".review", durable=True)
        while (message := await review.get(no_ack=False, fail=False)) is not None:
            headers = {
                key: value
                for key, value in message.headers.items()
                if not key.startswith("x-itemjournal-")
            }
            copy = aio_pika.Message(
                message.body,
                headers=headers,
                content_type=message.content_type,
                message_id=message.message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await channel.default_exchange.publish(copy, routing_key=env["QUEUE"])
            await message.ack()  # only after the broker confirmed the copy
            moved += 1
    return moved


async def redrive_jetstream(env: dict[str, str]) -> int:
    """The messages of the review stream present now, each copied to ``<QUEUE>`` and, once
    JetStream confirmed the copy, deleted from the review stream."""
    queue = env["QUEUE"]
    stream, review_stream = streams(queue)
    client = await nats.connect(env["BROKER"])
    moved = 0
    try:
        js = client.jetstream()
        await declare_streams(js, queue)
        state = (await js.stream_info(review_stream)).state
        seq = state.first_seq
        while state.messages and seq <= state.last_seq:
            try:
                message = await js.get_msg(
                    review_stream, seq=seq, subject=queue + ".review", next=True
                )
            except NotFoundError:  # none left
                break
            if message.seq is None or message.seq > state.last_seq:
                break  # refused again since the redrive began: left for the next one
            original = message.headers or {}
            headers = {
                key: value
                for key, value in original.items()
                if not key.startswith(("x-itemjournal-", "Nats-"))
            }
            if "Nats-Msg-Id" in original:
                headers.setdefault("message_id", original["Nats-Msg-Id"])
            await js.publish(queue, message.data or b"", headers=headers or None, stream=stream)
            await js.delete_msg(review_stream, message.seq)  # only after the copy's PubAck
            moved += 1
            seq = message.seq + 1
    finally:
        await client.close()
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redrive", action="store_true", help="move <QUEUE>.review back to <QUEUE>"
    )
    parser.add_argument(
        "--broker",
        metavar="URL",
        help="amqp://... for RabbitMQ (default: $AMQP_URL), nats://... for NATS JetStream",
    )
    options = parser.parse_args()
    env = settings(options.broker)
    if options.redrive:
        moved = anyio.run(redrive, env, backend="asyncio")
        print(f"moved {moved} message(s) from {env['QUEUE']}.review to {env['QUEUE']}")
    else:
        anyio.run(work, env, backend="asyncio")  # FastStream runs on asyncio


if __name__ == "__main__":
    main()
