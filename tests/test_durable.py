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

    threads = [threading.Thread(target=save, args=(w,)) for w in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    doc = json.loads(path.read_text())
    assert doc["i"] == 299 and doc["pad"] == doc["who"] * 4096
    assert [p.name for p in tmp_path.iterdir()] == ["array.json"]   # no temporary file left
