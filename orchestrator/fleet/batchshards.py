"""A dedicated-mode batch's files (:mod:`orchestrator.fleet.batcharray`): the input split into shards, each
shard's ``vllm run-batch`` answers merged back in input order in the shared runner's format
(:mod:`orchestrator.fleet.batchrun`: OpenAI's batch output, ``id`` ``batch_req_<hex>-<input line>``), and the
counting that tells how far a running shard is.  Streaming throughout: one line in memory, except the answers
of one shard read ahead when they come out of order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..durable import fsync_dir
from .batchout import EXPIRED

PROGRESS = re.compile(rb"Running batch:\s*\d+% Completed \| (\d+)/(\d+)")   # vLLM's progress line (tqdm)


def shard_bounds(total: int, shards: int) -> list[int]:
    """Where each shard starts (an index into the input's lines), and the end: sizes differ by at most one."""
    return [i * total // shards for i in range(shards + 1)]


def split_input(lines: Iterable[tuple[int, bytes]], total: int, shards: int, work: Path) -> list[int]:
    """Write the shard files one after the other, streaming (one line in memory, two files open); returns each
    shard's line count.  Lines past ``total`` go to the last shard."""
    bounds, counts = shard_bounds(total, shards), [0] * shards
    it = iter(lines)
    for i in range(shards):
        with open(work / f"shard-{i:04d}.jsonl", "wb") as data, open(work / f"shard-{i:04d}.idx", "w") as idx:
            while i == shards - 1 or counts[i] < bounds[i + 1] - bounds[i]:
                item = next(it, None)
                if item is None:
                    break
                line_no, raw = item
                raw = raw.rstrip(b"\r\n")
                data.write(raw + b"\n")
                idx.write(json.dumps([line_no, json.loads(raw)["custom_id"]]) + "\n")
                counts[i] += 1
            for f in (data, idx):
                f.flush()
                os.fsync(f.fileno())
    return counts


def _message(error) -> str:
    if isinstance(error, dict):
        inner = error.get("error") if isinstance(error.get("error"), dict) else error
        return str(inner.get("message", ""))
    return "" if error is None else str(error)


def openai_line(obj: dict, batch_id: str, line_no: int) -> tuple[dict, bool]:
    """One ``vllm run-batch`` output line as the shared runner writes it (OpenAI's batch output): (entry, ok)."""
    resp = obj.get("response") or {}
    status = int(resp.get("status_code") or 500)
    body, error = resp.get("body"), obj.get("error")
    ok = error is None and 200 <= status < 300 and body is not None
    if not ok and body is None:
        body = {"error": error["error"]} if isinstance(error, dict) and isinstance(error.get("error"), dict) else {
            "error": {"message": _message(error), "type": "BadRequestError" if status < 500 else "InternalServerError",
                      "param": None, "code": status}}   # (vLLM's error object: its type, the status as code)
    return ({"id": f"batch_req_{batch_id[6:]}-{line_no}", "custom_id": obj.get("custom_id"),
             "response": {"status_code": status, "request_id": f"{batch_id}-{line_no}", "body": body},
             "error": None}, ok)   # (OpenAI's: an error only for a line without an HTTP answer)


class _ByCustomId:
    """A shard's answers looked up in input order: O(1) memory while they come in order (vLLM's do), the
    ones read ahead kept otherwise."""

    def __init__(self, f):
        self.f, self.ahead = f, {}

    def get(self, custom_id: str) -> dict | None:
        if custom_id in self.ahead:
            return self.ahead.pop(custom_id)
        for raw in self.f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if obj.get("custom_id") == custom_id:
                return obj
            self.ahead[obj.get("custom_id")] = obj
        return None


def merge(work: Path, shards: int, batch_id: str, given_up: dict[int, str], out_path: Path,
          err_path: Path, expired: bool = False) -> tuple[int, int, int, int]:
    """Every shard's answers, in input order, into the output and error files (written whole: temp + rename).
    A shard given up has an error line for each of its lines; a shard neither done nor given up has none
    after a cancel, and a ``batch_expired`` error line for each of its lines after the expiry (every line not
    answered then has one, so the counts add up to the total).  Returns (completed, failed, prompt tokens,
    completion tokens)."""
    completed = failed = prompt = completion = 0
    tmp_out, tmp_err = out_path.with_name(out_path.name + ".merge"), err_path.with_name(err_path.name + ".merge")
    with open(tmp_out, "wb") as out, open(tmp_err, "wb") as err:
        for i in range(shards):
            result = work / "out" / f"shard-{i:04d}.jsonl"
            cut = not result.exists() and i not in given_up   # a cancel's or the expiry's
            if cut and not expired:
                continue
            with open(work / f"shard-{i:04d}.idx") as idx, open(result if result.exists() else os.devnull) as res:
                answers = _ByCustomId(res)
                for raw in idx:
                    line_no, cid = json.loads(raw)
                    obj = answers.get(cid) if i not in given_up else None
                    if obj is None:
                        why = given_up.get(i) or "the engine wrote no answer for this line"
                        entry, ok = {"id": f"batch_req_{batch_id[6:]}-{line_no}", "custom_id": cid, "response": None,
                                     "error": dict(EXPIRED) if cut else {"code": "shard_failed", "message": why}}, False
                    else:
                        entry, ok = openai_line(obj, batch_id, line_no)
                    usage = (((entry.get("response") or {}).get("body") or {}).get("usage")) or {}
                    prompt += int(usage.get("prompt_tokens") or 0)
                    completion += int(usage.get("completion_tokens") or 0)
                    (out if ok else err).write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
                    completed, failed = completed + ok, failed + (not ok)
        for f in (out, err):
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp_out, out_path)
    os.replace(tmp_err, err_path)
    fsync_dir(out_path.parent)   # the renames durable before the caller records the merge as done
    if err_path.parent != out_path.parent:
        fsync_dir(err_path.parent)
    return completed, failed, prompt, completion


def _answer(raw: bytes) -> tuple[bool, int, int] | None:
    """One answer line as the merge counts it: (ok, prompt tokens, completion tokens); None when unreadable."""
    try:
        entry, good = openai_line(json.loads(raw), "batch_", 0)
        usage = ((entry["response"] or {}).get("body") or {}).get("usage") or {}
        return good, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return None


def shard_usage(path: Path) -> tuple[int, int, int]:
    """A done shard's answers as the merge counts them: (lines answered, prompt tokens, completion tokens)."""
    ok = prompt = completion = 0
    with open(path, "rb") as f:
        for raw in f:
            if (a := _answer(raw)) is not None:
                ok, prompt, completion = ok + a[0], prompt + a[1], completion + a[2]
    return ok, prompt, completion


class LineCounter:
    """Lines of a file that grows (a task's ``.part``), counted from where the last call stopped; from the
    start again when the file was replaced or cut.  With ``answers``, ``ok`` counts the lines that the merge
    will count completed (the rest of ``lines`` will be failed ones): progress that does not go back at the end."""

    def __init__(self, answers: bool = False):
        self.answers = answers
        self.key, self.offset, self.lines, self.ok = None, 0, 0, 0

    def count(self, path: Path) -> int:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self.key or st.st_size < self.offset:
                    self.key, self.offset, self.lines, self.ok = (st.st_dev, st.st_ino), 0, 0, 0
                f.seek(self.offset)
                rest = b""
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    buf = rest + chunk
                    cut = buf.rfind(b"\n") + 1   # whole lines only: one being written is read next time
                    self.lines += buf.count(b"\n", 0, cut)
                    if self.answers:
                        self.ok += sum(1 for raw in buf[:cut].split(b"\n")[:-1] if (_answer(raw) or (False,))[0])
                    self.offset += cut
                    rest = buf[cut:]
        except OSError:
            self.key, self.offset, self.lines, self.ok = None, 0, 0, 0
        return self.lines


def logged_progress(path: Path) -> int:
    """Lines done by the last progress line in a task's log (vLLM writes its output only at the end)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            hits = PROGRESS.findall(f.read())
    except OSError:
        return 0
    return int(hits[-1][0]) if hits else 0
