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


def test_a_traceback_names_an_error_as_users_import_it() -> None:
    """``itemjournal.ConflictError: …``, not the private module it is defined in."""
    import pickle
    import traceback

    errors = [
        value
        for name in itemjournal.__all__
        if isinstance(value := getattr(itemjournal, name), type)
        and issubclass(value, BaseException)
    ]
    assert {error.__name__ for error in errors} >= {
        "JournalError",
        "ConflictError",
        "StorageFailed",
    }
    for error in errors:
        assert error.__module__ == "itemjournal", error
        assert pickle.loads(pickle.dumps(error)) is error
    shown = traceback.format_exception_only(
        itemjournal.InvalidArgument("bad", code="INVALID_LABEL")
    )
    assert shown[-1].startswith("itemjournal.InvalidArgument: "), shown


def test_an_error_of_a_public_module_is_named_by_that_module() -> None:
    import importlib

    modules = ["sync", "testing", "asgi", "wsgi", "celery", "faststream", "mcp", "otel"]
    owners: dict[type, list[str]] = {}
    for name in modules:
        module = importlib.import_module(f"itemjournal.{name}")
        for exported in module.__all__:
            value = getattr(module, exported)
            if isinstance(value, type) and issubclass(value, BaseException):
                owners.setdefault(value, []).append(module.__name__)
    assert owners, "no public module exports an error"
    for error, where in owners.items():
        if len(where) == 1 and error.__module__ != "itemjournal":
            assert error.__module__ == where[0], (error, where)
