"""Autoscaling on the real local SLURM cluster, simulator replicas: a request at zero is held and answered
(its sbatch follows within about a second), scale-up under load, no flapping at a threshold, scale-down and
scale to zero with no failed request, a scale-up that cannot start ends held requests with a 503 that names
it, and a daemon restart in the middle of a scale-up submits no duplicate."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import fleet_config, fleet_jobs, metric_sum, sim_model, slurm, wait_for

pytestmark = pytest.mark.cluster


def auto_model(name: str, fields: dict | None = None, **autoscale) -> dict:
    m = sim_model(name, simulator={"ttft_s": 0.01, "tokens_per_s": 50, "max_num_seqs": 16}, **(fields or {}))
    m.pop("replicas")
    m["autoscale"] = {"min_replicas": 0, "max_replicas": 3, "target_inflight_per_replica": 4, "window_s": 2,
                      "scale_up_delay_s": 2, "scale_down_delay_s": 8, "scale_to_zero_after_s": 12,
                      "cold_start_hold_s": 60, **autoscale}
    return m


def complete(d, model: str, max_tokens: int = 5, timeout: float = 90) -> tuple[int, dict, dict, float]:
    """One completion through the gateway: (status, headers, body, seconds)."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(d.gateway + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read()), time.monotonic() - t0


def submit_times(fleet: str) -> list[float]:
    out = slurm("squeue", "-h", "--name", f"slurmfleet-{fleet}", "-t", "all", "-O", "SubmitTime")
    return sorted(float(x) for x in out.split())


def decisions(d, model: str, direction: str) -> float:
    return metric_sum(d.metrics(), "slurmfleet_autoscale_decisions_total", model=model, direction=direction)


@pytest.mark.parametrize("workers", [1, 2])
def test_first_request_at_zero_is_held_and_answered(tmp_path, fleet_name, daemons, workers):
    # workers 2: the held request's urgent report comes from a gateway worker process
    # ticks 30 s apart: a submission within 10 s of the request comes from its urgent report, and an answer
    # within 25 s from the daemon ticking (and probing the new replica) faster while a request is held (bounds
    # with room for a loaded 2-core machine: the times themselves are printed)
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [auto_model("z")], gateway={"workers": workers},
                             daemon={"tick_interval_s": 30}))
    wait_for(lambda: d.status()["ticks"] >= 1, 20, "ticks")
    assert fleet_jobs(fleet_name) == [] and d.model("z")["autoscale"]["target"] == 0
    with urllib.request.urlopen(d.gateway + "/v1/models", timeout=5) as r:
        assert "z" in [m["id"] for m in json.loads(r.read())["data"]]   # listed at zero
    t_req = time.time()
    code, _, body, took = complete(d, "z")
    assert code == 200 and body["choices"][0]["text"], body
    assert len(submit_times(fleet_name)) == 1
    # the daemon submits on the held request's urgent report, not at its next tick (SLURM's SubmitTime has
    # whole seconds: the daemon's own log line says when sbatch returned, to the millisecond)
    line = next(ln for ln in d.logs().splitlines() if "submitted job" in ln)
    stamp, ms = line[:23].split(",")
    t_sub = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    print(f"cold start from zero (simulator, {workers} gateway process{'es' * (workers > 1)}): sbatch done {t_sub - t_req:.2f}s after the request, first answer "
          f"after {took:.2f}s")
    assert t_sub - t_req < 10   # target 1 s (printed above)
    assert took < 25, took       # not the next 30 s tick
    # a worker process's numbers arrive with its next report (every half second)
    m = wait_for(lambda: metric_sum(x := d.metrics(), "slurmfleet_cold_start_seconds_count", model="z") and x,
                 5, "the cold start counted")
    assert metric_sum(m, "slurmfleet_cold_start_seconds_count", model="z") == 1
    assert metric_sum(m, "slurmfleet_autoscale_decisions_total", model="z", direction="up", cause="cold_start") == 1
    assert metric_sum(m, "slurmfleet_replica_startup_seconds_count", model="z") == 1


