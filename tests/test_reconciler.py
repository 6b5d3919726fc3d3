"""The reconciler against a fake SLURM client (the process boundary) and real simulator endpoints."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from fakes import FakeSlurm
from gateway_harness import Sim
from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.discovery import Discovery
from orchestrator.fleet.probe import Prober
from orchestrator.observability.metrics import Metrics
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.render import Renderer
from orchestrator.statedir import StateDir


@pytest.fixture
def sim():
    s = Sim("reconciler", secret="s")   # (a port taken meanwhile by another test process: another try)
    yield s.port
    s.stop()


def publish(state, slurm: FakeSlurm, port: int) -> None:
    (state / "endpoints").mkdir(parents=True, exist_ok=True)
    for jid in slurm.jobs:
        (state / "endpoints" / f"{jid}.json").write_text(json.dumps(
            {"job_id": jid, "restart_count": 0, "model": "m", "host": "127.0.0.1", "port": port, "secret": "s",
             "node": "node1"}))


async def run(tmp_path, port, script) -> None:
    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}\nmodels:\n  - name: m\n    engine: simulator\n"
                           f"    replicas: 3\n    container: {{enabled: false}}\n    probe: {{interval_s: 0.01}}\n",
                           "f.yaml", {})
    slurm = FakeSlurm("f")
    async with aiohttp.ClientSession() as session:
        rec = Reconciler(cfg, slurm, Renderer(), Discovery(StateDir(tmp_path)), Prober(session), Metrics())
        await script(rec, slurm)


def test_one_empty_listing_does_not_resubmit_the_fleet(tmp_path, sim):
    async def script(rec, slurm):
        await rec.tick()
        assert slurm.submits == 3
        publish(tmp_path, slurm, sim)
        await rec.tick()
        await rec.tick()
        assert sum(1 for f in rec.replicas.values() if f.first_ready_time) == 3
        slurm.empty_listings = 1
        await rec.tick()
        assert slurm.submits == 3 and len(rec.replicas) == 3
        await rec.tick()
        assert slurm.submits == 3

    asyncio.run(run(tmp_path, sim, script))


def test_a_new_daemon_whose_first_listing_is_empty_resubmits_nothing_and_keeps_the_records(tmp_path, sim):
    async def script(rec, slurm):
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        await rec.tick()
        assert slurm.submits == 3 and sum(1 for f in rec.replicas.values() if f.first_ready_time) == 3
        again = Reconciler(rec.cfg, slurm, Renderer(), Discovery(StateDir(tmp_path)), rec.prober, Metrics())
        slurm.empty_listings = 1
        await again.tick()
        assert slurm.submits == 3 and slurm.cancels == []
        assert len(list((tmp_path / "endpoints").glob("*.json"))) == 3   # the jobs' records are kept
        for _ in range(2):
            await again.tick()
        assert slurm.submits == 3 and slurm.cancels == []
        assert sum(1 for f in again.replicas.values() if f.first_ready_time) == 3   # adopted, READY again

    asyncio.run(run(tmp_path, sim, script))


async def three_ready(rec, slurm, tmp_path, sim) -> set[str]:
    """The fleet's three jobs submitted, their records published and every one READY: their ids."""
    await rec.tick()
    publish(tmp_path, slurm, sim)
    await rec.tick()
    await rec.tick()
    first = set(slurm.jobs)
    assert slurm.submits == 3 and all(rec.replicas[j].first_ready_time for j in first)
    return first


def test_a_new_daemon_given_two_empty_listings_keeps_the_records_and_its_jobs_serve_when_listed(tmp_path, sim):
    """A new daemon whose first two listings leave every job out replaces them (the second listing decides), but
    keeps their engines' records as a running daemon keeps those of jobs that vanished: listed again, the old
    jobs serve at once and the surplus goes (the records were deleted, and the old jobs, never READY again,
    were cancelled at their startup timeout as early crashes, excluding their healthy nodes)."""
    async def script(rec, slurm):
        first = await three_ready(rec, slurm, tmp_path, sim)
        again = Reconciler(rec.cfg, slurm, Renderer(), Discovery(StateDir(tmp_path)), rec.prober, Metrics())
        slurm.empty_listings = 2
        await again.tick()
        await again.tick()
        assert slurm.submits == 6 and {p.stem for p in (tmp_path / "endpoints").glob("*.json")} == first
        for _ in range(4):
            await again.tick()
        assert set(again.replicas) == first and all(again.replicas[j].first_ready_time for j in first)
        assert set(slurm.cancels) == set(slurm.jobs) - first and slurm.submits == 6

    asyncio.run(run(tmp_path, sim, script))


def test_unreachable_controller_skips_the_tick_and_keeps_routing(tmp_path, sim):
    published = []

    async def script(rec, slurm):
        rec.on_update = lambda ready: published.append({k: len(v.replicas) for k, v in ready.items()})
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        slurm.listing_fails = 3
        for _ in range(3):
            await rec.tick()
        assert slurm.submits == 3 and rec.last_tick_error and "connect failure" in rec.last_tick_error
        assert published[-1] == {"m": 3}  # nothing was withdrawn while SLURM could not be read
        await rec.tick()
        assert rec.last_tick_error is None and slurm.submits == 3

    asyncio.run(run(tmp_path, sim, script))


