"""The WSGI Idempotency-Key middleware behind a real gunicorn: two sync workers, or two
threaded workers (``--threads 4``), with and without ``--preload``.

As for the ASGI middleware behind uvicorn (test_asgi_uvicorn.py, test_asgi_policy_uvicorn.py):
400 concurrent requests over 100 keys (a quarter of the keys also get a request with a
changed body) share one journal location; each handler performs a counted effect, a line
appended to a ledger. Each key's effect happens exactly once, every answer is one the
middleware documents, every replay is byte-identical to the response of the request that
ran; the ``release=`` policy holds through the server. Then a worker is SIGKILLed while
requests are in flight: no key's effect happens twice, and a key whose worker died between
its effect and its record is in review, never run again.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import httpx
import pytest

from itemjournal import Happened, RecordView, sync
from itemjournal.wsgi import replayable_response

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
T = TypeVar("T")

KEYS = 100
PER_KEY = 4
CHANGED_KEYS = 25  # keys 0..24 also get one request with another amount

APP = textwrap.dedent(
    '''
    """A payment endpoint whose effect is one line appended to a ledger."""

    import json
    import os
    import random
    import time
    import uuid

    from itemjournal.wsgi import IdempotencyMiddleware

    LEDGER = os.environ["ITEMJOURNAL_TEST_LEDGER"]
    CALLS = os.environ["ITEMJOURNAL_TEST_CALLS"]
    BEFORE, AFTER = (float(s) for s in os.environ["ITEMJOURNAL_TEST_SECONDS"].split(","))
    FIRST = {"limited": 429, "login": 401, "declined": 402, "broken": 503}


    def append(path, line):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


    def reply(start_response, status, payload, content_type="application/json"):
        body = payload.encode()
        start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]


    def charge(environ, start_response):
        order = json.loads(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))
        time.sleep(random.uniform(0.0, BEFORE))  # time for duplicates to arrive
        append(LEDGER, f"{order['order']} {order['amount']} {os.getpid()}\\n")
        time.sleep(random.uniform(0.0, AFTER))  # the effect is done, the record not yet
        payload = {"order": order["order"], "amount": order["amount"], "charge": uuid.uuid4().hex}
        return reply(start_response, "201 Created", json.dumps(payload))


    def pay(environ, start_response, name):
        append(CALLS, name + "\\n")
        with open(CALLS) as calls:
            call = sum(1 for line in calls if line.strip() == name)
        status = FIRST[name] if call == 1 or name == "declined" else 201
        payload = json.dumps({"endpoint": name, "call": call}, separators=(",", ":"))
        return reply(start_response, f"{status} Whatever", payload)


    def application(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/health":
            return reply(start_response, "200 OK", str(os.getpid()), "text/plain")
        if path.startswith("/pay/"):
            return pay(environ, start_response, path.removeprefix("/pay/"))
        return charge(environ, start_response)


    app = IdempotencyMiddleware(application, location=os.environ["ITEMJOURNAL_TEST_LOCATION"])
    if os.environ.get("ITEMJOURNAL_TEST_OPEN_AT_IMPORT"):
        app.open()  # with --preload: a journal opened in the arbiter, before the fork
    '''
)

CONFIGS = {
    "sync": ["--workers", "2"],
    "sync-preload": ["--workers", "2", "--preload"],
    "threads": ["--workers", "2", "--threads", "4"],
    "threads-preload": ["--workers", "2", "--threads", "4", "--preload"],
}


@dataclass
class Server:
    base: str
    location: str
    ledger: Path
    process: subprocess.Popen[bytes]
    config: str


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def start(tmp_path: Path, config: str, store: str, seconds: str) -> Iterator[Server]:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "payments_wsgi.py").write_text(APP)
    ledger = tmp_path / "ledger.log"
    if store == "sqlite":
        location = f"sqlite://{tmp_path}/journal/journal.db"
    else:
        location = str(tmp_path / "journal")
    # The location exists before the workers start, as in a deployment. Made in a thread
    # of its own: an async test starts servers too, and never blocks its event loop.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: sync.Journal.open(location).close()).result()
    port = free_port()
    env = {
        **os.environ,
        "ITEMJOURNAL_TEST_LEDGER": str(ledger),
        "ITEMJOURNAL_TEST_CALLS": str(tmp_path / "calls.log"),
        "ITEMJOURNAL_TEST_LOCATION": location,
        "ITEMJOURNAL_TEST_SECONDS": seconds,
    }
    if config.endswith("preload"):
        env["ITEMJOURNAL_TEST_OPEN_AT_IMPORT"] = "1"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--chdir",
            str(tmp_path / "app"),
            "--bind",
            f"127.0.0.1:{port}",
            *CONFIGS[config],
            "--graceful-timeout",
            "10",
            "--log-level",
            "warning",
            "payments_wsgi:app",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
        yield Server(base, location, ledger, process, config)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        text = output.decode(errors="replace") if output else ""
        assert "Traceback" not in text, text


@pytest.fixture(params=[(config, store) for config in CONFIGS for store in ("file", "sqlite")])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    config, store = request.param
    with start(tmp_path, config, store, "0.05,0") as started:
        yield started


def body(order: int, amount: int) -> bytes:
    return json.dumps({"order": order, "amount": amount}).encode()


def headers_for(order: int) -> dict[str, str]:
    return {"Idempotency-Key": f'"order-{order}"', "Content-Type": "application/json"}


def requests_for(seed: int) -> list[tuple[int, bytes]]:
    rng = random.Random(seed)
    requests: list[tuple[int, bytes]] = []
    for order in range(KEYS):
        bodies = [body(order, 100 + order)] * PER_KEY
        if order < CHANGED_KEYS:
            bodies[rng.randrange(PER_KEY)] = body(order, 999)
        requests.extend((order, each) for each in bodies)
    rng.shuffle(requests)
    return requests


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_two_workers_run_each_key_once_and_replay_it_exactly(server: Server) -> None:
    requests = requests_for(11)
    answers: list[tuple[int, bytes, httpx.Response]] = []
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=100)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=60) as client:

        async def send(order: int, content: bytes) -> None:
            response = await client.post("/charge", content=content, headers=headers_for(order))
            answers.append((order, content, response))

        async with anyio.create_task_group() as tg:
            for order, content in requests:
                tg.start_soon(send, order, content)
        first_round = time.monotonic() - started

        lines = server.ledger.read_text().splitlines()
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

        again: Counter[str] = Counter()
        for order in range(KEYS):
            response = await client.post(
                "/charge", content=body(order, 100 + order), headers=headers_for(order)
            )
            if response.status_code == 201:
                assert response.headers["idempotent-replayed"] == "true"
                assert response.content == fresh[order]
                again["201 replayed"] += 1
            else:
                assert response.status_code == 422
                assert ran_body[order] == body(order, 999)
                again["422 changed body"] += 1
    assert len(server.ledger.read_text().splitlines()) == KEYS
    counts = await in_thread(lambda journal: journal.counts(), server.location)
    assert counts["succeeded"] == sum(counts.values()) == KEYS
    print(
        f"gunicorn {server.config}, {store_of(server)} store: "
        f"{len(requests)} concurrent requests over {KEYS} keys, {sum(done.values())} effects "
        f"from {len(workers)} workers in {first_round:.1f} s; "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        + "; then "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(again.items()))
    )


async def in_thread(call: Callable[[sync.Journal], T], location: str) -> T:
    """``call`` on a blocking journal at ``location``, in a worker thread (never on the
    event loop)."""

    def run() -> T:
        with sync.Journal.open(location) as journal:
            return call(journal)

    return await anyio.to_thread.run_sync(run)


def ledger_lines(server: Server) -> list[str]:
    """The ledger's lines so far (none before the first effect made the file)."""
    try:
        return server.ledger.read_text().splitlines()
    except FileNotFoundError:
        return []


