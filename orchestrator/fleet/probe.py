"""Probes: is a replica's engine up and serving the right model?

``/health`` first, then ``/v1/models`` (with the job's secret) must list the
served name.  A deep probe (a 1-token completion) catches a multi-node replica
whose head answers ``/health`` while a worker node is dead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable

import aiohttp

from ..config import FleetConfig
from ..observability.metrics import Metrics
from .replica import Endpoint, ReplicaFacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool
    error: str | None = None
    max_model_len: int = 0   # the served model's context length, as /v1/models lists it (0: not listed)


class Prober:
    """Probes over one shared ClientSession."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def probe(self, ep: Endpoint, served_name: str, timeout_s: float, deep: bool = False,
                    deep_timeout_s: float = 10.0) -> ProbeResult:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = {"Authorization": f"Bearer {ep.secret}"}
        try:
            async with self.session.get(f"{ep.url}/health", headers=headers, timeout=timeout) as r:
                if r.status != 200:
                    return ProbeResult(False, f"/health returned {r.status}")
            async with self.session.get(f"{ep.url}/v1/models", headers=headers, timeout=timeout) as r:
                if r.status != 200:
                    return ProbeResult(False, f"/v1/models returned {r.status}")
                body = await r.json(content_type=None)
                models = {m.get("id"): m for m in body.get("data", []) if isinstance(m, dict)}
                if served_name not in models:
                    return ProbeResult(False, f"/v1/models does not list {served_name!r} (has {list(models)})")
                mml = models[served_name].get("max_model_len")
            if deep:
                payload = {"model": served_name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
                async with self.session.post(f"{ep.url}/v1/completions", json=payload, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=deep_timeout_s)) as r:
                    if r.status != 200:
                        return ProbeResult(False, f"1-token completion returned {r.status}")
                    await r.read()
        except asyncio.TimeoutError:
            return ProbeResult(False, "probe timed out" + (" (deep)" if deep else ""))
        except Exception as exc:  # noqa: BLE001 - whatever an engine answers ({"data": null}...) fails its probe only
            return ProbeResult(False, f"{type(exc).__name__}: {exc}")
        return ProbeResult(True, max_model_len=mml if type(mml) is int and mml > 0 else 0)


STARTING_PROBE_S = 1.0   # a replica not yet READY is probed at least this often (its first good probe serves held requests)


async def probe_all(replicas: Iterable[ReplicaFacts], cfg: FleetConfig, prober: Prober, metrics: Metrics,
                    now: float) -> None:
    """Probe, all at once, every running replica whose probe is due (a deep one when that is due too), and
    record the results in its facts: the first good one makes it READY, failures after that count."""
    due = []
    for f in replicas:
        m = cfg.model(f.model)
        # (a scale-down's drain is probed on: it may be called off, and must not come back on old results)
        if (m is None or f.endpoint is None or f.slurm_state != "RUNNING" or f.cancel_requested_at is not None
                or f.drain_requested_at is not None and f.drain_reason != "scale_down"):
            continue
        every = m.probe.interval_s if f.first_ready_time is not None else min(m.probe.interval_s, STARTING_PROBE_S)
        if f.last_probe_time is not None and now - f.last_probe_time < every:
            continue
        deep_every = m.deep_probe_interval_s
        # a failed deep probe is tried again at the next probe (a plain one that passes must not reset its count:
        # a multi-node replica whose head answers /health while a worker hangs stayed READY for ever)
        deep_failed = f.last_deep_probe_time is not None and f.last_deep_probe_time == f.last_probe_time and \
            f.last_probe_ok is False
        deep = bool(deep_every and f.first_ready_time is not None and (
            deep_failed or f.last_deep_probe_time is None or now - f.last_deep_probe_time >= deep_every))
        due.append((f, m, deep))
    results = await asyncio.gather(*(prober.probe(f.endpoint, m.name, m.probe.timeout_s, deep,
                                                  m.probe.deep_timeout_s) for f, m, deep in due), return_exceptions=True)
    for (f, m, deep), res in zip(due, results):
        if isinstance(res, BaseException):   # one probe's bug must not stop the tick (and the whole fleet's work)
            if isinstance(res, asyncio.CancelledError):
                raise res
            res = ProbeResult(False, f"{type(res).__name__}: {res}")
        f.last_probe_time, f.last_probe_ok, f.last_probe_error = now, res.ok, res.error
        if deep:
            f.last_deep_probe_time = now
        if res.ok:
            f.consecutive_failures = 0
            f.max_model_len = res.max_model_len or f.max_model_len
            if f.first_ready_time is None:
                f.first_ready_time, f.published_at = now, f.endpoint.start_time or None
                if f.start_time and (f.adopted_at is None or f.start_time >= f.adopted_at):
                    # (a job adopted RUNNING may have served for hours before this daemon's first probe)
                    metrics.startup_seconds.labels(f.model).observe(max(0.0, now - f.start_time))
                log.info("job %s (%s slot %d) is READY at %s", f.job_id, f.model, f.slot, f.endpoint.url)
        elif f.first_ready_time is not None:  # failures before the first success are start-up grace
            f.consecutive_failures += 1
            log.warning("probe of job %s failed (%d): %s", f.job_id, f.consecutive_failures, res.error)
