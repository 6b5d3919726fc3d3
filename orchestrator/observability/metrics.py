"""slurmfleet's Prometheus metrics: one registry per daemon, no module globals.

Labels stay bounded: model, slot (a replica's stable number), state, reason,
status code, command, and an API key's configured name (never its secret).  Job ids and request ids
never become labels.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..fleet.usagequery import KeyUsage
from ..reqstats import (COUNTERS, GATEWAY_ANSWERS, GAUGES, HISTOGRAMS, MIGRATION_CAUSES,
                        MIGRATION_OUTCOMES, RETRY_REASONS, RequestStats)
from .keymetrics import KeyCollector

SCALE_CAUSES = ("cold_start", "load", "engine_pressure", "idle", "bounds")
BACKOFF_CAUSES = ("crash", "submit_limit", "partition_closed")   # why a model may not submit yet (slurmfleet_model_backoff_seconds)
RESTART_REASONS = ("failed", "node_lost", "time_limit", "unhealthy", "config_change", "cancelled", "preempted")
ENGINE_SERIES = (  # (key in the scrape, metric, type, help)
    ("running", "slurmfleet_engine_requests_running", "gauge", "vllm:num_requests_running of the replica."),
    ("waiting", "slurmfleet_engine_requests_waiting", "gauge", "vllm:num_requests_waiting of the replica."),
    ("kv", "slurmfleet_engine_kv_cache_usage_ratio", "gauge", "vllm:kv_cache_usage_perc (0-1) of the replica."),
    ("prompt", "slurmfleet_engine_prompt_tokens", "counter", "vllm:prompt_tokens_total of the replica's engine."),
    ("generation", "slurmfleet_engine_generation_tokens", "counter",
     "vllm:generation_tokens_total of the replica's engine."),
    ("prefix_queries", "slurmfleet_engine_prefix_cache_queries_tokens", "counter",
     "vllm:prefix_cache_queries_total (prompt tokens looked up in the prefix cache) of the replica's engine."),
    ("prefix_hits", "slurmfleet_engine_prefix_cache_hits_tokens", "counter",
     "vllm:prefix_cache_hits_total (prompt tokens found in the prefix cache) of the replica's engine."),
)
GPU_SERIES = (
    ("utilization_ratio", "slurmfleet_gpu_utilization_ratio", "GPU utilization (0-1), from NVML."),
    ("memory_used_bytes", "slurmfleet_gpu_memory_used_bytes", "GPU memory used, NVML's count (includes reserved)."),
    ("memory_total_bytes", "slurmfleet_gpu_memory_total_bytes", "GPU memory in total."),
    ("temperature_celsius", "slurmfleet_gpu_temperature_celsius", "GPU temperature."),
    ("power_watts", "slurmfleet_gpu_power_watts", "GPU power draw."),
)
PENDING_BUCKETS = (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)   # (0.5 s to a day)
BATCH_STATUSES = (  # orchestrator.batches: ACTIVE, then TERMINAL
    "validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired", "cancelled")
SHARD_STATES = ("pending", "running", "done", "failed")


class Metrics:
    """All metrics of one daemon."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 request_stats: Callable[[], Iterable[dict]] = lambda: [],
                 key_usage: Callable[[], KeyUsage | None] = lambda: None,
                 batch_stats: Callable[[], dict | None] = lambda: None,
                 storage: Callable[[], dict | None] = lambda: None):
        r = self.registry = registry or CollectorRegistry()
        # fleet
        self.desired = Gauge("slurmfleet_replicas_desired", "Replicas the config asks for.", ["model"], registry=r)
        self.replicas = Gauge("slurmfleet_replicas", "Replicas by derived state.", ["model", "state"], registry=r)
        self.submissions = Counter("slurmfleet_job_submissions_total", "sbatch calls by result.",
                                   ["model", "result"], registry=r)
        self.restarts = Counter("slurmfleet_replica_restarts_total", "Replicas replaced, by reason.",
                                ["model", "reason"], registry=r)
        self.tick_seconds = Histogram("slurmfleet_reconcile_duration_seconds", "Reconcile tick duration.",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                      registry=r)   # (a tick waits for squeue: up to its command_timeout_s, 30 s)
        self.tick_errors = Counter("slurmfleet_reconcile_errors_total", "Ticks that could not read SLURM.", registry=r)
        self.slurm_seconds = Histogram("slurmfleet_slurm_command_duration_seconds", "SLURM command duration.",
                                       ["command"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                       registry=r)
        self.slurm_errors = Counter("slurmfleet_slurm_command_errors_total", "SLURM commands that failed.",
                                    ["command"], registry=r)
        self.backoff = Gauge("slurmfleet_model_backoff_seconds", "Seconds until the model may submit again, by "
                             "cause: crash (its jobs fail early), submit_limit (SLURM refuses more jobs: a job "
                             "count limit) or partition_closed (its partition is drained or inactive); the other "
                             "causes' series are 0.", ["model", "cause"], registry=r)
        self.blocked = Gauge("slurmfleet_model_blocked", "1 when the model cannot be scheduled as configured.",
                             ["model"], registry=r)
        # queue
        self.jobs = Gauge("slurmfleet_slurm_jobs", "This fleet's SLURM jobs by state and pending reason.",
                          ["model", "slurm_state", "reason"], registry=r)
        self.pending_seconds = Histogram("slurmfleet_job_pending_seconds", "Time jobs spent pending before start.",
                                         ["model"], buckets=PENDING_BUCKETS, registry=r)
        self.startup_seconds = Histogram("slurmfleet_replica_startup_seconds",
                                         "Time from a job's start (RUNNING) to its engine's first passed probe (READY).",
                                         ["model"], buckets=PENDING_BUCKETS, registry=r)
        # autoscaling
        self.autoscale_target = Gauge("slurmfleet_autoscale_target_replicas",
                                      "The autoscaler's replica target (autoscaled models only).", ["model"],
                                      registry=r)
        self.scale_decisions = Counter("slurmfleet_autoscale_decisions_total",
                                       "Autoscaler target changes by direction (up, down) and cause (cold_start, "
                                       "load, engine_pressure, idle, bounds).", ["model", "direction", "cause"],
                                       registry=r)
        self.oldest_pending = Gauge("slurmfleet_job_oldest_pending_seconds",
                                    "Age of the model's oldest pending job (0 when none pends).", ["model"], registry=r)
        self.time_left = Gauge("slurmfleet_replica_time_left_seconds", "Seconds before the replica's time limit.",
                               ["model", "slot"], registry=r)
        self.replica_up = Gauge("slurmfleet_replica_ready", "1 when a replica in this slot is READY, 0 while the slot's is queued, starting, unhealthy or failed.",
                                ["model", "slot"], registry=r)
        self.gateway_processes = Gauge(
            "slurmfleet_gateway_processes", "Gateway processes serving clients (the daemon itself, or its workers).",
            registry=r)
        self.worker_restarts = Counter("slurmfleet_gateway_worker_restarts_total",
                                       "Gateway worker processes that died and were started again.", registry=r)
        # config reloads (SIGHUP, `slurmfleet reload`): a rejected one leaves the fleet on its last good file
        self.reloads = Counter("slurmfleet_config_reloads_total", "Config reloads by result (applied, rejected: "
                               "the fleet runs on its last good file).", ["result"], registry=r)
        self.reload_ok = Gauge("slurmfleet_config_last_reload_successful", "0 when the last config reload was "
                               "rejected (the fleet runs on its last good file), else 1.", registry=r)
        self.reload_ok.set(1)
        for result in ("applied", "rejected"):
            self.reloads.labels(result)
        self.last_reload: dict | None = None   # the last reload's result, for the status (None: none yet)
        # requests: recorded lock-free by every gateway process, summed at scrape time from their reports
        self.request_stats = request_stats
        # per API key: from the fleet's usage ledger and the gateway reports (orchestrator.fleet.usagequery.key_usage)
        self.key_usage = key_usage
        # batches: the batch runner's stats() (orchestrator.fleet.batchrun), read at scrape time
        self.batch_stats = batch_stats
        # the state dir's free space and the usage ledger's health (see StorageCollector), read at scrape time
        self.storage = storage
        # engine and GPU readings, re-exported from the latest scrape (see LiveCollector)
        self.engine: dict[tuple[str, str], dict[str, float]] = {}
        self.gpus: dict[tuple[str, str, str, str, str], dict[str, float]] = {}   # (model, slot, node, gpu, job)
        self._initialised: set[str] = set()
        self._autoscaled: set[str] = set()
        r.register(LiveCollector(self))
        r.register(RequestCollector(lambda: self.request_stats(), lambda: self._initialised))
        r.register(KeyCollector(lambda: self.key_usage()))
        r.register(BatchCollector(lambda: self.batch_stats(), lambda: self._initialised))
        r.register(StorageCollector(lambda: self.storage()))

    def init_model(self, model: str) -> None:
        """Create every bounded label combination of a model at 0, so rates exist before the first event."""
        if model in self._initialised:
            return
        self._initialised.add(model)
        for result in ("ok", "error", "rejected"):
            self.submissions.labels(model, result)
        for reason in RESTART_REASONS:
            self.restarts.labels(model, reason)
        self.pending_seconds.labels(model)
        self.startup_seconds.labels(model)

    def init_autoscaled(self, model: str, target: int) -> None:
        """An autoscaled model's target, and its decision counters from 0 (a first decision is a rise)."""
        self.autoscale_target.labels(model).set(target)
        if model in self._autoscaled:
            return
        self._autoscaled.add(model)
        for direction, causes in (("up", ("cold_start", "load", "engine_pressure", "bounds")),
                                  ("down", ("load", "idle", "bounds"))):
            for cause in causes:
                self.scale_decisions.labels(model, direction, cause)

    def forget_autoscaled(self, model: str) -> None:
        """No longer autoscaled (or gone): no target series (the counters stay)."""
        try:
            self.autoscale_target.remove(model)
        except KeyError:
            pass

    def set_backoff(self, model: str, cause: str, seconds: float) -> None:
        for c in BACKOFF_CAUSES:
            self.backoff.labels(model, c).set(seconds if c == cause else 0.0)

    def forget_models(self, configured: set[str]) -> None:
        """Models a reload removed: no gauge series of theirs (an alert on one would fire for ever) and no
        zero-initialised request series (counters with counts stay until the daemon restarts)."""
        for model in self._initialised - configured:
            for g, labels in ((self.desired, [(model,)]), (self.oldest_pending, [(model,)]), (self.blocked, [(model,)]),
                              (self.backoff, [(model, c) for c in BACKOFF_CAUSES])):
                for lv in labels:
                    try:
                        g.remove(*lv)
                    except KeyError:
                        pass
        self._initialised &= configured

    async def recorded_reload(self, work: Awaitable[dict]) -> dict:
        """Run a reload (``work``: its reply) and record its result; one that raised is a rejected one."""
        try:
            result = await work
        except Exception as exc:
            self.reloaded({"ok": False, "errors": [f"{type(exc).__name__}: {exc}"]}, time.time())
            raise
        self.reloaded(result, time.time())
        return result

    def reloaded(self, result: dict, now: float) -> None:
        """A reload's result (the admin API's reply): counted, and kept for the status."""
        ok = bool(result.get("ok"))
        self.reloads.labels("applied" if ok else "rejected").inc()
        self.reload_ok.set(1 if ok else 0)
        self.last_reload = {"ok": ok, "time": now, "errors": list(result.get("errors") or [])}

    def observe_slurm(self, command: str, seconds: float, ok: bool) -> None:
        self.slurm_seconds.labels(command).observe(seconds)
        if not ok:
            self.slurm_errors.labels(command).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LiveCollector:
    """Yields the engine and GPU series from the latest scrape, so vanished replicas simply vanish."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        for key, name, kind, help_ in ENGINE_SERIES:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_, labels=["model", "slot"])
            for (model, slot), values in self.m.engine.items():
                if key in values:
                    fam.add_metric([model, slot], values[key])
            yield fam
        for key, name, help_ in GPU_SERIES:
            fam = GaugeMetricFamily(name, help_, labels=["model", "slot", "node", "gpu"])
            for labels, values in self.m.gpus.items():   # (no job label: a slot's GPUs, whichever job holds them)
                if key in values:
                    fam.add_metric(list(labels[:4]), values[key])
            yield fam


class RequestCollector:
    """Prometheus families from the sum of the snapshots ``sources`` returns; every configured model
    gets its series at zero (``models``) so rates exist before the first request."""

    def __init__(self, sources: Callable[[], Iterable[dict]], models: Callable[[], Iterable[str]]):
        self.sources, self.models = sources, models

    def describe(self):
        return []

    def collect(self):
        total = RequestStats()
        for snap in self.sources():
            total.add(snap)
        models = sorted(self.models())
        for m in models:
            for code, slot in GATEWAY_ANSWERS:
                total.requests.setdefault((m, code, slot), 0)
            for reason in RETRY_REASONS:
                total.retries.setdefault((m, reason), 0)
            for side in ("client", "upstream"):
                total.stream_aborts.setdefault((m, side), 0)
            for cause in MIGRATION_CAUSES:
                for outcome in MIGRATION_OUTCOMES:
                    total.migrations.setdefault((m, cause, outcome), 0)
            total.ejections.setdefault((m,), 0)
            total.inflight.setdefault(m, 0)
            total.queued.setdefault(m, 0)
            for attr, *_ in HISTOGRAMS:
                if attr != "kv_lag":   # only kv_aware models have one
                    total.hist(attr, m)
        for attr, name, help_, labels in COUNTERS:
            fam = CounterMetricFamily(name, help_, labels=list(labels))
            for key, v in sorted(getattr(total, attr).items()):
                fam.add_metric(list(key), v)
            yield fam
        for attr, name, help_ in GAUGES:
            fam = GaugeMetricFamily(name, help_, labels=["model"])
            for m, v in sorted(getattr(total, attr).items()):
                fam.add_metric([m], v)
            yield fam
        for attr, name, help_ in HISTOGRAMS:
            fam = HistogramMetricFamily(name, help_, labels=["model"])
            for m, h in sorted(getattr(total, attr).items()):
                cumulative, buckets = 0, []
                for bound, n in zip((*map(str, map(float, h.bounds)), "+Inf"), h.counts):
                    cumulative += n
                    buckets.append((bound, cumulative))
                fam.add_metric([m], buckets, h.sum)
            yield fam


class BatchCollector:
    """Batches by status, their requests answered (completed, failed) and tokens by model, requests not sent
    yet and in flight, dedicated-mode shards by state: from the batch runner's ``stats()``, read at scrape
    time.  Every status and shard state, and every configured model (``models``), is there at zero; no
    stats (no runner): the families without samples."""

    def __init__(self, source: Callable[[], dict | None], models: Callable[[], Iterable[str]]):
        self.source, self.models = source, models

    def describe(self):
        return []

    def collect(self):
        s = self.source()
        batches = GaugeMetricFamily("slurmfleet_batches", "Batches in the store by status (validating, in_progress, "
                                    "finalizing, cancelling, completed, failed, expired, cancelled).",
                                    labels=["status"])
        requests = CounterMetricFamily("slurmfleet_batch_requests", "Batch requests answered, by model and outcome "
                                       "(completed: 2xx; failed: 5xx or a broken connection after the runner's "
                                       "retries, cut off by the expiry, or a failed shard's lines; client_error: a "
                                       "4xx but 408, the line's own request or its key's rights; cancelled: in "
                                       "flight when the batch was cancelled; the last two were counted as failed "
                                       "before), since the daemon started.", labels=["model", "outcome"])
        tokens = CounterMetricFamily("slurmfleet_batch_tokens", "Tokens of batch requests by model and kind (prompt, "
                                     "completion), since the daemon started.", labels=["model", "kind"])
        queued = GaugeMetricFamily("slurmfleet_batch_queued_requests", "Lines of active batches not sent yet, by "
                                   "model.", labels=["model"])
        inflight = GaugeMetricFamily("slurmfleet_batch_inflight_requests", "Batch requests in flight through the "
                                     "gateway, by model.", labels=["model"])
        shards = GaugeMetricFamily("slurmfleet_batch_shards", "Shards (SLURM array tasks) of active dedicated-mode "
                                   "batches by state (pending, running, done, failed).", labels=["state"])
        if s is not None:
            models = set(self.models())
            for status in BATCH_STATUSES:
                batches.add_metric([status], s.get("batches", {}).get(status, 0))
            zero = {(m, o): 0 for m in models for o in ("completed", "failed")}
            for (m, outcome), n in sorted({**zero, **s.get("requests", {})}.items()):
                requests.add_metric([m, outcome], n)
            zero = {(m, k): 0 for m in models for k in ("prompt", "completion")}
            for (m, kind), n in sorted({**zero, **s.get("tokens", {})}.items()):
                tokens.add_metric([m, kind], n)
            for fam, key in ((queued, "queued"), (inflight, "inflight")):
                for m, n in sorted({**dict.fromkeys(models, 0), **s.get(key, {})}.items()):
                    fam.add_metric([m], n)
            for state in SHARD_STATES:
                shards.add_metric([state], s.get("shards", {}).get(state, 0))
        yield from (batches, requests, tokens, queued, inflight, shards)


class StorageCollector:
    """The state dir's file system (every record, the usage ledger, batch files and uploads share it) and the
    usage ledger's health, from ``source()`` at scrape time: ``free_bytes``, ``min_free_bytes`` (uploads are
    refused below it), ``ledger_pending_rows``, ``ledger_errors``; None: the families without samples."""

    def __init__(self, source: Callable[[], dict | None]):
        self.source = source

    def describe(self):
        return []

    def collect(self):
        s = self.source()
        free = GaugeMetricFamily("slurmfleet_state_dir_free_bytes", "Bytes free to the daemon's user on the state "
                                 "dir's file system (records, the usage ledger, batch files and uploads).")
        floor = GaugeMetricFamily("slurmfleet_state_dir_min_free_bytes", "batches.min_free_bytes: uploads that would "
                                  "leave less free are refused (507).")
        pending = GaugeMetricFamily("slurmfleet_usage_ledger_pending_rows", "Usage rows (and charges) kept in memory, "
                                    "not yet in the usage ledger's file.")
        errors = CounterMetricFamily("slurmfleet_usage_ledger_errors", "Times the usage ledger's file could not be "
                                     "opened, read or written (its rows stay in memory, tried again).")
        if s is not None:
            if s.get("free_bytes") is not None:   # (the file system could not be read: no sample)
                free.add_metric([], s["free_bytes"])
            floor.add_metric([], s["min_free_bytes"])
            pending.add_metric([], s["ledger_pending_rows"])
            errors.add_metric([], s["ledger_errors"])
        yield from (free, floor, pending, errors)


class FreeSpace:
    """The free bytes of the file system of ``root`` (the state dir, often shared), read off the event loop: a
    statvfs of a hung NFS or Lustre mount does not return, and on a scrape it froze the daemon (its ticks, the
    admin API, a gateway in the daemon's process).  :meth:`sample` starts a read in a thread unless the last is
    still out; :attr:`free` is what the last read found (None before one, or when it failed)."""

    def __init__(self, root: Path):
        self.root, self.free, self._out = root, None, None

    def sample(self) -> None:
        if self._out is None or self._out.done():
            self._out = asyncio.get_running_loop().run_in_executor(None, self.read)

    def read(self) -> int | None:
        try:
            st = os.statvfs(self.root)
            self.free = st.f_bavail * st.f_frsize
        except OSError:
            self.free = None
        return self.free


def storage_stats(free: FreeSpace, ledger, min_free_bytes: int) -> dict:
    """What :class:`StorageCollector` shows: the state dir's free space as last sampled, its usage ledger."""
    return {"free_bytes": free.free, "min_free_bytes": min_free_bytes, "ledger_pending_rows": ledger.pending_rows,
            "ledger_errors": ledger.errors}
