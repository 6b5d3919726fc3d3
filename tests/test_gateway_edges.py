"""The gateway at its edges, against fake engines (aiohttp apps or raw sockets in the harness's loop, the
process boundary): answers that are slow to start, refusals and their Retry-After, a replica that refuses the
gateway's secret, bodies it cannot read, methods it does not proxy, and requests held when it stops."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import logging
import re
import threading
import time

import pytest
from aiohttp import web

from conftest import ROOT, free_port, wait_for
from gateway_harness import Harness
from orchestrator.contract import Endpoint, Replica

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    resume: {enabled: false}
"""


@pytest.fixture
def gw(tmp_path):
    made: list = []

    def make(gateway: str = "") -> Harness:
        h = Harness(tmp_path, MODELS, "shutdown_grace_s: 1\n" + gateway)
        made.append(h)
        return h
    yield make
    for h in made:
        h.close()


def engines(h: Harness, *handlers) -> list[dict]:
    """One fake engine per handler (answering every POST), published as model m's READY replicas; each
    engine's record of what it was sent (``seen``: (headers, body) per request)."""
    out = []

    async def start(handler, rec):
        async def handle(request):
            rec["paths"].append(request.path)
            rec["seen"].append((dict(request.headers), await request.read()))
            return await handler(request)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        rec["runner"], rec["port"] = runner, site._server.sockets[0].getsockname()[1]
    for handler in handlers:
        rec = {"seen": [], "paths": []}
        h.call(start(handler, rec))
        out.append(rec)
        h.fakes = [*getattr(h, "fakes", ()), rec["runner"]]
    h.set_ready([Replica(f"job-{i}", "m", i, Endpoint(f"job-{i}", "127.0.0.1", e["port"], "x"))
                 for i, e in enumerate(out)])
    return out


def post(h: Harness, body: bytes, headers: dict | None = None, path: str = "/v1/completions", method: str = "POST"):
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=60)
    c.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


COMPLETION = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
BODY = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()


def test_a_request_without_a_model_is_refused_as_openai_refuses_its_path_and_every_answer_has_a_request_id(gw):
    """An unknown /v1 path was a 400 "must name a model" (the SDK's BadRequestError): OpenAI's is a 404, and a
    GET of chat completions vLLM's 405.  The gateway's own answers (model list, its refusals) had no
    x-request-id, which every proxied answer has (the SDK's ``request_id``)."""
    h = gw()

    async def answer(request):
        return web.json_response(COMPLETION)
    e = engines(h, answer)[0]
    status, headers, data = post(h, b'{"input": "x"}', {"x-request-id": "mine-1"}, path="/v1/foo")
    err = json.loads(data)["error"]
    assert status == 404 and err["code"] == "unknown_url" and "POST /v1/foo" in err["message"]
    assert headers["x-request-id"] == "mine-1"
    status, headers, data = post(h, b"", path="/v1/chat/completions", method="GET")
    assert status == 405 and headers["Allow"] == "POST" and json.loads(data)["error"]["code"] == "method_not_allowed"
    status, _, data = post(h, b"{}", path="/v1/chat/completions/")   # (a path vLLM serves, however spelled)
    assert status == 400 and json.loads(data)["error"]["code"] == "missing_model"
    status, _, data = post(h, b"", path="/v1/responses/resp_1", method="GET")   # (vLLM's, by a response's id: one
    assert status == 404 and json.loads(data)["error"]["code"] == "response_not_found"   # the gateway never named)
    # the same answers when the body names a model (it went to a replica, whose client got the engine's
    # {"detail": "Not Found"}): a path and method give one answer whatever the body
    status, _, data = post(h, BODY, path="/v1/foo")
    assert status == 404 and json.loads(data)["error"]["code"] == "unknown_url"
    status, headers, data = post(h, BODY, path="/v1/chat/completions", method="GET")
    assert status == 405 and headers["Allow"] == "POST" and json.loads(data)["error"] == {
        "message": "Invalid method for URL (GET /v1/chat/completions).", "type": "invalid_request_error",
        "param": None, "code": "method_not_allowed"}   # (OpenAI's words)
    status, _, data = post(h, b'{"model": 5, "prompt": "x"}', path="/v1/completions")
    assert status == 400 and json.loads(data)["error"]["code"] == "invalid_type", data   # (not "name a model")
    assert json.loads(data)["error"]["param"] == "model"
    status, _, data = post(h, BODY, path="/v1/chat")
    assert status == 404 and json.loads(data)["error"]["code"] == "unknown_url"
    assert e["seen"] == []
    assert post(h, BODY, path="/v1/completions/")[0] == 200   # (however spelled)
    assert post(h, BODY, path="/v1/responses/resp_1", method="GET")[0] == 404   # (no id of the gateway's: whatever
    # the body names; tests/test_stored_responses.py reads stored responses)
    status, headers, data = post(h, b"", path="/v1/models", method="GET")
    assert status == 200 and len(headers["x-request-id"]) == 32
    listed = post(h, b"", path="/v1/models/", method="GET")   # (was a 404: "The model `` does not exist")
    assert listed[0] == 200 and [c["id"] for c in json.loads(listed[2])["data"]] == ["m"]
    assert post(h, b"", {"x-request-id": "mine-2"}, path="/v1/models", method="GET")[1]["x-request-id"] == "mine-2"


def test_every_v1_route_of_the_installed_vllm_is_proxied_or_refused_on_purpose():
    """The gateway proxies the /v1 paths it knows (a request naming a model elsewhere is its 404): a route a new
    vLLM adds must be added to them, or it is refused without anyone deciding so (vLLM 0.32's /v1/systemone
    was, by review)."""
    from orchestrator.gateway.endpoints import ENGINE_ONLY, MODEL_PATHS
    sources = sorted(ROOT.glob(".venv-vllm/lib/python3*/site-packages/vllm/entrypoints"))
    if not sources:
        pytest.skip("no vLLM in .venv-vllm")
    routes = set()
    for f in sources[0].rglob("*.py"):
        routes |= set(re.findall(r'"(/v1/[A-Za-z0-9_/{}.-]+)"', f.read_text(encoding="utf-8", errors="replace")))
    own = {"/v1/models"}                # the gateway's own list
    websockets = {"/v1/realtime"}       # not HTTP requests: not proxied
    left = {r for r in routes if r not in MODEL_PATHS | ENGINE_ONLY | own | websockets
            and not r.startswith("/v1/responses/")}   # (a stored response's, by its id: proxied)
    assert len(routes) >= 15 and not left, sorted(left)


def test_models_are_listed_as_vllm_lists_them_with_their_context_length(gw):
    """/v1/models said ``created: 0`` (1970) and no ``max_model_len``, which vLLM's list carries and clients size
    their prompts by: now ``created`` is the time of asking, as vLLM's, and ``max_model_len`` what the model's
    READY replicas say (the least of them during a roll), absent while none has said."""
    h = gw()
    before = int(time.time())
    status, _, data = post(h, b"", path="/v1/models", method="GET")
    card = json.loads(data)["data"][0]
    assert status == 200 and card["id"] == "m" and before <= card["created"] <= time.time() + 1
    assert "max_model_len" not in card
    h.set_ready([Replica(f"job-{i}", "m", i, Endpoint(f"job-{i}", "127.0.0.1", 1, "x"), max_model_len=n)
                 for i, n in enumerate((4096, 2048, 0))])
    card = json.loads(post(h, b"", path="/v1/models", method="GET")[2])["data"][0]
    assert card["max_model_len"] == 2048
    one = json.loads(post(h, b"", path="/v1/models/m", method="GET")[2])
    assert one["max_model_len"] == 2048 and one["root"] == "m" and one["created"] >= before


def test_an_answer_not_streamed_may_take_longer_than_the_first_byte_timeout(gw):
    """vLLM sends a whole answer's headers when it is done: such a request has the request's timeout, not the
    first byte's (it was cut at 300 s, sent again to another replica, and three of them ejected a busy one)."""
    h = gw("first_byte_timeout_s: 0.5\nrequest_timeout_s: 20")

    async def slow(request):
        await asyncio.sleep(1.5)
        return web.json_response(COMPLETION)
    e, = engines(h, slow)
    status, _, data = post(h, BODY)
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "hi" and len(e["seen"]) == 1


def test_an_answer_not_streamed_past_the_request_timeout_is_a_504_tried_once(gw):
    """Its whole time is spent: no other replica gets it again (up to 1 + max_retries times the timeout), and
    the busy replica is not counted failed."""
    h = gw("request_timeout_s: 1")

    async def slow(request):
        await asyncio.sleep(3)
        return web.json_response(COMPLETION)
    a, b = engines(h, slow, slow)
    status, _, data = post(h, BODY)
    assert status == 504 and json.loads(data)["error"]["code"] == "upstream_timeout"
    tried = [e for e in (a, b) if "/v1/completions" in e["paths"]]
    assert len(tried) == 1 and tried[0]["paths"].count("/v1/completions") == 1, (a["paths"], b["paths"])
    assert all(s.failures == 0 for s in h.gateway.pools.pools["m"].slots.values())
    # its prompt is charged, as the replica that had it counts it (/tokenize), not tried elsewhere
    wait_for(lambda: "/tokenize" in tried[0]["paths"], 10, "the prompt counted by the replica that had it")


