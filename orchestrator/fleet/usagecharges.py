"""Charges by reference, for the usage ledger (:class:`orchestrator.fleet.usage.UsageLedger.charge_upto`): work the
gateway did not charge (a batch's lines, a dedicated batch's shard), as counters that only grow per reference.

Table ``charged_upto`` keeps each reference's counters charged so far, written in the same transaction as the usage
rows they add, so a charge made again (after a restart too) adds only what is new, and counters that went down (a
file cut) take nothing back.  A reference an earlier version charged once (table ``charged``) adds nothing.

What a reference adds is counted in memory (the budgets, the metrics) at once: against its counters known to this
process (read from the file the first time; when even that fails, it is counted at its write instead), so budgets
see batches while the file cannot be written.  Each part is booked in the hour it was charged in: what waits is
kept per reference and hour, written in that order.
"""

from __future__ import annotations

import sqlite3

MEMO = 4096   # references whose counters this process knows (the most recently charged)
Counts = tuple[int, int, int]
Added = tuple[str, str, str, Counts, int, Counts]   # (ref, key, model, what it added, hour, its counters after)
ROW = "SELECT requests, prompt_tokens, completion_tokens FROM charged_upto WHERE ref = ?"
ALL = 1 << 62   # the counters of a reference charged whole: no count passes them


class Charges:
    def __init__(self) -> None:
        # (ref, hour) -> (key, group, model, counters, counted in memory already), in the order charged
        self.waiting: dict[tuple[str, int], tuple[str, str | None, str, Counts, bool]] = {}
        self.known: dict[str, Counts] = {}   # ref -> counters counted in memory
        self.unwritten: dict[tuple[int, str], int] = {}   # (hour, key) -> tokens counted in memory, not in the file
        self.flying: tuple[dict, dict] = ({}, {})   # (waiting, unwritten) taken by a write not landed yet

    def seed(self, ref: str, db: sqlite3.Connection, counts: Counts) -> None:
        """Know ``ref``'s counters from the file (a reference this process has not charged yet)."""
        if ref in self.known or ref in self.refs_waiting():   # (one counted and waiting: not the file's)
            return
        row = db.execute(ROW, (ref,)).fetchone()
        if row is None and db.execute("SELECT 1 FROM charged WHERE ref = ?", (ref,)).fetchone():
            row = (ALL, ALL, ALL)   # (charged whole, once, by an earlier version: nothing more, ever)
        self._know(ref, tuple(row) if row is not None else (0, 0, 0))

    def add(self, ref: str, key: str, group: str | None, model: str, counts: Counts, hour: int) -> Counts | None:
        """Queue ``ref``'s counters for the next write; what to count in memory now (None: at the write)."""
        known = self.known.get(ref)
        before = self.waiting.get((ref, hour))   # (counters that went down within the hour: none taken back)
        queued = counts if before is None else tuple(max(c, b) for c, b in zip(counts, before[3]))
        self.waiting[(ref, hour)] = (key, group, model, queued, known is not None)
        if known is None:
            return None
        self._know(ref, tuple(max(c, k) for c, k in zip(counts, known)))
        d = tuple(max(0, c - k) for c, k in zip(counts, known))
        if d[1] or d[2]:
            self.unwritten[(hour, key)] = self.unwritten.get((hour, key), 0) + d[1] + d[2]
        return d

    def refs_waiting(self) -> set[str]:
        return {r for r, _ in self.waiting} | {r for r, _ in self.flying[0]}

    def take(self) -> dict:
        """What waits, for a write (in the ledger's thread): :meth:`landed` or :meth:`put_back` once it is done."""
        taken, self.flying = self.waiting, (self.waiting, self.unwritten)
        self.waiting, self.unwritten = {}, {}
        return taken

    @staticmethod
    def write(waiting: dict, db: sqlite3.Connection, upsert: str, bucket) -> list[Added]:
        """Write what :meth:`take` took (inside the caller's transaction), each reference's parts in the order
        charged; returns, for those not counted in memory yet, what :meth:`landed` takes once committed."""
        added = []
        for (ref, hour), (key, group, model, counts, counted) in waiting.items():
            before = db.execute(ROW, (ref,)).fetchone()
            if before is None and db.execute("SELECT 1 FROM charged WHERE ref = ?", (ref,)).fetchone():
                continue   # (charged whole, once, by an earlier version)
            before = before or (0, 0, 0)
            d = tuple(max(0, c - b) for c, b in zip(counts, before))
            upto = tuple(max(c, b) for c, b in zip(counts, before))
            if any(d):
                db.execute(upsert, (bucket(hour), key, group or "", model, *d))
                db.execute("INSERT OR REPLACE INTO charged_upto VALUES (?, ?, ?, ?, ?)", (ref, bucket(hour), *upto))
            if not counted:
                added.append((ref, key, model, d, hour, upto))
        return added

    def landed(self, added: list[Added]) -> None:
        """The write of what :meth:`take` took committed."""
        self.flying = ({}, {})
        for ref, *_, upto in added:
            self._know(ref, upto)

    def put_back(self) -> None:
        """The write of what :meth:`take` took failed: it waits again, before what was charged since."""
        (waiting, unwritten), self.flying = self.flying, ({}, {})
        for k, (key, group, model, counts, counted) in self.waiting.items():
            old = waiting.get(k)   # (the same reference and hour charged again since: the larger counters)
            grown = counts if old is None else tuple(max(c, o) for c, o in zip(counts, old[3]))
            waiting[k] = (key, group, model, grown, counted if old is None else counted and old[4])
        self.waiting = waiting
        for k, n in self.unwritten.items():
            unwritten[k] = unwritten.get(k, 0) + n
        self.unwritten = unwritten

    def unwritten_tokens(self, key: str, since_hour: int) -> int:
        """Tokens of ``key`` counted in memory from ``since_hour`` on that the file does not hold yet."""
        return sum(n for unwritten in (self.unwritten, self.flying[1]) for (h, k), n in unwritten.items()
                   if k == key and h >= since_hour)

    def _know(self, ref: str, counts: Counts) -> None:
        self.known.pop(ref, None)
        self.known[ref] = counts
        while len(self.known) > MEMO:   # the least recent goes, but one whose counted charge waits (it would count
            waiting = self.refs_waiting()                                             # again at its write)
            old = next((r for r in self.known if r not in waiting), None)
            if old is None:
                break
            del self.known[old]
