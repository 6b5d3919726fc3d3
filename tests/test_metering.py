"""Metering a replica's streams for the request's key: the usage chunk read (and dropped when only the gateway
asked for it) in the OpenAI, Responses and Messages framings, and what a client that leaves mid-stream pays."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import orjson
import pytest
from aiohttp import web

from conftest import present, wait_for
from gateway_harness import Harness, read_stream_and_leave
from orchestrator.contract import Endpoint, Replica
from orchestrator.gateway.metering import meter_events, usage_in_body

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    resume: {enabled: false}   # (a resumable stream is counted from its token ids: tests/test_resume.py)
"""


@pytest.fixture
def gw(tmp_path):
    made: list = []

    def make() -> Harness:
        h = Harness(tmp_path, MODELS, "api_keys:\n  - {name: bob, key: sk-bob}")
        made.append(h)
        return h
    yield make
    for h in made:
        h.close()


def fake_engine(h: Harness, path: str, handler, **more) -> tuple[web.AppRunner, int]:
    """An engine at ``path`` answering with ``handler`` (and at ``/{name}`` with ``more[name]``) in the harness's
    loop (so a test shapes the stream's timing), published as model m's only READY replica; returns its runner
    and port."""
    async def start():
        app = web.Application()
        app.router.add_post(path, handler)
        for name, h2 in more.items():
            app.router.add_post(f"/{name}", h2)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]
    runner, port = h.call(start())
    h.set_ready([Replica("job-fake", "m", 0, Endpoint("job-fake", "127.0.0.1", port, "x"))])
    return runner, port


class P:   # what meter_events reads and writes of a parsed request
    def __init__(self, strip: bool):
        self.strip_usage, self.usage, self.metered = strip, (0, 0), False


def test_stream_options_vllm_refuses_are_left_for_it_to_refuse():
    """``stream_options: "x"`` or ``[1]`` is vLLM's 400; the gateway made it ``{"include_usage": true}``, a valid
    request answered.  An object, or none, still gets the usage asked for."""
    from orchestrator.gateway.metering import ask_usage
    for opts in ("bogus", [1], 3):
        body = {"stream": True, "stream_options": opts}
        assert ask_usage("/v1/completions", body, False) == (False, False) and body["stream_options"] == opts
    body = {"stream": True}
    assert ask_usage("/v1/completions", body, False) == (True, True)
    assert body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert ask_usage("/v1/chat/completions", body, False) == (True, True) and body["stream_options"] == {
        "include_usage": True}


def test_a_streams_last_chunk_waits_for_the_fingerprint_of_the_usage_chunk_dropped_after_it():
    """Read by read: tokens go at once; the finish event waits; the usage chunk (the gateway's alone) is dropped and
    its system_fingerprint put on the finish event; a usage chunk without one (vLLM's --fingerprint-mode off)
    lets the finish event go as it came."""
    from orchestrator.gateway.metering import finish_held
    tok = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
    fin = b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
    for fp in ("vllm-0.32.0-abcd1234", None):
        p = P(strip=True)
        p.fingerprint = None
        assert finish_held(p, tok) == (tok, b"", 0)
        now, held, _ = finish_held(p, tok + fin)
        assert (now, held) == (tok, fin)
        usage = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2},
                              **({"system_fingerprint": fp} if fp else {})})
        events = meter_events(p, held + b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        now, held, _ = finish_held(p, events)
        assert held == b"" and now.endswith(b"data: [DONE]\n\n") and b"usage" not in now and p.usage == (1, 2)
        last = orjson.loads(now.split(b"\n\n")[0][6:])
        assert last["choices"][0]["text"] == "b" and last.get("system_fingerprint") == fp, last
    p = P(strip=True)
    p.fingerprint = None
    assert finish_held(p, fin) == (b"", fin, 0)   # (the first event a finish: all of it waits)
    # three choices: the first two ends go as they come (read by read, or two in one read), the last one waits
    fins = [fin.replace(b'"index":0', b'"index":%d' % i) for i in range(3)]
    assert finish_held(p, fins[0] + tok, 2) == (fins[0] + tok, b"", 1)
    assert finish_held(p, tok + fins[1] + tok + fins[2], 1) == (tok + fins[1] + tok, fins[2], 0)
    assert finish_held(p, fins[0] + fins[1], 2) == (fins[0] + fins[1], b"", 0)


def test_meter_events_takes_the_usage_and_drops_the_chunk_only_the_gateway_wanted():
    events = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
              b'data: [DONE]\n\n')
    p = P(strip=True)
    assert meter_events(p, events) == b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    assert p.usage == (7, 3)
    p = P(strip=False)
    assert meter_events(p, events) == events and p.usage == (7, 3)


