"""on_loop: work done in a thread hands the loop's state changes to the loop (a batch's end charging its owner
in the usage ledger, whose counters the loop changes with every request)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orchestrator.fleet.onloop import on_loop


async def test_a_call_from_a_thread_runs_on_the_loops_thread_and_one_on_the_loop_at_once():
    loop = asyncio.get_running_loop()
    here = threading.get_ident()
    ran: list[int] = []

    def fn() -> str:
        ran.append(threading.get_ident())
        return "written"
    assert await asyncio.to_thread(on_loop, loop, fn, "no") == "written"
    assert on_loop(loop, fn, "no") == "written"
    assert ran == [here, here]

    def boom() -> None:
        raise ValueError("the ledger's own error")
    with pytest.raises(ValueError, match="own error"):
        await asyncio.to_thread(on_loop, loop, boom, None)


def test_a_loop_that_does_not_get_to_it_or_has_closed_gives_the_default_and_runs_nothing():
    ran: list[str] = []
    loop = asyncio.new_event_loop()   # (not running: as a stopping daemon's loop blocked on this thread)
    try:
        assert on_loop(loop, lambda: ran.append("x"), False, timeout_s=0.2) is False
    finally:
        loop.close()
    assert on_loop(loop, lambda: ran.append("y"), False, timeout_s=0.2) is False
    assert ran == []
