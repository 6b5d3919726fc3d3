"""The autoscaler: the pure decision (table tests and load traces on a fake clock), its config, and the
reconciler and the ``autoscale`` loop acting on its targets against a fake SLURM."""

from __future__ import annotations

import json
import random
import re

import pytest
import yaml

from fakes import FakeSlurm
from orchestrator.config import AutoscaleConfig
from orchestrator.contract import GatewayReport, QueueState
from orchestrator.fleet.autoscale import Autoscaler, Capacity, Sample, decide
from orchestrator.fleet.elastic import Elastic
from orchestrator.fleet.nodememory import NodeMemory
from orchestrator.fleet.planner import Drain, View, plan_model
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.render import Renderer
from orchestrator.fleet.replica import State
from orchestrator.fleet.reports import ReportHub
from orchestrator.reqstats import RequestStats
from orchestrator.fleetfile import load_config_text
from orchestrator.contract import RoutingTable
from orchestrator.observability.metrics import Metrics
from orchestrator.observability.status import fleet_status, render_table
from orchestrator.yamlsrc import ConfigError
from reconciler_harness import T0, Harness as ClockHarness

A = AutoscaleConfig(min_replicas=0, max_replicas=4, target_inflight_per_replica=8, window_s=10,
                    scale_up_delay_s=10, scale_down_delay_s=60, scale_to_zero_after_s=120, trend_window_s=90)


def run_trace(a: AutoscaleConfig, demand, seconds: int, start: int = 1, cap=lambda target: Capacity(target, target),
              waiting=None, kv=None):
    """Feed one sample a second of ``demand(t)`` to an Autoscaler starting at ``start`` replicas; every
    decision that moved the target, as (t, target, cause)."""
    s = Autoscaler()
    s.adopt("m", start, a, 0.0)
    events = []
    for t in range(1, seconds + 1):
        d = demand(t)
        s.observe("m", Sample(float(t), d, 0, waiting(t) if waiting else None, kv(t) if kv else None), a)
        dec = s.step("m", a, cap(s.target("m")), float(t))
        if dec.direction:
            events.append((t, dec.target, dec.cause))
    return events


# -- the pure decision -------------------------------------------------------------------------------------------
def test_cold_start_goes_to_one_at_once_and_says_how_many_are_held():
    d = decide(A, [Sample(100.0, 0, 3)], 0, Capacity(), now=100.0, last_change=0.0, last_busy=100.0, since=0.0)
    assert (d.target, d.direction, d.cause) == (1, "up", "cold_start")
    assert "3 requests held" in d.reason
    idle = decide(A, [Sample(100.0)], 0, Capacity(), now=100.0, last_change=0.0, last_busy=None, since=0.0)
    assert (idle.target, idle.direction) == (0, "")
    # requests that came and ended at once (no room in the gateway's queue, or no hold): a cold start too
    d = decide(A, [Sample(100.0, served=2)], 0, Capacity(), now=100.0, last_change=0.0, last_busy=100.0, since=0.0)
    assert (d.target, d.cause) == (1, "cold_start") and "2 requests that could not be held" in d.reason


def test_bounds_clamp_the_target_in_one_event():
    a = AutoscaleConfig(min_replicas=2, max_replicas=3)
    assert decide(a, [], 0, Capacity(), now=1, last_change=0, last_busy=None, since=0).target == 2
    d = decide(a, [], 5, Capacity(5, 5), now=1, last_change=0, last_busy=None, since=0)
    assert (d.target, d.direction, d.cause) == (3, "down", "bounds")


def test_a_step_load_moves_the_target_once_after_the_up_delay():
    events = run_trace(A, lambda t: 0 if t < 100 else 30, 400)
    # 30 requests at 8 per replica ask for 4; the mean over the 10 s window crosses 3 replicas' worth first,
    # but the up delay takes the smallest recommendation of its window: one event, straight to the need
    assert len(events) == 1, events
    t, target, cause = events[0]
    assert target == 4 and cause == "load"
    assert 100 + A.scale_up_delay_s <= t <= 100 + A.window_s + A.scale_up_delay_s + 1
    # with room above the need (A's 4 replicas had hidden it): the step's trend (its slope over trend_window_s
    # stays positive for 90 s after it) was projected as a ramp's, so the target passed the need and came back
    # (a step to 8 in flight went 2, 1, 2, 1, a down and an up a second apart; one to 40 went 6, then 5)
    wide = A.model_copy(update={"max_replicas": 20})
    for level, need in ((8, 1), (30, 4), (40, 5), (48, 6), (100, 13)):
        events = run_trace(wide, lambda t: 0 if t < 100 else level, 600, start=1)
        assert [(e[1], e[2]) for e in events] == ([(need, "load")] if need > 1 else []), (level, events)
    events = run_trace(AutoscaleConfig(min_replicas=1, max_replicas=20), lambda t: 0 if t < 200 else 40, 1200)
    assert [e[1] for e in events] == [5], events   # the defaults (8 per replica): it went 6, then 5 after 300 s


def test_a_steady_load_at_a_threshold_does_not_flap():
    rng = random.Random(7)
    # around 16 in flight = exactly 2 replicas' worth at 8 each, with +-2 of noise every second, for an hour
    events = run_trace(A, lambda t: 16 + rng.choice((-2, -1, 0, 1, 2)), 3600, start=2)
    assert events == []
    # and a load just over a threshold moves the target once, then stays
    events = run_trace(A, lambda t: 26 + rng.choice((-1, 0, 1)), 3600, start=2)
    assert [e[1] for e in events] == [4]


