"""The reconciler on a fake clock: back-off, bad nodes, lost submissions, blocks, drains, handover, rolls.

SLURM, the endpoint records and the probes are fakes the test drives; nothing sleeps.  Every timing rule
is checked at its boundary: one tick just before the threshold, one just after.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest
import yaml

from fakes import sbatch_option
from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.discovery import Discovered
from orchestrator.fleet.nodememory import NodeMemory, restore
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.render import JobTag, Renderer, state_tag
from orchestrator.fleet.replica import ModelRuntime
from orchestrator.fleet.slurm import SlurmError
from orchestrator.fleet.submitting import Submitting
from orchestrator.observability.metrics import Metrics
from orchestrator.observability.status import fleet_status, render_table
from reconciler_harness import Harness, fleet_cfg


def lose(h: Harness, job: str, how: str) -> None:
    """``job`` is lost: its job fails ("failed"), or its engine stops answering (it is cancelled unhealthy)."""
    if how == "failed":
        h.slurm.end(job, "FAILED")
    else:
        h.down.add(job)


async def crash_and_wait(h: Harness, step: float = 0.5) -> float:
    """The newest job dies 1 s after starting, never READY; seconds until the next sbatch."""
    job = h.newest()
    h.down.add(job)
    await h.tick(advance_s=1)
    assert job in h.rec.replicas and job not in h.ready()
    h.slurm.end(job, "FAILED")
    n = h.sbatches
    await h.tick(advance_s=1)  # the failure is seen here: back-off starts
    waited = await h.run_until(lambda: h.sbatches > n, step)
    assert h.sbatches == n + 1
    return waited


async def test_early_failures_back_off_exponentially_to_max_and_a_ready_replica_resets_it():
    h = Harness(backoff={"base_s": 10, "max_s": 40, "early_failure_s": 100})
    await h.tick()
    assert h.sbatches == 1
    for crashes, delay in enumerate((10, 20, 40, 40), 1):  # base * 2**(n-1), +-25%, capped at max_s
        waited = await crash_and_wait(h)
        assert h.rec.runtime("m").crashes == crashes
        assert 0.75 * delay <= waited <= min(1.25 * delay, 40) + 0.5, (crashes, waited)   # (it passed max_s by 25%)

    job = h.newest()
    await h.tick(advance_s=1)
    assert h.ready() == {job}
    await h.tick(advance_s=99)
    assert h.rec.runtime("m").crashes == 4  # READY 99 s < early_failure_s
    await h.tick(advance_s=1)
    assert h.rec.runtime("m").crashes == 0 and h.rec.runtime("m").last_error is None
    h.rec.scale("m", 2)
    await h.tick(advance_s=1)
    assert h.sbatches == 6  # no back-off left: the new slot is submitted at once
    waited = await crash_and_wait(h)  # ...and its early failure backs off from base_s again
    assert 7.5 <= waited <= 13 and h.ready() == {job}


async def test_failures_before_ready_back_off_with_early_failure_s_zero_too():
    """``early_failure_s: 0`` (failures after READY are never early): with no replica READY since the crash the
    counter was reset at the next tick (served 0 s >= 0), so a model that cannot start was submitted again every
    few seconds for ever, its last error cleared. Found by a review."""
    h = Harness(backoff={"base_s": 10, "max_s": 40, "early_failure_s": 0})
    await h.tick()
    for crashes, delay in enumerate((10, 20, 40), 1):
        waited = await crash_and_wait(h)
        assert h.rec.runtime("m").crashes == crashes and h.rec.runtime("m").last_error, crashes
        assert 0.75 * delay <= waited <= min(1.25 * delay, 40) + 0.5, (crashes, waited)
    await h.tick(advance_s=1)   # one READY at last: then the counter goes
    await h.tick(advance_s=1)
    assert h.ready() and h.rec.runtime("m").crashes == 0


async def test_jobs_purged_from_squeue_before_their_end_was_seen_back_off_as_failures():
    """A site with a short MinJobAge purges a failed job within seconds: the job left squeue with no end state
    seen, was forgotten without a count, and its model was submitted again every other tick for ever, no node
    suspected (60 sbatches in 10 minutes against 4 for the same failures listed FAILED). Found by a review."""
    h = Harness(backoff={"base_s": 60, "max_s": 600, "early_failure_s": 300, "node_failure_threshold": 2})
    h.warmup_s = 1000   # (never READY: its engine fails at its start)
    await h.tick()
    for _ in range(120):   # 10 minutes of 5 s ticks; each job dies 5 s after its start and is purged at once
        for job, f in list(h.rec.replicas.items()):   # (seen RUNNING by the last tick: on a node, never READY)
            if f.slurm_state == "RUNNING" and job in h.slurm.jobs:
                h.down.add(job)
                del h.slurm.jobs[job]
        await h.tick(advance_s=5)
    rt = h.rec.runtime("m")
    assert h.sbatches <= 5 and rt.crashes >= h.sbatches - 1, (h.sbatches, rt.crashes)   # (the last: backing off)
    assert "failed" in rt.last_error and rt.excluded, (rt.last_error, rt.excluded)   # (its node: suspect)
    assert "gone from squeue" in rt.vacated[0][0]
    restarts = h.rec.metrics.registry.get_sample_value("slurmfleet_replica_restarts_total",
                                                       {"model": "m", "reason": "unknown"})
    assert restarts == rt.crashes


async def test_a_crash_loops_back_off_is_exported_as_a_crash():
    h = Harness(backoff={"base_s": 10, "max_s": 40, "early_failure_s": 100})
    await h.tick()
    job = h.newest()
    h.down.add(job)
    await h.tick(advance_s=1)
    h.slurm.end(job, "FAILED")
    await h.tick(advance_s=1)
    reg = h.rec.metrics.registry
    assert reg.get_sample_value("slurmfleet_model_backoff_seconds", {"model": "m", "cause": "crash"}) > 5
    assert reg.get_sample_value("slurmfleet_model_backoff_seconds", {"model": "m", "cause": "submit_limit"}) == 0
    # the status table's problem gives the back-off left, not also the log's figure from the crash ("backing off
    # 11s: ... next submission in 20s"; after it, a stale "next submission in 9s"; found by a soak)
    await h.tick(advance_s=3)
    table = re.sub(r"[│┃\s]+", " ", render_table(fleet_status(h.rec, now=h.now)))   # (cells wrap over lines)
    assert "backing off" in table and "early failures in a row" in table and "next submission in" not in table
    assert "next submission in" in h.rec.runtime("m").last_error   # (the log and the JSON status keep it)


async def test_a_pending_reasons_label_is_its_code_without_node_names():
    """squeue's ``ReqNodeNotAvail, UnavailableNodes:node2`` (as 22.05 and 24.11 print it) names the nodes down:
    a label value per set of nodes would have no bound.  The status keeps the whole reason."""
    h = Harness(replicas=2)
    await h.tick()
    a, b = sorted(h.rec.replicas, key=int)
    h.slurm.set(a, state="PENDING", reason="ReqNodeNotAvail, UnavailableNodes:node2")
    h.slurm.set(b, state="PENDING", reason="ReqNodeNotAvail, UnavailableNodes:node[3-4]")
    await h.tick(advance_s=1)
    reg = h.rec.metrics.registry
    assert reg.get_sample_value("slurmfleet_slurm_jobs", {"model": "m", "slurm_state": "PENDING",
                                                          "reason": "ReqNodeNotAvail"}) == 2
    assert h.rec.replicas[a].reason == "ReqNodeNotAvail, UnavailableNodes:node2"


async def test_a_model_removed_and_added_back_starts_without_its_old_back_off():
    """A model in a crash loop is removed, fixed, and added back by reloads: its first job goes at once (it
    waited out the old back-off, up to backoff.max_s, and its next crash doubled from the old count)."""
    h = Harness(backoff={"base_s": 100, "max_s": 400, "early_failure_s": 1000})
    await h.tick()
    for _ in range(3):
        await crash_and_wait(h, step=5)
    h.down.add(h.newest())
    await h.tick(advance_s=1)
    h.slurm.end(h.newest(), "FAILED")
    await h.tick(advance_s=1)
    assert h.rec.runtime("m").crashes == 4 and h.rec.runtime("m").backoff_until > h.now + 100
    cfg = h.rec.cfg
    h.rec.apply_config(fleet_cfg(backoff={"base_s": 100, "max_s": 400, "early_failure_s": 1000}).model_copy(
        update={"models": []}))
    await h.tick(advance_s=1)
    n = h.sbatches
    h.rec.apply_config(cfg)
    await h.tick(advance_s=1)
    assert h.sbatches == n + 1 and h.rec.runtime("m").crashes == 0


async def test_a_replica_failing_after_serving_longer_than_early_failure_s_is_no_crash():
    h = Harness(backoff={"base_s": 10, "early_failure_s": 100})
    await h.tick(2, advance_s=1)
    job = h.newest()
    assert h.ready() == {job}
    await h.tick(advance_s=200)
    h.slurm.end(job, "FAILED")
    await h.tick(advance_s=1)
    assert h.rec.runtime("m").crashes == 0 and h.sbatches == 2


@pytest.mark.parametrize("how", ["failed", "unhealthy"])
@pytest.mark.parametrize("served_s,early", [(3600, False), (30, True)], ids=["served an hour", "young"])
async def test_an_adopted_replica_lost_soon_after_a_restart_counts_from_its_engines_start(served_s, early, how):
    """A daemon restarted adopts a replica serving for an hour, which dies (or stops answering) 20 s later: it
    was counted an early failure (a crash, a back-off before its replacement), its age taken from the adoption
    (the new daemon's first good probe of it), not from when its engine came up (its record's time).  One
    adopted 30 s after its start that dies so is still early.  Found by a review."""
    h = Harness(backoff={"base_s": 10, "max_s": 40, "early_failure_s": 100},
                probe={"interval_s": 1, "failure_threshold": 2})
    await h.tick(2, advance_s=1)
    job = h.newest()
    assert h.ready() == {job}
    await h.tick(advance_s=served_s)
    h.restart()
    await h.tick(advance_s=1)
    assert h.rec.replicas[job].adopted_at == h.now and h.ready() == {job}
    await h.tick(advance_s=20)
    lose(h, job, how)
    n = h.sbatches
    await h.run_until(lambda: job not in h.rec.replicas or h.rec.replicas[job].cancel_requested_at, step=1)
    await h.tick(advance_s=1)
    rt = h.rec.runtime("m")
    assert (rt.crashes, rt.backoff_until > h.now, h.sbatches - n) == ((1, True, 0) if early else (0, False, 1))


@pytest.mark.parametrize("how", ["unhealthy", "failed"])
async def test_a_replica_lost_soon_after_ready_backs_off_however_long_it_loaded(how):
    """A replica that loads for longer than early_failure_s and then dies (its job fails, or its engine stops
    answering and it is cancelled unhealthy) soon after READY is an early failure: the next sbatch waits out
    a back-off (an unhealthy one was replaced at once, for ever; a failed one counted from the job's start; and
    since the fake SLURM gives a running job squeue's EndTime, its time limit's end, an unhealthy one was taken
    to have served until then)."""
    h = Harness(backoff={"base_s": 10, "max_s": 40, "early_failure_s": 100}, probe={"interval_s": 1,
                "failure_threshold": 2, "startup_timeout_s": 900})
    h.warmup_s = 300
    await h.tick()
    for loop in (1, 2):
        job = h.newest()
        await h.run_until(lambda: h.ready() == {job}, step=5)
        await h.tick(advance_s=5)
        lose(h, job, how)
        n = h.sbatches
        waited = await h.run_until(lambda: h.sbatches > n, step=0.5)
        assert h.rec.runtime("m").crashes == loop and waited >= 7.5 * loop - 3, (loop, waited)
        assert "after READY" in h.rec.runtime("m").last_error


async def test_one_models_unforeseen_error_stops_neither_the_others_nor_routing():
    """An error other than SLURM's in one model's reconcile (a template, a fork failing) is that model's
    last_error: the other models are reconciled, a dead engine leaves routing and drains finish."""
    h = Harness(replicas=1)
    two = fleet_cfg(replicas=1)
    other = two.models[0].model_copy(update={"name": "b"})
    h.rec.apply_config(two.model_copy(update={"models": [*two.models, other]}))
    await h.tick(2, advance_s=1)
    assert h.ready() and len(h.slurm.jobs) == 2
    render = h.rec.renderer.render

    def broken(cfg, m, *a, **k):
        if m.name == "b":
            raise RuntimeError("template broke")
        return render(cfg, m, *a, **k)
    h.rec.renderer.render = broken
    b_job = next(j for j, f in h.rec.replicas.items() if f.model == "b")
    h.slurm.end(b_job, "CANCELLED")   # an admin's scancel: b must submit again, and its render fails
    m_job = next(iter(h.ready()))
    h.down.add(m_job)
    await h.run_until(lambda: m_job not in h.ready() and h.sbatches == 3, step=1, limit=60)
    assert "template broke" in h.rec.runtime("b").last_error and m_job in h.slurm.cancels


async def test_failures_on_one_node_exclude_it_for_node_exclude_s():
    h = Harness(backoff={"node_failure_threshold": 2, "node_exclude_s": 300})
    h.slurm.node = "gpu7"
    await h.tick(2, advance_s=1)
    h.slurm.end(h.newest(), "NODE_FAIL")
    await h.tick(advance_s=1)
    assert h.sbatches == 2 and sbatch_option(h.slurm.scripts[-1], "exclude") is None  # one failure: no exclusion
    h.slurm.end(h.newest(), "NODE_FAIL", nodelist="gpu[6-7]")  # a two-node job: gpu7's 2nd failure, gpu6's 1st
    await h.tick(advance_s=1)
    excluded_at = h.now
    assert h.sbatches == 3 and sbatch_option(h.slurm.scripts[-1], "exclude") == "gpu7"
    assert h.rec.runtime("m").crashes == 0  # a lost node is no crash: no back-off

    h.slurm.node = "gpu9"
    await h.tick(advance_s=299)
    h.rec.scale("m", 2)
    await h.tick(advance_s=1)  # exactly node_exclude_s later: still excluded
    assert h.sbatches == 4 and sbatch_option(h.slurm.scripts[-1], "exclude") == "gpu7"
    h.rec.scale("m", 3)
    await h.tick(advance_s=1)
    assert h.now == excluded_at + 301
    assert h.sbatches == 5 and sbatch_option(h.slurm.scripts[-1], "exclude") is None
    # gpu7's old failures are outside the window now: one more does not exclude it again
    h.slurm.end(h.newest(), "NODE_FAIL", nodelist="gpu7")
    await h.tick(advance_s=1)
    assert h.sbatches == 6 and sbatch_option(h.slurm.scripts[-1], "exclude") is None


async def test_a_job_pending_behind_an_exclusion_that_ends_may_run_on_that_node_again():
    """A replica submitted while a node was excluded waits for the other nodes: when the exclusion ends, the
    pending job's exclusion list is updated (scontrol update ExcNodeList), not kept for as long as it waits."""
    h = Harness(backoff={"node_failure_threshold": 1, "node_exclude_s": 300})
    h.slurm.node = "gpu7"
    await h.tick(2, advance_s=1)
    h.slurm.start_state = "PENDING"   # the other nodes are busy: the replacement waits
    h.slurm.end(h.newest(), "NODE_FAIL")
    await h.tick(advance_s=1)
    waiting = h.newest()
    assert sbatch_option(h.slurm.scripts[-1], "exclude") == "gpu7" and h.slurm.jobs[waiting].state == "PENDING"
    await h.tick(299, advance_s=1)
    assert h.slurm.exclude_updates == []
    await h.tick(2, advance_s=1)
    assert h.slurm.exclude_updates == [(waiting, ())]   # once: gpu7 is a node like the others again


