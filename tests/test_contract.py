"""The routing contract between the fleet and the gateway, without sockets: the table publisher, the
report hub, the gateway's pools and leases, /readyz, and the layering the contract stands for."""

from __future__ import annotations

import ast
import pickle
import random
import subprocess
import sys

import pytest

from conftest import ROOT
from orchestrator.fleetfile import load_config_text
from orchestrator.contract import (Endpoint, EngineLoad, GatewayReport, ModelRoutes, QueueState, Replica,
                                   RoutingTable)
from orchestrator.fleet.publisher import TablePublisher
from orchestrator.fleet.reports import ReportHub
from orchestrator.gateway.pool import Pools
from orchestrator.gateway.server import Gateway
from orchestrator.gateway.upstream import Upstream
from orchestrator.reqstats import RequestStats


def cfg_with(models: str = "  - {name: m, engine: simulator, container: {enabled: false}, replicas: 2}\n",
             gateway: str = ""):
    return load_config_text(f"fleet: f\nstate_dir: /tmp/x\ngateway: {{{gateway}}}\nmodels:\n{models}", "f.yaml", {})


def rep(jid: str, slot: int = 0, model: str = "m", port: int = 1) -> Replica:
    return Replica(jid, model, slot, Endpoint(jid, "127.0.0.1", port, "s"))


class Sink:
    def __init__(self):
        self.tables = []

    def publish(self, table):
        self.tables.append(table)


def test_publisher_versions_only_changes_and_joins_the_scraped_load():
    sink, hub = Sink(), ReportHub()
    pub = TablePublisher(sink, hub)
    routes = {"m": ModelRoutes(2, (rep("1"), rep("2", 1)))}
    pub.on_routes(routes)
    pub.on_routes(dict(routes))  # the same READY set every tick: no new table
    assert [t.version for t in sink.tables] == [1] and hub.table_version == 1
    pub.on_loads({"2": EngineLoad(waiting=3.0, running=1.0, kv_usage=0.5)})
    t = sink.tables[-1]
    assert t.version == 2 and t.ready("m")[1].load.waiting == 3.0 and t.ready("m")[0].load == EngineLoad()
    assert t.desired("m") == 2 and t.desired("other") == 0
    pub.on_routes({"m": ModelRoutes(0, ())})  # scaled to zero
    assert sink.tables[-1].version == 3 and sink.tables[-1].ready("m") == ()
    # both directions cross a process boundary as pickles
    report = GatewayReport(1, 3, {"1": 2}, {"m": QueueState(1, 0.5)}, RequestStats().snapshot())
    assert pickle.loads(pickle.dumps(sink.tables[-1])) == sink.tables[-1]
    assert pickle.loads(pickle.dumps(report)) == report


def test_hub_sums_processes_waits_for_every_ack_and_keeps_counters_of_dead_ones():
    hub = ReportHub()
    hub.published(5)
    stats = RequestStats()
    stats.request("m", 200, "0")
    hub.receive(GatewayReport(1, 5, {"j1": 2}, {"m": QueueState(3, 1.5)}, stats.snapshot()))
    hub.receive(GatewayReport(2, 5, {"j1": 1, "j2": 4}, {"m": QueueState(1, 4.0)}, stats.snapshot()))
    assert hub.inflight("j1") == 3 and hub.inflight("j2") == 4 and hub.inflight("j9") == 0
    assert hub.queued() == {"m": QueueState(4, 4.0)}
    hub.published(6)  # a process that has not routed on the newest table might still send j9 a request
    assert hub.inflight("j9") == 1
    hub.receive(GatewayReport(1, 6, {}, {}, stats.snapshot()))
    hub.receive(GatewayReport(2, 6, {}, {}, stats.snapshot()))
    assert hub.inflight("j9") == 0
    total = RequestStats()
    for snap in hub.stats_snapshots():
        total.add(snap)
    assert total.requests == {("m", "200", "0"): 2}
    hub.retire(2)  # died: its counted requests stay, its in-flight goes
    hub.receive(GatewayReport(1, 6, {"j1": 1}, {}, stats.snapshot()))
    total = RequestStats()
    for snap in hub.stats_snapshots():
        total.add(snap)
    assert total.requests == {("m", "200", "0"): 2} and hub.inflight("j1") == 1


