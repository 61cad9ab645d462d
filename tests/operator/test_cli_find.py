"""Finding one record from what an operator has in hand: the key ``list`` and ``--json``
print (whole, or a unique prefix of it), a client's ``Idempotency-Key`` (the middleware's
record, on every store), and the one table of exit and error codes."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from click.testing import CliRunner, Result
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.identity import identity_digest
from itemjournal._operator.cli.app import cli
from itemjournal._operator.cli.errors import ERROR_CODES, EXIT_CODES
from itemjournal.asgi import IdempotencyMiddleware, MalformedKey, key_identity

DEFINITION = definition_digest("cli-find-tests-v1")
CLEAN_ENV: dict[str, str | None] = {
    "ITEMJOURNAL_LOCATION": None,
    "ITEMJOURNAL_INPUT_KEY_FILE": None,
    "ITEMJOURNAL_VIEWER_TOKEN": None,
}
MANUAL = Path(__file__).resolve().parents[2] / "docs" / "cli.md"  # the command's page


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=dict(CLEAN_ENV), catch_exceptions=False)


def one_error(result: Result, code: str, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {code}: "), lines[0]
    return lines[0]


def sharing_a_prefix(length: int) -> tuple[Identity, Identity]:
    """Two identities whose keys begin with the same ``length`` hex digits."""
    seen: dict[str, Identity] = {}
    for n in itertools.count():
        identity = Identity("shop", "billing", "charge", f"order-{n}")
        prefix = identity_digest(identity)[:length]
        if prefix in seen:
            return seen[prefix], identity
        seen[prefix] = identity
    raise AssertionError("unreachable")


TWINS = sharing_a_prefix(4)


async def _seed(location: str) -> None:
    async with await Journal.open(location) as journal:
        for identity in TWINS:
            claim = await journal.begin(identity, {}, DEFINITION)
            assert isinstance(claim, Claim)
            await journal.mark_review(identity, "provider timed out")


@pytest.fixture
def loc(tmp_path: Path) -> str:
    location = f"sqlite://{tmp_path}/journal.db"
    anyio.run(_seed, location)
    return location


# ----------------------------------------------------------------------- by key or prefix


def test_show_by_key_or_a_unique_prefix(loc: str) -> None:
    first, second = TWINS
    key = identity_digest(first)
    other = identity_digest(second)
    common = next(n for n in range(64) if key[n] != other[n])  # digits the two keys share
    for given in (key, key[: common + 1], key[: common + 1].upper()):
        result = invoke("-L", loc, "show", given, "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["identity"] == list(first)
    human = invoke("-L", loc, "show", key[: common + 1])
    assert human.exit_code == 0
    assert "shop/billing/charge/" + first.item in human.stdout


def test_an_ambiguous_prefix_is_refused_naming_the_matches(loc: str) -> None:
    first, _second = TWINS
    prefix = identity_digest(first)[:4]
    line = one_error(invoke("-L", loc, "show", prefix), "AMBIGUOUS_KEY")
    assert "2 records" in line
    for identity in TWINS:
        assert identity.item in line


@pytest.mark.parametrize("given", ["abc", "xyz123", "0123456789abcdef-", "a" * 65, "12 34"])
def test_a_malformed_key_is_refused(loc: str, given: str) -> None:
    one_error(invoke("-L", loc, "show", given), "INVALID_KEY")


def test_a_missing_record_is_bad_input(loc: str) -> None:
    """A record that is not there is exit 2, like every other input that names nothing."""
    missing = "f" * 64 if not identity_digest(TWINS[0]).startswith("f") else "0" * 64
    line = one_error(invoke("-L", loc, "show", missing), "NOT_FOUND")
    assert missing[:12] in line
    one_error(invoke("-L", loc, "show", "shop", "billing", "charge", "nope"), "NOT_FOUND")


def test_show_takes_four_labels_or_one_key(loc: str) -> None:
    line = one_error(invoke("-L", loc, "show", "shop", "billing"), "USAGE")
    assert "SCOPE PROGRAM JOB ITEM" in line and "KEY" in line
    one_error(invoke("-L", loc, "show"), "USAGE")


# ------------------------------------------------------------------- an Idempotency-Key


async def _order(request: Request) -> JSONResponse:
    return JSONResponse({"order": "made"}, status_code=201)


SHOP = Starlette(routes=[Route("/orders", _order, methods=["POST"])])


async def _request(journal: Journal, key: str, scope: Any) -> None:
    app = IdempotencyMiddleware(SHOP, journal=journal, scope=scope)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        response = await client.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
        assert response.status_code == 201


def _show(location: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "itemjournal", "-L", location, "show", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_show_idempotency_key_finds_the_middleware_s_record(
    anyio_backend: str, make_journal: Any, location: str
) -> None:
    journal = await make_journal()
    await _request(journal, "8e03978e-40d5-43e8-bc93-6894a57f9324", None)
    await _request(journal, '"a key, quoted"', "user-42")
    # A scope function's value that is not a label: its digest is the scope label.
    await _request(journal, "per-tenant", lambda scope: "tenant@example.com")
    views = [view async for view in journal.records()]
    assert len(views) == 3

    cases: list[tuple[list[str], Identity]] = [
        (
            ["8e03978e-40d5-43e8-bc93-6894a57f9324"],
            key_identity("8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ),
        (['"a key, quoted"', "--scope", "user-42"], key_identity("a key, quoted", scope="user-42")),
        (
            ["per-tenant", "--scope", "tenant@example.com"],
            key_identity("per-tenant", scope="tenant@example.com"),
        ),
    ]
    stored = {view.identity for view in views}
    for args, identity in cases:
        assert identity in stored  # the helper gives the identity the middleware wrote
        found = await anyio.to_thread.run_sync(
            lambda args=args: _show(location, "--idempotency-key", *args, "--json")
        )
        assert found.returncode == 0, found.stderr
        shown = json.loads(found.stdout)
        assert shown["identity"] == list(identity)
        assert shown["status"] == "succeeded"
        assert shown["receipt"].startswith("http 201 sha256:")
    other = await anyio.to_thread.run_sync(
        lambda: _show(location, "--idempotency-key", "per-tenant", "--json")
    )
    assert other.returncode == 2  # the same key in another scope is another record
    assert other.stderr.startswith("error: NOT_FOUND: ")
    bad = await anyio.to_thread.run_sync(lambda: _show(location, "--idempotency-key", "a b"))
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: INVALID_KEY: ")


def test_key_identity_is_the_middleware_s_recipe() -> None:
    assert key_identity("k") == ("default", "http", "idempotency-key", key_identity("k").item)
    assert key_identity("k") != key_identity("k", scope="user-1")
    assert key_identity("k", scope="user-1").scope == "user-1"
    assert key_identity("k", scope="a user").scope.startswith("s-")
    assert len(key_identity("k").item) == 64
    for bad in ("", "x" * 256):
        with pytest.raises(MalformedKey):
            key_identity(bad)


def test_show_idempotency_key_options(loc: str) -> None:
    one_error(invoke("-L", loc, "show", "--idempotency-key", "k", "a", "b", "c", "d"), "USAGE")
    one_error(invoke("-L", loc, "show", "--scope", "user-1", *TWINS[0]), "USAGE")
    line = one_error(invoke("-L", loc, "show", "--idempotency-key", "k"), "NOT_FOUND")
    assert "Idempotency-Key" in line
    one_error(
        invoke("-L", loc, "show", "--idempotency-key", "k", "--program", "not a label"),
        "INVALID_LABEL",
    )


# --------------------------------------------------------------------- the codes' table


def test_one_table_of_exit_and_error_codes_in_help_and_the_manual() -> None:
    top = invoke("--help")
    assert top.exit_code == 0
    help_text = " ".join(top.stdout.split())
    manual = MANUAL.read_text(encoding="utf-8")
    for code, meaning in EXIT_CODES:
        assert f"{code} {' '.join(meaning.split())}" in help_text
        assert f"| {code} | {meaning} |" in manual
    codes = [code for code, _, _ in ERROR_CODES]
    assert len(codes) == len(set(codes))
    for code, exit_code, meaning in ERROR_CODES:
        assert f"{code} ({exit_code})" in help_text, code
        assert f"| `{code}` | {exit_code} | {meaning} |" in manual, code
    for needed in ("NOT_FOUND", "INVALID_KEY", "AMBIGUOUS_KEY", "INVALID_CHECK_ARG", "USAGE"):
        assert needed in codes
    assert dict((c, e) for c, e, _ in ERROR_CODES)["NOT_FOUND"] == 2
    # Every code the command's modules raise is in the table.
    source = "".join(
        path.read_text(encoding="utf-8")
        for path in (Path(cli.callback.__code__.co_filename).parent).glob("*.py")  # type: ignore[union-attr]
    )
    raised = set(re.findall(r'(?:CommandError|_BadValue)\(\s*"([A-Z_]+)"', source))
    assert raised <= set(codes), raised - set(codes)


def test_a_key_search_counts_the_records_it_could_not_read(tmp_path: Path) -> None:
    root = tmp_path / "journal"
    anyio.run(_seed, str(root))
    spoiled = next(root.glob("*/*.json"))
    spoiled.write_text("{not json", encoding="utf-8")
    line = one_error(invoke("show", "--location", str(root), "ffffffff"), "NOT_FOUND")
    assert "(1 record(s) could not be read)" in line
