"""The ``itemjournal`` command on the file and SQLite stores: every command with good and
bad input, its exit codes (0 fine, 1 problems found, 2 bad usage or input), one-line
errors naming their code, stable ``--json`` shapes, and a few real processes (``python -m
itemjournal`` and the installed script) for what only a real process shows."""

from __future__ import annotations

import json
import os
import pty
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from _builders import written_long_ago
from click.testing import CliRunner, Result

import itemjournal
from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.identity import identity_digest
from itemjournal._operator.cli.app import cli

DEFINITION = definition_digest("cli-tests-v1")
SECRET = "4242-4242-secret-card"  # an input value: it must never appear in any output
OLD = "2020-01-02T03:04:05.000000+00:00"

ORDER_1 = Identity("shop", "billing", "charge", "order-1")  # succeeded, with a result
ORDER_2 = Identity("shop", "billing", "charge", "order-2")  # succeeded
ORDER_3 = Identity("shop", "billing", "charge", "order-3")  # needs_review
ORDER_4 = Identity("shop", "billing", "charge", "order-4")  # started, this process owns it
MSG_1 = Identity("shop", "mail", "send", "msg-1")  # needs_review
MSG_2 = Identity("shop", "mail", "send", "msg-2")  # released

VIEW_KEYS = [
    "key",
    "identity",
    "status",
    "receipt",
    "attempt",
    "created_at",
    "updated_at",
    "owner",
    "owner_alive",
    "review_reason",
    "result_size",
]
FULL_KEYS = [*VIEW_KEYS, "result", "history"]
EVENT_KEYS = ["at", "event", "status", "attempt", "note"]
PROBLEM_KEYS = ["code", "message", "location"]
CLEAN_ENV: dict[str, str | None] = {
    "ITEMJOURNAL_LOCATION": None,
    "ITEMJOURNAL_INPUT_KEY_FILE": None,
    "ITEMJOURNAL_VIEWER_TOKEN": None,
}
VENV_BIN = Path(sys.executable).parent


# ------------------------------------------------------------------------------ helpers


