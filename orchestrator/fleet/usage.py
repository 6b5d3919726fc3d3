"""Durable per-key usage: what every API key asked of which model, hour by hour, in ``<state_dir>/usage.sqlite3``.

Each gateway process reports, per key name, cumulative counters of its incarnation
(:class:`~orchestrator.contract.TenantUsage`: ``models`` maps a model to requests, prompt and completion tokens).
:meth:`UsageLedger.observe` turns them into deltas (it remembers the last counters seen per process incarnation and
key: a new incarnation starts from zero, a report seen twice adds nothing, a counter that went down started again)
and adds them to rows pending in memory for the current UTC hour. :meth:`UsageLedger.flush` writes the pending rows
in one transaction, adding to the rows already there.

Table ``usage``: one row per (``hour`` "YYYY-MM-DDTHH" UTC, ``key`` name, ``grp`` the key's group or "", ``model``)
with ``requests``, ``prompt_tokens``, ``completion_tokens``. SQLite in WAL mode: ``slurmfleet usage``
(:func:`query`) reads it while the daemon writes.

A batch's lines are charged by the batch runner, not the gateway, from what its files hold
(:meth:`UsageLedger.charge_upto`): under a reference (a batch, a dedicated batch's shard), counters that only grow,
each reference's charged so far kept in table ``charged_upto`` (:mod:`.usagecharges`).  (Table ``charged`` keeps
the spools booked, and the references an earlier version charged once.)

Durability: the daemon flushes every ~2 s (written in the ledger's own thread: :mod:`.usageio`) and once more at
shutdown. On SIGTERM nothing is lost: the daemon flushes
after the gateway processes have stopped and sent their last reports. Each flush also writes, in the same
transaction, the counters it has booked of every worker incarnation (table ``seen``). A worker process writes its
last counters to ``<state_dir>/usage-spool/<incarnation>.json`` as it exits; on SIGKILL (or a crash) of the daemon,
even in its own shutdown, its workers finish the requests in flight and the next daemon books each such file once
(:meth:`UsageLedger.ingest`: the counters less those ``seen`` had, the reference ``spool:<incarnation>`` in
``charged`` in the same transaction), so nothing they served is lost; a daemon that stops in order marks the
spools of its workers that ended (their last report read) booked as it closes the ledger (one still running then
spools later: the next daemon books it as above). With the gateway in the daemon's own process (``gateway.workers:
1``) a SIGKILL loses at most the last ~2.5 s (the flush interval plus the report interval); a power loss may also
lose the last commits (``synchronous=NORMAL``).

Table ``background`` holds the background responses of the Responses API not charged yet, written in each flush's
transaction by :class:`.background.BackgroundBook` (:meth:`UsageLedger.attach`): the counters booked and the
responses left to charge always agree, for the next daemon.

Robustness: a locked, unreadable or corrupt file never stops the daemon. The error is logged (at most once a
minute), the pending rows stay in memory and the next flush tries again; a corrupt file is best moved away by hand
(the next flush then starts a new one). While the file cannot be read, :meth:`period_tokens` counts only what this
daemon observed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..contract import GatewayReport, TenantUsage
from .usagecharges import Charges
from .usageio import Busy, Io, Job, OffLoop
from .usageschema import HOUR_S, SCHEMA, SCHEMA_VERSION, UPSERT, hour_bucket

log = logging.getLogger("slurmfleet.usage")
SESSION_HOURS = 32 * 24   # the session fallback's tokens are kept this long (past any budget period)
KEEP_INCARNATIONS = 3    # per process: the live one and the last ones (a departed report may come late)
RETRY_S = 60.0           # a period total counted without the file is read from it again after this long
REJECT_REASONS = ("rpm", "tpm", "concurrency", "budget")   # TenantUsage.rejected's keys (the gateway's refusals)
SEEN_KEEP_S = 7 * 86400   # a worker's booked counters, for a spool it may still write (one killed with its daemon never does)
CHARGED_KEEP_S = 90 * 86400   # a reference's counters charged so far, after its last charge (a batch ends in a day)
_NONE = TenantUsage()
_ZERO = (0, 0, 0)

Row = tuple[str, str, str | None, str]   # (hour, key, group, model)


def _delta(cur: tuple[int, ...], prev: tuple[int, ...]) -> tuple[int, ...]:
    """What was added since ``prev``; all of ``cur`` when a counter went down (its counting started again)."""
    if any(c < p for c, p in zip(cur, prev)):
        return cur
    return tuple(c - p for c, p in zip(cur, prev))


class UsageLedger(OffLoop):
    """Per-key usage of one daemon, durable in ``path`` (see the module docstring)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time, spool: Path | None = None):
        self.path, self.clock, self.spool = Path(path), clock, spool   # spool: where workers leave <incarnation>.json
        self._db: sqlite3.Connection | None = None
        self._seen: dict[int, dict[str, dict[str, TenantUsage]]] = {}  # process -> incarnation -> key -> last
        self._ended: set[str] = set()   # incarnations of those whose process ended (their last report in)
        self._dirty: dict[tuple[str, str], TenantUsage] = {}   # (incarnation, key) -> counters booked, not yet in `seen`
        self._refresh_at = 0.0   # when the live workers' `seen` rows are next made recent
        self._pending: dict[Row, list[int]] = {}
        self._charges = Charges()   # charges by reference (charge_upto)
        self._purge_at = 0.0   # when _purge_stale next runs with the charges' writes
        self._totals: dict[tuple[str, str], list[int]] = {}       # since this object was created
        self._rejected: dict[tuple[str, str], int] = {}
        self._session: dict[tuple[int, str], int] = {}           # (hour index, key) -> tokens observed
        self._period: dict[str, dict[float, list]] = {}   # key -> since -> [since hour, tokens, retry at] (its own
                                                          # budget's period, and its group's)
        self._hour, self._bucket = -1, ""
        self._failed_at = -math.inf
        self.extras: list = []   # others' rows written in each flush's transaction (attach)
        self.errors = 0   # times the file could not be opened, read or written (slurmfleet_usage_ledger_errors_total)
        self.io = Io()   # the file's own thread, and what of the file work is out there (:mod:`.usageio`)
        try:
            self._connect()
        except sqlite3.Error as exc:
            self._failed("open", exc)

    def attach(self, extra) -> None:
        """Write ``extra``'s rows (``dirty``, ``write(db)``, ``written()``: :class:`.background.BackgroundBook`,
        :class:`.quotawindow.QuotaWindow`) in each flush's transaction, once it has read what the file holds of
        them (``load(db)``, ``loaded``: tried now, and at each flush until it could)."""
        self.extras.append(extra)
        self._load_extras()

    def _load_extras(self) -> None:
        for x in self.extras:
            if not x.loaded:
                try:
                    with self.io.lock:
                        x.load(self._connect())
                except sqlite3.Error as exc:   # (not dirty until loaded: what the last daemon left is kept)
                    self._failed("read", exc)

    # -- observing ----------------------------------------------------------------------------------------
    def observe(self, report: GatewayReport, groups: Mapping[str, str | None], last: bool = False) -> None:
        """Add what is new in ``report`` (``groups``: key name -> its group now; ``last``: its process ended)."""
        known = self._seen.get(report.process, {}).get(report.incarnation)
        for gone in [n for n in known or () if n not in report.tenants]:
            del known[gone]   # its process forgot the key (removed by a reload): one added back counts from zero
        if last and (known is not None or report.tenants):
            self._ended.add(report.incarnation)
        if not report.tenants:
            return
        seen = self._incarnation(report.process, report.incarnation)
        hour = int(self.clock() // HOUR_S)
        if hour != self._hour:
            self._hour, self._bucket = hour, hour_bucket(hour * HOUR_S)
            # the fallback's hours beyond the longest budget period (a month) are never read again
            for s in [s for s in self._session if s[0] < hour - SESSION_HOURS]:
                del self._session[s]
        for name, u in report.tenants.items():
            last = seen.get(name)
            if last is u:
                continue
            seen[name] = u
            last = last or _NONE
            if u.models != last.models:
                if report.process:   # (a worker's: it spools its last counters if this daemon dies)
                    self._dirty[(report.incarnation, name)] = u
                for model, cur in u.models.items():
                    prev = last.models.get(model, _ZERO)
                    if cur != prev:
                        self._add(name, groups.get(name), model, _delta(cur, prev))
            if u.rejected != last.rejected:
                for reason, n in u.rejected.items():
                    prev = last.rejected.get(reason, 0)
                    if n != prev:
                        k = (name, reason)
                        self._rejected[k] = self._rejected.get(k, 0) + (n - prev if n > prev else n)

    def _incarnation(self, process: int, incarnation: str) -> dict[str, TenantUsage]:
        mine = self._seen.get(process)
        if mine is None:
            mine = self._seen[process] = {}
        seen = mine.get(incarnation)
        if seen is None:
            seen = mine[incarnation] = {}
            while len(mine) > KEEP_INCARNATIONS:
                self._ended.discard(next(iter(mine)))
                del mine[next(iter(mine))]
        return seen

    def _add(self, key: str, group: str | None, model: str, d: tuple[int, ...]) -> None:
        row = self._pending.get((self._bucket, key, group, model))
        if row is None:
            row = self._pending[(self._bucket, key, group, model)] = [0, 0, 0]
        for i in range(3):
            row[i] += d[i]
        self._count(key, model, d, self._hour)

    def _count(self, key: str, model: str, d: tuple[int, ...], hour: int) -> None:
        """What was just added, in the in-memory totals, the session fallback and the period totals."""
        requests, prompt, completion = d
        total = self._totals.get((key, model))
        if total is None:
            total = self._totals[(key, model)] = [0, 0, 0]
        total[0] += requests
        total[1] += prompt
        total[2] += completion
        tokens = prompt + completion
        if tokens:
            s = (hour, key)
            self._session[s] = self._session.get(s, 0) + tokens
            for cached in self._period.get(key, {}).values():
                if hour >= cached[0]:
                    cached[1] += tokens

    def charge_upto(self, ref: str, key: str, group: str | None, model: str, counts: tuple[int, int, int],
                    write: bool = True) -> bool:
        """Charge ``key`` for work the gateway did not charge (a batch's lines, a dedicated batch's shard), up to
        ``counts`` (requests, prompt, completion tokens: what ``ref``'s work holds so far, only growing), once
        (:mod:`.usagecharges`), in the hour of the call.  ``write``: written at once, in one transaction with
        ``ref``'s new counters, else at the next flush (kept for it too when the file cannot be written).  True
        once it is in the file (a caller about to forget the work, a batch about to end, asks again until then)."""
        hour = int(self.clock() // HOUR_S)
        if ref not in self._charges.known and self._free():   # (a flush out: counted once written, then)
            try:
                with self.io.lock:
                    self._charges.seed(ref, self._connect(), tuple(counts))
            except (sqlite3.Error, OSError) as exc:   # (counted once written, then)
                self._failed("read", exc)
        now = self._charges.add(ref, key, group, model, tuple(counts), hour)
        if now is not None and any(now):
            self._count(key, model, now, hour)
        return self._write_charges() if write else True

    def _write_charges(self) -> bool:
        """The charges waiting, written now in a transaction of their own (False: not now, they wait)."""
        if not self._free():
            return False
        job = Job(self.clock(), {}, {}, [], [], self._charges.take(), self.clock() >= self._purge_at)
        return self._land(job, self._write(job)) and not self._charges.waiting

    # -- reading --------------------------------------------------------------------------------------------
    def period_tokens(self, key: str, since_epoch_s: float) -> int:
        """Prompt + completion tokens of ``key`` in the hours from the one ``since_epoch_s`` falls in (a
        period start is a whole hour): read from the file once per key and period, then kept up to date."""
        periods = self._period.setdefault(key, {})
        cached = periods.get(since_epoch_s)
        if cached is not None and (not cached[2] or self.clock() < cached[2]):
            return cached[1]
        since_hour = int(since_epoch_s // HOUR_S)
        lo = hour_bucket(since_hour * HOUR_S)
        pending = sum(r[1] + r[2] for (h, k, _g, _m), r in self._pending.items() if k == key and h >= lo) + \
            self._charges.unwritten_tokens(key, since_hour)   # (counted, not written yet)
        try:
            if not self._free():   # (a flush out, stuck: not waited for; read at the next call)
                raise Busy
            with self.io.lock:
                stored = self._connect().execute(
                    "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage WHERE key = ? AND hour >= ?",
                    (key, lo)).fetchone()[0]
            tokens, retry_at = stored + pending, 0.0
        except (Busy, sqlite3.Error, OSError) as exc:   # this daemon's own counts; the file read again later (busy:
            tokens = sum(n for (h, k), n in self._session.items() if k == key and h >= since_hour)   # at the next
            retry_at = self.clock() or 1e-9   # call)
            if not isinstance(exc, Busy):
                self._failed("read", exc)
                retry_at = self.clock() + RETRY_S
        periods.pop(since_epoch_s, None)
        periods[since_epoch_s] = [since_hour, tokens, retry_at]
        while len(periods) > 4:   # (a key's own period and its group's, and the ones just ended)
            del periods[next(iter(periods))]
        return tokens

    def booked_groups(self, since_epoch_s: float) -> list[tuple[str, str, str]] | None:
        """(group, key, the last hour) of every key with usage booked under a group in the hours from the one
        ``since_epoch_s`` falls in (a range of the table's key, which starts with the hour); None when the file
        cannot be read."""
        if not self._free():
            return None
        try:
            with self.io.lock:
                return self._connect().execute("SELECT grp, key, MAX(hour) FROM usage WHERE hour >= ? AND grp != '' "
                                               "GROUP BY grp, key", (hour_bucket(since_epoch_s),)).fetchall()
        except (sqlite3.Error, OSError) as exc:
            self._failed("read", exc)
            return None

    def totals(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """Since this ledger was created, per (key, model): requests, prompt tokens, completion tokens."""
        return {k: (v[0], v[1], v[2]) for k, v in self._totals.items()}

    def rejections(self) -> dict[tuple[str, str], int]:
        """Since this ledger was created, per (key, reason): requests refused by the key's limits."""
        return dict(self._rejected)

    @property
    def pending_rows(self) -> int:
        return len(self._pending) + len(self._charges.waiting) + self.io.rows()

    # -- writing --------------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Write the pending rows in one transaction; False (rows kept for the next try) when it failed.  On the
        caller's thread, after the flush out in the ledger's thread (:meth:`flush_soon`) if one is."""
        self.io.wait()
        self._land_out()
        job = self._take()
        return job is None or self._land(job, self._write(job))

    def ingest(self, incarnation: str, tenants: Mapping[str, Mapping[str, tuple[int, int, int]]],
               groups: Mapping[str, str | None], at: float | None = None,
               also: Callable[[sqlite3.Connection], None] | None = None) -> bool:
        """Book a worker's spooled last counters (key -> model -> requests, prompt, completion): what they hold
        beyond what was booked of ``incarnation`` (table ``seen``), once (reference ``spool:<incarnation>``), in
        the hour they were spooled (``at``; now, when it is unknown or ahead of the clock), not the hour a later
        daemon read them.  True once booked (the caller removes the spool), False when the file cannot be
        written (try again).  ``also(db)`` runs in the same transaction when it books the spool (not when it was
        booked already)."""
        if not self.flush():
            return False
        hour = int(min(self.clock(), at if at is not None else math.inf) // HOUR_S)
        bucket, added = hour_bucket(hour * HOUR_S), []
        try:
            with self.io.lock, self._connect() as db:
                if db.execute("INSERT OR IGNORE INTO charged (ref, hour) VALUES (?, ?)",
                              (f"spool:{incarnation}", bucket)).rowcount:
                    booked = {(k, m): tuple(c) for k, m, *c in db.execute(
                        "SELECT key, model, requests, prompt_tokens, completion_tokens FROM seen WHERE incarnation = ?",
                        (incarnation,))}
                    for key, models in tenants.items():
                        for model, cur in models.items():
                            d = _delta(tuple(cur), booked.get((key, model), _ZERO))
                            if any(d):
                                db.execute(UPSERT, (bucket, key, groups.get(key) or "", model, *d))
                                added.append((key, model, d))
                    if also is not None:
                        also(db)
                db.execute("DELETE FROM seen WHERE incarnation = ?", (incarnation,))
                self._purge_stale(db)
        except sqlite3.Error as exc:
            self._failed("write", exc)
            return False
        for key, model, d in added:
            self._count(key, model, d, hour)
        for mine in self._seen.values():   # one of this daemon's own (spooled as it stopped, before its last
            seen = mine.get(incarnation)   # report was read): that report adds nothing more
            if seen is not None:
                for key, models in tenants.items():
                    seen[key] = dataclasses.replace(seen.get(key, _NONE), models=dict(models))
        return True

    def close(self) -> None:
        """Flush, then close the file.  The workers whose process ended have their last reports in: the spools
        they wrote as they stopped are booked (``spool:<incarnation>`` marked, their counters dropped, in one
        transaction).  One whose end was not seen (a stop cut short) may serve and spool on: its spool is the next
        daemon's to book, less its counters kept here."""
        if self.flush():
            mine = [inc for proc, incs in self._seen.items() if proc for inc in incs if inc in self._ended]
            bucket = hour_bucket(self.clock())
            try:
                with self.io.lock, self._connect() as db:
                    db.executemany("INSERT OR IGNORE INTO charged (ref, hour) VALUES (?, ?)",
                                   [(f"spool:{inc}", bucket) for inc in mine])
                    db.executemany("DELETE FROM seen WHERE incarnation = ?", [(inc,) for inc in mine])
                    self._purge_stale(db)
            except sqlite3.Error as exc:
                self._failed("write", exc)
        if self._db is not None:
            self._db.close()
            self._db = None
        self.io.close()

    def _purge_stale(self, db: sqlite3.Connection) -> None:
        """Drop the booked counters of workers not heard of for ``SEEN_KEEP_S`` (killed with their daemon: no spool
        will come), but those whose spool waits to be booked (a daemon down that long: its counters still count),
        the counters of references not charged for ``CHARGED_KEEP_S`` (their batches ended long ago), and the marks
        of spools booked that long ago, but those whose file is still there (its removal failed: booked once)."""
        stale = [inc for (inc,) in db.execute("SELECT DISTINCT incarnation FROM seen WHERE at < ?",
                                              (self.clock() - SEEN_KEEP_S,))]
        db.executemany("DELETE FROM seen WHERE incarnation = ?", [(inc,) for inc in stale if not self._spooled(inc)])
        cut = hour_bucket(self.clock() - CHARGED_KEEP_S)
        db.execute("DELETE FROM charged_upto WHERE hour < ?", (cut,))
        old = [ref for (ref,) in db.execute("SELECT ref FROM charged WHERE hour < ?", (cut,))]
        db.executemany("DELETE FROM charged WHERE ref = ?",
                       [(r,) for r in old if not (r.startswith("spool:") and self._spooled(r[6:]))])

    def _spooled(self, incarnation: str) -> bool:
        """Whether a worker's spool file is there (not booked yet, or booked and its removal failed)."""
        return self.spool is not None and (self.spool / f"{incarnation}.json").exists()

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a read may run on the event loop: never wait long (a flush runs in the ledger's thread)
            db = sqlite3.connect(self.path, timeout=0.5, check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:   # (a read: a file another
                    db.executescript(SCHEMA)                                        # holds can still be read)
            except sqlite3.Error:
                db.close()
                raise
            self._db = db
        return self._db

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if self._db is not None:   # open it again next time (the file may have been moved away)
            self._db.close()
            self._db = None
        now = time.monotonic()
        if now - self._failed_at >= 60:
            self._failed_at = now
            log.error("usage ledger %s: cannot %s (%s: %s); %d usage rows kept in memory, retrying "
                      "(a corrupt file: move it away and a new one is started)", self.path, what,
                      type(exc).__name__, exc, len(self._pending) + len(self._charges.waiting))