def test_a_rising_load_is_met_earlier_along_its_trend_and_a_falling_one_is_not_projected():
    ramp = lambda t: max(0.0, min(30.0, (t - 100) * 0.1))   # 0 -> 30 in flight over 300 s, then steady
    with_trend = run_trace(A, ramp, 600)
    without = run_trace(A.model_copy(update={"trend_window_s": 0}), ramp, 600)
    # the same steps to the same end (30 at 8 per replica: 4), one event per threshold
    assert [e[1] for e in with_trend] == [e[1] for e in without] == [2, 3, 4]
    # the up rule lags a ramp by half its window and its delay (15 s), and without a trend it waits for the load
    # to pass the tolerance band over n replicas (0.1 x n x 8 requests, 8n s at 0.1/s); along the trend
    # (0.1/s, 1.5 requests ahead, over RISING_SHARE of a replica's target) each step comes both sooner: at the
    # threshold itself, with no band, since a trend is not noise
    for n, ((t1, *_), (t0, *_)) in enumerate(zip(with_trend, without), start=1):
        sooner = A.window_s / 2 + A.scale_up_delay_s + A.tolerance * n * A.target_inflight_per_replica / 0.1
        assert abs(t0 - t1 - sooner) <= 5, (with_trend, without)
        assert abs(ramp(t1) - n * A.target_inflight_per_replica) <= 1.0, with_trend
    # the reason says how much of the load was the trend's look-ahead
    s = Autoscaler()
    s.adopt("m", 1, A, 0.0)
    for t in range(1, 200):
        s.observe("m", Sample(float(t), int(ramp(t)), 0), A)
        d = s.step("m", A, Capacity(s.target("m"), s.target("m")), float(t))
        if d.direction:
            break
    assert d.direction == "up" and "of it the rising trend" in d.reason, d
    # a falling load is sized by its mean alone: the trend never lowers the target sooner
    fall = lambda t: 30 if t < 100 else max(9.0, 30 - (t - 100) * 0.1)
    assert run_trace(A, fall, 800, start=4) == run_trace(A.model_copy(update={"trend_window_s": 0}), fall, 800, start=4)


def test_scale_down_follows_the_mean_load_at_most_once_per_down_delay():
    events = run_trace(A, lambda t: 30 if t < 200 else 9, 600, start=4)
    downs = [e for e in events if e[1] < 4]
    assert downs[-1][1] == 2 and len(downs) <= 2                   # 9 in flight at 8 per replica: 2
    assert all(b[0] - a[0] >= A.scale_down_delay_s for a, b in zip(downs, downs[1:]))
    # a noisy load just under a threshold (11-13, mean 12, at 6 per replica: 2) does not keep a third replica
    rng = random.Random(5)
    b = A.model_copy(update={"target_inflight_per_replica": 6})
    events = run_trace(b, lambda t: rng.choice((9, 10, 11, 12, 13, 14)), 1200, start=3)
    assert [e[1] for e in events] == [2]
    # a load of exactly 2 replicas' worth (10-14, mean 12) whose 10 s windows are over 12 half the time but stay
    # within the tolerance of 2 (13.2): the third replica goes within two down delays and is not asked back (the
    # second half's check counts the tolerance around the new count, as the scale-up rule will)
    for seed in (11, 12):
        rng = random.Random(seed)
        events = run_trace(b, lambda t: rng.choice((10, 11, 12, 13, 14)), 1800, start=3)
        assert [e[1] for e in events] == [2] and events[0][0] <= 2 * b.scale_down_delay_s, events
    # a short dip does not move it: the last window asks for as much as before
    events = run_trace(A, lambda t: 0 if 300 <= t < 315 else 30, 400, start=4)
    assert events == []


@pytest.mark.parametrize("kv_total, start, events", [(1.0, 1, [(2, "engine_pressure")]), (0.8, 2, [(1, "load")])])
def test_a_replica_added_for_a_full_kv_cache_is_not_taken_back_while_fewer_would_be_full(kv_total, start, events):
    """6 long-context requests: the load asks for one replica; their KV cache is kv_total of one replica's,
    spread over the replicas there are.  At 1.0, one replica is full (over the 0.9 high): the pressure rule
    adds a second; the down rule, which the load alone would let take it back, keeps it (else the pressure
    rule would add it again: a flap a down delay long, all day).  At 0.8 one replica holds them: two go to one."""
    a = AutoscaleConfig(min_replicas=1, max_replicas=4)   # 8 per replica, kv_cache_high 0.9, down delay 300 s
    s = Autoscaler()
    s.adopt("m", start, a, 0.0)
    seen = []
    for t in range(1, 3601):
        n = s.target("m")
        s.observe("m", Sample(float(t), 6, 0, 0.0, kv_total / n), a)
        d = s.step("m", a, Capacity(n, n), float(t))
        if d.direction:
            seen.append((d.target, d.cause))
    assert seen == events
    if kv_total == 1.0:
        assert "KV cache would be 100% full" in d.reason, d


def test_scale_to_zero_only_after_the_idle_time():
    events = run_trace(A, lambda t: 5 if t < 50 else 0, 400, start=1)
    assert events == [(49 + int(A.scale_to_zero_after_s), 0, "idle")]   # t=49 was the last busy second
    # an idle time shorter than the down delay: zero after it, not after the delay (whose mean load held one)
    z = A.model_copy(update={"scale_to_zero_after_s": 60, "scale_down_delay_s": 300})
    assert run_trace(z, lambda t: 3 if t < 400 else 0, 1200) == [(459, 0, "idle")]
    # idle from the start (a daemon started again beside an idle replica): zero after the idle time too, not
    # after the down delay (the first samples' age held it)
    assert run_trace(z, lambda t: 0, 1200) == [(60, 0, "idle")]
    keep_one = A.model_copy(update={"min_replicas": 1})
    assert run_trace(keep_one, lambda t: 5 if t < 50 else 0, 400, start=1) == []
    # idle down to a min_replicas of 1 is the idle rule's (counted as idle, said as idle), not a fall of the
    # load's: it was "load asked for 1 or fewer for 300s" with cause load, 61 s into a 300 s down delay
    keep_one = z.model_copy(update={"min_replicas": 1})
    assert run_trace(keep_one, lambda t: 0, 400, start=3) == [(60, 1, "idle")]
    s = Autoscaler()
    s.adopt("m", 3, keep_one, 0.0)
    for t in range(1, 61):
        s.observe("m", Sample(float(t), 0, 0, None, None), keep_one)
        d = s.step("m", keep_one, Capacity(3, 3), float(t))
    assert (d.target, d.direction, d.cause) == (1, "down", "idle") and d.reason == "idle for 60s: down to " \
        "min_replicas (1)", d


def test_a_pending_job_blocks_more_scale_up_and_is_named():
    cap = Capacity(active=2, ready=1, pending=(("4242", "Resources"),))
    samples = [Sample(float(t), 40, 0) for t in range(0, 40)]
    d = decide(A, samples, 2, cap, now=39.0, last_change=0.0, last_busy=39.0, since=0.0)
    assert d.target == 2 and not d.direction
    assert "4242" in d.reason and "Resources" in d.reason
    d = decide(A, samples, 2, Capacity(2, 2), now=39.0, last_change=0.0, last_busy=39.0, since=0.0)
    assert (d.target, d.direction) == (4, "up")


