"""What a refusal tells a person: every ``ConflictError`` (and ``UnresolvedClaim``) names
the identity's four labels and the record's key, says what the record says, and ends with
a next step that works as printed: each ``itemjournal`` command it gives is run here, in a
shell, against the journal's location; each call is evaluated on the journal. A refusal
raised into the caller's code carries a short traceback (its frames are counted).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

import itemjournal
from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    Journal,
    JournalError,
    RecordView,
    Reuse,
    UnresolvedClaim,
    definition_digest,
)
from itemjournal import sync as blocking
from itemjournal._model.refusals import Where, explain
from itemjournal.testing import MemoryStore

pytestmark = pytest.mark.anyio

ITEM = Identity("shop", "billing", "charge", "order-3")
INPUTS = {"amount_cents": 1250}
BIN = Path(sys.executable).parent
PACKAGE = Path(itemjournal.__file__).resolve().parent
# What only a person decides, written <like-this> in a command: filled in before it runs.
FILLED = {"<receipt>": "ch_3", "<note>": "checked", "<why>": "looked", "<seconds>": "1"}


# --------------------------------------------------------------------------- helpers


def snippets(message: str) -> list[str]:
    """The calls and commands of a message, as a person copies them (between backticks)."""
    return re.findall(r"`([^`]+)`", message)


def commands(message: str) -> list[str]:
    return [text for text in snippets(message) if text.startswith("itemjournal ")]


def calls(message: str) -> list[str]:
    return [text for text in snippets(message) if text.startswith(("journal.", "await journal."))]


def fill(command: str, **more: str) -> str:
    for placeholder, value in {**FILLED, **more}.items():
        command = command.replace(placeholder, shlex.quote(value))
    return command


def run(command: str) -> subprocess.CompletedProcess[str]:
    """The command as a person runs it: in a shell, with the installed ``itemjournal``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ITEMJOURNAL_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "200"
    return subprocess.run(
        ["/bin/sh", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def runs(command: str, **more: str) -> str:
    done = run(fill(command, **more))
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def names_the_record(error: JournalError, view: RecordView) -> str:
    """The message, checked for the labels, the key and a status; returned for more."""
    message = str(error)
    assert message.startswith(f"{error.code}: ")
    assert "/".join(view.identity) in message
    assert view.key and view.key in message
    assert "\n" not in message  # one line, as the command prints every error
    return message


async def refusal(code: str, call: Any) -> ConflictError:
    with pytest.raises(ConflictError) as caught:
        await call
    assert caught.value.code == code
    assert caught.value.view is not None
    return caught.value


@pytest.fixture
async def opened(location: str) -> Any:
    journal = await Journal.open(location)
    yield journal
    await journal.aclose()


def owner_process(location: str, *, identity: Identity = ITEM) -> subprocess.Popen[str]:
    """Another process that claims ``identity`` and holds it until it is killed."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from itemjournal.sync import Journal
        journal = Journal.open({location!r})
        journal.begin({tuple(identity)!r}, {INPUTS!r}, "billing-v3")
        print("claimed", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "claimed"
    return child


def stop(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


@pytest.fixture
def other_owner(location: str) -> Iterator[subprocess.Popen[str]]:
    child = owner_process(location)
    yield child
    stop(child)


# ------------------------------------------------------------------ each code, by command


async def test_review_required_names_the_record_and_its_commands_run(opened: Journal) -> None:
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    await opened.mark_review(ITEM, "timeout talking to the provider")
    error = await refusal("REVIEW_REQUIRED", opened.begin(ITEM, INPUTS, "billing-v3"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert message.startswith("REVIEW_REQUIRED: attempt 1 is needs_review")
    assert "needs review (attempt 1) since " in message
    assert error.view.updated_at is not None and error.view.updated_at in message
    assert "timeout talking to the provider" in message
    show, happened, did_not = commands(message)
    assert show.startswith("itemjournal show shop billing charge order-3 --location ")
    shown = runs(show)
    assert error.view.key in shown and "needs_review" in shown
    # As printed, with <receipt> and <note> still in it, it does not run (here, where no
    # file is named so): nothing is decided by a command pasted unread.
    assert run(happened).returncode != 0
    assert (await opened.inspect(ITEM)).status == "needs_review"
    assert "--retry" in did_not
    assert "resolved shop/billing/charge/order-3: succeeded, receipt ch_3" in runs(happened)
    assert (await opened.inspect(ITEM)).receipt == "ch_3"


async def test_the_resolve_for_a_retry_runs_as_printed(opened: Journal) -> None:
    await opened.begin(ITEM, INPUTS, "billing-v3")
    await opened.mark_review(ITEM, "unsure")
    error = await refusal("REVIEW_REQUIRED", opened.begin(ITEM, INPUTS, "billing-v3"))
    _, _, did_not = commands(str(error))
    runs(did_not)
    assert (await opened.inspect(ITEM)).status == "released"
    assert isinstance(await opened.begin(ITEM, INPUTS, "billing-v3"), Claim)


async def test_review_required_after_a_dead_owner(opened: Journal, location: str) -> None:
    stop(owner_process(location))
    with anyio.fail_after(30):
        while (await opened.inspect(ITEM)).owner_alive is not False:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    error = await refusal("REVIEW_REQUIRED", opened.begin(ITEM, INPUTS, "billing-v3"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert "started by an owner that is gone" in message
    assert error.view.review_reason is not None and error.view.review_reason in message
    show = commands(message)[0]
    assert "needs_review" in runs(show)


async def test_in_progress_elsewhere_says_wait_and_shows(
    opened: Journal, other_owner: subprocess.Popen[str]
) -> None:
    error = await refusal("IN_PROGRESS", opened.begin(ITEM, INPUTS, "billing-v3"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert f"owned by pid {other_owner.pid} on " in message
    assert "this very process" not in message
    assert "which is alive" in message
    assert "wait=" in message
    show = commands(message)[-1]
    assert "started" in runs(show)


async def test_in_progress_held_by_this_process_says_how_to_send_it_to_review(
    opened: Journal,
) -> None:
    # A notebook cell that failed between begin and complete: its claim is this very
    # process's, which lives on, so IN_PROGRESS would never end by itself.
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    error = await refusal("IN_PROGRESS", opened.begin(ITEM, INPUTS, "billing-v3"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert f"owned by pid {os.getpid()} on " in message
    assert "this very process" in message
    assert "will not end on its own" in message
    [review] = calls(message)
    assert review.startswith("await journal.mark_review(")
    view = await eval(review.removeprefix("await "), {"journal": opened})
    assert view.status == "needs_review"
    assert view.review_reason == "abandoned by its caller"
    assert "needs_review" in runs(commands(message)[-1])  # the show command runs


async def test_input_changed(opened: Journal) -> None:
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    await opened.complete(claim, "ch_3")
    error = await refusal("INPUT_CHANGED", opened.begin(ITEM, {"amount_cents": 990}, "billing-v3"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert message.startswith("INPUT_CHANGED: succeeded record was made from other inputs")
    assert "succeeded (attempt 1) since " in message
    assert "ch_3" not in message  # a receipt is not for the logs a refusal ends up in
    assert "990" not in message and "1250" not in message  # nor are the inputs
    assert "itemjournal.label(text)" in message
    [show] = commands(message)
    assert "ch_3" in runs(show)


async def test_definition_changed_names_the_compatible_call(opened: Journal) -> None:
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    await opened.complete(claim, "ch_3")
    error = await refusal("DEFINITION_CHANGED", opened.begin(ITEM, INPUTS, "billing-v4"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    [compatible] = [text for text in snippets(message) if text.startswith("compatible=")]
    assert definition_digest("billing-v3") in compatible
    kwargs = eval(f"dict({compatible})")
    reused = await opened.begin(ITEM, INPUTS, "billing-v4", **kwargs)
    assert isinstance(reused, Reuse)
    assert reused.receipt == "ch_3"
    [show] = commands(message)
    runs(show)


async def test_definition_changed_on_a_record_in_review_says_settle_first(
    opened: Journal,
) -> None:
    await opened.begin(ITEM, INPUTS, "billing-v3")
    await opened.mark_review(ITEM, "unsure")
    error = await refusal("DEFINITION_CHANGED", opened.begin(ITEM, INPUTS, "billing-v4"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert "compatible=" not in message
    assert "must be settled first" in message
    show, *_ = commands(message)
    runs(show)


async def test_not_in_review(opened: Journal) -> None:
    await opened.begin(ITEM, INPUTS, "billing-v3")
    error = await refusal("NOT_IN_REVIEW", opened.resolve(ITEM, retry=True, note="n"))
    assert error.view is not None
    message = names_the_record(error, error.view)
    assert message.startswith("NOT_IN_REVIEW: the record is started, not needs_review")
    assert "this very process" in message  # this test's own claim
    runs(commands(message)[-1])
    # Absent: the labels are checked, and the job's records listed.
    other = Identity("shop", "billing", "charge", "order-77")
    error = await refusal("NOT_IN_REVIEW", opened.resolve(other, retry=True, note="n"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert "does not exist" in message
    [listing] = commands(message)
    assert listing.startswith("itemjournal list --scope shop --program billing --job charge")
    assert "order-3" in runs(listing)


async def test_not_in_review_of_a_succeeded_record(opened: Journal) -> None:
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    await opened.complete(claim, "ch_3")
    error = await refusal("NOT_IN_REVIEW", opened.resolve(ITEM, retry=True, note="n"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert "nothing to do" in message
    runs(commands(message)[0])


async def test_not_started(opened: Journal) -> None:
    claim = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(claim, Claim)
    await opened.mark_review(ITEM, "unsure")
    error = await refusal("NOT_STARTED", opened.complete(claim, "ch_3"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert message.startswith("NOT_STARTED: the record is needs_review, not started")
    show, happened, _ = commands(message)
    runs(show)
    runs(happened)
    other = Identity("shop", "billing", "charge", "order-9")
    error = await refusal("NOT_STARTED", opened.mark_review(other, "why"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert "does not exist" in message
    runs(commands(message)[0])


async def test_claim_mismatch(opened: Journal) -> None:
    first = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(first, Claim)
    await opened.mark_review(ITEM, "unsure")
    await opened.resolve(ITEM, retry=True, note="not charged")
    second = await opened.begin(ITEM, INPUTS, "billing-v3")
    assert isinstance(second, Claim)
    error = await refusal("CLAIM_MISMATCH", opened.complete(first, "ch_3"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert "is started (attempt 2)" in message
    assert "do not declare this claim's outcome" in message
    assert "attempt" in runs(commands(message)[-1])


async def test_unresolved_claim(opened: Journal) -> None:
    with pytest.raises(UnresolvedClaim) as caught:
        async with opened.claim(ITEM, INPUTS, "billing-v3"):
            pass
    view = caught.value.view
    assert view is not None
    message = names_the_record(caught.value, view)
    assert message.startswith("UNRESOLVED_CLAIM: the claim on ")
    assert "block ended without complete or mark_review" in message
    show, _, did_not = commands(message)
    runs(show)
    runs(did_not)
    assert (await opened.inspect(ITEM)).status == "released"


async def test_the_commands_of_a_keyed_journal_take_its_key(location: str, tmp_path: Path) -> None:
    key = b"k" * 32
    key_file = tmp_path / "input.key"
    key_file.write_bytes(key)
    async with await Journal.open(location, input_key=key) as journal:
        await journal.begin(ITEM, INPUTS, "billing-v3")
        await journal.mark_review(ITEM, "unsure")
        error = await refusal("REVIEW_REQUIRED", journal.begin(ITEM, INPUTS, "billing-v3"))
    message = str(error)
    show = commands(message)[0]
    assert "--input-key-file <key-file>" in show
    assert "<key-file>: a file holding the journal's input key" in message
    assert "needs_review" in runs(show, **{"<key-file>": str(key_file)})


# ------------------------------------------------------------------- calls, in memory


async def test_a_journal_no_command_reaches_gives_calls_that_work() -> None:
    journal = Journal(MemoryStore())
    await journal.begin(ITEM, INPUTS, "billing-v3")
    await journal.mark_review(ITEM, "unsure")
    error = await refusal("REVIEW_REQUIRED", journal.begin(ITEM, INPUTS, "billing-v3"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert commands(message) == []
    inspect, happened, did_not = calls(message)
    assert (await eval(inspect.removeprefix("await "), {"journal": journal})).status == (
        "needs_review"
    )
    settled = await eval(fill(did_not).removeprefix("await "), {"journal": journal})
    assert settled.status == "released"
    assert happened.startswith('await journal.resolve(("shop", "billing", "charge", "order-3"), ')


def test_the_blocking_journal_gives_blocking_calls() -> None:
    journal = blocking.Journal(MemoryStore())
    journal.begin(ITEM, INPUTS, "billing-v3")
    with pytest.raises(ConflictError) as caught:
        journal.begin(ITEM, INPUTS, "billing-v3")
    review, show = calls(str(caught.value))
    assert review.startswith("journal.mark_review(")
    assert show == 'journal.inspect(("shop", "billing", "charge", "order-3"))'
    assert eval(review, {"journal": journal}).status == "needs_review"
    assert eval(show, {"journal": journal}).status == "needs_review"


async def test_input_key_mismatch_on_a_record() -> None:
    store = MemoryStore()
    keyed = Journal(store, input_key=b"k" * 32)
    await keyed.begin(ITEM, INPUTS, "billing-v3")
    error = await refusal("INPUT_KEY_MISMATCH", Journal(store).begin(ITEM, INPUTS, "billing-v3"))
    message = names_the_record(error, error.view)  # type: ignore[arg-type]
    assert "Journal.open(location, input_key=<the key>)" in message


# ------------------------------------------------------------------- the pure function


def test_a_location_with_a_secret_is_never_shown_and_the_command_reads_the_environment() -> None:
    view = RecordView(
        identity=ITEM,
        status="needs_review",
        attempt=1,
        updated_at="2026-11-30T18:47:01.000+00:00",
        review_reason="unsure",
        key=itemjournal.identity_digest(ITEM),
    )
    where = Where("postgresql://shop:***@db.internal/shop")
    message = explain("attempt 1 is needs_review", "REVIEW_REQUIRED", view, own=None, where=where)
    show = commands(message)[0]
    assert show == "itemjournal show shop billing charge order-3"
    assert "ITEMJOURNAL_LOCATION" in message
    assert "postgresql://shop:***@db.internal/shop" in message


def test_where_of_redacts_a_password() -> None:
    from itemjournal._journal.decisions import where_of

    class Store:
        location = "postgresql://shop:s3cret@db.internal/shop?sslpassword=t0p"

    where = where_of(Store(), "sha256", awaited=True)  # type: ignore[arg-type]
    assert where.location is not None
    assert "s3cret" not in where.location and "t0p" not in where.location
    assert where.hidden_secret


def test_a_location_with_spaces_is_quoted_for_the_shell(tmp_path: Path) -> None:
    where = Where(str(tmp_path / "a journal"))
    assert where.command("show", *ITEM).endswith(shlex.quote(str(tmp_path / "a journal")))


# --------------------------------------------------------------------------- tracebacks


def library_frames(error: BaseException) -> list[traceback.FrameSummary]:
    return [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if Path(frame.filename).resolve().is_relative_to(PACKAGE)
    ]


# At most this many of the library's frames stand between the caller and a refusal: the
# public method (begin), and for a claim block the block's entry too.
MAX_LIBRARY_FRAMES = 2


def test_a_refusal_from_the_blocking_journal_has_a_short_traceback(tmp_path: Path) -> None:
    root = tmp_path / "journal"
    with blocking.Journal.open(str(root)) as journal:
        journal.begin(ITEM, INPUTS, "billing-v3")
        journal.mark_review(ITEM, "unsure")
        with pytest.raises(ConflictError) as begun:
            journal.begin(ITEM, INPUTS, "billing-v3")
        with pytest.raises(ConflictError) as claimed:  # noqa: SIM117 - the block is the point
            with journal.claim(ITEM, INPUTS, "billing-v3"):
                pass
    assert [frame.name for frame in library_frames(begun.value)] == ["begin"]
    assert [frame.name for frame in library_frames(claimed.value)] == ["__enter__", "begin"]
    for error in (begun.value, claimed.value):
        assert error.code == "REVIEW_REQUIRED"
        assert len(library_frames(error)) <= MAX_LIBRARY_FRAMES
        assert error.__cause__ is None and error.__suppress_context__
        printed = "".join(traceback.format_exception(error))
        assert "During handling" not in printed
        assert len(printed.splitlines()) <= 12


async def test_a_refusal_from_the_async_journal_has_a_short_traceback(tmp_path: Path) -> None:
    async with await Journal.open(str(tmp_path / "journal")) as journal:
        await journal.begin(ITEM, INPUTS, "billing-v3")
        await journal.mark_review(ITEM, "unsure")
        with pytest.raises(ConflictError) as begun:
            await journal.begin(ITEM, INPUTS, "billing-v3")
        with pytest.raises(ConflictError) as claimed:
            async with journal.claim(ITEM, INPUTS, "billing-v3"):
                pass
    assert [frame.name for frame in library_frames(begun.value)] == ["begin"]
    assert [frame.name for frame in library_frames(claimed.value)] == ["__aenter__", "begin"]
    for error in (begun.value, claimed.value):
        assert len(library_frames(error)) <= MAX_LIBRARY_FRAMES
        printed = "".join(traceback.format_exception(error))
        assert "During handling" not in printed


async def test_a_blocking_refusal_in_a_thread_is_as_short(tmp_path: Path) -> None:
    """A notebook cell runs in a thread that runs an event loop: the same."""

    def cell() -> ConflictError:
        with blocking.Journal.open(str(tmp_path / "journal")) as journal:
            journal.begin(ITEM, INPUTS, "billing-v3")
            journal.mark_review(ITEM, "unsure")
            try:
                journal.begin(ITEM, INPUTS, "billing-v3")
            except ConflictError as error:
                return error
        raise AssertionError("not refused")

    error = await anyio.to_thread.run_sync(cell)
    assert [frame.name for frame in library_frames(error)] == ["begin"]
