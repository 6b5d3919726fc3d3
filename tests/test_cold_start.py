"""Requests held through a cold start in the gateway: oldest first, an urgent report to the fleet, a 503 that
says what the fleet waits for, and held requests ended at once when the model is blocked."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
import urllib.request

import openai
import pytest
import yaml

from conftest import ROOT, wait_for
from gateway_harness import Harness, Sim
from orchestrator.config import GatewayConfig, ModelConfig
from orchestrator.contract import Endpoint, ModelRoutes, Replica, RoutingTable
from orchestrator.gateway.pool import NoReplica, Pools, QueueFull
from test_gateway import post, sims  # noqa: F401 - fixtures

AUTO = """\
  - name: m
    engine: simulator
    container: {{enabled: false}}
    autoscale: {{min_replicas: 0, max_replicas: 2, cold_start_hold_s: {hold}}}
"""


def model(**kw) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False},
                                       "max_inflight_per_replica": 1, **kw})


def replica(jid: str) -> Replica:
    return Replica(jid, "m", 0, Endpoint(jid, "127.0.0.1", 1, "s"))


async def test_held_requests_get_the_replica_oldest_first():
    pools = Pools(GatewayConfig(), [model(autoscale={"max_replicas": 1})])
    pool = pools.resolve("m")
    assert pool.hold_s() == 600.0          # no READY replica: the cold-start hold, not the 30 s queue timeout
    order: list[int] = []

    async def one(i: int) -> None:
        lease = await pool.acquire({}, {}, set(), 30)
        order.append(i)
        await asyncio.sleep(0.01)
        lease.ok = True
        lease.release()

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.005)           # arrive in order 0..4
    assert len(pool.waiting_since) == 5
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))   # one slot of capacity 1
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == [0, 1, 2, 3, 4]
    assert pool.hold_s() == 30.0             # with a READY replica: the ordinary queue timeout


async def test_a_request_queued_behind_a_full_replica_that_dies_is_held_like_a_cold_start():
    """The queue timeout (0.5 s here) was fixed when the request began to wait behind the one full replica;
    when that replica leaves the table the model has none READY, and the request is held for
    ``cold_start_hold_s`` from when it came (it got a 503 after 0.5 s while the next replica was on its way),
    then served by the next one.  A request that waits behind a full replica that stays has the queue
    timeout, and its 503 says no replica had room (it said none became ready)."""
    pools = Pools(GatewayConfig(queue_timeout_s=0.5), [model(autoscale={"max_replicas": 1, "cold_start_hold_s": 60})])
    pool = pools.resolve("m")
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
    busy = pool.try_acquire({}, {}, set())
    assert busy is not None and pool.hold_s() == 0.5
    t0 = time.monotonic()
    with_room = asyncio.create_task(pool.acquire({}, {}, set(), None))
    try:
        await asyncio.wait_for(with_room, 5)
        raise AssertionError("served by a full replica")
    except NoReplica:
        assert 0.4 < time.monotonic() - t0 < 2.0
    waiter = asyncio.create_task(pool.acquire({}, {}, set(), None))
    await asyncio.sleep(0.1)
    pools.apply(RoutingTable(2, {"m": ModelRoutes(1, (), "job 2 is PENDING in SLURM (Resources)")}))
    await asyncio.sleep(1.5)
    assert not waiter.done()
    pools.apply(RoutingTable(3, {"m": ModelRoutes(1, (replica("j2"),))}))
    lease = await asyncio.wait_for(waiter, 5)
    assert lease.slot.job_id == "j2"


def test_a_503_after_waiting_behind_full_replicas_says_none_had_room(tmp_path):
    h = Harness(tmp_path, AUTO.format(hold=60) + "    max_inflight_per_replica: 1\n", "queue_timeout_s: 0.5")
    sim = Sim("t0", "--tokens-per-s", "50")
    try:
        h.route_to([sim])
        slow = threading.Thread(target=post, args=(h.base + "/v1/completions", json.dumps(
            {"model": "m", "prompt": "x", "max_tokens": 200}).encode()))
        slow.start()
        wait_for(lambda: any(x.inflight for x in h.gateway.pools.resolve("m").slots.values()), 5, "the slow request on the replica")
        code, _, body = post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode())
        assert code == 503 and body["error"]["message"].startswith("No replica of `m` had room within"), body
        slow.join(30)
    finally:
        h.close()
        sim.stop()


async def test_a_blocked_model_ends_held_requests_at_once_with_the_reason():
    pools = Pools(GatewayConfig(), [model(autoscale={"max_replicas": 1})])
    pool = pools.resolve("m")
    waiter = asyncio.create_task(pool.acquire({}, {}, set(), 600))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    pools.apply(RoutingTable(2, {"m": ModelRoutes(1, (), "", "sbatch rejected the job: invalid partition")}))
    try:
        await asyncio.wait_for(waiter, 5)
        raise AssertionError("a blocked model served a request")
    except NoReplica as exc:
        assert "invalid partition" in exc.args[0]
    assert time.monotonic() - t0 < 1.0
    try:   # and a new request is not held at all
        await pool.acquire({}, {}, set(), 600)
        raise AssertionError("held a request for a blocked model")
    except NoReplica:
        pass


async def test_a_reload_that_removes_a_model_ends_its_held_requests_at_once():
    pools = Pools(GatewayConfig(), [model(autoscale={"max_replicas": 1}), model(name="other")])
    waiter = asyncio.create_task(pools.resolve("m").acquire({}, {}, set(), 600))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    pools.set_models(GatewayConfig(), [model(name="other")])
    try:
        await asyncio.wait_for(waiter, 5)
        raise AssertionError("a removed model served a request")
    except NoReplica as exc:
        assert exc.args[0] == "model m was removed from the fleet"
    assert time.monotonic() - t0 < 1.0 and pools.resolve("m") is None


def test_hold_ends_with_a_503_naming_the_pending_job_and_a_replica_ending_the_hold_serves(tmp_path, sims):
    urgent: list[int] = []
    h = Harness(tmp_path, AUTO.format(hold=1.5), "queue_timeout_s: 0.5")
    try:
        h.hub.on_urgent = lambda: urgent.append(1)
        h.gateway.on_hold = lambda: h.hub.receive(h.gateway.report(urgent=True))

        async def publish(routes):
            h.publisher.on_routes(routes)
        h.call(publish({"m": ModelRoutes(1, (), "job 4242 is PENDING in SLURM (Resources)",
                                         waiting_from=time.time() - 12)}))
        t0 = time.monotonic()
        code, headers, body = post(h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
        waited = time.monotonic() - t0
        assert code == 503 and body["error"]["code"] == "no_replica", body
        # the time waited is the gateway's to add, when it answers (12 s before the publication, 1.5 s held)
        assert re.search(r"within 1.5s; job 4242 is PENDING in SLURM \(Resources\) for 1[345]s\.$",
                         body["error"]["message"]), body
        assert headers["Retry-After"] == "30"
        assert 1.4 < waited < 10          # the model's hold (1.5 s), not the queue timeout (0.5 s)
        assert urgent == [1]              # the fleet heard of the held request at once, once
        # a held request is served when a replica turns READY, and counted as a cold start
        s = sims(1)[0]
        result = []
        t = threading.Thread(target=lambda: result.append(post(
            h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 3}).encode())))
        t.start()
        wait_for(lambda: len(urgent) == 2, 5, "the second held request's urgent report")
        h.set_ready([s.backend()])
        t.join(10)
        assert result and result[0][0] == 200
        assert h.metric("slurmfleet_cold_start_seconds_count", model="m") == 1
        assert h.metric("slurmfleet_request_queue_wait_seconds_count", model="m") == 2
    finally:
        h.close()


def test_requests_that_cannot_be_held_tell_the_fleet_once_a_second_and_a_blocked_model_not_at_all(tmp_path):
    """Every request to a model that ends its wait at once (no hold, or blocked) sent an urgent report, each
    one waking the reconcile loop for a tick (an squeue) at once: steady traffic to such a model kept it
    ticking back to back.  A model with no hold still wakes the fleet (a cold start), at most once a second;
    a blocked one (pinned at 0, a spec SLURM rejects) has nothing to wake."""
    urgent: list[float] = []
    h = Harness(tmp_path, AUTO.format(hold=0), "")
    try:
        h.hub.on_urgent = lambda: urgent.append(time.monotonic())
        h.gateway.on_hold = lambda: h.hub.receive(h.gateway.report(urgent=True))
        body = json.dumps({"model": "m", "prompt": "x"}).encode()
        t0 = time.monotonic()
        codes = [post(h.base + "/v1/completions", body)[0] for _ in range(30)]
        spent = time.monotonic() - t0
        assert set(codes) == {503}
        wait_for(lambda: urgent, 5, "the first urgent report")
        assert 1 <= len(urgent) <= spent + 2, (len(urgent), spent)   # (30 before)

        async def publish(routes):
            h.publisher.on_routes(routes)
        h.call(publish({"m": ModelRoutes(0, (), "", "model m is pinned at 0 replicas by 'slurmfleet scale'")}))
        time.sleep(1.1)
        before = len(urgent)
        assert {post(h.base + "/v1/completions", body)[0] for _ in range(10)} == {503}
        time.sleep(0.2)
        assert len(urgent) == before
        # nothing will change before an operator acts: its Retry-After (30 s) made the openai SDK wait out two
        # retries (a minute) before it raised; x-should-retry: false tells it not to retry
        code, headers, err = post(h.base + "/v1/completions", body)
        assert headers.get("x-should-retry") == "false" and "pinned at 0" in err["error"]["message"], headers
        client = openai.OpenAI(base_url=h.base + "/v1", api_key="none", max_retries=2)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="m", prompt="x")
        assert e.value.status_code == 503 and time.monotonic() - t0 < 10
    finally:
        h.close()


def test_held_requests_wait_on_when_the_replica_that_ended_the_hold_is_dead(tmp_path, sims):
    """The replica that ends the hold is READY in the table but its engine has died (no probe saw it yet):
    each held request's one try is refused, and it waits on, within its hold, for the next replica, which
    serves all five (they were all answered 502 at once: every replica had been tried)."""
    h = Harness(tmp_path, AUTO.format(hold=60))
    dead = Sim("dead", "--fault", "refuse")
    try:
        async def publish(routes):
            h.publisher.on_routes(routes)
        h.call(publish({"m": ModelRoutes(1, (), "job 7 is starting")}))
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(post(
            h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 3}).encode())))
            for _ in range(5)]
        for t in threads:
            t.start()
        wait_for(lambda: len(h.gateway.pools.resolve("m").waiting_since) == 5, 10, "five held requests")
        h.set_ready([dead.backend()])
        wait_for(lambda: h.metric("slurmfleet_request_retries_total", model="m", reason="connect") == 5, 10,
                 "each held request refused by the dead replica")
        assert results == []
        h.set_ready([sims(1)[0].backend()])
        for t in threads:
            t.join(20)
        assert [r[0] for r in results] == [200] * 5, results
        # one wait a request, its two waits summed (each was a queue_wait of its own: 10 for 5 requests)
        assert h.metric("slurmfleet_request_queue_wait_seconds_count", model="m") == 5
    finally:
        dead.proc.kill()
        h.close()


def test_a_held_request_whose_replica_was_dead_waits_on_only_within_its_first_hold(tmp_path):
    """The hold bounds the whole wait: a held request that tried a dead replica 2.5 s into its 8 s hold and
    went back to waiting ends at 8 s, not 8 s after its second wait began (10.5 s).  (The hold is long enough
    for a loaded machine to reach the try within it; the bound is relative to when the try came.)"""
    h = Harness(tmp_path, AUTO.format(hold=8))
    dead = Sim("dead", "--fault", "refuse")
    try:
        async def publish(routes):
            h.publisher.on_routes(routes)
        h.call(publish({"m": ModelRoutes(1, (), "job 7 is starting")}))
        results: list = []
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: results.append(post(
            h.base + "/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 3}).encode())))
        t.start()
        wait_for(lambda: len(h.gateway.pools.resolve("m").waiting_since) == 1, 10, "the held request")
        time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
        h.set_ready([dead.backend()])
        tried = time.monotonic() - t0
        wait_for(lambda: h.metric("slurmfleet_request_retries_total", model="m", reason="connect") == 1, 10,
                 "the try on the dead replica")
        h.set_ready([])   # the probes saw it die: no replica again
        t.join(30)
        waited = time.monotonic() - t0
        assert results and results[0][0] == 503 and results[0][2]["error"]["code"] == "no_replica", results
        assert 7.9 < waited < tried + 8 - 0.5, (waited, tried)
    finally:
        dead.proc.kill()
        h.close()


async def test_a_retry_waiting_behind_the_replica_it_tried_gets_the_queue_timeout_not_a_cold_hold():
    """An autoscaled model's only READY replica is one the request already tried (it answered 503), and full: the
    request waits the queue timeout, not the cold-start hold (600 s) as if no replica were READY."""
    pools = Pools(GatewayConfig(queue_timeout_s=0.5), [model(autoscale={"max_replicas": 2})])
    pool = pools.resolve("m")
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
    busy = pool.try_acquire({}, {}, set())
    assert busy is not None and pool.hold_s() == 0.5
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(pool.acquire({}, {}, {"j1"}, None), 10)
        raise AssertionError("a lease on the replica it excluded")
    except NoReplica:
        pass
    assert time.monotonic() - t0 < 5
    busy.release()


async def test_a_generation_moving_off_a_dead_replica_waits_even_with_the_queue_full():
    """The queue is full (here: no room at all) when a replica dies under load: a generation under way that must
    move (rank -1) still waits its turn for a replica (its stream ended at once with an error)."""
    pools = Pools(GatewayConfig(max_queue_per_model=0), [model()])
    pool = pools.resolve("m")
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
    busy = pool.try_acquire({}, {}, set())
    try:
        await pool.acquire({}, {}, set(), 5)
        raise AssertionError("a new request queued beyond the queue's size")
    except QueueFull:
        pass
    moving = asyncio.create_task(pool.acquire({}, {}, set(), 5, -1))
    await asyncio.sleep(0.1)
    assert not moving.done()
    busy.ok = True
    busy.release()
    lease = await asyncio.wait_for(moving, 5)
    assert lease.slot.job_id == "j1"
    lease.release()


async def test_a_held_request_back_from_a_replica_that_refused_it_keeps_its_place_in_a_full_queue():
    """A held request whose new replica refused its connect waits again (its hold from its arrival): with the
    queue filled meanwhile by later arrivals it got a 429, and with room it went to the back, behind them.
    Found by a review."""
    pools = Pools(GatewayConfig(max_queue_per_model=2), [model(autoscale={"max_replicas": 1})])
    pool = pools.resolve("m")
    arrived = time.monotonic() - 5   # held since, then its replica j0 refused it
    later = [asyncio.create_task(pool.acquire({}, {}, set(), 30)) for _ in range(2)]   # the queue is full now
    await asyncio.sleep(0.05)
    assert len(pool.waiting_since) == 2
    try:
        await pool.acquire({}, {}, set(), 30)
        raise AssertionError("a new request queued beyond the queue's size")
    except QueueFull:
        pass
    back = asyncio.create_task(pool.acquire({}, {}, {"j0"}, None, 0, "", arrived, {"j0": time.monotonic()}))
    await asyncio.sleep(0.05)
    assert not back.done() and len(pool.waiting_since) == 3
    assert pool.queue_state(time.monotonic()).oldest_age_s >= 5   # (the status's oldest held age: its own)
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))   # one slot of capacity 1
    lease = await asyncio.wait_for(back, 5)   # first: it arrived before them
    assert lease.slot.job_id == "j1" and not any(t.done() for t in later)
    lease.release()
    for t in later:
        (await asyncio.wait_for(t, 5)).release()


def test_models_at_zero_stay_listed(tmp_path):
    h = Harness(tmp_path, AUTO.format(hold=1), "")
    try:
        with urllib.request.urlopen(h.base + "/v1/models", timeout=5) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["m"]
    finally:
        h.close()


def test_yaml_example_documents_autoscale():
    doc = yaml.safe_load((ROOT / "configs" / "example.yaml").read_text())
    assert any("autoscale" in m for m in doc["models"])


async def test_a_request_held_again_after_its_new_replica_failed_waits_out_one_hold_from_its_arrival():
    """Its hold ended with a replica whose first answer was a reset, and that replica left the table before the
    retry: the second wait started a whole new cold_start_hold_s (a 503 after up to twice the hold, saying it
    was one hold).  The hold counts from the request's arrival."""
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.parsing import Parsed, Rejected
    from orchestrator.gateway.server import Gateway
    from orchestrator.gateway.upstreamerrors import UpstreamFailed
    from orchestrator.reqstats import RequestStats
    cfg = load_config_text("fleet: f\nstate_dir: /nonexistent/sf\nmodels:\n  - name: m\n    engine: simulator\n"
                           "    container: {enabled: false}\n"
                           "    autoscale: {min_replicas: 0, max_replicas: 2, cold_start_hold_s: 4}\n", "f.yaml", {})

    class Up:
        async def request(self, *a, **k):
            await asyncio.sleep(0.05)
            raise UpstreamFailed("connection reset")   # the new engine died on its first request

    class Transport:
        def is_closing(self) -> bool:
            return False

    class Request:
        headers: dict = {}
        transport = Transport()
    pools = Pools(cfg.gateway, cfg.models)
    gw = Gateway(cfg, pools, Up(), RequestStats())
    p = Parsed(Request(), pools.resolve("m"), "m", {"model": "m"}, b"{}", b"", gw.tenants.identify({}))

    async def fleet() -> None:
        await asyncio.sleep(2.5)   # a replica READY 2.5 s into the hold, gone from the table at once
        pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
        await asyncio.sleep(0.02)
        pools.apply(RoutingTable(2, {"m": ModelRoutes(1, ())}))
    lag = [0.0]

    async def watch() -> None:   # how late this loop ran (a loaded machine: other processes had the CPUs)
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.02)
            lag[0] += max(0.0, time.monotonic() - t - 0.02)
    t0 = time.monotonic()
    task, watcher = asyncio.create_task(fleet()), asyncio.create_task(watch())
    try:
        resp = await gw._proxy(p, {"request_id": "x", "upstream_id": "x", "retries": 0}, t0)
    except Rejected as e:
        resp = e.response
    took = time.monotonic() - t0
    watcher.cancel()
    await task
    # (6.5 s before: 2.5 + another 4), less the time the loop was held up
    assert resp.status == 503 and 3.9 <= took < 5.5 + lag[0], (resp.status, took, lag[0])


