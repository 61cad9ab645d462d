"""A worker loop that charges orders through itemjournal.

Three workers drain a queue of five orders against a payment provider that honours
idempotency keys (``Claim.key``). Run it over the same directory several times
(``make demo`` does, through ``demo.py``):

* the first run (``--fresh``): the provider never answers for order-3, so its outcome is
  unknown and the claim block marks it ``needs_review``; order-5 is charged by the provider
  and then the worker process is killed (SIGKILL) before it records the receipt, leaving
  order-5 ``started`` by a process that no longer exists;
* a rerun reuses every receipt, finds order-5's owner gone and refuses it
  (``REVIEW_REQUIRED``, "owner process gone"), refuses order-3, and asks the provider
  nothing, until they are settled: by reconciliation, which asks the provider what happened
  to each idempotency key (``what_happened`` below is the check), or by an operator
  (``itemjournal resolve``).

    python examples/worker_loop.py --root /tmp/demo-journal --fresh
    python examples/worker_loop.py --root /tmp/demo-journal
    PYTHONPATH=examples ITEMJOURNAL_LOCATION=/tmp/demo-journal \
        itemjournal reconcile --check worker_loop:what_happened \
        --check-arg ledger=/tmp/demo-journal.provider.jsonl --yes

``--root`` defaults to ``$ITEMJOURNAL_LOCATION``, the variable the ``itemjournal``
command reads, or else ``./demo-journal``. The provider keeps its charges in
``<root>.provider.jsonl``, one JSON line per charge, beside the journal.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

import itemjournal
from itemjournal import ConflictError, DidNotHappen, Happened, Journal, RecordView, Unknown

ORDERS = {
    "order-1": "12.00",
    "order-2": "7.50",
    "order-3": "99.90",
    "order-4": "3.20",
    "order-5": "45.00",
}
SLOW_ORDER = "order-3"  # on the first run the provider never answers for this one
KILLED_ORDER = "order-5"  # on the first run the worker dies after this charge
WORKERS = 3
DEFINITION = itemjournal.definition_digest("charge-v1")


def ledger_path(root: str) -> str:
    return root.rstrip(os.sep) + ".provider.jsonl"


def read_ledger(path: str) -> list[dict[str, str]]:
    """Every charge the provider has made, oldest first."""
    try:
        with open(path, encoding="utf-8") as file:
            return [json.loads(line) for line in file if line.strip()]
    except FileNotFoundError:
        return []


class Provider:
    """A stand-in payment provider that honours idempotency keys, as real ones do: the
    same key returns the same charge id and never charges twice, across processes."""

    def __init__(self, ledger: str, hang_on: str | None) -> None:
        self.ledger = ledger
        self.hang_on = hang_on
        self.asked = 0
        self.charged = 0

    def _lookup_sync(self, idempotency_key: str) -> dict[str, str] | None:
        for line in read_ledger(self.ledger):
            if line["idempotency_key"] == idempotency_key:
                return line
        return None

    async def lookup(self, idempotency_key: str) -> dict[str, str] | None:
        """What happened to this key: the charge made under it, or None (none was made)."""
        return await anyio.to_thread.run_sync(self._lookup_sync, idempotency_key)

    def _charge_sync(self, order: str, amount: str, idempotency_key: str) -> str:
        known = self._lookup_sync(idempotency_key)
        if known is not None:
            return known["charge"]
        charge = f"ch_{secrets.token_hex(6)}"
        entry = {
            "idempotency_key": idempotency_key,
            "charge": charge,
            "order": order,
            "amount": amount,
        }
        data = (json.dumps(entry) + "\n").encode()
        fd = os.open(self.ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.charged += 1
        return charge

    async def charge(self, order: str, amount: str, idempotency_key: str) -> str:
        self.asked += 1
        await anyio.sleep(0.01)
        if order == self.hang_on:
            await anyio.sleep_forever()
        return await anyio.to_thread.run_sync(self._charge_sync, order, amount, idempotency_key)


async def what_happened(view: RecordView, *, ledger: str) -> Happened | DidNotHappen | Unknown:
    """The reconciliation check: ask the provider what happened to the record's key.

    ``itemjournal reconcile --check worker_loop:what_happened --check-arg ledger=PATH``
    calls it for each record in review (this directory on ``PYTHONPATH``; ``ledger`` is
    the provider's ledger, beside the journal). ``DidNotHappen`` is safe here because
    the provider honours the idempotency key: should a lost charge still land, the retry
    under the same key gets that charge back and nothing is charged twice.
    """
    charge = await Provider(ledger, hang_on=None).lookup(view.key)
    if charge is None:
        return DidNotHappen(f"no charge under the key {view.key[:16]}... in its ledger")
    return Happened(
        charge["charge"],
        note=f"charge {charge['charge']} of {charge['amount']} for {charge['order']} in its ledger",
    )


def die_now(order: str, charge: str) -> None:
    print(
        f"  {order}: charged by the provider ({charge}); the worker process is killed "
        f"(SIGKILL) before it records the receipt",
        flush=True,
    )
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


async def process(
    journal: Journal, provider: Provider, order: str, amount: str, crash: anyio.Event | None
) -> str:
    identity = ("demo-shop", "billing", "charge", order)
    try:
        async with journal.claim(identity, {"amount": amount}, DEFINITION) as attempt:
            if attempt.reused:
                return f"reused receipt {attempt.receipt} (not charged again)"
            assert attempt.claim is not None
            with anyio.fail_after(0.5):
                receipt = await provider.charge(order, amount, attempt.claim.key)
            if crash is not None:
                await crash.wait()  # let every other order settle first
                die_now(order, receipt)
            await attempt.complete(receipt)
            return f"charged, receipt {receipt}"
    except TimeoutError:
        return "provider timed out: outcome unknown, marked needs_review"
    except ConflictError as error:
        return f"refused ({error.code}): {error.message}"


async def run(root: str, fresh: bool) -> None:
    ledger = ledger_path(root)
    if fresh:

        def clean() -> None:
            shutil.rmtree(root, ignore_errors=True)
            if os.path.exists(ledger):
                os.remove(ledger)

        await anyio.to_thread.run_sync(clean)
    first = fresh
    provider = Provider(ledger, hang_on=SLOW_ORDER if first else None)
    others_settled = anyio.Event()
    settled = 0
    label = "first run" if first else "rerun"
    print(f"== {label} (pid {os.getpid()}, {WORKERS} workers), journal at {root}", flush=True)
    async with await Journal.open(root) as journal:

        async def worker(queue: MemoryObjectReceiveStream[tuple[str, str]]) -> None:
            nonlocal settled
            async with queue:
                async for order, amount in queue:
                    crash = others_settled if first and order == KILLED_ORDER else None
                    outcome = await process(journal, provider, order, amount, crash)
                    view = await journal.inspect(("demo-shop", "billing", "charge", order))
                    reviewed = view.status == "needs_review" and view.review_reason
                    why = f", reason: {view.review_reason}" if reviewed else ""
                    print(f"  {order}: {outcome}  [{view.status}{why}]", flush=True)
                    settled += 1
                    if settled == len(ORDERS) - 1:
                        others_settled.set()

        send, receive = anyio.create_memory_object_stream[tuple[str, str]](len(ORDERS))
        async with anyio.create_task_group() as tg:
            for _ in range(WORKERS):
                tg.start_soon(worker, receive.clone())
            receive.close()
            async with send:
                for order, amount in ORDERS.items():
                    await send.send((order, amount))
        print(
            f"  the provider was asked {provider.asked} time(s) and made "
            f"{provider.charged} new charge(s) in this run",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("ITEMJOURNAL_LOCATION") or os.path.abspath("demo-journal")
    parser.add_argument("--root", default=default)
    parser.add_argument("--fresh", action="store_true", help="start from an empty journal")
    options = parser.parse_args()
    anyio.run(run, os.path.abspath(options.root), options.fresh)


if __name__ == "__main__":
    main()
