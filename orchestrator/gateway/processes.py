"""Gateway worker processes: one port, several processes, one daemon deciding where requests may go.

With ``gateway.workers > 1`` the daemon serves no client itself.  It starts
that many ``python -m orchestrator.gateway.worker`` processes; each binds the
gateway port with SO_REUSEPORT (the kernel spreads connections over them) and
runs the same :class:`~orchestrator.proxy.Gateway` on uvloop.  A private
socket pair per worker carries, daemon -> worker, the config and every change
of the READY replicas with their scraped load, and worker -> daemon, an
acknowledgement of each change plus its in-flight counts per job and request
statistics (every half second).  The daemon sums those into ``/metrics``
(a dead worker's counters are kept, so counters never go down), counts a job's
in-flight requests over all workers before a drain completes, and restarts a
worker that dies, with back-off.  Routing state (in-flight per replica,
ejections) is per worker, as in Envoy or nginx workers.

Frames are a 4-byte length and a pickle: both ends are this package, on a
socket pair nobody else holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import socket
import struct
import sys
import time
from collections.abc import Callable

from ..config import FleetConfig
from ..observability.metrics import Metrics
from ..fleet.reconciler import Backend
from ..reqstats import RequestStats

log = logging.getLogger("slurmfleet.workers")
STATS_INTERVAL_S = 0.5


def write_msg(writer: asyncio.StreamWriter, msg: dict) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(struct.pack("!I", len(data)) + data)


async def read_msg(reader: asyncio.StreamReader) -> dict | None:
    """The next frame, or None at EOF."""
    try:
        (n,) = struct.unpack("!I", await reader.readexactly(4))
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


@dataclasses.dataclass
class Worker:
    index: int
    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader
    started: float
    acked: int = -1
    inflight: dict[str, int] = dataclasses.field(default_factory=dict)


class GatewayWorkers:
    """Starts, feeds, watches and stops the gateway worker processes."""

    def __init__(self, cfg: FleetConfig, metrics: Metrics, load: Callable[[], dict] = dict):
        self.cfg, self.metrics, self.load = cfg, metrics, load
        self.n = cfg.gateway.workers
        self.workers: dict[int, Worker] = {}
        self.version = 0
        self.ready: dict[str, list[Backend]] = {}
        self.stopping = False
        self.restarts = 0

    # feeding
    def publish(self, ready: dict[str, list[Backend]] | None = None) -> None:
        """Send the READY replicas (when given and changed) and the latest scraped load to every worker."""
        if ready is not None and ready != self.ready:
            self.ready = {m: list(bs) for m, bs in ready.items()}
            self.version += 1
        msg = {"t": "ready", "version": self.version, "ready": self.ready, "load": self.load()}
        for w in self.workers.values():
            write_msg(w.writer, msg)

    def set_config(self, cfg: FleetConfig) -> None:
        if (cfg.gateway.workers, cfg.gateway.host, cfg.gateway.port) != (self.n, self.cfg.gateway.host,
                                                                         self.cfg.gateway.port):
            log.warning("gateway.workers/host/port changes take effect at the next start")
        self.cfg = cfg
        for w in self.workers.values():
            write_msg(w.writer, {"t": "config", "cfg": cfg})

    def inflight(self, job_id: str) -> int:
        """Requests on this job over all workers; at least 1 while a worker has not seen the latest change
        (it might still route there)."""
        total = sum(w.inflight.get(job_id, 0) for w in self.workers.values())
        if any(w.acked < self.version for w in self.workers.values()):
            return max(1, total)
        return total

    def info(self) -> dict:
        """For ``slurmfleet status``: processes serving, restarts, requests queued per model in the workers."""
        total = RequestStats()
        for snap in self.metrics.worker_stats.values():
            total.add(snap)
        return {"processes": len(self.workers), "worker_restarts": self.restarts, "queued": total.queued}

    # lifecycle
    async def start(self) -> bool:
        """Start every worker; False (and nothing left running) if one cannot listen."""
        for i in range(self.n):
            try:
                self.workers[i] = await self._spawn(i)
            except RuntimeError as exc:
                log.error("%s", exc)
                await self.stop(0)
                return False
        self.metrics.gateway_processes.set(len(self.workers))
        self.publish()
        return True

    async def _spawn(self, index: int) -> Worker:
        mine, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator.gateway.worker", str(theirs.fileno()), str(index),
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "SLURMFLEET_LOG_LEVEL": logging.getLevelName(logging.getLogger().level)})
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        write_msg(writer, {"t": "config", "cfg": self.cfg})
        try:
            first = await asyncio.wait_for(read_msg(reader), 30)
        except asyncio.TimeoutError:
            first = None
        if not first or first.get("t") != "listening":
            writer.close()
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
            why = first.get("error") if first else "exited or did not answer"
            raise RuntimeError(f"gateway worker {index} could not start: {why}")
        log.info("gateway worker %d (pid %d) listening on %s:%d", index, proc.pid, self.cfg.gateway.host,
                 self.cfg.gateway.port)
        return Worker(index, proc, writer, reader, time.monotonic())

    async def watch(self, index: int) -> None:
        """Root task per worker: take its reports; when it dies, keep its counters and start another."""
        backoff = 1.0
        while not self.stopping:
            w = self.workers.get(index)
            if w is None:
                try:
                    w = self.workers[index] = await self._spawn(index)
                    self.metrics.gateway_processes.set(len(self.workers))
                    self.publish()
                except RuntimeError as exc:
                    log.error("%s; retrying in %.0fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
            while (msg := await read_msg(w.reader)) is not None:
                if msg["t"] == "stats":
                    w.acked, w.inflight = msg["version"], msg["inflight"]
                    self.metrics.worker_stats[index] = msg["stats"]
            code = await w.proc.wait()
            self.workers.pop(index, None)
            self.metrics.gateway_processes.set(len(self.workers))
            self.metrics.retire_worker(index)
            w.writer.close()
            if self.stopping:
                return
            self.metrics.worker_restarts.inc()
            self.restarts += 1
            log.error("gateway worker %d (pid %d) exited with %s; starting another", index, w.proc.pid, code)
            if time.monotonic() - w.started > 60:
                backoff = 1.0
            await asyncio.sleep(backoff)
            backoff = min(30.0, backoff * 2)

    async def stop(self, grace_s: float) -> None:
        """Workers stop accepting, fail /readyz and finish open streams for up to ``grace_s``."""
        self.stopping = True
        for w in self.workers.values():
            write_msg(w.writer, {"t": "stop"})
        for w in list(self.workers.values()):
            try:
                await asyncio.wait_for(w.proc.wait(), grace_s + 5)
            except asyncio.TimeoutError:
                log.error("gateway worker %d did not stop within %.0fs; killing it", w.index, grace_s + 5)
                w.proc.kill()
                await w.proc.wait()