def test_the_requests_a_dead_process_held_are_counted_as_cut():
    """A gateway worker killed (SIGKILL, the OOM killer) cut the requests it held: they were counted nowhere, so
    the error ratio missed them.  They end as of its last report: 502, slot "lost"."""
    hub = ReportHub()
    stats = RequestStats()
    stats.request("m", 200, "0")
    hub.receive(GatewayReport(1, 0, {"j1": 2}, {"m": QueueState(1, 0.5), "idle": QueueState(0, 0.0)},
                              stats.snapshot(inflight={"m": 2, "n": 1})))
    hub.receive(GatewayReport(2, 0, {"j1": 4}, {}, stats.snapshot(inflight={"m": 4})))
    hub.retire(1)
    hub.retire(9)   # (never reported: nothing)
    total = RequestStats()
    for snap in hub.stats_snapshots():
        total.add(snap)
    assert total.requests == {("m", "200", "0"): 2, ("m", "502", "lost"): 3, ("n", "502", "lost"): 1}
    assert total.inflight == {"m": 4}


def test_a_dead_processs_gauges_go_with_it_its_counters_stay():
    """A retired gateway process's KV index size (a gauge combined by max over processes) was kept as a floor
    for ever: 500 blocks reported by a process long dead beside a live one's 10."""
    hub = ReportHub()
    dead, live = RequestStats(), RequestStats()
    dead.kv_blocks["m"], live.kv_blocks["m"] = 500, 10
    dead.bump("kv_events", 7, "m")
    hub.receive(GatewayReport(1, 0, {}, {}, dead.snapshot()))
    hub.receive(GatewayReport(2, 0, {}, {}, live.snapshot()))
    hub.retire(1)
    total = RequestStats()
    for snap in hub.stats_snapshots():
        total.add(snap)
    assert total.kv_blocks == {"m": 10} and total.kv_events == {("m",): 7}


def pools_for(cfg) -> Pools:
    return Pools(cfg.gateway, cfg.models, rng=random.Random(0))


def test_a_lease_is_the_one_in_flight_count_and_outlives_the_replicas_routing():
    cfg = cfg_with()
    pools = pools_for(cfg)
    pools.apply(RoutingTable(1, {"m": ModelRoutes(2, (rep("1"), rep("2", 1)))}))
    pool = pools.resolve("m")
    leases = [pool.try_acquire({}, {}, set()) for _ in range(4)]
    assert sum(pools.inflight_by_job().values()) == 4 and pools.inflight_by_model() == {"m": 4}
    on_1 = [x for x in leases if x.slot.job_id == "1"]
    assert on_1 and pools.inflight_by_job()["1"] == len(on_1)
    pools.apply(RoutingTable(2, {"m": ModelRoutes(2, (rep("2", 1),))}))  # "1" drained: leaves routing...
    assert "1" not in pool.slots and pools.inflight_by_job()["1"] == len(on_1)  # ...its requests still count
    assert all(pool.try_acquire({}, {}, set()).slot.job_id == "2" for _ in range(3))
    for lease in on_1:
        lease.ok = True
        lease.release()
        lease.release()  # a second release is a no-op
    assert "1" not in pools.inflight_by_job() and "1" not in pools.jobs
    assert pools.inflight_by_model() == {"m": 4 - len(on_1) + 3}


