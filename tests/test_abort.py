"""vLLM's abort at its shutdown: on SIGTERM (``--shutdown-timeout 0``, its default) vLLM ends every request in
flight with ``finish_reason`` "abort" (a stream: that chunk, its usage, ``[DONE]``; a whole answer: a 200 with
the text so far) and a request added meanwhile gets nothing but the usage and ``[DONE]`` (a chat its role
chunk first).  The simulator does the same; the gateway takes it for the replica failure it is: a resumable
generation is continued on another replica, a whole answer not continued is retried there."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness, Sim
from orchestrator.config import ModelConfig
from orchestrator.gateway.resumeplan import plan
from orchestrator.gateway.stitch import Stitch

MODEL = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    resume: {max_migrations: 3, drain_grace_s: 0.5}
"""
CHAT = [{"role": "user", "content": "tell a story"}]


# -- the simulator, as vLLM ---------------------------------------------------------------------------------
def post(sim: Sim, path: str, body: dict):
    req = urllib.request.Request(sim.url + path, data=json.dumps({"model": "m", **body}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}"})
    return urllib.request.urlopen(req, timeout=30)


def events(r) -> list:
    """A stream's data objects, and "[DONE]"; read to its end."""
    return [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]"
            for e in r.read().decode().split("\n\n") if e.startswith("data: ")]


def read_some(r, n: int) -> bytes:
    """The first ``n`` events of a stream (the rest is left to read)."""
    got = b""
    while got.count(b"\n\n") < n:
        got += r.read1(4096)
    return got


@pytest.mark.parametrize("chat", [False, True])
def test_sigterm_ends_the_streams_in_flight_with_an_abort_chunk_then_exits(chat):
    sim = Sim("term", "--tokens-per-s", "20")
    try:
        body = {"max_tokens": 200, "stream": True, "return_token_ids": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, **({"messages": CHAT} if chat else {"prompt": "a story"})}
        r = post(sim, "/v1/chat/completions" if chat else "/v1/completions", body)
        head = read_some(r, 5)
        whole: list = []
        t = threading.Thread(target=lambda: whole.append(json.loads(post(sim, "/v1/completions", {
            "prompt": "another story", "max_tokens": 200, "ignore_eos": True, "return_token_ids": True}).read())))
        t.start()
        wait_for(lambda: sim.metric("vllm:num_requests_running") == 2, 10, "both requests running")
        time.sleep(0.3)
        os.kill(sim.proc.pid, signal.SIGTERM)
        got = [json.loads(e[6:]) for e in head.decode().split("\n\n") if e.startswith("data: ")] + events(r)
        t.join(10)
        assert sim.proc.wait(10) == 0
    finally:
        sim.stop()
    assert got[-1] == "[DONE]" and got[-2]["choices"] == []   # the usage chunk, then [DONE]
    last = got[-3]["choices"][0]
    assert last["finish_reason"] == "abort" and last["token_ids"] == []
    assert (last["delta"]["content"] if chat else last["text"]) == ""
    tokens = [t for c in got[:-3] for t in c["choices"][0].get("token_ids") or ()]
    assert 5 <= len(tokens) < 200 and got[-2]["usage"]["completion_tokens"] == len(tokens)
    assert all(c["choices"][0]["finish_reason"] is None for c in got[:-3])
    # the request not streamed: a 200 with the text so far, its finish_reason "abort"
    choice = whole[0]["choices"][0]
    assert choice["finish_reason"] == "abort" and 1 <= len(choice["token_ids"]) < 200
    assert whole[0]["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_a_request_added_while_it_shuts_down_is_aborted_at_once_and_the_drain_ends_in_aborts():
    """``--shutdown-timeout 3``: the requests in flight go on for 3 s, then are aborted; one added meanwhile is
    aborted at once, as vLLM's engine refuses it: a chat stream gets its role chunk, the usage and ``[DONE]``
    (no finish_reason at all), a completion stream the usage and ``[DONE]``, a whole answer "abort" and no text."""
    sim = Sim("drain", "--tokens-per-s", "20", "--shutdown-timeout", "3")
    try:
        r = post(sim, "/v1/completions", {"prompt": "a story", "max_tokens": 300, "stream": True,
                                          "ignore_eos": True})
        read_some(r, 3)
        t0 = time.monotonic()
        os.kill(sim.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        usage = {"stream_options": {"include_usage": True}, "stream": True, "return_token_ids": True}
        chat = events(post(sim, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, **usage}))
        comp = events(post(sim, "/v1/completions", {"prompt": "hi", "max_tokens": 5, **usage}))
        whole = json.loads(post(sim, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5}).read())
        rest = events(r)
        took = time.monotonic() - t0
        assert sim.proc.wait(10) == 0
    finally:
        sim.stop()
    assert [c["choices"][0]["delta"] for c in chat[:1]] == [{"role": "assistant", "content": ""}]
    assert chat[0]["prompt_token_ids"] and chat[1]["choices"] == [] and chat[1]["usage"]["completion_tokens"] == 0
    assert chat[2:] == ["[DONE]"]
    assert len(comp) == 2 and comp[0]["choices"] == [] and comp[0]["usage"]["completion_tokens"] == 0
    assert whole["choices"][0]["finish_reason"] == "abort" and whole["choices"][0]["message"]["content"] == ""
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert 2.9 < took < 6   # the drain's 3 s, then the abort


