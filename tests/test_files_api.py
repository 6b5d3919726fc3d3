"""The Files API (``/v1/files``) with the openai SDK as the client: upload, list, retrieve, content, delete;
batch-line checks as the upload streams in (a 400 naming the line, nothing stored); one key never sees
another's files; files outlive the gateway and are shared by gateway processes; a large upload in bounded
memory; and the store's side for the batch runner (lines, outputs written and resumed, adopted files)."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness
from orchestrator.batchcheck import IdSet
from orchestrator.batchfiles import SWEEP_AFTER_S, FileStore, owner_tag
from orchestrator.pagination import time_id

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    aliases: [m-alias]
  - name: m2
    engine: simulator
    container: {enabled: false}
"""
KEYS = """\
max_body_bytes: 4096
api_keys:
  - {name: alice, key: sk-alice}
  - {name: bob, key: sk-bob, models: [m]}
"""


def req(cid, model="m", url="/v1/chat/completions", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"custom_id": cid, "method": "POST", "url": url, "body": body, **extra}


def jsonl(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


@pytest.fixture
def gw(tmp_path):
    made: list[Harness] = []

    def make(keys: str = KEYS) -> Harness:
        h = Harness(tmp_path, MODELS, keys)
        made.append(h)
        return h
    yield make
    for h in made:
        if h.thread.is_alive():   # not closed by the test
            h.close()


def client(h: Harness, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0)


def upload(c: openai.OpenAI, tmp_path, data: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    p = tmp_path / name
    p.write_bytes(data)
    with open(p, "rb") as f:
        return c.files.create(file=f, purpose=purpose)


def stored(h: Harness) -> list[str]:
    d = h.tmp / "files"
    return sorted(n for n in os.listdir(d) if n != ".inputs.lock") if d.is_dir() else []   # (the store's lock)


def test_upload_list_retrieve_content_delete_round_trip(gw, tmp_path):
    h = gw()
    c = client(h)
    data = jsonl(req("a"), req("b", model="m-alias"), req("c", model="m2"))
    f = upload(c, tmp_path, data, name="prompts.jsonl")
    assert (f.object, f.bytes, f.filename, f.purpose, f.status) == ("file", len(data), "prompts.jsonl", "batch",
                                                                    "processed")
    assert f.id.startswith("file-") and abs(f.created_at - time.time()) < 5
    rec = FileStore(h.tmp / "files").get(f.id, "alice")       # what a batch needs, without reading the file
    assert (rec["lines"], rec["endpoint"], rec["models"]) == (3, "/v1/chat/completions", ["m", "m2"])
    assert [x.id for x in c.files.list()] == [f.id]
    assert c.files.retrieve(f.id) == f
    assert c.files.content(f.id).content == data
    assert [(n, json.loads(raw)["custom_id"]) for n, raw in FileStore(h.tmp / "files").open_lines(f.id)] == [
        (1, "a"), (2, "b"), (3, "c")]
    gone = c.files.delete(f.id)
    assert (gone.id, gone.object, gone.deleted) == (f.id, "file", True)
    for call in (c.files.retrieve, c.files.content, c.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert list(c.files.list()) == [] and stored(h) == []


BAD = [  # (what, file, line named, words in the message)
    ("malformed JSON", b'{"custom_id": "a", "method": "POST"\n', 1, "not valid JSON"),
    ("not an object", jsonl(req("a"), [1, 2]), 2, "not a JSON object"),
    ("no custom_id", jsonl(req("a"), {k: v for k, v in req("b").items() if k != "custom_id"}), 2, "`custom_id`"),
    ("duplicate custom_id", jsonl(req("a"), req("b"), req("a")), 3, "duplicate `custom_id` \"a\" (also on line 1)"),
    ("unknown model", jsonl(req("a"), req("b", model="nope")), 2, "model `nope` does not exist"),
    ("no model", jsonl({**req("a"), "body": {"prompt": "x"}}), 1, "`body.model`"),
    ("mixed urls", jsonl(req("a"), req("b", url="/v1/embeddings")), 2, "line 1's is /v1/chat/completions"),
    ("unknown url", jsonl(req("a", url="/v1/responses")), 1, "`url` must be one of"),
    ("no url first", jsonl({k: v for k, v in req("a").items() if k != "url"}, req("b")), 1, "not null"),
    ("no url at all", jsonl(*({k: v for k, v in req(c).items() if k != "url"} for c in "ab")), 1, "`url` must be"),
    ("wrong method", jsonl(req("a"), req("b", method="GET")), 2, '`method` must be "POST", not "GET"'),
    ("body not an object", jsonl({**req("a"), "body": "x"}), 1, "`body` must be a JSON object"),
    ("streaming", jsonl(req("a"), {**req("b"), "body": {**req("b")["body"], "stream": True}}), 2, "`body.stream`"),
    ("blank line inside", jsonl(req("a")) + b"\n" + jsonl(req("b")), 2, "is empty"),
    ("line too long", jsonl(req("a"), {**req("b"), "body": {"model": "m", "prompt": "x" * 5000}}), 2,
     "longer than 4096 bytes"),
    ("not UTF-8", jsonl(req("a")) + b'{"custom_id": "\xff"}\n', 2, "not valid JSON"),
]


@pytest.mark.parametrize("what,data,line,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_line_is_a_400_naming_it_and_nothing_is_stored(gw, tmp_path, what, data, line, words):
    h = gw()
    with pytest.raises(openai.BadRequestError) as err:
        upload(client(h), tmp_path, data)
    msg = err.value.body["message"]
    assert msg.startswith(f"Line {line}: ") and words in msg, msg
    assert err.value.body["param"] == "file"
    assert stored(h) == []    # no content, no record, no temporary file


def test_a_model_the_key_may_not_use_is_refused_like_an_unknown_one(gw, tmp_path):
    h = gw()
    data = jsonl(req("a", model="m-alias"), req("b", model="m2"))
    with pytest.raises(openai.BadRequestError) as err:
        upload(client(h, "sk-bob"), tmp_path, data)
    assert err.value.body["message"] == "Line 2: the model `m2` does not exist or you do not have access to it."
    assert upload(client(h, "sk-alice"), tmp_path, data).bytes == len(data)   # alice may use every model


@pytest.mark.parametrize("data,purpose,words", [
    (b"", "batch", "The file is empty"),
    (b"\n\n", "batch", "The file is empty"),
    (jsonl(req("a")), "fine-tune", "Purpose 'fine-tune' is not supported"),
    (jsonl(req("a")), "batch_output", "written by the batch runner"),
    (jsonl(req("a")), "whatever", "Invalid purpose 'whatever'"),
])
def test_empty_files_and_other_purposes_are_refused(gw, tmp_path, data, purpose, words):
    h = gw()
    with pytest.raises(openai.BadRequestError) as err:
        upload(client(h), tmp_path, data, purpose=purpose)
    assert words in err.value.body["message"]
    assert stored(h) == []


def test_trailing_blank_lines_are_not_requests(gw, tmp_path):
    h = gw()
    f = upload(client(h), tmp_path, jsonl(req("a"), req("b")) + b"\n\r\n")
    store = FileStore(h.tmp / "files")
    assert store.get(f.id, "alice")["lines"] == 2
    assert [n for n, _ in store.open_lines(f.id)] == [1, 2]


def test_another_key_never_sees_a_file(gw, tmp_path):
    h = gw()
    f = upload(client(h), tmp_path, jsonl(req("a")))
    bob = client(h, "sk-bob")
    assert list(bob.files.list()) == []
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert client(h).files.retrieve(f.id).id == f.id       # bob's delete did not touch it
    with pytest.raises(openai.AuthenticationError):
        client(h, "sk-nobody").files.list()


def http(h: Harness, method: str, path: str, key: str = "sk-alice") -> tuple[int, dict, dict]:
    r = urllib.request.Request(h.base + path, method=method, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(r, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_wrong_methods_and_paths_are_openai_errors(gw, tmp_path):
    h = gw()
    f = upload(client(h), tmp_path, jsonl(req("a")))
    for method, path, status, allow in [("PUT", "/v1/files", 405, "GET, POST"),
                                        ("POST", f"/v1/files/{f.id}", 405, "GET, DELETE"),
                                        ("DELETE", f"/v1/files/{f.id}/content", 405, "GET"),
                                        ("GET", f"/v1/files/{f.id}/other", 404, None),
                                        ("GET", "/v1/files/../admin.key", 404, None)]:
        code, headers, body = http(h, method, path)
        assert code == status and body["error"]["type"] == "invalid_request_error", (method, path)
        assert headers.get("Allow") == allow
    code, _, body = http(h, "POST", "/v1/files")      # not a form
    assert code == 400 and "multipart/form-data" in body["error"]["message"]
    code, _, body = http(h, "GET", "/v1/filesystem")   # not the Files API: proxied, names no model, and no
    assert code == 404 and "Invalid URL (GET /v1/filesystem)" in body["error"]["message"]   # such vLLM path


def form(*fields: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in fields:
        fn = f'; filename="{filename}"' if filename else ""
        out += f'--XX\r\nContent-Disposition: form-data; name="{name}"{fn}\r\n\r\n'.encode() + value + b"\r\n"
    return out + b"--XX--\r\n"


def post_form(h: Harness, body: bytes) -> tuple[int, dict]:
    r = urllib.request.Request(h.base + "/v1/files", data=body, method="POST", headers={
        "Authorization": "Bearer sk-alice", "Content-Type": "multipart/form-data; boundary=XX"})
    try:
        with urllib.request.urlopen(r, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_file_expires_after_what_its_upload_asked_and_is_then_gone(gw, tmp_path):
    """The SDK's ``expires_after`` (form fields ``expires_after[anchor]``/``[seconds]``: they were refused as
    unknown parameters): the file's ``expires_at``; past it the file is not found, listed nor deleted, and
    :meth:`FileStore.expire` removes it unless a batch that has not ended reads it.  Without one, OpenAI's 30 days
    (``batches.file_expiry_s``; 0: none): a client written for OpenAI never deletes its files, which filled the
    key's quota."""
    h = gw()
    c = client(h)
    data = jsonl(req("a"))
    p = tmp_path / "in.jsonl"
    p.write_bytes(data)
    f = c.files.create(file=p.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    g = upload(c, tmp_path, data)
    assert f.expires_at == f.created_at + 3600 and g.expires_at == g.created_at + 30 * 86400
    h.reload(h.text + "batches:\n  file_expiry_s: 0\n")
    kept = upload(c, tmp_path, data)
    assert kept.expires_at is None
    h.reload(h.text)
    assert c.files.retrieve(f.id).expires_at == f.expires_at
    for bad, words in [({"anchor": "created_at", "seconds": 60}, "from 3600"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "created_at"),
                       ({"anchor": "created_at", "seconds": 2592001}, "30 days")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=p.open("rb"), purpose="batch", expires_after=bad)
        assert e.value.body["param"] == "expires_after" and words in e.value.body["message"], e.value.body
    store = FileStore(h.tmp / "files")
    assert store.expire(now=f.expires_at - 1) == 0   # (from the file's own times: this machine may be slow)
    rec_path = store.record_path(f.id, "alice")   # an hour on: past its expiry
    rec = json.loads(rec_path.read_text())
    rec["expires_at"] = int(time.time()) - 1
    rec_path.write_text(json.dumps(rec))
    for call in (c.files.retrieve, c.files.content, c.files.delete):   # a delete too: it removed the content a
        with pytest.raises(openai.NotFoundError):                        # batch still reads (the batch failed)
            call(f.id)
    assert [x.id for x in c.files.list()] == [kept.id, g.id] and store.data_path(f.id).exists()
    assert store.expire(keep={f.id}) == 0 and store.data_path(f.id).exists()   # a running batch's input stays
    assert store.expire() == 1 and not store.data_path(f.id).exists() and not rec_path.exists()
    assert store.get(g.id, "alice") is not None


def test_the_form_in_any_order_and_its_missing_or_unknown_fields(gw):
    h = gw()
    data = jsonl(req("a"))
    code, body = post_form(h, form(("file", data, "a.jsonl"), ("purpose", b"batch", None)))   # file first
    assert code == 200 and (body["filename"], body["bytes"]) == ("a.jsonl", len(data))
    for fields, words in [((("file", data, "a.jsonl"),), "no `purpose`"),
                          ((("purpose", b"batch", None),), "no `file`"),
                          ((("purpose", b"batch", None), ("expires_after", b"1", None)), "Unknown parameter"),
                          ((("purpose", b"batch", None), ("file", data, "a"), ("file", data, "b")), "One `file`")]:
        code, body = post_form(h, form(*fields))
        assert code == 400 and words in body["error"]["message"], fields
    assert len(stored(h)) == 2     # the first upload's content and record


def test_a_client_that_goes_away_mid_upload_leaves_nothing(gw):
    h = gw()
    head = form(("purpose", b"batch", None))[:-4] + (
        b'\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n')   # the file, cut short
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\n"
              b"Content-Type: multipart/form-data; boundary=XX\r\nContent-Length: 100000000\r\n\r\n"
              + head + jsonl(*(req(f"r{i}") for i in range(2000))))
    wait_for(lambda: any(n.startswith(".up-") for n in stored(h)), 5, "the upload's temporary file")
    s.close()
    wait_for(lambda: stored(h) == [], 5, "the temporary file removed")


def test_listing_pages_newest_first_filters_by_purpose_and_shows_the_runners_outputs(gw, tmp_path):
    h = gw()
    c = client(h)
    ids = [upload(c, tmp_path, jsonl(req(f"x{i}"))).id for i in range(3)]
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "r1"}\n{"id": "r2"}\n')
    store = FileStore(h.tmp / "files")
    oid = store.adopt(out, "alice", "batch_output", "b_output.jsonl", file_id="file-abc123o")
    assert oid == "file-abc123o" and not out.exists()
    assert store.adopt(out, "alice", "batch_output", "b_output.jsonl", file_id=oid) == oid   # again: done
    newest_first = [oid, *reversed(ids)]
    page = c.files.list(limit=2)
    assert [x.id for x in page.data] == newest_first[:2] and page.has_more
    assert [x.id for x in c.files.list(limit=2)] == newest_first                # the SDK follows `after`
    assert [x.id for x in c.files.list(order="asc")] == newest_first[::-1]
    assert [x.id for x in c.files.list(purpose="batch_output")] == [oid]
    assert c.files.content(oid).content == b'{"id": "r1"}\n{"id": "r2"}\n'
    assert store.get(oid, "alice")["lines"] == 2
    with pytest.raises(openai.BadRequestError):
        c.files.list(limit=0)


def test_a_client_that_deletes_what_it_pages_through_deletes_everything(gw, tmp_path):
    """The SDK asks for the page after the last id it was given; deleted meanwhile, that id still places the
    page (ids start with their creation time): before, the page was empty and the loop ended with files left.
    A cursor of another purpose (a batch's output) places a filtered list the same way; a gone id of the old random form is a
    400 that names ``after``, never an empty page."""
    h = gw()
    c = client(h)
    ids = [upload(c, tmp_path, jsonl(req(f"x{i}"))).id for i in range(5)]
    assert all(len(i) == len("file-") + 28 for i in ids)
    store = FileStore(h.tmp / "files")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "r1"}\n')
    # the newest, of another purpose, named as the batch runner names a batch's output (its batch id's + "o")
    oid = store.adopt(out, "alice", "batch_output", "o.jsonl", file_id=f"file-{time_id('batch_')[6:]}o")
    assert [x.id for x in c.files.list(purpose="batch", limit=2, after=oid)] == ids[::-1]
    c.files.delete(oid)
    assert [x.id for x in c.files.list(after=oid)] == ids[::-1]   # (was a 400: its id is one longer)
    gone = []
    for f in c.files.list(limit=2):
        c.files.delete(f.id)
        gone.append(f.id)
    assert gone == ids[::-1] and list(c.files.list()) == []
    with pytest.raises(openai.BadRequestError) as err:
        c.files.list(after="file-" + "ab" * 12)
    assert err.value.body["param"] == "after" and "file-abab" in err.value.body["message"]


def test_files_outlive_the_gateway_and_every_gateway_process_sees_them(gw, tmp_path):
    h1 = gw()
    data = jsonl(req("a"), req("b"))
    f = upload(client(h1), tmp_path, data)
    h2 = gw()                                     # a second process on the same state dir
    assert [x.id for x in client(h2).files.list()] == [f.id]
    assert client(h2).files.content(f.id).content == data
    h1.close()
    h3 = gw()                                     # a restart
    assert client(h3).files.retrieve(f.id) == f
    assert client(h3).files.delete(f.id).deleted
    assert list(client(h2).files.list()) == []


def test_uploads_have_their_own_size_limit(gw, tmp_path, monkeypatch):
    import orchestrator.gateway.files as files
    monkeypatch.setattr(files, "MAX_UPLOAD_BYTES", 1000)
    h = gw()
    c = client(h)
    for n in (20, 2000):      # over the limit as it streams in / by its Content-Length before it is read
        with pytest.raises(openai.APIStatusError) as err:
            upload(c, tmp_path, jsonl(*(req(f"r{i}") for i in range(n))))
        assert err.value.status_code == 413 and "larger than 1000 bytes" in err.value.body["message"]
    assert stored(h) == []
    assert upload(c, tmp_path, jsonl(req("a"))).bytes < 1000


def test_a_bad_line_early_in_a_large_upload_is_still_answered(gw, tmp_path):
    h = gw()
    line = json.dumps(req("x")).encode()
    data = jsonl(req("a"), req("a")) + b"".join(line.replace(b'"x"', b'"x%d"' % i) + b"\n" for i in range(100_000))
    with pytest.raises(openai.BadRequestError) as err:   # the client sends all 10 MB, then reads the 400
        upload(client(h), tmp_path, data)
    assert err.value.body["message"].startswith("Line 2: duplicate")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_upload_streams_in_bounded_memory(gw, tmp_path):
    h = gw()
    n = 200_000
    pad = "p" * 250
    p = tmp_path / "big.jsonl"
    with open(p, "wb") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": f"{i} {pad}", "max_tokens": 2}}).encode() + b"\n")
    size = p.stat().st_size
    peak, base, stop = [0], rss_bytes(), threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    try:
        t0 = time.monotonic()
        with open(p, "rb") as fh:
            f = client(h).files.create(file=fh, purpose="batch")
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    growth = peak[0] - base
    print(f"{n} lines, {size / 2**20:.0f} MiB uploaded in {took:.2f}s; RSS grew {growth / 2**20:.1f} MiB")
    assert f.bytes == size and size > 60 * 2**20
    assert growth < 24 * 2**20          # the client and the gateway together: far below the file's size
    store = FileStore(h.tmp / "files")
    assert store.get(f.id, "alice")["lines"] == n
    last = collections.deque(store.open_lines(f.id), maxlen=1)[0]     # read through, one line at a time
    assert last[0] == n and json.loads(last[1])["custom_id"] == f"req-{n - 1}"


def test_the_duplicate_check_is_bounded_for_a_million_lines():
    ids = IdSet()
    for i in range(1_000_000):
        assert ids.add(f"request-{i}", i + 1) == 0
    assert ids.add("request-4242", 7) == 4243 and ids.add("request-999999", 7) == 1_000_000
    table = len(ids.keys) * ids.keys.itemsize + len(ids.lines) * ids.lines.itemsize
    assert table <= 24 * 2**20 + 2**20     # 2^21 slots of 12 bytes: 24 MiB, about 25 bytes a line


def test_an_output_is_appended_resumed_after_a_crash_and_stored_once(tmp_path):
    store = FileStore(tmp_path / "files")
    w = store.create_output("alice", "batch_output", "b_output.jsonl", file_id="file-b1o")
    w.append(b'{"id": 1}')
    w.append(b'{"id": 2}\n')
    w.f.write(b'{"id": 3, "half')          # SIGKILL in the middle of a line
    w.f.flush()
    assert store.get("file-b1o", "alice") is None          # not a file until finalized
    w = store.create_output("alice", "batch_output", "b_output.jsonl", file_id="file-b1o")
    assert w.lines == 2
    w.append(b'{"id": 3}')
    w.f.flush()
    os.replace(w.path, store.data_path("file-b1o"))     # SIGKILL between the content's rename and its record
    w = store.create_output("alice", "batch_output", "b_output.jsonl", file_id="file-b1o")
    assert w.lines == 3
    rec = w.finalize()
    assert (rec["lines"], rec["bytes"], rec["purpose"]) == (3, 30, "batch_output")
    assert [raw for _, raw in store.open_lines("file-b1o")] == [b'{"id": 1}', b'{"id": 2}', b'{"id": 3}']
    again = store.create_output("alice", "batch_output", "b_output.jsonl", file_id="file-b1o").finalize()
    assert again == rec and store.open_lines("file-b1o") is not None      # finalized twice: stored once
    with pytest.raises(KeyError):
        store.create_output("alice", "batch_output", "x", file_id="file-../../etc")


def test_what_a_crash_leaves_is_swept_once_it_is_old(tmp_path):
    store = FileStore(tmp_path)
    w = store.upload()
    w.write(b"half an upload")
    (tmp_path / "file-orphan.data").write_bytes(b"content without a record")
    kept = store.adopt(tmp_path / "missing", "alice", "batch_output", "x")   # an empty stored file
    assert store.sweep() == 0
    assert store.sweep(now=time.time() + SWEEP_AFTER_S + 1) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([f"{kept}.data", store.record_path(kept, "alice").name])
    assert store.get(kept, "alice")["bytes"] == 0 and store.get(kept, "bob") is None


@pytest.mark.parametrize("err", ["EPERM", "EXDEV", "ENOSYS", "EMLINK", "EINVAL", "ENOSPC", "EDQUOT", "EIO", "EROFS"])
def test_adopt_moves_the_content_where_a_hard_link_is_refused_but_for_a_full_disk(tmp_path, monkeypatch, err):
    """A file system that will not hard-link into the store (AFS and EOS: EXDEV across folders; some FUSE ones:
    ENOSYS; EMLINK, EINVAL) gets the content moved in, as before adopt linked it: only EPERM and EOPNOTSUPP
    moved, so every batch's hand-over raised there and the batch stayed finalizing for good.  A link refused
    for the disk's sake (full, over quota, an I/O error, read-only) raises, the source kept for the next try."""
    import errno
    store, src = FileStore(tmp_path / "files"), tmp_path / "b.output.jsonl"
    src.write_bytes(b'{"a": 1}\n{"a": 2}\n')
    code = getattr(errno, err)

    def refused(a, b):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(os, "link", refused)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
        with pytest.raises(OSError) as e:
            store.adopt(src, "alice", "batch_output", "b_output.jsonl", "file-b1o")
        assert e.value.errno == code and src.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
        assert store.get("file-b1o", "alice") is None and not store.data_path("file-b1o").exists()
        return
    assert store.adopt(src, "alice", "batch_output", "b_output.jsonl", "file-b1o") == "file-b1o"
    assert not src.exists() and store.get("file-b1o", "alice")["lines"] == 2
    assert [raw for _, raw in store.open_lines("file-b1o")] == [b'{"a": 1}', b'{"a": 2}']


def test_content_moved_in_whose_record_keeps_failing_is_not_swept_while_the_tries_go_on(tmp_path, monkeypatch):
    """Moved in (no hard links), then its record cannot be written (a full disk) for longer than the sweep's
    hour: each try makes the content recent again, so a sweep does not take it before its record is written."""
    store, src = FileStore(tmp_path / "files"), tmp_path / "b.output.jsonl"
    src.write_bytes(b'{"a": 1}\n')
    def no_links(a, b):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    real, full = FileStore.publish, [True]

    def publish(self, *a, **kw):
        if full[0]:
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)
    monkeypatch.setattr(FileStore, "publish", publish)
    data, old = store.data_path("file-b1o"), time.time() - 2 * SWEEP_AFTER_S
    for _ in range(2):   # tries 2 h apart (the batch runner's back-off tries every 5 minutes at most)
        with pytest.raises(OSError):
            store.adopt(src, "alice", "batch_output", "b_output.jsonl", "file-b1o")
        assert not src.exists() and data.exists()   # moved in, not recorded
        assert store.sweep(now=time.time() + 60) == 0
        os.utime(data, (old, old))
    full[0] = False
    assert store.adopt(src, "alice", "batch_output", "b_output.jsonl", "file-b1o") == "file-b1o"
    assert [raw for _, raw in store.open_lines("file-b1o")] == [b'{"a": 1}'] and store.sweep(now=time.time() + 60) == 0


# -- storage quotas (batches.max_file_bytes_per_key, max_files_per_key, min_free_bytes) --------------------------
def quotas(h: Harness, **batches) -> Harness:
    """The harness's fleet with these ``batches:`` settings, applied as the daemon's reload does."""
    h.reload(h.text + f"batches: {json.dumps(batches)}\n")
    return h


def lines(n: int, prefix: str = "r") -> bytes:
    return jsonl(*(req(f"{prefix}{i}") for i in range(n)))


def test_an_upload_past_its_keys_byte_quota_is_refused_and_nothing_is_stored(gw, tmp_path):
    """Refused as it streams in (its Content-Length alone did not show it) and, when its Content-Length does,
    before its body is read: 400 ``storage_limit_exceeded`` naming the limit and what the key stores."""
    h = quotas(gw(), max_file_bytes_per_key=100_000)
    c = client(h)
    first = upload(c, tmp_path, lines(380))
    assert 60_000 < first.bytes < 62_000
    for data in (lines(380, "s"), lines(2000, "t")):   # refused mid-stream / by its Content-Length
        with pytest.raises(openai.BadRequestError) as err:
            upload(c, tmp_path, data)
        body = err.value.body
        assert (body["code"], body["param"]) == ("storage_limit_exceeded", "file"), body
        assert (f"this key's files may take 100000 bytes in all; it stores {first.bytes} bytes in 1 file, and this "
                "upload would pass the limit. Deleting files") in body["message"], body
        assert stored(h) == sorted([f"{first.id}.data", FileStore(h.tmp / "files").record_path(first.id, "alice").name])
    assert upload(c, tmp_path, lines(200, "u")).bytes <= 100_000 - first.bytes   # what room is left still takes one


def test_an_upload_past_its_keys_file_count_is_refused(gw, tmp_path):
    h = quotas(gw(), max_files_per_key=2)
    c = client(h)
    ids = [upload(c, tmp_path, jsonl(req(f"x{i}"))).id for i in range(2)]
    with pytest.raises(openai.BadRequestError) as err:
        upload(c, tmp_path, jsonl(req("y")))
    assert err.value.body["code"] == "storage_limit_exceeded"
    assert "this key may store 2 files; it stores " in err.value.body["message"]
    assert len(stored(h)) == 4 and [f.id for f in c.files.list()] == ids[::-1]
    with socket.create_connection(("127.0.0.1", h.port), timeout=10) as s:   # a client awaiting 100-continue:
        s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\nContent-Type: "
                  b"multipart/form-data; boundary=XX\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        got = b""   # refused at once, not told to send its body, the connection closed
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    head, _, answer = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), got
    assert json.loads(answer)["error"]["code"] == "storage_limit_exceeded"


def test_a_keys_own_storage_limits_take_the_place_of_the_fleets(gw, tmp_path):
    """``max_files`` and ``max_file_bytes`` on an api_keys entry: a team with large batches gets more room (or
    none), the other keys keep the ``batches:`` defaults."""
    keys = KEYS.replace("{name: alice, key: sk-alice}", "{name: alice, key: sk-alice, max_files: 3, max_file_bytes: 0}")
    h = quotas(gw(keys), max_files_per_key=1, max_file_bytes_per_key=100_000)
    alice, bob = client(h), client(h, "sk-bob")
    for i in range(3):   # past the fleet's file count, and its bytes (0: no limit for her)
        upload(alice, tmp_path, lines(380, f"a{i}"))
    with pytest.raises(openai.BadRequestError) as err:
        upload(alice, tmp_path, jsonl(req("a")))
    assert "this key may store 3 files" in err.value.body["message"]
    upload(bob, tmp_path, jsonl(req("b")))
    with pytest.raises(openai.BadRequestError) as err:   # bob: the fleet's limits
        upload(bob, tmp_path, jsonl(req("c")))
    assert "this key may store 1 file;" in err.value.body["message"]


def test_deleting_a_file_frees_room_for_the_next_upload(gw, tmp_path):
    h = quotas(gw(), max_files_per_key=1, max_file_bytes_per_key=100_000)
    c = client(h)
    f = upload(c, tmp_path, lines(380))
    for data in (jsonl(req("a")), lines(380, "s")):
        with pytest.raises(openai.BadRequestError):
            upload(c, tmp_path, data)
    c.files.delete(f.id)
    assert upload(c, tmp_path, lines(380, "s")).bytes == f.bytes


def test_another_keys_files_do_not_count(gw, tmp_path):
    h = quotas(gw(), max_files_per_key=1, max_file_bytes_per_key=100_000)
    alice, bob = client(h), client(h, "sk-bob")
    a = upload(alice, tmp_path, lines(380))
    b = upload(bob, tmp_path, lines(380))   # alice's files are hers: bob has room
    assert b.bytes == a.bytes
    with pytest.raises(openai.BadRequestError) as err:
        upload(bob, tmp_path, jsonl(req("x")))
    assert f"it stores {b.bytes} bytes in 1 file," in err.value.body["message"]   # bob's own, nothing of alice's


def test_uploads_in_progress_count_for_their_key(gw, tmp_path):
    """A second upload while the first still streams in is refused for the bytes the first brought so far (the
    store does not show them yet); once the first has ended (here: its client gone), there is room again."""
    h = quotas(gw(), max_file_bytes_per_key=80_000)
    data = lines(380)
    body = form(("purpose", b"batch", None), ("file", data, "a.jsonl"))
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\nContent-Type: "
              b"multipart/form-data; boundary=XX\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:30_000])
    time.sleep(0.3)
    s.sendall(body[30_000:-100])   # (the multipart reader reads ahead: a part's chunk is one read behind)
    d = h.tmp / "files"
    wait_for(lambda: sum((d / n).stat().st_size for n in stored(h) if n.startswith(".up-")) > 20_000, 5,
             "the first upload's bytes received")
    with pytest.raises(openai.BadRequestError) as err:
        upload(client(h), tmp_path, lines(380, "s"))
    assert "it stores 0 bytes in 0 files, and 1 other upload of it in progress" in err.value.body["message"]
    upload(client(h, "sk-bob"), tmp_path, lines(380, "s"))   # another key's upload in progress did not count
    s.close()
    wait_for(lambda: not any(n.startswith(".up-") for n in stored(h)), 5, "the first upload gone")
    assert upload(client(h), tmp_path, lines(380, "s")).bytes == len(data)


def test_the_free_space_floor_is_a_507_with_retry_after(gw, tmp_path, monkeypatch):
    """Under ``min_free_bytes`` free on the state dir's file system (as ``statvfs`` tells it), or the disk full
    as it is written: 507 ``insufficient_storage``, a ``server_error`` with ``Retry-After``; nothing stored."""
    from orchestrator.batchfiles import Writer
    h = quotas(gw(), min_free_bytes=10 * 2**20)
    c = client(h)
    real, free = os.statvfs, [10 * 2**20 + 30_000]

    def statvfs(path):
        if not str(path).startswith(str(tmp_path)):
            return real(path)
        return os.statvfs_result((4096, 512, 10**6, 0, free[0] // 512, 10**6, 10**5, 10**5, 0, 255))
    monkeypatch.setattr(os, "statvfs", statvfs)
    small = upload(c, tmp_path, lines(100))       # 13 KB: leaves more than the floor
    for data in (lines(380, "s"), lines(2000, "t")):   # refused as it streams in / by its Content-Length
        with pytest.raises(openai.InternalServerError) as err:
            upload(c, tmp_path, data)
        assert err.value.status_code == 507 and err.value.response.headers["Retry-After"] == "60"
        assert err.value.response.headers["x-should-retry"] == "false"   # (the SDK sent the upload twice more)
        assert (err.value.body["type"], err.value.body["code"]) == ("server_error", "insufficient_storage")
        assert "nearly full" in err.value.body["message"] and str(tmp_path) not in err.value.body["message"]
    assert len(stored(h)) == 2 and [f.id for f in c.files.list()] == [small.id]
    free[0] = 2**40
    monkeypatch.setattr(Writer, "write", lambda self, data: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(openai.InternalServerError) as err:   # the disk full all the same: ENOSPC
        upload(c, tmp_path, lines(380, "s"))
    assert err.value.status_code == 507 and len(stored(h)) == 2
    monkeypatch.undo()
    assert upload(c, tmp_path, lines(380, "s")).bytes > 50_000


def test_uploads_other_gateway_processes_receive_count_against_the_key(gw, tmp_path):
    """With several gateway workers, an upload counted only the uploads in progress in its own process: uploads
    through different workers at once could each pass the key's limit.  An upload's temporary file now says whose
    it is and what its request says it sends: the other processes count it (its bytes on disk, or the declared ones
    if more) until it is stored or given up; one whose process is gone does not count."""
    h = quotas(gw(), max_files_per_key=2, max_file_bytes_per_key=60_000)
    store = FileStore(h.tmp / "files")
    c = client(h)
    upload(c, tmp_path, lines(40, "a"))   # one stored
    other = subprocess.Popen(["cat"], stdin=subprocess.PIPE)   # another live process (until killed below)
    try:   # another worker's upload in progress: 1,000 bytes on disk of the 30,000 its request declared
        store.dir.mkdir(parents=True, exist_ok=True)
        busy = store.dir / f".up-{other.pid}-00ff.{owner_tag('alice')}.30000"
        busy.write_bytes(b"x" * 1000)
        stored_bytes = store.usage("alice")[0] - 30_000
        assert store.usage("alice") == (stored_bytes + 30_000, 2) and store.usage("bob") == (0, 0)
        with pytest.raises(openai.BadRequestError) as err:   # a third file for a key of two
            upload(c, tmp_path, lines(10, "b"))
        assert "this key may store 2 files" in err.value.body["message"]
        assert f"it stores {stored_bytes + 30_000} bytes in 2 files" in err.value.body["message"]
        busy.write_bytes(b"x" * 45_000)   # more on disk than declared: what is there counts
        assert store.usage("alice")[0] == stored_bytes + 45_000
    finally:
        other.kill()
        other.wait()
    assert store.usage("alice") == (stored_bytes, 1)   # its process gone: not an upload any more
    assert upload(c, tmp_path, lines(10, "b")).bytes > 0
    mine = store.upload("alice", 512)   # (how a gateway process names the upload it receives)
    assert mine.path.name.endswith(f".{owner_tag('alice')}.512") and store.usage("alice")[1] == 2   # (its own:
    mine.abort()                                                                   # counted by the process itself)
    # a daemon starting drops what its predecessor's gateway processes left (a process id reused since would
    # make them count again), not the batch runner's own temporary files
    left = store.dir / f".up-{os.getpid() + 1}-00aa.{owner_tag('alice')}.30000"
    left.write_bytes(b"x")
    runner = store.dir / ".up-1-00bb"
    runner.write_bytes(b"x")
    assert store.drop_uploads() == 2 and not left.exists() and not busy.exists() and runner.exists()


def test_batch_outputs_count_but_are_never_refused(gw, tmp_path):
    """The batch runner stores a key's outputs past its quota (adopted or written line by line): they count in
    its usage, so its next upload is refused; files past their expiry do not count."""
    h = quotas(gw(), max_files_per_key=2, max_file_bytes_per_key=1000)
    store = FileStore(h.tmp / "files")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "r"}\n' * 200)
    store.adopt(out, "alice", "batch_output", "b_output.jsonl", expires_after=3600)
    w = store.create_output("alice", "batch_output", "b_error.jsonl")
    for i in range(200):
        w.append(b'{"id": "e%d"}' % i, sync=False)
    errs = w.finalize()["bytes"]
    known: dict = {}   # (what the gateway keeps: each record read once)
    assert store.usage("alice", known) == (2400 + errs, 2) and errs > 2000 and len(known) == 2
    assert store.usage("alice", known, now=time.time() + 3601) == (errs, 1)   # the output past its expiry
    assert store.usage("bob") == (0, 0)
    for data in (jsonl(req("a")), lines(380)):
        with pytest.raises(openai.BadRequestError) as err:
            upload(client(h), tmp_path, data)
        assert f"this key may store 2 files; it stores {2400 + errs} bytes in 2 files" in err.value.body["message"]
    assert len(stored(h)) == 4


@pytest.mark.parametrize("what", ["retrieve", "content", "delete"])
def test_a_file_read_on_a_stalled_state_dir_holds_its_request_not_the_event_loop(gw, tmp_path, monkeypatch, what):
    """A file's record is a file of the state dir, shared with the nodes: its GET, its content's and its DELETE
    read it on the event loop, and a stalled NFS or Lustre mount stalled every client of the gateway."""
    from stuckio import asked_while_stalled, stall
    h = gw()
    c = client(h)
    f = upload(c, tmp_path, jsonl(req("a")))
    gap, got = asked_while_stalled(h, stall(monkeypatch, FileStore, "get"), lambda: getattr(c.files, what)(f.id))
    assert gap < 0.25, f"the event loop stood still {gap:.2f}s while the file's record was read"
    assert got, what


@pytest.mark.parametrize("what", ["write", "upload", "create"])
def test_an_upload_and_a_batch_create_on_a_stalled_state_dir_hold_their_request_not_the_event_loop(
        gw, tmp_path, monkeypatch, what):
    """An upload's chunks were written to the state dir (and its temporary file made) on the event loop, and a
    batch's create read its input file's record there: a stalled NFS or Lustre mount stalled every client of the
    gateway. Found by a review."""
    from stuckio import asked_while_stalled, stall
    from orchestrator.batchfiles import Writer
    h = gw()
    c = client(h)
    (tmp_path / "in.jsonl").write_bytes(jsonl(req("a")))
    if what == "create":
        f = upload(c, tmp_path, jsonl(req("a")))
        ask = lambda: c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",   # noqa: E731
                                       completion_window="24h")
    else:
        ask = lambda: upload(c, tmp_path, jsonl(req("a")))   # noqa: E731
    stuck = stall(monkeypatch, *{"write": (Writer, "write"), "upload": (FileStore, "upload"),
                                 "create": (FileStore, "get")}[what])
    gap, got = asked_while_stalled(h, stuck, ask)
    assert gap < 0.25, f"the event loop stood still {gap:.2f}s"
    assert got and got[0].id, got
