"""Replica facts (and a model's memory of its replicas) and the one pure function that derives a
replica's state from them.

Facts are what was observed (SLURM's view, the endpoint record, probe results,
what the daemon asked for).  ``derive_state`` turns them into a state; nothing
else decides what state a replica is in.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
import re
from collections.abc import Iterable

from ..config import BackoffConfig, ModelConfig
from ..contract import Endpoint
from .slurm import SlurmError

log = logging.getLogger("orchestrator.fleet.reconciler")
# sbatch's refusal for a count of jobs (QOS or association MaxSubmitJobs): not the config's fault, it clears
SUBMIT_LIMIT = re.compile(r"job submit limit|MaxSubmitJob", re.IGNORECASE)
# sbatch's refusal while the job's partition is set DRAIN or INACTIVE (maintenance: its queued jobs stay, new ones
# are refused until it is UP again): not the config's fault either
PARTITION_CLOSED = re.compile(r"partition not available", re.IGNORECASE)


def refused_for_now(text: str) -> str | None:
    """Why sbatch refused a job for now, not for good: "submit_limit" or "partition_closed" (None: neither)."""
    return "submit_limit" if SUBMIT_LIMIT.search(text) else "partition_closed" if PARTITION_CLOSED.search(text) \
        else None


class State(str, enum.Enum):
    QUEUED = "QUEUED"          # pending in SLURM
    STARTING = "STARTING"      # running, engine not yet answering
    READY = "READY"            # running, probes pass: receives traffic
    UNHEALTHY = "UNHEALTHY"    # running but failing probes (or never came up): to be replaced
    DRAINING = "DRAINING"      # no new traffic; cancelled once in-flight requests finish
    STOPPING = "STOPPING"      # cancel sent, SLURM still shows it
    FAILED = "FAILED"          # ended without being asked to
    GONE = "GONE"              # ended after the daemon cancelled it, or left squeue

    def __str__(self) -> str:
        return self.value


TERMINAL_SLURM = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                            "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"})
QUEUED_SLURM = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
                          "CONFIGURING"})
# held for good by SLURM itself: its reservation deleted, or requeued held after it exited with one of the site's
# RequeueExitHold codes (SPECIAL_EXIT: the job stays in the queue, held, until someone releases or cancels it)
HELD_FOR_GOOD = frozenset({"RESV_DEL_HOLD", "SPECIAL_EXIT"})
ENDED_SLURM = TERMINAL_SLURM | HELD_FOR_GOOD   # a batch task that will not run again on its own
STOPPING_SLURM = frozenset({"COMPLETING", "STAGE_OUT", "SIGNALING"})
# pending reasons that will never clear on their own: report, cancel, do not resubmit (a partition set DOWN
# or INACTIVE for maintenance, PartitionNotAvail, comes back: its jobs wait, their reason shown)
FATAL_PENDING = frozenset({
    "PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit", "InvalidQOS",
    "InvalidAccount", "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied",
    "ReqNodeNotAvail_Invalid",
})
# pending reasons of a job SLURM held after it failed to launch (a prolog, a broken node): it never starts unless
# someone releases it, so it is replaced like a failed start (an admin's or user's hold is theirs: left alone)
LAUNCH_FAILED = frozenset({"launch failed requeued held", "launch_failed_requeued_held", "JobHoldMaxRequeue"})
SERVING = frozenset({State.READY})
ACTIVE = frozenset({State.QUEUED, State.STARTING, State.READY})


def held_for_good(state: str | None, reason: str | None) -> bool:
    """A job (or array task) SLURM holds that never runs unless someone releases it: a special exit, a deleted
    reservation, a failed launch (an admin's or user's hold is theirs, and not this)."""
    return state in HELD_FOR_GOOD or state in QUEUED_SLURM and (reason or "").split(",")[0].strip() in LAUNCH_FAILED


def fatal_pending(reason: str | None) -> bool:
    if not reason:
        return False
    head = reason.split(",")[0].strip()
    return head in FATAL_PENDING or bool(re.search(r"PerJob(Limit)?$", head))


@dataclasses.dataclass
class ReplicaFacts:
    """Everything observed about one replica (one SLURM job)."""

    job_id: str
    model: str
    slot: int
    config_hash: str
    slurm_state: str | None = "PENDING"   # None: no longer in squeue
    reason: str | None = None
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    time_limit_s: int | None = None
    nodelist: str = ""
    restart_count: int = 0
    endpoint: Endpoint | None = None
    last_probe_time: float | None = None
    last_probe_ok: bool | None = None
    last_probe_error: str | None = None
    consecutive_failures: int = 0
    last_deep_probe_time: float | None = None
    first_ready_time: float | None = None
    published_at: float | None = None     # the record's time (the job's clock) of the engine that went READY
    drain_requested_at: float | None = None
    drain_reason: str = ""                # scale_down, time_limit, config_change, operator, replace
    cancel_requested_at: float | None = None
    time_limit_warned: bool = False       # the job got SLURM's USR1 early warning
    replace_requested: bool = False       # an operator's drain once a successor serves (a handover)
    missing_listings: int = 0             # consecutive squeue listings that did not show it
    adopted_at: float | None = None       # found in squeue by this daemon, not submitted by it (a restart)
    max_model_len: int = 0                # the engine's context length, from its /v1/models (0: not seen yet)
    excluded: tuple[str, ...] = ()        # the nodes its sbatch excluded (an adopted job's are not known)
    engine_hash: str = ""                 # what its generations follow from (ModelConfig.engine_hash, its tag's)
    requeued: bool = False                # SLURM requeued it (preempted, node lost): its last run still ending

    def shift(self, step: float) -> None:
        """The wall clock stepped by ``step``: the daemon's own readings of it move along (SLURM's are SLURM's)."""
        for name in ("last_probe_time", "last_deep_probe_time", "first_ready_time", "drain_requested_at",
                     "cancel_requested_at", "adopted_at"):
            if (t := getattr(self, name)) is not None:
                setattr(self, name, t + step)

    def time_left_s(self, now: float) -> float | None:
        if self.time_limit_s is None or self.start_time is None or self.slurm_state != "RUNNING":
            return None
        return self.start_time + self.time_limit_s - now


