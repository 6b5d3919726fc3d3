"""Run only the gateway (no SLURM) in front of fixed backends, for benchmarks.

    python bench/gateway_serve.py --port 9100 --backend http://127.0.0.1:9001 [--backend ...] [--workers 2]

With ``--workers N`` (N > 1) the same worker processes as ``gateway.workers`` serve, fed by the same
supervisor the daemon uses.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import urllib.parse

import uvloop
from aiohttp import web

from orchestrator.config import load_config_text
from orchestrator.observability.metrics import Metrics
from orchestrator.gateway.pool import Pools
from orchestrator.gateway.server import Gateway
from orchestrator.fleet.reconciler import Backend
from orchestrator.gateway.upstream import Upstream
from orchestrator.gateway.processes import GatewayWorkers
from orchestrator.fleet.replica import Endpoint


async def main(args: argparse.Namespace) -> None:
    cfg = load_config_text(f"""
fleet: bench
state_dir: /tmp/slurmfleet-bench
gateway: {{host: 127.0.0.1, port: {args.port}, max_queue_per_model: 10000, workers: {args.workers}}}
models:
  - name: m
    engine: simulator
    container: {{enabled: false}}
    routing: {args.policy}
    max_inflight_per_replica: 100000
""", "bench.yaml", {})
    metrics = Metrics()
    backends = []
    for i, url in enumerate(args.backend):
        u = urllib.parse.urlparse(url)
        backends.append(Backend(f"b{i}", "m", i, Endpoint(f"b{i}", u.hostname, u.port, "bench-secret")))
    if args.workers > 1:
        workers = GatewayWorkers(cfg, metrics)
        if not await workers.start():
            raise SystemExit(1)
        workers.publish({"m": backends})
        print(f"gateway on :{args.port} ({args.workers} workers) -> {args.backend}", flush=True)
        await asyncio.gather(*(workers.watch(i) for i in range(args.workers)))
        return
    pools = Pools(cfg.models, cfg.gateway.max_queue_per_model)
    gw = Gateway(cfg, pools, Upstream(cfg.gateway.connect_timeout_s), metrics.stats)
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
    ap.add_argument("--workers", type=int, default=1)
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(main(ap.parse_args()))
