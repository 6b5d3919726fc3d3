"""``routing: kv_aware``: the scoring (cached prefix against load, bounded load, the routed-keys fallback) on an
index fed with vLLM-shaped events, and the gateway's wiring (a policy bound to the pool's KV state, the
counters that reach ``/metrics``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from orchestrator.config import GatewayConfig, ModelConfig
from orchestrator.contract import NO_LOAD, EngineLoad, Endpoint, ModelRoutes, Replica, RoutingTable
from orchestrator.devtools.tinymodel import build_tokenizer
from orchestrator.gateway.kvindex import BlockRemoved, BlockStored
from orchestrator.gateway.kvroute import KvRouting
from orchestrator.gateway.pool import Pools
from orchestrator.prompttokens import PromptTokenizer
from orchestrator.reqstats import RequestStats


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@dataclass
class Cand:
    job_id: str
    inflight: int = 0
    load: EngineLoad = field(default_factory=lambda: NO_LOAD)
    prefill_pending: int = 0


def model(tok_dir, **kw) -> ModelConfig:
    return ModelConfig(name="m", engine="simulator", model_path=str(tok_dir), routing="kv_aware",
                       container={"enabled": False}, **kw)


def chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def store(kv: KvRouting, job: str, ids: list[int], bs: int = 16) -> None:
    """The events an engine sends after prefilling ``ids``: one BlockStored per full block, chained."""
    idx = kv.models["m"].index.replica(job)
    parent = None
    for i in range(len(ids) // bs):
        h = f"{job}-{len(idx)}-{i}".encode()   # engine hashes are unique per block content
        assert idx.apply(BlockStored([h], parent, ids[i * bs:(i + 1) * bs], bs)) is not False
        parent = h
    idx.approximate = False


DOC = " ".join(f"paragraph {i} of the shared tenant document explains the cluster policy in detail." for i in range(40))


def routing(tok_dir) -> tuple[KvRouting, PromptTokenizer]:
    kv = KvRouting(RequestStats(), random.Random(1))
    kv.set_models([model(tok_dir)])
    return kv, PromptTokenizer.from_dir(tok_dir)


def test_the_replica_holding_the_prefix_wins_and_the_prediction_is_counted(tok_dir):
    kv, tok = routing(tok_dir)
    ids = tok.prompt_ids(chat(DOC, "first question"), True)
    store(kv, "b", ids)
    cands = [Cand("a"), Cand("b"), Cand("c")]
    for q in ("what is the quota?", "who runs the cluster?", "when is maintenance?"):
        body = chat(DOC, q)
        assert kv.choose("m", cands, body, random.Random(0)).job_id == "b"
    n = len(tok.prompt_ids(chat(DOC, "what is the quota?"), True))
    assert n > 300
    predicted = kv.stats.kv_predicted_hits[("m",)]
    assert predicted >= 3 * (len(ids) // 16 - 2) * 16   # the shared blocks (the question's blocks differ)
    assert kv.stats.kv_prompt_tokens[("m",)] >= 3 * n - 10


def test_prefill_ahead_outweighs_a_small_cached_prefix_and_bounded_load_spreads_a_hot_one(tok_dir):
    kv, tok = routing(tok_dir)
    short = "a short shared preamble for everyone. " * 3
    store(kv, "b", tok.prompt_ids(chat(short, "x"), True))
    # b holds a block or two, but 2,000 prompt tokens wait for prefill there: a answers first
    pick = kv.choose("m", [Cand("a", 1), Cand("b", 3, prefill_pending=2000)], chat(short, "y"), random.Random(0))
    assert pick.job_id == "a" and kv.take_charge("m") == len(tok.prompt_ids(chat(short, "y"), True))
    # a long cached prefix on b is worth more than a little prefill ahead of it, and only the rest is charged
    store(kv, "b", tok.prompt_ids(chat(DOC, "x"), True))
    n = len(tok.prompt_ids(chat(DOC, "z"), True))
    assert kv.choose("m", [Cand("a", 1), Cand("b", 2, prefill_pending=100)], chat(DOC, "z"), random.Random(0)).job_id == "b"
    assert 0 < kv.take_charge("m") < 40 and kv.take_charge("m") == 0 and n > 300
    # ... but never beyond the bound (2 x the mean in flight + 2): a hot prefix cannot take every request
    assert kv.choose("m", [Cand("a", 0), Cand("c", 0), Cand("b", 9)], chat(DOC, "z"), random.Random(0)).job_id != "b"


def test_without_events_what_was_routed_where_stands_in(tok_dir):
    kv, _ = routing(tok_dir)
    cands = [Cand("a"), Cand("b"), Cand("c"), Cand("d")]
    first = kv.choose("m", cands, chat(DOC, "q1"), random.Random(7)).job_id
    again = {kv.choose("m", cands, chat(DOC, f"q{i}"), random.Random(i)).job_id for i in range(2, 10)}
    assert again == {first}


def test_the_index_size_counts_routed_keys_of_replicas_without_events(tok_dir):
    kv, _ = routing(tok_dir)
    kv.choose("m", [Cand("a")], chat(DOC, "q1"), random.Random(7))   # no events from a: what was routed stands in
    kv.export()
    kv.export()   # exporting twice changes nothing (it used to make an empty event index, which then counted 0)
    assert kv.stats.kv_blocks["m"] > 20 and kv.models["m"].index.held("a") is None


def test_a_prefix_just_sent_counts_as_cached_before_its_events_arrive(tok_dir):
    kv, _ = routing(tok_dir)
    for j in "abcd":   # every replica's feed in sync and empty: no event yet for what is being sent
        kv.models["m"].index.replica(j).approximate = False
    cands = [Cand("a"), Cand("b"), Cand("c"), Cand("d")]
    first = kv.choose("m", cands, chat(DOC, "q1"), random.Random(7))
    first.prefill_pending = kv.take_charge("m")   # its prefill is still ahead there
    again = kv.choose("m", cands, chat(DOC, "q2"), random.Random(8))
    assert again is first and kv.take_charge("m") < 40   # not a second prefill of the document elsewhere
    # an engine of 128-token blocks (8 index keys each) will hold only whole blocks of the document
    kv.models["m"].index.replica("a").engine_block_size = 128
    kv.export()
    third = kv.choose("m", cands, chat(DOC, "q3"), random.Random(9))
    n = len(kv.models["m"].tokenizer.prompt_ids(chat(DOC, "q3"), True))
    assert third is first and (n - kv.take_charge("m")) % 128 == 0


def test_a_prefix_just_sent_then_stored_and_evicted_is_not_cached_there(tok_dir):
    """What was sent counts as cached only until the replica's events store it; after that its index decides,
    so a BlockRemoved (the engine evicted the document under pressure) is believed within RECENT_S too."""
    kv, tok = routing(tok_dir)
    mk = kv.models["m"]
    for j in "ab":
        mk.index.replica(j).approximate = False
    cands = [Cand("a"), Cand("b")]
    first = kv.choose("m", cands, chat(DOC, "q1"), random.Random(7)).job_id
    ids = tok.prompt_ids(chat(DOC, "q1"), True)
    n, hits = kv.cached("m", chat(DOC, "q2"), cands)
    assert hits[first] >= len(ids) // 16 * 16 - 32          # sent, no event yet: counted
    idx = mk.index.replica(first)
    hashes = []
    for i in range(len(ids) // 16):                        # the engine prefilled it: stored, block by block
        hashes.append(f"blk{i}".encode())
        idx.apply(BlockStored([hashes[-1]], hashes[-2] if i else None, ids[i * 16:(i + 1) * 16], 16))
    assert kv.cached("m", chat(DOC, "q2"), cands)[1][first] >= len(ids) // 16 * 16 - 32   # the index says so now
    for hsh in reversed(hashes):                           # ... then evicted it
        idx.apply(BlockRemoved([hsh]))
    assert kv.cached("m", chat(DOC, "q2"), cands)[1].get(first, 0) == 0
    kv.take_charge("m")
    kv.choose("m", cands, chat(DOC, "q3"), random.Random(0))
    assert kv.take_charge("m") > len(ids) - 64   # charged a whole prefill (it used to be charged none)


def test_the_prediction_stops_a_block_before_the_prompts_last_token_as_vllm_does(tok_dir):
    """vLLM computes a prompt's last token again, in whole blocks: a prompt of 32 tokens cached whole reuses 16
    (the prediction used to be all 32); of 40, 32; with 32-token engine blocks, a 32-token prompt reuses none."""
    kv, _ = routing(tok_dir)
    ids = list(range(100, 140))
    store(kv, "b", ids)
    assert kv.cached("m", {"model": "m", "prompt": ids[:32]}, [Cand("b")]) == (32, {"b": 16})
    assert kv.cached("m", {"model": "m", "prompt": ids}, [Cand("b")]) == (40, {"b": 32})
    kv.choose("m", [Cand("b")], {"model": "m", "prompt": ids[:32]}, random.Random(0))
    assert kv.take_charge("m") == 16 and kv.stats.kv_predicted_hits[("m",)] == 16
    kv.models["m"].step = 2
    assert kv.cached("m", {"model": "m", "prompt": ids[:32]}, [Cand("b")]) == (32, {"b": 0})


def test_prompt_logprobs_or_echo_read_no_cache_as_in_vllm(tok_dir):
    """vLLM reads no prefix cache for a request that wants prompt logprobs (skip_reading_prefix_cache): asked
    for, or implied by a chat's echo (at its top_logprobs, 0 by default) or a completion's echo with logprobs.
    Such a request has no cached prefix anywhere, like a salted one (it used to be predicted cached)."""
    kv, tok = routing(tok_dir)
    store(kv, "b", tok.prompt_ids(chat(DOC, "q"), True))
    store(kv, "b", tok.encode(DOC))
    cmpl = {"model": "m", "prompt": DOC}
    for body in ({**chat(DOC, "q"), "prompt_logprobs": 0}, {**chat(DOC, "q"), "echo": True},
                 {**chat(DOC, "q"), "echo": "true", "top_logprobs": None}, {**cmpl, "echo": True, "logprobs": 0},
                 {**cmpl, "prompt_logprobs": 1}, {**chat(DOC, "q"), "cache_salt": "s"}):
        assert kv.cached("m", body, [Cand("b")]) == (0, {}), body
    for body in ({**chat(DOC, "q"), "logprobs": True, "top_logprobs": 2}, {**chat(DOC, "q"), "echo": "false"},
                 {**cmpl, "echo": True}, {**cmpl, "logprobs": 3}, {**cmpl, "prompt_logprobs": None}):
        assert kv.cached("m", body, [Cand("b")])[1]["b"] > 300, body


def test_an_untokenizable_prompt_goes_to_the_least_loaded(tok_dir):
    kv, _ = routing(tok_dir)
    cands = [Cand("a", 3), Cand("b", 1), Cand("c", 2)]
    assert kv.choose("m", cands, {"model": "m", "prompt": {"not": "a prompt"}}, random.Random(0)).job_id == "b"
    assert kv.choose("m", cands, {"model": "m", "prompt": "hi"}, random.Random(0)).job_id == "b"   # under a block
    cands[1].prefill_pending = 500   # the least prefill ahead first, then the fewest in flight
    assert kv.choose("m", cands, {"model": "m", "prompt": "hi"}, random.Random(0)).job_id == "c"


async def test_a_lease_carries_its_prefill_until_the_first_byte(tok_dir):
    stats = RequestStats()
    pools = Pools(GatewayConfig(), [model(tok_dir)], random.Random(0), stats=stats)
    try:
        pools.apply(RoutingTable(1, {"m": ModelRoutes(2, (Replica("j1", "m", 0, ep("j1", False)),
                                                          Replica("j2", "m", 1, ep("j2", False))))}))
        a = pools.pools["m"].try_acquire(chat(DOC, "q1"), {}, set())
        assert a is not None and a.prefill > 300 and a.slot.prefill_pending == a.prefill
        b = pools.pools["m"].try_acquire(chat(DOC, "q2"), {}, set())   # the same prefix: the same replica, cached
        assert b.slot is a.slot and 0 < b.prefill < 40 and a.slot.prefill_pending == a.prefill + b.prefill
        a.first_byte()
        assert a.slot.prefill_pending == b.prefill
        b.release()
        a.release()
        assert a.slot.prefill_pending == 0 and a.slot.inflight == 0
    finally:
        await pools.close()


def test_no_tokenizer_on_this_host_routes_by_load(tmp_path):
    kv = KvRouting(RequestStats(), random.Random(0))
    kv.set_models([ModelConfig(name="m", engine="simulator", model_path=str(tmp_path / "nowhere"),
                               routing="kv_aware", container={"enabled": False})])
    assert kv.choose("m", [Cand("a", 2), Cand("b", 0)], chat(DOC, "q"), random.Random(0)).job_id == "b"


def test_the_engines_chat_template_and_tokenizer_in_vllm_args_are_followed(tok_dir, tmp_path):
    """``vllm_args`` ``chat-template`` (a file) replaces the tokenizer's template, as it does in the engine, and
    ``tokenizer`` (a directory) is where the engine's tokenizer is: the gateway reads the same, not
    ``model_path``'s; a change of either makes a new tokenizer."""
    template = tmp_path / "engine.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}")
    kv = KvRouting(RequestStats(), random.Random(0))
    kv.set_models([model(tok_dir, vllm_args={"chat-template": str(template)})])
    first = kv.models["m"]
    assert first.tokenizer.render_chat(chat("sys", "q")) == "<<system>> sys\n<<user>> q\n"
    ids = PromptTokenizer.from_dir(tok_dir).encode("<<system>> sys\n<<user>> q\n", False)
    assert first.prompt(chat("sys", "q"))[1] == len(ids)

    empty = tmp_path / "weights-only"
    empty.mkdir()
    kv.set_models([ModelConfig(name="m", engine="simulator", model_path=str(empty), routing="kv_aware",
                               container={"enabled": False}, vllm_args={"tokenizer": str(tok_dir)})])
    second = kv.models["m"]
    assert second is not first and second.tokenizer is not None and second.tokenizer.source == str(tok_dir)
    assert second.tokenizer.render_chat(chat("sys", "q")) != "<<system>> sys\n<<user>> q\n"   # the model's own
    kv.set_models([model(tok_dir, vllm_args={"tokenizer": str(empty)})])   # the engine's tokenizer is not here:
    assert kv.models["m"].tokenizer is None                                 # not model_path's instead