async def test_an_exclusion_update_that_fails_is_tried_again_at_the_next_tick():
    """The expired exclusion was forgotten before its scontrol update ran: one that failed (a busy slurmctld) was
    never tried again, and the pending job waited for the other nodes for as long as it waited."""
    h = Harness(backoff={"node_failure_threshold": 1, "node_exclude_s": 300})
    h.slurm.node = "gpu7"
    await h.tick(2, advance_s=1)
    h.slurm.start_state = "PENDING"
    h.slurm.end(h.newest(), "NODE_FAIL")
    await h.tick(advance_s=1)
    waiting = h.newest()
    h.slurm.exclude_errors.append(SlurmError("scontrol", "Socket timed out on send/recv", transient=True))
    await h.tick(301, advance_s=1)   # (the exclusion ends here: its update fails)
    assert h.slurm.exclude_updates == [] and not h.slurm.exclude_errors
    await h.tick(advance_s=1)
    assert h.slurm.exclude_updates == [(waiting, ())]
    await h.tick(3, advance_s=1)
    assert h.slurm.exclude_updates == [(waiting, ())]   # (once it went through: no more)


async def test_bad_nodes_and_the_jobs_pending_behind_them_survive_a_restart(tmp_path):
    """The nodes a model excluded after failures were the daemon's memory only: a daemon started again submitted
    to the bad node at once, and the job pending with it excluded was never let onto it when the exclusion ended
    (only the daemon that excluded it knew).  Now they are kept in the state dir, and a pending job adopted after
    the restart is taken to exclude them."""
    path = tmp_path / "nodes.json"
    h = Harness(backoff={"node_failure_threshold": 1, "node_exclude_s": 300}, node_memory=NodeMemory(path))
    h.slurm.node = "gpu7"
    await h.tick(2, advance_s=1)
    h.slurm.start_state = "PENDING"   # the other nodes are busy: the replacement waits
    h.slurm.end(h.newest(), "NODE_FAIL")
    await h.tick(advance_s=1)
    waiting, excluded_at = h.newest(), h.now
    assert sbatch_option(h.slurm.scripts[-1], "exclude") == "gpu7"
    await h.rec.nodes.synced()   # (written off the event loop; a change while a write is under way: at the next tick)
    await h.tick()
    await h.rec.nodes.synced()
    kept = json.loads(path.read_text())["m"]
    assert kept["excluded"] == {"gpu7": excluded_at + 300} and kept["job"] == h.cfg.models[0].job_hash()
    h.restart(nodes=NodeMemory(path))   # the daemon killed and started again 100 s later
    await h.tick(advance_s=100)
    assert h.rec.replicas[waiting].excluded == ("gpu7",) and h.rec.runtime("m").excluded == {"gpu7": excluded_at + 300}
    h.rec.scale("m", 2)
    await h.tick(advance_s=1)
    assert sbatch_option(h.slurm.scripts[-1], "exclude") == "gpu7"   # still excluded for the new submissions
    await h.run_until(lambda: h.slurm.exclude_updates, step=10, limit=300)
    assert h.slurm.exclude_updates[0][0] == waiting and h.slurm.exclude_updates[0][1] == ()
    assert excluded_at + 300 < h.now <= excluded_at + 311
    for _ in range(2):   # (a change while a write is under way is written at the next tick)
        await h.tick(advance_s=1)
        await h.rec.nodes.synced()
    kept = json.loads(path.read_text())["m"]   # no bad node left to keep (its failure, as old as the exclusion,
    assert set(kept) == {"jobs"} and set(kept["jobs"]) == set(h.rec.replicas)   # counts no more): the jobs


async def test_a_crash_loops_back_off_survives_a_restart(tmp_path):
    """A model in a crash loop's back-off whose daemon is started again (an upgrade, a supervisor bringing a
    crashed daemon back) waits out the back-off and goes on doubling it: it submitted at once and started again
    from base_s (nodes.json kept only its bad nodes)."""
    path = tmp_path / "nodes.json"
    h = Harness(backoff={"base_s": 10, "max_s": 1000, "early_failure_s": 100, "node_exclude_s": 0},
                node_memory=NodeMemory(path))
    await h.tick()
    for _ in range(3):   # back-offs of about 10, 20 and 40 s
        await crash_and_wait(h)
    job = h.newest()
    h.down.add(job)
    await h.tick(advance_s=1)
    h.slurm.end(job, "FAILED")
    n = h.sbatches
    await h.tick(advance_s=1)   # the fourth early failure: about 80 s (60-100) before the next submission
    until = h.rec.runtime("m").backoff_until
    assert 60 <= until - h.now <= 100 and h.rec.runtime("m").crashes == 4
    for _ in range(2):   # (a change while a write is under way is written at the next tick)
        await h.rec.nodes.synced()
        await h.tick(advance_s=1)
    await h.rec.nodes.synced()
    assert json.loads(path.read_text())["m"]["backoff"]["crashes"] == 4
    h.restart(nodes=NodeMemory(path))   # the daemon killed and started again
    assert until - h.now >= 55
    await h.run_until(lambda: h.sbatches > n, step=1, limit=200)
    assert until <= h.now <= until + 2   # not before the back-off's end (it was at once), and then at once
    rt = h.rec.runtime("m")
    assert rt.crashes == 4 and "4 early failures in a row" in rt.last_error
    assert "early failures" in fleet_status(h.rec, now=h.now)["models"][0]["last_error"]
    await crash_and_wait(h)   # the fifth: about 160 s, the doubling goes on
    assert rt.crashes == 5 and 120 <= rt.backoff_until - rt.crashed_at <= 200


def test_a_back_off_kept_is_restored_for_its_own_job_shape_and_within_max_s():
    m = fleet_cfg().models[0]
    kept = {"crashes": 3, "crashed_at": 100.0, "until": 150.0, "slot": 0, "cause": "crash", "error": "job 7 failed",
            "log": "/l/m-7.log"}
    rt = ModelRuntime()
    assert restore({"m": {"job": m.job_hash(), "backoff": kept}}, rt, m, 120.0)
    assert (rt.crashes, rt.crashed_at, rt.backoff_until, rt.crash_slot, rt.last_error, rt.last_log) == (
        3, 100.0, 150.0, 0, "job 7 failed", "/l/m-7.log")
    other = m.model_copy(update={"partition": "other"})   # a new job shape starts clean, as after a reload
    rt = ModelRuntime()
    assert not restore({"m": {"job": m.job_hash(), "backoff": kept}}, rt, other, 120.0) and rt.crashes == 0
    for bad in ({**kept, "until": "later"}, {**kept, "crashes": -1}, {**kept, "until": float("inf")}, "x"):
        rt = ModelRuntime()
        assert not restore({"m": {"job": m.job_hash(), "backoff": bad}}, rt, m, 120.0) and rt.backoff_until == 0
    # kept by a daemon whose clock ran ahead: no longer than max_s from now, no crash in the future
    rt = ModelRuntime()
    assert restore({"m": {"job": m.job_hash(), "backoff": {**kept, "crashed_at": 1e6, "until": 1e6}}}, rt, m, 120.0)
    assert rt.backoff_until == 120.0 + m.backoff.max_s and rt.crashed_at == 120.0


def test_bad_nodes_kept_for_another_job_shape_are_not_restored():
    m = fleet_cfg().models[0]
    other = m.model_copy(update={"partition": "other"})
    doc = {"m": {"job": m.job_hash(), "excluded": {"gpu7": 5.0}, "failures": {"gpu7": [1.0]}}}
    rt = ModelRuntime()
    assert restore(doc, rt, m, 2.0) and rt.excluded == {"gpu7": 5.0} and rt.node_failures == {"gpu7": [1.0]}
    rt = ModelRuntime()
    assert m.job_hash() != other.job_hash() and not restore(doc, rt, other, 2.0) and rt.excluded == {}
    for bad in ("soon", float("nan")):
        assert not restore({"m": {"job": m.job_hash(), "excluded": {"gpu7": bad}}}, rt, m, 2.0) and rt.excluded == {}
    # kept by a daemon whose clock ran ahead: no longer than node_exclude_s from now
    assert restore(doc, rt, m, 2.0 - m.backoff.node_exclude_s) and rt.excluded == {"gpu7": 2.0}


