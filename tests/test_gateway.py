"""The gateway with the openai SDK as the client, in front of several simulator replicas."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness, Sim

MODEL = """\
  - name: m
    aliases: [m-alias]
    engine: simulator
    container: {{enabled: false}}
    routing: {routing}
    max_inflight_per_replica: {cap}
"""


@pytest.fixture
def sims():
    made: list[Sim] = []

    def make(n: int, *args: str, **kw) -> list[Sim]:
        out = [Sim(f"s{len(made) + i}", *args, **kw) for i in range(n)]
        made.extend(out)
        return out

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def harness(tmp_path):
    made: list[Harness] = []

    def make(routing: str = "least_outstanding", cap: int = 64, gateway: str = "", extra_models: str = "") -> Harness:
        h = Harness(tmp_path, MODEL.format(routing=routing, cap=cap) + extra_models, gateway)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def client(h: Harness, key: str = "none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0, **kw)


def three_replicas(harness, sims, policy: str) -> tuple[Harness, list, openai.OpenAI]:
    """A gateway routing with ``policy`` over three simulators (slots 0-2 of model m), and a client."""
    h = harness(policy)
    backends = sims(3)
    h.route_to(backends)
    return h, backends, client(h)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def assert_openai_error(body: dict, code: str | None = None) -> None:
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    if code:
        assert body["error"]["code"] == code


def test_sdk_sync_async_streamed_and_not(harness, sims):
    h = harness()
    backends = sims(2)
    h.route_to(backends)
    c = client(h)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    # the simulator's greedy tokens are a function of the prompt: the same request, the same answer
    assert len(r.choices[0].message.content.split()) == 5 and r.usage.completion_tokens == 5
    chunks = list(c.completions.create(model="m-alias", prompt="hi", max_tokens=6, stream=True))
    whole = c.completions.create(model="m", prompt="hi", max_tokens=6).choices[0].text
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole and len(whole.split()) == 6
    assert sorted(m.id for m in c.models.list().data) == ["m", "m-alias"]
    assert c.models.retrieve("m-alias").id == "m-alias"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")

    async def run():
        ac = openai.AsyncOpenAI(base_url=h.base + "/v1", api_key="none", max_retries=0)
        r1 = await ac.completions.create(model="m", prompt="x", max_tokens=3)
        stream = await ac.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=4, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
        await ac.close()
        return r1.choices[0].text, text

    t1, t2 = asyncio.run(run())
    assert len(t1.split()) == 3 and len(t2.split()) == 4
    assert sum(s.served() for s in backends) == 5


def test_round_robin_is_exact(harness, sims):
    h, backends, c = three_replicas(harness, sims, "round_robin")
    for _ in range(30):
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert [s.served() for s in backends] == [10, 10, 10]


def test_least_outstanding_avoids_the_slow_replica(harness, sims):
    h = harness("least_outstanding")
    slow = sims(1, "--ttft-s", "1.0")[0]
    fast = sims(2, "--ttft-s", "0.01")
    h.route_to([slow, *fast])

    async def load():
        ac = openai.AsyncOpenAI(base_url=h.base + "/v1", api_key="none", max_retries=0)

        async def worker():
            for _ in range(15):
                await ac.completions.create(model="m", prompt="x", max_tokens=1)
        await asyncio.gather(*(worker() for _ in range(8)))
        await ac.close()

    asyncio.run(load())
    counts = [slow.served()] + [s.served() for s in fast]
    assert sum(counts) == 120
    assert counts[0] < min(counts[1:]) / 3, counts


def test_prefix_affinity_sticks_and_spreads(harness, sims):
    h, backends, c = three_replicas(harness, sims, "prefix_affinity")
    for _ in range(12):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "same long system prompt"}],
                                  max_tokens=1)
    counts = [s.served() for s in backends]
    assert sorted(counts) == [0, 0, 12], counts
    for i in range(30):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                  user=f"user-{i}")
    spread = [s.served() - n for s, n in zip(backends, counts)]
    assert sum(1 for x in spread if x > 0) == 3, spread


def test_load_aware_avoids_the_queued_engine(harness, sims):
    h = harness("load_aware")
    busy = sims(1, "--max-num-seqs", "1", "--ttft-s", "5")[0]
    idle = sims(2)
    h.route_to([busy, *idle])

    def hog():  # fill the busy engine directly: one running, two waiting
        try:
            post(busy.url + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode(),
                 {"Authorization": f"Bearer {busy.secret}"})
        except OSError:
            pass

    threads = [threading.Thread(target=hog, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: busy.metric("vllm:num_requests_waiting") >= 2, 5, "busy engine queue")
    h.scrape()
    assert h.metric("slurmfleet_engine_requests_waiting", slot="0") == 2
    c = client(h)
    for _ in range(20):
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert sum(s.served() for s in idle) == 20


def test_errors_are_openai_shaped(harness, sims, tmp_path):
    h = harness(gateway="api_keys: [good-key, 'sha256:" + __import__("hashlib").sha256(b"hashed-key").hexdigest()
                + "']\nmax_body_bytes: 2048")
    h.set_ready([sims(1)[0].backend()])
    with pytest.raises(openai.AuthenticationError):
        client(h, "bad-key").completions.create(model="m", prompt="x", max_tokens=1)
    assert client(h, "hashed-key").completions.create(model="m", prompt="x", max_tokens=1).choices
    with pytest.raises(openai.NotFoundError) as e:
        client(h, "good-key").completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    auth = {"Authorization": "Bearer good-key"}
    code, _, body = post(h.base + "/v1/completions", b"{not json", auth)
    assert code == 400
    assert_openai_error(body, "invalid_json")
    code, _, body = post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x" * 5000}).encode(), auth)
    assert code == 413
    assert_openai_error(body, "request_too_large")
    code, _, body = post(h.base + "/v1/completions", b"{}", {"Authorization": "Bearer nope"})
    assert code == 401
    assert_openai_error(body, "invalid_api_key")
    # routes the gateway does not have, and methods a route does not take, are OpenAI-shaped too
    code, _, body = post(h.base + "/nowhere", b"{}", auth)
    assert code == 404
    assert_openai_error(body, "unknown_url")
    code, headers, body = post(h.base + "/v1/models", b"{}", auth)
    assert code == 405 and headers["Allow"] == "GET"
    assert_openai_error(body, "method_not_allowed")
    assert [m.id for m in client(h, "good-key").models.list().data] == ["m", "m-alias"]


def test_credentials_are_not_forwarded_and_request_id_round_trips_to_the_client_only(harness, sims):
    h = harness(gateway="api_keys: [client-key]")
    s = sims(1)[0]
    h.set_ready([s.backend()])
    code, headers, _ = post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode(),
                            {"Authorization": "Bearer client-key", "x-request-id": "req-123", "Cookie": "a=b",
                             "x-slurmfleet-batch-owner": "alice"})
    assert code == 200 and headers["x-request-id"] == "req-123"
    seen = {k.lower(): v for k, v in json.loads(s.get("/sim/last_headers")).items()}
    assert seen["authorization"] == f"Bearer {s.secret}" and len(seen["x-request-id"]) == 32   # the gateway's own:
    # vLLM takes it as its request's id, so a client's (another's, guessed) never reaches an engine
    assert "cookie" not in seen and "client-key" not in json.dumps(seen)
    assert "x-slurmfleet-batch-owner" not in seen   # the gateway's own header: no key name reaches an engine
    for admin in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):   # a replica's, for everyone: not a client's
        code, _, body = post(h.base + admin, json.dumps({"model": "m", "lora_name": "x", "lora_path": "/x"}).encode(),
                             {"Authorization": "Bearer client-key"})
        assert code == 404 and body["error"]["code"] == "unknown_url", body
    made = set()
    for _ in range(2):
        code, headers, _ = post(h.base + "/v1/completions",
                                json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode(),
                                {"Authorization": "Bearer client-key"})
        made.add(headers["x-request-id"])
        assert len(headers["x-request-id"]) == 32
        seen = {k.lower(): v for k, v in json.loads(s.get("/sim/last_headers")).items()}
        assert seen["x-request-id"] == headers["x-request-id"]
    assert len(made) == 2  # created ids are unique
    # curl's Expect: 100-continue is answered by the gateway and not passed on
    out = subprocess.run(["curl", "-s", "-H", "Expect: 100-continue", "-H", "Content-Type: application/json",
                          "-H", "Authorization: Bearer client-key", "--data-binary",
                          json.dumps({"model": "m", "prompt": "x" * 3000, "max_tokens": 1}),
                          h.base + "/v1/completions"], capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["choices"], out
    seen = {k.lower(): v for k, v in json.loads(s.get("/sim/last_headers")).items()}
    assert "expect" not in seen


@pytest.mark.parametrize("fault", ["refuse", "503", "hang", "hang, keep-alives"])
def test_a_failing_replica_is_retried_elsewhere(harness, sims, fault):
    # (a hung replica sends a stream's headers, as vLLM does, then nothing, or only keep-alive comments: its
    # request_timeout_s ends the wait; the keep-alives kept it waiting for ever)
    h = harness("round_robin", gateway="first_byte_timeout_s: 1.0\nrequest_timeout_s: 1.5")
    bad = sims(1, "--fault", fault.split(",")[0], *(["--sse-keep-alive-interval", "1"] if "keep" in fault else []))[0]
    good = sims(1)[0]
    h.route_to([bad, good])
    c = client(h)
    for _ in range(6):
        assert c.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text
    assert good.served() == 6
    assert h.metric("slurmfleet_request_retries_total") >= 1


def test_a_retry_that_has_tried_every_replica_answers_at_once(harness, sims):
    """Both replicas answer 503: once each was tried, the client gets that answer, not a wait of the queue
    timeout (30 s) for a replica that is not there and then a 503 that says none became ready."""
    h = harness("round_robin")
    h.route_to(sims(2, "--fault", "503"))
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client(h).completions.create(model="m", prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and time.monotonic() - t0 < 10
    assert e.value.body is None or e.value.body.get("code") != "no_replica"


def test_a_retry_after_a_first_byte_timeout_gets_a_whole_queue_wait_of_its_own(harness, sims):
    """A request that waited in the queue, took a replica that hangs and timed out waiting for its first bytes
    (its headers came at once, as vLLM's do: the total deadline) waits again for the other replica, for a whole
    queue timeout: the time it waited before and the hung attempt do not count against the second wait (it got
    a 503 at once)."""
    h = harness(cap=1, gateway="queue_timeout_s: 2.5\nfirst_byte_timeout_s: 1.5\nrequest_timeout_s: 1.5")
    good = sims(1, "--tokens-per-s", "10")[0]
    hang = sims(1, "--fault", "hang")[0]
    h.set_ready([good.backend(slot=0)])
    results: dict[str, object] = {}

    def run(name: str, tokens: int) -> None:
        try:   # (a streams: an answer not streamed is due whole within request_timeout_s, 1.5 s here)
            r = client(h).completions.create(model="m", prompt="x", max_tokens=tokens, stream=name == "a",
                                             extra_body={"ignore_eos": True})
            results[name] = "".join(c.choices[0].text for c in r if c.choices) if name == "a" else r.choices[0].text
        except openai.APIStatusError as exc:
            results[name] = exc.status_code
    a = threading.Thread(target=run, args=("a", 30))   # holds the good replica about 3 s
    a.start()
    slots = h.gateway.pools.resolve("m").slots
    wait_for(lambda: slots[f"job-{good.name}"].inflight == 1, 10, "a on the good replica")
    b = threading.Thread(target=run, args=("b", 2))
    b.start()
    wait_for(lambda: len(h.gateway.pools.resolve("m").waiting_since) == 1, 10, "b queued")
    h.set_ready([good.backend(slot=0), hang.backend(slot=1)])   # b takes the hanging one, times out at 1.5 s
    a.join(20)
    b.join(20)
    assert isinstance(results.get("a"), str) and isinstance(results.get("b"), str), results
    assert h.metric("slurmfleet_request_retries_total", model="m") >= 1


def test_death_mid_stream_is_a_clean_error_not_a_hang(harness, sims):
    h = harness()
    h.set_ready([sims(1, "--fault", "die-mid-stream")[0].backend()])
    c = client(h, timeout=20)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                           stream=True):
            pass
    assert time.monotonic() - t0 < 10
    assert h.metric("slurmfleet_stream_aborts_total", side="upstream") == 1


def test_ejection_and_return(harness, sims):
    # a 6 s first ejection: the requests below that must not reach the ejected replica fit in it on a loaded machine
    h = harness("round_robin", gateway="eject_base_s: 6")
    a, b, c3 = sims(3)
    h.route_to([a, b, c3])
    c = client(h)
    a.fault("503")
    for _ in range(12):
        c.completions.create(model="m", prompt="x", max_tokens=1)
    t_eject = time.monotonic()
    assert h.metric("slurmfleet_replica_ejections_total") == 1
    before = a.metric("vllm:e2e_request_latency_seconds_count")
    a.fault("none")
    for _ in range(6):  # ejected: no traffic
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert a.served() == before == 0
    time.sleep(max(0.0, 6.2 - (time.monotonic() - t_eject)))  # the first ejection lasts 6 s
    for _ in range(9):
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert a.served() >= 2


def test_queue_full_gets_429_with_retry_after(harness, sims):
    h = harness(cap=1, gateway="max_queue_per_model: 1\nqueue_timeout_s: 20")
    h.set_ready([sims(1, "--ttft-s", "1.5")[0].backend()])
    results = []

    def one():
        results.append(post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    codes = sorted(r[0] for r in results)
    assert codes == [200, 200, 429], codes
    limited = next(r for r in results if r[0] == 429)
    assert limited[1]["Retry-After"] and limited[2]["error"]["code"] == "queue_full"


def test_no_replica_503_after_timeout_and_one_appearing_serves_the_waiter(harness, sims):
    h = harness(gateway="queue_timeout_s: 1")
    t0 = time.monotonic()
    code, headers, body = post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
    assert code == 503 and headers["Retry-After"] and body["error"]["code"] == "no_replica"
    assert 0.9 < time.monotonic() - t0 < 5
    h2 = harness(gateway="queue_timeout_s: 20")
    s = sims(1)[0]
    result = []
    t = threading.Thread(target=lambda: result.append(post(h2.base + "/v1/completions",
                                                             json.dumps({"model": "m", "prompt": "x"}).encode())))
    t.start()
    time.sleep(1.0)
    assert not result
    h2.set_ready([s.backend()])
    t.join(10)
    assert result and result[0][0] == 200


def test_client_disconnect_aborts_upstream(harness, sims):
    h = harness()
    s = sims(1, "--tokens-per-s", "5")[0]
    h.set_ready([s.backend()])
    c = client(h)
    stream = c.completions.create(model="m", prompt="x", max_tokens=200, stream=True)
    next(iter(stream))
    assert s.metric("vllm:num_requests_running") == 1
    stream.close()
    wait_for(lambda: s.metric("vllm:num_requests_running") == 0, 3, "engine running count to drop")
    assert h.metric("slurmfleet_stream_aborts_total", side="client") == 1


def test_a_client_that_leaves_the_queue_costs_the_engine_nothing(harness, sims):
    import socket
    h = harness(cap=1)
    s = sims(1, "--tokens-per-s", "10")[0]
    h.set_ready([s.backend()])
    c = client(h)
    stream = c.completions.create(model="m", prompt="x", max_tokens=20, stream=True)
    next(iter(stream))   # the one slot is taken: what comes next waits in the gateway's queue
    host, port = h.base.split("//")[1].split(":")
    body = json.dumps({"model": "m", "prompt": "y", "max_tokens": 5}).encode()
    for _ in range(3):   # clients that send a request and leave while it is queued
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.2)
    list(stream)
    ok = c.completions.create(model="m", prompt="z", max_tokens=2)   # served at once: nothing queued before it
    assert ok.choices[0].text
    wait_for(lambda: s.served() >= 2, 5, "the engine to count its requests")
    time.sleep(0.5)
    assert s.served() == 2   # the stream and the last one: the others never reached the engine


def test_a_stream_past_the_shutdown_grace_is_cut_at_it_and_frees_its_replica_slot(harness, sims):
    """aiohttp's own shutdown gives a streaming handler its timeout twice (once, then once more after failing a
    body it no longer reads): the daemon's deadline cut it short, which left the stream running with its lease
    and tenant count held.  At the grace the stream is cancelled as a leaving client's is, and its slot freed."""
    h = harness(gateway="shutdown_grace_s: 4")
    s = sims(1, "--tokens-per-s", "10")[0]
    h.set_ready([s.backend()])
    stream = client(h).completions.create(model="m", prompt="x", max_tokens=400, stream=True)   # 40 s
    next(iter(stream))
    took: list[float] = []
    stopper = threading.Thread(target=lambda: took.append(h.shutdown()))
    stopper.start()
    with pytest.raises(openai.APIError):   # cut, not served to its end (30 s)
        for _ in stream:
            pass
    stopper.join(30)
    assert took and 3.5 < took[0] < 7.5, took   # the grace once (aiohttp's own: 8 s and more)
    assert h.call(_inflight(h)) == {}
    wait_for(lambda: s.metric("vllm:num_requests_running") == 0, 10, "the engine to abort the generation")


