"""The autoscaler: load samples in, a replica target out.

Facts in, state out.  :class:`Autoscaler` stores what it observed (one :class:`Sample` per model every
sampling period: requests in flight and queued over every gateway process, the engines' waiting queue
and KV-cache use) and what it decided last; :func:`decide` is the one pure function that turns those into
the next :class:`Decision`, table-tested on its own.

How a target is chosen (``AutoscaleConfig`` documents each knob):

* the load is in-flight + queued requests averaged over ``window_s``; it asks for
  ``ceil(load / target_inflight_per_replica)`` replicas, kept at the current target while the load is
  within ``tolerance`` of it, or three times its own noise (:mod:`.loadstats`; at most 0.5), and not rising
  along its trend (the band is against noise); a load over by less than its noise is met over longer spans
  (from twice the window or the up delay, up to ``scale_down_delay_s``) once it stands out of their noise, or
  over the down delay's span with the tolerance alone;
* pressure (requests queued in the gateway, or the engines' waiting queue or KV use above their highs)
  in every sample of ``pressure_scale_up_delay_s``, with every replica READY and none on its way, raises
  the target at once by one (or to what the load asks for, if more): the replicas are full now;
* the target rises once every sample of the last ``scale_up_delay_s`` asked for more than it, straight
  to what the load asks for now; while the load rises (over ``window_s`` too: a step is flat after it), the
  up rule sees it projected forward along its trend (the least-squares slope over ``trend_window_s``) by the
  rule's own lag, ``window_s`` / 2 + ``scale_up_delay_s``;
* it falls to what the mean load of the last ``scale_down_delay_s`` asks for, once the smaller count holds
  that mean plus twice its own noise within ``tolerance`` and no window of the delay's second half asks for
  more with that count in force (tolerance included), at most once per ``scale_down_delay_s``: a steady load
  at a threshold moves nothing, a step moves the target once per delay; nor while the engines' waiting queue
  or KV use, spread over the smaller count, would pass its high (the requests in flight beyond the engines'
  slots too, when the config sets them), or the recent load what the gateway admits to it (the pressure rule
  would ask the replica straight back);
* a model at zero with a request held in the gateway goes to one replica at once (a cold start);
  zero is reached only after ``scale_to_zero_after_s`` without any request;
* a job still PENDING in SLURM is capacity on its way: nothing more is submitted behind it;
  no scale-down while a handover is in flight.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

from ..config import AutoscaleConfig, ModelConfig
from ..autoscaleconf import replica_slots
from .loadstats import (DOWN_Z, NOISE_CAP, NOISE_SPAN_MAX_S, NOISE_Z, RISING_SHARE, hold_s, noise, noise_span_s, rising,
                        newest, stay_s)
from .planner import handover_lead_s
from .replica import ACTIVE, ReplicaFacts, State


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One observation of a model's load."""

    t: float
    inflight: int = 0              # requests on its replicas, over every gateway process
    queued: int = 0                # requests waiting in the gateway for a replica
    waiting: float | None = None   # engines' waiting requests, mean per READY replica (None: no reading)
    kv: float | None = None        # engines' KV-cache use, mean over READY replicas (0-1)
    served: int = 0                # requests the gateway ended since the previous sample (a short one falls
                                   # between two samples, in flight in neither: it is activity all the same)
    backlog: int = 0               # batch lines not sent yet: load, but no sign of full replicas (the runner
                                   # holds them back by its own concurrency)
    demand: int = dataclasses.field(init=False)   # inflight + queued + backlog (stored: each step reads an hour's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "demand", self.inflight + self.queued + self.backlog)


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """The model's replicas as the reconciler sees them now."""

    active: int = 0                # QUEUED + STARTING + READY with the current config
    ready: int = 0
    pending: tuple[tuple[str, str], ...] = ()   # (job id, pending reason) of jobs still PENDING in SLURM
    handover: bool = False         # a replica is being replaced (time limit, config change)
    slots: int = 0                 # replica slots kept now: a retiring replica and its successor share one
    admits: int = 0                # requests the gateway processes admit per replica (beyond: its queue); 0: unknown
    engine_slots: int = 0          # sequences one replica's engine runs at once (its max_num_seqs); 0: unknown


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    target: int
    reason: str
    direction: str = ""   # "up", "down", or "" for no change
    cause: str = ""       # bounded metric label: cold_start, load, engine_pressure, idle, bounds