def test_the_responses_and_messages_apis_usage_is_metered_too():
    """vLLM's /v1/responses and /v1/messages say input_tokens/output_tokens, in the body, in a Responses
    stream's response.completed event and in a Messages stream's message_start and message_delta events."""
    p = P(strip=False)
    usage_in_body(p, b'{"id":"resp_1","object":"response","output":[],"usage":{"input_tokens":812,'
                     b'"input_tokens_details":{"cached_tokens":0},"output_tokens":40,"total_tokens":852}}')
    assert p.usage == (812, 40)
    p = P(strip=True)
    ev = (b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
          b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
          b'{"input_tokens":812,"output_tokens":40,"total_tokens":852}}}\n\n')
    assert meter_events(p, ev) == ev and p.usage == (812, 40)   # (nothing of theirs is dropped)
    p = P(strip=False)
    meter_events(p, b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":9,'
                    b'"output_tokens":1}}}\n\n')
    meter_events(p, b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":31}}\n\n')
    assert p.usage == (9, 31)


def test_a_long_answers_usage_is_read_without_parsing_it_whole(monkeypatch):
    """A long answer (a batch of embeddings, prompt_logprobs) is not parsed whole on the event loop to read its
    usage: the last "usage" key's object is decoded, not a prompt token's text "usage" after it, nor a quoted one
    inside a text."""
    from orchestrator.gateway import metering
    vectors = ",".join('{"index":%d,"object":"embedding","embedding":[%s]}' % (i, ",".join(["0.125"] * 256))
                       for i in range(64))
    tail = ',"prompt_logprobs":[null,{"1":{"logprob":-1.5,"rank":1,"decoded_token":"usage"}}]}'
    body = ('{"id":"e","object":"list","data":[%s],"model":"m","choices":[{"text":"say \\"usage\\":{\\"x\\":1}"}],'
            '"usage":{"prompt_tokens":640,"total_tokens":640,"completion_tokens":0}%s' % (vectors, tail)).encode()
    assert len(body) > 65536 and orjson.loads(body)["usage"]["prompt_tokens"] == 640

    def whole(data):
        raise AssertionError(f"a {len(data)}-byte answer parsed whole")
    monkeypatch.setattr(metering.orjson, "loads", whole)
    p = P(strip=False)
    usage_in_body(p, body)
    assert p.usage == (640, 0)
    p = P(strip=False)
    usage_in_body(p, body.replace(b'"usage":{"prompt', b'"usagE":{"prompt'))   # no usage key: none read
    assert p.usage == (0, 0)


def test_only_a_streams_last_count_marks_it_metered():
    """Usage in every chunk (vLLM's continuous_usage_stats), a Messages message_start, a Responses in-progress
    event: not the last count. The usage chunk, message_delta, and a Responses stream's end (completed,
    incomplete, failed) are."""
    def metered(ev: bytes) -> bool:
        p = P(strip=False)
        meter_events(p, ev)
        return p.metered
    assert not metered(b'data: {"choices":[{"text":"a"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n')
    assert not metered(b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":9,'
                       b'"output_tokens":1}}}\n\n')
    assert metered(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n')
    assert metered(b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":31}}\n\n')
    for end in (b"response.completed", b"response.incomplete", b"response.failed"):
        assert metered(b"event: " + end + b'\ndata: {"type":"' + end + b'","response":{"usage":'
                       b'{"input_tokens":8,"output_tokens":4}}}\n\n')


def test_a_client_that_leaves_a_messages_stream_pays_for_what_it_was_sent(gw):
    """A Messages stream says its input tokens and 1 output token first (message_start), the output count last:
    a client that leaves before the end pays an output token per event it was sent, not the first 1."""
    h = gw()

    async def messages(request):   # an engine's /v1/messages stream (vLLM's event framing), 2000 tokens slowly
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                         b'{"input_tokens":9,"output_tokens":1}}}\n\n')
        for _ in range(2000):
            await resp.write(b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
                             b'{"type":"text_delta","text":"a\\n\\nb"}}\n\n')
            await asyncio.sleep(0.005)
        return resp

    runner, _ = fake_engine(h, "/v1/messages", messages)
    try:
        read_stream_and_leave(h, "/v1/messages", {"model": "m", "max_tokens": 2000, "stream": True, "messages": [
            {"role": "user", "content": "hi"}]}, lambda got: got.count(b"content_block_delta\ndata:") >= 30)
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][1] == 9 and 30 <= t.usage["m"][2] < 2000   # (not 1; "\n\n" in a text is escaped)
    finally:
        h.call(runner.cleanup())




def test_a_client_that_leaves_pays_for_the_tokens_it_was_sent_not_the_keep_alives(gw):
    """vLLM's --sse-keep-alive-interval sends `: keep-alive` events while a stream waits and between tokens: a
    client that left was charged a token for each of them too."""
    h = gw()

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            for _ in range(10):
                await resp.write(b": keep-alive\n\n")
            await resp.write(b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i)
        await asyncio.sleep(2)   # (the client leaves meanwhile)
        return resp

    runner, _ = fake_engine(h, "/v1/completions", completions)
    try:
        got = read_stream_and_leave(h, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 100,
                                                           "stream": True}, lambda got: b'"t2"' in got)
        assert got.count(b": keep-alive") == 30
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][2] == 3
    finally:
        h.call(runner.cleanup())


