"""The command as an operator meets it on a real terminal: ``list`` and ``show`` under a
pseudo-terminal of 80, 100 and 120 columns (status and reason on every row, a shortened
label found again through the key column), and hostile text (escape sequences, CR, LF,
bidirectional and zero-width characters) in reasons, receipts, notes and a check's
answers: nothing of it reaches the terminal or a log line raw."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.identity import identity_digest

DEFINITION = definition_digest("cli-terminal-tests-v1")
CLEAN_ENV = ("ITEMJOURNAL_LOCATION", "ITEMJOURNAL_INPUT_KEY_FILE", "ITEMJOURNAL_VIEWER_TOKEN")
# The records the ASGI middleware writes: a digest as the item label.

LONG = [
    Identity("default", "http", "idempotency-key", identity_digest(("k", "e", "y", str(n))))
    for n in range(3)
]
SHORT = [Identity("shop", "billing", "charge", f"order-{n}") for n in range(1, 4)]
# What each record is expected to show on its row: its status and its reason or receipt.
EXPECTED = {
    LONG[0]: ("needs_review", "provider timed out"),
    LONG[1]: ("succeeded", "receipt ch_7"),
    LONG[2]: ("released", "-"),
    SHORT[0]: ("needs_review", "smtp timeout"),
    SHORT[1]: ("succeeded", "receipt ch_1"),
    SHORT[2]: ("started", "pid"),
}
SGR = re.compile(rb"\x1b\[[0-9;]*m")  # rich's own styling, the only escapes it may send


async def _seed(location: str) -> None:
    async with await Journal.open(location) as journal:
        for identity, (status, _) in EXPECTED.items():
            claim = await journal.begin(identity, {"cents": 1}, DEFINITION)
            assert isinstance(claim, Claim)
            if status == "succeeded":
                await journal.complete(claim, "ch_7" if identity in LONG else "ch_1")
            elif status in ("needs_review", "released"):
                reason = "provider timed out" if identity in LONG else "smtp timeout"
                await journal.mark_review(identity, reason)
                if status == "released":
                    await journal.resolve(identity, retry=True, note="no charge")


@pytest.fixture
def loc(tmp_path: Path) -> str:
    location = f"sqlite://{tmp_path}/journal.db"
    anyio.run(_seed, location)
    return location


def on_a_terminal(
    args: list[str],
    columns: int,
    *,
    stderr_to: Path | None = None,
    more_env: dict[str, str] | None = None,
    expect: int = 0,
) -> bytes:
    """Run ``itemjournal ARGS`` with stdout (and stderr, unless ``stderr_to``) on a
    pseudo-terminal of ``columns`` x 40; what the terminal was sent. The size comes from
    the terminal itself (no COLUMNS or LINES in the environment)."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"):
        env.pop(name, None)
    env.update(TERM="xterm-256color", TTY_INTERACTIVE="0", **(more_env or {}))
    err = stderr_to.open("wb") if stderr_to is not None else None
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "itemjournal", *args],
            stdin=secondary,
            stdout=secondary,
            stderr=err if err is not None else secondary,
            env=env,
        )
    finally:
        if err is not None:
            err.close()
    os.close(secondary)
    shown = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(primary)
    assert child.wait(timeout=60) == expect, shown
    return shown


def screen_text(shown: bytes) -> str:
    """What the terminal shows, without rich's styling; the terminal's CR LF as LF."""
    plain = SGR.sub(b"", shown).replace(b"\r\n", b"\n")
    return plain.decode("utf-8")