def test_failures_eject_after_the_configured_count_never_more_than_half():
    cfg = cfg_with(gateway="eject_after_failures: 2, eject_base_s: 7")
    now = [100.0]
    pools = Pools(cfg.gateway, cfg.models, rng=random.Random(0), clock=lambda: now[0])
    pools.apply(RoutingTable(1, {"m": ModelRoutes(2, (rep("1"), rep("2", 1)))}))
    pool = pools.resolve("m")

    def fail(jid: str) -> bool:
        lease = pool.try_acquire({}, {}, {"1", "2"} - {jid})
        assert lease.slot.job_id == jid
        lease.ok = False
        return lease.release()

    assert fail("1") is False and fail("1") is True  # the 2nd consecutive failure ejects
    assert pools.jobs["1"].ejected_until == pytest.approx(107.0)
    assert [s.job_id for s in pool.routable(set())] == ["2"]
    assert fail("2") is False and fail("2") is False  # ejecting "2" too would leave none: panic mode instead
    now[0] = 108.0
    assert {s.job_id for s in pool.routable(set())} == {"1", "2"}


def test_the_requests_an_ejected_replica_held_do_not_count_towards_its_next_ejection():
    """A replica with a network blip fails every request it holds: those that fail after its ejection kept adding
    to its count, and back from its ejection one failure ejected it again for twice as long."""
    cfg = cfg_with(gateway="eject_after_failures: 3, eject_base_s: 2")
    now = [100.0]
    pools = Pools(cfg.gateway, cfg.models, rng=random.Random(0), clock=lambda: now[0])
    pools.apply(RoutingTable(1, {"m": ModelRoutes(3, (rep("1"), rep("2", 1), rep("3", 2)))}))
    pool = pools.resolve("m")
    held = [pool.try_acquire({}, {}, {"2", "3"}) for _ in range(20)]   # 20 requests in flight on "1"
    ejected = []
    for lease in held:   # the blip: all of them fail
        lease.ok = False
        ejected.append(lease.release())
    assert ejected.count(True) == 1 and pools.jobs["1"].ejected_until == pytest.approx(102.0)
    now[0] = 103.0   # back
    for _ in range(2):
        lease = pool.try_acquire({}, {}, {"2", "3"})
        lease.ok = False
        assert lease.release() is False   # two failures of three: not ejected again
    assert pools.jobs["1"].ejected_until == pytest.approx(102.0)


async def test_readyz_follows_the_desired_count_the_fleet_publishes():
    from orchestrator.gateway import endpoints
    cfg = cfg_with()
    gw = Gateway(cfg, pools_for(cfg), Upstream(1.0), RequestStats())
    try:
        assert (await endpoints.readyz(gw, None)).status == 503  # no table yet: the config's replicas stand in
        gw.publish(RoutingTable(1, {"m": ModelRoutes(2, ())}))
        assert (await endpoints.readyz(gw, None)).status == 503
        gw.publish(RoutingTable(2, {"m": ModelRoutes(0, ())}))  # `slurmfleet scale m 0`
        assert (await endpoints.readyz(gw, None)).status == 200
        gw.publish(RoutingTable(3, {"m": ModelRoutes(1, (rep("1"),))}))
        assert (await endpoints.readyz(gw, None)).status == 200
        report = gw.report()
        assert report.table_version == 3 and report.process == 0
    finally:
        gw.upstream.close()


async def test_readyz_leaves_out_a_model_waking_from_zero_not_one_below_its_floor():
    """A model autoscaled from zero (target 1, its job PENDING or loading) made the whole gateway 503: a load
    balancer following /readyz cut every model's clients off for a cold start.  Its requests are held, so it
    does not count; one whose min_replicas is above 0 still does."""
    from orchestrator.gateway import endpoints
    auto = "  - {name: %s, engine: simulator, container: {enabled: false}, autoscale: {min_replicas: %d, max_replicas: 2}}\n"
    cfg = cfg_with(auto % ("z", 0) + auto % ("f", 1))
    gw = Gateway(cfg, pools_for(cfg), Upstream(1.0), RequestStats())
    try:
        gw.publish(RoutingTable(1, {"z": ModelRoutes(1, ()), "f": ModelRoutes(1, (rep("1", model="f"),))}))
        assert (await endpoints.readyz(gw, None)).status == 200      # z waking from zero
        gw.publish(RoutingTable(2, {"z": ModelRoutes(1, ()), "f": ModelRoutes(1, ())}))
        assert (await endpoints.readyz(gw, None)).status == 503      # f below its floor
    finally:
        gw.upstream.close()


