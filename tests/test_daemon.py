"""The fleet daemon on the real local SLURM cluster, with the simulator as the payload."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import http.client
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, cluster_exclusive, fleet_config, fleet_jobs, metric_sum, sim_model, slurm, wait_for
from orchestrator.observability.status import render_table

pytestmark = pytest.mark.cluster


metric = metric_sum


def chat(gateway: str, model: str, timeout: float = 30) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(gateway + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            json.loads(r.read())
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_replicas_come_up_and_a_cancelled_job_is_replaced(tmp_path, fleet_name, daemons):
    # a 1 s tick (not the tests' 0.5 s): "within two ticks" below is counted in ticks read over HTTP
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 3)], daemon={"tick_interval_s": 1}))
    wait_for(lambda: len(d.ready("m")) == 3, 60, "3 READY")
    assert chat(d.gateway, "m") == 200
    victim = d.ready("m")[0]
    t0 = time.monotonic()
    slurm("scancel", victim["job_id"])
    # a replacement is submitted within two ticks of the job leaving RUNNING
    wait_for(lambda: [r for r in d.model("m")["replicas"] if r["job_id"] != victim["job_id"]
                      and r["slot"] == victim["slot"]], 15, "replacement submitted")
    # counted from the log: the daemon saw the job end (SLURM may hold it COMPLETING for a while under load,
    # and the replacement waits for that), then submitted the replacement within two 1 s ticks
    log = d.logs()
    ended = [t for t, _ in log_times(log, rf"job {victim['job_id']} \(m slot {victim['slot']}\) ended ")]
    submitted = [t for t, _ in log_times(log, rf"submitted job \d+ for m slot {victim['slot']} ") if ended and t >= ended[0]]
    assert ended and submitted and submitted[0] - ended[0] <= 2.5, (ended, submitted)
    # the submission says what it replaces (it said "scale_up", as an autoscaler's; found by a soak)
    assert re.search(rf"submitted job \d+ for m slot {victim['slot']} \(replaces job {victim['job_id']}, cancelled\)",
                     log), log
    def healed() -> bool:   # (one status: two can see the victim READY, then not, and its successor not yet)
        ready = {r["job_id"] for r in d.ready("m")}
        return len(ready) == 3 and victim["job_id"] not in ready
    wait_for(healed, 30, "3 READY again")
    took = time.monotonic() - t0
    print(f"scancel -> replacement READY: {took:.1f}s")
    assert len([j for j in fleet_jobs(fleet_name) if j["state"] == "RUNNING"]) == 3
    m = d.metrics()
    assert metric(m, "slurmfleet_replica_restarts_total", model="m", reason="cancelled") == 1
    # one squeue per tick, nothing per job
    squeues = metric(m, "slurmfleet_slurm_command_duration_seconds_count", command="squeue")
    assert squeues <= d.status()["ticks"] + 1
    assert metric(m, "slurmfleet_slurm_command_duration_seconds_count", command="scontrol") == 0


def test_one_state_dir_has_one_daemon(tmp_path):
    from orchestrator.statedir import StateDir, StateDirBusy
    state = StateDir(tmp_path / "s")
    state.create()
    fd = state.lock()
    assert fd is not None and (tmp_path / "s" / "daemon.lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(StateDirBusy, match=f"pid {os.getpid()}"):
        state.lock()                    # another open of the file: refused, though in the same process
    os.close(fd)                        # (a daemon's end, however it ends, closes it)
    again = state.lock()
    assert again is not None
    os.close(again)


def test_sigkill_and_restart_adopts_without_duplicates(tmp_path, fleet_name, daemons):
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 2), sim_model("q", 1)])
    d = daemons(cfg)
    wait_for(lambda: len(d.ready("m")) == 2 and len(d.ready("q")) == 1, 60, "all READY")
    # an operator's pin (`slurmfleet scale q 2`) outlives a crash on the same config; a reload drops it
    assert d.request("POST", "/admin/scale", {"model": "q", "replicas": 2})[0] == 200
    wait_for(lambda: len(d.ready("q")) == 2, 60, "q pinned at 2")
    before = sorted(j["job_id"] for j in fleet_jobs(fleet_name))
    # a second daemon on the same state dir refuses to start (it would submit the fleet's jobs a second time)
    second = subprocess.run([sys.executable, "-m", "orchestrator", "serve", "--config", str(cfg)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and f"another slurmfleet daemon (pid {d.proc.pid}) runs on state_dir" in \
        second.stderr, second.stderr[-2000:]
    d.stop(signal.SIGKILL)   # the kernel releases its lock: the next daemon starts
    d2 = daemons(cfg)
    wait_for(lambda: d2.status()["ticks"] >= 6, 30, "6 ticks")
    after = sorted(j["job_id"] for j in fleet_jobs(fleet_name))
    assert after == before, "the restarted daemon submitted or lost jobs"
    assert "submitted job" not in d2.logs()
    assert metric(d2.metrics(), "slurmfleet_job_submissions_total") == 0
    assert {r["job_id"] for r in d2.model("m")["replicas"]} | {r["job_id"] for r in d2.model("q")["replicas"]} == set(before)
    wait_for(lambda: len(d2.ready("m")) == 2, 20, "adopted replicas READY")
    assert chat(d2.gateway, "m") == 200
    assert d2.model("q")["desired"] == 2 and len(d2.ready("q")) == 2
    assert d2.request("POST", "/admin/reload")[1]["ok"]
    wait_for(lambda: d2.model("q")["desired"] == 1, 10, "the file's count after a reload")
    assert not (tmp_path / "state" / "pins.json").exists()


def test_scale_down_add_and_remove_models_by_reload(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("a", 3), sim_model("b", 1)])
    d = daemons(path)
    wait_for(lambda: len(d.ready("a")) == 3 and len(d.ready("b")) == 1, 60, "initial fleet")
    cfg = yaml.safe_load(path.read_text())
    cfg["models"] = [sim_model("a", 1), sim_model("c", 2)]
    path.write_text(yaml.safe_dump(cfg))
    d.send(signal.SIGHUP)

    def converged():
        jobs = fleet_jobs(fleet_name)
        models = [re.search(r"model=([^;]+)", j["comment"]).group(1) for j in jobs]
        return sorted(models) == ["a", "c", "c"] and all(j["state"] == "RUNNING" for j in jobs)

    wait_for(converged, 60, "squeue shows a x1, c x2, no b")
    wait_for(lambda: len(d.ready("c")) == 2, 30, "c READY")
    assert chat(d.gateway, "c") == 200
    assert chat(d.gateway, "b") == 404


def test_time_limit_handover_drops_no_request(tmp_path, fleet_name, daemons):
    # The successor is due min(handover_lead_s, time_limit / 2) before the job's end, taken from the time limit
    # SLURM reports. SLURM limits are whole minutes: rather than wait a minute into a 2:00 job, its limit is cut
    # to 1:00 once it serves (scontrol, as an operator may), which puts it inside the 60 s lead at once.
    model = sim_model("h", 1, time_limit="2:00", drain={"handover_lead_s": 60, "timeout_s": 10, "signal_lead_s": 30})
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [model]))
    first = wait_for(lambda: d.ready("h"), 60, "READY")[0]
    results: list[int] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            results.append(chat(d.gateway, "h"))
            time.sleep(0.05)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    timeline = {}
    try:
        def watch():
            reps = {r["job_id"]: r for r in d.model("h")["replicas"]}
            succ = [r for jid, r in reps.items() if jid != first["job_id"]]
            if succ and succ[0]["state"] == "READY" and "succ_ready" not in timeline:
                timeline["succ_ready"] = time.monotonic()
            old = reps.get(first["job_id"])
            if (old is None or old["state"] in ("STOPPING", "GONE")) and "old_cancelled" not in timeline:
                timeline["old_cancelled"] = time.monotonic()
            return "old_cancelled" in timeline and "succ_ready" in timeline
        wait_for(lambda: results, 10, "traffic flowing")
        t0 = time.monotonic()
        slurm("scontrol", "update", f"jobid={first['job_id']}", "timelimit=1")
        wait_for(watch, 90, "handover", interval=0.1)
        n = len(results)
        wait_for(lambda: len(results) >= n + 30, 30, "traffic after the handover")  # served by the successor
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert timeline["succ_ready"] <= timeline["old_cancelled"], timeline
    assert results and set(results) == {200}, {c: results.count(c) for c in set(results)}
    print(f"handover: successor READY at {timeline['succ_ready'] - t0:.1f}s, old cancelled at "
          f"{timeline['old_cancelled'] - t0:.1f}s, {len(results)} requests, all 200")
    assert "draining job %s (h slot 0): time_limit" % first["job_id"] in d.logs()


def test_node_set_down_is_replaced(tmp_path, fleet_name, daemons, cluster):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("n", 1)]))
    rep = wait_for(lambda: d.ready("n"), 60, "READY")[0]
    node = rep["nodes"]
    with cluster_exclusive():  # a node set DOWN kills every job on it: no other test may have one there
        try:
            slurm("scontrol", "update", f"nodename={node}", "state=down", "reason=slurmfleet-test")
            new = wait_for(lambda: [r for r in d.ready("n") if r["job_id"] != rep["job_id"]], 60,
                           "replacement READY")
            assert new[0]["nodes"] != node
            assert metric(d.metrics(), "slurmfleet_replica_restarts_total", model="n", reason="node_lost") == 1
        finally:
            slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def log_times(log: str, pattern: str) -> list[tuple[float, re.Match]]:
    """(seconds, match) of each daemon log line whose message matches ``pattern``."""
    out = []
    for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ [\w.]+: " + pattern, log, re.M):
        out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000, m))
    return out


def test_crashing_payload_backs_off(tmp_path, fleet_name, daemons):
    # The exact delays (doubling, capped, reset by a replica that serves) are tested on a fake clock in
    # test_reconciler_clock.py. Here, end to end: a payload that dies 2 s after it starts is resubmitted only
    # after growing pauses that the daemon really waits out, and the status says why.
    model = sim_model("crash", 1, simulator={"fail_after_s": 2},
                      backoff={"base_s": 2, "max_s": 60, "early_failure_s": 60, "node_exclude_s": 0})
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [model]))
    m = wait_for(lambda: (x := d.model("crash"))["crashes"] >= 3 and x, 90, "3 early failures", interval=0.1)
    assert "failed" in (m["last_error"] or "") and "next submission in" in m["last_error"], m
    submits = metric(d.metrics(), "slurmfleet_job_submissions_total", model="crash")
    log = d.logs()
    subs = [t for t, _ in log_times(log, r"submitted job \d+ for crash ")]
    crashes = [(t, int(x["delay"]))
               for t, x in log_times(log, r"model crash: .*; next submission in (?P<delay>\d+)s; its log: \S+/logs/crash-\d+\.log$")]
    assert len(crashes) == 3, crashes
    # without back-off a job every ~3 s (2 s run + a tick), each submitted in the tick that saw the last fail;
    # with it: one submission per crash, each only after its pause, and the pauses grow (base 2 s, doubling,
    # +-25% jitter: 2, 3-5, 6-10 s)
    assert submits == len(subs) == 3, (submits, subs)
    delays = [delay for _, delay in crashes]
    assert delays[0] < delays[1] < delays[2] and delays[2] >= 2 * delays[0], delays
    pauses = [next_submit - crashed for (crashed, _), next_submit in zip(crashes, subs[1:])]
    print(f"back-off: stated delays {delays} s, crash-to-resubmit pauses {[round(p, 1) for p in pauses]} s")
    # each pause waited out (it counts from the start of the tick that logged the crash; the delay is rounded)
    assert all(p > delay - 1.5 for p, delay in zip(pauses, delays)), (crashes, subs)


def test_missing_partition_is_reported_not_retried(tmp_path, fleet_name, daemons):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("p", 2, partition="nosuchpart")]))
    wait_for(lambda: d.model("p")["blocked"], 20, "blocked")
    ticks = d.status()["ticks"]
    wait_for(lambda: d.status()["ticks"] >= ticks + 5, 20, "5 more ticks")
    m = d.model("p")
    assert "Invalid partition" in m["blocked"]
    assert metric(d.metrics(), "slurmfleet_job_submissions_total", model="p") == 1
    assert fleet_jobs(fleet_name) == []


def test_unsatisfiable_pending_reason_blocks_the_model(tmp_path, fleet_name, daemons):
    # partition 'short' allows 5 minutes: a 10-minute job pends with PartitionTimeLimit/PartitionConfig forever
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("s", 1, partition="short", time_limit=10)]))
    m = wait_for(lambda: (x := d.model("s"))["blocked"] and x, 30, "blocked")
    assert "cannot start: SLURM says Partition" in m["blocked"]
    wait_for(lambda: fleet_jobs(fleet_name) == [], 15, "the pending job cancelled")
    ticks = d.status()["ticks"]
    wait_for(lambda: d.status()["ticks"] >= ticks + 4, 20, "4 more ticks")
    assert metric(d.metrics(), "slurmfleet_job_submissions_total", model="s") == 1


def test_bad_config_on_sighup_keeps_the_fleet(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("k", 2)])
    d = daemons(path)
    wait_for(lambda: len(d.ready("k")) == 2, 60, "READY")
    jobs = sorted(j["job_id"] for j in fleet_jobs(fleet_name))
    good = path.read_text()
    path.write_text(good.replace("replicas: 2", "replicas: -5"))
    d.send(signal.SIGHUP)
    line = next(i for i, ln in enumerate(good.splitlines(), 1) if "replicas: 2" in ln)
    wait_for(lambda: f"{path}:{line}:" in d.logs(), 10, "error with the line number in the log")
    assert "models[0].replicas" in d.logs()
    code, res = d.request("POST", "/admin/reload")
    assert code == 422 and res["errors"][0].startswith(f"{path}:{line}:")
    # hostile YAML on SIGHUP (a Python tag, a recursive alias, a non-UTF-8 byte): logged with its line; the
    # daemon (which these stopped, exit 0, before) serves on
    for bad in (good.replace("replicas: 2", "replicas: !!python/name:os.system 2"),
                good + "x: &r [*r]\n", good.replace("replicas: 2", "replicas: 2 # \udcff")):
        path.write_bytes(bad.encode("utf-8", "surrogateescape"))
        before = d.logs().count("reload rejected")
        d.send(signal.SIGHUP)
        wait_for(lambda: d.logs().count("reload rejected") > before, 10, "the bad reload logged")
        assert d.proc.poll() is None and "Traceback" not in d.logs()
    ticks = d.status()["ticks"]
    wait_for(lambda: d.status()["ticks"] >= ticks + 4, 20, "4 more ticks")  # time to act on a bad config
    assert sorted(j["job_id"] for j in fleet_jobs(fleet_name)) == jobs
    assert len(d.ready("k")) == 2 and d.model("k")["desired"] == 2
    # a rejected reload was in the log alone: config management that pushed a bad file never heard of it
    last = d.status()["last_reload"]
    assert last["ok"] is False and last["errors"], last
    assert "last reload REJECTED" in render_table(d.status())   # (what `slurmfleet status` prints)
    m = d.metrics()
    assert metric(m, "slurmfleet_config_last_reload_successful") == 0
    assert metric(m, "slurmfleet_config_reloads_total", result="rejected") == 5   # (4 SIGHUPs, one admin reload)
    path.write_text(good)
    assert d.request("POST", "/admin/reload")[0] == 200
    m = d.metrics()
    assert metric(m, "slurmfleet_config_last_reload_successful") == 1 and d.status()["last_reload"]["ok"] is True
    assert metric(m, "slurmfleet_config_reloads_total", result="applied") == 1


def test_sbatch_timeout_is_found_by_its_tag_not_submitted_twice(tmp_path, fleet_name, daemons, monkeypatch):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text("#!/bin/bash\n/usr/bin/sbatch \"$@\"\nsleep 6\n")
    (shim / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:/usr/bin:/bin:/usr/sbin:/sbin")
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("t", 2)],
                             cluster={"command_timeout_s": 2}))
    wait_for(lambda: len(d.ready("t")) == 2, 60, "READY")
    ticks = d.status()["ticks"]
    wait_for(lambda: d.status()["ticks"] >= ticks + 5, 30, "5 more ticks")
    assert len(fleet_jobs(fleet_name)) == 2
    assert metric(d.metrics(), "slurmfleet_job_submissions_total", model="t", result="error") == 2


def test_shutdown_is_bounded_and_leaves_jobs_or_cancels_them(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("x", 1)])
    d = daemons(path)
    wait_for(lambda: d.ready("x"), 60, "READY")
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 10
    assert len(fleet_jobs(fleet_name)) == 1
    d2 = daemons(path, "--cancel-jobs-on-exit")
    wait_for(lambda: d2.ready("x"), 20, "adopted")
    assert d2.stop(signal.SIGTERM) == 0
    wait_for(lambda: fleet_jobs(fleet_name) == [], 15, "jobs cancelled on exit")


def test_admin_api_needs_key_and_cli_works(tmp_path, fleet_name, daemons):
    import subprocess
    import sys

    from conftest import ROOT

    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("c", 1)])
    d = daemons(path)
    req = urllib.request.Request(d.admin + "/admin/status")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    wait_for(lambda: d.ready("c"), 60, "READY")
    env = {"SLURMFLEET_ADMIN_KEY": "admin-secret", "PATH": "/usr/bin:/bin"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "orchestrator", *args, "--config", str(path)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)

    out = cli("status")
    assert out.returncode == 0 and "READY" in out.stdout and "c" in out.stdout, out.stderr
    js = json.loads(cli("status", "--json").stdout)
    assert js["models"][0]["ready"] == 1
    assert cli("scale", "c", "2").returncode == 0
    wait_for(lambda: len(d.ready("c")) == 2, 30, "scaled to 2")
    jid = d.ready("c")[0]["job_id"]
    assert cli("drain", jid).returncode == 0
    wait_for(lambda: jid not in {j["job_id"] for j in fleet_jobs(fleet_name)}, 30, "drained job cancelled")
    wait_for(lambda: len(d.ready("c")) == 2, 30, "back to 2")
    log = d.log.read_text()   # an operator's acts are in the log (an audit trail)
    assert "admin: scale c to 2 asked from 127.0.0.1" in log and f"admin: drain of job {jid} asked from" in log
    assert cli("reload").returncode == 0
    wait_for(lambda: len(fleet_jobs(fleet_name)) == 1, 30, "reload resets the scale to the file's 1")
    # drain --replace of the only replica: it serves until its successor does, then goes
    only = wait_for(lambda: [r["job_id"] for r in d.ready("c")] if len(d.ready("c")) == 1 else None, 30, "one")[0]
    bad = urllib.request.Request(d.admin + f"/admin/drain/{only}", data=b'{"replace": "yes"}', method="POST",
                                 headers={"Authorization": "Bearer admin-secret"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=5)
    assert e.value.code == 400 and "replace" in json.loads(e.value.read())["error"]["message"]
    assert cli("drain", only, "--replace").returncode == 0

    def replaced() -> bool:
        ready = {r["job_id"] for r in d.ready("c")}
        assert ready, "the model went without a READY replica during its replacement"
        return only not in ready and only not in {j["job_id"] for j in fleet_jobs(fleet_name)}
    wait_for(replaced, 60, "the replica replaced")


def test_usr1_early_warning_hands_over(tmp_path, fleet_name, daemons):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("w", 1)]))
    old = wait_for(lambda: d.ready("w"), 60, "READY")[0]
    # what SLURM does `signal_lead_s` before the time limit (--signal=B:USR1@N): USR1 to the batch shell
    slurm("scancel", "--signal=USR1", "--batch", old["job_id"])
    mark = Path(d.cfg["state_dir"]) / "endpoints" / f"{old['job_id']}.0.draining"
    wait_for(mark.exists, 10, "the job's drain mark")
    new = wait_for(lambda: [r for r in d.ready("w") if r["job_id"] != old["job_id"]], 60, "successor READY")
    assert new[0]["slot"] == old["slot"]
    wait_for(lambda: old["job_id"] not in {j["job_id"] for j in fleet_jobs(fleet_name)}, 30, "old job cancelled")
    assert chat(d.gateway, "w") == 200


def test_config_change_rolls_one_at_a_time_without_losing_capacity(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("r", 3)])
    d = daemons(path)
    wait_for(lambda: len(d.ready("r")) == 3, 60, "3 READY")
    before = {r["job_id"] for r in d.ready("r")}
    cfg = yaml.safe_load(path.read_text())
    cfg["models"][0]["env"] = {"ROLL": "2"}
    path.write_text(yaml.safe_dump(cfg))
    code, res = d.request("POST", "/admin/reload")
    assert code == 200 and any("rolling" in c for c in res["changes"])
    min_ready, max_jobs = 3, 0

    def rolled():
        nonlocal min_ready, max_jobs
        ready = {r["job_id"] for r in d.ready("r")}
        min_ready = min(min_ready, len(ready))
        # replicas: jobs pending or running; a drained one that is still COMPLETING (its engine stopping) is not
        max_jobs = max(max_jobs, len(fleet_jobs(fleet_name, "PENDING,CONFIGURING,RUNNING")))
        return len(ready) == 3 and not ready & before

    wait_for(rolled, 120, "all replicas replaced", interval=0.2)
    assert min_ready >= 3, "capacity dropped below the desired count during the roll"
    assert max_jobs <= 4, "more than one surge replica at a time"
    assert metric(d.metrics(), "slurmfleet_replica_restarts_total", model="r", reason="config_change") == 3


def test_multi_node_head_answering_health_but_not_serving_is_replaced(tmp_path, fleet_name, daemons):
    # a 2-node replica whose head still says /health 200 while generation hangs (a dead or stuck worker):
    # only the 1-token completion probe sees it. That probe waits at least 10 s for its token (the prober's
    # floor), so one failed deep probe is enough here; a plain probe gets 5 s, not to fail on a busy machine
    model = sim_model("mn", 1, nodes=2, probe={"deep_interval_s": 1, "failure_threshold": 1, "timeout_s": 5},
                      simulator={"extra_args": ["--shutdown-timeout", "3"]})   # (a stop that takes a while, as vLLM's)
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [model]))
    old = wait_for(lambda: d.ready("mn"), 60, "2-node replica READY")[0]
    rec = json.loads((Path(d.cfg["state_dir"]) / "endpoints" / f"{old['job_id']}.json").read_text())
    base = f"http://{rec['host']}:{rec['port']}"
    req = urllib.request.Request(base + "/sim/fault", data=b'{"fault": "hang"}',
                                 headers={"Authorization": f"Bearer {rec['secret']}"})
    urllib.request.urlopen(req, timeout=5).read()
    assert urllib.request.urlopen(urllib.request.Request(base + "/health", headers={
        "Authorization": f"Bearer {rec['secret']}"}), timeout=5).status == 200
    new = wait_for(lambda: [r for r in d.ready("mn") if r["job_id"] != old["job_id"]], 90, "replacement READY")
    assert new and "job %s" % old["job_id"] in d.logs()
    assert metric(d.metrics(), "slurmfleet_replica_restarts_total", model="mn", reason="unhealthy") == 1
    # its stop reached both nodes' scripts, which stopped their engines (a plain scancel TERMs srun, which
    # KILLs its tasks: neither script's exit trap ran)
    log = next((Path(d.cfg["state_dir"]) / "logs").glob(f"*{old['job_id']}*"))
    wait_for(lambda: all(f"rank {n} stopped" in log.read_text() for n in (0, 1)), 60, "both ranks' clean stop")
    assert "forcing job termination" not in log.read_text()   # srun was never TERMed (it KILLs its tasks then)


def worker_pids(daemon_pid: int) -> set[int]:
    pids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            cmd = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\nPPid:\t{daemon_pid}\n" in text and b"orchestrator.gateway.worker" in cmd:
            pids.add(int(status.parent.name))
    return pids


def completion(gateway: str, max_tokens: int, stream: bool = False, key: str | None = None) -> urllib.request.Request:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": stream,
                       "ignore_eos": True}).encode()
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return urllib.request.Request(gateway + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json", **auth})


def in_flight(d) -> int:
    return sum(r["inflight"] or 0 for r in d.ready("m"))


def test_gateway_workers_share_the_port_report_in_flight_and_are_restarted(tmp_path, fleet_name, daemons):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 2, simulator={"tokens_per_s": 40})],
                             gateway={"workers": 2}))
    wait_for(lambda: len(d.ready("m")) == 2, 60, "2 READY")
    first = worker_pids(d.proc.pid)
    assert len(first) == 2
    assert metric(d.metrics(), "slurmfleet_gateway_processes") == 2

    def one(_: int) -> str:
        with urllib.request.urlopen(completion(d.gateway, 2), timeout=30) as r:
            assert r.status == 200
            return r.headers["x-request-id"]
    with ThreadPoolExecutor(8) as ex:
        ids = list(ex.map(one, range(60)))
    # request ids carry a per-process prefix: both workers served (new connection per request, kernel spreads them)
    assert len({i[:16] for i in ids}) == 2
    wait_for(lambda: metric(d.metrics(), "slurmfleet_requests_total", model="m", code="200") == 60, 5,
             "the daemon's /metrics sums both workers")

    # a long stream through a worker shows up as the replica's in-flight count in the daemon (drains wait on it)
    t = threading.Thread(target=lambda: urllib.request.urlopen(completion(d.gateway, 200, True), timeout=30).read())
    t.start()
    wait_for(lambda: in_flight(d) == 1, 5, "in-flight stream seen by the daemon")
    t.join()
    wait_for(lambda: in_flight(d) == 0, 5, "stream finished")

    # a worker that dies is replaced; counters keep what it counted
    before = metric(d.metrics(), "slurmfleet_requests_total", model="m")
    victim = sorted(first)[0]
    os.kill(victim, signal.SIGKILL)
    def replaced() -> bool:   # (one look at /proc: two looks can see the victim alive, then gone, and no successor)
        now = worker_pids(d.proc.pid)
        return len(now) == 2 and victim not in now
    wait_for(replaced, 15, "worker restarted")
    assert metric(d.metrics(), "slurmfleet_requests_total", model="m") >= before
    assert metric(d.metrics(), "slurmfleet_gateway_worker_restarts_total") == 1
    wait_for(lambda: metric(d.metrics(), "slurmfleet_gateway_processes") == 2, 10, "2 processes serving again")
    assert d.status()["gateway"] == {"processes": 2, "worker_restarts": 1}
    with ThreadPoolExecutor(4) as ex:
        assert len(list(ex.map(one, range(20)))) == 20
    wait_for(lambda: metric(d.metrics(), "slurmfleet_requests_total", model="m") == before + 20, 5, "counted")
    assert "gateway worker" in d.log.read_text() and "starting another" in d.log.read_text()
    # a reload reaches every worker: once a client key is configured, both refuse requests without it
    cfg = yaml.safe_load(d.config.read_text())
    cfg["gateway"]["api_keys"] = ["client-key"]
    d.config.write_text(yaml.safe_dump(cfg))
    d.send(signal.SIGHUP)

    def refused(_: int) -> str | None:
        try:
            urllib.request.urlopen(completion(d.gateway, 2), timeout=30).close()
            return None
        except urllib.error.HTTPError as e:
            return e.headers["x-request-id"][:16] if e.code == 401 else None
    seen: set[str | None] = set()

    def both_refuse() -> bool:   # each worker applies the reload when its table comes: wait for both
        seen.update(refused(0) for _ in range(8))
        return len(seen - {None}) == 2
    wait_for(both_refuse, 15, "reload applied by both workers")
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(refused, range(40)))
    assert None not in answers and len(set(answers)) == 2
    # a hangup that reaches the workers too (a terminal's, `kill -HUP -- -PGID`): they serve on (they died of it)
    hung_up = worker_pids(d.proc.pid)
    for pid in hung_up:
        os.kill(pid, signal.SIGHUP)
    time.sleep(1.0)
    assert worker_pids(d.proc.pid) == hung_up and metric(d.metrics(), "slurmfleet_gateway_worker_restarts_total") == 1

    # SIGTERM: the workers stop accepting, let an open stream finish, and go with the daemon
    alive = worker_pids(d.proc.pid)
    got: list[bytes] = []

    def stream_to_the_end() -> None:
        with urllib.request.urlopen(completion(d.gateway, 400, True, "client-key"), timeout=30) as r:
            got.append(r.read())
    t = threading.Thread(target=stream_to_the_end)
    t.start()
    wait_for(lambda: in_flight(d) == 1, 5, "stream open")
    assert d.stop(signal.SIGTERM, timeout=40) == 0
    t.join(10)
    assert got and got[0].rstrip().endswith(b"data: [DONE]") and got[0].count(b'"text"') == 400
    assert not [p for p in alive if running(p)]


def running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_signal_while_the_daemon_starts_is_its_signal_not_its_end(tmp_path, fleet_name, sig):
    """A SIGHUP (a config tool's reload right after a start) or a SIGTERM while the gateway workers started ended
    the daemon at once, without a word (rc 129, 143): the handlers came with the last root task.  Now a SIGHUP
    is a reload once it serves, and a SIGTERM its orderly stop."""
    from conftest import DaemonProc
    config = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 0)], gateway={"workers": 2})
    d = DaemonProc(config)
    d.fh = open(d.log, "ab")
    d.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config", str(config)],
                              stdout=d.fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              cwd=ROOT)
    try:
        wait_for(lambda: "open-files limit" in d.log.read_text() or d.proc.poll() is not None, 30, "the start")
        d.send(sig)   # (before the workers serve, on a machine as slow as CI's: their start takes a second)
        if sig == signal.SIGTERM:
            assert d.proc.wait(60) == 0, d.log.read_text()[-3000:]
            assert "shutting down" in d.log.read_text()
        else:
            wait_for(lambda: "SIGHUP: reloading" in d.log.read_text() or d.proc.poll() is not None, 30, "the reload")
            assert d.proc.poll() is None, d.log.read_text()[-3000:]
            wait_for(d._up, 30, "the admin API")
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGTERM, timeout=30)


def test_a_second_sigterm_writes_the_reported_usage_down_before_it_exits(monkeypatch):
    """The second SIGTERM's exit came before the usage the gateway processes had reported was written down (the
    ledger is flushed every ~2 s): the tenancy's last reports, written, then the signal's own action.  The write
    is bounded (a hung state dir: logged, and the process ends all the same), and none is made beside the
    orderly stop's own (under way: it holds the file)."""
    import asyncio
    from types import SimpleNamespace

    from orchestrator.daemon import Daemon
    from orchestrator.fleet.lastwrite import LastWrite
    order: list[str] = []
    monkeypatch.setattr(signal, "raise_signal", lambda sig: order.append(f"raise {signal.Signals(sig).name}"))
    cfg = SimpleNamespace(daemon=SimpleNamespace(task_stop_timeout_s=0.5))

    async def second_sigterm(flush, started: bool = False) -> None:
        last = None if flush is None else LastWrite(SimpleNamespace(settle=lambda: order.append("reports taken")),
                                                    SimpleNamespace(flush=flush, path="usage.sqlite3"))
        if last is not None:
            last.started = started
        d = SimpleNamespace(stop=asyncio.Event(), last_write=last, cfg=cfg)
        d.stop.set()   # (the first SIGTERM's)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        try:
            Daemon._signalled(d, signal.SIGTERM, asyncio.Event())
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    asyncio.run(second_sigterm(lambda: order.append("usage written")))
    assert order == ["reports taken", "usage written", "raise SIGTERM"]
    order.clear()

    def broken():
        raise OSError("disk full")
    asyncio.run(second_sigterm(broken))   # (a ledger it cannot write: it exits all the same)
    assert order == ["reports taken", "raise SIGTERM"]
    order.clear()
    hung = threading.Event()
    t0 = time.monotonic()
    asyncio.run(second_sigterm(lambda: hung.wait(10)))   # (a hung state dir: it exits after the bound)
    hung.set()
    assert order == ["reports taken", "raise SIGTERM"] and time.monotonic() - t0 < 3
    order.clear()
    asyncio.run(second_sigterm(lambda: order.append("usage written"), started=True))   # (the stop's, under way)
    assert order == ["raise SIGTERM"]
    order.clear()
    asyncio.run(second_sigterm(None))   # (before the tenancy exists: a start that hangs)
    assert order == ["raise SIGTERM"]