def piped(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "itemjournal", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def row_of(text: str, identity: Identity) -> tuple[str, str]:
    """The row of ``identity`` (found by a prefix of its key) and the prefix it shows."""
    key = identity_digest(identity)
    for line in text.splitlines():
        for word in line.split():
            if len(word) >= 8 and key.startswith(word):
                return line, word
    raise AssertionError(f"no row shows a prefix of {key} in\n{text}")


# ------------------------------------------------------------------- fitting the terminal


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_list_fits_the_terminal_and_every_row_reads(loc: str, columns: int) -> None:
    text = screen_text(on_a_terminal(["-L", loc, "list"], columns))
    lines = text.splitlines()
    assert all(len(line) <= columns for line in lines), "\n".join(lines)
    assert "STATUS" in lines[0] and "KEY" in lines[0]
    assert "…" not in lines[0]  # no header cut short
    assert lines[-1] == "6 records"
    for identity, (status, detail) in EXPECTED.items():
        row, prefix = row_of(text, identity)
        assert status in row.split(), row
        assert detail in row, row
        if identity in LONG:
            item = identity.item
            assert item not in text  # 64 characters: shortened in the middle ...
            (name,) = [word for word in row.split() if "/" in word]
            head, cut, tail = name.split("/")[3].partition("…")
            assert cut and len(head) >= 3 and len(tail) >= 3, row
            assert item.startswith(head) and item.endswith(tail), row
        # ... and the key prefix on its row finds the record again.
        found = piped("-L", loc, "show", prefix, "--json")
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["identity"] == list(identity)


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_show_of_a_shortened_label_on_the_terminal(loc: str, columns: int) -> None:
    listed = screen_text(on_a_terminal(["-L", loc, "list", "--status", "needs_review"], columns))
    _, prefix = row_of(listed, LONG[0])
    text = screen_text(on_a_terminal(["-L", loc, "show", prefix], columns))
    assert all(len(line) <= columns for line in text.splitlines()), text
    assert identity_digest(LONG[0]) in text.replace("\n", "").replace(" ", "")
    assert "needs_review" in text and "provider timed out" in text


def test_wide_shows_every_label_and_the_key_whole(loc: str) -> None:
    text = screen_text(on_a_terminal(["-L", loc, "list", "--wide"], 80))
    for identity in EXPECTED:
        assert identity.item in text
        assert identity_digest(identity) in text


# ----------------------------------------------------------------------- hostile text

ATTACK = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\r\nforged line\u202eevil\u200bzw\u2028ls\x9b31m"
RAW = ("\x1b", "\x07", "\r", "\u202e", "\u200b", "\u2028", "\x9b")
SEEN = (
    "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mred\\r\\nforged line\\u202eevil\\u200bzw\\u2028ls\\x9b31m"
)
HOSTILE = [Identity("shop", "billing", "charge", f"hostile-{n}") for n in range(1, 5)]

CHECK = f"""
from itemjournal import DidNotHappen, Happened, Unknown

ATTACK = {ATTACK!r}


async def check(view):
    if view.identity.item == "hostile-2":
        return Happened("ch_" + ATTACK, note="note " + ATTACK)
    if view.identity.item == "hostile-3":
        return DidNotHappen("evidence " + ATTACK)
    raise RuntimeError("provider down " + ATTACK)
"""


async def _seed_hostile(location: str) -> None:
    async with await Journal.open(location) as journal:
        for n, identity in enumerate(HOSTILE, start=1):
            claim = await journal.begin(identity, {"cents": 1}, DEFINITION)
            assert isinstance(claim, Claim)
            if n == 1:
                await journal.complete(claim, f"ch_1{ATTACK}")
            else:
                await journal.mark_review(identity, f"reason {ATTACK}")
        await journal.resolve(HOSTILE[2], retry=True, note=f"note {ATTACK}")
        again = await journal.begin(HOSTILE[2], {"cents": 1}, DEFINITION)
        assert isinstance(again, Claim)
        await journal.mark_review(HOSTILE[2], f"again {ATTACK}")


def assert_clean(text: str) -> None:
    for raw in RAW:
        assert raw not in text, (raw, text)
    stray = [char for char in text if char != "\n" and not char.isprintable()]
    assert not stray, stray


def test_hostile_text_never_reaches_the_terminal_raw(tmp_path: Path) -> None:
    location = f"sqlite://{tmp_path}/journal.db"
    anyio.run(_seed_hostile, location)
    for args in (
        ["list"],
        ["list", "--wide"],
        ["show", *HOSTILE[0]],
        ["show", *HOSTILE[2]],
        ["show", identity_digest(HOSTILE[1])[:12]],
    ):
        shown = on_a_terminal(["-L", location, *args], 100)
        assert b"\x1b" not in SGR.sub(b"", shown), (args, shown)
        text = screen_text(shown)
        assert_clean(text)
        assert "\\x1b]0;owned" in text, (args, text)
    whole = screen_text(on_a_terminal(["-L", location, "show", *HOSTILE[2]], 200))
    assert SEEN in whole.replace("\n", "")
    # The JSON and the export keep the stored text exactly (escaped as JSON, ASCII only).
    exported = piped("-L", location, "export")
    assert exported.returncode == 0
    assert "\x1b" not in exported.stdout
    views = {
        tuple(view["identity"]): view for view in map(json.loads, exported.stdout.split("\n")[:-1])
    }
    assert views[HOSTILE[0]]["receipt"] == f"ch_1{ATTACK}"
    assert views[HOSTILE[1]]["review_reason"] == f"reason {ATTACK}"
    shown = json.loads(piped("-L", location, "show", *HOSTILE[2], "--json").stdout)
    assert [event["note"] for event in shown["history"]][2] == f"note {ATTACK}"


def test_a_check_s_hostile_answers_and_the_log_records_are_escaped(tmp_path: Path) -> None:
    location = f"sqlite://{tmp_path}/journal.db"
    anyio.run(_seed_hostile, location)
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "hostile_checks.py").write_text(textwrap.dedent(CHECK), encoding="utf-8")
    log = tmp_path / "stderr.log"
    search = os.pathsep.join(filter(None, [str(checks), os.environ.get("PYTHONPATH")]))
    for args in (["--dry-run"], ["--yes"]):
        shown = on_a_terminal(
            ["-v", "-L", location, "reconcile", "--check", "hostile_checks:check", *args],
            120,
            stderr_to=log,
            more_env={"PYTHONPATH": search},
            expect=1,  # one check failed
        )
        assert b"\x1b" not in SGR.sub(b"", shown), shown
        text = screen_text(shown)
        assert_clean(text)
        assert "\\x1b]0;owned" in text
        logged = log.read_text(encoding="utf-8")
        assert_clean(logged)
        if args == ["--yes"]:
            assert "INFO itemjournal: resolved shop/billing/charge/hostile-2" in logged
            assert "INFO itemjournal: resolved shop/billing/charge/hostile-3" in logged
            assert "\\x1b]0;owned" in logged
