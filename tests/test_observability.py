"""Metrics through a real Prometheus: every dashboard query returns data, rules load and fire, names lint."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from conftest import (ROOT, cluster_exclusive, fleet_config, fleet_jobs, free_port, metric_sum, sim_model, slurm,
                      wait_for)

pytestmark = pytest.mark.cluster
GRAFANA = ROOT / "grafana"


def prom_get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((GRAFANA / "dashboards" / "slurmfleet-fleet.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace('=~"$model"', '=~".*"')


def prom_value(base: str, query: str) -> float | None:
    """The value of a query that gives one series (None when it gives none)."""
    res = prom_get(base, "/api/v1/query", query=query)["data"]["result"]
    assert len(res) <= 1, (query, res)
    return float(res[0]["value"][1]) if res else None


def panel_target(panel_id: int, legend: str) -> str:
    """The query of a dashboard panel's target whose legend holds ``legend``, as Prometheus takes it (every
    model, rates over 5m)."""
    dash = json.loads((GRAFANA / "dashboards" / "slurmfleet-fleet.json").read_text())
    [expr] = [t["expr"] for p in dash["panels"] if p["id"] == panel_id for t in p.get("targets", [])
              if legend in t["legendFormat"]]
    return expr.replace("$__rate_interval", "5m").replace('=~"$model"', '=~".*"')


def promql_test(tmp_path: Path, series: dict[str, str], exprs: list[tuple[str, str, list[tuple[str, float]]]]) -> str:
    """``promtool test rules`` of queries over input series (one a minute): (expr, eval time, the samples it must
    give); promtool's report, or "" when each query gave exactly its samples."""
    doc = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "promql_expr_test": [{"expr": e, "eval_time": at, "exp_samples": [{"labels": lb, "value": v} for lb, v in want]}
                             for e, at, want in exprs]}]}
    f = tmp_path / "queries.test.yml"
    f.write_text(yaml.safe_dump(doc))
    r = subprocess.run(["promtool", "test", "rules", str(f)], capture_output=True, text=True)
    return "" if r.returncode == 0 else r.stdout + r.stderr


def rules_for_test(rules: Path) -> str:
    """The production rules with every `for:` cut to 0s, and the scale-up pending threshold to 1s, so that
    they can fire within a test; and SlurmfleetModelNoReadyReplica's look at past READY replicas sampled every
    second, not at whole minutes: a test that crossed a minute's start while its model was starting (not yet
    READY) and then lost its replicas before the next one made the model look new (never READY), whose alert
    waits 25 minutes (the rule's own promtool tests cover the minute steps)."""
    doc = yaml.safe_load(rules.read_text())
    for rule in doc["groups"][0]["rules"]:
        rule["for"] = "0s"
        if rule["alert"] == "SlurmfleetModelNoReadyReplica":
            rule["expr"], n = re.subn(r"\[30m:1m\]", "[30m:1s]", rule["expr"])
            assert n == 2, rule["expr"]
        if rule["alert"] == "SlurmfleetScaleUpPending":
            rule["expr"], n = re.subn(r"(slurmfleet_job_oldest_pending_seconds\s*>\s*)\d+", r"\g<1>1", rule["expr"])
            assert n == 1, rule["expr"]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture
def prometheus(tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("prometheus is not installed (apt-get install prometheus)")
    procs = []

    def start(target_port: int, rules: Path) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "slurmfleet", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }))
        p = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "prometheus.log", "w"))
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(base), 30, "prometheus ready")
        return base

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def _ready(base: str) -> bool:
    try:
        urllib.request.urlopen(base + "/-/ready", timeout=1)
        return True
    except OSError:
        return False


