"""The systems compared, each through the same item cycle: claim, a trivial effect, completion.

Every function here runs inside a fresh child process (``child.py``). A *spec* is the
dictionary the parent hands that process (JSON on its command line): the system's name and
whatever the system needs (a directory, a PostgreSQL schema, a Redis URL).

Throughput: ``open_sync(spec)`` or ``open_async(spec)`` yields a cycle function taking the
cycle's number; it claims a new item, runs the effect (a counter, no I/O) and completes
the item, and raises unless the claim was fresh. ``effects()`` of the opened system counts
the effects that ran, checked against the cycles afterwards.

Crash: ``claim_and_crash(spec, item, ledger)`` claims ``item``, runs the effect (a line
appended to ``ledger`` and fsynced), reports ``EFFECT`` on stdout and waits to be killed;
``ask(spec, items, ledger)`` asks for each item again with the same effect and answers how
each request ended.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

SyncCycle = Callable[[int], None]
AsyncCycle = Callable[[int], Awaitable[None]]

DEFINITION = "peers-bench-v1"
POWERTOOLS_BENCH_REMAINING_MS = 900_000  # the Lambda context's time left: 15 minutes
DBOS_VERSION = "ijpeers-1"  # the application version, fixed so a restart recovers
DBOS_ASK_WAIT = 3.0  # seconds a DBOS request for a pending workflow is left waiting


class Effects:
    """Counts the trivial effects that ran (any thread)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def run(self, index: int) -> str:
        with self._lock:
            self.count += 1
        return f"receipt-{index}"


def append_line(ledger: str, item: str) -> None:
    """The crash table's effect: one line appended to the ledger and fsynced."""
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{item}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def crash_point() -> None:
    """After the crash effect: say so and wait for the SIGKILL."""
    sys.stdout.write("EFFECT\n")
    sys.stdout.flush()
    time.sleep(600)
    raise SystemExit("not killed")


# ---------------------------------------------------------------------- itemjournal


def _identity(index: int | str) -> tuple[str, str, str, str]:
    return ("peers", "bench", "item", f"i{index}")


def _location(spec: dict[str, Any]) -> str:
    store = spec["store"]
    if store == "file":
        return os.path.join(spec["dir"], "journal")
    if store == "sqlite":
        return f"sqlite://{os.path.join(spec['dir'], 'journal.db')}"
    separator = "&" if "?" in spec["postgres_url"] else "?"
    return f"{spec['postgres_url']}{separator}schema={spec['schema']}&pool_size=8"


@contextmanager
def itemjournal_sync(spec: dict[str, Any], effects: Effects) -> Iterator[SyncCycle]:
    from itemjournal import Claim
    from itemjournal.sync import Journal

    journal = Journal.open(_location(spec))

    def cycle(index: int) -> None:
        claim = journal.begin(_identity(index), {"n": index}, DEFINITION)
        if not isinstance(claim, Claim):
            raise TypeError(f"expected a fresh claim, got {claim!r}")
        journal.complete(claim, effects.run(index))

    try:
        yield cycle
    finally:
        journal.close()


@asynccontextmanager
async def itemjournal_async(spec: dict[str, Any], effects: Effects) -> AsyncIterator[AsyncCycle]:
    from itemjournal import Claim, Journal

    journal = await Journal.open(_location(spec))

    async def cycle(index: int) -> None:
        claim = await journal.begin(_identity(index), {"n": index}, DEFINITION)
        if not isinstance(claim, Claim):
            raise TypeError(f"expected a fresh claim, got {claim!r}")
        await journal.complete(claim, effects.run(index))

    try:
        yield cycle
    finally:
        await journal.aclose()


def itemjournal_crash(spec: dict[str, Any], item: str, ledger: str) -> None:
    from itemjournal import Claim, Journal

    async def main() -> None:
        journal = await Journal.open(_location(spec))
        claim = await journal.begin(_identity(item), {"n": item}, DEFINITION)
        if not isinstance(claim, Claim):
            raise TypeError(f"expected a fresh claim, got {claim!r}")
        append_line(ledger, item)
        crash_point()

    asyncio.run(main())


def itemjournal_ask(spec: dict[str, Any], items: Iterable[str], ledger: str) -> list[str]:
    from itemjournal import Claim, ConflictError, Journal

    async def main() -> list[str]:
        answers = []
        async with await Journal.open(_location(spec)) as journal:
            for item in items:
                try:
                    claim = await journal.begin(_identity(item), {"n": item}, DEFINITION)
                except ConflictError as error:
                    answers.append(error.code)
                    continue
                if isinstance(claim, Claim):
                    append_line(ledger, item)
                    await journal.complete(claim, f"receipt-{item}")
                    answers.append("ran")
                else:
                    answers.append("reused")
        return answers

    return asyncio.run(main())


# ---------------------------------------------------------------------- DBOS Transact


