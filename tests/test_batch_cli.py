"""``slurmfleet batch results``: the output file appears whole or not at all, against a gateway (a small
aiohttp server standing in for it, at the process boundary) whose download breaks part way."""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from conftest import free_port
from orchestrator.batchcli import cmd_batch, shard_lines

LINES = b'{"id":"batch_req_1-0","custom_id":"a"}\n{"id":"batch_req_1-1","custom_id":"b"}\n'
ERRORS = b'{"id":"batch_req_1-2","custom_id":"c"}\n'


@pytest.fixture
def gateway():
    """(url, set_break): a stand-in gateway serving batch b1 (completed, output file-o, error file-e)."""
    state = {"break": False}

    async def batch(request):
        return web.json_response({"id": "b1", "status": "completed", "output_file_id": "file-o",
                                  "error_file_id": "file-e", "request_counts": {"total": 3}})

    async def content(request):
        body = LINES if request.match_info["fid"] == "file-o" else ERRORS
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(body[:30])
        if state["break"]:
            request.transport.abort()   # the connection breaks mid-file
            return resp
        await resp.write(body[30:])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/batches/{bid}", batch)
    app.router.add_get("/v1/files/{fid}/content", content)
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}", state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def results(url: str, out: Path, errors: bool = False) -> int:
    args = argparse.Namespace(batch_cmd="results", id="b1", output=str(out), errors=errors, api_key="k", url=url)
    cfg = SimpleNamespace(gateway=SimpleNamespace(host="127.0.0.1", port=1))
    return cmd_batch(args, lambda path: cfg, "fleet.yaml")


def test_a_download_that_breaks_leaves_the_old_file_and_no_part_of_the_new(gateway, tmp_path, capsys):
    url, state = gateway
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"an earlier download\n")
    state["break"] = True
    assert results(url, out) == 1
    assert "slurmfleet batch results" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier download\n" and list(tmp_path.iterdir()) == [out]
    state["break"] = False
    assert results(url, out, errors=True) == 0
    assert out.read_bytes() == LINES + ERRORS and list(tmp_path.iterdir()) == [out]


def test_a_shards_line_says_how_many_of_its_answers_are_errors():
    b = {"slurm": {"job_id": "7", "job_name": "slurmfleet-t-batch_1", "shards": [
        {"shard": 0, "state": "done", "job": "7_0", "node": "n1", "lines": 3, "done": 3, "errors": 1, "retries": 1},
        {"shard": 1, "state": "RUNNING", "job": "7_1", "node": "n2", "lines": 2, "done": 1, "errors": 0, "retries": 0}]}}
    out = shard_lines(b)
    assert out[1].endswith("3/3 (1 answered with an error)  1 retry") and out[2].endswith("1/2")
