"""The Batch API end to end with the openai SDK: upload, create, the fleet's runner sends the lines through the
gateway, poll, download; another key sees nothing."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time

import openai
import pytest

from gateway_harness import Harness, Sim

MODEL = "  - name: m\n    engine: simulator\n    container: {enabled: false}\n"
KEYS = "api_keys:\n  - {name: alice, key: sk-alice}\n  - {name: bob, key: sk-bob}\n"


def runner_key(h: Harness) -> None:
    """The gateway takes the fleet's batch runner key, "runner-secret", as the daemon wires it."""
    h.cfg.gateway._batch_key = "runner-secret"
    h.call(asyncio.sleep(0))
    h.gateway.set_config(h.cfg)


def in_loop(h: Harness, root):
    """The fleet's usage ledger, made (its file opened) in the harness's loop, where the runner charges it."""
    from orchestrator.fleet.usage import UsageLedger

    async def make():
        return UsageLedger(root / "usage.sqlite3")
    return h.call(make())


def test_a_batch_runs_through_the_gateway_and_only_its_owner_sees_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, "slurmfleet.access")
    h = Harness(tmp_path, MODEL, KEYS)
    sim = Sim("b0")
    try:
        h.route_to([sim])
        runner_key(h)
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m", "prompt": f"p {i}", "max_tokens": 3}} for i in range(20)]
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
        f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                           purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert b.status == "validating" and b.request_counts.total == 20
        with pytest.raises(openai.ConflictError) as e:   # the input of a batch that has not ended stays (and the
            c.files.delete(f.id)                         # SDK does not send it again, as it does a 409 by default)
        assert e.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.NotFoundError):       # (and another key learns nothing of it)
            openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0).files.delete(f.id)
        with pytest.raises(openai.BadRequestError):     # a shard count that only looks like digits
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                             metadata={"shards": "\u00b2"})
        with pytest.raises(openai.BadRequestError) as e:   # not a string: a 400 (it was a 500, unhashable)
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window=["24h"])  # type: ignore
        assert e.value.body["param"] == "completion_window"

        with pytest.raises(openai.BadRequestError) as e:   # OpenAI's bounds: 1 hour to 30 days
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                             output_expires_after={"anchor": "created_at", "seconds": 59})
        assert e.value.body["param"] == "output_expires_after"
        c.batches.cancel(b.id)   # (the same input again, with its output files expiring in two hours)
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                             output_expires_after={"anchor": "created_at", "seconds": 7200})

        ledger = in_loop(h, tmp_path)
        runner, stop_runner = h.batch_runner(tmp_path, 8, charge=lambda ref, owner, m, counts, write=True:
                                             ledger.charge_upto(ref, owner, None, m, counts, write))
        deadline = time.monotonic() + 30
        while (b := c.batches.retrieve(b.id)).status != "completed":
            assert time.monotonic() < deadline, b
            time.sleep(0.2)
        assert b.request_counts.completed == 20 and b.request_counts.failed == 0
        out_file = c.files.retrieve(b.output_file_id)
        assert out_file.expires_at == out_file.created_at + 7200
        assert b.usage.output_tokens == 60 and b.usage.total_tokens == b.usage.input_tokens + 60 > 60
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] == 3
                   for o in out)
        # a line's request_id is its request's in the gateway's access log (beside the id its replica got)
        logged = {json.loads(r.getMessage())["request_id"] for r in caplog.records if r.name == "slurmfleet.access"}
        assert {o["response"]["request_id"] for o in out} <= logged, logged
        bob = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(b.id)
        assert bob.batches.list().data == []
        ten = h.gateway.tenants.by_name
        assert ten["_batches"].requests == 20   # sent by the runner, in its own lowest class...
        # ...charged to alice by the runner, from its output (the gateway charges no one: a line it served that the
        # runner then lost is sent again, and was charged twice)
        assert ledger.totals() == {("alice", "m"): (20, b.usage.input_tokens, 60)}
        assert not ten["_batches"].usage and not ten["bob"].usage and not ten["alice"].usage
        assert ten["alice"].requests == 0   # she sent no request herself
        bob.completions.create(model="m", prompt="x", max_tokens=2,   # a client cannot pass its use to another
                               extra_headers={"x-slurmfleet-batch-owner": "alice"})
        assert ten["bob"].usage["m"][0] == 1 and not ten["alice"].usage

        assert c.files.delete(f.id).deleted             # the batch has ended: its input may go
        stop_runner()
    finally:
        h.close()
        sim.stop()


