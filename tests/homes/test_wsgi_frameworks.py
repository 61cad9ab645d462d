"""The WSGI middleware around a Flask and a Django application, and the record both
middlewares share: one written through the ASGI middleware is replayed through the WSGI
one, and the other way round, on one location."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import flask
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from itemjournal import Withdraw, asgi, sync
from itemjournal.wsgi import IdempotencyMiddleware, claim_of

PROBLEM = "application/problem+json"


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{value}"'}


def client_for(app: Any) -> httpx.Client:
    transport = httpx.WSGITransport(app=app, raise_app_exceptions=False)
    return httpx.Client(transport=transport, base_url="http://shop.test")


@pytest.fixture(params=["file", "sqlite"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/journal.db"
    return str(tmp_path / "journal")


@pytest.fixture
def journal(location: str) -> Iterator[sync.Journal]:
    with sync.Journal.open(location) as opened:
        yield opened


# ---------------------------------------------------------------------------- Flask


def flask_shop(charges: list[str], *, propagate: bool = False) -> flask.Flask:
    app = flask.Flask("shop")
    app.config["PROPAGATE_EXCEPTIONS"] = propagate
    calls = {"limited": 0, "withdraws": 0}

    @app.post("/orders")
    def create() -> tuple[dict[str, object], int]:
        claim = claim_of(flask.request.environ)
        assert claim is not None
        charges.append(claim.key)
        order = flask.request.get_json()
        return {"order": order["item"], "charge": len(charges)}, 201

    @app.post("/limited")
    def limited() -> tuple[str, int]:
        charges.append("limited")
        calls["limited"] += 1
        return "slow down", 429 if calls["limited"] == 1 else 201

    @app.post("/boom")
    def boom() -> str:
        charges.append("boom")
        raise RuntimeError("provider timed out")

    @app.post("/withdraws")
    def withdraws() -> tuple[str, int]:
        charges.append("withdraws")
        calls["withdraws"] += 1
        if calls["withdraws"] == 1:
            raise Withdraw("the basket was empty")
        return "done", 201

    return app


def test_a_flask_app(journal: sync.Journal) -> None:
    charges: list[str] = []
    app = flask_shop(charges)
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, journal=journal)  # type: ignore[method-assign]
    with client_for(app) as client:
        first = client.post("/orders", json={"item": "book"}, headers=key("o"))
        again = client.post("/orders", json={"item": "book"}, headers=key("o"))
        changed = client.post("/orders", json={"item": "kite"}, headers=key("o"))
        missing = client.post("/orders", json={"item": "book"})
        limited = client.post("/limited", content=b"", headers=key("l"))
        retried = client.post("/limited", content=b"", headers=key("l"))
    assert first.status_code == 201
    assert first.json() == {"order": "book", "charge": 1}
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == "application/json"
    assert changed.status_code == 422
    assert missing.status_code == 400
    assert missing.headers["content-type"] == PROBLEM
    assert (limited.status_code, retried.status_code) == (429, 201)  # released, ran again
    views = {view.status for view in journal.records()}
    assert views == {"succeeded"}
    assert charges[0] == next(v.key for v in journal.records() if v.attempt == 1)


def test_a_flask_error_page_needs_review(journal: sync.Journal) -> None:
    charges: list[str] = []
    app = flask_shop(charges)
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, journal=journal)  # type: ignore[method-assign]
    with client_for(app) as client:
        first = client.post("/boom", content=b"", headers=key("b"))
        again = client.post("/boom", content=b"", headers=key("b"))
    assert first.status_code == 500  # Flask's own error page
    assert again.status_code == 409
    assert again.json()["review_reason"].startswith("the application answered 500")
    assert charges == ["boom"]


def test_a_flask_withdraw_that_reaches_the_middleware_releases_the_key(
    journal: sync.Journal,
) -> None:
    charges: list[str] = []
    app = flask_shop(charges, propagate=True)
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, journal=journal)  # type: ignore[method-assign]
    with client_for(app) as client:
        first = client.post("/withdraws", content=b"", headers=key("w"))
        again = client.post("/withdraws", content=b"", headers=key("w"))
    assert first.status_code == 500
    assert first.json()["type"].endswith("request-withdrawn")
    assert (again.status_code, again.text) == (201, "done")
    assert charges == ["withdraws", "withdraws"]


# ---------------------------------------------------------------------------- Django


def django_application(charges: list[str]) -> Any:
    import django
    from django.conf import settings
    from django.core.handlers.wsgi import WSGIHandler
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.urls import path

    def create(request: HttpRequest) -> HttpResponse:
        claim = claim_of(request.META)
        assert claim is not None
        DJANGO_CHARGES[-1].append(claim.key)
        order = json.loads(request.body)
        response = JsonResponse({"order": order["item"]}, status=201)
        response["Location"] = "/orders/1"
        response.set_cookie("session", "secret")
        return response

    def boom(request: HttpRequest) -> HttpResponse:
        DJANGO_CHARGES[-1].append("boom")
        raise RuntimeError("provider timed out")

    if not settings.configured:
        urls = types.ModuleType("wsgi_test_django_urls")
        urls.urlpatterns = [path("orders", create), path("boom", boom)]  # type: ignore[attr-defined]
        sys.modules[urls.__name__] = urls
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["*"],
            SECRET_KEY="not a secret: tests only",
            ROOT_URLCONF=urls.__name__,
            MIDDLEWARE=[],
            INSTALLED_APPS=[],
            DATABASES={},
            LOGGING_CONFIG=None,
        )
        django.setup()
    DJANGO_CHARGES.append(charges)
    return WSGIHandler()


DJANGO_CHARGES: list[list[str]] = []


def test_a_django_app(journal: sync.Journal) -> None:
    charges: list[str] = []
    app = IdempotencyMiddleware(django_application(charges), journal=journal)
    with client_for(app) as client:
        first = client.post("/orders", json={"item": "book"}, headers=key("o"))
        again = client.post("/orders", json={"item": "book"}, headers=key("o"))
        changed = client.post("/orders", json={"item": "kite"}, headers=key("o"))
        broken = client.post("/boom", content=b"", headers=key("b"))
        broken_again = client.post("/boom", content=b"", headers=key("b"))
    assert first.status_code == 201
    assert "set-cookie" in first.headers
    assert again.content == first.content == b'{"order": "book"}'
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == "/orders/1"
    assert "set-cookie" not in again.headers
    assert changed.status_code == 422
    assert broken.status_code == 500  # Django's own error page
    assert broken_again.status_code == 409
    assert broken_again.json()["code"] == "REVIEW_REQUIRED"
    assert len(charges) == 2
    assert charges[0] == next(v.key for v in journal.records() if v.status == "succeeded")


# ---------------------------------------------------------------------------- two protocols


def starlette_shop(charges: list[str]) -> Starlette:
    async def create(request: Request) -> Response:
        charges.append("asgi")
        return JSONResponse(
            {"order": (await request.json())["item"], "via": "asgi"},
            status_code=201,
            headers={"location": "/orders/1", "etag": '"v1"'},
        )

    return Starlette(routes=[Route("/orders", create, methods=["POST"])])


def flask_plain(charges: list[str]) -> flask.Flask:
    app = flask.Flask("plain")

    @app.post("/orders")
    def create() -> flask.Response:
        charges.append("wsgi")
        body = json.dumps({"order": flask.request.get_json(force=True)["item"], "via": "wsgi"})
        response = flask.Response(body, status=201, content_type="application/json")
        response.headers["Location"] = "/orders/1"
        response.headers["ETag"] = '"v1"'
        return response

    return app


def asgi_post(location: str, charges: list[str], body: bytes, value: str) -> httpx.Response:
    async def post() -> httpx.Response:
        middleware = asgi.IdempotencyMiddleware(starlette_shop(charges), location=location)
        transport = httpx.ASGITransport(app=middleware)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as c:
                return await c.post("/orders", content=body, headers=key(value))
        finally:
            await middleware.aclose()

    return anyio.run(post)


def test_a_record_is_replayed_through_either_protocol(location: str) -> None:
    charges: list[str] = []
    wsgi_app = IdempotencyMiddleware(flask_plain(charges).wsgi_app, location=location)
    body = b'{"item": "book"}'
    with client_for(wsgi_app) as client:
        # Written through ASGI, replayed through WSGI.
        through_asgi = asgi_post(location, charges, body, "a")
        replayed = client.post("/orders", content=body, headers=key("a"))
        changed = client.post("/orders", content=b'{"item": "kite"}', headers=key("a"))
        # Written through WSGI, replayed through ASGI.
        through_wsgi = client.post("/orders", content=body, headers=key("w"))
        replayed_by_asgi = asgi_post(location, charges, body, "w")
    wsgi_app.close()
    assert charges == ["asgi", "wsgi"]
    assert through_asgi.status_code == replayed.status_code == 201
    assert replayed.content == through_asgi.content
    assert replayed.headers["idempotent-replayed"] == "true"
    assert changed.status_code == 422
    assert through_wsgi.json()["via"] == "wsgi"
    assert replayed_by_asgi.content == through_wsgi.content
    assert replayed_by_asgi.headers["idempotent-replayed"] == "true"

    def replayed_headers(response: httpx.Response) -> list[tuple[str, str]]:
        return [(n, v) for n, v in response.headers.multi_items() if n != "date"]

    # A replay is the same response whichever middleware gives it.
    again_by_asgi = asgi_post(location, charges, body, "a")
    assert replayed_headers(again_by_asgi) == replayed_headers(replayed)
    assert again_by_asgi.content == replayed.content
    with sync.Journal.open(location) as journal:
        stored = {view.status: view.result for view in journal.records()}
    assert set(stored) == {"succeeded"}