def _dbos_launch(spec: dict[str, Any], executor_id: str | None, step: Any, is_async: bool) -> Any:
    """Configure and launch DBOS on the spec's store; the workflow (one step) it registered."""
    from dbos import DBOS

    if spec["store"] == "postgres":
        url = spec["postgres_url"]
    else:
        url = f"sqlite:///{os.path.join(spec['dir'], 'dbos.sqlite')}"
    config: dict[str, Any] = {
        "name": "ijpeers",
        "system_database_url": url,
        "dbos_system_schema": spec.get("schema", "dbos"),
        "application_version": DBOS_VERSION,
        "log_level": "WARNING",
    }
    if executor_id is not None:
        config["executor_id"] = executor_id
    DBOS(config=config)  # type: ignore[arg-type]
    if is_async:
        effect_step = DBOS.step(name="effect")(step)

        async def item_workflow(key: str, index: int) -> str:
            return str(await effect_step(key, index))

        workflow = DBOS.workflow(name="item")(item_workflow)
    else:
        effect_step = DBOS.step(name="effect")(step)

        def item_workflow_sync(key: str, index: int) -> str:
            return str(effect_step(key, index))

        workflow = DBOS.workflow(name="item")(item_workflow_sync)
    DBOS.launch()
    return workflow


@contextmanager
def dbos_sync(spec: dict[str, Any], effects: Effects) -> Iterator[SyncCycle]:
    from dbos import DBOS, SetWorkflowID

    def step(key: str, index: int) -> str:
        return effects.run(index)

    workflow = _dbos_launch(spec, None, step, is_async=False)

    def cycle(index: int) -> None:
        with SetWorkflowID(f"i{index}"):
            workflow(f"i{index}", index)

    try:
        yield cycle
    finally:
        DBOS.destroy()


@contextmanager
def dbos_async(spec: dict[str, Any], effects: Effects) -> Iterator[AsyncCycle]:
    from dbos import DBOS, SetWorkflowID

    async def step(key: str, index: int) -> str:
        return effects.run(index)

    workflow = _dbos_launch(spec, None, step, is_async=True)

    async def cycle(index: int) -> None:
        with SetWorkflowID(f"i{index}"):
            await workflow(f"i{index}", index)

    try:
        yield cycle
    finally:
        DBOS.destroy()


_CRASHING = False


def _dbos_crash_step(ledger: str) -> Callable[[str, int], str]:
    def step(key: str, index: int) -> str:
        append_line(ledger, key)
        if _CRASHING:
            crash_point()
        return f"receipt-{key}"

    return step


def dbos_crash(spec: dict[str, Any], item: str, ledger: str) -> None:
    from dbos import SetWorkflowID

    global _CRASHING
    _CRASHING = True
    workflow = _dbos_launch(spec, None, _dbos_crash_step(ledger), is_async=False)
    with SetWorkflowID(item):
        workflow(item, 0)


def dbos_ask(spec: dict[str, Any], items: Iterable[str], ledger: str) -> list[str]:
    """Ask again from another executor: the call waits for the pending workflow."""
    from dbos import SetWorkflowID

    workflow = _dbos_launch(spec, f"asker-{os.getpid()}", _dbos_crash_step(ledger), False)
    answers = []
    for item in items:
        outcome: list[str] = []

        def call(item: str = item, outcome: list[str] = outcome) -> None:
            with SetWorkflowID(item):
                outcome.append(str(workflow(item, 0)))

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(DBOS_ASK_WAIT)
        answers.append("waits (PENDING)" if thread.is_alive() else "returned")
    return answers  # the caller leaves with os._exit: a waiting call never ends by itself


def dbos_recover(spec: dict[str, Any], items: Iterable[str], ledger: str) -> list[str]:
    """Restart as the crashed executor: DBOS recovers its pending workflows at launch."""
    from dbos import DBOS

    _dbos_launch(spec, None, _dbos_crash_step(ledger), is_async=False)
    answers = []
    for item in items:
        handle = DBOS.retrieve_workflow(item)
        handle.get_result()
        answers.append(f"recovered: {handle.get_status().status}")
    return answers


# ---------------------------------------------------------------------- Powertools


class LambdaContext:
    """What the idempotency utility reads of a Lambda context: the time left."""

    def __init__(self, remaining_ms: int) -> None:
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms


def _powertools(spec: dict[str, Any], function: Callable[..., Any], remaining_ms: int) -> Any:
    import redis
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    client = redis.Redis.from_url(spec["redis_url"], decode_responses=True)
    layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=600)
    config.register_lambda_context(LambdaContext(remaining_ms))
    return idempotent_function(
        data_keyword_argument="item",
        persistence_store=layer,
        config=config,
        key_prefix=spec["key_prefix"],
    )(function)


