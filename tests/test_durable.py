"""Records written whole: two threads saving one record at once (a batch array's split in a worker thread, a
hold or cancel on the event loop) each leave a whole record, never an error or a mix of both."""

from __future__ import annotations

import json
import threading

from orchestrator.durable import write_whole


def test_two_threads_saving_one_record_at_once_each_write_it_whole(tmp_path):
    path, errors = tmp_path / "array.json", []
    barrier = threading.Barrier(2)

    def save(who: str) -> None:
        barrier.wait()
        try:
            for i in range(300):
                write_whole(path, json.dumps({"who": who, "i": i, "pad": who * 4096}).encode())
        except OSError as exc:   # (with one temporary name per process: the other's rename took it)
            errors.append(exc)

    torn, reads, writing = [], [0], threading.Event()

    def read() -> None:   # a reader meanwhile (a restarted daemon, `slurmfleet batch status`) sees a whole record
        while writing.is_set():
            try:
                data = path.read_bytes()
            except FileNotFoundError:   # (before the first rename)
                continue
            reads[0] += 1
            try:
                doc = json.loads(data)
                assert doc["pad"] == doc["who"] * 4096
            except (ValueError, AssertionError, KeyError):
                torn.append(len(data))

    writing.set()
    threads = [threading.Thread(target=save, args=(w,)) for w in "ab"]
    reader = threading.Thread(target=read)
    for t in [*threads, reader]:
        t.start()
    for t in threads:
        t.join(60)
    writing.clear()
    reader.join(60)
    assert errors == [] and torn == [] and reads[0] > 0, (errors, torn[:5], reads)
    assert path.stat().st_mode & 0o777 == 0o600
    doc = json.loads(path.read_text())
    assert doc["i"] == 299 and doc["pad"] == doc["who"] * 4096
    assert [p.name for p in tmp_path.iterdir()] == ["array.json"]   # no temporary file left
