"""``@once(journal, identity=...)``: an ``async def`` that returns a receipt, run at most
once per identity, through the claim block."""

from __future__ import annotations

import functools
import typing
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, ParamSpec, TypeAlias, overload

import anyio

from .._journal.arguments import (
    Definitions,
    check_compatible,
    check_definition,
    check_wait,
    definition_hashes,
    is_async,
)
from .._journal.faces import ASYNC
from .._journal.journal import Journal
from .._model.errors import InvalidArgument
from .._model.identity import (
    DefinitionLike,
    Identity,
    IdentityLike,
    coerce_identity,
    input_digest,
)
from .._model.records import receipt_problem, result_problem
from .sources import JournalSource, journal_of

__all__ = ["once"]

P = ParamSpec("P")

InputValue: TypeAlias = "str | int | bool | None"
Inputs: TypeAlias = "Mapping[str, InputValue]"
Pair: TypeAlias = "tuple[str, str | None]"

# What a call returns, decided once when the function is decorated (see ``once``).
_STR = "a receipt str"
_PAIR = "a (receipt, result) pair"
_AS_STORED = "as stored"


def once(
    journal: JournalSource,
    *,
    identity: IdentityLike | Callable[..., IdentityLike],
    inputs: Inputs | Callable[..., Inputs] | None = None,
    definition: DefinitionLike | None = None,
    wait: float | None = None,
    compatible: Iterable[DefinitionLike] = (),
) -> Once:
    """Decorate an ``async def`` that performs one effect and returns its receipt.

    Each call claims its identity in ``journal`` first; the function runs only under a
    fresh claim, and its receipt is stored. A later call with the same identity, inputs
    and definition returns the stored receipt without running the function::

        @itemjournal.once(
            journal,
            identity=lambda order: ("shop", "billing", "charge", order.id),
            inputs=lambda order: {"amount_cents": order.amount_cents},
            definition="billing-v3",
        )
        async def charge(order: Order) -> str:
            return (await provider.charge(order.id, order.amount_cents)).id

        receipt = await charge(order)   # the provider is called at most once per order

    ``journal``: a ``Journal``, or a function of no arguments returning one (or an
    awaitable of one), called on every call, for applications that open their journal
    at startup.

    ``identity`` and ``inputs``: fixed values, or functions that take the call's
    arguments (exactly as the decorated function does) and return them. ``inputs``
    defaults to no inputs.

    ``definition``: what ``begin`` takes, with the same meaning. A 64-character
    lowercase hex string is used as the definition digest itself; any other string is a
    version (``definition_digest(version)``), so only a deliberate bump is a new
    definition; a callable stands for its source. Omitted: the digest of the decorated
    function's source, so any edit of the function is a new definition. A source is read
    at the first call, in a worker thread; one that cannot be read fails that call with
    ``INVALID_HASH`` before anything is written.

    ``compatible``: earlier definitions (same forms) this function is compatible with,
    passed to ``journal.claim``: a record that succeeded under one of them is reused.

    ``wait``: passed to ``journal.claim``; seconds to wait while the identity is in
    progress elsewhere, then answer as usual (``IN_PROGRESS`` on timeout).

    What a call returns: the function returns a receipt ``str``, or a ``(receipt,
    result)`` pair whose ``result`` (a ``str`` or None) is stored for replay. A function
    annotated ``-> str`` always returns the receipt, also when reused; one annotated
    ``-> tuple[str, str]`` always returns a pair, whose result is None when the record
    holds none (resolved by an operator, say). A function whose return annotation is
    neither (or cannot be resolved) gets back what was stored: a pair when a result was
    stored, the receipt otherwise.

    Exits, as the claim block: when the function raises or is cancelled, the record
    needs review and the exception goes on. When it returns anything but the promised
    shape with a valid receipt, the record needs review with a reason saying what was
    wrong, and ``InvalidArgument`` (``INVALID_RECEIPT``) is raised. Errors of the claim
    itself (``INPUT_CHANGED``, ``DEFINITION_CHANGED``, ``IN_PROGRESS``,
    ``REVIEW_REQUIRED``, ...) come from the call before the function runs.
    """
    if not isinstance(journal, Journal) and not callable(journal):
        raise InvalidArgument(
            f"once() takes a Journal or a function returning one, not {type(journal).__name__}",
            code="INVALID_ARGUMENT",
        )
    chosen_identity: Identity | Callable[..., IdentityLike]
    chosen_identity = identity if callable(identity) else coerce_identity(identity)
    chosen_inputs: Inputs | Callable[..., Inputs]
    if inputs is None:
        chosen_inputs = {}
    elif isinstance(inputs, Mapping):
        chosen_inputs = dict(inputs)  # a copy: later edits of the caller's dict change nothing
        input_digest(chosen_inputs)  # refuses bad inputs now, not at the first call
    elif callable(inputs):
        chosen_inputs = inputs
    else:
        raise InvalidArgument(
            f"inputs must be a mapping or a function returning one, not {type(inputs).__name__}",
            code="INVALID_INPUTS",
        )
    # Refused now, not at the first call: the definitions (the sources of callables are
    # read at the first call) and the wait.
    chosen_definition = None if definition is None else check_definition(definition)
    earlier = check_compatible(compatible)
    wait = check_wait(wait)
    return Once(
        journal,
        identity=chosen_identity,
        inputs=chosen_inputs,
        definition=chosen_definition,
        wait=wait,
        compatible=earlier,
    )


