"""The FastStream middleware: each message claimed before its handler, acknowledged only
once its completion is durable, and kept (never dropped, never run twice) when its record
cannot be run."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
from faststream import BaseMiddleware
from faststream.message import StreamMessage

from .._journal.arguments import check_definitions, check_wait
from .._journal.journal import Journal
from .._model.conflicts import ConflictError
from .._model.errors import InvalidArgument, JournalError, StorageFailed
from .._model.identity import (
    DefinitionLike,
    Identity,
    InputValue,
    coerce_identity,
    input_digest,
)
from .._model.view import Claim
from .once import _AS_STORED, _unpack

__all__ = [
    "DeadLetter",
    "Header",
    "JournalMiddleware",
    "MessageId",
    "Refusal",
    "RefusalPolicy",
    "Reject",
    "current_claim",
]

log = logging.getLogger("itemjournal")

Inputs: TypeAlias = "Mapping[str, InputValue]"

_CLAIM: contextvars.ContextVar[Claim] = contextvars.ContextVar("itemjournal_faststream_claim")


def current_claim() -> Claim:
    """The claim of the message the running handler serves (pass its ``key`` on to the
    provider as its idempotency key). Outside a handler behind ``JournalMiddleware``:
    ``InvalidArgument`` (``INVALID_CLAIM``)."""
    try:
        return _CLAIM.get()
    except LookupError:
        raise InvalidArgument(
            "current_claim() is called from a handler behind JournalMiddleware",
            code="INVALID_CLAIM",
        ) from None


@dataclass(frozen=True, slots=True)
class MessageId:
    """The item label is the id the message carries: RabbitMQ's ``message_id`` property, or
    a ``message_id``, ``Nats-Msg-Id`` (JetStream's de-duplication id) or ``correlation_id``
    header, in this order. A message without one is refused (``INVALID_IDENTITY``): the id
    FastStream would make up for it changes with each delivery."""


@dataclass(frozen=True, slots=True)
class Header:
    """The item label is the value of this message header."""

    name: str


ItemSource: TypeAlias = "MessageId | Header | Callable[[Any], str]"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a message was not run: the error's ``code`` (``REVIEW_REQUIRED``,
    ``IN_PROGRESS``, ``INPUT_CHANGED``, ``INVALID_IDENTITY``, ``INVALID_LABEL``,
    ``INVALID_INPUTS``, a handler's failure as ``HANDLER_FAILED``...), a short reason, and
    the record's identity and ``key`` when they are known (the identity of a message whose
    inputs were refused, no key: nothing was recorded)."""

    code: str
    reason: str
    identity: Identity | None = None
    key: str | None = None

    def headers(self) -> dict[str, str]:
        """The reason as message headers, for a dead-letter copy."""
        headers = {"x-itemjournal-code": self.code, "x-itemjournal-reason": self.reason[:500]}
        if self.identity is not None:
            headers["x-itemjournal-identity"] = "/".join(self.identity)
        if self.key is not None:
            headers["x-itemjournal-key"] = self.key
        return headers


RefusalPolicy: TypeAlias = "Callable[[StreamMessage[Any], Refusal], Awaitable[None]]"


class Reject:
    """The default policy: reject the message without requeueing it. RabbitMQ moves it to
    the queue's dead-letter exchange (``x-dead-letter-exchange``; with none configured,
    RabbitMQ drops it: configure one). NATS JetStream terminates it (``+TERM``): it stays
    in the stream under its sequence (until the stream's limits remove it), is never
    delivered to that consumer again, and the server publishes a ``MSG_TERMINATED``
    advisory (``$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>``) naming
    the stream sequence, without the refusal's reason: the reason is only in the log. To
    keep the reason with the message, use ``DeadLetter`` to a review stream."""

    async def __call__(self, message: StreamMessage[Any], refusal: Refusal) -> None:
        await message.reject()


class DeadLetter:
    """Publish a copy of the message, with the refusal in ``x-itemjournal-*`` headers,
    through ``publish(body, headers)``; only once that returned is the original
    acknowledged. A crash between the two leaves a second copy, never none. ::

        DeadLetter(lambda body, headers: broker.publish(body, "orders.review",
                                                        headers=headers))

    On JetStream, give ``publish`` the review stream (``broker.publish(..., stream=...)``)
    so that it returns once JetStream has stored the copy. The copy keeps the message's
    text headers but those JetStream acts on when a message is published (``Nats-*``:
    expectations, rollups, time to live, de-duplication), which would refuse the copy or
    harm the review stream; a ``Nats-Msg-Id`` travels as the ``message_id`` header, so
    ``MessageId()`` names the same item when the copy is re-driven.
    """

    def __init__(self, publish: Callable[[bytes, dict[str, str]], Awaitable[object]]) -> None:
        self._publish = publish

    async def __call__(self, message: StreamMessage[Any], refusal: Refusal) -> None:
        headers = {
            key: value
            for key, value in message.headers.items()
            if isinstance(value, str) and not key.lower().startswith("nats-")
        }
        own = message.headers.get("Nats-Msg-Id")
        if isinstance(own, str) and own:
            headers.setdefault("message_id", own)
        headers.update(refusal.headers())
        await self._publish(message.body, headers)
        await message.ack()


class JournalMiddleware:
    """A FastStream middleware (``RabbitBroker(middlewares=[...])``, or a router's) that
    runs each message's handler under a claim of ``journal``.

    See the module ``itemjournal.faststream`` for the contract.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        scope: str,
        program: str,
        job: str,
        item: ItemSource,
        inputs: Callable[[Any], Inputs] | None = None,
        definition: DefinitionLike,
        compatible: Iterable[DefinitionLike] = (),
        wait: float | None = 30.0,
        on_refused: RefusalPolicy | None = None,
    ) -> None:
        if not isinstance(journal, Journal):
            raise InvalidArgument(
                f"JournalMiddleware takes a Journal, not {type(journal).__name__}",
                code="INVALID_ARGUMENT",
            )
        coerce_identity((scope, program, job, "x"))  # the fixed labels, checked now
        if not isinstance(item, MessageId | Header) and not callable(item):
            raise InvalidArgument(
                "item is MessageId(), Header(name) or a function of the decoded body",
                code="INVALID_IDENTITY",
            )
        self.journal = journal
        self._labels = (scope, program, job)
        self._item = item
        self._inputs = inputs
        self._definition, *self._compatible = check_definitions(definition, compatible)
        self._wait = check_wait(wait)
        self._on_refused: RefusalPolicy = on_refused if on_refused is not None else Reject()
        self._draining = False
        self.in_flight = 0

    def stop_taking(self) -> None:
        """From now on a message is given back to the broker (requeued) before any claim,
        for another worker; those already claimed go on. Call it when a drain begins."""
        self._draining = True

    def __call__(self, msg: Any, /, *, context: Any) -> _Scope:
        return _Scope(msg, context=context, owner=self)

    async def identity_of(self, message: StreamMessage[Any]) -> tuple[Identity, Inputs]:
        """The identity and inputs of a message, as the middleware claims it. Raises what
        refuses the message: ``InvalidArgument`` (``INVALID_IDENTITY``, ``INVALID_LABEL``,
        ``INVALID_INPUTS``) or the error of the ``item`` or ``inputs`` function."""
        return await self._identity(message), await self._checked_inputs(message)

    async def _identity(self, message: StreamMessage[Any]) -> Identity:
        if isinstance(self._item, MessageId):
            item: object = _own_id(message)
            if item is None:
                raise InvalidArgument(
                    "the message carries no id (no message_id property, no message_id, "
                    "Nats-Msg-Id or correlation_id header), so MessageId() names nothing "
                    "that a redelivery would name again",
                    code="INVALID_IDENTITY",
                )
        elif isinstance(self._item, Header):
            item = message.headers.get(self._item.name)
        else:
            item = self._item(await message.decode())
        return coerce_identity((*self._labels, item))

    async def _checked_inputs(self, message: StreamMessage[Any]) -> Inputs:
        inputs = {} if self._inputs is None else self._inputs(await message.decode())
        input_digest(inputs)  # refuses what the journal would refuse: a float, a long text
        return inputs

    async def consume(self, call_next: Callable[[Any], Awaitable[Any]], message: Any) -> Any:
        if self._draining:
            await message.nack()
            return None
        # A message the journal would refuse as an argument is a plain refusal: handed to
        # the policy once, never raised to the broker as a handler failure.
        try:
            ident = await self._identity(message)
        except Exception as error:
            await self._refuse(message, _plain(error, "INVALID_IDENTITY", None))
            return None
        try:
            inputs = await self._checked_inputs(message)
        except Exception as error:
            await self._refuse(message, _plain(error, "INVALID_INPUTS", ident))
            return None
        self.in_flight += 1
        claimed: Claim | None = None
        entered = False
        try:
            async with self.journal.claim(
                ident, inputs, self._definition, wait=self._wait, compatible=self._compatible
            ) as attempt:
                entered = True
                if attempt.reused:
                    await message.ack()
                    return None
                claimed = attempt.claim
                token = _CLAIM.set(claimed)
                try:
                    value: object = await call_next(message)
                finally:
                    _CLAIM.reset(token)
                receipt, result, problem = _unpack(value, _AS_STORED, "the handler")
                if problem is not None:
                    with anyio.CancelScope(shield=True):
                        await attempt.mark_review(problem)
                    raise InvalidArgument(problem, code="INVALID_RECEIPT")
                await attempt.complete(receipt, result=result)
        except StorageFailed as error:
            if claimed is None:  # nothing was claimed: the broker may try it again
                log.warning("message %s given back: %s", ident, error)
                await message.nack()
                return None
            await self._refuse(message, _refusal(error, ident, claimed))
            raise
        except ConflictError as error:
            if claimed is None:  # refused at entry: IN_PROGRESS, REVIEW_REQUIRED...
                view = error.view
                await self._refuse(
                    message, Refusal(error.code, error.message, ident, view.key if view else None)
                )
                return None
            await self._refuse(message, _refusal(error, ident, claimed))
            raise
        except Exception as error:
            if not entered and isinstance(error, InvalidArgument):  # refused before a claim
                await self._refuse(message, _plain(error, "INVALID_ARGUMENT", ident))
                return None
            await self._refuse(message, _refusal(error, ident, claimed))
            raise
        else:
            await message.ack()  # only now: the receipt is durable
            return value
        finally:
            self.in_flight -= 1

    async def _refuse(self, message: StreamMessage[Any], refusal: Refusal) -> None:
        log.warning(
            "message %s kept by the refusal policy: %s: %s",
            "/".join(refusal.identity) if refusal.identity else message.message_id,
            refusal.code,
            refusal.reason,
        )
        with anyio.CancelScope(shield=True):
            try:
                await self._on_refused(message, refusal)
            except Exception:
                # The policy could not keep it (a dead-letter publish failed): give it back
                # rather than let an acknowledgement policy reject or drop it.
                log.exception("the refusal policy failed; the message is given back")
                await message.nack()


def _code(error: BaseException, default: str) -> str:
    return error.code if isinstance(error, JournalError) else default


def _plain(error: Exception, default: str, ident: Identity | None) -> Refusal:
    """A refusal before any claim: the journal's message, or the function's error."""
    if isinstance(error, JournalError):
        return Refusal(error.code, error.message, ident)
    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return Refusal(default, reason, ident)


def _own_id(message: StreamMessage[Any]) -> str | None:
    """The id the message carries: RabbitMQ's ``message_id`` property, else a
    ``message_id``, ``Nats-Msg-Id`` or ``correlation_id`` header. Not FastStream's
    ``message.message_id`` as such: for a message without one it is made afresh for each
    delivery, so a redelivery would be another item."""
    own = getattr(message.raw_message, "message_id", None)
    if isinstance(own, str) and own:
        return own
    for name in ("message_id", "Nats-Msg-Id", "correlation_id"):
        value = message.headers.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def _refusal(error: BaseException, ident: Identity, claimed: Claim | None) -> Refusal:
    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return Refusal(_code(error, "HANDLER_FAILED"), reason, ident, claimed.key if claimed else None)


class _Scope(BaseMiddleware):
    """One message's pass through ``JournalMiddleware``."""

    def __init__(self, msg: Any, /, *, context: Any, owner: JournalMiddleware) -> None:
        super().__init__(msg, context=context)
        self._owner = owner

    async def consume_scope(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        return await self._owner.consume(call_next, msg)
