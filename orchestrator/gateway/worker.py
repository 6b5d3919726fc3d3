"""One gateway worker process (see :mod:`orchestrator.gateway.processes`); started by the daemon, not by hand.

    python -c "$WORKER_MAIN" <package folder> <socket fd> <process number>   (processes.WORKER_MAIN)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web

from ..contract import GatewayReport
from ..procgc import settle
from ..reqstats import RequestStats
from ..statedir import StateDir
from .http import stop_serving
from .pool import Pools
from .processes import CODE_CHANGED, REPORT_INTERVAL_S, code_fingerprint, package_root, read_msg, write_msg
from ..tlsfiles import ServerTls
from .server import Gateway
from .upstream import Upstream

log = logging.getLogger("slurmfleet.worker")


async def serve(fd: int, process: int) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    if os.environ.get("SLURMFLEET_CODE", "") != code_fingerprint():   # (before a frame is unpickled)
        log.error("%s", CODE_CHANGED)
        write_msg(writer, {"t": "error", "error": f"{CODE_CHANGED} (the package in {package_root()})"})
        await writer.drain()
        return 3
    first = await read_msg(reader)
    if not first or first.get("t") != "config":
        return 2
    cfg = first["cfg"]
    gw = cfg.gateway
    stats = RequestStats()
    gateway = Gateway(cfg, Pools(gw, cfg.models, stats=stats), Upstream(gw.connect_timeout_s), stats, process)
    gateway.tenants.restarted = bool(first.get("restarted"))   # (no even split: see Tenants)
    gateway.publish(first["table"])
    runner = web.ServerRunner(gateway.server(), access_log=None, shutdown_timeout=1.0)   # (stop_serving has the grace)
    await runner.setup()
    try:
        tls = ServerTls(gw)   # (HTTPS with gateway.tls)
        await web.TCPSite(runner, gw.host, gw.port, reuse_port=True, ssl_context=tls.context).start()
    except OSError as exc:   # (an ssl.SSLError too: the certificate changed since the config was read)
        write_msg(writer, {"t": "error", "error": f"cannot listen on {gw.host}:{gw.port}: {exc.strerror or exc}"})
        await writer.drain()
        return 1
    write_msg(writer, {"t": "listening", "pid": os.getpid()})
    settle()   # (what the start built lives as long as the process)
    orphaned = False   # the daemon died: the last counters go to the usage spool, not to it

    def report(urgent: bool = False) -> None:
        nonlocal orphaned
        if not orphaned:
            try:
                write_msg(writer, {"t": "report", "report": gateway.report(urgent)})
            except (ConnectionError, RuntimeError, OSError):   # the daemon died (uvloop raises on a closed socket)
                orphaned = True
    gateway.on_hold = lambda: report(True)  # the fleet hears of a cold start at once, not at the next report
    gateway.on_follow = report   # ... and of a background response this process now follows (to charge it)

    async def reporter() -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            report()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # Ctrl-C reaches the daemon, which stops us in order
    loop.add_signal_handler(signal.SIGHUP, lambda: None)  # (so does a hangup: the daemon reloads, we serve on)

    async def commands() -> None:
        nonlocal orphaned
        while (msg := await read_msg(reader)) is not None:
            if msg["t"] == "table":
                gateway.publish(msg["table"])
                report()  # the fleet learns at once that this process routes on the new table
            elif msg["t"] == "config":
                gateway.set_config(msg["cfg"])
                tls.reload(msg["cfg"].gateway)
            elif msg["t"] == "stop":
                break
        else:
            orphaned = not stop.is_set()
        stop.set()  # asked to, or the daemon is gone: never serve without it

    tasks = [asyncio.create_task(reporter(), name="report"), asyncio.create_task(commands(), name="commands")]
    await stop.wait()
    gateway.closing()
    # stops accepting; open streams get shutdown_grace_s (then a second to end: the daemon kills at grace + 5 s)
    await stop_serving(runner, gw.shutdown_grace_s, cancel_wait_s=1.0)
    for t in tasks:
        t.cancel()
    report()   # (cumulative: one now, the last after the chores, whose prompt counts belong in it)
    await gateway.settle()
    report()
    try:
        await writer.drain()
    except (ConnectionError, RuntimeError, OSError):   # the daemon is gone
        pass
    # always: a daemon killed in its own shutdown never booked the report just sent (one that stops in order
    # marks this spool booked as it closes its ledger)
    spool_usage(StateDir(cfg.state_dir), gateway.report(False), tuple(gateway.following.charged))
    await gateway.close()
    return 0


def spool_usage(state: StateDir, report: GatewayReport, charged: tuple[str, ...] = ()) -> None:
    """The worker's last usage counters, for the next daemon to book (its own died with them unbooked), and the
    background responses it still followed (not charged: the next daemon's gateway takes them over) and the last it
    charged (``charged``: the next daemon must not charge them again)."""
    tenants = {k: {m: list(c) for m, c in u.models.items()} for k, u in report.tenants.items() if u.models}
    if not tenants and not report.background and not charged:
        return
    try:
        state.usage_spool.mkdir(mode=0o700, parents=True, exist_ok=True)
        state.write_private(state.usage_spool / f"{report.incarnation}.json",
                            json.dumps({"incarnation": report.incarnation, "process": report.process,
                                       "at": time.time(), "tenants": tenants,   # (and the background responses
                                       "background": [list(dataclasses.astuple(b)) for b in report.background],
                                       "charged": list(charged)}))
    except OSError as exc:
        log.error("this worker's last usage counters could not be spooled to %s: %s", state.usage_spool, exc)


def main() -> None:
    fd, process = int(sys.argv[-2]), int(sys.argv[-1])
    logging.basicConfig(level=os.environ.get("SLURMFLEET_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s %(name)s[{process}]: %(message)s")
    try:
        import uvloop
        sys.exit(uvloop.run(serve(fd, process)))
    except ImportError:
        sys.exit(asyncio.run(serve(fd, process)))


if __name__ == "__main__":
    main()
