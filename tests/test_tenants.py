"""Named API keys at the gateway, with the openai SDK as the client and simulator replicas: limits and their
429s, the models a key may use, token counting from the replicas' usage (and the usage chunk the client
did not ask for taken out of its stream), and the fleet's usage ledger fed from the gateway's reports."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import metric_sum, wait_for
from gateway_harness import Harness, Sim, read_stream_and_leave
from orchestrator.fleet.usagequery import key_usage, query
from orchestrator.observability.metrics import Metrics

MODELS = """\
  - name: m
    engine: simulator
    container: {{enabled: false}}
    resume: {{enabled: {resume}}}
  - name: m2
    engine: simulator
    container: {{enabled: false}}
"""
KEYS = """\
api_keys:
  - {name: alice, key: sk-alice, group: nlp, rpm: 3}
  - {name: bob, key: sk-bob, group: nlp, models: [m]}
  - {name: carol, key: sk-carol, budget_tokens: 40, budget_period: day}
"""


@pytest.fixture
def gw(tmp_path):
    made: list = []

    def make(resume: bool = True, keys: str = KEYS) -> tuple[Harness, Sim]:
        h = Harness(tmp_path, MODELS.format(resume=str(resume).lower()), keys)
        sim = Sim("t0")
        made.extend([h, sim])
        h.route_to([sim])
        return h, sim
    yield make
    for x in made:
        (x.close if isinstance(x, Harness) else x.stop)()


def client(h: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0)


def test_a_stream_flag_that_is_not_a_boolean_is_refused(gw):
    h, _ = gw()
    with pytest.raises(openai.BadRequestError) as e:   # vLLM would stream on 1 with no usage chunk: unmetered
        client(h, "sk-bob").completions.create(model="m", prompt="x", max_tokens=20, extra_body={"stream": 1})
    assert "`stream` must be a boolean" in str(e.value)


@pytest.mark.parametrize("resume", [True, False])
def test_tokens_are_counted_from_the_replicas_usage_and_the_extra_chunk_never_shows(gw, resume):
    h, sim = gw(resume)
    c = client(h, "sk-bob")
    chunks = list(c.completions.create(model="m", prompt="one two three", max_tokens=5, stream=True))
    assert chunks and all(ch.usage is None for ch in chunks)          # the client did not ask for usage
    asked = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}],
                                           max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4
    whole = c.completions.create(model="m", prompt="x y", max_tokens=3)
    assert whole.usage.completion_tokens == 3
    h.tenancy_tick(flush=True)
    rows = query(h.tmp / "usage.sqlite3", 0, time.time() + 3600, ["key", "model"])
    bob = [r for r in rows if r["key"] == "bob"]
    assert len(bob) == 1 and bob[0]["model"] == "m" and bob[0]["requests"] == 3
    # exactly the replica's own counters
    assert bob[0]["prompt_tokens"] == sim.metric("vllm:prompt_tokens_total")
    assert bob[0]["completion_tokens"] == sim.metric("vllm:generation_tokens_total") == 5 + 4 + 3


def test_rpm_limit_gives_openai_429_with_retry_after_and_ratelimit_headers(gw):
    h, _ = gw()
    c = client(h, "sk-alice")
    h.tenancy_tick()
    for _ in range(3):
        r = c.completions.with_raw_response.create(model="m", prompt="x", max_tokens=1)
        assert r.headers["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="m", prompt="x", max_tokens=1)
    err = e.value
    assert err.status_code == 429 and err.body["type"] == "requests" and err.body["code"] == "rate_limit_exceeded"
    assert "requests per minute" in err.body["message"] and "alice" in err.body["message"]
    h.tenancy_tick()   # the fleet's view: nothing left in the window
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="m", prompt="x", max_tokens=1)
    hdr = e.value.response.headers
    assert 50 <= int(hdr["Retry-After"]) <= 60           # the window frees its first request in about a minute
    assert hdr["x-ratelimit-remaining-requests"] == "0" and hdr["x-ratelimit-reset-requests"].endswith("s")
    # in the gateway's counters a key's refusals are the slot "refused": no activity of the model (the autoscaler
    # does not keep a replica for a client that retries on a spent limit)
    counts = {tuple(k): n for k, n in h.gateway.report().stats["requests"]}
    assert counts[("m", "429", "refused")] == 2 and ("m", "429", "none") not in counts
    # another key is not affected
    assert client(h, "sk-bob").completions.create(model="m", prompt="x", max_tokens=1).choices


def test_a_restarted_daemon_keeps_the_minute_a_key_already_used(gw):
    """The rpm window outlives its daemon: what a key used in the last minute is written with the usage ledger's
    counters, and the next daemon's gateway refuses what the window has no room for (a restart is no new minute)."""
    h, _ = gw()
    h.tenancy_tick()
    for _ in range(3):
        client(h, "sk-alice").completions.create(model="m", prompt="x", max_tokens=1)
    h.tenancy_tick(flush=True)   # (then killed: nothing more written)
    after, _ = gw()   # the next daemon, on the same state directory
    after.tenancy_tick()
    with pytest.raises(openai.RateLimitError) as e:
        client(after, "sk-alice").completions.create(model="m", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded" and 50 <= int(e.value.response.headers["Retry-After"]) <= 60
    assert client(after, "sk-bob").completions.create(model="m", prompt="x", max_tokens=1).choices


def test_a_key_sees_and_uses_only_its_models_and_bad_keys_get_401(gw):
    h, _ = gw()
    bob = client(h, "sk-bob")
    assert [m.id for m in bob.models.list().data] == ["m"]
    with pytest.raises(openai.NotFoundError) as e:
        bob.completions.create(model="m2", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    # a model it may not use and one that does not exist get the same answer: a key learns no other model's name
    with pytest.raises(openai.NotFoundError) as unknown:
        bob.completions.create(model="m3", prompt="x", max_tokens=1)
    assert unknown.value.body["message"] == e.value.body["message"].replace("m2", "m3")
    for name in ("m2", "m3"):   # nor through the order of the checks: a bad `stream` told an existing model apart
        with pytest.raises(openai.NotFoundError) as e:
            bob.completions.create(model=name, prompt="x", max_tokens=1, extra_body={"stream": "yes"})
        assert e.value.body["code"] == "model_not_found"
    for name in ("m2", "m3"):
        with pytest.raises(openai.NotFoundError) as e:
            bob.models.retrieve(name)
        assert e.value.body["message"] == f"The model `{name}` does not exist or you do not have access to it."
    assert sorted(m.id for m in client(h, "sk-alice").models.list().data) == ["m", "m2"]
    with pytest.raises(openai.AuthenticationError):
        client(h, "sk-nobody").completions.create(model="m", prompt="x", max_tokens=1)
    # a key whose bytes are not UTF-8 is a wrong key, a 401: it was a 500 (its digest raised), retried by the SDK
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(h.base)
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.putrequest(method, path)
        conn.putheader("Authorization", b"Bearer \xff\xfe")
        conn.putheader("Content-Type", "application/json")
        body = b'{"model": "m", "prompt": "x", "max_tokens": 1}' if method == "POST" else b""
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key", (path, r.status)
        conn.close()


def test_readyz_names_the_models_without_a_ready_replica_only_to_a_key_that_may_use_them(gw):
    """/readyz needs no key: its status code is for health checkers, and the names it gave told anyone which
    models exist (those scaled to zero or down), which keys limited to some models are otherwise kept from."""
    import json
    import urllib.error
    import urllib.request
    h, _ = gw()   # m has a READY replica, m2 none

    def readyz(key: str | None) -> tuple[int, dict]:
        req = urllib.request.Request(h.base + "/readyz", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    assert readyz(None) == (503, {"status": "not ready", "shutting_down": False})
    assert readyz("sk-nobody") == (503, {"status": "not ready", "shutting_down": False})
    assert readyz("sk-bob")[1]["models_without_ready_replica"] == []   # (m only)
    assert readyz("sk-alice") == (503, {"status": "not ready", "shutting_down": False,
                                        "models_without_ready_replica": ["m2"]})


def test_budget_exhaustion_is_insufficient_quota_until_the_period_ends(gw):
    h, _ = gw()
    now = [time.time()]
    h.tenancy.wall = h.tenancy.ledger.clock = lambda: now[0]   # the fleet's calendar, moved by the test
    c = client(h, "sk-carol")
    day_end = (now[0] // 86400 + 1) * 86400

    def left(key: str):   # on the loop's thread, as the batch runner asks (the ledger's sqlite lives there)
        async def ask():
            return h.tenancy.budget_left(key)
        return h.call(ask())
    assert left("carol") == (40, day_end) and left("alice") is None
    c.completions.create(model="m", prompt="a b c d e", max_tokens=38)   # 38 + the prompt's 5 tokens > 40
    h.tenancy_tick()
    assert left("carol") == (40 - 43, day_end)   # what a dedicated batch of carol's goes by

    def budget_series() -> dict:   # /metrics as the daemon wires it (its usage ledger: on the loop's thread)
        async def render():
            return Metrics(key_usage=lambda: key_usage(h.tenancy.ledger, [], h.tenancy.groups,
                                                       h.tenancy.budgets)).render().decode()
        text = h.call(render())
        return {name: metric_sum(text, f"slurmfleet_key_budget_{name}", key="carol")
                for name in ("tokens", "used_tokens", "reset_timestamp_seconds")} | {
            "others": sum(metric_sum(text, "slurmfleet_key_budget_tokens", key=k) for k in ("alice", "bob"))}
    assert budget_series() == {"tokens": 40, "used_tokens": 43, "reset_timestamp_seconds": day_end, "others": 0}
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert e.value.body["type"] == "insufficient_quota"
    assert e.value.response.headers["x-should-retry"] == "false"   # (the SDK retried twice, past a day's wait)
    retry = int(e.value.response.headers["Retry-After"])
    assert 0 < retry <= 86400 and abs(retry - (86400 - now[0] % 86400)) < 5   # the next UTC day
    now[0] += retry + 1    # the next day: a new budget
    h.tenancy_tick()
    assert left("carol") == (40, day_end + 86400)
    assert budget_series() == {"tokens": 40, "used_tokens": 0, "reset_timestamp_seconds": day_end + 86400,
                               "others": 0}
    assert c.completions.create(model="m", prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_a_new_gateway_process_refuses_a_spent_budget_before_its_first_allowance(gw):
    """A worker that starts (or restarts) has no allowance of its own until the fleet has its first report; the
    routing table it starts from says which keys' budgets are spent, so it refuses them from its first request
    (before, a budget-only key was admitted unchecked until then)."""
    from orchestrator.gateway.tenants import Tenants
    h, _ = gw()
    client(h, "sk-carol").completions.create(model="m", prompt="a b c d e", max_tokens=38)   # 43 > 40
    h.tenancy_tick()
    table = h.publisher.table
    assert set(table.budgets_spent) == {"carol"} and time.time() < table.budgets_spent["carol"] <= time.time() + 86400
    fresh = Tenants(h.cfg.gateway, 0, "a-new-incarnation", h.gateway.pools.names)
    fresh.apply(table)   # the table's allowances are another incarnation's: none is its own
    carol, bob = fresh.by_name["carol"], fresh.by_name["bob"]
    assert carol.allow is None
    refused = fresh.admit(carol, "m", {"model": "m"})
    assert refused is not None and refused.status == 429 and b"insufficient_quota" in refused.body
    assert 0 < int(refused.headers["Retry-After"]) <= 86400
    assert fresh.budget_refusal(carol) is not None   # (a batch of carol's is refused there too)
    assert fresh.admit(bob, "m", {"model": "m"}) is None   # a key without a budget: admitted


def test_a_budget_a_reload_removes_no_longer_holds_the_keys_batch_lines(gw):
    """A key's spent budget, then a reload that takes the budget away: its batch lines run again (the spent
    allowance stayed with the key, so the runner's lines for it got 429 insufficient_quota until expiry)."""
    h, _ = gw()

    def reload(text: str) -> None:   # with the fleet's batch runner key, "runner-secret", as the daemon wires it
        h.reload(text)
        h.cfg.gateway._batch_key = "runner-secret"
        h.call(asyncio.sleep(0))
        h.gateway.set_config(h.cfg)
    reload(h.text)
    runner = client(h, "runner-secret")

    def line():
        return runner.completions.create(model="m", prompt="x", max_tokens=1,
                                         extra_headers={"x-slurmfleet-batch-owner": "carol"})
    client(h, "sk-carol").completions.create(model="m", prompt="a b c d e", max_tokens=38)   # 43 > 40
    h.tenancy_tick()
    with pytest.raises(openai.RateLimitError):
        line()
    reload(h.text.replace(", budget_tokens: 40, budget_period: day", ""))
    h.tenancy_tick()
    assert line().usage.completion_tokens == 1


def test_a_reload_that_takes_the_last_limit_away_frees_a_spent_budgets_batch_lines(tmp_path):
    """As above with carol's budget the only limit of the fleet: the tables after the reload carry no allowance at
    all, and the one that said her budget was spent no longer holds."""
    h = Harness(tmp_path, MODELS.format(resume="false"), KEYS.replace(", rpm: 3", ""))
    sim = Sim("t0")
    try:
        h.route_to([sim])
        h.cfg.gateway._batch_key = "runner-secret"
        h.gateway.set_config(h.cfg)

        def line():
            return client(h, "runner-secret").completions.create(
                model="m", prompt="x", max_tokens=1, extra_headers={"x-slurmfleet-batch-owner": "carol"})
        client(h, "sk-carol").completions.create(model="m", prompt="a b c d e", max_tokens=38)   # 43 > 40
        h.tenancy_tick()
        assert set(h.publisher.table.budgets_spent) == {"carol"}
        with pytest.raises(openai.RateLimitError):
            line()
        h.reload(h.text.replace(", budget_tokens: 40, budget_period: day", ""))
        h.cfg.gateway._batch_key = "runner-secret"
        h.call(asyncio.sleep(0))
        h.gateway.set_config(h.cfg)
        h.tenancy_tick()
        assert not h.publisher.table.allowances and not h.publisher.table.budgets_spent
        assert line().usage.completion_tokens == 1
    finally:
        h.close()
        sim.stop()


def test_the_keys_class_is_the_engines_priority_and_a_client_cannot_raise_it(tmp_path):
    import json
    from orchestrator.gateway.headers import HOP_BYTES
    h = Harness(tmp_path, "  - name: m\n    engine: simulator\n    container: {enabled: false}\n"
                          "    scheduling_policy: priority\n",
                "api_keys:\n  - {name: vip, key: sk-vip, priority: high}\n  - {name: bulk, key: sk-bulk, priority: low}\n")
    sim = Sim("p0", "--scheduling-policy", "priority")
    try:
        h.route_to([sim])
        seen = []
        for key, asked in (("sk-vip", None), ("sk-bulk", None), ("sk-bulk", -100), ("sk-vip", 5)):
            extra = {} if asked is None else {"priority": asked}
            client(h, key).completions.create(model="m", prompt="x", max_tokens=1, extra_body=extra,
                                              extra_headers={"X-Vllm-Priority": "-100"})
            seen.append(json.loads(sim.get("/sim/last_body"))["priority"])
        # high = 0, low = 2; a client may ask for a lower priority (a larger value), never a higher one
        assert seen == [0, 2, 2, 5]
        assert b"x-vllm-priority" in HOP_BYTES   # vLLM would take the header over the body: it never passes
    finally:
        h.close()
        sim.stop()


def test_a_reload_changes_limits_without_dropping_a_request_or_a_count(gw):
    h, _ = gw()
    c = client(h, "sk-alice")
    stream = c.completions.create(model="m", prompt="x", max_tokens=300, stream=True)   # about 1.5 s
    first = next(iter(stream))
    h.reload(h.text.replace("rpm: 3}", "rpm: 5}"))          # alice may now send 5 a minute
    rest = [ch for ch in stream if ch.choices]
    assert first.choices and len(rest) == 299                 # the open stream finished
    for _ in range(4):                                        # 1 + 4 = 5: the count from before the reload kept
        c.completions.create(model="m", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="m", prompt="x", max_tokens=1)
    assert h.gateway.tenants.by_name["alice"].requests == 5


def test_a_reload_that_raises_a_spent_limit_says_ask_again_in_a_second_until_its_table(gw):
    """After a reload that raises a spent rpm (or budget), the allowance of the old limits still holds until the
    fleet's next table (about half a second): its refusal said the old window's wait (Retry-After: 60, which the
    openai SDK waits out; for a budget, the period's end with x-should-retry: false) and "0 remaining" of the
    new limit.  Found by a soak."""
    keys = KEYS.replace("budget_tokens: 40", "budget_tokens: 5")
    h, _ = gw(keys=keys)
    alice, carol = client(h, "sk-alice"), client(h, "sk-carol")
    h.tenancy_tick()
    for _ in range(3):
        alice.completions.create(model="m", prompt="x", max_tokens=1)
    carol.completions.create(model="m", prompt="a b c", max_tokens=4)   # more than its budget of 5
    h.tenancy_tick()   # the fleet's view: alice's window full, carol's budget spent
    day_end = lambda: 86400 - time.time() % 86400   # (the budget's period: the UTC day; in its last hour the wait
    # was under the hour this test once asked for)
    for c, wait in ((alice, lambda s: 50 <= s <= 60), (carol, lambda s: abs(s - day_end()) <= 5)):
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="m", prompt="x", max_tokens=1)
        assert wait(int(e.value.response.headers["Retry-After"])), e.value.response.headers
    h.reload(h.text.replace("rpm: 3}", "rpm: 100}").replace("budget_tokens: 5", "budget_tokens: 1000"))
    with pytest.raises(openai.RateLimitError) as e:   # the old allowance's cap, until the table: ask again soon
        alice.completions.create(model="m", prompt="x", max_tokens=1)
    hdr = e.value.response.headers
    assert hdr["Retry-After"] == "1" and hdr["x-ratelimit-limit-requests"] == "100", hdr
    assert "x-ratelimit-remaining-requests" not in hdr   # (the old allowance's 0 is not the new limit's)
    with pytest.raises(openai.RateLimitError) as e:
        carol.completions.create(model="m", prompt="x", max_tokens=1)
    assert e.value.response.headers["Retry-After"] == "1" and "x-should-retry" not in e.value.response.headers
    h.tenancy_tick()   # the table with the new limits' allowances
    r = alice.completions.with_raw_response.create(model="m", prompt="x", max_tokens=1)
    assert r.headers["x-ratelimit-remaining-requests"] == "96"
    assert carol.completions.create(model="m", prompt="x", max_tokens=1).choices


def test_requests_open_across_a_reload_end_on_the_keys_counters(gw):
    """A request holds its key's tenant from arrival to end: a reload during it must not leave its concurrency
    taken for ever (the key was refused with 429 'in flight' until a restart) nor lose its tokens."""
    h, _ = gw(keys="api_keys:\n  - {name: erin, key: sk-erin, max_concurrent: 2, tpm: 100000}\n")
    c = client(h, "sk-erin")
    s1 = c.completions.create(model="m", prompt="x", max_tokens=100, stream=True)
    s2 = c.completions.create(model="m", prompt="x", max_tokens=100, stream=True)
    next(iter(s1)), next(iter(s2))
    h.reload(h.text.replace("tpm: 100000", "tpm: 100001"))   # any reload
    list(s1), list(s2)
    t = h.gateway.tenants.by_name["erin"]
    wait_for(lambda: t.inflight == 0, 10, "both requests to end in the gateway")   # (after the client's last byte)
    assert t.tokens >= 200 and t.tpm == 100001
    c.completions.create(model="m", prompt="x", max_tokens=1)   # not refused: nothing is in flight


def test_a_key_a_reload_removes_mid_request_keeps_its_usage_and_gets_its_counters_back(gw):
    """A request whose key a reload revokes finishes on the key's tenant: its tokens reach the ledger (they
    were lost: the report walked only the keys configured now), and a key that comes back by a later reload
    goes on from its counters (a fresh tenant under the same name would read as a counter that went back)."""
    h, _ = gw(keys="api_keys:\n  - {name: alice, key: sk-alice}\n  - {name: bob, key: sk-bob}\n")
    s = client(h, "sk-alice").completions.create(model="m", prompt="x", max_tokens=100, stream=True)
    next(iter(s))
    h.tenancy_tick(flush=True)
    with_alice = h.text
    h.reload(with_alice.replace("  - {name: alice, key: sk-alice}\n", ""))
    assert len(list(s)) >= 99 and "alice" not in h.gateway.tenants.by_name
    t = h.gateway.tenants.retired["alice"]
    wait_for(lambda: t.inflight == 0, 10, "the request to end in the gateway")
    h.tenancy_tick(flush=True)

    def alice() -> list[dict]:
        return [r for r in query(h.tmp / "usage.sqlite3", 0, time.time() + 3600, ["key"]) if r["key"] == "alice"]
    assert [(r["requests"], r["completion_tokens"]) for r in alice()] == [(1, 100)]
    with pytest.raises(openai.AuthenticationError):
        client(h, "sk-alice").completions.create(model="m", prompt="x", max_tokens=1)
    h.reload(with_alice)
    assert h.gateway.tenants.by_name["alice"] is t and "alice" not in h.gateway.tenants.retired
    client(h, "sk-alice").completions.create(model="m", prompt="x", max_tokens=5)
    h.tenancy_tick(flush=True)
    assert [(r["requests"], r["completion_tokens"]) for r in alice()] == [(2, 105)]


def test_a_client_that_leaves_a_stream_is_charged_what_it_was_sent(gw):
    """A stream that cannot be continued (logprobs) ends without its usage chunk when the client leaves: its key
    is charged a token for each event it was sent, not nothing (a way round tpm and budgets), and its prompt as
    the replica's /tokenize counts it (a long prompt read for one chunk cost its prefill)."""
    import json
    import urllib.request
    h, sim = gw()
    msgs = [{"role": "user", "content": "a long question " * 200}]
    read_stream_and_leave(h, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 2000,
                          "stream": True, "logprobs": True}, lambda got: got.count(b"data:") >= 30)
    t = h.gateway.tenants.by_name["bob"]
    wait_for(lambda: t.inflight == 0, 10, "the request to end")
    req = urllib.request.Request(sim.url + "/tokenize", data=json.dumps({"model": "m", "messages": msgs}).encode(),
                                 headers={"Authorization": f"Bearer {sim.secret}", "Content-Type": "application/json"})
    prompt = json.loads(urllib.request.urlopen(req, timeout=10).read())["count"]
    wait_for(lambda: t.usage["m"][1] == prompt > 600, 10, "the prompt charged")
    out = t.usage["m"][2]
    assert 30 <= out < 2000 and t.usage["m"][0] == 1 and t.tokens == prompt + out   # (about 10 s, aborted)


@pytest.mark.parametrize("form", ["texts", "ids"])
def test_a_prompt_given_as_a_list_is_charged_when_its_client_leaves_the_stream(gw, form):
    """Only a text or a flat list of ids was counted: `prompt: ["..."]` or `[[ids]]`, a stream read for a few
    events and left, paid its events alone (600 tokens prefilled, 5 charged)."""
    h, sim = gw()
    text = "a long question " * 200
    req = urllib.request.Request(sim.url + "/tokenize", data=json.dumps({"model": "m", "prompt": text}).encode(),
                                 headers={"Authorization": f"Bearer {sim.secret}", "Content-Type": "application/json"})
    tokens = json.loads(urllib.request.urlopen(req, timeout=10).read())["tokens"]
    prompt = [text] if form == "texts" else [tokens]   # (the simulator, as vLLM for a stream, takes one prompt)
    want = len(tokens)
    read_stream_and_leave(h, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2000, "stream": True,
                          "logprobs": 1}, lambda got: got.count(b"data:") >= 10)
    t = h.gateway.tenants.by_name["bob"]
    wait_for(lambda: t.inflight == 0 and t.usage["m"][1] > 0, 10, "the prompt charged")
    assert t.usage["m"][1] == want >= 600, (t.usage, want)


def test_a_resumable_request_left_before_its_first_token_is_charged_its_prompt(tmp_path):
    """With resume on (the default, streamed or not), a client that left during the prefill paid nothing: the
    prompt's count came only with the first event; without resume it paid the prompt."""
    import socket
    h = Harness(tmp_path, MODELS.format(resume="true"), KEYS)
    sim = Sim("slow", "--prefill-s-per-token", "0.01")
    try:
        h.route_to([sim])
        for stream in (True, False):
            body = json.dumps({"model": "m", "prompt": f"word{stream} " * 300, "max_tokens": 50,   # (uncached)
                               "stream": stream}).encode()
            t = h.gateway.tenants.by_name["bob"]
            before = t.usage.get("m", [0, 0, 0])[1]
            s = socket.create_connection(("127.0.0.1", h.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-bob\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(1.0)   # (the prefill takes about 3 s)
            s.close()
            wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] > before, 15, "the prompt charged")
            assert t.usage["m"][1] - before >= 300 and t.usage["m"][2] == 0, (stream, t.usage)
    finally:
        h.close()
        sim.stop()


def test_a_batch_owners_standing_follows_the_keys_a_reload_leaves(gw):
    """What a dedicated batch's array goes by (the shared runner's lines get the gateway's 401 / 404): its key
    revoked, or the model taken from it, refuses the rest of its work; an open gateway's batches are anyone's."""
    h, _ = gw()

    def refusal(key: str, model: str):
        async def ask():
            return h.tenancy.owner_refusal(key, model)
        return h.call(ask())
    assert refusal("alice", "m2") is None and refusal("bob", "m") is None
    assert refusal("bob", "m2") == "the key `bob` may no longer use the model `m2`"
    h.reload(h.text.replace("    - {name: alice, key: sk-alice, group: nlp, rpm: 3}\n", "")
             .replace("models: [m]", "models: [m2]"))
    assert refusal("alice", "m") == "the key `alice` no longer exists"
    assert refusal("bob", "m") == "the key `bob` may no longer use the model `m`" and refusal("bob", "m2") is None
    h.reload("".join(ln for ln in h.text.splitlines(True) if "api_keys:" not in ln and "{name:" not in ln))   # open
    assert refusal("anonymous", "m") is None and refusal("", "m") is None
    assert refusal("carol", "m") == "the key `carol` no longer exists"


def test_a_retired_key_is_reported_until_a_minute_after_its_last_request_ended():
    """On a fake clock: a removed key with a request in flight stays in the reports while it runs and
    ``RETIRED_KEEP_S`` after it ends (the fleet takes a report every half second), then it is forgotten; a
    removed key that never had a request is not kept at all."""
    from orchestrator.config import GatewayConfig, KeyPolicy
    from orchestrator.gateway.tenants import RETIRED_KEEP_S, Tenants
    now = [0.0]
    keys = [KeyPolicy(name="a", key="sk-a"), KeyPolicy(name="b", key="sk-b"), KeyPolicy(name="c", key="sk-c")]
    ts = Tenants(GatewayConfig(api_keys=keys), 0, "inc", {}, clock=lambda: now[0])
    a = ts.identify({"Authorization": "Bearer sk-a"})
    assert ts.admit(a, "m", {}) is None   # one request of a's in flight
    ts.set_config(GatewayConfig(api_keys=keys[2:]), {})
    assert set(ts.retired) == {"a"} and set(ts.report()) == {"a"}
    now[0] = 10 * RETIRED_KEEP_S
    assert "a" in ts.report()             # still running
    a.finish("m", 3, 4)
    now[0] += 1
    assert ts.report()["a"].models == {"m": (1, 3, 4)}
    now[0] += RETIRED_KEEP_S
    assert "a" in ts.report()             # a minute after its end: the last report with it
    now[0] += 1
    assert ts.report() == {} and ts.retired == {}


def test_an_answer_lost_with_its_replica_is_not_charged(gw):
    """A non-streamed request whose only replica dies mid-generation gets a 502 (nothing to continue it on):
    its key is charged no tokens (they were charged, and the SDK's retry of the 502 paid them twice)."""
    import os
    import signal
    import threading
    h, _ = gw()
    slow = Sim("slow", "--tokens-per-s", "40")
    try:
        h.route_to([slow])
        result: list = []

        def ask() -> None:
            try:
                client(h, "sk-bob").completions.create(model="m", prompt="x", max_tokens=80,
                                                       extra_body={"ignore_eos": True})
            except openai.APIStatusError as exc:
                result.append(exc.status_code)
        t = threading.Thread(target=ask)
        t.start()
        wait_for(lambda: slow.metric("vllm:num_requests_running") > 0, 10, "the generation under way")
        time.sleep(0.4)
        os.kill(slow.proc.pid, signal.SIGKILL)
        t.join(30)
        assert result == [502]
        h.tenancy_tick(flush=True)
        rows = [r for r in query(h.tmp / "usage.sqlite3", 0, time.time() + 3600, ["key"]) if r["key"] == "bob"]
        assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows) == 0, rows
    finally:
        slow.stop()


@pytest.mark.parametrize("revoked", ["api_keys: []\n", "api_keys_file: {file}\n"])
def test_a_reload_that_revokes_the_last_key_lets_nobody_in(gw, tmp_path, revoked):
    """The gateway was open (every client the anonymous tenant) whenever no key was left, so an operator who
    revoked the last key (commented out of the keys file, or taken from api_keys) opened it to everyone, the
    revoked key included.  Open is only neither api_keys nor a keys file set."""
    h, _ = gw(keys="api_keys:\n  - {name: alice, key: sk-alice}\n")
    client(h, "sk-alice").completions.create(model="m", prompt="x", max_tokens=1)
    keys = tmp_path / "keys.txt"
    keys.write_text("# sk-alice revoked\n")
    closed = h.text.replace("  api_keys:\n    - {name: alice, key: sk-alice}\n", "  " + revoked.format(file=keys))
    h.reload(closed)
    for key in ("sk-alice", "junk"):
        with pytest.raises(openai.AuthenticationError):
            client(h, key).completions.create(model="m", prompt="x", max_tokens=1)
    req = urllib.request.Request(h.base + "/v1/completions", data=b'{"model": "m", "prompt": "x", "max_tokens": 1}')
    with pytest.raises(urllib.error.HTTPError) as e:   # no key at all
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401
    assert "anonymous" not in h.gateway.tenants.by_name
    h.reload(closed.replace("  " + revoked.format(file=keys), ""))   # no key source at all: open, as documented
    openai.OpenAI(base_url=h.base + "/v1", api_key="any", max_retries=0).completions.create(
        model="m", prompt="x", max_tokens=1)


def test_x_ratelimit_remaining_counts_what_was_admitted_since_the_counters_the_fleet_saw(tmp_path):
    """Every routing table carries the allowances (a routes or engine-load update too): each one re-based the
    count, so remaining jumped back to the fleet's figure (5 of 10 used, then 10 again after a load update, and
    the 11th request refused all the same); and a new allowance lost what was admitted between the report it
    came from and its arrival.  It counts from the counters the fleet saw (``Allowance.requests_seen``)."""
    from orchestrator.contract import Allowance, ProcessAllowances, RoutingTable
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.tenants import Tenants
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ngateway:\n  api_keys:\n"
                           "    - {name: a, key: sk-a, rpm: 10}\n"
                           "models:\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n", "f.yaml", {})
    now = [0.0]
    ts = Tenants(cfg.gateway, 0, "inc", {"m": "m"}, clock=lambda: now[0])

    def table(version: int, **allow) -> RoutingTable:
        return RoutingTable(version, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(**allow)})})
    first = dict(requests_upto=10, requests_left=10, requests_reset_s=60.0)
    ts.apply(table(1, **first))
    t = ts.by_name["a"]
    for _ in range(5):
        assert ts.admit(t, "m", {}) is None
    remaining = lambda: ts.headers(t)["x-ratelimit-remaining-requests"]   # noqa: E731
    assert remaining() == "5"
    now[0] = 10.0
    ts.apply(table(2, **first))              # the same allowance in a later table
    assert remaining() == "5" and ts.headers(t)["x-ratelimit-reset-requests"] == "50s"
    ts.apply(table(3, requests_upto=10, requests_left=7, requests_reset_s=50.0, requests_seen=3))   # from a report
    assert remaining() == "5"                # at 3 admitted: the 2 since then are not in its 7
    for _ in range(5):
        assert ts.admit(t, "m", {}) is None
    assert remaining() == "0" and ts.admit(t, "m", {}).status == 429