def _recommend(a: AutoscaleConfig, window: Sequence[Sample], current: int, rise: float = 0.0,
               band: float | None = None, mean: float | None = None, over: float | None = None) -> tuple[int, str, str]:
    """What the load of ``window`` (the last ``window_s`` of samples) asks for: (replicas, cause, why); ``rise``
    (requests) is added to its mean (``mean``, when the caller has it): the trend's look-ahead; ``band``: the
    tolerance (None: ``a.tolerance``)."""
    band = a.tolerance if band is None else band
    load = (sum(s.demand for s in window) / len(window) if mean is None else mean) + rise
    want = math.ceil(load / a.target_inflight_per_replica - 1e-9)
    ahead = f", {rise:.1f} of it the rising trend" if rise >= 0.05 else ""
    why = (f"load {load:.1f} (in flight + queued, {a.window_s if over is None else over:.0f}s mean{ahead}) at "
           f"{a.target_inflight_per_replica:g}/replica")
    if current > 0 and abs(load / (current * a.target_inflight_per_replica) - 1) <= band:
        want = current
    if load > 0:
        want = max(want, 1)
    return max(a.min_replicas, min(a.max_replicas, want)), "load", why


def _pressure(a: AutoscaleConfig, s: Sample) -> str:
    """Why the replicas of sample ``s`` are full (requests wait for a slot now), or "" when they are not."""
    if s.queued:
        return f"{s.queued} request{'s' * (s.queued != 1)} queued in the gateway"
    if s.waiting is not None and s.waiting > a.engine_waiting_high:
        return f"engines report {s.waiting:.1f} waiting per replica"
    if s.kv is not None and s.kv > a.kv_cache_high:
        return f"engines' KV cache {s.kv:.0%} full"
    return ""


def _crowded(a: AutoscaleConfig, window: Sequence[Sample], current: int, fewer: int, slots: int = 0) -> str:
    """Why ``fewer`` replicas would be full where ``current`` are not (the engines' mean waiting queue or KV
    use over ``window``, spread over fewer replicas, above its high; or, with the engines' ``slots`` known, the
    requests in flight beyond them: a queue that is empty now grows once fewer slots run them), or "": a
    scale-down the load allows but the engines do not (long contexts, few slots) is not taken, or the
    pressure rule would ask the replica straight back."""
    scale = current / fewer
    kvs = [s.kv for s in window if s.kv is not None]
    if kvs and sum(kvs) / len(kvs) * scale > a.kv_cache_high:
        return f"the engines' KV cache would be {sum(kvs) / len(kvs) * scale:.0%} full"
    waits = [s.waiting for s in window if s.waiting is not None]
    if waits and sum(waits) / len(waits) * scale > a.engine_waiting_high:
        return f"the engines would have {sum(waits) / len(waits) * scale:.1f} waiting per replica"
    over = sum(s.inflight for s in window) / len(window) / fewer - slots if slots and window else 0.0
    if over > a.engine_waiting_high:
        return f"the engines would queue {over:.1f} each beyond their {slots} slots"
    return ""


def _noisy(a: AutoscaleConfig, span: Sequence[Sample], fewer: int, sigma: float, peak: float) -> str:
    """Why ``fewer`` replicas' up rule would ask for the replica back on the load's own excursions (the mean of
    ``span`` plus ``NOISE_Z`` times a window's noise ``sigma``, past the band that rule has there: where
    ``NOISE_CAP`` narrows it, one or two replicas of long requests), or ""."""
    top = fewer * a.target_inflight_per_replica   # (no further than the busiest moment seen: bursts of a few)
    reach = min(peak, sum(s.demand for s in span) / max(1, len(span)) + NOISE_Z * sigma)
    over = top * (1 + max(a.tolerance, min(NOISE_CAP, NOISE_Z * sigma / top)))
    return f"its {a.window_s:.0f}s mean goes to {reach:.1f} on its own (more asked over {over:.1f})" if reach > over else ""