def test_a_replica_an_operator_replaces_is_a_handover_not_capacity():
    """`drain --replace`: the replica being replaced is retiring (its successor is the capacity), as one near
    its time limit: a target adopted meanwhile (a daemon restart, `scale auto`) is not raised by it."""
    from orchestrator.fleet.autoscale import capacity_of
    from orchestrator.fleet.replica import ReplicaFacts
    from reconciler_harness import fleet_cfg
    m = fleet_cfg().models[0]
    old = ReplicaFacts("1", "m", 0, m.job_hash(), replace_requested=True)
    other = ReplicaFacts("2", "m", 1, m.job_hash())
    successor = ReplicaFacts("3", "m", 0, m.job_hash(), reason="Resources")
    cap = capacity_of(m, [(old, State.READY), (other, State.READY), (successor, State.QUEUED)], [], T0)
    assert (cap.active, cap.ready, cap.handover, cap.slots) == (2, 1, True, 2)
    # its successor pending is no scale-up to wait for: a load that asks for more is met (it froze every scale-up
    # while the successor pended, up to the whole handover lead)
    assert cap.pending == ()
    samples = [Sample(float(t), 40, 0) for t in range(0, 40)]
    d = decide(A, samples, 2, cap, now=39.0, last_change=0.0, last_busy=39.0, since=0.0)
    assert d.direction == "up" and d.target > 2, d
    placed = capacity_of(m, [(old, State.READY), (other, State.READY)], [("n1", 0)], T0)   # (its sbatch not seen yet)
    assert placed.pending == () and placed.active == 2
    old.drain_reason = "replace"
    cap = capacity_of(m, [(old, State.DRAINING), (other, State.READY), (successor, State.READY)], [], T0)
    assert (cap.active, cap.ready, cap.handover) == (2, 2, True)


def test_no_scale_down_while_a_handover_is_in_flight_but_an_idle_model_still_goes_to_zero():
    samples = [Sample(float(t), 0, 0) for t in range(0, 400)]
    a1 = A.model_copy(update={"min_replicas": 1})
    d = decide(a1, samples, 3, Capacity(3, 3, handover=True), now=399.0, last_change=0.0, last_busy=10.0, since=0.0)
    assert d.target == 3 and "handover" in d.reason
    d = decide(a1, samples, 3, Capacity(3, 3), now=399.0, last_change=0.0, last_busy=10.0, since=0.0)
    assert (d.target, d.direction) == (1, "down")
    # to zero: the successor (perhaps PENDING for the nodes the old job holds) is cancelled, the old one drained
    d = decide(A, samples, 3, Capacity(3, 3, handover=True), now=399.0, last_change=0.0, last_busy=10.0, since=0.0)
    assert (d.target, d.direction, d.cause) == (0, "down", "idle")


def test_engine_pressure_asks_for_one_more_only_when_no_replica_is_on_its_way():
    # little gateway load but the engines queue (long generations): waiting above the high mark
    events = run_trace(A, lambda t: 6, 120, start=1, waiting=lambda t: 10.0)
    assert events and events[0][1:] == (2, "engine_pressure")
    assert run_trace(A, lambda t: 6, 120, start=1, waiting=lambda t: 10.0,
                     cap=lambda target: Capacity(target, max(0, target - 1))) == []  # one still STARTING
    # the target just raised and its job not yet submitted (the reconciler's next pass): no second step on
    # top of it while the engines still queue (a benchmark run went 2 -> 3 -> 4 a second apart)
    events = run_trace(A, lambda t: 6, 50, start=1, waiting=lambda t: 10.0, cap=lambda target: Capacity(1, 1))
    assert [e[1] for e in events] == [2], events
    events = run_trace(A, lambda t: 6, 120, start=1, kv=lambda t: 0.97)
    assert events and events[0][1:] == (2, "engine_pressure")


def test_full_replicas_add_one_at_once_after_the_pressure_delay_not_the_up_delay():
    a = A.model_copy(update={"engine_waiting_high": 0, "pressure_scale_up_delay_s": 3})
    # in-flight load within the current target, but the engines queue from t=20 on: +1 three seconds later
    events = run_trace(a, lambda t: 8, 60, start=1, waiting=lambda t: 2.0 if t >= 20 else 0.0)
    assert events[0] == (22, 2, "engine_pressure")   # samples 20, 21, 22 all full (a 3 s delay)
    # one full sample now and then (a moment's burst) moves nothing
    assert run_trace(a, lambda t: 8, 120, start=1, waiting=lambda t: 1.0 if t % 3 == 0 else 0.0) == []
    # requests queued in the gateway behind full replicas count the same
    s = [Sample(float(t), 8, 3 if t >= 20 else 0) for t in range(0, 24)]
    d = decide(a, s, 1, Capacity(1, 1), now=23.0, last_change=0.0, last_busy=23.0, since=0.0)
    assert (d.target, d.direction, d.cause) == (2, "up", "engine_pressure") and "queued in the gateway" in d.reason
    # ... but not while a replica is on its way, and never above the maximum
    assert decide(a, s, 1, Capacity(2, 1), now=23.0, last_change=0.0, last_busy=23.0, since=0.0).target == 1
    assert decide(a, s, 4, Capacity(4, 4), now=23.0, last_change=0.0, last_busy=23.0, since=0.0).target == 4


async def test_requests_held_through_a_cold_start_are_no_full_replica_once_it_is_ready():
    """The pressure rule read the samples of its delay taken before the replica was READY: the requests held
    for the cold start (still in a worker's last report as it applies the new table) looked like a full
    replica, and a second one was added as the first turned READY."""
    h = Elastic_()   # the default pressure delay, 5 s
    h.slurm.start_state = "PENDING"
    await h.tick()
    for sec in range(12):
        h.now += 1
        h.gateway(queued=2)
        h.elastic.step(h.now)
        await h.tick()
        if sec == 6:   # the job starts; its engine answers at once
            h.slurm.set(next(iter(h.slurm.jobs)), state="RUNNING", start_time=h.now, nodelist="n1")
        if h.ready():
            break
    assert h.ready() and h.rec.autoscaler.target("m") == 1
    h.now += 0.5
    h.elastic.step(h.now)   # the worker's report from before its held requests took their leases
    assert h.rec.autoscaler.target("m") == 1, h.rec.autoscaler.decisions["m"]
    moved = []
    for _ in range(7):      # ... but requests still waiting for the whole delay once it is READY: one more
        h.now += 1
        h.gateway(queued=2)
        h.elastic.step(h.now)
        d = h.rec.autoscaler.decisions["m"]
        moved += [(d.target, d.cause)] if d.direction else []
    assert moved == [(2, "engine_pressure")], moved


