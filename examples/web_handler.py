"""A FastAPI order endpoint behind itemjournal's Idempotency-Key middleware.

    python examples/web_handler.py --root /tmp/web-journal --port 8000

then send the same request twice; the second answer is the first one, replayed:

    curl -i localhost:8000/orders -H 'Idempotency-Key: "order-1"' -H 'X-User: alice' \\
         -H 'Content-Type: application/json' -d '{"item": "book", "quantity": 2}'

The same key with another body is refused (422), a duplicate that arrives while the
first request still runs is told to retry (409, ``Retry-After``), and a request whose
charge failed is held for an operator (``itemjournal list --status needs_review``).
The ``X-User`` header stands in for authentication: the middleware's ``scope`` keeps
each user's keys apart. ``--root`` defaults to ``$ITEMJOURNAL_LOCATION``, the variable
the ``itemjournal`` command reads, or else ``./web-journal``.
"""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

from itemjournal.asgi import IdempotencyMiddleware, claim_of


class Order(BaseModel):
    item: str
    quantity: int


class Provider:
    """A stand-in payment provider that honours idempotency keys, as real ones do."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}

    async def charge(self, amount_cents: int, idempotency_key: str) -> str:
        if idempotency_key not in self.charges:
            self.charges[idempotency_key] = f"ch_{uuid.uuid4().hex[:12]}"
        return self.charges[idempotency_key]


PRICES = {"book": 1250, "pen": 199}


def user_of(scope: Any) -> str:
    """The caller's identity; a real application takes it from its authentication."""
    for name, value in scope["headers"]:
        if name == b"x-user":
            return str(value.decode("latin-1"))
    return "anonymous"


def create_app(location: str, provider: Provider | None = None) -> FastAPI:
    """The application: POST /orders needs an Idempotency-Key; GET /health does not."""
    charges = provider if provider is not None else Provider()
    app = FastAPI(title="orders")

    @app.post("/orders", status_code=201)
    async def create_order(order: Order, request: Request) -> dict[str, object]:
        if order.item not in PRICES:
            raise HTTPException(404, f"no such item: {order.item}")  # a 4xx completes
        claim = claim_of(request.scope)
        assert claim is not None  # the middleware requires a key on POST
        amount = PRICES[order.item] * order.quantity
        charge = await charges.charge(amount, idempotency_key=claim.key)
        return {"order": f"ord_{uuid.uuid4().hex[:12]}", "amount_cents": amount, "charge": charge}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(IdempotencyMiddleware, location=location, scope=user_of)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        default=os.environ.get("ITEMJOURNAL_LOCATION", os.path.abspath("web-journal")),
        help="the journal location: an absolute directory, sqlite:///absolute/path.db or "
        "postgresql://…",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    options = parser.parse_args()
    uvicorn.run(create_app(options.root), host=options.host, port=options.port)


if __name__ == "__main__":
    main()
