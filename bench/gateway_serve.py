"""Run only the gateway (no SLURM) in front of fixed backends, for benchmarks.

    python bench/gateway_serve.py --port 9100 --backend http://127.0.0.1:9001 [--backend ...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import urllib.parse

import aiohttp
import uvloop
from aiohttp import web

from orchestrator.config import load_config_text
from orchestrator.metrics import Metrics
from orchestrator.pool import Pools
from orchestrator.proxy import Gateway
from orchestrator.reconciler import Backend
from orchestrator.upstream import Upstream
from orchestrator.replica import Endpoint


async def main(args: argparse.Namespace) -> None:
    cfg = load_config_text(f"""
fleet: bench
state_dir: /tmp/slurmfleet-bench
gateway: {{host: 127.0.0.1, port: {args.port}, max_queue_per_model: 10000}}
models:
  - name: m
    engine: simulator
    container: {{enabled: false}}
    routing: {args.policy}
    max_inflight_per_replica: 100000
""", "bench.yaml", {})
    metrics = Metrics()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        pools = Pools(cfg.models, cfg.gateway.max_queue_per_model)
        gw = Gateway(cfg, pools, Upstream(cfg.gateway.connect_timeout_s), metrics)
        backends = []
        for i, url in enumerate(args.backend):
            u = urllib.parse.urlparse(url)
            backends.append(Backend(f"b{i}", "m", i, Endpoint(f"b{i}", u.hostname, u.port, "bench-secret")))
        pools.update({"m": backends})
        runner = web.ServerRunner(gw.server(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, reuse_port=True).start()
        print(f"gateway on :{args.port} -> {args.backend}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True)
    ap.add_argument("--policy", default="round_robin")
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(main(ap.parse_args()))
