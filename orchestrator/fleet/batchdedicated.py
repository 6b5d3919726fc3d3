"""Dedicated mode in the batch runner: a batch created with ``metadata.shards`` runs as its own SLURM job array
(:mod:`orchestrator.fleet.batcharray`, made by the daemon's ``dedicated`` factory).  The runner starts or adopts
the array, turns a cancel, the expiry or its owner's key revoked into the array's cancel, charges each shard
done to the owner, holds the array while the owner's token budget is spent, shows each shard's state, pending
reason and lines done in the record's ``slurm`` field (what ``slurmfleet batch status`` prints), and hands the
merged output and error files over as in shared mode (a blocked array too, with the shards done; and one that
fails any other way: its array cancelled, the batch ``failed`` with why).  A restart in any state goes on: the
array's own state file says what was submitted and merged, the record's ``ending`` how it ends."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..batches import BatchStore, batch_usage
from ..timefmt import utc_minute
from .batcharray import ArrayBatch, ArrayBlocked
from .batchend import client_reason, counted
from .batchrules import live_jobs
from .batchshards import LineCounter, merge, shard_usage

if TYPE_CHECKING:
    from .batchrun import BatchRunner

log = logging.getLogger("slurmfleet.batches")
SCAN_S = 1.0
# a dedicated batch's shard state (batcharray's progress) -> the metrics' (None: not counted)
SHARD_STATES = {"done": "done", "failed": "failed", "cancelled": None, "RUNNING": "running",
                "COMPLETING": "running", "CONFIGURING": "running"}


def shard_states(arrays: Iterable[ArrayBatch]) -> dict[str, int]:
    """The shards of the arrays being run, by state (pending, running, done, failed)."""
    out = dict.fromkeys(("pending", "running", "done", "failed"), 0)
    for a in arrays:
        for sh in a.progress()["shards"]:
            state = SHARD_STATES.get(sh["state"], "pending")
            if state:
                out[state] += 1
    return out


async def run_dedicated(runner: "BatchRunner", rec: dict) -> None:
    """Dedicated mode: start (or adopt) the batch's job array, turn a cancel or the expiry into its cancel,
    report its shards in the record, then hand the merged files over."""
    bid = rec["id"]
    if runner.dedicated is None:
        raise RuntimeError("this daemon cannot run dedicated batches")
    if not runner.cancel_asked(rec) and rec["status"] == "validating" and runner.clock() < rec["expires_at"]:
        rec.update(status="in_progress", in_progress_at=int(runner.clock()))   # (expired: it never ran)
        runner.store.save(rec)
    try:
        arr = runner.dedicated(rec, runner.store.dir / f"{bid}.output.jsonl", runner.store.dir / f"{bid}.errors.jsonl")
    except Exception as exc:  # noqa: BLE001 - its model left the fleet's YAML (a restart), say: it fails
        log.exception("batch %s: its job array's executor cannot be made", bid)
        return await fail_unbuilt(runner, rec, exc)
    merged = arr.st["merged"] is not None   # a restart after the merge: the counts are in the record
    stop = decided(rec, arr.st)
    runner.arrays[bid] = arr
    charged: set[int] = set()
    model = (rec.get("models") or [""])[0]
    task = None
    try:
        if not merged:   # (a restart: what happened meanwhile stops it before anything more is submitted)
            stop = await ending(runner, rec, stop, model)
            if stop and not arr.st["cancelled"]:
                await arr.cancel(expired=stop == "expired")
        task = asyncio.create_task(arr.run(), name=f"batch-{bid}-array")
        while not task.done():
            await asyncio.wait({task}, timeout=SCAN_S)
            array_progress(runner.store, rec, arr)   # (first: an end is decided on the shards as they are now)
            if not merged:
                stop = await ending(runner, rec, stop, model)
            await charge_shards(runner, rec, model, arr, charged)
            if stop and not merged and not arr.st["cancelled"]:
                await arr.cancel(expired=stop == "expired")   # (expired: its lines not done get error lines)
            elif not stop and not merged:
                hold_for_budget(runner, rec, arr)
        completed, failed = task.result()
    except ArrayBlocked as exc:   # it fails, with the shards done (they are charged: the owner gets them)
        stop = await asyncio.to_thread(decide, runner, rec, "failed", {"object": "list", "data": [
            {"code": "slurm_blocked", "message": str(exc), "param": None, "line": None}]})
        completed, failed = await arr.merge_done()
    except Exception as exc:  # noqa: BLE001 - anything else: it fails, its array cancelled, the shards done kept
        log.exception("batch %s failed; cancelling its job array", bid)
        why = client_reason(exc)   # (no server path)
        if arr.st["merged"] is None:
            why += "; the batch's job array was cancelled, the shards done are handed over"
            if not arr.st["cancelled"]:
                await arr.cancel()
        stop = await asyncio.to_thread(fail, runner, rec, why)
        if task is not None:   # (one still running ends once its tasks are gone, with its own merge)
            await asyncio.gather(task, return_exceptions=True)
        completed, failed = await arr.merge_done()
    finally:
        if task is not None:
            task.cancel()
        runner.arrays.pop(bid, None)
    while not await charge_shards(runner, rec, model, arr, charged):   # the cleanup forgets the shards
        log.warning("batch %s: the usage ledger cannot be written; the batch ends once its shards are charged", bid)
        await asyncio.sleep(SCAN_S)
    if not merged:
        runner.count(model, "completed", {"prompt_tokens": arr.prompt_tokens, "completion_tokens": arr.completion_tokens},
                     completed)
        runner.count(model, "failed", {}, failed)
    def end() -> None:   # (in a thread: the lock waits on a gateway's cancel; the hand-over fsyncs and counts a large
        nonlocal stop    # output; its folder goes with it: a stop cancelling this task leaves neither half done)
        stop = counted(runner, rec, stop, completed, failed, arr.prompt_tokens, arr.completion_tokens,
                       lambda: array_progress(runner.store, rec, arr))   # (a cancel asked as its last shard ended)
        runner.finalize(rec, stop)
        arr.cleanup()
    await asyncio.to_thread(end)


def fail(runner: "BatchRunner", rec: dict, why: str) -> str:
    """The batch is to end ``failed`` with ``why`` (kept: a restart ends it so), unless a cancel came first
    (:func:`decide`); how it ends."""
    return decide(runner, rec, "failed", {"object": "list", "data": [
        {"code": "runner_error", "message": why, "param": None, "line": None}]})


async def fail_unbuilt(runner: "BatchRunner", rec: dict, exc: Exception) -> None:
    """The batch's executor cannot be made (its model left the fleet's YAML while the daemon was down, say): its
    jobs are cancelled (:func:`cancel_unbuilt`), and it fails, with the shards done read from its work folder,
    merged, charged and handed over; one merged with its end decided before a crash ends as decided."""
    bid, work, model = rec["id"], runner._work(rec["id"]), (rec.get("models") or [""])[0]
    try:
        st = json.loads((work / "array.json").read_text())
    except (OSError, ValueError):
        st = {}
    # merged and its end decided before a crash (completed: ending "", cancelled, expired): it ends so, not failed
    merged = st.get("merged") is not None
    stop = decided(rec, st) if merged and ("ending" in rec or decided(rec, st)) else "failed"
    said = await cancel_unbuilt(runner, rec, st)
    if stop == "failed":   # (unless a cancel came first: then it ends cancelled, as its answer said)
        stop = await asyncio.to_thread(fail, runner, rec, f"{exc}: the batch cannot run; the shards done are handed "
                                       f"over{said}")
    counts, given_up = st.get("counts") or [], {int(k): v for k, v in (st.get("given_up") or {}).items()}
    done = [i for i, n in enumerate(counts) if n and i not in given_up and
            LineCounter().count(work / "out" / f"shard-{i:04d}.jsonl") == n]
    c, f, prompt, completion = st.get("merged") or (0, 0, 0, 0)
    if counts and st.get("merged") is None:
        c, f, prompt, completion = await asyncio.to_thread(
            merge, work, len(counts), bid, given_up, runner.store.dir / f"{bid}.output.jsonl",
            runner.store.dir / f"{bid}.errors.jsonl",   # (expired: its batch_expired lines)
            bool(st.get("expired")) or rec.get("ending") == "expired")
    for i in done:   # (the same references as the executor's: a shard charged before is not charged again)
        try:
            usage = await asyncio.to_thread(shard_usage, work / "out" / f"shard-{i:04d}.jsonl")
        except OSError as e:   # (its files went with a cleanup): not counted, as the executor does
            log.warning("batch %s: cannot read shard %d's answers: %s", bid, i, e)
            continue
        while runner.charge(f"batch:{bid}:shard-{i}", rec.get("owner") or "", model, usage) is False:
            log.warning("batch %s: the usage ledger cannot be written; the batch ends once its shards are charged", bid)
            await asyncio.sleep(SCAN_S)
    if st.get("merged") is None:
        runner.count(model, "completed", {"prompt_tokens": prompt, "completion_tokens": completion}, c)
        runner.count(model, "failed", {}, f)
    rec["request_counts"].update(completed=c, failed=f)
    rec["usage"] = batch_usage(prompt, completion)
    runner.mark_ending(rec, stop)
    runner.store.save(rec)
    await asyncio.to_thread(runner.finalize, rec, stop)


async def cancel_unbuilt(runner: "BatchRunner", rec: dict, st: dict) -> str:
    """The jobs of a batch whose executor cannot be made, scancelled (``runner.cancel_job``) as the executor's
    cancel does: its array and retries (``st``, the array's state: not merged nor cancelled yet) and every job
    squeue lists under the batch's job name with a task not ended (``runner.batch_jobs``: an sbatch whose
    outcome was unknown, a duplicate, a cancelled array's jobs still live).  Their tasks would run on GPUs for
    nothing, into a work folder the next start removes.  What the error says of them: those that could not be
    cancelled or listed are named (an operator's scancel then)."""
    bid, merged = rec["id"], st.get("merged") is not None
    jobs = {st.get("job"), *(st.get("attempts") or {}).values()} - {None} \
        if not merged and not st.get("cancelled") else set()
    listed, name = False, (rec.get("slurm") or {}).get("job_name") or f"slurmfleet-<fleet>-{bid}"
    if runner.batch_jobs is not None and st.get("counts") is not None:   # (split: it may have submitted)
        try:
            rows = await runner.batch_jobs(bid)
            jobs |= live_jobs(rows)
            listed, name = True, next((r.name for r in rows), name)
        except Exception as e:  # noqa: BLE001 - named in the error: an operator's scancel then
            log.warning("batch %s: cannot list its jobs in squeue: %s", bid, e)
    left = []
    for job in sorted(jobs):
        try:
            if runner.cancel_job is None:
                raise RuntimeError("no SLURM client")
            await runner.cancel_job(job)
        except Exception as e:  # noqa: BLE001 - named in the error: an operator's scancel then
            log.warning("batch %s: cannot cancel its job %s: %s", bid, job, e)
            left.append(job)
    said = f"; its job array ({', '.join(sorted(jobs - set(left)))}) was cancelled" if len(left) < len(jobs) else ""
    if left:
        said += f"; its job array may still be running: this daemon could not cancel it (scancel {' '.join(left)})"
    if not listed and not merged and (st.get("submitting") or st.get("cancelled")):
        said += (f"; jobs of its name may still be running (an sbatch whose outcome was unknown, a cancel not "
                 f"yet done): this daemon could not list them (scancel --name={name})")
    return said


def decided(rec: dict, st: dict) -> str:
    """How the batch was to end as a restart finds it ('' if not decided, or decided to complete): its record's
    ``ending`` ("" for a completion: ``mark_ending(rec, "")``), else its array's expiry (``st``, the array's
    state: told the array before the record's save of it, by a version before), else a cancel (the record
    ``cancelling``)."""
    if "ending" in rec:
        return rec["ending"]
    return ("expired" if st.get("expired") else "") or ("cancelled" if rec["status"] == "cancelling" else "")


async def ending(runner: "BatchRunner", rec: dict, stop: str, model: str) -> str:
    """How the batch is to end, once it is: a cancel asked for, its expiry, its owner's key revoked (or the
    model taken from it: the shared runner's lines fail then, 401 / 404, so none of its work runs on), or its
    model taken out of the fleet's config (as a restart would fail it: its array cannot be made then).  The
    expiry and a failure are saved in the record's ``ending`` (a cancel is its ``cancelling``), as
    :func:`decide` does: a restart ends the batch as decided.  Once every shard is done (or given up: its lines
    fail) nothing but a cancel is decided: its lines are answered, and it completes (the merge of a large batch
    takes minutes, and its window could close meanwhile)."""
    if stop:
        return stop
    if runner.cancel_asked(rec, scanned=True):   # (its marker as the last scan found it: each tick, off the loop)
        return "cancelled"
    shards = (rec.get("slurm") or {}).get("shards")   # (as array_progress found them, just before)
    if shards and all(sh["state"] in ("done", "failed") for sh in shards):
        return ""
    if runner.clock() >= rec["expires_at"]:
        return await asyncio.to_thread(decide, runner, rec, "expired")
    why = runner.refusal(rec.get("owner") or "", model)
    code = "key_revoked"
    if not runner.in_fleet(model):
        why, code = f"the model `{model}` is no longer in the fleet (a reload took it out)", "model_not_found"
    if why:
        return await asyncio.to_thread(decide, runner, rec, "failed", {"object": "list", "data": [
            {"code": code, "message": f"{why}: the batch's job array was cancelled", "param": None, "line": None}]})
    return ""


def decide(runner: "BatchRunner", rec: dict, how: str, errors: dict | None = None) -> str:
    """Save the batch's end ``how`` (and ``errors``) under the lock a cancel is weighed under (run in a thread: it
    waits on the gateway's cancel), as a shared batch's expiry is: a cancel asked before it wins and the batch ends
    as that cancel's answer said (``cancelled``, returned); one asked after is refused (409).  How it ends."""
    with runner.store.deciding(rec["id"]):
        if runner.cancel_asked(rec):
            return "cancelled"
        rec["ending"] = how
        if errors is not None:
            rec["errors"] = errors
        runner.store.save(rec)
        return how


async def charge_shards(runner: "BatchRunner", rec: dict, model: str, arr: ArrayBatch, charged: set[int]) -> bool:
    """Each shard done into the owner's usage as a shared batch's lines are counted: once, under the batch's id
    and the shard's (again after a restart adds nothing), as soon as it is done, so the owner's
    budget sees it in the period it was done in.  True when every shard done is in the ledger's file."""
    ok = True
    for i, counts in (await arr.shard_usage()).items():
        if i not in charged:
            if runner.charge(f"batch:{rec['id']}:shard-{i}", rec.get("owner") or "", model, counts) is False:
                ok = False   # kept in memory by the ledger; asked again (the same reference) until written
            else:
                charged.add(i)
    return ok


def hold_for_budget(runner: "BatchRunner", rec: dict, arr: ArrayBatch) -> None:
    """Hold the array's tasks that have not started while its owner's token budget is spent (its shards
    done are in it); release them once it is not (the next period, a raised budget, no budget any more).
    Tasks running finish: a spent budget is passed by at most their lines."""
    owner = rec.get("owner") or ""
    budget = runner.budget(owner) if owner else None
    spent = None
    if budget is not None and budget[0] <= 0:
        spent = (f"the token budget of key {owner} is spent until "
                 f"{utc_minute(budget[1])}: shards not started wait for it")
    arr.hold(spent)   # (None: released)


def array_progress(store: BatchStore, rec: dict, arr: ArrayBatch) -> None:
    """The array's shards into the record (``slurm``: job, each shard's state, pending reason, lines done)."""
    p = arr.progress()
    slurm = {"job_id": p["job_id"], "job_name": p["job_name"], "blocked": p["blocked"], "held": p["held"],
             "waiting": p.get("waiting"), "shards": p["shards"]}
    counts = rec["request_counts"]
    done = {"completed": sum(s["done"] - s["errors"] for s in p["shards"]),   # (as the merge will count them)
            "failed": sum(s["lines"] if s["state"] == "failed" else s["errors"] for s in p["shards"])} \
        if all(s["errors"] is not None for s in p["shards"]) else {k: counts[k] for k in ("completed", "failed")}
    if p["merged"]:   # (a shard done whose answers are not read yet: the counts stay as they were, a scan at most)
        done = {"completed": counts["completed"], "failed": counts["failed"]}
    else:   # a task that died mid-shard (retried from its first line) takes back no answer shown: none goes back
        done["completed"] = min(max(done["completed"], counts["completed"]), counts["total"] - done["failed"])
    if rec.get("slurm") != slurm or {k: counts[k] for k in done} != done:
        rec["slurm"] = slurm
        counts.update(done)
        store.save(rec)
