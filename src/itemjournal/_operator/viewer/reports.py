"""What the serving viewer logs about abuse: each cause once, then a count.

A flood of slow or broken connections repeats the same event thousands of times a
second (a connection cut at its deadline, ``accept`` out of files, a malformed request).
Logging each one would fill the disk with the same line; logging none would hide the
attack. ``Reports`` logs the first of each cause at once, counts the rest, and logs the
count at most once per interval (and when the viewer stops).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["REPORT_INTERVAL", "Reports"]

REPORT_INTERVAL: Final = 60.0
# Set on the records ``Reports`` emits, so that its own filter lets them through.
_MARK: Final = "itemjournal_report"


@dataclasses.dataclass
class _Cause:
    level: int
    since: float  # when the count below began
    count: int = 0  # occurrences since ``since`` not yet logged


class Reports:
    """Each cause logged once, then counted (``logger``: where the lines go)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = REPORT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self.causes: dict[str, _Cause] = {}
        # How to run a function later (the event loop's ``call_later``), so that a count
        # is logged when its interval ends even if nothing more happens; None: counts
        # are logged at the next occurrence after the interval, and by ``flush``.
        self.later: Callable[[float, Callable[[], None]], Any] | None = None
        self._due: float | None = None  # when the scheduled ``_log_due`` runs

    def report(self, level: int, cause: str) -> bool:
        """One more occurrence of ``cause``: logged if it is the first, else counted (and
        the count logged when the interval has passed). True when it was the first."""
        now = self.clock()
        known = self.causes.get(cause)
        if known is None:
            self.causes[cause] = _Cause(level, now)
            self.logger.log(
                level,
                "%s (repeats are counted and logged at most every %.0f s)",
                cause,
                self.interval,
                extra={_MARK: True},
            )
            return True
        known.count += 1
        if now - known.since >= self.interval:
            self._log_count(cause, known, now)
        else:
            self._schedule(known.since + self.interval)
        return False

    def flush(self) -> None:
        """Log every count not yet logged (when the viewer stops)."""
        now = self.clock()
        for cause, known in self.causes.items():
            if known.count:
                self._log_count(cause, known, now)

    def _schedule(self, when: float) -> None:
        if self.later is None or (self._due is not None and self._due <= when):
            return
        self._due = when
        self.later(max(0.0, when - self.clock()), self._log_due)

    def _log_due(self) -> None:
        """Log the counts whose interval has ended; come back for the others."""
        now = self.clock()
        self._due = None
        for cause, known in self.causes.items():
            if not known.count:
                continue
            if now - known.since >= self.interval:
                self._log_count(cause, known, now)
            else:
                self._schedule(known.since + self.interval)

    def _log_count(self, cause: str, known: _Cause, now: float) -> None:
        self.logger.log(
            known.level,
            "%s: %d more in the last %.0f s",
            cause,
            known.count,
            now - known.since,
            extra={_MARK: True},
        )
        known.count = 0
        known.since = now

    def filter(self) -> logging.Filter:
        """A filter for another logger (the server's, asyncio's): its warnings and errors
        pass through ``report``, so each message is logged once (with its traceback, if
        it has one) and its repeats are counted."""
        return _Collapse(self)


class _Collapse(logging.Filter):
    def __init__(self, reports: Reports) -> None:
        super().__init__()
        self.reports = reports

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, _MARK, False):
            return True
        cause = f"{record.name}: {record.msg}"
        if record.exc_info and record.exc_info[0] is not None:
            cause += f" ({record.exc_info[0].__name__})"
        known = self.reports.causes.get(cause)
        if known is None:
            # The first is logged as it is, so its traceback (if any) is seen once.
            self.reports.causes[cause] = _Cause(record.levelno, self.reports.clock())
            return True
        self.reports.report(record.levelno, cause)
        return False
