"""The order in which a model's queued requests take replicas: strict priority classes, round-robin between the
keys (tenants) of a class, oldest first within a key."""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator


class Waiter:
    """A request queued for a replica: its priority class (``rank``, 0 first), its key, what it excludes, its
    body and when it started waiting (kv_aware's election reads them)."""

    __slots__ = ("rank", "key", "exclude", "body", "start", "wake")

    def __init__(self, rank: int, key: str, exclude: set[str], body: dict | None = None, start: float = 0.0):
        self.rank, self.key, self.exclude, self.body, self.start = rank, key, exclude, body, start
        self.wake: asyncio.Event | None = None   # set when it may take a replica now (ModelPool.notify)


class AdmissionQueue:
    """Who takes the next replica with room: strict priority classes, round-robin between the keys of a
    class, oldest first within a key."""

    def __init__(self) -> None:
        self.classes: dict[int, OrderedDict[str, deque[Waiter]]] = {}

    def add(self, w: Waiter) -> None:
        fifo = self.classes.setdefault(w.rank, OrderedDict()).setdefault(w.key, deque())
        if fifo and w.start < fifo[-1].start:   # (a held request back after its replica refused it: its place)
            fifo.insert(next(i for i, x in enumerate(fifo) if x.start > w.start), w)
        else:
            fifo.append(w)

    def head(self) -> Waiter | None:
        if not self.classes:
            return None
        keys = self.classes[min(self.classes)]
        return keys[next(iter(keys))][0]

    def first(self, limit: int) -> Iterator[Waiter]:
        """Up to ``limit`` waiters in serving order: classes by rank; within one, the keys' oldest in turn, then
        their second oldest, and so on."""
        n = 0
        for rank in sorted(self.classes):
            for row in itertools.zip_longest(*self.classes[rank].values()):
                for w in row:
                    if w is not None:
                        yield w
                        n += 1
                        if n >= limit:
                            return

    def remove(self, w: Waiter, served: bool) -> None:
        """``w`` leaves the queue; when it was served, its key goes to the back of its class."""
        keys = self.classes[w.rank]
        fifo = keys[w.key]
        fifo.remove(w)
        if not fifo:
            del keys[w.key]
            if not keys:
                del self.classes[w.rank]
        elif served:
            keys.move_to_end(w.key)
