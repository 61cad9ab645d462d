"""One caller's operation in the SQLite store's batching writer.

An operation (a step on one row, or a setting) waits in the writer's queue (``_PENDING``),
is taken into a batch (``_TAKEN``) and is done (``_DONE``) once the batch's fate is
known. Inside the batch, in the writer thread, its outcome is only decided; it is
published to its caller when the batch has committed, or failed, as a whole. An awaiting
caller is woken through its event loop (``token``); a blocking caller, which has no
loop, through its own ``waker``, set straight from the writer thread.
"""

from __future__ import annotations

import threading
from typing import Any, Final, Generic, TypeVar

import anyio
from anyio.lowlevel import EventLoopToken

from ..._model.identity import Identity, identity_digest
from ..seam import StepFunction

__all__ = ["_DONE", "_PENDING", "_TAKEN", "_Operation"]

T = TypeVar("T")

_PENDING, _TAKEN, _DONE = 0, 1, 2
_UNSET: Final[Any] = object()


class _Operation(Generic[T]):
    """One caller's step (or setting), waiting for (or inside) a batch.

    Inside the batch (in the writer thread) the outcome is only *decided*
    (``pending``); it is published (``answer``/``error``, ``settled``) when the batch's
    fate is known, and the caller is woken through its event loop.
    """

    __slots__ = (
        "_done",
        "abandoned",
        "answer",
        "culprit",
        "depends",
        "error",
        "identity",
        "key",
        "pending",
        "queued_at",
        "setting",
        "settled",
        "state",
        "step",
        "token",
        "waker",
        "wrote",
    )

    def __init__(
        self,
        key: str,
        *,
        identity: Identity | None = None,
        step: StepFunction[T] | None = None,
        setting: tuple[str, str] | None = None,
    ) -> None:
        self.key = key  # the row's digest, or the meta key of a setting
        self.identity = identity
        self.step = step
        self.setting = setting
        self.state = _PENDING
        self.token: EventLoopToken | None = None  # the caller's event loop, to be woken on
        self.waker: threading.Event | None = None  # or, for a blocking caller, its own
        self.queued_at = 0.0  # time.monotonic() when the caller queued it
        self.abandoned = False  # its caller was cancelled while a batch held it
        self._done: anyio.Event | None = None
        self.answer: T = _UNSET
        self.error: BaseException | None = None
        self.settled = False
        self.pending: tuple[bool, Any] | None = None  # (is an error, value), decided
        self.wrote = False  # its write is part of the transaction
        self.depends = False  # it read a row an earlier member of its batch wrote
        self.culprit = False  # its step raised a BaseException that ended the batch

    @classmethod
    def of(cls, identity: Identity, step: StepFunction[T]) -> _Operation[T]:
        return cls(identity_digest(identity), identity=identity, step=step)

    @property
    def done(self) -> anyio.Event:
        """Set (on the caller's event loop) when the operation is done."""
        if self._done is None:
            self._done = anyio.Event()
        return self._done

    def reset(self) -> None:
        self.pending = None
        self.wrote = self.depends = self.culprit = False

    def publish(self) -> None:
        """Make the decided outcome the caller's answer."""
        assert self.pending is not None
        is_error, value = self.pending
        if is_error:
            self.error = value
        else:
            self.answer = value
        self.settled = True

    def fail(self, error: BaseException) -> None:
        self.answer = _UNSET
        self.error = error
        self.settled = True

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.answer