def _queues(recent: Sequence[Sample], fewer: int, admits: int) -> str:
    """Why ``fewer`` replicas would have requests wait in the gateway (the busiest of the ``recent`` samples is
    more than it admits to that many: its queue would be the pressure rule's reason to scale straight back
    up), or ""."""
    peak = max((s.inflight + s.queued for s in recent), default=0)
    if admits and peak > fewer * admits:
        return f"the gateway would queue requests ({peak} at the busiest, {admits} admitted per replica)"
    return ""


def decide(a: AutoscaleConfig, samples: Sequence[Sample], current: int, cap: Capacity, *, now: float,
           last_change: float, last_busy: float | None, since: float, ready_since: float = -math.inf, hold: float | None = None) -> Decision:
    """The next target of a model.

    ``samples``: oldest first, the newest last (at ``now``); ``current``: the target in force;
    ``last_change``: when it last moved; ``last_busy``: the last time any request was in flight or queued
    (None: never since ``since``, when sampling started); ``ready_since``: since when every replica of the
    target has been READY (math.inf: not now)."""
    clamped = max(a.min_replicas, min(a.max_replicas, current))
    if clamped != current:
        return Decision(clamped, f"bounds are {a.min_replicas}-{a.max_replicas}",
                        "up" if clamped > current else "down", "bounds")
    latest = samples[-1] if samples else Sample(now)
    if current == 0:
        if latest.demand > 0 or latest.served > 0:
            # (served: requests that came and could not wait, with no room in the gateway's queue or no hold)
            held = f"{latest.queued} request{'s' * (latest.queued != 1)} held" if latest.queued else \
                f"{latest.inflight} in flight" if latest.inflight else \
                f"{latest.backlog} batch line{'s' * (latest.backlog != 1)} to send" if latest.backlog else \
                f"{latest.served} request{'s' * (latest.served != 1)} that could not be held"
            return Decision(max(1, a.min_replicas), f"cold start: {held}", "up", "cold_start")
        return Decision(0, f"idle: scaled to zero (min_replicas {a.min_replicas})")

    demands = [s.demand for s in samples]
    sums = list(itertools.accumulate(demands, initial=0))   # (each window's mean from two)

    def recs(span: float, at: int = current, rise: float = 0.0,
             band: float | None = None) -> list[tuple[int, str, str]] | None:
        """The recommendation at every sample of the last ``span`` seconds, with ``at`` replicas in force (the
        tolerance, or ``band``, is around it) and ``rise`` added to each window's load; None before that much
        is seen."""
        if now - since < span or not samples:
            return None
        out = []
        lo = len(samples) - 1   # each window's first sample: it only moves back as i does (linear, not quadratic
        for i in range(len(samples) - 1, -1, -1):   # in the span: an hour's down delay cost 100 ms a step)
            s = samples[i]
            if now - s.t > span and out:
                break
            lo = min(lo, i)
            while lo > 0 and s.t - samples[lo - 1].t < a.window_s:
                lo -= 1
            out.append(_recommend(a, samples, at, rise, band, (sums[i + 1] - sums[lo]) / (i + 1 - lo)))
        return out

    window = newest(samples, now, a.window_s, closed=False) or samples[-1:]
    latest_want, _, latest_why = _recommend(a, window, current) if window else (current, "", "")
    if samples and current < a.max_replicas and cap.ready >= current and cap.active == cap.ready \
            and not cap.pending and now - max(since, ready_since) >= a.pressure_scale_up_delay_s:
        # replicas full now (requests wait for a slot): no noise explains that, so no long delay either; only
        # with every replica of the target READY (a target just raised, its job not yet submitted, is capacity
        # on its way too), for the whole delay (requests held through a cold start are no full replica)
        why = [_pressure(a, s) for s in newest(samples, now, a.pressure_scale_up_delay_s, False)] or [_pressure(a, latest)]
        if all(why):
            want = max(current + 1, latest_want)
            return Decision(want, f"{why[-1]} for {a.pressure_scale_up_delay_s:.0f}s with every replica READY",
                            "up", "engine_pressure")
    # a rising load, projected forward by this rule's own lag (half the window, then the delay): a ramp is met
    # as it reaches a threshold, not that lag later; the trend adds nothing to a flat or falling load.  The
    # tolerance band is there against noise, and a trend is not noise: a load rising by RISING_SHARE of a
    # replica's target or more over the lag meets no band
    capacity = current * a.target_inflight_per_replica
    hold = hold_s(samples, now, noise_span_s(a)) if hold is None else hold   # (the caller's, computed once)
    rise = rising(a, samples, now, hold) * (a.window_s / 2 + a.scale_up_delay_s)
    climbing = rise >= RISING_SHARE * a.target_inflight_per_replica
    sigma = noise(a, samples, now, hold)

    def band_over(span: float) -> float:
        # the band for a mean over ``span`` s: the noise shrinks as it lengthens, once it is longer than the window
        # and than twice a request (before, a request's load is in most of it, as in the window)
        return max(a.tolerance, min(NOISE_CAP, NOISE_Z * sigma * math.sqrt(min(1.0, max(a.window_s, 2 * hold) / span)) / capacity))

    fast = band_over(a.window_s)   # (the band of one window's mean: the up rule's, and what status shows)
    up, held = recs(a.scale_up_delay_s, current, rise, 0.0 if climbing else fast), a.scale_up_delay_s
    if not climbing and not (up and min(r[0] for r in up) > current) and latest_want > current:
        # a load over the target by less than a window's noise: met once a longer mean stands out of its own
        # (smaller) noise, or over the down delay's span asks for more as the scale-down would read it; each half
        # of that span too (a step is met once its own load fills both), and all of the span since the last change
        # (what came before it is no evidence for the count in force)
        first = 2 * max(a.window_s, a.scale_up_delay_s)   # (spans doubling from it, then the down delay's)
        spans = [first * 2 ** k for k in range(12) if first * 2 ** k < a.scale_down_delay_s]
        times = [s.t for s in samples]
        for span in spans + [max(first, a.scale_down_delay_s)]:
            if now - since >= span and now - last_change >= span:
                # each half's mean from the prefix sums (an hour's down delay keeps 3,600 samples)
                lo, mid = bisect.bisect_left(times, now - span), bisect.bisect_left(times, now - span / 2)
                if not lo < mid < len(samples):
                    continue
                # (over the whole down delay, the band the scale-down applies to that mean: the tolerance)
                band = band_over(span / 2) if span < a.scale_down_delay_s else a.tolerance
                if all(_recommend(a, (), current, band=band, mean=(sums[j] - sums[i]) / (j - i))[0] > current
                       for i, j in ((lo, mid), (mid, len(samples)))):
                    # to what the span's second half asks for (its first may hold more than is left): at least one more
                    want, cause, why = _recommend(a, (), current, over=span / 2,
                                                  mean=(sums[-1] - sums[mid]) / (len(samples) - mid))
                    up, held = [(max(current + 1, want), cause, why)], span
                    break
    if up and min(r[0] for r in up) > current:
        want, cause, why = up[0]   # asked for more all along: go to what the load asks for now, in one step
        if cap.pending:
            jid, reason = cap.pending[0]
            return Decision(current, f"{why} asks for {want}, but job {jid} is still PENDING in SLURM "
                            f"({reason or 'no reason yet'}): not stacking more behind it")
        return Decision(want, f"{why} asks for {want} (more than {current} for {held:.0f}s)",
                        "up", cause)
    # idle: no request for scale_to_zero_after_s (last_busy before ``since``: quiet since before a daemon's
    # restart, :meth:`Autoscaler.restore_quiet`), and this daemon's own samples for a down delay at least
    quiet = since if last_busy is None else last_busy
    idle = latest.demand == 0 and now - quiet >= a.scale_to_zero_after_s and \
        now - since >= min(a.scale_to_zero_after_s, a.scale_down_delay_s)
    span = newest(samples, now, a.scale_down_delay_s)
    if samples and (idle or now - since >= a.scale_down_delay_s and now - last_change >= a.scale_down_delay_s):
        # what the mean load of the whole down delay asks for (not its busiest moment: a noisy load just under a
        # threshold must not keep a replica for ever), once no sample of its second half would have asked for
        # more than that with that many in force (a short dip, or a load coming back, moves nothing; the
        # tolerance is around the new count, as the scale-up rule will see it: a load the smaller count keeps
        # within tolerance does not hold the replica back)
        # (the delay's mean is itself noise: of a window's, smaller by the square root of its length past twice a
        # request; the smaller count must hold it plus DOWN_Z of that within its tolerance)
        margin = DOWN_Z * sigma * math.sqrt(min(1.0, max(a.window_s, 2 * hold) / max(a.scale_down_delay_s, a.window_s)))
        peak = max(demands)   # (over the noise's span: no reach past what was ever seen)
        sure = math.ceil(min(peak, (sums[-1] - sums[len(samples) - len(span)]) / max(1, len(span)) + margin) / (a.target_inflight_per_replica * (1 + a.tolerance)) - 1e-9)
        want = a.min_replicas if idle else max(1, sure, _recommend(a, span, current)[0])   # (idle: the delay's mean
        # load may hold what scale_to_zero_after_s, shorter than scale_down_delay_s, lets go)
        recent = recs(max(a.window_s, a.scale_down_delay_s / 2), max(want, 1)) or [(latest_want, "", "")]
        if want < current and (idle or max(r[0] for r in recent) <= max(want, 1)):
            crowd = "" if idle else _crowded(a, window, current, max(want, 1), cap.engine_slots) or _queues(
                [s for s in span if now - s.t <= a.scale_down_delay_s / 2], max(want, 1), cap.admits) or _noisy(
                a, span, max(want, 1), sigma, peak)
            if crowd:
                return Decision(current, f"would scale down to {want}, but at {max(want, 1)} {crowd}")
            if cap.handover and want > 0:   # (an idle model still goes to zero: its successor is cancelled and
                # the replica it replaces drained, with no request to fail; waiting would hold the GPUs as long as
                # the successor pends, for good when it waits for the nodes the old job holds)
                return Decision(current, f"would scale down to {want}, but a handover is in flight")
            if idle:   # (to min_replicas: no request for scale_to_zero_after_s, whatever the down delay)
                return Decision(want, f"idle for {a.scale_to_zero_after_s:.0f}s: " + (f"down to min_replicas ({want})"
                                if want else "releasing the last replica"), "down", "idle")
            return Decision(want, f"load asked for {want} or fewer for {a.scale_down_delay_s:.0f}s", "down", "load")
    noisy = f", within its noise: +-{fast:.0%} of {current}" if latest_want > current and fast > a.tolerance else ""
    return Decision(current, f"steady: {latest_why or 'no load'} (asks for {latest_want}{noisy})")


