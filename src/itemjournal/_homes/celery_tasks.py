"""The Celery home: a task whose effect happens once per item, claimed in a blocking
journal before its body runs, completed before the task returns."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, ParamSpec, Protocol, TypeAlias, TypeVar

import celery

from .._journal.arguments import check_definitions, check_wait, definition_hashes_blocking
from .._model.errors import InvalidArgument, JournalError, StorageFailed
from .._model.identity import DefinitionLike, Identity, IdentityLike, InputValue, coerce_identity
from .._model.view import Claim
from .._sync.claim import ClaimedAttempt, ReusedAttempt
from .._sync.journal import Journal
from .._sync.once import _PAIR, _STR, _declared_shape, _name, _unpack
from .._sync.sources import JournalSource, journal_of

__all__ = [
    "Fail",
    "OnceTask",
    "Refusal",
    "RefusalPolicy",
    "TaskRefused",
    "current_claim",
    "once_task",
]

log = logging.getLogger("itemjournal")

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

Inputs: TypeAlias = "Mapping[str, InputValue]"

# What a task's options may not undo: without them a killed worker's task is lost, or
# acknowledged before its record says how it ended.
_REQUIRED = {"acks_late": True, "reject_on_worker_lost": True}

_CLAIM: contextvars.ContextVar[Claim] = contextvars.ContextVar("itemjournal_celery_claim")


def current_claim() -> Claim:
    """The claim of the task the running body serves (pass its ``key`` on to the provider
    as its idempotency key). Outside a body under ``once_task``: ``InvalidArgument``
    (``INVALID_CLAIM``)."""
    try:
        return _CLAIM.get()
    except LookupError:
        raise InvalidArgument(
            "current_claim() is called from the body of a task made by once_task",
            code="INVALID_CLAIM",
        ) from None


class TaskRefused(JournalError):
    """A task the journal did not let run. ``code`` is the refusal's (``REVIEW_REQUIRED``,
    ``IN_PROGRESS``, ``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``RECORD_INVALID``,
    ``INVALID_IDENTITY``...), ``identity`` its four labels (when they could be made) and
    ``key`` the record's key. Its arguments are plain text, so a result backend stores it
    and gives it back with any serializer."""

    def __init__(
        self,
        code: str,
        reason: str,
        identity: Iterable[str] | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(reason, code=code)
        self.identity: tuple[str, ...] | None = None if identity is None else tuple(identity)
        self.key = key
        labels = None if self.identity is None else list(self.identity)
        self.args = (code, reason, labels, key)

    def __reduce__(self) -> tuple[object, ...]:
        return (TaskRefused, self.args)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a task did not run, for a refusal policy: the refusal's ``code`` and reason,
    the record's identity and ``key`` when known, and the task (its name, id and
    arguments), so a policy can send a copy somewhere an operator looks."""

    code: str
    reason: str
    identity: Identity | None
    key: str | None
    task: str
    task_id: str | None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def error(self) -> TaskRefused:
        """The refusal as the exception a failed task stores."""
        return TaskRefused(self.code, self.reason, self.identity, self.key)


RefusalPolicy: TypeAlias = "Callable[[Refusal], object]"


class Fail:
    """The default refusal policy: the task fails with ``TaskRefused`` (the refusal's
    code); with late acknowledgement its message is acknowledged, so it is not delivered
    again, and its failure is what the result backend, the events and the worker's log
    show. The record stays as it is (in review for ``REVIEW_REQUIRED``)."""

    def __call__(self, refusal: Refusal) -> NoReturn:
        raise refusal.error()


