"""Wiring: build every part once, run the named root tasks, shut down within a bound.

Root tasks (each named, guarded, logged): ``reconcile`` (the control loop),
``scrape`` (engine metrics), ``signals`` (SIGHUP reloads, SIGTERM/SIGINT stop).
A root task that dies takes the daemon down cleanly rather than leaving it
half-alive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from .fleet.admin import Admin, ensure_admin_key
from .config import FleetConfig, load_config
from .fleet.discovery import Discovery
from .fleet.probe import Prober
from .observability.metrics import Metrics
from .gateway.pool import Pools
from .gateway.server import Gateway
from .fleet.reconciler import Reconciler
from .fleet.render import Renderer
from .observability.scrape import EngineScraper
from .fleet.slurm import CliSlurm
from .observability.status import fleet_status
from .gateway.upstream import Upstream
from .gateway.processes import GatewayWorkers
from .yamlsrc import ConfigError

log = logging.getLogger("slurmfleet")


class Daemon:
    def __init__(self, config_path: str | Path, cfg: FleetConfig, *, cancel_jobs_on_exit: bool = False,
                 shutdown_timeout_s: float = 30.0, scale_overrides: dict[str, int] | None = None):
        self.scale_overrides = dict(scale_overrides or {})
        self.config_path = str(config_path)
        self.cfg = cfg
        self.cancel_jobs_on_exit = cancel_jobs_on_exit
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        self.metrics = Metrics()
        self.workers: GatewayWorkers | None = None

    async def reload(self) -> dict:
        try:
            cfg = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as exc:
            for p in exc.problems:
                log.error("reload rejected, fleet unchanged: %s", p)
            return {"ok": False, "errors": [str(p) for p in exc.problems]}
        if cfg.fleet != self.cfg.fleet or cfg.state_dir != self.cfg.state_dir:
            msg = "fleet and state_dir cannot change on reload; restart the daemon"
            log.error("reload rejected, fleet unchanged: %s", msg)
            return {"ok": False, "errors": [f"{self.config_path}: {msg}"]}
        changes = self.reconciler.apply_config(cfg)
        self.gateway.set_config(cfg)
        if self.workers:
            self.workers.set_config(cfg)
        self.slurm.timeout_s = cfg.cluster.command_timeout_s
        self.cfg = cfg
        for c in changes:
            log.info("reload: %s", c)
        log.info("reload applied (%d changes)", len(changes))
        self.wake.set()
        return {"ok": True, "changes": changes}

    async def run(self) -> int:
        cfg = self.cfg
        for sub in ("endpoints", "logs", "gpu"):
            Path(cfg.state_dir, sub).mkdir(parents=True, exist_ok=True)
        gw = cfg.gateway
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=gw.request_timeout_s, sock_connect=gw.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            self.slurm = CliSlurm(cfg.job_name, cfg.cluster.slurm_conf, cfg.cluster.command_timeout_s,
                                  observer=self.metrics.observe_slurm)
            self.pools = Pools(cfg.models, gw.max_queue_per_model)
            if gw.workers > 1:
                self.workers = GatewayWorkers(cfg, self.metrics, load=self._load)
                self.pools.external_inflight = self.workers.inflight
            self.reconciler = Reconciler(cfg, self.slurm, Renderer(), Discovery(cfg.state_dir), Prober(session),
                                         self.metrics, inflight=self.pools.inflight, on_update=self._on_ready)
            for model, n in self.scale_overrides.items():
                self.reconciler.scale(model, n)
            upstream = Upstream(gw.connect_timeout_s)
            self.gateway = Gateway(cfg, self.pools, upstream, self.metrics.stats)
            self.scraper = EngineScraper(session, self.pools, self.metrics, state_dir=cfg.state_dir, running=lambda: [
                (f.job_id, f.model, f.slot) for f in self.reconciler.replicas.values() if f.slurm_state == "RUNNING"])
            keys = ensure_admin_key(cfg.state_dir, cfg.daemon.admin_api_keys, os.environ.get("SLURMFLEET_ADMIN_KEY"))
            admin = Admin(keys, self.metrics, status=lambda: fleet_status(
                              self.reconciler, self.pools, gpus=self.metrics.gpus,
                              gateway=self.workers.info() if self.workers else None),
                          reload=self.reload, drain=self._drain, scale=self._scale)
            admin_runner = web.AppRunner(admin.app(), access_log=None, shutdown_timeout=2.0)
            sites = [(admin_runner, cfg.daemon.admin_host, cfg.daemon.admin_port, "daemon.admin_port")]
            gw_runner = None  # with gateway workers, the daemon itself serves no client
            if not self.workers:
                gw_runner = web.ServerRunner(self.gateway.server(), access_log=None,
                                             shutdown_timeout=gw.shutdown_grace_s)
                sites.insert(0, (gw_runner, gw.host, gw.port, "gateway.port"))
            for runner, *_ in sites:
                await runner.setup()
            for runner, host, port, what in sites:
                try:
                    await web.TCPSite(runner, host, port, reuse_address=True).start()
                except OSError as exc:
                    log.error("cannot listen on %s:%d (%s in %s): %s", host, port, what, self.config_path,
                              exc.strerror)
                    for r, *_ in sites:
                        await r.cleanup()
                    return 1
            roots = [("reconcile", self._reconcile_loop()), ("scrape", self._scrape_loop()),
                     ("signals", self._signals())]
            if self.workers:
                if not await self.workers.start():
                    log.error("cannot start the gateway workers on %s:%d (gateway.port in %s)", gw.host, gw.port,
                              self.config_path)
                    for _, coro in roots:
                        coro.close()
                    await admin_runner.cleanup()
                    return 1
                roots += [(f"gateway-worker-{i}", self.workers.watch(i)) for i in range(gw.workers)]
            log.info("gateway on http://%s:%d (%d process%s), admin on http://%s:%d, %d models", gw.host, gw.port,
                     gw.workers, "es" if gw.workers > 1 else "", cfg.daemon.admin_host, cfg.daemon.admin_port,
                     len(cfg.models))
            tasks = {asyncio.create_task(self._guard(name, coro), name=name) for name, coro in roots}
            await self.stop.wait()
            log.info("shutting down: gateway stops accepting, open streams get %.0fs", gw.shutdown_grace_s)
            self.gateway.shutting_down = True
            t0 = time.monotonic()
            if self.workers:
                self.workers.stopping = True
            for t in tasks:
                t.cancel()
            done, pending = await asyncio.wait(tasks, timeout=5.0)
            for t in pending:
                log.error("root task %s did not stop within 5s", t.get_name())
            if self.workers:
                await self.workers.stop(gw.shutdown_grace_s)
            else:
                try:
                    await asyncio.wait_for(gw_runner.cleanup(), gw.shutdown_grace_s + 5)
                except asyncio.TimeoutError:
                    log.error("gateway did not close within %.0fs", gw.shutdown_grace_s + 5)
            await admin_runner.cleanup()
            if self.cancel_jobs_on_exit:
                await self._cancel_all()
            else:
                log.info("leaving %d jobs running for the next start to adopt", len(self.reconciler.replicas))
            upstream.close()
            log.info("stopped in %.1fs", time.monotonic() - t0)
        return 0

    def _on_ready(self, ready: dict) -> None:
        self.pools.update(ready)
        if self.workers:
            self.workers.publish(ready)

    def _load(self) -> dict[str, tuple]:
        """The latest scraped engine load per job, for the workers' load-aware routing."""
        return {jid: (s.waiting, s.kv_usage, s.running) for p in self.pools.pools.values()
                for jid, s in p.slots.items()}

    def _drain(self, job_id: str) -> bool:
        ok = self.reconciler.request_drain(job_id)
        self.wake.set()
        return ok

    def _scale(self, model: str, n: int) -> None:
        self.reconciler.scale(model, n)
        self.wake.set()

    async def _guard(self, name: str, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            log.debug("root task %s cancelled", name)
            raise
        except Exception:
            log.exception("root task %s crashed; stopping the daemon", name)
            self.stop.set()

    async def _reconcile_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.reconciler.tick()
            except Exception:  # one bad tick must not kill the loop; the next tick heals
                log.exception("reconcile tick failed")
            self.wake.clear()
            left = self.cfg.daemon.tick_interval_s - (time.monotonic() - t0)
            if left > 0:
                try:
                    await asyncio.wait_for(self.wake.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def _scrape_loop(self) -> None:
        while True:
            await self.scraper.scrape_once()
            if self.workers:
                self.workers.publish()
            await asyncio.sleep(min(5.0, self.cfg.daemon.tick_interval_s))

    async def _signals(self) -> None:
        loop = asyncio.get_running_loop()
        hup = asyncio.Event()
        loop.add_signal_handler(signal.SIGHUP, hup.set)
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        while True:
            await hup.wait()
            hup.clear()
            log.info("SIGHUP: reloading %s", self.config_path)
            await self.reload()

    async def _cancel_all(self) -> None:
        ids = list(self.reconciler.replicas)
        log.info("--cancel-jobs-on-exit: cancelling %d jobs", len(ids))
        for jid in ids:
            try:
                await asyncio.wait_for(self.slurm.cancel(jid), 10)
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.warning("scancel %s failed: %s", jid, exc)