def imports_of(path) -> set[str]:
    return module_imports(path.read_text(), path.parent.relative_to(ROOT).as_posix().replace("/", "."))


def module_imports(source: str, pkg: str) -> set[str]:
    """Every module a source in package ``pkg`` names in an import, in any of its forms (each name of a
    ``from X import a`` as ``X.a`` too, since ``a`` may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x)
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_the_import_check_sees_every_form_of_import():
    pkg = "orchestrator.gateway"
    for line in ("import orchestrator.fleet.slurm", "from .. import fleet", "from ..fleet import slurm",
                 "from orchestrator.fleet import slurm", "from ..fleet.slurm import Slurm", "import orchestrator.fleet"):
        assert any(f"{m}.".startswith("orchestrator.fleet.") for m in module_imports(line, pkg)), line
    for line in ("from .. import contract", "from ..contract import RoutingTable", "from . import pool", "import os",
                 "from ..fleetfile import parse_config"):   # (the shared fleet-file reader is not the fleet side)
        assert not any(f"{m}.".startswith("orchestrator.fleet.") for m in module_imports(line, pkg)), line


@pytest.mark.parametrize("side,other", [("gateway", "fleet"), ("fleet", "gateway")])
def test_the_two_sides_meet_only_in_the_contract(side, other):
    for path in (ROOT / "orchestrator" / side).glob("*.py"):
        bad = [m for m in imports_of(path) if f"{m}.".startswith(f"orchestrator.{other}.")]
        assert not bad, f"{path.name} imports {bad}"


def test_a_gateway_worker_loads_neither_the_fleet_nor_the_templates():
    code = ("import sys, orchestrator.gateway.worker; "
            "print(sorted(m for m in sys.modules if m.startswith(('orchestrator.fleet', 'orchestrator.observability',"
            " 'jinja2', 'prometheus_client'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_is_much_over_400_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "orchestrator").rglob("*.py")}
    assert max(sizes.values()) <= 420, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


async def test_a_failing_scrape_does_not_stop_the_scrape_loop(tmp_path):
    import asyncio

    from orchestrator.daemon import Daemon

    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\ndaemon: {{tick_interval_s: 0.01}}\nmodels: []\n",
                           "f.yaml", {})
    daemon = Daemon(tmp_path / "f.yaml", cfg)
    calls = []

    class Scraper:
        async def scrape_once(self):
            calls.append(1)
            if len(calls) <= 2:
                raise OSError(24, "Too many open files")

    daemon.scraper = Scraper()
    task = asyncio.create_task(daemon._guard("scrape", daemon._scrape_loop()))
    for _ in range(200):
        if len(calls) >= 4:
            break
        await asyncio.sleep(0.01)
    assert len(calls) >= 4 and not task.done() and not daemon.stop.is_set()
    task.cancel()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
async def test_a_slots_newer_replica_speaks_for_it_while_both_are_ready(order):
    """A successor and the replica it replaces share a slot while both are READY: the newer one's engine
    readings are the slot's whatever the table's order (they used to flip with it, and the slot's token
    counters went back and forth: a reset to Prometheus each time)."""
    from orchestrator.contract import Endpoint, Replica
    from orchestrator.observability.metrics import Metrics
    from orchestrator.observability.scrape import EngineScraper

    old = Replica("99", "m", 0, Endpoint("99", "127.0.0.1", 1, "s", start_time=100.0))
    new = Replica("100", "m", 0, Endpoint("100", "127.0.0.1", 2, "s", start_time=200.0))
    pair = [old, new]

    down: set[str] = set()

    class Readings(EngineScraper):   # the engines' /metrics, as parsed: each replica's own counter
        async def _one(self, r):
            return None if r.job_id in down else (r, {"prompt": 1000.0 if r is old else 5.0})

    metrics = Metrics()
    scraper = Readings(None, metrics, lambda: [pair[i] for i in order], lambda loads: None)
    await scraper.scrape_once()
    assert metrics.engine[("m", "0")] == {"prompt": 5.0}
    down.add("100")                  # one failed scrape of the newer: its last readings, not the older's total
    await scraper.scrape_once()
    assert metrics.engine[("m", "0")] == {"prompt": 5.0}


def test_a_data_parallel_replicas_kv_use_is_the_mean_of_its_engines():
    """vLLM with data parallelism has a series per engine (label ``engine``): counts add up, KV-cache use is a
    share of the replica's memory (a sum passed 1: a percentunit panel over 100%, the autoscaler misled)."""
    from orchestrator.observability.scrape import parse_engine_metrics
    text = ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.9\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.7\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 4\n')
    got = parse_engine_metrics(text)
    assert got["running"] == 7 and abs(got["kv"] - 0.8) < 1e-9
    # a NaN (an engine's gauge before its first value) is no reading: it made the autoscaler's mean NaN, and
    # NaN > high is false, so its engine guards were off
    got = parse_engine_metrics(text + '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} '
                               'NaN\nvllm:num_requests_waiting{engine="1"} 2\n')
    assert got["waiting"] == 2


