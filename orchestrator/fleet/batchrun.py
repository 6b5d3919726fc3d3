"""The batch runner (root task ``batches``): runs every active batch of :mod:`orchestrator.batches` on the
fleet's spare capacity, through the gateway like any client but with the daemon's own key, whose requests
are the gateway's lowest priority class (and vLLM's lowest ``priority`` where the model schedules by it).

Durable and exactly once in the output: each answer is one line appended (and fsync'd) to the batch's
output or error file, with the request's input line number in its ``id``; a runner that starts again (a
daemon restart, even after SIGKILL) reads those files back, cuts a line half written, and sends only the
lines without an answer; its owner is charged from those files (:mod:`orchestrator.fleet.batchcharge`), each line
once.  Memory is one bit per input line plus the requests in flight.  Its end, once its
counts are final, is never undone by an error: a hand-over that fails (a full disk) is tried again after a
back-off (:mod:`orchestrator.fleet.batchend`).

Concurrency adapts per batch, every second, to the model's state in the routing table: halved when its
engines queue requests (``vllm:num_requests_waiting``), their KV cache is nearly full, or interactive
requests wait in the gateway; grown by one per READY replica while the batch uses all it has.  A cancel
(marker file) stops new requests at once and aborts those in flight; an expired ``completion_window``
ends the batch as ``expired`` with what was done.

A batch created with ``metadata.shards`` runs in dedicated mode instead: its own SLURM job array of ``vllm
run-batch`` tasks (:mod:`orchestrator.fleet.batcharray`, made by the daemon's ``dedicated`` factory); the runner
watches it, turns a cancel or an expiry into the array's cancel, shows each shard's progress in the record's
``slurm`` field, and hands the merged files over as in shared mode.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import aiohttp
import orjson

from ..batches import TERMINAL, BatchStore, batch_usage
from ..contract import QueueState, RoutingTable
from ..keys import BATCH_OWNER
from .batcharray import ArrayBatch
from . import batchcharge, batchend, batchscan
from .batchdedicated import run_dedicated, shard_states
from .batchout import EXPIRED, OUTCOMES, Run
from .slurm import JobInfo

log = logging.getLogger("slurmfleet.batches")
SCAN_S = 1.0
READ_LINES = 512   # the input's lines read at a time, in a thread
WAIT_STATUS = {429, 503}          # busy, scaling, a budget spent: nothing ran; tried again until the expiry
BROKEN_STATUS = {500, 502, 504}   # the line may have run (or may break a replica): tried BROKEN_TRIES times
BROKEN_TRIES = 5
RETRY_AFTER_MAX_S = 30.0          # a Retry-After longer than this is looked at again after this long


def next_limit(limit: int, inflight: int, replicas: int, busy: bool, cap: int, full: bool = False) -> int:
    """Additive increase while the batch uses what it has and the model is not busy; halve when it is; one
    less per replica while a replica runs near all its slots (an engine does not preempt a running request
    for a more urgent one: an interactive request needs a free slot when it comes)."""
    if replicas == 0:
        return 1
    if busy:
        return max(1, limit // 2)
    if full:
        return max(1, limit - replicas)
    if inflight >= limit:
        return min(cap, limit + replicas)
    return limit


class BatchRunner:
    def __init__(self, store: BatchStore, files, url: Callable[[], str], secret: str,
                 session: aiohttp.ClientSession, table: Callable[[], RoutingTable],
                 queued: Callable[[], Mapping[str, QueueState]], max_inflight: Callable[[str], int],
                 clock: Callable[[], float] = time.time, kv_high: Callable[[], float] = lambda: 0.9,
                 dedicated: Callable[[dict, Path, Path], ArrayBatch] | None = None,
                 slots: Callable[[str], int | None] = lambda m: None,
                 charge: Callable[..., bool] = lambda ref, owner, m, counts, write=True: True,
                 budget: Callable[[str], tuple[int, float] | None] = lambda owner: None,
                 refusal: Callable[[str, str], str | None] = lambda owner, model: None,
                 in_fleet: Callable[[str], bool] = lambda model: True,
                 connect_timeout_s: float = 3.0, cancel_job: Callable[[str], Awaitable[None]] | None = None,
                 batch_jobs: Callable[[str], Awaitable[list[JobInfo]]] | None = None,
                 retention_s: Callable[[], float] = lambda: 0.0):
        # a request waits as long as the gateway holds it (its queue, a cold start, a long generation: the
        # gateway bounds each and answers): only the connection to the gateway is timed here
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self.store, self.files, self.url, self.secret, self.session = store, files, url, secret, session
        # (reference, owner key, model, (requests, prompt, completion tokens) so far, write=now?) into the owner's
        # usage, what is new per reference: a batch's lines (the gateway does not charge them), a dedicated
        # batch's shards
        self.charge = charge
        # an owner key's token budget: (tokens left in its period, the period's end, epoch s), None without one
        self.budget = budget
        # why an owner key's work on a model may not run any more (revoked, the model taken away), or None
        self.refusal = refusal
        self.in_fleet = in_fleet   # is the model in the fleet's config (a reload may have taken it out)
        self.table, self.queued, self.max_inflight, self.clock, self.kv_high = (table, queued, max_inflight,
                                                                                 clock, kv_high)
        self.dedicated, self.slots = dedicated, slots
        self.retention_s = retention_s   # an ended batch's record goes this long after its end (0: never)
        self.cancel_job = cancel_job   # scancel of a job array whose executor cannot be made (its model left)
        self.batch_jobs = batch_jobs   # squeue of a batch's job name, by its id (the same batch: every job of it)
        self.runs: dict[str, asyncio.Task] = {}
        self.progress: dict[str, Run] = {}
        self.arrays: dict[str, ArrayBatch] = {}
        self.states: dict[str, int] = {}                  # batches in the store by status, as the last scan saw
        self.requests: dict[tuple[str, str], int] = {}    # (model, one of OUTCOMES) since this start
        self.tokens: dict[tuple[str, str], int] = {}      # (model, prompt|completion) since this start
        self.ended: dict[str, dict] = {}   # ended records (final), read once: the scan runs every second
        self.swept, self.next_expiry = False, 0.0   # (a first scan's sweep of crashes' leftovers; expired files)
        self.retries: dict[str, tuple[int, float]] = {}   # batches whose end failed: (tries, next try, epoch s)
        self.left: set[str] = set()   # batches whose run ended while the scan's read was out
        self.cancels: dict[str, int] = {}   # batches not ended whose cancel the last scan found asked, and when

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.scan_off_loop()
                except Exception:  # one bad record must not stop the runner: the next scan retries
                    log.exception("batch scan failed")
                await asyncio.sleep(SCAN_S)
        finally:   # the daemon stops: requests in flight are sent again by the next start
            await self.close()

    async def scan_off_loop(self) -> None:
        """The records read in a thread (a hung state dir stalls this scan only: :mod:`.batchscan`), applied here."""
        self.left = set()   # (runs ended from now on: their records read may be from before their end)
        self._apply(await asyncio.to_thread(batchscan.read, self.store, self.ended, self.retention_s(),
                                            self.clock(), not self.swept))

    def scan(self) -> None:
        """:meth:`scan_off_loop` all on the caller's thread."""
        self.left = set()
        self._apply(batchscan.read(self.store, self.ended, self.retention_s(), self.clock(), not self.swept))

    def _apply(self, found: batchscan.Found) -> None:
        states = dict.fromkeys(("validating", "in_progress", "finalizing", "cancelling", *sorted(TERMINAL)), 0)
        inputs = set()   # of batches not ended: kept past their expiry while their runners read them
        self.ended, self.cancels = found.ended, found.cancels
        for rec in found.records:
            bid = rec["id"]
            states[rec["status"]] = states.get(rec["status"], 0) + 1
            if rec["status"] not in TERMINAL:
                inputs.add(rec.get("input_file_id"))
            if rec["status"] in ("validating", "in_progress", "finalizing", "cancelling") and bid not in self.runs \
                    and bid not in self.left and self.clock() >= self.retries.get(bid, (0, 0.0))[1]:
                self.runs[bid] = asyncio.create_task(self._guarded(rec), name=f"batch-{bid}")
        self.states, self.swept = states, True
        if found.dropped:
            log.info("removed %d batch record%s ended over %g days ago (batches.retention_s)", found.dropped,
                     "s" * (found.dropped != 1), self.retention_s() / 86400)
        if self.clock() >= self.next_expiry:   # files past their expires_at go, a minute late at most (off the
            self.next_expiry = self.clock() + 60.0   # loop: it reads every key's file records)
            self.expiring = asyncio.ensure_future(asyncio.to_thread(self.files.expire, inputs, self.clock(),
                                                                    self.store.inputs))

    def pending(self) -> dict[str, int]:
        """Per model: batch requests not answered yet (what an autoscaler may count as load).  A dedicated
        batch brings its own GPUs: not the fleet's load; nor do the lines of an owner whose token budget is spent
        (the gateway refuses them until the next period: a replica kept for them would serve nothing)."""
        out: dict[str, int] = {}
        for r in self.progress.values():
            if (left := self.budget(r.rec["owner"])) is not None and left[0] <= 0:
                continue
            left = r.rec["request_counts"]["total"] - r.completed - r.failed - len(r.inflight)   # not sent yet
            for m in r.rec.get("models") or ():
                out[m] = out.get(m, 0) + left
        return out

    def stats(self) -> dict:
        """What the metrics show (orchestrator.observability): batches by status, requests answered and tokens
        since this start, per model what waits and what is in flight, the dedicated batches' shards by state."""
        inflight: dict[str, int] = {}
        for r in self.progress.values():
            for m in r.rec.get("models") or ():
                inflight[m] = inflight.get(m, 0) + len(r.inflight)
        return {"batches": dict(self.states), "requests": dict(self.requests), "tokens": dict(self.tokens),
                "queued": self.pending(), "inflight": inflight, "shards": shard_states(self.arrays.values())}

    def count(self, model: str, outcome: str, usage: Mapping, n: int = 1) -> None:
        """``n`` lines answered with ``outcome`` (one of OUTCOMES: a dedicated batch's are completed or failed)."""
        for o in OUTCOMES:   # (every outcome of a model that has had a batch line, from 0)
            self.requests.setdefault((model, o), 0)
        self.requests[(model, outcome)] += n
        for kind in ("prompt", "completion"):
            t = int(usage.get(f"{kind}_tokens") or 0)
            if t:
                self.tokens[(model, kind)] = self.tokens.get((model, kind), 0) + t

    def _work(self, bid: str) -> Path:
        return batchscan.work(self.store, bid)

    async def close(self) -> None:
        for t in self.runs.values():
            t.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)

    async def _guarded(self, rec: dict) -> None:
        try:
            await self._run(rec)
            self.retries.pop(rec["id"], None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - it fails with why, or its end is tried again; the daemon goes on
            await asyncio.to_thread(batchend.run_failed, self, rec, exc)   # (reads its files back: off the loop)
        finally:
            if rec["status"] in TERMINAL:   # (ended by run_failed: its back-off goes with it)
                self.retries.pop(rec["id"], None)
            self.runs.pop(rec["id"], None)
            self.left.add(rec["id"])
            run = self.progress.pop(rec["id"], None)
            if run is not None:
                run.close()

    async def _run(self, rec: dict) -> None:
        now = self.clock()
        if rec.get("shards"):
            return await run_dedicated(self, rec)
        if "ending" in rec:   # stopped while it was ending, its counts final: end it
            return await asyncio.to_thread(self.finalize, rec, rec["ending"])
        if not self.cancel_asked(rec) and rec["status"] == "validating" and now < rec["expires_at"]:   # (expired: it
            rec.update(status="in_progress", in_progress_at=int(now))   # never ran, OpenAI's in_progress_at is null)
            self.store.save(rec)
        model = (rec.get("models") or [""])[0]
        run = self.progress[rec["id"]] = await asyncio.to_thread(   # (reads its answers back: a large batch's
            Run, rec, self.store.dir, rec["request_counts"]["total"],  # files are read off the daemon's loop)
            lambda outcome, usage: self.count(model, outcome, usage))
        if batchcharge.begin(rec, run):   # (what its owner is charged counts from here)
            self.store.save(rec)
        if self.cancel_asked(rec):   # before any line is sent (or again, after a restart)
            run.stop = "cancelled"
        elif now >= rec["expires_at"]:   # (a daemon down across the expiry sends nothing more)
            run.stop = "expired"
        pump = asyncio.create_task(self._send_all(run))
        try:
            while not pump.done():
                await asyncio.wait({pump}, timeout=SCAN_S)
                self._tune(run, model)
                if not run.stop and self.cancel_asked(rec, scanned=True):
                    run.stop = "cancelled"
                elif not run.stop and self.clock() >= rec["expires_at"]:
                    run.stop = "expired"
                if run.stop == "expired":   # (in a thread: under the lock a gateway's cancel holds on the state dir)
                    await asyncio.to_thread(batchend.expiring, self, rec, run)
                if run.stop or run.broken:
                    pump.cancel()
                    for t in list(run.inflight):
                        t.cancel()   # closing the connection makes the engine abort the generation
                await self._progress(run)
            await asyncio.gather(pump, *run.inflight, return_exceptions=True)
        finally:
            pump.cancel()
            for t in list(run.inflight):   # a shutdown: the lines in flight are sent again by the next start, so
                t.cancel()                 # none may answer after the files close (charged twice, written nowhere)
            await asyncio.gather(*run.inflight, return_exceptions=True)
        failed = run.broken or (not pump.cancelled() and pump.exception())
        if failed:   # lines it could not read, send or write down: the batch fails with why, not 'completed'
            run.close()
            raise failed
        if run.stop == "expired":   # (decided as the last lines were sent: saved now, unless a cancel came first)
            await asyncio.to_thread(batchend.expiring, self, rec, run)
        if run.stop == "expired":   # (a large input is read in a thread: the daemon's loop goes on)
            await asyncio.to_thread(run.expire_rest, self.files.open_lines(rec["input_file_id"]))
        run.close()
        await batchcharge.settle(self, run)   # (its owner charged all it was answered before its counts are final)
        run.stop = await asyncio.to_thread(batchend.counted, self, rec, run.stop, run.completed, run.failed,
                                           run.prompt_tokens, run.completion_tokens)   # (final: a restart moves files)
        await asyncio.to_thread(self.finalize, rec, run.stop)   # (fsyncs and counts a large output: off the loop)

    def cancel_asked(self, rec: dict, scanned: bool = False) -> bool:
        """Whether the batch is being cancelled.  A cancel asked moves a batch ``validating`` or ``in_progress``
        to ``cancelling`` at once, saved, before any step forward: a GET shows ``cancelling`` from the cancel's
        answer on (the gateway reads the marker too), never an earlier status.  ``scanned``: as the last scan
        found its marker (a running batch's look every second, off the loop), not looked at now."""
        asked = self.cancels.get(rec["id"]) if scanned else self.store.cancel_requested(rec["id"])
        if asked and rec["status"] in ("validating", "in_progress"):
            rec.update(status="cancelling", cancelling_at=rec.get("cancelling_at") or asked)   # (as its answer said)
            self.store.save(rec)
        return bool(asked) and rec["status"] == "cancelling"

    def mark_ending(self, rec: dict, stop: str) -> None:
        """The record's last step before its files are handed over: ``cancelling`` for a cancel (an OpenAI
        cancelled batch has no ``finalizing_at``), ``finalizing`` otherwise; ``ending`` says how it ends.  A
        record ``finalizing`` already (its hand-over tried again, or a restart) keeps its ``finalizing_at``."""
        if stop == "cancelled":
            rec.update(status="cancelling", ending=stop)
        else:
            at = rec.get("finalizing_at") if rec["status"] == "finalizing" else None
            rec.update(status="finalizing", ending=stop, finalizing_at=at or int(self.clock()))

    async def _send_all(self, run: Run) -> None:
        """Send every unanswered line, at most ``run.limit`` at once."""

        def done(t: asyncio.Task) -> None:
            run.inflight.discard(t)
            run.wake.set()
        if run.stop:
            return
        lines = await asyncio.to_thread(self.files.open_lines, run.rec["input_file_id"])   # (the state dir's: read
        while block := await asyncio.to_thread(list, itertools.islice(lines, READ_LINES)):   # in a thread, in blocks)
            for line, raw in block:
                if run.seen[line >> 3] & (1 << (line & 7)):
                    if not line & 4095:   # (a restart's walk past a million answered lines: the loop serves meanwhile)
                        await asyncio.sleep(0)
                    continue
                while len(run.inflight) >= run.limit and not run.broken:
                    run.wake.clear()
                    await run.wake.wait()
                if run.broken:   # answers can no longer be written down: send nothing more
                    break
                task = asyncio.create_task(self._one(run, line, raw))
                run.inflight.add(task)
                task.add_done_callback(done)
            if run.broken:
                break
        await asyncio.gather(*list(run.inflight), return_exceptions=True)

    async def _one(self, run: Run, line: int, raw: bytes) -> None:
        req: dict = {}
        try:
            req = orjson.loads(raw)   # the parser that checked the upload
            status, body, ok = await self._send(run, req, f"{run.rec['id']}-{line}")
        except asyncio.CancelledError:   # a cancel or the expiry aborts it: an error line (a shutdown: sent again)
            if run.stop and not run.seen[line >> 3] & (1 << (line & 7)):   # (not one answered as it synced)
                try:
                    run.counted(*run.write(line, req.get("custom_id"), None, {"error": {
                        "message": f"aborted in flight: the batch was {run.stop}"}}, False, f"batch_{run.stop}"))
                except Exception as exc:  # noqa: BLE001
                    self._broken(run, line, exc)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever went wrong with this line, it gets an error line
            log.exception("batch %s line %d failed", run.rec["id"], line)
            await self._write(run, line, req.get("custom_id") if isinstance(req, dict) else None, None,
                              {"error": {"message": f"{type(exc).__name__}: {exc}"}}, False, "runner_error")
            return
        await self._write(run, line, req["custom_id"], status, body, ok, "" if status else EXPIRED["code"])

    async def _write(self, run: Run, line: int, *answer) -> None:
        """The line's one answer; one that cannot be written down (a full disk) fails the batch, keeping what
        was written, and never becomes a second line for the same input line."""
        try:
            await run.answer(line, *answer)
        except Exception as exc:  # noqa: BLE001
            self._broken(run, line, exc)

    @staticmethod
    def _broken(run: Run, line: int, exc: Exception) -> None:
        log.error("batch %s: the answer to line %d could not be written", run.rec["id"], line, exc_info=exc)
        run.broken = run.broken or exc
        run.wake.set()

    async def _send(self, run: Run, req: dict, rid: str) -> tuple[int, object, bool]:
        """The line's answer: a "busy" answer (429, 503) is tried again until the batch expires, after its
        Retry-After; a failure (500, 502, 504, a broken connection) up to ``BROKEN_TRIES`` times in all, then
        it is the line's error.  A line the expiry cuts off while it waits to try again: no status (its error
        line is ``batch_expired``, as the lines never sent), and the batch stops as expired.  ``rid``, the output
        line's ``request_id``, is its ``x-request-id``: the gateway's access log names it with the replica's."""
        delay, broken = 0.5, 0
        data = orjson.dumps(req["body"])   # (compact, UTF-8: the gateway's body limit counts what the client sent)
        headers = {"Authorization": f"Bearer {self.secret}", BATCH_OWNER: run.rec["owner"],
                   "Content-Type": "application/json", "x-request-id": rid}
        while True:
            after = 0.0
            try:
                async with self.session.post(self.url() + req["url"], data=data, headers=headers,
                                             timeout=self.timeout) as r:
                    body = await r.json(content_type=None)
                    status = r.status
                    after = _retry_after(r.headers.get("Retry-After"))
            except aiohttp.ClientConnectorError as exc:   # (the gateway not there: nothing ran, a restart soon)
                status, body = 503, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            except (aiohttp.ClientError, ValueError, asyncio.TimeoutError) as exc:
                status, body = 502, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            if status in BROKEN_STATUS:
                broken += 1
            if status not in WAIT_STATUS | BROKEN_STATUS or broken >= BROKEN_TRIES:
                break
            left = run.rec["expires_at"] - self.clock()
            if left > 0:
                pause = max(delay * (0.5 + random.random()), min(after, RETRY_AFTER_MAX_S))
                await asyncio.sleep(min(pause, left))   # the fleet is busy or scaling: try again
                delay = min(10.0, delay * 2)
            if self.clock() >= run.rec["expires_at"]:   # the expiry cut it off: the batch has expired
                run.stop = run.stop or "expired"
                return None, {"error": {"message": EXPIRED["message"]}}, False
        return status, body, 200 <= status < 300

    def _tune(self, run: Run, model: str) -> None:
        routes = self.table().models.get(model)
        replicas = routes.replicas if routes else ()
        q = self.queued().get(model)
        busy = bool(q and q.depth) or any((r.load.waiting or 0) > 0 or (r.load.kv_usage or 0) > self.kv_high()
                                           for r in replicas)
        slots = self.slots(model)   # the engine's max_num_seqs, when the config says it
        full = bool(slots) and any((r.load.running or 0) >= slots - max(1, slots // 5) for r in replicas)
        cap = max(1, len(replicas) * self.max_inflight(model))
        run.limit = next_limit(run.limit, len(run.inflight), len(replicas), busy, cap, full)
        run.wake.set()

    async def _progress(self, run: Run) -> None:
        counts = run.rec["request_counts"]
        if (counts["completed"], counts["failed"]) != (run.completed, run.failed):
            counts.update(completed=run.completed, failed=run.failed)
            run.rec["usage"] = batch_usage(run.prompt_tokens, run.completion_tokens)
            await asyncio.to_thread(self.store.save, dict(run.rec))   # (two fsyncs a second: off the loop)
        batchcharge.progress(self, run)   # (the owner's usage, from what the files hold)

    def finalize(self, rec: dict, stop: str) -> None:
        """Hand the output and error files over and end the record (:func:`orchestrator.fleet.batchend.finalize`)."""
        batchend.finalize(self, rec, stop)


def _retry_after(value: str | None) -> float:
    """A Retry-After header's seconds (0 when absent or not a number of seconds)."""
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0
