"""The middleware's storage policy behind a real uvicorn process.

A 429 and a 401 release the key (the retry runs the handler again), a 402 is kept and
replayed, a 5xx needs review; a reconciliation that settles the 5xx with
``Happened(result=replayable_response(...))`` makes every later retry a byte-identical
replay of that response.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from itemjournal import Happened, Journal, RecordView
from itemjournal.asgi import replayable_response

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

APP = textwrap.dedent(
    '''
    """Endpoints that answer what each test needs, counting the calls of each."""

    import os
    from collections import Counter

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from itemjournal.asgi import IdempotencyMiddleware

    CALLS: Counter[str] = Counter()
    FIRST = {"limited": 429, "login": 401, "declined": 402, "broken": 503}


    async def endpoint(request: Request) -> Response:
        name = request.path_params["name"]
        CALLS[name] += 1
        status = FIRST[name] if CALLS[name] == 1 or name == "declined" else 201
        return JSONResponse({"endpoint": name, "call": CALLS[name]}, status_code=status)


    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")


    app = IdempotencyMiddleware(
        Starlette(
            routes=[
                Route("/pay/{name}", endpoint, methods=["POST"]),
                Route("/health", health),
            ]
        ),
        location=os.environ["ITEMJOURNAL_TEST_LOCATION"],
    )
    '''
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _create(location: str) -> None:
    journal = await Journal.open(location)
    await journal.aclose()


@pytest.fixture(params=["file", "sqlite"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(base URL, journal location) of a running uvicorn."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "policy_app.py").write_text(APP)
    if request.param == "sqlite":
        location = f"sqlite://{tmp_path}/journal/journal.db"
    else:
        location = str(tmp_path / "journal")
    anyio.run(_create, location)
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "policy_app:app",
            "--app-dir",
            str(tmp_path / "app"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env={**os.environ, "ITEMJOURNAL_TEST_LOCATION": location},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.1)
        yield base, location
    finally:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        text = output.decode(errors="replace") if output else ""
        assert "Traceback" not in text, text


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{value}"', "Content-Type": "application/json"}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_policy_through_a_real_server(server: tuple[str, str]) -> None:
    base, location = server
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:

        async def post(name: str, value: str) -> httpx.Response:
            return await client.post(f"/pay/{name}", content=b"{}", headers=key(value))

        # 429 and 401: the key is released, the retry runs the handler again.
        for name, status in (("limited", 429), ("login", 401)):
            refused = await post(name, name)
            assert refused.status_code == status
            assert refused.json() == {"endpoint": name, "call": 1}
            retried = await post(name, name)
            assert retried.status_code == 201
            assert "idempotent-replayed" not in retried.headers
            assert retried.json() == {"endpoint": name, "call": 2}
            replayed = await post(name, name)
            assert replayed.headers["idempotent-replayed"] == "true"
            assert replayed.content == retried.content

        # 402: final, kept and replayed; the handler runs once.
        declined = await post("declined", "declined")
        assert declined.status_code == 402
        again = await post("declined", "declined")
        assert again.status_code == 402
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == declined.content == b'{"endpoint":"declined","call":1}'

        # 5xx: needs review; the same key is refused until it is settled.
        broken = await post("broken", "broken")
        assert broken.status_code == 503
        held = await post("broken", "broken")
        assert held.status_code == 409
        assert held.json()["code"] == "REVIEW_REQUIRED"

        # A reconciliation finds the effect happened and hands over the response to give.
        body = b'{"endpoint":"broken","charge":"ch_reconciled"}'
        built = replayable_response(
            201, body, content_type="application/json", headers={"Location": "/charges/1"}
        )

        async def check(view: RecordView) -> Happened:
            return Happened("ch_reconciled", result=built)

        async with await Journal.open(location) as journal:
            report = await journal.reconcile(check)
            assert len(report.happened) == 1
            counts = await journal.counts()
        retries = [await post("broken", "broken") for _ in range(3)]
        for retry in retries:
            assert retry.status_code == 201
            assert retry.content == body
            assert retry.headers["content-type"] == "application/json"
            assert retry.headers["location"] == "/charges/1"
            assert retry.headers["idempotent-replayed"] == "true"

        def headers(response: httpx.Response) -> list[tuple[str, str]]:
            return [(n, v) for n, v in response.headers.multi_items() if n != "date"]

        assert all(headers(retry) == headers(retries[0]) for retry in retries)
    # Every record ended succeeded: the 429 and 401 keys after their released first
    # attempt, the 402 at once, the 503 by the reconciliation.
    assert counts["succeeded"] == sum(counts.values()) == 4
    store = "sqlite" if location.startswith("sqlite:") else "file"
    print(
        f"uvicorn, {store} store: 429 and 401 released and run again, 402 replayed, "
        f"503 needs review, then replayed {len(retries)} times from the reconciled response"
    )