def ep(job: str, kv: bool = True) -> Endpoint:
    return Endpoint(job, "127.0.0.1", 1, "s", kv_events="tcp://127.0.0.1:9" if kv else "",
                    kv_replay="tcp://127.0.0.1:10" if kv else "", kv_topic=f"kv.{job}")


async def test_the_pool_binds_the_policy_follows_the_table_and_exports_counters(tok_dir):
    stats = RequestStats()
    pools = Pools(GatewayConfig(), [model(tok_dir)], random.Random(0), stats=stats)
    try:
        assert pools.kv is not None and pools.pools["m"].policy.kv is pools.kv
        table = RoutingTable(1, {"m": ModelRoutes(2, (Replica("j1", "m", 0, ep("j1")), Replica("j2", "m", 1, ep("j2"))))})
        pools.apply(table)
        assert "j1" in pools.kv.models["m"].feeds and "j2" in pools.kv.models["m"].feeds
        lease = pools.pools["m"].try_acquire(chat(DOC, "q"), {}, set())
        assert lease is not None
        lease.release()
        pools.apply(RoutingTable(2, {"m": ModelRoutes(1, (Replica("j1", "m", 0, ep("j1")),))}))
        assert "j2" not in pools.kv.models["m"].feeds and "j2" not in pools.kv.models["m"].index.job_ids()
        pools.kv.export()
        snap = stats.snapshot()
        assert [["m"], stats.kv_prompt_tokens[("m",)]] in snap["kv_prompt_tokens"] and stats.kv_prompt_tokens[("m",)] > 300
        assert ["m", stats.kv_blocks["m"]] in snap["kv_blocks"]
    finally:
        await pools.close()


