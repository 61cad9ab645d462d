"""The read-only web viewer: pages, the JSON API, refusals, headers, tokens and serving,
on the file and SQLite stores, on asyncio and trio."""

from __future__ import annotations

import base64
import contextlib
import html
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

import itemjournal
from itemjournal import InvalidArgument, Journal
from itemjournal._model.identity import identity_digest
from itemjournal._operator.viewer import app as viewer
from itemjournal._operator.viewer.app import create_app, serve

DEFINITION = itemjournal.definition_digest("viewer-test-v1")
SCRIPT = "<script>alert(1)</script>"
SECRET_RESULT = "the first response body, never served"
STORES = ("file", "sqlite")
RECORDS = 240  # the shared journal: a few hundred records, every status
TOKEN = "s3cret-viewer-token-0123456789"
SECURITY = {
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
ROW = re.compile(r'<tr class="record[^"]*" data-status="([a-z_]+)"(?: data-key="([0-9a-f]{64})")?')
NEXT = re.compile(r'<a class="next" rel="next" href="([^"]+)"')
VIEW_FIELDS = {
    "key",
    "identity",
    "status",
    "receipt",
    "result_bytes",
    "attempt",
    "created_at",
    "updated_at",
    "owner",
    "owner_alive",
    "review_reason",
}
OWNER_FIELDS = {"host", "pid", "started_at", "process"}
EVENT_FIELDS = {"at", "event", "status", "attempt", "note"}


# --------------------------------------------------------------------------- journals


def location_of(store: str, directory: Path) -> str:
    if store == "sqlite":
        return f"sqlite://{directory}/journal.db"
    return str(directory / "journal")


def identity_of(number: int) -> tuple[str, str, str, str]:
    scope = ("shop", "ops")[number % 2]
    program = ("billing", "mail", "stock")[number % 3]
    job = ("charge", "refund")[(number // 6) % 2]
    return (scope, program, job, f"item-{number:04d}")


def status_of(number: int) -> str:
    return ("succeeded", "needs_review", "released", "started", "succeeded")[number % 5]


async def fill(journal: Journal, count: int, *, first: int = 0) -> None:
    """``count`` records of every status (``status_of``), written concurrently."""
    limiter = anyio.CapacityLimiter(32)

    async def one(number: int) -> None:
        async with limiter:
            identity = identity_of(number)
            claim = await journal.begin(identity, {"n": number}, DEFINITION)
            assert isinstance(claim, itemjournal.Claim)
            status = status_of(number)
            if status == "succeeded":
                result = SECRET_RESULT if number % 10 == 0 else None
                await journal.complete(claim, f"rcpt-{number}", result=result)
            elif status in ("needs_review", "released"):
                reason = SCRIPT if number == 1 else f"provider timed out for {number}"
                await journal.mark_review(identity, reason)
                if status == "released":
                    await journal.resolve(identity, retry=True, note=f"retry <b>{number}</b>")

    async with anyio.create_task_group() as group:
        for number in range(first, first + count):
            group.start_soon(one, number)


def build(location: str, count: int) -> None:
    """Make a journal of ``count`` records (outside any running event loop)."""

    async def main() -> None:
        journal = await Journal.open(location)
        try:
            await fill(journal, count)
        finally:
            await journal.aclose()

    anyio.run(main)


@pytest.fixture(scope="module", params=STORES)
def shared_location(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A journal of ``RECORDS`` records, made once per store; the viewer only reads it."""
    directory = tmp_path_factory.mktemp(f"viewer-{request.param}")
    location = location_of(str(request.param), directory)
    build(location, RECORDS)
    return location


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def own_location(store: str, tmp_path: Path) -> str:
    """A location for one test's own journal (not yet created)."""
    return location_of(store, tmp_path)


@contextlib.asynccontextmanager
async def viewing(
    location: str, *, token: str | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[Journal, httpx.AsyncClient]]:
    journal = await Journal.open(location)
    try:
        app = create_app(journal, token=token)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
            yield journal, client
    finally:
        await journal.aclose()


def rows(page: str) -> list[tuple[str, str | None]]:
    """(status, key) of each row of a listing page."""
    return [(status, key or None) for status, key in ROW.findall(page)]


def next_link(page: str) -> str | None:
    found = NEXT.findall(page)
    assert len(found) <= 1
    return html.unescape(found[0]) if found else None


def check_headers(response: httpx.Response) -> None:
    for name, value in SECURITY.items():
        assert response.headers.get(name) == value, (name, response.url)
    assert "server" not in response.headers or "uvicorn" not in response.headers["server"]


# --------------------------------------------------------------------------- pages and API


@pytest.mark.anyio
async def test_counts_on_the_page_and_in_the_api(shared_location: str) -> None:
    async with viewing(shared_location) as (journal, client):
        expected = await journal.counts()
        assert expected["started"] > 0
        assert expected["needs_review"] > 0
        assert expected["released"] > 0
        assert expected["invalid"] == 0
        response = await client.get("/api/counts")
        assert response.status_code == 200
        check_headers(response)
        assert response.json() == {"counts": expected, "total": RECORDS}
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        check_headers(page)
        for status, number in expected.items():
            shown = re.search(rf'data-count="{status}">\s*<span class="n">(\d+)</span>', page.text)
            assert shown is not None, status
            assert int(shown.group(1)) == number
        assert f'<span class="n">{RECORDS}</span> <span class="label">all</span>' in page.text


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("query", "wanted"),
    [
        ("status=needs_review", {"status": "needs_review"}),
        ("status=started&scope=ops", {"status": "started", "scope": "ops"}),
        ("program=mail&job=refund", {"program": "mail", "job": "refund"}),
        (
            "scope=shop&program=stock&job=charge",
            {"scope": "shop", "program": "stock", "job": "charge"},
        ),
    ],
)
async def test_filters_show_only_matching_records(
    shared_location: str, query: str, wanted: dict[str, str]
) -> None:
    def matches(number: int) -> bool:
        scope, program, job, _ = identity_of(number)
        have = {"status": status_of(number), "scope": scope, "program": program, "job": job}
        return all(have[name] == value for name, value in wanted.items())

    expected = {
        identity_digest(itemjournal.Identity(*identity_of(n))) for n in range(RECORDS) if matches(n)
    }
    assert 0 < len(expected) < RECORDS
    async with viewing(shared_location) as (_, client):
        body = (await client.get(f"/api/records?{query}&limit=500")).json()
        assert (
            body["filters"]
            == {"status": None, "scope": None, "program": None, "job": None} | wanted
        )
        assert body["next"] is None
        assert {record["key"] for record in body["records"]} == expected
        for record in body["records"]:
            assert all(
                record["status" if name == "status" else "identity"][name] == value
                if name != "status"
                else record["status"] == value
                for name, value in wanted.items()
            )
        page = await client.get(f"/?{query}&limit=500")
        assert page.status_code == 200
        shown = rows(page.text)
        assert {key for _, key in shown} == expected
        if "status" in wanted:
            assert {status for status, _ in shown} == {wanted["status"]}
            assert f'<option value="{wanted["status"]}" selected>' in page.text


@pytest.mark.anyio
async def test_every_record_appears_once_across_the_pages(shared_location: str) -> None:
    everything = {identity_digest(itemjournal.Identity(*identity_of(n))) for n in range(RECORDS)}
    async with viewing(shared_location) as (_, client):
        # The JSON API, by 50 (the default) and by 7.
        for limit, pages_wanted in ((None, -(-RECORDS // 50)), (7, -(-RECORDS // 7))):
            seen: list[str] = []
            after: str | None = None
            pages = 0
            while True:
                params = {} if after is None else {"after": after}
                if limit is not None:
                    params["limit"] = str(limit)
                body = (await client.get("/api/records", params=params)).json()
                pages += 1
                assert len(body["records"]) <= (limit or 50)
                keys = [record["key"] for record in body["records"]]
                assert keys == sorted(keys)  # key order
                seen.extend(keys)
                after = body["next"]
                if after is None:
                    break
                assert after == keys[-1]
            assert pages == pages_wanted
            assert len(seen) == len(set(seen)) == RECORDS
            assert set(seen) == everything
        # The pages, following their "next page" links.
        seen = []
        url: str | None = "/"
        pages = 0
        while url is not None:
            page = await client.get(url)
            assert page.status_code == 200
            pages += 1
            keys = [key for _, key in rows(page.text)]
            assert len(keys) <= 50
            seen.extend(key for key in keys if key is not None)
            if pages > 1:
                assert '<a class="first" href="/">' in page.text
            url = next_link(page.text)
        assert pages == -(-RECORDS // 50)
        assert len(seen) == len(set(seen)) == RECORDS
        assert set(seen) == everything


@pytest.mark.anyio
async def test_next_page_links_keep_the_filters(shared_location: str) -> None:
    async with viewing(shared_location) as (_, client):
        first = await client.get("/?status=succeeded&scope=shop&limit=5")
        link = next_link(first.text)
        assert link is not None
        assert link.startswith("/?status=succeeded&scope=shop&limit=5&after=")
        second = await client.get(link)
        assert {status for status, _ in rows(second.text)} == {"succeeded"}
        assert not set(rows(first.text)) & set(rows(second.text))


@pytest.mark.anyio
async def test_detail_page_and_api(shared_location: str) -> None:
    reviewed = itemjournal.Identity(*identity_of(1))  # needs_review, reason SCRIPT
    succeeded = itemjournal.Identity(*identity_of(0))  # succeeded, with a result
    started = itemjournal.Identity(*identity_of(3))
    async with viewing(shared_location) as (journal, client):
        view = await journal.inspect(succeeded)
        body = (await client.get("/api/records/" + "/".join(succeeded))).json()
        assert set(body) == VIEW_FIELDS | {"history"}
        assert body["key"] == view.key == identity_digest(succeeded)
        assert body["identity"] == dict(succeeded._asdict())
        assert body["status"] == "succeeded"
        assert body["receipt"] == "rcpt-0"
        assert body["result_bytes"] == len(SECRET_RESULT.encode())
        assert SECRET_RESULT not in str(body)
        assert body["attempt"] == 1
        assert body["created_at"] == view.created_at
        assert body["updated_at"] == view.updated_at
        assert set(body["owner"]) == OWNER_FIELDS
        assert body["owner"]["pid"] == os.getpid()
        assert body["owner_alive"] is None
        assert [event["event"] for event in body["history"]] == ["begin", "complete"]
        assert all(set(event) == EVENT_FIELDS for event in body["history"])

        page = await client.get("/records/" + "/".join(succeeded))
        assert page.status_code == 200
        check_headers(page)
        assert f"{len(SECRET_RESULT.encode())} bytes stored (not shown)" in page.text
        assert SECRET_RESULT not in page.text
        assert "<code>rcpt-0</code>" in page.text
        assert view.key in page.text

        alive = (await client.get("/api/records/" + "/".join(started))).json()
        assert alive["status"] == "started"
        assert alive["owner_alive"] is True
        page = await client.get("/records/" + "/".join(started))
        assert '<span class="alive" id="owner-alive">alive</span>' in page.text

        body = (await client.get("/api/records/" + "/".join(reviewed))).json()
        assert body["status"] == "needs_review"
        assert body["review_reason"] == SCRIPT
        assert [event["event"] for event in body["history"]] == ["begin", "mark_review"]


@pytest.mark.anyio
async def test_free_text_is_escaped(shared_location: str) -> None:
    reviewed = "/".join(identity_of(1))
    released = "/".join(identity_of(2))
    async with viewing(shared_location) as (_, client):
        for url in (f"/records/{reviewed}", "/?status=needs_review&limit=500"):
            page = await client.get(url)
            assert page.status_code == 200
            assert "<script" not in page.text.lower()
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        page = await client.get(f"/records/{released}")
        assert "retry &lt;b&gt;2&lt;/b&gt;" in page.text
        assert "<b>" not in page.text


@pytest.mark.anyio
async def test_listing_shapes(shared_location: str) -> None:
    async with viewing(shared_location) as (_, client):
        body = (await client.get("/api/records?limit=3")).json()
        assert set(body) == {"filters", "after", "limit", "records", "next"}
        assert body["limit"] == 3
        assert body["after"] is None
        assert len(body["records"]) == 3
        for record in body["records"]:
            assert set(record) == VIEW_FIELDS
        assert body["next"] == body["records"][-1]["key"]
        head = await client.head("/api/records?limit=3")
        assert head.status_code == 200
        check_headers(head)
        css = await client.get("/static/viewer.css")
        assert css.status_code == 200
        assert css.headers["content-type"] == "text/css; charset=utf-8"
        assert "badge" in css.text
        check_headers(css)
        icon = await client.get("/static/favicon.svg")
        assert icon.status_code == 200
        assert icon.headers["content-type"] == "image/svg+xml"
        assert icon.text.startswith("<svg")
        check_headers(icon)


# --------------------------------------------------------------------------- bad input


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("query", "code", "words"),
    [
        ("status=lost", "INVALID_ARGUMENT", "status is one of"),
        ("status=invalid", "INVALID_ARGUMENT", "status is one of"),
        ("scope=bad%20label", "INVALID_LABEL", "scope 'bad label'"),
        ("program=-dash", "INVALID_LABEL", "program '-dash'"),
        ("job=" + "j" * 81, "INVALID_LABEL", "job"),
        ("after=xyz", "INVALID_ARGUMENT", "after is a record key"),
        ("after=" + "A" * 64, "INVALID_ARGUMENT", "after is a record key"),
        ("limit=0", "INVALID_ARGUMENT", "limit is a whole number"),
        ("limit=501", "INVALID_ARGUMENT", "limit is a whole number"),
        ("limit=%D9%A3", "INVALID_ARGUMENT", "limit is a whole number"),
        ("colour=red", "INVALID_ARGUMENT", "unknown query parameter 'colour'"),
        ("status=started&status=released", "INVALID_ARGUMENT", "given 2 times"),
    ],
)
async def test_bad_query_input_is_a_400_naming_its_code(
    shared_location: str, query: str, code: str, words: str
) -> None:
    async with viewing(shared_location) as (_, client):
        for path in ("/api/records", "/"):
            response = await client.get(f"{path}?{query}")
            assert response.status_code == 400, (path, query)
            check_headers(response)
            if path == "/api/records":
                error = response.json()["error"]
                assert error["code"] == code
                assert words in error["message"]
            else:
                assert f'<code id="code">{code}</code>' in response.text
                assert words in html.unescape(response.text)


@pytest.mark.anyio
async def test_empty_form_fields_mean_no_filter(shared_location: str) -> None:
    async with viewing(shared_location) as (_, client):
        page = await client.get("/?status=&scope=&program=&job=")
        assert page.status_code == 200
        assert len(rows(page.text)) == 50


@pytest.mark.anyio
async def test_bad_labels_in_a_record_path_are_a_400(shared_location: str) -> None:
    async with viewing(shared_location) as (_, client):
        for prefix in ("/records", "/api/records"):
            response = await client.get(f"{prefix}/shop/billing/charge/bad%20item")
            assert response.status_code == 400
            assert "INVALID_LABEL" in response.text
            check_headers(response)


@pytest.mark.anyio
async def test_unknown_records_and_paths_are_404(shared_location: str) -> None:
    async with viewing(shared_location) as (_, client):
        response = await client.get("/api/records/shop/billing/charge/no-such-item")
        assert response.status_code == 404
        assert response.json() == {
            "error": {
                "code": "NOT_FOUND",
                "message": "no record for shop/billing/charge/no-such-item",
            }
        }
        page = await client.get("/records/shop/billing/charge/no-such-item")
        assert page.status_code == 404
        assert '<code id="code">NOT_FOUND</code>' in page.text
        check_headers(page)
        for path in ("/nope", "/api/nope", "/records/a/b/c", "/static/other.css"):
            response = await client.get(path)
            assert response.status_code == 404, path
            check_headers(response)
        assert (await client.get("/api/nope")).json()["error"]["code"] == "NOT_FOUND"


@pytest.mark.anyio
async def test_a_storage_failure_is_a_503_and_a_bug_a_bare_500(
    shared_location: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with viewing(shared_location) as (journal, client):

        async def unreadable() -> dict[str, int]:
            raise itemjournal.StorageFailed("cannot list the journal", errno=5)

        monkeypatch.setattr(journal, "counts", unreadable)
        failed = await client.get("/api/counts")
        assert failed.status_code == 503
        assert failed.json()["error"] == {
            "code": "STORAGE_FAILED",
            "message": "cannot list the journal",
        }
        page = await client.get("/counts")
        assert page.status_code == 503
        check_headers(page)
        monkeypatch.setattr(journal.store, "tally", unreadable)  # what ``/`` counts with
        page = await client.get("/")
        assert page.status_code == 503
        check_headers(page)

        async def broken() -> dict[str, int]:
            raise RuntimeError("a secret detail")

        monkeypatch.setattr(journal.store, "tally", broken)
        failed = await client.get("/")
        assert failed.status_code == 500
        assert "a secret detail" not in failed.text
        assert '<code id="code">INTERNAL_ERROR</code>' in failed.text
        check_headers(failed)
        assert "a secret detail" in caplog.text


@pytest.mark.anyio
async def test_links_keep_the_prefix_of_a_mounted_viewer(shared_location: str) -> None:
    journal = await Journal.open(shared_location)
    try:
        transport = httpx.ASGITransport(app=create_app(journal), root_path="/journal")
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            page = await client.get("/journal/?status=started&limit=2")
            assert page.status_code == 200
            assert 'href="/journal/static/viewer.css"' in page.text
            assert 'href="/journal/records/' in page.text
            link = next_link(page.text)
            assert link is not None
            assert link.startswith("/journal/?status=started&limit=2&after=")
            assert (await client.get(link)).status_code == 200
            missing = await client.get("/journal/api/records/a/b/c/d")
            assert missing.json()["error"]["code"] == "NOT_FOUND"
    finally:
        await journal.aclose()


def test_times_are_shown_to_the_second() -> None:
    from itemjournal._operator.viewer import templates as viewer

    assert viewer._when("2026-11-30T18:25:24.513409+00:00") == "2026-11-30 18:25:24"
    assert viewer._when(None) == "—"


# --------------------------------------------------------------------------- read-only


def snapshot(location: str) -> object:
    """Every byte the store keeps (files), or every row (SQLite); read in a worker thread."""
    if location.startswith("sqlite://"):
        with contextlib.closing(sqlite3.connect(location[len("sqlite://") :])) as connection:
            return connection.execute("SELECT * FROM itemjournal_records ORDER BY 1").fetchall()
    found: dict[str, bytes] = {}
    for folder, _, names in os.walk(location):
        for name in names:
            path = Path(folder, name)
            found[str(path)] = path.read_bytes()
    return found


@pytest.mark.anyio
async def test_every_other_method_is_refused_and_changes_nothing(own_location: str) -> None:
    journal = await Journal.open(own_location)
    try:
        await fill(journal, 12)
    finally:
        await journal.aclose()
    item = "/".join(identity_of(3))  # started
    paths = (
        "/",
        "/?status=started",
        "/api/counts",
        "/api/records",
        f"/api/records/{item}",
        f"/records/{item}",
        "/static/viewer.css",
        "/nope",
        "/api",
    )
    before = await anyio.to_thread.run_sync(snapshot, own_location)
    async with viewing(own_location) as (journal, client):
        views_before = (await client.get("/api/records")).json()
        refused = 0
        for path in paths:
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND"):
                response = await client.request(
                    method, path, json={"status": "succeeded", "receipt": "forged"}
                )
                assert response.status_code == 405, (method, path)
                assert response.headers["allow"] == "GET, HEAD"
                check_headers(response)
                refused += 1
        assert (await client.post("/api/records")).json()["error"]["code"] == "METHOD_NOT_ALLOWED"
        assert (await client.get("/api/records")).json() == views_before
        assert (await journal.inspect(identity_of(3))).status == "started"
    assert await anyio.to_thread.run_sync(snapshot, own_location) == before
    print(f"{refused} non-GET requests refused, store unchanged")


# --------------------------------------------------------------------------- invalid records


def corrupt(location: str, identity: tuple[str, str, str, str]) -> None:
    """Make the stored record of ``identity`` unreadable (run in a worker thread)."""
    digest = identity_digest(itemjournal.Identity(*identity))
    if location.startswith("sqlite://"):
        database = location[len("sqlite://") :]
        with contextlib.closing(sqlite3.connect(database)) as connection, connection:
            connection.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                (b"{ not a record <script>", digest),
            )
        return
    path = Path(location, digest[:2], f"{digest}.json")
    path.write_bytes(b"{ not a record <script>")


@pytest.mark.anyio
async def test_an_invalid_record_is_a_row_marked_invalid(own_location: str) -> None:
    journal = await Journal.open(own_location)
    try:
        await fill(journal, 20)
    finally:
        await journal.aclose()
    broken = identity_of(5)  # succeeded
    key = identity_digest(itemjournal.Identity(*broken))
    await anyio.to_thread.run_sync(corrupt, own_location, broken)
    async with viewing(own_location) as (_, client):
        counts = (await client.get("/api/counts")).json()["counts"]
        assert counts["invalid"] == 1
        body = (await client.get("/api/records")).json()
        assert len(body["records"]) == 20
        invalid = [record for record in body["records"] if record["status"] == "invalid"]
        assert len(invalid) == 1
        assert set(invalid[0]) == {"key", "status", "error"}
        assert invalid[0]["key"] == key
        assert invalid[0]["error"]["code"] == "RECORD_INVALID"
        # Whatever the filter asks, a record whose status is unknown is still listed.
        filtered = (await client.get("/api/records?status=released")).json()["records"]
        assert "invalid" in {record["status"] for record in filtered}
        page = await client.get("/")
        assert page.status_code == 200
        assert ("invalid", key) in rows(page.text)
        assert len(rows(page.text)) == 20
        assert "<code>RECORD_INVALID</code>" in page.text
        assert "<script" not in page.text
        detail = await client.get("/records/" + "/".join(broken))
        assert detail.status_code == 200
        assert '<span class="badge invalid" id="status">invalid</span>' in detail.text
        body = (await client.get("/api/records/" + "/".join(broken))).json()
        assert body["status"] == "invalid"
        assert body["key"] == key
        assert body["identity"] == dict(itemjournal.Identity(*broken)._asdict())
        assert body["error"]["code"] == "RECORD_INVALID"


@pytest.mark.anyio
async def test_a_page_ending_on_an_invalid_record_still_pages_on(own_location: str) -> None:
    journal = await Journal.open(own_location)
    try:
        await fill(journal, 9)
    finally:
        await journal.aclose()
    keys = sorted(identity_digest(itemjournal.Identity(*identity_of(n))) for n in range(9))
    by_key = {identity_digest(itemjournal.Identity(*identity_of(n))): n for n in range(9)}
    await anyio.to_thread.run_sync(corrupt, own_location, identity_of(by_key[keys[2]]))
    async with viewing(own_location) as (_, client):
        seen: list[str] = []
        after: str | None = None
        while True:
            body = (
                await client.get(
                    "/api/records", params={"limit": "3"} | ({"after": after} if after else {})
                )
            ).json()
            seen.extend(record["key"] for record in body["records"])
            after = body["next"]
            if after is None:
                break
        assert seen == keys


# --------------------------------------------------------------------------- tokens and hosts


@pytest.mark.anyio
async def test_a_token_is_checked_on_every_request(own_location: str) -> None:
    journal = await Journal.open(own_location)
    await journal.aclose()
    async with viewing(own_location, token=TOKEN, host="viewer.example") as (_, client):
        for path in ("/", "/api/counts", "/static/viewer.css", "/nope"):
            missing = await client.get(path)
            assert missing.status_code == 401, path
            assert (
                missing.headers["www-authenticate"] == 'Basic realm="itemjournal", charset="UTF-8"'
            )
            check_headers(missing)
            assert own_location not in missing.text  # nothing about the journal before the token
        assert (await client.get("/api/counts")).json()["error"]["code"] == "TOKEN_REQUIRED"

        def bearer(value: str) -> dict[str, str]:
            return {"authorization": f"Bearer {value}"}

        def basic(user: str, password: str) -> dict[str, str]:
            raw = base64.b64encode(f"{user}:{password}".encode()).decode()
            return {"authorization": f"Basic {raw}"}

        wrong = await client.get("/api/counts", headers=bearer(TOKEN + "x"))
        assert wrong.status_code == 403
        assert wrong.json()["error"]["code"] == "TOKEN_WRONG"
        assert (await client.get("/", headers=bearer(TOKEN[:-1]))).status_code == 403
        assert (await client.get("/", headers=bearer(""))).status_code == 403
        again = await client.get("/", headers=basic("operator", "nope"))
        assert again.status_code == 401  # a browser asks again
        assert "www-authenticate" in again.headers
        assert (await client.get("/", headers=basic("", TOKEN + " "))).status_code == 401
        assert (await client.get("/", headers={"authorization": "Basic !!!"})).status_code == 401
        assert (
            await client.get("/", headers={"authorization": f"Token {TOKEN}"})
        ).status_code == 401
        assert (await client.get("/", headers=basic(TOKEN, ""))).status_code == 401
        # The token is never read from the URL.
        assert (await client.get(f"/api/counts?token={TOKEN}")).status_code == 401

        right = await client.get("/api/counts", headers=bearer(TOKEN))
        assert right.status_code == 200
        check_headers(right)
        assert (await client.get("/", headers=basic("anyone", TOKEN))).status_code == 200
        assert (await client.get("/static/viewer.css", headers=basic("", TOKEN))).status_code == 200
        # A method other than GET is refused before the token is even looked at.
        assert (await client.post("/", headers=bearer(TOKEN))).status_code == 405
        assert (await client.delete("/")).status_code == 405


@pytest.mark.anyio
async def test_without_a_token_only_loopback_host_names_are_answered(own_location: str) -> None:
    journal = await Journal.open(own_location)
    await journal.aclose()
    async with viewing(own_location) as (_, client):
        for host in ("127.0.0.1:8080", "localhost", "LOCALHOST:1", "[::1]:8080", "127.1.2.3"):
            response = await client.get("/api/counts", headers={"host": host})
            assert response.status_code == 200, host
        for host in (
            "rebound.example",
            "rebound.example:8080",
            "10.0.0.1",
            "[2001:db8::1]:80",
            "[::1",
            "",
        ):
            response = await client.get("/api/counts", headers={"host": host})
            assert response.status_code == 400, host
            assert response.json()["error"]["code"] == "HOST_REFUSED"
            check_headers(response)


def test_create_app_refuses_a_bad_token() -> None:
    for token in ("", "with space", "tab\t", "naïve"):
        with pytest.raises(InvalidArgument) as caught:
            create_app("/nowhere", token=token)
        assert caught.value.code == "INVALID_ARGUMENT"


# --------------------------------------------------------------------------- lifespan


@pytest.mark.anyio
async def test_a_location_is_opened_at_startup_and_closed_at_shutdown(own_location: str) -> None:
    journal = await Journal.open(own_location)
    try:
        await fill(journal, 3)
    finally:
        await journal.aclose()
    app = create_app(own_location)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        before = await client.get("/api/counts")
        assert before.status_code == 503  # not started: the journal is not open
        assert before.json()["error"]["message"] == "the journal is not open"
        async with app.router.lifespan_context(app):
            counts = (await client.get("/api/counts")).json()
            assert counts["total"] == 3
        after = await client.get("/")
        assert after.status_code == 503
        check_headers(after)


@pytest.mark.anyio
async def test_a_missing_journal_is_refused_never_created(store: str, tmp_path: Path) -> None:
    location = location_of(store, tmp_path / "absent")
    app = create_app(location)
    with pytest.raises(InvalidArgument) as caught:
        async with app.router.lifespan_context(app):
            pass
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "the viewer never creates one" in caught.value.message
    assert not (tmp_path / "absent").exists()


# --------------------------------------------------------------------------- serve


@pytest.fixture
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(viewer.TOKEN_ENV, raising=False)


@pytest.mark.usefixtures("no_token_env")
@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "192.0.2.10", "viewer.example", "127.0.0.1.example"]
)
def test_serve_refuses_a_non_loopback_bind_without_a_token(host: str, tmp_path: Path) -> None:
    location = str(tmp_path / "journal")
    with pytest.raises(InvalidArgument) as caught:
        serve(location, host=host, port=free_port())
    assert caught.value.code == "INVALID_ARGUMENT"
    assert f"refusing to serve on {host}" in caught.value.message
    assert "token" in caught.value.message
    assert not Path(location).exists()


@pytest.mark.usefixtures("no_token_env")
def test_serve_warns_when_it_listens_beyond_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidArgument) as caught:  # stops at the missing journal
        serve(str(tmp_path / "absent"), host="0.0.0.0", port=free_port(), token=TOKEN)
    assert "no journal directory" in caught.value.message
    assert "warning: the viewer listens on 0.0.0.0" in capsys.readouterr().err


def test_serve_takes_the_token_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(viewer.TOKEN_ENV, TOKEN)
    with pytest.raises(InvalidArgument) as caught:
        serve(str(tmp_path / "absent"), host="0.0.0.0", port=free_port())
    assert "refusing" not in caught.value.message
    assert "warning" in capsys.readouterr().err


@pytest.mark.usefixtures("no_token_env")
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"port": -1}, "port is 0 to 65535"),
        ({"port": 70000}, "port is 0 to 65535"),
        ({"port": True}, "port is 0 to 65535"),
        ({"host": ""}, "host is an address"),
        ({"token": "two words"}, "printable ASCII"),
    ],
)
def test_serve_refuses_bad_arguments(options: dict[str, Any], words: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as caught:
        serve(str(tmp_path), **options)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert words in caught.value.message


@pytest.mark.usefixtures("no_token_env")
@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"])
def test_serve_needs_no_token_on_loopback(host: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as caught:  # stops at the missing journal
        serve(str(tmp_path / "absent"), host=host, port=free_port())
    assert "no journal directory" in caught.value.message
    assert not (tmp_path / "absent").exists()
    sqlite = f"sqlite://{tmp_path}/absent.db"
    with pytest.raises(InvalidArgument) as caught:
        serve(sqlite, host=host, port=free_port())
    assert "no SQLite journal" in caught.value.message
    assert not (tmp_path / "absent.db").exists()


def test_serve_reports_a_journal_it_cannot_open(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as caught:
        serve("relative/journal", port=free_port())
    assert caught.value.code == "ABSOLUTE_ROOT_REQUIRED"


def has_ipv6_loopback() -> bool:
    try:
        free_port("::1")
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def wait_until_served(
    url: str,
    *,
    deadline: float,
    headers: dict[str, str] | None = None,
    alive: Callable[[], bool] = lambda: True,
) -> httpx.Response:
    last: Exception | None = None
    while time.monotonic() < deadline and alive():
        try:
            return httpx.get(url, headers=headers, timeout=2.0)
        except httpx.TransportError as error:
            last = error
            time.sleep(0.05)
    raise AssertionError(f"nothing answered at {url}: {last!r}")


@pytest.fixture
def recorded_servers(monkeypatch: pytest.MonkeyPatch) -> list[uvicorn.Server]:
    """The uvicorn servers ``serve`` makes, so that a test can stop one."""
    made: list[uvicorn.Server] = []

    class Recorded(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            made.append(self)

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    return made


@pytest.mark.usefixtures("no_token_env")
def test_serve_in_a_thread_answers_and_stops(
    tmp_path: Path, recorded_servers: list[uvicorn.Server], capsys: pytest.CaptureFixture[str]
) -> None:
    location = str(tmp_path / "journal")
    build(location, 4)
    # IPv6 written as in a URL ("[::1]") when this machine has it, else 127.0.0.1.
    address = "::1" if has_ipv6_loopback() else "127.0.0.1"
    netloc = f"[{address}]" if ":" in address else address
    port = free_port(address)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            serve(location, host=netloc, port=port, token=TOKEN, trust_shared_root=True)
        except BaseException as error:  # reported by the test below
            failures.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        try:
            response = wait_until_served(
                f"http://{netloc}:{port}/api/counts",
                deadline=time.monotonic() + 20,
                headers={"authorization": f"Bearer {TOKEN}"},
                alive=thread.is_alive,
            )
        except AssertionError as error:
            thread.join(timeout=5)
            raise AssertionError(f"serve failed: {failures!r}") from error
        assert response.status_code == 200
        assert response.json()["total"] == 4
        check_headers(response)
        assert "server" not in response.headers
        assert httpx.get(f"http://{netloc}:{port}/", timeout=2).status_code == 401
    finally:
        deadline = time.monotonic() + 20
        while not recorded_servers and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        for server in recorded_servers:
            server.should_exit = True
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert failures == []
    capsys.readouterr()  # uvicorn's access log: not a figure


@pytest.mark.usefixtures("no_token_env")
def test_a_real_uvicorn_process_serves_the_viewer(tmp_path: Path) -> None:
    location = f"sqlite://{tmp_path}/journal.db"
    build(location, 30)
    port = free_port()
    code = (
        "import sys\n"
        "from itemjournal._operator.viewer.app import serve\n"
        "serve(sys.argv[1], host='127.0.0.1', port=int(sys.argv[2]))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != viewer.TOKEN_ENV}
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-c", code, location, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        page = wait_until_served(f"http://127.0.0.1:{port}/", deadline=started + 30)
        assert page.status_code == 200
        check_headers(page)
        assert len(rows(page.text)) == 30
        refused = httpx.post(f"http://127.0.0.1:{port}/api/records", timeout=5)
        assert refused.status_code == 405
        other_host = httpx.get(
            f"http://127.0.0.1:{port}/", headers={"host": "rebound.example"}, timeout=5
        )
        assert other_host.status_code == 400
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == 0, output.decode(errors="replace")
    log = output.decode(errors="replace")
    assert f"http://127.0.0.1:{port}" in log
    assert '"GET / HTTP/1.1" 200' in log
    print(f"uvicorn subprocess served and stopped in {time.monotonic() - started:.2f} s")


def test_templates_and_stylesheet_are_package_data() -> None:
    folder = Path(itemjournal.__file__).parent / "_viewer_templates"
    names = {path.name for path in folder.iterdir()}
    assert {
        "base.html",
        "index.html",
        "detail.html",
        "invalid.html",
        "error.html",
        "viewer.css",
    } <= names


@pytest.mark.anyio
async def test_a_postgresql_location_is_served_and_its_password_never_shown() -> None:
    from conftest import postgres_schema

    with postgres_schema() as url:
        journal = await Journal.open(url)
        try:
            await fill(journal, 4)
        finally:
            await journal.aclose()
        # The server trusts every local connection, so any password opens it: the point
        # is that the one given never reaches a page.
        scheme, rest = url.split("://", 1)
        user, host = rest.split("@", 1)
        with_password = f"{scheme}://{user}:hunter2-secret@{host}"
        app = create_app(with_password)
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
            app.router.lifespan_context(app),
        ):
            counts = (await client.get("/api/counts")).json()
            assert counts["total"] == 4
            pages = [await client.get("/"), await client.get("/api/records")]
            for page in pages:
                assert page.status_code == 200
                assert "hunter2-secret" not in page.text
            assert ":***@" in pages[0].text  # the location is shown, its password hidden
