"""A read-only web viewer of a journal (``itemjournal serve``): Starlette, uvicorn, Jinja2.

Pages (HTML) and a JSON API for the same:

* ``/`` and ``/api/records``: one page of records, filtered by the GET parameters
  ``status``, ``scope``, ``program`` and ``job``, paged by key (``after=<key>``,
  ``limit=1..500``, 50 by default). A page reads ``limit + 1`` records from the journal
  and never more (the store starts after ``after``). ``/`` also shows the records per
  status at a cost that does not grow with the journal: what the store counts on its
  indexes (``Store.tally``: SQLite, PostgreSQL), or, for a store without one (the file
  store), an exact count when the journal holds at most ``COUNT_LIMIT`` records, and
  otherwise a link to ``/counts``.
* ``/records/<scope>/<program>/<job>/<item>`` and ``/api/records/<scope>/…/<item>``: one
  record, its owner (and whether it is alive) and its history. A stored result is
  described by its size only; its content is never served.
* ``/counts`` and ``/api/counts``: the number of records per status, and of records that
  cannot be read, exactly (``Journal.counts``: every record read strictly, so its time
  grows with the journal).

Only GET and HEAD are answered; every other method, on every path, is refused with 405
before anything is read. Nothing the viewer serves can change a record: it calls only
``Journal.records``, ``Journal.counts``, ``Journal.inspect`` and the store's ``tally``
and ``scan``, which read.

Every response carries a strict ``Content-Security-Policy`` (no scripts at all; the
stylesheet is a file served by the app), ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: no-referrer``, ``X-Frame-Options: DENY`` and ``Cache-Control: no-store``.
Templates escape every value (Jinja2 autoescape).

With a token, every request must carry it, as ``Authorization: Bearer <token>`` (scripts)
or as the password of HTTP Basic authentication (browsers; any user name). A token is never
taken from the URL, so it cannot end up in access logs or browser history. Without a token,
the viewer answers only requests addressed to a loopback host name (``127.0.0.1``,
``localhost``, ``[::1]``), which keeps pages of other sites from reading it through DNS
rebinding.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hmac
import ipaddress
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Final
from urllib.parse import urlencode

import anyio
import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..._journal.journal import Journal
from ..._model.errors import InvalidArgument, JournalError, RecordInvalid, StorageFailed
from ..._model.identity import Identity, check_label, coerce_identity, identity_digest
from ..._model.records import STATUSES, Event
from ..._model.view import RecordView
from ..._stores.registry import redact

__all__ = ["TOKEN_ENV", "create_app", "serve"]

TOKEN_ENV: Final = "ITEMJOURNAL_VIEWER_TOKEN"
PAGE_SIZE: Final = 50
MAX_PAGE_SIZE: Final = 500
# At most this many records are read to count them on ``/`` when the store has no
# ``tally`` (the file store): a few tens of milliseconds; beyond it, ``/counts`` counts.
COUNT_LIMIT: Final = 500
ALLOWED_METHODS: Final = ("GET", "HEAD")

SECURITY_HEADERS: Final = (
    (
        "content-security-policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
    ("cache-control", "no-store"),
)

_PARAMETERS: Final = ("status", "scope", "program", "job", "after", "limit")
_KEY: Final = re.compile(r"[0-9a-f]{64}")
_KEY_IN: Final = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_TOKEN: Final = re.compile(r"[\x21-\x7e]+")  # visible ASCII: fits any header unchanged
_LOOPBACK_NAMES: Final = frozenset({"localhost"})
_TITLES: Final = {
    400: "Bad request",
    401: "Authentication required",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    500: "Internal error",
    503: "Unavailable",
}

_log = logging.getLogger("itemjournal.viewer")


# --------------------------------------------------------------------------- templates


def _read_package_files() -> tuple[dict[str, str], bytes, bytes]:
    """The templates and the stylesheet, read once when the module is imported (so no
    request ever touches the disk for them)."""
    folder = resources.files("itemjournal") / "_viewer_templates"
    names = (
        "base.html",
        "index.html",
        "counts.html",
        "counts_nav.html",
        "detail.html",
        "invalid.html",
        "error.html",
    )
    templates = {name: (folder / name).read_text(encoding="utf-8") for name in names}
    return templates, (folder / "viewer.css").read_bytes(), (folder / "favicon.svg").read_bytes()


def _when(value: str | None) -> str:
    """An ISO-8601 UTC time as ``2025-01-31 12:34:56`` (the page says it is UTC)."""
    if not value:
        return "—"
    return value[:19].replace("T", " ")


_TEMPLATE_TEXT, _CSS, _ICON = _read_package_files()
_ENVIRONMENT = jinja2.Environment(
    loader=jinja2.DictLoader(_TEMPLATE_TEXT),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    auto_reload=False,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENVIRONMENT.filters["when"] = _when
_TEMPLATES: Final = {name: _ENVIRONMENT.get_template(name) for name in _TEMPLATE_TEXT}


# --------------------------------------------------------------------------- JSON shapes


def _identity_json(identity: Identity) -> dict[str, str]:
    return dict(zip(Identity._fields, identity, strict=True))


def _result_bytes(view: RecordView) -> int | None:
    return None if view.result is None else len(view.result.encode("utf-8"))


def _event_json(event: Event) -> dict[str, object]:
    return {
        "at": event.at,
        "event": event.event,
        "status": event.status,
        "attempt": event.attempt,
        "note": event.note,
    }


def _view_json(view: RecordView, *, history: bool) -> dict[str, object]:
    owner = view.owner
    data: dict[str, object] = {
        "key": view.key,
        "identity": _identity_json(view.identity),
        "status": view.status,
        "receipt": view.receipt,
        "result_bytes": _result_bytes(view),
        "attempt": view.attempt,
        "created_at": view.created_at,
        "updated_at": view.updated_at,
        "owner": None
        if owner is None
        else {
            "host": owner.host,
            "pid": owner.pid,
            "started_at": owner.started_at or None,
            "process": owner.process or None,
        },
        "owner_alive": view.owner_alive,
        "review_reason": view.review_reason,
    }
    if history:
        data["history"] = [_event_json(event) for event in view.history]
    return data


def _error_json(error: JournalError) -> dict[str, str]:
    return {"code": error.code, "message": error.message}


def _problem_key(problem: JournalError) -> str | None:
    """The key of the record a problem is about, when its location names one."""
    location = getattr(problem, "location", None)
    found = _KEY_IN.findall(location) if isinstance(location, str) else []
    return found[-1] if found else None


# --------------------------------------------------------------------------- queries


@dataclass(frozen=True, slots=True)
class _Query:
    """A listing's parameters, checked."""

    status: str | None = None
    scope: str | None = None
    program: str | None = None
    job: str | None = None
    after: str | None = None
    limit: int = PAGE_SIZE

    @property
    def filtered(self) -> bool:
        return any(value is not None for value in self.filters.values())

    @property
    def filters(self) -> dict[str, str | None]:
        return {
            "status": self.status,
            "scope": self.scope,
            "program": self.program,
            "job": self.job,
        }

    def parameters(self, **changes: str | None) -> str:
        """The query string of this listing, with ``changes`` (``None`` drops one)."""
        values: dict[str, str | None] = dict(self.filters)
        if self.limit != PAGE_SIZE:
            values["limit"] = str(self.limit)
        values.update(changes)
        pairs = [(name, value) for name, value in values.items() if value is not None]
        return urlencode(pairs)


