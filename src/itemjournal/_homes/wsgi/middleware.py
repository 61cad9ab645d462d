"""The WSGI middleware: a request with a key is claimed in the journal, run once, recorded,
and answered from the record ever after.

The journal given by location is opened on the first request of each process that serves
one (a gunicorn worker after the fork, ``--preload`` or not) and shared by its threads.
The request path reads the key and the body, claims, and hands the application to a
``Response``, which the server iterates and closes. The contract is written in
``itemjournal.wsgi``.
"""

from __future__ import annotations

import io
import os
import threading
import weakref
from collections.abc import Callable, Iterable

from ..._model.errors import JournalError
from ..._model.identity import Identity
from ..._model.view import Claim
from ..._sync.journal import Journal
from ..http.keys import DEFAULT_SCOPE, DEFINITION, request_identity
from ..http.policy import DEFAULT_MAX_BODY, check_options, check_scope_value, request_key
from ..http.problems import Answer, refusal, unavailable
from ..http.responses import RELEASED_STATUSES, stored_reply
from .protocol import (
    Environ,
    ScopeFunction,
    StartResponse,
    WSGIApp,
    key_fields,
    logger,
    read_body,
    request_inputs,
    send_reply,
)
from .response import Response

__all__ = ["IdempotencyMiddleware", "claim_of"]

_CLAIM_ENVIRON_KEY = "itemjournal.claim"


def claim_of(environ: Environ) -> Claim | None:
    """The journal's claim on the request being handled (None without a key).

    Hand ``claim_of(request.environ).key`` (Flask; ``request.META`` in Django) to a
    downstream service as *its* idempotency key, so that even an operator-approved retry
    cannot repeat the effect there.
    """
    claim = environ.get(_CLAIM_ENVIRON_KEY)
    return claim if isinstance(claim, Claim) else None


# Middlewares whose opening lock a forked child must not inherit: a lock another thread
# held at the fork would be held for good in the child.
_LIVE: weakref.WeakSet[IdempotencyMiddleware] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for middleware in list(_LIVE):
        middleware._opening = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class IdempotencyMiddleware:
    """Answer duplicate requests from the journal instead of running them again.

    See ``itemjournal.wsgi`` for the whole contract.
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        location: str | None = None,
        journal: Journal | None = None,
        scope: str | ScopeFunction | None = None,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool | Callable[[Environ], bool] = True,
        wait: float | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        release: Iterable[int] = RELEASED_STATUSES,
    ) -> None:
        self._release = check_options(
            given=(location is not None) + (journal is not None),
            scope=scope,
            wait=wait,
            max_body=max_body,
            release=release,
        )
        self.app = app
        self._location = location
        self._journal = journal
        self._scope = scope
        self._methods = frozenset(method.upper() for method in methods)
        self._required = required
        self._wait = wait
        self._max_body = max_body
        self._opening = threading.Lock()
        _LIVE.add(self)

    @property
    def journal(self) -> Journal | None:
        """The journal in use (None while one given by ``location`` is not open)."""
        return self._journal

    def open(self) -> Journal:
        """The journal, opening the one at ``location`` once, whichever thread asks first.

        A journal opened before a fork serves the child too (``itemjournal.sync`` works
        after ``fork``); one opened in the child stays the child's.
        """
        journal = self._journal
        if journal is not None:
            return journal
        with self._opening:
            if self._journal is None:
                assert self._location is not None
                self._journal = Journal.open(self._location)
            return self._journal

    def close(self) -> None:
        """Close a journal this middleware opened (a given ``journal`` stays open)."""
        if self._location is None:
            return
        with self._opening:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if str(environ.get("REQUEST_METHOD", "")).upper() not in self._methods:
            return self.app(environ, start_response)
        try:
            prepared = self._prepare(environ)
        except Answer as answer:
            return send_reply(start_response, answer.reply)
        if prepared is None:  # no key, and none required
            return self.app(environ, start_response)
        identity, inputs, body = prepared
        try:
            journal = self.open()
        except JournalError as error:
            logger.exception("itemjournal could not open %s", self._location)
            return send_reply(start_response, unavailable(error))
        context = journal.claim(identity, inputs, DEFINITION, wait=self._wait)
        try:
            attempt = context.__enter__()
        except JournalError as error:
            refused = refusal(error)
            if refused.status == 503:
                logger.error("itemjournal refused an idempotent request: %s", error)
            return send_reply(start_response, refused)
        if attempt.reused:
            context.__exit__(None, None, None)
            return send_reply(start_response, stored_reply(attempt.result, attempt.receipt))
        app_environ = dict(environ)
        # The body was read whole to fingerprint it: the application reads it again.
        app_environ["wsgi.input"] = io.BytesIO(body)
        app_environ["CONTENT_LENGTH"] = str(len(body))
        app_environ["wsgi.input_terminated"] = True
        app_environ[_CLAIM_ENVIRON_KEY] = attempt.claim
        response = Response(context, attempt, start_response, self._release)
        return response.run(self.app, app_environ)

    def _prepare(self, environ: Environ) -> tuple[Identity, dict[str, str | int], bytes] | None:
        """Identity, inputs and body of a request with a key; None when it has none."""
        key = request_key(
            key_fields(environ),
            environ.get("REQUEST_METHOD"),
            lambda: self._required(environ) if callable(self._required) else self._required,
        )
        if key is None:
            return None
        scope_value = self._scope_value(environ)
        body = read_body(environ, self._max_body)
        return request_identity(scope_value, key), request_inputs(environ, body), body

    def _scope_value(self, environ: Environ) -> str:
        if self._scope is None:
            return DEFAULT_SCOPE
        if isinstance(self._scope, str):
            return self._scope
        return check_scope_value(self._scope(environ))
