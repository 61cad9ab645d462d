"""The Idempotency-Key middleware, through an in-process ASGI client, on every store."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from itemjournal import Journal
from itemjournal.asgi import (
    DEFINITION,
    MAX_KEY_CHARS,
    IdempotencyMiddleware,
    MalformedKey,
    claim_of,
    parse_key,
)

pytestmark = pytest.mark.anyio

PROBLEM = "application/problem+json"


class Shop:
    """A small application whose handlers count the effects they perform."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.entered = anyio.Event()
        self.release = anyio.Event()
        routes = [
            Route("/orders", self.create, methods=["POST", "PATCH", "GET"]),
            Route("/slow", self.slow, methods=["POST"]),
            Route("/boom", self.boom, methods=["POST"]),
            Route("/unavailable", self.unavailable, methods=["POST"]),
            Route("/big", self.big, methods=["POST"]),
            Route("/binary", self.binary, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def create(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"orders": len(self.effects)})
        body = await request.body()
        self.effects.append(body.decode())
        response = JSONResponse(
            {
                "order": len(self.effects),
                "echo": body.decode(),
                "user": request.headers.get("x-user"),
            },
            status_code=201,
            headers={"location": f"/orders/{len(self.effects)}", "x-trace": "first"},
        )
        response.set_cookie("session", "secret")
        return response

    async def slow(self, request: Request) -> Response:
        self.entered.set()
        await self.release.wait()
        self.effects.append("slow")
        return PlainTextResponse(f"slow done {len(self.effects)}")

    async def boom(self, request: Request) -> Response:
        self.effects.append("boom")
        raise RuntimeError("provider timed out")

    async def unavailable(self, request: Request) -> Response:
        self.effects.append("unavailable")
        return PlainTextResponse("upstream down", status_code=503)

    async def big(self, request: Request) -> Response:
        self.effects.append("big")
        return PlainTextResponse("x" * 70_000 + str(len(self.effects)))

    async def binary(self, request: Request) -> Response:
        self.effects.append("binary")
        return Response(bytes(range(256)) * 4 + bytes([len(self.effects)]), media_type="image/png")


Client = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture
async def shop() -> Shop:
    return Shop()


def client_for(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://shop.test")


@pytest.fixture
async def client(shop: Shop, journal: Journal) -> AsyncIterator[httpx.AsyncClient]:
    app = IdempotencyMiddleware(shop.app, journal=journal)
    async with client_for(app) as http:
        yield http


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{value}"'}


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    document = response.json()
    assert set(document) >= {"type", "title", "status", "detail"}
    assert document["status"] == status
    return dict(document)


# ---------------------------------------------------------------------------- the key


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ('"abc"', "abc"),
        ('  "abc"  ', "abc"),
        ('"a \\"quoted\\" \\\\ key"', 'a "quoted" \\ key'),
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("token:with/slash", "token:with/slash"),
        ('"' + "k" * MAX_KEY_CHARS + '"', "k" * MAX_KEY_CHARS),
    ],
)
def test_parse_key_accepts_strings_and_tokens(header: str, expected: str) -> None:
    assert parse_key(header) == expected
    assert parse_key(header.encode()) == expected


@pytest.mark.parametrize(
    "header",
    [
        '"unclosed',
        '"bad \\n escape"',
        '"abc";param=1',
        '"abc" "def"',
        '""',
        "",
        "two words",
        '"tab\tinside"',
        '"' + "k" * (MAX_KEY_CHARS + 1) + '"',
        "k" * (MAX_KEY_CHARS + 1),
    ],
)
def test_parse_key_refuses_malformed_values(header: str) -> None:
    with pytest.raises(MalformedKey):
        parse_key(header)
    with pytest.raises(MalformedKey):
        parse_key('"caf\u00e9"'.encode())


async def test_missing_key_is_400(client: httpx.AsyncClient, shop: Shop) -> None:
    response = await client.post("/orders", content=b"{}")
    document = problem(response, 400)
    assert "Idempotency-Key" in document["detail"]
    assert shop.effects == []


