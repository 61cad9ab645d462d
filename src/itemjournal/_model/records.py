"""The record (version 1 and 2 documents): its fields and the rules its values obey.

Here: ``Record``, ``Owner``, ``Event``, the statuses and events a record can hold, the
limits of receipts, results and notes (and the checks that say why a value breaks them),
and how an owner's ``process`` is spelled. How a record becomes bytes and is read back
strictly lives in ``codec``: the rules are shared by the journal, the homes and the
codec, while only the stores (and the journal's checks) need the codec.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from .identity import Identity

__all__ = [
    "EVENTS",
    "HISTORY_LIMIT",
    "MAX_NOTE_CHARS",
    "MAX_RECEIPT_CHARS",
    "MAX_RECORD_BYTES",
    "MAX_RESULT_BYTES",
    "STATUSES",
    "Event",
    "Owner",
    "ProcessName",
    "Record",
    "note_problem",
    "parse_process",
    "receipt_problem",
    "result_problem",
    "utc_now",
]

MAX_RESULT_BYTES = 64 * 1024
MAX_RECORD_BYTES = 1024 * 1024
HISTORY_LIMIT = 32
MAX_RECEIPT_CHARS = 200
MAX_NOTE_CHARS = 500
STATUSES = ("started", "succeeded", "needs_review", "released")
EVENTS = ("begin", "complete", "mark_review", "resolve", "sweep", "withdrawn")

# An owner process (see _owner): "<boot id>:<pid-namespace inode>:<time-namespace inode>:
# <start ticks>"; before time namespaces were recorded, "<boot id>:<pid ns>:<ticks>"; an
# owner that could not name its process but knew its boot: "<boot id>" alone.
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_NUMBER = r"(?:0|[1-9][0-9]{0,19})"
_PROCESS = re.compile(rf"({_UUID})(?::([1-9][0-9]{{0,19}})(?::({_NUMBER}))?:({_NUMBER}))?")
MAX_U64 = 2**64 - 1


def utc_now() -> str:
    """Current UTC time, ISO-8601 with microseconds and an explicit offset."""
    global _second
    micros = time.time_ns() // 1000
    seconds, fraction = divmod(micros, 1_000_000)
    known = _second
    if known[0] != seconds:  # the date and time of day change once a second
        text = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")[:19]
        known = _second = (seconds, text)
    return f"{known[1]}.{fraction:06d}+00:00"


_second: tuple[int, str] = (-1, "")


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def receipt_problem(receipt: object) -> str | None:
    """Why ``receipt`` breaks the receipt rules, or None when it is acceptable."""
    if not isinstance(receipt, str):
        return f"a receipt is a str, not {type(receipt).__name__}"
    if _unencodable(receipt):
        return "a receipt must be valid Unicode (no lone surrogates)"
    if not receipt.strip():
        return "a receipt must not be blank"
    if len(receipt) > MAX_RECEIPT_CHARS:
        return f"a receipt has at most {MAX_RECEIPT_CHARS} characters, got {len(receipt)}"
    return None


def result_problem(result: object) -> str | None:
    """Why ``result`` cannot be stored for replay, or None when it can (None included)."""
    if result is None:
        return None
    if not isinstance(result, str):
        return f"a result is a str, not {type(result).__name__}"
    if _unencodable(result):
        return "a result must be valid Unicode (no lone surrogates)"
    size = len(result.encode("utf-8"))
    if size > MAX_RESULT_BYTES:
        return f"a result has at most {MAX_RESULT_BYTES} bytes of UTF-8, got {size}"
    return None


def note_problem(note: object, what: str) -> str | None:
    if not isinstance(note, str):
        return f"{what} is a str, not {type(note).__name__}"
    if _unencodable(note):
        return f"{what} must be valid Unicode (no lone surrogates)"
    if not note.strip():
        return f"{what} must not be blank"
    if len(note) > MAX_NOTE_CHARS:
        return f"{what} has at most {MAX_NOTE_CHARS} characters, got {len(note)}"
    return None


class ProcessName(NamedTuple):
    """What an owner's ``process`` says of it; a part the owner could not read is None."""

    boot: str
    pid_namespace: int | None
    time_namespace: int | None
    """None in a record written before time namespaces were recorded."""
    ticks: int | None


def parse_process(text: str) -> ProcessName | None:
    """What an owner's ``process`` names, or None if it is not a name an owner writes.

    None for anything but the canonical spellings (lowercase, no leading zeros, each
    number at most 2**64-1); the empty string (nothing known) is None too.
    """
    match = _PROCESS.fullmatch(text)
    if match is None:
        return None
    if match[2] is None:
        return ProcessName(match[1], None, None, None)
    namespace, ticks = int(match[2]), int(match[4])
    time_namespace = None if match[3] is None else int(match[3])
    if namespace > MAX_U64 or ticks > MAX_U64 or (time_namespace or 0) > MAX_U64:
        return None
    return ProcessName(match[1], namespace, time_namespace, ticks)


@dataclass(frozen=True, slots=True)
class Owner:
    """The process that holds a started claim.

    ``process`` names it exactly: ``"<boot id>:<pid-namespace inode>:<time-namespace
    inode>:<start ticks>"`` (Linux ``/proc``; see ``parse_process`` for the other forms),
    ``"<boot id>"`` when the owner knew only its boot, ``""`` when it could not tell.
    Liveness compares only that; ``started_at`` (UTC ISO-8601, or ``""``) is for people
    reading the record and is never compared: it is derived from the wall clock's idea of
    the boot time, which moves when the clock is stepped.
    """

    host: str
    pid: int
    started_at: str
    process: str = ""
    session: str = ""
    """The database session the claim was made in (``"pg:<16 hex>"``), or ``""``.

    Stores shared by many hosts judge liveness by it (the session still holds its lock);
    a document carries the ``session`` key only when it is set."""


@dataclass(frozen=True, slots=True)
class Event:
    """One transition, kept in the record's bounded history."""

    at: str
    event: str
    status: str
    attempt: int
    note: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    identity: Identity
    input_kind: str
    input_hash: str
    definition_hash: str
    claim_id: str
    status: str
    receipt: str | None
    attempt: int
    created_at: str
    updated_at: str
    owner: Owner | None
    review_reason: str | None
    history: tuple[Event, ...] = field(default=())
    result: str | None = None

    def advance(
        self, event: str, status: str, at: str, note: str | None = None, **changes: Any
    ) -> Record:
        """The next record: ``changes`` applied, the event appended to the bounded history."""
        get = changes.get
        attempt = get("attempt", self.attempt)
        history = (*self.history, Event(at, event, status, attempt, note))[-HISTORY_LIMIT:]
        if not changes.keys() <= _CHANGEABLE:
            return replace(self, status=status, updated_at=at, history=history, **changes)
        # ``dataclasses.replace`` spelled out: it would look every field up by name again.
        return Record(
            self.identity,
            self.input_kind,
            get("input_hash", self.input_hash),
            get("definition_hash", self.definition_hash),
            get("claim_id", self.claim_id),
            status,
            get("receipt", self.receipt),
            attempt,
            get("created_at", self.created_at),
            at,
            get("owner", self.owner),
            get("review_reason", self.review_reason),
            history,
            get("result", self.result),
        )


# What ``Record.advance`` may change besides status, time and history (anything else goes
# through ``dataclasses.replace``, which refuses what is not a field).
_CHANGEABLE = frozenset(
    {
        "input_hash",
        "definition_hash",
        "claim_id",
        "receipt",
        "attempt",
        "created_at",
        "owner",
        "review_reason",
        "result",
    }
)