def test_rules_check_and_unit_tests():
    names = re.findall(r"^\s*- alert: (\w+)", (GRAFANA / "alerts.yml").read_text(), re.M)
    r = subprocess.run(["promtool", "check", "rules", str(GRAFANA / "alerts.yml")], capture_output=True, text=True)
    assert r.returncode == 0 and f"SUCCESS: {len(names)} rules found" in r.stdout, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", (GRAFANA / "alerts.test.yml").read_text()))
    assert set(names) <= tested, f"alerts without a unit test: {set(names) - tested}"
    r = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], capture_output=True, text=True, cwd=GRAFANA)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_stream_that_stayed_on_its_draining_replica_is_not_drawn_as_a_move(tmp_path):
    """outcome="stayed" (a draining replica's stream with nowhere to go) is no move: the moves panel leaves it
    out and draws it as a series of its own; every model has its series from 0, as every other outcome."""
    from orchestrator.observability.metrics import RequestCollector
    series = {'slurmfleet_stream_migrations_total{model="m",cause="drain",outcome="stayed"}': "0+60x10",
              'slurmfleet_stream_migrations_total{model="m",cause="reset",outcome="ok"}': "0+120x10"}
    assert promql_test(tmp_path, series, [
        (panel_target(36, "{{cause}} -> {{outcome}}"), "5m", [('{model="m",cause="reset",outcome="ok"}', 2)]),
        (panel_target(36, "stayed"), "5m", [('{model="m"}', 1)])]) == ""
    fams = {f.name: f for f in RequestCollector(lambda: [], lambda: ["m"]).collect()}
    zero = {(s.labels["cause"], s.labels["outcome"]) for s in fams["slurmfleet_stream_migrations"].samples}
    assert ("drain", "stayed") in zero and ("abort", "ok") in zero
    assert "stayed:" in fams["slurmfleet_stream_migrations"].documentation


def test_kv_event_gaps_are_drawn_per_gateway_process(tmp_path):
    """Each gateway process subscribes to every replica's KV events: the kv series are sums over processes (their
    help says so), and the panel's gaps are per process: 2 workers that each see the same 60 gaps a minute draw
    60 a minute, not 120."""
    from orchestrator.observability.metrics import RequestCollector
    series = {'slurmfleet_kv_event_gaps_total{model="m",outcome="replayed",job="slurmfleet",instance="h:8081"}':
              "0+120x10",
              'slurmfleet_kv_feed_incidents_total{model="m",kind="rebuild",job="slurmfleet",instance="h:8081"}':
              "0+12x10",
              'slurmfleet_kv_index_approximate_replicas{model="m",job="slurmfleet",instance="h:8081"}': "3x10",
              'slurmfleet_gateway_processes{job="slurmfleet",instance="h:8081"}': "2x10"}
    assert promql_test(tmp_path, series, [(panel_target(39, "gaps"), "5m", [('{model="m",outcome="replayed"}', 300)]),
                                          (panel_target(39, "feed"), "5m", [('{model="m",kind="rebuild"}', 30)]),
                                          (panel_target(39, "approximate"), "5m", [('{model="m"}', 3)])]) == ""
    fams = {f.name: f.documentation for f in RequestCollector(lambda: [], lambda: ["m"]).collect()}
    for name in ("slurmfleet_kv_events", "slurmfleet_kv_event_gaps", "slurmfleet_kv_event_lag_seconds",
                 "slurmfleet_kv_feed_incidents"):
        assert "summed over gateway processes, each of which subscribes" in fams[name], name