@pytest.mark.parametrize("asked", [True, False])
def test_a_client_that_leaves_after_the_usage_chunk_pays_the_replicas_count(gw, asked):
    """The replica's usage chunk is the last count: a client that closes once it has the stream's [DONE], before
    the replica's response ended, pays those 3 tokens, not one per event it was sent (was 6, a CI flake), and its request is a 200, not an
    abort."""
    h = gw()

    async def chat(request):   # 3 tokens, the usage chunk, [DONE]; the response itself ends a while later
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta in ({"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {"content": "c"}):
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n")
        await resp.write(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
                         b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}'
                         b'\n\ndata: [DONE]\n\n')
        await asyncio.sleep(3)
        return resp

    runner, _ = fake_engine(h, "/v1/chat/completions", chat)
    try:
        body = {"model": "m", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        if asked:
            body["stream_options"] = {"include_usage": True}
        got = read_stream_and_leave(h, "/v1/chat/completions", body, lambda got: b"data: [DONE]" in got)  # (the SDK)
        assert (b'"usage"' in got) is asked   # (the gateway's own usage chunk is taken out)
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][1:3] == [7, 3]
        # a whole answer, not an aborted stream, to an SRE's dashboard
        assert h.metric("slurmfleet_requests_total", model="m", code="200") == 1
        assert h.metric("slurmfleet_stream_aborts_total", side="client") == 0
    finally:
        h.call(runner.cleanup())


def test_a_one_byte_piece_of_a_stream_waits_for_the_rest_of_its_event(gw, monkeypatch):
    """A piece of the replica's stream that is a single byte and ends no event (the `d` of the usage chunk's
    `data:`) was sent alone, the next piece began `ata: {...}`, and the usage chunk was never seen: the key paid
    nothing for the stream and the client got a usage chunk it had not asked for."""
    from orchestrator.gateway.upstream import Response
    h = gw()
    pieces: list[bytes] = []   # what the gateway read from the replica, piece by piece
    read = Response.iter_chunks

    async def spy(self):
        async for piece in read(self):
            pieces.append(piece)
            yield piece
    monkeypatch.setattr(Response, "iter_chunks", spy)

    async def until(cond):
        while not cond():
            await asyncio.sleep(0.01)

    async def completions(request):   # each piece written once the gateway has read the one before
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}\n\n'
        await resp.write(first)
        await until(lambda: b"".join(pieces) == first)
        await resp.write(b"d")
        await until(lambda: pieces[-1:] == [b"d"])
        await resp.write(b'ata: {"id":"x","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":100,'
                         b'"total_tokens":107}}\n\ndata: [DONE]\n\n')
        return resp

    runner, _ = fake_engine(h, "/v1/completions", completions)
    try:
        got = read_stream_and_leave(h, "/v1/completions", {"model": "m", "prompt": "x", "stream": True},
                                    lambda got: b"[DONE]" in got)
        assert b'"usage"' not in got and got.endswith(b"data: [DONE]\n\n")
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][1:3] == [7, 100]
    finally:
        h.call(runner.cleanup())


