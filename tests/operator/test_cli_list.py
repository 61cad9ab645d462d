"""``list`` in an order an operator can read (last change by default, creation, or key),
with ``--json --history``, and the table's layouts: whole labels when piped or ``--wide``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result

from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.identity import identity_digest
from itemjournal._operator.cli.app import cli

DEFINITION = definition_digest("cli-list-tests-v1")
CLEAN_ENV: dict[str, str | None] = {
    "ITEMJOURNAL_LOCATION": None,
    "ITEMJOURNAL_INPUT_KEY_FILE": None,
    "ITEMJOURNAL_VIEWER_TOKEN": None,
}
X = [Identity("shop", "billing", "charge", f"x{n}") for n in range(1, 4)]
LONG = Identity("default", "http", "idempotency-key", "ab" * 32)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=dict(CLEAN_ENV), catch_exceptions=False)


async def _seed(location: str) -> None:
    """Created x1, x2, x3, LONG in that order; last changed x2, x3, LONG, x1."""
    async with await Journal.open(location) as journal:
        claims = {}
        for identity in (*X, LONG):
            claim = await journal.begin(identity, {}, DEFINITION)
            assert isinstance(claim, Claim)
            claims[identity] = claim
        await journal.complete(claims[X[2]], "ch_3")
        await journal.mark_review(LONG, "provider timed out")
        await journal.complete(claims[X[0]], "ch_1")


@pytest.fixture(params=["file", "sqlite"])
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    location = (
        f"sqlite://{tmp_path}/journal.db" if request.param == "sqlite" else str(tmp_path / "j")
    )
    anyio.run(_seed, location)
    return location


def items(result: Result) -> list[str]:
    assert result.exit_code == 0, result.stderr
    return [json.loads(line)["identity"][3] for line in result.stdout.splitlines()]


def test_list_sorts_by_last_change_by_creation_or_by_key(loc: str) -> None:
    by_update = ["x2", "x3", LONG.item, "x1"]
    assert items(invoke("-L", loc, "list", "--json", "--sort", "updated")) == by_update
    assert items(invoke("-L", loc, "list", "--json", "--sort", "created")) == [
        "x1",
        "x2",
        "x3",
        LONG.item,
    ]
    by_key = [i.item for i in sorted((*X, LONG), key=identity_digest)]
    assert items(invoke("-L", loc, "list", "--json", "--sort", "key")) == by_key
    assert items(invoke("-L", loc, "list", "--json")) == by_key  # streamed, as before
    # The table: oldest change first, the newest next to the prompt.
    table = invoke("-L", loc, "list").stdout.splitlines()
    shown = [line.split()[4] for line in table[2:-1]]
    assert shown == by_update
    limited = invoke("-L", loc, "list", "--json", "--sort", "updated", "--limit", "2")
    assert items(limited) == by_update[:2]
    one_error = invoke("-L", loc, "list", "--sort", "random")
    assert one_error.exit_code == 2
    assert one_error.stderr.startswith("error: USAGE: ")


def test_list_json_with_history(loc: str) -> None:
    result = invoke("-L", loc, "list", "--json", "--history", "--sort", "created")
    assert result.exit_code == 0, result.stderr
    views: list[dict[str, Any]] = [json.loads(line) for line in result.stdout.splitlines()]
    assert [list(view)[-1] for view in views] == ["history"] * 4
    assert "result" not in views[0]
    assert [event["event"] for event in views[0]["history"]] == ["begin", "complete"]
    plain = json.loads(invoke("-L", loc, "list", "--json").stdout.splitlines()[0])
    assert list(views[0])[:-1] == list(plain)
    refused = invoke("-L", loc, "list", "--history")
    assert refused.exit_code == 2
    assert refused.stderr.startswith("error: USAGE: ")


def test_piped_and_wide_tables_keep_every_label_and_the_key_whole(loc: str) -> None:
    for args in (["list"], ["list", "--wide"]):
        text = invoke("-L", loc, *args).stdout
        assert LONG.item in text
        assert identity_digest(LONG) in text
        header = text.splitlines()[0].split()
        assert header[:5] == ["STATUS", "SCOPE", "PROGRAM", "JOB", "ITEM"]
        assert "KEY" in header
