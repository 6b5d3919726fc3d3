"""What of a model's load samples is signal and what is noise: the statistics the autoscaler's up rule
reads (pure functions of :class:`~orchestrator.fleet.autoscale.Sample` sequences, oldest first).

Requests in flight are a count that moves on its own: with a few requests per replica, a Poisson load's
10 s mean moves by a third of itself, and requests that last longer than the window (long generations)
keep it up or down for as long as they run, so a steady load shows excursions and slopes that look like a
step or a ramp.  What tells them apart: :func:`noise`, how much a window's mean moves on its own (measured on
the load itself, on means far enough apart that a request of one is gone by the other); :func:`hold_s`, how
long a request stays (past twice that, a longer mean's noise shrinks with the square root of its length); and
:func:`rising`, a trend only when its slope stands out of the noise.
"""

from __future__ import annotations

import itertools
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

DOWN_Z = 2.0
"""The scale-down goes to a count that holds (with ``tolerance``) the down delay's mean load plus this many times
that mean's noise (a window's, smaller by the square root of the delay past twice a request): a mean over a
few requests' stays is itself noise, and a load a little over a threshold went down on one that dipped, and
came back up at its next excursion (17 in flight of 80-240 s requests at 8 per replica: 27 events in four
hours).  Short requests and the defaults' 300 s delay make it a fraction of a request."""

RISING_SHARE = 0.1
"""A load whose trend adds this share of ``target_inflight_per_replica`` or more over the up rule's lag is rising:
the up rule sees it without the tolerance band.  (In ``bench/autoscale_model.py``'s days, 0.05 let the noise of
a flat load through, so a steady middle held a third replica longer; 0.15 met ramps late.)"""


FALL_Z = 3.0
"""A load whose mean over its last two :func:`noise_lag` s is this many times its noise under the level its noise
was read at (the median level of the differences read), and under half of it, has fallen: :func:`noise` is then
told at its new level (without the half, the wander of long requests whose noise was read too close together
passed for a fall at 3-7 of 22 moments of a steady load, and narrowed the band by 0.7-0.9x).  Requests that stay
under half a window (:func:`short_stay`) have no such wander, and their fall needs no half: a burst of 3 s
requests at 22 in flight that fell to 11 kept its noise for as long as it ruled the differences' median, and its
margins held a third replica at 11 (6 per replica) for 173 s (``bench/autoscale.py``, seed 13, on the cluster; a
replay of that run's samples: 44 s now).
(Told at the level of the last lag or two on any load, a steady load's dips narrowed the band, and it went down
and up again: 80-240 s requests at 8.4 in flight moved 10 times in six hours, against none.)"""


class Load(Protocol):
    t: float
    inflight: int
    served: int
    backlog: int

    @property
    def demand(self) -> int: ...


MAD_SD = 1.4826 / math.sqrt(2)
"""A window mean's standard deviation from the median absolute deviation of differences of two such means (a
normal's sd is 1.4826 times its MAD, and a difference of two has sqrt(2) times the spread of one)."""

NOISE_SPAN_MAX_S = 3600.0
"""The longest :func:`noise` looks back, for requests that last long (the autoscaler keeps that much)."""


def newest(samples: Sequence[Load], now: float, span: float, closed: bool = True) -> list:
    """The newest of ``samples`` (oldest first) within ``span`` of ``now`` (``now - t <= span``, or ``<`` when not
    ``closed``): found by a binary search, not a pass over the hour kept (that cost most of a step)."""
    lo, hi = 0, len(samples)   # (the first sample within the span: the test holds from some sample on, as
    while lo < hi:             # times only grow)
        mid = (lo + hi) // 2
        age = now - samples[mid].t
        if age > span or not closed and age == span:
            lo = mid + 1
        else:
            hi = mid
    return list(itertools.islice(samples, lo, None))


def noise_span_s(a: AutoscaleConfig, hold: float = 0.0) -> float:
    """How far back :func:`noise` looks: the trend's span or the down delay's, at least 6 windows, and at least
    12 lags of :func:`noise_lag` (up to ``NOISE_SPAN_MAX_S``: a step is then in a twelfth of the differences,
    and the median's reading is steady)."""
    return max(a.trend_window_s, a.scale_down_delay_s, 6 * a.window_s,
               min(NOISE_SPAN_MAX_S, 12 * noise_lag(a, hold) * a.window_s))