@contextmanager
def powertools_sync(spec: dict[str, Any], effects: Effects) -> Iterator[SyncCycle]:
    def effect(item: dict[str, Any]) -> dict[str, str]:
        return {"receipt": effects.run(item["n"])}

    guarded = _powertools(spec, effect, POWERTOOLS_BENCH_REMAINING_MS)

    def cycle(index: int) -> None:
        answer = guarded(item={"id": f"i{index}", "n": index})
        if answer != {"receipt": f"receipt-{index}"}:
            raise RuntimeError(f"unexpected answer {answer!r}")

    yield cycle


def _powertools_crash_effect(ledger: str, crashing: bool) -> Callable[..., Any]:
    def effect(item: dict[str, Any]) -> dict[str, str]:
        append_line(ledger, item["id"])
        if crashing:
            crash_point()
        return {"receipt": f"receipt-{item['id']}"}

    return effect


def powertools_crash(spec: dict[str, Any], item: str, ledger: str) -> None:
    guarded = _powertools(
        spec, _powertools_crash_effect(ledger, True), spec["in_progress_expiry_ms"]
    )
    guarded(item={"id": item})


def powertools_ask(spec: dict[str, Any], items: Iterable[str], ledger: str) -> list[str]:
    from aws_lambda_powertools.utilities.idempotency.exceptions import (
        IdempotencyAlreadyInProgressError,
    )

    guarded = _powertools(
        spec, _powertools_crash_effect(ledger, False), spec["in_progress_expiry_ms"]
    )
    answers = []
    for item in items:
        before = _ledger_counts(ledger).get(item, 0)
        try:
            guarded(item={"id": item})
        except IdempotencyAlreadyInProgressError:
            answers.append("IdempotencyAlreadyInProgressError")
            continue
        answers.append("ran" if _ledger_counts(ledger).get(item, 0) > before else "reused")
    return answers


# ---------------------------------------------------------------------- the idempotency package


def _idempotency_guard(spec: dict[str, Any], function: Callable[..., Any]) -> Any:
    from idempotency import idempotent
    from idempotency.stores.file import FileStore

    store = FileStore(os.path.join(spec["dir"], "idempotency"))
    return idempotent(store=store, key=lambda key, *rest: f"bench-{key}")(function)


@contextmanager
def idempotency_sync(spec: dict[str, Any], effects: Effects) -> Iterator[SyncCycle]:
    def effect(key: str, index: int) -> str:
        return effects.run(index)

    guarded = _idempotency_guard(spec, effect)

    def cycle(index: int) -> None:
        answer = guarded(f"i{index}", index)
        if answer != f"receipt-{index}":
            raise RuntimeError(f"unexpected answer {answer!r}")

    yield cycle


def idempotency_crash(spec: dict[str, Any], item: str, ledger: str) -> None:
    def effect(key: str) -> str:
        append_line(ledger, key)
        crash_point()
        return f"receipt-{key}"

    _idempotency_guard(spec, effect)(item)


def idempotency_ask(spec: dict[str, Any], items: Iterable[str], ledger: str) -> list[str]:
    ran: list[str] = []

    def effect(key: str) -> str:
        append_line(ledger, key)
        ran.append(key)
        return f"receipt-{key}"

    guarded = _idempotency_guard(spec, effect)
    answers = []
    for item in items:
        guarded(item)
        answers.append("ran" if item in ran else "reused")
    return answers


def _ledger_counts(ledger: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    try:
        with open(ledger, encoding="utf-8") as stream:
            for line in stream:
                counts[line.strip()] = counts.get(line.strip(), 0) + 1
    except FileNotFoundError:
        pass
    return counts


# ---------------------------------------------------------------------- the table of systems

SYNC_SYSTEMS: dict[str, Callable[[dict[str, Any], Effects], Any]] = {
    "itemjournal": itemjournal_sync,
    "dbos": dbos_sync,
    "powertools": powertools_sync,
    "idempotency": idempotency_sync,
}
ASYNC_SYSTEMS: dict[str, Callable[[dict[str, Any], Effects], Any]] = {
    "itemjournal": itemjournal_async,
    "dbos": dbos_async,
}
ASYNC_OPENS_IN_LOOP = {"itemjournal"}  # an async context manager, entered in the event loop
CRASH: dict[str, Callable[[dict[str, Any], str, str], None]] = {
    "itemjournal": itemjournal_crash,
    "dbos": dbos_crash,
    "powertools": powertools_crash,
    "idempotency": idempotency_crash,
}
ASK: dict[str, Callable[[dict[str, Any], Iterable[str], str], list[str]]] = {
    "itemjournal": itemjournal_ask,
    "dbos": dbos_ask,
    "powertools": powertools_ask,
    "idempotency": idempotency_ask,
}
AFTER: dict[str, Callable[[dict[str, Any], Iterable[str], str], list[str]]] = {
    **ASK,
    "dbos": dbos_recover,
}
