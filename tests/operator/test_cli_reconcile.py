"""``itemjournal reconcile`` end to end, on the file and SQLite stores: a check module written
into the test's directory, ``--dry-run`` and ``--yes``, the ``--json`` document, exit codes
(1 when a check failed, 2 for bad input), bad ``--check`` specs, the progress bar."""

from __future__ import annotations

import io
import itertools
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner, Result

from itemjournal import Claim, Identity, Journal, RecordView, definition_digest
from itemjournal._model.identity import identity_digest
from itemjournal._operator.cli.app import cli

DEFINITION = definition_digest("cli-reconcile-tests-v1")
CLEAN_ENV: dict[str, str | None] = {
    "ITEMJOURNAL_LOCATION": None,
    "ITEMJOURNAL_INPUT_KEY_FILE": None,
    "ITEMJOURNAL_VIEWER_TOKEN": None,
}


def order(n: int, scope: str = "shop") -> Identity:
    return Identity(scope, "billing", "charge", f"order-{n}")


DONE = order(1)  # succeeded: never checked
RUNNING = order(7)  # started: never checked
IN_REVIEW = [order(n) for n in (2, 3, 4, 5, 6)]
ELSEWHERE = order(8, scope="outlet")  # needs_review, in another scope

CHECKS = """
import os

from itemjournal import DidNotHappen, Happened, Unknown

LEDGER = {"order-2": "ch_2", "order-8": "ch_8"}


async def check(view):
    item = view.identity.item
    if item in LEDGER:
        return Happened(LEDGER[item], note="in the provider's ledger")
    if item == "order-4":
        return Unknown("the provider is still settling")
    if item == "order-5":
        raise RuntimeError("provider down")
    return DidNotHappen("no charge for key " + view.key[:12])


async def calm(view):
    return Unknown("asked nothing")


def plain(view):
    return DidNotHappen("a plain function's answer")


class Checks:
    @staticmethod
    async def nested(view):
        return Unknown("a static method")


async def meddle(view):
    # Someone else settles the record while the check asks the provider: it is left.
    from itemjournal import Journal

    async with await Journal.open(os.environ["RECON_LOCATION"]) as journal:
        await journal.resolve(view.identity, retry=True, note="an operator was faster")
    return Happened("ch_late")


NOT_A_FUNCTION = 42
"""

_names = itertools.count()


