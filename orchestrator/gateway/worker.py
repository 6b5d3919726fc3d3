"""One gateway worker process (see :mod:`orchestrator.workers`); started by the daemon, not by hand.

    python -m orchestrator.gateway.worker <socket fd> <index>
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from .pool import Pools
from .server import Gateway
from ..reqstats import RequestStats
from .upstream import Upstream
from .processes import STATS_INTERVAL_S, read_msg, write_msg

log = logging.getLogger("slurmfleet.worker")


def apply_load(pools: Pools, load: dict[str, tuple]) -> None:
    for pool in pools.pools.values():
        for jid, slot in pool.slots.items():
            if jid in load:
                slot.waiting, slot.kv_usage, slot.running = load[jid]


async def serve(fd: int, index: int) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    first = await read_msg(reader)
    if not first or first.get("t") != "config":
        return 2
    cfg = first["cfg"]
    gw = cfg.gateway
    stats = RequestStats()
    pools = Pools(cfg.models, gw.max_queue_per_model)
    upstream = Upstream(gw.connect_timeout_s)
    gateway = Gateway(cfg, pools, upstream, stats)
    runner = web.ServerRunner(gateway.server(), access_log=None, shutdown_timeout=gw.shutdown_grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, gw.host, gw.port, reuse_port=True).start()
    except OSError as exc:
        write_msg(writer, {"t": "error", "error": f"cannot listen on {gw.host}:{gw.port}: {exc.strerror}"})
        await writer.drain()
        return 1
    write_msg(writer, {"t": "listening", "pid": os.getpid()})
    version = -1

    def report() -> None:
        write_msg(writer, {"t": "stats", "version": version, "inflight": dict(pools.inflight_by_job),
                           "stats": stats.snapshot()})

    async def reporter() -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            report()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # Ctrl-C reaches the daemon, which stops us in order

    async def commands() -> None:
        nonlocal version
        while (msg := await read_msg(reader)) is not None:
            if msg["t"] == "ready":
                pools.update(msg["ready"])
                apply_load(pools, msg["load"])
                version = msg["version"]
                report()
            elif msg["t"] == "config":
                gateway.set_config(msg["cfg"])
            elif msg["t"] == "stop":
                break
        stop.set()  # asked to, or the daemon is gone: never serve without it

    tasks = [asyncio.create_task(reporter(), name="report"), asyncio.create_task(commands(), name="commands")]
    await stop.wait()
    gateway.shutting_down = True
    await runner.cleanup()  # stops accepting; open streams get shutdown_grace_s
    for t in tasks:
        t.cancel()
    report()
    upstream.close()
    return 0


def main() -> None:
    fd, index = int(sys.argv[1]), int(sys.argv[2])
    logging.basicConfig(level=os.environ.get("SLURMFLEET_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    try:
        import uvloop
        sys.exit(uvloop.run(serve(fd, index)))
    except ImportError:
        sys.exit(asyncio.run(serve(fd, index)))


if __name__ == "__main__":
    main()