@dataclasses.dataclass
class ModelRuntime:
    """Per-model memory of the control loop: back-off, blocks, bad nodes, scale overrides."""

    crashes: int = 0
    crashed_at: float = 0.0               # when the last early failure was counted
    backoff_until: float = 0.0
    blocked: str | None = None
    last_error: str | None = None
    last_log: str | None = None           # the output file of the job of the last early failure
    node_failures: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    excluded: dict[str, float] = dataclasses.field(default_factory=dict)
    unexclude: set[str] = dataclasses.field(default_factory=set)   # pending jobs whose ExcNodeList update failed
    desired_override: int | None = None
    submitted: int = 0
    backoff_cause: str = "crash"          # what backoff_until is for: "crash", "submit_limit" or "partition_closed"
                                          # (BACKOFF_CAUSES)
    crash_slot: int | None = None         # the slot of the last early failure (its back-off is a crash loop's)
    vacated: dict[int, tuple[str, float]] = dataclasses.field(default_factory=dict)   # slot -> (its job that ended,
                                          # how), when: the next submission for it is that job's replacement

    def may_submit(self, now: float, slot: int, urgent: bool) -> bool:
        """Whether an sbatch for ``slot`` may go now: never while blocked; during a back-off only a successor
        before a time limit (``urgent``), and only through another slot's crash loop (not its own, nor a job
        count limit's back-off, which sets none)."""
        return self.blocked is None and (now >= self.backoff_until or urgent and self.crash_slot not in (None, slot))

    def forget_failures(self) -> None:
        """A new job shape (a reload, a model re-added): its predecessor's crashes, message and bad nodes are
        history (a config mistake's failures had excluded node after node, and still did after the fix)."""
        self.crashes, self.backoff_until, self.last_error, self.last_log = 0, 0.0, None, None
        self.node_failures, self.excluded = {}, {}

    def shift(self, step: float) -> None:
        """The wall clock stepped by ``step``: back-off, exclusions and crash times keep their lengths."""
        self.crashed_at, self.backoff_until = self.crashed_at + step, self.backoff_until + step
        self.vacated = {slot: (why, t + step) for slot, (why, t) in self.vacated.items()}
        self.node_failures = {n: [t + step for t in ts] for n, ts in self.node_failures.items()}
        self.excluded = {n: t + step for n, t in self.excluded.items()}

    def expire_exclusions(self, now: float, replicas: Iterable[ReplicaFacts]) -> list[ReplicaFacts]:
        """End the exclusions past their time; the pending jobs that exclude such a node, their ``excluded`` now
        the nodes still excluded (submitted while it was, they would wait for the other nodes for ever)."""
        if not (gone := {n for n, until in self.excluded.items() if now > until}):
            return []
        for n in gone:
            del self.excluded[n]
        out = [f for f in replicas if f.slurm_state == "PENDING" and gone & set(f.excluded)]
        for f in out:
            f.excluded = tuple(n for n in f.excluded if n not in gone)
        return out

    def count_crash(self, f: ReplicaFacts, now: float, reason: str, b: BackoffConfig, rng: random.Random,
                    log_path: str = "") -> None:
        """A replica of this model ended badly (``reason``: failed, node_lost, unhealthy): suspect its nodes
        and, for an early failure, back off before the next submission, noting where its output is
        (``last_log``: for the operator, `slurmfleet status` shows how it ends; never in a client's 503)."""
        ready = ready_since(f)   # an engine that served a while says nothing of its load; one that dies
        end = f.end_time if f.slurm_state in TERMINAL_SLURM else None   # (a running job's is its time limit's)
        ran = (end or now) - (ready or f.start_time or now)   # soon after READY (however long it loaded) does
        # a node is suspect only when it lost the job or the job never came up on it: a replica that served
        # and then died says nothing about its node
        for node in expand_hostlist(f.nodelist) if reason == "node_lost" or ready is None else ():
            hits = [t for t in self.node_failures.get(node, []) if now - t < b.node_exclude_s] + [now]
            self.node_failures[node] = hits
            if len(hits) >= b.node_failure_threshold and b.node_exclude_s > 0:
                self.excluded[node] = now + b.node_exclude_s
                log.warning("excluding node %s for model %s for %.0fs after %d failures", node, f.model,
                            b.node_exclude_s, len(hits))
        if reason in ("failed", "unhealthy") and (ready is None or ran < b.early_failure_s):
            self.crashes += 1
            self.crashed_at, self.crash_slot = now, f.slot
            raw = b.base_s * 2 ** min(self.crashes - 1, 40)   # (+-25%, never past max_s, and spread below it there)
            delay = min(raw * rng.uniform(0.75, 1.25), b.max_s * rng.uniform(0.75, 1.0))
            self.backoff_until, self.backoff_cause = now + delay, "crash"
            self.last_error = (f"job {f.job_id} {'failed' if reason == 'failed' else 'turned unhealthy'} {ran:.0f}s "
                               f"after {'start' if ready is None else 'READY'} ({self.crashes} early failures in a "
                               f"row); next submission in {delay:.0f}s")
            self.last_log = log_path or None
            log.warning("model %s: %s%s", f.model, self.last_error, f"; its log: {log_path}" if log_path else "")


    def sbatch_failed(self, m: ModelConfig, exc: SlurmError, now: float, stale: bool = False) -> str:
        """Note an sbatch that failed: "rejected" (a job count limit or a partition drained: tried again after
        ``backoff.max_s``; or the job itself: blocked until a reload), "error" (transient: the job may exist), or
        "" (refused with nodes excluded: submitted again at once without them, since the exclusion may leave
        nowhere to run)."""
        self.last_error = f"sbatch failed: {exc}"
        # the user's or QOS's job count (batch arrays too): frees as jobs end; a partition's maintenance: ends
        if cause := refused_for_now(str(exc)):
            self.backoff_until, self.crash_slot, self.backoff_cause = now + m.backoff.max_s, None, cause
            log.warning("model %s: %s; trying again in %.0fs", m.name, self.last_error, m.backoff.max_s)
            return "rejected"
        if exc.transient:
            return "error"
        if self.excluded:
            log.warning("model %s: %s; submitting again without excluding %s", m.name, self.last_error,
                        ", ".join(sorted(self.excluded)))
            self.excluded.clear()
            return ""
        if stale:   # a reload replaced the config while its sbatch ran: the new one gets its own chance
            log.warning("model %s: %s, for a config a reload has replaced since", m.name, self.last_error)
            return "rejected"
        self.blocked = f"sbatch rejected the job: {exc} (fix the config, then reload)"
        log.error("model %s: %s", m.name, self.blocked)
        return "rejected"


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """An sbatch whose outcome is unknown (it timed out): found by its nonce or expired."""

    model: str
    slot: int
    config_hash: str
    nonce: str
    deadline: float