async def lost_sbatch() -> tuple[Harness, str]:
    h = Harness(daemon={"submit_confirm_s": 60})
    h.slurm.submit_errors.append(SlurmError("sbatch", "Socket timed out on send/recv", transient=True))
    await h.tick()
    script = h.slurm.scripts[0]
    nonce = JobTag.decode(sbatch_option(script, "comment")).nonce
    assert h.sbatches == 1 and not h.slurm.jobs and list(h.rec.placeholders) == [nonce]
    return h, script


async def test_an_sbatch_without_an_answer_holds_back_the_ticks_other_sbatches_and_is_watched_from_its_end():
    """slurmctld overloaded: squeue answers, sbatch times out.  Each planned sbatch of the tick tried its own, one
    after another (4 x 30 s with the default timeout: routing and drains waited as long), and the watch for each
    job that may exist counted from the tick's start, so the later ones expired before their sbatch returned."""
    h = Harness(replicas=4, daemon={"submit_confirm_s": 600})
    submit = h.slurm.submit

    async def slow(script):
        h.now += 30   # (no answer for 30 s)
        return await submit(script)
    h.slurm.submit = slow
    h.slurm.submit_errors = [SlurmError("sbatch", "Socket timed out on send/recv", transient=True)] * 4
    start = h.now
    await h.tick()
    assert h.slurm.submits == 1 and len(h.rec.placeholders) == 1
    assert next(iter(h.rec.placeholders.values())).deadline == start + 30 + 600   # from the answer, not the tick
    h.slurm.submit_errors.clear()
    await h.tick(advance_s=1)   # (an sbatch that answers in 30 s is past two ticks' time: one a tick)
    await h.run_until(lambda: h.slurm.submits == 4, step=1, limit=300)
    assert len(h.slurm.jobs) == 3   # the other slots; the first one's job is watched for


async def test_an_sbatch_that_could_not_start_is_tried_again_at_the_next_tick_not_watched_for():
    """A fork refused (EAGAIN, a full descriptor table): sbatch never ran, so no job can exist: the next tick
    submits again, where an sbatch that timed out is watched for (its job may exist) for submit_confirm_s."""
    h = Harness(daemon={"submit_confirm_s": 60})
    h.slurm.submit_errors.append(SlurmError("sbatch", "cannot start it: [Errno 11] EAGAIN", transient=True,
                                            started=False))
    await h.tick()
    assert h.sbatches == 1 and not h.rec.placeholders and "EAGAIN" in h.rec.runtime("m").last_error
    await h.tick(advance_s=1)
    assert len(h.slurm.jobs) == 1 and h.slurm.submits == 2
    # the sbatch that went through ends that error: it stayed in `slurmfleet status`'s problem column for good,
    # and in the 503s of requests held while no job was known
    assert h.rec.runtime("m").last_error is None


class Publishing(Harness):
    """Keeps every table the reconciler publishes."""

    def on_update(self, ready) -> None:
        self.__dict__.setdefault("tables", []).append(ready)
        super().on_update(ready)


async def test_each_replica_is_published_with_the_engine_it_runs():
    """A generation continues only on a replica of the same engine (orchestrator.gateway.resumeplan.Elsewhere): a
    job carries its model's engine_hash in its tag; one an earlier release tagged (none there) counts with its
    settings' when its hash is current, else with its hash (another engine, for all the fleet knows)."""
    import re
    h = Publishing()
    await h.tick()
    await h.tick(advance_s=1)
    m = h.rec.cfg.models[0]
    assert {r.job_id: r.engine for r in h.tables[-1]["m"].replicas} == {h.newest(): m.engine_hash()}
    assert f";eng={m.engine_hash()}" in sbatch_option(h.slurm.scripts[0], "comment")
    g = Publishing()
    old = re.sub(r";eng=[0-9a-f]+", "", h.slurm.scripts[0])
    current, outdated = g.slurm.create(old), g.slurm.create(old.replace(f"hash={m.job_hash()}", "hash=0123456789ab"))
    await g.tick()
    assert g.rec.replicas[current].engine_hash == m.engine_hash()
    assert g.rec.replicas[outdated].engine_hash == "0123456789ab"


async def test_lost_sbatch_whose_job_shows_up_is_adopted_without_a_second_submit():
    h, script = await lost_sbatch()
    await h.tick(30, advance_s=1)
    assert h.sbatches == 1
    jid = h.slurm.create(script)  # squeue finally shows it, carrying the nonce
    await h.tick(advance_s=1)
    assert not h.rec.placeholders and h.rec.replicas[jid].slot == 0
    await h.tick(100, advance_s=1)
    assert h.sbatches == 1 and h.ready() == {jid}


async def test_lost_sbatch_whose_job_never_shows_up_is_resubmitted_once_after_submit_confirm_s():
    h, _ = await lost_sbatch()
    await h.tick(60, advance_s=1)  # at the deadline itself: still waiting
    assert h.sbatches == 1 and h.rec.placeholders
    await h.tick(advance_s=1)
    assert h.sbatches == 2 and not h.rec.placeholders
    await h.tick(100, advance_s=1)
    assert h.sbatches == 2 and len(h.rec.replicas) == 1


@pytest.mark.parametrize("how", ["timed_out", "killed_in_sbatch"])
async def test_a_restart_watches_for_the_job_of_an_sbatch_of_unknown_outcome_before_submitting_again(tmp_path, how):
    """The daemon dies while an sbatch it could not confirm may still make a job (one that timed out, or one it was
    killed in): the next daemon, whose first squeue does not list the job yet, waits for it (its nonce) instead of
    submitting the slot again (it did: two jobs, one cancelled a tick later), and submits again only after
    submit_confirm_s without it."""
    path = tmp_path / "submitting.json"
    h = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(path))
    if how == "timed_out":
        h.slurm.submit_errors.append(SlurmError("sbatch", "Socket timed out on send/recv", transient=True))
        await h.tick()
    else:
        started, never = asyncio.Event(), asyncio.Event()

        async def hangs(script: str) -> str:
            h.slurm.scripts.append(script)
            started.set()
            await never.wait()
        h.slurm.submit = hangs
        tick = asyncio.create_task(h.tick())
        await asyncio.wait_for(started.wait(), 5)
        tick.cancel()   # (the daemon is killed here: nothing after this runs)
        await asyncio.gather(tick, return_exceptions=True)
    script = h.slurm.scripts[0]
    assert [p["nonce"] for p in json.loads(path.read_text())["submitting"]] == [JobTag.decode(sbatch_option(script, "comment")).nonce]
    h2 = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(path))
    h2.now = h.now + 10
    await h2.tick(20, advance_s=1)
    assert h2.slurm.submits == 0 and not h2.rec.replicas       # not listed yet: waited for
    jid = h2.slurm.create(script)                              # slurmctld has it after all
    await h2.tick(advance_s=1)
    await h2.rec.placeholders.synced()   # (written off the event loop)
    assert h2.rec.replicas[jid].slot == 0 and not json.loads(path.read_text())["submitting"]
    await h2.tick(60, advance_s=1)
    assert h2.slurm.submits == 0 and set(h2.rec.replicas) == {jid}
    h3 = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(path))   # (nothing left to wait for)
    await h3.tick()
    assert h3.slurm.submits == 1


async def test_a_deadline_read_back_is_no_later_than_submit_confirm_s_from_now(tmp_path):
    """A file written by a daemon whose clock ran ahead (or stepped back since) must not hold the slot for longer
    than a watch would: its deadline is cut to submit_confirm_s from the start."""
    path = tmp_path / "submitting.json"
    path.write_text(json.dumps({"submitting": [{"model": "m", "slot": 0, "config_hash": "h", "nonce": "abc",
                                                "deadline": time.time() + 86400}]}))
    assert Submitting(path, max_wait_s=60)["abc"].deadline <= time.time() + 60


async def test_an_sbatch_that_raised_something_else_leaves_no_placeholder(tmp_path):
    h = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(tmp_path / "submitting.json"))

    async def broken(script: str) -> str:
        raise OSError("no such file: sbatch")
    h.slurm.submit = broken
    await h.tick()   # (the model's reconcile logs it and goes on)
    assert not h.rec.placeholders


async def test_a_watched_sbatch_whose_job_never_comes_is_submitted_again_after_a_restart(tmp_path):
    path = tmp_path / "submitting.json"
    h = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(path))
    h.slurm.submit_errors.append(SlurmError("sbatch", "Socket timed out on send/recv", transient=True))
    await h.tick()
    h2 = Harness(daemon={"submit_confirm_s": 60}, submitting=Submitting(path))
    h2.now = h.now + 30
    await h2.tick(30, advance_s=1)
    assert h2.slurm.submits == 0
    await h2.tick(2, advance_s=1)   # past the deadline (60 s after the first sbatch)
    assert h2.slurm.submits == 1 and len(h2.rec.replicas) == 1


@pytest.mark.parametrize("reason,fatal", [("PartitionConfig", True), ("QOSMaxGRESPerJob", True),
                                          ("Resources", False), ("PartitionNotAvail", False)])
async def test_impossible_pending_reason_cancels_and_blocks_until_reload(reason, fatal):
    h = Harness()
    h.slurm.start_state = "PENDING"
    await h.tick()
    jid = h.newest()
    h.slurm.set(jid, reason=reason)
    await h.tick(advance_s=5)
    assert h.slurm.cancels == ([jid] if fatal else [])
    assert (reason in (h.rec.runtime("m").blocked or "")) == fatal
    await h.tick(20, advance_s=60)
    assert h.sbatches == 1 and h.slurm.cancels == ([jid] if fatal else [])
    assert (jid in h.rec.replicas) != fatal
    h.rec.apply_config(fleet_cfg(probe={"interval_s": 2}))  # a reload (the job shape is the same)
    await h.tick(advance_s=5)
    assert h.rec.runtime("m").blocked is None and h.sbatches == (2 if fatal else 1)


async def test_a_requeued_job_pending_for_good_is_replaced_without_blocking_the_model():
    """A job requeued after its node was lost can pend for a reason that never clears (BadConstraints, seen after
    node loss on cloud clusters): it ran as configured, so the cluster, not the file, is at fault.  It blocked
    the model until a reload; it is now cancelled and replaced."""
    h = Harness()
    await h.tick(2, advance_s=1)
    jid = h.newest()
    assert h.ready() == {jid}
    h.slurm.set(jid, state="PENDING", reason="BeginTime", restart_count=1, start_time=None)   # (a requeue's wait)
    await h.tick(advance_s=5)
    assert h.ready() == set() and h.slurm.cancels == []
    h.slurm.set(jid, reason="BadConstraints")
    await h.tick(advance_s=5)
    assert h.slurm.cancels == [jid] and h.rec.runtime("m").blocked is None
    await h.tick(3, advance_s=1)
    assert h.sbatches == 2 and h.newest() != jid


async def test_permanent_sbatch_rejection_blocks_until_reload():
    h = Harness(replicas=2)
    h.slurm.submit_errors.append(SlurmError("sbatch", "Invalid partition name specified", transient=False))
    await h.tick()
    assert h.sbatches == 1 and "rejected" in h.rec.runtime("m").blocked and not h.rec.placeholders
    await h.tick(20, advance_s=60)
    assert h.sbatches == 1
    h.rec.apply_config(fleet_cfg(replicas=2, partition="gpu"))
    await h.tick()
    assert h.sbatches == 3 and h.rec.runtime("m").blocked is None


@pytest.mark.parametrize("cause, text, says", [
    ("submit_limit", "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
     "the model waits for SLURM's job limit to free (sbatch failed:"),
    # (slurmctld 22.05's words, seen on the local cluster, for a partition an admin set DRAIN or INACTIVE)
    ("partition_closed", "Required partition not available (inactive or drain)",
     "the model waits for its partition to take jobs again (sbatch failed:")])