def capacity_of(m: ModelConfig, replicas: Sequence[tuple[ReplicaFacts, State]],
                placeholders: Sequence[tuple[str, int]], now: float, workers: int = 1) -> Capacity:
    """A model's replicas as the autoscaler counts them: active ones of the current config (PENDING jobs and
    submissions not yet in squeue, given as (nonce, slot), included: capacity on its way), READY ones, PENDING
    ones with their reasons, whether a handover (a replica replaced for its time limit, a config change or an
    operator's ``drain --replace``) is in flight, and the slots kept (retiring replicas included: what a target adopted now must keep)."""
    lead = handover_lead_s(m)
    h = m.job_hash()
    active = ready = 0
    pending: list[tuple[str, str]] = []
    slots = {slot for _, slot in placeholders}

    def retiring(f: ReplicaFacts, st: State) -> bool:   # (its successor is the capacity that counts)
        tl = f.time_left_s(now)
        return st in ACTIVE and (f.config_hash != h or f.time_limit_warned or f.replace_requested or (
            st == State.READY and tl is not None and tl < lead)) or (
            st == State.DRAINING and f.drain_reason in ("time_limit", "config_change", "replace"))
    gone = [retiring(f, st) for f, st in replicas]
    old = {f.slot for (f, _), r in zip(replicas, gone) if r}
    handover = bool(old)
    for (f, st), r in zip(replicas, gone):
        if st in ACTIVE:
            slots.add(f.slot)
            if r:
                continue
            active += 1
            ready += st == State.READY
            if st == State.QUEUED and f.slot not in old:   # (a successor pending is no scale-up to wait for)
                pending.append((f.job_id, f.reason or ""))
    for nonce, slot in placeholders:
        active += 1
        if slot not in old:
            pending.append((f"(submission {nonce})", "not yet seen in squeue"))
    return Capacity(active, ready, tuple(pending), handover, len(slots), m.max_inflight_per_replica * workers,
                    replica_slots(m))