def test_a_replicas_refusal_keeps_its_retry_after_and_gets_one_when_it_has_none(gw):
    h = gw("max_retries: 0")

    async def busy(request):
        return web.json_response({"error": {"message": "busy", "type": "x", "code": 503}}, status=503,
                                 headers={"Retry-After": "7"})
    engines(h, busy)
    status, headers, data = post(h, BODY)
    assert status == 503 and headers["Retry-After"] == "7" and json.loads(data)["error"]["message"] == "busy"

    async def limited(request):
        return web.Response(status=429, text="slow down")
    engines(h, limited)
    status, headers, data = post(h, BODY)
    assert status == 429 and headers["Retry-After"] == "1" and json.loads(data)["error"]["type"] == "upstream_error"

    async def broken(request):
        return web.Response(status=502, text="bad")
    engines(h, broken)
    status, headers, _ = post(h, BODY)
    assert status == 502 and "Retry-After" not in headers   # (an SDK backs off by its own rule)


HOP_BY_HOP = {"Connection": "x-hop, keep-alive", "X-Hop": "for the gateway", "Keep-Alive": "timeout=5",
              "Proxy-Authenticate": "Basic", "Trailer": "x-sum", "Upgrade": "h2c", "Server": "uvicorn",
              "x-request-id": "the-engines-own"}


def test_a_bytes_embedding_keeps_its_metadata_header_and_is_charged_its_usage(gw):
    """vLLM's /v1/embeddings with `encoding_format: "bytes"` answers the vectors as a chunked body and their
    layout and usage in a `metadata` response header: the gateway passed only Content-Type and x-request-id on
    (the client could not decode the vectors) and, the body being no JSON with a length, charged nothing.  The
    replica's end-to-end headers reach the client now, not its hop-by-hop ones (nor those its Connection
    names), and the gateway's x-request-id wins."""
    h = gw()
    meta = {"id": "embd-1", "created": 1, "model": "m", "data": [{"index": 0, "embed_dtype": "float32",
            "endianness": "little", "start": 0, "end": 16, "shape": [4]}],
            "usage": {"prompt_tokens": 9, "total_tokens": 9}}
    vectors = bytes(range(16))

    async def embed(request):
        resp = web.StreamResponse(headers={"metadata": json.dumps(meta), "Content-Type": "application/octet-stream",
                                           **HOP_BY_HOP})
        await resp.prepare(request)
        await resp.write(vectors)
        return resp
    engines(h, embed)
    status, headers, data = post(h, json.dumps({"model": "m", "input": "hi", "encoding_format": "bytes"}).encode(),
                                 {"x-request-id": "mine"}, path="/v1/embeddings")
    assert status == 200 and data == vectors and json.loads(headers["metadata"]) == meta
    assert headers["Content-Type"] == "application/octet-stream" and headers["x-request-id"] == "mine"
    lower = {k.lower(): v for k, v in headers.items()}
    assert not {"x-hop", "keep-alive", "proxy-authenticate", "trailer", "upgrade"} & set(lower), headers
    assert lower.get("connection") != HOP_BY_HOP["Connection"] and "uvicorn" not in lower.get("server", "")
    wait_for(lambda: h.gateway.tenants.anonymous.tokens == 9, 10, "the embedding's 9 prompt tokens charged")

    async def whole(request):   # (an answer with a length: read whole, its headers all the same)
        return web.json_response(COMPLETION, headers={"x-engine-note": "kept", **HOP_BY_HOP})
    engines(h, whole)
    status, headers, data = post(h, BODY, {"x-request-id": "mine"})
    lower = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and lower["x-engine-note"] == "kept" and lower["x-request-id"] == "mine"
    assert not {"x-hop", "keep-alive", "proxy-authenticate", "trailer", "upgrade"} & set(lower), headers


def test_a_bytes_only_embedding_is_charged_too_and_gets_no_metadata_header(gw):
    """`encoding_format: "bytes_only"` is vLLM's bytes embeddings without the metadata header, and so without
    any usage: such requests were never charged.  The replica is asked for "bytes" (the same vectors) and its
    metadata header, read for the usage, is taken out of the client's answer."""
    h = gw()
    vectors = bytes(range(16))

    async def embed(request):   # as vLLM answers
        fmt = json.loads(await request.read())["encoding_format"]
        meta = {"id": "embd-1", "data": [{"index": 0, "start": 0, "end": 16, "shape": [4]}],
                "usage": {"prompt_tokens": 5, "total_tokens": 5}}
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           **({"metadata": json.dumps(meta)} if fmt == "bytes" else {})})
        await resp.prepare(request)
        await resp.write(vectors)
        return resp
    e, = engines(h, embed)
    status, headers, data = post(h, json.dumps({"model": "m", "input": "hi", "encoding_format": "bytes_only"})
                                 .encode(), path="/v1/embeddings")
    assert status == 200 and data == vectors and "metadata" not in {k.lower() for k in headers}
    assert json.loads(e["seen"][-1][1])["encoding_format"] == "bytes"
    wait_for(lambda: h.gateway.tenants.anonymous.tokens == 5, 10, "the embedding's 5 prompt tokens charged")


def test_a_refusal_whose_body_never_comes_is_a_gateway_answer_not_a_500(gw):
    """503 headers, then the connection closes before the body: the gateway answers the client itself."""
    h = gw("max_retries: 0")

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 100"
                     b"\r\n\r\n{\"err")
        await writer.drain()
        writer.close()

    server, port = h.call(raw_server(serve))
    try:
        h.set_ready([Replica("job-raw", "m", 0, Endpoint("job-raw", "127.0.0.1", port, "x"))])
        status, headers, data = post(h, BODY)
        assert status == 503 and "error" in json.loads(data)
    finally:
        server.close()


def test_a_replica_that_refuses_the_gateways_secret_is_skipped(gw):
    """A stale endpoint (another job's engine on that port) answers 401 before any work: another replica
    serves the request, and the refusing one counts as failed (enough of them eject it)."""
    h = gw()

    async def stale(request):
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)

    async def good(request):
        await asyncio.sleep(0.3)   # (busy: the balancer sends the others to the stale one)
        return web.json_response(COMPLETION)
    a, b = engines(h, stale, good)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(post(h, BODY))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [s for s, _, _ in got] == [200] * 4 and not any(b"Unauthorized" in d for _, _, d in got)
    assert len(b["seen"]) == 4 and a["seen"]   # (every request the stale one refused went on to the other)
    slot = h.gateway.pools.pools["m"].slots["job-0"]
    assert slot.failures >= 1 or slot.ejected_until > 0


