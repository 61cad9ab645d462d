"""The table of ``list``: one that fits the terminal it is shown on, and one with
everything whole for a pipe or ``--wide``.

On a terminal the table is as wide as the terminal. The status, the key column and the
receipt, reason or owner are always there (that last column folds, never cuts); the
identity is one column, ``scope/program/job/item``. When the row does not fit, the labels
are shortened in the middle (``3f2a9c…e0b1d``): to 20 characters each, then the attempt
gives way, then the labels go to 12, then the update time gives way, then the labels go
to 7. The key column
shows enough of each key to tell the rows apart (10 hex digits at least): ``show`` takes
it to find the record whose label was shortened.

Piped, or with ``--wide``, nothing is shortened: every label in a column of its own and
the whole key, as wide as that needs (for grep and diff, and to copy a label whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from ..._model.identity import Identity
from ..._model.view import RecordView
from .render import _detail, _status_text, _when

_DETAIL = "RECEIPT / REASON / OWNER"
_UPDATED = "UPDATED (UTC)"
_UPDATED_WIDTH = len("2026-11-30 18:47:01Z")
_KEY_DIGITS = 10  # at least: 40 bits, unlikely to begin two keys of one journal
_GAP = 2  # columns apart on a terminal: one cell of padding, one of the box
_WIDE_GAP = 3  # the same, with the padding on both sides, when nothing has to fit
# Each try at fitting a terminal: attempt shown, update time shown, longest label.
_STEPS: tuple[tuple[bool, bool, int | None], ...] = (
    (True, True, None),
    (True, True, 20),
    (False, True, 20),
    (False, True, 12),
    (False, False, 12),
    (False, False, 7),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """What one record shows in the table, made safe for a terminal."""

    status: str
    identity: Identity
    attempt: int
    updated: str
    key: str
    detail: str


def row(view: RecordView) -> Row:
    return Row(
        view.status, view.identity, view.attempt, _when(view.updated_at), view.key, _detail(view)
    )


def shortened(label: str, limit: int | None) -> str:
    """``label`` cut in the middle to at most ``limit`` characters: its start and its end
    stay, so it can still be recognised (labels are ASCII: one character, one column)."""
    if limit is None or len(label) <= limit:
        return label
    head = limit // 2
    tail = limit - 1 - head
    return f"{label[:head]}\u2026{label[len(label) - tail :]}"


def _key_digits(rows: Sequence[Row]) -> int:
    digits = _KEY_DIGITS
    while digits < 64 and len({r.key[:digits] for r in rows}) < len(rows):
        digits += 1
    return digits


def fitted(rows: Sequence[Row], width: int) -> Table:
    """The table for a terminal ``width`` columns wide."""
    status_width = max(len("STATUS"), *(len(r.status) for r in rows))
    digits = _key_digits(rows)
    for with_attempt, with_updated, limit in _STEPS:
        names = ["/".join(shortened(label, limit) for label in r.identity) for r in rows]
        identity_width = max(len("IDENTITY"), *(len(name) for name in names))
        fixed = [status_width, identity_width, digits]
        if with_attempt:
            fixed.append(len("ATTEMPT"))
        if with_updated:
            fixed.append(_UPDATED_WIDTH)
        if sum(fixed) + _GAP * len(fixed) + len(_DETAIL) <= width:
            break
    table = Table(
        box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, width=None
    )
    table.add_column("STATUS", width=status_width, no_wrap=True)
    table.add_column("IDENTITY", width=identity_width, no_wrap=True)
    table.add_column("KEY", width=digits, no_wrap=True)
    if with_attempt:
        table.add_column("ATTEMPT", width=len("ATTEMPT"), no_wrap=True)
    if with_updated:
        table.add_column(_UPDATED, width=_UPDATED_WIDTH, no_wrap=True)
    table.add_column(_DETAIL, overflow="fold")
    for r, name in zip(rows, names, strict=True):
        cells = [_status_text(r.status), Text(name), Text(r.key[:digits])]
        if with_attempt:
            cells.append(Text(str(r.attempt)))
        if with_updated:
            cells.append(Text(r.updated))
        cells.append(Text(r.detail))
        table.add_row(*cells)
    return table


_WIDE_COLUMNS = ("STATUS", "SCOPE", "PROGRAM", "JOB", "ITEM", "ATTEMPT", _UPDATED, "KEY", _DETAIL)


def _wide_cells(r: Row) -> tuple[Text, ...]:
    return (
        _status_text(r.status),
        *(Text(label) for label in r.identity),
        Text(str(r.attempt)),
        Text(r.updated),
        Text(r.key),
        Text(r.detail),
    )


def wide(rows: Sequence[Row]) -> tuple[Table, int]:
    """The table with everything whole, and the width it needs."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in _WIDE_COLUMNS:
        table.add_column(name, no_wrap=True)
    widths = [len(name) for name in _WIDE_COLUMNS]
    for r in rows:
        cells = _wide_cells(r)
        table.add_row(*cells)
        widths = [max(w, cell.cell_len) for w, cell in zip(widths, cells, strict=True)]
    return table, sum(widths) + _WIDE_GAP * (len(widths) - 1)
