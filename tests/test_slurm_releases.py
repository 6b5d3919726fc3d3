"""Slurm 22.05 (Debian 12) and 24.11 (Debian 13), side by side, on real captures of the same scenarios.

``tests/data/slurm-captures/<release>/`` holds what both releases really printed (see the README there):
every squeue row must parse with a known state, the differences between the releases must come out as
measured, and the reconciler must take the same decision on both where the situation is the same: a drained
or DOWN node is transient, a request for more nodes than exist blocks the model (22.05 leaves it PENDING with
``PartitionNodeLimit``, 24.11 rejects the sbatch at once), a requeue is a lost node, not a failure, and a
requeued job's 365-day limit (24.11's stand-in for "no limit") starts no early handover.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from orchestrator.fleet.render import JobTag
from orchestrator.fleet.replica import (QUEUED_SLURM, STOPPING_SLURM, TERMINAL_SLURM, Policy, ReplicaFacts, State,
                                        derive_state, fatal_pending)
from orchestrator.fleet.slurm import CliSlurm, JobInfo, SlurmError, classify, parse_squeue
from reconciler_harness import Harness, fleet_cfg

CAPTURES = Path(__file__).parent / "data" / "slurm-captures"
RELEASES = ("22.05", "24.11")
FLEET = {"22.05": "cap22", "24.11": "cap24"}
KNOWN_STATES = TERMINAL_SLURM | QUEUED_SLURM | STOPPING_SLURM | {"RUNNING"}
YEAR_S = 365 * 86400
DRAINED = {"22.05": "ReqNodeNotAvail, UnavailableNodes:node4",   # the drained node named
           "24.11": "ReqNodeNotAvail, May be reserved for other job"}
DOWN = "ReqNodeNotAvail, UnavailableNodes:node2"                # a DOWN node is named on both
NOT_ENOUGH_NODES = "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions"


# -- reading the captures ---------------------------------------------------------------------------------------

def squeue_files(release: str) -> list[Path]:
    files = sorted((CAPTURES / release).glob("squeue-*.txt"))
    assert len(files) == 10, files
    return files


def jobs(release: str, name: str) -> dict[str, JobInfo]:
    return {j.job_id: j for j in parse_squeue((CAPTURES / release / name).read_text())}


def row(release: str, name: str, model: str, slot: int = 0) -> JobInfo:
    """The row of a scenario (the model name its job carried) in one capture."""
    found = [j for j in jobs(release, name).values()
             if (t := JobTag.decode(j.comment)) and (t.model, t.slot) == (model, slot)]
    assert len(found) == 1, (release, name, model, found)
    return found[0]


def job_ids(release: str) -> dict[str, str]:
    """Scenario number -> job id (``J20=11``), from jobids-phase*.txt."""
    out = {}
    for f in sorted((CAPTURES / release).glob("jobids-*.txt")):
        out.update(w.split("=", 1) for w in f.read_text().split())
    return out


def stderr(release: str, name: str) -> str:
    """A captured stderr without the capture's own notes (``rc=...`` lines, ``#`` comments)."""
    lines = (CAPTURES / release / f"{name}.stderr").read_text().splitlines()
    return "\n".join(ln for ln in lines if not ln.startswith(("rc=", "#"))).strip()


def scontrol(release: str, name: str) -> dict[str, str]:
    """``scontrol show job`` as key -> value (values hold no spaces there; Comment's trailing one is cut)."""
    text = (CAPTURES / release / name).read_text()
    return dict(m.groups() for m in re.finditer(r"(\S+?)=(\S*)", text))


def squeue_json_jobs(release: str) -> dict[int, dict]:
    text = (CAPTURES / release / "squeue-json-filtered.json").read_text()
    doc, _ = json.JSONDecoder().raw_decode(text)  # the capture appends its own "rc=0" line
    return {j["job_id"]: j for j in doc["jobs"]}