@pytest.fixture(params=["file", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def location_of(kind: str, base: Path) -> str:
    return f"sqlite://{base}/journal.db" if kind == "sqlite" else str(base / "journal")


def run_async(function: Any, *args: Any) -> Any:
    return anyio.run(function, *args)


async def _open(location: str, **options: Any) -> Journal:
    return await Journal.open(location, **options)


async def _seed(location: str, options: dict[str, Any]) -> None:
    async with await _open(location, **options) as journal:
        for identity in (ORDER_1, ORDER_2, ORDER_3, ORDER_4, MSG_1, MSG_2):
            claim = await journal.begin(identity, {"card": SECRET}, DEFINITION)
            assert isinstance(claim, Claim)
            if identity == ORDER_1:
                await journal.complete(claim, "ch_1", result='{"paid": true}')
            elif identity == ORDER_2:
                await journal.complete(claim, "ch_2")
            elif identity == ORDER_3:
                await journal.mark_review(identity, "provider timed out")
            elif identity in (MSG_1, MSG_2):
                await journal.mark_review(identity, "smtp timeout")
        await journal.resolve(MSG_2, retry=True, note="never sent")


def seed(location: str, **options: Any) -> None:
    """Six records: 2 succeeded, 2 needs_review, 1 started, 1 released."""
    run_async(_seed, location, options)


@pytest.fixture
def loc(kind: str, tmp_path: Path) -> str:
    location = location_of(kind, tmp_path)
    seed(location)
    return location


async def _views(location: str) -> dict[Identity, tuple[str, str | None, int]]:
    found: dict[Identity, tuple[str, str | None, int]] = {}
    async with await _open(location) as journal:
        async for item in journal.records():
            if isinstance(item, itemjournal.RecordView):
                found[item.identity] = (item.status, item.receipt, len(item.history))
    return found


def state(location: str) -> dict[Identity, tuple[str, str | None, int]]:
    """Every readable record's status, receipt and history length."""
    result: dict[Identity, tuple[str, str | None, int]] = run_async(_views, location)
    return result


async def _inspect(location: str, identity: Identity) -> itemjournal.RecordView:
    async with await _open(location) as journal:
        return await journal.inspect(identity)


def inspect(location: str, identity: Identity) -> itemjournal.RecordView:
    view: itemjournal.RecordView = run_async(_inspect, location, identity)
    return view


def invoke(
    *args: str, env: dict[str, str | None] | None = None, stdin: str | None = None
) -> Result:
    runner = CliRunner()
    return runner.invoke(
        cli, list(args), input=stdin, env={**CLEAN_ENV, **(env or {})}, catch_exceptions=False
    )


def one_error(result: Result, code: str, exit_code: int = 2) -> str:
    """The result failed with exactly one stderr line, ``error: CODE: ...``."""
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {code}: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def plant_invalid(location: str, identity: Identity) -> None:
    """Replace the stored record of ``identity`` with bytes no record can be."""
    digest = identity_digest(identity)
    if location.startswith("sqlite://"):
        database = sqlite3.connect(location[len("sqlite://") :])
        try:
            with database:
                changed = database.execute(
                    "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                    (b"{not a record", digest),
                ).rowcount
            assert changed == 1
        finally:
            database.close()
        return
    path = Path(location) / digest[:2] / f"{digest}.json"
    assert path.exists()
    path.write_bytes(b"\x00garbage, not a record")
    path.chmod(0o600)


def _patch_clock(monkeypatch: pytest.MonkeyPatch, stamp: str) -> None:
    """Make every module of the journal read ``stamp`` as the time now."""
    from itemjournal._model import records as _records

    real = _records.utc_now
    for name, module in list(sys.modules.items()):
        if name.startswith("itemjournal") and getattr(module, "utc_now", None) is real:
            monkeypatch.setattr(module, "utc_now", lambda: stamp)


async def _dead_owner_claim(location: str) -> None:
    """A started claim whose owner process is gone: made by a child that exits at once."""
    script = textwrap.dedent(
        f"""
        import os, anyio, itemjournal
        async def main():
            journal = await itemjournal.Journal.open({location!r})
            await journal.begin(("shop", "billing", "charge", "order-9"), {{}},
                                itemjournal.definition_digest("x"))
            os._exit(0)
        anyio.run(main)
        """
    )
    await anyio.run_process([sys.executable, "-c", script])


# ------------------------------------------------------------------------ location rules

ALL_COMMANDS: list[list[str]] = [
    ["list"],
    ["show", *ORDER_1],
    ["counts"],
    ["review", *ORDER_4, "--reason", "stuck"],
    ["resolve", *ORDER_3, "--retry", "--note", "n"],
    ["resolve", "--status", "needs_review", "--retry", "--note", "n"],
    ["sweep"],
    ["verify"],
    ["prune", "--older-than", "30d"],
    ["export"],
    ["serve"],
]


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_missing_location_is_refused(command: list[str]) -> None:
    line = one_error(invoke(*command), "ABSOLUTE_ROOT_REQUIRED")
    assert "ITEMJOURNAL_LOCATION" in line


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize(
    "location", ["relative/journal", "sqlite://relative.db", "sqlite:relative.db", "~/j"]
)
def test_relative_location_is_refused(command: list[str], location: str) -> None:
    one_error(invoke("-L", location, *command), "ABSOLUTE_ROOT_REQUIRED")
    one_error(invoke(*command, env={"ITEMJOURNAL_LOCATION": location}), "ABSOLUTE_ROOT_REQUIRED")


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_location_without_a_journal_is_refused_and_left_alone(
    command: list[str], kind: str, tmp_path: Path
) -> None:
    missing = location_of(kind, tmp_path / "nothing-here")
    one_error(invoke("-L", missing, *command), "NO_JOURNAL")
    assert not (tmp_path / "nothing-here").exists()
    # A directory that is not a journal is not made one.
    (tmp_path / "plain").mkdir()
    one_error(invoke("-L", str(tmp_path / "plain"), *command), "NO_JOURNAL")
    assert list((tmp_path / "plain").iterdir()) == []


def test_the_location_from_the_environment_or_either_option(loc: str, tmp_path: Path) -> None:
    other = location_of("file", tmp_path / "other")
    run_async(_seed_empty, other)
    by_env = invoke("list", "--json", env={"ITEMJOURNAL_LOCATION": loc})
    by_group = invoke("-L", loc, "list", "--json")
    by_command = invoke("list", "--json", "-L", loc)
    assert by_env.exit_code == by_group.exit_code == by_command.exit_code == 0
    assert len(json_lines(by_env.stdout)) == 6
    assert by_env.stdout == by_group.stdout == by_command.stdout
    # The command's own option wins over the group's and the environment's.
    overridden = invoke("-L", loc, "list", "--json", "--location", other)
    assert overridden.exit_code == 0
    assert overridden.stdout == ""
    from_env = invoke("list", "--json", "-L", other, env={"ITEMJOURNAL_LOCATION": loc})
    assert from_env.stdout == ""


async def _seed_empty(location: str) -> None:
    async with await _open(location):
        pass


# ---------------------------------------------------------------------------------- list


def test_list_shows_every_record_as_a_table(loc: str) -> None:
    result = invoke("-L", loc, "list")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["STATUS", "SCOPE", "PROGRAM", "JOB", "ITEM"]
    assert lines[-1] == "6 records"
    body = "\n".join(lines)
    assert "provider timed out" in body
    assert "receipt ch_1" in body
    assert "pid" in body and "(alive)" in body  # the started record's owner is this process
    assert all(line == line.rstrip() for line in lines)  # piped: no trailing blanks


def test_list_json_is_one_view_per_line_in_key_order(loc: str) -> None:
    result = invoke("-L", loc, "list", "--json")
    assert result.exit_code == 0
    views = json_lines(result.stdout)
    assert len(views) == 6
    for view in views:
        assert list(view) == VIEW_KEYS
        assert view["key"] == identity_digest(Identity(*view["identity"]))
    assert [v["key"] for v in views] == sorted(v["key"] for v in views)
    by_item = {v["identity"][3]: v for v in views}
    assert by_item["order-1"]["receipt"] == "ch_1"
    assert by_item["order-1"]["result_size"] == len(b'{"paid": true}')
    assert by_item["order-2"]["result_size"] is None
    assert by_item["order-3"]["review_reason"] == "provider timed out"
    assert by_item["order-4"]["owner_alive"] is True
    assert by_item["order-4"]["owner"]["pid"] == os.getpid()
    assert list(by_item["order-4"]["owner"]) == ["host", "pid", "started_at", "process"]
    assert by_item["order-1"]["owner_alive"] is None
    assert SECRET not in result.stdout


def test_list_filters_and_limit(loc: str) -> None:
    def items(*args: str) -> list[str]:
        result = invoke("-L", loc, "list", "--json", *args)
        assert result.exit_code == 0, result.stderr
        return sorted(view["identity"][3] for view in json_lines(result.stdout))

    assert items("--status", "needs_review") == ["msg-1", "order-3"]
    assert items("--status", "succeeded") == ["order-1", "order-2"]
    assert items("--program", "mail") == ["msg-1", "msg-2"]
    assert items("--job", "charge", "--status", "started") == ["order-4"]
    assert items("--scope", "elsewhere") == []
    assert len(items("--limit", "2")) == 2
    human = invoke("-L", loc, "list", "--limit", "2")
    assert human.stdout.splitlines()[-1] == "2 records (--limit 2 reached; more match)"
    everything = invoke("-L", loc, "list", "--limit", "6")
    assert everything.stdout.splitlines()[-1] == "6 records"


def test_list_of_an_empty_selection(loc: str) -> None:
    result = invoke("-L", loc, "list", "--scope", "nobody")
    assert result.exit_code == 0
    assert result.stdout == "0 records\n"


@pytest.mark.parametrize("status", ["bogus", "absent", "invalid", "NEEDS_REVIEW", ""])
def test_list_refuses_an_unknown_status(loc: str, status: str) -> None:
    line = one_error(invoke("-L", loc, "list", "--status", status), "INVALID_STATUS")
    assert "needs_review" in line


@pytest.mark.parametrize("option", ["--scope", "--program", "--job"])
@pytest.mark.parametrize("label", ["bad label", "-dash", "", "x" * 81, "a/b", "ü"])
def test_list_refuses_a_bad_label(loc: str, option: str, label: str) -> None:
    one_error(invoke("-L", loc, "list", option, label), "INVALID_LABEL")


@pytest.mark.parametrize("limit", ["0", "-1", "many"])
def test_list_refuses_a_bad_limit(loc: str, limit: str) -> None:
    one_error(invoke("-L", loc, "list", "--limit", limit), "USAGE")


# ---------------------------------------------------------------------------------- show


def test_show_a_record_with_its_history(loc: str) -> None:
    result = invoke("-L", loc, "show", *MSG_2)
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "shop/mail/send/msg-2" in text
    assert identity_digest(MSG_2) in text
    assert "released" in text
    assert "history" in text
    for event in ("begin", "mark_review", "resolve"):
        assert event in text
    assert "never sent" in text and "smtp timeout" in text


def test_show_json_is_the_full_view(loc: str) -> None:
    result = invoke("-L", loc, "show", *ORDER_1, "--json")
    assert result.exit_code == 0
    view = json.loads(result.stdout)
    assert list(view) == FULL_KEYS
    assert view["identity"] == list(ORDER_1)
    assert view["result"] == '{"paid": true}'
    assert [e["event"] for e in view["history"]] == ["begin", "complete"]
    assert all(list(event) == EVENT_KEYS for event in view["history"])
    assert SECRET not in result.stdout


def test_show_an_absent_record(loc: str) -> None:
    line = one_error(invoke("-L", loc, "show", "shop", "billing", "charge", "nope"), "NOT_FOUND", 2)
    assert "shop/billing/charge/nope" in line


@pytest.mark.parametrize("position", range(4))
def test_show_refuses_a_bad_label(loc: str, position: int) -> None:
    labels = list(ORDER_1)
    labels[position] = "not a label"
    line = one_error(invoke("-L", loc, "show", *labels), "INVALID_LABEL")
    assert Identity._fields[position] in line


def test_show_needs_four_labels(loc: str) -> None:
    line = one_error(invoke("-L", loc, "show", "shop", "billing", "charge"), "USAGE")
    assert "ITEM" in line


# -------------------------------------------------------------------------------- counts


def test_counts_human_and_json(loc: str) -> None:
    human = invoke("-L", loc, "counts")
    assert human.exit_code == 0
    rows = {line.split()[0]: line.split()[1] for line in human.stdout.splitlines()[2:]}
    assert rows == {
        "started": "1",
        "succeeded": "2",
        "needs_review": "2",
        "released": "1",
        "invalid": "0",
        "total": "6",
    }
    shaped = invoke("-L", loc, "counts", "--json")
    assert shaped.exit_code == 0
    counts = json.loads(shaped.stdout)
    assert list(counts) == ["started", "succeeded", "needs_review", "released", "invalid", "total"]
    assert counts["total"] == 6 and counts["needs_review"] == 2


# -------------------------------------------------------------------------------- review


def test_review_marks_a_started_record(loc: str) -> None:
    result = invoke("-L", loc, "review", *ORDER_4, "--reason", "worker host rebooted")
    assert result.exit_code == 0, result.stderr
    assert (
        result.stdout == "marked shop/billing/charge/order-4 needs_review: worker host rebooted\n"
    )
    view = inspect(loc, ORDER_4)
    assert view.status == "needs_review"
    assert view.review_reason == "worker host rebooted"


def test_review_json(loc: str) -> None:
    result = invoke("-L", loc, "review", *ORDER_4, "--reason", "r", "--json")
    assert result.exit_code == 0
    view = json.loads(result.stdout)
    assert list(view) == VIEW_KEYS
    assert view["status"] == "needs_review"


def test_review_of_a_record_that_is_not_started(loc: str) -> None:
    before = state(loc)
    line = one_error(invoke("-L", loc, "review", *ORDER_1, "--reason", "r"), "NOT_STARTED", 1)
    assert "succeeded" in line
    one_error(invoke("-L", loc, "review", "shop", "x", "y", "z", "--reason", "r"), "NOT_STARTED", 1)
    assert state(loc) == before


def test_review_bad_input(loc: str) -> None:
    before = state(loc)
    one_error(invoke("-L", loc, "review", *ORDER_4), "USAGE")  # --reason is required
    one_error(invoke("-L", loc, "review", *ORDER_4, "--reason", "  "), "INVALID_ARGUMENT")
    one_error(
        invoke("-L", loc, "review", "shop", "b c", "x", "y", "--reason", "r"), "INVALID_LABEL"
    )
    assert state(loc) == before


# ------------------------------------------------------------------------ resolve: one


def test_resolve_one_record_by_retry_or_receipt(loc: str) -> None:
    retried = invoke("-L", loc, "resolve", *ORDER_3, "--retry", "--note", "no charge upstream")
    assert retried.exit_code == 0, retried.stderr
    assert retried.stdout == "resolved shop/billing/charge/order-3: released\n"
    received = invoke("-L", loc, "resolve", *MSG_1, "--receipt", "msg_77", "--note", "it went")
    assert received.exit_code == 0
    assert received.stdout == "resolved shop/mail/send/msg-1: succeeded, receipt msg_77\n"
    view = inspect(loc, MSG_1)
    assert (view.status, view.receipt) == ("succeeded", "msg_77")
    assert view.history[-1].note == "it went"
    assert inspect(loc, ORDER_3).history[-1].note == "no charge upstream"


def test_resolve_one_json(loc: str) -> None:
    result = invoke("-L", loc, "resolve", *ORDER_3, "--retry", "--note", "n", "--json")
    assert result.exit_code == 0
    view = json.loads(result.stdout)
    assert list(view) == VIEW_KEYS
    assert view["status"] == "released"


def test_resolve_a_record_not_in_review(loc: str) -> None:
    before = state(loc)
    line = one_error(
        invoke("-L", loc, "resolve", *ORDER_4, "--retry", "--note", "n"), "NOT_IN_REVIEW", 1
    )
    assert line.startswith("error: NOT_IN_REVIEW: the record is started, not needs_review. ")
    assert "shop/billing/charge/order-4" in line  # the refusal names the record
    assert f"`itemjournal show shop billing charge order-4 --location {loc}`" in line
    one_error(
        invoke("-L", loc, "resolve", *ORDER_1, "--receipt", "r", "--note", "n"), "NOT_IN_REVIEW", 1
    )
    absent = ("shop", "billing", "charge", "order-77")
    one_error(invoke("-L", loc, "resolve", *absent, "--retry", "--note", "n"), "NOT_IN_REVIEW", 1)
    assert state(loc) == before


@pytest.mark.parametrize(
    ("args", "code"),
    [
        ([*ORDER_3, "--retry"], "USAGE"),  # no --note
        ([*ORDER_3, "--note", "n"], "USAGE"),  # neither --retry nor --receipt
        ([*ORDER_3, "--retry", "--receipt", "r", "--note", "n"], "USAGE"),
        ([*ORDER_3[:3], "--retry", "--note", "n"], "USAGE"),  # three labels
        ([*ORDER_3, "extra", "--retry", "--note", "n"], "USAGE"),
        ([*ORDER_3, "--retry", "--note", "n", "--yes"], "USAGE"),
        ([*ORDER_3, "--retry", "--note", "n", "--job", "charge"], "USAGE"),
        ([*ORDER_3, "--retry", "--note", "n", "--status", "needs_review"], "USAGE"),
        ([*ORDER_3, "--receipt-from", "x", "--note", "n"], "USAGE"),
        ([*ORDER_3, "--retry", "--note", " "], "INVALID_ARGUMENT"),
        ([*ORDER_3, "--receipt", " ", "--note", "n"], "INVALID_RECEIPT"),
        ([*ORDER_3, "--receipt", "r" * 201, "--note", "n"], "INVALID_RECEIPT"),
        (["shop", "billing", "charge", "order 3", "--retry", "--note", "n"], "INVALID_LABEL"),
    ],
)
def test_resolve_one_bad_input_changes_nothing(loc: str, args: list[str], code: str) -> None:
    before = state(loc)
    one_error(invoke("-L", loc, "resolve", *args), code)
    assert state(loc) == before


# ----------------------------------------------------------------------- resolve: bulk


def test_bulk_resolve_without_yes_changes_nothing(loc: str) -> None:
    before = state(loc)
    result = invoke("-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "n")
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "order-3" in text and "msg-1" in text
    assert "provider timed out" in text
    assert "retry: released" in text
    assert text.splitlines()[-1] == (
        "would resolve 2 records; nothing changed: run again with --yes to apply"
    )
    assert state(loc) == before


def test_bulk_resolve_with_yes_resolves_every_match(loc: str) -> None:
    result = invoke(
        "-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "bulk", "--yes"
    )
    assert result.exit_code == 0, result.stderr
    assert "resolved shop/billing/charge/order-3: released" in result.stdout
    assert "resolved shop/mail/send/msg-1: released" in result.stdout
    assert result.stdout.splitlines()[-1] == "resolved 2 of 2 records"
    after = state(loc)
    assert after[ORDER_3][0] == after[MSG_1][0] == "released"
    assert after[ORDER_1][0] == "succeeded" and after[ORDER_4][0] == "started"


def test_bulk_resolve_by_filter(loc: str) -> None:
    result = invoke(
        "-L",
        loc,
        "resolve",
        "--status",
        "needs_review",
        "--program",
        "mail",
        "--retry",
        "--note",
        "n",
        "--yes",
    )
    assert result.exit_code == 0
    after = state(loc)
    assert after[MSG_1][0] == "released"
    assert after[ORDER_3][0] == "needs_review"


def test_bulk_resolve_json(loc: str) -> None:
    planned = invoke(
        "-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "n", "--json"
    )
    assert planned.exit_code == 0
    plan = json.loads(planned.stdout)
    assert list(plan) == ["applied", "planned", "resolved", "failed", "left", "problems"]
    assert plan["applied"] is False
    assert sorted(p["identity"][3] for p in plan["planned"]) == ["msg-1", "order-3"]
    assert all(list(p) == ["key", "identity", "decision", "receipt"] for p in plan["planned"])
    assert {p["decision"] for p in plan["planned"]} == {"retry"}
    assert plan["resolved"] == plan["failed"] == plan["left"] == plan["problems"] == []
    applied = invoke(
        "-L",
        loc,
        "resolve",
        "--status",
        "needs_review",
        "--retry",
        "--note",
        "n",
        "--json",
        "--yes",
    )
    done = json.loads(applied.stdout)
    assert done["applied"] is True
    assert sorted(v["status"] for v in done["resolved"]) == ["released", "released"]
    assert all(list(v) == VIEW_KEYS for v in done["resolved"])


def test_bulk_resolve_when_nothing_is_in_review(loc: str) -> None:
    result = invoke(
        "-L",
        loc,
        "resolve",
        "--status",
        "needs_review",
        "--scope",
        "nobody",
        "--retry",
        "--note",
        "n",
        "--yes",
    )
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "resolved 0 of 0 records"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--retry", "--note", "n"], "USAGE"),  # neither a record nor --status
        (["--status", "started", "--retry", "--note", "n"], "INVALID_STATUS"),
        (["--status", "bogus", "--retry", "--note", "n"], "INVALID_STATUS"),
        (["--status", "needs_review", "--note", "n"], "USAGE"),
        (["--status", "needs_review", "--receipt", "r", "--note", "n"], "USAGE"),
        (["--status", "needs_review", "--retry", "--receipt-from", "f", "--note", "n"], "USAGE"),
        (["--status", "needs_review", "--retry"], "USAGE"),
        (["--status", "needs_review", "--retry", "--note", "n", "--job", "a b"], "INVALID_LABEL"),
        (["--status", "needs_review", "--retry", "--note", ""], "INVALID_ARGUMENT"),
    ],
)
def test_bulk_resolve_bad_input_changes_nothing(loc: str, args: list[str], code: str) -> None:
    before = state(loc)
    one_error(invoke("-L", loc, "resolve", *args, "--yes"), code)
    assert state(loc) == before


def test_bulk_resolve_receipts_from_a_file(loc: str, tmp_path: Path) -> None:
    receipts = tmp_path / "receipts.txt"
    receipts.write_text(
        "# from the provider's dashboard\n"
        "\n"
        "shop billing charge order-3   ch_3 (found late)  \n"
        + json.dumps({"identity": list(MSG_1), "receipt": "msg_1"})
        + "\n",
        encoding="utf-8",
    )
    base = ["-L", loc, "resolve", "--status", "needs_review", "--receipt-from", str(receipts)]
    before = state(loc)
    preview = invoke(*base, "--note", "reconciled")
    assert preview.exit_code == 0, preview.stderr
    assert "receipt ch_3 (found late): succeeded" in preview.stdout
    assert "receipt msg_1: succeeded" in preview.stdout
    assert state(loc) == before
    applied = invoke(*base, "--note", "reconciled", "--yes")
    assert applied.exit_code == 0, applied.stderr
    after = state(loc)
    assert after[ORDER_3][:2] == ("succeeded", "ch_3 (found late)")
    assert after[MSG_1][:2] == ("succeeded", "msg_1")


def test_bulk_resolve_receipts_for_records_not_in_review(loc: str, tmp_path: Path) -> None:
    receipts = tmp_path / "receipts.txt"
    receipts.write_text(
        "shop billing charge order-3 ch_3\n"  # in review: resolved
        "shop billing charge order-1 ch_1\n"  # succeeded already
        "shop billing charge order-77 ch_77\n",  # no such record
        encoding="utf-8",
    )
    args = ["--status", "needs_review", "--receipt-from", str(receipts), "--note", "n", "--yes"]
    result = invoke("-L", loc, "resolve", *args)
    assert result.exit_code == 1
    assert "resolved shop/billing/charge/order-3: succeeded, receipt ch_3" in result.stdout
    assert (
        "not resolved shop/billing/charge/order-1: NOT_IN_REVIEW: the record is succeeded, "
        "not needs_review" in result.stdout
    )
    assert "not resolved shop/billing/charge/order-77: NOT_IN_REVIEW: the record is absent" in (
        result.stdout
    )
    # msg-1 is in review but has no receipt in the file: it stays as it is.
    assert f"left in review shop/mail/send/msg-1: no receipt in {receipts}" in result.stdout
    assert result.stdout.splitlines()[-1] == "resolved 1 of 1 record; 2 not resolved"
    assert state(loc)[MSG_1][0] == "needs_review"
    # A receipt for a record in review that the filter leaves out is not applied either.
    filtered = invoke(
        "-L",
        loc,
        "resolve",
        "--status",
        "needs_review",
        "--program",
        "billing",
        "--receipt-from",
        str(_lines(tmp_path, "shop mail send msg-1 m1\n")),
        "--note",
        "n",
        "--yes",
        "--json",
    )
    assert filtered.exit_code == 1
    report = json.loads(filtered.stdout)
    assert [f["error"]["code"] for f in report["failed"]] == ["FILTERED_OUT"]
    assert list(report["failed"][0]) == ["key", "identity", "error"]
    assert list(report["failed"][0]["error"]) == PROBLEM_KEYS
    assert state(loc)[MSG_1][0] == "needs_review"


def _lines(tmp_path: Path, text: str, name: str = "r.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_bulk_resolve_receipts_from_stdin(loc: str) -> None:
    result = invoke(
        "-L",
        loc,
        "resolve",
        "--status",
        "needs_review",
        "--receipt-from",
        "-",
        "--note",
        "n",
        "--yes",
        stdin="shop billing charge order-3 ch_3\n",
    )
    assert result.exit_code == 0, result.stderr
    assert state(loc)[ORDER_3][:2] == ("succeeded", "ch_3")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("shop billing charge order-3\n", "expected SCOPE PROGRAM JOB ITEM RECEIPT"),
        ("shop billing charge order/3 r\n", "INVALID_LABEL"),
        ('{"identity": ["shop", "billing", "charge"], "receipt": "r"}\n', "four labels"),
        ('{"identity": ["shop", "billing", "charge", "order-3"]}\n', "exactly the keys"),
        ('{"identity": ["shop", "billing", "charge", "order-3"], "receipt": 5}\n', "receipt"),
        ('{"identity": ["shop", "billing", "charge", "order-3"], "receipt": " "}\n', "blank"),
        ("{not json\n", "not a JSON object"),
        ("shop billing charge order-3 a\nshop billing charge order-3 b\n", "more than once"),
        ("shop billing charge order-3 " + "r" * 201 + "\n", "INVALID_RECEIPT"),
    ],
)
def test_bulk_resolve_refuses_a_bad_receipt_file(
    loc: str, tmp_path: Path, text: str, why: str
) -> None:
    path = _lines(tmp_path, "shop mail send msg-1 fine\n" + text)
    before = state(loc)
    line = one_error(
        invoke(
            "-L",
            loc,
            "resolve",
            "--status",
            "needs_review",
            "--receipt-from",
            str(path),
            "--note",
            "n",
            "--yes",
        ),
        "INVALID_RECEIPT_FILE",
    )
    assert why in line
    assert state(loc) == before


def test_bulk_resolve_refuses_an_unreadable_receipt_file(loc: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.txt")
    args = ["--status", "needs_review", "--receipt-from", missing, "--note", "n", "--yes"]
    one_error(invoke("-L", loc, "resolve", *args), "INVALID_RECEIPT_FILE")
    args[3] = str(_lines(tmp_path, "# nothing but a comment\n\n"))
    assert "names no record" in one_error(
        invoke("-L", loc, "resolve", *args), "INVALID_RECEIPT_FILE"
    )
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"shop billing charge order-3 caf\xe9\n")
    args[3] = str(latin)
    one_error(invoke("-L", loc, "resolve", *args), "INVALID_RECEIPT_FILE")


# --------------------------------------------------------------------------------- sweep


def test_sweep_marks_records_whose_owner_is_gone(loc: str) -> None:
    run_async(_dead_owner_claim, loc)
    result = invoke("-L", loc, "sweep")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (
        "marked shop/billing/charge/order-9 [needs_review]: owner process gone\n"
        "marked 1 record needs_review\n"
    )
    # The live owner's claim is left alone; a second sweep has nothing to do.
    assert inspect(loc, ORDER_4).status == "started"
    again = invoke("-L", loc, "sweep", "--json")
    assert again.exit_code == 0
    assert json.loads(again.stdout) == {"marked": [], "problems": []}


def test_sweep_json(loc: str) -> None:
    run_async(_dead_owner_claim, loc)
    result = invoke("-L", loc, "sweep", "--json")
    report = json.loads(result.stdout)
    assert [v["identity"][3] for v in report["marked"]] == ["order-9"]
    assert list(report["marked"][0]) == VIEW_KEYS


# -------------------------------------------------------------------------------- verify


def test_verify_a_sound_journal(loc: str) -> None:
    result = invoke("-L", loc, "verify")
    assert result.exit_code == 0
    assert result.stdout == f"ok: no problems in {loc}\n"
    shaped = invoke("-L", loc, "verify", "--json")
    assert json.loads(shaped.stdout) == {"ok": True, "problems": []}


def test_verify_reports_an_invalid_record(loc: str) -> None:
    plant_invalid(loc, ORDER_2)
    result = invoke("-L", loc, "verify")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("RECORD_INVALID: ")
    assert identity_digest(ORDER_2) in lines[0]
    shaped = json.loads(invoke("-L", loc, "verify", "--json").stdout)
    assert shaped["ok"] is False and len(shaped["problems"]) == 1


# --------------------------------------------------------------------------------- prune


@pytest.mark.parametrize(
    "duration", ["30", "d", "0s", "0d", "-1d", "1.5d", "3x", "", "30 d", "1y", "9" * 30 + "w"]
)
def test_prune_refuses_a_bad_duration(loc: str, duration: str) -> None:
    before = state(loc)
    one_error(invoke("-L", loc, "prune", "--older-than", duration), "INVALID_DURATION")
    assert state(loc) == before


def test_prune_needs_older_than(loc: str) -> None:
    one_error(invoke("-L", loc, "prune"), "USAGE")


def test_prune_removes_only_old_resolved_records(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = location_of(kind, tmp_path)
    with monkeypatch.context() as patched:
        _patch_clock(patched, OLD)
        seed(location)  # every record of the seed is old
    written_long_ago(location, 60 * 86400)  # and so the kernel says
    young = Identity("shop", "billing", "charge", "young")
    run_async(_claim_and_complete, location, young)
    preview = invoke("-L", location, "prune", "--older-than", "30d", "--dry-run")
    assert preview.exit_code == 0, preview.stderr
    assert sorted(preview.stdout.splitlines()[:-1]) == [
        "would remove shop/billing/charge/order-1 [succeeded]: receipt ch_1",
        "would remove shop/billing/charge/order-2 [succeeded]: receipt ch_2",
        "would remove shop/mail/send/msg-2 [released]",
    ]
    assert preview.stdout.splitlines()[-1].startswith("would remove 3 records last changed before ")
    assert len(state(location)) == 7
    result = invoke("-L", location, "prune", "--older-than", "30d", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert list(report) == ["dry_run", "older_than", "cutoff", "removed", "problems", "kept"]
    assert report["kept"] == []
    assert report["dry_run"] is False
    assert report["older_than"] == 30 * 86400
    assert sorted(v["identity"][3] for v in report["removed"]) == ["msg-2", "order-1", "order-2"]
    left = state(location)
    assert sorted(identity.item for identity in left) == ["msg-1", "order-3", "order-4", "young"]
    again = invoke("-L", location, "prune", "--older-than", "1d")
    assert again.exit_code == 0
    assert again.stdout.startswith("removed 0 records last changed before ")


async def _claim_and_complete(location: str, identity: Identity) -> None:
    async with await _open(location) as journal:
        claim = await journal.begin(identity, {}, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, "fresh")


# -------------------------------------------------------------------------------- export


def test_export_writes_full_views_with_results(loc: str) -> None:
    result = invoke("-L", loc, "export")
    assert result.exit_code == 0
    views = json_lines(result.stdout)
    assert len(views) == 6
    assert all(list(view) == FULL_KEYS for view in views)
    by_item = {v["identity"][3]: v for v in views}
    assert by_item["order-1"]["result"] == '{"paid": true}'
    assert [e["event"] for e in by_item["msg-2"]["history"]] == ["begin", "mark_review", "resolve"]
    # Inputs are never stored, so they never appear: not their value, not a field.
    assert SECRET not in result.stdout
    assert "input" not in result.stdout


def test_export_without_results_and_with_filters(loc: str) -> None:
    result = invoke("-L", loc, "export", "--no-results", "--status", "succeeded")
    views = json_lines(result.stdout)
    assert sorted(v["identity"][3] for v in views) == ["order-1", "order-2"]
    by_item = {v["identity"][3]: v for v in views}
    assert by_item["order-1"]["result"] is None
    assert by_item["order-1"]["result_size"] == len(b'{"paid": true}')
    one_error(invoke("-L", loc, "export", "--status", "nope"), "INVALID_STATUS")
    one_error(invoke("-L", loc, "export", "--job", "a b"), "INVALID_LABEL")


# ---------------------------------------------------------- an invalid record everywhere


def test_an_invalid_record_is_reported_and_never_stops_a_command(loc: str) -> None:
    plant_invalid(loc, ORDER_2)

    listing = invoke("-L", loc, "list", "--json")
    assert listing.exit_code == 1
    assert len(json_lines(listing.stdout)) == 5
    problems = listing.stderr.splitlines()
    assert len(problems) == 1
    assert problems[0].startswith("problem: RECORD_INVALID: ")

    human = invoke("-L", loc, "list")
    assert human.exit_code == 1
    assert human.stdout.splitlines()[-1] == "5 records"

    exported = invoke("-L", loc, "export")
    assert exported.exit_code == 1
    assert len(json_lines(exported.stdout)) == 5
    assert exported.stderr.startswith("problem: RECORD_INVALID: ")

    counts = json.loads(invoke("-L", loc, "counts", "--json").stdout)
    assert counts["invalid"] == 1 and counts["total"] == 6

    one_error(invoke("-L", loc, "show", *ORDER_2), "RECORD_INVALID", 1)
    one_error(invoke("-L", loc, "resolve", *ORDER_2, "--retry", "--note", "n"), "RECORD_INVALID", 1)

    swept = invoke("-L", loc, "sweep")
    assert swept.exit_code == 1
    assert swept.stderr.startswith("problem: RECORD_INVALID: ")

    pruned = invoke("-L", loc, "prune", "--older-than", "1d", "--dry-run")
    assert pruned.exit_code == 1
    assert len(pruned.stderr.splitlines()) == 1

    bulk = invoke(
        "-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "n", "--yes"
    )
    assert bulk.exit_code == 1
    assert bulk.stderr.startswith("problem: RECORD_INVALID: ")
    assert bulk.stdout.splitlines()[-1] == "resolved 2 of 2 records"
    assert invoke("-L", loc, "verify").exit_code == 1


# ------------------------------------------------------------------------- keyed journal


def test_a_keyed_journal_needs_its_key_file(kind: str, tmp_path: Path) -> None:
    key = b"0123456789abcdef-not-a-real-key\n"  # the exact bytes, newline included
    key_file = tmp_path / "input.key"
    key_file.write_bytes(key)
    location = location_of(kind, tmp_path)
    seed(location, input_key=key)
    one_error(invoke("-L", location, "list"), "INPUT_KEY_MISMATCH")
    assert invoke("-L", location, "--input-key-file", str(key_file), "list").exit_code == 0
    assert invoke("-L", location, "list", "--input-key-file", str(key_file)).exit_code == 0
    by_env = invoke("-L", location, "verify", env={"ITEMJOURNAL_INPUT_KEY_FILE": str(key_file)})
    assert by_env.exit_code == 0, by_env.stderr
    stripped = tmp_path / "stripped.key"
    stripped.write_bytes(key.rstrip(b"\n"))
    one_error(
        invoke("-L", location, "--input-key-file", str(stripped), "list"), "INPUT_KEY_MISMATCH"
    )
    short = tmp_path / "short.key"
    short.write_bytes(b"short")
    one_error(invoke("-L", location, "--input-key-file", str(short), "list"), "INVALID_ARGUMENT")
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"")
    one_error(invoke("-L", location, "--input-key-file", str(empty), "list"), "INVALID_KEY_FILE")
    missing = str(tmp_path / "missing.key")
    one_error(invoke("-L", location, "--input-key-file", missing, "list"), "INVALID_KEY_FILE")


# ---------------------------------------------------------------------------------- serve


def test_serve_validates_then_calls_the_viewer(loc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from itemjournal._operator.viewer import app as _viewer

    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(_viewer, "serve", lambda location, **kw: calls.append((location, kw)))
    assert invoke("-L", loc, "serve").exit_code == 0
    assert calls == [
        (
            loc,
            {
                "host": "127.0.0.1",
                "port": 8080,
                "token": None,
                "input_key": None,
                "trust_shared_root": False,
            },
        )
    ]
    calls.clear()
    result = invoke(
        "-L",
        loc,
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        env={"ITEMJOURNAL_VIEWER_TOKEN": "s3cret"},
    )
    assert result.exit_code == 0
    assert calls[0][1]["token"] == "s3cret" and calls[0][1]["port"] == 9000
    for host in ("::1", "[::1]", "localhost", "127.0.0.2"):
        assert invoke("-L", loc, "serve", "--host", host).exit_code == 0
    # The location may be given to serve as an argument, as in ``itemjournal serve LOCATION``.
    calls.clear()
    assert invoke("serve", loc).exit_code == 0
    assert invoke("-L", loc, "serve", loc).exit_code == 0
    assert [call[0] for call in calls] == [loc, loc]
    one_error(invoke("serve", loc, "-L", "/elsewhere"), "USAGE")
    one_error(invoke("serve", "relative"), "ABSOLUTE_ROOT_REQUIRED")


def test_serve_refuses_an_open_address_without_a_token(
    loc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from itemjournal._operator.viewer import app as _viewer

    monkeypatch.setattr(_viewer, "serve", lambda *a, **kw: pytest.fail("must not serve"))
    for host in ("0.0.0.0", "192.0.2.7", "::", "example.org"):
        one_error(invoke("-L", loc, "serve", "--host", host), "TOKEN_REQUIRED")
    one_error(invoke("-L", loc, "serve", "--token", " "), "INVALID_ARGUMENT")
    one_error(invoke("-L", loc, "serve", "--port", "70000"), "USAGE")


def test_serve_without_the_viewer(loc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "itemjournal._operator.viewer.app", None)
    line = one_error(invoke("-L", loc, "serve"), "VIEWER_UNAVAILABLE", 1)
    assert "no web viewer" in line


# --------------------------------------------------------------------------- usage, text


def test_usage_errors_are_one_line(loc: str) -> None:
    line = one_error(invoke("-L", loc, "frobnicate"), "USAGE")
    assert "frobnicate" in line
    one_error(invoke("-L", loc, "list", "--frob"), "USAGE")
    one_error(invoke("-L", loc, "list", "--status"), "USAGE")


def test_help_and_version() -> None:
    top = invoke("--help")
    assert top.exit_code == 0
    for command in (
        "list",
        "show",
        "counts",
        "review",
        "resolve",
        "sweep",
        "verify",
        "prune",
        "export",
        "serve",
    ):
        assert command in top.stdout
    assert invoke("resolve", "--help").exit_code == 0
    assert "--receipt-from" in invoke("resolve", "--help").stdout
    version = invoke("--version")
    assert version.exit_code == 0
    assert itemjournal.__version__ in version.stdout
    bare = invoke()
    assert bare.exit_code == 2
    assert "Commands:" in bare.stdout


def test_control_characters_never_reach_the_terminal(loc: str) -> None:
    run_async(_review_with, loc, "timeout \x1b[2J\x1b]0;owned\x07 [bold]not markup[/bold] \u202e")
    for args in (
        ["list"],
        ["show", *ORDER_4],
        ["list", "--json"],
        ["export"],
        ["show", *ORDER_4, "--json"],
    ):
        result = invoke("-L", loc, *args)
        assert result.exit_code == 0
        for bad in ("\x1b", "\x07", "\u202e"):
            assert bad not in result.stdout, args
    human = invoke("-L", loc, "show", *ORDER_4).stdout
    assert "\\x1b[2J" in human and "[bold]not markup[/bold]" in human and "\\u202e" in human
    shaped = json.loads(invoke("-L", loc, "show", *ORDER_4, "--json").stdout)
    assert shaped["review_reason"].startswith("timeout \x1b[2J")


async def _review_with(location: str, reason: str) -> None:
    async with await _open(location) as journal:
        await journal.mark_review(ORDER_4, reason)


# ------------------------------------------------------------------ real processes


def _commands() -> Iterator[list[str]]:
    yield [sys.executable, "-m", "itemjournal"]
    script = VENV_BIN / "itemjournal"
    if script.exists():
        yield [str(script)]


def process(
    command: Sequence[str], *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
        check=False,
    )


def test_real_processes_exit_codes_and_one_line_errors(kind: str, tmp_path: Path) -> None:
    location = location_of(kind, tmp_path)
    seed(location)
    plant_invalid(location, ORDER_2)
    for command in _commands():
        ok = process(command, "-L", location, "counts", "--json")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["invalid"] == 1
        verify = process(command, "-L", location, "verify")
        assert verify.returncode == 1
        assert verify.stdout.startswith("RECORD_INVALID: ")
        cases = [
            (["list", "--status", "bogus"], 2, "INVALID_STATUS"),
            (["show", "shop", "b c", "x", "y"], 2, "INVALID_LABEL"),
            (["resolve", *ORDER_4, "--retry", "--note", "n"], 1, "NOT_IN_REVIEW"),
            (["show", *ORDER_2], 1, "RECORD_INVALID"),
            (["prune", "--older-than", "soon"], 2, "INVALID_DURATION"),
            (["list", "--nope"], 2, "USAGE"),
        ]
        for args, code, name in cases:
            done = process(command, "-L", location, *args)
            assert done.returncode == code, (args, done.stderr)
            assert done.stderr.count("\n") == 1, done.stderr
            assert done.stderr.startswith(f"error: {name}: ")
        missing = process(command, "list")
        assert missing.returncode == 2
        assert missing.stderr.startswith("error: ABSOLUTE_ROOT_REQUIRED: ")
        relative = process(command, "list", env={"ITEMJOURNAL_LOCATION": "journal"})
        assert relative.returncode == 2
        assert relative.stderr.startswith("error: ABSOLUTE_ROOT_REQUIRED: ")


def test_without_the_cli_extra_the_command_says_what_to_install() -> None:
    for missing in ("click", "rich"):
        script = f"import sys; sys.modules[{missing!r}] = None; import itemjournal.__main__"
        done = process([sys.executable, "-c", script])
        assert done.returncode == 1
        assert done.stderr == (
            f"error: CLI_UNAVAILABLE: the itemjournal command needs {missing}: "
            "pip install 'itemjournal[cli]'\n"
        )


def test_a_closed_pipe_ends_quietly(loc: str) -> None:
    command = [sys.executable, "-m", "itemjournal", "-L", loc, "export"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()  # the reader is gone before the first line
        stderr = child.stderr.read()
        assert child.wait(timeout=60) in (0, 1)
    assert b"Traceback" not in stderr


# ------------------------------------------------------------------ progress on a terminal


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite journal of 1,200 succeeded records: more than a progress bar's threshold."""
    location = f"sqlite://{tmp_path_factory.mktemp('big')}/journal.db"

    async def fill() -> None:
        async with await _open(location) as journal:

            async def one(n: int) -> None:
                identity = Identity("bulk", "load", "job", f"n{n:05}")
                claim = await journal.begin(identity, {}, DEFINITION)
                assert isinstance(claim, Claim)
                await journal.complete(claim, f"r{n}")

            async with anyio.create_task_group() as group:
                for n in range(1200):
                    group.start_soon(one, n)

    anyio.run(fill)
    return location


def _on_a_terminal(args: Sequence[str], out: Path) -> tuple[int, bytes]:
    """Run with stderr on a pseudo-terminal (stdout to a file); what the terminal showed."""
    primary, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
    for name in ("NO_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR"):
        env.pop(name, None)
    with out.open("wb") as sink:
        child = subprocess.Popen(
            [sys.executable, "-m", "itemjournal", *args], stdout=sink, stderr=secondary, env=env
        )
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
    return child.wait(timeout=60), shown


def test_progress_on_a_terminal_for_a_long_scan(big: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    code, shown = _on_a_terminal(["-L", big, "export"], out)
    assert code == 0
    assert b"exporting" in shown  # the bar, on stderr
    assert len(out.read_bytes().splitlines()) == 1200
    assert b"\x1b" not in out.read_bytes()  # stdout stays clean data


def test_no_progress_for_a_short_scan_on_a_terminal(loc: str, tmp_path: Path) -> None:
    code, shown = _on_a_terminal(["-L", loc, "list", "--json"], tmp_path / "out.jsonl")
    assert code == 0
    assert shown == b""


def test_no_progress_when_piped(big: str) -> None:
    for args in (["export"], ["list", "--json"], ["list"]):
        done = process([sys.executable, "-m", "itemjournal"], "-L", big, *args)
        assert done.returncode == 0
        assert done.stderr == ""
        assert "\x1b" not in done.stdout
    listed = process([sys.executable, "-m", "itemjournal"], "-L", big, "list")
    assert listed.stdout.splitlines()[-1] == "1200 records"


# ----------------------------------------------------------------- the edges, in process


def test_progress_meter_in_process(loc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a terminal on stderr and more records than the threshold, scans drive a bar;
    the data on stdout is the same as without one, written in batches."""
    import io

    from rich.console import Console

    from itemjournal._operator.cli import progress as _cli

    screen = io.StringIO()
    monkeypatch.setattr(
        _cli, "_err_console", lambda: Console(file=screen, force_terminal=True, width=80)
    )
    monkeypatch.setattr(_cli, "PROGRESS_THRESHOLD", 3)
    monkeypatch.setattr(_cli, "_FLUSH_EVERY", 2)
    plain = invoke("-L", loc, "list", "--json")
    assert len(json_lines(plain.stdout)) == 6
    assert invoke("-L", loc, "export").exit_code == 0
    assert "exporting" in screen.getvalue()
    filtered = invoke("-L", loc, "list", "--json", "--job", "charge")
    assert len(json_lines(filtered.stdout)) == 4
    limited = invoke("-L", loc, "list", "--limit", "5")
    assert limited.stdout.splitlines()[-1] == "5 records (--limit 5 reached; more match)"
    assert invoke("-L", loc, "list", "--limit", "2").exit_code == 0  # below the threshold
    bulk = invoke("-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "n")
    assert bulk.exit_code == 0
    monkeypatch.setattr(_cli, "PROGRESS_THRESHOLD", 100)  # more than the journal holds
    assert invoke("-L", loc, "list", "--json").stdout == plain.stdout


def test_terminal_output_is_coloured_and_still_escaped(loc: str) -> None:
    run_async(_review_with, loc, "boom \x1b[2J")
    result = invoke("-L", loc, "list", env={"FORCE_COLOR": "1", "COLUMNS": "200"})
    assert result.exit_code == 0
    assert "\x1b[" in result.stdout  # rich's own styling
    assert "\x1b[2J" not in result.stdout
    assert "\\x1b[2J" in result.stdout


def test_a_postgres_location_is_passed_through_and_shown_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A postgresql:// or postgres:// URL reaches ``Journal.open`` exactly as given; no
    output ever shows its password. Without the PostgreSQL store (or its extra), the
    journal's refusal names the extra; with it, a closed port is ``STORAGE_FAILED``."""
    import importlib
    import importlib.util

    try:  # imported here, outside any event loop, when it is there at all
        store = importlib.util.find_spec("itemjournal._stores.postgres.store") is not None
        if store:
            importlib.import_module("itemjournal._stores.postgres.store")
    except ImportError:
        store = False
    real_open = Journal.open.__func__  # type: ignore[attr-defined]
    given: list[str] = []

    async def open_quickly(cls: type[Journal], location: str, **options: Any) -> Journal:
        given.append(location)
        journal: Journal = await real_open(cls, location, lock_timeout=2.0, **options)
        return journal

    monkeypatch.setattr(Journal, "open", classmethod(open_quickly))
    for url in (
        "postgresql://app:s3cret-pw@127.0.0.1:1/test",
        "postgres://app:s3cret-pw@127.0.0.1:1/test?sslmode=disable",
    ):
        result = invoke("-L", url, "counts")
        assert given[-1] == url
        assert "s3cret-pw" not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        last = result.stderr.splitlines()[-1]
        if store:
            assert result.exit_code == 1, result.stderr
            assert last.startswith("error: STORAGE_FAILED: "), last
            assert "app:***@127.0.0.1:1" in last
        else:
            assert result.exit_code == 2, result.stderr
            assert last.startswith("error: INVALID_ARGUMENT: "), last
            assert "itemjournal[postgres]" in last
    for bad in ("postgresql:test", "postgres:/db"):
        line = one_error(invoke("-L", bad, "list"), "ABSOLUTE_ROOT_REQUIRED")
        assert "postgresql://user@host/database" in line


def test_an_oversized_key_or_receipt_file(loc: str, tmp_path: Path) -> None:
    big_key = tmp_path / "big.key"
    big_key.write_bytes(b"k" * 5000)
    one_error(invoke("-L", loc, "--input-key-file", str(big_key), "list"), "INVALID_KEY_FILE")
    from itemjournal._operator.cli import receipts as _cli

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(_cli, "_MAX_RECEIPT_FILE_BYTES", 10)
        path = _lines(tmp_path, "shop billing charge order-3 ch_3\n")
        args = ["--status", "needs_review", "--receipt-from", str(path), "--note", "n"]
        line = one_error(invoke("-L", loc, "resolve", *args), "INVALID_RECEIPT_FILE")
        assert "too large" in line


def test_main_without_standalone_mode_returns_the_exit_code(
    loc: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["-L", loc, "counts", "--json"], standalone_mode=False) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 6
    assert cli.main(["-L", loc, "show", "a", "b", "c", "d"], standalone_mode=False) == 2
    assert cli.main(["-L", loc, "list", "--status", "x"], standalone_mode=False) == 2


def test_main_is_the_console_script(
    loc: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from itemjournal._operator.cli import app as _cli

    monkeypatch.setattr(sys, "argv", ["itemjournal", "-L", loc, "verify"])
    with pytest.raises(SystemExit) as exit_info:
        _cli.main()
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"ok: no problems in {loc}\n"


def test_python_dash_m_runs_the_command(
    loc: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runpy

    monkeypatch.setattr(sys, "argv", ["itemjournal", "-L", loc, "counts", "--json"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("itemjournal", run_name="__main__")
    assert exit_info.value.code == 0
    assert json.loads(capsys.readouterr().out)["total"] == 6


@pytest.mark.parametrize(
    ("raised", "code", "exit_code"),
    [
        (KeyboardInterrupt(), "INTERRUPTED", 130),
        (__import__("click").ClickException("odd"), "USAGE", 1),
    ],
)
def test_interrupts_and_other_click_errors_are_one_line(
    loc: str, monkeypatch: pytest.MonkeyPatch, raised: BaseException, code: str, exit_code: int
) -> None:
    from itemjournal._operator.cli import records as _cli

    def fail(*args: object) -> None:
        raise raised

    monkeypatch.setattr(_cli, "_run", fail)
    result = invoke("-L", loc, "counts")
    assert result.exit_code == exit_code
    # After Ctrl-C, a blank line first closes the terminal's "^C" echo.
    assert result.stderr.lstrip("\n").startswith(f"error: {code}: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_closed_stdout_in_process(loc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from itemjournal._operator.cli import records as _cli

    def closed(lines: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(_cli, "_write", closed)
    result = invoke("-L", loc, "counts", "--json")
    assert result.exit_code == 1
    assert result.stderr == ""


def test_counts_names_invalid_records(loc: str) -> None:
    plant_invalid(loc, ORDER_2)
    human = invoke("-L", loc, "counts")
    assert human.exit_code == 0
    assert human.stdout.splitlines()[6].split() == ["invalid", "1"]


def test_bulk_receipt_for_an_invalid_record(loc: str, tmp_path: Path) -> None:
    plant_invalid(loc, ORDER_2)
    path = _lines(tmp_path, "shop billing charge order-2 ch_2\nshop billing charge order-3 c3\n")
    args = ["--status", "needs_review", "--receipt-from", str(path), "--note", "n", "--yes"]
    result = invoke("-L", loc, "resolve", "--json", *args)
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [f["error"]["code"] for f in report["failed"]] == ["RECORD_INVALID"]
    assert [v["identity"][3] for v in report["resolved"]] == ["order-3"]
    assert [p["code"] for p in report["problems"]] == ["RECORD_INVALID"]


def test_bulk_resolve_when_a_record_changes_under_it(
    loc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another operator resolved one record between the plan and the decision."""
    real = Journal.resolve

    async def racing(self: Journal, identity: Any, **options: Any) -> Any:
        if Identity(*identity) == ORDER_3:
            await real(self, identity, retry=True, note="someone else")
        return await real(self, identity, **options)

    monkeypatch.setattr(Journal, "resolve", racing)
    result = invoke(
        "-L", loc, "resolve", "--status", "needs_review", "--retry", "--note", "n", "--yes"
    )
    assert result.exit_code == 1
    assert "not resolved shop/billing/charge/order-3: NOT_IN_REVIEW" in result.stdout
    assert result.stdout.splitlines()[-1] == "resolved 1 of 2 records; 1 not resolved"
    assert inspect(loc, ORDER_3).history[-1].note == "someone else"


def test_serve_when_the_viewer_extra_is_missing(loc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "itemjournal._operator.viewer.app", raising=False)
    monkeypatch.delattr(itemjournal, "_viewer", raising=False)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    line = one_error(invoke("-L", loc, "serve"), "VIEWER_UNAVAILABLE", 1)
    assert "pip install 'itemjournal[viewer]'" in line


# ------------------------------------------------------------------------- log records


def test_a_real_process_prints_its_own_lines_and_no_log_records(kind: str, tmp_path: Path) -> None:
    """The journal logs a record going to ``needs_review`` at WARNING; without logging
    set up, Python would print it to stderr after the command's own line. The command
    says what it did once."""
    location = location_of(kind, tmp_path)
    seed(location)
    done = process(
        [sys.executable, "-m", "itemjournal"], "-L", location, "review", *ORDER_4, "--reason", "r"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("marked shop/billing/charge/order-4 needs_review")
    assert done.stderr == ""
    swept = process([sys.executable, "-m", "itemjournal"], "-L", location, "sweep")
    assert swept.returncode == 0, swept.stderr
    assert swept.stderr == ""


def test_verbose_shows_the_journal_s_log_records_on_stderr(kind: str, tmp_path: Path) -> None:
    location = location_of(kind, tmp_path)
    seed(location)
    command = [sys.executable, "-m", "itemjournal"]
    done = process(command, "-v", "-L", location, "review", *ORDER_4, "--reason", "stuck")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("marked shop/billing/charge/order-4 needs_review")
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "WARNING" in lines[0]
    assert "shop/billing/charge/order-4" in lines[0]
    assert SECRET not in done.stderr
    # -vv adds the routine DEBUG records, and still never an input.
    debug = process(
        command, "-vv", "-L", location, "resolve", *ORDER_4, "--receipt", "ch_4", "--note", "n"
    )
    assert debug.returncode == 0, debug.stderr
    assert "INFO itemjournal: resolved shop/billing/charge/order-4" in debug.stderr
    assert SECRET not in debug.stderr
