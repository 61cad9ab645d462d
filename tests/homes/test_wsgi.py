"""The WSGI Idempotency-Key middleware, through an in-process WSGI client, on every store:
the same answers as the ASGI middleware's (tests/homes/test_asgi.py and
test_asgi_policy.py), and what only WSGI has (an iterable response, ``close()``,
``write()``, exceptions a WSGI server would answer itself)."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import postgres_schema, postgres_url

from itemjournal import Happened, InvalidArgument, RecordView, Unknown, Withdraw, sync
from itemjournal.testing import MemoryStore
from itemjournal.wsgi import (
    DEFINITION,
    RELEASED_STATUSES,
    IdempotencyMiddleware,
    claim_of,
    replayable_response,
)

PROBLEM = "application/problem+json"
Environ = dict[str, Any]


class Shop:
    """A bare WSGI application whose handlers count the effects they perform."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.statuses: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.withdraw_next = False

    def __call__(self, environ: Environ, start_response: Any) -> Iterable[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        path = environ["PATH_INFO"]
        if environ["REQUEST_METHOD"] == "GET":
            return self.reply(start_response, 200, json.dumps({"orders": len(self.effects)}))
        if path == "/orders":
            self.effects.append(body.decode())
            order = len(self.effects)
            text = json.dumps(
                {"order": order, "echo": body.decode(), "user": environ.get("HTTP_X_USER")}
            )
            headers = [
                ("Location", f"/orders/{order}"),
                ("X-Trace", "first"),
                ("Set-Cookie", "session=secret"),
            ]
            return self.reply(start_response, 201, text, headers, "application/json")
        if path == "/slow":
            self.entered.set()
            assert self.release.wait(10)
            self.effects.append("slow")
            return self.reply(start_response, 200, f"slow done {len(self.effects)}")
        if path == "/boom":
            self.effects.append("boom")
            raise RuntimeError("provider timed out")
        if path == "/unavailable":
            self.effects.append("unavailable")
            return self.reply(start_response, 503, "upstream down")
        if path == "/big":
            self.effects.append("big")
            return self.reply(start_response, 200, "x" * 70_000 + str(len(self.effects)))
        if path == "/binary":
            self.effects.append("binary")
            payload = bytes(range(256)) * 4 + bytes([len(self.effects)])
            start_response("200 OK", [("Content-Type", "image/png")])
            return [payload]
        if path == "/pay":
            self.effects.append("pay")
            status = self.statuses.pop(0) if self.statuses else 201
            text = json.dumps({"call": len(self.effects), "status": status})
            return self.reply(start_response, status, text, content_type="application/json")
        if path == "/withdraws":
            self.effects.append("withdraws")
            if self.withdraw_next:
                self.withdraw_next = False
                raise Withdraw("the basket was empty when the request was checked")
            return self.reply(start_response, 201, f"done {len(self.effects)}")
        return self.reply(start_response, 404, "no such page")

    @staticmethod
    def reply(
        start_response: Any,
        status: int,
        text: str,
        headers: list[tuple[str, str]] | None = None,
        content_type: str = "text/plain; charset=utf-8",
    ) -> list[bytes]:
        body = text.encode()
        start_response(
            f"{status} Whatever",
            [("Content-Type", content_type), ("Content-Length", str(len(body))), *(headers or [])],
        )
        return [body]


@pytest.fixture(params=["file", "sqlite", "memory", "postgres"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sync.Journal]:
    """A blocking journal on each store."""
    kind = str(request.param)
    if kind == "memory":
        made = sync.Journal(MemoryStore())
        yield made
        made.close()
        return
    if kind == "postgres":
        postgres_url()
        with postgres_schema() as url:
            made = sync.Journal.open(url)
            yield made
            made.close()
        return
    where = f"sqlite://{tmp_path}/journal.db" if kind == "sqlite" else str(tmp_path / "journal")
    made = sync.Journal.open(where)
    yield made
    made.close()


@pytest.fixture
def shop() -> Shop:
    return Shop()


def client_for(app: Any) -> httpx.Client:
    transport = httpx.WSGITransport(app=app, raise_app_exceptions=False)
    return httpx.Client(transport=transport, base_url="http://shop.test")


@pytest.fixture
def client(shop: Shop, journal: sync.Journal) -> Iterator[httpx.Client]:
    with client_for(IdempotencyMiddleware(shop, journal=journal)) as http:
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


def only_record(journal: sync.Journal) -> RecordView:
    [view] = list(journal.records())
    return view


# ---------------------------------------------------------------------------- the key


def test_missing_key_is_400(client: httpx.Client, shop: Shop) -> None:
    document = problem(client.post("/orders", content=b"{}"), 400)
    assert "Idempotency-Key" in document["detail"]
    assert shop.effects == []


@pytest.mark.parametrize(
    "value",
    [
        '"unclosed',
        '"bad \\x escape"',
        "two words",
        '""',
        '"' + "k" * 256 + '"',
        '"a","b"',  # two fields, as a WSGI server joins them
    ],
)
def test_malformed_or_too_long_key_is_400(client: httpx.Client, shop: Shop, value: str) -> None:
    response = client.post("/orders", content=b"{}", headers={"Idempotency-Key": value})
    assert problem(response, 400)["title"] == "Idempotency-Key malformed"
    assert shop.effects == []


# ---------------------------------------------------------------------------- replay


def test_first_request_runs_once_and_duplicates_replay_it_byte_for_byte(
    client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    first = client.post("/orders", content=b'{"sku": 7}', headers=key("k-1"))
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert "set-cookie" in first.headers
    for _ in range(3):
        again = client.post("/orders", content=b'{"sku": 7}', headers=key("k-1"))
        assert again.status_code == 201
        assert again.content == first.content
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["content-type"] == first.headers["content-type"]
        assert again.headers["location"] == first.headers["location"]
        assert again.headers["content-length"] == str(len(first.content))
        assert "set-cookie" not in again.headers  # never stored, never replayed
        assert "x-trace" not in again.headers  # not in the allow-list
    assert shop.effects == ['{"sku": 7}']
    token = client.post("/orders", content=b'{"sku": 7}', headers={"Idempotency-Key": "k-1"})
    assert token.content == first.content
    assert token.headers["idempotent-replayed"] == "true"
    view = only_record(journal)
    assert view.status == "succeeded"
    assert view.identity[1:3] == ("http", "idempotency-key")
    assert "k-1" not in json.dumps(list(view.identity))  # the raw key is never a label
    assert view.receipt is not None
    assert view.receipt.startswith("http 201 sha256:")


def test_binary_response_is_replayed_byte_for_byte(client: httpx.Client, shop: Shop) -> None:
    first = client.post("/binary", content=b"", headers=key("bin"))
    again = client.post("/binary", content=b"", headers=key("bin"))
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
def test_same_key_for_another_request_is_422(
    client: httpx.Client, shop: Shop, method: str, path: str, body: bytes
) -> None:
    client.post("/orders", content=b'{"sku": 7}', headers=key("k-2"))
    response = client.request(method, path, content=body, headers=key("k-2"))
    assert problem(response, 422)["code"] == "INPUT_CHANGED"
    assert shop.effects == ['{"sku": 7}']


def test_a_duplicate_in_flight_is_409_with_retry_after(client: httpx.Client, shop: Shop) -> None:
    answers: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: answers.append(client.post("/slow", content=b"x", headers=key("slow")))
    )
    first.start()
    assert shop.entered.wait(10)
    duplicate = client.post("/slow", content=b"x", headers=key("slow"))
    shop.release.set()
    first.join(10)
    assert problem(duplicate, 409)["code"] == "IN_PROGRESS"
    assert duplicate.headers["retry-after"] == "1"
    assert answers[0].status_code == 200
    assert answers[0].text == "slow done 1"
    assert shop.effects == ["slow"]


def test_wait_lets_a_duplicate_get_the_replay(shop: Shop, journal: sync.Journal) -> None:
    answers: dict[str, httpx.Response] = {}
    with client_for(IdempotencyMiddleware(shop, journal=journal, wait=10)) as client:

        def post(name: str) -> None:
            answers[name] = client.post("/slow", content=b"x", headers=key("w"))

        first = threading.Thread(target=post, args=("fresh",))
        first.start()
        assert shop.entered.wait(10)
        duplicate = threading.Thread(target=post, args=("replayed",))
        duplicate.start()
        threading.Event().wait(0.1)
        shop.release.set()
        first.join(10)
        duplicate.join(10)
    assert "idempotent-replayed" not in answers["fresh"].headers
    assert answers["replayed"].headers["idempotent-replayed"] == "true"
    assert answers["replayed"].content == answers["fresh"].content == b"slow done 1"
    assert shop.effects == ["slow"]


# ---------------------------------------------------------------------------- uncertain outcomes


def test_a_raising_app_is_a_problem_500_then_needs_review(
    client: httpx.Client, shop: Shop, journal: sync.Journal, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="itemjournal.wsgi"):
        first = client.post("/boom", content=b"", headers=key("boom"))
    assert problem(first, 500)["title"] == "Internal Server Error"
    (logged,) = [record for record in caplog.records if record.name == "itemjournal.wsgi"]
    assert logged.exc_info is not None and "provider timed out" in str(logged.exc_info[1])
    again = client.post("/boom", content=b"", headers=key("boom"))
    document = problem(again, 409)
    assert document["code"] == "REVIEW_REQUIRED"
    assert "RuntimeError: provider timed out" in document["review_reason"]
    assert shop.effects == ["boom"]
    assert only_record(journal).status == "needs_review"


def test_a_5xx_response_needs_review(client: httpx.Client, shop: Shop) -> None:
    first = client.post("/unavailable", content=b"", headers=key("u"))
    assert first.status_code == 503
    assert first.text == "upstream down"
    again = client.post("/unavailable", content=b"", headers=key("u"))
    assert "answered 503" in problem(again, 409)["review_reason"]
    assert shop.effects == ["unavailable"]


def test_an_app_that_sends_nothing_needs_review(journal: sync.Journal) -> None:
    def app(environ: Environ, start_response: Any) -> list[bytes]:
        return []

    with client_for(IdempotencyMiddleware(app, journal=journal)) as client:
        problem(client.post("/x", content=b"", headers=key("n")), 500)
        again = client.post("/x", content=b"", headers=key("n"))
    assert problem(again, 409)["review_reason"] == "the application sent no response"


def test_a_response_over_the_limit_passes_once_then_says_it_cannot_replay(
    client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    first = client.post("/big", content=b"", headers=key("big"))
    assert first.status_code == 200
    assert first.text == "x" * 70_000 + "1"
    again = client.post("/big", content=b"", headers=key("big"))
    document = problem(again, 409)
    assert "too large" in document["detail"]
    assert document["receipt"].startswith("http 200 sha256:")
    assert shop.effects == ["big"]
    assert only_record(journal).status == "succeeded"


def test_an_operator_resolution_without_a_response_is_not_replayed(
    client: httpx.Client, journal: sync.Journal
) -> None:
    client.post("/boom", content=b"", headers=key("r"))
    journal.resolve(only_record(journal).identity, receipt="refund-77", note="checked")
    document = problem(client.post("/boom", content=b"", headers=key("r")), 409)
    assert document["receipt"] == "refund-77"
    assert "not kept" in document["detail"]


def test_a_journal_that_cannot_open_is_503(shop: Shop, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the journal's directory should be")
    middleware = IdempotencyMiddleware(shop, location=str(blocked / "journal"))
    with client_for(middleware) as client:
        response = client.post("/orders", content=b"{}", headers=key("j"))
    assert problem(response, 503)["code"]
    assert response.headers["retry-after"] == "5"
    assert shop.effects == []


# ---------------------------------------------------------------------------- what passes


def test_other_methods_pass_through_untouched(
    client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    assert client.get("/orders").json() == {"orders": 0}
    assert "idempotent-replayed" not in client.get("/orders", headers=key("g")).headers
    assert list(journal.records()) == []


def test_a_key_is_optional_when_not_required(shop: Shop, journal: sync.Journal) -> None:
    middleware = IdempotencyMiddleware(
        shop, journal=journal, required=lambda environ: environ["PATH_INFO"] != "/orders"
    )
    with client_for(middleware) as client:
        assert client.post("/orders", content=b"a").status_code == 201
        assert client.post("/orders", content=b"a").status_code == 201
        problem(client.post("/big", content=b""), 400)
    assert shop.effects == ["a", "a"]


def test_a_body_over_the_limit_is_413(shop: Shop, journal: sync.Journal) -> None:
    middleware = IdempotencyMiddleware(shop, journal=journal, max_body=10)
    with client_for(middleware) as client:
        problem(client.post("/orders", content=b"x" * 11, headers=key("b")), 413)
    # A chunked body (no Content-Length, the stream terminated by the server).
    status, _, body = call(
        middleware, "/orders", b"y" * 11, key("b"), {"wsgi.input_terminated": True}
    )
    assert status.startswith("413")
    assert json.loads(body)["status"] == 413
    with client_for(middleware) as client:
        assert client.post("/orders", content=b"x" * 10, headers=key("b")).is_success
    assert shop.effects == ["x" * 10]


def test_a_chunked_body_is_read_to_its_end(shop: Shop, journal: sync.Journal) -> None:
    middleware = IdempotencyMiddleware(shop, journal=journal)
    extra = {"wsgi.input_terminated": True}
    status, _, body = call(middleware, "/orders", b'{"chunked": 1}', key("c"), extra)
    assert status.startswith("201")
    assert json.loads(body)["echo"] == '{"chunked": 1}'
    status, headers, again = call(middleware, "/orders", b'{"chunked": 1}', key("c"), extra)
    assert (again, dict(headers)["idempotent-replayed"]) == (body, "true")


def test_a_body_shorter_than_its_length_is_400(shop: Shop, journal: sync.Journal) -> None:
    middleware = IdempotencyMiddleware(shop, journal=journal)
    status, _, body = call(middleware, "/orders", b"abc", key("s"), {"CONTENT_LENGTH": "10"})
    assert status.startswith("400")
    assert json.loads(body)["type"].endswith("request-incomplete")
    assert shop.effects == []
    assert list(journal.records()) == []


# ---------------------------------------------------------------------------- scopes


def test_the_scope_keeps_users_keys_apart(shop: Shop, journal: sync.Journal) -> None:
    middleware = IdempotencyMiddleware(
        shop, journal=journal, scope=lambda environ: str(environ["HTTP_X_USER"])
    )
    with client_for(middleware) as client:
        alice = client.post("/orders", content=b"1", headers={**key("same"), "x-user": "alice"})
        bob = client.post(
            "/orders", content=b"1", headers={**key("same"), "x-user": "bob@example.com"}
        )
        alice_again = client.post(
            "/orders", content=b"1", headers={**key("same"), "x-user": "alice"}
        )
    assert alice.json()["user"] == "alice"
    assert bob.json()["user"] == "bob@example.com"  # bob's own run, not alice's response
    assert alice_again.content == alice.content
    assert alice_again.headers["idempotent-replayed"] == "true"
    assert shop.effects == ["1", "1"]
    scopes = sorted(view.identity[0] for view in journal.records())
    assert "alice" in scopes
    assert any(label.startswith("s-") for label in scopes)


def test_the_handler_finds_its_claim(journal: sync.Journal) -> None:
    seen: list[str | None] = []

    def app(environ: Environ, start_response: Any) -> list[bytes]:
        claim = claim_of(environ)
        seen.append(None if claim is None else claim.key)
        start_response("200 OK", [])
        return [b"ok"]

    with client_for(IdempotencyMiddleware(app, journal=journal, required=False)) as client:
        client.post("/x", content=b"", headers=key("c"))
        client.post("/x", content=b"")
    assert seen == [only_record(journal).key, None]


# ---------------------------------------------------------------------------- the policy


def test_the_policy_is_the_asgi_one() -> None:
    from itemjournal import asgi

    assert RELEASED_STATUSES is asgi.RELEASED_STATUSES
    assert replayable_response is asgi.replayable_response
    assert DEFINITION == asgi.DEFINITION


@pytest.mark.parametrize("status", sorted(RELEASED_STATUSES))
def test_a_released_status_frees_the_key_and_the_retry_runs_again(
    status: int, client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    shop.statuses = [status]
    first = client.post("/pay", content=b"{}", headers=key("k"))
    assert first.status_code == status
    view = only_record(journal)
    assert view.status == "released"
    assert [event.event for event in view.history] == ["begin", "withdrawn"]
    assert f"answered {status}" in (view.history[-1].note or "")
    again = client.post("/pay", content=b"{}", headers=key("k"))
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert len(shop.effects) == 2
    view = only_record(journal)
    assert (view.status, view.attempt) == ("succeeded", 2)


@pytest.mark.parametrize("status", [402, 404, 410, 200, 202])
def test_any_other_status_below_500_is_final_and_replayed(
    status: int, client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    shop.statuses = [status]
    first = client.post("/pay", content=b"{}", headers=key("k"))
    again = client.post("/pay", content=b"{}", headers=key("k"))
    assert first.status_code == again.status_code == status
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert len(shop.effects) == 1
    assert only_record(journal).status == "succeeded"


def test_an_explicit_policy_chooses_what_is_kept(shop: Shop, journal: sync.Journal) -> None:
    with client_for(IdempotencyMiddleware(shop, journal=journal, release=[402])) as client:
        shop.statuses = [429, 402]
        limited = client.post("/pay", content=b"{}", headers=key("a"))
        replayed = client.post("/pay", content=b"{}", headers=key("a"))
        assert limited.status_code == replayed.status_code == 429  # kept under this policy
        assert replayed.headers["idempotent-replayed"] == "true"
        declined = client.post("/pay", content=b"{}", headers=key("b"))
        retried = client.post("/pay", content=b"{}", headers=key("b"))
        assert declined.status_code == 402
        assert retried.status_code == 201  # released under this policy: ran again
    assert len(shop.effects) == 3


def test_the_middleware_refuses_bad_arguments(shop: Shop) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        IdempotencyMiddleware(shop)
    with pytest.raises(ValueError, match="scope"):
        IdempotencyMiddleware(shop, location="/tmp/j", scope="not a label")
    with pytest.raises(ValueError, match="wait"):
        IdempotencyMiddleware(shop, location="/tmp/j", wait=float("nan"))
    for bad in ([500], [99], [True], 429, "429"):
        with pytest.raises(InvalidArgument) as caught:
            IdempotencyMiddleware(shop, location="/tmp/unused", release=bad)  # type: ignore[arg-type]
        assert caught.value.code == "INVALID_ARGUMENT"


def test_an_app_that_raises_withdraw_releases_the_key(
    client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    shop.withdraw_next = True
    first = client.post("/withdraws", content=b"{}", headers=key("w"))
    document = problem(first, 500)
    assert document["type"].endswith("request-withdrawn")
    assert "released" in document["detail"]
    view = only_record(journal)
    assert view.status == "released"
    assert view.history[-1].note == "the basket was empty when the request was checked"
    again = client.post("/withdraws", content=b"{}", headers=key("w"))
    assert (again.status_code, again.text) == (201, "done 2")


def test_a_reconciled_request_is_replayed_with_the_built_response(
    client: httpx.Client, shop: Shop, journal: sync.Journal
) -> None:
    shop.statuses = [503]
    assert client.post("/pay", content=b"{}", headers=key("k")).status_code == 503
    body = b'{"call": 1, "charge": "ch_1"}'
    built = replayable_response(201, body, content_type="application/json", headers={"etag": '"1"'})

    def check(view: RecordView) -> Happened | Unknown:
        return Happened("ch_1", result=built)

    assert len(journal.reconcile(check).happened) == 1
    replays = [client.post("/pay", content=b"{}", headers=key("k")) for _ in range(2)]
    for replay in replays:
        assert (replay.status_code, replay.content) == (201, body)
        assert replay.headers["content-type"] == "application/json"
        assert replay.headers["etag"] == '"1"'
        assert replay.headers["idempotent-replayed"] == "true"
    assert replays[0].headers.raw == replays[1].headers.raw
    assert len(shop.effects) == 1


def test_replayable_response_is_the_format_the_middleware_stores(journal: sync.Journal) -> None:
    body = json.dumps({"order": 7, "note": "caf\u00e9"}).encode()

    def app(environ: Environ, start_response: Any) -> list[bytes]:
        headers = [
            ("Content-Type", "application/json"),
            ("Location", "/orders/7"),
            ("Set-Cookie", "session=secret"),
        ]
        start_response("201 Created", headers)
        return [body]

    with client_for(IdempotencyMiddleware(app, journal=journal)) as client:
        client.post("/", content=b"", headers=key("r"))
    built = replayable_response(
        201, body, headers={"Location": "/orders/7"}, content_type="application/json"
    )
    assert only_record(journal).result == built


# ---------------------------------------------------------------------------- the iterable


def call(
    app: Any,
    path: str,
    body: bytes,
    headers: dict[str, str],
    extra: Environ | None = None,
) -> tuple[str, list[tuple[str, str]], bytes]:
    """One request through ``app`` as a WSGI server makes it; the iterable drained and
    closed."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    written: list[bytes] = []

    def start_response(status: str, response_headers: Any, exc_info: Any = None) -> Any:
        started.append((status, list(response_headers)))
        return written.append

    result = app(environ_for(path, body, headers, extra), start_response)
    try:
        chunks = b"".join(written) + b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    status, response_headers = started[-1]
    return status, [(name.lower(), value) for name, value in response_headers], chunks


def environ_for(
    path: str, body: bytes, headers: dict[str, str], extra: Environ | None = None
) -> Environ:
    environ: Environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
    }
    if not (extra or {}).get("wsgi.input_terminated"):
        environ["CONTENT_LENGTH"] = str(len(body))
    for name, value in headers.items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    environ.update(extra or {})
    return environ


class Stream:
    """An application whose response is three chunks, each handed over on demand."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.closed = False
        self.produced = 0

    def __call__(self, environ: Environ, start_response: Any) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        try:
            for number in range(3):
                if number == self.fail_at:
                    raise ConnectionError(f"the provider hung up at chunk {number}")
                self.produced += 1
                yield f"chunk {number};".encode()
        finally:
            self.closed = True


def test_a_streamed_response_completes_only_with_its_last_chunk(journal: sync.Journal) -> None:
    stream = Stream()
    middleware = IdempotencyMiddleware(stream, journal=journal)
    started: list[str] = []
    result = middleware(
        environ_for("/s", b"", key("s")), lambda status, headers, exc=None: started.append(status)
    )
    seen = []
    for chunk in result:
        # Until the application has no more, the chunk before the last is held back and
        # the record is not complete.
        seen.append((chunk, only_record(journal).status))
    result.close()
    assert seen == [
        (b"chunk 0;", "started"),
        (b"chunk 1;", "started"),
        (b"chunk 2;", "succeeded"),
    ]
    assert started == ["200 OK"]
    status, headers, body = call(middleware, "/s", b"", key("s"))
    assert (status, body) == ("200 OK", b"chunk 0;chunk 1;chunk 2;")
    assert ("idempotent-replayed", "true") in headers
    assert stream.produced == 3


def test_a_response_the_server_closes_early_needs_review(journal: sync.Journal) -> None:
    stream = Stream()
    middleware = IdempotencyMiddleware(stream, journal=journal)
    result = middleware(environ_for("/s", b"", key("s")), lambda *args: None)
    first = next(iter(result))  # the client leaves after the first chunk
    result.close()
    assert first == b"chunk 0;"
    assert stream.closed
    view = only_record(journal)
    assert view.status == "needs_review"
    assert view.review_reason == "the server closed the response before the application finished it"


def test_a_failure_after_bytes_went_out_goes_on_to_the_server(journal: sync.Journal) -> None:
    stream = Stream(fail_at=2)
    middleware = IdempotencyMiddleware(stream, journal=journal)
    result = iter(middleware(environ_for("/s", b"", key("s")), lambda *args: None))
    assert next(result) == b"chunk 0;"
    with pytest.raises(ConnectionError, match="chunk 2"):
        next(result)
    assert stream.closed
    view = only_record(journal)
    assert view.status == "needs_review"
    assert "ConnectionError: the provider hung up at chunk 2" in (view.review_reason or "")


def test_a_failure_before_any_byte_replaces_the_started_response(journal: sync.Journal) -> None:
    stream = Stream(fail_at=1)
    middleware = IdempotencyMiddleware(stream, journal=journal)
    calls: list[tuple[str, Any]] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        calls.append((status, exc_info))
        return lambda data: None

    body = b"".join(middleware(environ_for("/s", b"", key("s")), start_response))
    assert [status for status, _ in calls] == ["200 OK", "500 Internal Server Error"]
    assert isinstance(calls[1][1][1], ConnectionError)  # replaced as PEP 3333 allows
    assert json.loads(body)["title"] == "Internal Server Error"
    assert only_record(journal).status == "needs_review"


def test_what_write_sends_is_recorded_and_replayed(journal: sync.Journal) -> None:
    def legacy(environ: Environ, start_response: Any) -> list[bytes]:
        write = start_response("201 Created", [("Content-Type", "text/plain")])
        write(b"written, ")
        return [b"then returned"]

    middleware = IdempotencyMiddleware(legacy, journal=journal)
    assert call(middleware, "/w", b"", key("w"))[2] == b"written, then returned"
    status, headers, body = call(middleware, "/w", b"", key("w"))
    assert (status, body) == ("201 Created", b"written, then returned")
    assert ("idempotent-replayed", "true") in headers


def test_a_system_exit_goes_on_after_the_record_is_marked(journal: sync.Journal) -> None:
    def timed_out(environ: Environ, start_response: Any) -> list[bytes]:
        raise SystemExit(1)  # what gunicorn raises in a worker past its timeout

    middleware = IdempotencyMiddleware(timed_out, journal=journal)
    with pytest.raises(SystemExit):
        call(middleware, "/t", b"", key("t"))
    assert only_record(journal).status == "needs_review"


# ---------------------------------------------------------------------------- the journal's life


def test_the_journal_opens_once_per_process_on_first_use(
    shop: Shop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opens: list[str] = []
    real_open = sync.Journal.open

    def counting_open(where: str, **options: Any) -> sync.Journal:
        opens.append(where)
        threading.Event().wait(0.01)
        return real_open(where, **options)

    monkeypatch.setattr(sync.Journal, "open", counting_open)
    location = str(tmp_path / "journal")
    middleware = IdempotencyMiddleware(shop, location=location)
    assert middleware.journal is None
    answers: list[int] = []
    with client_for(middleware) as client:
        threads = [
            threading.Thread(
                target=lambda n=n: answers.append(
                    client.post("/orders", content=b"c", headers=key(f"c{n}")).status_code
                )
            )
            for n in range(10)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert answers == [201] * 10
    assert opens == [location]
    middleware.close()
    assert middleware.journal is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("opened_before", [False, True])
def test_a_forked_child_serves_with_the_journal(
    shop: Shop, tmp_path: Path, opened_before: bool
) -> None:
    location = str(tmp_path / "journal")
    middleware = IdempotencyMiddleware(shop, location=location)
    if opened_before:  # gunicorn --preload with a journal opened at import
        middleware.open()
    with middleware._opening:  # a lock held by another thread at the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            code = 1
            try:
                status, _, _ = call(middleware, "/orders", b"1", key("f"))
                code = 0 if status.startswith("201") else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    replay_status, headers, _ = call(middleware, "/orders", b"1", key("f"))
    assert replay_status.startswith("201")
    assert ("idempotent-replayed", "true") in headers
    assert shop.effects == []  # the effect happened in the child, once
    middleware.close()