async def test_unsent_batch_lines_are_load_but_not_full_replicas():
    """The batch runner holds lines back by its own concurrency: they counted as requests queued in the gateway,
    so every sample read as full replicas and the pressure rule added one every few seconds up to the maximum
    (2 lines in flight and 6 unsent, a load of one replica), the load rule taking them back after the delay."""
    a = A.model_copy(update={"pressure_scale_up_delay_s": 3})
    s = [Sample(float(t), 2, 0, backlog=6) for t in range(0, 60)]
    d = decide(a, s, 1, Capacity(1, 1), now=59.0, last_change=0.0, last_busy=59.0, since=0.0)
    assert (d.target, d.direction) == (1, ""), d
    assert decide(a, s[-1:], 0, Capacity(), now=59.0, last_change=0.0, last_busy=59.0,   # (at zero: a cold start)
                  since=0.0).reason == "cold start: 2 in flight"
    assert decide(a, [Sample(1.0, backlog=6)], 0, Capacity(), now=1.0, last_change=0.0, last_busy=1.0,
                  since=0.0).reason == "cold start: 6 batch lines to send"
    h = Elastic_()
    h.elastic.batch_pending = lambda: {"m": 6}
    await h.tick()
    h.gateway(queued=1)
    h.elastic.step(h.now)
    last = h.rec.autoscaler.samples["m"][-1]
    assert (last.queued, last.backlog, last.demand) == (1, 6, 7)


def test_scale_down_drains_the_least_loaded_replica_nearest_its_limit_first():
    views = [View("a", 0, State.READY, "h", 5000.0, inflight=4), View("b", 1, State.READY, "h", 9000.0, inflight=0),
             View("c", 2, State.READY, "h", 3000.0, inflight=0), View("d", 3, State.READY, "h", None, inflight=9)]
    actions = plan_model("m", 2, "h", views, handover_lead_s=600)
    assert actions == [Drain("c", "scale_down"), Drain("b", "scale_down")]


# -- config ------------------------------------------------------------------------------------------------------
def model_yaml(**fields) -> str:
    m = {"name": "m", "engine": "simulator", "container": {"enabled": False}, **fields}
    return yaml.safe_dump({"fleet": "f", "state_dir": "/tmp/sf", "models": [m]}, sort_keys=False)


def test_config_errors_name_the_field_and_line():
    with pytest.raises(ConfigError) as e:
        load_config_text(model_yaml(autoscale={"min_replicas": 3, "max_replicas": 2}), "f.yaml", {})
    msg = str(e.value)
    assert "f.yaml:" in msg and "autoscale" in msg and "min_replicas (3) is greater than max_replicas (2)" in msg
    with pytest.raises(ConfigError) as e:
        load_config_text(model_yaml(replicas=2, autoscale={"max_replicas": 2}), "f.yaml", {})
    assert "replicas and autoscale exclude each other" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config_text(model_yaml(autoscale={"max_replicas": 2, "target_inflight": 3}), "f.yaml", {})
    assert "autoscale.target_inflight" in str(e.value) and "unknown field" in str(e.value)


def test_autoscale_is_not_part_of_the_job():
    a = load_config_text(model_yaml(autoscale={"max_replicas": 2}), "f.yaml", {}).models[0]
    b = load_config_text(model_yaml(replicas=3), "f.yaml", {}).models[0]
    assert a.job_hash() == b.job_hash()


# -- the reconciler and the autoscale loop on a fake clock --------------------------------------------------------
def auto_cfg(**autoscale):
    doc = {"fleet": "f", "state_dir": "/nonexistent/sf", "models": [{
        "name": "m", "engine": "simulator", "container": {"enabled": False}, "probe": {"interval_s": 1},
        "autoscale": {"min_replicas": 0, "max_replicas": 3, "target_inflight_per_replica": 4, "window_s": 2,
                      "scale_up_delay_s": 2, "scale_down_delay_s": 30, "scale_to_zero_after_s": 60,
                      **autoscale}}]}
    return load_config_text(yaml.safe_dump(doc), "f.yaml", {})


class Elastic_(ClockHarness):
    """The clock harness with an autoscaled model, a report hub fed by a fake gateway process, and the
    autoscale loop's step."""

    def __init__(self, slurm: FakeSlurm | None = None, nodes: NodeMemory | None = None, **autoscale):
        super().__init__()
        if slurm is not None:   # a new daemon on the same SLURM: its cancels are checked against its routes
            self.slurm = slurm
            slurm.on_cancel = self.not_routed
        self.hub = ReportHub()
        self.table = RoutingTable(1, {})
        self.woken = 0
        self.rec = Reconciler(auto_cfg(**autoscale), self.slurm, Renderer(), self, self, Metrics(),
                              clock=lambda: self.now, inflight=self.hub.inflight, on_update=self.on_update,
                              rng=random.Random(0), mono=lambda: self.now, nodes=nodes)
        self.elastic = Elastic(self.rec, self.hub, lambda: self.table, self.rec.metrics, self.wake)

    def wake(self) -> None:
        self.woken += 1

    def on_update(self, routes) -> None:
        super().on_update(routes)
        self.routes = routes

    def gateway(self, queued: int = 0, inflight: dict[str, int] | None = None) -> None:
        self.hub.receive(GatewayReport(1, self.hub.table_version, inflight or {},
                                       {"m": QueueState(queued, 1.0)} if queued else {}))