def noise_lag(a: AutoscaleConfig, hold: float) -> int:
    """How many windows apart the means :func:`noise` compares are: two (one window between them), or as many
    as twice a request's stay (``hold``, :func:`hold_s`): a load of long requests wanders with them, slowly, and
    means closer together than that differ by a small part of it (10-30 s requests' noise read at 60-70% of
    their 10 s means' spread, 80-240 s requests' at 35%: the fast rule's band was that much too narrow, and a
    steady load at a threshold went up, and down again a down delay later)."""
    if not math.isfinite(hold):   # (none ended yet: no stay to go by)
        return 2
    return max(2, min(int(NOISE_SPAN_MAX_S / 12 / a.window_s), math.ceil(2 * hold / a.window_s)))


def noise(a: AutoscaleConfig, samples: Sequence[Load], now: float, hold: float = 0.0) -> float:
    """The standard deviation of a ``window_s`` mean of the load (batch backlog aside) around its level, over
    the last :func:`noise_span_s`: from the differences of non-overlapping windows' means :func:`noise_lag`
    apart (two windows, or twice a request's ``hold``: far enough apart that the requests of one are gone by
    the other), through their median absolute deviation around their median (a step is a few large
    differences among many, a ramp the same rise in each: neither is noise).  0 before three such differences
    are seen (pairs of idle windows do not count: a load idle over most of the span has too few for a reading
    at first, not a reading of 0).  After a fall (``FALL_Z``) it is told at the new level, never wider."""
    span, lag = noise_span_s(a, hold), noise_lag(a, hold)
    means = window_means(newest(samples, now, span), a.window_s)
    pairs = [(x, y) for x, y in zip(means, means[lag:]) if x or y]   # (idle against idle: no reading of the noise;
    if len(pairs) < 3:                                                 # a quiet night read as none for half a span)
        return 0.0
    mid = statistics.median(y - x for x, y in pairs)   # (a ramp's rise between two windows: no noise)
    sd = MAD_SD * statistics.median(abs(y - x - mid) for x, y in pairs)
    # a count's spread goes with the square root of its level: after a fall far out of that spread (40 to 10 in
    # flight) the old level's held a replica for half an hour, so each difference is then read at its own level
    # and the spread told at the level of the last two lags (of one lag, a dip at the new level narrowed it); the
    # fall is from the level the spread was read at (the differences' median), not the span's mean, which
    # follows the fall down and let the old spread back while it still ruled the median
    now_level = statistics.fmean(means[-2 * lag - 1:])
    was = statistics.median((x + y) / 2 for x, y in pairs)
    if was - now_level > FALL_Z * sd and (now_level < was / 2 or short_stay(a, hold)):   # (a wander of long requests
        # may pass 3 sd; short ones' means two windows apart are independent: their noise is read right)
        unit = statistics.median(abs(y - x - mid) / math.sqrt(max(1.0, (x + y) / 2)) for x, y in pairs)
        return min(sd, MAD_SD * unit * math.sqrt(max(1.0, now_level)))
    return sd


def window_means(pts: Sequence[Load], window: float) -> list[float]:
    """The mean load (batch backlog aside: the runner's lines come and go in its own rhythm) of consecutive
    windows of ``pts``: each from a sample to the last one less than ``window`` after it; the last window,
    not over yet, left out."""
    ts = [s.t for s in pts]
    ys = [s.demand - s.backlog for s in pts]
    means: list[float] = []
    i, n, step = 0, len(ts), 1
    while i < n:   # (each window's end found from the last one's length: a sample or two looked at, not all)
        start, j = ts[i], min(n, i + step)
        while j > i + 1 and ts[j - 1] - start >= window:
            j -= 1
        while j < n and ts[j] - start < window:
            j += 1
        if j == n:
            break
        means.append(sum(ys[i:j]) / (j - i))
        i, step = j, j - i
    return means


def short_stay(a: AutoscaleConfig, hold: float) -> bool:
    """Whether a request stays (``hold``, :func:`hold_s`) under half a ``window_s``: means two windows apart then
    share no request, and a load's level moves only as its arrivals do."""
    return 2 * hold < a.window_s


