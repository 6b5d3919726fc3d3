"""Engine metrics: scrape each READY replica's ``/metrics`` concurrently, with a timeout.

The values feed the ``load_aware`` routing policy and are re-exported under
bounded ``model``/``slot`` labels.  A dead replica costs one timeout, never a
stalled ``/metrics`` of the daemon (scrapes run in their own task).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .metrics import Metrics
from .pool import Pools, Slot

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
    def __init__(self, session: aiohttp.ClientSession, pools: Pools, metrics: Metrics, timeout_s: float = 2.0):
        self.session, self.pools, self.metrics, self.timeout_s = session, pools, metrics, timeout_s

    async def _one(self, model: str, slot: Slot) -> None:
        ep = slot.backend.endpoint
        try:
            async with self.session.get(f"{ep.url}/metrics", headers={"Authorization": f"Bearer {ep.secret}"},
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    return
                values = parse_engine_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", ep.url, exc)
            return
        slot.running, slot.waiting, slot.kv_usage = values.get("running"), values.get("waiting"), values.get("kv")
        lab = (model, str(slot.backend.slot))
        for key, gauge in (("running", self.metrics.engine_running), ("waiting", self.metrics.engine_waiting),
                           ("kv", self.metrics.engine_kv), ("prompt", self.metrics.engine_prompt_tokens),
                           ("generation", self.metrics.engine_generation_tokens)):
            if key in values:
                gauge.labels(*lab).set(values[key])

    async def scrape_once(self) -> None:
        targets = [(name, s) for name, p in self.pools.pools.items() for s in list(p.slots.values())]
        live = {(name, str(s.backend.slot)) for name, s in targets}
        for gauge in (self.metrics.engine_running, self.metrics.engine_waiting, self.metrics.engine_kv,
                      self.metrics.engine_prompt_tokens, self.metrics.engine_generation_tokens):
            for labels in list(gauge._metrics):  # drop series of replicas that are gone
                if labels not in live:
                    gauge.remove(*labels)
        await asyncio.gather(*(self._one(name, s) for name, s in targets))
