"""The batch runner's scan of its records (every second): the files read in a thread, what they say applied on the
event loop (:meth:`orchestrator.fleet.batchrun.BatchRunner.scan_off_loop`).

The state dir is shared with the compute nodes (NFS, Lustre), which can stall for seconds or hang: the scan's
listing and reads of the records, and its removals of those past ``batches.retention_s``, ran on the daemon's event
loop, and stalled every client of a gateway in the daemon's process with it.  :func:`read` does that file work and
touches nothing of the runner (it works on a copy of the runner's ``ended``); the runner applies what it found on
the loop.  A scan not back yet holds the next one (no second thread queued behind a hung mount).  A record read
before a run of its batch ended may show it not ended: the runner starts no run from a read that began before the
batch's last run ended (the next scan reads the record again).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from ..batches import TERMINAL, BatchStore, ended_at

log = logging.getLogger("slurmfleet.batches")


@dataclasses.dataclass
class Found:
    records: list[dict]      # every record kept (an ended one as its stub: ``BatchStore.all``)
    ended: dict[str, dict]   # the runner's ``ended``, brought up to date
    dropped: int             # records removed past the retention
    cancels: dict[str, int] = dataclasses.field(default_factory=dict)   # batches not ended whose cancel was
    # asked, and when (their markers looked at here, not by each running batch every second on the loop)


def read(store: BatchStore, ended: dict[str, dict], keep_s: float, now: float, sweep: bool) -> Found:
    """Every record, but those of batches ended over ``keep_s`` ago (0: kept for ever), removed here with their
    work folders; ``sweep``: the work folders of the ended batches go too (a crash's leftovers, the first scan's)."""
    ended, records, dropped, cancels = dict(ended), [], 0, {}
    for rec in store.all(ended):
        bid = rec["id"]
        ends = rec["status"] in TERMINAL
        if keep_s and ends and (end := rec["ended_at"] if "ended_at" in rec else ended_at(rec)) is not None \
                and now - end > keep_s:
            shutil.rmtree(work(store, bid), ignore_errors=True)   # (a crash's leftover: found by its record only)
            try:
                store.remove(bid)   # (batches.retention_s: GET /v1/batches/<id> is a 404 from now on)
            except OSError as exc:   # (the next scan tries again; the other batches go on)
                log.warning("cannot remove the record of batch %s, ended over %g days ago: %s", bid,
                            keep_s / 86400, exc)
                continue
            ended.pop(store.path(bid).name, None)
            dropped += 1
            continue
        if sweep and ends:   # a crash between the end and the clean-up
            shutil.rmtree(work(store, bid), ignore_errors=True)
        elif not ends and (asked := store.cancel_requested(bid)) is not None:
            cancels[bid] = asked
        records.append(rec)
    return Found(records, ended, dropped, cancels)


def work(store: BatchStore, bid: str) -> Path:
    """A dedicated batch's work folder."""
    return store.dir / f"{bid}.array"
