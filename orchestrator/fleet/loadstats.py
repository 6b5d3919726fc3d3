"""What of a model's load samples is signal and what is noise: the statistics the autoscaler's up rule
reads (pure functions of :class:`~orchestrator.fleet.autoscale.Sample` sequences, oldest first).

Requests in flight are a count that moves on its own: with a few requests per replica, a Poisson load's
10 s mean moves by a third of itself, and requests that last longer than the window (long generations)
keep it up or down for as long as they run, so a steady load shows excursions and slopes that look like a
step or a ramp.  What tells them apart: :func:`noise`, how much a window's mean moves on its own (measured on
the load itself, whatever its requests' lengths); :func:`hold_s`, how long a request stays (past twice that,
a longer mean's noise shrinks with the square root of its length); and :func:`rising`, a trend only when its
slope stands out of the noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Protocol

from ..config import AutoscaleConfig

TREND_Z = 3.0
"""A slope is a trend once it is this many standard errors above zero (:func:`slope_error`).  In
``bench/autoscale_model.py``'s days (3 s requests, a 90 s trend) 3 changed little against no test at all
(slow requests 18.3 against 18.0 a day over 60 seeds), while 4 met the ramp to the burst late (22.7)."""

NOISE_Z = 3.0
"""The up rule's band is this many times the noise (up to ``NOISE_CAP``) of the load's mean over the current replicas'
target load (the noise of a ``window_s`` mean for the fast rule; of a longer mean, smaller by the square root
of its length, for the longer spans it also checks): an excursion of a steady load stays inside it."""

NOISE_CAP = 0.5
"""...but never wider than this (a share of the current replicas' target load): with one or two replicas of
long requests three times the noise is 50-130%, and a load twice the target would have waited for the longer
spans."""

RISING_SHARE = 0.1
"""A load whose trend adds this share of ``target_inflight_per_replica`` or more over the up rule's lag is rising:
the up rule sees it without the tolerance band.  (In ``bench/autoscale_model.py``'s days, 0.05 let the noise of
a flat load through, so a steady middle held a third replica longer; 0.15 met ramps late.)"""


class Load(Protocol):
    t: float
    inflight: int
    served: int
    backlog: int

    @property
    def demand(self) -> int: ...


def noise_span_s(a: AutoscaleConfig) -> float:
    """How far back :func:`noise` looks: the trend's span or the down delay's, at least 6 windows."""
    return max(a.trend_window_s, a.scale_down_delay_s, 6 * a.window_s)


def noise(a: AutoscaleConfig, samples: Sequence[Load], now: float) -> float:
    """The standard deviation of a ``window_s`` mean of the load (batch backlog aside) around its level, over
    the last :func:`noise_span_s`: from the differences of non-overlapping windows' means two windows apart
    (one window between them: requests longer than that still carry over, so the noise of long requests is
    underestimated rather than over), through their median absolute deviation around their median (a step
    is one large difference among many, a ramp the same rise in each: neither is noise).  0 before three such
    differences are seen (pairs of idle windows do not count: a load idle over most of the span has too few
    for a reading at first, not a reading of 0)."""
    span = noise_span_s(a)
    means: list[float] = []
    total = count = 0
    start = None
    for s in samples:
        if now - s.t > span:
            continue
        if start is None:
            start = s.t
        elif s.t - start >= a.window_s:
            means.append(total / count)
            total = count = 0
            start = s.t
        total += s.demand - s.backlog   # (batch lines the runner holds back come and go in its own rhythm)
        count += 1
    diffs = [y - x for x, y in zip(means, means[2:]) if x or y]   # (idle against idle: no reading of the noise;
    if len(diffs) < 3:                                              # a quiet night read as none for half a span)
        return 0.0
    mid = statistics.median(diffs)   # (a ramp's rise between two windows: no noise)
    return 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)   # (a normal's sd from its MAD)



def hold_s(samples: Sequence[Load], now: float, span: float) -> float:
    """How long a request stays in flight, on average over the last ``span`` (Little's law: the requests in
    flight integrated over time, over the requests ended; samples taken closer together weigh less); infinite
    when requests were in flight and none ended (they outlast the span), 0 when none were."""
    held = ended = 0.0
    prev = None
    for s in samples:
        if now - s.t <= span:
            held += s.inflight * (s.t - prev if prev is not None else 1.0)
            ended += s.served
        prev = s.t
    return held / ended if ended else math.inf if held else 0.0


def rising(a: AutoscaleConfig, samples: Sequence[Load], now: float) -> float:
    """The load's rise per second over the last ``trend_window_s`` (least-squares slope of the samples' demand);
    0 when it is flat or falling, when its slope is within ``TREND_Z`` standard errors of zero (noise), when
    the trend is off, before 90% of that span is seen, or once the load has stopped rising (the last
    ``window_s`` no higher than the one before: a step's slope stays positive for a whole trend window after
    it, and projecting it would scale up again and again past what the load needs)."""
    if a.trend_window_s <= 0:
        return 0.0
    pts = [s for s in samples if now - s.t <= a.trend_window_s]
    if len(pts) < 3 or now - pts[0].t < 0.9 * a.trend_window_s or pts[-1].t == pts[0].t:
        return 0.0   # (samples all at one instant have no slope: linear_regression would raise)
    last = [s for s in pts if now - s.t < a.window_s]
    if len(last) >= 3 and last[-1].t > last[0].t and statistics.linear_regression(
            [s.t for s in last], [s.demand for s in last]).slope <= 0:
        return 0.0
    ts, ys = [s.t for s in pts], [s.demand for s in pts]
    fit = statistics.linear_regression(ts, ys)
    return fit.slope if fit.slope > 0 and fit.slope >= TREND_Z * slope_error(ts, ys, fit.slope, fit.intercept) else 0.0


def slope_error(ts: Sequence[float], ys: Sequence[float], slope: float, intercept: float) -> float:
    """The standard error of a least-squares slope through (``ts``, ``ys``), widened for residuals that follow
    each other (requests that last longer than a sample apart keep the load up or down for as long): times
    sqrt((1 + r) / (1 - r)), r the residuals' lag-one autocorrelation (an AR(1) noise's effective sample
    count).  0 for a perfect fit."""
    res = [y - (intercept + slope * t) for t, y in zip(ts, ys)]
    n = len(res)
    ss = sum(r * r for r in res)
    if n < 3 or ss == 0:
        return 0.0
    tm = sum(ts) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx == 0:
        return 0.0
    r1 = max(0.0, min(0.98, sum(x * y for x, y in zip(res, res[1:])) / ss))
    return math.sqrt(ss / (n - 2) / sxx * (1 + r1) / (1 - r1))