@pytest.fixture(params=["file", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _seed(location: str) -> None:
    async with await Journal.open(location) as journal:
        for identity in (DONE, RUNNING, *IN_REVIEW, ELSEWHERE):
            claim = await journal.begin(identity, {"amount": 1250}, DEFINITION)
            assert isinstance(claim, Claim)
            if identity == DONE:
                await journal.complete(claim, "ch_1")
            elif identity != RUNNING:
                await journal.mark_review(identity, "provider timed out")


@pytest.fixture
def loc(kind: str, tmp_path: Path) -> str:
    location = f"sqlite://{tmp_path}/journal.db" if kind == "sqlite" else str(tmp_path / "j")
    anyio.run(_seed, location)
    return location


@pytest.fixture
def checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A check module of a fresh name in a directory of its own, importable; the module
    path is restored afterwards (the command puts the current directory on it)."""
    name = f"recon_checks_{next(_names)}"
    where = tmp_path / "checks"
    where.mkdir()
    (where / f"{name}.py").write_text(textwrap.dedent(CHECKS), encoding="utf-8")
    monkeypatch.setattr(sys, "path", [str(where), *sys.path])
    return name


async def _views(location: str) -> dict[Identity, RecordView]:
    found: dict[Identity, RecordView] = {}
    async with await Journal.open(location) as journal:
        async for item in journal.records():
            if isinstance(item, RecordView):
                found[item.identity] = item
    return found


def views(location: str) -> dict[Identity, RecordView]:
    found: dict[Identity, RecordView] = anyio.run(_views, location)
    return found


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(
        cli, list(args), env={**CLEAN_ENV, **(env or {})}, catch_exceptions=False
    )


def one_error(result: Result, code: str, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {code}: "), lines[0]
    return lines[0]


def rows(stdout: str) -> dict[str, str]:
    """The per-record table: item -> its line."""
    found = {}
    for line in stdout.splitlines():
        for word in line.split():
            if word.startswith("order-"):
                found[word] = line
    return found


# ------------------------------------------------------------------------------ dry run


def test_dry_run_calls_the_checks_and_changes_nothing(loc: str, checks: str) -> None:
    before = views(loc)
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--dry-run")
    assert result.exit_code == 1, result.stderr  # order-5's check failed
    assert result.stderr == ""
    assert views(loc) == before
    table = rows(result.stdout)
    assert set(table) == {"order-2", "order-3", "order-4", "order-5", "order-6", "order-8"}
    assert table["order-2"].split()[0] == "happened"
    assert "would resolve succeeded, receipt ch_2: in the provider's ledger" in table["order-2"]
    assert table["order-3"].split()[0] == "did_not_happen"
    assert "would resolve released: no charge for key" in table["order-3"]
    assert "left in review: the provider is still settling" in table["order-4"]
    assert "check failed: RuntimeError: provider down" in table["order-5"]
    lines = result.stdout.splitlines()
    assert lines[-1] == (
        "would resolve 4 of 6 checked records; nothing changed: run again with --yes to apply"
    )
    summary = {line.split()[0]: line.split()[-1] for line in lines if len(line.split()) == 2}
    assert summary == {
        "OUTCOME": "RECORDS",
        "happened": "2",
        "did_not_happen": "2",
        "unknown": "1",
        "left": "0",
        "failed": "1",
        "problems": "0",
        "checked": "6",
    }


# ---------------------------------------------------------------------------------- yes


def test_yes_resolves_as_the_checks_say(loc: str, checks: str) -> None:
    before = views(loc)
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--yes")
    assert result.exit_code == 1, result.stderr
    after = views(loc)
    assert after[DONE] == before[DONE] and after[RUNNING] == before[RUNNING]
    assert (after[order(2)].status, after[order(2)].receipt) == ("succeeded", "ch_2")
    assert after[order(3)].status == after[order(6)].status == "released"
    assert after[order(4)] == before[order(4)]  # unknown: left alone
    assert after[order(5)] == before[order(5)]  # the check failed: left alone
    note = after[order(2)].history[-1].note
    assert note == (
        f"reconciled by {checks}.check: the provider reports it happened: in the provider's ledger"
    )
    released = after[order(3)].history[-1].note
    assert released == (
        f"reconciled by {checks}.check: the provider reports it did not happen: "
        f"no charge for key {identity_digest(order(3))[:12]}"
    )
    assert "resolved succeeded, receipt ch_2" in rows(result.stdout)["order-2"]
    assert result.stdout.splitlines()[-1] == "resolved 4 of 6 checked records; 1 check(s) failed"
    # Again: only what is still in review is checked; a check that never fails exits 0.
    calm = invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--yes")
    assert calm.exit_code == 0, calm.stderr
    assert set(rows(calm.stdout)) == {"order-4", "order-5"}
    assert calm.stdout.splitlines()[-1] == "resolved 0 of 2 checked records"
    assert views(loc) == after


def test_filters_and_limit(loc: str, checks: str) -> None:
    result = invoke(
        "-L", loc, "reconcile", "--check", f"{checks}:check", "--yes", "--scope", "outlet"
    )
    assert result.exit_code == 0, result.stderr
    assert set(rows(result.stdout)) == {"order-8"}
    assert views(loc)[ELSEWHERE].receipt == "ch_8"
    assert views(loc)[order(2)].status == "needs_review"
    for args in (["--job", "refund"], ["--program", "mail"]):
        none = invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--yes", *args)
        assert none.exit_code == 0
        assert none.stdout.splitlines()[-1] == "resolved 0 of 0 checked records"
    limited = invoke("-L", loc, "reconcile", "--check", f"{checks}:plain", "--yes", "--limit", "1")
    assert limited.exit_code == 0, limited.stderr
    assert limited.stdout.splitlines()[-1] == "resolved 5 of 5 checked records"
    assert views(loc)[order(5)].history[-1].note == (
        f"reconciled by {checks}.plain: the provider reports it did not happen: "
        "a plain function's answer"
    )


def test_a_record_settled_by_someone_else_meanwhile_is_left(loc: str, checks: str) -> None:
    result = invoke(
        "-L",
        loc,
        "reconcile",
        "--check",
        f"{checks}:meddle",
        "--yes",
        "--scope",
        "outlet",
        env={"RECON_LOCATION": loc},
    )
    assert result.exit_code == 0, result.stderr
    assert "changed meanwhile, left as it is: now released" in rows(result.stdout)["order-8"]
    after = views(loc)[ELSEWHERE]
    assert after.history[-1].note == "an operator was faster"
    assert after.receipt is None


# --------------------------------------------------------------------------------- json


def test_json_is_one_stable_document(loc: str, checks: str) -> None:
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--yes", "--json")
    assert result.exit_code == 1
    assert result.stderr == ""
    document = json.loads(result.stdout)
    assert list(document) == ["dry_run", "check", "counts", "records", "problems"]
    assert document["dry_run"] is False
    assert document["check"] == f"{checks}:check"
    assert document["counts"] == {
        "checked": 6,
        "happened": 2,
        "did_not_happen": 2,
        "unknown": 1,
        "left": 0,
        "failed": 1,
        "problems": 0,
    }
    records = document["records"]
    assert [entry["key"] for entry in records] == sorted(entry["key"] for entry in records)
    by_item = {entry["identity"][3]: entry for entry in records}
    for entry in records:
        assert list(entry) == ["key", "identity", "outcome", "verdict", "error", "view"]
        assert entry["view"]["key"] == entry["key"]
    assert by_item["order-2"]["outcome"] == "happened"
    assert by_item["order-2"]["verdict"] == {
        "kind": "happened",
        "receipt": "ch_2",
        "result_size": None,
        "note": "in the provider's ledger",
    }
    assert by_item["order-2"]["view"]["status"] == "succeeded"
    assert by_item["order-3"]["verdict"]["kind"] == "did_not_happen"
    assert by_item["order-3"]["view"]["status"] == "released"
    assert by_item["order-4"]["verdict"] == {
        "kind": "unknown",
        "receipt": None,
        "result_size": None,
        "note": "the provider is still settling",
    }
    assert by_item["order-4"]["view"]["status"] == "needs_review"
    failed = by_item["order-5"]
    assert (failed["outcome"], failed["verdict"]) == ("failed", None)
    assert failed["error"] == "RuntimeError: provider down"
    assert document["problems"] == []
    dry = json.loads(
        invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--dry-run", "--json").stdout
    )
    assert dry["dry_run"] is True
    assert dry["counts"]["checked"] == 2  # order-4 and order-5 are all that is left


def test_an_unreadable_record_is_a_problem_and_exits_1(loc: str, checks: str) -> None:
    digest = identity_digest(order(3))
    if loc.startswith("sqlite://"):
        database = sqlite3.connect(loc[len("sqlite://") :])
        with database:
            database.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                (b"{broken", digest),
            )
        database.close()
    else:
        Path(loc, digest[:2], f"{digest}.json").write_bytes(b"{broken")
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--dry-run")
    assert result.exit_code == 1
    assert result.stderr.startswith("problem: RECORD_INVALID: ")
    assert result.stdout.splitlines()[-1].startswith("would resolve 0 of 5 checked records")
    document = json.loads(
        invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--yes", "--json").stdout
    )
    assert [problem["code"] for problem in document["problems"]] == ["RECORD_INVALID"]
    assert document["counts"]["problems"] == 1


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("modes", [[], ["--dry-run", "--yes"]])
def test_exactly_one_of_dry_run_and_yes(loc: str, checks: str, modes: list[str]) -> None:
    before = views(loc)
    line = one_error(invoke("-L", loc, "reconcile", "--check", f"{checks}:check", *modes), "USAGE")
    assert "--dry-run" in line and "--yes" in line
    assert views(loc) == before


def test_check_is_required_and_limit_positive(loc: str, checks: str) -> None:
    one_error(invoke("-L", loc, "reconcile", "--yes"), "USAGE")
    one_error(
        invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--yes", "--limit", "0"),
        "USAGE",
    )
    one_error(
        invoke("-L", loc, "reconcile", "--check", f"{checks}:check", "--yes", "--scope", "a b"),
        "INVALID_LABEL",
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("{m}", "package.module:function"),
        ("{m}:", "package.module:function"),
        (":check", "package.module:function"),
        ("{m}:check-it", "package.module:function"),
        ("{m}.py:check", "no module named"),
        ("no_such_module_here:check", "no module named no_such_module_here"),
        ("{m}:missing", "has no attribute missing"),
        ("{m}:Checks.missing", "has no attribute Checks.missing"),
        ("{m}:NOT_A_FUNCTION", "is a int, not a function"),
        ("{m}:Checks", "is a type, not a function"),
        ("{m}_broken:check", "ZeroDivisionError: division by zero"),
        ("{m}_needs:check", "ModuleNotFoundError: No module named 'a_dependency_not_here'"),
    ],
)
def test_a_bad_check_spec_is_one_error_and_changes_nothing(
    loc: str, checks: str, tmp_path: Path, spec: str, words: str
) -> None:
    where = tmp_path / "checks"
    (where / f"{checks}_broken.py").write_text("x = 1 / 0\n", encoding="utf-8")
    (where / f"{checks}_needs.py").write_text("import a_dependency_not_here\n", encoding="utf-8")
    before = views(loc)
    line = one_error(
        invoke("-L", loc, "reconcile", "--check", spec.format(m=checks), "--yes"), "INVALID_CHECK"
    )
    assert words in line, line
    assert views(loc) == before


def test_a_static_method_may_be_the_check(loc: str, checks: str) -> None:
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:Checks.nested", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "left in review: a static method" in rows(result.stdout)["order-2"]


# ---------------------------------------------------------- where the module is found


def test_the_check_module_is_found_in_the_current_directory(
    loc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"recon_here_{next(_names)}"
    here = tmp_path / "project"
    here.mkdir()
    (here / f"{name}.py").write_text(textwrap.dedent(CHECKS), encoding="utf-8")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".")])
    monkeypatch.chdir(here)
    result = invoke("-L", loc, "reconcile", "--check", f"{name}:calm", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert str(here) == sys.path[0]


def test_a_real_process_with_pythonpath(kind: str, tmp_path: Path) -> None:
    location = f"sqlite://{tmp_path}/journal.db" if kind == "sqlite" else str(tmp_path / "j")
    anyio.run(_seed, location)
    where = tmp_path / "elsewhere"
    where.mkdir()
    (where / "provider_checks.py").write_text(textwrap.dedent(CHECKS), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(PYTHONPATH=str(where), ITEMJOURNAL_LOCATION=location)
    command = [sys.executable, "-m", "itemjournal", "reconcile"]
    done = subprocess.run(
        [*command, "--check", "provider_checks:check", "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout)["counts"]["happened"] == 2
    missing = subprocess.run(
        [*command, "--check", "provider_checks:check", "--yes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in env.items() if k != "PYTHONPATH"},
        cwd=tmp_path,
        check=False,
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: INVALID_CHECK: cannot import provider_checks")
    assert missing.stderr.count("\n") == 1


# ------------------------------------------------------------------------------ progress


def test_a_progress_bar_on_a_terminal_but_not_for_json(
    loc: str, checks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from itemjournal._operator.cli import progress as _cli

    screen = io.StringIO()
    monkeypatch.setattr(
        _cli, "_err_console", lambda: Console(file=screen, force_terminal=True, width=80)
    )
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--dry-run")
    assert result.exit_code == 0
    assert "reconciling" in screen.getvalue()
    assert "\x1b" not in result.stdout  # the bar is never on stdout
    screen.truncate(0)
    screen.seek(0)
    data = invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--dry-run", "--json")
    assert data.exit_code == 0
    assert screen.getvalue() == ""
    assert json.loads(data.stdout)["counts"]["checked"] == 6
    filtered = invoke(
        "-L", loc, "reconcile", "--check", f"{checks}:calm", "--dry-run", "--scope", "outlet"
    )
    assert filtered.exit_code == 0
    assert "reconciling" in screen.getvalue()


def test_no_progress_bar_when_not_on_a_terminal(loc: str, checks: str) -> None:
    result = invoke("-L", loc, "reconcile", "--check", f"{checks}:calm", "--dry-run")
    assert result.exit_code == 0
    assert result.stderr == ""


# ---------------------------------------------------------------------------- check args

ARG_CHECKS = """
from itemjournal import Unknown


async def with_args(view, *, ledger, mode="slow"):
    return Unknown(f"ledger={ledger} mode={mode}")


def plain_with_args(view, ledger):
    return Unknown(f"plain ledger={ledger}")
"""


@pytest.fixture
def arg_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"recon_arg_checks_{next(_names)}"
    where = tmp_path / "arg_checks"
    where.mkdir()
    (where / f"{name}.py").write_text(textwrap.dedent(ARG_CHECKS), encoding="utf-8")
    monkeypatch.setattr(sys, "path", [str(where), *sys.path])
    return name


def test_check_args_are_given_to_the_check_as_keyword_arguments(loc: str, arg_checks: str) -> None:
    result = invoke(
        "-L", loc, "reconcile", "--check", f"{arg_checks}:with_args", "--dry-run", "--json",
        "--check-arg", "ledger=/var/lib/shop/ledger=v2.jsonl", "--check-arg", "mode=",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    notes = {entry["verdict"]["note"] for entry in json.loads(result.stdout)["records"]}
    assert notes == {"ledger=/var/lib/shop/ledger=v2.jsonl mode="}
    plain = invoke(
        "-L", loc, "reconcile", "--check", f"{arg_checks}:plain_with_args", "--dry-run",
        "--json", "--check-arg", "ledger=x",
    )  # fmt: skip
    assert plain.exit_code == 0, plain.stderr
    notes = {entry["verdict"]["note"] for entry in json.loads(plain.stdout)["records"]}
    assert notes == {"plain ledger=x"}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--check-arg", "ledger"], "NAME=VALUE"),
        (["--check-arg", "=x"], "NAME=VALUE"),
        (["--check-arg", "1ledger=x"], "NAME=VALUE"),
        (["--check-arg", "ledger=a", "--check-arg", "ledger=b"], "more than once"),
        (["--check-arg", "ledger=a", "--check-arg", "colour=red"], "colour"),
        ([], "ledger"),  # a required argument not given
    ],
)
def test_a_bad_check_arg_is_refused_before_any_check(
    loc: str, arg_checks: str, args: list[str], said: str
) -> None:
    before = views(loc)
    result = invoke("-L", loc, "reconcile", "--check", f"{arg_checks}:with_args", "--yes", *args)
    line = one_error(result, "INVALID_CHECK_ARG")
    assert said in line
    assert views(loc) == before