def _parse_query(request: Request) -> _Query:
    """Check a listing's GET parameters; an empty value (a blank form field) means absent."""
    params = request.query_params
    unknown = sorted(set(params.keys()) - set(_PARAMETERS))
    if unknown:
        raise InvalidArgument(
            f"unknown query parameter {unknown[0]!r}; the parameters are {', '.join(_PARAMETERS)}",
            code="INVALID_ARGUMENT",
        )
    values: dict[str, str | None] = {}
    for name in _PARAMETERS:
        given = params.getlist(name)
        if len(given) > 1:
            raise InvalidArgument(
                f"query parameter {name!r} is given {len(given)} times; give it once",
                code="INVALID_ARGUMENT",
            )
        values[name] = given[0] if given and given[0] != "" else None
    status = values["status"]
    if status is not None and status not in STATUSES:
        raise InvalidArgument(
            f"status is one of {', '.join(STATUSES)}, not {status!r}", code="INVALID_ARGUMENT"
        )
    labels = {
        name: None if values[name] is None else check_label(values[name], name)
        for name in ("scope", "program", "job")
    }
    after = values["after"]
    if after is not None and _KEY.fullmatch(after) is None:
        raise InvalidArgument(
            f"after is a record key (64 lowercase hex characters), not {after!r}",
            code="INVALID_ARGUMENT",
        )
    limit = PAGE_SIZE
    text = values["limit"]
    if text is not None:
        if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_PAGE_SIZE:
            raise InvalidArgument(
                f"limit is a whole number from 1 to {MAX_PAGE_SIZE}, not {text!r}",
                code="INVALID_ARGUMENT",
            )
        limit = int(text)
    return _Query(status=status, after=after, limit=limit, **labels)


