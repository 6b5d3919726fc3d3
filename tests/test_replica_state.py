"""derive_state: one pure function, tested with a table."""

from __future__ import annotations

import pytest

from orchestrator.fleet.replica import Endpoint, Policy, ReplicaFacts, State, derive_state, end_reason, ready_since

NOW = 10_000.0
EP = Endpoint("1", "127.0.0.1", 9000, "s")
P = Policy(startup_timeout_s=300, failure_threshold=3)


def facts(**kw) -> ReplicaFacts:
    base = dict(job_id="1", model="m", slot=0, config_hash="h", slurm_state="RUNNING", start_time=NOW - 60)
    base.update(kw)
    return ReplicaFacts(**base)


TABLE = [
    ("pending", dict(slurm_state="PENDING", start_time=None), State.QUEUED),
    ("requeued", dict(slurm_state="REQUEUED"), State.QUEUED),
    ("configuring nodes", dict(slurm_state="CONFIGURING"), State.QUEUED),
    ("running, no record yet", dict(), State.STARTING),
    ("running, record, never probed ok", dict(endpoint=EP), State.STARTING),
    ("running, record, probe passed", dict(endpoint=EP, first_ready_time=NOW - 5), State.READY),
    ("ready, 2 failures < threshold", dict(endpoint=EP, first_ready_time=NOW - 5, consecutive_failures=2), State.READY),
    ("ready, failures at threshold", dict(endpoint=EP, first_ready_time=NOW - 5, consecutive_failures=3), State.UNHEALTHY),
    ("never ready past startup timeout", dict(start_time=NOW - 301, endpoint=EP), State.UNHEALTHY),
    ("not ready within startup timeout", dict(start_time=NOW - 299), State.STARTING),
    ("adopted hours after its start, within the startup time since", dict(start_time=NOW - 9999, adopted_at=NOW - 299,
                                                                       endpoint=EP), State.STARTING),
    ("adopted, past the startup time since", dict(start_time=NOW - 9999, adopted_at=NOW - 301), State.UNHEALTHY),
    ("held by SLURM after a failed launch", dict(slurm_state="PENDING", reason="launch failed requeued held"),
     State.UNHEALTHY),
    ("held at the requeue limit", dict(slurm_state="REQUEUE_HOLD", reason="JobHoldMaxRequeue"), State.UNHEALTHY),
    ("held by an admin: theirs", dict(slurm_state="PENDING", reason="JobHeldAdmin"), State.QUEUED),
    ("held: its reservation was deleted (it counted as capacity for ever)", dict(slurm_state="RESV_DEL_HOLD"),
     State.UNHEALTHY),
    ("requeued held after a RequeueExitHold exit code: stays queued, held, until cancelled",
     dict(slurm_state="SPECIAL_EXIT", endpoint=EP, first_ready_time=NOW - 5), State.UNHEALTHY),
    ("probe passed but record gone (requeue)", dict(endpoint=None, first_ready_time=NOW - 5), State.STARTING),
    ("served for hours, record gone", dict(start_time=NOW - 9999, first_ready_time=NOW - 9000), State.UNHEALTHY),
    # a multi-node job warned of its time limit stops its own steps before it: ending, not unhealthy (it was
    # cancelled and counted an unhealthy restart, feeding the crash-loop alert)
    ("warned of its time limit, record gone", dict(start_time=NOW - 9999, first_ready_time=NOW - 9000,
                                                   time_limit_warned=True), State.STOPPING),
    ("warned, never ready, past startup timeout", dict(start_time=NOW - 301, time_limit_warned=True), State.UNHEALTHY),
    ("drain requested", dict(endpoint=EP, first_ready_time=NOW - 5, drain_requested_at=NOW - 1), State.DRAINING),
    ("cancel requested, still running", dict(endpoint=EP, cancel_requested_at=NOW - 1), State.STOPPING),
    ("completing", dict(slurm_state="COMPLETING"), State.STOPPING),
    ("completing its last run after a requeue (preempted): queued capacity, PENDING again after it",
     dict(slurm_state="COMPLETING", requeued=True), State.QUEUED),
    ("completing after a requeue, and cancelled by us", dict(slurm_state="COMPLETING", requeued=True,
                                                           cancel_requested_at=NOW - 1), State.STOPPING),
    ("suspended", dict(slurm_state="SUSPENDED", endpoint=EP, first_ready_time=NOW - 5), State.UNHEALTHY),
    ("failed by itself", dict(slurm_state="FAILED", endpoint=EP, first_ready_time=NOW - 5), State.FAILED),
    ("node failure", dict(slurm_state="NODE_FAIL"), State.FAILED),
    ("time limit", dict(slurm_state="TIMEOUT"), State.FAILED),
    ("cancelled outside the daemon", dict(slurm_state="CANCELLED"), State.FAILED),
    ("cancelled by the daemon", dict(slurm_state="CANCELLED", cancel_requested_at=NOW - 3), State.GONE),
    ("left squeue", dict(slurm_state=None), State.GONE),
    # SLURM has the final word: a job that is not running is not ready, whatever its last probe said
    ("pending with a stale ready probe", dict(slurm_state="PENDING", endpoint=EP, first_ready_time=NOW - 5), State.QUEUED),
]


