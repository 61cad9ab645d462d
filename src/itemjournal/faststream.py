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

1. Its identity is ``(scope, program, job, item)``, the item taken from the message: the
   id it carries (``MessageId()``), a header, or a function of the decoded body;
   ``inputs`` (a function of the decoded body) are its fingerprint. A message whose
   identity or inputs cannot be made, or are not valid (a label that is not one, a float
   or a text too long among the inputs), is a plain refusal: handed to ``on_refused``
   once (``INVALID_IDENTITY``, ``INVALID_LABEL``, ``INVALID_INPUTS``, or the function's
   error as ``INVALID_IDENTITY``/``INVALID_INPUTS``), never run, never recorded, and not
   raised to FastStream as a handler failure.
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
   ``Reject()`` (no requeue: RabbitMQ's dead-letter exchange; JetStream terminates it,
   keeping it in the stream without the reason); ``DeadLetter(publish)`` publishes a copy
   with the reason in ``x-itemjournal-*`` headers (on JetStream, to a review stream),
   then acknowledges. Never dropped, never run a second time.
6. A storage failure before anything was claimed gives the message back (``nack``,
   requeued): nothing was recorded, so it may run later.

``stop_taking()`` starts a drain: later messages are given back before any claim, so the
broker hands them to other workers, while those in flight finish. With FastStream's
``graceful_timeout`` the broker's ``stop()`` waits for them that long.

On NATS JetStream, subscribe with a durable pull consumer (``durable=...,
pull_sub=PullSub(batch_size=...)``) whose ``ack_wait`` exceeds the longest handler: a
message not acknowledged within it is delivered again while its first run lives; the
journal answers that delivery ``IN_PROGRESS`` and the middleware waits (``wait``) for the
first run, then acknowledges the copy without running it. ``examples/broker_worker.py``
runs on both brokers, with a review queue or stream and a re-drive.

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
