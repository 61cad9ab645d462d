"""A worker loop that charges orders through itemjournal.

Run it twice over the same directory (``make demo`` does, through ``demo.py``): the
first run charges the orders and leaves one whose provider call timed out in
``needs_review``; the second run reuses every receipt and refuses to charge the uncertain
order again, until an operator decides (``itemjournal resolve``).

    python examples/worker_loop.py --root /tmp/demo-journal --fresh
    python examples/worker_loop.py --root /tmp/demo-journal

``--root`` defaults to ``$ITEMJOURNAL_LOCATION``, the variable the ``itemjournal``
command reads, or else ``./demo-journal``.
"""

from __future__ import annotations

import argparse
import os
import shutil

import anyio

import itemjournal
from itemjournal import ConflictError, Journal

ORDERS = {"order-1": "12.00", "order-2": "7.50", "order-3": "99.90", "order-4": "3.20"}
SLOW_ORDER = "order-3"  # the provider never answers for this one on the first run
DEFINITION = itemjournal.definition_digest("charge-v1")


class Provider:
    """A stand-in payment provider that honours idempotency keys, as real ones do."""

    def __init__(self, hang_on: str | None) -> None:
        self.hang_on = hang_on
        self.charges: dict[str, str] = {}

    async def charge(self, order: str, amount: str, idempotency_key: str) -> str:
        await anyio.sleep(0.01)
        if order == self.hang_on:
            await anyio.sleep_forever()
        receipt = self.charges.setdefault(idempotency_key, f"ch_{order}_{amount}")
        return receipt


async def process(journal: Journal, provider: Provider, order: str, amount: str) -> str:
    identity = ("demo-shop", "billing", "charge", order)
    try:
        async with journal.claim(identity, {"amount": amount}, DEFINITION) as attempt:
            if attempt.reused:
                return f"reused receipt {attempt.receipt} (not charged again)"
            assert attempt.claim is not None
            with anyio.fail_after(0.5):
                receipt = await provider.charge(order, amount, attempt.claim.key)
            await attempt.complete(receipt)
            return f"charged, receipt {receipt}"
    except TimeoutError:
        return "provider timed out: outcome unknown, marked needs_review"
    except ConflictError as error:
        return f"refused ({error.code}): {error.message}"


async def run(root: str, fresh: bool) -> None:
    if fresh:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))
    first = fresh
    provider = Provider(hang_on=SLOW_ORDER if first else None)
    label = "first run" if first else "rerun"
    print(f"== {label} (pid {os.getpid()}), journal at {root}")
    async with await Journal.open(root) as journal:
        results: dict[str, str] = {}

        async def one(order: str, amount: str) -> None:
            results[order] = await process(journal, provider, order, amount)

        async with anyio.create_task_group() as tg:
            for order, amount in ORDERS.items():
                tg.start_soon(one, order, amount)
        for order in ORDERS:
            view = await journal.inspect(("demo-shop", "billing", "charge", order))
            why = f", reason: {view.review_reason}" if view.review_reason else ""
            print(f"  {order}: {results[order]}  [{view.status}{why}]")
        print(f"  the provider made {len(provider.charges)} charge(s) in this run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("ITEMJOURNAL_LOCATION") or os.path.abspath("demo-journal")
    parser.add_argument("--root", default=default)
    parser.add_argument("--fresh", action="store_true", help="start from an empty journal")
    options = parser.parse_args()
    anyio.run(run, os.path.abspath(options.root), options.fresh)


if __name__ == "__main__":
    main()
