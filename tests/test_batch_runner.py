"""The batch runner's pieces: resuming from its own output (exactly once, a half-written line cut), the
adaptive concurrency rule, and the batch records."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from fakes import error_file_fails_once
from orchestrator.batches import BatchStore, new_batch, public
from orchestrator.batchfiles import FileStore
from orchestrator.fleet.batchout import Run, done_lines
from orchestrator.fleet.batchrun import BatchRunner, next_limit


def line(bid: str, n: int, tokens: int = 0) -> bytes:
    body = {"usage": {"prompt_tokens": tokens, "completion_tokens": tokens}}
    return json.dumps({"id": f"batch_req_{bid}-{n}", "custom_id": f"c{n}",
                       "response": {"status_code": 200, "body": body}}).encode() + b"\n"


def test_resume_reads_answered_lines_and_cuts_the_half_written_one(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(line("x", 0, 1) + line("x", 5, 2) + line("x", 9, 3) + b'{"id": "batch_req_x-7", "cus')
    seen = bytearray(2)
    assert done_lines(out, seen) == (3, 6, 6)
    assert [n for n in range(16) if seen[n >> 3] & (1 << (n & 7))] == [0, 5, 9]
    assert out.read_bytes().endswith(line("x", 9, 3))      # the torn line is gone: it will be sent again
    assert done_lines(tmp_path / "missing.jsonl", seen) == (0, 0, 0)


def test_an_odd_answer_body_is_an_answer_with_no_tokens_not_a_batch_that_cannot_resume(tmp_path):
    """(an engine's answer that is not an object, or a usage of odd types, raised reading the output back: the
    batch could not resume after a restart, nor fail keeping its answers, and was tried again for ever)"""
    odd = [{"response": {"status_code": 200, "body": "text"}},
           {"response": {"status_code": 200, "body": {"usage": "n/a"}}},
           {"response": {"status_code": 200, "body": {"usage": {"prompt_tokens": "7", "completion_tokens": True}}}}]
    out = tmp_path / "o.jsonl"
    out.write_bytes(b"".join(json.dumps({"id": f"batch_req_x-{n}", "custom_id": f"c{n}", **o}).encode() + b"\n"
                             for n, o in enumerate(odd)) + line("x", 3, 2))
    assert done_lines(out, bytearray(1)) == (4, 2, 2)


@pytest.mark.parametrize("limit,inflight,replicas,busy,cap,want", [
    (4, 4, 2, False, 64, 6),     # uses all it has, model not busy: one more per replica
    (4, 2, 2, False, 64, 4),     # does not use it all: stays
    (8, 8, 2, True, 64, 4),      # engines queue or interactive requests wait: halve
    (1, 1, 2, True, 64, 1),      # never below one
    (63, 63, 2, False, 64, 64),  # never above the replicas' room
    (9, 9, 0, False, 64, 1),     # no replica: one request, held through the cold start
])
def test_batch_concurrency_rule(limit, inflight, replicas, busy, cap, want):
    assert next_limit(limit, inflight, replicas, busy, cap) == want


@pytest.mark.parametrize("limit,busy,want", [
    (20, False, 18),   # a replica runs near all its slots: one less per replica (2), room for interactive requests
    (2, False, 1),     # never below one
    (20, True, 10),    # engines queue as well: halve
])
def test_batch_concurrency_leaves_slots_free_near_full(limit, busy, want):
    assert next_limit(limit, limit, 2, busy, 64, full=True) == want


def test_records_are_per_owner_listed_newest_first_and_cancel_is_a_marker(tmp_path):
    store = BatchStore(tmp_path)
    a = new_batch("alice", "file-1", "/v1/completions", "24h", {"k": "v"}, 3, ["m"], now=100)
    b = new_batch("alice", "file-2", "/v1/completions", "24h", None, 1, ["m"], now=200)
    c = new_batch("bob", "file-3", "/v1/chat/completions", "24h", None, 1, ["m"], now=300)
    for r in (a, b, c):
        store.save(r)
    assert store.get(a["id"], "bob") is None and store.get(a["id"], "alice") == a
    page, more = store.list("alice", limit=1)
    assert [r["id"] for r in page] == [b["id"]] and more
    page, more = store.list("alice", limit=5, after=b["id"])
    assert [r["id"] for r in page] == [a["id"]] and not more
    assert "owner" not in public(a) and public(a)["expires_at"] == 100 + 86400
    assert not store.cancel_requested(a["id"])
    store.request_cancel(a["id"])
    assert store.cancel_requested(a["id"])
    assert store.load("batch_../../etc") is None


def test_a_scan_every_second_reads_an_ended_record_once(tmp_path):
    """Ended records are final (never written again): a caller's ``ended`` stands in for them after one read, so
    the runner's scan every second does not read and parse every batch ever run; one not ended is read each time."""
    store = BatchStore(tmp_path)
    done = {**new_batch("alice", "file-1", "/v1/completions", "24h", None, 1, ["m"], now=100), "status": "completed"}
    live = new_batch("alice", "file-2", "/v1/completions", "24h", None, 1, ["m"], now=200)
    for r in (done, live):
        store.save(r)
    ended: dict = {}
    assert sorted((r["id"], r["status"]) for r in store.all(ended)) == sorted(
        [(done["id"], "completed"), (live["id"], "validating")])
    store.path(done["id"]).write_text("not json")   # (a read now would skip it)
    store.save({**live, "status": "in_progress"})
    assert sorted((r["id"], r["status"]) for r in store.all(ended)) == sorted(
        [(done["id"], "completed"), (live["id"], "in_progress")])
    assert [r["id"] for r in store.all()] == [live["id"]]   # (without ``ended``: every record read)
    store.path(done["id"]).unlink()   # (an operator's clean-up: its stand-in goes too)
    assert [r["id"] for r in store.all(ended)] == [live["id"]] and ended == {}