async def test_an_sbatch_refused_for_now_backs_off_and_tries_again(cause, text, says):
    """A QOS's or association's MaxSubmitJobs (a batch array of the same user can fill it) clears as jobs end,
    and a partition's maintenance ends: the model backs off and submits again (it was blocked until someone
    reloaded: a drained partition left a model at zero after its maintenance)."""
    h = Harness(backoff={"base_s": 10, "max_s": 120})
    h.slurm.submit_errors.append(SlurmError("sbatch", f"Batch job submission failed: {text}", transient=False))
    await h.tick()
    rt = h.rec.runtime("m")
    assert h.sbatches == 1 and rt.blocked is None and text in rt.last_error
    await h.tick(advance_s=1)
    reg = h.rec.metrics.registry
    # its back-off is its cause's, not a crash loop's (the crash-loop alert reads cause="crash")
    assert reg.get_sample_value("slurmfleet_model_backoff_seconds", {"model": "m", "cause": cause}) == 119
    assert reg.get_sample_value("slurmfleet_model_backoff_seconds", {"model": "m", "cause": "crash"}) == 0
    from orchestrator.fleet.routes import waiting_on
    why, _ = waiting_on("m", [], rt, 1, h.now)   # (a held request's 503): no crash to speak of
    assert why.startswith(says) and "crash" not in why
    await h.tick(advance_s=118)
    assert h.sbatches == 1
    await h.tick(advance_s=2)
    assert h.sbatches == 2 and len(h.rec.replicas) == 1


@pytest.mark.parametrize("idle_after_s", [None, 5])
async def test_drain_cancels_once_idle_or_at_drain_timeout(idle_after_s):
    h = Harness(drain={"timeout_s": 30})
    await h.tick(2, advance_s=1)
    jid = h.newest()
    assert h.ready() == {jid}
    h.busy[jid] = 1
    assert await h.rec.request_drain(jid)
    await h.tick()
    assert jid not in h.ready() and h.slurm.cancels == []
    for s in range(1, 41):
        if s == idle_after_s:
            h.busy[jid] = 0
        await h.tick(advance_s=1)
        assert h.slurm.cancels == ([jid] if s >= (idle_after_s or 30) else []), s
    assert jid not in h.rec.replicas and len(h.ready()) == 1  # the replacement serves


async def test_time_limit_handover_surges_then_drains_never_below_desired():
    h = Harness(replicas=2, time_limit="1:00:00", drain={"handover_lead_s": 300, "stagger_s": 600})
    await h.tick(2, advance_s=1)
    a, b = sorted(h.rec.replicas, key=int)
    assert h.ready() == {a, b} and h.slurm.jobs[b].time_limit_s == 3000  # slot 1 is staggered: expires first
    mark = len(h.updates)
    await h.tick(advance_s=h.slurm.jobs[b].start_time + 2700 - h.now)  # 300 s left: not under the lead yet
    assert h.sbatches == 2
    h.warmup_s, h.busy[b] = 20, 1
    await h.tick(advance_s=1)
    c = h.newest()
    assert h.sbatches == 3 and h.rec.replicas[c].slot == 1
    await h.tick(advance_s=1)   # the successor STARTING in b's slot: the slot's time left is still b's, nearer
    left = h.rec.metrics.registry.get_sample_value("slurmfleet_replica_time_left_seconds", {"model": "m", "slot": "1"})
    assert left == h.slurm.jobs[b].start_time + 3000 - h.now
    waited = 1 + await h.run_until(lambda: c in h.ready(), step=1)
    assert waited >= 20 and h.ready() == {a, c}
    assert h.rec.replicas[b].drain_requested_at == h.now and h.slurm.cancels == []  # drained, requests in flight
    assert all(b in r for r in h.updates[mark:-1])  # the old one served until its successor was READY
    h.busy[b] = 0
    await h.tick(advance_s=1)
    assert h.slurm.cancels == [b]
    await h.tick(5, advance_s=1)
    assert h.sbatches == 3 and set(h.rec.replicas) == {a, c}
    assert min(len(r) for r in h.updates[mark:]) >= 2


async def test_usr1_time_limit_warning_starts_a_handover_early():
    h = Harness(time_limit="4:00:00")
    await h.tick(3, advance_s=1)
    a = h.newest()
    assert h.sbatches == 1
    h.draining.add(a)  # the job wrote <id>.draining: SLURM's warning came, whatever the clock says
    await h.tick(advance_s=1)
    assert h.sbatches == 2 and h.ready() == {a}


async def test_a_job_that_stops_itself_before_its_time_limit_ends_at_its_limit_not_unhealthy():
    """A multi-node job not handed over in time stops its own steps before its limit (SLURM's TERM would KILL the
    nodes' engines): its record goes, then it ends COMPLETED.  It was cancelled as unhealthy, then counted a
    failure (restarts{unhealthy}, the crash-loop alert's input): it is a time-limit end, and no crash."""
    h = Harness(time_limit="4:00:00")
    await h.tick(3, advance_s=1)
    a = h.newest()
    await h.tick(advance_s=3000)   # (hours of service: well past the startup timeout)
    h.draining.add(a)              # SLURM's warning
    await h.tick(advance_s=1)
    successor = h.newest()
    assert successor != a and h.ready() == {a}
    h.down.add(successor)          # its engine still loading
    h.unpublished.add(a)           # no handover in time: the job stops its own steps, its record goes
    h.down.add(a)                  # ... and its engines (the probes failed, and it was cancelled as unhealthy)
    await h.tick()
    assert a not in h.ready()      # out of routing at once, not sent requests until its probes failed
    await h.tick(3, advance_s=1)
    assert a not in h.slurm.cancels and a in h.rec.replicas
    h.slurm.end(a, "COMPLETED")
    await h.tick(advance_s=1)
    restarts = h.rec.metrics.restarts
    assert restarts.labels("m", "time_limit")._value.get() == 1
    assert restarts.labels("m", "unhealthy")._value.get() == 0 and restarts.labels("m", "failed")._value.get() == 0
    assert h.rec.runtime("m").crashes == 0 and h.sbatches == 2 and a not in h.rec.replicas


async def test_a_job_drained_for_its_time_limit_that_ends_by_itself_counts_one_time_limit_end():
    """Its handover's drain counts the replica's time-limit end; the job ending before the daemon's cancel
    (a multi-node job stopping its own steps, or SLURM's limit while requests finish) counted it again."""
    h = Harness(time_limit="4:00:00")
    await h.tick(3, advance_s=1)
    a = h.newest()
    h.busy[a] = 1                  # a request in flight: the drain waits for it
    h.draining.add(a)
    await h.run_until(lambda: h.rec.replicas[a].drain_reason == "time_limit", step=1)
    h.slurm.end(a, "COMPLETED")
    await h.tick(2, advance_s=1)
    assert h.rec.metrics.restarts.labels("m", "time_limit")._value.get() == 1 and a not in h.rec.replicas


async def test_a_job_cancelled_before_a_restart_is_stopping_to_the_next_daemon_not_a_crash():
    """A cancelled job runs on for its stop's grace (a multi-node one 10-25 s).  A daemon restarted meanwhile
    adopted it as a replica starting in its slot, and its end (143: FAILED) counted a crash (back-off) and
    failures on its nodes.  The cancel is marked in the state dir, as an operator's drain is."""
    h = Harness(replicas=1)
    await h.tick(3, advance_s=1)
    jid = h.newest()
    h.slurm.ignore_cancel = True   # (it stops in its own time)
    h.down.add(jid)                # its engine stops answering: unhealthy, cancelled and replaced
    marked_first = []
    h.slurm.on_cancel = lambda j: marked_first.append(j in h.cancelled)   # (a daemon killed just after its scancel
    # adopted the job as a replica: the mark comes first)
    h.slurm.cancel_errors = [SlurmError("scancel", "Socket timed out", transient=True)]
    await h.run_until(lambda: not h.slurm.cancel_errors, step=1)
    assert h.cancelled == {jid}    # (a scancel that failed is sent again: by this daemon, or by the next one)
    await h.run_until(lambda: jid in h.slurm.cancels, step=1)
    assert h.cancelled == {jid} and marked_first and all(marked_first)
    h.rec = Reconciler(h.rec.cfg, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       inflight=lambda j: h.busy.get(j, 0), on_update=h.on_update, rng=random.Random(0))
    await h.tick(2, advance_s=1)
    assert h.rec.replicas[jid].cancel_requested_at is not None
    h.slurm.end(jid, "FAILED")   # (exit 143: its TERM)
    await h.tick(2, advance_s=1)
    assert h.rec.metrics.restarts.labels("m", "failed")._value.get() == 0 and h.rec.runtime("m").crashes == 0
    assert jid not in h.rec.replicas and h.cancelled == set() and h.sbatches == 2


async def test_config_roll_replaces_one_replica_at_a_time_without_losing_capacity():
    h = Harness(replicas=3)
    await h.tick(2, advance_s=1)
    old = set(h.rec.replicas)
    assert h.ready() == old and len(old) == 3
    new = fleet_cfg(replicas=3, simulator={"ttft_s": 0.5})
    new_hash = new.models[0].job_hash()
    assert new_hash != h.rec.cfg.models[0].job_hash()
    h.warmup_s = 3
    h.rec.apply_config(new)
    for _ in range(40):
        await h.tick(advance_s=1)
        assert len(h.ready()) >= 3
        alive = [j for j in h.slurm.jobs.values() if j.state in ("PENDING", "RUNNING")]
        assert len(alive) <= 4  # max_surge 1
    assert h.sbatches == 6 and sorted(h.slurm.cancels) == sorted(old)
    assert {f.config_hash for f in h.rec.replicas.values()} == {new_hash}
    assert sorted(f.slot for f in h.rec.replicas.values()) == [0, 1, 2]
    assert len(h.ready()) == 3 and not h.ready() & old


async def test_a_cluster_setting_the_jobs_inherit_rolls_them_and_one_they_override_does_not():
    """``cluster.account`` (and partition, qos, reservation, constraint, requeue, sbatch_options) reach every
    job that does not set its own: a reload that changes it rolls the replicas, one at a time, onto the new
    account (the fleet used to stay on the old one until each job's time limit); a model with its own account
    is not rolled by it."""
    h = Harness(replicas=2)
    h.rec.apply_config(fleet_cfg(replicas=2, cluster={"account": "lab-a"}))
    await h.tick(2, advance_s=1)
    old = set(h.rec.replicas)
    assert len(h.ready()) == 2 and {sbatch_option(s, "account") for s in h.slurm.scripts[-2:]} == {"lab-a"}
    h.rec.apply_config(fleet_cfg(replicas=2, cluster={"account": "lab-a", "sbatch_options": {"mail-type": "END"}}))
    await h.run_until(lambda: not h.ready() & old, step=1)
    assert sorted(h.slurm.cancels) == sorted(old) and h.sbatches == 4
    assert [sbatch_option(s, "mail-type") for s in h.slurm.scripts] == [None, None, "END", "END"]
    own = fleet_cfg(replicas=2, account="lab-m", cluster={"account": "lab-a"})
    h.rec.apply_config(own)
    old = set(h.rec.replicas)
    await h.run_until(lambda: not h.ready() & old and len(h.ready()) == 2, step=1)
    n = h.sbatches
    assert n == 6 and [sbatch_option(s, "account") for s in h.slurm.scripts[4:]] == ["lab-m", "lab-m"]
    h.rec.apply_config(fleet_cfg(replicas=2, account="lab-m", cluster={"account": "lab-b"}))
    assert h.rec.cfg.models[0].job_hash() == own.models[0].job_hash()
    await h.tick(10, advance_s=1)
    assert h.sbatches == n and len(h.ready()) == 2