async def test_first_held_request_submits_at_once_and_a_restart_submits_no_duplicate():
    h = Elastic_()
    await h.tick()
    assert h.elastic.step(h.now) is False and h.slurm.submits == 0   # idle at zero: nothing
    h.slurm.start_state = "PENDING"
    h.gateway(queued=2)
    assert h.elastic.step(h.now) is True and h.woken == 1             # the reconciler is woken at once...
    await h.tick()                                                    # ...and its tick submits
    assert h.slurm.submits == 1 and h.rec.desired(h.rec.cfg.model("m")) == 1
    jid = next(iter(h.slurm.jobs))
    h.slurm.set(jid, reason="Resources")
    await h.tick(advance_s=1)
    assert "PENDING in SLURM (Resources)" in h.routes["m"].waiting_on and jid in h.routes["m"].waiting_on
    assert 0 < h.routes["m"].waiting_from <= h.now
    # no clock in the routes: a job pending for minutes publishes no new table every tick (each new table makes
    # every drain of the fleet wait for the gateway processes' next reports)
    before = h.routes["m"]
    await h.tick(advance_s=5)
    assert h.routes["m"] == before
    # more load while the job pends: capacity on its way, nothing stacked behind it
    for _ in range(10):
        h.now += 1
        h.gateway(queued=40)
        h.elastic.step(h.now)
        await h.tick()
    assert h.slurm.submits == 1
    st = fleet_status(h.rec, h.hub, now=h.now)["models"][0]
    assert st["autoscale"]["pending_jobs"] == [{"job_id": jid, "reason": "Resources"}]
    assert "still PENDING" in st["autoscale"]["reason"]
    assert "autoscaling" in render_table(fleet_status(h.rec, h.hub, now=h.now))
    # a new daemon (same SLURM) adopts the pending job as its target: no duplicate, no cancel
    again = Elastic_(slurm=h.slurm)
    again.now = h.now
    again.gateway(queued=40)
    again.elastic.step(again.now)     # before the first squeue: no decision at all
    assert again.rec.autoscaler.target("m") is None
    for _ in range(5):
        await again.tick(advance_s=1)
        again.gateway(queued=40)
        again.elastic.step(again.now)
    assert h.slurm.submits == 1 and h.slurm.cancels == []
    assert again.rec.autoscaler.target("m") == 1


async def test_requests_shorter_than_a_sample_keep_a_model_from_scaling_to_zero():
    """One request every 10 s, each ended between two one-second samples (in flight in none of them): the
    gateway's count of ended requests is activity, so the model is not scaled to zero after
    ``scale_to_zero_after_s`` (60 s) while they come (it was: the samples saw no load), and once they stop it
    is, 60 s after the last."""
    h = Elastic_(min_replicas=0)
    await h.tick()
    h.gateway(queued=1)
    h.elastic.step(h.now)
    await h.tick()
    await h.tick(advance_s=1)
    assert h.rec.autoscaler.target("m") == 1
    stats = RequestStats()
    for sec in range(300):
        h.now += 1
        if sec % 10 == 0 and sec < 200:
            stats.request("m", 200, "0")   # served between the previous sample and this one
        h.hub.receive(GatewayReport(1, h.hub.table_version, {}, {}, stats.snapshot(inflight={}, queued={})))
        h.elastic.step(h.now)
        await h.tick()
        if sec < 250:
            assert h.rec.autoscaler.target("m") == 1, (sec, h.rec.autoscaler.decisions["m"])
    d = h.rec.autoscaler.decisions["m"]
    assert h.rec.autoscaler.target("m") == 0 and "idle" in d.reason, d


async def test_a_model_a_reload_removes_or_fixes_leaves_no_autoscaling_series():
    """/metrics drops ``slurmfleet_autoscale_target_replicas`` of a model a reload removed (it stayed for ever:
    the reconciler forgot the model's target before the autoscale loop looked for it) or gave a fixed count."""
    for change in ("remove", "fix"):
        h = Elastic_(min_replicas=1)
        await h.tick()
        h.elastic.step(h.now)
        await h.tick(advance_s=1)
        assert 'slurmfleet_autoscale_target_replicas{model="m"}' in h.rec.metrics.render().decode()
        doc = _doc(h)
        m = dict(doc["models"][0])
        m.pop("autoscale")
        m["replicas"] = 1
        if change == "remove":
            m["name"] = "other"
        doc["models"] = [m]
        h.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
        h.rec.on_update = lambda routes: None   # (the harness reads model m's routes)
        h.slurm.on_cancel = lambda jid: None
        for _ in range(3):
            h.now += 1
            h.elastic.step(h.now)
            await h.tick()
        shown = [ln for ln in h.rec.metrics.render().decode().splitlines() if ln.startswith("slurmfleet_autoscale_target")]
        assert shown == [], (change, shown)


async def _first_replica(h: Elastic_) -> None:
    """A request held at zero: one replica comes up."""
    await h.tick()
    h.gateway(queued=1)
    h.elastic.step(h.now)
    await h.tick()
    await h.tick(advance_s=1)


async def _idle(h: Elastic_, alive, limit_s: float, each=None) -> float:
    """Idle seconds (the gateway reporting nothing) until ``alive()`` is empty or ``limit_s`` passed, ``each(t)``
    called every second; how long it took."""
    t0 = h.now
    while alive() and h.now - t0 < limit_s:
        h.now += 1
        if each is not None:
            each(h.now - t0)
        h.gateway()
        h.elastic.step(h.now)
        await h.tick()
    return h.now - t0


async def test_scale_up_under_load_then_down_to_zero_after_idle():
    h = Elastic_()
    jobs = lambda: [j for j in h.slurm.jobs.values() if j.state == "RUNNING"]  # noqa: E731
    await _first_replica(h)
    assert len(jobs()) == 1
    for _ in range(10):   # 10 in flight at 4 per replica: 3 replicas (the maximum)
        h.now += 1
        h.gateway(inflight={jobs()[0].job_id: 10})
        h.elastic.step(h.now)
        await h.tick()
    assert len(jobs()) == 3
    ups = h.rec.metrics.scale_decisions.labels("m", "up", "load")._value.get()
    assert ups == 1
    # idle: down only after the delays, the last one after scale_to_zero_after_s; drains, never a failed request
    took = await _idle(h, jobs, 200)
    assert not jobs()
    assert took >= 60
    assert h.rec.autoscaler.target("m") == 0
    assert h.rec.metrics.scale_decisions.labels("m", "down", "idle")._value.get() == 1