def runner(root) -> BatchRunner:
    """A runner whose gateway is unreachable (these batches never get to send a line)."""
    return BatchRunner(BatchStore(root / "batches"), FileStore(root / "files"), url=lambda: "http://127.0.0.1:9",
                       secret="x", session=None, table=lambda: SimpleNamespace(models={}), queued=lambda: {},
                       max_inflight=lambda m: 1)


def answered(bid: str, n: int, ok: bool) -> bytes:
    return json.dumps({"id": f"batch_req_{bid[6:]}-{n}", "custom_id": f"c{n}",
                       "response": {"status_code": 200, "body": {}} if ok else None,
                       "error": None if ok else {"code": "batch_cancelled", "message": "aborted"}}).encode() + b"\n"


def three_lines(r: BatchRunner) -> dict:
    up = r.files.upload()
    up.write(b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m"}}).encode() + b"\n" for i in range(1, 4)))
    return up.commit("alice", "batch", "in.jsonl", 3, "/v1/completions", ["m"])


async def test_a_batch_whose_lines_cannot_be_read_fails_it_does_not_complete(tmp_path):
    r = runner(tmp_path)
    f = three_lines(r)
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, 3, ["m"])
    rec["status"] = "in_progress"
    r.store.save(rec)
    (tmp_path / "batches" / f"{rec['id']}.output.jsonl").write_bytes(answered(rec["id"], 1, True))
    r.files.delete(f["id"], "alice")            # the input is gone (this runs after a restart)
    await r._guarded(r.store.load(rec["id"]))
    got = r.store.load(rec["id"])
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "runner_error", got
    assert got["errors"]["data"][0]["message"] == "FileNotFoundError: No such file or directory"   # no server path
    # what it had answered is kept: the output file, with its line
    assert got["request_counts"]["completed"] == 1 and got["output_file_id"] and got["error_file_id"] is None
    assert [n for n, _ in r.files.open_lines(got["output_file_id"])] == [1]   # (numbered from 1)


async def test_a_batch_that_fails_before_any_answer_leaves_no_file_nor_back_off_behind(tmp_path):
    """Its run's empty output and error files stayed in the batches folder for ever (the retention removes
    records), and a batch ended by a failure kept its back-off entry. Found by a review."""
    r = runner(tmp_path)
    f = three_lines(r)
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, 3, ["m"])
    rec["status"] = "in_progress"
    r.store.save(rec)
    r.retries[rec["id"]] = (1, 0.0)   # an earlier try failed
    r.files.delete(f["id"], "alice")   # the input is gone (this runs after a restart)
    await r._guarded(r.store.load(rec["id"]))
    got = r.store.load(rec["id"])
    assert got["status"] == "failed" and got["output_file_id"] is None and got["error_file_id"] is None, got
    assert sorted(p.name for p in r.store.dir.glob(f"{rec['id']}*")) == [f"{rec['id']}.json"]
    assert rec["id"] not in r.retries


async def test_a_failed_batchs_output_lists_by_when_it_failed_not_when_it_was_created(tmp_path):
    """(a failure has no finalizing_at nor cancelling_at: its output file took its batch's id, and a files list,
    newest first by created_at, put it below every file uploaded while the batch ran)"""
    r = runner(tmp_path)
    f = three_lines(r)
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, 3, ["m"], now=time.time() - 7200)
    rec["status"] = "in_progress"
    r.store.save(rec)
    mid = r.files.upload()
    mid.write(b"{}\n")
    mid = mid.commit("alice", "batch", "mid.jsonl", 1, "/v1/completions", ["m"])   # uploaded while it ran
    (tmp_path / "batches" / f"{rec['id']}.output.jsonl").write_bytes(answered(rec["id"], 1, True))
    r.files.delete(f["id"], "alice")
    r.clock = lambda: time.time() + 5
    await r._guarded(r.store.load(rec["id"]))
    got = r.store.load(rec["id"])
    assert got["status"] == "failed" and got["output_file_id"], got
    assert [x["id"] for x in r.files.list("alice", None, 10, None, "desc")[0]] == [got["output_file_id"], mid["id"]]
    r.finalize(dict(got, status="in_progress"), "failed")   # a restart ends it again: the same file
    assert r.store.load(rec["id"])["output_file_id"] == got["output_file_id"]


