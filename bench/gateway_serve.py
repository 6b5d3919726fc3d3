"""Run only the gateway (no SLURM) in front of fixed backends, for benchmarks.

    python bench/gateway_serve.py --port 9100 --backend http://127.0.0.1:9001 [--backend ...] [--workers 2]

With ``--workers N`` (N > 1) the same worker processes as ``gateway.workers`` serve, fed by the same
supervisor the daemon uses.

For ``--routing kv_aware`` each backend may name its engine's KV-cache event sockets after its URL,
``--backend URL,kv=tcp://HOST:PORT,replay=tcp://HOST:PORT,topic=TOPIC``, and ``--model-path DIR`` is where
the gateway reads the model's tokenizer (``--block-size``: the engines' KV block size, default 16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import urllib.parse

import uvloop

from orchestrator.fleetfile import load_config_text
from orchestrator.contract import Endpoint, ModelRoutes, Replica
from orchestrator.fleet.publisher import TablePublisher
from orchestrator.fleet.reports import ReportHub
from orchestrator.gateway.local import LocalGateway
from orchestrator.gateway.processes import GatewayWorkers
from orchestrator.procgc import settle

KV_FIELDS = {"kv": "kv_events", "replay": "kv_replay", "topic": "kv_topic"}


def parse_backend(spec: str) -> tuple[str, dict[str, str]]:
    """``URL[,kv=...,replay=...,topic=...]`` -> (URL, Endpoint keyword arguments for its KV-event sockets)."""
    url, *opts = spec.split(",")
    kv: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in KV_FIELDS:
            raise SystemExit(f"--backend {spec!r}: unknown option {opt!r} (one of: {', '.join(KV_FIELDS)})")
        kv[KV_FIELDS[key]] = value
    return url, kv


async def main(args: argparse.Namespace) -> None:
    extra = ""
    if args.model_path:
        extra += f"\n    model_path: {json.dumps(args.model_path)}"
    if args.block_size:
        extra += f"\n    simulator: {{block_size: {args.block_size}}}"
    cfg = load_config_text(f"""
fleet: bench
state_dir: /tmp/slurmfleet-bench
gateway: {{host: 127.0.0.1, port: {args.port}, max_queue_per_model: 10000, queue_timeout_s: 600, workers: {args.workers}}}
models:
  - name: m
    engine: simulator
    container: {{enabled: false}}
    routing: {args.policy}
    max_inflight_per_replica: {args.max_inflight_per_replica}{extra}
""", "bench.yaml", {})
    replicas = []
    for i, spec in enumerate(args.backend):
        url, kv = parse_backend(spec)
        u = urllib.parse.urlparse(url)
        replicas.append(Replica(f"b{i}", "m", i, Endpoint(f"b{i}", u.hostname, u.port, "bench-secret", **kv)))
    hub = ReportHub()
    sink = GatewayWorkers(cfg, hub) if args.workers > 1 else LocalGateway(cfg)
    if args.workers == 1:
        hub.attach(0, sink.report)
    if not await sink.start():
        raise SystemExit(1)
    TablePublisher(sink, hub).on_routes({"m": ModelRoutes(len(replicas), tuple(replicas))})
    settle()   # (as the daemon and the workers do once serving)
    print(f"gateway on :{args.port} ({args.workers} process(es), {args.policy}) -> {args.backend}", flush=True)
    tasks = [coro for _name, coro in sink.root_tasks()]
    await asyncio.gather(*tasks) if tasks else await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True, help="URL[,kv=tcp://..,replay=tcp://..,topic=T]")
    ap.add_argument("--policy", "--routing", dest="policy", default="round_robin")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--model-path", help="the model's directory (its tokenizer, for routing: kv_aware)")
    ap.add_argument("--block-size", type=int, help="the engines' KV-cache block size (routing: kv_aware)")
    ap.add_argument("--max-inflight-per-replica", type=int, default=100000,
                    help="the model's cap (default: none to speak of; requests over it wait in the gateway)")
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(main(ap.parse_args()))
