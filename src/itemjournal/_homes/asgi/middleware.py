"""The middleware: a request with a key is claimed in the journal, run once, recorded, and
answered from the record ever after.

The lifespan opens and closes a journal given by location; the request path reads the key
and the body, claims, runs the application behind a ``Recorder`` and settles the record
from what the application sent. The contract is written in ``itemjournal.asgi``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import anyio

from ..._journal.journal import Journal
from ..._model.errors import JournalError
from ..._model.identity import Identity
from ..._model.view import Claim
from ..._model.withdrawal import Withdraw
from ..http.policy import (
    DEFAULT_MAX_BODY,
    NO_RESPONSE,
    UNFINISHED,
    check_options,
    check_scope_value,
    declared_too_large,
    released,
    request_key,
)
from ..http.problems import (
    Answer,
    internal_error,
    refusal,
    too_large,
    unavailable,
    withdrawn_error,
)
from ..http.responses import RELEASED_STATUSES, answered_reason
from .keys import DEFAULT_SCOPE, DEFINITION, header, request_identity, request_inputs
from .protocol import ASGIApp, Message, Receive, Scope, ScopeFunction, Send, logger, send_reply
from .responses import Recorder, replay

__all__ = ["DEFAULT_MAX_BODY", "IdempotencyMiddleware", "claim_of"]

_CLAIM_SCOPE_KEY = "itemjournal.claim"
# Server extensions that would let a response bypass the body messages we record.
_BYPASSING_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopy")


def claim_of(scope: Scope) -> Claim | None:
    """The journal's claim on the request being handled (None without a key).

    Hand ``claim_of(request.scope).key`` to a downstream service as *its* idempotency
    key, so that even an operator-approved retry cannot repeat the effect there.
    """
    claim = scope.get(_CLAIM_SCOPE_KEY)
    return claim if isinstance(claim, Claim) else None


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the application the body already read, then the client's."""
    delivered = False

    async def receive_replayed() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_replayed


