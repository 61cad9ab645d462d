"""Text as a terminal or a log line may carry it: every character a terminal would act on,
hide or reorder is shown escaped instead.

Stored text comes from callers, providers and exceptions. Shown raw, an escape sequence
can retitle or clear the operator's terminal, a carriage return or a line feed can forge
a line of output or of a log, a bidirectional override can make ``gnp.exe`` read as
``exe.png``, and a zero-width character can make two different receipts look the same.
``safe_text`` is the one place that decides what is safe: everything Python does not call
printable (``str.isprintable``: the C0 and C1 controls, DEL, the format characters, among
them the bidirectional marks, overrides and isolates and the zero-width characters, the
line and paragraph separators, spaces other than the ASCII space, unassigned and private
code points, lone surrogates) is written as its escape, ``\\n``, ``\\x1b``, ``\\u200b``,
``\\U000e0041``. Backslashes are kept as they are, so an escape is visible but not
reversible.
"""

from __future__ import annotations

__all__ = ["safe_text"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    point = ord(char)
    if point < 0x100:
        return f"\\x{point:02x}"
    if point < 0x10000:
        return f"\\u{point:04x}"
    return f"\\U{point:08x}"


def safe_text(text: str) -> str:
    """``text`` with every character a terminal would act on or hide shown escaped."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)