async def test_a_gateway_worker_that_cannot_start_again_counts_each_attempt():
    """A worker that died and cannot be started again (an import error after an upgrade, a crash before it
    listens): every attempt is a restart in slurmfleet_gateway_worker_restarts_total, so the restart alert
    fires (only the death was counted, once: the gateway ran a process short, silently)."""
    import asyncio
    from orchestrator.gateway.processes import GatewayWorkers
    cfg = load_config_text("fleet: f\nstate_dir: /nonexistent/sf\nmodels: []\ngateway: {workers: 2, "
                           "worker_restart_base_s: 0.01, worker_restart_max_s: 0.02}\n", "f.yaml", {})
    restarts: list[int] = []
    workers = GatewayWorkers(cfg, None, on_restart=lambda: restarts.append(1))

    async def cannot(process: int):
        raise RuntimeError(f"gateway worker {process} could not start: exited or did not answer")
    workers._spawn = cannot
    task = asyncio.create_task(workers.watch(1))
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(restarts) >= 5 and workers.restarts == len(restarts) and workers.processes == 0


async def test_a_gateway_worker_started_during_a_reload_gets_the_new_config(tmp_path):
    """set_config writes to the workers listed, and one starting is listed only once it listens: a reload in that
    window left it on the old config until the next (a revoked key kept working on its share of connections)."""
    import asyncio
    import urllib.error
    import urllib.request

    from conftest import free_port
    from orchestrator.gateway import processes
    port = free_port()
    text = (f"fleet: f\nstate_dir: {tmp_path}\nmodels: []\ngateway: {{port: {port}, shutdown_grace_s: 0, "
            "api_keys: [sk-kept, sk-revoked]}\n")
    workers = processes.GatewayWorkers(load_config_text(text, "f.yaml", {}), None)
    listening, go = asyncio.Event(), asyncio.Event()
    real = processes.read_msg

    async def held(reader):   # the worker's 'listening' reply, held until the reload is done
        msg = await real(reader)
        listening.set()
        await go.wait()
        return msg
    processes.read_msg = held
    try:
        start = asyncio.create_task(workers.start())
        await asyncio.wait_for(listening.wait(), 30)
        workers.set_config(load_config_text(text.replace(", sk-revoked", ""), "f.yaml", {}))
        go.set()
        assert await start
    finally:
        processes.read_msg = real

    def status(key: str) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        try:
            return urllib.request.urlopen(req, timeout=5).status
        except urllib.error.HTTPError as e:
            return e.code
    try:
        codes = []
        for _ in range(40):
            codes = [await asyncio.to_thread(status, k) for k in ("sk-kept", "sk-revoked")]
            if codes == [200, 401]:
                break
            await asyncio.sleep(0.1)
        assert codes == [200, 401]
    finally:
        await workers.stop(0)


