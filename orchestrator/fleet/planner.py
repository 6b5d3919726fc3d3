"""What to do for one model, given its replicas' states: a pure function.

Surge-then-drain: a replica that must go (its config changed, its time limit
is near, or an operator asked for its replacement) keeps serving until a
successor is READY, then it is drained.
"""

from __future__ import annotations

import dataclasses
import math

from ..config import ModelConfig
from ..configchecks import handover_cap_s
from .replica import ACTIVE, State


def handover_lead_s(model: ModelConfig) -> float:
    """How long before its time limit a replica is handed over: ``drain.handover_lead_s``, at most half the
    shortest slot limit (a quarter of the limit when staggered: slot limits wrap within its half), so every
    replica serves a while first."""
    return min(model.drain.handover_lead_s, handover_cap_s(model.time_limit or 0, model.drain.stagger_s))


def reload_changes(old: list[ModelConfig], new: list[ModelConfig]) -> list[str]:
    """What a reload does, model by model, as its reply and the log say it (a changed job shape rolls)."""
    before, names, out = {m.name: m for m in old}, {m.name for m in new}, []
    for m in new:
        prev = before.get(m.name)
        if prev is None:
            out.append(f"model {m.name} added ({m.count_label} replicas)")
            continue
        count = f"{prev.count_label} -> {m.count_label}" if prev.count_label != m.count_label else ""
        skip = ("replicas", "autoscale") if count else ("replicas",)   # (the count says those)
        fields = ", ".join(f for f in type(m).model_fields if f not in skip and getattr(prev, f) != getattr(m, f))
        if prev.job_hash() != m.job_hash():
            out.append(f"model {m.name} changed ({fields}): rolling its replicas" + (f" ({count})" if count else ""))
        elif prev != m:
            out.append(f"model {m.name} updated (" + "; ".join(x for x in (count and count + " replicas", fields) if x)
                       + ")")
    return out + [f"model {m.name} removed: draining its replicas" for m in old if m.name not in names]


@dataclasses.dataclass(frozen=True)
class View:
    """A replica as the planner sees it."""

    job_id: str
    slot: int
    state: State
    config_hash: str
    time_left_s: float | None = None
    time_limit_warned: bool = False
    replace: bool = False       # an operator asked for it to be handed over (``slurmfleet drain --replace``)
    placeholder: bool = False   # a submission not yet seen in squeue
    inflight: int = 0           # requests on it now (over every gateway process)
    drain_reason: str = ""      # why it drains (scale_down, time_limit, ...), "" when it does not
    failing: bool = False       # its last probe failed (a scale-down's drain failing its probes stays drained)
    adopted: bool = False       # running when this daemon found it, no probe passed yet: it may have served for hours


@dataclasses.dataclass(frozen=True)
class Submit:
    model: str
    slot: int
    reason: str
    urgent: bool = dataclasses.field(default=False, compare=False)   # a successor before a time limit: no back-off


@dataclasses.dataclass(frozen=True)
class Drain:
    job_id: str
    reason: str
    replaced: bool = dataclasses.field(default=True, compare=False)   # a READY successor serves in its slot


@dataclasses.dataclass(frozen=True)
class Cancel:
    job_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Undrain:
    """A replica draining for a scale-down serves again: the model wants it back (load returned, or a request
    raced the scale-down), and it is warm where a new job would queue and load."""
    job_id: str


Action = Submit | Drain | Cancel | Undrain


