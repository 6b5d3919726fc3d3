"""A file call made to hang (a state dir on a stalled NFS or Lustre mount), and a watch of the event loop meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

CAP_S = 3.0   # the longest a stuck call waits: code that makes it on the event loop holds the loop that long, no more


class Stuck:
    def __init__(self) -> None:
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    def wait(self) -> None:
        """Called where the file work would be: waits until released (``CAP_S`` at most)."""
        self.calls += 1
        self.entered.set()
        self.release.wait(CAP_S)

    async def longest_gap(self, watch_s: float = 0.3) -> float:
        """The longest the event loop left a 20 ms sleep waiting, from now until ``watch_s`` after the call got
        stuck (on the loop, the stuck call holds it ``CAP_S``)."""
        gap, last, end = 0.0, time.monotonic(), time.monotonic() + 2 * CAP_S
        while (now := time.monotonic()) < end:
            if self.entered.is_set() and end - now > watch_s:
                end = now + watch_s
            await asyncio.sleep(0.02)
            gap, last = max(gap, time.monotonic() - last), time.monotonic()
        assert self.entered.is_set(), "the file call was never made"
        return gap


def stall(monkeypatch, cls, name: str) -> Stuck:
    """``cls.name`` made to hang (until released, ``CAP_S`` at most) before it does its work."""
    stuck, real = Stuck(), getattr(cls, name)

    def stalled(self, *args, **kw):
        stuck.wait()
        return real(self, *args, **kw)
    monkeypatch.setattr(cls, name, stalled)
    return stuck


def asked_while_stalled(h, stuck: Stuck, ask) -> tuple[float, list]:
    """``ask()`` from a client thread while the harness ``h``'s event loop is watched: (the loop's longest stand,
    once the stalled call was made; what ``ask`` answered, once released)."""
    got: list = []
    client = threading.Thread(target=lambda: got.append(ask()))
    client.start()
    gap = h.call(stuck.longest_gap())
    stuck.release.set()
    client.join(30)
    return gap, got