def test_the_abort_fault_aborts_the_requests_in_flight_and_the_simulator_goes_on():
    sim = Sim("fault", "--tokens-per-s", "20")
    try:
        r = post(sim, "/v1/completions", {"prompt": "a story", "max_tokens": 200, "stream": True,
                                          "ignore_eos": True})
        read_some(r, 3)
        sim.fault("abort")
        got = events(r)
        assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "abort"
        assert got[-2]["choices"][0]["text"] == "" and len(got) < 50
        after = json.loads(post(sim, "/v1/completions", {"prompt": "a story", "max_tokens": 5}).read())
        assert after["choices"][0]["finish_reason"] == "length" and sim.proc.poll() is None
    finally:
        sim.stop()


# -- the gateway --------------------------------------------------------------------------------------------
def test_an_abort_chunk_is_recorded_shown_without_its_finish_reason_and_ends_nothing():
    """An "abort" that carries a last token: the client gets the token, not the finish_reason; the generation
    is not over (the caller moves the rest), and the chunk of an abort with nothing in it is not shown."""
    m = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}})
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 9, "stream": True}, m)
    st = Stitch(spec)

    def ev(delta, ids, finish=None):
        ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{**ch, "stop_reason": None} if finish else ch]}
    shown = st.take({**ev({"role": "assistant", "content": ""}, None), "prompt_token_ids": [1, 2]}, False)
    shown += st.take(ev({"content": " a"}, [11]), False)
    assert not st.aborted
    shown += st.take(ev({"content": " b"}, [12], "abort"), False)   # (vLLM's last chunk has a stop_reason)
    assert st.aborted and st.finish is None and st.ids == [11, 12] and "".join(st.text) == " a b"
    assert [c["choices"][0]["delta"].get("content") for c in shown] == ["", " a", " b"]
    assert all(c["choices"][0]["finish_reason"] is None and "stop_reason" not in c["choices"][0] for c in shown)
    assert st.take(ev({"content": ""}, [], "abort"), True) == [] and st.finish is None
    assert st.continuation_body("m")["prompt"] == [1, 2, 11, 12]


@pytest.mark.parametrize("usage", [False, True])
def test_an_abort_on_the_last_token_ends_the_generation_with_length(usage):
    """An abort that carries the request's last token (vLLM shutting down just then) left nothing to continue:
    the stream ended with the error event of a generation that could not go on.  It is complete: it ends as vLLM
    ends it, ``finish_reason: length``, before the usage chunk when one was asked for."""
    m = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}})
    opts = {"stream_options": {"include_usage": True}} if usage else {}
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True, **opts}, m)
    st = Stitch(spec)

    def ev(text, ids, finish=None):
        return {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}]}
    st.take({**ev(" a", [11]), "prompt_token_ids": [1, 2]}, False)
    assert not st.ran_out()   # (one token more to come)
    st.take(ev(" b", [12], "abort"), False)
    assert st.aborted and st.ran_out() and st.finish == "length" and not st.ran_out()
    end = st.ending()
    assert end[0]["choices"][0]["finish_reason"] == "length" and end[0]["choices"][0]["text"] == ""
    assert len(end) == (2 if usage else 1)
    if usage:
        assert end[1]["choices"] == [] and end[1]["usage"]["completion_tokens"] == 2
    assert st.whole()["choices"][0]["finish_reason"] == "length"