def test_a_body_the_gateway_cannot_read_is_a_400_and_a_gzip_one_reaches_the_replica_plain(gw):
    h = gw()

    async def good(request):
        return web.json_response(COMPLETION)
    e, = engines(h, good)
    status, _, data = post(h, b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"})
    assert status == 400 and json.loads(data)["error"]["code"] == "invalid_body"
    status, _, _ = post(h, gzip.compress(BODY), {"Content-Encoding": "gzip"})
    headers, body = e["seen"][-1]
    assert status == 200 and json.loads(body)["prompt"] == "x"
    assert "content-encoding" not in {k.lower() for k in headers}   # (it was decoded: plain JSON, not labelled gzip)


def test_a_replica_gets_no_hop_by_hop_header_nor_accept_encoding(gw):
    """The list of hop-by-hop headers said `trailers` (the header is Trailer), the headers a client's Connection
    names reached the replica, and so did Accept-Encoding: a replica that compressed its answer would have had
    its bodies read compressed by the gateway (usage, SSE events, a resume), so it is asked for a plain one."""
    h = gw()

    async def good(request):
        return web.json_response(COMPLETION)
    e, = engines(h, good)
    status, _, _ = post(h, BODY, {"Connection": "keep-alive, X-Hop-Note", "X-Hop-Note": "for the gateway",
                                  "Trailer": "x-sum", "TE": "trailers", "Keep-Alive": "timeout=5",
                                  "Accept-Encoding": "gzip, br", "X-Client-Note": "kept"})
    lower = {k.lower(): v for k, v in e["seen"][-1][0].items()}
    assert status == 200 and lower["x-client-note"] == "kept"
    assert not {"x-hop-note", "trailer", "te", "keep-alive", "accept-encoding"} & set(lower), lower


def read_answer(sock) -> tuple[bytes, bytes]:
    """The head and body of the first HTTP answer on a raw socket (a 100 Continue is one)."""
    got = b""
    while True:
        head, sep, body = got.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        if sep and len(body) >= (int(length.group(1)) if length else 0):
            return head, body
        more = sock.recv(65536)
        assert more, got
        got += more


def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(gw):
    """`Expect: 100-continue` was answered 100 whatever the Content-Length: a client declaring 1 GB was told to
    send it, and cut off with a 413 at max_body_bytes.  It gets the 413 at once (no 100, the connection
    closed), and so does one that sends such a body without asking."""
    import socket
    h = gw("max_body_bytes: 4096")
    for expect in ("Expect: 100-continue\r\n", ""):
        with socket.create_connection(("127.0.0.1", h.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n" + expect.encode() + b"\r\n")
            head, body = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower(), (expect, head)
        assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_head_request_is_refused_at_once(gw):
    """A HEAD's answer has a length and no body: proxied, the gateway waited for that body until its timeout."""
    h = gw()

    async def good(request):
        return web.json_response(COMPLETION)
    e, = engines(h, good)
    t0 = time.monotonic()
    status, headers, _ = post(h, b"", path="/v1/chat/completions?model=m", method="HEAD")
    assert status == 405 and "POST" in headers["Allow"] and time.monotonic() - t0 < 5 and e["seen"] == []


def test_a_request_held_for_a_replica_gets_a_503_when_the_gateway_stops(gw):
    """With no READY replica a request is held (here up to 60 s); the gateway stopping ends it with a 503 at
    once, not cut off when the worker is stopped."""
    h = gw("queue_timeout_s: 60")
    h.set_ready([])
    got: list = []
    t = threading.Thread(target=lambda: got.append(post(h, BODY)))
    t.start()
    deadline = time.monotonic() + 10
    while not h.gateway.pools.pools["m"].waiting_since and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()

    async def stop():
        h.gateway.closing()
    h.call(stop())
    t.join(10)
    status, headers, data = got[0]
    err = json.loads(data)["error"]
    assert status == 503 and "shutting down" in err["message"] and err["code"] == "shutting_down"
    assert headers["Retry-After"] == "5"   # (not no_replica's 30: a restarted gateway answers sooner)
    assert time.monotonic() - t0 < 5


def test_a_request_queued_behind_a_full_replica_gets_a_503_when_the_gateway_stops(tmp_path):
    """A request waiting for room on a busy replica (``max_inflight_per_replica``) when the gateway stops: it had
    its connection cut at the end of the grace, with no answer.  It never reached an engine, so it gets the 503
    that says so at once (a retry reaches a gateway that is not stopping); the request in flight finishes."""
    models = MODELS.replace("engine: simulator\n", "engine: simulator\n    max_inflight_per_replica: 1\n")
    h = Harness(tmp_path, models, "shutdown_grace_s: 10\nqueue_timeout_s: 60")
    try:
        async def slow(request):
            await asyncio.sleep(2)
            return web.json_response(COMPLETION)
        engines(h, slow)
        got: dict = {}

        def client(name):
            got[name] = (*post(h, BODY), time.monotonic())
        first = threading.Thread(target=client, args=("first",))
        first.start()
        wait_for(lambda: h.gateway.pools.inflight_by_job(), 10, "the first request on the replica")
        queued = threading.Thread(target=client, args=("queued",))
        queued.start()
        wait_for(lambda: h.gateway.pools.pools["m"].waiting_since, 10, "the second request queued")

        async def stop():
            h.gateway.closing()
        h.call(stop())
        for t in (first, queued):
            t.join(15)
        status, headers, data, at = got["queued"]
        assert status == 503 and json.loads(data)["error"]["code"] == "shutting_down" and headers["Retry-After"] == "5"
        assert got["first"][0] == 200 and at < got["first"][3]   # (answered before the request in flight ended)
    finally:
        h.close()


def test_a_reload_changes_the_retry_budget(gw):
    h = gw()
    h.reload(h.text.replace("gateway:\n", "gateway:\n  retry_budget_ratio: 0.5\n"))

    async def apply():
        h.gateway.set_config(h.cfg)
        return h.gateway.budget.ratio
    assert h.call(apply()) == 0.5


def test_a_client_that_stops_reading_a_stream_lets_its_replica_go(gw, caplog):
    """A client keeps its connection but reads nothing more (it broke out of a stream without closing it): once
    its socket is full, it gets stream_idle_timeout_s, then its connection closes, the replica's slot is free
    and the engine's generation ends (before, both were held for ever).  It is counted (499) and logged as a
    request, and it is no error of the gateway's (aiohttp logged "Error handling request" with a traceback)."""
    import socket
    caplog.set_level(logging.INFO)
    h = gw("stream_idle_timeout_s: 1")
    ended = threading.Event()

    async def flood(request):   # an endless stream of large events
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b'data: {"choices":[{"index":0,"text":"' + b"x" * 65536 + b'"}]}\n\n'
        try:
            while True:
                await resp.write(event)
        except ConnectionError:   # the gateway let it go: this fake engine ends quietly (raised, aiohttp.server
            return resp           # logs it, under the name the gateway's own errors would have)
        finally:
            ended.set()
    engines(h, flood)
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 100000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", h.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        assert ended.wait(30), "the engine's stream never ended"
        deadline = time.monotonic() + 10
        while h.gateway.pools.inflight_by_job() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.gateway.pools.inflight_by_job() == {}
        wait_for(lambda: h.metric("slurmfleet_requests_total", code="499") == 1, 10, "the 499 counted")
        logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "slurmfleet.access"]
        assert [r["status"] for r in logged] == [499]
        assert not [r for r in caplog.records if r.name == "aiohttp.server"], caplog.text   # (another test's loop,
        # collected meanwhile in this process, may log its own asyncio errors: not this request's)
    finally:
        s.close()


@pytest.mark.parametrize("on", [True, False])
def test_the_access_log_names_the_client_and_its_key_and_can_be_turned_off(gw, caplog, on):
    """One JSON line per request, with no client address or key name (a junk client's 401s could not be told
    from a tenant's) and no setting: its volume at thousands of requests a second was the daemon log's."""
    caplog.set_level(logging.INFO)
    h = gw("api_keys: [{name: alice, key: sk-alice}]\n" + ("" if on else "access_log: false\n"))

    async def answer(request):
        return web.json_response(COMPLETION)
    engines(h, answer)
    assert post(h, BODY, {"Authorization": "Bearer sk-alice"})[0] == 200
    assert post(h, BODY, {"Authorization": "Bearer sk-nobody"})[0] == 401
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "slurmfleet.access"]
    if not on:
        assert logged == [] and h.metric("slurmfleet_requests_total") == 2
        return
    assert [(r["status"], r["key"], r["model"], r["client"]) for r in logged] == [
        (200, "alice", "m", "127.0.0.1"), (401, None, None, "127.0.0.1")], logged


def test_behind_a_trusted_proxy_the_access_log_names_the_client_it_forwards(gw, caplog):
    """gateway.trusted_proxies: a request from a trusted proxy is from the rightmost X-Forwarded-For address that
    is not a trusted proxy's; without the setting the header names nothing (any client can send it)."""
    caplog.set_level(logging.INFO)
    h = gw('trusted_proxies: ["127.0.0.0/8", 10.0.0.0/8]\n')

    async def answer(request):
        return web.json_response(COMPLETION)
    engines(h, answer)
    xff = {"X-Forwarded-For": "198.51.100.1, 203.0.113.9:4711, 10.1.2.3"}
    assert post(h, BODY, xff)[0] == 200
    assert post(h, BODY)[0] == 200   # (no header: the proxy's own address)
    h.reload(h.text.replace('  trusted_proxies: ["127.0.0.0/8", 10.0.0.0/8]\n', ""))
    assert post(h, BODY, xff)[0] == 200
    logged = [json.loads(r.getMessage())["client"] for r in caplog.records if r.name == "slurmfleet.access"]
    assert logged == ["203.0.113.9", "127.0.0.1", "127.0.0.1"]


def test_a_large_whole_answer_to_a_client_that_stops_reading_it_is_let_go(gw):
    """A whole answer (20 MB of embeddings) to a client that reads nothing: aiohttp wrote it without a timeout,
    and the connection held the whole body for ever (one per such client).  Now it is written as a stream is:
    after stream_idle_timeout_s without progress the connection closes.  It is written after the handler returned,
    as a whole answer always was: the replica's slot is free at once (not held while the client reads).  A client
    that reads gets it whole, with its length."""
    import socket
    h = gw("stream_idle_timeout_s: 1")
    big = json.dumps({"object": "list", "data": [{"embedding": [0.123456] * 2_000_000}], "model": "m",
                      "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
    engines(h, lambda request: asyncio.sleep(0, web.Response(body=big, content_type="application/json")))
    body = json.dumps({"model": "m", "input": "x"}).encode()
    status, headers, data = post(h, body, path="/v1/embeddings")
    assert status == 200 and data == big and int(headers["Content-Length"]) == len(big) and headers["x-request-id"]
    s = socket.create_connection(("127.0.0.1", h.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        wait_for(lambda: h.metric("slurmfleet_requests_total", code="200") == 2, 30, "the second answer begun")
        assert h.gateway.pools.inflight_by_job() == {}   # (the answer whole at the gateway: the replica is free)
        wait_for(lambda: not h.runner.server.connections, 30, "the reader-less client let go")
    finally:
        s.close()


def test_a_replica_that_times_out_after_its_headers_is_a_504_and_a_whole_answer_is_not_tried_again(gw):
    """Headers, then nothing: a timeout, answered as one (504 upstream_timeout), not as a replica that failed
    (502).  An answer not streamed whose body does not come in ``request_timeout_s`` spent the request's whole
    time: not sent to another replica for as long again (as one whose headers never came)."""
    h = gw("request_timeout_s: 1\nmax_retries: 1")

    async def stall(request):
        stream = json.loads(await request.read()).get("stream")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        if not stream:
            resp.content_length = 100   # (a whole answer: its length, then not its body)
        await resp.prepare(request)
        await asyncio.sleep(3)
        return resp
    a, b = engines(h, stall, stall)
    for stream in (True, False):
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "stream": stream}).encode())
        err = json.loads(data)["error"]
        assert status == 504 and err["code"] == "upstream_timeout", (stream, data)
    assert a["paths"].count("/v1/completions") + b["paths"].count("/v1/completions") == 3   # the stream tried
    # twice (nothing had begun), the whole once


def test_a_json_body_goes_to_its_replica_as_application_json(gw):
    """The gateway reads a body with no Content-Type, or an application/*+json one, as JSON (as FastAPI does);
    vLLM's generation routes take application/json alone and answered those a 400.  A body read as JSON goes as
    application/json; a form keeps its own type (the audio test above)."""
    h = gw()

    async def ok(request):
        return web.json_response(COMPLETION)
    e, = engines(h, ok)
    for ctype in (None, "application/vnd.api+json", "application/json; charset=utf-8"):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=60)
        c.request("POST", "/v1/completions", BODY, {"Content-Type": ctype} if ctype else {})
        r = c.getresponse()
        assert r.status == 200, (ctype, r.read())
        c.close()
        headers, body = e["seen"][-1]
        assert headers["Content-Type"] == "application/json" and json.loads(body)["prompt"] == "x", (ctype, headers)
        assert [k for k in headers if k.lower() == "content-type"] == ["Content-Type"]
    # a body after a UTF-8 byte order mark (PowerShell's utf8 files), which vLLM reads: a 400 invalid_json was it
    assert post(h, b"\xef\xbb\xbf" + BODY)[0] == 200 and json.loads(e["seen"][-1][1].decode("utf-8-sig"))["prompt"] == "x"


def test_a_request_that_two_replicas_drop_mid_work_is_not_sent_to_a_third(gw):
    """A replica that dies takes every request it held, and those are tried again elsewhere whatever the retry
    budget; a request whose second replica dies under it too may be what kills them (a query of death): it was
    sent to ``max_retries`` + 1 replicas, each dropped in turn.  It now gets a 502 that says why after two, with
    ``x-should-retry: false``: the openai SDK, which sends a 5xx again twice by default, took four more down."""
    import openai
    h = gw("max_retries: 3")
    drops = {"left": 4}

    async def dies(request):
        await request.read()
        await asyncio.sleep(1.1)   # work (past the reused-connection race the upstream client resends at once)
        if drops["left"] > 0:
            drops["left"] -= 1
            request.transport.close()
            return web.Response()
        return web.json_response(COMPLETION)
    fleet = engines(h, dies, dies, dies, dies)
    status, headers, data = post(h, BODY)
    err = json.loads(data)["error"]
    assert status == 502 and "Two replicas failed" in err["message"], data
    assert headers.get("x-should-retry") == "false", headers
    assert sum(len(e["seen"]) for e in fleet) == 2 and drops["left"] == 2
    with pytest.raises(openai.InternalServerError):   # (its default retries: 2)
        openai.OpenAI(base_url=h.base + "/v1", api_key="k").completions.create(model="m", prompt="x", max_tokens=1)
    assert sum(len(e["seen"]) for e in fleet) == 4 and drops["left"] == 0
    drops["left"] = 1   # one replica's death alone: the request goes on elsewhere and is answered
    status, _, data = post(h, BODY)
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "hi", data
    assert sum(len(e["seen"]) for e in fleet) == 6


def test_a_replica_that_does_not_answer_in_time_is_a_504(gw):
    h = gw("first_byte_timeout_s: 0.5\nmax_retries: 0")

    async def stuck(request):
        await asyncio.sleep(5)
        return web.json_response(COMPLETION)
    engines(h, stuck)
    status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 1, "stream": True}).encode())
    assert status == 504 and json.loads(data)["error"]["code"] == "upstream_timeout"