def plan_model(model: str, desired: int, config_hash: str, views: list[View], *, handover_lead_s: float,
               max_surge: int = 1, max_submits: int | None = None) -> list[Action]:
    """Actions that move one model's replicas toward ``desired`` READY replicas of ``config_hash``.

    ``max_submits``: None for no limit, 0 while backing off or blocked; it does not hold back the successor of
    a replica near its time limit (another slot's crash loop would let it time out with none READY).
    """
    actions: list[Action] = []
    for v in views:
        if v.state == State.UNHEALTHY and not v.placeholder:
            actions.append(Cancel(v.job_id, "unhealthy"))
    active = [v for v in views if v.state in ACTIVE]
    outdated = [v for v in active if v.config_hash != config_hash]
    # an outdated replica that serves, or that served before a restart of the daemon (adopted: its first probe
    # under this daemon may fail once, or the first scan of its record be missed), is handed over, not cancelled
    serving = [v for v in outdated if v.state == State.READY or v.adopted and v.state == State.STARTING]
    for v in outdated:
        if v not in serving and not v.placeholder:
            actions.append(Cancel(v.job_id, "config_change"))
    timed_out = [v for v in active if v.state == State.READY and (
        v.time_limit_warned or (v.time_left_s is not None and v.time_left_s < handover_lead_s))]
    near_end = timed_out + [v for v in active if v.state == State.READY and v.replace and v not in timed_out]
    expiring = [v for v in near_end if v.config_hash == config_hash]
    retiring = serving + expiring
    gone = {v.job_id for v in outdated} | {v.job_id for v in expiring}
    fresh = [v for v in active if v.job_id not in gone]

    excess = len(fresh) - desired
    if excess > 0:
        # give up what serves least first: queued, then starting, then a ready one whose last probe failed, then
        # the least loaded ready one (the one nearest its time limit when equal); highest slot first
        rank = {State.QUEUED: 0, State.STARTING: 1, State.READY: 2}
        victims = sorted(fresh, key=lambda v: (rank[v.state], not v.failing, v.inflight, math.inf if v.time_left_s
                                               is None else v.time_left_s, -v.slot))[:excess]
        for v in victims:
            if v.placeholder:
                continue
            actions.append(Drain(v.job_id, "scale_down") if v.state == State.READY else Cancel(v.job_id, "scale_down"))
        fresh = [v for v in fresh if v not in victims]

    missing = desired - len(fresh)
    if missing > 0:   # a scale-down's drains (of this config, far from their time limit) come back before new jobs
        back = sorted((v for v in views if v.state == State.DRAINING and v.drain_reason == "scale_down"
                       and not v.failing and v.config_hash == config_hash and not v.time_limit_warned
                       and (v.time_left_s is None or v.time_left_s >= handover_lead_s)),
                      key=lambda v: (-v.inflight, v.slot))[:missing]
        actions.extend(Undrain(v.job_id) for v in back)
        fresh, missing = fresh + back, missing - len(back)
    # a roll's replicas still draining hold their GPUs: they count against its surge; replicas near their time
    # limit (outdated or not) are all replaced at once, and a scale-up beyond the roll never waits
    # (an operator's replacements, `drain --replace`, are not urgent: they take the surge's room, as a roll)
    old_draining = sum(v.state == State.DRAINING and (v.config_hash != config_hash or v.replace) for v in views)
    room = desired + max_surge - len(fresh) - len(retiring) - old_draining
    n = max(0, min(missing, max(room, missing - len(retiring), len(timed_out))))
    used = {v.slot for v in fresh}
    retiring_by_urgency = sorted(retiring, key=lambda v: (v.time_left_s is None, v.time_left_s or 0.0, v.slot))
    slots = [v.slot for v in retiring_by_urgency if v.slot not in used]
    slots = list(dict.fromkeys(slots))
    candidate, taken = 0, used | set(slots)   # (sets: a count of 1000 costs no quadratic search)
    while len(slots) < n:
        if candidate not in taken:
            slots.append(candidate)
        candidate += 1
    chosen, urgent = slots[:n], {v.slot for v in timed_out}
    if max_submits is not None:
        others = [s for s in chosen if s not in urgent][:max(0, max_submits - sum(s in urgent for s in chosen))]
        chosen = [s for s in chosen if s in urgent or s in others]
    for slot in chosen:
        reason = "handover" if any(v.slot == slot for v in retiring) else "scale_up"
        actions.append(Submit(model, slot, reason, urgent=slot in urgent))

    fresh_ready = sum(1 for v in fresh if v.state == State.READY)
    n_drain = fresh_ready + len(retiring) - desired
    for v in retiring_by_urgency[:max(0, n_drain)]:   # (with no READY successor the count falls: no restart)
        actions.append(Drain(v.job_id, "config_change" if v.config_hash != config_hash else "replace" if v.replace
                             else "time_limit", any(f.slot == v.slot and f.state == State.READY for f in fresh)))
    return actions
