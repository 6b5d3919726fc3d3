"""The batch series: the runner's stats() as Prometheus families, read at scrape time."""

from __future__ import annotations

import subprocess

from prometheus_client.parser import text_string_to_metric_families

from orchestrator.batches import ACTIVE, TERMINAL
from orchestrator.observability.metrics import BATCH_STATUSES, Metrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def stats(**over) -> dict:
    return {"batches": {s: 0 for s in BATCH_STATUSES} | {"in_progress": 2, "completed": 5, "failed": 1},
            "requests": {("m", "completed"): 40, ("m", "failed"): 3, ("gone", "completed"): 7},
            "tokens": {("m", "prompt"): 400, ("m", "completion"): 120},
            "queued": {"m": 17},
            "inflight": {"m": 8},
            "shards": {"pending": 1, "running": 2, "done": 3, "failed": 0}} | over


def test_the_statuses_are_the_stores_own():
    assert set(BATCH_STATUSES) == ACTIVE | TERMINAL and len(BATCH_STATUSES) == 8


def test_batch_series_from_the_runners_stats():
    calls = []
    metrics = Metrics()
    metrics.batch_stats = lambda: calls.append(1) or stats()   # what the daemon sets: the runner's stats
    metrics.init_model("m")
    metrics.init_model("idle")
    text = metrics.render().decode()
    assert calls == [1]   # read once per scrape
    got = samples(text)
    want = {
        ("slurmfleet_batches", (("status", "in_progress"),)): 2,
        ("slurmfleet_batches", (("status", "completed"),)): 5,
        ("slurmfleet_batches", (("status", "failed"),)): 1,
        ("slurmfleet_batches", (("status", "expired"),)): 0,
        ("slurmfleet_batch_requests_total", (("model", "m"), ("outcome", "completed"))): 40,
        ("slurmfleet_batch_requests_total", (("model", "m"), ("outcome", "failed"))): 3,
        ("slurmfleet_batch_requests_total", (("model", "gone"), ("outcome", "completed"))): 7,
        ("slurmfleet_batch_tokens_total", (("kind", "prompt"), ("model", "m"))): 400,
        ("slurmfleet_batch_tokens_total", (("kind", "completion"), ("model", "m"))): 120,
        ("slurmfleet_batch_queued_requests", (("model", "m"),)): 17,
        ("slurmfleet_batch_inflight_requests", (("model", "m"),)): 8,
        ("slurmfleet_batch_shards", (("state", "running"),)): 2,
        ("slurmfleet_batch_shards", (("state", "done"),)): 3,
    }
    assert {k: got.get(k) for k in want} == want
    assert sum(v for (n, _), v in got.items() if n == "slurmfleet_batches") == 8
    assert len([k for k in got if k[0] == "slurmfleet_batches"]) == 8
    assert len([k for k in got if k[0] == "slurmfleet_batch_shards"]) == 4
    # a configured model with no batch yet: every series at zero, so rate() works from its first batch
    for name, label, values in (("slurmfleet_batch_requests_total", "outcome", ("completed", "failed")),
                                ("slurmfleet_batch_tokens_total", "kind", ("prompt", "completion"))):
        for v in values:
            assert got[(name, tuple(sorted({"model": "idle", label: v}.items())))] == 0, (name, v)
    assert got[("slurmfleet_batch_queued_requests", (("model", "idle"),))] == 0
    assert got[("slurmfleet_batch_inflight_requests", (("model", "idle"),))] == 0
    assert 'model="gone",outcome="failed"' not in text   # no zero series invented for unconfigured models
    assert "# TYPE slurmfleet_batch_requests_total counter" in text
    assert "# TYPE slurmfleet_batch_queued_requests gauge" in text
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_partial_stats_fill_every_status_and_shard_state_with_zero():
    metrics = Metrics(batch_stats=lambda: {"batches": {"completed": 1}})
    got = samples(metrics.render().decode())
    batches = {dict(k[1])["status"]: v for k, v in got.items() if k[0] == "slurmfleet_batches"}
    assert batches == {s: (1 if s == "completed" else 0) for s in BATCH_STATUSES}
    shards = {dict(k[1])["state"]: v for k, v in got.items() if k[0] == "slurmfleet_batch_shards"}
    assert shards == {"pending": 0, "running": 0, "done": 0, "failed": 0}


def test_without_a_runner_the_families_are_there_empty():
    text = Metrics().render().decode()
    assert "# TYPE slurmfleet_batches gauge" in text
    assert "slurmfleet_batches{" not in text and "slurmfleet_batch_requests_total{" not in text
    assert "slurmfleet_batch_shards{" not in text
