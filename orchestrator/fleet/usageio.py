"""The usage ledger's file work off the event loop: its own thread, one write out at a time.

The ledger's file (``<state_dir>/usage.sqlite3``) is on the state dir, shared with the compute nodes (NFS, Lustre),
which can stall for seconds or hang.  Its flush every 2 s ran on the daemon's event loop, and a stalled mount
stalled every client of a gateway in the daemon's process with it.  A flush now takes what it writes out of memory
on the loop (:class:`Job`: the counters go on there meanwhile), writes it in the ledger's own thread, and lands
what it did on the loop again (:class:`Written`: what it wrote is forgotten, what it could not waits again).  One
write is out at a time: a flush while one is out is skipped (its rows wait for the next), not queued behind a hung
mount.  The connection is used by one thread at a time (:attr:`Io.lock`); a read on the loop while a write is out
waits for it a few milliseconds, then does without (as when the file cannot be read).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import sqlite3
from collections.abc import Callable

from .usageschema import HOUR_S, UPSERT, hour_bucket

log = logging.getLogger("slurmfleet.usage")


class Busy(Exception):
    """A write is out in the ledger's thread: the file is not read on the loop now."""


@dataclasses.dataclass
class Job:
    now: float
    pending: dict    # (hour, key, group, model) -> [requests, prompt, completion] to add
    dirty: dict      # (incarnation, key) -> the counters booked (table ``seen``)
    live: list       # (now, incarnation): the live workers' ``seen`` rows made recent
    extras: list     # the attached rows to write (``write(db)``, then ``written()``)
    charges: dict    # the charges by reference taken (:meth:`.usagecharges.Charges.take`)
    purge: bool      # the stale rows purged with the charges


@dataclasses.dataclass
class Written:
    ok: bool        # all of it is in the file
    charges: bool   # its charges are
    added: list     # what its charges added that was not counted in memory yet