def test_scale_up_under_load_no_flapping_then_down_and_to_zero_without_a_failed_request(tmp_path, fleet_name,
                                                                                          daemons):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [auto_model("u", min_replicas=1)]))
    wait_for(lambda: len(d.ready("u")) == 1, 60, "the minimum replica READY")
    c = openai.OpenAI(base_url=d.gateway + "/v1", api_key="x", max_retries=0, timeout=120)
    failures: list[str] = []
    served = [0]
    stop = threading.Event()
    clients = [threading.Event() for _ in range(12)]

    def client(active: threading.Event) -> None:
        while not stop.is_set():
            if not active.is_set():
                time.sleep(0.05)
                continue
            try:
                # 3 s streams (150 tokens at 50/s): a client's gap between two requests, long on a loaded
                # machine, is a small part of its time, so 12 clients are about 12 in flight (with 0.8 s
                # streams a CI run saw too few in flight at first and scaled up in two steps)
                s = c.completions.create(model="u", prompt="x", max_tokens=150, stream=True)
                text = "".join(ch.choices[0].text for ch in s if ch.choices)
                if not text:
                    failures.append("empty")
                served[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure counts
                failures.append(repr(exc))

    threads = [threading.Thread(target=client, args=(e,), daemon=True) for e in clients]
    for t in threads:
        t.start()
    try:
        # 12 streams in flight at 4 per replica: the maximum, 3
        for e in clients:
            e.set()
        wait_for(lambda: len(d.ready("u")) == 3, 90, "3 READY replicas under load")
        assert decisions(d, "u", "up") == 1      # one step, straight to what the load asks for
        # 8 streams = exactly 2 replicas' worth: one step down, then steady for longer than the delays
        for e in clients[8:]:
            e.clear()
        wait_for(lambda: d.model("u")["autoscale"]["target"] == 2, 60, "target 2")
        wait_for(lambda: len(fleet_jobs(fleet_name)) == 2, 60, "one replica drained away")
        ups, downs = decisions(d, "u", "up"), decisions(d, "u", "down")
        # an absence can only be watched for: one down delay and one window (the fake-clock tests in
        # test_autoscale.py hold a noisy threshold load for an hour); a flapping target would have moved
        a = d.cfg["models"][0]["autoscale"]
        time.sleep(a["scale_down_delay_s"] + a["window_s"] + 1)
        assert (decisions(d, "u", "up"), decisions(d, "u", "down")) == (ups, downs)
        assert d.model("u")["autoscale"]["target"] == 2
        # idle: back to the minimum, 1 (drained: no request fails)
        for e in clients:
            e.clear()
        wait_for(lambda: len(fleet_jobs(fleet_name)) == 1, 60, "down to the minimum")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [] and served[0] > 20
    # with min_replicas 0 after a reload (no replica restarted), the last one goes after the idle time
    doc = d.cfg
    doc["models"][0]["autoscale"]["min_replicas"] = 0
    (tmp_path / "f.yaml").write_text(json.dumps(doc))
    job = fleet_jobs(fleet_name)[0]["job_id"]
    # (the step down to the minimum above is the idle rule's too when it comes before the load rule's)
    idle = metric_sum(d.metrics(), "slurmfleet_autoscale_decisions_total", model="u", cause="idle")
    assert d.request("POST", "/admin/reload")[1]["ok"]
    wait_for(lambda: fleet_jobs(fleet_name) == [], 60, "scaled to zero")
    assert metric_sum(d.metrics(), "slurmfleet_autoscale_decisions_total", model="u", cause="idle") == idle + 1
    assert job not in {j["job_id"] for j in fleet_jobs(fleet_name)}


def test_a_scale_up_that_cannot_start_ends_held_requests_with_a_503_naming_it(tmp_path, fleet_name, daemons):
    # partition 'short' allows 5 minutes: a 10-minute job pends there forever (blocked at once);
    # 'gpu' with the job held by an operator: held requests wait out the hold and learn why (requeueable jobs,
    # so that a job SLURM started before the test could hold it is put back, held)
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [
        auto_model("short", {"partition": "short", "time_limit": 10}),
        auto_model("held", cold_start_hold_s=6)], cluster={"requeue": True}))
    wait_for(lambda: d.status()["ticks"] > 2, 20, "ticks")
    code, headers, body, took = complete(d, "short")
    assert code == 503 and headers.get("Retry-After"), body
    assert "cannot start" in body["error"]["message"] and "Partition" in body["error"]["message"], body
    assert took < 30
    result = []
    t = threading.Thread(target=lambda: result.append(complete(d, "held")))
    t.start()
    jobs = wait_for(lambda: [j for j in fleet_jobs(fleet_name) if "model=held;" in j["comment"]
                             and j["state"] in ("PENDING", "RUNNING")], 10, "the scale-up job")
    jid = jobs[0]["job_id"]
    slurm("scontrol", "hold", jid, check=False)        # pending: held (a running job is not pending any more)
    if slurm("squeue", "-h", "-j", jid, "-o", "%T", check=False).strip() != "PENDING":
        slurm("scontrol", "requeuehold", jid)            # started meanwhile: back to the queue, held
    t.join(30)
    code, headers, body, took = result[0]
    assert code == 503 and headers.get("Retry-After") == "30", body
    msg = body["error"]["message"]
    assert "within 6s" in msg and jid in msg and "PENDING" in msg, msg
    assert "held" in msg.lower(), msg   # JobHeldUser/JobHeldAdmin, or "job requeued in held state"


def test_a_daemon_killed_mid_scale_up_submits_no_duplicate(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [auto_model("r", cold_start_hold_s=5)])
    d = daemons(path)
    wait_for(lambda: d.status()["ticks"] > 2, 20, "ticks")
    def held() -> None:
        try:
            complete(d, "r", timeout=10)
        except OSError:   # the daemon holding it is killed
            pass
    t = threading.Thread(target=held, daemon=True)
    t.start()
    jobs = wait_for(lambda: fleet_jobs(fleet_name), 10, "the scale-up job")
    d.stop(signal.SIGKILL)
    d2 = daemons(path)
    wait_for(lambda: d2.status()["ticks"] > 6, 30, "ticks of the new daemon")
    assert [j["job_id"] for j in fleet_jobs(fleet_name)] == [j["job_id"] for j in jobs]
    assert d2.model("r")["autoscale"]["target"] == 1
