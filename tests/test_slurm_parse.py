"""squeue parsing on both release shapes (22.05 captured here, 24.11 transcribed), error classes, tags."""

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
    jobs = {j.job_id: j for j in parse_squeue((DATA / "squeue-24.11.txt").read_text())}
    assert len(jobs) == 6
    assert jobs["2042"].reason == "ReqNodeNotAvail, UnavailableNodes:gpu-a[003-004]"
    assert jobs["2043"].time_limit_s == 1800 and fatal_pending(jobs["2043"].reason)
    assert not fatal_pending(jobs["2042"].reason)
    assert jobs["2040"].restart_count == 1 and jobs["2040"].state == "PENDING"
    assert jobs["2039"].state == "TIMEOUT" and jobs["2039"].time_limit_s == 14400
    assert expand_hostlist(jobs["2044"].nodelist) == ["gpu-c1", "gpu-c3"]
    assert JobTag.decode(jobs["2041"].comment).model == "r1-70b"


@pytest.mark.parametrize("text,transient", [
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", False),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified", False),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", False),
    ("squeue: error: Unable to contact slurm controller (connect failure)", True),
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", True),
    ("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying", True),
    ("slurm_load_jobs error: Zero Bytes were transmitted or received", True),
])
def test_error_classification(text, transient):
    assert classify(text) is transient


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
