"""Background responses (the Responses API's ``background: true``) charged once, whichever process or daemon dies.

A gateway process follows each background response it answered until the response ends on its replica, then
charges its key the usage it ended with (:mod:`orchestrator.gateway.stored`); until then its reports list it
(:attr:`~orchestrator.contract.GatewayReport.background`).  A process charges a response and drops it from its
list in one step, so the report that counts the charge is the first that lacks it.  The fleet's half,
:class:`BackgroundBook`, fed every tenancy tick:

* **a process that is gone** (killed, crashed, stopped with the daemon): what its last report listed, and no live
  process does, is an orphan.  Each orphan is handed to the live process with the fewest handed to it, in the
  routing table (:attr:`~orchestrator.contract.RoutingTable.adopt`), which follows and charges it in turn.  One
  handed to process P in table V is P's once P reports routing on V or later; from then, its absence from P's
  reports means P charged it (or P's last report, if P is gone too: then it is an orphan again);
* **a daemon that is gone**: every response not charged yet (followed, orphaned or handed out) is written with the
  usage ledger's counters, in the same transaction (table ``background`` of ``usage.sqlite3``), so the counters
  booked and the responses left to charge always agree.  The next daemon hands every one out again.  A daemon
  that stops in order writes them after its processes' last reports; one that was killed may have left workers
  that went on for ``gateway.shutdown_grace_s`` and spooled their last counters with the responses they still
  followed and those they charged (:meth:`BackgroundBook.spooled`): a response such a worker followed, or was handed,
  waits for its spool (while the spool is on disk, or that long and a margin when none came) before it is handed
  out, and is dropped if the spool shows it charged.  A worker that exits while its daemon runs on spools too (its
  spool lists what its last report did): one of those this daemon already saw charged by another process is not
  handed out again (the last :data:`CHARGED_KEEP` it saw charged are remembered).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from ..contract import Background, GatewayReport

log = logging.getLogger("slurmfleet.background")
SPOOL_MARGIN_S = 10.0   # beyond the workers' shutdown grace: how long a killed daemon's worker may still spool
CHARGED_KEEP = 10_000   # the background responses this daemon saw charged that a late spool cannot hand out again
SCHEMA = """
CREATE TABLE IF NOT EXISTS background (
    rid TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    job_id TEXT NOT NULL,
    prompt_guess INTEGER NOT NULL,
    incarnation TEXT NOT NULL
) WITHOUT ROWID
"""


class BackgroundBook:
    """The background responses not charged yet, over every gateway process and across daemons."""

    def __init__(self, hold_s: float, spool: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s    # how long a response a killed daemon's worker followed waits for its spool
        self.spool, self.clock = spool, clock   # (spool: where the workers' <incarnation>.json files are)
        self.loaded = False     # what the last daemon left is read (until then nothing is written over it)
        self.live: dict[str, tuple[Background, str]] = {}   # rid -> (response, incarnation of the worker following it)
        self.spools: dict[int, str] = {}   # live process -> its incarnation, if it is a worker (it may spool: not 0)
        self.orphans: dict[str, Background] = {}
        self.given: dict[str, tuple[int, int | None]] = {}  # orphan -> (process, first table version carrying it)
        self.held: dict[str, tuple[Background, str, float]] = {}   # -> (response, its worker's incarnation, until)
        self.final = False      # the daemon stops in order: every process's last report is in, no spool will come
        self.charged: dict[str, None] = {}   # the last ones seen charged (in order): a worker's spool may list them
        self._stored: frozenset[tuple] = frozenset()   # the rows the ledger's file holds now
        self._rows: frozenset[tuple] = frozenset()
        self._writing: frozenset[tuple] = frozenset()

    # -- facts in -------------------------------------------------------------------------------------------------
    def observe(self, reports: Sequence[GatewayReport], departed: Iterable[GatewayReport], now: float) -> None:
        """One tenancy tick: the live processes' reports and the last reports of processes gone since the last."""
        self.spools = {r.process: r.incarnation for r in reports if r.process}   # (process 0 dies with its daemon)
        live = {b.rid: (b, self.spools.get(r.process, "")) for r in reports for b in r.background}
        for d in departed:
            listed = {b.rid for b in d.background}
            for rid, (proc, version) in list(self.given.items()):
                if proc != d.process:
                    continue
                if version is not None and d.table_version >= version and rid not in listed:
                    self._settled(rid, charged=True)   # it had taken it, and charged it before its last report
                else:
                    self.given.pop(rid)       # it died before taking it, or while following it: hand it out again
            for b in d.background:
                if b.rid not in live:
                    self.orphans[b.rid] = b
        by_process = {r.process: r for r in reports}
        for rid, (proc, version) in list(self.given.items()):
            r = by_process.get(proc)
            if rid in live or r is not None and version is not None and r.table_version >= version:
                self._settled(rid, charged=rid not in live)   # taken (listed now), or charged already
            elif r is None:
                self.given.pop(rid)  # its process is gone: hand it out again
        for rid in [rid for rid in self.orphans if rid in live]:
            self._settled(rid)
        for rid, (b, inc, until) in list(self.held.items()):
            if rid in live:
                del self.held[rid]
            elif now >= until and not (self.spool is not None and (self.spool / f"{inc}.json").exists()):
                del self.held[rid]   # (a spool on disk not booked yet, the ledger locked: it still decides)
                self.orphans[rid] = b
                log.info("background response %s: no spool came from the worker that followed it; handed out", rid)
        for rid in self.live.keys() - live.keys():
            if rid not in self.orphans:
                self._settled(rid, charged=True)   # its process dropped it: charged (in that report, or its last)
        self.live = live
        self._rows = frozenset(self._snapshot())

    def close(self) -> None:
        """The daemon stops, after its last tick: if no worker process is alive any more (an orderly stop: their last
        reports are in), the rows written next wait for no spool; one alive (a second SIGTERM cut the stop short)
        may still charge what it follows, and spool."""
        self.final = not self.spools
        self._rows = frozenset(self._snapshot())

    def spooled(self, incarnation: str, background: Iterable[Background], charged: Iterable[str]) -> None:
        """A worker of a killed daemon spooled its last counters (booked now, in the transaction that writes these
        rows), the background responses it still followed and those it charged: the first are orphans, the charged
        ones are dropped, and one the rows gave it but it neither followed nor charged (handed to it in a table it
        never applied) is an orphan too.  A worker of this daemon that exited while it ran on spools too: one it
        listed that this daemon saw charged since (by the process it was handed to) is not handed out again."""
        done = set(charged)
        for rid, (b, inc, _until) in list(self.held.items()):
            if inc == incarnation:
                del self.held[rid]
                if rid in done:
                    log.info("background response %s was charged by worker %s after its daemon died", rid, inc)
                elif rid not in self.live and rid not in self.charged:
                    self.orphans[rid] = b
        for rid in done:   # (one its hold let go of before the spool came, not handed out yet)
            if rid in self.orphans and rid not in self.given:
                del self.orphans[rid]
            self._charge(rid)
        for rid, b in {b.rid: b for b in background if b.rid not in self.charged}.items():
            self.held.pop(rid, None)   # (held for another worker's spool: this one had it last)
            if rid not in self.live:
                self.orphans[rid] = b
        self._rows = frozenset(self._snapshot())

    def _settled(self, rid: str, charged: bool = False) -> None:
        self.orphans.pop(rid, None)
        self.given.pop(rid, None)
        if charged:
            self._charge(rid)

    def _charge(self, rid: str) -> None:
        self.charged.pop(rid, None)
        self.charged[rid] = None
        while len(self.charged) > CHARGED_KEEP:
            del self.charged[next(iter(self.charged))]

    # -- state out ------------------------------------------------------------------------------------------------
    def adopt(self, processes: Iterable[int]) -> Mapping[int, tuple[Background, ...]]:
        """Hand every orphan not handed out yet to the live process with the fewest; what the next table carries:
        process -> the orphans handed to it (until each is settled).  Call :meth:`published` with its version."""
        procs = sorted(set(processes))
        if not self.orphans or not procs:
            return {}
        load = {p: 0 for p in procs}
        for proc, _ in self.given.values():
            if proc in load:
                load[proc] += 1
        for rid in self.orphans:
            if rid not in self.given or self.given[rid][0] not in load:
                proc = min(procs, key=lambda p: (load[p], p))
                self.given[rid] = (proc, None)
                load[proc] += 1
        out: dict[int, list[Background]] = {}
        for rid, (proc, _) in self.given.items():
            out.setdefault(proc, []).append(self.orphans[rid])
        return {p: tuple(bs) for p, bs in out.items()}

    def published(self, version: int) -> None:
        """The table that carries :meth:`adopt`'s answer has ``version``."""
        for rid, (proc, v) in self.given.items():
            if v is None:
                self.given[rid] = (proc, version)
        self._rows = frozenset(self._snapshot())   # (handed to a worker: its spool decides, after a killed daemon)

    def pending(self) -> int:
        """Background responses not charged yet (followed, orphaned, held for a spool)."""
        return len(self._rows)

    def by_key(self) -> dict[str, int]:
        """:meth:`pending` per API key name."""
        out: dict[str, int] = {}
        for row in self._rows:
            out[row[1]] = out.get(row[1], 0) + 1
        return out

    # -- durability (through the usage ledger's flush: :meth:`UsageLedger.attach`) ----------------------------------
    @property
    def dirty(self) -> bool:
        return self.loaded and self._rows != self._stored

    def _snapshot(self) -> list[tuple]:
        """The rows to write: each response with the incarnation of the worker it is with (whose spool it waits
        for after a killed daemon), "" when no spool can come (a process in the daemon's own, an orphan)."""
        rows = list(self.live.values())
        rows += [(b, self.spools.get(self.given[rid][0], "") if rid in self.given else "")
                 for rid, b in self.orphans.items() if rid not in self.live]
        rows += [(b, inc) for rid, (b, inc, _u) in self.held.items()
                 if rid not in self.live and rid not in self.orphans]
        return [(b.rid, b.key, b.model, b.job_id, b.prompt_guess, "" if self.final else inc) for b, inc in rows]

    def write(self, db: sqlite3.Connection) -> None:
        """Inside the ledger's flush transaction: the rows of every response not charged yet."""
        rows = self._rows   # (read once: written in the ledger's thread, while the loop may make new ones)
        db.execute(SCHEMA)
        db.execute("DELETE FROM background")
        db.executemany("INSERT INTO background VALUES (?, ?, ?, ?, ?, ?)", sorted(rows))
        self._writing = rows

    def written(self) -> None:
        """The flush that wrote them committed."""
        self._stored = self._writing

    def load(self, db: sqlite3.Connection) -> None:
        """At start (again at each flush until it could be read): what the last daemon left to charge.  Those a worker
        of its followed, or was handed, wait for that worker's spool (it may have gone on after its daemon was
        killed); the others are orphans now."""
        db.execute(SCHEMA)
        rows = db.execute("SELECT rid, key, model, job_id, prompt_guess, incarnation FROM background").fetchall()
        until = self.clock() + self.hold_s
        for rid, key, model, job_id, guess, inc in rows:
            b = Background(rid, key, model, job_id, int(guess))
            if inc:
                self.held[rid] = (b, inc, until)
            else:
                self.orphans[rid] = b
        self.loaded = True
        self._stored = frozenset(tuple(r) for r in rows)
        self._rows = frozenset(self._snapshot())
        if rows:
            log.info("%d background response(s) the last daemon left to charge: handed out to this one's gateway",
                     len(rows))
