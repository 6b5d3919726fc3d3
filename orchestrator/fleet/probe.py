"""Probes: is a replica's engine up and serving the right model?

``/health`` first, then ``/v1/models`` (with the job's secret) must list the
served name.  A deep probe (a 1-token completion) catches a multi-node replica
whose head answers ``/health`` while a worker node is dead.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from .replica import Endpoint


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
        except (aiohttp.ClientError, ValueError, AttributeError) as exc:
            return ProbeResult(False, f"{type(exc).__name__}: {exc}")
        return ProbeResult(True, max_model_len=mml if type(mml) is int and mml > 0 else 0)