async def test_batch_lines_failed_are_the_services_failures_not_a_tenants_4xx_or_cancel(tmp_path, monkeypatch):
    """slurmfleet_batch_requests_total{outcome="failed"}, which SlurmfleetBatchRequestsFailing reads, counts the
    service failing (a 5xx after the retries, a 408); a line's own 4xx is client_error and a line in flight when
    its tenant cancels the batch is cancelled.  The batch's request_counts still count every error line as
    failed (OpenAI's)."""
    from types import SimpleNamespace

    from orchestrator.batches import BatchStore, new_batch
    from orchestrator.batchfiles import FileStore
    from orchestrator.fleet import batchrun
    from orchestrator.observability.metrics import Metrics
    monkeypatch.setattr(batchrun, "BROKEN_TRIES", 1)   # (a 500 is the line's answer at once, not after back-offs)
    statuses = [200, 400, 404, 408, 500, None]         # the last one hangs until the cancel
    sent = []

    class Session:
        def post(self, url, data, headers, timeout):
            class Ctx:
                async def __aenter__(self):
                    status = statuses[json.loads(data)["prompt"]]
                    sent.append(status)
                    if status is None:
                        await asyncio.Event().wait()   # (until the cancel aborts it)
                    return SimpleNamespace(status=status, json=self.json, headers={})

                async def json(self, content_type=None):
                    return {"error": {"message": "no"}}

                async def __aexit__(self, *exc):
                    return False
            return Ctx()
    r = batchrun.BatchRunner(BatchStore(tmp_path / "batches"), FileStore(tmp_path / "files"),
                             url=lambda: "http://127.0.0.1:9", secret="x", session=Session(),
                             table=lambda: SimpleNamespace(models={}), queued=lambda: {}, max_inflight=lambda m: 1)
    up = r.files.upload()
    up.write(b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": i}}).encode() + b"\n" for i in range(6)))
    f = up.commit("alice", "batch", "in.jsonl", 6, "/v1/completions", ["m"])
    rec = new_batch("alice", f["id"], "/v1/completions", "24h", None, 6, ["m"])
    rec["status"] = "in_progress"
    r.store.save(rec)
    task = asyncio.create_task(r.run())   # (its scans start the batch, and find the cancel's marker)
    try:
        await asyncio.wait_for(_until(lambda: None in sent), 10)
        r.store.request_cancel(rec["id"])
        await asyncio.wait_for(_until(lambda: r.store.load(rec["id"])["status"] == "cancelled" and not r.runs), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    got = r.store.load(rec["id"])
    assert got["status"] == "cancelled" and got["request_counts"] == {"total": 6, "completed": 1, "failed": 5}, got
    assert r.stats()["requests"] == {("m", "completed"): 1, ("m", "client_error"): 2, ("m", "failed"): 2,
                                     ("m", "cancelled"): 1}
    metrics = Metrics(batch_stats=r.stats)
    metrics.init_model("m")
    text = metrics.render().decode()
    assert 'slurmfleet_batch_requests_total{model="m",outcome="failed"} 2.0' in text
    assert "client_error: a 4xx" in text   # (its help says what each outcome counts)


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def test_dashboards_metrics_and_alerts_against_prometheus(tmp_path, fleet_name, daemons, prometheus):
    # obs-auto is autoscaled from zero: its first request is held through a cold start
    auto = sim_model("obs-auto", autoscale={"min_replicas": 0, "max_replicas": 1, "cold_start_hold_s": 60})
    del auto["replicas"]
    # obs-b routes kv_aware: its job publishes KV-cache events, the gateway tokenizes with its tokenizer
    from orchestrator.devtools.tinymodel import build_tokenizer
    tok = build_tokenizer(tmp_path / "tok")
    # (obs-b's fallback is never taken here: its series is there from 0, for the fallbacks panel)
    models = [sim_model("obs-a", 2), sim_model("obs-b", 1, simulator={"tokens_per_s": 100}, routing="kv_aware",
                                                  model_path=str(tok), gateway={"fallbacks": ["obs-a"]}), auto]
    # the clients' key ("none") has a token budget, and its group another, for the Tenants row's budget series
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, models, gateway={
        "api_keys": [{"name": "obs", "key": "none", "budget_tokens": 10**9, "group": "obs-lab"}],
        "groups": {"obs-lab": {"budget_tokens": 10**9}}}))
    rules = tmp_path / "alerts.yml"
    rules.write_text(rules_for_test(GRAFANA / "alerts.yml"))
    base = prometheus(int(d.admin.rsplit(":", 1)[1]), rules)

    def cold_start() -> float:
        c = openai.OpenAI(base_url=d.gateway + "/v1", api_key="none", max_retries=0, timeout=60)
        t = time.monotonic()
        c.completions.create(model="obs-auto", prompt="x", max_tokens=3)
        return time.monotonic() - t

    with ThreadPoolExecutor(1) as pool:  # the cold start runs while obs-a and obs-b come up
        held = pool.submit(cold_start)
        # held in the gateway for the second or two the job takes to pend and start (too short to be sure a 1s
        # scrape sees it: read from the daemon)
        wait_for(lambda: held.done() or metric_sum(d.metrics(), "slurmfleet_requests_queued", model="obs-auto") == 1,
                 10, "the request held", interval=0.05)
        assert not held.done(), held.result()
        wait_for(lambda: len(d.ready("obs-a")) == 2 and len(d.ready("obs-b")) == 1, 60, "replicas READY")
        held_s = held.result(60)
    assert len(d.ready("obs-auto")) == 1

    # a GPU reading as a job's NVML exporter writes it (captured on an H200), for a running job of obs-a
    job = d.ready("obs-a")[0]
    reading = json.loads((ROOT / "tests" / "data" / "nvml-h200.json").read_text())
    gpu_file = Path(d.cfg["state_dir"]) / "gpu" / f"{job['job_id']}.9.json"  # rank 0's file is the job's own
    stop = threading.Event()

    def traffic():
        c = openai.OpenAI(base_url=d.gateway + "/v1", api_key="none", max_retries=0)
        while not stop.is_set():
            gpu_file.write_text(json.dumps({**reading, "job_id": job["job_id"], "time": time.time()}))
            for m in ("obs-a", "obs-b"):   # a prompt of a few blocks, the same each time: prefix-cache hits
                c.completions.create(model=m, prompt="the same long prompt of a few blocks " * 12, max_tokens=3)
                for _ in c.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=3, stream=True):
                    pass
            time.sleep(0.1)

    t = threading.Thread(target=traffic)
    t.start()
    # a batch of obs-a through the daemon's runner, for the Batches row
    client = openai.OpenAI(base_url=d.gateway + "/v1", api_key="none", max_retries=0, timeout=30)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "obs-a", "prompt": f"batch line {i} " * (i + 1), "max_tokens": 3}} for i in range(12)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    try:
        results = {}

        def empty_queries() -> list[tuple[str, str]]:
            for title, expr in dashboard_queries():
                res = prom_get(base, "/api/v1/query", query=grafana_to_promql(expr))
                assert res["status"] == "success", (title, expr, res)
                results[(title, expr)] = len(res["data"]["result"])
            return [k for k, n in results.items() if n == 0]

        # each query has data once Prometheus has scraped a few times under traffic (rates need two samples)
        deadline = time.monotonic() + 60
        while (empty := empty_queries()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not empty, f"queries with no data: {empty}"
        print(f"{len(results)} dashboard queries over {len({k[0] for k in results})} panels returned data")
        batch = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed",
                                                                                  "expired") and b, 60, "batch done")
    finally:
        stop.set()
        t.join()

    # the Batches row's series carry the batch: its 12 lines answered, its tokens as the output file has them
    assert batch.status == "completed" and batch.request_counts.completed == 12, batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    prompt = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    completion = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    assert len(out) == 12 and prompt > 12 and completion == 12 * 3
    want = {'slurmfleet_batch_requests_total{model="obs-a", outcome="completed"}': 12,
            'slurmfleet_batch_requests_total{model="obs-a", outcome="failed"}': 0,
            'slurmfleet_batch_tokens_total{model="obs-a", kind="prompt"}': prompt,
            'slurmfleet_batch_tokens_total{model="obs-a", kind="completion"}': completion,
            'slurmfleet_batches{status="completed"}': 1,
            'sum(slurmfleet_batches)': 1,
            'sum(slurmfleet_batch_requests_total{model!="obs-a"})': 0,   # obs-b and obs-auto at 0 from the start
            'sum(slurmfleet_batch_queued_requests)': 0,
            'sum(slurmfleet_batch_inflight_requests)': 0,
            'sum(slurmfleet_batch_shards)': 0,   # shared mode: no shard
            'slurmfleet_usage_ledger_errors_total': 0,   # (the ledger took the batch owner's charge, and the rest)
            'slurmfleet_state_dir_min_free_bytes': 1 << 30}   # (batches.min_free_bytes's default)
    seen: dict[str, float | None] = {}

    def scraped() -> bool:
        seen.update({q: prom_value(base, q) for q in want})
        return seen == want
    with contextlib.suppress(AssertionError):
        wait_for(scraped, 15, "the batch's series scraped")
    assert seen == want
    assert prom_value(base, 'count(slurmfleet_batch_queued_requests)') == 3   # every configured model
    assert prom_value(base, 'slurmfleet_state_dir_free_bytes') > 0

    # the autoscaling series carry the cold start: one decision up, one observation of
    # each histogram, and the cold start (request -> first byte) no shorter than its parts
    def one(metric: str) -> float | None:
        return prom_value(base, f'{metric}{{model="obs-auto"}}')

    wait_for(lambda: one("slurmfleet_replica_startup_seconds_count") == 1, 10, "obs-auto's start-up scraped")
    assert prom_value(base, 'slurmfleet_autoscale_decisions_total{model="obs-auto", direction="up", '
                            'cause="cold_start"}') == 1
    assert prom_value(base, 'sum(slurmfleet_autoscale_decisions_total{model="obs-auto"})') == 1
    assert one("slurmfleet_autoscale_target_replicas") == 1
    for metric in ("cold_start", "request_queue_wait", "job_pending", "replica_startup"):
        assert one(f"slurmfleet_{metric}_seconds_count") == 1, metric
    cold, wait, pending, startup = (one(f"slurmfleet_{m}_seconds_sum") for m in (
        "cold_start", "request_queue_wait", "job_pending", "replica_startup"))
    print(f"cold start {cold:.2f}s (client {held_s:.2f}s): held {wait:.2f}s, pending {pending:.0f}s, "
          f"start-up {startup:.2f}s")
    assert wait <= cold <= held_s
    assert cold >= pending + startup - 2  # SLURM's submit and start times are whole seconds

    gpu = prom_get(base, "/api/v1/query", query="slurmfleet_gpu_power_watts")["data"]["result"]
    assert gpu and gpu[0]["metric"]["model"] == "obs-a" and float(gpu[0]["value"][1]) == pytest.approx(691.199)

    text = d.metrics()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for line in text.splitlines():
        if line.startswith("slurmfleet_") and "{" in line:
            labels = set(re.findall(r'(\w+)="', line))
            assert not labels & {"job_id", "request_id", "job"}, line

    # no READY replica: the partition goes down, the jobs are cancelled, replacements pend (obs-auto's too:
    # a replica of its target that stays PENDING)
    with cluster_exclusive():  # a partition DOWN holds every new job of every test
        try:
            slurm("scontrol", "update", "partitionname=gpu", "state=down")
            for j in fleet_jobs(fleet_name):
                if "model=obs-b;" in j["comment"] or "model=obs-auto;" in j["comment"]:
                    slurm("scancel", j["job_id"])

            def firing() -> dict[str, set[str]]:
                out: dict[str, set[str]] = {}
                for a in prom_get(base, "/api/v1/alerts")["data"]["alerts"]:
                    if a["state"] == "firing":
                        out.setdefault(a["labels"]["alertname"], set()).add(a["labels"].get("model"))
                return out

            want = {"SlurmfleetModelNoReadyReplica": {"obs-b", "obs-auto"}, "SlurmfleetScaleUpPending": {"obs-auto"}}
            last: dict[str, set[str]] = {}

            def all_fired() -> bool:
                last.clear()
                last.update(firing())
                return all(v <= last.get(k, set()) for k, v in want.items())

            wait_for(all_fired, 30, "SlurmfleetModelNoReadyReplica and SlurmfleetScaleUpPending firing")
            assert {k: last[k] for k in want} == want, last
        finally:
            slurm("scontrol", "update", "partitionname=gpu", "state=up")


def test_status_shows_engine_and_gpu_columns(tmp_path, fleet_name, daemons):
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("st", 1)]))
    job = wait_for(lambda: d.ready("st"), 60, "READY")[0]
    reading = json.loads((ROOT / "tests" / "data" / "nvml-h200.json").read_text())
    (Path(d.cfg["state_dir"]) / "gpu" / f"{job['job_id']}.1.json").write_text(
        json.dumps({**reading, "time": time.time() + 3600}))
    rep = wait_for(lambda: (r := d.ready("st")[0])["gpu_utilization"] is not None and r["engine_running"] is not None
                   and r, 20, "engine and GPU readings in status")
    assert rep["gpu_utilization"] == 1.0 and rep["gpus"] == 1 and rep["kv_cache_usage"] == 0.0
    # the job's own exporter ran on a node with no GPU: it reported nothing rather than inventing values
    own_file = Path(d.cfg["state_dir"]) / "gpu" / f"{job['job_id']}.0.json"
    own = json.loads(wait_for(lambda: own_file.exists() and own_file.read_text(), 10, "the job's own gpu file"))
    assert own["gpus"] == [] and "NVML" in own["error"] and own["job_id"] == job["job_id"]