async def test_a_daemon_restart_does_not_start_an_idle_model_s_idle_time_again(tmp_path):
    """The time a model had been idle when its daemon stopped counts after the restart (nodes.json keeps since
    when it had no request): quiet 50 s of its 60 s ``scale_to_zero_after_s`` and the daemon started again 5 s
    later, it goes to zero once the new daemon has seen it idle for a down delay (30 s), where it waited the
    whole 60 s again (each restart held an idle model's GPUs another ``scale_to_zero_after_s``). A model busy
    when its daemon stopped keeps none: its idle time starts with the new daemon."""
    path = tmp_path / "nodes.json"
    h = Elastic_(nodes=NodeMemory(path))
    running = lambda: [j for j in h.slurm.jobs.values() if j.state == "RUNNING"]  # noqa: E731
    await _first_replica(h)
    for _ in range(5):
        h.now += 1
        h.gateway(inflight={running()[0].job_id: 2})
        h.elastic.step(h.now)
        await h.tick()
    await h.rec.nodes.synced()
    assert "quiet_since" not in json.loads(path.read_text()).get("m", {})   # busy: nothing kept
    last_busy = h.now
    await _idle(h, running, 50)
    await h.tick()
    await h.rec.nodes.synced()
    assert json.loads(path.read_text())["m"]["quiet_since"] == int(last_busy)   # its last busy second
    assert len(running()) == 1
    h2 = Elastic_(slurm=h.slurm, nodes=NodeMemory(path))   # killed, started again 5 s later
    h2.now = h.now + 5
    await h2.tick()
    took = await _idle(h2, running, 200)
    assert not running() and h2.rec.autoscaler.target("m") == 0
    assert 30 <= took < 40, took
    assert "idle" in h2.rec.autoscaler.decisions["m"].reason


async def test_an_idle_model_goes_to_zero_though_a_handover_waits_on_a_pending_successor():
    """A handover (here an operator's drain --replace) whose successor stays PENDING (its nodes are the ones the
    old job holds) blocked the scale to zero of an idle model for as long as it pended: the GPUs stayed held."""
    h = Elastic_()
    live = lambda: [j for j in h.slurm.jobs.values() if j.state in ("RUNNING", "PENDING")]  # noqa: E731
    await _first_replica(h)
    (old,) = live()
    h.slurm.start_state = "PENDING"
    assert await h.rec.request_drain(old.job_id, replace=True) == "replacing"
    took = await _idle(h, live, 300)
    assert not live() and took < 90, (took, [(j.job_id, j.state) for j in live()])
    assert h.slurm.submits == 2 and h.rec.autoscaler.target("m") == 0


async def test_scale_auto_on_a_model_not_pinned_changes_nothing():
    """`slurmfleet scale m auto` on a model not pinned (a script making sure) reset its autoscaler: its samples and
    idle time went, and run every 50 s it kept an idle model from ever scaling to zero."""
    h = Elastic_()
    jobs = lambda: [j for j in h.slurm.jobs.values() if j.state == "RUNNING"]  # noqa: E731
    await _first_replica(h)
    assert len(jobs()) == 1
    took = await _idle(h, jobs, 200, each=lambda t: t % 20 == 0 and h.rec.scale("m", None))
    assert not jobs() and took < 90, took


async def test_pin_with_scale_then_auto_and_reload_turning_autoscaling_off_keeps_the_replicas():
    h = Elastic_(min_replicas=1)
    await h.tick()
    h.elastic.step(h.now)
    await h.tick(advance_s=1)
    assert h.slurm.submits == 1
    h.rec.scale("m", 2)    # pinned: the autoscaler does not move it
    h.elastic.step(h.now)
    await h.tick(advance_s=1)
    assert h.slurm.submits == 2
    st = fleet_status(h.rec, h.hub, now=h.now)["models"][0]["autoscale"]
    assert st["pinned"] and st["target"] == 2 and "pinned at 2" in st["reason"]
    # the metrics: desired is the pin, the target the autoscaler's own (the dashboard's lines parted only so; a
    # ScaleUpPending alert read the pin as the autoscaler's wish)
    reg = h.rec.metrics.registry
    assert reg.get_sample_value("slurmfleet_replicas_desired", {"model": "m"}) == 2
    assert reg.get_sample_value("slurmfleet_autoscale_target_replicas", {"model": "m"}) == 1
    h.rec.scale("m", None)  # auto again: starts from the 2 that exist
    h.elastic.step(h.now)
    assert h.rec.autoscaler.target("m") == 2
    # reload: autoscaling off with replicas: 2 -> no job restarted or cancelled
    doc = yaml.safe_load(yaml.safe_dump(h.rec.cfg.model_dump(mode="json", exclude_defaults=True)))
    doc["models"][0].pop("autoscale")
    doc["models"][0]["replicas"] = 2
    h.rec.scale("m", 3)    # pinned again: the reload drops the pin, and says so (it said nothing: a soak)
    changes = h.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
    assert changes[-1] == "model m: `slurmfleet scale` pin (3 replicas) dropped, back to 2", changes
    await h.tick(n=3, advance_s=1)
    assert h.slurm.cancels == [] and h.slurm.submits == 2
    # a pin on a model without autoscale is shown too (status said desired 1 and nothing of the pin)
    h.rec.scale("m", 1)
    st = fleet_status(h.rec, h.hub, now=h.now)
    assert st["models"][0]["autoscale"] is None and st["models"][0]["pinned"] == 1, st["models"][0]
    assert re.search(r"│ m\s+│ 1 \(pinned\)", render_table(st)), render_table(st)


def _running(h) -> list[str]:
    return [j.job_id for j in h.slurm.jobs.values() if j.state == "RUNNING"]


async def _at_three_busy(h) -> None:
    """Cold start, then 10 in flight at 4 per replica: the model at its maximum, 3 READY replicas."""
    await h.tick()
    h.gateway(queued=1)
    h.elastic.step(h.now)
    await h.tick()
    await h.tick(advance_s=1)
    for _ in range(15):
        h.now += 1
        h.gateway(inflight={_running(h)[0]: 10})
        h.elastic.step(h.now)
        await h.tick()
    assert len(_running(h)) == 3 and h.rec.autoscaler.target("m") == 3


def _doc(h) -> dict:
    return yaml.safe_load(yaml.safe_dump(h.rec.cfg.model_dump(mode="json", exclude_defaults=True)))


