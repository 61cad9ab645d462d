"""A FastStream worker on RabbitMQ that charges orders through itemjournal.

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
(messages in flight per worker, default 8).

    python examples/broker_worker.py             # a worker, until SIGTERM
    python examples/broker_worker.py --redrive   # move <QUEUE>.review back to <QUEUE>

Re-driving: once an operator has settled the records in review (``itemjournal resolve
--retry`` for a charge that did not happen, ``--receipt`` for one that did), ``--redrive``
moves every message of ``<QUEUE>.review`` back to ``<QUEUE>``, each one acknowledged on
the review queue only after the broker has confirmed its copy on the work queue. The
next delivery claims a released order afresh, and acknowledges a settled one without
charging; a message whose record is still in review goes back to ``<QUEUE>.review``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import aio_pika
import anyio
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

import itemjournal
from itemjournal import Journal
from itemjournal.faststream import DeadLetter, JournalMiddleware, current_claim

DEFINITION = "charge-v1"


def settings() -> dict[str, str]:
    names = ("AMQP_URL", "QUEUE", "LEDGER", "ITEMJOURNAL_LOCATION")
    missing = [name for name in names if not os.environ.get(name)]
    if missing:
        sys.exit(f"broker_worker: set {', '.join(missing)}")
    return {name: os.environ[name] for name in names}


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
    async with await Journal.open(env["ITEMJOURNAL_LOCATION"]) as journal:

        async def to_review(body: bytes, headers: dict[str, str]) -> object:
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
        broker = RabbitBroker(
            env["AMQP_URL"],
            middlewares=[middleware],
            graceful_timeout=drain_seconds,
            default_channel=Channel(prefetch_count=prefetch),
            logger=None,
        )

        @broker.subscriber(RabbitQueue(queue, durable=True))
        async def charge(body: dict[str, Any]) -> str:
            key = current_claim().key
            await anyio.sleep(effect_seconds)
            line = f"{body['order']} {key}\n"
            await anyio.to_thread.run_sync(append_to_ledger, env["LEDGER"], line)
            return f"ledger:{body['order']}"

        async with itemjournal.drain_on_signals(grace=drain_seconds) as drain:
            await broker.connect()
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


async def redrive(env: dict[str, str]) -> int:
    """Move every message of ``<QUEUE>.review`` back to ``<QUEUE>``; return how many."""
    moved = 0
    connection = await aio_pika.connect(env["AMQP_URL"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redrive", action="store_true", help="move <QUEUE>.review back to <QUEUE>"
    )
    options = parser.parse_args()
    env = settings()
    if options.redrive:
        moved = anyio.run(redrive, env, backend="asyncio")
        print(f"moved {moved} message(s) from {env['QUEUE']}.review to {env['QUEUE']}")
    else:
        anyio.run(work, env, backend="asyncio")  # FastStream runs on asyncio


if __name__ == "__main__":
    main()
