"""Celery tasks whose effect happens once per item (extra ``celery``).

``once_task`` makes a task of a Celery app that runs its body under a claim of a blocking
journal (``itemjournal.sync``)::

    from celery import Celery
    from itemjournal.celery import current_claim, once_task
    from itemjournal.sync import Journal

    app = Celery("shop", broker="amqp://guest:guest@localhost//")
    journal = Journal.open("/var/lib/shop/journal")   # at import, before the pool forks

    @once_task(
        app, journal,
        identity=lambda order_id, amount_cents: ("shop", "billing", "charge", order_id),
        inputs=lambda order_id, amount_cents: {"amount_cents": amount_cents},
        definition="charge-v1",
        name="charge",
    )
    def charge(order_id: str, amount_cents: int) -> str:
        result = provider.charge(order_id, amount_cents, idempotency_key=current_claim().key)
        return result.id                                   # the receipt

    charge.delay("order-17", 4500)

For each delivery of the task, in this order:

1. Its identity comes from the task's **arguments** (not from the task id: a task sent
   twice for one order is one item), its inputs too.
2. It is claimed before the body runs: the ``started`` record is durable first, and its
   owner is the process that runs the body (the pool child on the prefork pool).
3. The body returns the receipt (or a ``(receipt, result)`` pair); it is stored
   (``complete``) before the task returns it. The task runs with ``acks_late=True`` and
   ``reject_on_worker_lost=True``: the message is acknowledged only after the task
   returned, and a task whose pool child was killed goes back to the queue rather than
   being lost.

What each answer of ``begin`` does with the task:

| answer of ``begin`` | the body | the task | its message |
|---|---|---|---|
| a claim | runs | returns the receipt once it is stored | acknowledged after |
| a reuse (the item succeeded) | never runs | returns the stored receipt | acknowledged |
| ``IN_PROGRESS`` (1) | never runs | waits, then is retried (2) | acknowledged, retry queued |
| ``REVIEW_REQUIRED`` (3) | never runs | ``on_refused`` (4) | acknowledged, never requeued |
| any other refusal (5) | never runs | ``on_refused`` (4) | acknowledged, never requeued |
| ``STORAGE_FAILED``, no claim | never runs | retried (6) | acknowledged, retry queued |
| the body raises | ran | fails; the record needs review | acknowledged |
| no valid receipt | ran | fails ``INVALID_RECEIPT``; record in review | acknowledged |
| the worker is killed | ran, how far unknown | killed | requeued, then (3) |

1. The item runs elsewhere: a redelivery after Redis' visibility timeout while the first
   run goes on, a duplicate sent meanwhile.
2. It waits up to ``wait`` seconds in its pool slot, then is retried (``task.retry``)
   after ``in_progress_countdown`` seconds, with no retry limit: neither lost nor failed,
   it returns the receipt once the first run has stored it.
3. Its owner died mid-effect (``begin`` sends the record to review), or it was in review.
4. By default ``Fail()``: the task fails with ``TaskRefused``, whose ``code`` is the
   refusal's; the record stays as it is (in review). Never run, never requeued in a loop,
   visible as a failed task and as a record (``itemjournal list --status needs_review``).
5. ``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``RECORD_INVALID``, or an identity or inputs
   that cannot be made from the arguments (``INVALID_LABEL``...).
6. Nothing was recorded, so it may run later: retried after ``in_progress_countdown``
   seconds within the task's own ``max_retries``, then it fails with ``STORAGE_FAILED``.

A task run in the calling process (``task.apply()``, or called as a function) is never
retried: ``IN_PROGRESS`` there goes to ``on_refused`` after ``wait``.

What the broker itself can lose, which no journal sees (it cannot see a task it never
received): kombu's Redis transport takes a message off the list (``BRPOP``) before it
records it as unacknowledged, so a worker's main process killed between the two drops
that message; a broker that loses a message it had acknowledged to the publisher (Redis
without ``appendfsync always``, a non-durable RabbitMQ queue) loses the task before any
worker has it. On Redis a message that is unacknowledged longer than the transport's
``visibility_timeout`` is delivered again while its first run goes on: the journal makes
that copy wait (``IN_PROGRESS``) instead of running it.
"""

from ._homes.celery_tasks import (
    Fail,
    OnceTask,
    Refusal,
    RefusalPolicy,
    TaskRefused,
    current_claim,
    once_task,
)

__all__ = [
    "Fail",
    "OnceTask",
    "Refusal",
    "RefusalPolicy",
    "TaskRefused",
    "current_claim",
    "once_task",
]

# A failed task's result names its error as users import it (``itemjournal.celery.TaskRefused``).
TaskRefused.__module__ = __name__
