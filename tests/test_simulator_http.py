"""The simulator's HTTP timing, as vLLM's: a stream's 200 and SSE headers go out once the request is rendered
(vLLM returns a ``StreamingResponse`` around an async generator that adds the request to the engine when first
read), before its wait in the queue, its prefill, or a hung engine; a request vLLM refuses still gets its 400.
``--sse-keep-alive-interval N`` (an integer, 0 off) sends ``: keep-alive`` comments on a stream idle N s."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, free_port, wait_for
from gateway_harness import Sim
from orchestrator.devtools.simulator import parse_args


def open_stream(sim: Sim, timeout: float = 30, **body) -> tuple[http.client.HTTPResponse, float]:
    """POST a completion; the response once its headers came, and how long they took."""
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=timeout)
    payload = {"model": "m", "prompt": "tell a story", **body}
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(payload),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}"})
    resp = conn.getresponse()
    return resp, time.monotonic() - t0


def lines(resp: http.client.HTTPResponse, t0: float) -> list[tuple[float, str]]:
    """Each non-empty line of a stream to its end, with when it came (s after ``t0``)."""
    out = []
    while line := resp.readline():
        if line.strip():
            out.append((time.monotonic() - t0, line.decode().strip()))
    return out


def test_a_streams_headers_go_out_before_its_wait_in_the_queue_and_its_prefill():
    sim = Sim("hdr", "--max-num-seqs", "1", "--tokens-per-s", "5", "--ttft-s", "0")
    try:
        busy = threading.Thread(target=lambda: open_stream(sim, max_tokens=25, ignore_eos=True, stream=True)[0].read())
        busy.start()   # holds the one slot about 5 s
        wait_for(lambda: sim.metric("vllm:num_requests_running") == 1, 15, "the first request running")
        resp, took = open_stream(sim, max_tokens=2, stream=True)
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
        assert took < 4 and sim.metric("vllm:num_requests_waiting") == 1   # queued, its headers already here
        data = [text for _, text in lines(resp, 0) if text.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) == 3
        busy.join(30)
    finally:
        sim.stop()
    sim = Sim("prefill", "--ttft-s", "5")
    try:
        resp, took = open_stream(sim, max_tokens=1, stream=True)
        got = lines(resp, time.monotonic() - took)
        assert resp.status == 200 and took < 4 and got[0][0] > 4   # the headers, then the first token
    finally:
        sim.stop()


@pytest.mark.parametrize("body", [{"max_tokens": 5000}, {"stream_options": "x"}, {"prompt": "a " * 40}])
def test_a_stream_vllm_refuses_is_still_a_400(body):
    sim = Sim("refused", "--num-gpu-blocks-override", "3")   # (2 usable blocks of 16 tokens: 40 never fit)
    try:
        resp, _ = open_stream(sim, **{"stream": True, **body})
        assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == 400
    finally:
        sim.stop()


def assert_hangs_after_headers(sim: Sim) -> None:
    resp, took = open_stream(sim, timeout=3, max_tokens=2, stream=True)
    assert resp.status == 200 and took < 2.5
    with pytest.raises(socket.timeout):   # no event ever
        resp.readline()
    with pytest.raises(socket.timeout):   # a whole answer: not even its headers
        open_stream(sim, timeout=3, max_tokens=2)


def hanging(sim: Sim) -> bool:
    """A stream's first event does not come within a second (a served one takes milliseconds)."""
    try:
        resp, _ = open_stream(sim, timeout=1.0, max_tokens=2, stream=True)
        resp.readline()
        return False
    except socket.timeout:
        return True


def test_a_hung_engine_answers_a_streams_headers_and_then_nothing():
    sim = Sim("hang", "--fault", "hang")
    try:
        assert_hangs_after_headers(sim)
    finally:
        sim.stop()


def test_a_head_whose_worker_is_lost_answers_a_streams_headers_and_then_nothing():
    master = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "orchestrator.devtools.simulator", "--headless", "--nnodes", "2",
                               "--node-rank", "1", "--master-port", str(master)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    head = Sim("head", "--nnodes", "2", "--master-port", str(master))
    try:
        resp, _ = open_stream(head, max_tokens=2, stream=True)
        assert [t for _, t in lines(resp, 0)][-1] == "data: [DONE]"   # both ranks there: it serves
        worker.kill()
        worker.wait()
        wait_for(lambda: hanging(head), 15, "the head to see its worker's connection close")
        assert_hangs_after_headers(head)
    finally:
        worker.kill()
        head.stop()


