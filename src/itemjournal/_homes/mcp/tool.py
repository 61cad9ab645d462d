"""``effect_once``: an MCP tool whose effect happens at most once per call identity.

A call's identity, inputs and definition are worked out from the tool and its arguments
(``CallShape``); the call then goes through ``journal.claim``, so every way out of the
tool leaves the record as the claim block does (an exception under the claim marks it
``needs_review``, a withdrawal releases it). What the journal answers becomes an MCP tool
result: the stored answer (fresh or replayed), or a tool error for the model to read.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
import re
import typing
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, ParamSpec, TypeAlias

from mcp.types import CallToolResult
from pydantic_core import to_jsonable_python

from ..._journal.arguments import (
    check_compatible,
    check_definition,
    check_wait,
    definition_hashes,
    is_async,
)
from ..._journal.journal import Journal
from ..._model.conflicts import ConflictError
from ..._model.errors import InvalidArgument
from ..._model.identity import (
    MAX_INPUT_INT,
    DefinitionLike,
    Identity,
    IdentityLike,
    InputValue,
    check_label,
    coerce_identity,
    identity_digest,
    label,
)
from ..._model.view import Claim
from ..sources import JournalSource, journal_of
from . import answers

__all__ = ["EffectOnce", "current_claim", "effect_once"]

Arguments: TypeAlias = "Mapping[str, Any]"

P = ParamSpec("P")

_INPUT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_MAX_INPUTS = 20
_MAX_TEXT = 20_000

_claim: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "itemjournal_mcp_claim", default=None
)


def current_claim() -> Claim:
    """The claim the running effect-once tool holds: pass ``current_claim().key`` to the
    service the tool calls as its idempotency key. ``INVALID_CLAIM`` outside such a tool."""
    claim = _claim.get()
    if claim is None:
        raise InvalidArgument(
            "current_claim() is only known inside a tool made effect-once",
            code="INVALID_CLAIM",
        )
    return claim


def _canonical(value: object) -> bytes:
    """The canonical JSON of ``value`` (sorted keys, compact, UTF-8); ``ValueError`` for a
    value JSON cannot carry (NaN, an infinity, an object of no JSON form) or text that
    is not Unicode (a lone surrogate: ``UnicodeEncodeError``, a ``ValueError`` too)."""
    text = json.dumps(
        to_jsonable_python(value),
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
        allow_nan=False,
    )
    return text.encode("utf-8")


def fingerprint(arguments: Arguments) -> str:
    """SHA-256 hex of the arguments' canonical JSON (sorted keys, compact, UTF-8)."""
    return hashlib.sha256(_canonical(dict(arguments))).hexdigest()


def unrecordable(arguments: Arguments) -> str | None:
    """Why ``arguments`` cannot be recorded (named by the first argument at fault), or
    None when they can: every name and value must have one canonical JSON text in UTF-8.
    A call refused here never reaches the journal, so nothing runs."""
    for name, value in arguments.items():
        shown = json.dumps(name) if isinstance(name, str) else repr(name)
        if not isinstance(name, str) or not _is_text(name):
            return f"the argument name {shown} is not plain Unicode text"
        try:
            _canonical(value)
        except UnicodeEncodeError:
            return (
                f"the argument {shown} holds text that is not valid Unicode (a lone "
                "surrogate, as a JSON \\ud800 escape makes)"
            )
        except (ValueError, TypeError):
            return (
                f"the argument {shown} holds a value JSON cannot carry (NaN or an infinity, "
                "or an object with no JSON form)"
            )
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def inputs_of(arguments: Arguments) -> dict[str, InputValue]:
    """The arguments as the record's inputs when they fit the journal's rules, otherwise
    one input, ``arguments``, the fingerprint of them all."""
    fits = len(arguments) <= _MAX_INPUTS and all(
        isinstance(name, str)
        and _INPUT_KEY.fullmatch(name) is not None
        and (
            value is None
            or (isinstance(value, int) and -MAX_INPUT_INT <= value <= MAX_INPUT_INT)
            or (isinstance(value, str) and len(value) <= _MAX_TEXT)
        )
        for name, value in arguments.items()
    )
    if fits:
        return dict(arguments)
    return {"arguments": fingerprint(arguments)}


