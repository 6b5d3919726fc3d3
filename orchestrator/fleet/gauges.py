"""The fleet's gauges, set from the replicas' states once a tick: replicas by state, SLURM jobs by state and
pending reason, the replica count wanted, the oldest pending job's age, and per READY or STARTING slot its
time left and whether it serves (0 for a slot whose replica is queued, starting, unhealthy or failed)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..config import ModelConfig
from ..observability.metrics import Metrics
from .replica import QUEUED_SLURM, ReplicaFacts, State

REASON_CHARS = 64
# the states of a replica whose slot should serve: its slot's slurmfleet_replica_ready is 0 until one is READY
SERVING = frozenset({State.QUEUED, State.STARTING, State.READY, State.UNHEALTHY, State.FAILED})


def reason_code(reason: str | None) -> str:
    """A pending reason as a label value: SLURM's code, without the node names some reasons go on with
    (``ReqNodeNotAvail, UnavailableNodes:node[2-4]``: a new series for each set of nodes down would have no
    bound).  ``slurmfleet status`` shows the whole reason."""
    return (reason or "").split(",", 1)[0].split(":", 1)[0].strip()[:REASON_CHARS]


def export_gauges(metrics: Metrics, models: Sequence[ModelConfig],
                  states: Mapping[str, Sequence[tuple[ReplicaFacts, State]]],
                  desired: Callable[[ModelConfig], int], now: float) -> None:
    """``states``: per model (the configured ones and any left from a removed one), its replicas and states."""
    counts: dict[tuple[str, str], int] = {}
    jobs: dict[tuple[str, str, str], int] = {}
    configured = {m.name for m in models}
    time_left: dict[tuple[str, str], float] = {}
    ready: dict[tuple[str, str], int] = {}   # a configured model's slot that should serve: 1 while one is READY
    metrics.time_left.clear()
    metrics.replica_up.clear()
    for name, replicas in states.items():
        for f, st in replicas:
            counts[(name, st.value)] = counts.get((name, st.value), 0) + 1
            key = (name, f.slurm_state or "GONE", reason_code(f.reason))
            jobs[key] = jobs.get(key, 0) + 1
            tl = f.time_left_s(now)
            if tl is not None and st in (State.READY, State.STARTING):   # a slot's retiring replica and its
                slot = (name, str(f.slot))                                # successor: the one nearer its end
                time_left[slot] = min(tl, time_left.get(slot, tl))
            if name in configured and st in SERVING:   # (a drained or stopped one's slot is not one to serve)
                slot = (name, str(f.slot))
                ready[slot] = max(ready.get(slot, 0), int(st == State.READY and f.endpoint is not None))
    for (name, slot), up in ready.items():
        metrics.replica_up.labels(name, slot).set(up)
    for (name, slot), tl in time_left.items():
        metrics.time_left.labels(name, slot).set(tl)
    metrics.replicas.clear()
    metrics.jobs.clear()
    metrics.forget_models(configured)
    for m in models:
        metrics.init_model(m.name)
        metrics.desired.labels(m.name).set(desired(m))
        ages = [now - f.submit_time for f, _ in states.get(m.name, ())
                if f.slurm_state in QUEUED_SLURM and f.submit_time]
        metrics.oldest_pending.labels(m.name).set(max(ages, default=0.0))
        for st in State:
            metrics.replicas.labels(m.name, st.value).set(counts.get((m.name, st.value), 0))
    for (model, sstate, reason), n in jobs.items():
        metrics.jobs.labels(model, sstate, reason).set(n)
