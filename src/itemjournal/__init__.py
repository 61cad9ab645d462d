"""itemjournal: record the intent before an external effect, and how it ended.

Claim an item before a side effect; the journal makes the intent durable first,
then keeps the receipt you declare, or that the outcome needs review. A rerun
reuses the receipt, refuses unresolved work and notices changed inputs or code.
"""

# First of all: a platform the journal cannot keep its promise on is refused here, with
# the reason, before any module that needs fcntl, fork or /proc is imported.
from ._locations import check_platform as _check_platform

_check_platform()


from ._each import EachDone as EachDone
from ._each import EachFailure as EachFailure
from ._each import EachReport as EachReport
from ._each import run_each as run_each
from ._errors import ConflictError as ConflictError
from ._errors import InvalidArgument as InvalidArgument
from ._errors import JournalError as JournalError
from ._errors import RecordInvalid as RecordInvalid
from ._errors import StorageFailed as StorageFailed
from ._errors import UnresolvedClaim as UnresolvedClaim
from ._fileio import FileSystem as FileSystem
from ._filestore import FileStore as FileStore
from ._identity import Identity as Identity
from ._identity import definition_digest as definition_digest
from ._identity import input_digest as input_digest
from ._journal import Attempt as Attempt
from ._journal import Journal as Journal
from ._observe import JournalStatistics as JournalStatistics
from ._once import once as once
from ._reconcile import DidNotHappen as DidNotHappen
from ._reconcile import Happened as Happened
from ._reconcile import ReconcileReport as ReconcileReport
from ._reconcile import Unknown as Unknown
from ._records import Event as Event
from ._records import Owner as Owner
from ._sqlitestore import SQLiteStore as SQLiteStore
from ._store import Step as Step
from ._store import Store as Store
from ._view import Claim as Claim
from ._view import PruneReport as PruneReport
from ._view import RecordView as RecordView
from ._view import Reuse as Reuse
from ._view import SweepReport as SweepReport

__all__ = [
    "Attempt",
    "Claim",
    "ConflictError",
    "DidNotHappen",
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
    "SQLiteStore",
    "Step",
    "StorageFailed",
    "Store",
    "SweepReport",
    "Unknown",
    "UnresolvedClaim",
    "definition_digest",
    "input_digest",
    "once",
    "run_each",
]

__version__ = "0.1.0"
