"""One shared-mode batch's answers on disk: the output and error files, each answer one line appended and
fsync'd before it counts, with the request's input line number in its ``id``; read back after a restart (a
line half written is cut), so a line is answered exactly once."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import orjson


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
            except (ValueError, KeyError, IndexError, AttributeError):
                break
            seen[line >> 3] |= 1 << (line & 7)
            n += 1
            usage = ((obj.get("response") or {}).get("body") or {}).get("usage") or {}
            prompt += int(usage.get("prompt_tokens") or 0)
            completion += int(usage.get("completion_tokens") or 0)
            good += len(raw)
        f.truncate(good)
    return n, prompt, completion


class Run:
    """One batch being run: its files, its progress, its concurrency."""

    def __init__(self, rec: dict, dir: Path, total: int, count: Callable[[bool, dict], None] = lambda ok, u: None):
        self.rec, self.count = rec, count
        self.out_path = dir / f"{rec['id']}.output.jsonl"
        self.err_path = dir / f"{rec['id']}.errors.jsonl"
        self.seen = bytearray(total // 8 + 1)
        self.completed, p_ok, c_ok = done_lines(self.out_path, self.seen)
        self.failed, p_err, c_err = done_lines(self.err_path, self.seen)
        self.prompt_tokens, self.completion_tokens = p_ok + p_err, c_ok + c_err
        self.limit = 2
        self.inflight: set[asyncio.Task] = set()
        self.wake = asyncio.Event()   # a request ended or the limit moved
        self.stop = ""   # why new requests stopped: "cancelled", "expired"
        self.broken: Exception | None = None   # an answer could not be written: the batch fails with it
        self.out = open(self.out_path, "ab")
        self.err = open(self.err_path, "ab")

    def answer(self, line: int, custom_id: str, status: int | None, body, ok: bool, code: str = "") -> None:
        """One answer, durable before it counts.  No status: the request was aborted (``code`` says why)."""
        entry = {"id": f"batch_req_{self.rec['id'][6:]}-{line}", "custom_id": custom_id,
                 "response": None if status is None else {"status_code": status,
                                                          "request_id": f"{self.rec['id']}-{line}", "body": body},
                 "error": None if ok else {"code": code or str(status), "message": _message(body)}}
        f = self.out if ok else self.err
        f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
        self.seen[line >> 3] |= 1 << (line & 7)
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        self.count(ok, usage)

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
                     "error": {"code": "batch_expired",
                               "message": "This request could not be executed before the completion window expired."}}
            self.err.write(orjson.dumps(entry) + b"\n")
            self.seen[line >> 3] |= 1 << (line & 7)
            n += 1
        self.err.flush()
        os.fsync(self.err.fileno())
        self.failed += n

    def close(self) -> None:
        self.out.close()
        self.err.close()


def _message(body) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return ""