def test_a_job_gone_for_two_listings_is_replaced(tmp_path, sim):
    async def script(rec, slurm):
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        victim = next(iter(slurm.jobs))
        del slurm.jobs[victim]  # purged from squeue (e.g. past MinJobAge)
        await rec.tick()
        assert slurm.submits == 3
        await rec.tick()
        assert slurm.submits == 4 and victim not in rec.replicas

    asyncio.run(run(tmp_path, sim, script))


def test_jobs_two_odd_listings_left_out_keep_their_records_and_serve_again_when_listed(tmp_path, sim):
    """Two empty listings in a row: the jobs count as gone and are replaced. When squeue lists them again they
    are adopted, and their engines' records (written once, at their start) are still there: they serve again and
    the surplus goes (before, the records were deleted with them, and those jobs could never be READY again)."""
    async def script(rec, slurm):
        first = await three_ready(rec, slurm, tmp_path, sim)
        slurm.empty_listings = 2
        await rec.tick()
        await rec.tick()
        assert not first & rec.replicas.keys() and slurm.submits == 6   # replaced
        assert {p.stem for p in (tmp_path / "endpoints").glob("*.json")} == first   # the records stay
        replacements = set(slurm.jobs) - first
        for _ in range(4):
            await rec.tick()
        # the old jobs serve again; the surplus, the replacements whose engines never answered, are cancelled
        assert set(rec.replicas) == first and all(rec.replicas[j].first_ready_time for j in first)
        assert set(slurm.cancels) == replacements and slurm.submits == 6

    asyncio.run(run(tmp_path, sim, script))


def test_a_forged_record_never_takes_over_a_jobs_routing(tmp_path, sim):
    """A record speaks only for the job its file is named after, written on that job's head node."""
    async def script(rec, slurm):
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        jid = next(iter(slurm.jobs))
        real = rec.replicas[jid].endpoint
        forged = {"job_id": jid, "restart_count": 0, "model": "m", "host": "127.0.0.1", "port": 1, "secret": "x",
                  "node": "node1"}
        (tmp_path / "endpoints" / f"{jid}.json").unlink()
        (tmp_path / "endpoints" / "evil.json").write_text(json.dumps(forged))
        await rec.tick()
        assert rec.replicas[jid].endpoint == real  # the evil file is ignored (the job's record missing from a
        # scan drops nothing while the job runs: its probes judge the engine)
        (tmp_path / "endpoints" / f"{jid}.json").write_text(json.dumps({**forged, "node": "node7"}))
        await rec.tick()
        assert rec.replicas[jid].endpoint is None  # written elsewhere than the job's head: ignored
        (tmp_path / "endpoints" / f"{jid}.json").write_text(json.dumps({**forged, "port": real.port,
                                                                        "secret": real.secret}))
        await rec.tick()
        assert rec.replicas[jid].endpoint is not None

    asyncio.run(run(tmp_path, sim, script))


def test_a_ready_replica_is_published_with_its_engines_context_length(tmp_path, sim):
    """The probe reads the served model's max_model_len from /v1/models; the routing table carries it (a
    continuation that runs to the end of the context asks for that much: vLLM refuses more)."""
    published = []

    async def script(rec, slurm):
        rec.on_update = lambda ready: published.append(ready)
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        await rec.tick()
        reps = published[-1]["m"].replicas
        assert len(reps) == 3 and {r.max_model_len for r in reps} == {4096}

    asyncio.run(run(tmp_path, sim, script))


def test_an_operators_drain_is_marked_in_the_state_dir_and_a_new_daemon_goes_on_with_it(tmp_path, sim):
    async def script(rec, slurm):
        await rec.tick()
        publish(tmp_path, slurm, sim)
        await rec.tick()
        await rec.tick()
        jid = sorted(rec.replicas)[0]
        mark = tmp_path / "endpoints" / f"{jid}.drain"
        rec.inflight = lambda j: 1 if j == jid else 0     # a stream in flight there: the drain waits for it
        assert await rec.request_drain(jid) and mark.exists()
        again = Reconciler(rec.cfg, slurm, Renderer(), Discovery(StateDir(tmp_path)), rec.prober, Metrics(),
                           inflight=lambda j: 0)
        await again.tick()
        assert again.replicas[jid].drain_reason == "operator" and slurm.cancels == [jid]
        for _ in range(3):
            await again.tick()
        assert jid not in again.replicas and not mark.exists()   # the mark goes with the job

    asyncio.run(run(tmp_path, sim, script))


