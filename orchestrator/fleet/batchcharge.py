"""A shared-mode batch's owner is charged by the batch runner from what the batch's files hold, not by the gateway
that served its lines: the gateway's charge came when an answer was whole, before the runner had written it down,
so a line the runner then lost (a stop, a cancel, a daemon killed with its gateway workers) was sent again and
charged twice.

The files are the truth: each answer is one line fsync'd there once (:mod:`orchestrator.fleet.batchout`).  The
runner charges the owner, under the reference ``batch:<id>``, the counts its files hold (requests: the answers in
the output file, 2xx; tokens: every answer's ``usage``), every second while the batch runs (counted at once for
the owner's budget, written with the ledger's next flush) and once more, waiting until the ledger's file has it,
before its counts are final.  The ledger keeps what each reference was charged so far
(:meth:`orchestrator.fleet.usage.UsageLedger.charge_upto`), so a charge made again, after a restart too, adds
only the lines new since.

A batch an earlier version began (its gateway charged the lines it answered) has no ``charge_base`` in its
record; the first run by this version sets it to what its files hold then, before it sends a line, and charges
only what comes after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .batchout import Run

if TYPE_CHECKING:
    from .batchrun import BatchRunner

log = logging.getLogger("slurmfleet.batches")
RETRY_S = 2.0   # a batch about to end waits this long between tries of a ledger that cannot be written
WARN_EVERY_S = 60.0   # ... and says so this often


def begin(rec: dict, run: Run) -> bool:
    """Set the record's ``charge_base`` (once, before a line is sent): what its files hold, nothing for a batch
    that never ran, the lines an earlier version's gateway charged for one it ran.  True when it must be saved."""
    if "charge_base" in rec:
        return False
    rec["charge_base"] = [run.completed, run.prompt_tokens, run.completion_tokens]
    return True


def charge(runner: "BatchRunner", rec: dict, completed: int, prompt: int, completion: int,
           write: bool = True) -> tuple[int, int, int] | None:
    """Charge the owner up to what the files hold (``completed`` answers, their tokens): the counts charged, or
    None when the ledger could not be written (asked again later).  ``write`` False: the ledger writes it with its
    next flush (counted in memory, for the owner's budget, at once).  A record without a ``charge_base`` was
    never run by this version: its lines were charged by the gateway that served them."""
    base = rec.get("charge_base")
    if base is None:
        return 0, 0, 0
    counts = (max(0, completed - base[0]), max(0, prompt - base[1]), max(0, completion - base[2]))
    model = (rec.get("models") or [""])[0]
    if runner.charge(f"batch:{rec['id']}", rec.get("owner") or "", model, counts, write=write) is False:
        return None
    return counts


def progress(runner: "BatchRunner", run: Run) -> None:
    """Charge what the run's files hold now, when it moved since the last charge (the ledger's next flush writes
    it: one transaction for every batch, off the runner's tick)."""
    now = (run.completed, run.prompt_tokens, run.completion_tokens)
    if now != run.charged:
        charge(runner, run.rec, *now, write=False)
        run.charged = now


async def settle(runner: "BatchRunner", run: Run, clock=time.monotonic) -> None:
    """Before the batch's counts are final: all its files hold charged and in the ledger's file, however long the
    ledger refuses (its alert, SlurmfleetUsageLedgerFailing, says so): the files are handed over next, and a
    restart would not read them again."""
    now = (run.completed, run.prompt_tokens, run.completion_tokens)
    said = -WARN_EVERY_S
    while charge(runner, run.rec, *now) is None:
        if clock() - said >= WARN_EVERY_S:
            said = clock()
            log.warning("batch %s: the usage ledger cannot be written; the batch ends once its lines are charged",
                        run.rec["id"])
        await asyncio.sleep(RETRY_S)
    run.charged = now
