"""One shared-mode batch's answers on disk: the output and error files, each answer one line appended and
fsync'd before it counts (one fsync, in a thread, for the answers that came meanwhile), with the request's input line number in its ``id``; read back after a restart (a
line half written is cut), so a line is answered exactly once."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import orjson

from ..durable import fsync_dir

# the error of a line the batch's expiry cut off (OpenAI's, for each line an expired batch did not answer)
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}


def done_lines(path: Path, seen: bytearray) -> tuple[int, int, int]:
    """Mark the input lines answered in ``path`` (``id`` ends ``-<line>``); cut a last line half written.
    Returns (answers, prompt tokens, completion tokens)."""
    if not path.exists():
        return 0, 0, 0
    n = prompt = completion = 0
    with open(path, "r+b") as f:
        good = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                obj = json.loads(raw)
                line = int(obj["id"].rsplit("-", 1)[1])
            except (ValueError, KeyError, IndexError, AttributeError, TypeError):
                break
            seen[line >> 3] |= 1 << (line & 7)
            n += 1
            body = (obj.get("response") or {}).get("body")   # (an engine's answer: not always an object)
            usage = body.get("usage") if isinstance(body, dict) else None
            if isinstance(usage, dict):
                prompt += _count(usage.get("prompt_tokens"))
                completion += _count(usage.get("completion_tokens"))
            good += len(raw)
        f.truncate(good)
    return n, prompt, completion


OUTCOMES = ("completed", "failed", "client_error", "cancelled")   # slurmfleet_batch_requests_total's outcome


def outcome(status: int | None, ok: bool, code: str) -> str:
    """An answer's outcome in the metrics: completed (2xx); client_error (a 4xx but 408: the line's own request,
    or its key's rights, not the service failing); cancelled (in flight when its batch was cancelled); failed
    (5xx or a broken connection after the retries, cut off by the expiry, a runner error)."""
    if ok:
        return "completed"
    if status is not None and 400 <= status < 500 and status != 408:
        return "client_error"
    return "cancelled" if code == "batch_cancelled" else "failed"


class Run:
    """One batch being run: its files, its progress, its concurrency."""

    def __init__(self, rec: dict, dir: Path, total: int, count: Callable[[str, dict], None] = lambda o, u: None):
        self.rec, self.count = rec, count
        self.out_path = dir / f"{rec['id']}.output.jsonl"
        self.err_path = dir / f"{rec['id']}.errors.jsonl"
        self.seen = bytearray(total // 8 + 1)
        self.completed, p_ok, c_ok = done_lines(self.out_path, self.seen)
        self.failed, p_err, c_err = done_lines(self.err_path, self.seen)
        self.prompt_tokens, self.completion_tokens = p_ok + p_err, c_ok + c_err
        self.charged: tuple[int, int, int] | None = None   # (completed, tokens) its owner was charged up to
        self.limit = 2
        self.inflight: set[asyncio.Task] = set()
        self.wake = asyncio.Event()   # a request ended or the limit moved
        self.stop = ""   # why new requests stopped: "cancelled", "expired"
        self.broken: Exception | None = None   # an answer could not be written: the batch fails with it
        made = not (self.out_path.exists() and self.err_path.exists())
        self.out = open(self.out_path, "ab")
        self.err = open(self.err_path, "ab")
        if made:   # (their names as durable as the answers fsync'd in them: a power cut loses no answer counted)
            fsync_dir(dir)
        self.written = {True: 0, False: 0}   # answers appended to the output (True) and error (False) file
        self.synced = {True: 0, False: 0}    # ... of which an fsync has made durable
        self.syncing = asyncio.Lock()
        self.fsyncs = 0

    def write(self, line: int, custom_id: str, status: int | None, body, ok: bool, code: str = "") -> tuple[str, dict]:
        """Append one answer (in the file, not yet fsync'd): the line is never sent again.  No status: the
        request was aborted (``code`` says why).  Returns its outcome and usage."""
        entry = {"id": f"batch_req_{self.rec['id'][6:]}-{line}", "custom_id": custom_id,
                 "response": None if status is None else {"status_code": status,
                                                          "request_id": f"{self.rec['id']}-{line}", "body": body},
                 "error": None if ok or status is not None else {"code": code, "message": _message(body)}}
        f = self.out if ok else self.err
        f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")   # (any JSON the engine sent)
        f.flush()
        self.written[ok] += 1
        self.seen[line >> 3] |= 1 << (line & 7)
        usage = body.get("usage") if isinstance(body, dict) else None
        return outcome(status, ok, code), usage if isinstance(usage, dict) else {}

    def counted(self, outcome: str, usage: dict) -> None:
        if outcome == "completed":
            self.completed += 1
        else:   # (request_counts.failed: every error line)
            self.failed += 1
        self.prompt_tokens += _count(usage.get("prompt_tokens"))
        self.completion_tokens += _count(usage.get("completion_tokens"))
        self.count(outcome, usage)

    async def answer(self, line: int, custom_id: str, status: int | None, body, ok: bool, code: str = "") -> None:
        """One answer, durable before it counts (or, when the fsync fails or the task is cancelled meanwhile,
        counted anyway: it is in the file, which the batch's end, or a restart, reads)."""
        outcome, usage = self.write(line, custom_id, status, body, ok, code)
        try:
            await self.durable(ok)
        finally:   # (a cancel while it syncs: the line is written, and close() syncs it)
            self.counted(outcome, usage)

    async def durable(self, ok: bool) -> None:
        """Wait until what was written to the file is fsync'd: one fsync, in a thread, for the answers that
        came meanwhile (the daemon's loop, which may serve the gateway too, never waits on the disk)."""
        mine = self.written[ok]
        async with self.syncing:
            if self.synced[ok] >= mine:
                return
            upto, f = self.written[ok], self.out if ok else self.err
            await asyncio.to_thread(_fsync, os.dup(f.fileno()))   # (its own descriptor: close() may come first)
            self.fsyncs += 1
            self.synced[ok] = max(self.synced[ok], upto)

    def expire_rest(self, lines) -> None:
        """Every line never answered gets its ``batch_expired`` error line (as OpenAI's expired batches say),
        written in one go and made durable once; a restart part way writes the rest."""
        n = 0
        for line, raw in lines:
            if self.seen[line >> 3] & (1 << (line & 7)):
                continue
            try:
                custom_id = orjson.loads(raw).get("custom_id")
            except (ValueError, AttributeError):
                custom_id = None
            entry = {"id": f"batch_req_{self.rec['id'][6:]}-{line}", "custom_id": custom_id, "response": None,
                     "error": dict(EXPIRED)}
            self.err.write(orjson.dumps(entry) + b"\n")
            self.seen[line >> 3] |= 1 << (line & 7)
            n += 1
        self.err.flush()
        os.fsync(self.err.fileno())
        self.failed += n

    def close(self) -> None:
        for f in (self.out, self.err):
            if not f.closed:
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError:   # (a full disk: what was written stays; a restart reads it back)
                    pass
                f.close()


def _count(value) -> int:
    """A token count from an answer's ``usage``: a whole number, else 0 (an odd engine's answer ends no batch)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _message(body) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return ""


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