async def test_a_reload_unpins_scale_from_the_replicas_that_exist_not_the_target_before_the_pin():
    h = Elastic_(min_replicas=1)
    await h.tick()
    h.elastic.step(h.now)
    await h.tick(advance_s=1)
    assert h.rec.autoscaler.target("m") == 1
    h.rec.scale("m", 3)   # pinned for a peak: 3 replicas, busy
    await h.tick(n=3, advance_s=1)
    assert len(_running(h)) == 3
    busy = {jid: 10 for jid in _running(h)}
    h.gateway(inflight=busy)
    h.rec.apply_config(load_config_text(yaml.safe_dump(_doc(h)), "f.yaml", {}))   # the same file again
    await h.tick()        # a reload wakes the reconciler at once, before the next sample
    for _ in range(10):   # the load still asks for 3 (30 in flight at 4 per replica): nothing is drained
        h.now += 1
        h.gateway(inflight=busy)
        h.elastic.step(h.now)
        await h.tick()
    assert h.rec.autoscaler.target("m") == 3
    assert h.slurm.cancels == [] and not [f for f in h.rec.replicas.values() if f.drain_requested_at]


async def test_a_reload_that_lowers_the_bounds_applies_at_once_not_at_the_autoscalers_next_step():
    """The reconciler planned the first tick after a reload with the target of the old bounds (it wakes at once,
    the autoscaler a second later): max_replicas 4 -> 2 at a target of 3 could submit a third replica's
    replacement, and status showed target 3 against bounds 0-2 meanwhile. Found by a review."""
    h = Elastic_()
    await _at_three_busy(h)
    doc = _doc(h)
    doc["models"][0]["autoscale"]["max_replicas"] = 2
    h.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
    m = h.rec.cfg.models[0]
    assert h.rec.autoscaler.target("m") == 3 and h.rec.desired(m) == 2   # (no step yet)
    st = fleet_status(h.rec, h.hub, now=h.now)["models"][0]
    assert st["desired"] == 2 and st["autoscale"]["target"] == 2 and st["autoscale"]["max"] == 2, st


@pytest.mark.parametrize("how", ["restart", "reload"])
async def test_replicas_being_replaced_are_adopted_and_rolled_not_drained(how):
    """A new daemon (or a reload turning autoscaling on) that meets a changed job shape adopts the replicas it
    will replace: each gets a successor before it is drained, and the model never drops below its count."""
    if how == "restart":
        h = Elastic_()
        await _at_three_busy(h)
        doc = _doc(h)
        doc["models"][0]["simulator"] = {"ttft_s": 0.123}   # the job changes: every replica is outdated
        h2 = Elastic_(slurm=h.slurm)
        h2.now = h.now
        h2.rec.cfg = load_config_text(yaml.safe_dump(doc), "f.yaml", {})
    else:
        h2 = Elastic_()
        doc = _doc(h2)
        auto = doc["models"][0].pop("autoscale")
        doc["models"][0]["replicas"] = 3
        h2.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
        await h2.tick(n=3, advance_s=1)
        assert len(_running(h2)) == 3
        doc["models"][0].pop("replicas")
        doc["models"][0]["autoscale"] = auto
        doc["models"][0]["simulator"] = {"ttft_s": 0.123}
        h2.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
    old = set(_running(h2))
    fewest = 3
    for _ in range(30):
        h2.now += 1
        h2.gateway(inflight={jid: 4 for jid in h2.ready()})   # a drained replica leaves routing: its requests end
        h2.elastic.step(h2.now)
        await h2.tick()
        fewest = min(fewest, len(h2.ready()))
    assert h2.rec.autoscaler.target("m") == 3
    assert fewest == 3                                   # never fewer serving than before
    assert len(_running(h2)) == 3 and not old & set(_running(h2))   # all three rolled onto the new shape


async def test_a_wall_clock_step_does_not_scale_the_fleet():
    """The autoscale task's windows and delays run on the monotonic clock: a wall clock stepped 200 s forward (NTP,
    a resumed VM) on an idle sample must not read as 200 s idle (scale to zero at once)."""
    import asyncio
    h = Elastic_()
    await _at_three_busy(h)
    mono = h.now
    h.rec.mono = lambda: mono + 1.0          # one second later on the monotonic clock...
    h.rec.clock = lambda: h.now + 200.0      # ...while the wall clock jumped
    h.gateway()                              # an idle sample, as a quiet second is
    task = asyncio.create_task(h.elastic.run(), name="autoscale")
    try:
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert h.rec.autoscaler.samples["m"][-1].t == mono + 1.0   # the task sampled, on the monotonic clock
    assert h.rec.autoscaler.target("m") == 3, h.rec.autoscaler.decisions["m"]


async def test_a_model_pinned_at_zero_ends_held_requests_at_once_one_scaled_to_zero_wakes():
    h = Elastic_()
    await h.tick()
    assert h.routes["m"].blocked == ""        # at zero by the autoscaler: a request wakes it, so it is held
    h.rec.scale("m", 0)
    await h.tick()
    assert "pinned at 0 replicas by 'slurmfleet scale'" in h.routes["m"].blocked   # nothing will wake it
    h.rec.scale("m", None)
    await h.tick()
    assert h.routes["m"].blocked == ""
    doc = _doc(h)
    doc["models"][0].pop("autoscale")
    doc["models"][0]["replicas"] = 0
    h.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
    await h.tick()
    assert h.routes["m"].blocked == "model m has replicas: 0 in the fleet file"


async def test_a_rejected_scale_up_blocks_the_model_and_the_routes_say_so():
    from orchestrator.fleet.slurm import SlurmError
    h = Elastic_()
    await h.tick()
    h.slurm.submit_errors.append(SlurmError("sbatch", "invalid partition specified: nope", transient=False))
    h.gateway(queued=1)
    h.elastic.step(h.now)
    await h.tick()
    assert h.routes["m"].blocked and "invalid partition specified" in h.routes["m"].blocked


@pytest.mark.parametrize("slot, woken", [("none", True), ("refused", False)])
async def test_at_zero_a_request_that_could_not_wait_wakes_the_model_and_a_refused_one_does_not(slot, woken):
    """With ``max_queue_per_model: 0`` or ``cold_start_hold_s: 0`` a request at zero ends at once (429 queue_full,
    503) and is never queued: it wanted the model all the same, so it starts a replica (the model stayed at zero
    for ever).  A request a key's limits or rights refused (slot "refused") is no activity: a client retrying on a
    spent budget kept the last replica's GPUs for ever."""
    h = Elastic_(min_replicas=0)
    await h.tick()
    stats = RequestStats()
    stats.request("m", 429, slot)
    h.hub.receive(GatewayReport(1, h.hub.table_version, {}, {}, stats.snapshot(inflight={}, queued={})))
    assert h.elastic.step(h.now) is woken
    assert h.rec.autoscaler.target("m") == (1 if woken else 0)
    if woken:
        return
    h.gateway(queued=1)   # served once, then only refused requests for longer than scale_to_zero_after_s (60 s)
    h.elastic.step(h.now)
    await h.tick()
    for sec in range(90):
        h.now += 1
        stats.request("m", 429, "refused")
        h.hub.receive(GatewayReport(1, h.hub.table_version, {}, {}, stats.snapshot(inflight={}, queued={})))
        h.elastic.step(h.now)
        await h.tick()
    assert h.rec.autoscaler.target("m") == 0, h.rec.autoscaler.decisions["m"]



