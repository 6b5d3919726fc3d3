"""Zero broken streams on the real cluster: a stream whose replica's job is cancelled, whose node is lost, or
that is drained (``slurmfleet drain``) continues on the other replica, token for token; the drain finishes in
the grace time instead of waiting for the stream."""

from __future__ import annotations

import time

import openai
import pytest

from conftest import cluster_exclusive, fleet_config, fleet_jobs, sim_model, slurm, wait_for

pytestmark = pytest.mark.cluster


def two_replicas(tmp_path, fleet_name, daemons, resume: bool = True):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model(
        "s", 2, simulator={"ttft_s": 0.01, "tokens_per_s": 20, "max_num_seqs": 16},
        resume={"drain_grace_s": 1.0, "enabled": resume}, drain={"timeout_s": 60})]))
    wait_for(lambda: len(d.ready("s")) == 2, 60, "2 READY replicas")
    c = openai.OpenAI(base_url=d.gateway + "/v1", api_key="x", max_retries=0, timeout=60)
    return d, c


def greedy(c, n: int = 140, stream: bool = True):
    return c.completions.create(model="s", prompt="a long story", max_tokens=n, temperature=0, stream=stream,
                                extra_body={"ignore_eos": True})


def busy_job(d) -> dict:
    return wait_for(lambda: next((r for r in d.ready("s") if r["inflight"]), None), 10, "the replica streaming")


@pytest.mark.parametrize("how", ["scancel", "node_lost"])
def test_a_stream_survives_its_job_ending(tmp_path, fleet_name, daemons, how):
    d, c = two_replicas(tmp_path, fleet_name, daemons)
    want = greedy(c, stream=False).choices[0].text
    pieces = []
    victim = None
    with cluster_exclusive() if how == "node_lost" else _nothing():
        try:
            for i, ch in enumerate(greedy(c)):   # 140 tokens at 20/s: 7 s, 6 s left at the kill
                pieces.append(ch.choices[0].text if ch.choices else "")
                if i == 20:
                    victim = busy_job(d)
                    if how == "scancel":
                        slurm("scancel", victim["job_id"])
                    else:   # a node SLURM loses: every job on it ends
                        slurm("scontrol", "update", f"nodename={victim['nodes']}", "state=down",
                              "reason=slurmfleet-test")
        finally:
            if how == "node_lost" and victim:
                slurm("scontrol", "update", f"nodename={victim['nodes']}", "state=resume", check=False)
    assert victim is not None and "".join(pieces) == want
    m = d.metrics()
    assert "slurmfleet_stream_migrations_total" in m and ',outcome="ok"} 1.0' in m


@pytest.mark.parametrize("resume", [True, False])
def test_drain_moves_long_streams_and_finishes_in_the_grace_time(tmp_path, fleet_name, daemons, resume):
    d, c = two_replicas(tmp_path, fleet_name, daemons, resume)
    want = greedy(c, 160, stream=False).choices[0].text   # 8 s of generation
    pieces = []
    t_drain = t_gone = None

    def gone() -> bool:   # out of RUNNING (a job SLURM still tears down, COMPLETING, has stopped serving)
        return victim["job_id"] not in {j["job_id"] for j in fleet_jobs(fleet_name, "PENDING,RUNNING,CONFIGURING")}
    for i, ch in enumerate(greedy(c, 160)):
        pieces.append(ch.choices[0].text if ch.choices else "")
        if i == 10:
            victim = busy_job(d)
            assert d.request("POST", f"/admin/drain/{victim['job_id']}")[0] == 200
            t_drain = time.monotonic()
        if t_drain and t_gone is None and gone():
            t_gone = time.monotonic() - t_drain
    left = time.monotonic() - t_drain   # what the stream had left at the drain
    assert "".join(pieces) == want
    if t_gone is None:
        wait_for(gone, 30, "drained job gone")
        t_gone = time.monotonic() - t_drain
    print(f"drain with a stream of {left:.1f} s left, resume {'on' if resume else 'off'}: job gone {t_gone:.1f}s "
          f"after the drain")
    if resume:   # about the grace time (1 s) plus a tick and the scancel, not what the stream had left
        assert t_gone < 5 and t_gone < left - 1.5, (t_gone, left)
    else:        # before: the drain waited for the stream
        assert t_gone >= left - 0.5, (t_gone, left)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