async def test_a_kill_after_the_cancel_was_seen_recounts_from_the_files_and_keeps_the_error_file(tmp_path):
    r = runner(tmp_path)
    rec = new_batch("alice", "file-abc", "/v1/completions", "24h", None, 5, ["m"])
    rec.update(status="cancelling")            # what a progress save wrote in the tick that saw the cancel
    rec["request_counts"].update(completed=2, failed=0)
    r.store.save(rec)
    r.store.request_cancel(rec["id"])
    d = tmp_path / "batches"
    (d / f"{rec['id']}.output.jsonl").write_bytes(answered(rec["id"], 1, True) + answered(rec["id"], 2, True))
    (d / f"{rec['id']}.errors.jsonl").write_bytes(answered(rec["id"], 3, False) + answered(rec["id"], 4, False))
    await r._guarded(r.store.load(rec["id"]))   # killed before the final save; the restarted runner ends it
    got = r.store.load(rec["id"])
    assert got["status"] == "cancelled" and got["request_counts"]["failed"] == 2 and got["error_file_id"], got


async def test_a_cancel_asked_before_the_runner_starts_a_batch_never_shows_it_in_progress(tmp_path):
    """The cancel's answer said ``cancelling``: the runner moves the batch there before any step forward (it
    saved ``in_progress`` first, so a GET went cancelling, in_progress, cancelled); an OpenAI cancelled
    batch has cancelling_at and cancelled_at, no finalizing_at."""
    r = runner(tmp_path)
    rec = new_batch("alice", three_lines(r)["id"], "/v1/completions", "24h", None, 3, ["m"])
    r.store.save(rec)
    asked = r.store.request_cancel(rec["id"])
    saved, real = [], r.store.save
    r.store.save = lambda rec: (saved.append(rec["status"]), real(rec))
    await r._guarded(r.store.load(rec["id"]))
    got = r.store.load(rec["id"])
    assert saved[0] == "cancelling" and "in_progress" not in saved and saved[-1] == "cancelled", saved
    assert got["cancelling_at"] == asked and got["cancelled_at"] and got["finalizing_at"] is None
    assert got["in_progress_at"] is None and got["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    fid = got["output_file_id"]   # (a time id of when it was made, its batch's random part)
    assert fid.endswith(f"{rec['id'][18:]}o") and asked * 1000 <= int(fid[5:17], 16) <= time.time() * 1000, fid


def test_an_unfinished_batch_names_its_input_file_and_odd_batch_ids_are_unknown(tmp_path):
    store = BatchStore(tmp_path)
    a = new_batch("alice", "file-1", "/v1/completions", "24h", None, 3, ["m"])
    store.save(a)
    assert store.uses("file-1", "alice") == a["id"] and store.uses("file-1", "bob") is None
    store.save({**a, "status": "completed"})
    assert store.uses("file-1", "alice") is None
    assert store.load("batch_" + "a" * 300) is None and store.load("batch_²") is None


class FakeSession:
    """The runner's HTTP session (its process boundary, the gateway): answers every line at once, or never."""

    def __init__(self, hang: bool = False):
        self.hang, self.posts = hang, 0

    def post(self, url, data, headers, timeout):
        session = self

        class Ctx:
            async def __aenter__(self):
                session.posts += 1
                if session.hang:
                    await asyncio.sleep(3600)
                return SimpleNamespace(status=200, json=self.json, headers={})

            async def json(self, content_type=None):
                return {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}

            async def __aexit__(self, *exc):
                return False
        return Ctx()


class BusySession:
    """The runner's HTTP session answering 429 (the fleet busy) to every line; ``on_post`` runs as each is sent."""

    def __init__(self, on_post):
        self.posts, self.on_post = 0, on_post

    def post(self, url, data, headers, timeout):
        session = self

        class Ctx:
            async def __aenter__(self):
                session.posts += 1
                session.on_post()
                return SimpleNamespace(status=429, json=self.json, headers={"Retry-After": "1"})

            async def json(self, content_type=None):
                return {"error": {"message": "busy", "type": "rate_limit_error", "code": 429}}

            async def __aexit__(self, *exc):
                return False
        return Ctx()


def live_runner(tmp_path, session) -> tuple[BatchRunner, dict]:
    r = runner(tmp_path)
    r.session = session
    f = three_lines(r)
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, 3, ["m"])
    rec["status"] = "in_progress"
    r.store.save(rec)
    return r, r.store.load(rec["id"])


async def test_a_batch_past_its_expiry_at_a_restart_sends_nothing_more(tmp_path):
    session = FakeSession()
    r, rec = live_runner(tmp_path, session)
    rec["expires_at"] = int(time.time()) - 60   # the daemon was down across the expiry
    await r._guarded(rec)
    got = r.store.load(rec["id"])
    assert got["status"] == "expired" and session.posts == 0
    assert [json.loads(x)["error"]["code"] for _, x in r.files.open_lines(got["error_file_id"])] == ["batch_expired"] * 3