def test_no_scale_down_to_a_count_whose_gateway_cap_the_load_passes():
    """The gateway admits max_inflight_per_replica x workers per replica and queues the rest; its queue is the
    pressure rule's reason to add a replica, and the load rule took that replica back (it saw only the engines'
    pressure at the smaller count): with a cap of 8 and a load of 6-9 a second at a target of 8, 14-16 scale events
    in four hours.  The down rule now asks whether the smaller count would queue at the busiest recent moment."""
    a = AutoscaleConfig(min_replicas=1, max_replicas=4, target_inflight_per_replica=8, tolerance=0.3)
    for admits, most in ((8, 1), (0, 100)):
        rng = random.Random(1)
        s = Autoscaler()
        s.adopt("m", 1, a, 0.0)
        events = []
        for t in range(1, 2 * 3600):
            n, d = s.target("m"), rng.choice((6, 7, 8, 9))
            inflight = min(d, n * 8)   # (what the gateway lets through at the cap)
            s.observe("m", Sample(float(t), inflight, d - inflight), a)
            dec = s.step("m", a, Capacity(n, n, admits=admits), float(t))
            if dec.direction:
                events.append((t, dec.target, dec.cause))
        assert len(events) <= most and (admits or len(events) >= 4), (admits, events[:8])   # (0: cap unknown, as before)


def test_no_scale_down_to_a_count_whose_engine_slots_the_load_passes():
    """Engines of 4 slots (``max_num_seqs``) under a target of 10 in flight per replica: at 18 in flight two
    replicas run 8 and queue 5 each, over the engines' waiting high (4), so the pressure rule adds a third; with
    three, 2 wait each, and the down rule scaled that linearly (3 at two replicas: under the high) and took the
    third back, a down delay later, all day.  It now reads the engines' slots: 18 on two would queue 5 each."""
    a = AutoscaleConfig(min_replicas=1, max_replicas=4, target_inflight_per_replica=10, scale_down_delay_s=60,
                        pressure_scale_up_delay_s=3)
    for slots, most in ((4, 1), (0, 10**4)):
        rng = random.Random(2)
        s = Autoscaler()
        s.adopt("m", 2, a, 0.0)
        events = []
        for t in range(1, 3600):
            n, d = s.target("m"), rng.choice((17, 18, 19))
            s.observe("m", Sample(float(t), d, 0, max(0.0, d / n - 4)), a)
            dec = s.step("m", a, Capacity(n, n, engine_slots=slots), float(t))
            if dec.direction:
                events.append((t, dec.target, dec.cause))
        assert len(events) <= most and (slots or len(events) >= 10), (slots, events[:8])   # (0: unknown: 115 an hour)
        if slots:
            assert events[0][1:] == (3, "engine_pressure") and "queue" in dec.reason and "slots" in dec.reason, dec


async def test_a_request_racing_scale_to_zero_does_not_cost_a_new_job():
    """The gateway routes to the last replica until the tick that drains it: the request it took there reads as
    a cold start, and the drain is called off (it submitted a new job and cancelled the warm one)."""
    h = Elastic_()
    await h.tick()
    h.gateway(queued=1)                      # cold start
    h.elastic.step(h.now)
    await h.tick()
    await h.tick(advance_s=1)
    running = lambda: [j.job_id for j in h.slurm.jobs.values() if j.state == "RUNNING"]  # noqa: E731
    assert len(running()) == 1 and h.ready()
    jid = running()[0]
    # idle until the autoscaler lets the last replica go
    for _ in range(200):
        h.now += 1
        h.gateway()
        if h.elastic.step(h.now):
            break
    assert h.rec.autoscaler.target("m") == 0
    # the gateway still routes to it (the reconciler has not ticked yet): a request lands on it
    h.gateway(inflight={jid: 1})
    await h.tick()                           # drains it (busy: 1 request)
    for _ in range(3):                       # the request runs 3 s on the draining replica
        h.now += 1
        h.gateway(inflight={jid: 1})
        h.elastic.step(h.now)
        await h.tick()
    h.now += 1
    h.gateway()
    h.elastic.step(h.now)
    await h.tick()
    await h.tick(advance_s=1)
    # the request was served by the replica it was admitted to; nothing else asked for the model
    assert h.slurm.submits == 1, "a second job was submitted for a request already being served"
    assert running() == [jid] and h.ready() and h.rec.autoscaler.target("m") == 1


async def test_an_operators_drain_and_a_failing_drain_are_not_called_off():
    """A scale-down's drain that an operator then drains (a bad node) or whose engine dies meanwhile is not
    brought back when the model wants a replica again: the operator's stayed 'scale_down' and served again, and
    an unprobed drain came back READY on old probe results."""
    from reconciler_harness import Harness
    for how in ("operator", "engine died"):
        h = Harness(replicas=3, drain={"timeout_s": 600})
        await h.tick(2, advance_s=1)
        h.busy = dict.fromkeys(h.ready(), 1)   # busy: the drains wait
        h.rec.scale("m", 1)
        await h.tick(advance_s=1)
        [keep] = h.ready()
        [d] = [j for j in h.busy if j != keep and h.rec.replicas[j].drain_requested_at is not None][:1]
        if how == "operator":
            await h.rec.request_drain(d)
        else:
            h.down.add(d)
            await h.tick(2, advance_s=1)
        h.rec.scale("m", 3)   # load is back
        for _ in range(4):
            await h.tick(advance_s=1)
            assert d not in h.ready(), how
        assert h.rec.replicas[d].drain_reason == ("operator" if how == "operator" else "scale_down"), how
        assert len(h.ready()) == 3, (how, h.ready())   # the other drain came back, and one new job
