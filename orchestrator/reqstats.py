"""The gateway's request metrics as plain numbers.

Recording happens on the proxy's hot path for every request, so it is a dict
increment or a bisect, without locks or label lookups.  The numbers leave each
gateway process as a snapshot inside its
:class:`~orchestrator.contract.GatewayReport`, are summed in the daemon, and
become Prometheus families only at scrape time
(:class:`orchestrator.observability.metrics.RequestCollector`).
The gauges (in flight, queued) are not recorded per request: the gateway reads
them off its replica slots and queues when it makes a snapshot.  Names, labels and buckets are those of the
README's metrics reference (``slurmfleet_requests_total`` and the rest).
"""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800,
                   3600)   # (a cold start's hold may last 30 minutes and more: cold_start_hold_s)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 1, 2.5)   # seconds per output token: a fast decode is a few ms, a loaded one 0.1 s
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)   # tokens
MIGRATION_CAUSES = ("reset", "eof", "timeout", "engine_error", "drain", "abort")   # (every series from 0)
MIGRATION_OUTCOMES = ("ok", "no_replica", "exhausted", "impossible", "stayed")
GATEWAY_ANSWERS = (("503", "none"), ("429", "none"), ("499", "none"), ("429", "refused"))   # (code, slot) of the
# answers the gateway gives itself (no replica, queue full, the client left in the queue, a key's limits): every
# configured model has these series from 0, so an outage's first burst of them is seen by rate()
RETRY_REASONS = ("connect", "reset", "timeout", "status_429", "status_502", "status_503", "status_504")
COUNTERS = (  # (attribute, metric name without _total, help, label names)
    ("requests", "slurmfleet_requests", "Client requests by model, final status code (499: the client left before "
                 "its answer ended; 502: a stream cut mid-way) and slot (the replica whose answer or failure the client "
                 "got; none: answered by no replica, the gateway's 429/503/499; refused: by the key's limits or rights; "
                 "lost: held by a gateway worker that died, as of its last report, code 502); "
                 "each counted once, its retried attempts in slurmfleet_request_retries_total.",
     ("model", "code", "slot")),
    ("retries", "slurmfleet_request_retries", "Requests retried on another replica.", ("model", "reason")),
    ("fallbacks", "slurmfleet_request_fallbacks", "Requests another model took because the one they asked could not "
     "(no replica within its wait, its queue full, none to come): by the model asked and the one that took them "
     "(models[].gateway.fallbacks).", ("model", "to")),
    ("ejections", "slurmfleet_replica_ejections", "Replicas ejected after failures.", ("model",)),
    ("stream_aborts", "slurmfleet_stream_aborts", "Answers cut after the replica's first byte, by side: the client "
     "left (client) or the replica broke it (upstream); a resumable request not streamed counts too (the gateway "
     "reads its replica's answer as a stream).", ("model", "side")),
    ("migrations", "slurmfleet_stream_migrations", "Generations moved to another replica mid-generation, by cause "
     "(reset, eof, timeout, engine_error, drain, abort: vLLM aborted it as it shut down) and outcome (ok; or not "
     "moved: no_replica, exhausted, impossible; stayed: a draining replica's stream with nowhere to go, left "
     "there, counted once and no move).", ("model", "cause", "outcome")),
    ("kv_prompt_tokens", "slurmfleet_kv_prompt_tokens", "Prompt tokens of requests routed kv_aware, as the gateway "
     "tokenized them.", ("model",)),
    ("kv_predicted_hits", "slurmfleet_kv_predicted_cached_tokens", "Prompt tokens the gateway predicted cached on "
     "the replica it chose (compare with the engines' prefix cache hits).", ("model",)),
    ("kv_events", "slurmfleet_kv_events", "KV-cache events applied to the gateway's index, summed over gateway "
     "processes, each of which subscribes to every replica (with gateway.workers N, N x the events).", ("model",)),
    ("kv_gaps", "slurmfleet_kv_event_gaps", "Gaps in a replica's KV-cache event sequence, by outcome (replayed: "
     "filled from the replay socket; reset: the replica's index was cleared), summed over gateway processes, each "
     "of which subscribes (a gap every process sees counts once per process).", ("model", "outcome")),
    ("kv_feed", "slurmfleet_kv_feed_incidents", "Incidents of the gateway's KV-cache event feeds, by kind (error: a "
     "malformed message, an undecodable batch, a failed session; restart: a replica's publisher started anew; "
     "rebuild: its index re-read from seq 0 after a block stored with an unknown parent; unknown_parent: such a "
     "store; replay_failure: a replay that could not fill what was missing), summed over gateway processes, each "
     "of which subscribes to every replica.", ("model", "kind")),
)
HISTOGRAMS = (
    ("duration", "slurmfleet_request_duration_seconds", "Request duration at the gateway."),
    ("ttft", "slurmfleet_time_to_first_token_seconds", "Time to the first token: a stream's first event (vLLM's "
     "keep-alive comments are not), or a resumable request's not streamed, read from its replica as a stream; a "
     "whole answer relayed as it came counts in the request duration only."),
    ("queue_wait", "slurmfleet_request_queue_wait_seconds",
     "Time requests waited in the gateway for a replica (held through a cold start, or all replicas full)."),
    ("cold_start", "slurmfleet_cold_start_seconds",
     "Time to the first response byte (not a keep-alive) of requests held with no READY replica: they arrived "
     "at none, or the replicas they waited for died meanwhile."),
    ("kv_lag", "slurmfleet_kv_event_lag_seconds", "Age of KV-cache event batches when the gateway applied them, "
     "summed over gateway processes, each of which subscribes (N x the counts with gateway.workers N; the "
     "quantiles hold)."),
    ("tpot", "slurmfleet_time_per_output_token_seconds", "Time per output token after the first, per request: (the "
     "request's duration - its time to first token) / (its completion tokens - 1), for a 200 answer with a first "
     "token time (streamed, or a resumable one read as a stream), one choice (n 1, one prompt) and 2 completion "
     "tokens or more."),
    ("prompt_tokens", "slurmfleet_request_prompt_tokens", "Prompt tokens per request answered 200, as its replica "
     "counted them (its usage)."),
    ("output_tokens", "slurmfleet_request_output_tokens", "Completion tokens per request answered 200 with any, as "
     "its replica counted them (its usage; every choice's, with n > 1)."),
)
KV_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)   # seconds
BUCKETS = {"tpot": TPOT_BUCKETS, "prompt_tokens": TOKEN_BUCKETS, "output_tokens": TOKEN_BUCKETS,
           "kv_lag": KV_LAG_BUCKETS}   # else latency
