"""The gateway inside the daemon's own process (``gateway.workers: 1``): the in-process
:class:`~orchestrator.contract.RoutingSink`, read by the fleet's report hub when it needs a report."""

from __future__ import annotations

import logging

from aiohttp import web

from ..config import FleetConfig
from ..contract import GatewayReport, ReportSink, RoutingTable
from ..reqstats import RequestStats
from ..tlsfiles import ServerTls
from .http import stop_serving
from .pool import Pools
from .server import Gateway
from .upstream import Upstream

log = logging.getLogger("slurmfleet.gateway")


class LocalGateway:
    processes = 1
    restarts = 0

    def __init__(self, cfg: FleetConfig, config_path: str = "the config", reports: ReportSink | None = None):
        gw = cfg.gateway
        self.config_path = config_path
        stats = RequestStats()
        self.gateway = Gateway(cfg, Pools(gw, cfg.models, stats=stats), Upstream(gw.connect_timeout_s), stats, 0)
        if reports is not None:  # a held request is reported at once (the hub reads the rest when it needs it)
            self.gateway.on_hold = lambda: reports.receive(self.gateway.report(urgent=True))
        self.runner: web.ServerRunner | None = None
        self.tls: ServerTls | None = None

    def publish(self, table: RoutingTable) -> None:
        self.gateway.publish(table)

    def set_config(self, cfg: FleetConfig) -> None:
        self.gateway.set_config(cfg)
        if self.tls is not None:
            self.tls.reload(cfg.gateway)

    def report(self) -> GatewayReport:
        return self.gateway.report()

    def root_tasks(self) -> list:
        return []

    async def start(self) -> bool:
        gw = self.gateway.cfg.gateway
        self.runner = web.ServerRunner(self.gateway.server(), access_log=None, shutdown_timeout=1.0)   # (see stop)
        await self.runner.setup()
        try:
            self.tls = ServerTls(gw)   # (HTTPS with gateway.tls)
            await web.TCPSite(self.runner, gw.host, gw.port, reuse_address=True, ssl_context=self.tls.context).start()
        except OSError as exc:   # (an ssl.SSLError too: the certificate changed since the config was read)
            log.error("cannot listen on %s:%d (gateway.port in %s): %s", gw.host, gw.port, self.config_path,
                      exc.strerror or exc)
            await self.runner.cleanup()
            return False
        return True

    @property
    def port(self) -> int:
        """The port it listens on (the configured one, or the one the kernel gave for port 0)."""
        addrs = self.runner.addresses if self.runner is not None else []
        return addrs[0][1] if addrs else self.gateway.cfg.gateway.port

    def closing(self) -> None:
        """The daemon is stopping: new requests get 503 and /readyz fails."""
        self.gateway.closing()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; open streams get ``grace_s`` to finish, then are cut."""
        self.gateway.closing()
        try:
            if self.runner is not None:
                await stop_serving(self.runner, grace_s)
        finally:
            await self.gateway.close()
