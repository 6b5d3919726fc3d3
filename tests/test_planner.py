"""plan_model: scale, replace, surge-then-drain handover and config rolls, as a table."""

from __future__ import annotations

from orchestrator.config import ModelConfig
from orchestrator.fleet.planner import Cancel, Drain, Submit, Undrain, View, plan_model, reload_changes
from orchestrator.fleet.replica import State

R, S, Q, U = State.READY, State.STARTING, State.QUEUED, State.UNHEALTHY


def v(jid, slot, state, h="new", left=None, warned=False, placeholder=False, replace=False):
    return View(str(jid), slot, state, h, left, warned, replace, placeholder)


def plan(desired, views, **kw):
    kw.setdefault("handover_lead_s", 60)
    return plan_model("m", desired, "new", views, **kw)


def test_scale_up_from_nothing_fills_slots_in_order():
    assert plan(3, []) == [Submit("m", 0, "scale_up"), Submit("m", 1, "scale_up"), Submit("m", 2, "scale_up")]


def test_steady_state_does_nothing():
    assert plan(2, [v(1, 0, R), v(2, 1, S)]) == []


def test_replacement_reuses_the_missing_slot():
    assert plan(3, [v(1, 0, R), v(3, 2, R)]) == [Submit("m", 1, "scale_up")]


def test_scale_down_cancels_queued_before_draining_ready():
    acts = plan(1, [v(1, 0, R), v(2, 1, R), v(3, 2, Q)])
    assert Cancel("3", "scale_down") in acts and Drain("2", "scale_down") in acts and len(acts) == 2


def test_scale_down_drains_a_ready_replica_whose_probes_fail_before_a_healthy_one():
    # (a failed probe or two leaves a replica READY: the scale-down drained the idle healthy one, then the failing
    # one was cancelled as unhealthy, and the model was left with no replica to serve)
    failing = View("2", 1, R, "new", 5000, inflight=1, failing=True)
    assert plan(1, [View("1", 0, R, "new", 3000), failing]) == [Drain("2", "scale_down")]
    assert plan(1, [View("1", 0, R, "new", 3000), View("2", 1, R, "new", 5000, inflight=1)]) == [Drain("1", "scale_down")]


def d(jid, slot, reason, h="new", left=None, warned=False, inflight=0):
    return View(str(jid), slot, State.DRAINING, h, left, warned, inflight=inflight, drain_reason=reason)


def test_a_scale_downs_drain_serves_again_before_a_new_job_is_asked_for():
    # (a request raced a scale to zero, or load came back while the scale-down drained: a new job queued and
    # loaded while the warm replica was cancelled once its requests ended)
    assert plan(1, [d(1, 0, "scale_down", inflight=1)]) == [Undrain("1")]
    assert plan(2, [v(1, 0, R), d(2, 1, "scale_down"), d(3, 2, "scale_down", inflight=2)]) == [Undrain("3")]
    assert plan(3, [d(2, 1, "scale_down")]) == [Undrain("2"), Submit("m", 0, "scale_up"), Submit("m", 2, "scale_up")]
    # not one draining for another reason, of an old config, or near its time limit: a new job
    for other in (d(1, 0, "time_limit"), d(1, 0, "operator"), d(1, 0, "scale_down", h="old"),
                  d(1, 0, "scale_down", left=30), d(1, 0, "scale_down", warned=True)):
        assert plan(1, [other]) == [Submit("m", 0, "scale_up")], other
    assert plan(0, [d(1, 0, "scale_down", inflight=1)]) == []


def test_unhealthy_is_cancelled_and_replaced():
    acts = plan(2, [v(1, 0, R), v(2, 1, U)])
    assert acts == [Cancel("2", "unhealthy"), Submit("m", 1, "scale_up")]


def test_time_limit_handover_surges_then_drains():
    # slot 0 nears its limit: a successor for slot 0 first, the old one keeps serving
    step1 = plan(2, [v(1, 0, R, left=30), v(2, 1, R, left=5000)])
    assert step1 == [Submit("m", 0, "handover")]
    # successor starting: nothing to do yet
    assert plan(2, [v(1, 0, R, left=20), v(2, 1, R, left=5000), v(3, 0, S, left=7000)]) == []
    # successor ready: drain the old one
    done = plan(2, [v(1, 0, R, left=10), v(2, 1, R, left=5000), v(3, 0, R, left=7000)])
    assert done == [Drain("1", "time_limit")] and done[0].replaced   # (a replica restart, counted)