@pytest.mark.parametrize(
    "value", ['"unclosed', '"bad \\x escape"', "two words", '""', '"' + "k" * 256 + '"']
)
async def test_malformed_or_too_long_key_is_400(
    client: httpx.AsyncClient, shop: Shop, value: str
) -> None:
    response = await client.post("/orders", content=b"{}", headers={"Idempotency-Key": value})
    assert problem(response, 400)["title"] == "Idempotency-Key malformed"
    assert shop.effects == []


async def test_two_keys_in_one_request_are_400(client: httpx.AsyncClient, shop: Shop) -> None:
    headers = [("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')]
    response = await client.post("/orders", content=b"{}", headers=headers)
    problem(response, 400)
    assert shop.effects == []


# ---------------------------------------------------------------------------- replay


async def test_first_request_runs_once_and_duplicates_replay_it_byte_for_byte(
    client: httpx.AsyncClient, shop: Shop, journal: Journal
) -> None:
    first = await client.post("/orders", content=b'{"sku": 7}', headers=key("k-1"))
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert "set-cookie" in first.headers
    for _ in range(3):
        again = await client.post("/orders", content=b'{"sku": 7}', headers=key("k-1"))
        assert again.status_code == 201
        assert again.content == first.content
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["content-type"] == first.headers["content-type"]
        assert again.headers["location"] == first.headers["location"]
        assert again.headers["content-length"] == str(len(first.content))
        assert "set-cookie" not in again.headers  # never stored, never replayed
        assert "x-trace" not in again.headers  # not in the allow-list
    assert shop.effects == ['{"sku": 7}']
    # The bare-token form of the same key is the same key.
    token = await client.post("/orders", content=b'{"sku": 7}', headers={"Idempotency-Key": "k-1"})
    assert token.content == first.content
    assert token.headers["idempotent-replayed"] == "true"
    records = [view async for view in journal.records()]
    assert len(records) == 1
    (view,) = records
    assert view.status == "succeeded"
    assert view.identity[1:3] == ("http", "idempotency-key")
    assert "k-1" not in json.dumps(list(view.identity))  # the raw key is never a label
    assert view.receipt is not None
    assert view.receipt.startswith("http 201 sha256:")


async def test_binary_response_is_replayed_byte_for_byte(
    client: httpx.AsyncClient, shop: Shop
) -> None:
    first = await client.post("/binary", content=b"", headers=key("bin"))
    again = await client.post("/binary", content=b"", headers=key("bin"))
    assert first.status_code == again.status_code == 200
    assert again.content == first.content
    assert again.headers["content-type"] == "image/png"
    assert again.headers["idempotent-replayed"] == "true"
    assert shop.effects == ["binary"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/orders", b'{"sku": 8}'),
        ("POST", "/orders?coupon=1", b'{"sku": 7}'),
        ("PATCH", "/orders", b'{"sku": 7}'),
    ],
)
async def test_same_key_for_another_request_is_422(
    client: httpx.AsyncClient, shop: Shop, method: str, path: str, body: bytes
) -> None:
    await client.post("/orders", content=b'{"sku": 7}', headers=key("k-2"))
    response = await client.request(method, path, content=body, headers=key("k-2"))
    assert problem(response, 422)["code"] == "INPUT_CHANGED"
    assert shop.effects == ['{"sku": 7}']


async def test_a_duplicate_in_flight_is_409_with_retry_after(
    client: httpx.AsyncClient, shop: Shop
) -> None:
    answers: list[httpx.Response] = []

    async def first() -> None:
        answers.append(await client.post("/slow", content=b"x", headers=key("slow")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await shop.entered.wait()
        duplicate = await client.post("/slow", content=b"x", headers=key("slow"))
        assert problem(duplicate, 409)["code"] == "IN_PROGRESS"
        assert duplicate.headers["retry-after"] == "1"
        shop.release.set()
    assert answers[0].status_code == 200
    assert answers[0].text == "slow done 1"
    assert shop.effects == ["slow"]


async def test_wait_lets_a_duplicate_get_the_replay(shop: Shop, journal: Journal) -> None:
    app = IdempotencyMiddleware(shop.app, journal=journal, wait=10)
    answers: list[httpx.Response] = []
    async with client_for(app) as client:

        async def first() -> None:
            answers.append(await client.post("/slow", content=b"x", headers=key("w")))

        async def duplicate() -> None:
            answers.append(await client.post("/slow", content=b"x", headers=key("w")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await shop.entered.wait()
            tg.start_soon(duplicate)
            await anyio.sleep(0.05)
            shop.release.set()
    fresh, replayed = answers
    assert "idempotent-replayed" not in fresh.headers
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == fresh.content == b"slow done 1"
    assert shop.effects == ["slow"]


# ---------------------------------------------------------------------------- uncertain outcomes


async def test_a_raising_handler_is_500_then_needs_review(
    client: httpx.AsyncClient, shop: Shop, journal: Journal
) -> None:
    first = await client.post("/boom", content=b"", headers=key("boom"))
    assert first.status_code == 500
    again = await client.post("/boom", content=b"", headers=key("boom"))
    document = problem(again, 409)
    assert document["code"] == "REVIEW_REQUIRED"
    assert "RuntimeError: provider timed out" in document["review_reason"]
    assert "provider timed out" in document["detail"]
    assert shop.effects == ["boom"]
    (view,) = [view async for view in journal.records()]
    assert view.status == "needs_review"


async def test_a_bare_asgi_app_that_raises_gets_a_problem_500(journal: Journal) -> None:
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        raise ValueError("card declined, maybe")

    async with client_for(IdempotencyMiddleware(app, journal=journal)) as client:
        first = await client.post("/pay", content=b"1", headers=key("p"))
        assert problem(first, 500)["title"] == "Internal Server Error"
        again = await client.post("/pay", content=b"1", headers=key("p"))
    assert "ValueError: card declined, maybe" in problem(again, 409)["review_reason"]
    assert calls == ["/pay"]


async def test_the_exception_goes_on_to_the_server(journal: Journal) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("for the server's log")

    middleware = IdempotencyMiddleware(app, journal=journal)
    transport = httpx.ASGITransport(app=middleware)  # raises the application's exceptions
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        with pytest.raises(ValueError, match="for the server's log"):
            await client.post("/pay", content=b"1", headers=key("p"))


async def test_a_5xx_response_needs_review(client: httpx.AsyncClient, shop: Shop) -> None:
    first = await client.post("/unavailable", content=b"", headers=key("u"))
    assert first.status_code == 503
    assert first.text == "upstream down"
    again = await client.post("/unavailable", content=b"", headers=key("u"))
    assert "answered 503" in problem(again, 409)["review_reason"]
    assert shop.effects == ["unavailable"]


async def test_an_app_that_sends_nothing_needs_review(journal: Journal) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    async with client_for(IdempotencyMiddleware(app, journal=journal)) as client:
        problem(await client.post("/x", content=b"", headers=key("n")), 500)
        again = await client.post("/x", content=b"", headers=key("n"))
    assert problem(again, 409)["review_reason"] == "the application sent no response"


async def test_a_response_over_the_limit_passes_once_then_says_it_cannot_replay(
    client: httpx.AsyncClient, shop: Shop, journal: Journal
) -> None:
    first = await client.post("/big", content=b"", headers=key("big"))
    assert first.status_code == 200
    assert first.text == "x" * 70_000 + "1"
    again = await client.post("/big", content=b"", headers=key("big"))
    document = problem(again, 409)
    assert "too large" in document["detail"]
    assert document["receipt"].startswith("http 200 sha256:")
    assert shop.effects == ["big"]
    (view,) = [view async for view in journal.records()]
    assert view.status == "succeeded"


async def test_an_operator_resolution_without_a_response_is_not_replayed(
    client: httpx.AsyncClient, journal: Journal
) -> None:
    await client.post("/boom", content=b"", headers=key("r"))
    (view,) = [view async for view in journal.records()]
    await journal.resolve(view.identity, receipt="refund-77", note="checked the provider")
    again = await client.post("/boom", content=b"", headers=key("r"))
    document = problem(again, 409)
    assert document["receipt"] == "refund-77"
    assert "not kept" in document["detail"]


# ---------------------------------------------------------------------------- what passes


async def test_other_methods_pass_through_untouched(
    client: httpx.AsyncClient, shop: Shop, journal: Journal
) -> None:
    response = await client.get("/orders")
    assert response.json() == {"orders": 0}
    response = await client.get("/orders", headers=key("g"))
    assert "idempotent-replayed" not in response.headers
    assert [view async for view in journal.records()] == []


async def test_a_key_is_optional_when_not_required(shop: Shop, journal: Journal) -> None:
    app = IdempotencyMiddleware(
        shop.app, journal=journal, required=lambda scope: scope["path"] != "/orders"
    )
    async with client_for(app) as client:
        assert (await client.post("/orders", content=b"a")).status_code == 201
        assert (await client.post("/orders", content=b"a")).status_code == 201
        problem(await client.post("/big", content=b""), 400)
    assert shop.effects == ["a", "a"]


# The middleware stops reading a body once it is over the limit, so the client's chunk
# generators are left unfinished; trio warns when it collects them. They are collected
# here, inside the test, where that warning is expected.
@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
async def test_a_body_over_the_limit_is_413(shop: Shop, journal: Journal) -> None:
    app = IdempotencyMiddleware(shop.app, journal=journal, max_body=10)
    async with client_for(app) as client:
        problem(await client.post("/orders", content=b"x" * 11, headers=key("b")), 413)

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"xxxxx"

        problem(await client.post("/orders", content=chunks(), headers=key("b")), 413)
        gc.collect()
        assert (await client.post("/orders", content=b"x" * 10, headers=key("b"))).is_success
    assert shop.effects == ["x" * 10]


# ---------------------------------------------------------------------------- scopes


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_the_scope_keeps_users_keys_apart(
    shop: Shop, journal: Journal, asynchronous: bool
) -> None:
    def user(scope: Any) -> str:
        headers = dict(scope["headers"])
        return str(headers[b"x-user"].decode())

    async def user_later(scope: Any) -> str:
        await anyio.lowlevel.checkpoint()
        return user(scope)

    app = IdempotencyMiddleware(
        shop.app, journal=journal, scope=user_later if asynchronous else user
    )
    async with client_for(app) as client:
        alice = await client.post(
            "/orders", content=b"1", headers={**key("same"), "x-user": "alice"}
        )
        bob = await client.post(
            "/orders", content=b"1", headers={**key("same"), "x-user": "bob@example.com"}
        )
        alice_again = await client.post(
            "/orders", content=b"1", headers={**key("same"), "x-user": "alice"}
        )
    assert alice.json()["user"] == "alice"
    assert bob.json()["user"] == "bob@example.com"  # bob's own run, not alice's response
    assert alice_again.content == alice.content
    assert alice_again.headers["idempotent-replayed"] == "true"
    assert shop.effects == ["1", "1"]
    scopes = sorted([view.identity[0] async for view in journal.records()])
    assert "alice" in scopes
    assert any(label.startswith("s-") for label in scopes)  # not a label: a digest of it


# ---------------------------------------------------------------------------- the journal's life


async def lifespan(app: Any, *events: str) -> list[str]:
    """Drive the ASGI lifespan protocol through ``app``; the messages the server got."""
    incoming = [{"type": f"lifespan.{event}"} for event in events]
    sent: list[str] = []

    async def receive() -> dict[str, str]:
        assert incoming, "the application asked for more lifespan events than the server sends"
        return incoming.pop(0)

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    with anyio.fail_after(10):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return sent


async def test_lifespan_opens_and_closes_the_journal(shop: Shop, location: str) -> None:
    app = IdempotencyMiddleware(shop.app, location=location)
    assert app.journal is None
    opened: list[Journal] = []

    original_send_startup: list[str] = []

    async def probe(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        assert app.journal is not None
        opened.append(app.journal)
        original_send_startup.append("started")
        async with client_for(app) as client:
            response = await client.post("/orders", content=b"l", headers=key("life"))
            assert response.status_code == 201
        message = await receive()
        assert message["type"] == "lifespan.shutdown"
        await send({"type": "lifespan.shutdown.complete"})

    app.app = _ShopWithLifespan(probe, shop.app)
    sent = await lifespan(app, "startup", "shutdown")
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert app.journal is None
    assert original_send_startup == ["started"]
    # What the first life wrote, a second journal reads.
    async with await Journal.open(location) as again:
        (view,) = [view async for view in again.records()]
        assert view.status == "succeeded"


class _ShopWithLifespan:
    """Route lifespan to a probe and requests to the shop."""

    def __init__(self, probe: Any, app: Any) -> None:
        self.probe = probe
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.probe(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def test_startup_fails_when_the_journal_cannot_open(shop: Shop) -> None:
    app = IdempotencyMiddleware(shop.app, location="relative/journal")
    sent = await lifespan(app, "startup", "shutdown")
    assert sent[0] == "lifespan.startup.failed"
    assert app.journal is None


async def test_a_starlette_app_runs_its_lifespan_through_the_middleware(
    shop: Shop, location: str
) -> None:
    app = IdempotencyMiddleware(shop.app, location=location)
    sent = await lifespan(app, "startup", "shutdown")
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert app.journal is None


async def test_without_lifespan_the_journal_opens_once_on_first_use(
    shop: Shop, location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opens: list[str] = []
    real_open = Journal.open

    async def counting_open(where: str, **options: Any) -> Journal:
        opens.append(where)
        await anyio.sleep(0.01)
        return await real_open(where, **options)

    monkeypatch.setattr(Journal, "open", counting_open)
    app = IdempotencyMiddleware(shop.app, location=location)
    async with client_for(app) as client:
        answers: list[int] = []

        async def post(n: int) -> None:
            response = await client.post("/orders", content=b"c", headers=key(f"c{n}"))
            answers.append(response.status_code)

        async with anyio.create_task_group() as tg:
            for n in range(10):
                tg.start_soon(post, n)
    assert answers == [201] * 10
    assert opens == [location]
    await app.aclose()
    assert app.journal is None


async def test_a_given_journal_stays_open(shop: Shop, journal: Journal) -> None:
    app = IdempotencyMiddleware(shop.app, journal=journal)
    sent = await lifespan(app, "startup", "shutdown")
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    await app.aclose()
    assert app.journal is journal
    assert (await journal.counts()) is not None


def test_the_middleware_refuses_bad_arguments() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    with pytest.raises(ValueError, match="exactly one"):
        IdempotencyMiddleware(app)
    with pytest.raises(ValueError, match="scope"):
        IdempotencyMiddleware(app, location="/tmp/j", scope="not a label")
    with pytest.raises(ValueError, match="wait"):
        IdempotencyMiddleware(app, location="/tmp/j", wait=float("nan"))
    assert len(DEFINITION) == 64


async def test_the_handler_finds_its_claim(journal: Journal) -> None:
    seen: list[str | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        claim = claim_of(scope)
        seen.append(None if claim is None else claim.key)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with client_for(IdempotencyMiddleware(app, journal=journal, required=False)) as client:
        await client.post("/x", content=b"", headers=key("c"))
        await client.post("/x", content=b"")
    (view,) = [view async for view in journal.records()]
    assert seen == [view.key, None]