def test_an_abort_on_the_last_token_of_the_context_ends_with_length():
    """A chat without max_tokens runs to its context's end: aborted on the token that fills it, there is nothing
    to continue (the continuation's prompt would fill the context: vLLM's 400)."""
    m = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}})
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": True}, m)
    st = Stitch(spec)
    st.take({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a"}, "token_ids": [11, 12],
                          "finish_reason": "abort"}]}, False)
    assert spec.max_tokens is None and not st.ran_out() and not st.ran_out(5) and st.ran_out(4)
    assert st.ending()[0]["choices"][0]["finish_reason"] == "length"


@pytest.fixture
def fleet(tmp_path):
    made: list = []

    def make(*args: str) -> tuple[Harness, list[Sim]]:
        h = Harness(tmp_path, MODEL, "queue_timeout_s: 5")
        made.append(h)
        sims = [Sim(f"r{i}", *args) for i in range(2)]
        made.extend(sims)
        h.route_to(sims)
        return h, sims

    yield make
    for x in made:
        (x.close if isinstance(x, Harness) else x.stop)()


def client(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key="x", max_retries=0, timeout=60)


def serving(sims: list[Sim]) -> Sim:
    return wait_for(lambda: next((s for s in sims if s.metric("vllm:num_requests_running") > 0), None), 10,
                    "a replica generating")


def create(h: Harness, chat: bool, n: int, **kw):
    c = client(h)
    kw = dict(model="m", max_tokens=n, temperature=0, extra_body={"ignore_eos": True}, **kw)
    return (c.chat.completions.create(messages=CHAT, **kw) if chat else
            c.completions.create(prompt="once upon a time", **kw))


def text_of(ch, chat: bool) -> str:
    return (ch.choices[0].delta.content if chat else ch.choices[0].text) or ""


def abort_during(sims: list[Sim], call, after_s: float) -> None:
    """``call`` in a thread; ``after_s`` after a replica began running it, that replica aborts; ``call``'s end."""
    t = threading.Thread(target=call)
    t.start()
    victim = serving(sims)
    time.sleep(after_s)
    victim.fault("abort")
    t.join(30)


@pytest.mark.parametrize("how", ["sigterm", "fault"])
@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_its_replica_aborts_is_continued_on_the_other(fleet, chat, how):
    """vLLM SIGTERMed (scancel, preemption, a time limit) ends the stream with finish_reason "abort", usage and
    [DONE]: the gateway took that for the end, and the client got a truncated answer ending "abort"."""
    h, sims = fleet("--tokens-per-s", "40")
    r = create(h, chat, 120)
    want = r.choices[0].message.content if chat else r.choices[0].text
    pieces, finishes, usage, victim = [], [], None, None
    for i, ch in enumerate(create(h, chat, 120, stream=True, stream_options={"include_usage": True})):
        usage = ch.usage or usage
        if ch.choices:
            pieces.append(text_of(ch, chat))
            finishes.append(ch.choices[0].finish_reason)
        if i == 17 and victim is None:
            victim = serving(sims)
            os.kill(victim.proc.pid, signal.SIGTERM) if how == "sigterm" else victim.fault("abort")
    assert victim is not None
    assert "".join(pieces) == want and [f for f in finishes if f] == ["length"]
    assert usage.completion_tokens == 120
    assert h.metric("slurmfleet_stream_migrations_total", model="m", cause="abort", outcome="ok") == 1
    if how == "sigterm":
        assert victim.proc.wait(10) == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_a_generation_aborted_before_its_first_token_is_served_by_the_other(fleet, chat, stream):
    """Aborted before a token, vLLM sends no chunk with a finish_reason (a chat its role chunk, then usage and
    [DONE]): the gateway ended the request there, with no text at all."""
    h, sims = fleet("--ttft-s", "1.5")
    want = create(h, chat, 5)
    want = want.choices[0].message.content if chat else want.choices[0].text
    result: list = []

    def one() -> None:
        r = create(h, chat, 5, stream=stream)
        if not stream:
            result.append((r.choices[0].message.content if chat else r.choices[0].text, r.choices[0].finish_reason))
            return
        chunks = [ch for ch in r if ch.choices]
        result.append(("".join(text_of(ch, chat) for ch in chunks),
                       [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason]))
    abort_during(sims, one, 0.3)   # admitted, its first token 1.2 s away
    assert result == [(want, ["length"] if stream else "length")]
    # continued from the prompt's ids where the replica sent them (a chat), else retried from scratch
    assert h.metric("slurmfleet_stream_migrations_total", model="m", cause="abort", outcome="ok") + h.metric(
        "slurmfleet_request_retries_total", model="m", reason="abort") == 1


