"""How the command shows what it found: text made safe for a terminal, the ``--json``
shapes of views and problems (the module docstring of ``app`` lists them), tables and
lines for people, and writing to stdout and stderr.

Whatever a record holds reaches a terminal only escaped (``_clean``), and JSON output
is ASCII only, so stored text can never drive the terminal it is shown on."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from ..._model.errors import JournalError
from ..._model.identity import Identity
from ..._model.records import Event
from ..._model.text import safe_text
from ..._model.view import RecordView

_STATUS_STYLE = {
    "started": "cyan",
    "succeeded": "green",
    "needs_review": "bold yellow",
    "released": "magenta",
}


def _clean(text: str) -> str:
    """Text safe to put on a terminal: control, escape, bidirectional and zero-width
    characters shown escaped (``safe_text``, which the journal's log records use too)."""
    return safe_text(text)


def _error_line(code: str, message: str) -> str:
    return _clean(f"error: {code}: {message}")


def _problem_text(problem: JournalError) -> str:
    text = f"{problem.code}: {problem.message}"
    location = getattr(problem, "location", None)
    if isinstance(location, str) and location and location not in problem.message:
        text += f" ({location})"
    return _clean(text)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# -------------------------------------------------------------------------- json shapes


def _identity(identity: Identity) -> list[str]:
    return list(identity)


def _view_json(view: RecordView) -> dict[str, Any]:
    owner = view.owner
    return {
        "key": view.key,
        "identity": _identity(view.identity),
        "status": view.status,
        "receipt": view.receipt,
        "attempt": view.attempt,
        "created_at": view.created_at,
        "updated_at": view.updated_at,
        "owner": None
        if owner is None
        else {
            "host": owner.host,
            "pid": owner.pid,
            "started_at": owner.started_at,
            "process": owner.process,
        },
        "owner_alive": view.owner_alive,
        "review_reason": view.review_reason,
        "result_size": None if view.result is None else len(view.result.encode("utf-8")),
    }


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "at": event.at,
        "event": event.event,
        "status": event.status,
        "attempt": event.attempt,
        "note": event.note,
    }


def _full_json(view: RecordView, *, with_result: bool = True) -> dict[str, Any]:
    shape = _view_json(view)
    shape["result"] = view.result if with_result else None
    shape["history"] = [_event_json(event) for event in view.history]
    return shape


def _problem_json(problem: JournalError) -> dict[str, Any]:
    location = getattr(problem, "location", None)
    return {
        "code": problem.code,
        "message": problem.message,
        "location": location if isinstance(location, str) else None,
    }


def _dumps(value: object, *, indent: int | None = None) -> str:
    # ASCII only: whatever a record holds, the output cannot drive a terminal.
    if indent is None:
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value, indent=indent)


def _show_identity(identity: Sequence[str]) -> str:
    return "/".join(identity)


# ------------------------------------------------------------------------------ output


class _Screen:
    """Human output on stdout: rich on a terminal; piped, plain lines as wide as they need
    to be (not cut at 80 columns) and without trailing blanks, for grep and diff."""

    def __init__(self) -> None:
        console = Console()
        self.terminal = console.is_terminal
        self.console = console if self.terminal else Console(width=240, no_color=True)

    @property
    def width(self) -> int:
        """The columns a table may use: the terminal's; piped, as many as it needs."""
        return self.console.width

    def print(self, renderable: RenderableType, *, width: int | None = None) -> None:
        """Print ``renderable``; given ``width`` wider than the screen, that wide (a
        terminal then wraps the lines)."""
        console = self.console
        if width is not None and width > console.width:
            console = Console(width=width) if self.terminal else Console(width=width, no_color=True)
        if self.terminal:
            console.print(renderable)
            return
        with console.capture() as captured:
            console.print(renderable)
        _write(line.rstrip() for line in captured.get().splitlines())


def _out_console() -> _Screen:
    return _Screen()


def _write(lines: Iterable[str]) -> None:
    text = "".join(f"{line}\n" for line in lines)
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _status_text(status: str) -> Text:
    return Text(status, style=_STATUS_STYLE.get(status, ""))


def _when(stamp: str | None) -> str:
    """A timestamp for people: UTC to the second."""
    if not stamp:
        return "-"
    try:
        moment = datetime.fromisoformat(stamp).astimezone(UTC)
    except ValueError:
        return _clean(stamp)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def _owner_text(view: RecordView) -> str:
    owner = view.owner
    if owner is None:
        return "-"
    text = f"pid {owner.pid} on {owner.host}"
    if view.status == "started":
        text += {True: " (alive)", False: " (gone)", None: " (alive? unknown here)"}[
            view.owner_alive
        ]
    return _clean(text)


def _detail(view: RecordView) -> str:
    if view.status == "needs_review":
        return _clean(view.review_reason or "-")
    if view.status == "started":
        return _owner_text(view)
    if view.receipt is not None:
        return _clean(f"receipt {view.receipt}")
    return "-"


def _view_lines(views: Iterable[RecordView], verb: str) -> list[str]:
    lines = []
    for view in views:
        detail = _detail(view)
        more = "" if detail == "-" else f": {detail}"
        lines.append(_clean(f"{verb} {_show_identity(view.identity)} [{view.status}]{more}"))
    return lines


def _resolved_line(view: RecordView) -> str:
    outcome = view.status
    if view.receipt is not None and view.status == "succeeded":
        outcome += f", receipt {view.receipt}"
    return _clean(f"resolved {_show_identity(view.identity)}: {outcome}")