async def _cut_mid_event(request, first: bytes, events: list[bytes], half: bytes):
    """A replica that sends ``first`` and ``events``, half an event, then dies (its connection reset)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(first)
    for ev in events:
        await resp.write(ev)
        await asyncio.sleep(0.01)
    await resp.write(half)
    await asyncio.sleep(0.2)
    request.transport.abort()
    return resp


def test_a_stream_its_replica_cuts_mid_event_ends_with_an_error_the_sdk_raises_and_charges_what_was_sent(gw):
    """A stream that is not continued (resume off here; n, stop, tools... elsewhere) and whose replica dies in the
    middle of an event: the half event was written before the error, on one line (`data: {"id":"x","chodata:
    {"error"...`), and the openai SDK raised a JSONDecodeError, not an APIError.  And its key paid nothing (the
    replica's count never came): it pays what it was sent, a token per event, and its prompt as a replica counts
    it."""
    import openai
    h = gw()
    delta = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'

    async def chat(request):
        return await _cut_mid_event(request, b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant"}}]}'
                                    b'\n\n', [delta] * 5, b'data: {"id":"x","cho')

    async def tokenize(request):
        return web.json_response({"count": 11})

    runner, _ = fake_engine(h, "/v1/chat/completions", chat, tokenize=tokenize)
    try:
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0)
        got = []
        with pytest.raises(openai.APIError) as e:
            for chunk in c.chat.completions.create(model="m", max_tokens=20, stream=True, stop=["zz"],
                                                   messages=[{"role": "user", "content": "hi"}]):
                got.append(chunk)
        assert "failed mid-stream" in str(e.value) and len(got) == 6
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0 and t.usage["m"][1] == 11, 10, "the request to end and its prompt counted")
        assert t.usage["m"][2] == 6
    finally:
        h.call(runner.cleanup())


def test_a_messages_stream_its_replica_cuts_ends_with_anthropics_error_event(gw):
    """The anthropic SDK raises on an `event: error` only: the unnamed OpenAI-style error ended a Messages stream
    as if it were whole."""
    import urllib.request
    h = gw()

    async def messages(request):
        return await _cut_mid_event(request, b'event: message_start\ndata: {"type":"message_start","message":'
                                    b'{"usage":{"input_tokens":9,"output_tokens":1}}}\n\n',
                                    [b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
                                     b'{"type":"text_delta","text":"a"}}\n\n'] * 3, b"event: content_block_delta\nda")

    runner, _ = fake_engine(h, "/v1/messages", messages)
    try:
        req = urllib.request.Request(h.base + "/v1/messages", data=json.dumps({
            "model": "m", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Authorization": "Bearer sk-bob", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        assert body.count(b"content_block_delta\ndata:") == 3 and b"\nda\n" not in body and b"daevent" not in body
        last = body.split(b"\n\n")[-2]
        assert last.startswith(b"event: error\ndata: ")
        assert json.loads(last.split(b"data: ", 1)[1]) == {"type": "error", "error": {
            "type": "api_error", "message": "The replica failed mid-stream."}}
    finally:
        h.call(runner.cleanup())


@pytest.mark.parametrize("count_s", [2.5, 6.0])
def test_a_stopping_gateway_waits_for_the_prompt_count_of_a_stream_its_client_left(gw, count_s):
    """A client leaves a stream before its usage came: its prompt is counted by the replica's /tokenize after the
    request ended. A gateway stopping right then waits for that count (its last report carries it: a worker's
    is the fleet's last word on its keys) before it closes its connections to the replicas. A count slower than
    the stop's wait (3 s) is cut off and its prompt estimated: it charged nothing (a review found it)."""
    from orchestrator.gateway.local import LocalGateway
    h = gw()

    async def chat(request):   # tokens until the client leaves, never the usage
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2000):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
            await asyncio.sleep(0.005)
        return resp

    async def tokenize(request):   # a replica slow to count (within the stop's CHORES_WAIT_S, 3 s, or past it)
        await asyncio.sleep(count_s)
        return web.json_response({"count": 42})

    runner, _ = fake_engine(h, "/v1/chat/completions", chat, tokenize=tokenize)
    try:
        read_stream_and_leave(h, "/v1/chat/completions", {"model": "m", "max_tokens": 2000, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}, lambda got: got.count(b"data:") >= 10)
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][1] == 0 and h.gateway.chores   # its prompt is being counted
        local = LocalGateway.__new__(LocalGateway)   # the daemon's in-process gateway, around this one
        local.gateway, local.runner = h.gateway, h.runner
        h.call(local.stop(1.0))
        assert (t.usage["m"][1] == 42 if count_s < 3 else 0 < t.usage["m"][1] != 42) and not h.gateway.chores, t.usage
    finally:
        h.call(runner.cleanup())


