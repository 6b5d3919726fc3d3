"""slurmfleet's Prometheus metrics: one registry per daemon, no module globals.

Labels stay bounded: model, slot (a replica's stable number), state, reason,
status code, command.  Job ids and request ids never become labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PENDING_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


class Metrics:
    """All metrics of one daemon."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # fleet
        self.desired = Gauge("slurmfleet_replicas_desired", "Replicas the config asks for.", ["model"], registry=r)
        self.replicas = Gauge("slurmfleet_replicas", "Replicas by derived state.", ["model", "state"], registry=r)
        self.submissions = Counter("slurmfleet_job_submissions_total", "sbatch calls by result.",
                                   ["model", "result"], registry=r)
        self.restarts = Counter("slurmfleet_replica_restarts_total", "Replicas replaced, by reason.",
                                ["model", "reason"], registry=r)
        self.tick_seconds = Histogram("slurmfleet_reconcile_duration_seconds", "Reconcile tick duration.",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.tick_errors = Counter("slurmfleet_reconcile_errors_total", "Ticks that could not read SLURM.", registry=r)
        self.slurm_seconds = Histogram("slurmfleet_slurm_command_duration_seconds", "SLURM command duration.",
                                       ["command"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                       registry=r)
        self.slurm_errors = Counter("slurmfleet_slurm_command_errors_total", "SLURM commands that failed.",
                                    ["command"], registry=r)
        self.backoff = Gauge("slurmfleet_model_backoff_seconds", "Seconds until the model may submit again.",
                             ["model"], registry=r)
        self.blocked = Gauge("slurmfleet_model_blocked", "1 when the model cannot be scheduled as configured.",
                             ["model"], registry=r)
        # queue
        self.jobs = Gauge("slurmfleet_slurm_jobs", "This fleet's SLURM jobs by state and pending reason.",
                          ["model", "slurm_state", "reason"], registry=r)
        self.pending_seconds = Histogram("slurmfleet_job_pending_seconds", "Time jobs spent pending before start.",
                                         ["model"], buckets=PENDING_BUCKETS, registry=r)
        self.time_left = Gauge("slurmfleet_replica_time_left_seconds", "Seconds before the replica's time limit.",
                               ["model", "slot"], registry=r)
        self.replica_up = Gauge("slurmfleet_replica_ready", "1 when the replica in this slot is READY.",
                                ["model", "slot"], registry=r)
        # requests
        self.requests = Counter("slurmfleet_requests_total", "Requests by model, status code and slot.",
                                ["model", "code", "slot"], registry=r)
        self.inflight = Gauge("slurmfleet_requests_in_flight", "Requests being served.", ["model"], registry=r)
        self.queued = Gauge("slurmfleet_requests_queued", "Requests waiting in the gateway for a replica.",
                            ["model"], registry=r)
        self.duration = Histogram("slurmfleet_request_duration_seconds", "Request duration at the gateway.",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("slurmfleet_time_to_first_token_seconds", "Time to the first response byte.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("slurmfleet_request_retries_total", "Requests retried on another replica.",
                               ["model", "reason"], registry=r)
        self.ejections = Counter("slurmfleet_replica_ejections_total", "Replicas ejected after failures.",
                                 ["model"], registry=r)
        self.stream_aborts = Counter("slurmfleet_stream_aborts_total", "Streams cut after the first byte.",
                                     ["model", "side"], registry=r)
        # engine (re-exported from each replica's /metrics)
        self.engine_running = Gauge("slurmfleet_engine_requests_running", "vllm:num_requests_running per replica.",
                                    ["model", "slot"], registry=r)
        self.engine_waiting = Gauge("slurmfleet_engine_requests_waiting", "vllm:num_requests_waiting per replica.",
                                    ["model", "slot"], registry=r)
        self.engine_kv = Gauge("slurmfleet_engine_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc (0-1) per replica.",
                               ["model", "slot"], registry=r)
        self.engine_prompt_tokens = Gauge("slurmfleet_engine_prompt_tokens", "vllm:prompt_tokens_total per replica (counter of the current job).",
                                          ["model", "slot"], registry=r)
        self.engine_generation_tokens = Gauge("slurmfleet_engine_generation_tokens", "vllm:generation_tokens_total per replica (counter of the current job).",
                                              ["model", "slot"], registry=r)

    def observe_slurm(self, command: str, seconds: float, ok: bool) -> None:
        self.slurm_seconds.labels(command).observe(seconds)
        if not ok:
            self.slurm_errors.labels(command).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
