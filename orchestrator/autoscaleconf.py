"""A model's ``autoscale`` settings (part of the fleet config's schema, re-exported by :mod:`orchestrator.config`)."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field, model_validator

from .configchecks import FieldError, int_arg
from .keys import Strict


class AutoscaleConfig(Strict):
    """Replicas follow the load between ``min_replicas`` and ``max_replicas`` (exclusive with ``replicas``).

    The load of a model is its requests in flight plus those queued in the gateway, averaged over
    ``window_s``; it asks for ``ceil(load / target_inflight_per_replica)`` replicas, or one more than now
    once the replicas have been full for ``pressure_scale_up_delay_s``.  A rise must hold for ``scale_up_delay_s``
    and a fall for ``scale_down_delay_s`` before the target moves (in one step); a load within
    ``tolerance`` of the current target, or within its own noise, keeps it (a rise within the noise is met over
    longer spans, up to ``scale_down_delay_s``); a rising load is projected forward by the up rule's lag
    (``trend_window_s``).  A replica PENDING in SLURM counts as capacity: no
    further scale-up is submitted behind it."""

    min_replicas: int = Field(0, ge=0, le=1000)
    """Never fewer replicas. 0 allows scale to zero: requests are then held through a cold start."""
    max_replicas: int = Field(1, ge=1, le=1000)
    """Never more replicas."""
    target_inflight_per_replica: float = Field(8.0, gt=0)
    """Requests (in flight + queued in the gateway) one replica should carry on average."""
    window_s: float = Field(10.0, gt=0)
    """Averaging window of the load (seconds)."""
    scale_up_delay_s: float = Field(10.0, ge=0)
    """A higher target must be asked for this long before it is applied (seconds); longer when the load is
    over the target by less than its noise (see ``tolerance``)."""
    scale_down_delay_s: float = Field(300.0, ge=0)
    """A lower target must be asked for this long, and this long after the last change (seconds)."""
    scale_to_zero_after_s: float = Field(900.0, ge=0)
    """With ``min_replicas: 0``: the last replica drains after this long without any request (seconds)."""
    cold_start_hold_s: float = Field(600.0, ge=0)
    """While no replica is READY (scaled to zero, or all gone), a request is held this long for one to come
    up before a 503 (seconds; instead of ``gateway.queue_timeout_s``)."""
    tolerance: float = Field(0.1, ge=0, lt=1)
    """A load within this fraction of the current target's capacity does not move it, unless it is rising
    along its trend (see ``trend_window_s``): the band is against noise, and a trend is not noise.  The band
    is wider where the load's own noise is (three times a window's measured spread, up to 0.5: few or long
    requests); a load over the target by less than that moves it over longer spans, up to
    ``scale_down_delay_s`` (:func:`orchestrator.fleet.autoscale.decide`)."""
    engine_waiting_high: float = Field(4.0, ge=0)
    """Engine-side queue (``vllm:num_requests_waiting``, mean per READY replica) above which the replicas
    count as full (0: any request waiting); no scale-down that would put them above it."""
    kv_cache_high: float = Field(0.9, gt=0, le=1)
    """Mean ``vllm:kv_cache_usage_perc`` (0-1) above which the replicas count as full; no scale-down that
    would put them above it (their use times the count now over the count after)."""
    trend_window_s: float = Field(300.0, ge=0)
    """A rising load is looked ahead along: its slope over this long (least squares over the samples, three
    standard errors above zero, the error widened for requests that outlast a sample) times
    the up rule's own lag (``window_s`` / 2 + ``scale_up_delay_s``) is added to the load the up rule sees, so a
    ramp is met when it reaches a threshold rather than a lag later (seconds; 0: off).  A falling or flat load
    adds nothing, as does one that stopped rising over the last ``window_s`` (a step), and nothing is projected
    before this long is seen."""
    pressure_scale_up_delay_s: float = Field(5.0, ge=0)
    """Full replicas (requests queued in the gateway, or engines above ``engine_waiting_high`` or
    ``kv_cache_high``) in every sample of this long, with every replica READY and none on its way, add one
    replica at once, without ``scale_up_delay_s`` (seconds)."""

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscaleConfig":
        if self.min_replicas > self.max_replicas:
            raise FieldError(("min_replicas", "max_replicas"), f"min_replicas ({self.min_replicas}) is greater than max_replicas ({self.max_replicas})")
        return self


def replica_slots(m) -> int:
    """The sequences one replica of model ``m`` runs at once: its engine's slots (``max_num_seqs``) times its
    data-parallel ranks; 0 when vLLM picks its own."""
    return (m.engine_slots or 0) * max(1, int_arg(m.vllm_args.get("data-parallel-size")) or 1)


def advisories(models: Iterable, workers: int) -> list[str]:
    """What ``validate``, a reload and a start warn of in autoscale settings that are valid but work against
    each other: a target per replica above what the gateway lets a replica take (its in-flight cap, per
    gateway process), so replicas fill and requests queue before the load rule asks for more; or above what
    a replica's engine runs at once (its slots, times its data-parallel ranks) plus ``engine_waiting_high``, so
    the engines count as full before the target's load is reached."""
    out = []
    for m in models:
        a = getattr(m, "autoscale", None)
        if a is None:
            continue
        cap = m.max_inflight_per_replica * workers
        target = a.target_inflight_per_replica
        if target > cap:
            out.append(f"model {m.name}: autoscale.target_inflight_per_replica {target:g} is "
                       f"above the {cap} requests a replica takes (max_inflight_per_replica x gateway.workers): "
                       "replicas fill and requests queue in the gateway before the load rule asks for more (engine "
                       f"pressure adds one replica at a time); set it at or below {cap}")
        slots = replica_slots(m)
        if slots and target > slots + a.engine_waiting_high:
            out.append(f"model {m.name}: autoscale.target_inflight_per_replica {target:g} is above the {slots} "
                       f"sequences a replica's engine runs at once plus autoscale.engine_waiting_high "
                       f"({a.engine_waiting_high:g}): its engines queue past that high before the load rule asks for "
                       f"more, so engine pressure sizes the model (one replica at a time), not the target; set it at or "
                       f"below {slots + a.engine_waiting_high:g}, or raise the engines' max-num-seqs")
    return out
