"""A call made from a worker thread that must run on the event loop: state the loop alone changes (the usage
ledger's counters and charges), asked for by work done in a thread (a batch's end, :mod:`.batchend`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], default: T, timeout_s: float = 30.0) -> T:
    """``fn()`` on ``loop``: at once on the loop's own thread, else handed to it and waited for, at most
    ``timeout_s``; ``default`` when the loop has closed or did not get to it (a stopping daemon's loop that waits
    for this thread), and then ``fn`` does not run."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:   # (no loop in this thread)
        here = False
    if here:
        return fn()
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as exc:   # (the caller's to see, in its thread)
                fut.set_exception(exc)
    try:
        loop.call_soon_threadsafe(call)
        return fut.result(timeout_s)
    except RuntimeError:   # the loop has closed
        return default
    except concurrent.futures.TimeoutError:
        if fut.cancel():   # (not started: it never will)
            return default
        return fut.result()   # (started on the loop meanwhile: its result)