async def test_jobs_tagged_by_earlier_releases_are_adopted_as_current_and_a_daemon_only_setting_rolls_none():
    """A daemon upgraded to the present hash adopts the jobs its predecessors tagged (the model part alone,
    from before the site part; the site part with the settings the job does not read hashed too): no roll of
    the whole fleet for the upgrade; one whose settings are outdated is rolled. A reload that changes only a
    setting the daemon reads (a drain's wait, the handover lead) then rolls nothing."""
    cfg = fleet_cfg(replicas=3, cluster={"partition": "gpu"})
    m = cfg.models[0]
    plain = fleet_cfg(replicas=3).models[0].job_hash()   # (a fleet without cluster settings has a site part too:
    assert "+" in m.job_hash() and "+" in plain          # a tag without one is always a job from before it)
    assert plain.split("+")[0] == m.job_hash().split("+")[0] and plain != m.job_hash()
    h = Harness(replicas=3)
    h.rec.apply_config(cfg)
    tags = (m.job_hash(legacy=True).split("+")[0], m.job_hash(legacy=True), "0123456789ab")
    for slot, hsh in enumerate(tags):
        h.slurm.create(f"#SBATCH --comment={JobTag('f', 'm', slot, hsh, f'n{slot}').encode()}\n#SBATCH --time=10:00:00\n")
    *current, outdated = sorted(h.slurm.jobs)
    await h.run_until(lambda: outdated not in h.rec.replicas and len(h.ready()) == 3, step=1)
    assert h.slurm.cancels == [outdated] and h.sbatches == 1 and set(current) <= h.ready()
    assert {h.rec.replicas[j].config_hash for j in current} == {m.job_hash()}
    h.rec.apply_config(fleet_cfg(replicas=3, cluster={"partition": "gpu"}, drain={"timeout_s": 5, "handover_lead_s": 60}))
    await h.tick(10, advance_s=1)
    assert h.sbatches == 1 and h.slurm.cancels == [outdated] and len(h.ready()) == 3


async def test_an_operators_replace_serves_until_its_successor_does_even_across_a_restart():
    """`slurmfleet drain --replace JOB` of a model's only replica: a successor is submitted, the job keeps
    serving while it starts (and while a new daemon takes over), and only then drains ("replace"). Asked of
    a replica that serves nothing yet, it is a plain drain."""
    h = Harness(replicas=1)
    await h.tick(2, advance_s=1)
    jid = h.newest()
    mark = len(h.updates)
    assert await h.rec.request_drain(jid, replace=True) == "replacing" and h.replace == {jid}
    await h.tick(advance_s=1)
    successor = h.newest()
    assert successor != jid and h.rec.replicas[successor].slot == h.rec.replicas[jid].slot
    h.down.add(successor)   # its engine starts slowly
    await h.tick(5, advance_s=1)
    h.rec = Reconciler(h.rec.cfg, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       inflight=lambda j: h.busy.get(j, 0), on_update=h.on_update, rng=random.Random(0))
    await h.tick(5, advance_s=1)
    assert h.ready() == {jid} and h.sbatches == 2
    shown = fleet_status(h.rec, now=h.now)["models"][0]["replicas"]
    assert [r["job_id"] for r in shown if r["handing_over"]] == [jid]
    # a gateway process behind the newest table: drains count every job busy, the status shows what is in flight
    from orchestrator.contract import GatewayReport
    from orchestrator.fleet.reports import ReportHub
    hub = ReportHub()
    hub.attach(1, lambda: GatewayReport(1, 1, inflight={jid: 2}))
    hub.published(2)
    assert hub.inflight_by_job().get(successor) == 1
    shown = {r["job_id"]: r["inflight"] for r in fleet_status(h.rec, hub, now=h.now)["models"][0]["replicas"]}
    assert shown == {jid: 2, successor: 0}, shown
    assert "READY (handing over)" in render_table(fleet_status(h.rec, now=h.now))
    # each shows its own GPUs (the readings are keyed by slot for the metrics: both showed both jobs')
    slot = str(h.rec.replicas[jid].slot)
    gpus = {("m", slot, "node1", str(g), jid): {"utilization_ratio": 0.5} for g in range(2)}
    rows = {r["job_id"]: r for r in fleet_status(h.rec, now=h.now, gpus=gpus)["models"][0]["replicas"]}
    assert (rows[jid]["gpus"], rows[jid]["gpu_utilization"]) == (2, 0.5)
    assert (rows[successor]["gpus"], rows[successor]["gpu_utilization"]) == (0, None)
    h.down.clear()
    await h.run_until(lambda: successor in h.ready(), step=1)
    assert all(jid in r for r in h.updates[mark:-1])   # it served until its successor was READY
    assert h.ready() == {successor} and h.rec.replicas[jid].drain_reason == "replace" and h.sbatches == 2
    await h.run_until(lambda: jid in h.slurm.cancels, step=1)
    h.slurm.end(jid, "CANCELLED")
    await h.tick(3, advance_s=1)
    assert h.ready() == {successor} and h.sbatches == 2 and h.replace == set()   # the mark goes with the job
    h.warmup_s = 1000
    h.rec.scale("m", 2)
    await h.tick(advance_s=1)
    starting = h.newest()
    assert await h.rec.request_drain(starting, replace=True) == "draining" and h.replace == set()


@pytest.mark.parametrize("first_look", ["probe fails", "scan missed"])
async def test_a_restart_with_a_changed_job_shape_rolls_the_adopted_replicas(first_look):
    """The operator changes a model's job shape and restarts the daemon (not a reload).  The new daemon's first
    probe of each adopted engine fails once (a slow answer), or its first scan of the records is missed (a slow
    shared file system): the replicas were STARTING to it, and all three were cancelled in the first tick.
    They are handed over one at a time instead, each serving until its successor is READY."""
    probe = {"interval_s": 1, "failure_threshold": 3, "startup_timeout_s": 900}
    h = Harness(replicas=3, probe=probe)
    await h.tick(2, advance_s=1)
    old = h.ready()
    assert len(old) == 3
    changed = fleet_cfg(replicas=3, probe=probe, simulator={"ttft_s": 0.07})
    assert changed.models[0].job_hash() != h.rec.cfg.models[0].job_hash()
    h.rec = Reconciler(changed, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       on_update=h.on_update, rng=random.Random(0))
    if first_look == "probe fails":
        h.down |= old
        await h.tick(advance_s=1)
        h.down.clear()
    else:
        real, h.scan = h.scan, lambda: asyncio.sleep(0, Discovered({}, frozenset()))
        await h.tick(advance_s=1)
        h.scan = real
    assert h.slurm.cancels == [] and h.sbatches == 4   # one successor, the three still there
    await h.tick(advance_s=1)
    assert h.ready() >= old - set(h.slurm.cancels)
    await h.run_until(lambda: len(h.ready() - old) == 3, step=1)
    assert h.sbatches == 6 and len(set(h.slurm.cancels) & old) == 3


async def test_a_job_whose_comment_a_site_rewrites_stays_ours_and_says_so(caplog):
    """A site's job_submit plugin sets every job's Comment, where slurmfleet keeps its tag: the daemon's own job
    was counted out of squeue's listing, replaced two ticks later, and again, and none was ever cancelled (ten
    jobs for one replica after 20 ticks).  It is followed by its id, and the model's status says why a restarted
    daemon could not adopt it."""
    h = Harness(replicas=1)
    create = h.slurm.create

    def rewritten(script):
        jid = create(script)
        h.slurm.set(jid, comment="site: project=abc")
        return jid
    h.slurm.create = rewritten
    await h.tick(20, advance_s=5)
    assert h.sbatches == 1 and sum(j.state == "RUNNING" for j in h.slurm.jobs.values()) == 1
    assert len(h.ready()) == 1 and h.slurm.cancels == []
    why = h.rec.runtime("m").last_error
    assert "comment" in why and "site: project=abc" in why and "--comment" in why
    assert sum("no longer holds slurmfleet's tag" in r.getMessage() for r in caplog.records) == 1
    for _ in range(6):   # replaced again and again (crashes, time limits): what squeue forgot is forgotten here too
        old = h.newest()
        h.slurm.end(old)
        await h.run_until(lambda: h.newest() != old and h.newest() in h.ready(), step=5)
        del h.slurm.jobs[old]   # (its record purged from squeue)
    await h.tick(2, advance_s=5)
    assert h.sbatches == 7 and len(h.rec.replicas) == 1
    assert h.rec.untagged == {h.newest()}   # (one id per job ever replaced, for the daemon's life)


async def test_a_requeued_job_that_completes_its_last_run_for_long_is_not_replaced():
    """Preempted with requeue (or its node lost): squeue shows the job COMPLETING, its restart count up, while
    KillWait and the epilog run, then PENDING.  Past rescancel_after_s of COMPLETING a second job was submitted,
    and once the first was PENDING again the first (its place in the queue kept) was cancelled as surplus."""
    h = Harness(replicas=1)
    await h.tick(2, advance_s=1)
    (a,) = h.ready()
    h.slurm.set(a, state="COMPLETING", restart_count=1, end_time=h.now)
    await h.tick(12, advance_s=5)
    assert h.sbatches == 1 and h.ready() == set()
    h.slurm.set(a, state="PENDING", reason="BeginTime", nodelist="", start_time=None)
    await h.tick(advance_s=5)
    assert h.sbatches == 1 and h.slurm.cancels == []
    h.slurm.set(a, state="RUNNING", start_time=h.now, nodelist="gpu1")
    await h.run_until(lambda: h.ready() == {a}, step=1)
    assert h.sbatches == 1 and h.slurm.cancels == []


async def test_an_operators_drain_goes_on_after_a_restart_of_the_daemon():
    """`slurmfleet drain JOB`, then the daemon restarts before the drain is done: the new daemon finds the
    drain's mark and goes on with it (the job was adopted as a READY replica, and a scale-down then drained
    the least loaded of the two: the successor, keeping the job the operator wanted gone)."""
    h = Harness(replicas=1, drain={"timeout_s": 60})
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.busy[jid] = 3                                   # streams in flight: the drain waits for them
    assert await h.rec.request_drain(jid) and h.requested == {jid}
    await h.tick(2, advance_s=1)
    successor = h.newest()
    assert successor != jid and h.ready() == {successor} and h.slurm.cancels == []
    h.rec = Reconciler(h.rec.cfg, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       inflight=lambda j: h.busy.get(j, 0), on_update=h.on_update, rng=random.Random(0))
    h.busy[successor] = 0
    await h.tick(advance_s=1)
    assert h.rec.replicas[jid].drain_reason == "operator" and h.ready() <= {successor}
    await h.run_until(lambda: jid in h.slurm.cancels, step=1)
    assert h.slurm.cancels == [jid] and h.sbatches == 2
    h.slurm.end(jid, "CANCELLED")
    await h.tick(3, advance_s=1)
    assert h.ready() == {successor} and h.requested == set()   # the mark goes with the job


async def test_a_model_removed_by_a_reload_leaves_no_gauge_series_behind():
    """A removed model's desired count, back-off, blocked flag and oldest pending age go with it: its
    `desired > 0 unless READY` (SlurmfleetModelNoReadyReplica) fired for ever after the reload."""
    h = Harness(replicas=1)
    two = {"fleet": "f", "state_dir": "/nonexistent/sf", "models": [
        {"name": n, "engine": "simulator", "replicas": 1, "container": {"enabled": False}} for n in ("m", "gone")]}
    h.rec.apply_config(load_config_text(yaml.safe_dump(two), "f.yaml", {}))
    await h.tick(2, advance_s=1)
    reg = h.rec.metrics.registry
    names = ("slurmfleet_replicas_desired", "slurmfleet_model_backoff_seconds", "slurmfleet_model_blocked",
             "slurmfleet_job_oldest_pending_seconds")
    def labels(n, model):
        return {"model": model, "cause": "crash"} if n == "slurmfleet_model_backoff_seconds" else {"model": model}
    assert all(reg.get_sample_value(n, labels(n, "gone")) is not None for n in names)
    h.rec.apply_config(fleet_cfg(replicas=1))
    await h.tick(3, advance_s=1)
    assert [s for s in reg.collect() for x in s.samples if x.labels.get("model") == "gone" and s.type == "gauge"] == []
    assert all(reg.get_sample_value(n, labels(n, "m")) is not None for n in names)
    assert reg.get_sample_value("slurmfleet_replicas_desired", {"model": "m"}) == 1


async def test_a_removed_models_drains_keep_its_own_drain_timeout():
    """A reload that removes a model drains its replicas: they were cut at a fixed 30 s (the model's config gone),
    not at the model's own drain.timeout_s, with their streams."""
    h = Harness(replicas=1, drain={"timeout_s": 120})
    await h.tick(2, advance_s=1)
    (job,) = h.ready()
    h.busy[job] = 2   # streams in flight
    other = {"fleet": "f", "state_dir": "/nonexistent/sf", "models": [
        {"name": "x", "engine": "simulator", "replicas": 0, "container": {"enabled": False}}]}
    h.rec.apply_config(load_config_text(yaml.safe_dump(other), "f.yaml", {}))   # model m removed
    await h.tick(60, advance_s=1)
    assert job not in h.slurm.cancels and h.rec.replicas[job].drain_requested_at is not None
    await h.tick(65, advance_s=1)
    assert job in h.slurm.cancels