async def test_a_batch_still_validating_past_its_expiry_ends_expired_without_having_been_in_progress(tmp_path):
    """A daemon down from a batch's creation across its window: the batch was moved to ``in_progress`` first, its
    ``in_progress_at`` after its ``expires_at``, for a batch that never ran (OpenAI leaves it null). Found by a
    review."""
    session = FakeSession()
    r, rec = live_runner(tmp_path, session)
    rec.update(status="validating", in_progress_at=None, expires_at=int(time.time()) - 60)
    r.store.save(rec)
    await r._guarded(r.store.load(rec["id"]))
    got = r.store.load(rec["id"])
    assert got["status"] == "expired" and got["in_progress_at"] is None and session.posts == 0, got


async def test_a_line_waiting_out_a_busy_fleet_when_the_batch_expires_gets_a_batch_expired_line(tmp_path):
    """The gateway answers 429 (busy, a budget spent) until the expiry: the lines it cut off are
    ``batch_expired`` errors, as every line an expired batch did not answer, not 429s; the batch is
    ``expired``, not ``completed``."""
    r, rec = live_runner(tmp_path, None)
    now = [time.time()]
    r.clock = lambda: now[0]

    def expire():
        now[0] = rec["expires_at"] + 1   # the expiry passes while it waits
    r.session = busy = BusySession(expire)
    await asyncio.wait_for(r._guarded(rec), 10)
    got = r.store.load(rec["id"])
    assert got["status"] == "expired" and got["request_counts"] == {"total": 3, "completed": 0, "failed": 3}, got
    errors = [json.loads(x) for _, x in r.files.open_lines(got["error_file_id"])]
    assert sorted((e["custom_id"], e["error"]["code"], e["response"]) for e in errors) == [
        (f"c{i}", "batch_expired", None) for i in (1, 2, 3)]
    assert 1 <= busy.posts <= 3


@pytest.mark.parametrize("cancel_at", ["after_the_decision", "before_it_is_seen"])
async def test_a_cancel_as_a_shared_batch_expires_is_refused_or_wins_never_answered_then_undone(
        tmp_path, monkeypatch, cancel_at):
    """The runner decided an expiry in memory and saved it only with the final counts: a cancel asked meanwhile
    was answered 200 ``cancelling`` and the batch then ended ``expired``. Now the expiry is saved when decided:
    a cancel after that is refused (the gateway's check, ``ending_otherwise``), one asked before the runner saw
    it wins (the batch ends ``cancelled``, as its answer said). Found by a review."""
    from orchestrator.batches import ending_otherwise
    from orchestrator.fleet import batchcharge
    r, rec = live_runner(tmp_path, None)
    now = [time.time()]
    r.clock = lambda: now[0]
    refused = []

    def expire():
        now[0] = rec["expires_at"] + 1   # the expiry passes while the line waits
        if cancel_at == "before_it_is_seen" and not refused:   # (the gateway's check, then its marker)
            refused.append(ending_otherwise(r.store.load(rec["id"])))
            if not refused[-1]:
                r.store.request_cancel(rec["id"])
    settle = batchcharge.settle

    async def settling(runner, run):   # the expiry's lines written, the counts not saved yet: a cancel now?
        refused.append(ending_otherwise(r.store.load(rec["id"])))
        return await settle(runner, run)
    monkeypatch.setattr(batchcharge, "settle", settling)
    r.session = BusySession(expire)
    await asyncio.wait_for(r._guarded(rec), 10)
    got = r.store.load(rec["id"])
    if cancel_at == "after_the_decision":
        assert refused == [True] and got["status"] == "expired" and got["cancelling_at"] is None, (refused, got)
    else:
        assert refused[0] is False and got["status"] == "cancelled" and got["cancelling_at"], (refused, got)


async def test_an_answer_that_cannot_be_written_fails_the_batch_and_is_never_written_twice(tmp_path, monkeypatch):
    session = FakeSession()
    r, rec = live_runner(tmp_path, session)
    real, failed = Run.answer, []

    def full_disk(self, line, *a, **kw):
        if line == 2 and not failed:   # once: a second try would write (a runner_error line, for a line answered)
            failed.append(line)
            raise OSError(28, "No space left on device")
        return real(self, line, *a, **kw)
    monkeypatch.setattr(Run, "answer", full_disk)
    await r._guarded(rec)
    got = r.store.load(rec["id"])
    assert got["status"] == "failed" and "No space left" in got["errors"]["data"][0]["message"], got
    lines = [json.loads(x)["custom_id"] for _, x in r.files.open_lines(got["output_file_id"])]
    assert lines == ["c1"] and got["error_file_id"] is None   # nothing for line 2, and nothing sent after it
    assert session.posts == 2


