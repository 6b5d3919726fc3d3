"""The ``autoscale`` root task: samples every autoscaled model's load each second (and at once when a
gateway process reports a request held for a model without a READY replica), steps the
:class:`~orchestrator.fleet.autoscale.Autoscaler`, and wakes the reconciler when a target moves, so a
cold start's ``sbatch`` follows its first request within a second rather than at the next tick.

The load comes through the contract: requests in flight per job and queued per model from the gateway
reports (:class:`~orchestrator.fleet.reports.ReportHub`), the engines' waiting queue and KV-cache use
from the routing table's READY replicas.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping

from ..contract import RoutingTable
from ..observability.metrics import SCALE_CAUSES, Metrics
from .autoscale import Sample
from .nodememory import quiet_since
from .reconciler import Reconciler
from .reports import ReportHub

log = logging.getLogger(__name__)


class Elastic:
    def __init__(self, reconciler: Reconciler, hub: ReportHub, table: Callable[[], RoutingTable], metrics: Metrics,
                 wake_fleet: Callable[[], None], interval_s: float = 1.0,
                 batch_pending: Callable[[], Mapping[str, int]] = dict):
        self.rec, self.hub, self.table, self.metrics = reconciler, hub, table, metrics
        self.batch_pending = batch_pending   # per model: batch requests not sent yet (load, not pressure)
        self.wake_fleet, self.interval_s = wake_fleet, interval_s
        self.event = asyncio.Event()
        self._ended: dict[str, int] = {}   # per model: requests ended, at the previous sample
        self._shown: set[str] = set()       # models whose autoscaling series /metrics shows
        self._restored = False              # the idle times the last daemon kept (nodes.json) taken up

    def poke(self) -> None:
        """A gateway process holds a request for a model without a READY replica: sample now."""
        self.event.set()

    def step(self, now: float, at: float | None = None) -> bool:
        """Sample and decide for every autoscaled model; True (and the reconciler woken) when a target moved.
        ``now``: wall time (SLURM's clock: time limits); ``at``: the autoscaler's (monotonic) time, ``now`` if None."""
        rec = self.rec
        at = now if at is None else at
        scaler = rec.autoscaler
        if not rec.observed:  # before squeue was read, the jobs to adopt are unknown: no decision
            return False
        if not self._restored:
            self._restored = True
            for m in rec.cfg.models:
                if m.autoscale is not None and (t := quiet_since(rec.nodes.loaded, m.name, now)) is not None:
                    scaler.restore_quiet(m.name, at - (now - t))
                    log.info("autoscale %s: no request for %.0fs as the last daemon saw it (its downtime included): "
                             "the idle time counts from then", m.name, now - t)
        queued = self.hub.queued()
        pending = self.batch_pending()
        ended, self._ended = self._ended, self.hub.requests_by_model()
        per_model: dict[str, int] = {}
        for jid, n in dict(self.hub.inflight_by_job()).items():
            f = rec.replicas.get(jid)
            if f is not None:
                per_model[f.model] = per_model.get(f.model, 0) + n
        table = self.table()
        moved = False
        for m in rec.cfg.models:
            a = m.autoscale
            if a is None:
                continue
            loads = [r.load for r in table.ready(m.name)]
            # (a NaN an engine's metrics gave made the mean NaN, and NaN > high is false: both guards off)
            waits = [x.waiting for x in loads if x.waiting is not None and math.isfinite(x.waiting)]
            kvs = [x.kv_usage for x in loads if x.kv_usage is not None and math.isfinite(x.kv_usage)]
            q = queued.get(m.name)
            scaler.observe(m.name, Sample(at, per_model.get(m.name, 0), q.depth if q else 0,
                                          sum(waits) / len(waits) if waits else None,
                                          sum(kvs) / len(kvs) if kvs else None,
                                          max(0, self._ended.get(m.name, 0) - ended.get(m.name, 0)),
                                          pending.get(m.name, 0)), a)
            if rec.runtime(m.name).desired_override is not None:  # pinned by `slurmfleet scale`: the target it
                held = scaler.target(m.name)                        # will go back to (desired shows the pin)
                self.metrics.init_autoscaled(m.name, a.min_replicas if held is None else held)
                continue
            before = scaler.target(m.name)
            d = scaler.step(m.name, a, rec.capacity(m, now), at)
            self.metrics.init_autoscaled(m.name, d.target)
            if d.direction:
                if d.cause in SCALE_CAUSES:
                    self.metrics.scale_decisions.labels(m.name, d.direction, d.cause).inc()
                log.info("autoscale %s: %s -> %d replicas: %s", m.name, before, d.target, d.reason)
            moved |= d.target != before
        auto = {m.name for m in rec.cfg.models if m.autoscale is not None}
        for name in self._shown - auto:   # removed by a reload (the reconciler forgot its target already)
            self.metrics.forget_autoscaled(name)
        self._shown = auto
        if moved:
            self.wake_fleet()
        return moved

    async def run(self) -> None:
        while True:
            try:
                self.step(self.rec.clock(), self.rec.mono())
            except Exception:  # one bad step must not stop autoscaling; the next sample heals
                log.exception("autoscale step failed")
            self.event.clear()
            try:   # (not wait_for: on 3.11 it drops a cancel that meets the event)
                async with asyncio.timeout(self.interval_s):
                    await self.event.wait()
            except TimeoutError:
                pass
