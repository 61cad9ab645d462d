"""The middleware's storage policy: which responses are final (kept and replayed) and
which release the key for a retry; ``Withdraw`` from a handler; ``replayable_response``
for a reconciliation. In process, on every store."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from itemjournal import Happened, InvalidArgument, Journal, RecordView, Unknown, Withdraw
from itemjournal.asgi import (
    RELEASED_STATUSES,
    REPLAYED_HEADERS,
    IdempotencyMiddleware,
    replayable_response,
)

pytestmark = pytest.mark.anyio


class Answers:
    """A handler that answers each request with the next status it is given, counting."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.calls = 0
        self.withdraw_next = False
        routes = [
            Route("/pay", self.pay, methods=["POST"]),
            Route("/withdraws", self.withdraws, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def pay(self, request: Request) -> Response:
        self.calls += 1
        status = self.statuses.pop(0) if self.statuses else 201
        return JSONResponse({"call": self.calls, "status": status}, status_code=status)

    async def withdraws(self, request: Request) -> Response:
        self.calls += 1
        if self.withdraw_next:
            self.withdraw_next = False
            raise Withdraw("the basket was empty when the request was checked")
        return PlainTextResponse(f"done {self.calls}", status_code=201)


def client_for(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://shop.test")


@pytest.fixture
def answers() -> Answers:
    return Answers()


@pytest.fixture
async def client(answers: Answers, journal: Journal) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(IdempotencyMiddleware(answers.app, journal=journal)) as http:
        yield http


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{value}"'}


async def only_record(journal: Journal) -> RecordView:
    [view] = [view async for view in journal.records()]
    assert isinstance(view, RecordView)
    return view


def test_the_default_policy() -> None:
    assert frozenset({400, 401, 403, 408, 409, 422, 425, 429}) == RELEASED_STATUSES


@pytest.mark.parametrize("status", sorted(RELEASED_STATUSES))
async def test_a_released_status_frees_the_key_and_the_retry_runs_again(
    status: int, client: httpx.AsyncClient, answers: Answers, journal: Journal
) -> None:
    answers.statuses = [status]
    first = await client.post("/pay", content=b"{}", headers=key("k"))
    assert first.status_code == status
    assert first.json() == {"call": 1, "status": status}
    view = await only_record(journal)
    assert view.status == "released"
    assert [event.event for event in view.history] == ["begin", "withdrawn"]
    assert f"answered {status}" in (view.history[-1].note or "")
    again = await client.post("/pay", content=b"{}", headers=key("k"))
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert answers.calls == 2  # the handler ran again
    view = await only_record(journal)
    assert (view.status, view.attempt) == ("succeeded", 2)


@pytest.mark.parametrize("status", [402, 404, 410, 200, 202])
async def test_any_other_status_below_500_is_final_and_replayed(
    status: int, client: httpx.AsyncClient, answers: Answers, journal: Journal
) -> None:
    answers.statuses = [status]
    first = await client.post("/pay", content=b"{}", headers=key("k"))
    again = await client.post("/pay", content=b"{}", headers=key("k"))
    assert first.status_code == again.status_code == status
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert answers.calls == 1
    assert (await only_record(journal)).status == "succeeded"


async def test_a_5xx_still_needs_review(
    client: httpx.AsyncClient, answers: Answers, journal: Journal
) -> None:
    answers.statuses = [502]
    assert (await client.post("/pay", content=b"{}", headers=key("k"))).status_code == 502
    again = await client.post("/pay", content=b"{}", headers=key("k"))
    assert again.status_code == 409
    assert again.json()["code"] == "REVIEW_REQUIRED"
    assert (await only_record(journal)).status == "needs_review"
    assert answers.calls == 1


async def test_an_explicit_policy_chooses_what_is_kept(answers: Answers, journal: Journal) -> None:
    app = IdempotencyMiddleware(answers.app, journal=journal, release=[402])
    async with client_for(app) as client:
        answers.statuses = [429, 402]
        limited = await client.post("/pay", content=b"{}", headers=key("a"))
        replayed = await client.post("/pay", content=b"{}", headers=key("a"))
        assert limited.status_code == replayed.status_code == 429  # kept under this policy
        assert replayed.headers["idempotent-replayed"] == "true"
        declined = await client.post("/pay", content=b"{}", headers=key("b"))
        retried = await client.post("/pay", content=b"{}", headers=key("b"))
        assert declined.status_code == 402
        assert retried.status_code == 201  # released under this policy: ran again
    assert answers.calls == 3


def test_the_policy_refuses_what_it_cannot_mean() -> None:
    for bad in ([500], [503], [99], [True], ["429"], 429, "429"):
        with pytest.raises(InvalidArgument) as caught:
            IdempotencyMiddleware(Starlette(), location="/tmp/unused", release=bad)  # type: ignore[arg-type]
        assert caught.value.code == "INVALID_ARGUMENT"
    IdempotencyMiddleware(Starlette(), location="/tmp/unused", release=range(400, 500))
    IdempotencyMiddleware(Starlette(), location="/tmp/unused", release=())


# ---------------------------------------------------------------------------- Withdraw


async def test_a_handler_that_raises_withdraw_releases_the_key(
    client: httpx.AsyncClient, answers: Answers, journal: Journal
) -> None:
    answers.withdraw_next = True
    first = await client.post("/withdraws", content=b"{}", headers=key("w"))
    assert first.status_code == 500  # what Starlette answers for any exception
    view = await only_record(journal)
    assert view.status == "released"
    assert view.history[-1].event == "withdrawn"
    assert view.history[-1].note == "the basket was empty when the request was checked"
    again = await client.post("/withdraws", content=b"{}", headers=key("w"))
    assert again.status_code == 201
    assert again.text == "done 2"
    assert answers.calls == 2


async def test_a_bare_app_that_raises_withdraw_gets_a_problem_saying_so(
    journal: Journal,
) -> None:
    calls: list[str] = []

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        calls.append("called")
        if len(calls) == 1:
            raise Withdraw("the account is frozen")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with client_for(IdempotencyMiddleware(bare, journal=journal)) as client:
        first = await client.post("/", content=b"", headers=key("w"))
        assert first.status_code == 500
        assert first.headers["content-type"] == "application/problem+json"
        document = first.json()
        assert document["type"].endswith("request-withdrawn")
        assert "released" in document["detail"]
        again = await client.post("/", content=b"", headers=key("w"))
        assert (again.status_code, again.content) == (201, b"ok")
    assert calls == ["called", "called"]


# ---------------------------------------------------------------------------- replayable


async def test_replayable_response_is_the_format_the_middleware_stores(
    journal: Journal,
) -> None:
    body = json.dumps({"order": 7, "note": "caf\u00e9"}).encode()

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"location", b"/orders/7"),
            (b"set-cookie", b"session=secret"),
        ]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with client_for(IdempotencyMiddleware(bare, journal=journal)) as client:
        await client.post("/", content=b"", headers=key("r"))
    stored = (await only_record(journal)).result
    built = replayable_response(
        201, body, headers={"Location": "/orders/7"}, content_type="application/json"
    )
    assert built == stored  # the very document the middleware wrote
    assert json.loads(built) == {
        "v": 1,
        "status": 201,
        "headers": [["content-type", "application/json"], ["location", "/orders/7"]],
        "text": body.decode(),
    }
    assert json.loads(replayable_response(200, b"\xff\x00")) == {
        "v": 1,
        "status": 200,
        "headers": [],
        "base64": "/wA=",
    }
    assert json.loads(replayable_response(200, "text"))["text"] == "text"


def test_replayable_response_refuses_what_cannot_be_replayed() -> None:
    for call in (
        lambda: replayable_response(99, b""),
        lambda: replayable_response(600, b""),
        lambda: replayable_response(True, b""),  # type: ignore[arg-type]
        lambda: replayable_response(200, 42),  # type: ignore[arg-type]
        lambda: replayable_response(200, b"", headers={"set-cookie": "a=b"}),
        lambda: replayable_response(200, b"", headers={"content-length": "0"}),
        lambda: replayable_response(200, b"", headers=[("etag", 1)]),  # type: ignore[list-item]
        lambda: replayable_response(200, b"", content_type="text/\u2603"),
        lambda: replayable_response(200, b"x" * 70_000),
    ):
        with pytest.raises(InvalidArgument) as caught:
            call()
        assert caught.value.code == "INVALID_ARGUMENT"
    assert "content-type" in REPLAYED_HEADERS


async def test_a_reconciled_request_is_replayed_with_the_built_response(
    client: httpx.AsyncClient, answers: Answers, journal: Journal
) -> None:
    answers.statuses = [503]
    assert (await client.post("/pay", content=b"{}", headers=key("k"))).status_code == 503
    body = b'{"call": 1, "charge": "ch_1"}'
    built = replayable_response(201, body, content_type="application/json", headers={"etag": '"1"'})

    async def check(view: RecordView) -> Happened | Unknown:
        return Happened("ch_1", result=built)

    report = await journal.reconcile(check)
    assert len(report.happened) == 1
    replays = [await client.post("/pay", content=b"{}", headers=key("k")) for _ in range(2)]
    for replay in replays:
        assert replay.status_code == 201
        assert replay.content == body
        assert replay.headers["content-type"] == "application/json"
        assert replay.headers["etag"] == '"1"'
        assert replay.headers["idempotent-replayed"] == "true"
    assert replays[0].headers.raw == replays[1].headers.raw
    assert answers.calls == 1