# -- the parser on both sets ------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_every_captured_squeue_row_parses_with_a_known_state(release):
    rows = 0
    for f in squeue_files(release):
        lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
        parsed = parse_squeue(f.read_text())
        assert len(parsed) == len(lines), f.name
        for j, line in zip(parsed, lines):
            rows += 1
            assert j.job_id == line.split("|", 1)[0] and j.job_id.isdigit()
            assert j.state in KNOWN_STATES, (f.name, line)
            assert j.name == f"slurmfleet-{FLEET[release]}"
            tag = JobTag.decode(j.comment)
            assert tag is not None and tag.fleet == FLEET[release], (f.name, line)
            assert j.submit_time is not None and j.submit_time > 1.7e9, (f.name, line)
            assert j.time_limit_s is None or j.time_limit_s >= 60
            if j.state == "RUNNING":
                assert j.nodelist and j.batch_host and j.start_time and j.start_time >= j.submit_time
            if j.state == "PENDING":
                assert j.nodelist == "" and j.batch_host is None and j.reason
            if j.end_time is not None and j.start_time is not None:
                assert j.end_time >= j.start_time
            facts = ReplicaFacts(j.job_id, "m", 0, "h", slurm_state=j.state, reason=j.reason, start_time=j.start_time,
                                 time_limit_s=j.time_limit_s, nodelist=j.nodelist, restart_count=j.restart_count)
            expected = {"RUNNING": State.STARTING, "PENDING": State.QUEUED}.get(j.state, State.FAILED)
            assert derive_state(facts, j.start_time or j.submit_time, Policy()) == expected, (f.name, line)
    assert rows == 159  # the same scenarios, phase by phase, on both releases


@pytest.mark.parametrize("release", RELEASES)
def test_requeued_job_pending_again_has_no_nodes_an_end_time_of_start_plus_limit_and_a_new_submit_time(release):
    """Scenario J23 (a --requeue job whose node went DOWN), before and after: the same on both releases."""
    jid = job_ids(release)["J23"]
    before, after = jobs(release, "squeue-phase2a.txt")[jid], jobs(release, "squeue-phase2b-nodefail.txt")[jid]
    assert (before.state, before.restart_count, before.nodelist) == ("RUNNING", 0, "node3")
    assert (after.state, after.reason, after.restart_count) == ("PENDING", "BeginTime", 1)
    assert after.nodelist == "" and after.batch_host is None
    assert after.time_limit_s == 600 and after.end_time == after.start_time + 600  # not N/A
    assert after.submit_time > before.submit_time  # reset to the requeue


@pytest.mark.parametrize("release", RELEASES)
def test_requeued_job_without_a_time_limit_comes_back_with_365_days_on_2411_only(release):
    """Scenario J3 (``--time=UNLIMITED``, requeued by hand, then by a DOWN node)."""
    jid = job_ids(release)["J3"]
    first, again = jobs(release, "squeue-phase1.txt")[jid], jobs(release, "squeue-phase2a.txt")[jid]
    assert (first.time_limit_s, first.end_time, first.restart_count) == (None, None, 0)  # UNLIMITED, EndTime NONE
    assert again.state == "RUNNING" and again.restart_count == 1
    ctl = scontrol(release, "scontrol-show-job-3-after-nodefail.txt")
    if release == "22.05":
        assert (again.time_limit_s, again.end_time) == (None, None)
        assert ctl["TimeLimit"] == "UNLIMITED" and ctl["JobState"] == "RUNNING" and ctl["Restarts"] == "1"
        return
    assert again.time_limit_s == YEAR_S and again.end_time == again.start_time + YEAR_S
    pending = jobs(release, "squeue-phase2b-nodefail.txt")[jid]  # requeued a second time: the 24.11 line
    assert (pending.state, pending.restart_count, pending.nodelist) == ("PENDING", 2, "")
    assert pending.time_limit_s == YEAR_S and pending.end_time == pending.start_time + YEAR_S
    assert pending.submit_time > again.submit_time > first.submit_time
    # scontrol agrees with squeue, in 24.11's own words
    assert (ctl["JobState"], ctl["Restarts"], ctl["TimeLimit"], ctl["NodeList"]) == ("PENDING", "2", "365-00:00:00", "")
    assert int(ctl["EndTime"]) == pending.end_time and int(ctl["SubmitTime"]) == pending.submit_time
    assert "ReqTRES" in ctl and "TRES" not in ctl and "LicensesAlloc" not in ctl and "Power" not in ctl