@pytest.mark.parametrize("case,kw,expected", TABLE, ids=[t[0] for t in TABLE])
def test_derive_state(case, kw, expected):
    assert derive_state(facts(**kw), NOW, P) is expected


def test_time_left():
    f = facts(time_limit_s=3600, start_time=NOW - 600)
    assert f.time_left_s(NOW) == 3000
    assert facts(time_limit_s=None).time_left_s(NOW) is None
    assert facts(slurm_state="PENDING", time_limit_s=60).time_left_s(NOW) is None


@pytest.mark.parametrize("kw,reason", [
    (dict(slurm_state="TIMEOUT"), "time_limit"),
    (dict(slurm_state="COMPLETED", time_limit_warned=True), "time_limit"),   # (it stopped its steps before the limit)
    (dict(slurm_state="COMPLETED"), "failed"),   # an engine that exits 0 on its own is no replica's end
    (dict(slurm_state="FAILED", time_limit_warned=True), "failed"),
    (dict(slurm_state="NODE_FAIL"), "node_lost"),
    (dict(slurm_state="CANCELLED"), "cancelled"),
    (dict(slurm_state="PREEMPTED"), "preempted"),
])
def test_end_reason(kw, reason):
    assert end_reason(facts(**kw)) == reason


@pytest.mark.parametrize("kw,since", [
    (dict(), None),                                                         # never READY
    (dict(adopted_at=NOW - 50), None),                                      # adopted, never READY to this daemon
    (dict(first_ready_time=NOW - 20, published_at=NOW - 30), NOW - 20),     # watched from its start: its first
    # good probe; adopted serving for an hour, first probed at the adoption: when its engine came up (its age
    # was taken from the adoption, and its crash soon after a restart counted early)
    (dict(start_time=NOW - 3700, adopted_at=NOW - 20, first_ready_time=NOW - 20, published_at=NOW - 3600), NOW - 3600),
    (dict(start_time=NOW - 3700, adopted_at=NOW - 20, first_ready_time=NOW - 20), NOW - 3700),   # no record time
    (dict(start_time=NOW - 3700, adopted_at=NOW - 20, first_ready_time=NOW - 20, published_at=NOW - 9999),
     NOW - 3700),                                                           # a node's clock behind: the job's start
    (dict(start_time=NOW - 600, adopted_at=NOW - 500, first_ready_time=NOW - 20, published_at=NOW - 10),
     NOW - 20),                                                             # adopted loading: READY when seen so
])
def test_ready_since(kw, since):
    assert ready_since(facts(**kw)) == since