async def test_the_kv_event_counters_never_go_back_when_a_reload_makes_the_index_anew(tok_dir):
    """The feeds' counts are exported as what they added: a reload that makes a model's index (and its feeds)
    anew used to set the process's totals back to the new feeds' counts (a counter reset to Prometheus, whose
    rate then counted the whole total again); a model no longer kv_aware leaves no index size behind."""
    stats = RequestStats()
    pools = Pools(GatewayConfig(), [model(tok_dir)], random.Random(0), stats=stats)
    try:
        pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (Replica("j1", "m", 0, ep("j1")),))}))
        fs = pools.kv.models["m"].feeds.stats()["j1"]
        # 3 gaps, each replayed, and a reset that was no gap (the first catch-up found seq 0 gone): 3 replayed (the
        # replayed count was gaps - resets: 2)
        fs.events_applied, fs.gaps, fs.replayed, fs.resets, fs.lag_s = 40, 3, 3, 1, 3.0
        fs.lags.extend([0.0007, 0.3, 3.0])   # three live batches since the last export: three observations (the
        pools.kv.export()                    # latest alone was observed, once per export)
        assert stats.kv_events[("m",)] == 40 and stats.kv_gaps[("m", "replayed")] == 3
        for _ in range(100):   # reports of an idle feed: its last lag is not observed again each time
            pools.kv.export()
        lag = stats.hist("kv_lag", "m")
        assert (sum(lag.counts), lag.sum) == (3, pytest.approx(3.3007)) and lag.counts[1] == 1   # (0.5-1 ms)
        fs.gaps, fs.resets = 4, 2   # a gap the replay could not fill
        pools.kv.export()
        assert stats.kv_gaps[("m", "replayed")] == 3 and stats.kv_gaps[("m", "reset")] == 2
        pools.set_models(GatewayConfig(), [model(tok_dir, simulator={"block_size": 32})])   # a new index, new feeds
        fresh = pools.kv.models["m"].feeds.stats()["j1"]
        assert fresh is not fs
        fresh.events_applied = 5
        pools.kv.export()
        assert stats.kv_events[("m",)] == 45 and stats.kv_gaps[("m", "reset")] == 2
        pools.set_models(GatewayConfig(), [ModelConfig(name="m", engine="simulator", model_path=str(tok_dir),
                                                       container={"enabled": False})])   # not kv_aware any more
        pools.kv.export()
        assert "m" not in stats.kv_blocks and stats.kv_events[("m",)] == 45
    finally:
        await pools.close()