async def test_job_still_running_after_scancel_is_cancelled_again_after_rescancel_after_s():
    h = Harness(daemon={"rescancel_after_s": 30})
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.ignore_cancel = True
    await h.rec.request_drain(jid)
    await h.tick()
    assert h.slurm.cancels == [jid]
    for s in range(1, 63):
        await h.tick(advance_s=1)
        assert h.slurm.cancels == [jid] * (1 + (s >= 31) + (s >= 62)), s
    h.slurm.end(jid, "CANCELLED")
    await h.tick(40, advance_s=1)
    assert h.slurm.cancels == [jid] * 3 and jid not in h.rec.replicas


async def test_a_multi_node_job_is_stopped_by_a_term_to_its_batch_shell_first():
    """A plain scancel TERMs srun too, which answers by KILLing every node's engine (no clean stop, vLLM's shared
    memory left behind): a multi-node job's first scancel is a TERM to its batch shell alone, which stops the
    nodes' scripts through SLURM; one still running after rescancel_after_s gets the plain scancel."""
    h = Harness(daemon={"rescancel_after_s": 30}, nodes=2)
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.ignore_cancel = True
    await h.rec.request_drain(jid)
    await h.tick()
    assert h.slurm.cancels == [jid] and h.slurm.signals == [(jid, "TERM")]
    await h.tick(31, advance_s=1)
    assert h.slurm.cancels == [jid, jid] and h.slurm.signals == [(jid, "TERM")]   # then the plain one
    gone = Harness(daemon={"rescancel_after_s": 30}, nodes=2)   # the job's nodes decide, not the config now: a
    await gone.tick(2, advance_s=1)                             # reload that removes the model drains its jobs
    jid = gone.newest()
    gone.rec.apply_config(fleet_cfg(daemon={"rescancel_after_s": 30}, replicas=1))   # (one node now)
    await gone.tick(20, advance_s=1)
    assert (jid, "TERM") in gone.slurm.signals, gone.slurm.cancels
    pending = Harness(nodes=2)   # a PENDING one: the plain scancel (slurmctld refuses a signal to it: rc 228)
    pending.slurm.start_state = "PENDING"
    await pending.tick(2, advance_s=1)
    await pending.rec.request_drain(pending.newest())
    await pending.tick()
    assert pending.slurm.cancels and pending.slurm.signals == []
    one = Harness()   # one node: the plain scancel (the batch shell and the node script both take the TERM)
    await one.tick(2, advance_s=1)
    first = one.newest()
    await one.rec.request_drain(first)
    await one.tick()
    assert one.slurm.cancels == [first] and one.slurm.signals == []


async def test_probes_go_on_while_slurm_cannot_be_read_and_a_dead_engine_leaves_routing():
    h = Harness(replicas=2, probe={"interval_s": 1, "failure_threshold": 3})
    await h.tick(2, advance_s=1)
    a, b = sorted(h.ready())
    h.slurm.listing_fails = 10  # slurmctld down for 10 ticks
    h.down.add(a)               # ...and meanwhile a's engine dies
    await h.tick(2, advance_s=1)
    assert h.ready() == {a, b}  # two failed probes: not yet
    await h.tick(advance_s=1)
    assert h.ready() == {b} and h.sbatches == 2  # withdrawn at the third; nothing submitted blind
    await h.tick(7, advance_s=1)
    assert h.sbatches == 2 and h.rec.last_tick_error
    await h.tick(advance_s=1)  # SLURM answers again: now a is cancelled, and replaced after a back-off (READY 2 s)
    assert h.sbatches == 2 and h.slurm.cancels == [a] and h.rec.runtime("m").crashes == 1
    assert 7 <= await h.run_until(lambda: h.sbatches == 3, step=1, limit=20) <= 14 and h.slurm.cancels == [a]


async def test_a_job_ending_on_its_own_is_awaited_before_its_replacement():
    """COMPLETING (not cancelled by the daemon) is no free slot yet: only the final state says whether the job
    crashed, and a crash must back off before the next submission."""
    h = Harness(backoff={"base_s": 10, "early_failure_s": 100})
    h.warmup_s = 1000  # never READY: every end is an early failure
    await h.tick(advance_s=1)
    first = h.newest()
    h.slurm.set(first, state="COMPLETING", end_time=h.now)  # the engine died; SLURM is cleaning up
    await h.tick(3, advance_s=1)
    assert h.sbatches == 1  # no replacement while the job is still ending
    h.slurm.end(first, "FAILED")
    await h.tick(advance_s=1)
    assert h.rec.runtime("m").crashes == 1 and h.sbatches == 1  # now it is a crash: back off first
    waited = await h.run_until(lambda: h.sbatches == 2, step=0.5)
    assert 7 <= waited <= 13


async def test_scans_that_miss_the_records_cancel_nothing_while_the_engines_answer():
    """The endpoint folder unreadable for a few scans (a shared file system's blip): the replicas that served
    keep their endpoints, since their probes still pass (one such scan made every READY replica UNHEALTHY,
    past its startup timeout, and cancelled it); an engine that really died is still found by its probes."""
    h = Harness(replicas=2, probe={"interval_s": 1, "startup_timeout_s": 900})
    await h.tick(2, advance_s=1)
    ready = h.ready()
    await h.tick(advance_s=1000)                  # served longer than the startup timeout
    real = h.scan

    async def blind() -> Discovered:
        return Discovered({}, frozenset())
    h.scan = blind
    await h.tick(3, advance_s=1)
    assert h.slurm.cancels == [] and h.ready() == ready and h.sbatches == 2
    h.scan = real
    h.down.add(max(ready))
    h.slurm.on_cancel = lambda jid: None          # (an UNHEALTHY replica is cancelled in the tick it leaves routing)
    await h.tick(4, advance_s=1)
    assert h.slurm.cancels == [max(ready)]


async def test_a_restarted_daemon_keeps_an_adopted_replica_through_a_slow_probe_not_a_dead_one():
    """After a restart every job is adopted unproven (no probe has passed under this daemon), though it
    started hours ago: one failed probe made it UNHEALTHY at once (past the startup timeout), cancelled and
    counted as a crash on its node.  Now it has the startup time from its adoption; one that never answers
    goes when that has passed (not routed meanwhile)."""
    h = Harness(replicas=2, probe={"interval_s": 1, "failure_threshold": 3, "startup_timeout_s": 900})
    await h.tick(2, advance_s=1)
    a, b = sorted(h.ready())
    await h.tick(advance_s=3600)
    h.rec = Reconciler(h.rec.cfg, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       on_update=h.on_update, rng=random.Random(0))
    h.down |= {a, b}                              # a: one slow probe; b: dead
    await h.tick(advance_s=1)
    h.down.discard(a)
    await h.tick(advance_s=1)
    assert h.slurm.cancels == [] and h.ready() == {a}
    await h.tick(advance_s=800)
    assert h.slurm.cancels == [] and h.ready() == {a}
    await h.tick(advance_s=200)
    assert h.slurm.cancels == [b]


async def test_staggered_slots_never_get_a_limit_their_handover_lead_eats():
    """A 1 h limit staggered by 25 min a slot with a 10 min handover lead: slot 2's limit was 60 s (the
    floor), inside the lead from its start, so every successor was replaced at once (64 sbatch in 10
    minutes).  The stagger wraps within half the limit and the lead is at most a quarter of it."""
    h = Harness(replicas=3, time_limit="1:00:00", drain={"handover_lead_s": 600, "stagger_s": 1500})
    await h.tick(2, advance_s=1)
    limits = sorted(h.slurm.jobs[j].time_limit_s for j in h.rec.replicas)
    assert limits == [2100, 2400, 3600]           # 3600 - (slot x 1500 mod 1800)
    await h.tick(60, advance_s=10)
    assert h.sbatches == 3 and h.slurm.cancels == []


async def test_a_job_slurm_held_after_a_failed_launch_is_replaced_with_back_off():
    """SLURM requeues a job whose launch failed (a prolog, a broken node) and holds it: it never starts on its
    own, and it kept its slot for ever (3 h here, nothing served).  It is cancelled and replaced now, and a
    launch that keeps failing backs off as crashes do."""
    h = Harness(replicas=1, backoff={"base_s": 10, "max_s": 400})
    h.slurm.on_cancel = lambda jid: None          # (an UNHEALTHY replica is cancelled in the tick it leaves routing)
    await h.tick(2, advance_s=1)
    first = h.newest()
    h.slurm.set(first, state="PENDING", reason="launch failed requeued held", nodelist="", restart_count=1)
    await h.tick(advance_s=1)
    assert h.slurm.cancels == [first]
    await h.run_until(lambda: h.sbatches == 2 and h.newest() in h.ready(), step=1)
    gaps = []
    for _ in range(3):                            # every launch fails: the waits grow
        jid = h.newest()
        h.slurm.set(jid, state="PENDING", reason="launch failed requeued held", nodelist="", restart_count=1)
        n = h.sbatches
        gaps.append(await h.run_until(lambda: h.sbatches > n, step=1))
    assert gaps[0] < gaps[-1] and h.rec.runtime("m").crashes >= 3, gaps


async def test_the_crash_back_off_grows_while_another_replica_serves():
    """One replica serves throughout while its sibling's successors crash at start: the back-off still grows
    (it was reset every tick because some replica of the model had been READY for early_failure_s, so the
    crashing slot was resubmitted every base_s for ever), and it resets once a successor has served."""
    h = Harness(replicas=2, backoff={"base_s": 10, "max_s": 400, "early_failure_s": 100})
    await h.tick(2, advance_s=1)
    await h.tick(advance_s=200)
    keep = min(h.rec.replicas, key=int)

    class AllBut(set):
        def __contains__(self, jid) -> bool:
            return jid != keep
    h.down = AllBut()
    h.slurm.on_cancel = lambda jid: None
    h.slurm.end(h.newest(), "FAILED")
    waits = []
    for _ in range(4):
        n = h.sbatches
        await h.tick(advance_s=1)
        waits.append(await h.run_until(lambda: h.sbatches > n, 0.5))
        h.slurm.end(h.newest(), "FAILED")
    assert waits[1] >= 7 and waits[-1] > 2.5 * waits[1] and h.rec.runtime("m").crashes >= 3, waits   # 10, 20, 40 s (jitter)
    h.down = set()
    n = h.sbatches
    await h.run_until(lambda: h.sbatches > n, 1)
    await h.tick(110, advance_s=1)                # the successor serves past early_failure_s
    assert h.rec.runtime("m").crashes == 0


async def test_a_restarted_daemon_does_not_count_an_old_requeue_again():
    """A job SLURM requeued once (restart count 1) is adopted by a new daemon: no node loss is counted again
    (each restart of the daemon added one to restarts{node_lost} for every job ever requeued), and it serves."""
    h = Harness()
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.set(jid, restart_count=1)
    await h.tick(2, advance_s=1)
    assert h.rec.metrics.restarts.labels("m", "node_lost")._value.get() == 1
    await h.tick(advance_s=3600)
    h.rec = Reconciler(h.rec.cfg, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       on_update=h.on_update, rng=random.Random(0))
    await h.tick(2, advance_s=1)
    assert h.rec.metrics.restarts.labels("m", "node_lost")._value.get() == 0 and h.ready() == {jid}
    # nor are its pending time and its start-up (an hour of serving, before this daemon) observed again
    m = h.rec.metrics
    assert [sum(b.get() for b in hist.labels("m")._buckets) for hist in (m.pending_seconds, m.startup_seconds)] == [0, 0]