@pytest.mark.parametrize("release", RELEASES)
def test_drained_and_down_node_reasons(release):
    ids = job_ids(release)
    final = jobs(release, "squeue-phase6.txt")
    for scenario in ("J30", "J31", "J40"):  # asked for the drained node4
        assert final[ids[scenario]].reason == DRAINED[release], scenario
    assert final[ids["J42"]].reason == DOWN  # asked for the DOWN node2
    assert row(release, "squeue-phase2a.txt", "rnna").reason == DRAINED[release]
    assert row(release, "squeue-phase2a.txt", "big").reason == NOT_ENOUGH_NODES  # all 4 nodes, one DOWN
    for reason in (DRAINED[release], DOWN, NOT_ENOUGH_NODES):
        assert not fatal_pending(reason), reason
    assert fatal_pending(row(release, "squeue-final.txt", "ptl").reason)  # PartitionTimeLimit, on both
    name = {"22.05": "scontrol-show-job-24-reqnodenotavail.txt", "24.11": "scontrol-show-job-23-reqnodenotavail.txt"}
    assert scontrol(release, name[release])["Reason"] == DRAINED[release].replace(" ", "_")


def test_more_nodes_than_exist_pending_on_2205_rejected_on_2411():
    assert (CAPTURES / "22.05" / "err-sbatch-too-many-nodes.stdout").read_text().strip() == "17"  # accepted
    job = squeue_json_jobs("22.05")[17]
    assert (job["job_state"], job["state_reason"], job["node_count"]) == ("PENDING", "PartitionNodeLimit", 9)
    assert fatal_pending(job["state_reason"])
    assert stderr("24.11", "err-sbatch-too-many-nodes") == (
        "sbatch: error: Batch job submission failed: Requested node configuration is not available")
    assert (CAPTURES / "24.11" / "err-sbatch-too-many-nodes.stdout").read_text() == ""


# -- error classification on both sets ----------------------------------------------------------------------------

PERMANENT = ["err-sbatch-bad-constraint", "err-sbatch-bad-option", "err-sbatch-bad-partition", "err-sbatch-bad-time",
             "err-sbatch-mem-too-big", "err-sbatch-too-many-gpus", "err-scancel-signal-finished",
             "err-scontrol-show-unknown", "err-squeue-unknown-job"]
TRANSIENT = ["err-ctld-down-sbatch", "err-ctld-down-scancel", "err-ctld-down-scontrol", "err-ctld-down-squeue"]


@pytest.mark.parametrize("release", RELEASES)
def test_captured_errors_are_classified(release):
    extra_transient = [f.name.removesuffix(".stderr") for f in (CAPTURES / release).glob("err-munge-down-*.stderr")]
    assert len(extra_transient) == {"22.05": 0, "24.11": 5}[release]
    for name in PERMANENT + (["err-sbatch-too-many-nodes"] if release == "24.11" else []):
        text = stderr(release, name)
        assert text and classify(text) is False, (name, text)
    for name in TRANSIENT + extra_transient:
        text = stderr(release, name)
        assert text and classify(text) is True, (name, text)


def _stub(tmp_path: Path, tool: str, stdout: str = "", stderr_text: str = "", rc: int = 0) -> None:
    (tmp_path / f"{tool}.out").write_text(stdout)
    (tmp_path / f"{tool}.err").write_text(stderr_text)
    exe = tmp_path / tool
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path}/{tool}.out'\ncat '{tmp_path}/{tool}.err' >&2\nexit {rc}\n")
    exe.chmod(0o755)


@pytest.mark.parametrize("release", RELEASES)
async def test_cli_client_reads_the_captured_listing_and_raises_the_captured_errors(release, tmp_path):
    cli = CliSlurm(f"slurmfleet-{FLEET[release]}", bin_dir=str(tmp_path))
    _stub(tmp_path, "squeue", stdout=(CAPTURES / release / "squeue-phase6.txt").read_text())
    listed = await cli.list_jobs()
    assert [j.job_id for j in listed] == list(jobs(release, "squeue-phase6.txt"))
    _stub(tmp_path, "sbatch", stderr_text=stderr(release, "err-sbatch-too-many-gpus") + "\n", rc=1)
    with pytest.raises(SlurmError) as exc:
        await cli.submit("#!/bin/bash\n")
    assert not exc.value.transient and "Requested node configuration is not available" in str(exc.value)
    _stub(tmp_path, "sbatch", stderr_text=stderr(release, "err-ctld-down-sbatch") + "\n", rc=1)
    with pytest.raises(SlurmError) as exc:
        await cli.submit("#!/bin/bash\n")
    # (it never reached slurmctld: no job was made, none is awaited in squeue; a cold start waited 2 minutes)
    assert exc.value.transient and not exc.value.started
    _stub(tmp_path, "sbatch", stderr_text="sbatch: error: Batch job submission failed: Socket timed out on send/recv "
          "operation\n", rc=1)
    with pytest.raises(SlurmError) as exc:
        await cli.submit("#!/bin/bash\n")
    assert exc.value.transient and exc.value.started   # (slurmctld may have taken it: awaited in squeue)


