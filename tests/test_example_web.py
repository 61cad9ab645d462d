"""examples/web_handler.py: the FastAPI app runs in-process and serves as documented."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest

from itemjournal import Journal

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "web_handler.py"
ORDER = {"item": "book", "quantity": 2}


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("web_handler_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Run ``app``'s lifespan around the block, as a server does."""
    to_app, app_inbox = anyio.create_memory_object_stream[dict[str, Any]](4)
    app_outbox, from_app = anyio.create_memory_object_stream[dict[str, Any]](4)
    with to_app, app_inbox, app_outbox, from_app:
        async with anyio.create_task_group() as tg:
            scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
            tg.start_soon(app, scope, app_inbox.receive, app_outbox.send)
            await to_app.send({"type": "lifespan.startup"})
            assert (await from_app.receive())["type"] == "lifespan.startup.complete"
            yield
            await to_app.send({"type": "lifespan.shutdown"})
            assert (await from_app.receive())["type"] == "lifespan.shutdown.complete"


@pytest.mark.anyio
async def test_the_example_app_in_process(location: str) -> None:
    example = load_example()
    provider = example.Provider()
    app = example.create_app(location, provider)
    transport = httpx.ASGITransport(app=app)
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://orders.test") as client,
    ):
        alice = {"Idempotency-Key": '"order-1"', "X-User": "alice"}
        first = await client.post("/orders", json=ORDER, headers=alice)
        again = await client.post("/orders", json=ORDER, headers=alice)
        changed = await client.post("/orders", json={**ORDER, "quantity": 3}, headers=alice)
        bob = await client.post("/orders", json=ORDER, headers={**alice, "X-User": "bob"})
        missing = await client.post("/orders", json=ORDER)
        kite = {"item": "kite", "quantity": 1}
        unknown = await client.post("/orders", json=kite, headers={"Idempotency-Key": "k"})
        unknown_again = await client.post("/orders", json=kite, headers={"Idempotency-Key": "k"})
        health = await client.get("/health")
    assert first.status_code == 201
    assert first.json()["amount_cents"] == 2500
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert changed.status_code == 422
    assert bob.status_code == 201
    assert bob.json()["order"] != first.json()["order"]
    assert missing.status_code == 400
    assert missing.headers["content-type"] == "application/problem+json"
    assert unknown.status_code == unknown_again.status_code == 404
    assert unknown_again.headers["idempotent-replayed"] == "true"
    assert health.json() == {"status": "ok"}
    assert len(provider.charges) == 2  # alice once, bob once, each under its claim's key
    async with await Journal.open(location) as journal:
        counts = await journal.counts()
    assert counts["succeeded"] == sum(counts.values()) == 3


def test_the_example_explains_itself() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--root" in result.stdout
    assert "Idempotency-Key" in result.stdout


def test_the_example_serves_and_replays(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = tmp_path / "web-journal"
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--root", str(root), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, "the example exited"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the example did not start serving"
            time.sleep(0.1)
        headers = {"Idempotency-Key": '"order-1"', "X-User": "alice"}
        first = httpx.post(f"{base}/orders", json=ORDER, headers=headers)
        again = httpx.post(f"{base}/orders", json=ORDER, headers=headers)
    finally:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=30)
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert b"Traceback" not in output
    assert server.returncode == 0
