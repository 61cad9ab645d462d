"""Workers on real brokers, through the FastStream middleware, killed and restarted: 500
messages (100 duplicates on purpose), 3 worker processes of ``examples/broker_worker.py``
(on RabbitMQ, and on NATS JetStream with ``--broker nats://…``), at least 10 SIGKILLs at
random. Every order is charged at most once; every message is acknowledged with its record
``succeeded`` or dead-lettered with its record in review; none is lost. Then the reviews
are settled (``resolve``, ``--retry`` when the ledger has no charge), the review queue
re-driven with ``--redrive``, and every order is in the ledger exactly once. Also: a
SIGTERM drain, a re-drive of one review on its own, and on JetStream a charge longer than
``ack_wait``."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _brokers import AMQP_URL, NATS_URL, JetWork, Rabbit, body, read_review, require, unique

from itemjournal import Journal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "broker_worker.py"
ORDERS = 400
DUPLICATES = 100


def ident(order: str) -> tuple[str, str, str, str]:
    return ("shop", "billing", "charge", order)


class Cluster:
    """Worker processes of one kind on one queue, one journal and one ledger."""

    def __init__(self, kind: str, tmp_path: Path, **extra: str) -> None:
        self.kind = kind
        self.broker: Rabbit | JetWork = (
            Rabbit(unique("ij-test")) if kind == "rabbit" else JetWork(unique("ij-test"))
        )
        # The RabbitMQ worker runs as its environment says; the JetStream one with --broker.
        self.args = [] if kind == "rabbit" else ["--broker", NATS_URL]
        self.journal = str(tmp_path / "journal")
        self.ledger = tmp_path / "ledger"
        self.env = {
            **os.environ,
            "AMQP_URL": AMQP_URL,
            "NATS_URL": NATS_URL,
            "QUEUE": self.broker.name,
            "LEDGER": str(self.ledger),
            "ITEMJOURNAL_LOCATION": self.journal,
            "DRAIN_SECONDS": "5",
            "PREFETCH": "4",
            "ACK_WAIT": "2",  # a killed worker's messages go to another within 2 s
            **extra,
        }
        self.logs = tmp_path
        self.workers: list[subprocess.Popen[bytes]] = []
        self.started = 0

    def start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        log = open(self.logs / f"worker-{self.started}.log", "wb")  # noqa: SIM115
        worker = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.workers.append(worker)
        return worker

    def wait_consuming(self, worker: subprocess.Popen[bytes], timeout: float = 60) -> None:
        log = self.logs / f"worker-{self.workers.index(worker) + 1}.log"
        deadline = time.monotonic() + timeout
        while b"consuming" not in log.read_bytes():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [worker for worker in self.workers if worker.poll() is None]

    def stop_all(self) -> list[int]:
        codes = []
        for worker in self.alive():
            worker.send_signal(signal.SIGTERM)
        for worker in self.workers:
            codes.append(worker.wait(timeout=30))
        return codes

    def kill_all(self) -> None:
        for worker in self.alive():
            worker.kill()
            worker.wait()

    def ledger_lines(self) -> list[tuple[str, str]]:
        if not self.ledger.exists():
            return []
        return [
            (line.split()[0], line.split()[1])
            for line in self.ledger.read_text().splitlines()
            if line.strip()
        ]

    def records(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            async with await Journal.open(self.journal) as journal:
                return {view.identity.item: view async for view in journal.records()}

        return anyio.run(go)

    def settle_reviews(self) -> tuple[int, int]:
        """Resolve every review from the ledger: a charge there is the receipt, none is a
        retry (the effect is a local append, so its absence is proof). Returns
        (with receipt, retried)."""
        charged = {order: key for order, key in self.ledger_lines()}

        async def go() -> tuple[int, int]:
            settled = retried = 0
            async with await Journal.open(self.journal) as journal:
                async for view in journal.records(status="needs_review"):
                    order = view.identity.item
                    if charged.get(order) == view.key:
                        await journal.resolve(
                            view.identity, receipt=f"ledger:{order}", note="in the ledger"
                        )
                        settled += 1
                    else:
                        assert order not in charged
                        await journal.resolve(view.identity, retry=True, note="not in the ledger")
                        retried += 1
            return settled, retried

        return anyio.run(go)

    def redrive(self) -> int:
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), "--redrive", *self.args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(result.stdout.split()[1])

    def run_until_empty(self, settled: int, timeout: float = 120) -> None:
        """Workers until every order has settled and the queue holds nothing."""
        deadline = time.monotonic() + timeout
        done, waiting = 0, -1
        while True:
            assert time.monotonic() < deadline, (
                f"the workers did not finish: {done} of {settled} records settled, "
                f"{waiting} message(s) waiting"
            )
            while len(self.alive()) < 3:
                self.start()
            records = self.records()
            done = sum(1 for view in records.values() if view.status != "started")
            waiting = self.broker.waiting()
            if done >= settled and waiting == 0:
                codes = self.stop_all()
                if self.broker.waiting() == 0:
                    return
                del codes
            time.sleep(0.3)


def publish_orders(cluster: Cluster) -> list[str]:
    orders = [f"order-{n}" for n in range(ORDERS)]
    messages = orders + random.sample(orders, DUPLICATES)
    random.shuffle(messages)
    cluster.broker.publish(body(order) for order in messages)
    return orders


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
def test_killed_workers_charge_nothing_twice_and_lose_nothing(kind: str, tmp_path: Path) -> None:
    require(kind)
    cluster = Cluster(kind, tmp_path, EFFECT_SECONDS="0.2")
    try:
        cluster.broker.publish([])  # the queues (or streams), before any worker
        for _ in range(3):
            cluster.wait_consuming(cluster.start())
        orders = publish_orders(cluster)
        kills = 0
        rng = random.Random()
        while kills < 10:
            time.sleep(rng.uniform(0.1, 0.3))
            victim = rng.choice(cluster.alive())
            victim.kill()
            victim.wait()
            kills += 1
            cluster.start()
        charged_during_kills = len(cluster.ledger_lines())
        assert charged_during_kills < ORDERS  # every kill came while there was work
        cluster.run_until_empty(ORDERS)

        # After the run: at most one charge per order; each message acknowledged with its
        # record succeeded, or dead-lettered with its record in review.
        lines = cluster.ledger_lines()
        per_order = collections.Counter(order for order, _ in lines)
        assert max(per_order.values()) == 1
        records = cluster.records()
        assert sorted(records) == sorted(orders)
        statuses = collections.Counter(view.status for view in records.values())
        assert set(statuses) <= {"succeeded", "needs_review"}
        for order, key in lines:
            assert records[order].key == key
        review = {order for order, view in records.items() if view.status == "needs_review"}
        for order, view in records.items():
            if view.status == "succeeded":
                assert per_order[order] == 1
        dead_lettered = cluster.broker.peek_review()
        kept = read_review(cluster.broker)
        assert len(kept) == dead_lettered
        in_review_queue = {message["order"] for message, _ in kept}
        assert in_review_queue == review  # every review is kept, nothing else is there
        for message, headers in kept:
            assert headers["x-itemjournal-code"] in {"REVIEW_REQUIRED", "HANDLER_FAILED"}
            assert headers["x-itemjournal-key"] == records[message["order"]].key
        lost = set(orders) - review - {o for o, v in records.items() if v.status == "succeeded"}
        assert lost == set()
        # Settle, re-drive with the example's --redrive: every order then charged once.
        settled, retried = cluster.settle_reviews()
        assert cluster.redrive() == dead_lettered
        assert cluster.broker.peek_review() == 0
        cluster.run_until_empty(ORDERS)
        final = collections.Counter(order for order, _ in cluster.ledger_lines())
        assert sorted(final) == sorted(orders)
        assert set(final.values()) == {1}
        assert {view.status for view in cluster.records().values()} == {"succeeded"}
        assert cluster.broker.peek_review() == 0
        print(
            f"{kind}: {ORDERS + DUPLICATES} messages ({DUPLICATES} duplicates), {kills} SIGKILLs, "
            f"{cluster.started} worker starts, {charged_during_kills} charged by the last kill; "
            f"{len(lines)} charges, at most 1 per order; "
            f"{statuses['needs_review']} in review, {dead_lettered} dead-lettered, 0 lost; "
            f"settled {settled} by receipt, {retried} retried and re-driven; "
            f"final ledger {len(final)} orders, 1 charge each"
        )
    finally:
        cluster.kill_all()
        cluster.broker.delete()


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
def test_sigterm_drains_the_messages_in_flight(kind: str, tmp_path: Path) -> None:
    require(kind)
    cluster = Cluster(kind, tmp_path, EFFECT_SECONDS="0.2", PREFETCH="8", DRAIN_SECONDS="5")
    try:
        orders = [f"order-{n}" for n in range(40)]
        cluster.broker.publish(body(order) for order in orders)  # there before the worker
        first = cluster.start()
        cluster.wait_consuming(first)
        deadline = time.monotonic() + 20
        while True:
            statuses = collections.Counter(v.status for v in cluster.records().values())
            if statuses["started"] == 8:
                break
            assert time.monotonic() < deadline, statuses
            time.sleep(0.01)
        in_flight = statuses["started"]
        signalled = time.monotonic()
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=10)
        drained_in = time.monotonic() - signalled
        assert code == 0
        assert drained_in < 5
        after = cluster.records()
        assert collections.Counter(v.status for v in after.values())["needs_review"] == 0
        assert all(v.status == "succeeded" for v in after.values())
        by_first = len(after)
        cluster.run_until_empty(len(orders))
        final = cluster.records()
        assert sorted(final) == sorted(orders)
        assert {v.status for v in final.values()} == {"succeeded"}
        others = {v.owner.pid for v in final.values() if v.owner} - {first.pid}
        assert others  # the rest went to the other workers
        per_order = collections.Counter(order for order, _ in cluster.ledger_lines())
        assert sorted(per_order) == sorted(orders)
        assert set(per_order.values()) == {1}
        print(
            f"{kind} drain: SIGTERM with {in_flight} in flight (0.2 s effects, grace 5 s): "
            f"exit {code} in {drained_in:.2f} s, 0 in review, "
            f"{by_first} settled by the drained worker, "
            f"{len(orders) - by_first} redelivered to {len(others)} other workers, "
            f"1 charge per order"
        )
    finally:
        cluster.kill_all()
        cluster.broker.delete()


@pytest.mark.parametrize("kind", ["rabbit", "nats"])
def test_a_review_resolved_retry_is_redriven_and_charged_once(kind: str, tmp_path: Path) -> None:
    require(kind)
    cluster = Cluster(kind, tmp_path)
    try:
        cluster.broker.publish([])
        # A worker that died after its claim: the record is started by a process gone.
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import anyio, sys\n"
                "from itemjournal import Journal, definition_digest\n"
                "async def main():\n"
                "    async with await Journal.open(sys.argv[1]) as journal:\n"
                "        await journal.begin(('shop', 'billing', 'charge', 'order-7'),\n"
                "                            {'amount_cents': 100}, 'charge-v1')\n"
                "anyio.run(main)\n",
                cluster.journal,
            ],
            check=True,
        )
        cluster.broker.publish([body("order-7")])
        worker = cluster.start()
        cluster.wait_consuming(worker)
        deadline = time.monotonic() + 20
        while cluster.broker.peek_review() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        in_review = cluster.records()["order-7"]
        assert in_review.status == "needs_review"
        assert cluster.ledger_lines() == []
        ((kept, headers),) = read_review(cluster.broker)  # the reason, where the redrive reads
        assert kept == {"order": "order-7", "amount_cents": 100}
        assert headers["x-itemjournal-code"] == "REVIEW_REQUIRED"
        assert headers["x-itemjournal-key"] == in_review.key
        assert headers["x-itemjournal-identity"] == "shop/billing/charge/order-7"
        itemjournal_cli = Path(sys.executable).parent / "itemjournal"
        subprocess.run(
            [
                str(itemjournal_cli),
                "resolve",
                *ident("order-7"),
                "--retry",
                "--note",
                "no charge in the ledger",
            ],
            env=cluster.env,
            check=True,
            capture_output=True,
        )
        assert cluster.redrive() == 1
        deadline = time.monotonic() + 20
        while cluster.records()["order-7"].status != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cluster.stop_all() == [0]
        view = cluster.records()["order-7"]
        assert view.attempt == 2
        assert cluster.ledger_lines() == [("order-7", view.key)]
        assert cluster.broker.waiting() == 0
        assert cluster.broker.peek_review() == 0
        print(f"{kind} re-drive: 1 review resolved --retry, 1 message moved back, 1 effect")
    finally:
        cluster.kill_all()
        cluster.broker.delete()


def deliveries(jet: JetWork) -> int:
    """How many times the consumer ``workers`` has delivered a message, redeliveries too."""

    async def go() -> int:
        client = await nats.connect(NATS_URL)
        try:
            info = await client.jetstream().consumer_info(jet.stream, "workers")
            return int(info.delivered.consumer_seq or 0)
        finally:
            await client.close()

    return asyncio.run(go())


def test_a_charge_longer_than_ack_wait_is_neither_run_twice_nor_lost(tmp_path: Path) -> None:
    """JetStream delivers a message again while its first run lives (4 s charges, 1 s
    ack_wait): the journal answers IN_PROGRESS, the copy waits for the first run and is
    acknowledged without charging."""
    require("nats")
    cluster = Cluster("nats", tmp_path, EFFECT_SECONDS="4", ACK_WAIT="1", PREFETCH="1")
    try:
        orders = ["order-1", "order-2"]
        cluster.broker.publish([])
        for _ in range(3):
            cluster.wait_consuming(cluster.start())
        cluster.broker.publish(body(order) for order in orders)
        deadline = time.monotonic() + 60
        while not (
            {v.status for v in cluster.records().values()} == {"succeeded"}
            and len(cluster.records()) == len(orders)
            and cluster.broker.waiting() == 0
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert cluster.stop_all() == [0, 0, 0]
        delivered = deliveries(cluster.broker)
        per_order = collections.Counter(order for order, _ in cluster.ledger_lines())
        assert per_order == {order: 1 for order in orders}  # never charged twice
        assert delivered > len(orders)  # redelivered while the first runs lived
        assert cluster.broker.peek_review() == 0  # and none of them sent to review
        assert cluster.broker.waiting() == 0  # none lost: every delivery acknowledged
        print(
            f"nats ack_wait 1 s, charges 4 s: {len(orders)} orders, {delivered} deliveries, "
            f"1 charge each, 0 in review"
        )
    finally:
        cluster.kill_all()
        cluster.broker.delete()