class Autoscaler:
    """Per model: the samples of the longest window needed, the target in force and the last decision."""

    def __init__(self) -> None:
        self.samples: dict[str, collections.deque[Sample]] = {}
        self.targets: dict[str, int] = {}
        self.decisions: dict[str, Decision] = {}
        self.last_change: dict[str, float] = {}
        self.last_busy: dict[str, float] = {}
        self.since: dict[str, float] = {}
        self.ready_since: dict[str, float] = {}   # since when every replica of the target is READY
        self.holds: dict[str, float] = {}         # how long a request stays (:func:`hold_s`), at the last step

    def target(self, model: str) -> int | None:   # (None before the model's first decision)
        return self.targets.get(model)

    def adopt(self, model: str, active: int, a: AutoscaleConfig, now: float) -> int:
        """Start from the replicas that exist (after a start, a reload or a restart; ``active``: the slots they
        keep, :attr:`Capacity.slots`, so a replica being replaced counts once and is replaced, not dropped): no
        duplicate of a scale-up already submitted, no cancel of one the bounds allow."""
        n = max(a.min_replicas, min(a.max_replicas, active))
        self.targets[model] = n
        self.last_change[model] = now
        self.since.setdefault(model, now)
        self.decisions[model] = Decision(n, f"adopted {active} existing replica{'s' * (active != 1)}")
        return n

    def forget(self, model: str) -> None:
        for d in (self.samples, self.targets, self.decisions, self.last_change, self.last_busy, self.since,
                  self.ready_since, self.holds):
            d.pop(model, None)

    def quiet_since(self, model: str) -> float | None:
        """Since when the model has had no request (this clock), while it has none; None while it has some,
        and before its first sample."""
        q = self.samples.get(model)
        if not q or q[-1].demand or q[-1].served:
            return None
        return self.last_busy.get(model, self.since.get(model))

    def quiet(self, now: float, at: float) -> dict[str, float]:
        """:meth:`quiet_since` of every model sampled, as wall times (``now``: the wall clock at ``at``, this one)."""
        return {m: now - (at - t) for m in self.samples if (t := self.quiet_since(m)) is not None}

    def restore_quiet(self, model: str, t: float) -> None:
        """The last daemon saw no request for ``model`` since ``t`` (on this clock): its idle time counts from
        there, not from this daemon's start (a request seen since counts, as ever)."""
        self.last_busy.setdefault(model, t)

    def observe(self, model: str, sample: Sample, a: AutoscaleConfig) -> None:
        q = self.samples.setdefault(model, collections.deque())
        q.append(sample)
        self.since.setdefault(model, sample.t)
        if sample.demand > 0 or sample.served:
            self.last_busy[model] = sample.t
        keep = max(2 * a.scale_up_delay_s, a.scale_down_delay_s, NOISE_SPAN_MAX_S) + a.window_s + 1.0
        while q and sample.t - q[0].t > keep:
            q.popleft()

    def step(self, model: str, a: AutoscaleConfig, cap: Capacity, now: float) -> Decision:
        """Decide, and make the decision the target in force."""
        current = self.targets.get(model)
        if current is None:
            current = self.adopt(model, max(cap.slots, cap.active), a, now)
        if cap.ready >= current > 0 and cap.active == cap.ready and not cap.pending:
            self.ready_since.setdefault(model, now)
        else:
            self.ready_since.pop(model, None)
        # (the samples the spans and the noise need, not the hour kept for requests that last long)
        need = max(2 * a.scale_up_delay_s, a.scale_down_delay_s, noise_span_s(a, self.holds.get(model, 0.0)))
        recent = newest(kept := self.samples.get(model, ()), now, need + a.window_s + 1.0)
        self.holds[model] = stay_s(recent, kept, now, noise_span_s(a))
        d = decide(a, recent, current, cap, now=now,
                   last_change=self.last_change.get(model, now), last_busy=self.last_busy.get(model),
                   since=self.since.get(model, now), ready_since=self.ready_since.get(model, math.inf), hold=self.holds[model])
        self.decisions[model] = d
        if d.target != current:
            self.targets[model] = d.target
            self.last_change[model] = now
        return d