class IdempotencyMiddleware:
    """Answer duplicate requests from the journal instead of running them again.

    See the module's documentation for the whole contract.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        location: str | None = None,
        journal: Journal | None = None,
        scope: str | ScopeFunction | None = None,
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool | Callable[[Scope], bool] = True,
        wait: float | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        release: Iterable[int] = RELEASED_STATUSES,
    ) -> None:
        release = check_options(
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
        self._release = release
        self._opening: anyio.Lock | None = None

    @property
    def journal(self) -> Journal | None:
        """The journal in use (None while one given by ``location`` is not open)."""
        return self._journal

    async def open(self) -> Journal:
        """The journal, opening the one at ``location`` once, whoever asks first."""
        if self._journal is not None:
            return self._journal
        if self._opening is None:
            self._opening = anyio.Lock()
        async with self._opening:
            if self._journal is None:
                assert self._location is not None
                self._journal = await Journal.open(self._location)
            return self._journal

    async def aclose(self) -> None:
        """Close a journal this middleware opened (a given ``journal`` stays open)."""
        if self._location is None or self._journal is None:
            return
        journal, self._journal = self._journal, None
        await journal.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] == "http" and str(scope.get("method", "")).upper() in self._methods:
            await self._http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # ------------------------------------------------------------------ lifespan

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._location is None:
            await self.app(scope, receive, send)
            return

        async def lifespan_send(message: Message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                try:
                    await self.open()
                except Exception as error:
                    logger.exception("itemjournal could not open %s", self._location)
                    await send(
                        {
                            "type": "lifespan.startup.failed",
                            "message": f"itemjournal could not open {self._location}: {error}",
                        }
                    )
                    return
            elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                with anyio.CancelScope(shield=True):
                    await self.aclose()
            await send(message)

        try:
            await self.app(scope, receive, lifespan_send)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    # ------------------------------------------------------------------ requests

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            prepared = await self._prepare(scope, receive)
        except Answer as answer:
            await send_reply(send, answer.reply)
            return
        if prepared is None:  # no key, and none required
            await self.app(scope, receive, send)
            return
        if isinstance(prepared, _Gone):
            return
        identity, inputs, body = prepared
        try:
            journal = await self.open()
        except JournalError as error:
            logger.exception("itemjournal could not open %s", self._location)
            await send_reply(send, unavailable(error))
            return
        app_scope = dict(scope)
        extensions = scope.get("extensions")
        if isinstance(extensions, dict):
            app_scope["extensions"] = {
                name: value
                for name, value in extensions.items()
                if name not in _BYPASSING_EXTENSIONS
            }
        recorder: Recorder | None = None
        entered = False
        try:
            async with journal.claim(identity, inputs, DEFINITION, wait=self._wait) as attempt:
                entered = True
                if attempt.reused:
                    await replay(send, attempt.result, attempt.receipt)
                    return
                recorder = Recorder(send, attempt, self._release)
                app_scope[_CLAIM_SCOPE_KEY] = attempt.claim
                await self.app(app_scope, _replaying(body, receive), recorder.send)
                if not recorder.started:
                    await attempt.mark_review(NO_RESPONSE)
                elif not recorder.finished:
                    await attempt.mark_review(UNFINISHED)
                elif recorder.held is not None:
                    await attempt.mark_review(answered_reason(recorder.status))
        except JournalError as error:
            if entered:
                await _after_failure(send, recorder)
                raise
            refused = refusal(error)
            if refused.status == 503:
                logger.error("itemjournal refused an idempotent request: %s", error)
            await send_reply(send, refused)
            return
        except Withdraw:
            # The application declared nothing was sent; the claim block withdrew the
            # claim (or found the record changed, and left it: then it is not free).
            view = None if recorder is None else recorder.attempt.view
            await _after_failure(send, recorder, withdrawn=released(view))
            raise
        except Exception:
            await _after_failure(send, recorder)
            raise
        if recorder is not None:
            if not recorder.started:
                await send_reply(send, internal_error())
            elif recorder.held is not None:
                await send(recorder.held)

    async def _prepare(
        self, scope: Scope, receive: Receive
    ) -> tuple[Identity, dict[str, str | int], bytes] | _Gone | None:
        """Identity, inputs and body of a request with a key; None when it has none."""
        key = request_key(
            header(scope, b"idempotency-key"),
            scope.get("method"),
            lambda: self._required(scope) if callable(self._required) else self._required,
        )
        if key is None:
            return None
        scope_value = await self._scope_value(scope)
        body = await self._read_body(scope, receive)
        if body is None:
            return _Gone()
        return request_identity(scope_value, key), request_inputs(scope, body), body

    async def _scope_value(self, scope: Scope) -> str:
        if self._scope is None:
            return DEFAULT_SCOPE
        if isinstance(self._scope, str):
            return self._scope
        value = self._scope(scope)
        if inspect.isawaitable(value):
            value = await value
        return check_scope_value(value)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole request body (None if the client left), refused beyond the limit."""
        declared_too_large(header(scope, b"content-length"), self._max_body)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > self._max_body:
                raise Answer(too_large(self._max_body))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _Gone:
    """The client disconnected before its request body arrived: nothing to answer."""


async def _after_failure(send: Send, recorder: Recorder | None, *, withdrawn: bool = False) -> None:
    """The application raised: answer what the client has not been answered yet.

    The application's exception is what goes on to the server: a client that left
    meanwhile must not replace it with an error of its own.
    """
    try:
        if withdrawn and (recorder is None or not recorder.started):
            await send_reply(send, withdrawn_error())
        elif recorder is None or not recorder.started:
            await send_reply(send, internal_error())
        elif recorder.held is not None:
            await send(recorder.held)
    except Exception:
        logger.debug("could not answer a failed idempotent request", exc_info=True)