def test_x_ratelimit_reset_counts_from_the_first_request_the_fleet_has_not_counted(tmp_path):
    """An idle key's allowance (nothing in its window: reset 60 s) stays the same table after table, and the
    reset counted from when it came: a minute later a request's answer said ``remaining 2, reset 0s`` (as if
    the window were already whole again; found by a soak).  A window that held no use frees a minute after
    the first request admitted since; one that held some, when its oldest leaves."""
    from orchestrator.contract import Allowance, ProcessAllowances, RoutingTable
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.tenants import Tenants
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ngateway:\n  api_keys:\n"
                           "    - {name: a, key: sk-a, rpm: 3, tpm: 1000}\n"
                           "models:\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n", "f.yaml", {})
    now = [0.0]
    ts = Tenants(cfg.gateway, 0, "inc", {"m": "m"}, clock=lambda: now[0])
    idle = dict(requests_upto=3, requests_left=3, requests_reset_s=61.0, tokens_upto=1000, tokens_left=1000,
                tokens_reset_s=61.0)   # (more than the window: it holds none)
    ts.apply(RoutingTable(1, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(**idle)})}))
    t = ts.by_name["a"]
    now[0] = 100.0   # no new table: the allowance is the same while the key is idle
    assert ts.admit(t, "m", {}) is None
    hdr = ts.headers(t)
    assert hdr["x-ratelimit-remaining-requests"] == "2" and hdr["x-ratelimit-reset-requests"] == "1m0s", hdr
    assert hdr["x-ratelimit-reset-tokens"] == "0s", hdr   # (its tokens count as it ends: none in the window yet)
    now[0] = 103.0
    assert ts.admit(t, "m", {}) is None
    assert ts.headers(t)["x-ratelimit-reset-requests"] == "57s"   # the first one leaves first
    # the fleet has counted both (its window's oldest leaves in 56 s): from its word, a second later
    now[0] = 104.0
    ts.apply(RoutingTable(2, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(
        requests_upto=3, requests_left=1, requests_reset_s=56.0, requests_seen=2, tokens_upto=1000,
        tokens_left=1000, tokens_reset_s=61.0)})}))
    now[0] = 105.0
    hdr = ts.headers(t)
    assert hdr["x-ratelimit-remaining-requests"] == "1" and hdr["x-ratelimit-reset-requests"] == "55s", hdr
    # a window's first use counted the instant it was made leaves in a whole window: 60 s is a use, not none
    # (a reset of 60 was read as "the window held none": 0s for a second after the fleet counted the first)
    ts2 = Tenants(cfg.gateway, 0, "inc", {"m": "m"}, clock=lambda: now[0])
    u = ts2.by_name["a"]
    assert ts2.admit(u, "m", {}) is None
    ts2.apply(RoutingTable(3, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(
        requests_upto=3, requests_left=2, requests_reset_s=60.0, requests_seen=1, tokens_upto=1000,
        tokens_left=1000, tokens_reset_s=61.0)})}))
    assert ts2.headers(u)["x-ratelimit-reset-requests"] == "1m0s"
    u.finish("m", 10, 20)   # its tokens count as it ends: they leave the window a minute from then
    assert ts2.headers(u)["x-ratelimit-reset-tokens"] == "1m0s"


