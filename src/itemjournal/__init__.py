"""itemjournal: record the intent before an external effect, and how it ended.

Claim an item before a side effect; the journal makes the intent durable first,
then keeps the receipt you declare, or that the outcome needs review. A rerun
reuses the receipt, refuses unresolved work and notices changed inputs or code.
"""

# First of all: a platform the journal cannot keep its promise on is refused here, with
# the reason, before any module that needs fcntl, fork or /proc is imported.
from ._stores.registry import check_platform as _check_platform

_check_platform()


from ._homes.drain import Drain as Drain
from ._homes.drain import drain_on_signals as drain_on_signals
from ._homes.each import EachDone as EachDone
from ._homes.each import EachFailure as EachFailure
from ._homes.each import EachReport as EachReport
from ._homes.each import run_each as run_each
from ._homes.once import once as once
from ._journal.claim import Attempt as Attempt
from ._journal.claim import ClaimedAttempt as ClaimedAttempt
from ._journal.claim import ReusedAttempt as ReusedAttempt
from ._journal.journal import Journal as Journal
from ._journal.observe import JournalStatistics as JournalStatistics
from ._model.conflicts import ConflictError as ConflictError
from ._model.conflicts import UnresolvedClaim as UnresolvedClaim
from ._model.errors import InvalidArgument as InvalidArgument
from ._model.errors import JournalError as JournalError
from ._model.errors import RecordInvalid as RecordInvalid
from ._model.errors import StorageFailed as StorageFailed
from ._model.identity import Identity as Identity
from ._model.identity import definition_digest as definition_digest
from ._model.identity import identity_digest as identity_digest
from ._model.identity import input_digest as input_digest
from ._model.identity import label as label
from ._model.records import Event as Event
from ._model.records import Owner as Owner
from ._model.verdicts import Check as Check
from ._model.verdicts import DidNotHappen as DidNotHappen
from ._model.verdicts import Happened as Happened
from ._model.verdicts import ReconcileReport as ReconcileReport
from ._model.verdicts import Unknown as Unknown
from ._model.view import Claim as Claim
from ._model.view import PruneReport as PruneReport
from ._model.view import RecordView as RecordView
from ._model.view import Reuse as Reuse
from ._model.view import SweepReport as SweepReport
from ._model.withdrawal import Withdraw as Withdraw
from ._stores.fileio import FileSystem as FileSystem
from ._stores.files.store import FileStore as FileStore
from ._stores.seam import Step as Step
from ._stores.seam import Store as Store
from ._stores.sqlite.store import SQLiteStore as SQLiteStore

__all__ = [
    "Attempt",
    "Check",
    "Claim",
    "ClaimedAttempt",
    "ConflictError",
    "DidNotHappen",
    "Drain",
    "EachDone",
    "EachFailure",
    "EachReport",
    "Event",
    "FileStore",
    "FileSystem",
    "Happened",
    "Identity",
    "InvalidArgument",
    "Journal",
    "JournalError",
    "JournalStatistics",
    "Owner",
    "PruneReport",
    "ReconcileReport",
    "RecordInvalid",
    "RecordView",
    "Reuse",
    "ReusedAttempt",
    "SQLiteStore",
    "Step",
    "StorageFailed",
    "Store",
    "SweepReport",
    "Unknown",
    "UnresolvedClaim",
    "Withdraw",
    "definition_digest",
    "drain_on_signals",
    "identity_digest",
    "input_digest",
    "label",
    "once",
    "run_each",
]

# A traceback names an error as users import it (``itemjournal.ConflictError: …``), not by
# the private module that defines it; pickle finds it under the same name.
_ERRORS = (ConflictError, InvalidArgument, JournalError, RecordInvalid, StorageFailed)
for _error in (*_ERRORS, UnresolvedClaim, Withdraw):
    _error.__module__ = __name__
del _error, _ERRORS

__version__ = "0.1.0"
