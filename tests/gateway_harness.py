"""The gateway in a thread of its own, in front of simulator processes (real sockets both ways)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp import web

from conftest import ROOT, free_port, metric_sum, wait_for
from orchestrator.fleetfile import load_config_text
from orchestrator.batches import BatchStore
from orchestrator.batchfiles import FileStore
from orchestrator.contract import Endpoint, ModelRoutes, Replica
from orchestrator.fleet.batchrun import BatchRunner
from orchestrator.fleet.publisher import TablePublisher
from orchestrator.fleet.reports import ReportHub
from orchestrator.fleet.tenancy import Tenancy
from orchestrator.fleet.usage import UsageLedger
from orchestrator.gateway.http import stop_serving
from orchestrator.gateway.pool import Pools
from orchestrator.gateway.server import Gateway
from orchestrator.gateway.upstream import Upstream
from orchestrator.observability.metrics import Metrics
from orchestrator.observability.scrape import EngineScraper
from orchestrator.reqstats import RequestStats


class Sim:
    def __init__(self, name: str, *args: str, served: str = "m", secret: str | None = None, env: dict | None = None):
        self.name = name
        self.secret = secret or f"secret-{name}-{secrets.token_hex(4)}"   # (its own: _up knows it answers)
        self.max_model_len: int | None = None
        for _ in range(3):   # a port free when chosen, taken by another xdist worker before the simulator bound it:
            self.port = free_port()   # it exits at once, and another try gets another port
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.devtools.simulator", "--port", str(self.port), "--served-model-name",
                 served, "--api-key", self.secret, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, **env} if env else None)
            if "refuse" in args:
                return
            wait_for(lambda: self.proc.poll() is not None or self._up(), 15, f"simulator {name}")
            if self.proc.poll() is None:
                return
        raise AssertionError(f"simulator {name} exited at its start three times (status {self.proc.returncode})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _up(self) -> bool:
        """This simulator answers (with its own secret: another worker's on the same port would not)."""
        try:
            self.get("/sim/last_headers")   # (not /v1: a simulator started with --fault 503 answers those 503)
            return True
        except OSError:
            return False

    def get(self, path: str) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.secret}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read()

    def fault(self, mode: str) -> None:
        req = urllib.request.Request(self.url + "/sim/fault", data=f'{{"fault": "{mode}"}}'.encode(),
                                     headers={"Authorization": f"Bearer {self.secret}"})
        urllib.request.urlopen(req, timeout=5).read()

    def metric(self, name: str) -> float:
        return metric_sum(self.get("/metrics").decode(), name)

    def served(self) -> int:
        return int(self.metric("vllm:e2e_request_latency_seconds_count"))

    def backend(self, model: str = "m", slot: int = 0) -> Replica:
        """The READY replica the fleet would publish: its context length read from /v1/models, as its probe does."""
        jid = f"job-{self.name}"
        if self.max_model_len is None:
            try:
                self.max_model_len = json.loads(self.get("/v1/models"))["data"][0]["max_model_len"]
            except (OSError, ValueError, KeyError, IndexError):
                pass
        return Replica(jid, model, slot, Endpoint(jid, "127.0.0.1", self.port, self.secret),
                       max_model_len=self.max_model_len or 0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Harness:
    def __init__(self, tmp: Path, models_yaml: str, gateway_yaml: str = ""):
        self.port = free_port()
        text = (f"fleet: gw\nstate_dir: {tmp}\ngateway:\n  port: {self.port}\n"
                + "".join(f"  {ln}\n" for ln in gateway_yaml.strip().splitlines() if ln.strip())
                + "models:\n" + models_yaml)
        self.cfg = load_config_text(text, "gw.yaml", {})
        self.tmp, self.text = tmp, text
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        # wired as the daemon wires the in-process gateway: table publisher -> gateway -> report hub
        self.hub = ReportHub()
        self.metrics = Metrics(request_stats=self.hub.stats_snapshots)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        gw = self.cfg.gateway
        self.gateway = Gateway(self.cfg, Pools(gw, self.cfg.models), Upstream(gw.connect_timeout_s), RequestStats())
        self.hub.attach(0, self.gateway.report)
        self.publisher = TablePublisher(self.gateway, self.hub)
        self.tenancy = Tenancy(self.cfg, self.hub, UsageLedger(self.tmp / "usage.sqlite3"),
                               self.publisher.on_allowances)
        self.scraper = EngineScraper(self.session, self.metrics, targets=lambda: [
            r for m in self.publisher.table.models.values() for r in m.replicas], on_loads=self.publisher.on_loads)
        self.runner = web.ServerRunner(self.gateway.server(), access_log=None,
                                    shutdown_timeout=self.cfg.gateway.shutdown_grace_s)
        await self.runner.setup()
        for attempt in range(3):
            try:
                await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
                return
            except OSError:   # taken by another xdist worker since free_port chose it
                if attempt == 2:
                    raise
                self.port = free_port()

    def set_ready(self, replicas: list[Replica]) -> None:
        """Publish a routing table with these READY replicas (desired: each model's configured count)."""
        routes = {m.name: ModelRoutes(m.replicas, tuple(r for r in replicas if r.model == m.name))
                  for m in self.cfg.models}

        async def upd():
            self.publisher.on_routes(routes)
        self.call(upd())

    def tenancy_tick(self, flush: bool = False) -> None:
        """One turn of the fleet's tenancy loop: usage into the ledger (written down with ``flush``),
        allowances into a new table."""
        async def tick():
            self.tenancy.tick()
            if flush:
                self.tenancy.ledger.flush()
        self.call(tick())

    def reload(self, text: str) -> None:
        """Apply another config text as the daemon's reload does (gateway and tenancy)."""
        cfg = load_config_text(text, "gw.yaml", {})

        async def apply():
            self.gateway.set_config(cfg)
            self.tenancy.set_config(cfg)
        self.call(apply())
        self.cfg = cfg

    def scrape(self) -> None:
        self.call(self.scraper.scrape_once())

    def metric(self, name: str, **labels) -> float:
        return metric_sum(self.metrics.render().decode(), name, **labels)

    def route_to(self, sims: list["Sim"]) -> None:
        """Make these simulators the READY replicas of model m, slot = position."""
        self.set_ready([s.backend(slot=i) for i, s in enumerate(sims)])

    def batch_runner(self, root: Path, max_inflight: int, session_timeout: aiohttp.ClientTimeout | None = None, **kw):
        """The fleet's batch runner (store and files under ``root``) running in the harness's loop against
        this gateway with the secret ``runner-secret``, sharing a session whose default timeout is
        ``session_timeout`` (as the daemon's is its probes'); returns (runner, stop)."""
        async def start():
            session = aiohttp.ClientSession(**({"timeout": session_timeout} if session_timeout else {}))
            runner = BatchRunner(BatchStore(root / "batches"), FileStore(root / "files"), url=lambda: self.base,
                                 secret="runner-secret", session=session, table=lambda: self.publisher.table,
                                 queued=self.hub.queued, max_inflight=lambda m: max_inflight, **kw)
            return runner, session, asyncio.get_running_loop().create_task(runner.run())
        runner, session, task = self.call(start())

        async def stop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await session.close()
        return runner, lambda: self.call(stop())

    def shutdown(self) -> float:
        t0 = time.monotonic()
        self.gateway.shutting_down = True
        self.call(stop_serving(self.runner, self.cfg.gateway.shutdown_grace_s), timeout=120)
        return time.monotonic() - t0

    def close(self) -> None:
        try:
            self.call(self.runner.cleanup())
        except Exception:  # noqa: BLE001 - already closed
            pass

        async def settle() -> None:   # as a stopping gateway does: its requests' chores (a prompt's count) end,
            await self.gateway.settle()   # or are cancelled, before the loop stops (not left to the collector)
            await asyncio.sleep(0)
        self.call(settle())
        for runner in getattr(self, "fakes", ()):   # (fake engines a test started in this loop)
            self.call(runner.cleanup())
        self.call(self.session.close())

        async def close_upstream() -> None:
            self.gateway.upstream.close()
            await asyncio.sleep(0)  # let the cancelled sweeper finish
        self.call(close_upstream())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def read_stream_and_leave(h: "Harness", path: str, body: dict, until, key: str = "sk-bob") -> bytes:
    """A client that streams ``body`` from ``path`` with ``key``, reads until ``until(what it got)`` and closes
    the connection at once; what it got."""
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    c.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = c.getresponse()
    got = b""
    while not until(got):
        got += r.read1(4096)
    c.close()
    return got
