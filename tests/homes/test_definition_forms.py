"""``once`` and ``run_each`` speak the journal's one language of definitions: a digest, a
version string or a callable, with the digest ``definition_digest`` gives; and both take
``compatible=`` as ``begin`` does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    Reuse,
    definition_digest,
    once,
    run_each,
)

pytestmark = pytest.mark.anyio

ITEM = Identity("shop", "billing", "charge", "A-1")


def ident(item: int) -> Identity:
    return Identity("shop", "billing", "charge", f"A-{item}")


async def charge_v3(item: int, claim: Claim) -> str:
    return f"ch-{item}"


FORMS: dict[str, Callable[[], Any]] = {
    "digest": lambda: definition_digest("billing-v3"),
    "version": lambda: "billing-v3",
    "callable": lambda: charge_v3,
}
DIGEST_OF = {
    "digest": definition_digest("billing-v3"),
    "version": definition_digest("billing-v3"),
    "callable": definition_digest(charge_v3),
}


class Calls:
    def __init__(self) -> None:
        self.count = 0


async def succeeded_under(journal: Journal, identity: Identity, definition: str) -> None:
    claim = await journal.begin(identity, {}, definition)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "ch-old", result="old")


async def made_under(journal: Journal, identity: Identity, digest: str) -> bool:
    """Whether the record of ``identity`` is reused under exactly ``digest``."""
    return isinstance(await journal.begin(identity, {}, digest), Reuse)


# ---------------------------------------------------------------- once


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_once_takes_every_form_with_its_digest(journal: Journal, form: str) -> None:
    @once(journal, identity=ITEM, definition=FORMS[form]())
    async def charge() -> str:
        return "ch-1"

    assert await charge() == "ch-1"
    assert await made_under(journal, ITEM, DIGEST_OF[form])


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_once_reuses_under_a_compatible_definition(journal: Journal, form: str) -> None:
    await succeeded_under(journal, ITEM, DIGEST_OF[form])
    calls = Calls()

    @once(journal, identity=ITEM, definition="billing-v4", compatible=(FORMS[form](),))
    async def charge() -> tuple[str, str | None]:
        calls.count += 1
        return "ch-new", None

    assert await charge() == ("ch-old", "old")
    assert calls.count == 0


async def test_once_refuses_a_record_of_a_definition_not_declared(journal: Journal) -> None:
    await succeeded_under(journal, ITEM, definition_digest("billing-v2"))
    calls = Calls()

    @once(journal, identity=ITEM, definition="billing-v4", compatible=("billing-v3",))
    async def charge() -> str:
        calls.count += 1
        return "ch-new"

    with pytest.raises(ConflictError) as caught:
        await charge()
    assert caught.value.code == "DEFINITION_CHANGED"
    assert "compatible=" in str(caught.value)
    assert calls.count == 0


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"definition": object()}, "INVALID_HASH"),
        ({"definition": "Ab" * 32}, "INVALID_HASH"),
        ({"compatible": "billing-v3"}, "INVALID_ARGUMENT"),
        ({"compatible": None}, "INVALID_ARGUMENT"),
        ({"compatible": (3,)}, "INVALID_HASH"),
        ({"compatible": ("",)}, "INVALID_HASH"),
    ],
)
async def test_once_refuses_bad_definitions_when_decorating(
    journal: Journal, options: dict[str, Any], code: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        once(journal, identity=ITEM, **options)
    assert caught.value.code == code


async def test_once_a_compatible_callable_without_source_fails_the_call_first(
    journal: Journal,
) -> None:
    namespace: dict[str, Any] = {}
    exec("async def generated() -> str:\n    return 'ch-1'\n", namespace)

    @once(journal, identity=ITEM, definition="billing-v4", compatible=(namespace["generated"],))
    async def charge() -> str:
        return "ch-1"

    with pytest.raises(InvalidArgument) as caught:
        await charge()
    assert caught.value.code == "INVALID_HASH"
    assert (await journal.inspect(ITEM)).status == "absent"


# ---------------------------------------------------------------- run_each


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_run_each_takes_every_form_with_its_digest(journal: Journal, form: str) -> None:
    report = await run_each(
        journal, range(2), charge_v3, identity=ident, definition=FORMS[form](), limit=2
    )
    assert len(report.succeeded) == 2
    assert await made_under(journal, ident(0), DIGEST_OF[form])
    assert await made_under(journal, ident(1), DIGEST_OF[form])


async def test_run_each_by_default_is_the_digest_of_its_function(journal: Journal) -> None:
    await run_each(journal, range(1), charge_v3, identity=ident, limit=1)
    assert await made_under(journal, ident(0), DIGEST_OF["callable"])


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_run_each_reuses_under_a_compatible_definition(journal: Journal, form: str) -> None:
    await succeeded_under(journal, ident(0), DIGEST_OF[form])
    await succeeded_under(journal, ident(1), definition_digest("billing-v2"))
    report = await run_each(
        journal,
        range(3),
        charge_v3,
        identity=ident,
        definition="billing-v4",
        compatible=[FORMS[form]()],
        limit=2,
    )
    assert [(done.identity, done.receipt, done.result) for done in report.reused] == [
        (ident(0), "ch-old", "old")
    ]
    assert [failure.code for failure in report.refused] == ["DEFINITION_CHANGED"]
    assert [done.identity for done in report.succeeded] == [ident(2)]
    assert await made_under(journal, ident(2), definition_digest("billing-v4"))


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"definition": object()}, "INVALID_HASH"),
        ({"compatible": "billing-v3"}, "INVALID_ARGUMENT"),
        ({"compatible": (3,)}, "INVALID_HASH"),
    ],
)
async def test_run_each_refuses_bad_definitions_before_any_item(
    journal: Journal, options: dict[str, Any], code: str
) -> None:
    calls = Calls()

    async def counted(item: int, claim: Claim) -> str:
        calls.count += 1
        return "ch"

    with pytest.raises(InvalidArgument) as caught:
        await run_each(journal, range(2), counted, identity=ident, limit=1, **options)
    assert caught.value.code == code
    assert calls.count == 0
    assert (await journal.inspect(ident(0))).status == "absent"