def test_a_batch_is_refused_for_a_model_its_key_lost_since_the_upload(tmp_path):
    two = MODEL + MODEL.replace("name: m", "name: m2")
    h = Harness(tmp_path, two, "api_keys:\n  - {name: dave, key: sk-dave, models: [m, m2]}\n")
    try:
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-dave", max_retries=0)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m2", "prompt": "x"}}
        f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        h.reload(h.text.replace("models: [m, m2]", "models: [m]"))
        with pytest.raises(openai.NotFoundError) as e:
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert "m2" in str(e.value)
    finally:
        h.close()


def test_a_batch_the_fleet_cannot_run_is_refused_at_its_creation(tmp_path):
    """Accepted (200 ``validating``), then failed by the runner: a dedicated batch (``metadata.shards``) of a
    model on two nodes (an array task runs on one), and a batch of a model a reload removed since the upload
    (every line a 404: ``completed`` with every request failed)."""
    two = MODEL + MODEL.replace("name: m", "name: big") + "    nodes: 2\n"
    h = Harness(tmp_path, two, KEYS)
    try:
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)

        def upload(model: str):
            line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "messages": [{"role": "user", "content": "x"}]}}
            return c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        chat = "/v1/chat/completions"
        big = upload("big")
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(input_file_id=big.id, endpoint=chat, completion_window="24h", metadata={"shards": "4"})
        assert e.value.body["param"] == "metadata" and "`big` runs on 2" in e.value.body["message"], e.value.body
        assert c.batches.create(input_file_id=big.id, endpoint=chat,   # (shared mode: its replicas serve it)
                                completion_window="24h").status == "validating"
        m = upload("m")
        h.reload(h.text.replace(MODEL, "", 1))
        with pytest.raises(openai.NotFoundError) as e:
            c.batches.create(input_file_id=m.id, endpoint=chat, completion_window="24h")
        assert e.value.body["param"] == "input_file_id" and "`m`" in e.value.body["message"], e.value.body
        assert len(c.batches.list().data) == 1
    finally:
        h.close()


def test_a_keys_unfinished_dedicated_batches_hold_at_most_its_max_shards(tmp_path):
    """Who may start SLURM job arrays, and how many tasks: a key's own ``max_shards``, else
    ``batches.max_shards_per_key``, bounds the array tasks of its dedicated batches that have not ended (a 400
    ``shard_limit_exceeded`` that says how many are left); shared batches and other keys' arrays do not count,
    an ended batch gives its tasks back, and a reload changes the limits."""
    from orchestrator.batches import BatchStore
    keys = KEYS.replace("{name: alice, key: sk-alice}", "{name: alice, key: sk-alice, max_shards: 5}")
    h = Harness(tmp_path, MODEL, keys)
    try:
        h.reload(h.text + "batches:\n  max_shards_per_key: 0\n")
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}
        chat = "/v1/chat/completions"

        def client(key: str):
            c = openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0)
            f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
            return lambda shards=None: c.batches.create(input_file_id=f.id, endpoint=chat, completion_window="24h",
                                                        metadata=shards and {"shards": str(shards)})

        def refused(create, shards: int) -> str:
            with pytest.raises(openai.BadRequestError) as e:
                create(shards)
            assert e.value.body["code"] == "shard_limit_exceeded" and e.value.body["param"] == "metadata", e.value.body
            return e.value.body["message"]
        alice, bob = client("sk-alice"), client("sk-bob")
        assert "may have 5 array tasks in all, not 6" in refused(alice, 6)
        first = alice(3)
        assert first.status == "validating"
        assert "unfinished ones have 3, so 2 more at most, not 3" in refused(alice, 3)
        alice()   # a shared batch: the fleet's replicas serve it, no array
        alice(2)
        assert "may not run dedicated batches" in refused(bob, 1)
        assert bob().status == "validating"
        h.reload(h.text.replace("max_shards_per_key: 0", "max_shards_per_key: 4"))
        assert bob(4).status == "validating"   # (alice's 5 are hers: bob's own count is 0)
        assert "unfinished ones have 5, so 0 more" in refused(alice, 1)
        store = BatchStore(tmp_path / "batches")   # the runner ends the first (as its cancel would)
        store.save({**store.load(first.id), "status": "cancelled"})
        assert alice(3).status == "validating"
        assert "unfinished ones have 5" in refused(alice, 1)
    finally:
        h.close()