class _Transport:
    def is_closing(self):
        return False


class _Request:
    headers: dict = {}
    transport = _Transport()


def gateway_and_requests(hold: float, queue_timeout: float):
    """A gateway of one autoscaled model (one request per replica) and a maker of its parsed requests."""
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.parsing import Parsed
    from orchestrator.gateway.server import Gateway
    from orchestrator.reqstats import RequestStats
    cfg = load_config_text(
        f"fleet: f\nstate_dir: /nonexistent/sf\ngateway: {{queue_timeout_s: {queue_timeout}}}\nmodels:\n"
        + AUTO.format(hold=hold) + "    max_inflight_per_replica: 1\n", "f.yaml", {})
    pools = Pools(cfg.gateway, cfg.models)
    gw = Gateway(cfg, pools, None, RequestStats())
    return gw, pools, lambda: Parsed(_Request(), pools.resolve("m"), "m", {"model": "m"}, b"{}", b"",
                                     gw.tenants.identify({}))


async def test_the_503_after_a_hold_names_the_wait_it_had():
    """Held from zero (3 s), then the replica that came is full: the 503 names the 3 s it waited (it said the
    0.5 s queue timeout, and '0s' for it), and says no replica had room."""
    from orchestrator.gateway.parsing import Rejected
    gw, pools, mk = gateway_and_requests(hold=3, queue_timeout=0.5)
    first = asyncio.create_task(gw._route(mk(), set(), {}))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(gw._route(mk(), set(), {}))
    await asyncio.sleep(0.2)
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
    lease = await asyncio.wait_for(first, 2)   # the first held request takes the one place
    try:
        await asyncio.wait_for(second, 10)
        raise AssertionError("served")
    except Rejected as exc:
        resp = exc.response
    lease.release()
    body = json.loads(resp.body)
    assert resp.status == 503 and body["error"]["message"] == "No replica of `m` had room within 3s.", body