class Once:
    """The decorator ``once(...)`` returns; apply it to one ``async def`` or more."""

    def __init__(
        self,
        journal: JournalSource,
        *,
        identity: IdentityLike | Callable[..., IdentityLike],
        inputs: Inputs | Callable[..., Inputs],
        definition: str | Callable[..., Any] | None,
        wait: float | None,
        compatible: Definitions = (),
    ) -> None:
        self._journal = journal
        self._identity = identity
        self._inputs = inputs
        self._definition = definition
        self._wait = wait
        self._compatible = compatible

    def __repr__(self) -> str:
        return f"once(identity={self._identity!r}, definition={self._definition!r})"

    @overload
    def __call__(
        self, func: Callable[P, Awaitable[str]]
    ) -> Callable[P, Coroutine[Any, Any, str]]: ...

    @overload
    def __call__(
        self, func: Callable[P, Awaitable[tuple[str, str | None]]]
    ) -> Callable[P, Coroutine[Any, Any, tuple[str, str | None]]]: ...

    def __call__(
        self, func: Callable[P, Awaitable[str | tuple[str, str | None]]]
    ) -> Callable[P, Coroutine[Any, Any, str | tuple[str, str | None]]]:
        if ASYNC and not is_async(func):
            raise InvalidArgument(
                f"once() decorates an async def function; {_name(func)} is not one (plain "
                "functions take itemjournal.sync.once)",
                code="INVALID_ARGUMENT",
            )
        if not ASYNC and is_async(func):
            raise InvalidArgument(
                f"itemjournal.sync.once decorates a plain function; {_name(func)} is an async "
                "def (it takes itemjournal.once)",
                code="INVALID_ARGUMENT",
            )
        shape = _declared_shape(func)
        name = _name(func)
        forms = (func if self._definition is None else self._definition, *self._compatible)
        digests: list[tuple[str, frozenset[str]]] = []

        async def definitions() -> tuple[str, frozenset[str]]:
            # Sources are read on the first call, in a worker thread: decorating may
            # happen inside a running event loop, which must never wait for the disk.
            if not digests:
                digests.append(await definition_hashes(forms))
            return digests[0]

        @functools.wraps(func)
        async def run_once(*args: P.args, **kwargs: P.kwargs) -> str | Pair:
            journal = await self._journal_now()
            identity = (
                self._identity(*args, **kwargs) if callable(self._identity) else self._identity
            )
            inputs = self._inputs(*args, **kwargs) if callable(self._inputs) else self._inputs
            digest, accepted = await definitions()
            async with journal.claim(
                identity, inputs, digest, wait=self._wait, compatible=accepted
            ) as attempt:
                if attempt.reused:
                    if shape == _PAIR or (shape == _AS_STORED and attempt.result is not None):
                        return attempt.receipt, attempt.result
                    return attempt.receipt
                value: object = await func(*args, **kwargs)
                receipt, result, problem = _unpack(value, shape, name)
                if problem is not None:
                    # The effect may have happened: only an operator can say what it left.
                    with anyio.CancelScope(shield=True):
                        await attempt.mark_review(problem)
                    raise InvalidArgument(
                        f"{problem}; {list(attempt.claim.identity)} now needs review",
                        code="INVALID_RECEIPT",
                    )
                await attempt.complete(receipt, result=result)
            # A fresh call answers exactly as a reused one will.
            return (receipt, result) if isinstance(value, tuple) else receipt

        return run_once

    async def _journal_now(self) -> Journal:
        return await journal_of(self._journal, "once()")


def _name(func: object) -> str:
    """How a review reason names the function: ``charge`` or ``Billing.charge``."""
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    name = str(name).rpartition("<locals>.")[2]
    return name if len(name) <= 100 else name[:99] + "\u2026"


def _declared_shape(func: object) -> str:
    """``_STR``, ``_PAIR`` or ``_AS_STORED``, from the function's return annotation."""
    try:
        hint = typing.get_type_hints(func).get("return")
    except Exception:  # an annotation that cannot be resolved here: go by what was stored
        return _AS_STORED
    while hasattr(hint, "__supertype__"):  # NewType("Receipt", str)
        hint = getattr(hint, "__supertype__", None)
    if isinstance(hint, type) and issubclass(hint, str):
        return _STR
    if typing.get_origin(hint) is tuple and len(typing.get_args(hint)) == 2:
        return _PAIR
    return _AS_STORED


def _unpack(value: object, shape: str, name: str) -> tuple[str, str | None, str | None]:
    """``(receipt, result, None)`` for a valid return value, else ``("", None, problem)``."""
    receipt: object
    result: object = None
    if isinstance(value, tuple) and shape != _STR:
        if len(value) != 2:
            return "", None, f"{name} returned a tuple of {len(value)} items, not {_PAIR}"
        receipt, result = value
    elif isinstance(value, str) and shape != _PAIR:
        receipt = value
    else:
        promised = {_STR: _STR, _PAIR: _PAIR}.get(shape, f"{_STR} or {_PAIR}")
        return "", None, f"{name} returned {_a(type(value).__name__)}, not {promised}"
    problem = receipt_problem(receipt)
    if problem is not None:
        return "", None, f"{name} returned a receipt that is refused: {problem}"
    problem = result_problem(result)
    if problem is not None:
        return "", None, f"{name} returned a result that is refused: {problem}"
    assert isinstance(receipt, str)
    assert result is None or isinstance(result, str)
    return receipt, result, None


def _a(noun: str) -> str:
    if noun == "NoneType":
        return "None"
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"