ITEM = {"model": "m", "prompt": "", "content": "a" * 4000}


@pytest.mark.parametrize("body,want", [
    ({"prompt": ["x"] * 1000}, 16 * 7 + -(-(984 * 3) // 4)),   # 16 counted (7 each here), the rest estimated
    ({"input": [ITEM]}, -(-len(orjson.dumps(ITEM)) // 4)),   # (an item that names a model is no chat query)
    ({"prompt": [[1, 2, 3], [4]]}, 4),
    ({"messages": [{"role": "user", "content": "hi"}]}, 7),
    ({"prompt": None}, 0),
])
def test_a_left_prompt_too_small_to_count_alone_adds_up(monkeypatch, body, want):
    """Estimated parts were each rounded down (100,000 one-character prompts were charged 16 tokens), and a
    client's own item that named a model was sent to /tokenize as it was (a 40,000-character content counted
    as an empty prompt)."""
    from types import SimpleNamespace

    from orchestrator.gateway import metering

    async def tokenize(gw, slot, query):
        return 7 if set(query) <= {"model", "prompt", "messages"} and query.get("prompt", "x") else None
    monkeypatch.setattr(metering, "tokenized", tokenize)
    charged = []
    p = SimpleNamespace(body=body, model="m", tenant=SimpleNamespace(charge_prompt=lambda m, n: charged.append(n)))
    asyncio.run(metering.charge_prompt(None, p, None))
    assert sum(charged) == want and len(charged) <= 1, charged


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def post_as_bob(h: Harness, path: str, body: dict) -> tuple[int, bytes]:
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    c.request("POST", path, json.dumps(body), {"Authorization": "Bearer sk-bob", "Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def test_a_stream_the_engine_ends_with_its_own_error_event_is_charged_what_it_sent(gw):
    """vLLM ends a stream whose generation failed (a tool parser that raised, an engine error) with an error event
    and [DONE], and no usage chunk: the stream ended cleanly, so its key paid nothing for the 40 tokens it got."""
    h = gw()

    async def chat(request):   # two choices of 20 tokens each, then vLLM's error event
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(20):
            for i in range(2):
                await resp.write(sse({"id": "c", "choices": [{"index": i, "delta": {"content": "tok"}}]}))
        await resp.write(sse({"error": {"message": "tool parser failed", "type": "InternalServerError",
                                        "param": None, "code": 500}}) + b"data: [DONE]\n\n")
        return resp

    async def tokenize(request):
        return web.json_response({"count": 11})

    runner, _ = fake_engine(h, "/v1/chat/completions", chat, tokenize=tokenize)
    try:
        status, data = post_as_bob(h, "/v1/chat/completions", {"model": "m", "n": 2, "stream": True,
                                                                "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and data.count(b'"tok"') == 40 and b"tool parser failed" in data
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] == 11, 10, "the prompt counted")
        assert 40 <= t.usage["m"][2] <= 42, t.usage   # a token per event sent (the error and [DONE] are two)
    finally:
        h.call(runner.cleanup())


def interval_stream(k: int, events: int, chat: bool = False):
    """vLLM's stream with a stream_interval of k: a chat's role chunk, the first token alone, then k a chunk."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            await resp.write(sse({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(events):
            text = "w" * (1 if i == 0 else k)
            await resp.write(sse({"id": "x", "choices": [{"index": 0, **({"delta": {"content": text}} if chat else
                                                                            {"text": text})}]}))
        for _ in range(100):   # open until the gateway lets go of it (its client left), 5 s at most
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.05)
        return resp
    return handler


async def count_one(request):
    return web.json_response({"count": 1})


def test_a_client_that_leaves_pays_every_token_of_a_stream_interval(gw):
    """vLLM 0.32 takes ``stream_interval`` per request: the first token comes alone, then that many an event, and
    a client that left paid one token per event (1 + 2 x 1,000 tokens: 3).  A chat's role chunk carries none, and
    no more than max_tokens is charged."""
    h = gw()
    for path, chat, events, max_tokens, want in (("/v1/completions", False, 3, 4000, 2001),
                                                 ("/v1/chat/completions", True, 1, 4000, 2),
                                                 ("/v1/chat/completions", True, 3, 4000, 2001),
                                                 ("/v1/completions", False, 3, 1500, 1500)):
        runner, _ = fake_engine(h, path, interval_stream(1000, events, chat), tokenize=count_one)
        try:
            body = {"model": "m", "max_tokens": max_tokens, "stream": True, "stream_interval": 1000, "stop": ["zz"],
                    **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
            t = h.gateway.tenants.by_name["bob"]
            before = list(t.usage.get("m", [0, 0, 0])[1:])
            read_stream_and_leave(h, path, body, lambda got: got.count(b"data:") >= events + chat)
            wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] > before[0], 10, f"charged {path} {events}")
            assert t.usage["m"][2] - before[1] == want, (path, events, t.usage, before)
        finally:
            h.call(runner.cleanup())


def test_a_stream_cut_after_its_usage_chunk_keeps_the_replicas_count(gw):
    """The usage chunk came (1 token), then the connection broke before [DONE]: the key paid a token per event
    sent instead of the replica's exact count."""
    h = gw()

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(5):   # (keep-alive-like chatter the count knows better than)
            await resp.write(sse({"id": "x", "choices": [{"index": 0, "text": ""}]}))
        await resp.write(sse({"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}))
        await resp.write(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                                                  "total_tokens": 4}}))
        await asyncio.sleep(0.2)
        request.transport.abort()
        return resp

    runner, _ = fake_engine(h, "/v1/completions", completions, tokenize=count_one)
    try:
        status, data = post_as_bob(h, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1,
                                                           "stream": True, "stop": ["zz"]})
        assert status == 200 and b"failed mid-stream" in data and data.endswith(b"}\n\ndata: [DONE]\n\n"), data
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage["m"][1:] == [3, 1], t.usage
    finally:
        h.call(runner.cleanup())


def test_an_engines_refusal_in_a_stream_is_not_charged(gw):
    """A stream that is only the engine's 4xx error event and [DONE] (a bad prompt, refused) ran nothing."""
    h = gw()
    asked = []

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"error": {"message": "bad prompt", "type": "BadRequestError", "param": None,
                                        "code": 400}}) + b"data: [DONE]\n\n")
        return resp

    async def tokenize(request):
        asked.append(1)
        return web.json_response({"count": 11})

    runner, _ = fake_engine(h, "/v1/completions", completions, tokenize=tokenize)
    try:
        status, data = post_as_bob(h, "/v1/completions", {"model": "m", "prompt": "x", "stream": True,
                                                           "stop": ["zz"]})
        assert status == 200 and b"bad prompt" in data
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0, 10, "the request to end")
        assert t.usage.get("m", [1, 0, 0])[1:] == [0, 0] and asked == [], (t.usage, asked)
    finally:
        h.call(runner.cleanup())


def test_a_stream_of_several_prompts_is_not_held_when_one_of_them_ends(gw):
    """The last chunk of a stream waits for the fingerprint of the usage chunk after it; a completion of several
    prompts ends one prompt's choice long before the others, and their tokens waited for the stream's end."""
    h = gw()
    seen = threading.Event()

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}))
        await resp.write(sse({"id": "x", "choices": [{"index": 1, "text": "b", "finish_reason": None}]}))
        for _ in range(100):   # until the client has prompt 1's token (10 s at most)
            if seen.is_set():
                break
            await asyncio.sleep(0.1)
        await resp.write(sse({"id": "x", "choices": [{"index": 1, "text": "c", "finish_reason": "length"}]}))
        await resp.write(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                                                                  "total_tokens": 4}}) + b"data: [DONE]\n\n")
        return resp

    runner, _ = fake_engine(h, "/v1/completions", completions, tokenize=count_one)
    try:
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": ["p", "q"], "max_tokens": 2,
                                                         "stream": True}),
                  {"Authorization": "Bearer sk-bob", "Content-Type": "application/json"})
        r = c.getresponse()
        got, t0 = b"", time.monotonic()
        while b'"text":"b"' not in got:
            got += r.read1(4096)
        waited = time.monotonic() - t0
        seen.set()
        rest = r.read()
        c.close()
        assert waited < 8, waited   # (held: 10 s, the engine's own wait)
        assert b'"text":"c"' in rest and b"usage" not in got + rest
    finally:
        h.call(runner.cleanup())