def effect_once(
    journal: JournalSource,
    *,
    scope: str,
    program: str = "mcp",
    name: str | None = None,
    key_argument: str | None = "idempotency_key",
    identity: Callable[[str, dict[str, Any]], IdentityLike] | None = None,
    definition: DefinitionLike | None = None,
    compatible: Iterable[DefinitionLike] = (),
    wait: float | None = 10.0,
    retry_after: float = 5.0,
) -> EffectOnce:
    """Make an MCP tool effect-once; see ``itemjournal.mcp`` for the whole contract."""
    if not isinstance(journal, Journal) and not callable(journal):
        raise InvalidArgument(
            "effect_once() takes a Journal or a function returning one, "
            f"not {type(journal).__name__}",
            code="INVALID_ARGUMENT",
        )
    check_label(scope, "scope")
    check_label(program, "program")
    if name is not None:
        check_label(name, "tool name")
    if key_argument is not None and not (isinstance(key_argument, str) and key_argument):
        raise InvalidArgument("key_argument must be a name or None", code="INVALID_ARGUMENT")
    if identity is not None and not callable(identity):
        raise InvalidArgument("identity must be a function", code="INVALID_ARGUMENT")
    if isinstance(retry_after, bool) or not isinstance(retry_after, int | float):
        raise InvalidArgument("retry_after must be a number of seconds", code="INVALID_ARGUMENT")
    if not retry_after > 0:
        raise InvalidArgument("retry_after must be positive", code="INVALID_ARGUMENT")
    return EffectOnce(
        journal,
        scope=scope,
        program=program,
        name=name,
        key_argument=key_argument,
        identity=identity,
        definition=None if definition is None else check_definition(definition),
        compatible=check_compatible(compatible),
        wait=check_wait(wait),
        retry_after=float(retry_after),
    )