class OnceTask(Protocol[P, R_co]):
    """What ``once_task`` makes: a Celery task (``celery.Task``) whose ``delay`` takes the
    decorated function's arguments."""

    name: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def apply_async(
        self,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any: ...

    def apply(
        self,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any: ...

    def s(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...


def once_task(
    app: celery.Celery,
    journal: JournalSource,
    *,
    identity: Callable[..., IdentityLike],
    inputs: Callable[..., Inputs] | None = None,
    definition: DefinitionLike | None = None,
    compatible: Iterable[DefinitionLike] = (),
    wait: float | None = None,
    in_progress_countdown: float = 5.0,
    on_refused: RefusalPolicy | None = None,
    **options: Any,
) -> Callable[[Callable[P, R]], OnceTask[P, R]]:
    """Make a Celery task of ``app`` whose effect runs at most once per item.

    ``journal``: an ``itemjournal.sync.Journal`` (opened at import: it works in the pool's
    children after the fork), or a function of no arguments returning one.
    ``identity`` and ``inputs`` take the task's arguments, exactly as the decorated
    function does. ``definition`` and ``compatible``: as ``begin`` takes them (omitted:
    the decorated function's source). ``wait``: seconds a delivery waits in its pool slot
    while the item runs elsewhere, before it is retried (``None``: not at all).
    ``in_progress_countdown``: seconds before a delivery refused ``IN_PROGRESS`` is
    tried again (``task.retry``, without a retry limit). ``on_refused``: what a task the
    journal refuses does (default ``Fail()``). Every other keyword is the task's option,
    as ``app.task`` takes it (``name=``, ``queue=``...); ``acks_late`` and
    ``reject_on_worker_lost`` are always true.
    """
    for option, needed in _REQUIRED.items():
        if options.get(option, needed) is not needed:
            raise InvalidArgument(
                f"once_task needs {option}=True: without it a killed worker's task is lost",
                code="INVALID_ARGUMENT",
            )
    if "bind" in options:
        raise InvalidArgument(
            "once_task takes no bind=: the body gets its claim from current_claim()",
            code="INVALID_ARGUMENT",
        )
    if not isinstance(journal, Journal) and not callable(journal):
        raise InvalidArgument(
            "once_task takes an itemjournal.sync.Journal or a function returning one, "
            f"not {type(journal).__name__}",
            code="INVALID_ARGUMENT",
        )
    if not callable(identity):
        raise InvalidArgument(
            "identity is a function of the task's arguments returning its four labels",
            code="INVALID_IDENTITY",
        )
    if inputs is not None and not callable(inputs):
        raise InvalidArgument(
            "inputs is a function of the task's arguments returning a mapping",
            code="INVALID_INPUTS",
        )
    if wait is not None:
        check_wait(wait)
    countdown = check_wait(in_progress_countdown)
    policy: RefusalPolicy = on_refused if on_refused is not None else Fail()
    if not callable(policy):
        raise InvalidArgument("on_refused is a function of a Refusal", code="INVALID_ARGUMENT")

    def decorate(func: Callable[P, R]) -> OnceTask[P, R]:
        forms = check_definitions(definition if definition is not None else func, compatible)
        body = _Body(
            func,
            journal,
            identity=identity,
            inputs=inputs,
            digests=definition_hashes_blocking(forms),
            wait=wait,
            countdown=countdown if countdown is not None else 0.0,
            policy=policy,
        )

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            return body.run(task, args, kwargs)

        # Celery checks the arguments of ``delay`` against this signature.
        run.__signature__ = inspect.signature(func)  # type: ignore[attr-defined]
        # A proxy until the app is finalized: the task's name is read only when it runs.
        task = app.task(**{**options, **_REQUIRED})(run)
        return task  # type: ignore[no-any-return]

    return decorate


class _Body(Generic[P, R]):
    """One task's run: claim, body, complete; or the answer for a refusal."""

    def __init__(
        self,
        func: Callable[P, R],
        journal: JournalSource,
        *,
        identity: Callable[..., IdentityLike],
        inputs: Callable[..., Inputs] | None,
        digests: tuple[str, frozenset[str]],
        wait: float | None,
        countdown: float,
        policy: RefusalPolicy,
    ) -> None:
        self.func = func
        self.journal = journal
        self.identity = identity
        self.inputs = inputs
        self.definition, self.compatible = digests
        self.wait = wait
        self.countdown = countdown
        self.policy = policy
        self.shape = _declared_shape(func)
        self.name = _name(func)

    def run(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        journal = journal_of(self.journal, "once_task()")
        try:
            ident = coerce_identity(self.identity(*args, **kwargs))
            inputs = {} if self.inputs is None else dict(self.inputs(*args, **kwargs))
        except Exception as error:
            return self.refuse(task, args, kwargs, _code(error, "INVALID_IDENTITY"), error)
        started = False
        try:
            with journal.claim(
                ident, inputs, self.definition, wait=self.wait, compatible=self.compatible
            ) as attempt:
                started = True
                return self.settle(attempt, args, kwargs)
        except JournalError as error:
            if started:  # the body's own failure, or its completion's: the record says
                raise
            key = getattr(getattr(error, "view", None), "key", None)
            if isinstance(error, StorageFailed):
                # Nothing was claimed: the task may run later. Retried within the task's
                # own ``max_retries``, so a store that stays down ends in a visible failure.
                log.warning("task %s for %s retried: %s", task.name, ident, error)
                raise self.retry(task, error, max_retries=task.max_retries) from error
            if error.code == "IN_PROGRESS" and not _in_process(task):
                refused = TaskRefused(error.code, error.message, ident, key)
                log.info("task %s for %s retried: %s", task.name, ident, error.message)
                raise self.retry(task, refused, max_retries=math.inf) from error
            return self.refuse(task, args, kwargs, error.code, error, ident=ident, key=key)

    def settle(
        self,
        attempt: ReusedAttempt | ClaimedAttempt,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> object:
        if attempt.reused:
            if self.shape == _PAIR or (self.shape != _STR and attempt.result is not None):
                return (attempt.receipt, attempt.result)
            return attempt.receipt
        token = _CLAIM.set(attempt.claim)
        try:
            value: object = self.func(*args, **kwargs)
        finally:
            _CLAIM.reset(token)
        receipt, result, problem = _unpack(value, self.shape, self.name)
        if problem is not None:
            attempt.mark_review(problem)
            raise InvalidArgument(
                f"{problem}; {list(attempt.claim.identity)} now needs review",
                code="INVALID_RECEIPT",
            )
        attempt.complete(receipt, result=result)
        return (receipt, result) if isinstance(value, tuple) else receipt

    def retry(self, task: Any, error: Exception, *, max_retries: float | None) -> Exception:
        # Celery reads ``max_retries=None`` as the task's own limit, not as none.
        retried: Exception = task.retry(
            exc=error, countdown=self.countdown, max_retries=max_retries, throw=False
        )
        return retried

    def refuse(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        code: str,
        error: BaseException,
        *,
        ident: Identity | None = None,
        key: str | None = None,
    ) -> object:
        reason = error.message if isinstance(error, JournalError) else str(error)
        refusal = Refusal(
            code,
            reason or type(error).__name__,
            ident,
            key,
            str(task.name),
            getattr(task.request, "id", None),
            tuple(args),
            dict(kwargs),
        )
        log.warning(
            "task %s[%s] not run: %s: %s",
            refusal.task,
            refusal.task_id,
            code,
            "/".join(ident) if ident else refusal.reason,
        )
        return self.policy(refusal)


def _code(error: BaseException, default: str) -> str:
    return error.code if isinstance(error, JournalError) else default


def _in_process(task: Any) -> bool:
    """Run by ``apply()`` or called as a function: a retry there would run again at
    once, in this very call, so it is answered as a refusal instead."""
    request = task.request
    return bool(getattr(request, "is_eager", False) or getattr(request, "called_directly", True))
