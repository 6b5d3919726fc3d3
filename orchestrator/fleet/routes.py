"""What the fleet tells the gateway about each model besides its READY replicas: while none is READY,
what it is waiting for (so a request held through a cold start can say why it ended), and whether the
model is blocked (so held requests end at once)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..config import ModelConfig
from ..contract import ModelRoutes, Replica
from .replica import ModelRuntime, ReplicaFacts, State


def model_routes(m: ModelConfig, replicas: Sequence[tuple[ReplicaFacts, State]], rt: ModelRuntime, desired: int,
                 now: float) -> ModelRoutes:
    """The model's entry in the routing table: its READY replicas (with an endpoint), and while it has none,
    what it waits for; and why it cannot get one (blocked), if so."""
    ready = tuple(Replica(f.job_id, f.model, f.slot, f.endpoint, max_model_len=f.max_model_len, engine=f.engine_hash)
                  for f, st in replicas if st == State.READY and f.endpoint is not None)
    why, since = ("", 0.0) if ready else waiting_on(m.name, replicas, rt, desired, now)
    return ModelRoutes(desired, ready, why, rt.blocked or held_at_zero(m, rt, desired), since)


def waiting_on(name: str, replicas: Iterable[tuple[ReplicaFacts, State]], rt: ModelRuntime, desired: int,
               now: float) -> tuple[str, float]:
    """One line on why ``name`` has no READY replica (the job nearest to serving, or why there is none), and
    since when (epoch seconds; 0: no such moment).  The line holds no clock: the gateway adds the time waited
    when it answers, so the table does not change every tick while a job pends (a new table makes every
    drain wait for the gateway processes' next reports)."""
    starting = queued = None
    for f, st in replicas:
        if st == State.STARTING and (starting is None or (f.start_time or now) < (starting.start_time or now)):
            starting = f
        elif st == State.QUEUED and (queued is None or (f.submit_time or now) < (queued.submit_time or now)):
            queued = f
    if starting is not None:
        return (f"job {starting.job_id} is starting on {starting.nodelist or 'its node'} (its engine not ready "
                "yet)"), starting.start_time or 0.0
    if queued is not None:
        return f"job {queued.job_id} is PENDING in SLURM ({queued.reason or 'no reason yet'})", \
            queued.submit_time or 0.0
    if rt.blocked:
        return rt.blocked, 0.0
    if now < rt.backoff_until and rt.backoff_cause == "submit_limit":   # (SLURM's job count limit: no crash)
        return (f"the model waits for SLURM's job limit to free ({rt.last_error}; SLURM words a job over a per-job "
                "limit of its QOS or association, GPUs or time, the same: see `sacctmgr show qos`)"), 0.0
    if now < rt.backoff_until and rt.backoff_cause == "partition_closed":
        return f"the model waits for its partition to take jobs again ({rt.last_error})", 0.0
    if now < rt.backoff_until:
        return f"the model is backing off after crashes ({rt.last_error or 'early failures'})", 0.0
    if desired == 0:
        return f"model {name} has no replica wanted now", 0.0
    return rt.last_error or "a job is being submitted", 0.0


def held_at_zero(m: ModelConfig, rt: ModelRuntime, desired: int) -> str:
    """Why no request for ``m`` can be answered, when it is kept at zero replicas by the file or a pin (not
    by the autoscaler, which a request wakes): its held requests end at once with that, not after their hold."""
    if desired != 0 or (m.autoscale is not None and rt.desired_override is None):
        return ""
    if rt.desired_override is not None:
        return (f"model {m.name} is pinned at 0 replicas by 'slurmfleet scale' "
                f"('slurmfleet scale {m.name} auto' unpins it)")
    return f"model {m.name} has replicas: 0 in the fleet file"
