"""A record's document: the JSON object the stores keep, as text.

``document_text`` writes the text directly, field by field, in sorted key order: each
string goes through ``json.encoder.encode_basestring`` (the function the standard
encoder itself uses for strings when ``ensure_ascii`` is off), each integer through
``int.__repr__`` (as the standard encoder does), and the punctuation is the standard
encoder's default (``", "`` and ``": "``). A record's fields are only text, integers
and None, so that is the whole of JSON it needs, and the result is exactly
``json.JSONEncoder(ensure_ascii=False).encode(document_object(record))``, about three
times faster (``tests/model/test_document.py`` compares the two on generated records;
``benchmarks/README.md`` has the figures). A field of an unexpected type is not
guessed at: the text is then made by the standard encoder from ``document_object``.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

from .records import Owner, Record

__all__ = ["RESULT_VERSION", "VERSION", "document_object", "document_text"]

VERSION = 1  # a record without a result; written exactly as before results existed
RESULT_VERSION = 2  # a succeeded record carrying a replayable result

# ``ensure_ascii=False``: text is kept as UTF-8, not escaped. Made once: ``json.dumps``
# with options builds a new encoder on every call.
_ENCODER = json.JSONEncoder(ensure_ascii=False)


def document_object(record: Record) -> dict[str, Any]:
    """The document as a JSON object, every object's keys in sorted order (so that no
    ``sort_keys`` is needed and the text is that of a sorted dump)."""
    owner = record.owner
    document: dict[str, Any] = {
        "attempt": record.attempt,
        "claim_id": record.claim_id,
        "created_at": record.created_at,
        "definition_hash": record.definition_hash,
        "history": [
            {"at": e.at, "attempt": e.attempt, "event": e.event, "note": e.note, "status": e.status}
            for e in record.history
        ],
        "identity": list(record.identity),
        "input_hash": record.input_hash,
        "input_kind": record.input_kind,
        "owner": None if owner is None else _owner_object(owner),
        "receipt": record.receipt,
    }
    if record.result is not None:
        document["result"] = record.result
    document["review_reason"] = record.review_reason
    document["status"] = record.status
    document["updated_at"] = record.updated_at
    document["version"] = VERSION if record.result is None else RESULT_VERSION
    return document


def _owner_object(owner: Owner) -> dict[str, Any]:
    if owner.session:
        return {
            "host": owner.host,
            "pid": owner.pid,
            "process": owner.process,
            "session": owner.session,
            "started_at": owner.started_at,
        }
    return {
        "host": owner.host,
        "pid": owner.pid,
        "process": owner.process,
        "started_at": owner.started_at,
    }


def document_text(record: Record) -> str:
    """The document's JSON text, one line: the standard encoder's exact output.

    Raises what the standard encoder raises for a field it cannot encode.
    """
    try:
        return _direct(record)
    except (TypeError, _Unexpected):
        return _ENCODER.encode(document_object(record))


class _Unexpected(Exception):
    """An integer field that is not exactly an ``int`` (a ``bool`` would be spelled
    ``true`` by the standard encoder): left to it."""


def _direct(record: Record) -> str:
    # ``q`` refuses anything but text with TypeError: the standard encoder then decides.
    q = encode_basestring
    attempt = record.attempt
    if type(attempt) is not int:
        raise _Unexpected
    events = []
    for e in record.history:
        if type(e.attempt) is not int:
            raise _Unexpected
        note = "null" if e.note is None else q(e.note)
        events.append(
            f'{{"at": {q(e.at)}, "attempt": {e.attempt!r}, "event": {q(e.event)}, '
            f'"note": {note}, "status": {q(e.status)}}}'
        )
    owner = record.owner
    if owner is None:
        owner_text = "null"
    else:
        if type(owner.pid) is not int:
            raise _Unexpected
        session = f'"session": {q(owner.session)}, ' if owner.session else ""
        owner_text = (
            f'{{"host": {q(owner.host)}, "pid": {owner.pid!r}, "process": {q(owner.process)}, '
            f'{session}"started_at": {q(owner.started_at)}}}'
        )
    receipt, result, reason = record.receipt, record.result, record.review_reason
    result_text = "" if result is None else f'"result": {q(result)}, '
    return (
        f'{{"attempt": {attempt!r}, "claim_id": {q(record.claim_id)}, '
        f'"created_at": {q(record.created_at)}, '
        f'"definition_hash": {q(record.definition_hash)}, "history": [{", ".join(events)}], '
        f'"identity": [{", ".join([q(label) for label in record.identity])}], '
        f'"input_hash": {q(record.input_hash)}, "input_kind": {q(record.input_kind)}, '
        f'"owner": {owner_text}, "receipt": {"null" if receipt is None else q(receipt)}, '
        f"{result_text}"
        f'"review_reason": {"null" if reason is None else q(reason)}, '
        f'"status": {q(record.status)}, "updated_at": {q(record.updated_at)}, '
        f'"version": {VERSION if result is None else RESULT_VERSION}}}'
    )
