"""The examples run as documented."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str, expect: int = 0) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "worker_loop.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == expect, result.stderr
    return result.stdout


def ledger(root: str) -> list[dict[str, str]]:
    text = Path(root + ".provider.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_worker_loop_dies_then_reruns(tmp_path: Path) -> None:
    root = str(tmp_path / "demo")
    first = run("--root", root, "--fresh", expect=-signal.SIGKILL)
    assert first.count("charged, receipt") == 3
    assert "order-3: provider timed out" in first
    assert "[needs_review, reason: block raised TimeoutError]" in first
    assert "order-5: charged by the provider (ch_" in first
    assert "killed (SIGKILL) before it records the receipt" in first
    charged = ledger(root)
    assert sorted(line["order"] for line in charged) == ["order-1", "order-2", "order-4", "order-5"]
    second = run("--root", root)
    assert second.count("reused receipt") == 3
    assert "order-3: refused (REVIEW_REQUIRED)" in second
    assert "order-5: refused (REVIEW_REQUIRED)" in second
    assert "[needs_review, reason: owner process gone]" in second
    assert "asked 0 time(s) and made 0 new charge(s)" in second
    assert ledger(root) == charged


def test_demo_ends_with_reconciliation_settling_both_items(tmp_path: Path) -> None:
    root = str(tmp_path / "demo")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--root", root],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = result.stdout
    assert "Traceback" not in result.stderr
    check = "--check worker_loop:what_happened"
    steps = [
        "$ python examples/worker_loop.py --fresh",
        "died by SIGKILL (return code -9)",
        "$ python examples/worker_loop.py",
        "$ itemjournal list --status needs_review",
        "$ itemjournal show demo-shop billing charge order-5",
        f"$ itemjournal reconcile {check} --dry-run",
        f"$ itemjournal reconcile {check} --yes",
        "$ itemjournal show demo-shop billing charge order-5",
        "$ python examples/worker_loop.py",
        "$ itemjournal list",
    ]
    at = 0
    for step in steps:  # each step shown, in this order
        at = out.index(step, at) + len(step)
    first, rest = out.split("$ python examples/worker_loop.py\n", 1)
    rerun, operator = rest.split("$ itemjournal list --status needs_review", 1)
    operator, last_run = operator.split("$ python examples/worker_loop.py\n", 1)
    _, dry, applied = operator.split("$ itemjournal reconcile", 2)
    applied, audit = applied.split("$ itemjournal show", 1)

    charges = ledger(root)
    assert len(charges) == 5
    by_order: dict[str, list[str]] = {}
    for line in charges:
        by_order.setdefault(line["order"], []).append(line["charge"])
    assert sorted(by_order) == ["order-1", "order-2", "order-3", "order-4", "order-5"]
    assert all(len(ids) == 1 for ids in by_order.values())  # never charged twice
    (charge_5,) = by_order["order-5"]
    (charge_3,) = by_order["order-3"]

    assert f"order-5: charged by the provider ({charge_5})" in first
    assert "order-3: provider timed out" in first
    assert "order-5: refused (REVIEW_REQUIRED)" in rerun and "owner process gone" in rerun
    assert "order-3: refused (REVIEW_REQUIRED)" in rerun
    assert "asked 0 time(s)" in rerun
    review_list = operator.split("$ itemjournal show", 1)[0]
    assert review_list.count("needs_review   demo-shop") == 2
    assert "block raised TimeoutError" in review_list and "owner process gone" in review_list

    # The dry run asks the provider and changes nothing; --yes settles both items.
    assert f"would resolve succeeded, receipt {charge_5}" in dry
    assert "would resolve released: no charge under the key" in dry
    assert "would resolve 2 of 2 checked records; nothing changed" in dry
    assert f"resolved succeeded, receipt {charge_5}" in applied
    assert "resolved released: no charge under the key" in applied
    assert "resolved 2 of 2 checked records" in applied
    assert "failed                 0" in applied
    # The crashed item's history names the reconciliation that settled it.
    assert f"receipt        {charge_5}" in audit
    assert (
        "reconciled by worker_loop.what_happened: the provider reports it happened: "
        f"charge {charge_5} of 45.00 for order-5 in its ledger"
    ) in audit

    assert f"order-3: charged, receipt {charge_3}" in last_run
    assert f"order-5: reused receipt {charge_5}" in last_run
    assert last_run.count("reused receipt") == 4
    assert "asked 1 time(s) and made 1 new charge(s)" in last_run
    last_list = out.rsplit("$ itemjournal list", 1)[1]
    assert last_list.count("succeeded") == 5
    assert "order-5   1" in last_list and f"receipt {charge_5}" in last_list
    assert "order-3   2" in last_list and f"receipt {charge_3}" in last_list
    assert "needs_review" not in last_list
    assert last_list.rstrip().endswith("5 records")


CELERY_CHECK = """
import inspect, json, os
from celery import Celery
import celery_worker
from itemjournal.sync import Journal