async def test_a_shared_file_system_that_hangs_costs_a_scan_its_timeout_not_the_control_loop(tmp_path):
    """The endpoint folder on a file system that stops answering (NFS): a scan is a missed one after
    ``timeout_s`` (the tick went on waiting for ever: no probes, no routing, no replacements), the next tick
    waits on the same scan rather than starting another beside it, and an error (ESTALE) is a missed scan too."""
    import errno
    import threading
    import time
    d = Discovery(StateDir(tmp_path), timeout_s=0.3)
    (tmp_path / "endpoints").mkdir(parents=True)
    (tmp_path / "endpoints" / "7.json").write_text(json.dumps(
        {"job_id": "7", "host": "127.0.0.1", "port": 8000, "secret": "s", "node": "node1"}))
    gate, calls, real = threading.Event(), [], d._scan

    def hanging():
        calls.append(1)
        if not gate.wait(30):
            raise TimeoutError
        return real()
    d._scan = hanging
    t0 = time.monotonic()
    assert (await d.scan()).endpoints == {} and (await d.scan()).endpoints == {}
    await d.remove(["8"])        # (queued behind the hung scan: waited for timeout_s, not for ever)
    assert time.monotonic() - t0 < 5 and len(calls) == 1
    gate.set()
    wait = time.monotonic() + 5
    while not (await d.scan()).endpoints:
        assert time.monotonic() < wait
    assert set((await d.scan()).endpoints) == {"7"}

    def stale():
        raise OSError(errno.ESTALE, "Stale file handle")
    d._scan = stale
    assert (await d.scan()).endpoints == {}


async def test_an_ended_jobs_files_go_whichever_run_wrote_them_and_only_its_own(tmp_path):
    """Each run of a job has its own node script and Python folder (<jobid>.<restart>): once the job has left
    squeue they all go (a run killed before its own clean-up left them), an earlier version's too, and nothing
    of another job whose id starts the same."""
    state = StateDir(tmp_path)
    state.create()
    for name in ("12.node.sh", "12.0.node.sh", "12.3.node.sh", "123.0.node.sh"):
        (state.jobs / name).write_text("#!/bin/bash\n")
    for name in ("12.3.pylib", "123.0.pylib"):
        (state.jobs / name).mkdir()
        (state.jobs / name / "slurmfleet_engine_auth.py").write_text("")
    await Discovery(state, timeout_s=5).remove(["12"])
    assert sorted(p.name for p in state.jobs.iterdir()) == ["123.0.node.sh", "123.0.pylib"]


async def test_the_daemons_cancel_mark_is_found_and_goes_with_the_job(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    d = Discovery(state, timeout_s=5)
    await d.mark_cancel("12")
    await d.mark_drain("13")
    found = await d.scan()
    assert found.cancelled == {"12"} and found.requested == {"13"}
    await d.remove(["12"])
    assert (await d.scan()).cancelled == frozenset() and state.drain_request("13").exists()


async def test_old_logs_of_jobs_squeue_forgot_go_and_no_other_file(tmp_path):
    """Every job a fleet ever ran left its log in <state_dir>/logs for ever (a crash loop, a file a try): once a
    job has left squeue and its log has not changed for daemon.log_retention_s, the log goes; a job still listed
    keeps its log however old, a newer log stays, and a file that is no job's log is not touched."""
    import os
    import time
    state = StateDir(tmp_path)
    state.create()
    now = time.time()
    (state.logs / "m-99.log").mkdir()   # (not a file: left, and it stops no other removal)
    names = {"m-100.log": 8, "org_m-7.1b-101.log": 8, "m-102.log": 8, "m-103.log": 1, "notes.txt": 8,
             "m-latest.log": 8, "m-104.log.1": 8}   # -> age in days
    for name, days in names.items():
        (state.logs / name).write_text("vllm: ...\n")
        os.utime(state.logs / name, (now - days * 86400, now - days * 86400))
    d = Discovery(state, timeout_s=5)
    d.prune_logs(frozenset({"102"}), 7 * 86400, now)   # (in a thread of its own: the tick does not wait)
    d._pruning.result(10)
    assert sorted(p.name for p in state.logs.iterdir()) == ["m-102.log", "m-103.log", "m-104.log.1", "m-99.log",
                                                             "m-latest.log", "notes.txt"]
    d.close()


async def test_the_reconciler_looks_for_old_logs_once_an_hour_sparing_every_job_it_knows():
    """The sweep is given the jobs squeue lists (ended ones too) and those the daemon still follows; it runs at
    most once an hour, and not at all with daemon.log_retention_s 0."""
    from reconciler_harness import Harness
    h = Harness(replicas=2)
    calls = []

    def prune_logs(live, keep_s, now):
        calls.append((set(live), keep_s, now))
    h.prune_logs = prune_logs
    await h.tick(2, advance_s=5)
    assert len(calls) == 1 and calls[0][0] == set(h.slurm.jobs) and len(calls[0][0]) == 2
    assert calls[0][1] == 7 * 86400
    await h.tick(3, advance_s=1000)
    assert len(calls) == 1
    await h.tick(1, advance_s=1000)
    assert len(calls) == 2
    off = Harness(daemon={"log_retention_s": 0}, replicas=1)
    off.prune_logs = prune_logs
    await off.tick(3, advance_s=4000)
    assert len(calls) == 2