async def test_the_feeds_incidents_and_the_replicas_approximate_reach_the_metrics(tok_dir):
    """The feeds' errors, restarts, rebuilds, unknown parents and replay failures are counters by kind (what each
    feed added since the last export), and the replicas whose index is approximate a gauge, the largest over
    gateway processes (they used to be counted and never exported)."""
    from orchestrator.observability.metrics import RequestCollector
    stats = RequestStats()
    pools = Pools(GatewayConfig(), [model(tok_dir)], random.Random(0), stats=stats)
    try:
        pools.apply(RoutingTable(1, {"m": ModelRoutes(2, (Replica("j1", "m", 0, ep("j1")),
                                                          Replica("j2", "m", 1, ep("j2"))))}))
        feeds = pools.kv.models["m"].feeds.stats()
        feeds["j1"].errors, feeds["j1"].unknown_parents, feeds["j2"].restarts = 2, 5, 1
        pools.kv.models["m"].index.replica("j2").approximate = False   # j1 has not caught up yet
        pools.kv.export()
        feeds["j1"].errors = 3
        pools.kv.export()
        assert stats.kv_feed == {("m", "error"): 3, ("m", "restart"): 1, ("m", "rebuild"): 0,
                                 ("m", "unknown_parent"): 5, ("m", "replay_failure"): 0}
        assert stats.kv_approximate == {"m": 1}
        other = RequestStats()
        other.kv_approximate["m"] = 2
        fams = {f.name: f for f in RequestCollector(lambda: [stats.snapshot(), other.snapshot()], lambda: ["m"]).collect()}
        got = {s.labels["kind"]: s.value for s in fams["slurmfleet_kv_feed_incidents"].samples}
        assert got["error"] == 3 and got["unknown_parent"] == 5
        assert [s.value for s in fams["slurmfleet_kv_index_approximate_replicas"].samples] == [2]
    finally:
        await pools.close()