async def test_a_shutdown_leaves_no_line_in_flight_to_answer_after_the_files_close(tmp_path):
    r, rec = live_runner(tmp_path, FakeSession(hang=True))
    task = asyncio.create_task(r._guarded(rec))
    while not (r.progress.get(rec["id"]) and r.progress[rec["id"]].inflight):
        await asyncio.sleep(0.01)
    inflight = list(r.progress[rec["id"]].inflight)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert inflight and all(t.done() for t in inflight)   # (they were left waiting on the gateway)
    assert r.store.load(rec["id"])["status"] == "in_progress"   # the next start sends them again


async def test_a_batchs_end_and_its_progress_are_written_off_the_event_loop(tmp_path, monkeypatch):
    """With one gateway process the daemon's loop serves the clients: a batch's end (its output fsync'd and its
    lines counted, GBs for a large batch) and its progress record (two fsyncs a second) ran on it. Found by a
    review."""
    import threading
    from orchestrator.batchfiles import FileStore as Files
    from orchestrator.batches import BatchStore as Store
    on_loop = []
    adopt, save = Files.adopt, Store.save
    monkeypatch.setattr(Files, "adopt", lambda *a, **k: on_loop.append(
        ("adopt", threading.current_thread() is threading.main_thread())) or adopt(*a, **k))
    monkeypatch.setattr(Store, "save", lambda self, rec: on_loop.append(   # (a save with lines counted: progress)
        ("save", threading.current_thread() is threading.main_thread(), rec["status"],
         rec["request_counts"]["completed"] > 0)) or save(self, rec))
    r, rec = live_runner(tmp_path, FakeSession())
    await asyncio.wait_for(r._guarded(rec), 10)
    assert r.store.load(rec["id"])["status"] == "completed"
    assert ("adopt", False) in on_loop and ("adopt", True) not in on_loop, on_loop
    assert ("save", False, "in_progress", True) in on_loop, on_loop
    assert ("save", True, "in_progress", True) not in on_loop, on_loop


async def test_a_restart_walks_past_answered_lines_without_holding_the_event_loop(tmp_path):
    """A restarted batch skips the lines it answered before without an await between them: a nearly done batch
    of millions of lines held the daemon's loop while it read them all. Found by a review."""
    r = runner(tmp_path)
    up = r.files.upload()
    n = 20000
    up.write(b"".join(b'{"custom_id": "c%d", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}\n'
                      % i for i in range(1, n + 1)))
    f = up.commit("alice", "batch", "in.jsonl", n, "/v1/completions", ["m"])
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, n, ["m"])
    r.store.dir.mkdir(parents=True, exist_ok=True)
    run = Run(rec, r.store.dir, n, lambda outcome, usage: None)
    run.seen[:] = b"\xff" * len(run.seen)   # every line answered before the restart
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)
    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await r._send_all(run)
    t.cancel()
    run.close()
    assert ticks - before >= n // 4096, (before, ticks)


async def test_answers_are_fsynced_in_a_thread_one_fsync_for_those_that_came_meanwhile(tmp_path, monkeypatch):
    """The daemon's loop (which serves the gateway's clients too when it runs one process) never waits on the
    disk: 30 answers at once cost two fsyncs, none of them on the loop's thread, and each counts once it is
    durable."""
    import os
    import threading
    from orchestrator.fleet import batchout
    real, threads = os.fsync, []

    def slow_fsync(fd):
        threads.append(threading.get_ident())
        time.sleep(0.1)
        real(fd)
    monkeypatch.setattr(batchout.os, "fsync", slow_fsync)
    rec = new_batch("alice", "file-1", "/v1/completions", "24h", None, 30, ["m"])
    counted = []
    run = Run(rec, tmp_path, 30, lambda ok, usage: counted.append(ok))   # (made in a thread by the runner)
    threads.clear()   # (the folder's fsync as its files were made)
    loop_thread = threading.get_ident()
    await asyncio.gather(*(run.answer(i, f"c{i}", 200, {"usage": {"completion_tokens": 2}}, True) for i in range(30)))
    assert run.completed == 30 and run.completion_tokens == 60 and len(counted) == 30
    assert run.fsyncs == 2 and threads and loop_thread not in threads
    run.close()
    seen = bytearray(4)
    assert done_lines(run.out_path, seen)[0] == 30


def test_a_batchs_output_lists_by_when_it_was_made_and_keeps_its_id_across_a_restart(tmp_path):
    """A files list is newest first by ``created_at``: a batch's output, written when it ends, lists above a file
    uploaded while it ran (its id carried its batch's creation time, so it listed hours down), and above one
    uploaded while its hand-over waited (its id carried when the batch began to end: a client listing
    ``order=asc`` after the last id it knew never saw it); the id is the same when a restart ends the batch again."""
    r = runner(tmp_path)
    rec = new_batch("alice", "file-abc", "/v1/completions", "24h", None, 1, ["m"], now=time.time() - 7200)
    rec.update(status="finalizing", finalizing_at=int(time.time()) - 600)   # its hand-over failed, tried since
    rec["request_counts"].update(completed=1)
    r.store.save(rec)
    mid = three_lines(r)   # uploaded while it waited
    (tmp_path / "batches" / f"{rec['id']}.output.jsonl").write_bytes(answered(rec["id"], 1, True))
    r.finalize(dict(rec), "completed")
    out = r.store.load(rec["id"])["output_file_id"]
    page, _ = r.files.list("alice", None, 10, None, "desc")
    assert [f["id"] for f in page] == [out, mid["id"]]
    assert [f["id"] for f in r.files.list("alice", None, 10, out, "desc")[0]] == [mid["id"]]
    assert [f["id"] for f in r.files.list("alice", None, 10, mid["id"], "asc")[0]] == [out]
    r.finalize(dict(rec), "completed")   # a restart ends it again: the same file, not a second one
    assert r.store.load(rec["id"])["output_file_id"] == out and len(r.files.list("alice", None, 10, None, "desc")[0]) == 2


