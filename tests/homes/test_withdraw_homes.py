"""``raise Withdraw(reason)`` from a ``once`` function and a ``run_each`` function: the
claim is withdrawn (released, event ``withdrawn``), the exception goes on (``once``) or is
reported (``run_each``'s ``withdrawn`` list), and the next call runs the function again."""

from __future__ import annotations

import pytest

from itemjournal import (
    Claim,
    EachDone,
    EachFailure,
    EachReport,
    Identity,
    Journal,
    Withdraw,
    once,
    run_each,
)

pytestmark = pytest.mark.anyio


def ident(item: int | str) -> Identity:
    return Identity("shop", "mail", "send", f"item-{item}")


async def test_withdraw_from_a_once_function_releases_and_the_next_call_runs(
    journal: Journal,
) -> None:
    calls: list[str] = []
    blocked = {"bob"}

    @once(journal, identity=ident, definition="welcome-v1")
    async def welcome(user: str) -> str:
        calls.append(user)
        if user in blocked:
            raise Withdraw(f"{user} has not confirmed the address yet")
        return f"msg-{user}-{len(calls)}"

    with pytest.raises(Withdraw, match="bob has not confirmed"):
        await welcome("bob")
    view = await journal.inspect(ident("bob"))
    assert view.status == "released"
    assert [event.event for event in view.history] == ["begin", "withdrawn"]
    assert view.history[-1].note == "bob has not confirmed the address yet"

    blocked.clear()
    assert await welcome("bob") == "msg-bob-2"  # a fresh claim: the function ran again
    assert await welcome("bob") == "msg-bob-2"  # and now it is reused
    assert calls == ["bob", "bob"]
    view = await journal.inspect(ident("bob"))
    assert (view.status, view.attempt) == ("succeeded", 2)


async def test_withdraw_from_a_run_each_function_is_reported_as_withdrawn(
    journal: Journal,
) -> None:
    calls: list[int] = []
    not_ready = {2, 5}

    async def send(item: int, claim: Claim) -> str:
        calls.append(item)
        if item in not_ready:
            raise Withdraw(f"item {item} has no address yet")
        if item == 7:
            raise RuntimeError("provider timed out")
        return f"msg-{item}"

    report = await run_each(journal, range(8), send, identity=ident, definition="send-v1", limit=3)
    assert [done.item for done in report.succeeded] == [0, 1, 3, 4, 6]
    assert [failure.item for failure in report.failed] == [7]
    assert [entry.item for entry in report.withdrawn] == [2, 5]
    for entry in report.withdrawn:
        assert isinstance(entry, EachFailure)
        assert isinstance(entry.error, Withdraw)
        assert entry.identity == ident(entry.item)
        assert entry.view is not None and entry.view.status == "released"
        assert entry.view.history[-1].event == "withdrawn"
        assert entry.view.history[-1].note == f"item {entry.item} has no address yet"
    assert report.total == 8
    assert not report.ok
    assert report.counts() == {
        "succeeded": 5,
        "reused": 0,
        "failed": 1,
        "refused": 0,
        "withdrawn": 2,
    }
    assert report.summary() == ("8 items: 5 succeeded, 0 reused, 1 failed, 0 refused, 2 withdrawn")
    assert (await journal.inspect(ident(7))).status == "needs_review"

    not_ready.clear()
    calls.clear()
    again = await run_each(journal, range(8), send, identity=ident, definition="send-v1", limit=3)
    assert sorted(calls) == [2, 5]  # only the withdrawn items ran again, under fresh claims
    assert [done.item for done in again.succeeded] == [2, 5]
    assert [(await journal.inspect(ident(item))).attempt for item in (2, 5)] == [2, 2]
    assert again.withdrawn == ()
    assert "withdrawn" not in again.counts()  # shown only when an item was withdrawn
    assert again.summary() == "8 items: 2 succeeded, 5 reused, 0 failed, 1 refused"


def test_an_each_report_counts_withdrawn_items() -> None:
    withdrawn = EachFailure("x", ident("x"), Withdraw("not yet"))
    report: EachReport[str] = EachReport(
        succeeded=(EachDone("a", ident("a"), "r"),), withdrawn=(withdrawn,)
    )
    assert report.total == 2
    assert not report.ok
    assert report.summary() == "2 items: 1 succeeded, 0 reused, 0 failed, 0 refused, 1 withdrawn"