@dataclasses.dataclass(frozen=True)
class Policy:
    """The knobs derive_state needs."""

    startup_timeout_s: float = 900.0
    failure_threshold: int = 3


def derive_state(f: ReplicaFacts, now: float, policy: Policy) -> State:
    """The replica's state, from its facts alone.  SLURM's job state has the final word."""
    s = f.slurm_state
    if s is None:
        return State.GONE
    if s in TERMINAL_SLURM:
        return State.GONE if f.cancel_requested_at is not None else State.FAILED
    if s in STOPPING_SLURM and f.requeued and f.cancel_requested_at is None:
        return State.QUEUED   # (a requeue's last run ending, KillWait and epilog: PENDING again after it)
    if s in STOPPING_SLURM or f.cancel_requested_at is not None:
        return State.STOPPING
    if s in QUEUED_SLURM:   # (held for good: a failed launch, a deleted reservation, a special exit: never starts
        return State.UNHEALTHY if held_for_good(s, f.reason) else State.QUEUED   # on its own; replaced, and
        # cancelled, not left in the queue)
    if s != "RUNNING":  # SUSPENDED, STOPPED, RESIZING, ...
        return State.UNHEALTHY
    if f.drain_requested_at is not None:
        return State.DRAINING
    if f.endpoint is None and f.first_ready_time is not None and f.time_limit_warned:
        return State.STOPPING   # its time limit near and its engine gone: the job stops itself (a multi-node one its
    if f.first_ready_time is None or f.endpoint is None:   # own steps, before SLURM's TERM): not unhealthy
        # an adopted job has the startup time from its adoption: an engine that served for hours is not
        # killed for one slow probe after a restart of the daemon (a job whose engine died ends by itself)
        since = max(f.start_time or 0.0, f.adopted_at or 0.0)
        if f.start_time is not None and now - since > policy.startup_timeout_s:
            return State.UNHEALTHY
        return State.STARTING
    if f.consecutive_failures >= policy.failure_threshold:
        return State.UNHEALTHY
    return State.READY


