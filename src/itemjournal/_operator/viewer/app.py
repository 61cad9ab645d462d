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

import contextlib
import functools
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Final

import anyio
import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from ..._journal.journal import Journal
from ..._model.errors import InvalidArgument
from ..._stores.registry import redact
from .guard import _check_token, _Guard, _is_loopback
from .pages import _Viewer
from .reports import Reports
from .server import HEAD_LIMIT, KEEP_ALIVE, Listener, Room, bound_for, more_open_files, protocol_for
from .templates import Templates, _read_package_files

__all__ = ["TOKEN_ENV", "create_app", "serve"]

TOKEN_ENV: Final = "ITEMJOURNAL_VIEWER_TOKEN"


def _templates() -> Templates:
    """The templates in an environment that escapes every value, read once when the
    module is imported (so no request ever touches the disk for them)."""
    texts, css, icon = _read_package_files()
    environment = jinja2.Environment(
        loader=jinja2.DictLoader(texts),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        auto_reload=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return Templates(environment, css, icon)


_TEMPLATES: Final = _templates()


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
        viewer = _Viewer(journal_or_location, journal_or_location.store.location, _TEMPLATES)
        location: str | None = None
    else:
        location = os.fspath(journal_or_location)
        # The location is shown on every page: never a password.
        viewer = _Viewer(None, redact(location), _TEMPLATES)

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
    app.add_middleware(_Guard, token=token, templates=_TEMPLATES)
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

    Slow and abusive clients are bounded (see ``viewer/server.py``): a request head must
    be complete within 5 s, at most 2,048 connections are held (and never more than the
    limit of open files less 128), and each cause of trouble is logged once, then
    counted. While it serves, the process's soft limit of open files is raised to its hard
    limit; it is set back when serving ends.
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
    with contextlib.suppress(KeyboardInterrupt), more_open_files() as open_files:
        run = functools.partial(
            _serve,
            text,
            host=host,
            port=port,
            token=token,
            input_key=input_key,
            trust_shared_root=trust_shared_root,
            open_files=open_files,
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
    open_files: int,
) -> None:
    # Opened before anything listens, so a journal that cannot be opened is reported to
    # the caller as its JournalError rather than as a failed application startup.
    journal = await Journal.open(location, input_key=input_key, trust_shared_root=trust_shared_root)
    try:
        app = create_app(journal, token=token)
        # The server's log: its own lines, and each cause of trouble once, then counted.
        reports = Reports(logging.getLogger("uvicorn.error"))
        room = Room(bound_for(open_files), reports)
        configure = functools.partial(_configure, app, host=host, port=port, room=room)
        config, listener = await anyio.to_thread.run_sync(configure)
        collapse = reports.filter()
        loggers = [logging.getLogger(name) for name in ("uvicorn.error", "asyncio")]
        for logger in loggers:
            logger.addFilter(collapse)
        try:
            await uvicorn.Server(config).serve(sockets=[listener])
        finally:
            for logger in loggers:
                logger.removeFilter(collapse)
            listener.close()
            reports.flush()
    finally:
        with anyio.CancelScope(shield=True):
            await journal.aclose()


def _configure(
    app: Starlette, *, host: str, port: int, room: Room
) -> tuple[uvicorn.Config, Listener]:
    """The server's configuration and its listening socket, made in a worker thread (uvicorn
    imports its modules and logs where it listens; a port that cannot be bound ends the
    process as uvicorn does, with exit status 3)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        ws="none",
        proxy_headers=False,
        server_header=False,
        log_level="info",
        http=protocol_for(room),
        timeout_keep_alive=KEEP_ALIVE,
        h11_max_incomplete_event_size=HEAD_LIMIT,
    )
    config.load()
    bound = config.bind_socket()
    listener = Listener(bound.family, bound.type, bound.proto, fileno=bound.detach())
    listener.set_inheritable(False)
    listener.room = room
    listener.keep_spare()
    return config, listener