def test_a_large_answer_not_streamed_leaves_its_replica_connection_usable(gw):
    """An answer over the upstream client's high water mark (256 KiB: embeddings of a batch, logprobs) left its
    keep-alive connection idle with reading paused: the next request on it got the engine's work done and its
    answer never read, a 504 after request_timeout_s (every other request to the replica)."""
    h = gw("request_timeout_s: 3")

    async def big(request):
        return web.json_response({"object": "list", "data": [{"embedding": [0.1] * 100_000}]})
    e, = engines(h, big)
    body = json.dumps({"model": "m", "input": "x"}).encode()
    got = [post(h, body, path="/v1/embeddings") for _ in range(3)]
    assert [s for s, _, _ in got] == [200] * 3 and all(len(d) > 256 * 1024 for _, _, d in got)
    assert len(e["seen"]) == 3


def test_engine_only_paths_are_not_reached_however_spelled_and_control_characters_are_refused(gw):
    """vLLM's runtime LoRA routes change a replica for everyone: '/v1/load_lora_adapter%0A' passed the gateway
    as another path and matched the engine's route (Python's `$` matches before a trailing newline), with the
    job's secret.  A path with a control character is a 400; the engine-only paths however spelled a 404."""
    h = gw()
    heads: list[bytes] = []

    async def serve(reader, writer):   # a raw engine: it sees every request line, whatever its router would match
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head.split(b"\r\n")[0])
                await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server, port = h.call(raw_server(serve))
    try:
        h.set_ready([Replica("job-raw", "m", 0, Endpoint("job-raw", "127.0.0.1", port, "x"))])
        body = json.dumps({"model": "m", "lora_name": "x", "lora_path": "/x"}).encode()
        for path in ("/v1/load_lora_adapter%0A", "/v1/unload_lora_adapter%0a", "/v1/load_lora_adapter%0A?x=1",
                     "/v1/completions%00", "/v1/load_lora_adapter%7F", "/v1/models%0A"):
            status, _, data = post(h, body, path=path)
            assert status == 400 and json.loads(data)["error"]["code"] == "invalid_path", path
        for path in ("/v1/load_lora_adapter/", "/v1//load_lora_adapter", "/v1/./unload_lora_adapter",
                     "/v1/x/../load_lora_adapter", "/v1/%2E/load_lora_adapter", "/v1/load_lora_adapter%2F"):
            status, _, data = post(h, body, path=path)
            assert status == 404 and json.loads(data)["error"]["code"] == "unknown_url", path
        assert heads == []
        assert post(h, BODY)[0] == 200 and heads == [b"POST /v1/completions HTTP/1.1"]
        # a path the gateway allows however spelled reaches the engine as it was checked: vLLM answered a trailing
        # slash with a redirect to its own host and port (a replica's address, told to the client)
        for path in ("/v1/completions/", "/v1//completions", "/v1/x/../completions?a=1&api_key=k"):
            assert post(h, BODY, path=path)[0] == 200, path
        assert heads[1:] == [b"POST /v1/completions HTTP/1.1"] * 2 + [b"POST /v1/completions?a=1 HTTP/1.1"]
    finally:
        server.close()



