"""Reconcile tick cost against the number of replicas.

    .venv/bin/python bench/tick_cost.py --replicas 10 50 200 1000

The daemon's real Reconciler, Discovery (N endpoint records on disk) and Prober (real HTTP probes,
all to one simulator process) with a fake SLURM client at the process boundary that returns N RUNNING
jobs from one list call and counts the calls.  Reports the median tick and the SLURM calls per tick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.discovery import Discovery
from orchestrator.fleet.probe import Prober
from orchestrator.observability.metrics import Metrics
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.render import JobTag, Renderer
from orchestrator.fleet.slurm import JobInfo

ROOT = Path(__file__).resolve().parent.parent


class CountingSlurm:
    def __init__(self, jobs: list[JobInfo]):
        self.jobs, self.calls = jobs, 0

    async def list_jobs(self) -> list[JobInfo]:
        self.calls += 1
        return self.jobs

    async def submit(self, script: str) -> str:
        raise AssertionError("nothing should be submitted")

    async def cancel(self, job_id: str, signal: str | None = None) -> None:
        raise AssertionError("nothing should be cancelled")


async def measure(n: int, port: int, ticks: int) -> tuple[float, float, float]:
    state = Path(tempfile.mkdtemp(prefix="sf-tick-"))
    cfg = load_config_text(f"""
fleet: bench
state_dir: {state}
models:
  - name: m
    engine: simulator
    replicas: {n}
    container: {{enabled: false}}
    probe: {{interval_s: 0.001}}
""", "bench.yaml", {})
    h = cfg.models[0].job_hash()
    now = time.time()
    jobs = [JobInfo(str(1000 + i), cfg.job_name, "RUNNING", None, now - 60, now - 50, None, 86400, "node1", 0,
                    "node1", JobTag("bench", "m", i, h, str(i)).encode()) for i in range(n)]
    (state / "endpoints").mkdir(parents=True)
    for j in jobs:
        (state / "endpoints" / f"{j.job_id}.json").write_text(json.dumps(
            {"job_id": j.job_id, "restart_count": 0, "model": "m", "host": "127.0.0.1", "port": port, "secret": "s",
             "start_time": now - 50}))
    slurm = CountingSlurm(jobs)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        rec = Reconciler(cfg, slurm, Renderer(), Discovery(state), Prober(session), Metrics())
        await rec.tick()  # adopt
        samples = []
        for _ in range(ticks):
            t0 = time.perf_counter()
            await rec.tick()
            samples.append(time.perf_counter() - t0)
        ready = sum(1 for f in rec.replicas.values() if f.first_ready_time)
        assert ready == n, ready
    return statistics.median(samples), max(samples), slurm.calls / (ticks + 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 50, 200, 1000])
    ap.add_argument("--ticks", type=int, default=10)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sim = subprocess.Popen([sys.executable, "-m", "orchestrator.devtools.simulator", "--port", str(port),
                            "--served-model-name", "m", "--api-key", "s"], cwd=ROOT, stdout=subprocess.DEVNULL)
    time.sleep(1.5)
    try:
        print("| replicas | median tick (ms) | max tick (ms) | SLURM calls per tick | probes per tick |")
        print("|---|---|---|---|---|")
        for n in args.replicas:
            med, mx, calls = asyncio.run(measure(n, port, args.ticks))
            print(f"| {n} | {med * 1000:.1f} | {mx * 1000:.1f} | {calls:.0f} | {n} (2 HTTP requests each) |")
    finally:
        sim.terminate()


if __name__ == "__main__":
    main()