def test_keep_alive_comments_fill_a_streams_silences_only_with_the_flag():
    sim = Sim("ka", "--ttft-s", "2.5", "--sse-keep-alive-interval", "1")
    try:
        resp, took = open_stream(sim, max_tokens=3, stream=True)
        got = lines(resp, time.monotonic() - took)
        first = next(i for i, (_, text) in enumerate(got) if text.startswith("data: "))
        assert [text for _, text in got[:first]] == [": keep-alive", ": keep-alive"]   # at about 1 s and 2 s
        assert 0.8 < got[0][0] < 2.3 and got[first][0] > 2.3
        assert not any(text.startswith(":") for _, text in got[first:])   # 200 tokens/s: no silence of 1 s
    finally:
        sim.stop()
    sim = Sim("ka-hang", "--fault", "hang", "--sse-keep-alive-interval", "1")
    try:   # a hung engine's stream: vLLM's API server goes on sending them
        resp, _ = open_stream(sim, timeout=5, max_tokens=2, stream=True)
        assert [resp.readline(), resp.readline(), resp.readline()] == [b": keep-alive\n", b"\n", b": keep-alive\n"]
    finally:
        sim.stop()
    sim = Sim("no-ka", "--ttft-s", "2.5")
    try:
        resp, _ = open_stream(sim, max_tokens=3, stream=True)
        assert all(text.startswith("data: ") for _, text in lines(resp, 0))
    finally:
        sim.stop()


def test_the_keep_alive_interval_is_vllms_integer():
    assert parse_args([]).sse_keep_alive_interval == 0
    assert parse_args(["--sse-keep-alive-interval", "5"]).sse_keep_alive_interval == 5
    for bad in ("0.2", "-1"):   # vLLM's argparse (int), its check of the parsed value
        with pytest.raises(SystemExit):
            parse_args(["--sse-keep-alive-interval", bad])