async def test_a_job_requeued_held_after_a_special_exit_is_replaced_counted_once_and_not_as_a_lost_node():
    """(RequeueExitHold: SLURM requeues the job held, SPECIAL_EXIT): one restart, unhealthy, and the job leaves
    routing before its scancel (the harness checks every scancel); it was also counted a node lost (and logged
    so), two restarts for one exit, and cancelled while the gateway still routed to it."""
    h = Harness()
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.set(jid, state="SPECIAL_EXIT", restart_count=1, reason="JobHeldAdmin")
    await h.tick(2, advance_s=1)
    restarts = h.rec.metrics.restarts
    assert restarts.labels("m", "node_lost")._value.get() == 0 and restarts.labels("m", "unhealthy")._value.get() == 1
    assert jid in h.slurm.cancels
    await h.run_until(lambda: h.newest() != jid, step=1, limit=20)   # (after a back-off: it served 2 s)


async def test_a_requeued_jobs_stale_time_limit_mark_is_not_taken_for_its_new_run():
    """SLURM's time-limit warning left a mark, then the node was lost and the job requeued: while it waits,
    the old mark (its new run removes it at start) must not latch the warning again, or the new run would be
    handed over as soon as it is READY."""
    h = Harness(replicas=1, time_limit="1:00:00", drain={"handover_lead_s": 300})
    h.slurm.on_cancel = lambda jid: None
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.set(jid, state="PENDING", reason="BeginTime", nodelist="", restart_count=1)
    h.draining.add(jid)                           # the mark the lost run left (its USR1 came just before)
    await h.tick(2, advance_s=1)
    assert not h.rec.replicas[jid].time_limit_warned and h.sbatches == 1
    h.slurm.set(jid, state="RUNNING", reason=None, nodelist="node2", start_time=h.now)
    h.draining.discard(jid)                       # the new run removed it
    await h.tick(3, advance_s=1)
    assert jid in h.ready() and not h.rec.replicas[jid].time_limit_warned and h.sbatches == 1


async def test_a_time_limit_mark_counts_for_the_run_that_wrote_it_only():
    """Each run names its mark <jobid>.<restart>.draining: a requeued job's new run, RUNNING while the mark of the
    run before is still there (its clean-up not done, a shared file system's lag), is not handed over for it."""
    h = Harness(replicas=1, time_limit="1:00:00", drain={"handover_lead_s": 300})
    await h.tick(2, advance_s=1)
    jid = h.newest()
    h.slurm.set(jid, state="RUNNING", restart_count=1, start_time=h.now)   # requeued, running again
    h.draining.add(f"{jid}.0")                    # the mark of run 0
    await h.tick(3, advance_s=1)
    assert jid in h.ready() and not h.rec.replicas[jid].time_limit_warned and h.sbatches == 1
    h.draining.add(f"{jid}.1")                    # this run's own warning
    await h.tick(advance_s=1)
    assert h.rec.replicas[jid].time_limit_warned


async def test_a_replica_that_never_came_up_counts_one_crash_though_its_scancel_fails_a_few_times():
    """An UNHEALTHY replica whose scancel fails is cancelled again each tick: it was counted as a crash (and a
    failure of its node) each time, so one bad start could exclude the node and stretch the back-off."""
    h = Harness(probe={"interval_s": 1, "startup_timeout_s": 30}, backoff={"base_s": 10, "max_s": 600})
    h.slurm.on_cancel = lambda jid: None
    await h.tick()
    job = h.newest()
    h.down.add(job)                                # never answers
    h.slurm.cancel_errors = [SlurmError("scancel", "Socket timed out", transient=True)] * 3
    await h.tick(35, advance_s=1)                  # past its startup timeout, then three failed scancels
    assert h.slurm.cancels == [job]
    rt = h.rec.runtime("m")
    assert rt.crashes == 1 and len(rt.node_failures["node1"]) == 1


async def test_a_job_that_comes_back_after_it_ended_is_adopted_and_cancelled_as_surplus():
    """A replica's job ended (NODE_FAIL) and was replaced; an admin's requeue brings it back RUNNING. It was
    never looked at again (the daemon had it as finished): it held its node until its time limit."""
    h = Harness(probe={"interval_s": 1})
    await h.tick(2, advance_s=1)
    old = h.newest()
    h.slurm.end(old, "NODE_FAIL")
    await h.tick(3, advance_s=1)
    new = h.newest()
    assert new != old and h.ready() == {new}
    h.slurm.set(old, state="RUNNING", end_time=None, restart_count=1)
    await h.tick(advance_s=1)
    assert old in h.rec.replicas
    h.slurm.on_cancel = lambda jid: None
    await h.run_until(lambda: old in h.slurm.cancels, step=1, limit=400)
    assert new not in h.slurm.cancels and h.ready() == {new}


async def test_a_reload_while_an_sbatch_waits_submits_the_other_models_from_the_new_config():
    """The tick went on with the models of the config it started with: a reload that landed while one
    model's sbatch waited had the next model's job submitted from the old config (rolled at the next tick)."""
    doc = {"fleet": "f", "state_dir": "/nonexistent/sf", "models": [
        {"name": n, "engine": "simulator", "replicas": 1, "container": {"enabled": False}} for n in ("a", "m")]}
    h = Harness(probe={"interval_s": 1})
    h.rec.apply_config(load_config_text(yaml.safe_dump(doc), "f.yaml", {}))
    doc["models"][1]["simulator"] = {"ttft_s": 0.5}
    new = load_config_text(yaml.safe_dump(doc), "f.yaml", {})
    submit = h.slurm.submit

    async def reload_during_a(script: str) -> str:
        if JobTag.decode(sbatch_option(script, "comment")).model == "a":
            h.rec.apply_config(new)
        return await submit(script)
    h.slurm.submit = reload_during_a
    await h.tick()
    tags = [JobTag.decode(sbatch_option(s, "comment")) for s in h.slurm.scripts]
    assert [t.model for t in tags] == ["a", "m"]
    assert tags[1].config_hash == new.model("m").job_hash()


async def test_a_fleet_of_the_same_name_kept_in_another_state_dir_neither_adopts_nor_cancels_its_jobs():
    """A staging copy of the config (same ``fleet:`` name, another state dir) run by the same user adopted the
    production daemon's jobs, and drained and cancelled those of models its copy lacks.  The tag now carries a
    digest of the state dir; a job tagged before it did belongs to the fleet of its name."""
    h = Harness(replicas=2)
    await h.tick(2, advance_s=1)
    prod = set(h.rec.replicas)
    assert all(JobTag.decode(h.slurm.jobs[j].comment).state == state_tag("/nonexistent/sf") for j in prod)
    staging = h.rec.cfg.model_copy(update={"state_dir": "/elsewhere/sf"})
    h.rec = Reconciler(staging, h.slurm, Renderer(), h, h, Metrics(), clock=lambda: h.now, mono=lambda: h.now,
                       on_update=h.on_update, rng=random.Random(0))
    await h.tick(4, advance_s=1)
    assert h.slurm.cancels == [] and not prod & set(h.rec.replicas) and len(h.rec.replicas) == 2
    assert state_tag("/nonexistent/sf/") == state_tag("/nonexistent//sf") == state_tag("/nonexistent/sf")
    old = JobTag.decode("slurmfleet:v1;fleet=f;model=m;slot=0;hash=abc;nonce=n")
    assert old.owned_by("f", "/nonexistent/sf") and old.owned_by("f", "/elsewhere/sf") and not old.owned_by("g", "/x")


async def test_a_replica_that_fails_only_its_deep_probe_is_replaced():
    """A multi-node replica whose head answers /health while a worker hangs: only the deep probe (a 1-token
    completion) fails, and the plain probes between deep ones reset the failure count, so it stayed READY and
    routed for ever.  A failed deep probe is tried again at the next probe until it passes or the threshold is
    reached.  And a probe that raises what no engine should make it raise ({"data": null}) fails that probe, not
    every tick of the fleet."""
    from orchestrator.fleet.probe import ProbeResult
    h = Harness(probe={"interval_s": 5, "deep_interval_s": 30, "failure_threshold": 3})
    h.slurm.on_cancel = lambda jid: None
    await h.tick(2, advance_s=1)
    jid = h.newest()
    assert jid in h.ready()
    plain = h.probe

    async def probe(ep, served_name, timeout_s, deep=False, deep_timeout_s=10.0):
        if ep.job_id == jid and deep:
            return ProbeResult(False, "probe timed out (deep)")
        return await plain(ep, served_name, timeout_s, deep, deep_timeout_s)
    h.probe = probe
    await h.tick(30, advance_s=5)
    assert jid in h.slurm.cancels

    async def broken(ep, served_name, timeout_s, deep=False, deep_timeout_s=10.0):
        raise TypeError("'NoneType' object is not iterable")
    h.probe = broken
    await h.tick(advance_s=5)          # no exception out of the tick
    assert any("TypeError" in (f.last_probe_error or "") for f in h.rec.replicas.values())


async def test_a_replica_slurm_suspends_is_replaced_without_counting_a_crash():
    """Preemption in suspend mode (or an admin's scontrol suspend) stops a replica: it is replaced, but it did not
    crash: no back-off, and its node is not counted a bad one (as a PREEMPTED job is not)."""
    h = Harness(backoff={"base_s": 60, "max_s": 600})
    h.slurm.on_cancel = lambda jid: None
    h.warmup_s = 600.0                 # suspended while its engine loads (its node not yet proven either)
    await h.tick(2, advance_s=1)
    jid = h.newest()
    assert jid not in h.ready()
    h.slurm.set(jid, state="SUSPENDED")
    await h.tick(advance_s=1)
    assert jid in h.slurm.cancels
    rt = h.rec.runtime("m")
    assert rt.crashes == 0 and not rt.node_failures
    await h.tick(3, advance_s=1)
    assert h.sbatches == 2             # its successor at once, not after a back-off


async def test_nodes_excluded_after_failures_never_block_the_model():
    """Two lost runs of a 2-node job excluded both its nodes; when they were all the partition had, sbatch
    refused the job (not transient: 'Requested node configuration is not available') and the model was blocked
    until a reload, though the exclusions expire.  A refusal while nodes are excluded submits again without."""
    h = Harness(replicas=1)
    await h.tick(2, advance_s=1)
    h.slurm.on_cancel = lambda jid: None
    rt = h.rec.runtime("m")
    rt.excluded["node1"] = h.now + 1800
    h.slurm.end(h.newest(), "FAILED")
    h.slurm.submit_errors = [SlurmError("sbatch", "Requested node configuration is not available", transient=False)]
    await h.tick(3, advance_s=20)
    assert rt.blocked is None and not rt.excluded
    assert "#SBATCH --exclude" in h.slurm.scripts[-2] and "#SBATCH --exclude" not in h.slurm.scripts[-1]
    await h.tick(2, advance_s=1)
    assert h.newest() in h.ready()


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
async def test_a_step_of_the_wall_clock_keeps_the_daemons_timers(step_s):
    """NTP steps the wall clock (or a VM resumes): the probes go on every interval (back an hour, no replica was
    probed again for an hour: a dead engine stayed routed), and a drain waits its timeout (ahead an hour, it
    timed out at once and cancelled requests in flight), both on the monotonic clock's lengths."""
    h = Harness(replicas=3, drain={"timeout_s": 60})
    mono = [0.0]
    h.rec.mono = lambda: mono[0]

    async def tick(n: int = 1) -> None:
        for _ in range(n):
            h.now, mono[0] = h.now + 1, mono[0] + 1
            await h.rec.tick()
    await tick(2)
    h.busy = dict.fromkeys(h.ready(), 1)
    h.rec.scale("m", 1)
    await tick()
    [a] = h.ready()
    drained = set(h.busy) - {a}
    assert len(drained) == 2 and all(h.rec.replicas[j].drain_requested_at is not None for j in drained)  # (busy)
    h.now += step_s
    h.down.add(a)
    await tick(4)
    assert a in h.slurm.cancels   # probed and withdrawn (3 failures)
    [back] = h.ready()            # one of the scale-down's drains serves again (the model wants one)
    [b] = drained - {back}
    assert b not in h.slurm.cancels   # the other's drain has 56 s to go
    await tick(60)
    assert b in h.slurm.cancels