def test_a_batch_of_a_file_using_several_models_is_refused_one_file_per_model(tmp_path):
    """As OpenAI's: a batch is one model's (the runner tunes its concurrency, and counts its queued lines, per
    model); the upload itself may mix them (tests/test_files_api.py)."""
    two = MODEL + MODEL.replace("name: m", "name: m2")
    h = Harness(tmp_path, two, KEYS)
    try:
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": model, "prompt": "x"}} for i, model in enumerate(["m", "m2", "m"])]
        f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        err = e.value.body
        assert err["param"] == "input_file_id" and err["type"] == "invalid_request_error", err
        assert "2 models (m, m2)" in err["message"] and "one file per model" in err["message"]
        assert c.batches.list().data == []
        one = c.files.create(file=("one.jsonl", io.BytesIO(json.dumps(lines[0]).encode())), purpose="batch")
        assert c.batches.create(input_file_id=one.id, endpoint="/v1/completions", completion_window="24h").status \
            == "validating"
    finally:
        h.close()


def test_a_batch_line_runs_only_while_its_owner_key_may(tmp_path):
    """The runner's lines are the owner's use: a key a reload revoked (401), a model the key may no longer use
    (404), a token budget spent for the period (429 insufficient_quota, with Retry-After: the runner tries
    again, so the batch waits) stop them, as they would the owner's own requests."""
    from orchestrator.contract import Allowance
    h = Harness(tmp_path, MODEL + "  - name: n\n    engine: simulator\n    container: {enabled: false}\n",
                "api_keys:\n  - {name: alice, key: sk-alice, budget_tokens: 1000}\n"
                "  - {name: bob, key: sk-bob, models: [n]}\n")
    sim = Sim("b0")
    try:
        h.route_to([sim])
        runner_key(h)
        runner = openai.OpenAI(base_url=h.base + "/v1", api_key="runner-secret", max_retries=0)

        def line(owner: str):
            return runner.completions.create(model="m", prompt="x", max_tokens=2,
                                             extra_headers={"x-slurmfleet-batch-owner": owner})
        assert line("alice").usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError, match="no longer exists"):
            line("carol")
        with pytest.raises(openai.NotFoundError, match="may no longer use"):
            line("bob")
        alice = h.gateway.tenants.by_name["alice"]
        alice.allow, alice.allow_at = Allowance(budget_exhausted=True, tokens_reset_s=3600), time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            line("alice")
        assert e.value.code == "insufficient_quota" and int(e.value.response.headers["Retry-After"]) > 3000
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
        f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps({"custom_id": "a", "method": "POST",
                           "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}).encode())), purpose="batch")
        with pytest.raises(openai.RateLimitError) as e:   # nor is a new batch of hers taken while it is spent
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert e.value.code == "insufficient_quota" and c.batches.list().data == []
        assert int(e.value.response.headers["Retry-After"]) > 3000   # (the period's end, as for her requests)
        # (the line the runner sent and wrote nowhere charged no one: the runner charges what it wrote down)
        assert not alice.usage and h.gateway.tenants.by_name["_batches"].inflight == 0
    finally:
        h.close()
        sim.stop()


def test_a_wrong_method_on_a_batch_route_is_a_405_with_allow_and_an_unknown_route_a_404(tmp_path):
    import urllib.error
    import urllib.request
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        def call(method: str, path: str) -> tuple[int, str | None, str]:
            req = urllib.request.Request(h.base + path, method=method, data=b"{}" if method == "POST" else None,
                                         headers={"Authorization": "Bearer sk-alice"})
            try:
                urllib.request.urlopen(req, timeout=10)
                return 200, None, ""
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Allow"), json.loads(e.read())["error"]["code"]
        assert call("POST", "/v1/batches/batch_x") == (405, "GET", "method_not_allowed")
        assert call("GET", "/v1/batches/batch_x/cancel") == (405, "POST", "method_not_allowed")
        assert call("DELETE", "/v1/batches") == (405, "GET, POST", "method_not_allowed")
        assert call("GET", "/v1/batches/batch_x/results")[::2] == (404, "unknown_url")
        assert call("GET", "/v1/batches/batch_x/cancel/more")[::2] == (404, "unknown_url")
    finally:
        h.close()


def one_line_batch(h: Harness):
    """alice's client, an uploaded file of one completion and a batch of it: (client, file, batch)."""
    c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
    f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps({"custom_id": "a", "method": "POST",
                       "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}).encode())), purpose="batch")
    return c, f, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")


def test_a_batch_shows_cancelling_from_the_cancels_answer_on_before_its_runner_sees_it(tmp_path):
    """A GET or a list after the cancel's answer never shows an earlier status: the record still says what
    the runner last wrote (validating, in_progress) until it sees the cancel's marker."""
    from orchestrator.batches import BatchStore
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c, f, b = one_line_batch(h)
        got = c.batches.cancel(b.id)
        assert got.status == "cancelling" and got.cancelling_at
        for status in ("validating", "in_progress"):   # (no runner here: the record says what it last wrote)
            store = BatchStore(tmp_path / "batches")
            rec = store.get(b.id, "alice")
            rec["status"] = status
            store.save(rec)
            seen = c.batches.retrieve(b.id)
            assert (seen.status, seen.cancelling_at) == ("cancelling", got.cancelling_at), status
            assert [(x.status, x.cancelling_at) for x in c.batches.list().data] == [("cancelling", got.cancelling_at)]
            assert c.batches.cancel(b.id).status == "cancelling"
    finally:
        h.close()


def test_a_cancel_that_crosses_the_runners_last_look_is_not_answered_cancelling(tmp_path):
    """The cancel read the record (in_progress) while the runner, past its last look for a marker, saved the batch
    finalizing: the answer said "cancelling" and the batch then completed.  The runner looks and saves under the
    batch's lock (BatchStore.deciding), and the cancel reads and marks under it: here the runner holds it, saves
    finalizing, and the cancel waits for it, then sees that end."""
    from orchestrator.batches import BatchStore
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c, f, b = one_line_batch(h)
        store = BatchStore(tmp_path / "batches")
        held = threading.Event()

        def runner_ends_it():
            with store.deciding(b.id):
                held.set()
                time.sleep(0.5)   # (the cancel comes meanwhile)
                rec = store.get(b.id, "alice")
                rec.update(status="finalizing", ending="", finalizing_at=int(time.time()))
                store.save(rec)
        t = threading.Thread(target=runner_ends_it)
        t.start()
        held.wait(5)
        with pytest.raises(openai.ConflictError) as e:
            c.batches.cancel(b.id)
        t.join(5)
        assert "finalizing" in str(e.value) and c.batches.retrieve(b.id).status == "finalizing"
        assert e.value.response.headers["x-should-retry"] == "false"
        assert not (tmp_path / "batches" / f"{b.id}.cancel").exists()
    finally:
        h.close()


def test_a_batch_whose_end_is_decided_is_not_answered_cancelling(tmp_path):
    """A dedicated batch's expiry or failure is decided (and saved) while it still shows in_progress, minutes
    before its array has ended: a cancel then was answered "cancelling", and the batch ended expired or failed."""
    from orchestrator.batches import BatchStore
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c, f, b = one_line_batch(h)
        store = BatchStore(tmp_path / "batches")
        rec = store.get(b.id, "alice")
        rec.update(status="in_progress", ending="expired")
        store.save(rec)
        with pytest.raises(openai.ConflictError, match=r"ending \(expired\)"):
            c.batches.cancel(b.id)
        assert not store.cancel_requested(b.id)
        store.request_cancel(b.id)   # (a marker from before the end was decided: not shown over it)
        assert c.batches.retrieve(b.id).status == "in_progress"
        rec.update(ending="cancelled")   # the runner saw an earlier cancel: a repeat one is answered as before
        store.save(rec)
        assert c.batches.cancel(b.id).status == "cancelling"
    finally:
        h.close()


def test_the_batch_object_names_its_model_keeps_its_metadata_and_takes_a_trailing_slash(tmp_path):
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c, f, b = one_line_batch(h)
        assert b.model == "m" and c.batches.retrieve(b.id).model == "m"
        again = c.post("/batches/", cast_to=object, body={"input_file_id": f.id, "endpoint": "/v1/completions",
                                                          "completion_window": "24h", "metadata": {}})
        assert again["metadata"] == {} and again["status"] == "validating", again   # ({} came back null)
        assert [x.id for x in c.batches.list(limit=5).data] == [again["id"], b.id]
        with pytest.raises(openai.BadRequestError, match="between 1 and 100"):   # (was quietly 1)
            c.batches.list(limit=0)
    finally:
        h.close()


def test_a_batch_finalizing_cannot_be_cancelled_and_one_without_its_input_is_a_400(tmp_path):
    """Its lines are all answered: a cancel is refused (409) rather than answered "cancelling" and ignored."""
    from orchestrator.batches import BatchStore
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c, f, b = one_line_batch(h)
        store = BatchStore(tmp_path / "batches")
        rec = store.get(b.id, "alice")
        rec.update(status="finalizing", finalizing_at=int(time.time()))
        store.save(rec)
        with pytest.raises(openai.BadRequestError, match="input_file_id is required"):   # (not a 404 for "None")
            c.post("/batches", cast_to=object, body={"endpoint": "/v1/completions", "completion_window": "24h"})
        with pytest.raises(openai.ConflictError, match="finalizing"):
            c.batches.cancel(b.id)
        assert not store.cancel_requested(b.id)
    finally:
        h.close()


def test_a_body_that_is_not_the_gzip_it_says_is_a_400_on_the_batch_and_file_routes(tmp_path):
    """aiohttp's RequestPayloadError (a bad gzip body) got through both handlers: a 500 and a traceback, where
    the proxied routes answer 400 invalid_body."""
    import socket
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        for path, ctype in ((b"/v1/batches", b"application/json"), (b"/v1/files", b"multipart/form-data; boundary=B")):
            s = socket.create_connection(("127.0.0.1", h.port), timeout=10)
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\nContent-Type: "
                      + ctype + b"\r\nContent-Encoding: gzip\r\nContent-Length: 20\r\nConnection: close\r\n\r\n"
                      + b"x" * 20)
            out = b""
            while data := s.recv(65536):
                out += data
            s.close()
            head, body = out.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 400"), (path, out[:300])
            assert "Cannot read the request body" in json.loads(body)["error"]["message"]
    finally:
        h.close()


def test_a_batch_body_over_max_body_bytes_is_the_json_413_of_every_endpoint(tmp_path):
    """A create whose body is over gateway.max_body_bytes, with a length or chunked: it was aiohttp's plain-text
    413 ("Maximum request body size ... exceeded."), where the proxied routes answer OpenAI's JSON."""
    import urllib.error
    import urllib.request
    h = Harness(tmp_path, MODEL, KEYS + "max_body_bytes: 4096\n")
    try:
        body = json.dumps({"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h",
                           "metadata": {"pad": "x" * 5000}}).encode()
        for chunked in (False, True):
            data = iter([body[:3000], body[3000:]]) if chunked else body
            req = urllib.request.Request(h.base + "/v1/batches", data=data, method="POST", headers={
                "Authorization": "Bearer sk-alice", "Content-Type": "application/json",
                **({"Transfer-Encoding": "chunked"} if chunked else {})})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 413 and e.value.headers["Content-Type"].startswith("application/json"), chunked
            assert json.loads(e.value.read())["error"]["code"] == "request_too_large"
    finally:
        h.close()


def test_a_batch_made_while_its_file_is_deleted_either_stays_with_its_file_or_is_refused(tmp_path, monkeypatch):
    """The delete looked for batches reading the file, then deleted it; a batch made between the two (another
    gateway process, or this one: the look runs in a thread) was recorded with its input gone, and failed later.
    Both now go under the file store's lock: one of them is refused, and nothing is left half."""
    from orchestrator.batches import BatchStore

    looked = threading.Event()
    uses = BatchStore.uses

    def slow_uses(self, file_id, owner):   # the delete's look: answered, then slow to act on (a busy disk)
        found = uses(self, file_id, owner)
        looked.set()
        time.sleep(0.5)
        return found
    monkeypatch.setattr(BatchStore, "uses", slow_uses)
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
        line = {"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "p"}}
        f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        outcome = {}

        def delete():
            try:
                outcome["deleted"] = c.files.delete(f.id).deleted
            except openai.APIStatusError as exc:
                outcome["deleted"] = exc.status_code
        t = threading.Thread(target=delete)
        t.start()
        assert looked.wait(10)
        try:   # the batch made while the delete acts on its look
            outcome["batch"] = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                completion_window="24h").id
        except openai.NotFoundError:
            outcome["batch"] = None
        t.join(10)
        batches = c.batches.list().data
        file_there = any(x.id == f.id for x in c.files.list().data)
        assert outcome == {"deleted": True, "batch": None} and batches == [] and not file_there, outcome
    finally:
        h.close()


@pytest.mark.parametrize("what", ["retrieve", "cancel"])
def test_a_batch_read_or_cancelled_on_a_stalled_state_dir_holds_its_request_not_the_event_loop(tmp_path, monkeypatch,
                                                                                              what):
    """GET /v1/batches/{id} and its cancel read the record, its cancel marker and lock (files of the state dir,
    shared with the nodes) on the event loop: a stalled NFS or Lustre mount stalled every client of the gateway."""
    from orchestrator.batches import BatchStore
    from stuckio import asked_while_stalled, stall
    h = Harness(tmp_path, MODEL, KEYS)
    try:
        runner_key(h)
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
        line = {"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "p"}}
        f = c.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        gap, got = asked_while_stalled(h, stall(monkeypatch, BatchStore, "get"),
                                       lambda: getattr(c.batches, what)(b.id))
        assert gap < 0.25, f"the event loop stood still {gap:.2f}s while the batch's record was read"
        assert got and got[0].id == b.id and got[0].status == ("cancelling" if what == "cancel" else "validating")
    finally:
        h.close()