def test_a_client_that_leaves_pays_every_token_of_the_engines_stream_interval(tmp_path):
    """An engine started with ``--stream-interval 10`` (vllm_args) sends ten tokens an event to every request."""
    h = Harness(tmp_path, "  - name: m\n    engine: vllm\n    model_path: /m\n    container: {enabled: false}\n"
                "    resume: {enabled: false}\n    vllm_args: {stream-interval: 10}\n",
                "api_keys:\n  - {name: bob, key: sk-bob}")

    runner, _ = fake_engine(h, "/v1/completions", interval_stream(10, 3), tokenize=count_one)
    try:
        read_stream_and_leave(h, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 400, "stream": True},
                              lambda got: got.count(b"data:") >= 3)
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] == 1, 10, "the request charged")
        assert t.usage["m"][2] == 21, t.usage
    finally:
        h.call(runner.cleanup())
        h.close()


def test_continuous_usage_of_several_prompts_cut_short_charges_every_prompt(gw):
    """With ``continuous_usage_stats`` each chunk's usage is its own prompt's (and choice's): a stream of two
    prompts (50 and 70 tokens) cut before the final count was charged the last chunk's 70 as the whole prompt."""
    h = gw()

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for step in range(1, 4):
            for i, pt in ((0, 50), (1, 70)):
                await resp.write(sse({"id": "x", "choices": [{"index": i, "text": "t"}],
                                      "usage": {"prompt_tokens": pt, "completion_tokens": step,
                                                "total_tokens": pt + step}}))
        await asyncio.sleep(0.2)
        request.transport.abort()   # the replica dies
        return resp

    async def tokenize(request):   # the replica's count of each prompt
        return web.json_response({"count": {"a": 50, "b": 70}[(await request.json())["prompt"]]})

    runner, _ = fake_engine(h, "/v1/completions", completions, tokenize=tokenize)
    try:
        status, data = post_as_bob(h, "/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 10,
                                                           "stream": True, "stream_options": {
                                                               "include_usage": True, "continuous_usage_stats": True}})
        assert status == 200 and b"failed mid-stream" in data and data.endswith(b"}\n\ndata: [DONE]\n\n"), data
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] > 0, 10, "the prompts counted")
        assert t.usage["m"][1:] == [120, 6], t.usage
    finally:
        h.call(runner.cleanup())


