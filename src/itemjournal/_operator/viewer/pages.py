"""What each page and API answer shows: a listing's parameters and its paging by key,
the counts ``/`` can afford, one record and its history, and the JSON shapes of them.

``_Viewer`` holds the endpoints over one journal; ``app`` routes requests to them. Every
endpoint only reads (``Journal.records``, ``counts``, ``inspect``, the store's ``tally``
and ``scan``)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ..._journal.journal import Journal
from ..._model.errors import InvalidArgument, JournalError, RecordInvalid, StorageFailed
from ..._model.identity import Identity, check_label, coerce_identity, identity_digest
from ..._model.records import STATUSES, Event
from ..._model.view import RecordView
from .templates import Templates

PAGE_SIZE: Final = 50
MAX_PAGE_SIZE: Final = 500
# At most this many records are read to count them on ``/`` when the store has no
# ``tally`` (the file store): a few tens of milliseconds; beyond it, ``/counts`` counts.
COUNT_LIMIT: Final = 500

_PARAMETERS: Final = ("status", "scope", "program", "job", "after", "limit")
_KEY: Final = re.compile(r"[0-9a-f]{64}")
_KEY_IN: Final = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")

_log = logging.getLogger("itemjournal.viewer")


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


Handler = Callable[[Request], Awaitable[Response]]


class _Viewer:
    """The endpoints, over one journal (opened by the lifespan, or handed in)."""

    def __init__(self, journal: Journal | None, location: str, templates: Templates) -> None:
        self.journal = journal
        self.location = location
        self.templates = templates

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
        return self.templates.error(
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
            problems=True,
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
        return HTMLResponse(self.templates.render("index.html", context))

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
        return HTMLResponse(self.templates.render("counts.html", context))

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
            return HTMLResponse(self.templates.render("invalid.html", context))
        context.update(view=found, result_bytes=_result_bytes(found))
        return HTMLResponse(self.templates.render("detail.html", context))

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
        return Response(self.templates.css, media_type="text/css; charset=utf-8")

    async def icon(self, request: Request) -> Response:
        return Response(self.templates.icon, media_type="image/svg+xml")

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return self._error(request, 404, "NOT_FOUND", f"no page at {request.url.path}")


class _NotFound(Exception):
    def __init__(self, identity: Identity) -> None:
        super().__init__(identity)
        self.message = f"no record for {'/'.join(identity)}"