def test_an_upload_lists_by_when_it_was_stored_not_when_it_began(tmp_path):
    """A big upload begun before a small one and stored after it took its id when it began: a files list (by id)
    put it below the small one while its ``created_at`` was later, and a client listing ``order=asc`` after the
    small one's id never saw it. Found by a review."""
    r = runner(tmp_path)
    big = r.files.upload()
    big.write(b'{"custom_id": "a"}\n')
    time.sleep(0.01)   # (ids are milliseconds)
    small = three_lines(r)
    time.sleep(0.01)
    big = big.commit("alice", "batch", "big.jsonl", 1, "/v1/completions", ["m"])
    assert big["created_at"] >= small["created_at"]
    assert [f["id"] for f in r.files.list("alice", None, 10, None, "desc")[0]] == [big["id"], small["id"]]
    assert [f["id"] for f in r.files.list("alice", None, 10, small["id"], "asc")[0]] == [big["id"]]
    assert r.files.get(big["id"], "alice")["filename"] == "big.jsonl"


def test_the_runner_removes_expired_files_but_a_running_batchs_input(tmp_path):
    """Files past their ``expires_at`` are removed by the runner's scan (at most a minute late), except the input
    of a batch that has not ended (its lines are read on)."""
    r = runner(tmp_path)
    now = [time.time()]
    r.clock = lambda: now[0]
    up = r.files.upload()
    up.write(b"x\n")
    old = up.commit("alice", "batch", "old.jsonl", 1, expires_after=3600)
    used = three_lines(r)
    for f in (old, used):   # both past their expiry
        path = r.files.record_path(f["id"], "alice")
        path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": int(now[0]) - 1}))
    rec = new_batch("alice", used["id"], "/v1/completions", "24h", None, 3, ["m"])
    rec["status"] = "cancelling"   # (not ended: the runner's task is not started here, scan alone)
    r.store.save(rec)
    r.runs[rec["id"]] = None       # (scan starts no task for a batch it runs already)

    async def scan():
        r.scan()
        await r.expiring           # (in a thread: it reads every key's file records)
    asyncio.run(scan())
    assert r.files.get(old["id"], "alice", expired=True) is None and not r.files.data_path(old["id"]).exists()
    assert r.files.get(used["id"], "alice", expired=True) is not None
    # a batch made after the scan looked for the inputs in use, before the expiry went through the files
    late = three_lines(r)
    path = r.files.record_path(late["id"], "alice")
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": int(now[0]) - 1}))
    real_expire = r.files.expire

    def expire(keep, at, read):
        r.store.save(new_batch("alice", late["id"], "/v1/completions", "24h", None, 3, ["m"]))
        return real_expire(keep, at, read)
    r.files.expire, r.next_expiry = expire, 0.0
    asyncio.run(scan())
    assert r.files.get(late["id"], "alice", expired=True) is not None


