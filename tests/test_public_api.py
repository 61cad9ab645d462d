"""The public surface: ``__all__`` is honest and every name is documented."""

from __future__ import annotations

import types

import itemjournal


def test_all_is_honest() -> None:
    exported = set(itemjournal.__all__)
    public = {
        name
        for name, value in vars(itemjournal).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }  # public submodules (itemjournal.testing) are not names of the package itself
    assert exported == public
    assert itemjournal.__all__ == sorted(itemjournal.__all__)
    for name in exported:
        value = getattr(itemjournal, name)
        assert getattr(value, "__doc__", None), f"{name} has no docstring"


def test_public_names_of_the_contract() -> None:
    for name in (
        "Journal",
        "Identity",
        "Claim",
        "Reuse",
        "RecordView",
        "JournalError",
        "JournalStatistics",
        "UnresolvedClaim",
        "input_digest",
        "definition_digest",
    ):
        assert name in itemjournal.__all__
    assert itemjournal.Identity._fields == ("scope", "program", "job", "item")