async def test_a_model_that_cannot_get_a_replica_is_a_503_even_with_no_queue():
    """gateway.max_queue_per_model 0 and a model pinned at 0: a 503 that says why (it was a 429 queue_full with
    Retry-After 1, which clients retry forever)."""
    from orchestrator.gateway.parsing import Rejected
    gw, pools, mk = gateway_and_requests(hold=600, queue_timeout=30)
    pools.pools["m"].limits = dataclasses.replace(pools.pools["m"].limits, max_queue=0)
    pools.apply(RoutingTable(1, {"m": ModelRoutes(0, (), "", "model m is pinned at 0 replicas by 'slurmfleet scale'")}))
    try:
        await gw._route(mk(), set(), {})
        raise AssertionError("routed")
    except Rejected as exc:
        resp = exc.response
    body = json.loads(resp.body)
    assert resp.status == 503 and "pinned at 0" in body["error"]["message"], body


async def test_a_reload_that_shortens_the_hold_applies_to_held_requests():
    pools = Pools(GatewayConfig(), [model(autoscale={"max_replicas": 1, "cold_start_hold_s": 600})])
    waiter = asyncio.create_task(pools.resolve("m").acquire({}, {}, set(), None))
    await asyncio.sleep(0.1)
    pools.set_models(GatewayConfig(), [model(autoscale={"max_replicas": 1, "cold_start_hold_s": 1})])
    try:
        await asyncio.wait_for(waiter, 10)   # (it was held the 600 s it began with)
        raise AssertionError("served")
    except NoReplica as exc:
        assert exc.held and exc.waited_s == 1