async def raw_server(serve):
    """A raw TCP replica on a free port: (server, port)."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _send_slowly(h: Harness, head: bytes, pieces: list[tuple[float, bytes]], wait_s: float = 8.0) -> bytes:
    """A raw client: ``head``, then each piece after its pause; what the gateway answered before it closed
    (or within ``wait_s`` of the last piece)."""
    import socket
    s = socket.create_connection(("127.0.0.1", h.port))
    try:
        s.sendall(head)
        try:
            for pause, data in pieces:
                time.sleep(pause)
                s.sendall(data)
        except OSError:   # the gateway closed the connection: its answer may be in
            pass
        s.settimeout(wait_s)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionError):
            pass
        return got
    finally:
        s.close()


def test_a_request_body_that_trickles_or_stops_is_a_408(gw):
    """A whole head, then a body that stops (one byte of 1,000) or trickles (a byte every half second) held its
    connection and handler for ever (header_timeout_s covers heads only): such connections filled
    max_connections, unseen by any count.  After header_timeout_s of grace a body must keep 1 KiB/s on average."""
    h = gw("header_timeout_s: 1\nkeepalive_timeout_s: 2")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    got: list = []
    clients = [threading.Thread(target=lambda p=p: got.append(_send_slowly(h, head, p))) for p in (
        [(0, b"{")], [(0.5, b" ")] * 6)]
    t0 = time.monotonic()
    for c in clients:
        c.start()
    for c in clients:
        c.join(20)
    assert len(got) == 2 and time.monotonic() - t0 < 8
    for out in got:
        status, _, body = out.partition(b"\r\n")[0], 0, out.partition(b"\r\n\r\n")[2]
        assert status == b"HTTP/1.1 408 Request Timeout", out
        assert json.loads(body)["error"]["code"] == "request_timeout"
    assert not h.runner.server._connections
    # counted as what the clients got (they were counted as clients that left, 499)
    assert h.metric("slurmfleet_requests_total", code="408") == 2 and h.metric("slurmfleet_requests_total") == 2


def test_a_slow_but_steady_body_and_upload_are_served(gw):
    """The rule is a rate, not a short total: a request body at 4 KiB/s past the grace, and a Files API upload
    that stalls twice as long as the grace once it has sent some (its credit: a second per KiB), get through."""
    h = gw("header_timeout_s: 1")

    async def ok(request):
        return web.json_response(COMPLETION)
    e, = engines(h, ok)
    body = json.dumps({"model": "m", "prompt": "x" * 6000, "max_tokens": 1}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    out = _send_slowly(h, head + b"Content-Length: %d\r\n\r\n" % len(body),
                       [(0.5, body[i:i + 2048]) for i in range(0, len(body), 2048)])
    assert out.startswith(b"HTTP/1.1 200") and len(e["seen"]) == 1
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 900}]}})
    data = "".join(line.replace('"c"', f'"c{i}"') + "\n" for i in range(8)).encode()
    form = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XX\r\nContent-Disposition: '
            b'form-data; name="file"; filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n' + data
            + b"\r\n--XX--\r\n")
    head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: multipart/form-data; "
            b"boundary=XX\r\nContent-Length: %d\r\n\r\n" % len(form))
    pieces = [(0.3, form[i:i + 1024]) for i in range(0, len(form), 1024)]
    pieces[3] = (2.0, pieces[3][1])   # a stall, twice the grace, after 3 KiB
    out = _send_slowly(h, head, pieces)
    assert out.startswith(b"HTTP/1.1 200"), out
    assert json.loads(out.partition(b"\r\n\r\n")[2])["bytes"] == len(data)


def test_an_upload_that_stops_is_a_408_and_stores_nothing(gw):
    h = gw("header_timeout_s: 1")
    head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=XX\r\n"
            b"Content-Length: 100000\r\n\r\n")
    t0 = time.monotonic()
    out = _send_slowly(h, head, [(0, b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n')])
    assert out.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 6
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    status, _, data = post(h, b"", path="/v1/files", method="GET")
    assert status == 200 and json.loads(data)["data"] == []


def test_the_retry_budget_pays_only_for_retries_made(gw):
    """A token was taken before the check that another replica is left: a model with one overloaded replica
    spent one per request without a retry (the process's budget, shared by every model, stayed near 0), and
    503s from both of two replicas spent two for one retry."""
    h = gw()

    async def busy(request):
        return web.json_response({"error": {"message": "busy", "type": "x", "code": 503}}, status=503)
    engines(h, busy)
    for _ in range(8):
        assert post(h, BODY)[0] == 503
    assert h.gateway.budget.tokens == 5.0 and h.metric("slurmfleet_request_retries_total") == 0
    a, b = engines(h, busy, busy)
    assert post(h, BODY)[0] == 503 and len(a["seen"]) + len(b["seen"]) == 2
    assert h.gateway.budget.tokens == 4.0 and h.metric("slurmfleet_request_retries_total") == 1


def leave(h: Harness, body: bytes, until) -> None:
    """A client that sends ``body`` (not streamed) and closes its connection once ``until()`` holds."""
    import socket
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_for(until, 10, "the request to reach its wait")
    s.close()


def test_every_request_counts_once_with_its_final_status(gw):
    """requests_total counts each client request once, with the status it got: a model whose every replica
    refuses connections showed 0 requests (the error-rate alert stayed silent in a total outage), a 503 retried
    and then served counted twice (503 and 200), and a client that left before its answer's headers, not at all."""
    h = gw("queue_timeout_s: 60")
    h.set_ready([Replica(f"job-{i}", "m", i, Endpoint(f"job-{i}", "127.0.0.1", free_port(), "x")) for i in range(2)])
    assert [post(h, BODY)[0] for _ in range(4)] == [502] * 4
    assert h.metric("slurmfleet_requests_total", model="m", code="502") == 4
    assert h.metric("slurmfleet_requests_total") == 4 and h.metric("slurmfleet_request_retries_total") >= 1
    served = []

    async def once_busy(request):
        served.append(1)
        if len(served) == 1:
            return web.json_response({"error": {"message": "busy", "type": "x", "code": 503}}, status=503)
        return web.json_response(COMPLETION)
    engines(h, once_busy, once_busy)
    assert post(h, BODY)[0] == 200 and len(served) == 2
    assert h.metric("slurmfleet_requests_total", model="m", code="200") == 1
    assert h.metric("slurmfleet_requests_total") == 5
    assert h.metric("slurmfleet_request_retries_total", reason="status_503") == 1

    async def slow(request):
        await asyncio.sleep(2)
        e["done"] = True
        return web.json_response(COMPLETION)
    e, = engines(h, slow)
    leave(h, BODY, lambda: e["seen"])   # while its replica works on a whole answer
    wait_for(lambda: h.metric("slurmfleet_requests_total", code="499") == 1, 10, "the 499")
    h.set_ready([])
    leave(h, BODY, lambda: h.gateway.pools.pools["m"].waiting_since)   # while queued
    wait_for(lambda: h.metric("slurmfleet_requests_total", code="499") == 2, 10, "the second 499")
    wait_for(lambda: h.gateway.pools.pools["m"].waiting_since == [], 10, "the queue to empty")
    assert h.metric("slurmfleet_requests_total", code="499", slot="none") == 1
    assert h.metric("slurmfleet_requests_total") == 7
    wait_for(lambda: e.get("done"), 10, "the engine's answer")   # (its handler ends before the test)
    # refused before a model is known (the model a reload removed, no model, a bad body): counted, under one
    # label value, never the client's string (they were not counted: a removed model's 404s showed no traffic)
    assert [post(h, b)[0] for b in (BODY.replace(b'"m"', b'"gone"'), b'{"prompt": "x"}', b"{")] == [404, 400, 400]
    assert h.metric("slurmfleet_requests_total", model="(none)", code="404", slot="none") == 1
    assert h.metric("slurmfleet_requests_total", model="(none)", code="400") == 2
    assert h.metric("slurmfleet_requests_total") == 10 and h.metric("slurmfleet_requests_total", model="gone") == 0


def test_a_multipart_body_reaches_the_replica_byte_for_byte_and_other_types_are_refused(tmp_path):
    """vLLM's audio endpoints take multipart/form-data (``model`` a form field): every body was parsed as JSON,
    so a transcription got "Malformed JSON body". The gateway reads the form's model field alone and forwards
    the body as it came, with its Content-Type (an alias's model field renamed to the served name); a body of
    another type on a JSON endpoint is a 415 that names it, not a request the engine refuses after it was metered."""
    import openai
    h = Harness(tmp_path, MODELS + "    aliases: [whisper]\n", "shutdown_grace_s: 1")
    try:
        async def transcribe(request):
            return web.json_response({"text": "hello"})
        e, = engines(h, transcribe)
        audio = bytes(range(256)) * 8 + b"\r\n--notit\r\n"
        boundary = "b0undary"
        body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                b"Content-Type: audio/wav\r\n\r\n" + audio + b"\r\n--b0undary\r\n"
                b"Content-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--b0undary--\r\n")
        ctype = f"multipart/form-data; boundary={boundary}"
        status, _, data = post(h, body, {"Content-Type": ctype}, path="/v1/audio/transcriptions")
        assert status == 200 and json.loads(data) == {"text": "hello"}
        headers, got = e["seen"][-1]
        assert got == body and headers["Content-Type"] == ctype
        status, _, _ = post(h, body.replace(b"\r\n\r\nm\r\n", b"\r\n\r\nwhisper\r\n"), {"Content-Type": ctype},
                            path="/v1/audio/translations")
        assert status == 200 and e["seen"][-1][1] == body   # (the alias renamed, nothing else changed)

        c = openai.OpenAI(base_url=h.base + "/v1", api_key="none", max_retries=0)
        out = c.audio.transcriptions.create(model="m", file=("a.wav", audio, "audio/wav"), language="en")
        headers, got = e["seen"][-1]
        assert out.text == "hello" and headers["Content-Type"].startswith("multipart/form-data; boundary=")
        assert audio in got and b'name="language"\r\n\r\nen\r\n' in got
        assert h.metric("slurmfleet_requests_total", model="m", code="200") == 3

        n = len(e["seen"])
        for ct in ("text/plain", "application/x-www-form-urlencoded"):
            status, _, data = post(h, BODY, {"Content-Type": ct})
            err = json.loads(data)["error"]
            assert status == 415 and ct in err["message"] and err["code"] == "unsupported_media_type"
        status, _, data = post(h, body, {"Content-Type": "multipart/form-data"}, path="/v1/audio/transcriptions")
        assert status == 400 and "boundary" in json.loads(data)["error"]["message"]
        status, _, data = post(h, body.replace(b'name="model"', b'name="modelx"'), {"Content-Type": ctype},
                               path="/v1/audio/transcriptions")
        assert status == 400 and json.loads(data)["error"]["code"] == "missing_model"
        twice = body.replace(b"--b0undary--", b'--b0undary\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                             b"other\r\n--b0undary--")   # (routed by the first, vLLM's form keeps the last)
        status, _, data = post(h, twice, {"Content-Type": ctype}, path="/v1/audio/transcriptions")
        assert status == 400 and "two model fields" in json.loads(data)["error"]["message"], data
        assert len(e["seen"]) == n
        assert post(h, BODY, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    finally:
        h.close()


KEEP_ALIVE = b": keep-alive\n\n"   # vLLM's comment event (--sse-keep-alive-interval)


def completion_chunk(text: str, ids: list[int], finish: str | None = None, prompt: list[int] | None = None) -> bytes:
    """An event of vLLM's /v1/completions stream, with return_token_ids."""
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if prompt is not None:
        ch["prompt_token_ids"] = prompt
    return b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [ch]}).encode() + b"\n\n"


async def keep_alive_stream(request, before_s: float = 0.8, dies: bool = False):
    """A stream that is queued (keep-alives) for ``before_s``, then two tokens with a keep-alive between them;
    with ``dies``, its connection closes after the keep-alives, before any token."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(2):
        await resp.write(KEEP_ALIVE)
        await asyncio.sleep(before_s / 2)
    if dies:
        request.transport.close()
        return resp
    await resp.write(completion_chunk("a", [5], prompt=[1, 2]))
    await resp.write(KEEP_ALIVE)
    await resp.write(completion_chunk("b", [6], "length"))
    await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
                     b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}\n\ndata: [DONE]\n\n')
    return resp


def first_bytes(monkeypatch) -> list[float]:
    """When each request's replica gave its first byte, as kv_aware reads it (every lease charged a prefill)."""
    from orchestrator.gateway import pool
    seen: list[float] = []
    init, first = pool.Lease.__init__, pool.Lease.first_byte

    def charged(self, slot, owner, prefill=0):
        init(self, slot, owner, prefill or 1)

    def first_byte(self):
        if self.prefill:
            seen.append(time.monotonic())
        first(self)
    monkeypatch.setattr(pool.Lease, "__init__", charged)
    monkeypatch.setattr(pool.Lease, "first_byte", first_byte)
    return seen


