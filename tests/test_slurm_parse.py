"""squeue parsing on both releases (22.05 and 24.11, real captures), error classes, tags.

tests/test_slurm_releases.py reads every captured row of both releases; these are spot checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.fleet.render import JobTag
from orchestrator.fleet.replica import expand_hostlist, fatal_pending
from orchestrator.fleet.slurm import classify, parse_squeue

DATA = Path(__file__).parent / "data"


def test_squeue_2205_sample():
    jobs = {j.job_id: j for j in parse_squeue((DATA / "squeue-22.05.txt").read_text())}
    assert len(jobs) == 7
    run = jobs["5"]
    assert (run.state, run.nodelist, run.time_limit_s, run.batch_host) == ("RUNNING", "node[1-2]", 86400, "node1")
    assert run.start_time == 1796012060 and run.end_time == 1796098460
    assert jobs["3"].time_limit_s is None and jobs["3"].end_time is None  # UNLIMITED, EndTime NONE
    assert (jobs["7"].state, jobs["7"].reason, jobs["7"].start_time) == ("PENDING", "Resources", None)
    assert jobs["4"].state == "FAILED" and jobs["4"].reason == "NonZeroExitCode"
    assert jobs["9"].comment == "" and jobs["6"].comment == "x"
    tag = JobTag.decode(jobs["5"].comment)
    assert tag == JobTag("capture", "m2", 0, "abc", "3")


def test_squeue_2411_sample():
    """Real Slurm 24.11.5 output (Debian 13): one phase of the captured scenarios."""
    jobs = {j.job_id: j for j in parse_squeue((DATA / "slurm-captures" / "24.11" / "squeue-phase2b-nodefail.txt").read_text())}
    assert len(jobs) == 15
    assert jobs["11"].reason == "ReqNodeNotAvail, May be reserved for other job" and not fatal_pending(jobs["11"].reason)
    assert jobs["8"].reason == "PartitionTimeLimit" and jobs["8"].time_limit_s == 1800 and fatal_pending(jobs["8"].reason)
    assert (jobs["14"].state, jobs["14"].restart_count, jobs["14"].nodelist) == ("PENDING", 1, "")  # requeued
    assert jobs["14"].end_time == jobs["14"].start_time + 600  # the requeued line: EndTime = start + limit
    assert jobs["3"].time_limit_s == 365 * 86400  # requeued UNLIMITED job
    assert jobs["12"].state == "RUNNING" and jobs["12"].time_limit_s == 60
    assert jobs["13"].state == "NODE_FAIL" and jobs["15"].reason == "RaisedSignal:15(Terminated)"
    assert expand_hostlist(jobs["2"].nodelist) == ["node1", "node2"] and jobs["2"].batch_host == "node1"
    assert JobTag.decode(jobs["1"].comment) == JobTag("cap24", "m1", 0, "abc", "1")


@pytest.mark.parametrize("text,transient", [
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", False),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified", False),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", False),
    ("squeue: error: Unable to contact slurm controller (connect failure)", True),
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", True),
    ("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying", True),
    ("slurm_load_jobs error: Zero Bytes were transmitted or received", True),
    # no slurm.conf on this host (and no DNS SRV record): its setup, not the job's (validate --slurm refused it)
    ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\nsbatch: fatal: Could not establish "
     "a configuration source", True),
    ("sbatch: error: ClusterName needs to be specified\nsbatch: fatal: Unable to process configuration file", True),
    # a controller's failover (ESLURM_IN_STANDBY_MODE's text): it blocked every model submitting then until a
    # reload, as a config error (found by a review)
    ("sbatch: error: Batch job submission failed: Slurm backup controller in standby mode", True),
])
def test_error_classification(text, transient):
    assert classify(text) is transient


async def test_the_fleets_listings_show_jobs_of_partitions_hidden_from_its_user():
    """squeue leaves out, without --all, jobs in a partition hidden from the user (Hidden=YES, AllowGroups) that
    sbatch -p takes: never listed, a replica was never adopted nor cancelled, and submitted again every other
    tick (root sees them either way, so the cluster cannot show it here). Found by a review."""
    from orchestrator.fleet.slurm import CliSlurm
    cli, seen = CliSlurm("slurmfleet-f", None), []

    async def run(argv, stdin=None):
        seen.append(argv)
        return ""
    cli._run = run
    await cli.list_jobs()
    await cli.list_array_tasks("slurmfleet-f-batch_x")
    assert all(argv[0] == "squeue" and ("-a" in argv or "--all" in argv) for argv in seen) and len(seen) == 2


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]), ("node[1-3]", ["node1", "node2", "node3"]), ("gpu[01-02,07],cpu5", ["gpu01", "gpu02", "gpu07", "cpu5"]),
    ("", []),
])
def test_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


def test_tag_rejects_foreign_comments():
    assert JobTag.decode("") is None
    assert JobTag.decode("my own job") is None
    assert JobTag.decode("slurmfleet:v1;fleet=a;model=b") is None


async def test_a_slurm_conf_that_does_not_exist_is_said_at_once():
    """(sbatch and squeue waited about a minute on it, then spoke of ClusterName: the daemon's command timed out)"""
    import time

    from orchestrator.fleet.slurm import CliSlurm, SlurmError
    t0 = time.monotonic()
    with pytest.raises(SlurmError) as e:
        await CliSlurm("f", "/nonexistent/slurm.conf", 30).list_jobs()
    assert "SLURM_CONF /nonexistent/slurm.conf does not exist" in str(e.value) and e.value.transient
    assert time.monotonic() - t0 < 5