async def test_a_model_that_stops_routing_kv_aware_closes_its_event_feeds(tok_dir):
    """A model reloaded without ``kv_aware`` (or with another tokenizer or block size) leaves its KV state: its
    feeds stop and their ZMQ context (and its I/O thread) is destroyed, by the next routing table or at the
    latest when the gateway shuts down, not kept for the process's lifetime."""
    pools = Pools(GatewayConfig(), [model(tok_dir)], random.Random(0), stats=RequestStats())
    table = RoutingTable(1, {"m": ModelRoutes(1, (Replica("j1", "m", 0, ep("j1")),))})
    try:
        pools.apply(table)
        first = pools.kv.models["m"]
        assert "j1" in first.feeds and not first.feeds._ctx.closed
        pools.set_models(GatewayConfig(), [model(tok_dir, simulator={"block_size": 32})])   # another block size
        second = pools.kv.models["m"]
        assert second is not first and "j1" in second.feeds and "j1" not in first.feeds
        pools.set_models(GatewayConfig(), [ModelConfig(name="m", engine="simulator", model_path=str(tok_dir),
                                                       container={"enabled": False})])   # not kv_aware any more
        assert pools.kv.models == {} and "j1" not in second.feeds
    finally:
        await pools.close()
    assert first.feeds._ctx.closed and second.feeds._ctx.closed


