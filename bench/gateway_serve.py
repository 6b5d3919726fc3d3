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

from orchestrator.fleetfile import load_config_text
from orchestrator.contract import Endpoint, ModelRoutes, Replica
from orchestrator.fleet.publisher import TablePublisher
from orchestrator.fleet.reports import ReportHub
from orchestrator.gateway.local import LocalGateway
from orchestrator.gateway.processes import GatewayWorkers


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
    replicas = []
    for i, url in enumerate(args.backend):
        u = urllib.parse.urlparse(url)
        replicas.append(Replica(f"b{i}", "m", i, Endpoint(f"b{i}", u.hostname, u.port, "bench-secret")))
    hub = ReportHub()
    sink = GatewayWorkers(cfg, hub) if args.workers > 1 else LocalGateway(cfg)
    if args.workers == 1:
        hub.attach(0, sink.report)
    if not await sink.start():
        raise SystemExit(1)
    TablePublisher(sink, hub).on_routes({"m": ModelRoutes(len(replicas), tuple(replicas))})
    print(f"gateway on :{args.port} ({args.workers} process(es)) -> {args.backend}", flush=True)
    tasks = [coro for _name, coro in sink.root_tasks()]
    await asyncio.gather(*tasks) if tasks else await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--workers", type=int, default=1)
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(main(ap.parse_args()))