async def _inflight(h) -> dict:
    return {k: v for k, v in h.gateway.pools.inflight_by_job().items() if v}


def test_readyz_healthz_and_graceful_shutdown(harness, sims):
    h = harness(gateway="shutdown_grace_s: 20")
    with urllib.request.urlopen(h.base + "/healthz") as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(h.base + "/readyz")
    assert e.value.code == 503 and json.loads(e.value.read())["models_without_ready_replica"] == ["m"]
    s = sims(1, "--tokens-per-s", "10")[0]
    h.set_ready([s.backend()])
    assert urllib.request.urlopen(h.base + "/readyz").status == 200
    c = client(h)
    stream = c.completions.create(model="m", prompt="x", max_tokens=20, stream=True)
    first = next(iter(stream))
    took: list[float] = []
    stopper = threading.Thread(target=lambda: took.append(h.shutdown()))
    stopper.start()
    time.sleep(0.3)
    with pytest.raises(OSError):  # no longer accepting
        urllib.request.urlopen(h.base + "/healthz", timeout=2)
    rest = [ch.choices[0].text for ch in stream if ch.choices]
    stopper.join(30)
    assert len(rest) == 19 and first.choices[0].text.strip()  # the open stream finished
    assert took and took[0] < 20


@pytest.mark.parametrize("resumable", [True, False])
def test_the_engines_fingerprint_reaches_the_client_where_vllm_puts_it(harness, sims, resumable):
    """vLLM sends system_fingerprint on a whole answer, on a stream's last chunk, and on its usage chunk instead
    when the stream asked for usage.  The gateway asks every stream for usage and drops the chunk the client did
    not ask for, and a continued stream is rebuilt: the client never saw it on a stream (nor anywhere, continued)."""
    import hashlib
    h = harness()
    s = sims(1)[0]
    h.set_ready([s.backend()])
    c = client(h)
    fp = "vllm-0.0.0-" + hashlib.sha256(b"m").hexdigest()[:8]   # the simulator's, as vLLM's is its config's
    kw = {} if resumable else {"stop": ["never said"]}   # (stop strings: a stream that is not continued)
    assert c.completions.create(model="m", prompt="hi", max_tokens=3, **kw).system_fingerprint == fp
    for chat in (False, True):
        made = (c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          stream=True, **kw) if chat else
                c.completions.create(model="m", prompt="hi", max_tokens=3, stream=True, **kw))
        chunks = list(made)
        assert all(ch.choices for ch in chunks), chunks   # (no usage chunk: not asked for)
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].system_fingerprint == fp, chunks[-1]
        assert all(ch.system_fingerprint is None for ch in chunks[:-1])
    chunks = list(c.completions.create(model="m", prompt="hi", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 and chunks[-1].system_fingerprint == fp
    assert all(ch.system_fingerprint is None for ch in chunks[:-1])