async def test_a_held_request_tries_again_a_replica_that_refused_one_connect():
    """The replica that ends a hold refuses the held request's first connect (a lost SYN, a connect timeout)
    and then serves: the request tries it again a little later (it excluded the replica for the rest of the
    hold, then got a 503 'no replica became ready' while that replica served every other request)."""
    from orchestrator.gateway.upstreamerrors import ConnectFailed

    class Served(Exception):
        pass

    class Upstream:
        calls = 0

        async def request(self, *a, **k):
            Upstream.calls += 1
            await asyncio.sleep(0.01)
            if Upstream.calls == 1:
                raise ConnectFailed("cannot connect to 127.0.0.1:1: timed out")
            raise Served()

    gw, pools, mk = gateway_and_requests(hold=8, queue_timeout=30)
    gw.upstream = Upstream()

    async def fleet():
        await asyncio.sleep(0.3)   # the cold start's replica turns READY, and stays
        pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (replica("j1"),))}))
    task = asyncio.create_task(fleet())
    t0 = time.monotonic()
    try:
        await gw._proxy(mk(), {"request_id": "x", "upstream_id": "x", "retries": 0}, t0)
        raise AssertionError("answered without the replica")
    except Served:
        pass
    await task
    assert Upstream.calls == 2 and time.monotonic() - t0 < 7


