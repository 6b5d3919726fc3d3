"""The batch runner (root task ``batches``): runs every active batch of :mod:`orchestrator.batches` on the
fleet's spare capacity, through the gateway like any client but with the daemon's own key, whose requests
are the gateway's lowest priority class (and vLLM's lowest ``priority`` where the model schedules by it).

Durable and exactly once in the output: each answer is one line appended (and fsync'd) to the batch's
output or error file, with the request's input line number in its ``id``; a runner that starts again (a
daemon restart, even after SIGKILL) reads those files back, cuts a line half written, and sends only the
lines without an answer.  Memory is one bit per input line plus the requests in flight.

Concurrency adapts per batch, every second, to the model's state in the routing table: halved when its
engines queue requests (``vllm:num_requests_waiting``), their KV cache is nearly full, or interactive
requests wait in the gateway; grown by one per READY replica while the batch uses all it has.  A cancel
(marker file) stops new requests at once and aborts those in flight; an expired ``completion_window``
ends the batch as ``expired`` with what was done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from ..batches import BatchStore
from ..contract import QueueState, RoutingTable

log = logging.getLogger("slurmfleet.batches")
SCAN_S = 1.0
RETRY_STATUS = {429, 500, 502, 503, 504}


def done_lines(path: Path, seen: bytearray) -> tuple[int, int]:
    """Mark the input lines answered in ``path`` (``id`` ends ``-<line>``); cut a last line half written.
    Returns (answers, prompt + completion tokens)."""
    if not path.exists():
        return 0, 0
    n = tokens = 0
    with open(path, "r+b") as f:
        good = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                obj = json.loads(raw)
                line = int(obj["id"].rsplit("-", 1)[1])
            except (ValueError, KeyError, IndexError, AttributeError):
                break
            seen[line >> 3] |= 1 << (line & 7)
            n += 1
            usage = ((obj.get("response") or {}).get("body") or {}).get("usage") or {}
            tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            good += len(raw)
        f.truncate(good)
    return n, tokens


class Run:
    """One batch being run: its files, its progress, its concurrency."""

    def __init__(self, rec: dict, dir: Path, total: int):
        self.rec = rec
        self.out_path = dir / f"{rec['id']}.output.jsonl"
        self.err_path = dir / f"{rec['id']}.errors.jsonl"
        self.seen = bytearray(total // 8 + 1)
        self.completed, tok_ok = done_lines(self.out_path, self.seen)
        self.failed, tok_err = done_lines(self.err_path, self.seen)
        self.tokens = tok_ok + tok_err
        self.limit = 2
        self.inflight: set[asyncio.Task] = set()
        self.wake = asyncio.Event()   # a request ended or the limit moved
        self.stop = ""   # why new requests stopped: "cancelled", "expired"
        self.out = open(self.out_path, "ab")
        self.err = open(self.err_path, "ab")

    def answer(self, line: int, custom_id: str, status: int, body, ok: bool) -> None:
        entry = {"id": f"batch_req_{self.rec['id'][6:]}-{line}", "custom_id": custom_id,
                 "response": {"status_code": status, "request_id": f"{self.rec['id']}-{line}", "body": body},
                 "error": None if ok else {"code": str(status), "message": _message(body)}}
        f = self.out if ok else self.err
        f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            self.tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)

    def close(self) -> None:
        self.out.close()
        self.err.close()


def _message(body) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return ""


def next_limit(limit: int, inflight: int, replicas: int, busy: bool, cap: int) -> int:
    """Additive increase while the batch uses what it has and the model is not busy; halve when it is."""
    if replicas == 0:
        return 1
    if busy:
        return max(1, limit // 2)
    if inflight >= limit:
        return min(cap, limit + replicas)
    return limit


class BatchRunner:
    def __init__(self, store: BatchStore, files, url: Callable[[], str], secret: str,
                 session: aiohttp.ClientSession, table: Callable[[], RoutingTable],
                 queued: Callable[[], Mapping[str, QueueState]], max_inflight: Callable[[str], int],
                 clock: Callable[[], float] = time.time, kv_high: float = 0.9):
        self.store, self.files, self.url, self.secret, self.session = store, files, url, secret, session
        self.table, self.queued, self.max_inflight, self.clock, self.kv_high = (table, queued, max_inflight,
                                                                                 clock, kv_high)
        self.runs: dict[str, asyncio.Task] = {}
        self.progress: dict[str, Run] = {}

    async def run(self) -> None:
        try:
            while True:
                try:
                    self.scan()
                except Exception:  # one bad record must not stop the runner: the next scan retries
                    log.exception("batch scan failed")
                await asyncio.sleep(SCAN_S)
        finally:   # the daemon stops: requests in flight are sent again by the next start
            await self.close()

    def scan(self) -> None:
        for rec in self.store.all():
            bid = rec["id"]
            if rec["status"] in ("validating", "in_progress", "finalizing", "cancelling") and bid not in self.runs:
                self.runs[bid] = asyncio.create_task(self._guarded(rec), name=f"batch-{bid}")

    def pending(self) -> dict[str, int]:
        """Per model: batch requests not answered yet (what an autoscaler may count as load)."""
        out: dict[str, int] = {}
        for r in self.progress.values():
            left = r.rec["request_counts"]["total"] - r.completed - r.failed - len(r.inflight)   # not sent yet
            for m in r.rec.get("models") or ():
                out[m] = out.get(m, 0) + left
        return out

    async def close(self) -> None:
        for t in self.runs.values():
            t.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)

    async def _guarded(self, rec: dict) -> None:
        try:
            await self._run(rec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the batch fails with the reason; the daemon goes on
            log.exception("batch %s failed", rec["id"])
            rec.update(status="failed", failed_at=int(self.clock()),
                       errors={"object": "list", "data": [{"code": "runner_error", "message": str(exc),
                                                           "param": None, "line": None}]})
            self.store.save(rec)
        finally:
            self.runs.pop(rec["id"], None)
            run = self.progress.pop(rec["id"], None)
            if run is not None:
                run.close()

    async def _run(self, rec: dict) -> None:
        now = self.clock()
        if rec["status"] in ("finalizing", "cancelling"):   # stopped while it was ending: end it
            return self._finalize(rec, "cancelled" if rec["status"] == "cancelling" else "")
        if rec["status"] == "validating":
            rec.update(status="in_progress", in_progress_at=int(now))
            self.store.save(rec)
        run = self.progress[rec["id"]] = Run(rec, self.store.dir, rec["request_counts"]["total"])
        model = (rec.get("models") or [""])[0]
        pump = asyncio.create_task(self._send_all(run))
        try:
            while not pump.done():
                await asyncio.wait({pump}, timeout=SCAN_S)
                self._tune(run, model)
                if not run.stop and self.store.cancel_requested(rec["id"]):
                    run.stop = "cancelled"
                    rec.update(status="cancelling", cancelling_at=int(self.clock()))
                elif not run.stop and self.clock() >= rec["expires_at"]:
                    run.stop = "expired"
                if run.stop:
                    pump.cancel()
                    for t in list(run.inflight):
                        t.cancel()   # closing the connection makes the engine abort the generation
                self._progress(run)
            await asyncio.gather(pump, *run.inflight, return_exceptions=True)
        finally:
            pump.cancel()
        run.close()
        rec["request_counts"].update(completed=run.completed, failed=run.failed)
        rec["usage_tokens"] = run.tokens
        rec["status"] = "cancelling" if run.stop == "cancelled" else "finalizing"
        rec["finalizing_at"] = int(self.clock())
        self.store.save(rec)   # the counts are final: a restart from here only moves the files
        self._finalize(rec, run.stop)

    async def _send_all(self, run: Run) -> None:
        """Send every unanswered line, at most ``run.limit`` at once."""

        def done(t: asyncio.Task) -> None:
            run.inflight.discard(t)
            run.wake.set()
        for line, raw in self.files.open_lines(run.rec["input_file_id"]):
            if run.seen[line >> 3] & (1 << (line & 7)):
                continue
            while len(run.inflight) >= run.limit:
                run.wake.clear()
                await run.wake.wait()
            task = asyncio.create_task(self._one(run, line, raw))
            run.inflight.add(task)
            task.add_done_callback(done)
        await asyncio.gather(*list(run.inflight), return_exceptions=True)

    async def _one(self, run: Run, line: int, raw: bytes) -> None:
        req = json.loads(raw)
        delay = 0.5
        while True:
            try:
                async with self.session.post(self.url() + req["url"], json=req["body"],
                                             headers={"Authorization": f"Bearer {self.secret}"}) as r:
                    body = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, ValueError, asyncio.TimeoutError) as exc:
                status, body = 502, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            if status not in RETRY_STATUS or self.clock() >= run.rec["expires_at"]:
                break
            await asyncio.sleep(delay * (0.5 + random.random()))   # the fleet is busy or scaling: try again
            delay = min(10.0, delay * 2)
        run.answer(line, req["custom_id"], status, body, 200 <= status < 300)

    def _tune(self, run: Run, model: str) -> None:
        routes = self.table().models.get(model)
        replicas = routes.replicas if routes else ()
        q = self.queued().get(model)
        busy = bool(q and q.depth) or any((r.load.waiting or 0) > 0 or (r.load.kv_usage or 0) > self.kv_high
                                           for r in replicas)
        cap = max(1, len(replicas) * self.max_inflight(model))
        run.limit = next_limit(run.limit, len(run.inflight), len(replicas), busy, cap)
        run.wake.set()

    def _progress(self, run: Run) -> None:
        counts = run.rec["request_counts"]
        if (counts["completed"], counts["failed"]) != (run.completed, run.failed):
            counts.update(completed=run.completed, failed=run.failed)
            self.store.save(run.rec)

    def _finalize(self, rec: dict, stop: str) -> None:
        """Hand the output and error files to the file store (idempotent: their ids follow from the batch's)
        and end the record."""
        now, owner, bid = int(self.clock()), rec["owner"], rec["id"]
        out, err = self.store.dir / f"{bid}.output.jsonl", self.store.dir / f"{bid}.errors.jsonl"
        counts = rec["request_counts"]
        if counts["completed"] or not counts["failed"]:
            rec["output_file_id"] = self.files.adopt(out, owner, "batch_output", f"{bid}_output.jsonl",
                                                     file_id=f"file-{bid[6:]}o")
        if counts["failed"]:
            rec["error_file_id"] = self.files.adopt(err, owner, "batch_output", f"{bid}_error.jsonl",
                                                    file_id=f"file-{bid[6:]}e")
        for p in (out, err):
            p.unlink(missing_ok=True)
        if stop == "cancelled":
            rec.update(status="cancelled", cancelled_at=now)
        elif stop == "expired":
            rec.update(status="expired", expired_at=now)
        else:
            rec.update(status="completed", completed_at=now)
        self.store.save(rec)
        log.info("batch %s %s: %d completed, %d failed", bid, rec["status"], counts["completed"], counts["failed"])
