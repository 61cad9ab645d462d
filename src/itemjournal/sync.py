"""The journal for blocking code: the same operations as ``itemjournal``, without ``await``.

For Django and Flask views, Celery tasks, scripts, cron jobs and notebook cells::

    from itemjournal.sync import Journal

    journal = Journal.open("/var/lib/shop/journal")

    def charge(order_id: str, amount_cents: int) -> str:
        item = ("shop", "billing", "charge", order_id)
        with journal.claim(item, {"amount_cents": amount_cents}, "billing-v3") as attempt:
            if attempt.reused:
                return attempt.receipt
            charge = provider.charge(order_id, idempotency_key=attempt.claim.key)
            attempt.complete(charge.id)
            return charge.id

``Journal`` has the async journal's names, arguments, answers, errors and claim-block
rules (``close()`` for ``aclose()``, ``records()`` an iterator); it takes the same
locations and the same stores (``itemjournal.testing.MemoryStore()`` too), and keeps the
same records: a blocking and an async journal on one location exclude each other and
read each other's records, in one process or in many. ``once`` decorates a plain
function as ``itemjournal.once`` decorates an ``async def``.

One ``Journal`` serves any number of threads. Its blocking steps run in the caller's
thread: no event loop, no portal, no thread started per call (the SQLite store's writer
thread still commits the calls of all threads together). It works in a thread that runs
an event loop (a notebook cell), and in a child after ``fork`` (Celery's prefork pool,
gunicorn ``--preload``), which uses no lock, connection or file position of its parent's.
The async journal's code is the source of this one: ``tools/async_to_sync.py`` writes it.

A thread cannot be cancelled. A ``KeyboardInterrupt`` (the Stop button of a notebook)
that lands in a call leaves what a crash of the call at that moment would, with one
kindness: one that lands once ``begin`` has written its claim takes the claim back, as
a cancelled ``begin`` of the async face does, and one that lands in the claim block's
exit lets the exit finish its write first. See the "Synchronous code" guide.
"""

from __future__ import annotations

from ._sync.claim import Attempt, ClaimContext, ClaimedAttempt, ReusedAttempt
from ._sync.journal import Journal
from ._sync.once import once

__all__ = ["Attempt", "ClaimContext", "ClaimedAttempt", "Journal", "ReusedAttempt", "once"]