# -- on the real cluster, simulator replicas publishing vLLM's events ----------------------------------------------
def engine_counter(text: str, name: str) -> dict[str, float]:
    """Per slot, a re-exported engine counter of model m from the daemon's /metrics."""
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(name + "{") and 'model="m"' in ln:
            slot = ln.split('slot="', 1)[1].split('"', 1)[0]
            out[slot] = float(ln.rsplit(" ", 1)[1])
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("workers", [1, 2])
def test_kv_aware_on_the_cluster_follows_the_engines_cache(tmp_path, fleet_name, daemons, tok_dir, workers):
    import openai

    from conftest import fleet_config, metric_sum, sim_model, wait_for

    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model(
        "m", 2, model_path=str(tok_dir), routing="kv_aware",
        simulator={"ttft_s": 0.01, "tokens_per_s": 200, "block_size": 16, "prefill_s_per_token": 0.0002})],
        gateway={"workers": workers}))
    wait_for(lambda: len(d.ready("m")) == 2, 60, "2 READY replicas")
    c = openai.OpenAI(base_url=d.gateway + "/v1", api_key="x", max_retries=0, timeout=60)
    c.chat.completions.create(model="m", messages=chat(DOC, "first")["messages"], max_tokens=4)
    # every gateway process has the blocks from the events (the index gauge is the largest process's)
    wait_for(lambda: metric_sum(d.metrics(), "slurmfleet_kv_index_blocks", model="m") >= 20, 30,
             "the stored blocks in the gateway's index")
    for i in range(12):
        c.chat.completions.create(model="m", messages=chat(DOC, f"question {i}")["messages"], max_tokens=4)

    seen = []

    def settled():   # the engines' counters are scraped every few seconds: wait for the last scrape to agree
        m = d.metrics()
        hits = engine_counter(m, "slurmfleet_engine_prefix_cache_hits_tokens_total")
        predicted = metric_sum(m, "slurmfleet_kv_predicted_cached_tokens_total", model="m")
        seen[:] = [predicted, hits]
        return (m, hits) if predicted >= 12 * 300 and sum(hits.values()) == predicted else None
    try:
        m, hits = wait_for(settled, 30, "the engines' prefix-cache hits equal to the gateway's prediction")
    except AssertionError:
        raise AssertionError(f"predicted cached tokens, engine hits per slot: {seen}") from None
    # every follow-up hit the cache of the one replica that prefilled the document: the other one saw none
    assert len([v for v in hits.values() if v]) == 1, hits
    assert metric_sum(m, "slurmfleet_kv_events_total", model="m") >= 2


async def test_the_simulator_renders_prompts_as_vllm_does_for_a_router(tok_dir):
    """vLLM's /v1/chat/completions/render and /v1/completions/render (vllm-router's cache_aware asks them)."""
    import aiohttp
    from aiohttp import web

    from orchestrator.devtools.simulator import SimState, build_app, parse_args
    runner = web.AppRunner(build_app(SimState(parse_args([str(tok_dir), "--served-model-name", "m"]))))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    tok = PromptTokenizer.from_dir(tok_dir)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions/render", json=chat(DOC, "q")) as r:
                assert r.status == 200 and (await r.json())["token_ids"] == tok.prompt_ids(chat(DOC, "q"), True)
            async with s.post(f"http://127.0.0.1:{port}/v1/completions/render", json={"model": "m", "prompt": "hi there"}) as r:
                assert r.status == 200 and [x["token_ids"] for x in await r.json()] == [tok.encode("hi there")]
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions/render", json={"messages": 3}) as r:
                assert r.status == 400 and "error" in await r.json()
    finally:
        await runner.cleanup()


