"""The record codec: a ``Record`` to its document's bytes, and the strict reader back.

The reader trusts nothing it reads: every field is checked against the record's rules
(``records``), the JSON must be standard, a document must belong to the identity it is
stored under, and anything off is ``RECORD_INVALID``. The writer encodes a record once
and checks its text fields by the reader's own rules on the record itself, without
parsing its bytes back (the other fields are the journal's own making); the bytes are
remembered as that record, so the journal's next read of them parses nothing. Both
keep small bounded caches of what they already checked, since a journal reads and writes
the same few documents, labels and times again and again. Kept apart from ``records``
because only the stores (and the tests of hostile files) need the bytes; the rest of the
library needs only the record.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from .document import RESULT_VERSION, VERSION, document_text
from .errors import RecordInvalid
from .identity import Identity, identity_digest
from .records import (
    EVENTS,
    HISTORY_LIMIT,
    MAX_RECORD_BYTES,
    STATUSES,
    Event,
    Owner,
    Record,
    note_problem,
    parse_process,
    receipt_problem,
    result_problem,
)

__all__ = ["clear_decode_cache", "decode_record", "decode_row", "encode_record"]


_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_KIND = re.compile(r"sha256|hmac-sha256:[0-9a-f]{16}")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}\+00:00")
MAX_INT = 2**63 - 1
# A database session that holds a claim (see the PostgreSQL store): "<kind>:<16 hex>".
_SESSION = re.compile(r"[a-z][a-z0-9]{0,15}:[0-9a-f]{16}")

_KEYS = frozenset(
    {
        "version",
        "identity",
        "input_kind",
        "input_hash",
        "definition_hash",
        "claim_id",
        "status",
        "receipt",
        "attempt",
        "created_at",
        "updated_at",
        "owner",
        "review_reason",
        "history",
    }
)
_RESULT_KEYS = _KEYS | {"result"}
_OWNER_KEYS = frozenset({"host", "pid", "started_at", "process"})
_SESSION_OWNER_KEYS = _OWNER_KEYS | {"session"}
_EVENT_KEYS = frozenset({"at", "event", "status", "attempt", "note"})


# Documents this process wrote or already read strictly, by their exact bytes: reading
# the same bytes again gives the same record, so the parse can be skipped. Bounded;
# plain dict operations are atomic, so worker threads may share it.
_KNOWN: dict[bytes, Record] = {}
_KNOWN_LIMIT = 1024
_KNOWN_MAX_BYTES = 16 * 1024  # at most 16 MiB held, whatever the records look like


def _remember(data: bytes, record: Record) -> None:
    if len(data) > _KNOWN_MAX_BYTES:
        return
    if len(_KNOWN) >= _KNOWN_LIMIT:
        _KNOWN.clear()
    _KNOWN[data] = record


def clear_decode_cache() -> None:
    """Forget every remembered document, so that the next reads parse strictly again."""
    _KNOWN.clear()


def encode_record(record: Record) -> bytes:
    """The document's bytes, encoded once; refused if the strict reader would refuse them.

    The record's text fields are checked by the reader's rules (``_check``) and the
    bytes for the reader's limits (size, valid UTF-8) without being parsed back: a
    record the reader would reject there (a reason too long, a lone surrogate) is
    refused here, before anything is written, with ``RECORD_INVALID``, because a journal
    must never write what it cannot read back. The model suite and ``test_records`` read
    what the journal writes back strictly, with the decode cache cleared.
    """
    try:
        _check(record)
        # One line, by json's C encoder; ``itemjournal show`` pretty-prints.
        data = (document_text(record) + "\n").encode("utf-8")
        if len(data) > MAX_RECORD_BYTES:
            raise _Bad(f"record is larger than {MAX_RECORD_BYTES} bytes")
    except (_Bad, UnicodeEncodeError, TypeError, ValueError) as error:
        raise RecordInvalid(
            f"refusing to write a record of {list(record.identity)} that the strict reader "
            f"would reject: {error}"
        ) from None
    _remember(data, record)
    return data


def _check(record: Record) -> None:
    """The reader's rules for what a record's text fields may hold, applied before it is
    written: the receipt, the result, the review reason and the history's notes are
    where text from outside the journal (a caller's, an exception's message) lands.

    The other fields are the journal's own making, correct by construction: labels
    checked when the identity was taken (``coerce_identity``), digests and claim ids it
    computed, times from ``utc_now``, the owner this process named, statuses and events
    of the state machine, a history it bounds. They are not checked again on every
    write; the model suite reads back strictly every record the journal wrote.
    """
    status = record.status
    if status == "succeeded":
        problem = receipt_problem(record.receipt)
        if problem:
            raise _Bad(f"succeeded record with a bad receipt: {problem}")
    elif record.receipt is not None:
        raise _Bad(f"a {status} record carries a receipt")
    if record.result is not None:
        problem = result_problem(record.result)
        if problem:
            raise _Bad(f"bad result: {problem}")
        if status != "succeeded":
            raise _Bad(f"a {status} record carries a result")
    if record.review_reason is not None:
        _opt_note(record.review_reason, "review reason")
    for event in record.history:
        if event.note is not None:
            _opt_note(event.note, "history note")


class _Bad(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)  # built in C; a repeated key leaves it shorter than the pairs
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Bad(f"duplicate key {key!r}")
            seen.add(key)
    return result


def _constant(name: str) -> Any:
    raise _Bad(f"non-standard JSON constant {name}")


# Made once: ``json.loads`` with options builds a new decoder
# on every call, a few microseconds of every read.
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant)


# Texts already found to match a pattern, per pattern: labels, hashes and claim ids recur
# (every write of a record repeats them, and a journal's labels are few). Bounded; plain
# dict operations, safe across threads.
_MATCHED: dict[re.Pattern[str], dict[str, None]] = {}
_MATCHED_LIMIT = 4096


def _matches(pattern: re.Pattern[str], text: str) -> bool:
    seen = _MATCHED.get(pattern)
    if seen is None:
        seen = _MATCHED.setdefault(pattern, {})
    if text in seen:
        return True
    if pattern.fullmatch(text) is None:
        return False
    if len(seen) >= _MATCHED_LIMIT:
        seen.clear()
    seen[text] = None
    return True


def _str(value: Any, what: str, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{what} is not a string")
    if pattern is not None and not _matches(pattern, value):
        raise _Bad(f"{what} is malformed")
    return value


def _int(value: Any, what: str, minimum: int) -> int:
    if type(value) is not int or not minimum <= value <= MAX_INT:
        raise _Bad(f"{what} is not an integer from {minimum} to 2**63-1")
    return value


# Times already found well formed and real, by their exact text: a record repeats its
# times (created_at is its first event's, updated_at its last's) and every write of it
# checks its whole history again. Bounded; plain dict operations, safe across threads.
_GOOD_TIMES: dict[str, None] = {}
_GOOD_TIMES_LIMIT = 4096


def _time(value: Any, what: str) -> str:
    if type(value) is str and value in _GOOD_TIMES:
        return value
    text = _str(value, what, _TIME)
    try:
        datetime.fromisoformat(text)
    except ValueError:
        raise _Bad(f"{what} is not a real time") from None
    if len(_GOOD_TIMES) >= _GOOD_TIMES_LIMIT:
        _GOOD_TIMES.clear()
    _GOOD_TIMES[text] = None
    return text


def _process(value: Any) -> str:
    text = _str(value, "owner process")
    if text and parse_process(text) is None:
        raise _Bad("owner process is malformed")
    return text


def _opt_note(value: Any, what: str) -> str | None:
    if value is None:
        return None
    problem = note_problem(value, what)
    if problem:
        raise _Bad(problem)
    return str(value)


def _decode(data: bytes, expected: Identity | str) -> Record:
    if len(data) > MAX_RECORD_BYTES:
        raise _Bad(f"record is larger than {MAX_RECORD_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Bad("record is not UTF-8") from error
    try:
        if text.startswith("\ufeff"):  # what ``json.loads`` refuses before decoding
            raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
        raw = _DECODER.decode(text)
    except (ValueError, RecursionError) as error:
        raise _Bad(f"record is not valid JSON ({error})") from error
    if type(raw) is not dict:
        raise _Bad("record is not a JSON object")
    if b"\\u" in data:  # an escape may smuggle in a lone surrogate, which no write could store
        try:
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _Bad("record holds text that is not valid Unicode (a lone surrogate)") from None
    version = raw.get("version")
    if type(version) is not int or version not in (VERSION, RESULT_VERSION):
        raise _Bad(f"record version {version!r} is not {VERSION} or {RESULT_VERSION}")
    keys = _KEYS if version == VERSION else _RESULT_KEYS
    if raw.keys() != keys:  # compared as sets, without building one
        missing = sorted(keys - set(raw))
        unknown = sorted(set(raw) - keys)
        raise _Bad(f"record fields wrong (missing {missing}, unknown {unknown})")
    identity = raw["identity"]
    if (
        type(identity) is not list
        or len(identity) != 4
        or not all(isinstance(p, str) and _matches(_LABEL, p) for p in identity)
    ):
        raise _Bad("identity is not a list of four labels")
    if isinstance(expected, str):
        if identity_digest(Identity(*identity)) != expected:
            raise _Bad(f"record of identity {identity} is stored under another identity's name")
    elif tuple(identity) != tuple(expected):
        raise _Bad(f"record belongs to identity {identity}, not {list(expected)}")
    status = raw["status"]
    if status not in STATUSES:
        raise _Bad(f"unknown status {status!r}")
    receipt = raw["receipt"]
    if status == "succeeded":
        problem = receipt_problem(receipt)
        if problem:
            raise _Bad(f"succeeded record with a bad receipt: {problem}")
    elif receipt is not None:
        raise _Bad(f"a {status} record carries a receipt")
    owner_raw = raw["owner"]
    owner: Owner | None
    if owner_raw is None:
        owner = None
    else:
        if type(owner_raw) is not dict or (
            owner_raw.keys() != _OWNER_KEYS and owner_raw.keys() != _SESSION_OWNER_KEYS
        ):
            raise _Bad("owner is malformed")
        owner = Owner(
            host=_str(owner_raw["host"], "owner host"),
            pid=_int(owner_raw["pid"], "owner pid", 1),
            started_at=_str(owner_raw["started_at"], "owner started_at"),
            process=_process(owner_raw["process"]),
            session=_str(owner_raw["session"], "owner session", _SESSION)
            if "session" in owner_raw
            else "",
        )
    if status == "started" and owner is None:
        raise _Bad("a started record names no owner")
    history_raw = raw["history"]
    if type(history_raw) is not list or len(history_raw) > HISTORY_LIMIT:
        raise _Bad(f"history is not a list of at most {HISTORY_LIMIT} events")
    history = []
    for entry in history_raw:
        if type(entry) is not dict or entry.keys() != _EVENT_KEYS:
            raise _Bad("history entry is malformed")
        if entry["event"] not in EVENTS or entry["status"] not in STATUSES:
            raise _Bad("history entry names an unknown event or status")
        history.append(
            Event(
                at=_time(entry["at"], "history time"),
                event=entry["event"],
                status=entry["status"],
                attempt=_int(entry["attempt"], "history attempt", 1),
                note=_opt_note(entry["note"], "history note"),
            )
        )
    review_reason = _opt_note(raw["review_reason"], "review reason")
    result = raw.get("result")
    if version == RESULT_VERSION:
        problem = result_problem(result)
        if problem or result is None:
            raise _Bad(f"bad result: {problem or 'a version 2 record carries a result'}")
        if status != "succeeded":
            raise _Bad(f"a {status} record carries a result")
    return Record(
        identity=Identity(*identity),
        input_kind=_str(raw["input_kind"], "input_kind", _KIND),
        input_hash=_str(raw["input_hash"], "input_hash", _HEX64),
        definition_hash=_str(raw["definition_hash"], "definition_hash", _HEX64),
        claim_id=_str(raw["claim_id"], "claim_id", _HEX32),
        status=status,
        receipt=receipt,
        attempt=_int(raw["attempt"], "attempt", 1),
        created_at=_time(raw["created_at"], "created_at"),
        updated_at=_time(raw["updated_at"], "updated_at"),
        owner=owner,
        review_reason=review_reason,
        history=tuple(history),
        result=result,
    )


def decode_record(data: bytes, expected: Identity | str, *, location: str | None = None) -> Record:
    """Read a record strictly; anything unexpected is ``RECORD_INVALID``.

    ``expected`` is the identity asked for, or (when scanning) the identity digest the
    record's location was derived from.
    """
    known = _KNOWN.get(data)
    if known is not None:
        wanted = known.identity if isinstance(expected, tuple) else identity_digest(known.identity)
        if wanted == expected:
            return known
    try:
        record = _decode(data, expected)
    except _Bad as error:
        where = f" at {location}" if location else ""
        raise RecordInvalid(f"record{where} is invalid: {error}", location=location) from None
    _remember(data, record)
    return record


def decode_row(document: object, digest: str, status: object, *, location: str) -> Record:
    """The record a database row holds: its document read strictly, and its indexed
    status column checked against the document's; anything off is ``RECORD_INVALID``."""
    if not isinstance(document, bytes):
        raise RecordInvalid(f"record at {location} is not stored as bytes", location=location)
    record = decode_record(document, digest, location=location)
    if status != record.status:
        raise RecordInvalid(
            f"record at {location} has status column {status!r} but document "
            f"status {record.status!r}",
            location=location,
        )
    return record