# -- the reconciler's decisions on both sets ------------------------------------------------------------------

def moved(j: JobInfo, dt: float) -> JobInfo:
    """The row ``dt`` seconds later (its times, not its limit): a capture's step replayed on the harness clock."""
    return dataclasses.replace(j, **{k: getattr(j, k) + dt for k in ("submit_time", "start_time", "end_time")
                                     if getattr(j, k) is not None})


def as_ours(h: Harness, jid: str, captured: JobInfo) -> None:
    """From now on squeue shows the harness's job ``jid`` exactly as the captured row (its own tag kept)."""
    mine = h.slurm.jobs[jid]
    h.slurm.jobs[jid] = dataclasses.replace(captured, job_id=jid, name=mine.name, comment=mine.comment)


async def pending_harness(captured: JobInfo, **model) -> tuple[Harness, str]:
    """One replica, whose job squeue shows as ``captured``, on a clock just after that capture."""
    h = Harness(**{"drain": {"handover_lead_s": 30}, **model})  # the captures' 1-10 min limits: no handover
    h.now = captured.submit_time + 5
    h.slurm.start_state = "PENDING"
    await h.tick()
    jid = h.newest()
    as_ours(h, jid, captured)
    return h, jid


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("scenario", ["drained", "down", "not_enough_nodes"])
async def test_node_trouble_is_transient_the_job_waits_and_the_model_is_not_blocked(release, scenario):
    captured = {"drained": lambda: row(release, "squeue-phase2a.txt", "rnna"),
                "down": lambda: row(release, "squeue-phase6.txt", "down2"),
                "not_enough_nodes": lambda: row(release, "squeue-phase2a.txt", "big")}[scenario]()
    assert captured.state == "PENDING" and captured.reason in (DRAINED[release], DOWN, NOT_ENOUGH_NODES)
    h, jid = await pending_harness(captured)
    await h.tick(30, advance_s=60)
    rt = h.rec.runtime("m")
    assert rt.blocked is None and h.slurm.cancels == [] and h.sbatches == 1
    assert h.rec.state_of(h.rec.replicas[jid]) == State.QUEUED and h.rec.replicas[jid].reason == captured.reason
    if scenario == "drained":  # node4 resumed: the same job runs there (phase 3), READY, nothing replaced
        running = row(release, "squeue-phase3.txt", "rnna")
        assert (running.state, running.nodelist) == ("RUNNING", "node4")
        as_ours(h, jid, moved(running, h.now - running.start_time))
        await h.tick(2, advance_s=1)
        assert h.ready() == {jid} and h.sbatches == 1 and h.slurm.cancels == []


@pytest.mark.parametrize("release", RELEASES)
async def test_more_nodes_than_exist_blocks_the_model_until_a_reload(release, tmp_path):
    if release == "22.05":  # sbatch takes it; it pends with PartitionNodeLimit: cancelled, model blocked
        reason = squeue_json_jobs("22.05")[17]["state_reason"]
        captured = dataclasses.replace(row(release, "squeue-phase1.txt", "big"), reason=reason)
        h, jid = await pending_harness(captured)
        await h.tick(advance_s=5)
        assert h.slurm.cancels == [jid]
    else:  # sbatch refuses at once: the model is blocked, no job exists
        cli = CliSlurm("slurmfleet-f", bin_dir=str(tmp_path))
        _stub(tmp_path, "sbatch", stderr_text=stderr(release, "err-sbatch-too-many-nodes") + "\n", rc=1)
        with pytest.raises(SlurmError) as exc:
            await cli.submit("#!/bin/bash\n")
        reason = "Requested node configuration is not available"
        h = Harness(drain={"handover_lead_s": 30})
        h.slurm.submit_errors.append(exc.value)
        await h.tick()
        assert not h.slurm.jobs and not h.rec.placeholders and "rejected" in h.rec.runtime("m").blocked
    blocked = h.rec.runtime("m").blocked
    assert blocked and reason in blocked and "reload" in blocked
    await h.tick(20, advance_s=60)
    assert h.sbatches == 1  # no retry loop against a request that can never run
    assert h.rec.metrics.blocked.labels("m")._value.get() == 1
    h.rec.apply_config(fleet_cfg(probe={"interval_s": 2}))
    await h.tick(advance_s=5)
    assert h.rec.runtime("m").blocked is None and h.sbatches == 2