def test_n_choices_of_several_prompts_are_charged_the_replicas_usage_through_the_gateway(gw):
    """On the simulator (which, as vLLM, now answers n choices of each of several prompts): a key pays each prompt
    once and every choice's tokens, streamed or not, and a stream that did not ask for usage does not get the
    chunk the gateway asked for."""
    from gateway_harness import Sim
    h = gw()
    s = Sim("meter-n", "--ttft-s", "0", "--tokens-per-s", "2000")
    try:
        h.set_ready([s.backend()])
        t = h.gateway.tenants.by_name["bob"]
        body = {"model": "m", "prompt": ["one two three", "four five"], "n": 3, "temperature": 1.0, "seed": 1,
                "max_tokens": 5, "ignore_eos": True}
        status, data = post_as_bob(h, "/v1/completions", body)
        whole = json.loads(data)
        assert status == 200 and len(whole["choices"]) == 6
        assert present(whole["usage"]) == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}
        wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[0] == 1, 10, "the request charged")
        assert t.usage["m"] == [1, 5, 30]
        status, data = post_as_bob(h, "/v1/completions", {**body, "stream": True})
        events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
        assert status == 200 and all(e["choices"] for e in events) and not any("usage" in e for e in events)
        assert sorted({e["choices"][0]["index"] for e in events}) == list(range(6))
        # vLLM's fingerprint (on the usage chunk the gateway asked for and drops) is on the last choice's end
        ends = [e for e in events if e["choices"][0]["finish_reason"]]
        assert len(ends) == 6 and ends[-1] is events[-1] and events[-1].get("system_fingerprint", "").startswith(
            "vllm-") and not any("system_fingerprint" in e for e in events[:-1])
        wait_for(lambda: t.inflight == 0 and t.usage["m"][0] == 2, 10, "the stream charged")
        assert t.usage["m"] == [2, 10, 60]
    finally:
        s.stop()
