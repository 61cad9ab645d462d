"""One measurement, or one step of a crash run, in a fresh process: what ``bench_peers.py`` starts.

``child.py measure SPEC``: open the system, warm it up, run cycles for the spec's seconds on
``concurrency`` threads (sync face) or asyncio tasks (async face), and print one JSON line:
cycles, seconds, p50 and p99 of the cycle latency, CPU per item. Every cycle claims a new
item; afterwards the effects that ran must equal the cycles started.

``child.py crash SPEC ITEM LEDGER``: claim the item, run the effect (a line appended to the
ledger and fsynced), print ``EFFECT`` and wait for the parent's SIGKILL.

``child.py ask SPEC LEDGER ITEM...`` / ``child.py after SPEC LEDGER ITEM...``: ask for each
item again (``after``: after the peer's expiry, or a DBOS restart that recovers its pending
workflows) and print the answers as one JSON line. ``-`` for the items: open the system
first, then read them from stdin (the parent starts the asker before the crash it follows).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import systems


def _percentile(ordered: list[float], fraction: float) -> float:
    if not ordered:
        return math.nan
    return ordered[max(1, math.ceil(fraction * len(ordered))) - 1]


def _summary(latencies: list[float], seconds: float, cpu: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "cycles": len(ordered),
        "seconds": seconds,
        "rate": len(ordered) / seconds if seconds > 0 else math.nan,
        "p50_ms": _percentile(ordered, 0.50) * 1000,
        "p99_ms": _percentile(ordered, 0.99) * 1000,
        "cpu_ms": cpu / len(ordered) * 1000 if ordered else math.nan,
    }


def threads_phase(
    cycle: Callable[[int], None], concurrency: int, seconds: float, counter: Any
) -> tuple[list[float], float, float]:
    """Threads run cycles until ``seconds`` have passed; each finishes the cycle it began."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    clock = time.perf_counter
    deadline = clock() + seconds

    def worker() -> None:
        mine: list[float] = []
        try:
            while clock() < deadline and not errors:
                index = next(counter)
                started = clock()
                cycle(index)
                mine.append(clock() - started)
        except BaseException as error:
            errors.append(error)
        latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    cpu = time.process_time()
    started = clock()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = clock() - started
    cpu = time.process_time() - cpu
    if errors:
        raise errors[0]
    return latencies, elapsed, cpu


async def tasks_phase(
    cycle: Callable[[int], Awaitable[None]], concurrency: int, seconds: float, counter: Any
) -> tuple[list[float], float, float]:
    """Tasks on one event loop run cycles until ``seconds`` have passed."""
    latencies: list[float] = []
    clock = time.perf_counter
    deadline = clock() + seconds

    async def worker() -> None:
        while clock() < deadline:
            index = next(counter)
            started = clock()
            await cycle(index)
            latencies.append(clock() - started)

    cpu = time.process_time()
    started = clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, clock() - started, time.process_time() - cpu


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    effects = systems.Effects()
    counter = itertools.count()
    concurrency, seconds, warmup = spec["concurrency"], spec["seconds"], spec["warmup"]
    name = spec["system"]
    if spec["face"] == "sync":
        with systems.SYNC_SYSTEMS[name](spec, effects) as cycle:
            threads_phase(cycle, concurrency, warmup, counter)
            latencies, elapsed, cpu = threads_phase(cycle, concurrency, seconds, counter)
    elif name in systems.ASYNC_OPENS_IN_LOOP:

        async def main() -> tuple[list[float], float, float]:
            async with systems.ASYNC_SYSTEMS[name](spec, effects) as cycle:
                await tasks_phase(cycle, concurrency, warmup, counter)
                return await tasks_phase(cycle, concurrency, seconds, counter)

        latencies, elapsed, cpu = asyncio.run(main())
    else:
        with systems.ASYNC_SYSTEMS[name](spec, effects) as cycle:

            async def main() -> tuple[list[float], float, float]:
                await tasks_phase(cycle, concurrency, warmup, counter)
                return await tasks_phase(cycle, concurrency, seconds, counter)

            latencies, elapsed, cpu = asyncio.run(main())
    started = next(counter)
    if effects.count != started:
        raise RuntimeError(f"{started} cycles started, {effects.count} effects ran")
    return _summary(latencies, elapsed, cpu)


def main(argv: list[str]) -> None:
    mode, spec = argv[0], json.loads(argv[1])
    if mode == "measure":
        result = measure(spec)
    elif mode == "crash":
        systems.CRASH[spec["system"]](spec, argv[2], argv[3])
        return
    elif mode in ("ask", "after"):
        table = systems.ASK if mode == "ask" else systems.AFTER
        items = argv[3:] if argv[3:] != ["-"] else (line.strip() for line in sys.stdin)
        result = {"answers": table[spec["system"]](spec, items, argv[2])}
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if spec["system"] == "dbos" and mode == "ask":
        os._exit(0)  # a DBOS call still waiting for its pending workflow never returns


if __name__ == "__main__":
    main(sys.argv[1:])