def hold_s(samples: Sequence[Load], now: float, span: float) -> float:
    """How long a request stays in flight, on average over the last ``span`` (Little's law: the requests in
    flight integrated over time, over the requests ended; samples taken closer together weigh less); infinite
    when requests were in flight and none ended (they outlast the span), 0 when none were."""
    held = ended = 0.0
    for i in range(len(samples) - 1, -1, -1):   # (newest first: the span's samples only)
        s = samples[i]
        if now - s.t > span:
            break
        held += s.inflight * (s.t - samples[i - 1].t if i else 1.0)
        ended += s.served
    return held / ended if ended else math.inf if held else 0.0


def stay_s(recent: Sequence[Load], kept: Sequence[Load], now: float, span: float) -> float:
    """:func:`hold_s` over ``span`` of the ``recent`` samples; when none ended there, over all the samples
    ``kept`` (an hour), and at least as long as the oldest request in flight has stayed (since the last end,
    or the last moment none was in flight: an hour of short requests before long ones read as seconds)."""
    hold = hold_s(recent, now, span)
    if hold < math.inf:
        return hold
    since = next((s.t for s in reversed(kept) if s.served or not s.inflight), kept[0].t if kept else now)
    return max(hold_s(kept, now, math.inf), now - since)


def rising(a: AutoscaleConfig, samples: Sequence[Load], now: float, hold: float = 0.0) -> float:
    """The load's rise per second over the last ``trend_window_s`` (least-squares slope of the samples' demand);
    0 when it is flat or falling, when its slope is within ``TREND_Z`` standard errors of zero (noise), when
    the trend is off, before 90% of that span is seen, or once the load has stopped rising (the last
    ``window_s`` no higher than the one before: a step's slope stays positive for a whole trend window after
    it, and projecting it would scale up again and again past what the load needs)."""
    if a.trend_window_s <= 0:
        return 0.0
    pts = newest(samples, now, a.trend_window_s)
    if len(pts) < 3 or now - pts[0].t < 0.9 * a.trend_window_s or pts[-1].t == pts[0].t:
        return 0.0   # (samples all at one instant have no slope: linear_regression would raise)
    last = [s for s in pts if now - s.t < a.window_s]
    if len(last) >= 3 and last[-1].t > last[0].t and statistics.linear_regression(
            [s.t for s in last], [s.demand for s in last]).slope <= 0:
        return 0.0
    ts, ys = [s.t for s in pts], [s.demand for s in pts]
    fit = statistics.linear_regression(ts, ys)
    err = slope_error(ts, ys, fit.slope, fit.intercept, hold)
    return fit.slope if fit.slope > 0 and fit.slope >= TREND_Z * err else 0.0


def slope_error(ts: Sequence[float], ys: Sequence[float], slope: float, intercept: float, hold: float = 0.0) -> float:
    """The standard error of a least-squares slope through (``ts``, ``ys``), widened for residuals that follow
    each other (requests that last longer than a sample apart keep the load up or down for as long): times
    sqrt((1 + r) / (1 - r)), r the residuals' lag-one autocorrelation (an AR(1) noise's effective sample
    count), at most 0.98, and at least 1 - a sample's share of a request's ``hold`` (the share of requests still
    in flight a sample later: a count of requests that last 160 s stays 99.4% the same from one second to the
    next, and a fit takes part of their slow wander for its line; the residuals' own reading, capped at 0.98,
    counted that wander as 6 times more samples than it is, and it passed for a trend).  0 for a perfect fit."""
    res = [y - (intercept + slope * t) for t, y in zip(ts, ys)]
    n = len(res)
    ss = sum(r * r for r in res)
    if n < 3 or ss == 0:
        return 0.0
    tm = sum(ts) / n
    sxx = sum((t - tm) ** 2 for t in ts)
    if sxx == 0:
        return 0.0
    step = (ts[-1] - ts[0]) / (n - 1)
    held = min(0.999, 1 - step / hold) if step > 0 and math.isfinite(hold) and hold > step else 0.0
    r1 = max(held, min(0.98, sum(x * y for x, y in zip(res, res[1:])) / ss))
    return math.sqrt(ss / (n - 2) / sxx * (1 + r1) / (1 - r1))