def test_a_messages_requests_system_leads_its_prompt_as_vllm_renders_it(tok_dir):
    """A /v1/messages body puts its system prompt (usually the shared prefix) at the top level: vLLM makes it the
    chat's leading system message (text blocks joined, Claude Code's billing header left out).  The gateway read
    only ``messages``: every such prompt had the wrong blocks, a miss everywhere.  What vLLM may render otherwise
    (an inline system message, Anthropic tools) is not guessed: no prompt, no cache."""
    tok = PromptTokenizer.from_dir(tok_dir)
    user = [{"role": "user", "content": "hi"}]
    want = tok.prompt_ids({"messages": [{"role": "system", "content": "S1 S2"}, *user]}, True)
    assert tok.prompt_ids({"system": "S1 S2", "messages": user, "max_tokens": 5}, True) == want
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "S1"},
              {"type": "text", "text": " S2"}]
    assert tok.prompt_ids({"system": blocks, "messages": user, "max_tokens": 5}, True) == want
    for bad in ({"system": "S", "messages": [{"role": "system", "content": "again"}, *user]},
                {"system": "S", "messages": user, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}):
        with pytest.raises(ValueError):
            tok.prompt_ids(bad, True)


def test_a_block_size_only_str_isdigit_takes_is_no_block_size():
    """``block-size: "²"`` passed validation (str.isdigit) and int() raised as the gateway took the config: a
    reload half applied (the reconciler had the new config, the gateway the old), a start failed."""
    from orchestrator.gateway.kvroute import DEFAULT_BLOCK, _block_size
    m = ModelConfig.model_validate({"name": "m", "model_path": "/m", "container": {"enabled": False},
                                    "routing": "kv_aware", "vllm_args": {"block-size": "\u00b2"}})
    assert _block_size(m) == DEFAULT_BLOCK
    assert _block_size(m.model_copy(update={"vllm_args": {"block-size": "32"}})) == 32
    # the engine's slots (the batch runner's and kv_aware's) are read the same way: "²" raised there too
    assert m.model_copy(update={"vllm_args": {"max-num-seqs": "\u00b2"}}).engine_slots is None
    assert m.model_copy(update={"vllm_args": {"max-num-seqs": "8"}}).engine_slots == 8


def test_fallback_hits_are_whole_engine_blocks(tmp_path):
    tok = build_tokenizer(tmp_path)
    kv = KvRouting(RequestStats(), random.Random(1))
    kv.set_models([ModelConfig(name="m", engine="vllm", model_path=str(tok), routing="kv_aware",
                               container={"enabled": False})])   # no block-size in vllm_args: index of 16
    mk = kv.models["m"]
    # (only what was just sent was rounded to engine blocks, not the routed-keys fallback)
    # replica b's events show the engine's block size: 128
    idx = mk.index.replica("b")
    idx.apply(BlockStored([1], None, list(range(5000, 5128)), 128))
    idx.approximate = False
    kv.export()
    assert mk.step == 8
    # replica a has no events (approximate): what was routed there stands in
    old = list(range(1, 1001))
    mk.index.record("a", mk.index.keys(old))
    new = old[:200] + list(range(20000, 20800))   # shares 200 tokens: one whole 128-token engine block
    ntok, hits = kv.cached("m", {"model": "m", "prompt": new}, [Cand("a"), Cand("b")])
    assert hits["a"] % 128 == 0, f"predicted {hits['a']} cached tokens on a; the engine can serve 128"


def test_a_kv_aware_models_engine_never_gets_a_full_kv_cache_report_mode(tmp_path, tok_dir):
    """vllm_xargs.kv_cache_report_mode=full would have the engine re-announce a cached prefix as new stores,
    which the index counts as copies: the gateway takes that key out (and keeps the request's other xargs)."""
    import json

    import openai

    from gateway_harness import Harness, Sim
    h = Harness(tmp_path, "  - name: m\n    engine: simulator\n    container: {enabled: false}\n"
                          f"    model_path: {tok_dir}\n    routing: kv_aware\n")
    sim = Sim("p0")
    try:
        h.route_to([sim])
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="x", max_retries=0)
        c.completions.create(model="m", prompt="x", max_tokens=1,
                             extra_body={"vllm_xargs": {"kv_cache_report_mode": "full", "other": 1}})
        assert json.loads(sim.get("/sim/last_body"))["vllm_xargs"] == {"other": 1}
    finally:
        h.close()
        sim.stop()