async def test_a_time_limit_successor_is_submitted_through_another_slots_crash_back_off():
    """Back-off is per model: while slot 1 crash-looped (a back-off of up to backoff.max_s, 600 s by default,
    as long as the default handover lead), slot 0's successor before its time limit waited for it, and slot 0
    could reach its limit with no successor READY.  A time-limit successor goes at once; slot 1 still waits."""
    h = Harness(replicas=2, time_limit="0:20:00", drain={"handover_lead_s": 300, "stagger_s": 0},
                backoff={"base_s": 2000, "max_s": 4000, "early_failure_s": 100})
    await h.tick(2, advance_s=1)
    keep = min(h.rec.replicas, key=int)

    class AllBut(set):
        def __contains__(self, jid) -> bool:
            return jid != keep
    h.down = AllBut()                           # every job but slot 0's first dies at start
    h.slurm.end(max(h.rec.replicas, key=int), "FAILED")
    await h.tick(2, advance_s=1)
    rt = h.rec.runtime("m")
    assert rt.crashes == 1 and rt.backoff_until > h.now + 1400
    await h.tick(advance_s=h.slurm.jobs[keep].start_time + 1200 - 300 - h.now + 1)   # slot 0 inside its lead
    assert h.now < rt.backoff_until
    new = [j for j in h.rec.replicas if h.rec.replicas[j].slot == 0 and j != keep]
    assert len(new) == 1, h.rec.replicas    # its successor went at once, through the back-off
    assert not any(f.slot == 1 for f in h.rec.replicas.values())   # the crashing slot still waits


async def test_a_rejection_of_an_sbatch_a_reload_overtook_does_not_block_the_new_config():
    """A reload while a bad config's sbatch was running cleared the block, then that sbatch's rejection came
    back and blocked the corrected config until yet another reload."""
    h = Harness(replicas=1)
    gate = asyncio.Event()
    submit = h.slurm.submit

    async def slow_rejection(script: str) -> str:
        h.slurm.submit = submit
        await gate.wait()
        raise SlurmError("sbatch", "Invalid partition name specified", transient=False)
    h.slurm.submit = slow_rejection
    tick = asyncio.create_task(h.tick())
    await asyncio.sleep(0.05)                   # the sbatch is out
    h.rec.apply_config(fleet_cfg(replicas=1, partition="gpu"))   # the fix lands meanwhile
    gate.set()
    await tick
    assert h.rec.runtime("m").blocked is None
    await h.tick()
    assert h.rec.replicas and "--partition=gpu" in h.slurm.scripts[-1]


async def test_a_time_limit_successor_backs_off_from_its_own_crash_loop_and_a_job_count_limit():
    """The successor's bypass is only through another slot's crash loop: a successor that dies at start was
    submitted again every tick for the whole lead, and one refused for the user's job count every tick."""
    h = Harness(replicas=1, time_limit="0:20:00", drain={"handover_lead_s": 300, "stagger_s": 0},
                backoff={"base_s": 2000, "max_s": 4000, "early_failure_s": 100})
    await h.tick(2, advance_s=1)
    keep = h.newest()
    await h.tick(advance_s=h.slurm.jobs[keep].start_time + 1200 - 300 - h.now + 1)
    for _ in range(6):
        for j in [j for j in h.rec.replicas if j != keep and h.slurm.jobs[j].state != "FAILED"]:
            h.slurm.end(j, "FAILED")   # the successor dies at start
        await h.tick(advance_s=5)
    assert h.sbatches == 2 and h.rec.runtime("m").crashes == 1   # the first successor, then the back-off

    h = Harness(replicas=1, time_limit="0:20:00", drain={"handover_lead_s": 300, "stagger_s": 0})
    await h.tick(2, advance_s=1)
    keep = h.newest()
    calls = []

    async def limited(script: str) -> str:
        calls.append(h.now)
        raise SlurmError("sbatch", "Batch job submission failed: Job violates accounting/QOS policy (job submit "
                         "limit, user's size and/or time limits)", transient=False)
    h.slurm.submit = limited
    await h.tick(advance_s=h.slurm.jobs[keep].start_time + 1200 - 300 - h.now + 1)
    await h.tick(10, advance_s=5)
    assert len(calls) == 1



async def test_an_early_failure_says_how_its_log_ends_and_a_reload_forgets_the_bad_config(tmp_path):
    """A config mistake (a mistyped vllm_args flag) crash-looped with 'job N failed 7s after start', the cause only
    in the job's log; its failures excluded node after node, and the fixed config's jobs still excluded them
    and showed the old message."""
    from pathlib import Path

    from orchestrator.observability.status import fleet_status, render_table
    from reconciler_harness import fleet_cfg
    backoff = {"node_failure_threshold": 1, "node_exclude_s": 1800}
    h = Harness(backoff=backoff)
    h.rec.cfg = h.rec.cfg.model_copy(update={"state_dir": str(tmp_path)})
    h.warmup_s = 1000.0   # never READY
    h.slurm.node = "gpu7"
    await h.tick(advance_s=1)
    job = h.newest()
    log = Path(tmp_path) / "logs" / f"m-{job}.log"
    log.parent.mkdir()
    log.write_text("INFO starting the engine\nvllm: error: unrecognized arguments: --max-model-lenn 1024\n\n")
    h.slurm.end(job, "FAILED")
    await h.tick(advance_s=1)
    rt = h.rec.runtime("m")
    assert rt.last_error.startswith(f"job {job} failed") and "its log" not in rt.last_error   # (a client's 503 has it)
    assert rt.last_log == str(log) and "gpu7" in rt.excluded and rt.crashes == 1
    # `slurmfleet status` (the CLI, on the daemon's host) shows how the log ends
    table = render_table(fleet_status(h.rec, now=h.now))   # (its problem column wraps: word by word)
    assert all(w in table for w in ("ends:", "unrecognized", "--max-model-lenn")), table
    fixed = fleet_cfg(backoff=backoff, simulator={"ttft_s": 0.2}).model_copy(update={"state_dir": str(tmp_path)})
    h.rec.apply_config(fixed)   # a new job shape
    assert rt.last_error is None and rt.last_log is None and not rt.excluded and not rt.node_failures and not rt.crashes
    await h.tick(advance_s=1)
    assert sbatch_option(h.slurm.scripts[-1], "exclude") is None


def test_the_back_off_never_passes_max_s_whatever_its_jitter():
    """The +-25% jitter came after the cap: max_s 20 said 'next submission in 23s' (up to 750 s at the default
    600 s; found by a soak)."""
    import random as _random

    from orchestrator.config import BackoffConfig
    from orchestrator.fleet.replica import ModelRuntime, ReplicaFacts

    class Highest(_random.Random):
        def uniform(self, a, b):
            return b
    b = BackoffConfig(base_s=10, max_s=20, early_failure_s=300)
    rt = ModelRuntime()
    for n in range(1, 5):
        f = ReplicaFacts(job_id=str(n), model="m", slot=0, config_hash="h", slurm_state="FAILED", start_time=100.0,
                         end_time=101.0)
        rt.count_crash(f, 101.0, "failed", b, Highest())
        assert rt.backoff_until - 101.0 == min(20, 10 * 2 ** (n - 1) * 1.25), n
    assert "next submission in 20s" in rt.last_error


async def test_jobs_that_ended_while_no_daemon_watched_are_said_counted_and_named_by_their_replacements(tmp_path,
                                                                                                       caplog):
    """A daemon started again knew nothing of the jobs that ended while none ran: it filled their slots as new
    ones, with no log line, no restart counted and no reason.  The jobs followed are now kept in nodes.json."""
    import logging
    caplog.set_level(logging.INFO)
    path = tmp_path / "nodes.json"
    h = Harness(node_memory=NodeMemory(path), replicas=4)
    await h.tick(2, advance_s=1)
    a, b, c, d = sorted(h.rec.replicas, key=int)
    slots = {jid: f.slot for jid, f in h.rec.replicas.items()}
    await h.rec.nodes.synced()
    assert json.loads(path.read_text())["m"]["jobs"] == slots
    # the daemon is killed; meanwhile a fails, b's node is lost and squeue forgets b, c was being cancelled by
    # that daemon (its mark), d runs on
    h.slurm.end(a, "FAILED")
    h.slurm.end(b, "NODE_FAIL")
    del h.slurm.jobs[b]
    h.cancelled.add(c)
    h.slurm.end(c, "CANCELLED")
    h.restart(nodes=NodeMemory(path))
    await h.tick(advance_s=30)
    restarts = h.rec.metrics.restarts
    assert [restarts.labels("m", r)._value.get() for r in ("failed", "unknown", "cancelled", "node_lost")] == [1, 1, 0, 0]
    said = sorted(r.getMessage() for r in caplog.records if "while no daemon watched it" in r.getMessage())
    assert said == sorted([f"job {a} (m slot {slots[a]}) ended while no daemon watched it (squeue: FAILED): replacing it",
                           f"job {b} (m slot {slots[b]}) ended while no daemon watched it (squeue no longer lists "
                           "it): replacing it"]), said
    subs = {int(m.group(1)): m.group(2) for r in caplog.records
            if (m := re.match(r"submitted job \d+ for m slot (\d) \((.*)\)$", r.getMessage()))}
    assert subs[slots[a]] == f"replaces job {a}, failed, ended while no daemon watched"
    assert subs[slots[b]] == f"replaces job {b}, unknown, ended while no daemon watched"
    assert subs[slots[c]] == "scale_up" and d in h.rec.replicas and len(h.rec.replicas) == 4
    await h.rec.nodes.synced()
    assert set(json.loads(path.read_text())["m"]["jobs"]) == set(h.rec.replicas)
    h.restart(nodes=NodeMemory(path))   # the next start: nothing ended meanwhile, nothing said
    caplog.clear()
    await h.tick(advance_s=1)
    assert not [r for r in caplog.records if "no daemon watched" in r.getMessage()]


async def test_a_slots_ready_gauge_is_0_until_its_replica_serves_and_gone_once_it_is_scaled_away():
    """``slurmfleet_replica_ready`` per slot: 0 while the slot's replica is pending, starting or unhealthy (a
    slot had no series then, so ``== 0`` never fired and a sum went absent, not 0), 1 once READY; a slot scaled
    away has none."""
    h = Harness(replicas=2)
    h.warmup_s = 10.0
    await h.tick()

    def ready(slot: int) -> float | None:
        return h.rec.metrics.registry.get_sample_value("slurmfleet_replica_ready", {"model": "m", "slot": str(slot)})

    assert (ready(0), ready(1)) == (0.0, 0.0)   # queued
    a, b = sorted(h.rec.replicas, key=int)
    h.slurm.set(a, state="RUNNING")
    h.slurm.set(b, state="RUNNING")
    await h.tick(advance_s=1)
    assert (ready(0), ready(1)) == (0.0, 0.0)   # starting
    await h.run_until(lambda: ready(0) == 1.0 and ready(1) == 1.0, step=1)
    h.down.add(b)
    await h.run_until(lambda: ready(1) == 0.0, step=1)   # unhealthy: its slot waits for its replacement
    assert ready(0) == 1.0
    h.rec.scale("m", 1)
    await h.run_until(lambda: ready(1) is None, step=1)
    assert ready(0) == 1.0


async def test_a_slow_slurmctld_spreads_a_ticks_sbatches_over_ticks_and_the_probes_go_on():
    """slurmctld answering each sbatch in 4 s (within the timeout) while 6 replicas are asked for: the tick made
    them one after another, 24 s with no probe, no table published, no drain (a READY replica whose engine died
    stayed routed). A tick's sbatches stop after two ticks' time now; the next tick makes the rest. From a review."""
    h = Harness(replicas=6)
    submit = h.slurm.submit

    async def slow(script):
        h.now += 4.0   # (the fake clock: what the sbatch took)
        return await submit(script)
    h.slurm.submit = slow
    await h.tick()
    first = h.sbatches
    assert 2 <= first <= 3, first   # (5 s ticks: up to 10 s of sbatches)
    await h.tick(advance_s=5)
    assert h.sbatches >= min(6, 2 * first), h.sbatches
    await h.run_until(lambda: h.sbatches == 6, step=5, limit=60)
