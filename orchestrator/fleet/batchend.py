"""How a batch ends, in both modes of the runner (:mod:`orchestrator.fleet.batchrun`): its output and error files
handed over to the file store and its record ended (:func:`finalize`), or, when its run raises, what follows
(:func:`run_failed`).  Once its counts are final (its ``ending`` decided and saved: from there a restart only
hands the files over), an error is never the batch's end: a hand-over that fails (a full disk, a quota, an NFS
error) leaves it ``finalizing`` or ``cancelling``, its files where they are, and the runner's scan tries it
again after a back-off, as a restart would.  Before that, the batch fails with why, keeping the lines it
answered."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..batches import TERMINAL, batch_usage
from . import batchcharge
from .batchout import done_lines

if TYPE_CHECKING:
    from .batchrun import BatchRunner

log = logging.getLogger("slurmfleet.batches")
RETRY_MAX_S = 300.0   # a batch whose end fails is tried again after 2, 4, 8 ... s, this at most


def counts_final(rec: dict) -> bool:
    """Whether the batch's counts are final: its ``ending`` decided with them (``mark_ending``; in shared mode
    any ``ending``: it is saved with the final counts).  A dedicated batch's ``ending`` may be decided before
    its array has ended (a key revoked, a failure, the expiry): final once it is ``finalizing`` (or cancelled)."""
    if "ending" not in rec:
        return False
    return not rec.get("shards") or rec["status"] == "finalizing" or rec["ending"] == "cancelled"


def expiring(runner: "BatchRunner", rec: dict, run) -> None:
    """A shared batch's run just decided its expiry (``run.stop``): saved at once (``expiring``, its counts not
    final yet), under the lock a cancel is weighed under, so that a cancel asked from here is refused as the
    batch's end is decided (409); one asked before it wins, and the batch ends as that cancel's answer said."""
    if rec.get("expiring"):   # (saved already: a cancel since was refused, nothing to weigh again)
        return
    with runner.store.deciding(rec["id"]):
        if runner.cancel_asked(rec):
            run.stop = "cancelled"
        else:
            rec["expiring"] = True
            runner.store.save(rec)


def counted(runner: "BatchRunner", rec: dict, stop: str, completed: int, failed: int, prompt_tokens: int,
            completion_tokens: int, also=None) -> str:
    """A batch's counts, final, saved with how it ends (``stop``; a cancel asked as its last lines were answered:
    as that cancel's answer said, which is returned), and ``also()`` done, under the lock a cancel is weighed
    under.  Run in a thread: the lock waits on a gateway process's cancel, and both write to the state dir."""
    with runner.store.deciding(rec["id"]):
        if not stop and runner.cancel_asked(rec):
            stop = "cancelled"
        rec["request_counts"].update(completed=completed, failed=failed)
        rec["usage"] = batch_usage(prompt_tokens, completion_tokens)
        if also is not None:
            also()
        runner.mark_ending(rec, stop)
        runner.store.save(rec)
    return stop