def stream(h: Harness) -> tuple[float, bytes]:
    t0 = time.monotonic()
    status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}).encode())
    assert status == 200
    return t0, data


MODELS_RESUMED = MODELS.replace("resume: {enabled: false}", "resume: {max_migrations: 2}")


@pytest.mark.parametrize("resumed", [False, True])
def test_keep_alive_comments_are_no_first_byte_and_reach_the_client(tmp_path, monkeypatch, resumed):
    """vLLM's --sse-keep-alive-interval sends `: keep-alive` while a stream is queued, prefilling or between
    tokens: it was taken for the first byte (TTFT and cold-start histograms measured it, kv_aware released the
    request's prefill charge at once), and a resumable stream dropped them (the client's proxies never saw the
    keep-alives the operator turned them on for)."""
    seen = first_bytes(monkeypatch)
    h = Harness(tmp_path, MODELS_RESUMED if resumed else MODELS, "shutdown_grace_s: 1")
    try:
        engines(h, keep_alive_stream)
        t0, data = stream(h)
        assert data.count(KEEP_ALIVE) == 3 and data.index(KEEP_ALIVE) < data.index(b"data:")
        assert data.count(b'"text"') == 2 and data.endswith(b"data: [DONE]\n\n")
        assert len(seen) == 1 and seen[0] - t0 >= 0.7
        assert h.metric("slurmfleet_time_to_first_token_seconds_sum") >= 0.7
    finally:
        h.close()


def test_a_resumable_stream_that_only_got_keep_alives_starts_again_elsewhere(tmp_path):
    """Its replica dies after keep-alives (forwarded: the client's answer has begun), before any token: the
    request as first sent goes to another replica, into the same stream (it was retried from scratch while the
    keep-alives were dropped; forwarded, it must not end in an error for want of a retry)."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def flaky(request):
            calls.append(1)
            return await keep_alive_stream(request, 0.2, dies=len(calls) == 1)
        a, b = engines(h, flaky, flaky)
        _, data = stream(h)
        assert data.count(b'"text"') == 2 and b"error" not in data and data.endswith(b"data: [DONE]\n\n")
        sent = [body for _, body in a["seen"] + b["seen"]]
        assert len(sent) == 2 and sent[0] == sent[1]
        assert h.metric("slurmfleet_stream_migrations_total", outcome="ok") == 1
        wait_for(lambda: h.metric("slurmfleet_requests_total", code="200") == 1, 5, "the request counted")
        assert h.metric("slurmfleet_requests_total") == 1
    finally:
        h.close()


def test_a_whole_answer_whose_replica_died_after_a_token_without_ids_starts_again_elsewhere(tmp_path):
    """Not streamed, nothing has reached the client: a replica that dies after a token, its prompt's ids
    unknown (no continuation possible), leaves the request to start again on another, as first sent."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def dies_once(request):
            resp = await event_stream(request, calls)
            if len(calls) == 1:
                await resp.write(completion_chunk(" a", []))   # (an engine that sends no token ids)
                await asyncio.sleep(0.1)
                request.transport.close()
                return resp
            for chunk in (completion_chunk(" a", []), completion_chunk(" b", [], "length")):
                await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, dies_once, dies_once)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode())
        assert status == 200 and json.loads(data)["choices"][0]["text"] == " a b" and len(calls) == 2, data
        assert calls[0] == calls[1]
    finally:
        h.close()


async def event_stream(request, calls: list) -> web.StreamResponse:
    """A fake engine's streamed answer begun: the request's body noted in ``calls``, the headers sent."""
    calls.append(json.loads(await request.read()))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def test_a_stream_cut_in_the_middle_of_a_character_continues_before_it(tmp_path):
    """vLLM sends a character split over byte tokens (an emoji) as chunks with token ids and no text until it is
    whole.  A replica that died there was continued from a prompt ending in half a character, and vLLM's
    detokenizer then answers with the whole prompt's text: the client got its prompt in its answer.  Now the
    continuation starts before the character, and the client gets its ids once, with its text."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def split(request):
            resp = await event_stream(request, calls)
            if len(calls) == 1:   # " a", then two of the emoji's three byte tokens, and the replica dies
                for chunk in (completion_chunk(" a", [11], prompt=[1, 2]), completion_chunk("", [224]),
                              completion_chunk("", [176])):
                    await resp.write(chunk)
                await asyncio.sleep(0.2)
                request.transport.close()
                return resp
            for chunk in (completion_chunk("", [224], prompt=[1, 2, 11]), completion_chunk("", [176]),
                          completion_chunk(" \U0001f999", [257]), completion_chunk(" done", [251], "stop")):
                await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, split, split)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 9, "stream": True,
                                              "return_token_ids": True}).encode())
        assert status == 200 and len(calls) == 2 and calls[1]["prompt"] == [1, 2, 11], calls
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(c["text"] for c in choices) == " a \U0001f999 done"
        assert [i for c in choices for i in c["token_ids"]] == [11, 224, 176, 257, 251]
    finally:
        h.close()


BYTES = {1: b"x", 2: b"y", 11: b" a", 12: b" b", 224: b"\xf0\x9f", 176: b"\xa6", 257: b"\x99", 251: b" done"}


@pytest.mark.parametrize("decodes", [True, False])
def test_a_cut_after_a_merged_event_ending_in_half_a_character_continues_before_it(tmp_path, decodes):
    """Under load vLLM merges a request's outputs into one event: several ids, with the text of those that ended
    whole.  A replica that died right after such an event whose last ids are half a character was continued from a
    prompt ending mid-character.  Now the replica that takes the rest decodes the event's ids (/detokenize): they
    end in U+FFFD, so the continuation starts before the half character and the client gets it whole, its ids
    once.  An engine without /detokenize leaves the cut where it was."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    decoded: list = []
    try:
        async def merged(request):
            if request.path == "/detokenize":
                ids = json.loads(await request.read())["tokens"]
                decoded.append(ids)
                if not decodes:
                    return web.json_response({"detail": "Not Found"}, status=404)
                return web.json_response({"prompt": b"".join(BYTES[i] for i in ids).decode(errors="replace")})
            resp = await event_stream(request, calls)
            if len(calls) == 1:   # " a", then " b" merged with two of the emoji's three bytes, and the replica dies
                for chunk in (completion_chunk(" a", [11], prompt=[1, 2]), completion_chunk(" b", [12, 224, 176])):
                    await resp.write(chunk)
                await asyncio.sleep(0.2)
                request.transport.close()
                return resp
            made = [224, 176][len(calls[-1]["prompt"]) - 4:]   # (made again: none when the cut stayed)
            for chunk in (*(completion_chunk("", [i], prompt=calls[-1]["prompt"] if not n else None)
                            for n, i in enumerate(made)),
                          completion_chunk("\U0001f999" if decodes else "", [257], prompt=None if made else
                                           calls[-1]["prompt"]),
                          completion_chunk(" done", [251], "stop")):
                await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, merged, merged)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 9, "stream": True,
                                              "return_token_ids": True, "temperature": 0}).encode())
        assert status == 200 and len(calls) == 2, (calls, data)
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
        choices = [e["choices"][0] for e in events if e["choices"]]
        ids = [i for c in choices for i in c["token_ids"]]
        assert decoded and decoded[0] == [11, 12, 224, 176], decoded
        if decodes:   # [11, 12, 224, 176] ends in U+FFFD, [11, 12, 224] too, [11, 12] not: two ids back
            assert decoded == [[11, 12, 224, 176], [11, 12, 224], [11, 12]]
            assert calls[1]["prompt"] == [1, 2, 11, 12] and calls[1]["max_tokens"] == 7
            assert "".join(c["text"] for c in choices) == " a b\U0001f999 done"
            assert ids == [11, 12, 224, 176, 257, 251]
        else:   # as before: the continuation's prompt ends in half a character
            assert calls[1]["prompt"] == [1, 2, 11, 12, 224, 176] and calls[1]["max_tokens"] == 5
            assert ids == [11, 12, 224, 176, 257, 251]
    finally:
        h.close()