def test_a_second_sigterm_ends_the_daemon_without_waiting_for_the_streams_grace(tmp_path, fleet_name, daemons):
    """SIGTERM: open streams get shutdown_grace_s (here 120 s).  A second SIGTERM was ignored: the only way out
    sooner was SIGKILL.  Now it is SIGTERM's own action, at once, and the log says so."""
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 1, simulator={"tokens_per_s": 5})],
                             gateway={"shutdown_grace_s": 120}))
    wait_for(lambda: len(d.ready("m")) == 1, 60, "READY")
    def stream() -> None:
        try:
            urllib.request.urlopen(completion(d.gateway, 2000, True), timeout=60).read()
        except (OSError, http.client.HTTPException):   # (cut by the exit: what this test asks)
            pass
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    wait_for(lambda: in_flight(d) == 1, 10, "stream open")
    d.send(signal.SIGTERM)
    wait_for(lambda: "shutting down" in d.log.read_text(), 10, "the orderly stop begun")
    time.sleep(1.0)
    assert d.proc.poll() is None   # (the stream's grace)
    t0 = time.monotonic()
    d.send(signal.SIGTERM)
    assert d.proc.wait(15) == -signal.SIGTERM and time.monotonic() - t0 < 10
    assert "SIGTERM again: exiting now" in d.log.read_text()