async def test_a_hand_over_that_fails_keeps_the_answers_and_ends_the_batch_at_a_later_scan(tmp_path, monkeypatch):
    """A full disk as the output's record is written: the batch is not failed with nothing (its answers were
    counted again from a file moved away, its content then swept as a crash's leftover), it stays ``finalizing``
    with its files, a sweep meanwhile takes none of them, and a later scan (after a back-off) ends it."""
    from orchestrator.batchfiles import SWEEP_AFTER_S
    r, rec = live_runner(tmp_path, FakeSession())
    real, failed = FileStore.publish, []

    def full_disk(self, *a, **kw):
        if not failed:
            failed.append(a[0])
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)
    monkeypatch.setattr(FileStore, "publish", full_disk)
    await r._guarded(rec)
    got = r.store.load(rec["id"])
    assert failed and got["status"] == "finalizing" and got["ending"] == "" and got["output_file_id"] is None, got
    assert got["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and not got["errors"]
    now = [time.time()]
    r.clock, r.next_expiry = (lambda: now[0]), float("inf")
    r.scan()
    assert rec["id"] not in r.runs   # backing off: not tried again at once
    assert r.files.sweep(now=now[0] + 2 * SWEEP_AFTER_S) == 0   # nothing of it is a crash's leftover
    mid = three_lines(r)   # uploaded while the hand-over waits
    time.sleep(0.002)
    now[0] += 60
    r.scan()
    await r.runs[rec["id"]]
    got = r.store.load(rec["id"])
    assert got["status"] == "completed" and got["completed_at"], got
    out = [json.loads(x)["custom_id"] for _, x in r.files.open_lines(got["output_file_id"])]
    assert sorted(out) == ["c1", "c2", "c3"] and r.retries == {}
    # its id is of the try that made it, not of the first one: listed after the file uploaded meanwhile
    assert got["output_file_id"] != failed[0] and got["output_file_id"] > mid["id"], (got["output_file_id"], mid["id"])
    assert not (tmp_path / "batches" / f"{rec['id']}.output.jsonl").exists()


async def test_the_lines_of_an_owner_whose_budget_is_spent_are_no_load_for_the_autoscaler(tmp_path):
    """A batch's lines not sent yet count as load for its models (the autoscaler keeps replicas for them),
    but not while its owner's token budget is spent: the gateway refuses them until the next period, and a
    replica started or kept for them would serve nothing."""
    session = FakeSession(hang=True)
    r, rec = live_runner(tmp_path, session)
    task = asyncio.create_task(r._guarded(rec))
    try:
        for _ in range(100):
            if session.posts:
                break
            await asyncio.sleep(0.01)
        unsent = 3 - session.posts
        assert unsent > 0 and r.pending() == {"m": unsent}
        r.budget = lambda owner: (0, time.time() + 3600) if owner == "alice" else None
        assert r.pending() == {}
        r.budget = lambda owner: (5, time.time() + 3600)
        assert r.pending() == {"m": unsent}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_ended_batches_records_go_after_the_retention_and_nothing_else(tmp_path):
    """Every batch ever made kept its record (and a cancelled one its marker) for ever, and every listing, file
    deletion and the runner's scan read them all: an ended batch's record goes batches.retention_s after its end
    (the runner's scan, which forgets it too); a batch not ended stays however old, and so does its input."""
    day = 86400
    now = 1_800_000_000
    r = BatchRunner(BatchStore(tmp_path / "batches"), FileStore(tmp_path / "files"), url=lambda: "http://127.0.0.1:9",
                    secret="x", session=None, table=lambda: SimpleNamespace(models={}), queued=lambda: {},
                    max_inflight=lambda m: 1, clock=lambda: now, retention_s=lambda: 30 * day)
    old = {**new_batch("alice", "file-1", "/v1/completions", "24h", None, 1, ["m"], now=now - 41 * day),
           "status": "completed", "completed_at": now - 40 * day}
    recent = {**new_batch("bob", "file-2", "/v1/completions", "24h", None, 1, ["m"], now=now - 11 * day),
              "status": "failed", "failed_at": now - 10 * day}
    cancelled = {**new_batch("bob", "file-3", "/v1/completions", "24h", None, 1, ["m"], now=now - 41 * day),
                 "status": "cancelled", "cancelled_at": now - 31 * day, "cancelling_at": now - 31 * day - 5}
    running = {**new_batch("alice", "file-4", "/v1/completions", "24h", None, 1, ["m"], now=now - 60 * day),
               "status": "in_progress"}
    for rec in (old, recent, cancelled, running):
        r.store.save(rec)
    r.store.request_cancel(cancelled["id"])
    (r.store.dir / f"{old['id']}.array" / "logs").mkdir(parents=True)   # (a crash between its end and clean-up)
    r.scan()   # (the ended ones are read once, then stand in the runner's memory)
    try:
        assert {x["id"] for x in r.store.all()} == {recent["id"], running["id"]}
        assert sorted(p.name for p in r.store.dir.iterdir()) == sorted(
            [f"{recent['id']}.json", f"{running['id']}.json"])
        assert set(r.ended) == {f"{recent['id']}.json"} and r.states["in_progress"] == 1
        assert r.store.get(old["id"], "alice") is None
        now += 21 * day   # the one that failed 10 days ago goes too, from the runner's memory as well
        r.scan()
        assert {x["id"] for x in r.store.all()} == {running["id"]} and r.ended == {}
        r.retention_s = lambda: 0.0   # 0: kept for ever
        ended = {**running, "id": running["id"][:-1] + "z", "status": "expired", "expired_at": now - 400 * day}
        r.store.save(ended)
        r.scan()
        assert r.store.load(ended["id"]) is not None
    finally:
        await r.close()


async def test_an_output_its_owner_deleted_while_the_error_files_hand_over_waited_stays_deleted(tmp_path, monkeypatch):
    """The output handed over, then a full disk as the error file's record is written: the batch stays
    ``finalizing``; its owner deletes the output meanwhile (DELETE /v1/files/<id>).  The retry found that output's
    id not begun and handed it over again under a new id, empty (its content had gone with the first try): a
    deleted file came back.  It stays deleted, and the batch keeps its id (a GET of that file is a 404, as
    OpenAI's).  Found by a review."""
    r = runner(tmp_path)
    now = [time.time()]
    r.clock, r.next_expiry = (lambda: now[0]), float("inf")
    rec = new_batch("alice", three_lines(r)["id"], "/v1/completions", "24h", None, 3, ["m"])
    bid = rec["id"]
    rec.update(status="finalizing", finalizing_at=int(now[0]), ending="")   # its counts final
    rec["request_counts"].update(completed=2, failed=1)
    r.store.save(rec)
    (tmp_path / "batches" / f"{bid}.output.jsonl").write_bytes(answered(bid, 1, True) + answered(bid, 2, True))
    (tmp_path / "batches" / f"{bid}.errors.jsonl").write_bytes(answered(bid, 3, False))
    failed = error_file_fails_once(monkeypatch)
    await r._guarded(r.store.load(bid))
    assert failed and r.store.load(bid)["status"] == "finalizing" and bid in r.retries
    [out] = [f["id"] for f in r.files.list("alice", "batch_output")[0]]
    assert r.files.delete(out, "alice")   # its owner deletes the output while the hand-over waits
    now[0] += 60
    r.scan()
    await r.runs[bid]
    got = r.store.load(bid)
    kept = [(f["filename"], f["bytes"]) for f in r.files.list("alice", "batch_output")[0]]
    assert kept == [(f"{bid}_error.jsonl", len(answered(bid, 3, False)))], kept   # no output made again
    assert got["status"] == "completed" and got["output_file_id"] == out, got
    assert r.files.get(out, "alice", expired=True) is None and not r.files.data_path(out).exists()
    assert [json.loads(x)["custom_id"] for _, x in r.files.open_lines(got["error_file_id"])] == ["c3"]


async def test_a_stuck_state_dir_holds_the_scan_not_the_event_loop(tmp_path, monkeypatch):
    """The scan (every second) read the batch records on the event loop: a state dir stalled on NFS or Lustre
    stalled every client of a gateway in the daemon's process.  It reads them in a thread, applies them on the
    loop once they came, and starts no second read while one is out."""
    from stuckio import Stuck
    r = runner(tmp_path)
    r.next_expiry = float("inf")
    rec = {**new_batch("alice", "file-1", "/v1/completions", "24h", None, 1, ["m"]), "status": "completed"}
    r.store.save(rec)
    stuck, real = Stuck(), BatchStore.all

    def all_stuck(self, ended=None):
        stuck.wait()
        yield from real(self, ended)
    monkeypatch.setattr(BatchStore, "all", all_stuck)
    task = asyncio.create_task(r.run())
    try:
        gap = await stuck.longest_gap()
        assert gap < 0.25, f"the event loop stood still {gap:.2f}s while the records were read"
        assert stuck.calls == 1 and r.states == {}   # (one read out, nothing applied yet)
        stuck.release.set()
        for _ in range(200):
            if r.states:
                break
            await asyncio.sleep(0.01)
        assert r.states["completed"] == 1 and set(r.ended) == {f"{rec['id']}.json"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_batchs_answer_files_names_are_made_durable_once_when_they_are_created(tmp_path, monkeypatch):
    """Only the answers were fsync'd, never the folder that names the files: after a power cut the answers counted
    could lose their file. The folder is fsync'd once, as the files are created (not again on a restart's run)."""
    from orchestrator.fleet import batchout
    synced = []
    monkeypatch.setattr(batchout, "fsync_dir", synced.append)
    rec = new_batch("alice", "file-1", "/v1/completions", "24h", None, 3, ["m"])
    Run(rec, tmp_path, 3)
    assert synced == [tmp_path] and (tmp_path / f"{rec['id']}.output.jsonl").exists()
    Run(rec, tmp_path, 3)   # (a restart's run: the files are there)
    assert synced == [tmp_path]


@pytest.mark.parametrize("held", ["lock", "input"])
def test_a_shared_batchs_end_and_input_on_a_stalled_state_dir_hold_the_batch_not_the_event_loop(tmp_path, monkeypatch,
                                                                                                held):
    """The runner weighed a batch's end against a cancel under the batch's lock on the daemon's event loop, and read
    its input's lines there: a gateway process's cancel holding that lock on a stalled NFS or Lustre mount (or the
    input's read stalling) froze the daemon, and every client of a gateway in its process. Found by a review."""
    import threading
    from stuckio import Stuck, stall
    r, rec = live_runner(tmp_path, FakeSession())
    stuck = Stuck()
    if held == "lock":   # what a gateway's cancel does in its thread, its write stalled
        def cancel_stalled():
            with r.store.deciding(rec["id"]):
                stuck.wait()
        threading.Thread(target=cancel_stalled, daemon=True).start()
        assert stuck.entered.wait(5)
    else:
        stuck = stall(monkeypatch, FileStore, "open_lines")

    async def main():
        run = asyncio.create_task(r._guarded(rec))
        gap = await stuck.longest_gap()
        stuck.release.set()
        await asyncio.wait_for(run, 10)
        return gap
    gap = asyncio.run(main())
    assert gap < 0.25, f"the event loop stood still {gap:.2f}s"
    assert r.store.load(rec["id"])["status"] == "completed"