GAUGES = (
    ("inflight", "slurmfleet_requests_in_flight", "Requests being served."),
    ("queued", "slurmfleet_requests_queued", "Requests waiting in the gateway for a replica."),
    ("kv_blocks", "slurmfleet_kv_index_blocks", "Blocks in the gateway's KV-cache index, over the model's replicas "
     "(each gateway process keeps its own copy: the largest is reported)."),
    ("kv_approximate", "slurmfleet_kv_index_approximate_replicas", "Replicas of the model whose KV-cache event index "
     "is approximate (events lost, or not caught up or settled yet: what the gateway sent there counts too); each "
     "gateway process keeps its own index: the largest count is reported."),
)
MAX_GAUGES = frozenset({"kv_blocks", "kv_approximate"})   # per-process copies of one thing: combined by max, not sum


class Hist:
    """Bucket counts (not cumulative; the last one is +Inf) over ``bounds`` and the sum of observations."""

    __slots__ = ("counts", "sum", "bounds")

    def __init__(self, counts: list[int] | None = None, total: float = 0.0, bounds: tuple = LATENCY_BUCKETS):
        self.counts = counts if counts is not None else [0] * (len(bounds) + 1)
        self.sum = total
        self.bounds = bounds

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class RequestStats:
    """One process's request counters, histograms and gauges, keyed by label tuples."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, ...], int] = {}
        self.retries: dict[tuple[str, ...], int] = {}
        self.fallbacks: dict[tuple[str, ...], int] = {}
        self.ejections: dict[tuple[str, ...], int] = {}
        self.stream_aborts: dict[tuple[str, ...], int] = {}
        self.migrations: dict[tuple[str, ...], int] = {}
        self.kv_prompt_tokens: dict[tuple[str, ...], int] = {}
        self.kv_predicted_hits: dict[tuple[str, ...], int] = {}
        self.kv_events: dict[tuple[str, ...], int] = {}
        self.kv_gaps: dict[tuple[str, ...], int] = {}
        self.kv_feed: dict[tuple[str, ...], int] = {}
        self.duration: dict[str, Hist] = {}
        self.ttft: dict[str, Hist] = {}
        self.queue_wait: dict[str, Hist] = {}
        self.cold_start: dict[str, Hist] = {}
        self.kv_lag: dict[str, Hist] = {}
        self.tpot: dict[str, Hist] = {}
        self.prompt_tokens: dict[str, Hist] = {}
        self.output_tokens: dict[str, Hist] = {}
        self.inflight: dict[str, int] = {}
        self.queued: dict[str, int] = {}
        self.kv_blocks: dict[str, int] = {}
        self.kv_approximate: dict[str, int] = {}

    def count(self, family: str, *labels: str) -> None:
        d = getattr(self, family)
        d[labels] = d.get(labels, 0) + 1

    def bump(self, family: str, n: int, *labels: str) -> None:
        d = getattr(self, family)
        d[labels] = d.get(labels, 0) + n

    def request(self, model: str, code: int | str, slot: str) -> None:
        key = (model, str(code), slot)
        self.requests[key] = self.requests.get(key, 0) + 1

    def hist(self, family: str, model: str) -> Hist:
        d = getattr(self, family)
        h = d.get(model)
        if h is None:
            h = d[model] = Hist(bounds=BUCKETS.get(family, LATENCY_BUCKETS))
        return h

    def ended(self, model: str, code: int | str, slot: str, duration_s: float, ttft_s: float | None,
              usage: tuple[int, int] | None, choices: int | None = 1) -> None:
        """A request's end: its count, duration and, answered 200 (``usage``: its replica's prompt and completion
        tokens), its token counts and time per output token (with ``ttft_s``, one choice, 2 tokens or more)."""
        self.request(model, code, slot)
        self.hist("duration", model).observe(duration_s)
        if usage is None or code != 200:
            return
        prompt, completion = usage
        if prompt > 0:
            self.hist("prompt_tokens", model).observe(prompt)
        if completion > 0:
            self.hist("output_tokens", model).observe(completion)
        if ttft_s is not None and completion > 1 and choices == 1:   # (None: unsure how many)
            self.hist("tpot", model).observe(max(0.0, duration_s - ttft_s) / (completion - 1))

    def snapshot(self, inflight: dict[str, int] | None = None, queued: dict[str, int] | None = None) -> dict:
        """Everything as JSON-able lists (label tuples become lists), with the gauges given."""
        if inflight is not None:
            self.inflight = inflight
        if queued is not None:
            self.queued = queued
        out: dict = {name: [[list(k), v] for k, v in getattr(self, name).items()] for name, *_ in COUNTERS}
        for name, *_ in HISTOGRAMS:
            out[name] = [[m, h.counts, h.sum] for m, h in getattr(self, name).items()]
        for name, *_ in GAUGES:
            out[name] = [[m, v] for m, v in getattr(self, name).items()]
        return out

    def add(self, snap: dict) -> None:
        """Add another process's snapshot to these numbers."""
        for name, *_ in COUNTERS:
            d = getattr(self, name)
            for labels, v in snap.get(name, []):
                key = tuple(labels)
                d[key] = d.get(key, 0) + v
        for name, *_ in HISTOGRAMS:
            for model, counts, total in snap.get(name, []):
                h = self.hist(name, model)
                h.counts = [a + b for a, b in zip(h.counts, counts)]
                h.sum += total
        for name, *_ in GAUGES:
            d = getattr(self, name)
            for model, v in snap.get(name, []):
                d[model] = max(d.get(model, 0), v) if name in MAX_GAUGES else d.get(model, 0) + v