@dataclass(frozen=True, slots=True)
class _Row:
    """One listed item: a record's view, or the error that stands for an unreadable one."""

    key: str | None
    view: RecordView | None = None
    error: JournalError | None = None
    url: str | None = None

    def json(self) -> dict[str, object]:
        if self.view is not None:
            return _view_json(self.view, history=False)
        assert self.error is not None
        return {"key": self.key, "status": "invalid", "error": _error_json(self.error)}


@dataclass(slots=True)
class _Page:
    rows: list[_Row] = field(default_factory=list)
    next_after: str | None = None


@dataclass(frozen=True, slots=True)
class _Counts:
    """What ``/`` shows of the counts: exact, from the store's indexes, or none (more
    records than ``COUNT_LIMIT`` in a store that can only count them by reading them)."""

    counts: dict[str, int] | None
    exact: bool


# --------------------------------------------------------------------------- responses


def _wants_json(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path == "/api" or path.startswith("/api/")


def _error_response(
    scope: Scope,
    status_code: int,
    code: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    page: Mapping[str, object] | None = None,
) -> Response:
    """An error as JSON (under ``/api``) or as a page; ``page`` holds the links a page
    needs (left out for requests refused before they were let in)."""
    if _wants_json(scope):
        return JSONResponse(
            {"error": {"code": code, "message": message}}, status_code, headers=headers
        )
    context: dict[str, object] = {
        "index_url": "/",
        "css_url": "/static/viewer.css",
        "icon_url": "/static/favicon.svg",
        "location": "",
    }
    context.update(page or {})
    context.update(
        status_code=status_code,
        title=_TITLES.get(status_code, "Error"),
        code=code,
        message=message,
    )
    return HTMLResponse(_TEMPLATES["error.html"].render(context), status_code, headers=headers)


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port (and without an IPv6 literal's
    brackets)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Guard:
    """In front of every request: only GET and HEAD, the host check (without a token),
    the token check (with one), and the security headers on every response."""

    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self.app = app
        self.token = None if token is None else token.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS:
                    headers[name] = value
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send_guarded)
            return
        await self.app(scope, receive, send_guarded)

    def _refusal(self, scope: Scope) -> Response | None:
        method = scope["method"]
        if method not in ALLOWED_METHODS:
            return _error_response(
                scope,
                405,
                "METHOD_NOT_ALLOWED",
                f"the viewer is read-only: {method} is refused; only GET and HEAD are answered",
                headers={"allow": ", ".join(ALLOWED_METHODS)},
            )
        if self.token is None:
            host = _host_name(Headers(scope=scope).get("host", ""))
            if not _is_loopback(host):
                return _error_response(
                    scope,
                    400,
                    "HOST_REFUSED",
                    f"without a token the viewer answers only requests addressed to "
                    f"127.0.0.1, localhost or [::1], not to {host!r}",
                )
            return None
        return self._auth_refusal(scope)

    def _auth_refusal(self, scope: Scope) -> Response | None:
        assert self.token is not None
        challenge = {"www-authenticate": 'Basic realm="itemjournal", charset="UTF-8"'}
        raw = _raw_header(scope, b"authorization")
        if raw is None:
            return _error_response(
                scope,
                401,
                "TOKEN_REQUIRED",
                "this viewer needs its token: send 'Authorization: Bearer <token>', or "
                "give it as the password when the browser asks",
                headers=challenge,
            )
        scheme, _, credentials = raw.partition(b" ")
        scheme = scheme.lower()
        given: bytes | None = None
        if scheme == b"bearer":
            given = credentials.strip()
        elif scheme == b"basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True)
            except (binascii.Error, ValueError):
                decoded = b""
            given = decoded.partition(b":")[2] if b":" in decoded else None
        if given is not None and hmac.compare_digest(given, self.token):
            return None
        if scheme == b"bearer":
            return _error_response(scope, 403, "TOKEN_WRONG", "the token is not this viewer's")
        # Basic (a browser) or an unknown scheme: ask again, so a mistyped password can
        # be corrected in the browser's dialog.
        return _error_response(
            scope,
            401,
            "TOKEN_WRONG",
            "the token is not this viewer's (give it as the password, any user name)",
            headers=challenge,
        )


