"""A batch of refunds in an anyio task group, through itemjournal.run_each.

Twenty refunds go to a simulated payment provider, eight at a time. Three of them end
in an uncertain way (a 502 after the request was sent, a timeout, a dropped
connection): each of those records needs review, and no other refund is cancelled
because of them. Run it twice over the same directory: the rerun reuses every receipt
and refuses the three uncertain refunds, without calling the provider at all.

    python examples/task_group.py --root /tmp/refunds-journal --fresh
    python examples/task_group.py --root /tmp/refunds-journal

``--root`` defaults to ``$ITEMJOURNAL_LOCATION``, the variable the ``itemjournal``
command reads, or else ``./task-group-journal``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass

import anyio
import anyio.to_thread

from itemjournal import Claim, EachReport, Journal, run_each


@dataclass(frozen=True)
class Refund:
    id: str
    amount_cents: int


REFUNDS = [Refund(f"refund-{n:02d}", 500 + 125 * n) for n in range(1, 21)]
LIMIT = 8


class ProviderError(Exception):
    """The provider answered with an error; it may have acted before it did."""


class Provider:
    """A stand-in payment provider that honours idempotency keys, as real ones do."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled: list[str] = []  # refunds that saw a cancellation
        self.in_flight = 0
        self.most_in_flight = 0
        self.refunds: dict[str, str] = {}
        # The provider holds the first requests until LIMIT of them are in the air, so
        # the run shows the limit being reached however fast this machine claims items.
        self.full = anyio.Event()

    async def refund(self, refund: Refund, idempotency_key: str) -> str:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight == LIMIT:
            self.full.set()
        try:
            await self.full.wait()
            await anyio.sleep(0.01 * (int(refund.id[-2:]) % 5))
            receipt = self.refunds.setdefault(idempotency_key, f"re_{refund.id}")
            if refund.id == "refund-07":
                raise ProviderError("502 Bad Gateway after the request was sent")
            if refund.id == "refund-13":
                await anyio.sleep_forever()  # never answers
            if refund.id == "refund-18":
                raise ConnectionResetError("connection reset by peer")
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(refund.id)
            raise
        else:
            return receipt
        finally:
            self.in_flight -= 1


async def process(journal: Journal, provider: Provider) -> EachReport[Refund]:
    async def send(refund: Refund, claim: Claim) -> str:
        # claim.key is stable for the refund: the provider refunds at most once per key.
        with anyio.fail_after(2):
            return await provider.refund(refund, idempotency_key=claim.key)

    return await run_each(
        journal,
        REFUNDS,
        send,
        identity=lambda refund: ("demo-shop", "billing", "refund", refund.id),
        inputs=lambda refund: {"amount_cents": refund.amount_cents},
        definition="refund-v1",
        limit=LIMIT,
    )


async def run(root: str, fresh: bool) -> None:
    if fresh:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))
    provider = Provider()
    print(f"== {'first run' if fresh else 'rerun'}, journal at {root}")
    async with await Journal.open(root) as journal:
        report = await process(journal, provider)
    print(f"  {report.summary()}")
    for failure in report.failed:
        assert failure.view is not None
        print(f"  failed: {failure.item.id}  [{failure.view.status}: {failure.view.review_reason}]")
    for refusal in report.refused:
        print(f"  refused: {refusal.item.id}  [{refusal.code}]")
    # A timeout cancels its own refund; no refund is ever cancelled by another's failure.
    failed = {failure.item.id for failure in report.failed}
    siblings = [refund for refund in provider.cancelled if refund not in failed]
    print(
        f"  the provider was called {provider.calls} time(s), at most {provider.most_in_flight} "
        f"at once (limit {LIMIT}); {len(siblings)} refund(s) cancelled by another's failure"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("ITEMJOURNAL_LOCATION") or os.path.abspath("task-group-journal")
    parser.add_argument("--root", default=default)
    parser.add_argument("--fresh", action="store_true", help="start from an empty journal")
    options = parser.parse_args()
    anyio.run(run, os.path.abspath(options.root), options.fresh)


if __name__ == "__main__":
    main()
