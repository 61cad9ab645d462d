"""The Celery home's answers, in this process: tasks run by ``apply()`` (Celery's eager
path) and by an embedded worker on the in-memory transport (solo and threads pools).
The real workers on real brokers, killed, are in ``test_celery_chaos.py``."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from itemjournal import JournalError, StorageFailed
from itemjournal.celery import Fail, Refusal, TaskRefused, current_claim, once_task
from itemjournal.sync import Journal

DEFINITION = "charge-v1"


def ident(order: str) -> tuple[str, str, str, str]:
    return ("shop", "billing", "charge", order)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal.open(str(tmp_path / "journal"))
    yield opened
    opened.close()


@pytest.fixture
def app() -> Celery:
    made = Celery("tests", broker="memory://", backend="cache+memory://", set_as_current=False)
    made.conf.broker_connection_retry_on_startup = True
    made.conf.broker_transport_options = {"polling_interval": 0.05}
    return made


class Provider:
    """Counts the charges, remembers the keys they were made under."""

    def __init__(self) -> None:
        self.charges: list[tuple[str, int, str]] = []

    def charge(self, order_id: str, amount_cents: int) -> str:
        key = current_claim().key
        self.charges.append((order_id, amount_cents, key))
        return f"ch-{order_id}-{len(self.charges)}"


def charge_task(app: Celery, journal: Journal, provider: Provider, **options: Any) -> Any:
    options.setdefault("definition", DEFINITION)
    options.setdefault("shared", False)  # not added to the apps of later tests

    @once_task(
        app,
        journal,
        identity=lambda order_id, amount_cents: ident(order_id),
        inputs=lambda order_id, amount_cents: {"amount_cents": amount_cents},
        name="charge",
        **options,
    )
    def charge(order_id: str, amount_cents: int) -> str:
        return provider.charge(order_id, amount_cents)

    return charge


def refusal_of(result: Any) -> TaskRefused:
    assert result.state == "FAILURE"
    error = result.result
    assert isinstance(error, TaskRefused)
    return error


def test_the_task_acknowledges_late_and_comes_back_when_its_worker_is_lost(
    app: Celery, journal: Journal
) -> None:
    task = charge_task(app, journal, Provider())
    assert task.name == "charge"
    assert task.acks_late is True
    assert task.reject_on_worker_lost is True
    assert app.tasks["charge"].name == "charge"
    for option in ("acks_late", "reject_on_worker_lost"):
        with pytest.raises(JournalError) as refused:
            once_task(app, journal, identity=lambda: ident("x"), **{option: False})
        assert refused.value.code == "INVALID_ARGUMENT"
        assert "lost" in str(refused.value)
    with pytest.raises(JournalError, match="bind"):
        once_task(app, journal, identity=lambda: ident("x"), bind=True)
    with pytest.raises(JournalError) as wrong:
        once_task(app, object(), identity=lambda: ident("x"))  # type: ignore[arg-type]
    assert wrong.value.code == "INVALID_ARGUMENT"


def test_the_item_comes_from_the_arguments_not_the_task_id(app: Celery, journal: Journal) -> None:
    provider = Provider()
    task = charge_task(app, journal, provider)
    first = task.apply(("order-1", 4500), task_id="first")
    second = task.apply(("order-1", 4500), task_id="second")
    other = task.apply(kwargs={"order_id": "order-2", "amount_cents": 100})
    assert first.get() == second.get() == "ch-order-1-1"
    assert other.get() == "ch-order-2-2"
    view = journal.inspect(ident("order-1"))
    assert view.status == "succeeded"
    assert view.receipt == "ch-order-1-1"
    assert provider.charges == [
        ("order-1", 4500, view.key),
        ("order-2", 100, journal.inspect(ident("order-2")).key),
    ]
    assert view.owner is None or view.owner.pid > 0
    with pytest.raises(TypeError):
        task.delay("order-3")  # Celery checks the arguments against the body's


def test_review_required_never_runs_and_fails_with_its_code(app: Celery, journal: Journal) -> None:
    provider = Provider()
    task = charge_task(app, journal, provider)
    journal.begin(ident("order-1"), {"amount_cents": 4500}, DEFINITION)
    journal.mark_review(ident("order-1"), "the provider timed out")
    for _ in range(2):  # again and again: the same answer, never a run
        error = refusal_of(task.apply(("order-1", 4500)))
        assert error.code == "REVIEW_REQUIRED"
        assert error.identity == ident("order-1")
        assert error.key == journal.inspect(ident("order-1")).key
        assert str(error).startswith("REVIEW_REQUIRED: ")
    assert provider.charges == []
    assert journal.inspect(ident("order-1")).status == "needs_review"


def test_a_claim_whose_owner_died_is_sent_to_review(app: Celery, journal: Journal) -> None:
    location = str(journal.store.root)  # type: ignore[attr-defined]
    script = (
        "import sys\n"
        "from itemjournal.sync import Journal\n"
        "with Journal.open(sys.argv[1]) as journal:\n"
        "    journal.begin(('shop', 'billing', 'charge', 'order-9'), {'amount_cents': 1},"
        " 'charge-v1')\n"
    )
    subprocess.run([sys.executable, "-c", script, location], check=True)
    provider = Provider()
    task = charge_task(app, journal, provider)
    error = refusal_of(task.apply(("order-9", 1)))
    assert error.code == "REVIEW_REQUIRED"
    view = journal.inspect(ident("order-9"))
    assert view.status == "needs_review"
    assert "gone" in (view.review_reason or "")
    assert provider.charges == []


def test_other_refusals_go_to_the_policy(app: Celery, journal: Journal) -> None:
    provider = Provider()
    seen: list[Refusal] = []

    def keep(refusal: Refusal) -> str:
        seen.append(refusal)
        return f"kept {refusal.code}"

    task = charge_task(app, journal, provider, on_refused=keep)
    assert task.apply(("order-1", 4500)).get() == "ch-order-1-1"
    changed = task.apply(("order-1", 9900), task_id="changed")
    assert changed.get() == "kept INPUT_CHANGED"
    bad = task.apply(("not a label!", 1))
    assert bad.get() == "kept INVALID_LABEL"
    assert [r.code for r in seen] == ["INPUT_CHANGED", "INVALID_LABEL"]
    assert seen[0].identity == ident("order-1")
    assert seen[0].key == journal.inspect(ident("order-1")).key
    assert (seen[0].task, seen[0].task_id, seen[0].args) == ("charge", "changed", ("order-1", 9900))
    assert seen[1].identity is None
    assert len(provider.charges) == 1
    with pytest.raises(TaskRefused) as failed:
        Fail()(seen[0])
    assert failed.value.code == "INPUT_CHANGED"


def test_a_body_that_raises_leaves_its_record_in_review(app: Celery, journal: Journal) -> None:
    @once_task(app, journal, identity=ident, definition=DEFINITION, shared=False)
    def explode(order_id: str) -> str:
        raise TimeoutError("the provider did not answer")

    result = explode.apply(("order-1",))
    assert result.state == "FAILURE"
    assert isinstance(result.result, TimeoutError)
    view = journal.inspect(ident("order-1"))
    assert view.status == "needs_review"
    assert "TimeoutError" in (view.review_reason or "")
    assert refusal_of(explode.apply(("order-1",))).code == "REVIEW_REQUIRED"


def test_a_body_without_a_receipt_leaves_its_record_in_review(
    app: Celery, journal: Journal
) -> None:
    @once_task(app, journal, identity=ident, definition=DEFINITION, shared=False)
    def nothing(order_id: str) -> Any:
        return None

    result = nothing.apply(("order-1",))
    assert result.state == "FAILURE"
    assert getattr(result.result, "code", None) == "INVALID_RECEIPT"
    assert journal.inspect(ident("order-1")).status == "needs_review"


def test_a_pair_stores_its_result_and_a_reuse_returns_it(app: Celery, journal: Journal) -> None:
    runs: list[str] = []

    @once_task(app, journal, identity=ident, shared=False)
    def label(order_id: str) -> tuple[str, str | None]:
        runs.append(order_id)
        return (f"label-{order_id}", '{"tracking": "T1"}')

    assert label.apply(("order-1",)).get() == ("label-order-1", '{"tracking": "T1"}')
    assert tuple(label.apply(("order-1",)).get()) == ("label-order-1", '{"tracking": "T1"}')
    assert runs == ["order-1"]


def test_in_progress_in_this_process_waits_then_reuses(app: Celery, journal: Journal) -> None:
    provider = Provider()
    claim = journal.begin(ident("order-1"), {"amount_cents": 4500}, DEFINITION)
    assert not isinstance(claim, type(None))
    hasty = charge_task(app, journal, provider)
    error = refusal_of(hasty.apply(("order-1", 4500)))
    assert error.code == "IN_PROGRESS"  # in this process it is never retried in a loop

    app2 = Celery("patient", broker="memory://", set_as_current=False)
    patient = charge_task(app2, journal, provider, wait=10)
    finisher = threading.Timer(0.3, lambda: journal.complete(claim, "ch-first"))  # type: ignore[arg-type]
    finisher.start()
    started = time.monotonic()
    assert patient.apply(("order-1", 4500)).get() == "ch-first"
    assert time.monotonic() - started >= 0.25
    finisher.join()
    assert provider.charges == []


def test_current_claim_outside_a_task_body() -> None:
    with pytest.raises(JournalError) as outside:
        current_claim()
    assert outside.value.code == "INVALID_CLAIM"


def test_a_refusal_survives_pickle_and_a_json_result_backend(app: Celery) -> None:
    error = TaskRefused("REVIEW_REQUIRED", "owner process gone", ident("order-1"), "ab" * 32)
    again = pickle.loads(pickle.dumps(error))
    assert (again.code, again.message, again.identity, again.key) == (
        "REVIEW_REQUIRED",
        "owner process gone",
        ident("order-1"),
        "ab" * 32,
    )
    app.conf.result_serializer = "json"
    stored = app.backend.prepare_exception(error, "json")
    back = app.backend.exception_to_python(stored)
    assert isinstance(back, TaskRefused)
    assert (back.code, back.identity, back.key) == ("REVIEW_REQUIRED", ident("order-1"), "ab" * 32)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_worker_retries_in_progress_until_the_first_run_settles(
    pool: str, app: Celery, journal: Journal
) -> None:
    """A delivery refused ``IN_PROGRESS`` in a real worker is retried with a countdown:
    neither run nor failed, it returns the receipt once the first run stored it."""
    provider = Provider()
    task = charge_task(app, journal, provider, in_progress_countdown=0.2)
    app.loader.import_module("celery.contrib.testing.tasks")
    claim = journal.begin(ident("order-1"), {"amount_cents": 4500}, DEFINITION)
    with start_worker(app, pool=pool, concurrency=2, perform_ping_check=False):
        result = task.delay("order-1", 4500)
        deadline = time.monotonic() + 20
        while journal.statistics().refusals < 5:  # past Celery's default of 3 retries
            assert time.monotonic() < deadline, result.state
            assert result.state in {"RETRY", "PENDING"}  # waiting, neither run nor failed
            time.sleep(0.02)
        journal.complete(claim, "ch-first")  # type: ignore[arg-type]
        assert result.get(timeout=10) == "ch-first"
        fresh = task.delay("order-2", 100)
        assert fresh.get(timeout=10) == "ch-order-2-1"
    assert [order for order, _, _ in provider.charges] == ["order-2"]


def test_a_storage_failure_before_the_claim_is_retried_within_max_retries(
    app: Celery, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = Provider()
    task = charge_task(app, journal, provider, in_progress_countdown=0)
    calls: list[object] = []

    def failing_begin(*args: object, **kwargs: object) -> object:
        calls.append(args)
        raise StorageFailed("the disk is full")

    monkeypatch.setattr(journal, "begin", failing_begin)
    result = task.apply(("order-1", 4500))
    assert result.state == "FAILURE"
    assert isinstance(result.result, StorageFailed)
    assert len(calls) == 1 + task.max_retries  # nothing recorded: tried again, then failed
    assert provider.charges == []


def test_the_arguments_are_checked_when_the_task_is_made(app: Celery, journal: Journal) -> None:
    bad: list[dict[str, Any]] = [
        {"identity": ident("order-1")},
        {"identity": ident, "inputs": {"amount_cents": 1}},
        {"identity": ident, "on_refused": "fail"},
        {"identity": ident, "in_progress_countdown": -1},
    ]
    for options in bad:
        with pytest.raises(JournalError):
            once_task(app, journal, **options)
