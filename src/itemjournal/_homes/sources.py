"""Where a home gets its journal: a ``Journal``, or a function (plain or async) that
returns one when the first call needs it, so a decorator can stand at import time before
the application has opened its journal."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from .._journal.faces import ASYNC
from .._journal.journal import Journal
from .._model.errors import InvalidArgument

JournalSource: TypeAlias = "Journal | Callable[[], Journal | Awaitable[Journal]]"


async def journal_of(source: JournalSource, given_to: str) -> Journal:
    """The journal ``source`` stands for; ``given_to`` names the home in the error."""
    if isinstance(source, Journal):
        return source
    value = source()
    if ASYNC and inspect.isawaitable(value):
        value = await value
    if not isinstance(value, Journal):
        raise InvalidArgument(
            f"the journal function given to {given_to} returned {type(value).__name__}, "
            "not a Journal",
            code="INVALID_ARGUMENT",
        )
    return value