def store_of(server: Server) -> str:
    return "sqlite" if server.location.startswith("sqlite:") else "file"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("config", "store"), [("sync-preload", "file"), ("threads", "sqlite")])
async def test_a_worker_killed_mid_run_never_runs_a_key_twice(
    tmp_path: Path, config: str, store: str
) -> None:
    with start(tmp_path, config, store, "0.1,0.2") as server:
        await _kill_mid_run(server)


async def _kill_mid_run(server: Server) -> None:
    requests = requests_for(7)
    answers: list[tuple[int, bytes, httpx.Response | None]] = []
    killed: list[int] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=60) as client:

        async def send(order: int, content: bytes) -> None:
            try:
                response = await client.post("/charge", content=content, headers=headers_for(order))
            except httpx.TransportError:  # the worker that had the request was killed
                answers.append((order, content, None))
                return
            answers.append((order, content, response))

        async def kill() -> None:
            # The ledger is another process's file: polled, there is nothing to wait on.
            while len(lines := ledger_lines(server)) < KEYS // 3:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            # The worker that made the latest effect: it is between that effect and its
            # record, or already in its next request.
            pid = int(lines[-1].split()[2])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill)
            for order, content in requests:
                tg.start_soon(send, order, content)

        kinds: Counter[str] = Counter()
        fresh: dict[int, bytes] = {}
        for order, _content, response in answers:
            if response is None:
                kinds["lost with the worker"] += 1
            elif response.status_code == 201:
                replayed = "idempotent-replayed" in response.headers
                kinds["201 replayed" if replayed else "201 first"] += 1
                if not replayed:
                    assert order not in fresh
                    fresh[order] = response.content
            elif response.status_code in (409, 422):
                code = response.json()["code"]
                assert code in ("IN_PROGRESS", "REVIEW_REQUIRED", "INPUT_CHANGED")
                kinds[f"{response.status_code} {code}"] += 1
            else:
                pytest.fail(f"undocumented answer {response.status_code}: {response.text}")

        # Every key once more, in turn, after the run: a replay, a changed body, or the
        # record the killed worker left, in review.
        again: Counter[str] = Counter()
        for order in range(KEYS):
            response = await client.post(
                "/charge", content=body(order, 100 + order), headers=headers_for(order)
            )
            if response.status_code == 201:
                replayed = "idempotent-replayed" in response.headers
                again["201 replayed" if replayed else "201 first"] += 1
                if replayed and order in fresh:
                    assert response.content == fresh[order]
            elif response.status_code == 409:
                document = response.json()
                assert document["code"] == "REVIEW_REQUIRED"
                assert "owner process" in document["review_reason"]
                again["409 REVIEW_REQUIRED"] += 1
            else:
                assert response.status_code == 422
                again["422 INPUT_CHANGED"] += 1
    effects = Counter(int(line.split()[0]) for line in server.ledger.read_text().splitlines())
    assert max(effects.values()) == 1, "no key's effect twice"
    # A key whose record the killed worker left started, asked again with a changed body,
    # was answered 422 (inputs are checked before status) and is still started: the sweep
    # an operator runs after a crash sends it to review, as begin does for the others.
    await in_thread(lambda journal: journal.sweep(), server.location)
    views = await in_thread(lambda journal: list(journal.records()), server.location)
    statuses = Counter(view.status for view in views)
    assert statuses["succeeded"] + statuses["needs_review"] == len(views) == KEYS
    # The worker killed made the latest effect: it was between that effect and its record
    # (then that key is in review) or already in its next request (then none is).
    for view in views:
        if view.status == "succeeded":
            assert view.receipt is not None and view.receipt.startswith("http 201")
    print(
        f"gunicorn {server.config}, {store_of(server)} store, "
        f"worker {killed[0]} SIGKILLed after {KEYS // 3} effects: "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        + "; then "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(again.items()))
        + f"; {sum(effects.values())} effects for {len(effects)} keys, none twice; records: "
        + ", ".join(f"{count} {status}" for status, count in sorted(statuses.items()))
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_policy_through_a_real_server(tmp_path: Path) -> None:
    with start(tmp_path, "threads-preload", "sqlite", "0,0") as server:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:

            async def post(name: str) -> httpx.Response:
                headers = {"Idempotency-Key": f'"{name}"', "Content-Type": "application/json"}
                return await client.post(f"/pay/{name}", content=b"{}", headers=headers)

            for name, status in (("limited", 429), ("login", 401)):
                refused = await post(name)
                assert refused.status_code == status
                assert refused.json() == {"endpoint": name, "call": 1}
                retried = await post(name)
                assert retried.status_code == 201
                assert "idempotent-replayed" not in retried.headers
                assert retried.json() == {"endpoint": name, "call": 2}
                replayed = await post(name)
                assert replayed.headers["idempotent-replayed"] == "true"
                assert replayed.content == retried.content

            declined = await post("declined")
            again = await post("declined")
            assert declined.status_code == again.status_code == 402
            assert again.headers["idempotent-replayed"] == "true"
            assert again.content == declined.content == b'{"endpoint":"declined","call":1}'

            assert (await post("broken")).status_code == 503
            held = await post("broken")
            assert (held.status_code, held.json()["code"]) == (409, "REVIEW_REQUIRED")

            body = b'{"endpoint":"broken","charge":"ch_reconciled"}'
            built = replayable_response(
                201, body, content_type="application/json", headers={"Location": "/charges/1"}
            )

            def check(view: RecordView) -> Happened:
                return Happened("ch_reconciled", result=built)

            report = await in_thread(lambda journal: journal.reconcile(check), server.location)
            assert len(report.happened) == 1
            counts = await in_thread(lambda journal: journal.counts(), server.location)
            retries = [await post("broken") for _ in range(3)]
            for retry in retries:
                assert (retry.status_code, retry.content) == (201, body)
                assert retry.headers["location"] == "/charges/1"
                assert retry.headers["idempotent-replayed"] == "true"

            def headers(response: httpx.Response) -> list[tuple[str, str]]:
                return [(n, v) for n, v in response.headers.multi_items() if n != "date"]

            assert all(headers(retry) == headers(retries[0]) for retry in retries)
        assert counts["succeeded"] == sum(counts.values()) == 4