def _raw_header(scope: Scope, name: bytes) -> bytes | None:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _check_token(token: object) -> str | None:
    if token is None:
        return None
    if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
        raise InvalidArgument(
            "the viewer token is printable ASCII without spaces, and not empty",
            code="INVALID_ARGUMENT",
        )
    return token


# --------------------------------------------------------------------------- the app


Handler = Callable[[Request], Awaitable[Response]]


class _Viewer:
    """The endpoints, over one journal (opened by the lifespan, or handed in)."""

    def __init__(self, journal: Journal | None, location: str) -> None:
        self.journal = journal
        self.location = location

    def _journal(self) -> Journal:
        if self.journal is None:
            raise HTTPException(503, "the journal is not open")
        return self.journal

    def _page_context(self, request: Request) -> dict[str, object]:
        return {
            "index_url": request.url_for("index").path,
            "css_url": request.url_for("css").path,
            "icon_url": request.url_for("icon").path,
            "location": self.location,
        }

    def _record_url(self, request: Request, identity: Identity, *, api: bool = False) -> str:
        return request.url_for("api_record" if api else "record", **identity._asdict()).path

    def guarded(self, handler: Handler) -> Handler:
        """Turn errors into answers: bad input is a 400 naming its code, a storage
        failure a 503; anything unforeseen is logged and answered with a bare 500."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except InvalidArgument as error:
                return self._error(request, 400, error.code, error.message)
            except StorageFailed as error:
                return self._error(request, 503, error.code, error.message)
            except HTTPException as error:
                return self._error(request, error.status_code, "UNAVAILABLE", error.detail)
            except Exception:
                _log.exception("the viewer failed to answer %s", request.url.path)
                return self._error(request, 500, "INTERNAL_ERROR", "the viewer failed; see its log")

        return run

    def _error(self, request: Request, status_code: int, code: str, message: str) -> Response:
        return _error_response(
            request.scope, status_code, code, message, page=self._page_context(request)
        )

    async def _page(self, request: Request, query: _Query) -> _Page:
        """Read one page (``limit + 1`` items at most) after ``query.after``."""
        page = _Page()
        listing = self._journal().records(
            query.status,
            scope=query.scope,
            program=query.program,
            job=query.job,
            after=query.after,
        )
        more = False
        async with contextlib.aclosing(listing) as items:
            async for item in items:
                if len(page.rows) == query.limit:
                    more = True
                    break
                if isinstance(item, RecordView):
                    url = self._record_url(request, item.identity)
                    page.rows.append(_Row(key=item.key, view=item, url=url))
                else:
                    page.rows.append(_Row(key=_problem_key(item), error=item))
        if more:
            # The last row with a key: a trailing unreadable part of the store has none.
            page.next_after = next((row.key for row in reversed(page.rows) if row.key), None)
        return page

    async def _page_counts(self) -> _Counts:
        """The counts ``/`` shows, at a cost that does not grow with the journal."""
        store = self._journal().store
        tally = await store.tally()
        if tally is not None:
            return _Counts(tally.counts, tally.exact)
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        seen = 0
        async with contextlib.aclosing(store.scan()) as items:
            async for item in items:
                seen += 1
                if seen > COUNT_LIMIT:
                    return _Counts(None, exact=False)
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    counted["invalid"] += 1
                else:
                    counted[item.status] += 1
        return _Counts(counted, exact=True)

    async def index(self, request: Request) -> Response:
        query = _parse_query(request)
        counts = await self._page_counts()
        page = await self._page(request, query)
        index_url = request.url_for("index").path
        json_url = request.url_for("api_records").path
        own = query.parameters(after=query.after)
        context = self._page_context(request)
        numbers = counts.counts
        context.update(
            query=query,
            statuses=STATUSES,
            counts=None if numbers is None else list(numbers.items()),
            counts_exact=counts.exact,
            count_limit=COUNT_LIMIT,
            counts_url=request.url_for("counts").path,
            total=None if numbers is None else sum(numbers.values()),
            rows=page.rows,
            first_url=f"{index_url}?{query.parameters()}" if query.parameters() else index_url,
            next_url=None
            if page.next_after is None
            else f"{index_url}?{query.parameters(after=page.next_after)}",
            json_url=f"{json_url}?{own}" if own else json_url,
        )
        return HTMLResponse(_TEMPLATES["index.html"].render(context))

    async def api_records(self, request: Request) -> Response:
        query = _parse_query(request)
        page = await self._page(request, query)
        body: dict[str, object] = {
            "filters": query.filters,
            "after": query.after,
            "limit": query.limit,
            "records": [row.json() for row in page.rows],
            "next": page.next_after,
        }
        return JSONResponse(body)

    async def api_counts(self, request: Request) -> Response:
        counts = await self._journal().counts()
        return JSONResponse({"counts": counts, "total": sum(counts.values())})

    async def counts(self, request: Request) -> Response:
        counts = await self._journal().counts()
        context = self._page_context(request)
        context.update(
            statuses=STATUSES,
            counts=list(counts.items()),
            total=sum(counts.values()),
            json_url=request.url_for("api_counts").path,
        )
        return HTMLResponse(_TEMPLATES["counts.html"].render(context))

    async def _inspect(self, request: Request) -> tuple[Identity, RecordView | RecordInvalid]:
        params = request.path_params
        identity = coerce_identity([params[name] for name in Identity._fields])
        try:
            view = await self._journal().inspect(identity)
        except RecordInvalid as error:
            return identity, error
        if view.status == "absent":
            raise _NotFound(identity)
        return identity, view

    async def record(self, request: Request) -> Response:
        try:
            identity, found = await self._inspect(request)
        except _NotFound as missing:
            return self._error(request, 404, "NOT_FOUND", missing.message)
        context = self._page_context(request)
        context["json_url"] = self._record_url(request, identity, api=True)
        if isinstance(found, RecordInvalid):
            context.update(identity=identity, error=found)
            return HTMLResponse(_TEMPLATES["invalid.html"].render(context))
        context.update(view=found, result_bytes=_result_bytes(found))
        return HTMLResponse(_TEMPLATES["detail.html"].render(context))

    async def api_record(self, request: Request) -> Response:
        try:
            identity, found = await self._inspect(request)
        except _NotFound as missing:
            return self._error(request, 404, "NOT_FOUND", missing.message)
        if isinstance(found, RecordInvalid):
            body: dict[str, object] = {
                "key": identity_digest(identity),
                "identity": _identity_json(identity),
                "status": "invalid",
                "error": _error_json(found),
            }
            return JSONResponse(body)
        return JSONResponse(_view_json(found, history=True))

    async def css(self, request: Request) -> Response:
        return Response(_CSS, media_type="text/css; charset=utf-8")

    async def icon(self, request: Request) -> Response:
        return Response(_ICON, media_type="image/svg+xml")

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return self._error(request, 404, "NOT_FOUND", f"no page at {request.url.path}")


class _NotFound(Exception):
    def __init__(self, identity: Identity) -> None:
        super().__init__(identity)
        self.message = f"no record for {'/'.join(identity)}"


def create_app(
    journal_or_location: Journal | str | os.PathLike[str],
    *,
    token: str | None = None,
    input_key: bytes | None = None,
    trust_shared_root: bool = False,
) -> Starlette:
    """The viewer as an ASGI application.

    Given a ``Journal``, the app serves it and leaves opening and closing it to the
    caller. Given a location, the app opens the journal when it starts (its lifespan) and
    closes it when it stops (with ``input_key`` and ``trust_shared_root`` as
    ``Journal.open`` takes them); a location that holds no journal is refused, never
    created. With ``token``, every request must carry it (see the module's documentation).
    """
    token = _check_token(token)
    if isinstance(journal_or_location, Journal):
        viewer = _Viewer(journal_or_location, journal_or_location.store.location)
        location: str | None = None
    else:
        location = os.fspath(journal_or_location)
        viewer = _Viewer(None, redact(location))  # shown on every page: never a password

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if location is None:
            yield
            return
        await anyio.to_thread.run_sync(_require_journal, location)
        journal = await Journal.open(
            location, input_key=input_key, trust_shared_root=trust_shared_root
        )
        viewer.journal = journal
        try:
            yield
        finally:
            viewer.journal = None
            with anyio.CancelScope(shield=True):
                await journal.aclose()

    label = "/{scope}/{program}/{job}/{item}"
    routes = [
        Route("/", viewer.guarded(viewer.index), name="index"),
        Route("/records" + label, viewer.guarded(viewer.record), name="record"),
        Route("/counts", viewer.guarded(viewer.counts), name="counts"),
        Route("/api/counts", viewer.guarded(viewer.api_counts), name="api_counts"),
        Route("/api/records", viewer.guarded(viewer.api_records), name="api_records"),
        Route("/api/records" + label, viewer.guarded(viewer.api_record), name="api_record"),
        Route("/static/viewer.css", viewer.css, name="css"),
        Route("/static/favicon.svg", viewer.icon, name="icon"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: viewer.not_found},
    )
    app.add_middleware(_Guard, token=token)
    return app


# --------------------------------------------------------------------------- serving


def _require_journal(location: str) -> None:
    """Refuse a location that holds no journal: the viewer reads, it never creates one.

    A relative or otherwise malformed location is left for ``Journal.open`` to refuse
    with its own code. A PostgreSQL location is asked of its server: a schema without the
    journal's tables is refused (opening would make them); a server that cannot be asked
    is left for ``Journal.open`` to report."""
    if location.startswith(("postgresql://", "postgres://")):
        try:
            from ..._stores.postgres.store import missing_journal
        except ImportError:
            return
        missing = missing_journal(location)
        if missing is not None:
            raise InvalidArgument(
                f"{missing}; the viewer never creates one", code="INVALID_ARGUMENT"
            )
        return
    if location.startswith("sqlite://"):
        path = location[len("sqlite://") :]
        kind = "SQLite journal"
        found = os.path.isfile(path)
    else:
        path = location
        kind = "journal directory"
        found = os.path.isdir(path)
    if os.path.isabs(path) and not found:
        raise InvalidArgument(
            f"there is no {kind} at {path}; the viewer never creates one",
            code="INVALID_ARGUMENT",
        )


def serve(
    location: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    input_key: bytes | None = None,
    trust_shared_root: bool = False,
) -> None:
    """Serve the read-only viewer of the journal at ``location`` until interrupted.

    Binds ``127.0.0.1`` by default. Any other address needs a token (``token``, or the
    ``ITEMJOURNAL_VIEWER_TOKEN`` environment variable), and a warning is printed to
    stderr: the viewer speaks plain HTTP. ``input_key`` and ``trust_shared_root`` are
    passed to ``Journal.open``. Bad arguments and a journal that cannot be
    opened raise ``JournalError`` before anything listens.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    token = _check_token(token)
    if not isinstance(host, str) or not host.strip():
        raise InvalidArgument("host is an address to listen on", code="INVALID_ARGUMENT")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 literal as written in URLs
        host = host[1:-1]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port is 0 to 65535, not {port!r}", code="INVALID_ARGUMENT")
    if not _is_loopback(host):
        if token is None:
            raise InvalidArgument(
                f"refusing to serve on {host}, beyond this machine, without a token: pass "
                f"--token or set {TOKEN_ENV} (or serve on 127.0.0.1)",
                code="INVALID_ARGUMENT",
            )
        print(
            f"warning: the viewer listens on {host}:{port}, beyond this machine. Every "
            f"request must carry the token, which crosses the network in clear text unless "
            f"a TLS proxy stands in front.",
            file=sys.stderr,
        )
    text = os.fspath(location)
    _require_journal(text)
    with contextlib.suppress(KeyboardInterrupt):
        run = functools.partial(
            _serve,
            text,
            host=host,
            port=port,
            token=token,
            input_key=input_key,
            trust_shared_root=trust_shared_root,
        )
        anyio.run(run, backend="asyncio")


async def _serve(
    location: str,
    *,
    host: str,
    port: int,
    token: str | None,
    input_key: bytes | None,
    trust_shared_root: bool,
) -> None:
    # Opened before anything listens, so a journal that cannot be opened is reported to
    # the caller as its JournalError rather than as a failed application startup.
    journal = await Journal.open(location, input_key=input_key, trust_shared_root=trust_shared_root)
    try:
        app = create_app(journal, token=token)

        def configure() -> uvicorn.Config:
            config = uvicorn.Config(
                app,
                host=host,
                port=port,
                lifespan="on",
                ws="none",
                proxy_headers=False,
                server_header=False,
                log_level="info",
            )
            config.load()  # imports its protocol modules: disk reads, kept off the loop
            return config

        config = await anyio.to_thread.run_sync(configure)
        await uvicorn.Server(config).serve()
    finally:
        with anyio.CancelScope(shield=True):
            await journal.aclose()