def test_a_limited_keys_errors_carry_its_x_ratelimit_headers_too(gw):
    """OpenAI's x-ratelimit-* are on every answer of a limited key: a model's 503 (no replica), its queue's
    429 and a replica's 502/504 went without them."""
    h, _ = gw(keys=KEYS + "queue_timeout_s: 0.5\n")
    h.tenancy_tick()
    r = client(h, "sk-alice").completions.with_raw_response.create(model="m", prompt="x", max_tokens=1)
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(openai.APIStatusError) as e:
        client(h, "sk-alice").completions.create(model="m2", prompt="x", max_tokens=1)   # (m2 has no replica)
    assert e.value.status_code == 503 and e.value.body["code"] == "no_replica"
    assert e.value.response.headers["x-ratelimit-limit-requests"] == "3"
    assert e.value.response.headers["x-ratelimit-remaining-requests"] == "1"


@pytest.mark.parametrize("resume", [True, False])
def test_a_whole_answer_whose_client_leaves_is_charged_the_replicas_work(gw, resume):
    """A stream's client that leaves pays for what it was sent; a non-streamed request whose client left (its
    own timeout) before the answer paid nothing at all, though the engine had prefilled its prompt and
    generated for it: a way round tpm and budgets.  Read from the replica's stream (resumable), it pays the
    prompt and the tokens made so far; read whole, the prompt (the replica's own /tokenize count)."""
    h, sim = gw(resume)
    c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0, timeout=3.0)
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model="m", prompt="one two three four", max_tokens=2000,   # 10 s at 200 tokens/s
                             extra_body={"ignore_eos": True})
    t = h.gateway.tenants.by_name["bob"]
    wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] > 0, 10, "the request charged")
    requests, prompt, completion = t.usage["m"]
    wait_for(lambda: sim.metric("vllm:num_requests_running") == 0, 10, "the engine to stop the generation")
    req = urllib.request.Request(sim.url + "/tokenize", data=b'{"model": "m", "prompt": "one two three four"}',
                                 headers={"Authorization": f"Bearer {sim.secret}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        count = json.loads(r.read())["count"]
    assert prompt == count > 0 and requests == (1 if resume else 0)   # (a request counts once answered: its headers)
    if resume:
        assert 50 <= completion <= sim.metric("vllm:generation_tokens_total") + 5, completion   # about 3 s of it
    else:
        assert completion == 0


@pytest.mark.parametrize("resume", ["false", "true"])
def test_a_whole_answer_past_the_request_timeout_is_charged_its_prompt(tmp_path, resume):
    """A request not streamed that ran into the gateway's request_timeout_s (a 504, which the SDK retries twice)
    was charged nothing, nor counted, though its engine had prefilled and generated all that time: a client
    that leaves pays its prompt, and so does this one. Found by a review; so was the same with resume on (the
    default, which reads a whole answer as a stream): it pays what the engine made, its prompt and tokens."""
    models = MODELS.format(resume=resume).replace(f"    resume: {{enabled: {resume}}}\n",
                                                  f"    resume: {{enabled: {resume}}}\n    gateway: {{request_timeout_s: 1}}\n")
    h = Harness(tmp_path, models, KEYS)
    sim = Sim("t0")
    try:
        h.route_to([sim])
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as e:   # 2000 tokens at 200/s: 10 s, past the 1 s
            c.completions.create(model="m", prompt="one two three four", max_tokens=2000, extra_body={"ignore_eos": True})
        assert e.value.status_code == 504
        t = h.gateway.tenants.by_name["bob"]
        wait_for(lambda: t.inflight == 0 and t.usage.get("m", [0, 0, 0])[1] > 0, 10, "the prompt charged")
        req = urllib.request.Request(sim.url + "/tokenize", data=b'{"model": "m", "prompt": "one two three four"}',
                                     headers={"Authorization": f"Bearer {sim.secret}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            count = json.loads(r.read())["count"]
        assert t.usage["m"][1] == count > 0, (t.usage, count)   # (the replica's count)
        assert (t.usage["m"][2] > 0) == (resume == "true"), t.usage   # (resume: the tokens it read before the 504)
    finally:
        sim.stop()
        h.close()


def test_the_gateway_charges_no_batch_line_to_its_owner(gw):
    """The runner cancels its lines in flight when the daemon stops, and the next start sends them again: a
    line left once its answer had begun (every non-streamed request is a resumable stream inside) was charged to
    the batch's owner, and again when sent again (a restart overcharged a 40-line batch by 7 lines); so was a whole
    answer the runner then lost.  The runner charges the owner from what it wrote down (tests/test_batch_charge.py)."""
    h, _ = gw(keys=KEYS.replace(", budget_tokens: 40, budget_period: day", ""))
    h.cfg.gateway._batch_key = "runner-secret"
    h.call(asyncio.sleep(0))
    h.gateway.set_config(h.cfg)
    carol = h.gateway.tenants.by_name["carol"]
    leaving = openai.OpenAI(base_url=h.base + "/v1", api_key="runner-secret", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):   # 400 tokens at 200/s: left after its first tokens came
        leaving.completions.create(model="m", prompt="x", max_tokens=400, extra_body={"ignore_eos": True},
                                   extra_headers={"x-slurmfleet-batch-owner": "carol"})
    runner = h.gateway.tenants.by_name["_batches"]
    wait_for(lambda: runner.inflight == 0, 10, "the gateway to end the line the runner left")
    assert carol.usage.get("m", [0])[0] == 0, carol.usage
    out = client(h, "runner-secret").completions.create(model="m", prompt="x", max_tokens=3,
                                                        extra_headers={"x-slurmfleet-batch-owner": "carol"})
    assert out.usage.completion_tokens == 3 and runner.inflight == 0
    assert not carol.usage and not runner.usage and "carol" not in h.gateway.report().tenants


def test_a_gateway_process_started_again_admits_a_limited_key_only_on_its_first_allowance():
    """A worker that died is started again, its counters at zero: with the even split (rpm / workers) before its
    first allowance it admitted that much more though the others may have spent the window (up to a limit over
    the workers more, at each restart).  At the daemon's start the even split stays (nothing was spent)."""
    import dataclasses

    from orchestrator.config import GatewayConfig, KeyPolicy
    from orchestrator.contract import EMPTY_TABLE, Allowance, ProcessAllowances
    from orchestrator.gateway.tenants import Tenants
    cfg = GatewayConfig(workers=2, port=18000, api_keys=[KeyPolicy(name="a", key="sk-a", rpm=10)])
    first = Tenants(cfg, 1, "inc-1", {})
    a = first.by_name["a"]
    assert [first.admit(a, "m", {}) is None for _ in range(6)] == [True] * 5 + [False]   # the even split: 10 // 2
    again = Tenants(cfg, 1, "inc-2", {})
    again.restarted = True
    b = again.by_name["a"]
    refused = again.admit(b, "m", {})
    assert refused is not None and refused.status == 429 and refused.headers["Retry-After"] == "1"
    again.apply(dataclasses.replace(EMPTY_TABLE, version=1, allowances={
        1: ProcessAllowances("inc-2", {"a": Allowance(requests_upto=2, requests_left=2)})}))
    assert [again.admit(b, "m", {}) is None for _ in range(3)] == [True, True, False]
    # the daemon's start after another's, whose processes spent part of the minute (its table says so): the
    # workers' first tables carry no allowance of theirs yet, and no even split is admitted meanwhile
    after = Tenants(cfg, 1, "inc-3", {})
    after.apply(dataclasses.replace(EMPTY_TABLE, version=1, limits_carried=True))
    refused = after.admit(after.by_name["a"], "m", {})
    assert refused is not None and refused.status == 429 and refused.headers["Retry-After"] == "1"
    after.apply(dataclasses.replace(EMPTY_TABLE, version=2))   # (that minute over: a key new to it, the even split)
    assert after.admit(after.by_name["a"], "m", {}) is None


def test_a_budget_only_keys_share_running_out_is_counted_as_budget_not_tpm(tmp_path):
    """A key with a token budget and no tpm, at its process's share of what is left of the budget: refused for
    a second (another process may have tokens left), and counted under reason "budget" (it was "tpm": an operator
    looked for a tpm limit the key does not have); a spent budget is the refusal not to retry."""
    from orchestrator.contract import Allowance, ProcessAllowances, RoutingTable
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.tenants import Tenants
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ngateway:\n  api_keys:\n"
                           "    - {name: a, key: sk-a, budget_tokens: 1000, budget_period: day}\n"
                           "models:\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n", "f.yaml", {})
    ts = Tenants(cfg.gateway, 0, "inc", {"m": "m"})
    ts.apply(RoutingTable(1, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(
        tokens_upto=0, tokens_left=30, tokens_reset_s=3600)})}))
    t = ts.by_name["a"]
    refused = ts.admit(t, "m", {})
    assert refused.status == 429 and b"rate_limit_exceeded" in refused.body and b"near its token budget" in refused.body
    assert refused.headers["Retry-After"] == "1" and "x-should-retry" not in refused.headers
    assert t.rejected == {"budget": 1}
    ts.apply(RoutingTable(2, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(
        tokens_upto=0, tokens_left=0, tokens_reset_s=3600, budget_exhausted=True)})}))
    refused = ts.admit(t, "m", {})
    assert b"insufficient_quota" in refused.body and refused.headers["x-should-retry"] == "false"
    assert t.rejected == {"budget": 2}
    # with a tpm too, a share the budget bounds is still the budget's (it was "tpm", "tokens per minute: limit ...")
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ngateway:\n  api_keys:\n"
                           "    - {name: a, key: sk-a, tpm: 100000, budget_tokens: 1000000, budget_period: day}\n"
                           "models:\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n", "f.yaml", {})
    ts = Tenants(cfg.gateway, 0, "inc", {"m": "m"})
    for by_budget, reason, said in ((True, "budget", b"near its token budget"), (False, "tpm", b"tokens per minute")):
        ts.apply(RoutingTable(3 + by_budget, {}, allowances={0: ProcessAllowances("inc", {"a": Allowance(
            tokens_upto=0, tokens_left=400, tokens_reset_s=60, tokens_by_budget=by_budget,
            limits=(None, 100000, None, 1000000))})}))
        t = ts.by_name["a"]
        t.rejected.clear()
        refused = ts.admit(t, "m", {})
        assert refused.status == 429 and said in refused.body and t.rejected == {reason: 1}, (refused.body, t.rejected)


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_gateway_starts_on_a_table_that_names_the_spent_budgets(tmp_path, monkeypatch, workers):
    """At the daemon's start the gateway's processes got the empty table first (the tenancy loop started after
    them), so a key whose budget the ledger had spent was admitted until the loop's first table: with 8 workers,
    for seconds.  The daemon now takes a tenancy turn before its gateway starts."""
    from conftest import free_port
    from orchestrator.daemon import Daemon
    from orchestrator.fleet.usage import UsageLedger
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.local import LocalGateway
    from orchestrator.gateway.processes import GatewayWorkers
    ledger = UsageLedger(tmp_path / "usage.sqlite3")
    assert ledger.charge_upto("before-the-restart", "carol", None, "m", (1, 30, 20))   # (requests, tokens)
    ledger.close()
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ndaemon: {{admin_port: {free_port()}}}\n"
                           f"gateway:\n  port: {free_port()}\n  workers: {workers}\n  api_keys:\n"
                           "    - {name: carol, key: sk-carol, budget_tokens: 40, budget_period: day}\n"
                           "models:\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n", "f.yaml", {})
    daemon = Daemon(tmp_path / "f.yaml", cfg)
    first: list = []

    async def start(self) -> bool:   # what the gateway starts on; then the daemon ends (no worker is forked)
        first.append(daemon.publisher.table)
        return False
    monkeypatch.setattr(LocalGateway if workers == 1 else GatewayWorkers, "start", start)
    assert await daemon.run() == 1
    assert set(first[0].budgets_spent) == {"carol"} and first[0].budgets_spent["carol"] > time.time()
