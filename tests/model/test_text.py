"""``safe_text``: what the command shows and the journal logs carries no character that a
terminal would act on or hide, escaped so that an operator sees it was there."""

from __future__ import annotations

import pytest

from itemjournal._model.text import safe_text

# Each character a terminal would act on, hide or reorder, and how it is shown.
HOSTILE = {
    "\x1b": "\\x1b",  # escape: starts every control sequence
    "\x07": "\\x07",  # bell: ends an OSC sequence that retitles the terminal
    "\x00": "\\x00",
    "\x08": "\\x08",  # backspace: overprints what came before
    "\r": "\\r",
    "\n": "\\n",
    "\t": "\\t",
    "\x7f": "\\x7f",  # DEL
    "\x85": "\\x85",  # C1: next line
    "\x9b": "\\x9b",  # C1: control sequence introducer
    "\u061c": "\\u061c",  # Arabic letter mark
    "\u200b": "\\u200b",  # zero-width space
    "\u200c": "\\u200c",
    "\u200d": "\\u200d",
    "\u200e": "\\u200e",  # left-to-right mark
    "\u200f": "\\u200f",
    "\u2028": "\\u2028",  # line separator
    "\u2029": "\\u2029",  # paragraph separator
    "\u202a": "\\u202a",
    "\u202e": "\\u202e",  # right-to-left override
    "\u2060": "\\u2060",  # word joiner
    "\u2066": "\\u2066",
    "\u2069": "\\u2069",  # pop directional isolate
    "\ufeff": "\\ufeff",  # zero-width no-break space
    "\U000e0041": "\\U000e0041",  # a tag character: invisible
}


@pytest.mark.parametrize(("char", "shown"), HOSTILE.items(), ids=repr)
def test_every_hostile_character_is_shown_escaped(char: str, shown: str) -> None:
    assert safe_text(f"ch_123{char}") == f"ch_123{shown}"


def test_printable_text_is_kept_as_it_is() -> None:
    for text in ("", "order-3", "provider timed out", "Zahlung über 45,00 €", "支払い", "ok 🙂"):
        assert safe_text(text) is text or safe_text(text) == text
    assert safe_text("[bold]not markup[/bold] \\x1b") == "[bold]not markup[/bold] \\x1b"


def test_a_whole_attack_becomes_one_visible_line() -> None:
    attack = "timeout\x1b]0;owned\x07\x1b[2J\r\nfake: ok\u202egnp.exe"
    shown = safe_text(attack)
    assert shown == "timeout\\x1b]0;owned\\x07\\x1b[2J\\r\\nfake: ok\\u202egnp.exe"
    assert shown.isprintable()
