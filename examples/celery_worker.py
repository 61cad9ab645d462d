"""A Celery worker that charges orders through itemjournal: each order at most once.

One task, ``charge(order_id: str, amount_cents: int)``, on the default queue. Its body
waits ``EFFECT_SECONDS``, then charges the "provider": it appends one line
``<order_id> <amount_cents> <claim key>`` to the ledger file and fsyncs it. The task
returns the receipt. Send it as often as you like, kill the worker's processes (SIGKILL)
at any moment, restart them: no order is charged twice.

* A task sent again for an order that succeeded returns the stored receipt, uncharged.
* A copy delivered while the order is being charged elsewhere (Redis' visibility timeout
  ran out, a duplicate) waits: it is retried a little later and then returns the receipt.
* A task whose order needs review (a worker died between claim and receipt) fails with
  ``TaskRefused`` (``REVIEW_REQUIRED``) and is not delivered again; the order waits for an
  operator (``itemjournal list --status needs_review``, ``itemjournal resolve``).

Environment:

* ``BROKER_URL``: ``amqp://...`` (RabbitMQ) or ``redis://...``;
* ``ITEMJOURNAL_LOCATION``: the journal (as the ``itemjournal`` command reads it);
* ``LEDGER``: the ledger file;
* ``EFFECT_SECONDS``: how long a charge takes (default 0);
* ``VISIBILITY_TIMEOUT``: for a ``redis://`` broker, seconds before an unacknowledged
  task is delivered again (default Celery's).

Run, with ``examples/`` on ``PYTHONPATH``::

    PYTHONPATH=examples celery -A celery_worker worker
    PYTHONPATH=examples python -c "import celery_worker; celery_worker.charge.delay('o-1', 4500)"
"""

from __future__ import annotations

import os
import sys
import time

from celery import Celery

from itemjournal.celery import current_claim, once_task
from itemjournal.sync import Journal


def setting(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        sys.exit(f"celery_worker: set {name}")
    return value


BROKER_URL = setting("BROKER_URL")
LEDGER = setting("LEDGER")
EFFECT_SECONDS = float(os.environ.get("EFFECT_SECONDS") or 0)

app = Celery("celery_worker", broker=BROKER_URL)
app.conf.broker_connection_retry_on_startup = True
if BROKER_URL.startswith(("redis://", "rediss://")) and os.environ.get("VISIBILITY_TIMEOUT"):
    visibility = float(os.environ["VISIBILITY_TIMEOUT"])
    app.conf.broker_transport_options = {
        "visibility_timeout": visibility,
        # The transport looks for overdue tasks every 10 x 10 s by default; a short
        # timeout only means something if they are looked for about as often.
        "unacked_restore_interval": max(1, min(10, int(visibility // 2))),
        "unacked_restore_throttle": 1,
    }

# Opened at import, in the worker's main process: the pool's children use it after the
# fork, and each claim names the child that runs the task as its owner.
journal = Journal.open(setting("ITEMJOURNAL_LOCATION"))


def append_to_ledger(line: str) -> None:
    fd = os.open(LEDGER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@once_task(
    app,
    journal,
    identity=lambda order_id, amount_cents: ("shop", "billing", "charge", order_id),
    inputs=lambda order_id, amount_cents: {"amount_cents": amount_cents},
    definition="charge-v1",
    in_progress_countdown=1.0,
    name="charge",
)
def charge(order_id: str, amount_cents: int) -> str:
    key = current_claim().key
    time.sleep(EFFECT_SECONDS)
    append_to_ledger(f"{order_id} {amount_cents} {key}\n")
    return f"ledger:{order_id}"