async def test_a_held_request_whose_replicas_all_refuse_ends_after_its_hold():
    """Tried again 2 s later, replicas that keep refusing (3, each connect timing out after 1 s) kept a held request
    going round them past its hold, never answered."""
    from orchestrator.gateway.upstreamerrors import ConnectFailed

    class Upstream:
        calls = 0

        async def request(self, *a, **k):
            Upstream.calls += 1
            await asyncio.sleep(1.0)
            raise ConnectFailed("cannot connect to 127.0.0.1:1: timed out")

    gw, pools, mk = gateway_and_requests(hold=3, queue_timeout=1)
    gw.upstream = Upstream()

    async def fleet():
        await asyncio.sleep(0.2)
        pools.apply(RoutingTable(1, {"m": ModelRoutes(3, tuple(replica(f"j{i}") for i in range(3)))}))
    task = asyncio.create_task(fleet())
    t0 = time.monotonic()
    resp = await asyncio.wait_for(gw._proxy(mk(), {"request_id": "x", "upstream_id": "x", "retries": 0}, t0), 30)
    await task
    assert resp.status == 502 and Upstream.calls <= 6 and time.monotonic() - t0 < 10, (Upstream.calls, resp.status)


def test_a_request_held_after_it_began_to_wait_waits_on_past_a_dead_replica_too(tmp_path, sims):
    """A request queued behind the one full replica is held once that replica leaves the table; the replica that
    ends the hold is dead (no probe saw it yet).  A request held from its arrival waited on within its hold; this
    one, held later, got a 502 at once (every replica tried)."""
    h = Harness(tmp_path, AUTO.format(hold=60).replace("autoscale:", "max_inflight_per_replica: 1\n    autoscale:"))
    slow, dead = Sim("slow", "--tokens-per-s", "4"), Sim("dead", "--fault", "refuse")
    try:
        h.set_ready([slow.backend()])
        results: dict = {}

        def send(name: str, tokens: int) -> None:
            results[name] = post(h.base + "/v1/completions", json.dumps(
                {"model": "m", "prompt": "x", "max_tokens": tokens, "ignore_eos": True}).encode())
        first = threading.Thread(target=send, args=("first", 12))   # 3 s on the one slot
        first.start()
        wait_for(lambda: slow.metric("vllm:num_requests_running") == 1, 10, "the first request running")
        second = threading.Thread(target=send, args=("second", 2))
        second.start()
        wait_for(lambda: len(h.gateway.pools.resolve("m").waiting_since) == 1, 10, "the second one queued")

        async def publish(routes):
            h.publisher.on_routes(routes)
        h.call(publish({"m": ModelRoutes(1, (), "job 8 is starting")}))   # the full replica leaves: held
        time.sleep(1.5)   # (a waiter looks at least once a second; a new job takes far longer to be READY)
        h.set_ready([dead.backend()])
        wait_for(lambda: h.metric("slurmfleet_request_retries_total", model="m", reason="connect") == 1, 10,
                 "the held request refused by the dead replica")
        assert "second" not in results
        h.set_ready([sims(1)[0].backend()])
        second.join(20)
        first.join(20)
        assert results["second"][0] == 200, results["second"]
    finally:
        dead.proc.kill()
        slow.stop()
        h.close()
