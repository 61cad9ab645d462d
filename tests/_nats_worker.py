"""A FastStream worker on NATS JetStream for the broker tests: the same contract as
examples/broker_worker.py (which is RabbitMQ's), with ``NATS_URL``, ``SUBJECT`` (its
stream is ``<SUBJECT>-stream``, the review stream ``<SUBJECT>-review`` on the subject
``<SUBJECT>.review``), ``LEDGER``, ``ITEMJOURNAL_LOCATION``, ``DRAIN_SECONDS`` and
``EFFECT_SECONDS``. The streams are made by the tests, before the workers start."""

from __future__ import annotations

import os
from typing import Any

import anyio
from faststream.nats import ConsumerConfig, JStream, NatsBroker

import itemjournal
from itemjournal import Journal
from itemjournal.faststream import DeadLetter, JournalMiddleware, current_claim


def append_to_ledger(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


async def work() -> None:
    subject = os.environ["SUBJECT"]
    drain_seconds = float(os.environ.get("DRAIN_SECONDS", "10"))
    effect_seconds = float(os.environ.get("EFFECT_SECONDS", "0"))
    async with await Journal.open(os.environ["ITEMJOURNAL_LOCATION"]) as journal:

        async def to_review(body: bytes, headers: dict[str, str]) -> object:
            return await broker.publish(
                body, f"{subject}.review", headers=headers, stream=f"{subject}-review"
            )

        middleware = JournalMiddleware(
            journal,
            scope="shop",
            program="billing",
            job="charge",
            item=lambda body: body["order"],
            inputs=lambda body: {"amount_cents": body["amount_cents"]},
            definition="charge-v1",
            on_refused=DeadLetter(to_review),
        )
        broker = NatsBroker(
            os.environ["NATS_URL"],
            middlewares=[middleware],
            graceful_timeout=drain_seconds,
            logger=None,
        )

        @broker.subscriber(
            subject,
            stream=JStream(f"{subject}-stream", subjects=[subject]),
            durable="workers",
            queue="workers",
            config=ConsumerConfig(ack_wait=2, max_ack_pending=64),
            max_workers=4,
        )
        async def charge(body: dict[str, Any]) -> str:
            key = current_claim().key
            await anyio.sleep(effect_seconds)
            line = f"{body['order']} {key}\n"
            await anyio.to_thread.run_sync(append_to_ledger, os.environ["LEDGER"], line)
            return f"ledger:{body['order']}"

        async with itemjournal.drain_on_signals(grace=drain_seconds) as drain:
            await broker.connect()
            await broker.start()
            print(f"worker {os.getpid()} consuming {subject}", flush=True)
            await drain.wait()
            middleware.stop_taking()
            await broker.stop()


if __name__ == "__main__":
    anyio.run(work, backend="asyncio")
