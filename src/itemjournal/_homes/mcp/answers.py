"""What an effect-once tool hands back: the stored result document, its replay, and the
tool errors, worded for a language model to act on.

A stored result is a small JSON document (``FORMAT``): the text blocks of the tool's
answer and, when the tool returned a JSON object, that object as structured content. A
result stored by someone else (a reconciliation given a plain string) is replayed as one
text block, exactly as stored.
"""

from __future__ import annotations

import json
from typing import Any

from mcp.types import CallToolResult, TextContent
from pydantic_core import to_jsonable_python

from ..._model.errors import InvalidArgument
from ..._model.records import result_problem
from ..._model.view import RecordView

__all__ = [
    "FORMAT",
    "META_KEY",
    "answer_of",
    "changed_arguments",
    "changed_definition",
    "fresh",
    "replay",
    "still_running",
    "stored_result",
    "uncertain",
    "unrecordable",
    "withdrawn",
]

FORMAT = "itemjournal.mcp.result/1"
META_KEY = "itemjournal"


def stored_result(value: object) -> str:
    """The stored form of a tool's answer: what the journal keeps for replay.

    ``value`` is what a tool returns: a ``str`` (one text block), a ``CallToolResult``
    whose content is text blocks only, or any JSON value (a dict, a list, a number, a
    pydantic model), sent as its JSON text and, for an object, as structured content too.
    A reconciliation check uses it to settle a call with the very answer the tool would
    have given: ``Happened(receipt, result=stored_result({"invoice": "inv_1"}))``.
    ``INVALID_ARGUMENT`` for anything else, or a document over the journal's 64 KiB.
    """
    texts: list[str]
    structured: Any = None
    if isinstance(value, CallToolResult):
        if value.is_error:
            raise InvalidArgument("a tool error is not a result to store", code="INVALID_ARGUMENT")
        texts = []
        for block in value.content:
            if not isinstance(block, TextContent):
                raise InvalidArgument(
                    f"only text content can be stored for replay, not {block.type!r}",
                    code="INVALID_ARGUMENT",
                )
            texts.append(block.text)
        structured = value.structured_content
    elif isinstance(value, str):
        texts = [value]
    else:
        try:
            plain = to_jsonable_python(value)
            text = json.dumps(plain, ensure_ascii=False, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidArgument(
                f"a {type(value).__name__} is neither text nor JSON: {error}",
                code="INVALID_ARGUMENT",
            ) from error
        texts = [text]
        structured = plain if isinstance(plain, dict) else None
    document: dict[str, Any] = {"format": FORMAT, "text": texts}
    if structured is not None:
        document["structured"] = structured
    try:
        stored = json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidArgument(
            f"the structured content is not JSON: {error}", code="INVALID_ARGUMENT"
        ) from error
    problem = result_problem(stored)
    if problem is not None:
        raise InvalidArgument(
            f"the tool's answer cannot be stored: {problem}", code="INVALID_ARGUMENT"
        )
    return stored


def answer_of(stored: str | None, receipt: str) -> tuple[list[str], Any]:
    """The text blocks and structured content a stored result stands for."""
    if stored is None:
        return [
            "This action was already done (its receipt: "
            f"{receipt}); its original answer was not kept, so there is nothing more to show."
        ], None
    try:
        document = json.loads(stored)
    except ValueError:
        document = None
    if (
        isinstance(document, dict)
        and document.get("format") == FORMAT
        and isinstance(document.get("text"), list)
        and all(isinstance(text, str) for text in document["text"])
    ):
        return list(document["text"]), document.get("structured")
    return [stored], None


def fresh(stored: str, key: str) -> CallToolResult:
    """The first run's answer, built from what was stored, as every replay will be."""
    texts, structured = answer_of(stored, "")
    return _result(texts, structured, {"replay": False, "key": key})


def replay(view: RecordView | None, stored: str | None, receipt: str, key: str) -> CallToolResult:
    """A stored answer again, marked as a replay in ``_meta``: the tool did not run."""
    texts, structured = answer_of(stored, receipt)
    meta: dict[str, Any] = {"replay": True, "key": key, "receipt": receipt}
    if view is not None and view.updated_at:
        meta["settled_at"] = view.updated_at
    return _result(texts, structured, meta)


def changed_arguments(key: str) -> CallToolResult:
    return _error(
        "Refused: this idempotency key was already used for a call with different "
        "arguments, so the tool did not run and nothing was done. If you meant that "
        "earlier action, repeat it with exactly its original arguments to get its result. "
        "If this is a new, separate action, call again with a new idempotency key.",
        key,
    )


def changed_definition(key: str, where: str) -> CallToolResult:
    return _error(
        "Refused: the tool has changed since this action was first done under this "
        "idempotency key, so it did not run again and nothing was done now. Do not retry "
        "under a new key: the earlier action may already have taken effect. Tell the user "
        f"that a person must decide; the record is {where}.",
        key,
    )


def still_running(key: str, waited: float | None, retry_after: float) -> CallToolResult:
    how_long = f" after waiting {waited:g} seconds" if waited else ""
    return _error(
        f"Not finished yet: this action is still running in another call{how_long}, so it "
        "was not started again. Call again with the same arguments and the same "
        f"idempotency key in about {retry_after:g} seconds to get its result. Do not use "
        "a new idempotency key: that would do the action a second time.",
        key,
        {"retry_after_seconds": retry_after},
    )


def uncertain(key: str, where: str, why: str) -> CallToolResult:
    return _error(
        f"Outcome unknown: this action began but did not finish cleanly ({why}), so it "
        "may or may not have taken effect. Do not retry it, not with this idempotency key "
        "and not with a new one: a retry under a new key could do it twice. A person will "
        "check what happened and settle it; until then every repeat of this call gets "
        "this answer. Tell the user the action is waiting for review and give them this "
        f"reference: {key} (record {where}).",
        key,
        {"outcome": "unknown"},
    )


def withdrawn(key: str, reason: str) -> CallToolResult:
    return _error(
        f"Not done: the tool refused before doing anything ({reason}). Nothing was sent. "
        "You may correct the arguments and call again.",
        key,
        {"outcome": "not_done"},
    )


def unrecordable(why: str) -> CallToolResult:
    """The arguments cannot be recorded (``tool.unrecordable``): nothing was claimed and
    nothing ran, so there is no record and no key."""
    return _error(
        f"Refused: {why}, so the tool did not run and nothing was done. Correct the "
        "arguments and call again; a call with the same arguments gets this answer again.",
        None,
        {"outcome": "not_done"},
    )


def _result(texts: list[str], structured: Any, meta: dict[str, Any]) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text) for text in texts],
        structured_content=structured,
        _meta={META_KEY: meta},
    )


def _error(text: str, key: str | None, extra: dict[str, Any] | None = None) -> CallToolResult:
    meta: dict[str, Any] = {} if key is None else {"key": key}
    meta.update(extra or {})
    return CallToolResult(
        content=[TextContent(type="text", text=text)], is_error=True, _meta={META_KEY: meta}
    )
