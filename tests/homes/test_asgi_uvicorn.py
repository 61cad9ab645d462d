"""The Idempotency-Key middleware behind a real ``uvicorn --workers 4``.

400 concurrent requests over 100 keys (a quarter of the keys also get a request with a
changed body) reach four worker processes sharing one journal location; each handler
performs a counted effect, an O_APPEND line in a file. Each key's effect must happen
exactly once, every answer must be one the middleware documents, and every replay must
be byte-identical to the response of the request that ran.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from itemjournal import Journal

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

KEYS = 100
PER_KEY = 4
CHANGED_KEYS = 25  # keys 0..24 also get one request with another amount

APP = textwrap.dedent(
    '''
    """A payment endpoint whose effect is one appended line per charge."""

    import os
    import random
    import uuid

    import anyio
    import anyio.to_thread
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from itemjournal.asgi import IdempotencyMiddleware

    EFFECTS = os.environ["ITEMJOURNAL_TEST_EFFECTS"]


    def append(line: bytes) -> None:
        fd = os.open(EFFECTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


    async def charge(request: Request) -> Response:
        order = await request.json()
        await anyio.sleep(random.uniform(0.0, 0.05))  # time for duplicates to arrive
        line = f"{order['order']} {order['amount']} {os.getpid()}\\n".encode()
        await anyio.to_thread.run_sync(append, line)
        return JSONResponse(
            {"order": order["order"], "amount": order["amount"], "charge": uuid.uuid4().hex},
            status_code=201,
        )


    async def health(request: Request) -> Response:
        return PlainTextResponse(str(os.getpid()))


    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/charge", charge, methods=["POST"]), Route("/health", health)]),
        location=os.environ["ITEMJOURNAL_TEST_LOCATION"],
    )
    '''
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(params=["file", "sqlite"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(base URL, journal location, effects file) of a running uvicorn with 4 workers."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "payments_app.py").write_text(APP)
    effects = tmp_path / "effects.log"
    if request.param == "sqlite":
        location = f"sqlite://{tmp_path}/journal/journal.db"
    else:
        location = str(tmp_path / "journal")
    # The location exists before the workers start, as in a deployment: four processes
    # creating one new SQLite database at the same instant is the store's own concern.
    anyio.run(_create, location)
    port = free_port()
    env = {
        **os.environ,
        "ITEMJOURNAL_TEST_EFFECTS": str(effects),
        "ITEMJOURNAL_TEST_LOCATION": location,
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "payments_app:app",
            "--app-dir",
            str(tmp_path / "app"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "4",
            "--log-level",
            "warning",
        ],
        env=env,
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
        yield base, location, effects
    finally:
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        text = output.decode(errors="replace") if output else ""
        assert "Traceback" not in text, text


async def _create(location: str) -> None:
    journal = await Journal.open(location)
    await journal.aclose()


def body(order: int, amount: int) -> bytes:
    return json.dumps({"order": order, "amount": amount}).encode()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_four_workers_run_each_key_once_and_replay_it_exactly(
    server: tuple[str, str, Path],
) -> None:
    base, location, effects = server
    rng = random.Random(11)
    requests: list[tuple[int, bytes]] = []
    for order in range(KEYS):
        bodies = [body(order, 100 + order)] * PER_KEY
        if order < CHANGED_KEYS:
            bodies[rng.randrange(PER_KEY)] = body(order, 999)
        requests.extend((order, each) for each in bodies)
    rng.shuffle(requests)
    answers: list[tuple[int, bytes, httpx.Response]] = []
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=100)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:

        async def send(order: int, content: bytes) -> None:
            headers = {
                "Idempotency-Key": f'"order-{order}"',
                "Content-Type": "application/json",
            }
            answers.append(
                (order, content, await client.post("/charge", content=content, headers=headers))
            )

        async with anyio.create_task_group() as tg:
            for order, content in requests:
                tg.start_soon(send, order, content)
        first_round = time.monotonic() - started

        # Each key's effect happened exactly once.
        lines = effects.read_text().splitlines()
        done = Counter(int(line.split()[0]) for line in lines)
        assert done == Counter(range(KEYS)), "every key's effect exactly once"
        ran_body = {
            int(order): body(int(order), int(amount)) for order, amount, _ in map(str.split, lines)
        }
        workers = {line.split()[2] for line in lines}

        kinds: Counter[str] = Counter()
        fresh: dict[int, bytes] = {}
        replays: dict[int, list[bytes]] = defaultdict(list)
        for order, content, response in answers:
            if response.status_code == 201 and "idempotent-replayed" not in response.headers:
                kinds["201 first"] += 1
                assert order not in fresh, "one fresh response per key"
                assert content == ran_body[order]
                fresh[order] = response.content
            elif response.status_code == 201:
                kinds["201 replayed"] += 1
                assert response.headers["idempotent-replayed"] == "true"
                assert content == ran_body[order]
                replays[order].append(response.content)
            elif response.status_code == 409:
                kinds["409 in flight"] += 1
                assert response.headers["content-type"] == "application/problem+json"
                assert response.json()["code"] == "IN_PROGRESS"
                assert response.headers["retry-after"] == "1"
            elif response.status_code == 422:
                kinds["422 changed body"] += 1
                assert response.headers["content-type"] == "application/problem+json"
                assert response.json()["code"] == "INPUT_CHANGED"
                assert content != ran_body[order]
            else:
                pytest.fail(f"undocumented answer {response.status_code}: {response.text}")
        assert sorted(fresh) == list(range(KEYS))
        for order, bodies in replays.items():
            assert all(each == fresh[order] for each in bodies), "replays are byte-identical"

        # Once everything settled, every original request is a replay or a 422.
        again = Counter()
        for order in range(KEYS):
            response = await client.post(
                "/charge",
                content=body(order, 100 + order),
                headers={"Idempotency-Key": f"order-{order}", "Content-Type": "application/json"},
            )
            if response.status_code == 201:
                assert response.headers["idempotent-replayed"] == "true"
                assert response.content == fresh[order]
                again["201 replayed"] += 1
            else:
                assert response.status_code == 422
                assert ran_body[order] == body(order, 999)
                again["422 changed body"] += 1
    assert len(effects.read_text().splitlines()) == KEYS
    async with await Journal.open(location) as journal:
        counts = await journal.counts()
    assert counts["succeeded"] == sum(counts.values()) == KEYS
    store = "sqlite" if location.startswith("sqlite:") else "file"
    print(
        f"{len(requests)} concurrent requests over {KEYS} keys, {store} store: "
        f"{sum(done.values())} effects from {len(workers)} workers in {first_round:.1f} s; "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        + "; then "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(again.items()))
    )