def test_a_requests_tokenized_prompt_and_its_body_go_when_it_ends(tok_dir, tmp_path):
    """kv_aware keeps each request's tokenized prompt by its body, for its retries and its waits in the queue:
    the last 64 bodies stayed alive after their requests ended (long-context prompts: megabytes each).  Now an
    entry goes with its request, answered, retried on another replica or refused by every one."""
    import json

    from aiohttp import web

    import asyncio

    from conftest import wait_for
    from gateway_harness import Harness
    from test_gateway_edges import completion_chunk, engines, event_stream, post

    async def ok(request):
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [], "usage": {
            "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def busy(request):
        return web.json_response({"error": {"message": "busy"}}, status=503)
    h = Harness(tmp_path, f"  - name: m\n    engine: simulator\n    container: {{enabled: false}}\n"
                          f"    model_path: {tok_dir}\n    routing: kv_aware\n", "max_retries: 1")
    try:
        a, b = engines(h, busy, ok)
        kept = h.gateway.pools.kv.models["m"].prompts
        for i in range(3):
            status, _, _ = post(h, json.dumps(chat(DOC, f"question {i}?")).encode(), path="/v1/chat/completions")
            assert status == 200
        assert len(a["seen"]) + len(b["seen"]) >= 3 and len(kept) == 0, len(kept)
        engines(h, busy, busy)   # refused everywhere: a 503 after its retry
        status, _, _ = post(h, json.dumps(chat(DOC, "one more?")).encode(), path="/v1/chat/completions")
        assert status == 503 and len(kept) == 0
        calls: list = []

        async def dies_mid_stream(request):   # the continuation's body (the prompt's ids and more) goes too
            resp = await event_stream(request, calls)
            if len(calls) == 1:
                await resp.write(completion_chunk(" a", [11], prompt=[1, 2]))
                await asyncio.sleep(0.1)
                request.transport.close()
                return resp
            for c in (completion_chunk(" b", [12], prompt=[1, 2, 11]), completion_chunk(" c", [13], "stop")):
                await resp.write(c)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        engines(h, dies_mid_stream, dies_mid_stream)
        status, _, data = post(h, json.dumps({"model": "m", "prompt": DOC, "max_tokens": 5, "stream": True}).encode())
        assert status == 200 and len(calls) == 2 and b'" c"' in data, data
        wait_for(lambda: len(kept) == 0, 5, "the request's end (after its last bytes went)")
    finally:
        h.close()


@pytest.mark.parametrize("config,mode", [({"model_type": "gpt_oss"}, "harmony (gpt-oss)"),
                                         ({"architectures": ["DeepseekV32ForCausalLM"]}, "deepseek_v32"),
                                         ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, None)])
def test_a_model_vllm_renders_with_its_own_tokenizer_is_not_routed_on_the_gateways(tok_dir, tmp_path, caplog,
                                                                                   config, mode):
    """vLLM picks a renderer of its own for some models (gpt-oss's harmony format; a tokenizer mode per
    architecture: DeepSeek V3.2, Kimi, ...), not the chat template and tokenizer.json the gateway reads: the
    gateway's block keys never matched the engine's events, silently.  It says so and routes by load."""
    import json
    import shutil

    from orchestrator.gateway.kvroute import load_tokenizer
    d = tmp_path / "model"
    shutil.copytree(tok_dir, d)
    (d / "config.json").write_text(json.dumps(config))
    m = ModelConfig(name="m", engine="simulator", model_path=str(d), routing="kv_aware", container={"enabled": False})
    tok = load_tokenizer(m)
    assert (tok is None) == (mode is not None)
    assert (f"its own {mode} tokenizer" in caplog.text) if mode else "its own" not in caplog.text
    if mode:   # the engine told to use the model's own files (tokenizer-mode hf): followed, but for gpt-oss's
        hf = load_tokenizer(m.model_copy(update={"vllm_args": {"tokenizer-mode": "hf"}}))   # harmony (by type)
        assert (hf is None) == mode.startswith("harmony")