task = celery_worker.app.tasks["charge"]
first = task.apply(("order-1", 250)).get()
again = task.apply(("order-1", 250)).get()
with Journal.open(os.environ["ITEMJOURNAL_LOCATION"]) as journal:
    key = journal.inspect(("shop", "billing", "charge", "order-1")).key
print(json.dumps({
    "app": isinstance(celery_worker.app, Celery),
    "options": [task.acks_late, task.reject_on_worker_lost, getattr(task, "queue", None)],
    "default_queue": celery_worker.app.conf.task_default_queue,
    "parameters": list(inspect.signature(task.run).parameters),
    "receipts": [first, again],
    "key": key,
    "transport": celery_worker.app.conf.broker_transport_options,
}))
"""


def test_celery_worker_keeps_its_environment_contract(tmp_path: Path) -> None:
    import os

    env = {
        **os.environ,
        "PYTHONPATH": str(EXAMPLES),
        "BROKER_URL": "redis://127.0.0.1:6379/0",  # tasks run by apply(): never connected
        "ITEMJOURNAL_LOCATION": str(tmp_path / "journal"),
        "LEDGER": str(tmp_path / "ledger"),
        "VISIBILITY_TIMEOUT": "7",
    }
    result = subprocess.run(
        [sys.executable, "-c", CELERY_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["app"] is True
    assert seen["options"] == [True, True, None]  # late acks, back when lost, default queue
    assert seen["default_queue"] == "celery"
    assert seen["parameters"] == ["order_id", "amount_cents"]
    assert seen["receipts"] == ["ledger:order-1", "ledger:order-1"]
    ledger_text = (tmp_path / "ledger").read_text()
    assert ledger_text == f"order-1 250 {seen['key']}\n"  # charged once, with the claim key
    assert seen["transport"]["visibility_timeout"] == 7
    missing = subprocess.run(
        [sys.executable, "-c", "import celery_worker"],
        env={**env, "LEDGER": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 1
    assert "celery_worker: set LEDGER" in missing.stderr


def test_broker_worker_names_what_it_needs_on_each_broker() -> None:
    """RabbitMQ by default (AMQP_URL required, as before); ``--broker nats://…`` needs no
    AMQP_URL; an unknown scheme is named."""
    worker = str(EXAMPLES / "broker_worker.py")

    def start(*args: str, **env: str) -> str:
        done = subprocess.run(
            [sys.executable, worker, *args],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1
        return done.stderr

    rabbit = start()
    assert "set AMQP_URL, QUEUE, LEDGER, ITEMJOURNAL_LOCATION" in rabbit
    nats = start("--broker", "nats://127.0.0.1:4222", QUEUE="q")
    assert "set LEDGER, ITEMJOURNAL_LOCATION" in nats
    assert "AMQP_URL" not in nats
    other = start("--broker", "kafka://x", QUEUE="q", LEDGER="l", ITEMJOURNAL_LOCATION="j")
    assert "--broker is amqp://, amqps://, nats:// or tls://, not 'kafka'" in other
