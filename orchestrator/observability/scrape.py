"""Engine and GPU metrics of the replicas.

Engine: each READY replica's ``/metrics`` is scraped concurrently, with a timeout; the values feed
the ``load_aware`` routing policy and are re-exported under bounded ``model``/``slot`` labels.  A dead
replica costs one timeout, never a stalled ``/metrics`` of the daemon (scrapes run in their own task).
GPU: the files the jobs' NVML exporters write under ``<state_dir>/gpu/`` (read in a thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..contract import EngineLoad, Replica
from ..statedir import StateDir
from .metrics import Metrics

log = logging.getLogger(__name__)

WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",   # servers before vLLM 0.10
    "vllm:prompt_tokens": "prompt",
    "vllm:generation_tokens": "generation",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
}


RATIOS = ("kv", "kv_old")   # a share of the replica's memory: the mean over its engines, not their sum


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The wanted ``vllm:*`` series of one replica: counts summed over their labels (a data-parallel replica
    has a series per engine, label ``engine``), KV-cache use the mean of its engines' (a sum passed 1)."""
    out: dict[str, float] = {}
    n: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        key = WANTED.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_created") or not math.isfinite(s.value):   # (a NaN made the autoscaler's mean
                continue                                                      # NaN: its engine guards off)
            out[key] = out.get(key, 0.0) + s.value
            n[key] = n.get(key, 0) + 1
    for key in RATIOS:
        if key in out:
            out[key] /= n[key]
    if "kv" not in out and "kv_old" in out:
        out["kv"] = out["kv_old"]
    return out


class EngineScraper:
    """Scrapes every READY replica of the routing table (``targets``) and hands the engine loads to
    ``on_loads`` (the table publisher); keeps the values for ``/metrics``."""

    def __init__(self, session: aiohttp.ClientSession, metrics: Metrics,
                 targets: Callable[[], Iterable[Replica]], on_loads: Callable[[dict[str, EngineLoad]], None],
                 state: StateDir | None = None, running: Callable[[], list[tuple[str, str, int]]] = lambda: [],
                 timeout_s: float = 2.0):
        self.session, self.metrics, self.timeout_s = session, metrics, timeout_s
        self.targets, self.on_loads = targets, on_loads
        self.gpu_dir = state.gpu if state else None
        self.running = running  # (job_id, model, slot) of running replicas
        self.loads: dict[str, EngineLoad] = {}
        self.readings: dict[str, dict[str, float]] = {}   # per job: its engine's last readings

    async def _one(self, r: Replica) -> tuple[Replica, dict[str, float]] | None:
        ep = r.endpoint
        try:
            async with self.session.get(f"{ep.url}/metrics", headers={"Authorization": f"Bearer {ep.secret}"},
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    return None
                return r, parse_engine_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", ep.url, exc)
            return None

    def _read_gpus(self, jobs: list[tuple[str, str, int]], max_age_s: float = 60.0) -> dict:
        out: dict[tuple[str, str, str, str, str], dict[str, float]] = {}   # (model, slot, node, gpu, job id)
        if self.gpu_dir is None:
            return out
        by_job = {jid: (model, slot) for jid, model, slot in jobs}
        try:
            entries = list(os.scandir(self.gpu_dir))
        except FileNotFoundError:
            return out
        now = time.time()
        for e in entries:
            jid = e.name.split(".", 1)[0]
            if not e.name.endswith(".json") or jid not in by_job:
                continue
            try:
                doc = json.loads(Path(e.path).read_text())
            except (OSError, ValueError):
                continue
            if now - float(doc.get("time", 0)) > max_age_s:
                continue
            model, slot = by_job[jid]
            for g in doc.get("gpus") or []:
                out[(model, str(slot), str(doc.get("node", "")), str(g.get("index")), jid)] = {
                    k: float(v) for k, v in g.items() if isinstance(v, (int, float)) and k != "index"}
        return out

    async def scrape_once(self) -> None:
        targets = list(self.targets())
        results = [x for x in await asyncio.gather(*(self._one(r) for r in targets)) if x is not None]
        # a replica whose scrape failed keeps its last readings; one that left the table loses them
        self.readings = {r.job_id: self.readings[r.job_id] for r in targets if r.job_id in self.readings}
        self.readings.update({r.job_id: v for r, v in results})
        # a slot's successor and the replica it replaces are both READY for a while: the newer one speaks for
        # the slot, with its last readings when a scrape of it fails (a flip between them, between scrapes or
        # on a failed one, would move the slot's counters back and forth: a reset to Prometheus each time)
        self.metrics.engine = {(r.model, str(r.slot)): self.readings[r.job_id] for r in
                               sorted(targets, key=lambda r: (r.endpoint.start_time, _job_order(r.job_id)))
                               if r.job_id in self.readings}
        self.loads = {jid: EngineLoad(v.get("waiting"), v.get("running"), v.get("kv")) for jid, v in self.readings.items()}
        self.on_loads(self.loads)
        self.metrics.gpus = await asyncio.to_thread(self._read_gpus, self.running())


def _job_order(job_id: str) -> tuple[int, str]:
    """SLURM job ids grow: the later of two jobs started in the same second."""
    head = job_id.split("_", 1)[0]
    return (int(head) if head.isdigit() else -1, job_id)