def client_reason(exc: BaseException) -> str:
    """What a batch's owner is told of ``exc``: a file system error by its kind alone (its message names a path
    on the server), anything else as raised (the full error goes to the log)."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'I/O error'}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def run_failed(runner: "BatchRunner", rec: dict, exc: Exception) -> None:
    """The batch's run raised ``exc``.  Ended already (a clean-up after its end failed): it stays ended.  Its counts
    final: nothing is counted again nor ended; it is tried again after a back-off (the scan starts it anew from
    its saved record).  Otherwise it fails with why, keeping the lines it answered; when even that fails, it is
    tried again the same way."""
    bid = rec["id"]
    if rec["status"] in TERMINAL:
        log.error("batch %s: failed after it ended %s", bid, rec["status"], exc_info=exc)
        return
    if not counts_final(rec):
        log.error("batch %s failed", bid, exc_info=exc)
        why = client_reason(exc)
        rec.update(errors={"object": "list", "data": [{"code": "runner_error", "message": why,   # (no server path)
                                                       "param": None, "line": None}]})
        try:
            return fail_keeping_answers(runner, rec)
        except Exception as again:  # noqa: BLE001 - the answers stay in the batch folder: tried again
            exc = again
    tries = runner.retries.get(bid, (0, 0.0))[0] + 1
    wait = min(RETRY_MAX_S, 2.0 ** tries)
    runner.retries[bid] = (tries, runner.clock() + wait)
    log.error("batch %s cannot be ended (try %d): its files are kept; tried again in %.0f s", bid, tries, wait,
              exc_info=exc)


def fail_keeping_answers(runner: "BatchRunner", rec: dict) -> None:
    """A failed batch keeps the lines it answered: counted from its files (then final: a restart only ends it),
    or its record's counts when they are final already (its files may be handed over in part), handed over as
    its output and error files.  A dedicated batch's files are there once its shards are merged."""
    bid = rec["id"]
    merged = any((runner.store.dir / f"{bid}.{k}.jsonl").exists() for k in ("output", "errors"))
    if not rec.get("shards") or merged:   # (a dedicated batch's end decided before its merge too: expired, blocked)
        counts = rec["request_counts"]
        if counts_final(rec):
            ok, bad = counts["completed"], counts["failed"]
        else:
            seen = bytearray(counts["total"] // 8 + 1)
            ok, p_ok, c_ok = done_lines(runner.store.dir / f"{rec['id']}.output.jsonl", seen)
            bad, p_bad, c_bad = done_lines(runner.store.dir / f"{rec['id']}.errors.jsonl", seen)
            if not rec.get("shards") and batchcharge.charge(runner, rec, ok, p_ok + p_bad, c_ok + c_bad) is None:
                raise RuntimeError("the usage ledger cannot be written: its owner is charged first")
        if ok or bad:
            counts.update(completed=ok, failed=bad)
            rec["ending"], rec["ending_at"] = "failed", rec.get("ending_at") or int(runner.clock())
            runner.store.save(rec)
            return runner.finalize(rec, "failed")
    rec.update(status="failed", failed_at=int(runner.clock()))
    runner.store.save(rec)
    for k in ("output", "errors"):   # (a run's empty files: no answer to hand over, nothing to keep)
        (runner.store.dir / f"{bid}.{k}.jsonl").unlink(missing_ok=True)


def output_ids(runner: "BatchRunner", rec: dict, kinds: str) -> dict[str, str]:
    """The ids of a batch's output (kind "o") and error ("e") files, each a time id of this hand-over try (a
    files list orders them there, by their ``created_at``; ids of when the batch began to end sorted before files
    uploaded while a hand-over waited, and a client listing ``order=asc`` after the last id it knew missed them),
    with its batch's random part.  Kept in the record, saved before a file is made; an id whose file has begun
    (its record or its content there: a restart, a failed try) or was handed over (``handed``: deleted by its
    owner since, it stays deleted) is kept, one not begun is made again at each try.  One an earlier version
    made (from the batch's id alone, or from when it began to end) is found again."""
    owner, ids, saved = rec["owner"], rec.setdefault("file_ids", {}), runner.store.load(rec["id"]) or {}
    for k, v in (saved.get("file_ids") or {}).items():   # (a copy from before a try)
        ids.setdefault(k, v)
    rec["handed"] = "".join(k for k in "oe" if k in rec.get("handed", "") + saved.get("handed", ""))

    def begun(fid: str) -> bool:
        return runner.files.get(fid, owner, expired=True) is not None or runner.files.data_path(fid).exists()
    bid, at = rec["id"], rec.get("finalizing_at") or rec.get("cancelling_at") or rec.get("ending_at")
    fresh = {}
    for kind in kinds:
        old = [f"file-{bid[6:]}{kind}"] + ([f"file-{int(at * 1000):012x}{bid[18:]}{kind}"] if at else [])
        if not (kind in ids and (kind in rec["handed"] or begun(ids[kind]))):
            fresh[kind] = next((f for f in old if begun(f)), None) or (
                f"file-{int(time.time() * 1000):012x}{bid[18:]}{kind}" if len(bid) == len("batch_") + 28 else old[0])
    if fresh:
        ids.update(fresh)
        runner.store.save(rec)   # (before the files begin: a restart finds the ids they may have begun under)
    return ids


def finalize(runner: "BatchRunner", rec: dict, stop: str) -> None:
    """Hand the output and error files to the file store (idempotent: their ids follow from the batch's; a
    file not handed over stays in the batch folder until it is; one handed over is saved so in the record at
    once, and a later try leaves it be: its owner may have deleted it meanwhile) and end the record."""
    now, owner, bid = int(runner.clock()), rec["owner"], rec["id"]
    out, err = runner.store.dir / f"{bid}.output.jsonl", runner.store.dir / f"{bid}.errors.jsonl"
    counts, expires = rec["request_counts"], rec.get("output_expires_after_s")
    kinds = "o" * bool(counts["completed"] or not (counts["failed"] or stop == "failed")) + "e" * bool(counts["failed"])
    ids = output_ids(runner, rec, kinds)
    named = [(k, p, n) for k, p, n in (("o", out, "output"), ("e", err, "error")) if k in kinds]
    for kind, path, name in named:
        if kind not in rec["handed"]:
            runner.files.adopt(path, owner, "batch_output", f"{bid}_{name}.jsonl", ids[kind], expires)
            rec["handed"] += kind
            runner.store.save(rec)   # (a try after this one, or a restart, hands it over no more)
    rec.update({f"{name}_file_id": ids[kind] for kind, _, name in named})
    for p in (out, err):
        p.unlink(missing_ok=True)
    status = stop if stop in ("failed", "cancelled", "expired") else "completed"
    ended = {**rec, "status": status, f"{status}_at": now}
    runner.store.save(ended)   # (not saved, the record in memory is not ended either: tried again)
    rec.update(ended)
    log.info("batch %s %s: %d completed, %d failed", bid, rec["status"], counts["completed"], counts["failed"])