class EffectOnce:
    """What ``effect_once(...)`` returns: a decorator for a tool function of an
    ``MCPServer``, and ``call`` for a tool handler of a low-level ``Server``."""

    def __init__(
        self,
        journal: JournalSource,
        *,
        scope: str,
        program: str,
        name: str | None,
        key_argument: str | None,
        identity: Callable[[str, dict[str, Any]], IdentityLike] | None,
        definition: str | Callable[..., Any] | None,
        compatible: tuple[str | Callable[..., Any], ...],
        wait: float | None,
        retry_after: float,
    ) -> None:
        self._journal = journal
        self._scope = scope
        self._program = program
        self._name = name
        self._key_argument = key_argument
        self._identity = identity
        self._definition = definition
        self._compatible = compatible
        self._wait = wait
        self._retry_after = retry_after
        self._digests: dict[object, tuple[str, frozenset[str]]] = {}

    def __repr__(self) -> str:
        return f"effect_once(scope={self._scope!r}, name={self._name!r})"

    def __call__(
        self, func: Callable[P, Awaitable[Any]]
    ) -> Callable[P, Coroutine[Any, Any, CallToolResult]]:
        """Wrap an ``async def`` tool; the wrapper takes the same arguments and returns a
        ``CallToolResult`` (register it with ``server.tool()`` or ``server.add_tool``)."""
        if not is_async(func):
            raise InvalidArgument(
                "effect_once() decorates an async def tool function", code="INVALID_ARGUMENT"
            )
        tool_name: str = self._name or str(getattr(func, "__name__", ""))
        check_label(tool_name, "tool name")
        signature = inspect.signature(func)
        skipped = _context_parameters(func)

        @functools.wraps(func)
        async def tool(*args: P.args, **kwargs: P.kwargs) -> CallToolResult:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = {k: v for k, v in bound.arguments.items() if k not in skipped}
            return await self.call(
                tool_name, arguments, lambda: func(*args, **kwargs), definition_of=func
            )

        # What the server reads: the tool's own parameters, and a result it passes on as is.
        tool.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=CallToolResult
        )
        tool.__annotations__ = {
            **getattr(func, "__annotations__", {}),
            "return": CallToolResult,
        }
        return tool

    async def call(
        self,
        name: str,
        arguments: Arguments,
        run: Callable[[], Awaitable[Any]],
        *,
        definition_of: Callable[..., Any] | None = None,
    ) -> CallToolResult:
        """Run ``run()`` (the tool's effect) at most once for this call of tool ``name``
        with ``arguments``, and answer as an MCP tool result."""
        check_label(name, "tool name")
        if definition_of is None and self._definition is None:
            raise InvalidArgument(
                "effect_once(...).call needs definition=: the tool's version or its function",
                code="INVALID_ARGUMENT",
            )
        journal = await self._journal_now()
        problem = unrecordable(arguments)
        if problem is not None:
            return answers.unrecordable(problem)
        ident = self._identity_of(name, arguments)
        key = identity_digest(ident)
        where = " ".join(ident)
        inputs = inputs_of({k: v for k, v in arguments.items() if k != self._key_argument})
        digest, accepted = await self._definitions(definition_of or run)
        began = False
        try:
            async with journal.claim(
                ident, inputs, digest, wait=self._wait, compatible=accepted
            ) as attempt:
                if attempt.reused:
                    return answers.replay(None, attempt.result, attempt.receipt, key)
                began = True
                token = _claim.set(attempt.claim)
                try:
                    value = await run()
                finally:
                    _claim.reset(token)
                try:
                    stored = answers.stored_result(value)
                except InvalidArgument as error:
                    await attempt.mark_review(f"the tool's answer cannot be replayed: {error}")
                    return answers.uncertain(key, where, "its answer could not be kept")
                receipt = "sha256:" + hashlib.sha256(stored.encode("utf-8")).hexdigest()
                await attempt.complete(receipt, result=stored)
                return answers.fresh(stored, key)
        except Exception as error:
            if not began:
                if isinstance(error, ConflictError):
                    return self._refusal(error, key, where)
                raise
            # The claim block has settled the record already: released when the tool
            # withdrew its claim (nothing was sent), needs_review otherwise.
            view = await journal.inspect(ident)
            if view.status == "released":
                return answers.withdrawn(key, str(error) or type(error).__name__)
            if view.status == "needs_review":
                return answers.uncertain(key, where, "the tool failed after it began")
            raise

    def _refusal(self, error: ConflictError, key: str, where: str) -> CallToolResult:
        if error.code == "INPUT_CHANGED":
            return answers.changed_arguments(key)
        if error.code == "DEFINITION_CHANGED":
            return answers.changed_definition(key, where)
        if error.code == "IN_PROGRESS":
            return answers.still_running(key, self._wait, self._retry_after)
        if error.code == "REVIEW_REQUIRED":
            reason = error.view.review_reason if error.view is not None else None
            return answers.uncertain(key, where, reason or "it needs review")
        raise error

    def _identity_of(self, name: str, arguments: Arguments) -> Identity:
        if self._identity is not None:
            return coerce_identity(self._identity(name, dict(arguments)))
        given = arguments.get(self._key_argument) if self._key_argument else None
        if given is None:
            rest = {k: v for k, v in arguments.items() if k != self._key_argument}
            item = "a." + fingerprint(rest)
        elif isinstance(given, str):
            item = label("k." + given)  # "k.<key>" when that is a label: see itemjournal.mcp
        else:  # not text: its JSON, apart from every text key
            item = label("kj." + _canonical(given).decode("utf-8"))
        return Identity(self._scope, self._program, name, item)

    async def _definitions(self, func: Callable[..., Any]) -> tuple[str, frozenset[str]]:
        form = func if self._definition is None else self._definition
        known = self._digests.get(form)
        if known is None:
            # A source is read in a worker thread, once per tool.
            known = await definition_hashes((form, *self._compatible))
            self._digests[form] = known
        return known

    async def _journal_now(self) -> Journal:
        return await journal_of(self._journal, "effect_once()")


def _context_parameters(func: Callable[..., Any]) -> frozenset[str]:
    """The parameters the server fills with its request context: never arguments."""
    from mcp.server.mcpserver import Context

    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable annotations: the server cannot inject into them either
        return frozenset()
    found = set()
    for parameter, hint in hints.items():
        candidates = (hint, *typing.get_args(hint))
        if any(isinstance(c, type) and issubclass(c, Context) for c in candidates):
            found.add(parameter)
    found.discard("return")
    return frozenset(found)