class Io:
    def __init__(self) -> None:
        self.lock = threading.Lock()   # held while the connection is used
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.out: tuple[Job, concurrent.futures.Future] | None = None   # the write out, until landed
        self.owner, self.since = 0, 0.0   # the loop's thread that started it, when
        self._landing = threading.Lock()   # (a write is landed once: the loop's callback, or a last flush's thread)

    def run(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """``fn()`` in the ledger's thread (after the write out, if one is)."""
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slurmfleet-usage")
        return self.pool.submit(fn)

    def start(self, job: Job, write: Callable[[Job], Written], land: Callable[[], None]) -> None:
        """``write(job)`` in the ledger's thread; ``land()`` on this event loop once it is done."""
        loop = asyncio.get_running_loop()
        fut = self.run(lambda: write(job))
        self.out, self.owner, self.since = (job, fut), threading.get_ident(), time.monotonic()

        def back(_fut: concurrent.futures.Future) -> None:
            try:
                loop.call_soon_threadsafe(land)
            except RuntimeError:   # (the loop has closed: the next flush, on a thread, lands it)
                pass
        fut.add_done_callback(back)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether no write is out but one done, once waited for ``timeout_s`` (None: for as long as it takes)."""
        if self.out is None:
            return True
        return bool(concurrent.futures.wait([self.out[1]], timeout_s)[0])

    def done(self) -> tuple[Job, Written] | None:
        """The write out, once done, with what it did; once (then there is none out)."""
        with self._landing:
            if self.out is None or not self.out[1].done():
                return None
            (job, fut), self.out = self.out, None
        try:
            return job, fut.result()
        except Exception:  # noqa: BLE001 - what it held waits again
            log.exception("usage ledger: a write failed")
            return job, Written(False, False, [])

    def rows(self) -> int:
        """The rows of the write out (not in the file yet)."""
        return len(self.out[0].pending) + len(self.out[0].charges) if self.out is not None else 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class OffLoop:
    """The usage ledger's flush (:class:`.usage.UsageLedger`) in three steps: taken on the loop, written in the
    ledger's thread (or the caller's, by :meth:`.usage.UsageLedger.flush`), landed on the loop."""

    def flush_soon(self) -> None:
        """:meth:`flush` on the event loop: what to write taken out of memory here, written in the ledger's own
        thread (a state dir stalled on NFS or Lustre holds that thread, not the loop), landed here again; nothing
        while the last one is out (no second write queued behind a hung mount)."""
        if not self._free(0.0):
            return
        if (job := self._take()) is not None:
            self.io.start(job, self._write, self._land_out)

    def _take(self) -> Job | None:
        """What the next write holds, taken out of memory (the counters go on here meanwhile)."""
        now = self.clock()
        # hourly, every live worker's rows are made recent (a row is rewritten only when its counters move): only
        # a dead worker's age out of `seen`; an idle key's row of a live one was purged, its spool booked again
        live = [(now, inc) for incs in self._seen.values() for inc in incs] if now >= self._refresh_at else []
        self._load_extras()
        extras = [x for x in self.extras if x.dirty]
        if not self._pending and not self._dirty and not live and not extras and not self._charges.waiting:
            return None
        job = Job(now, self._pending, self._dirty, live, extras, self._charges.take(), now >= self._purge_at)
        self._pending, self._dirty = {}, {}
        return job

    def _write(self, job: Job) -> Written:
        """The file work of a write (the ledger's thread's, or the caller's): the charges in a transaction, then
        the rest in one."""
        with self.io.lock:
            added: list = []
            if job.charges:
                try:
                    db = self._connect()
                    with db:
                        added = self._charges.write(job.charges, db, UPSERT, lambda hour: hour_bucket(hour * HOUR_S))
                        if job.purge:   # (hourly, with the writes that make the rows)
                            self._purge_stale(db)
                except (sqlite3.Error, OSError) as exc:
                    self._failed("write", exc)
                    return Written(False, False, [])
            if not job.pending and not job.dirty and not job.live and not job.extras:
                return Written(True, True, added)
            rows = [(h, k, g or "", m, r[0], r[1], r[2]) for (h, k, g, m), r in job.pending.items()]
            seen = [(inc, key, model, *c, job.now) for (inc, key), u in job.dirty.items()
                    for model, c in u.models.items()]
            try:
                db = self._connect()
                with db:
                    db.executemany(UPSERT, rows)
                    db.executemany("INSERT OR REPLACE INTO seen VALUES (?, ?, ?, ?, ?, ?, ?)", seen)
                    db.executemany("UPDATE seen SET at = ? WHERE incarnation = ?", job.live)
                    for x in job.extras:
                        x.write(db)
            except (sqlite3.Error, OSError) as exc:
                self._failed("write", exc)
                return Written(False, True, added)
            return Written(True, True, added)

    def _land(self, job: Job, done: Written) -> bool:
        """A write done: what it wrote is forgotten here, what it could not write waits again (before what came
        since).  True when all of it is in the file."""
        if job.charges and done.charges:
            self._purge_at = job.now + HOUR_S if job.purge else self._purge_at
            self._charges.landed(done.added)
            for _ref, key, model, d, hour, _upto in done.added:
                if any(d):
                    self._count(key, model, d, hour)
        elif job.charges:
            self._charges.put_back()
        if done.ok:
            for x in job.extras:
                x.written()
            self._refresh_at = job.now + HOUR_S if job.live else self._refresh_at
            return True
        for row, r in job.pending.items():
            now = self._pending.setdefault(row, [0, 0, 0])
            for i in range(3):
                now[i] += r[i]
        for k, u in job.dirty.items():
            self._dirty.setdefault(k, u)   # (the counters booked since are the newer)
        return False

    async def settled(self) -> None:
        """The write out in the ledger's thread, if one is, done and landed."""
        if self.io.out is not None:
            await asyncio.wait({asyncio.wrap_future(self.io.out[1])})
        self._land_out()

    def _land_out(self) -> None:
        """Land the write of the ledger's thread once it is done (on the loop; once)."""
        if (out := self.io.done()) is not None:
            self._land(*out)

    def idle(self) -> bool:
        """No write out in the ledger's thread (one done is landed first)."""
        return self._free(0.0)

    def _free(self, wait_s: float = 0.05) -> bool:
        """Whether the file may be used on this thread now: no write out in the ledger's thread (one done is
        landed first, by the loop that started it: on another thread, one out is a no; it is waited for until
        ``wait_s`` after its start: milliseconds, but for a stalled state dir, not waited for again)."""
        if self.io.out is not None and threading.get_ident() != self.io.owner:
            return False
        if not self.io.wait(max(0.0, self.io.since + wait_s - time.monotonic())):
            return False
        self._land_out()
        return True
