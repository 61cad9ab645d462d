"""Workers on a message broker through FastStream (extra ``faststream``).

``JournalMiddleware`` runs each message's handler under a claim of a journal; give it to
the broker (or to a router) as one of its ``middlewares``::

    middleware = JournalMiddleware(
        journal, scope="shop", program="billing", job="charge",
        item=lambda body: body["order"],              # or MessageId(), Header("x-order")
        inputs=lambda body: {"amount_cents": body["amount_cents"]},
        definition="charge-v3",
    )
    broker = RabbitBroker(url, middlewares=[middleware])

    @broker.subscriber(queue)
    async def charge(body: dict[str, object]) -> str:
        claim = current_claim()
        return await provider.charge(body, idempotency_key=claim.key)   # the receipt

For each message, in this order:

1. Its identity is ``(scope, program, job, item)``, the item taken from the message: its
   message id, a header, or a function of the decoded body; ``inputs`` (a function of the
   decoded body) are its fingerprint. A message whose identity cannot be made is refused
   (``INVALID_IDENTITY``, or the function's error).
2. It is claimed (``journal.claim``) before the handler runs: the ``started`` record is
   durable first. ``current_claim()`` gives the handler its claim; pass ``claim.key`` to
   the provider as its idempotency key.
3. The handler returns the receipt (a ``str``) or a ``(receipt, result)`` pair; the
   receipt is stored (``complete``), and only then is the message acknowledged. A crash
   anywhere before leaves the message unacknowledged: the broker delivers it again, and
   the journal answers for it.
4. A message that succeeded before is acknowledged without calling the handler.
5. A message the journal refuses (``REVIEW_REQUIRED``, ``IN_PROGRESS`` after ``wait``
   seconds, ``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``RECORD_INVALID``), and a message
   whose handler raised (its record now needs review), goes to ``on_refused``: by default
   ``Reject()`` (no requeue: RabbitMQ's dead-letter exchange, JetStream's terminate);
   ``DeadLetter(publish)`` publishes a copy with the reason in ``x-itemjournal-*``
   headers, then acknowledges. Never dropped, never run a second time.
6. A storage failure before anything was claimed gives the message back (``nack``,
   requeued): nothing was recorded, so it may run later.

``stop_taking()`` starts a drain: later messages are given back before any claim, so the
broker hands them to other workers, while those in flight finish. With FastStream's
``graceful_timeout`` the broker's ``stop()`` waits for them that long.

Do not use ``AckPolicy.ACK_FIRST`` with it: the acknowledgement must come after the record.
"""

from ._homes.broker import (
    DeadLetter,
    Header,
    JournalMiddleware,
    MessageId,
    Refusal,
    RefusalPolicy,
    Reject,
    current_claim,
)

__all__ = [
    "DeadLetter",
    "Header",
    "JournalMiddleware",
    "MessageId",
    "Refusal",
    "RefusalPolicy",
    "Reject",
    "current_claim",
]
