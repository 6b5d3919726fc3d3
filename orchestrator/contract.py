"""The one contract between the fleet (control plane) and the gateway (data plane).

Fleet -> gateway: a :class:`RoutingTable`, immutable and versioned: per model the
desired replica count and the READY replicas, each with its endpoint, its
secret and the engine load scraped last.  The fleet publishes every new table
to a :class:`RoutingSink` (the gateway in this process, or the gateway worker
processes).

Fleet -> gateway also carries each gateway process's share of every API key's
limits (:class:`Allowance`, see :mod:`orchestrator.fleet.quota`), and the background responses a process is to
take over from one that is gone (:class:`Background`, see :mod:`orchestrator.fleet.background`).

Gateway -> fleet: one :class:`GatewayReport` per gateway process: which table
version it routes on, requests in flight per job, requests queued per model
(with the oldest one's age), its request statistics and its per-key counters
(:class:`TenantUsage`: what the limits and the usage ledger are computed from) and the background responses it
follows until they end (:class:`Background`).  Reports are summed in
one place (:class:`orchestrator.fleet.reports.ReportHub`) that drains,
``/metrics`` and ``slurmfleet status`` read.

A feature that crosses the seam adds a field with a default to one of these
types, never a channel of its own.  This module imports neither side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

CONTRACT_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """What a running job published: where its engine listens and its secret."""

    job_id: str
    host: str
    port: int
    secret: str
    restart_count: int = 0
    start_time: float = 0.0
    node: str = ""
    kv_events: str = ""   # the engine's KV-cache event publisher (tcp://host:port), "" when it has none
    kv_replay: str = ""   # ... and its replay socket
    kv_topic: str = ""
    kv_curve: bool = False   # the events come through the job's relay (orchestrator.kvrelay): keys from the secret

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own view of its load, from its ``/metrics`` (None: not scraped yet)."""

    waiting: float | None = None    # vllm:num_requests_waiting
    running: float | None = None    # vllm:num_requests_running
    kv_usage: float | None = None   # vllm:kv_cache_usage_perc, 0-1


NO_LOAD = EngineLoad()


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    """A READY replica as the gateway sees it."""

    job_id: str
    model: str
    slot: int
    endpoint: Endpoint
    load: EngineLoad = NO_LOAD
    max_model_len: int = 0   # the engine's context length, as its /v1/models says (0: not known)
    engine: str = ""         # what its generations follow from (model, weights, engine arguments): a generation is
                             # continued only on a replica with the same ("": not known, any)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRoutes:
    """One model's entry: how many replicas the fleet wants and which are READY now."""

    desired: int
    replicas: tuple[Replica, ...] = ()
    waiting_on: str = ""   # while none is READY: what the fleet waits for (a job's SLURM state and reason, ...)
    blocked: str = ""      # the model cannot get a replica until an operator acts: held requests end at once
    waiting_from: float = 0.0    # epoch s: since when ``waiting_on`` holds (0: no such moment); the gateway adds
                                 # the time waited when it answers (no clock in the table: it changes only on news)


RATE_WINDOW_S = 60.0   # rpm and tpm count the last minute


@dataclasses.dataclass(frozen=True, slots=True)
class Allowance:
    """How far one gateway process may go with one API key until the next table (see
    :mod:`orchestrator.fleet.quota`).  The fleet splits what is left of each limit over the processes by
    their recent demand, as caps on each process's own cumulative counters
    (:class:`TenantUsage`), so the sum over every process never passes the limit.  None: no such limit."""

    requests_upto: int | None = None   # admit while this process's cumulative admitted requests < this
    tokens_upto: int | None = None     # ... and its cumulative counted tokens < this (tpm and budget)
    concurrent: int | None = None      # at most this many of the key's requests in flight in this process
    requests_left: int | None = None   # over every process, when computed: left in the rpm window
    tokens_left: int | None = None     # ... left in the tpm window (or the budget, the smaller)
    requests_reset_s: float = 0.0      # when the rpm window next frees a request (> RATE_WINDOW_S: it holds none)
    tokens_reset_s: float = 0.0        # when the tpm window (or the budget's period) next frees tokens (the same)
    budget_exhausted: bool = False     # the key's token budget for this period is spent (429 insufficient_quota)
    tokens_by_budget: bool = False     # tokens_left is the budget's (less than the tpm window's): a refusal at
                                       # tokens_upto is the budget's, not the minute's
    requests_seen: int = 0             # this process's counters the fleet computed it from (what it admitted
    tokens_seen: int = 0               # after them is not in requests_left / tokens_left yet)
    limits: tuple | None = None        # the key's (rpm, tpm, max_concurrent, budget_tokens) it was computed for:
                                       # others (a reload changed them, the table with new ones not come yet) say
                                       # "ask again in a second", not the old window's wait (None: not said)


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessAllowances:
    """One gateway process's allowances: valid only for the incarnation they were computed for (a
    restarted process counts from zero again)."""

    incarnation: str
    keys: Mapping[str, Allowance]   # key name -> allowance