def test_an_idle_model_scaled_to_zero_mid_handover_drains_its_replica_as_replaced_by_none():
    """The successor is cancelled and the old replica drained: it was counted in slurmfleet_replica_restarts_total
    (time_limit, or config_change when outdated) though nothing replaced it. Found by a review."""
    for h, reason in (("new", "time_limit"), ("old", "config_change")):
        acts = plan(0, [v(1, 0, R, h=h, left=30), v(2, 0, Q, left=7000)])
        assert set(acts) == {Cancel("2", "scale_down"), Drain("1", reason)}, acts
        assert not next(a for a in acts if isinstance(a, Drain)).replaced


def test_usr1_warning_counts_as_expiring():
    assert plan(1, [v(1, 0, R, left=None, warned=True)]) == [Submit("m", 0, "handover")]


def test_an_operators_replace_is_a_handover_within_the_surge():
    # `slurmfleet drain --replace` of the only replica: a successor first, the old one serves meanwhile
    assert plan(1, [v(1, 0, R, left=5000, replace=True)]) == [Submit("m", 0, "handover")]
    assert plan(1, [v(1, 0, R, left=5000, replace=True), v(2, 0, S)]) == []
    assert plan(1, [v(1, 0, R, left=5000, replace=True), v(2, 0, R)]) == [Drain("1", "replace")]
    # with others to carry the load it is still replaced, never just removed: the model keeps its count
    assert plan(2, [v(1, 0, R, replace=True), v(2, 1, R)]) == [Submit("m", 0, "handover")]
    # every replica asked for (moving off a node): one successor at a time (max_surge), as a roll goes; the
    # ones near their time limit are not held back by it
    four = [v(i, i, R, left=5000, replace=True) for i in range(4)]
    assert plan(4, four) == [Submit("m", 0, "handover")]
    assert plan(4, four, max_surge=2) == [Submit("m", 0, "handover"), Submit("m", 1, "handover")]
    # a replaced replica still draining holds its GPUs: the next successor waits for it
    D = State.DRAINING
    assert plan(4, [v(0, 0, D, replace=True), *four[1:], v(9, 0, R)]) == []
    assert plan(4, [*four[1:], v(9, 0, R)]) == [Submit("m", 1, "handover")]
    assert plan(2, [v(1, 0, R, left=30, replace=True), v(2, 1, R, left=30, replace=True)]) == [
        Submit("m", 0, "handover"), Submit("m", 1, "handover")]


def test_config_roll_is_one_at_a_time():
    old = [v(1, 0, R, h="old"), v(2, 1, R, h="old"), v(3, 2, R, h="old")]
    assert plan(3, old) == [Submit("m", 0, "handover")]
    mid = old + [v(4, 0, S)]
    assert plan(3, mid) == []
    assert plan(3, old + [v(4, 0, R)]) == [Drain("1", "config_change")]


def test_a_rolls_replicas_still_draining_count_against_the_surge():
    """Slot 0's successor is READY and the old replica drains (long requests): the next successor waits for
    that drain (a roll of 3 with busy replicas ran 6 jobs at once with max_surge 1); a time-limit handover
    does not wait for it, nor does a scale-up of fresh replicas beyond the surge's room."""
    D = State.DRAINING
    rolling = [v(1, 0, D, h="old"), v(2, 1, R, h="old"), v(3, 2, R, h="old"), v(4, 0, R)]
    assert plan(3, rolling) == []
    assert plan(3, rolling[1:]) == [Submit("m", 1, "handover")]          # drained: the next one
    assert plan(3, [v(1, 0, D, h="old"), v(2, 1, R, left=30), v(3, 2, R), v(4, 0, R)]) == [Submit("m", 1, "handover")]
    assert plan(2, [v(1, 0, D, h="old"), v(4, 0, R)]) == [Submit("m", 1, "scale_up")]
    done = [v(j, j - 4, R) for j in (4, 5, 6)] + [v(j, j, D, h="old") for j in (1, 2, 3)]
    assert plan(5, done) == [Submit("m", 3, "scale_up"), Submit("m", 4, "scale_up")]   # rolled, draining: up
    # a roll that meets the time limit: every old replica near its end gets its successor at once
    ending = [v(1, 0, R, h="old", left=30), v(2, 1, R, h="old", left=40), v(3, 2, R, h="old", left=50)]
    assert plan(3, ending) == [Submit("m", s, "handover") for s in (0, 1, 2)]
    # a replica of the new config near its end is replaced, but the roll still waits for its drains
    busy = [v(1, 0, R, h="old"), v(2, 1, R, h="old"), v(3, 2, D, h="old"), v(4, 3, D, h="old"),
            v(5, 4, R), v(6, 5, R, left=30)]
    assert plan(4, busy, max_surge=2) == [Submit("m", 5, "handover")]


