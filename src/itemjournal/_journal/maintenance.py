"""Listing and maintenance: records, counts, prune, verify and sweep.

These read the whole journal (a store's ``scan``) rather than one identity, and each
writes, if at all, one record at a time through the journal's ``Runner``, so that a
record written meanwhile by a caller is judged again under its lock. A record or a part
of the store that cannot be read is reported, never a reason to stop. ``Journal``'s
methods of the same names delegate here; they keep the documentation.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator
from datetime import UTC, datetime, timedelta
from typing import TypedDict

from .._model.errors import InvalidArgument, JournalError, RecordInvalid, StorageFailed
from .._model.identity import check_label, identity_digest
from .._model.records import STATUSES, Record
from .._model.view import PruneReport, RecordView, SweepReport
from .._stores.threads import run_in_thread
from .arguments import check_after, check_dry_run, check_status
from .decisions import Liveness, prune_step, sweep_step, view_of
from .faces import ASYNC
from .runner import Runner

__all__ = ["INPUT_KIND", "Filters", "Maintenance"]

# The location's setting that names how its inputs are fingerprinted (SPEC section 1).
INPUT_KIND: str = "input_kind"

_VIEW_BATCH = 64  # records per worker trip when listings compute views
_PRUNABLE = ("succeeded", "released")
# Seconds a store's own clock may be off by (the kernel's whole-second boot time, coarse
# file times): it keeps a record only when it calls it younger by more than that.
_WITNESS_SLACK = 2.0
_KEY_IN = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


class Filters(TypedDict, total=False):
    """The labels and the key a listing (``Journal.records``) is narrowed by."""

    scope: str | None
    program: str | None
    job: str | None
    after: str | None


def _problem_key(problem: JournalError) -> str | None:
    """The key of the record a problem is about, when its location names one."""
    location = getattr(problem, "location", None)
    found = _KEY_IN.findall(location) if isinstance(location, str) else []
    return found[-1] if found else None


async def _views(records: list[Record], alive: Liveness) -> list[RecordView]:
    """Views of a batch of records; liveness reads /proc, so in one worker trip."""
    if not records:
        return []
    return await run_in_thread(
        lambda: [view_of(record.identity, record, alive) for record in records]
    )


def _record_times(record: Record) -> list[datetime]:
    """Every time a record holds: when it was made, last changed, and each event."""
    texts = {record.created_at, record.updated_at, *(event.at for event in record.history)}
    return [datetime.fromisoformat(text) for text in texts]


class Maintenance:
    """The whole-journal operations of one journal, on its runner (and so its store)."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._store = runner.store

    async def records(
        self,
        status: str | None,
        scope: str | None,
        program: str | None,
        job: str | None,
        after: str | None,
        *,
        problems: bool = True,
    ) -> AsyncGenerator[RecordView | RecordInvalid | StorageFailed, None]:
        """The listing; what cannot be read comes as its error with ``problems``, else
        is left out."""
        if not isinstance(problems, bool):
            raise InvalidArgument("problems must be True or False", code="INVALID_ARGUMENT")
        check_status(status)
        labels = tuple(
            None if value is None else check_label(value, what)
            for value, what in ((scope, "scope"), (program, "program"), (job, "job"))
        )
        check_after(after)
        if ASYNC:
            self._runner.guard.check()
        alive = self._store.owner_alive
        batch: list[Record] = []
        # The store starts after ``after`` itself: a page deep in a large journal reads
        # no record before it. The checks below stay, cheap, for problems without a key.
        scan = (
            self._store.scan(status=status)
            if after is None
            else self._store.scan(status=status, after=after)
        )
        async with contextlib.aclosing(scan) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    key = _problem_key(item)
                    if problems and (after is None or key is None or key > after):
                        for view in await _views(batch, alive):
                            yield view
                        batch.clear()
                        yield item
                    continue
                if (status is not None and item.status != status) or any(
                    wanted is not None and wanted != have
                    for wanted, have in zip(labels, item.identity[:3], strict=True)
                ):
                    continue
                if after is not None and identity_digest(item.identity) <= after:
                    continue
                batch.append(item)
                if len(batch) >= _VIEW_BATCH:
                    for view in await _views(batch, alive):
                        yield view
                    batch.clear()
        for view in await _views(batch, alive):
            yield view

    async def counts(self) -> dict[str, int]:
        if ASYNC:
            self._runner.guard.check()
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        async with contextlib.aclosing(self._store.scan()) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    counted["invalid"] += 1
                else:
                    counted[item.status] += 1
        return counted

    async def prune(self, older_than: timedelta, dry_run: bool) -> PruneReport:
        if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
            raise InvalidArgument(
                "older_than is a positive datetime.timedelta", code="INVALID_ARGUMENT"
            )
        check_dry_run(dry_run)
        if ASYNC:
            self._runner.guard.check()
        now = datetime.now(UTC)
        cutoff = now - older_than
        observer = self._runner.observer
        with self._runner.span("prune", None) as span:
            try:
                report = await self._prune(now, older_than, dry_run)
            except StorageFailed as failure:
                observer.failed("prune", None, failure)
                raise
            removed, problems = len(report.removed), len(report.problems)
            span.set("outcome", "pruned")
            span.set("removed", removed)
            span.set("problems", problems)
            span.set("dry_run", dry_run)
        observer.summary(
            "prune",
            f"prune {'would remove' if dry_run else 'removed'} {removed} records last changed "
            f"before {cutoff.isoformat(timespec='seconds')}; {problems} problems",
            removed=removed,
            problems=problems,
            dry_run=dry_run,
        )
        return report

    async def _prune(self, now: datetime, older_than: timedelta, dry_run: bool) -> PruneReport:
        alive = self._store.owner_alive
        cutoff = now - older_than
        removed: list[RecordView] = []
        kept: list[Record] = []
        problems: list[JournalError] = []

        async def settle(batch: list[Record]) -> None:
            """Remove those of ``batch`` the store's own clock calls old too."""
            ages = await self._store.ages([record.identity for record in batch])
            old = []
            for record, age in zip(batch, ages, strict=True):
                if age is not None and age < older_than - timedelta(seconds=_WITNESS_SLACK):
                    kept.append(record)
                else:
                    old.append(record)
            if dry_run:
                removed.extend(await _views(old, alive))
                return
            for record in old:
                ident = record.identity
                try:
                    view = await self._runner.apply(
                        "prune", ident, prune_step(ident, record, alive)
                    )
                except (RecordInvalid, StorageFailed) as error:
                    problems.append(error)
                    continue
                if view is not None:
                    removed.append(view)

        batch: list[Record] = []
        for status in _PRUNABLE:
            async with contextlib.aclosing(self._store.scan(status=status)) as items:
                async for item in items:
                    if isinstance(item, (RecordInvalid, StorageFailed)):
                        if status == _PRUNABLE[0]:  # each problem once, not once per status
                            problems.append(item)
                        continue
                    if item.status not in _PRUNABLE:
                        continue
                    times = _record_times(item)
                    if max(times) > now:  # written by a clock ahead of this one: keep
                        kept.append(item)
                        continue
                    if datetime.fromisoformat(item.updated_at) >= cutoff:
                        continue
                    batch.append(item)
                    if len(batch) >= _VIEW_BATCH:
                        await settle(batch)
                        batch = []
        await settle(batch)
        return PruneReport(tuple(removed), tuple(problems), tuple(await _views(kept, alive)))

    async def verify(self, input_kind: str) -> tuple[str, ...]:
        with self._runner.span("verify", None) as span:
            try:
                problems = await self._verify(input_kind)
            except StorageFailed as failure:
                self._runner.observer.failed("verify", None, failure)
                raise
            span.set("outcome", "verified")
            span.set("problems", len(problems))
            return problems

    async def _verify(self, input_kind: str) -> tuple[str, ...]:
        if ASYNC:
            self._runner.guard.check()
        problems: list[str] = []
        kind = await self._store.setting(INPUT_KIND, input_kind)
        async with contextlib.aclosing(self._store.scan()) as items:
            async for item in items:
                if isinstance(item, (RecordInvalid, StorageFailed)):
                    problems.append(str(item))
                elif item.input_kind != kind:
                    problems.append(
                        f"INPUT_KEY_MISMATCH: the record of {list(item.identity)} fingerprints "
                        f"inputs with {item.input_kind!r}, the location with {kind!r}"
                    )
        problems.extend(await self._store.check())
        return tuple(problems)

    async def sweep(self) -> SweepReport:
        observer = self._runner.observer
        with self._runner.span("sweep", None) as span:
            try:
                report = await self._sweep()
            except StorageFailed as failure:
                observer.failed("sweep", None, failure)
                raise
            marked, problems = len(report.marked), len(report.problems)
            span.set("outcome", "swept")
            span.set("marked", marked)
            span.set("problems", problems)
        observer.summary(
            "sweep",
            f"sweep marked {marked} records needs_review; {problems} problems",
            marked=marked,
            problems=problems,
        )
        return report

    async def _sweep(self) -> SweepReport:
        if ASYNC:
            self._runner.guard.check()
        alive = self._store.owner_alive
        why = self._store.gone_reason
        marked: list[RecordView] = []
        problems: list[JournalError] = []
        async with contextlib.aclosing(self._store.scan(status="started")) as records:
            async for record in records:
                if isinstance(record, (RecordInvalid, StorageFailed)):
                    problems.append(record)
                    continue
                if record.status != "started":
                    continue
                ident = record.identity
                try:
                    view = await self._runner.apply("sweep", ident, sweep_step(ident, alive, why))
                except (RecordInvalid, StorageFailed) as error:
                    problems.append(error)
                    continue
                if view is not None:
                    marked.append(view)
        return SweepReport(tuple(marked), tuple(problems))