@pytest.mark.parametrize("how", ["retried", "garbage"])
def test_a_replica_that_cannot_decode_the_cut_gets_the_whole_prompt(tmp_path, how):
    """The cut found by one replica's /detokenize was kept in the body sent to the next when the first failed at
    once (a 503) and the next could not decode: its prompt went back two ids that nothing would show again (the
    client got them twice, and two tokens more than it asked for).  And an answer of /detokenize that is not a JSON
    object broke the stream.  Now each replica's body is made from its own answer; one it cannot give leaves the
    cut where it was."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def engine(request):
            if request.path == "/detokenize":
                ids = json.loads(await request.read())["tokens"]
                if how == "garbage":
                    return web.json_response([1, 2])
                if len(calls) > 1:   # (the one that took the rest first decoded, then failed)
                    return web.json_response({"detail": "busy"}, status=500)
                return web.json_response({"prompt": b"".join(BYTES[i] for i in ids).decode(errors="replace")})
            if how == "retried" and len(calls) == 1:   # the one that took the rest: a 503 at once
                calls.append(json.loads(await request.read()))
                return web.json_response({"detail": "busy"}, status=503)
            resp = await event_stream(request, calls)
            if len(calls) == 1:
                await resp.write(completion_chunk(" a", [11], prompt=[1, 2]) + completion_chunk(" b", [12, 224, 176]))
                await asyncio.sleep(0.2)
                request.transport.close()
                return resp
            await resp.write(completion_chunk("\U0001f999", [257], prompt=calls[-1]["prompt"]) +
                             completion_chunk(" done", [251], "stop") + b"data: [DONE]\n\n")
            return resp
        engines(h, engine, engine, engine)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 9, "stream": True,
                                              "return_token_ids": True}).encode())
        assert status == 200 and len(calls) == (3 if how == "retried" else 2), (calls, data)
        if how == "retried":
            assert calls[1]["prompt"] == [1, 2, 11, 12] and calls[1]["max_tokens"] == 7   # (decoded: two back)
        assert calls[-1]["prompt"] == [1, 2, 11, 12, 224, 176] and calls[-1]["max_tokens"] == 5
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
        assert [i for e in events if e["choices"] for i in e["choices"][0]["token_ids"]] == [11, 12, 224, 176, 257, 251]
        assert events[-1]["choices"][0]["finish_reason"] == "stop" and b"error" not in data
    finally:
        h.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_generation_aborted_on_its_last_token_ends_with_length_on_the_same_replica(tmp_path, stream):
    """vLLM aborting a request (its shutdown) on the request's last token left nothing to continue, and the client
    got the error of a generation that could not go on: it is complete, and ends with ``length``."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def last(request):
            resp = await event_stream(request, calls)
            await resp.write(completion_chunk(" a", [11], prompt=[1, 2]) + completion_chunk(" b", [12], "abort"))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, last, last)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2,
                                              "stream": stream}).encode())
        assert status == 200 and len(calls) == 1 and b"error" not in data, data
        if stream:
            events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
            assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
            assert "".join(e["choices"][0]["text"] for e in events) == " a b" and data.endswith(b"data: [DONE]\n\n")
        else:
            choice = json.loads(data)["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"] == " a b"
    finally:
        h.close()


ENGINE_DEAD = (b'data: {"error": {"object": "error", "message": "EngineCore encountered an issue.", '
               b'"type": "InternalServerError", "param": null, "code": 500}}\n\n')


@pytest.mark.parametrize("first_token", [True, False, "second"])
def test_a_request_that_two_engines_died_on_is_not_sent_to_a_third(tmp_path, first_token):
    """A prompt that kills vLLM's engine (it sends its EngineDeadError event) moved on to the next replica as long
    as migrations (3) or retries were left: one request could take four replicas down.  As after two replicas that
    dropped its connection, two engines that died on it are the end (a migration or a plain retry)."""
    h = Harness(tmp_path, MODELS.replace("resume: {enabled: false}", "resume: {max_migrations: 3}"),
                "shutdown_grace_s: 1\nmax_retries: 3")
    calls: list = []
    try:
        async def dies(request):
            resp = await event_stream(request, calls)
            if first_token == "second":   # the first dies before a token (a retry), the second after one
                if len(calls) == 2:
                    await resp.write(completion_chunk(" a", [11], prompt=[1, 2]))
            elif first_token:
                await resp.write(completion_chunk(" a", [11], prompt=[1, 2]) if len(calls) == 1 else
                                 completion_chunk(" b", [12], prompt=[1, 2, 11]))
            await resp.write(ENGINE_DEAD)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, dies, dies, dies, dies)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 9, "stream": True}).encode())
        assert len(calls) == 2, calls
        if first_token == "second":   # (the count runs over its retry and its migrations)
            assert status == 200 and b'" a"' in data and b'"code": "502"' in data
        elif first_token:   # the client's stream ends with the error, after the tokens it got
            assert status == 200 and b'" a"' in data and b'" b"' in data and b'"code": "502"' in data
        else:
            assert status == 502 and b"Two replicas failed" in data
    finally:
        h.close()


async def usage_if_asked(request):
    """A stream of two tokens whose usage chunk comes only for a real ``include_usage: true`` (vLLM reads its
    request's lax bool: "false", "0", "no" are false)."""
    body = json.loads(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(completion_chunk("a", [5]) + completion_chunk("b", [6], "length"))
    if (body.get("stream_options") or {}).get("include_usage") is True:
        await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
                         b'"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    return resp


def test_every_stream_is_metered_whatever_its_include_usage_says(gw):
    """The gateway counts a stream's tokens from its usage chunk and asked for one unless the client's
    include_usage was truthy in Python: "false" is, vLLM reads it as false, so such a stream was served whole
    and never charged (tpm, budget, ledger).  The replica is asked a real true; the client sees the usage chunk
    only if its own value reads as true to vLLM."""
    h = gw()
    e, = engines(h, usage_if_asked)
    cases = [("false", False), ("0", False), ("no", False), ("true", True), (True, True), (None, False)]
    for asked, shown in cases:
        opts = {} if asked is None else {"stream_options": {"include_usage": asked}}
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "stream": True,
                                              **opts}).encode())
        assert status == 200 and json.loads(e["seen"][-1][1])["stream_options"]["include_usage"] is True, asked
        assert (b'"usage"' in data) == shown, (asked, data)
    for path in ("/v1/completions/", "/v1//completions"):   # (other spellings of the path: the usage was not
        # asked for, and the stream not charged)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}).encode(),
                               path=path)
        assert status == 200 and json.loads(e["seen"][-1][1])["stream_options"]["include_usage"] is True, path
        assert b'"usage"' not in data and data.endswith(b"data: [DONE]\n\n"), data
    cases += [(None, False)] * 2
    wait_for(lambda: h.gateway.tenants.anonymous.tokens == 4 * len(cases), 10, "every stream's 4 tokens charged")
    # vLLM puts usage in every chunk with continuous_usage_stats, but only with include_usage: a client that
    # did not ask for usage must not get it in every chunk because the gateway asked for the last one
    for asked in (False, True):
        post(h, json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {
            "include_usage": asked, "continuous_usage_stats": True}}).encode())
        want = {"include_usage": True, "continuous_usage_stats": True} if asked else {"include_usage": True}
        assert json.loads(e["seen"][-1][1])["stream_options"] == want


def test_a_whole_answer_is_charged_its_top_level_usage_whatever_its_prompt_logprobs_hold(gw):
    """vLLM writes prompt_logprobs after usage, and a prompt token whose text is "usage" appears there as
    "decoded_token":"usage": the last "usage" in the body was taken for the answer's, which read as none, so
    such an answer was never charged."""
    h = gw()
    answer = {**COMPLETION, "prompt_logprobs": [None, {"9": {"logprob": -1.0, "rank": 1, "decoded_token": "usage"},
                                                      "7": {"logprob": -2.0, "rank": 2, "decoded_token": "x"}}]}

    async def with_logprobs(request):
        return web.Response(body=json.dumps(answer, separators=(",", ":")).encode(), content_type="application/json")
    engines(h, with_logprobs)
    assert post(h, BODY)[0] == 200
    wait_for(lambda: h.gateway.tenants.anonymous.tokens == 2, 10, "the answer's 2 tokens charged")


def test_a_fault_on_the_replica_a_stream_moved_to_frees_that_replicas_slot(tmp_path):
    """A stream moved after its replica died; the replica it moved to sends an event the stitcher cannot read (a
    JSON number): the request fails, and the new replica's slot is given back (it was held for ever: the replica
    looked one request fuller, and a drain of it waited for that request to its timeout)."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def dies_then_odd(request):
            calls.append(1)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if len(calls) == 1:   # the first replica: a token, then it dies
                await resp.write(completion_chunk("a", [5], prompt=[1, 2]))
                await asyncio.sleep(0.1)
                request.transport.close()
                return resp
            await resp.write(b"data: 1\n\n")   # the second: an event that is no chunk
            await asyncio.sleep(1)
            return resp
        engines(h, dies_then_odd, dies_then_odd)
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}),
                  {"Content-Type": "application/json"})
        try:
            data = c.getresponse().read()
        except http.client.IncompleteRead as exc:   # (the fault cut the stream)
            data = exc.partial
        assert len(calls) == 2 and b'"text":"a"' in data and b"data: [DONE]" not in data
        wait_for(lambda: not any(h.gateway.pools.inflight_by_job().values()), 5, "every slot given back")
    finally:
        h.close()


def test_resumable_streams_reuse_their_replica_connection(tmp_path):
    """A resumable stream stops reading at ``[DONE]``, which vLLM writes before its body's chunked end: its
    connection was released unfinished and closed, so every resumable stream opened a new connection to the
    replica.  Now each goes back to the pool once its end comes, and the next stream reuses it."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    peers: list = []
    try:
        async def late_end(request):
            peers.append(request.transport.get_extra_info("peername"))
            resp = await keep_alive_stream(request, 0.0)
            await asyncio.sleep(0.05)   # the chunked terminator (write_eof) comes after [DONE]
            return resp
        e, = engines(h, late_end)
        idle = h.gateway.upstream._idle
        for _ in range(4):
            _, data = stream(h)
            assert data.count(b'"text"') == 2 and data.endswith(b"data: [DONE]\n\n")
            wait_for(lambda: idle.get(("127.0.0.1", e["port"])), 5, "the connection back in the pool")
        assert len(peers) == 4 and len(set(peers)) == 1, peers
    finally:
        h.close()


