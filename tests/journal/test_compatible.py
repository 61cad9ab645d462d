"""One language of definitions, and ``compatible=`` for finished work (SPEC §1, §3).

Every form a definition may take (a digest, a version string, a callable) means the same
to ``begin`` and ``claim``; a call that declares earlier definitions compatible reuses a
``succeeded`` record made under one of them and leaves every other record as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from itemjournal import (
    Claim,
    ConflictError,
    InvalidArgument,
    Journal,
    RecordView,
    Reuse,
    definition_digest,
)

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

ITEM = ("shop", "billing", "charge", "order-1")
INPUTS = {"amount_cents": 1250, "currency": "EUR"}


async def charge_v3(order: str) -> str:
    return f"ch_{order}"


# What each form of the same definition looks like: the digest, and what stands for it.
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


async def settled(journal: Journal, status: str, definition: object = "billing-v3") -> Claim:
    """Leave ``ITEM`` in ``status`` (succeeded, started, needs_review or released),
    made under ``definition``."""
    claim = await journal.begin(ITEM, INPUTS, definition)  # type: ignore[arg-type]
    assert isinstance(claim, Claim)
    if status == "succeeded":
        await journal.complete(claim, "ch_3", result='{"paid": true}')
    elif status in ("needs_review", "released"):
        await journal.mark_review(ITEM, "gateway timeout")
        if status == "released":
            await journal.resolve(ITEM, retry=True, note="the provider shows no charge")
    return claim


async def refused(code: str, awaitable: Any) -> ConflictError:
    with pytest.raises(ConflictError) as caught:
        await awaitable
    assert caught.value.code == code
    assert isinstance(caught.value.view, RecordView)
    return caught.value


# ---------------------------------------------------------------- one language


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_begin_takes_every_form_of_a_definition(journal: Journal, form: str) -> None:
    claim = await journal.begin(ITEM, INPUTS, FORMS[form]())
    assert isinstance(claim, Claim)
    assert claim.definition_hash == DIGEST_OF[form]


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_claim_takes_every_form_of_a_definition(journal: Journal, form: str) -> None:
    async with journal.claim(ITEM, INPUTS, FORMS[form]()) as attempt:
        assert attempt.claim.definition_hash == DIGEST_OF[form]
        await attempt.complete("ch_1")
    async with journal.claim(ITEM, INPUTS, DIGEST_OF[form]) as again:
        assert again.reused
        assert again.receipt == "ch_1"


async def test_a_version_and_its_digest_are_one_definition(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    outcome = await journal.begin(ITEM, INPUTS, definition_digest("billing-v3"))
    assert isinstance(outcome, Reuse)
    assert outcome.receipt == "ch_3"


@pytest.mark.parametrize(
    ("definition", "code"),
    [
        ("A" * 64, "INVALID_HASH"),
        (definition_digest("billing-v3").upper(), "INVALID_HASH"),
        ("", "INVALID_HASH"),
        ("   ", "INVALID_HASH"),
        (3, "INVALID_HASH"),
        (object(), "INVALID_HASH"),
        (b"billing-v3", "INVALID_HASH"),
        (None, "INVALID_HASH"),
        (len, "INVALID_HASH"),  # a callable without source
    ],
)
async def test_invalid_definitions_are_refused_and_write_nothing(
    journal: Journal, definition: object, code: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await journal.begin(ITEM, INPUTS, definition)  # type: ignore[arg-type]
    assert caught.value.code == code
    with pytest.raises(InvalidArgument) as in_block:
        async with journal.claim(ITEM, INPUTS, definition):  # type: ignore[arg-type]
            pass
    assert in_block.value.code == code
    assert (await journal.inspect(ITEM)).status == "absent"


@pytest.mark.parametrize(
    ("compatible", "code"),
    [
        ("billing-v2", "INVALID_ARGUMENT"),  # a bare string, not a collection of them
        (definition_digest("billing-v2"), "INVALID_ARGUMENT"),
        (None, "INVALID_ARGUMENT"),
        (7, "INVALID_ARGUMENT"),
        (charge_v3, "INVALID_ARGUMENT"),
        (("billing-v2", 7), "INVALID_HASH"),
        (("B" * 64,), "INVALID_HASH"),
        (("",), "INVALID_HASH"),
    ],
)
async def test_invalid_compatible_definitions_are_refused_and_write_nothing(
    journal: Journal, compatible: object, code: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await journal.begin(ITEM, INPUTS, "billing-v4", compatible=compatible)  # type: ignore[arg-type]
    assert caught.value.code == code
    assert "compatible" in caught.value.message
    assert (await journal.inspect(ITEM)).status == "absent"


# ---------------------------------------------------------------- compatible=


async def test_succeeded_under_v3_is_reused_under_v4_compatible_with_v3(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    before = await journal.inspect(ITEM)
    outcome = await journal.begin(ITEM, INPUTS, "billing-v4", compatible=("billing-v3",))
    assert isinstance(outcome, Reuse)
    assert (outcome.receipt, outcome.result, outcome.executed_here) == (
        "ch_3",
        '{"paid": true}',
        False,
    )
    assert await journal.inspect(ITEM) == before  # a reuse writes nothing


async def test_the_claim_block_reuses_under_a_compatible_definition(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    async with journal.claim(
        ITEM, INPUTS, "billing-v4", compatible=["billing-v2", "billing-v3"]
    ) as attempt:
        assert attempt.reused
        assert (attempt.receipt, attempt.result) == ("ch_3", '{"paid": true}')


@pytest.mark.parametrize("form", sorted(FORMS))
async def test_compatible_takes_every_form(journal: Journal, form: str) -> None:
    await settled(journal, "succeeded", DIGEST_OF[form])
    outcome = await journal.begin(ITEM, INPUTS, "billing-v4", compatible=(FORMS[form](),))
    assert isinstance(outcome, Reuse)
    assert outcome.receipt == "ch_3"


async def test_succeeded_under_v2_is_refused_under_v4_compatible_with_v3(
    journal: Journal,
) -> None:
    await settled(journal, "succeeded", "billing-v2")
    error = await refused(
        "DEFINITION_CHANGED",
        journal.begin(ITEM, INPUTS, "billing-v4", compatible=("billing-v3",)),
    )
    assert error.view is not None and error.view.status == "succeeded"


async def test_the_refusal_of_a_succeeded_record_names_the_way_out(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    error = await refused("DEFINITION_CHANGED", journal.begin(ITEM, INPUTS, "billing-v4"))
    assert "compatible=" in str(error)
    assert definition_digest("billing-v3") in str(error)


@pytest.mark.parametrize(("status", "code"), [("started", "DEFINITION_CHANGED")])
async def test_a_started_record_is_not_affected(journal: Journal, status: str, code: str) -> None:
    await settled(journal, status, "billing-v3")
    before = await journal.inspect(ITEM)
    error = await refused(
        code, journal.begin(ITEM, INPUTS, "billing-v4", compatible=("billing-v3",))
    )
    assert "compatible=" not in str(error)
    assert await journal.inspect(ITEM) == before
    # and under its own definition, the usual answer: the work is in progress
    await refused("IN_PROGRESS", journal.begin(ITEM, INPUTS, "billing-v3"))


async def test_a_needs_review_record_is_not_affected(journal: Journal) -> None:
    await settled(journal, "needs_review", "billing-v3")
    before = await journal.inspect(ITEM)
    error = await refused(
        "DEFINITION_CHANGED",
        journal.begin(ITEM, INPUTS, "billing-v4", compatible=("billing-v3",)),
    )
    assert "compatible=" not in str(error)
    assert await journal.inspect(ITEM) == before
    await refused("REVIEW_REQUIRED", journal.begin(ITEM, INPUTS, "billing-v3"))


async def test_a_released_record_is_claimed_afresh_under_the_new_definition(
    journal: Journal,
) -> None:
    await settled(journal, "released", "billing-v3")
    claim = await journal.begin(ITEM, INPUTS, "billing-v4", compatible=("billing-v3",))
    assert isinstance(claim, Claim)
    assert claim.attempt == 2
    assert claim.definition_hash == definition_digest("billing-v4")


async def test_other_inputs_are_input_changed_whatever_is_compatible(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    await refused(
        "INPUT_CHANGED",
        journal.begin(ITEM, {"amount_cents": 990}, "billing-v4", compatible=("billing-v3",)),
    )


async def test_a_reuse_under_a_compatible_definition_may_wait(journal: Journal) -> None:
    await settled(journal, "succeeded", "billing-v3")
    outcome = await journal.begin(ITEM, INPUTS, "billing-v4", wait=1.0, compatible=("billing-v3",))
    assert isinstance(outcome, Reuse)