def test_outdated_not_ready_is_cancelled_at_once():
    acts = plan(1, [v(1, 0, Q, h="old")])
    assert Cancel("1", "config_change") in acts and Submit("m", 0, "scale_up") in acts


def test_an_outdated_replica_adopted_after_a_restart_is_handed_over_even_before_its_first_probe_passes():
    """A restart with a changed job shape: the adopted replicas are STARTING until a probe passes under the new
    daemon (one that fails, or a missed scan of the records, kept them there); they were cancelled at once, every
    one, and the model had no replica until new jobs queued and loaded."""
    def a(jid, slot, state=S):
        return View(str(jid), slot, state, "old", adopted=True)
    assert plan(3, [a(1, 0), a(2, 1), a(3, 2)]) == [Submit("m", 0, "handover")]   # one at a time, as a roll
    assert plan(3, [a(1, 0), a(2, 1), a(3, 2), v(4, 0, R)]) == [Drain("1", "config_change")]   # (then the next)
    assert plan(1, [a(1, 0, Q)]) == [Cancel("1", "config_change"), Submit("m", 0, "scale_up")]   # (queued: no loss)
    assert plan(1, [a(1, 0, U)]) == [Cancel("1", "unhealthy"), Submit("m", 0, "scale_up")]   # (its probes failed)


def test_removed_model_drains_everything():
    acts = plan_model("gone", 0, "<removed>", [v(1, 0, R), v(2, 1, S)], handover_lead_s=0)
    assert set(acts) == {Cancel("2", "config_change"), Drain("1", "config_change")}


def test_backoff_and_block_limit_submissions():
    assert plan(3, [], max_submits=0) == []
    assert plan(3, [], max_submits=1) == [Submit("m", 0, "scale_up")]


def test_a_successor_before_a_time_limit_is_not_held_back_by_the_back_off():
    """(another slot's crash loop backs the model off: the replica at its limit still gets its successor)"""
    views = [v(1, 0, R, left=30), v(2, 1, R, warned=True), v(3, 2, R, h="old")]
    for cap in (0, 1):
        acts = [a for a in plan(4, views, max_submits=cap, max_surge=3) if isinstance(a, Submit)]
        assert [(a.slot, a.urgent) for a in acts] == [(0, True), (1, True)]   # not the roll, not slot 3's scale-up
    acts = plan(4, views, max_surge=3)
    assert [(a.slot, a.urgent) for a in acts if isinstance(a, Submit)] == [(0, True), (1, True), (2, False), (3, False)]


def test_placeholder_counts_as_queued_and_is_never_cancelled():
    assert plan(1, [v("pending-x", 0, Q, placeholder=True)]) == []
    assert plan(0, [v("pending-x", 0, Q, placeholder=True)]) == []


def test_a_reload_says_what_it_does_to_each_model_counts_included_when_it_also_rolls():
    def m(name: str = "m", **kw) -> ModelConfig:
        return ModelConfig.model_validate({"name": name, "engine": "simulator", "container": {"enabled": False}, **kw})
    old = [m(replicas=3), m("gone")]
    assert reload_changes(old, [m(replicas=2, simulator={"ttft_s": 4}), m("new")]) == [
        "model m changed (simulator): rolling its replicas (3 -> 2)", "model new added (1 replicas)",
        "model gone removed: draining its replicas"]
    assert reload_changes(old[:1], [m(simulator={"ttft_s": 4}, replicas=3)]) == [
        "model m changed (simulator): rolling its replicas"]
    assert reload_changes(old[:1], [m(replicas=2)]) == ["model m updated (3 -> 2 replicas)"]
    # what changed, by name: an alias alone said "updated (3 -> 3 replicas)", as if the count had (found by a soak)
    assert reload_changes(old[:1], [m(replicas=3, aliases=["mm"], probe={"interval_s": 7})]) == [
        "model m updated (aliases, probe)"]
    assert reload_changes(old[:1], [m(replicas=2, aliases=["mm"])]) == ["model m updated (3 -> 2 replicas; aliases)"]
    auto = [m(autoscale={"min_replicas": 1, "max_replicas": 4})]
    assert reload_changes(auto, [m(autoscale={"min_replicas": 1, "max_replicas": 4, "window_s": 20})]) == [
        "model m updated (autoscale)"]