def test_a_message_to_a_worker_that_just_ended_is_dropped_not_raised():
    """Under uvloop (the daemon's loop) a write to a worker's socket its end closed raised RuntimeError: a reload
    that met it stopped half-way (the reconciler on the new config, the workers after it on the old one: a revoked
    key still let in there).  The message is dropped: a worker started again gets the latest config."""
    import asyncio
    import socket

    import uvloop

    from orchestrator.gateway.processes import write_msg

    async def main() -> None:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        theirs.close()   # the worker ended
        assert await reader.read() == b""
        for i in range(3):
            write_msg(writer, {"t": "config", "n": i})
            await asyncio.sleep(0.01)
        writer.close()
    uvloop.run(main())


async def test_at_shutdown_a_stream_carried_on_still_waits_for_room_and_a_new_request_does_not():
    """The gateway stopping ends the waits of new requests for room on busy replicas (a 503 at once, not cut at the
    grace's end); a stream moving off a dead replica (rank -1) waits on: its client has part of its answer."""
    import asyncio

    from orchestrator.gateway.pool import NoReplica
    cfg = cfg_with("  - {name: m, engine: simulator, container: {enabled: false}, replicas: 1, "
                   "max_inflight_per_replica: 1}\n")
    pools = Pools(cfg.gateway, cfg.models, rng=random.Random(0))
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (rep("1"),))}))
    pool = pools.resolve("m")
    busy = pool.try_acquire({}, {}, set())
    carried = asyncio.ensure_future(pool.acquire({}, {}, set(), 30.0, rank=-1))
    new = asyncio.ensure_future(pool.acquire({}, {}, set(), 30.0))
    await asyncio.sleep(0.05)
    pools.close_queues("The gateway is shutting down.")
    for _ in range(5):   # (at once, the loop's next turns: not at its next look, a second later)
        await asyncio.sleep(0)
    assert new.done()
    with pytest.raises(NoReplica, match="shutting down"):
        await new
    assert not carried.done()
    busy.ok = True
    busy.release()
    lease = await asyncio.wait_for(carried, 5)
    assert lease.slot.job_id == "1"
    lease.release()


def test_the_gateways_own_refusals_have_series_at_zero_before_the_first():
    """slurmfleet_requests_total was made by its first request: the first burst of 503s of a model with no
    replica (or of 429s) started a new series, which rate() and increase() cannot see (the error-ratio panel
    and alert missed an outage's first interval; found by a soak).  The answers the gateway gives itself
    exist at 0 for every configured model; a replica's (its slot's) from its first."""
    from orchestrator.observability.metrics import Metrics
    from orchestrator.reqstats import RequestStats
    stats = RequestStats()
    metrics = Metrics(request_stats=lambda: [stats.snapshot()])
    metrics.init_model("m")
    text = metrics.render().decode()
    for code, slot in (("503", "none"), ("429", "none"), ("499", "none"), ("429", "refused")):
        assert f'slurmfleet_requests_total{{code="{code}",model="m",slot="{slot}"}} 0.0' in text, (code, slot)
    stats.request("m", 503, "none")
    assert 'slurmfleet_requests_total{code="503",model="m",slot="none"} 1.0' in metrics.render().decode()


async def test_a_reload_that_raised_while_applied_is_recorded_as_rejected():
    """A reload that failed while being applied (not while validated) left the gauge at 1 and no count."""
    from orchestrator.observability.metrics import Metrics
    m = Metrics()

    async def boom() -> dict:
        raise RuntimeError("apply failed")
    with pytest.raises(RuntimeError):
        await m.recorded_reload(boom())
    text = m.render().decode()
    assert "slurmfleet_config_last_reload_successful 0.0" in text
    assert 'slurmfleet_config_reloads_total{result="rejected"} 1.0' in text
    assert m.last_reload["ok"] is False and m.last_reload["errors"] == ["RuntimeError: apply failed"]