def ready_since(f: ReplicaFacts) -> float | None:
    """Since when the replica has served (None: never READY to this daemon): its first good probe; for a job
    this daemon adopted, which may be its first sight of an engine serving for hours, when the engine came up
    (its record's time, else SLURM's start of the job) if earlier, never before the job's start."""
    if f.first_ready_time is None or f.adopted_at is None:
        return f.first_ready_time
    came_up = max(f.published_at or 0.0, f.start_time or 0.0) or f.first_ready_time
    return min(came_up, f.first_ready_time)


END_REASON = {"TIMEOUT": "time_limit", "NODE_FAIL": "node_lost", "CANCELLED": "cancelled",
              "PREEMPTED": "preempted", "DEADLINE": "time_limit"}


def end_reason(f: ReplicaFacts) -> str:
    """Why a job that ended by itself ended (``slurmfleet_replica_restarts_total``'s reason; "failed" and
    "node_lost" count as crashes): a multi-node job warned of its time limit stops its own steps before it, and
    ends COMPLETED."""
    if f.slurm_state == "COMPLETED" and f.time_limit_warned:
        return "time_limit"
    return END_REASON.get(f.slurm_state or "", "failed")


_RANGE = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def expand_hostlist(nodelist: str) -> list[str]:
    """``node[1-3,7],gpu01`` -> ``['node1', 'node2', 'node3', 'node7', 'gpu01']`` (one bracket level)."""
    out: list[str] = []
    depth, cur = 0, ""
    parts = []
    for ch in nodelist:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        m = _RANGE.match(part)
        if not m:
            out.append(part)
            continue
        prefix, body, suffix = m.groups()
        for piece in body.split(","):
            if "-" in piece:
                lo, hi = piece.split("-", 1)
                width = len(lo)
                out += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            else:
                out.append(f"{prefix}{piece}{suffix}")
    return out