def test_a_whole_answer_not_continued_that_its_replica_aborts_is_retried_on_the_other(fleet):
    """A request the gateway does not continue (``stop``), not streamed: vLLM's abort is a 200 whose choice ends
    "abort" with the text so far; the gateway handed that to the client as the answer."""
    h, sims = fleet("--tokens-per-s", "40")
    kw = dict(stop=["never said"])
    want = create(h, False, 80, **kw).choices[0].text
    result: list = []
    abort_during(sims, lambda: result.append(create(h, False, 80, **kw)), 0.5)
    r = result[0]
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 80
    assert h.metric("slurmfleet_request_retries_total", model="m", reason="abort") == 1


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_not_continued_that_its_replica_aborts_before_a_token_is_retried_on_the_other(fleet, chat):
    """A stream the gateway does not continue (``stop``), aborted before its first token: vLLM sends no chunk with
    a finish_reason (a chat its role chunk, then the usage and [DONE]); the gateway relayed that, and the client
    got a 200 with no text, no finish_reason and no error."""
    h, sims = fleet("--ttft-s", "1.5")
    kw = dict(stop=["never said"])
    want = create(h, chat, 5, **kw)
    want = want.choices[0].message.content if chat else want.choices[0].text
    result: list = []

    def one() -> None:
        chunks = list(create(h, chat, 5, stream=True, stream_options={"include_usage": True}, **kw))
        result.append(("".join(text_of(ch, chat) for ch in chunks if ch.choices),
                       [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
                       [ch.usage.completion_tokens for ch in chunks if ch.usage],
                       [ch.choices[0].delta.role for ch in chunks if chat and ch.choices and ch.choices[0].delta.role]))
    abort_during(sims, one, 0.3)   # admitted, its first token 1.2 s away
    assert result == [(want, ["length"], [5], ["assistant"] if chat else [])]   # one role chunk, one usage
    assert h.metric("slurmfleet_request_retries_total", model="m", reason="abort") == 1
    assert h.metric("slurmfleet_stream_migrations_total") == 0


def test_a_stream_not_continued_aborted_before_a_token_after_keep_alives_ends_in_an_error(fleet):
    """The same after the replica's keep-alives reached the client (its answer has begun: no retry into it): an
    error event ends it, which the openai SDK raises, not an empty [DONE]."""
    h, sims = fleet("--ttft-s", "3", "--sse-keep-alive-interval", "1")
    errors: list = []

    def one() -> None:
        try:
            list(create(h, True, 5, stream=True, stop=["never said"]))
        except openai.APIError as exc:
            errors.append(exc)
    abort_during(sims, one, 1.6)   # a keep-alive sent
    assert len(errors) == 1 and "failed mid-stream" in str(errors[0])
    assert h.metric("slurmfleet_stream_aborts_total", model="m", side="upstream") == 1
