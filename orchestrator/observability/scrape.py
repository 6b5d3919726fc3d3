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
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .metrics import Metrics
from ..gateway.pool import Pools, Slot

log = logging.getLogger(__name__)

WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",   # servers before vLLM 0.10
    "vllm:prompt_tokens": "prompt",
    "vllm:generation_tokens": "generation",
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sum the wanted ``vllm:*`` series over their labels (one engine per replica)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        key = WANTED.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[key] = out.get(key, 0.0) + s.value
    if "kv" not in out and "kv_old" in out:
        out["kv"] = out["kv_old"]
    return out


class EngineScraper:
    def __init__(self, session: aiohttp.ClientSession, pools: Pools, metrics: Metrics, timeout_s: float = 2.0,
                 state_dir: str | None = None,
                 running: Callable[[], list[tuple[str, str, int]]] = lambda: []):
        self.session, self.pools, self.metrics, self.timeout_s = session, pools, metrics, timeout_s
        self.gpu_dir = Path(state_dir) / "gpu" if state_dir else None
        self.running = running  # (job_id, model, slot) of running replicas

    async def _one(self, model: str, slot: Slot) -> tuple[tuple[str, str], dict[str, float]] | None:
        ep = slot.backend.endpoint
        try:
            async with self.session.get(f"{ep.url}/metrics", headers={"Authorization": f"Bearer {ep.secret}"},
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    return None
                values = parse_engine_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", ep.url, exc)
            return None
        slot.running, slot.waiting, slot.kv_usage = values.get("running"), values.get("waiting"), values.get("kv")
        return (model, str(slot.backend.slot)), values

    def _read_gpus(self, jobs: list[tuple[str, str, int]], max_age_s: float = 60.0) -> dict:
        out: dict[tuple[str, str, str, str], dict[str, float]] = {}
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
                out[(model, str(slot), str(doc.get("node", "")), str(g.get("index")))] = {
                    k: float(v) for k, v in g.items() if isinstance(v, (int, float)) and k != "index"}
        return out

    async def scrape_once(self) -> None:
        targets = [(name, s) for name, p in self.pools.pools.items() for s in list(p.slots.values())]
        results = await asyncio.gather(*(self._one(name, s) for name, s in targets))
        self.metrics.engine = dict(r for r in results if r is not None)
        self.metrics.gpus = await asyncio.to_thread(self._read_gpus, self.running())