def nested(depth: int) -> str:
    """JSON of ``depth`` nested objects (json.dumps itself recurses: it cannot write them)."""
    return '{"k":' * (depth - 1) + "{}" + "}" * (depth - 1)


def test_a_body_nested_too_deep_to_write_back_is_a_400_not_a_500(gw):
    """orjson reads 1,023 levels but writes 254: a streamed chat (its usage asked for), a resumable request or
    an alias is re-encoded, so a body 255-1,023 levels deep was a 500 with a traceback per request (and
    prefix_affinity's key, repr() of the content, hit Python's recursion limit near 1,000).  Such a body is a
    400 invalid_json now, and one at the limit still reaches the replica."""
    h = gw()

    async def answer(request):
        return web.json_response(COMPLETION)
    e, = engines(h, answer)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    for depth in (255, 300, 1000):   # (the body itself is the first level)
        body = json.dumps(chat)[:-1] + ', "x": ' + nested(depth - 1) + "}"
        status, _, data = post(h, body.encode(), path="/v1/chat/completions")
        err = json.loads(data)["error"]
        assert status == 400 and err["code"] == "invalid_json" and "254" in err["message"], (depth, data)
    assert e["seen"] == []
    status, _, _ = post(h, (json.dumps(chat)[:-1] + ', "x": ' + nested(253) + "}").encode(), path="/v1/chat/completions")
    assert status == 200 and len(e["seen"]) == 1
    many = {"model": "m", "prompt": "[" * 1000 + "{" * 1000, "messages_": [{"a": [1]}] * 300}   # many brackets,
    assert post(h, json.dumps(many).encode())[0] == 200                                        # none of them deep


def test_a_multipart_boundary_outside_latin_1_is_read_not_a_500(gw):
    """aiohttp reads header values as UTF-8: a boundary such as "€" failed its latin-1 encoding with a 500.
    Its bytes are the header's own now: a form with that boundary is read, a broken one is the usual 400."""
    h = gw()

    async def transcribe(request):
        return web.json_response({"text": "hello"})
    e, = engines(h, transcribe)
    b = "€b".encode()
    body = (b"--" + b + b"\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--" + b + b"--\r\n")
    ctype = "multipart/form-data; boundary=€b".encode()
    for raw, want in ((body, 200), (body.replace(b"--" + b + b"--", b"--x--"), 400)):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
        c.putrequest("POST", "/v1/audio/transcriptions")
        c.putheader("Content-Type", ctype)
        c.putheader("Content-Length", str(len(raw)))
        c.endheaders(raw)
        r = c.getresponse()
        data = r.read()
        c.close()
        assert r.status == want and (want == 200 or json.loads(data)["error"]["code"] == "invalid_body"), data
    assert len(e["seen"]) == 1 and e["seen"][0][1] == body


def test_ejection_stays_capped_after_a_thousand_ejections():
    """The back-off is min(eject_max_s, base x 2^(ejections-1)): Python evaluates the power first, and past 1,024
    ejections (a replica failing now and then for about 17 hours) 2.0 x 2^1024 overflowed: every failed attempt
    there raised in the proxy's finally (a 500 instead of a retry elsewhere) and the replica was never ejected."""
    from orchestrator.config import GatewayConfig, ModelConfig
    from orchestrator.contract import ModelRoutes, RoutingTable
    from orchestrator.gateway.pool import Pools
    now = [1000.0]
    m = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}})
    pools = Pools(GatewayConfig(), [m], clock=lambda: now[0])
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, tuple(
        Replica(f"j{i}", "m", i, Endpoint(f"j{i}", "127.0.0.1", 1 + i, "s")) for i in range(3)))}))
    pool = pools.resolve("m")
    slot = pool.slots["j0"]
    slot.ejections = 1024
    for _ in range(pools.cfg.eject_after_failures):
        ejected = pool.failed(slot)
    assert ejected and slot.ejections == 1025 and slot.ejected_until == now[0] + pools.cfg.eject_max_s


def chat_chunk(delta: dict, ids: list[int] | None = None, finish: str | None = None, **top) -> bytes:
    """An event of vLLM's /v1/chat/completions stream, with return_token_ids."""
    ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
          **({"token_ids": ids} if ids is not None else {})}
    return b"data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                   **top, "choices": [ch]}).encode() + b"\n\n"


@pytest.mark.parametrize("how, key", [("streamed", "reasoning_content"), ("whole", "reasoning"),
                                      ("broken", "reasoning_content")])
def test_reasoning_of_a_model_thought_plain_reaches_the_client_and_is_not_continued(tmp_path, how, key):
    """A replica that streams reasoning deltas (a --reasoning-parser the model's config does not show) for a
    model the gateway thinks plain: its reasoning chunks, token ids and no content, were held as half a character
    and dropped, so the client never got the reasoning, with no failure at all.  Now they reach it as they came
    (a whole answer's message has them), and a break after them ends the stream with the error of a stream that
    cannot go on: a continuation (/v1/completions, no parser) would hand the client the raw rest as content."""
    h = Harness(tmp_path, MODELS_RESUMED, "shutdown_grace_s: 1")
    calls: list = []
    try:
        async def thinks(request):
            resp = await event_stream(request, calls)
            if len(calls) > 1:   # (a continuation: the raw text, the reasoning's end and the answer as content)
                await resp.write(completion_chunk("</think> Yes.", [23, 24, 25], "stop", prompt=calls[-1]["prompt"]))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            for chunk in (chat_chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2]),
                          chat_chunk({key: "Let"}, [21]), chat_chunk({key: " me think"}, [22])):
                await resp.write(chunk)
            if how == "broken":
                await asyncio.sleep(0.2)
                request.transport.close()
                return resp
            for chunk in (chat_chunk({}, [23]), chat_chunk({"content": " Yes"}, [24]),
                          chat_chunk({"content": "."}, [25], "stop"),
                          b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
                          b'"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":5,"total_tokens":7}}\n\n',
                          b"data: [DONE]\n\n"):
                await resp.write(chunk)
            return resp
        engines(h, thinks, thinks)
        status, _, data = post(h, json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 9, "stream": how != "whole"}).encode(),
                               path="/v1/chat/completions")
        assert status == 200 and len(calls) == 1, (calls, data)
        if how == "whole":
            message = json.loads(data)["choices"][0]["message"]
            assert message[key] == "Let me think" and message["content"] == " Yes.", message
            return
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        assert "".join(d.get(key) or "" for d in deltas) == "Let me think", deltas
        if how == "streamed":
            assert "".join(d.get("content") or "" for d in deltas) == " Yes." and "error" not in data.decode()
        else:
            assert "could not be continued" in events[-1]["error"]["message"] and data.endswith(b"data: [DONE]\n\n")
    finally:
        h.close()


@pytest.mark.parametrize("status,body,ctype,said", [
    (500, b"Internal Server Error", "text/plain", "The replica answered 500: Internal Server Error."),
    (404, b'{"detail": "Not Found"}', "application/json", "The model `m` does not serve /v1/embeddings."),
    (400, b'{"object": "error", "message": "bad prompt", "type": "BadRequestError", "param": null, "code": 400}',
     "application/json", "bad prompt"),
    (422, b'{"detail": [{"loc": ["body", "input"], "msg": "Field required"}]}', "application/json", None)])
def test_a_replicas_error_not_in_openais_shape_reaches_the_client_in_it(gw, status, body, ctype, said):
    """vLLM serves only its model's task's paths (FastAPI's 404 ``{"detail": "Not Found"}`` for the others), older
    vLLM's errors are a top-level ``{"object": "error"}``: the client got them as they came, and the SDK's error
    had no message (``Error code: 404``) nor code.  An error already in OpenAI's shape goes as it came."""
    h = gw()

    async def engine(request):
        return web.Response(status=status, body=body, content_type=ctype)
    engines(h, engine)
    code, headers, data = post(h, json.dumps({"model": "m", "input": "x"}).encode(), path="/v1/embeddings")
    assert code == status and headers["Content-Type"].startswith("application/json"), (code, headers)
    err = json.loads(data)["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"], err
    assert said is None or err["message"] == said, err
    assert said is not None or "Field required" in err["message"]


def test_an_engines_empty_500_is_tried_on_another_replica_and_a_second_is_a_502(gw):
    """vLLM answers a bare 500 when its engine died (EngineDeadError) before any output: the request went back to
    the client as an empty body labelled JSON; it is tried elsewhere now, as a request its replica dropped."""
    h = gw()

    async def dead(request):
        return web.Response(status=500)

    async def alive(request):
        return web.json_response(COMPLETION)
    a, b = engines(h, dead, alive)
    for _ in range(40):   # whichever the pick, the answer is the live one's; until the dead one had one (a random
        code, _, data = post(h, BODY)   # pick: four in a row went to the live one in a run of three)
        assert code == 200 and json.loads(data)["choices"][0]["text"] == "hi", (code, data)
        if a["paths"]:
            break
    assert "/v1/completions" in a["paths"]
    h2 = gw()
    engines(h2, dead, dead)
    code, _, data = post(h2, BODY)
    err = json.loads(data)["error"]
    assert code == 502 and err["message"], (code, err)