def post(sim: Sim, body: dict, headers: dict | None = None, path: str = "/v1/completions") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                 "Authorization": f"Bearer {sim.secret}", **(headers or {})})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_ids_model_names_and_refusals_as_vllm_answers_them():
    # each expectation is what `vllm serve --served-model-name a b` (0.32, the tiny model) answered
    sim = Sim("names", "--served-model-name", "b", served="a")   # (the flag extends: a, b)
    try:
        status, r = post(sim, {"model": "b", "prompt": "hello there", "max_tokens": 2}, {"X-Request-Id": "myid1"})
        assert status == 200 and r["id"] == "cmpl-myid1" and r["model"] == "a"   # the first served name
        status, r = post(sim, {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                               "request_id": "body-id"}, path="/v1/chat/completions")
        assert r["id"] == "chatcmpl-body-id"
        # the same id twice at once is two requests (the id is not the engine's key)
        both = [post(sim, {"model": "a", "prompt": "x", "max_tokens": 2}, {"X-Request-Id": "dup"}) for _ in range(2)]
        assert [s for s, _ in both] == [200, 200]
        status, r = post(sim, {"prompt": "hello", "max_tokens": 2})   # no model: vLLM serves it
        assert status == 200 and r["model"] == "a" and r["usage"]["completion_tokens"] == 2
        assert post(sim, {"model": "zz", "prompt": "x", "max_tokens": 2}) == (404, {"error": {
            "message": "The model `zz` does not exist. Valid aliases: a, b.", "type": "NotFoundError",
            "param": "model", "code": 404}})
        assert post(sim, {"model": "a", "prompt": "", "max_tokens": 2}) == (400, {"error": {
            "message": "Either prompt or prompt_embeds must be provided and non-empty.", "type": "BadRequestError",
            "param": "prompt", "code": 400}})
        status, r = post(sim, {"model": "a", "prompt": "x", "max_tokens": 2, "min_tokens": 5})
        assert status == 400 and r["error"]["message"] == "min_tokens must be less than or equal to max_tokens=2, got 5."
        # vLLM's generation routes read application/json only (validate_json_request): none, or another, is a 400
        for ctype in (None, "text/plain", "application/vnd.api+json"):
            conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": "a", "prompt": "x", "max_tokens": 2}),
                         {"Authorization": f"Bearer {sim.secret}", **({"Content-Type": ctype} if ctype else {})})
            resp = conn.getresponse()
            assert (resp.status, json.loads(resp.read())) == (400, {"error": {
                "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "type": "Bad Request", "param": None, "code": 400}}), ctype
        assert post(sim, {"model": "a", "prompt": "x", "max_tokens": 2},
                    {"Content-Type": "Application/JSON; charset=utf-8"})[0] == 200
        # no such path, or not that method: FastAPI's own JSON (Starlette's router raises its HTTPException, which
        # vLLM's handler of FastAPI's does not take: real vLLM 0.32 answers {"detail": "Not Found"})
        assert post(sim, {"model": "a"}, path="/v1/foo") == (404, {"detail": "Not Found"})
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        conn.request("GET", "/v1/chat/completions", headers={"Authorization": f"Bearer {sim.secret}"})
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read()), resp.getheader("Allow")) == (
            405, {"detail": "Method Not Allowed"}, "POST")
    finally:
        sim.stop()


def streamed(sim: Sim, body: dict, path: str = "/v1/completions") -> tuple[str, list[dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}"})
    chunks = [json.loads(x[6:]) for x in conn.getresponse().read().decode().split("\n\n")
              if x.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or "" for ch in choices), choices


def test_stop_strings_and_stop_token_ids_end_a_generation_as_vllm_ends_it():
    """``stop`` and ``stop_token_ids`` were ignored: the text ran on past the stop to max_tokens, "length".
    vLLM's rules: the earliest completed stop string ends it, the text cut before it (after it with
    include_stop_str_in_output), finish_reason "stop" and stop_reason the string; a stop token id ends it
    without its text, stop_reason the id; a stream's text is the whole answer's."""
    sim = Sim("stops")
    try:
        base = {"model": "m", "prompt": "tell a story", "max_tokens": 30, "ignore_eos": True,
                "return_token_ids": True}
        status, r = post(sim, base)
        full, ids = r["choices"][0]["text"], r["choices"][0]["token_ids"]
        assert status == 200 and len(ids) == 30 and r["choices"][0]["finish_reason"] == "length"
        stop = full[len(full) // 2:len(full) // 2 + 4]
        at = full.find(stop)
        for include, text in ((False, full[:at]), (True, full[:at + len(stop)])):
            status, r = post(sim, {**base, "stop": ["never said", stop], "include_stop_str_in_output": include})
            ch = r["choices"][0]
            assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (text, "stop", stop), include
            assert r["usage"]["completion_tokens"] == len(ch["token_ids"]) < 30
            assert full.startswith(ch["text"]) and ids[:len(ch["token_ids"])] == ch["token_ids"]
            got, choices = streamed(sim, {**base, "stop": ["never said", stop], "include_stop_str_in_output": include})
            assert got == text and (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("stop", stop)
        tok = ids[5]
        status, r = post(sim, {**base, "stop_token_ids": [tok]})
        ch = r["choices"][0]
        n = ids.index(tok) + 1
        assert (ch["finish_reason"], ch["stop_reason"], ch["token_ids"]) == ("stop", tok, ids[:n])
        _, chat = post(sim, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                             "ignore_eos": True, "stop": stop}, path="/v1/chat/completions")
        got, choices = streamed(sim, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 30, "ignore_eos": True, "stop": stop}, "/v1/chat/completions")
        assert got == chat["choices"][0]["message"]["content"] and choices[-1]["finish_reason"] == \
            chat["choices"][0]["finish_reason"]
        assert post(sim, {**base, "stop": 3})[0] == 400 and post(sim, {**base, "stop_token_ids": ["x"]})[0] == 400
    finally:
        sim.stop()


def test_the_context_length_is_the_flags_else_the_models_config_as_vllm_derives_it(tmp_path):
    """`--max-model-len` was dropped (the simulator said 4096 whatever a fleet's vllm_args asked), and a model
    folder's config.json (the tiny model's 2048) was not read as vLLM reads it."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 100}))
    for args, want in ((["--max-model-len", "64"], 64), ([str(tmp_path)], 100),
                       ([str(tmp_path), "--max-model-len", "80"], 80)):
        sim = Sim("len", *args)
        try:
            models = json.loads(sim.get("/v1/models"))["data"]
            assert [m["max_model_len"] for m in models] == [want], args
            status, r = post(sim, {"model": "m", "prompt": [1] * (want - 4), "max_tokens": 4, "ignore_eos": True})
            assert status == 200 and r["usage"]["completion_tokens"] == 4, r
            status, r = post(sim, {"model": "m", "prompt": [1] * (want - 4), "max_tokens": 5, "ignore_eos": True})
            assert status == 200 and r["usage"]["completion_tokens"] == 4, r   # (cut to the context left)
            status, r = post(sim, {"model": "m", "prompt": [1, 2], "max_tokens": want + 1})
            assert status == 400 and f"cannot be greater than max_model_len={want}" in r["error"]["message"], r
            status, r = post(sim, {"model": "m", "prompt": [1] * want, "max_tokens": 1})
            assert status == 400 and f"maximum context length ({want})" in r["error"]["message"], r
        finally:
            sim.stop()
