"""The names the Python blocks of README.md and docs/*.md assume: the application around
the journal (an order, a provider, a web app...), never itemjournal itself.

``tests/test_docs_blocks.py`` checks every block with ``mypy --strict`` and pyright as the
body of an ``async def`` (so a block may ``await`` and ``return`` at its top level), after
``import anyio``, ``import itemjournal``, ``from itemjournal import *`` and
``from docs_names import *``. A name a block uses without defining or importing it must be
one of those; add a stand-in here when a new block needs one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectReceiveStream
from fastapi import FastAPI, Request
from opentelemetry.sdk.trace import TracerProvider

from itemjournal import Identity, Journal, definition_digest
from itemjournal.testing import MemoryStore

__all__ = [
    "CHARGE",
    "Charge",
    "Order",
    "Orders",
    "Provider",
    "ProviderUnavailable",
    "Refund",
    "Request",
    "Response",
    "app",
    "identity",
    "inputs",
    "journal",
    "location",
    "log",
    "order",
    "provider",
    "refunds",
    "replay",
    "tracer_provider",
]


@dataclass(frozen=True)
class Order:
    id: str
    amount_cents: int


@dataclass(frozen=True)
class Refund:
    id: str
    amount_cents: int


@dataclass(frozen=True)
class Charge:
    id: str
    status: str
    pending: bool


class ProviderUnavailable(Exception):
    """The provider could not be asked."""


class Provider:
    """A payment provider that honours an idempotency key."""

    async def charge(self, order: Order, *, idempotency_key: str | None = None) -> Charge:
        raise NotImplementedError

    async def refund(self, refund_id: str, *, idempotency_key: str) -> str:
        raise NotImplementedError

    async def find_charge(self, *, idempotency_key: str) -> Charge | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Response:
    status: int
    body: str | None


def replay(receipt: str, result: str | None) -> Response:
    """The answer a handler gives again for a request that succeeded before."""
    return Response(200, result)


CHARGE = definition_digest("charge-v1")
identity = Identity("shop", "billing", "charge", "order-1")
inputs = {"amount_cents": 1250}
order = Order("order-1", 1250)
refunds = [Refund("refund-1", 500), Refund("refund-2", 990)]
provider = Provider()
journal = Journal(MemoryStore())
location = "/var/lib/shop/journal"
log = logging.getLogger("shop")
app = FastAPI()
tracer_provider = TracerProvider()
# A stream of orders to work through (the receiving end of an anyio memory object stream).
Orders = MemoryObjectReceiveStream[Order]
