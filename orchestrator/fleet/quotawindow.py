"""The rpm and tpm windows across a daemon's restart: what each key used in the last minute, written with the usage
ledger's counters (table ``quota_window`` of ``usage.sqlite3``, in each flush's transaction) and read back by
the next daemon, so a restart does not give every key a fresh minute.

Rows: (key, the whole second it was used in, wall clock; requests, tokens), for keys with an ``rpm`` or a ``tpm``
only, from the :class:`~.quota.QuotaBook`'s samples (every process, live or gone, this daemon's and the last's).
At start they become the samples of one more process that is gone (:data:`LAST_DAEMON`), on this daemon's clock:
:func:`~.quota.allocate` counts them in the window until they leave it, as it counts a dead worker's.  What the
last daemon counted after its last flush (about 2 s with a SIGKILL) is not in them.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Callable, Mapping

from .quota import WINDOW_S, ZERO, Limits, QuotaBook, Sample

LAST_DAEMON = (-1, "last-daemon")   # (process, incarnation) of what the last daemon's processes used
SCHEMA = """
CREATE TABLE IF NOT EXISTS quota_window (
    key TEXT NOT NULL,
    at INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (key, at)
) WITHOUT ROWID
"""


class QuotaWindow:
    """The ledger's ``extra`` (:meth:`~.usage.UsageLedger.attach`) that keeps the rpm and tpm windows.  A sample's
    second is its clock time plus one offset taken at the start (so a row stays the same row from flush to flush,
    and each flush writes only the rows that changed)."""

    def __init__(self, book: QuotaBook, limits: Callable[[], Mapping[str, Limits]], clock: Callable[[], float],
                 wall: Callable[[], float]):
        self.book, self.limits, self.clock, self.wall = book, limits, clock, wall
        self.offset = wall() - clock()   # this clock -> the wall clock
        self._stored: frozenset = frozenset()
        self._rows: frozenset = frozenset()
        self.loaded = False    # the last daemon's rows read (until then nothing is written over them)

    def rows(self) -> frozenset[tuple[str, int, int, int]]:
        """(key, second, requests, tokens) used in the last window by each key with a rate limit."""
        start = self.clock() - WINDOW_S
        keys = {k for k, lim in self.limits().items() if lim.rpm is not None or lim.tpm is not None}
        out: dict[tuple[str, int], list[int]] = {}
        for per_key in self.book.history.values():
            for key in keys & per_key.keys():
                prev = ZERO   # (an incarnation's counters start at zero; the last sample before the window is its base)
                for s in per_key[key]:
                    if s.t > start:
                        req = s.requests - prev.requests if s.requests >= prev.requests else s.requests
                        tok = s.tokens - prev.tokens if s.tokens >= prev.tokens else s.tokens
                        if req or tok:
                            row = out.setdefault((key, int(s.t + self.offset)), [0, 0])
                            row[0] += req
                            row[1] += tok
                    prev = s
        return frozenset((k, at, r, t) for (k, at), (r, t) in out.items())

    @property
    def dirty(self) -> bool:
        if not self.loaded:
            return False
        self._rows = self.rows()
        return self._rows != self._stored

    def write(self, db: sqlite3.Connection) -> None:
        """In the flush's transaction: the rows that changed since the last write (a second gone out of the
        window, a new one, a second's counts that grew); all of them to a file that lacks what the last write
        left (a new one: the old was moved away)."""
        db.execute(SCHEMA)
        if db.execute("SELECT COUNT(*) FROM quota_window").fetchone()[0] != len(self._stored):
            db.execute("DELETE FROM quota_window")
            self._stored = frozenset()
        db.executemany("DELETE FROM quota_window WHERE key = ? AND at = ?",
                       [(k, at) for k, at, *_ in self._stored - self._rows])
        db.executemany("INSERT OR REPLACE INTO quota_window VALUES (?, ?, ?, ?)", sorted(self._rows - self._stored))

    def written(self) -> None:
        self._stored = self._rows

    def load(self, db: sqlite3.Connection) -> None:
        """At start: the last daemon's use in the window, as one gone process's samples on this clock (what is out
        of it is deleted: older, or ahead of this wall clock, which went back since)."""
        wall = self.wall()
        lo, hi = int(wall - WINDOW_S) - 1, int(wall) + 1
        with db:
            db.execute(SCHEMA)
            db.execute("DELETE FROM quota_window WHERE at <= ? OR at > ?", (lo, hi))
            rows = db.execute("SELECT key, at, requests, tokens FROM quota_window ORDER BY key, at").fetchall()
        keys: dict[str, deque[Sample]] = {}
        now = self.clock()
        for key, at, req, tok in rows:
            # the middle of its second (the same second when written back), never after now (a use in the window
            # leaves it within one window: a Retry-After of at most the window)
            t = min(at - self.offset + 0.5, now)
            samples = keys.setdefault(key, deque([Sample(t - 1.0)]))   # (the base: nothing used)
            last = samples[-1]
            samples.append(Sample(t, last.requests + req, last.tokens + tok))
        if keys:
            self.book.history[LAST_DAEMON] = keys
        self.loaded = True
        self._stored = frozenset((k, at, r, tk) for k, at, r, tk in rows)
