"""The document's text written field by field is the standard encoder's, byte for byte."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from itemjournal._model.document import document_object, document_text
from itemjournal._model.identity import Identity
from itemjournal._model.records import Event, Owner, Record

# Any text at all, including quotes, backslashes, control characters, non-ASCII and lone
# surrogates: the writer's checks are not what is tested here, the spelling is.
TEXT = st.text(max_size=12)
MAYBE = st.none() | TEXT
NUMBER = st.integers(min_value=-(2**70), max_value=2**70)

EVENTS = st.builds(Event, TEXT, TEXT, TEXT, NUMBER, MAYBE)
SESSIONS = st.sampled_from(["", "pg:0a"]) | TEXT
OWNERS = st.none() | st.builds(Owner, TEXT, NUMBER, TEXT, TEXT, SESSIONS)
RECORDS = st.builds(
    Record,
    st.builds(Identity, TEXT, TEXT, TEXT, TEXT),
    TEXT,
    TEXT,
    TEXT,
    TEXT,
    TEXT,
    MAYBE,
    NUMBER,
    TEXT,
    TEXT,
    OWNERS,
    MAYBE,
    st.lists(EVENTS, max_size=4).map(tuple),
    MAYBE,
)


def standard(record: Record) -> str:
    return json.dumps(document_object(record), ensure_ascii=False, sort_keys=True)


@settings(max_examples=400)
@given(RECORDS)
def test_the_direct_text_is_the_standard_encoders(record: Record) -> None:
    assert document_text(record) == standard(record)


def test_fields_of_other_types_are_left_to_the_standard_encoder() -> None:
    """A bool where an integer belongs would be ``1`` if spelled as an int and ``true``
    by the standard encoder; a number where text belongs is not quoted by it. The text
    is the standard encoder's in both cases, and a value it cannot encode raises as it
    would."""
    now = "2026-12-02T12:00:00.000000+00:00"
    base = Record(
        Identity("s", "p", "j", "i"),
        "sha256",
        "a" * 64,
        "b" * 64,
        "c" * 32,
        "started",
        None,
        1,
        now,
        now,
        Owner("host", 7, now, "proc"),
        None,
        (Event(now, "begin", "started", 1),),
    )
    odd = [
        Record(**{**_fields(base), "attempt": True}),
        Record(**{**_fields(base), "receipt": 5}),
        Record(**{**_fields(base), "owner": Owner("host", False, now, "proc")}),
        Record(**{**_fields(base), "history": (Event(now, "begin", "started", True),)}),
        Record(**{**_fields(base), "status": 1.5}),
    ]
    for record in odd:
        assert document_text(record) == standard(record)
    assert '"attempt": true' in document_text(odd[0])
    unencodable = Record(**{**_fields(base), "receipt": object()})
    try:
        document_text(unencodable)
    except TypeError as error:
        assert "not JSON serializable" in str(error)
    else:
        raise AssertionError("an object that JSON cannot spell was encoded")


def _fields(record: Record) -> dict[str, object]:
    return {name: getattr(record, name) for name in Record.__dataclass_fields__}
