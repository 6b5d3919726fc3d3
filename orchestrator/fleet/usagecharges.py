"""Charges by reference, for the usage ledger (:class:`orchestrator.fleet.usage.UsageLedger.charge_upto`): work the
gateway did not charge (a batch's lines, a dedicated batch's shard), as counters that only grow per reference.

Table ``charged_upto`` keeps each reference's counters charged so far, written in the same transaction as the usage
rows they add, so a charge made again (after a restart too) adds only what is new, and counters that went down (a
file cut) take nothing back.  A reference an earlier version charged once (table ``charged``) adds nothing.

What a reference adds is counted in memory (the budgets, the metrics) when it is known: at once for one this
process has written before, even while the file cannot be written; at its first write otherwise (what it held
before this process is in the file).
"""

from __future__ import annotations

import sqlite3

MEMO = 4096   # references whose counters this process knows (the most recently charged)
Counts = tuple[int, int, int]


class Charges:
    def __init__(self) -> None:
        self.waiting: dict[str, tuple[str, str | None, str, Counts, int, bool]] = {}   # ref -> (key, group, model,
        self.known: dict[str, Counts] = {}   # counts, hour, counted in memory already); ref -> counters counted

    def add(self, ref: str, key: str, group: str | None, model: str, counts: Counts, hour: int) -> Counts | None:
        """Queue ``ref``'s counters for the next write; what to count in memory now (None: at the write)."""
        known = self.known.get(ref)
        self.waiting[ref] = (key, group, model, counts, hour, known is not None)
        if known is None:
            return None
        self._know(ref, tuple(max(c, k) for c, k in zip(counts, known)))
        return tuple(max(0, c - k) for c, k in zip(counts, known))

    def write(self, db: sqlite3.Connection, upsert: str, bucket) -> list[tuple[str, str, str, Counts, int, Counts]]:
        """Write what waits (inside the caller's transaction); returns, for the references not counted in memory
        yet, (ref, key, model, what it added, hour, its counters now) to :meth:`written` once committed."""
        added = []
        for ref, (key, group, model, counts, hour, counted) in self.waiting.items():
            before = db.execute("SELECT requests, prompt_tokens, completion_tokens FROM charged_upto WHERE ref = ?",
                                (ref,)).fetchone()
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

    def written(self, added: list[tuple[str, str, str, Counts, int, Counts]]) -> None:
        self.waiting.clear()
        for ref, *_, upto in added:
            self._know(ref, upto)

    def _know(self, ref: str, counts: Counts) -> None:
        self.known.pop(ref, None)
        self.known[ref] = counts
        while len(self.known) > MEMO:
            del self.known[next(iter(self.known))]
