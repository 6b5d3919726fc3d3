"""Batch records: the OpenAI Batch objects of :mod:`orchestrator.gateway.batchapi` (which creates them and
asks for cancels) and :mod:`orchestrator.fleet.batchrun` (which runs them), durable under the state dir.

One JSON file per batch, ``<state_dir>/batches/<id>.json``, written whole (temporary file, fsync, rename):
a reader never sees half a record.  Only the runner rewrites a record after its creation; a cancel is a
marker file of its own (``<id>.cancel``), so the two sides never write the same file.  What a batch has
done is not in its record but in its output and error files (one line per ``custom_id``, appended and
fsync'd); the record's ``request_counts`` is a progress report the runner refreshes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .durable import fsync_dir, write_whole
from .pagination import page, time_id

TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
DEDICATED_ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")   # what vLLM 0.32's run-batch serves
MAX_SHARDS = 1000
WINDOWS_S = {"24h": 86400}
PUBLIC = ("id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status", "output_file_id",
          "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
          "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "metadata", "usage")


def new_batch(owner: str, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None,
              total: int, models: list[str], now: float | None = None) -> dict:
    now = time.time() if now is None else now
    created = int(now)
    return {"id": time_id("batch_", now), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created, "in_progress_at": None,
            "expires_at": created + WINDOWS_S[completion_window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata,
            "owner": owner, "models": models, "usage": batch_usage(0, 0)}


def batch_usage(prompt: int, completion: int) -> dict:
    """The Batch object's ``usage`` (OpenAI's shape), from the answers' own ``usage``."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def ending_otherwise(record: dict) -> bool:
    """Its end is decided (saved) and is not a cancel's: expired or failed, while it still shows in progress (a
    shared batch's expiry is saved as ``expiring`` when its runner decides it, before its counts are final)."""
    return record.get("ending", "cancelled") != "cancelled" or bool(record.get("expiring"))


def ended_at(record: dict) -> int | None:
    """When an ended batch ended (epoch s), or None."""
    return max((t for k in ("completed_at", "failed_at", "expired_at", "cancelled_at")
                if type(t := record.get(k)) in (int, float)), default=None)


def public(record: dict) -> dict:
    """What a client sees of a record (not its owner or the runner's bookkeeping); a dedicated batch's
    ``slurm`` too: its job array and each shard's state, pending reason and lines done."""
    out = {k: record.get(k) for k in PUBLIC}
    out["model"] = (record.get("models") or [None])[0]   # (the model its lines name; OpenAI's Batch has one)
    if record.get("slurm"):
        out["slurm"] = record["slurm"]
    return out


class BatchStore:
    def __init__(self, root: str | Path):
        self.dir = Path(root)

    def path(self, batch_id: str) -> Path:
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum() or not batch_id.isascii() \
                or len(batch_id) > 64:
            raise KeyError(batch_id)
        return self.dir / f"{batch_id}.json"

    def save(self, record: dict) -> None:
        """Write the record whole (a crash leaves the old one or the new one, never half)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        write_whole(self.path(record["id"]), json.dumps(record, separators=(",", ":")).encode())

    def load(self, batch_id: str) -> dict | None:
        try:
            return json.loads(self.path(batch_id).read_text())
        except (KeyError, OSError, ValueError):
            return None

    def uses(self, file_id: str, owner: str) -> str | None:
        """The id of an unfinished batch of ``owner`` that reads ``file_id``, if any."""
        return next((r["id"] for r in self.all() if r.get("owner") == owner and r.get("input_file_id") == file_id
                     and r.get("status") not in TERMINAL), None)

    def inputs(self) -> set[str]:
        """The input files of the batches that have not ended."""
        return {r.get("input_file_id") for r in self.all() if r.get("status") not in TERMINAL}

    def get(self, batch_id: str, owner: str) -> dict | None:
        """The record if it belongs to ``owner`` (another key's batch does not exist for it)."""
        rec = self.load(batch_id)
        return rec if rec is not None and rec.get("owner") == owner else None

    def all(self, ended: dict[str, dict] | None = None) -> Iterator[dict]:
        """Every record.  ``ended`` (file name -> ``{"id", "status", "ended_at"}``, filled here, and forgetting what
        is gone) stands in for the ended ones, which are never written again: a caller that looks every second
        reads each of those once, not each time."""
        try:
            names = [e.name for e in os.scandir(self.dir) if e.name.startswith("batch_") and e.name.endswith(".json")]
        except OSError:
            return
        if ended is not None:
            for name in ended.keys() - set(names):
                del ended[name]
        for name in names:
            if ended is not None and (stub := ended.get(name)) is not None:
                yield stub
                continue
            try:
                rec = json.loads((self.dir / name).read_text())
            except (OSError, ValueError):
                continue
            if ended is not None and rec.get("status") in TERMINAL:
                ended[name] = {"id": rec["id"], "status": rec["status"], "ended_at": ended_at(rec)}
            yield rec

    def list(self, owner: str, limit: int = 20, after: str | None = None) -> tuple[list[dict], bool]:
        """The owner's batches, newest first, after the batch ``after``: (page, more)."""
        return page((r for r in self.all() if r.get("owner") == owner), "batch_", limit, after)

    def remove(self, batch_id: str) -> None:
        """Forget an ended batch: its record, then its cancel marker (``batches.retention_s``)."""
        for p in (self.path(batch_id), *(self.path(batch_id).with_suffix(x) for x in (".cancel", ".lock"))):
            p.unlink(missing_ok=True)

    @contextlib.contextmanager
    def deciding(self, batch_id: str) -> Iterator[None]:
        """Held (an flock, across the gateway's processes and the daemon) while a cancel is weighed against the
        batch's status, and while its runner looks for a cancel and saves the end it decides: a cancel that
        came as the last lines ended is either seen by the runner or answered with the end it saw."""
        fd = os.open(self.path(batch_id).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)   # (which lets the lock go)

    def request_cancel(self, batch_id: str) -> int:
        """Ask the runner to cancel the batch; returns when that was first asked (epoch s), its cancelling_at."""
        p = self.path(batch_id).with_suffix(".cancel")
        try:
            p.touch(exist_ok=False)
            fsync_dir(p.parent)   # (answered 'cancelling': a crash of the machine keeps the ask)
        except FileExistsError:   # (asked again: the first ask's time stays)
            pass
        return int(p.stat().st_mtime)

    def cancel_requested(self, batch_id: str) -> int | None:
        """When a cancel was asked (epoch s), or None."""
        try:
            return int(self.path(batch_id).with_suffix(".cancel").stat().st_mtime)
        except FileNotFoundError:
            return None