@pytest.mark.parametrize("release", RELEASES)
async def test_requeue_is_a_lost_node_and_its_365_day_limit_starts_no_handover(release):
    """Scenario J3 on a model without a time limit: running, requeued by a DOWN node (PENDING with the
    release's requeue line), running again; on 24.11 with a 365-day limit. The job is kept throughout."""
    jid3 = job_ids(release)["J3"]
    running = jobs(release, "squeue-phase1.txt")[jid3]
    h = Harness(time_limit="UNLIMITED", drain={"handover_lead_s": 600})
    h.now = running.start_time
    await h.tick()
    jid = h.newest()
    as_ours(h, jid, running)
    await h.tick(2, advance_s=1)
    assert h.ready() == {jid}
    restarts = h.rec.metrics.restarts.labels("m", "node_lost")

    # the requeue: 24.11's line of J3 itself; 22.05 has no pending line of J3 (it restarted at once), so J23's
    requeued = jobs(release, "squeue-phase2b-nodefail.txt")[jid3 if release == "24.11" else job_ids(release)["J23"]]
    assert requeued.state == "PENDING" and requeued.nodelist == "" and requeued.restart_count >= 1
    h.now = requeued.submit_time + 1
    as_ours(h, jid, requeued)
    await h.tick()
    assert h.ready() == set() and h.rec.state_of(h.rec.replicas[jid]) == State.QUEUED
    assert restarts._value.get() == 1 and h.sbatches == 1 and h.slurm.cancels == []  # the same job comes back

    again = jobs(release, "squeue-phase2a.txt")[jid3]  # J3 running after its requeue
    assert again.time_limit_s == (YEAR_S if release == "24.11" else None)
    again = dataclasses.replace(moved(again, h.now + 30 - again.start_time), restart_count=requeued.restart_count)
    h.now += 31
    as_ours(h, jid, again)
    await h.tick(2, advance_s=1)
    assert h.ready() == {jid}
    for _ in range(10):  # a day, in steps
        await h.tick(advance_s=8640)
    assert h.ready() == {jid} and h.sbatches == 1 and h.slurm.cancels == []
    assert h.rec.replicas[jid].drain_requested_at is None
    assert h.rec.runtime("m").crashes == 0 and h.rec.runtime("m").blocked is None


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("model,label", [("tmo", "time_limit"), ("nf", "node_lost"), ("sig", "failed")])
async def test_ended_jobs_are_replaced_for_the_same_reason_on_both_releases(release, model, label):
    """TIMEOUT, NODE_FAIL, and a batch script killed by a signal (22.05: FAILED JobLaunchFailure, 24.11:
    FAILED RaisedSignal:15(Terminated))."""
    ended = row(release, "squeue-final.txt", model)
    started = dataclasses.replace(ended, state="RUNNING", reason=None, end_time=ended.start_time + ended.time_limit_s)
    h = Harness(drain={"handover_lead_s": 30})  # the captures' 1-10 min limits: no handover before the end
    h.now = started.start_time
    await h.tick()
    jid = h.newest()
    as_ours(h, jid, started)
    await h.tick(advance_s=1)
    h.now = ended.end_time + 1
    as_ours(h, jid, ended)
    await h.tick()
    assert jid not in h.rec.replicas and h.rec.metrics.restarts.labels("m", label)._value.get() == 1
    rt = h.rec.runtime("m")
    if label == "failed":  # died 2 s after its start: an early failure, replaced after a back-off
        assert h.sbatches == 1 and rt.crashes == 1 and rt.backoff_until > h.now
        await h.run_until(lambda: h.sbatches == 2, step=1)
    else:  # no fault of the engine's: replaced at once, no back-off
        assert h.sbatches == 2 and rt.crashes == 0
    assert ended.state == {"tmo": "TIMEOUT", "nf": "NODE_FAIL", "sig": "FAILED"}[model]