@dataclasses.dataclass(frozen=True, slots=True)
class Background:
    """A background response of the Responses API that a gateway process follows to its end to charge its key's
    usage then: what another process needs to take it over."""

    rid: str            # the response's id on its replica
    key: str            # the API key's name it is charged to
    model: str          # the model it is charged under
    job_id: str         # the replica that makes and keeps it
    prompt_guess: int   # tokens charged when its usage cannot be read (its replica gone): its input's JSON bytes / 4


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingTable:
    """Everything the gateway needs to route, as of ``version`` (larger is newer)."""

    version: int
    models: Mapping[str, ModelRoutes]
    contract: int = CONTRACT_VERSION
    allowances: Mapping[int, ProcessAllowances] = dataclasses.field(default_factory=dict)  # process -> its share
    # keys whose token budget for this period is spent -> the period's end (epoch seconds: the same table all
    # period): what a process refuses before it has an allowance of its own (its counters are new, not the budget)
    budgets_spent: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # groups (gateway.groups) whose shared token budget for this period is spent -> the period's end (epoch s):
    # every key of such a group is refused (429 insufficient_quota) until then
    groups_spent: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # process -> background responses whose process is gone (or whose daemon was), for it to follow and charge
    adopt: Mapping[int, tuple[Background, ...]] = dataclasses.field(default_factory=dict)
    # the keys' rpm/tpm windows still hold what a previous daemon's processes admitted: a process without an
    # allowance of its own yet admits a limited key nothing (no even split of a minute partly spent)
    limits_carried: bool = False

    def ready(self, model: str) -> tuple[Replica, ...]:
        routes = self.models.get(model)
        return routes.replicas if routes else ()

    def desired(self, model: str) -> int:
        routes = self.models.get(model)
        return routes.desired if routes else 0


EMPTY_TABLE = RoutingTable(0, {})


@dataclasses.dataclass(frozen=True, slots=True)
class QueueState:
    """Requests of one model waiting in a gateway process for a replica."""

    depth: int = 0
    oldest_age_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class TenantUsage:
    """One API key's counters in one gateway process incarnation (cumulative: they only grow)."""

    requests: int = 0     # admitted by the key's limits
    tokens: int = 0       # prompt + completion tokens counted from the replicas' ``usage``
    demand: int = 0       # requests that asked (admitted or refused by a limit)
    inflight: int = 0     # requests of the key in flight now (a gauge)
    rejected: Mapping[str, int] = dataclasses.field(default_factory=dict)   # reason -> refused requests
    models: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    """model -> (requests answered, prompt tokens, completion tokens), cumulative."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayReport:
    """One gateway process's report to the fleet.

    ``stats`` is a :meth:`orchestrator.reqstats.RequestStats.snapshot` (counters only grow within one
    process, so the hub keeps the last report of a process that died).
    """

    process: int                                   # 0 in the daemon, 1.. for worker processes
    table_version: int                             # the newest routing table this process routes on
    inflight: Mapping[str, int] = dataclasses.field(default_factory=dict)      # job id -> requests
    queued: Mapping[str, QueueState] = dataclasses.field(default_factory=dict)  # model -> queue
    stats: Mapping = dataclasses.field(default_factory=dict)
    urgent: bool = False   # sent out of turn: a request is held for a model without a READY replica
    contract: int = CONTRACT_VERSION
    incarnation: str = ""  # random per process start: counters of a new incarnation start from zero
    tenants: Mapping[str, TenantUsage] = dataclasses.field(default_factory=dict)   # key name -> counters
    # the background responses it follows, not charged yet (one charged leaves this in the report that counts it)
    background: tuple[Background, ...] = ()


class RoutingSink(Protocol):
    """Where the fleet publishes routing tables: the gateway in this process, or its worker processes."""

    def publish(self, table: RoutingTable) -> None: ...


class ReportSink(Protocol):
    """Where gateway processes' reports go: the fleet's one place that sums them."""

    def receive(self, report: GatewayReport) -> None: ...
    def retire(self, process: int) -> None: ...
