"""Gateway worker processes: one port, several processes, one daemon deciding where requests may go.

With ``gateway.workers > 1`` the daemon serves no client itself.  :class:`GatewayWorkers` starts that
many ``python -m orchestrator.gateway.worker`` processes; each binds the gateway port with
SO_REUSEPORT (the kernel spreads connections over them) and runs the same
:class:`~orchestrator.gateway.server.Gateway` on uvloop.  It is the fleet's
:class:`~orchestrator.contract.RoutingSink` for them: over a private socket pair per worker, every
routing table goes down (and the config, on reload), and every half second each worker's
:class:`~orchestrator.contract.GatewayReport` comes up into the fleet's
:class:`~orchestrator.contract.ReportSink`.  A worker that dies is retired there (its counters kept)
and started again with back-off.  Routing state (in-flight per replica, ejections) is per worker, as
in Envoy or nginx workers.

Frames are a 4-byte length and a pickle: both ends are this package, on a socket pair nobody else holds.  The
same package: a worker started after the installed one changed under the running daemon (an upgrade) would read
the daemon's objects as its own classes, which may differ; it compares the daemon's :func:`code_fingerprint`
(``SLURMFLEET_CODE``) with its own first, and says so instead of serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import pickle
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..config import FleetConfig
from ..contract import EMPTY_TABLE, ReportSink, RoutingTable

log = logging.getLogger("slurmfleet.workers")
REPORT_INTERVAL_S = 0.5
SILENT_S = 30.0      # a worker that sends no report for this long (60 of them) is hung: killed, and started again
STOP_EXTRA_S = 5.0   # a stopping worker's time past the grace (it waits a second for cancelled handlers, then settles)


def port_taken(host: str, port: int) -> str | None:
    """Why the gateway port is not ours to share, or None.  The workers bind it with SO_REUSEPORT, which the
    kernel lets a second daemon of the same user do too (it would get half the clients' connections): a plain
    bind first (as the kernel sees it: fails only where some process listens on the port) says it is free."""
    if not port:
        return None
    try:
        addrs = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror}"
    for family, kind, proto, _, addr in addrs:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:   # (as asyncio binds it)
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
        except OSError as exc:   # (an address family the host lacks, IPv6 turned off: the workers skip it too)
            if exc.errno == errno.EADDRINUSE:
                return f"cannot listen on {host}:{port} (gateway.port): {exc.strerror} (another process listens there)"
    return None


def package_root() -> Path:
    """The folder holding this ``orchestrator`` package."""
    return Path(__file__).resolve().parent.parent.parent


def code_fingerprint() -> str:
    """A digest of this package's source as installed now (every ``.py`` file's path and bytes)."""
    root = package_root() / "orchestrator"
    h = hashlib.sha256()
    for p in sorted(p for p in root.rglob("*.py") if not any(x.startswith(".") for x in p.relative_to(root).parts)):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        try:
            h.update(p.read_bytes())
        except OSError:   # (removed meanwhile: an upgrade in progress)
            h.update(b"-")
    return h.hexdigest()


CODE_CHANGED = ("the slurmfleet installed now is not the one the daemon runs (upgraded under it?): restart the "
                "daemon to serve with the new one")
WORKER_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from orchestrator.gateway.worker import main; main()"


def write_msg(writer: asyncio.StreamWriter, msg: dict) -> None:
    """One frame; none to a worker that has just ended (its socket closing: under uvloop a write raises there, and
    a reload stopped half-way, the workers after it left on the old config; one started again gets the latest)."""
    if writer.is_closing():
        return
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        writer.write(struct.pack("!I", len(data)) + data)
    except (RuntimeError, ConnectionError):
        pass


async def read_msg(reader: asyncio.StreamReader) -> dict | None:
    """The next frame, or None at EOF."""
    try:
        (n,) = struct.unpack("!I", await reader.readexactly(4))
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


@dataclasses.dataclass
class Worker:
    process: int
    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader
    started: float
    told: bool = False   # sent "stop"
    killed: bool = False


class GatewayWorkers:
    """Starts, feeds, watches and stops the gateway worker processes (numbered 1..N in reports)."""

    def __init__(self, cfg: FleetConfig, reports: ReportSink, on_restart: Callable[[], None] = lambda: None):
        self.cfg, self.reports, self.on_restart = cfg, reports, on_restart
        self.n = cfg.gateway.workers
        self.workers: dict[int, Worker] = {}
        self.spawned: set[int] = set()   # processes started once already (one started again is "restarted")
        self.table: RoutingTable = EMPTY_TABLE
        self.stopping = False
        self.stop_at: float | None = None   # (monotonic) when the workers not ended yet are killed
        self.stop_after = 0.0   # (the grace and STOP_EXTRA_S)
        self.starting = 0   # workers being started again (by watch): stop() waits for them too
        self.started = asyncio.Event()   # (set as each of those is up, or failed)
        self.restarts = 0
        self.code = code_fingerprint()   # (the daemon's, as it started: a worker runs the code installed then)

    # the contract
    def publish(self, table: RoutingTable) -> None:
        self.table = table
        for w in self.workers.values():
            write_msg(w.writer, {"t": "table", "table": table})

    def set_config(self, cfg: FleetConfig) -> None:
        if (cfg.gateway.workers, cfg.gateway.host, cfg.gateway.port) != (self.n, self.cfg.gateway.host,
                                                                         self.cfg.gateway.port):
            log.warning("gateway.workers/host/port changes take effect at the next start")
        self.cfg = cfg
        for w in self.workers.values():
            write_msg(w.writer, {"t": "config", "cfg": cfg})

    @property
    def port(self) -> int:
        return self.cfg.gateway.port

    @property
    def processes(self) -> int:
        return len(self.workers)

    # lifecycle
    async def start(self) -> bool:
        """Start every worker; False (and nothing left running) if the port is another process's or a worker
        cannot listen."""
        taken = port_taken(self.cfg.gateway.host, self.cfg.gateway.port)
        if taken:
            log.error("%s", taken)
            return False
        for process in range(1, self.n + 1):
            try:
                self.workers[process] = await self._spawn(process)
            except (RuntimeError, OSError) as exc:
                log.error("%s", exc)
                await self.stop(0)
                return False
        return True

    def root_tasks(self) -> list[tuple[str, object]]:
        return [(f"gateway-worker-{p}", self.watch(p)) for p in range(1, self.n + 1)]

    async def _spawn(self, process: int) -> Worker:
        mine, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(   # (the daemon's own copy of the package, wherever it runs)
                sys.executable, "-c", WORKER_MAIN, str(package_root()), str(theirs.fileno()), str(process),
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "SLURMFLEET_LOG_LEVEL": logging.getLevelName(logging.getLogger().level),
                     "SLURMFLEET_CODE": self.code})
        except OSError:   # (no process to be had: EAGAIN under a process limit, ENOMEM)
            mine.close()
            raise
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=mine)
            sent, sent_cfg = self.table, self.cfg
            write_msg(writer, {"t": "config", "cfg": sent_cfg, "table": sent, "restarted": process in self.spawned})
            self.spawned.add(process)
            try:
                first = await asyncio.wait_for(read_msg(reader), 30)
            except asyncio.TimeoutError:
                first = None
        except BaseException:   # (cancelled: the daemon's end came first; no worker left behind it)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        if not first or first.get("t") != "listening":
            writer.close()
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
            why = first.get("error") if first else "exited or did not answer"
            raise RuntimeError(f"gateway worker {process} could not start: {why}")
        log.info("gateway worker %d (pid %d) listening on %s:%d", process, proc.pid, self.cfg.gateway.host,
                 self.cfg.gateway.port)
        if self.cfg is not sent_cfg:  # reloaded while the worker started (set_config wrote to the others only)
            write_msg(writer, {"t": "config", "cfg": self.cfg})
        if self.table is not sent:  # published while the worker started
            write_msg(writer, {"t": "table", "table": self.table})
        return Worker(process, proc, writer, reader, time.monotonic())

    def _restarted(self) -> None:
        self.on_restart()
        self.restarts += 1

    async def watch(self, process: int) -> None:
        """Root task per worker: take its reports; when it dies, retire it and start another."""
        backoff = self.cfg.gateway.worker_restart_base_s   # (the config in force: a reload changes it)
        while not self.stopping:
            w = self.workers.get(process)
            if w is None:
                try:
                    w = self.workers[process] = await self._start_again(process)
                except (RuntimeError, OSError) as exc:   # (OSError: no process to be had) each attempt counts:
                    self._restarted()   # workers that cannot start must be seen (SlurmfleetGatewayWorkerRestarting)
                    log.error("%s; retrying in %.0fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(self.cfg.gateway.worker_restart_max_s, backoff * 2)
                    continue
                if self.stop_at is not None:   # the stop began while it started (seconds of Python start-up):
                    self._tell_stop(w)         # it listens now, and ends as the others do (stop() waits for it)
            await self._take_reports(w)
            code = await w.proc.wait()
            self.workers.pop(process, None)
            self.reports.retire(process)
            w.writer.close()
            if self.stopping:
                return
            self._restarted()
            log.error("gateway worker %d (pid %d) exited with %s; starting another", process, w.proc.pid, code)
            if time.monotonic() - w.started > 60:
                backoff = self.cfg.gateway.worker_restart_base_s
            await asyncio.sleep(backoff)
            backoff = min(self.cfg.gateway.worker_restart_max_s, backoff * 2)

    async def _start_again(self, process: int) -> Worker:
        self.starting += 1
        try:
            return await self._spawn(process)
        finally:
            self.starting -= 1
            self.started.set()

    async def _take_reports(self, w: Worker) -> None:
        """A worker's reports until its end; one silent for SILENT_S is hung (a stopped or stuck event loop: its
        share of the clients' connections hang, and its last report, kept, holds drains and scale-downs), so it is
        killed, to be started again."""
        read: asyncio.Future | None = None   # (one read at a time, never cut in the middle of a frame)
        try:
            while True:
                read = read or asyncio.ensure_future(read_msg(w.reader))
                left = SILENT_S if self.stop_at is None else max(0.0, self.stop_at - time.monotonic())
                if not (await asyncio.wait({read}, timeout=min(SILENT_S, left)))[0]:
                    if self.stop_at is not None and time.monotonic() >= self.stop_at:
                        self._kill_late(w)   # (stop() kills at the same deadline: one stop() left behind too)
                        return
                    if self.stopping:
                        continue
                    log.error("gateway worker %d (pid %d) sent no report for %.0fs: killing it", w.process,
                              w.proc.pid, SILENT_S)
                    try:
                        w.proc.kill()
                    except ProcessLookupError:
                        pass
                    return
                msg, read = read.result(), None
                if msg is None:
                    return
                if msg["t"] == "report":
                    self.reports.receive(msg["report"])
        finally:
            if read is not None:
                read.cancel()

    def closing(self) -> None:
        """The daemon is stopping: dead workers are no longer replaced."""
        self.stopping = True

    async def stop(self, grace_s: float) -> None:
        """Workers stop accepting, fail /readyz and finish open streams for up to ``grace_s``; one still there the
        grace and ``STOP_EXTRA_S`` after the stop began is killed (one deadline for all of them, those started
        again during the stop too)."""
        self.stopping = True
        self.stop_after = grace_s + STOP_EXTRA_S
        self.stop_at = time.monotonic() + self.stop_after
        waits: dict[asyncio.Future, Worker] = {}
        while True:
            for w in [w for w in self.workers.values() if w not in waits.values()]:   # (and those started since)
                self._tell_stop(w)
                waits[asyncio.ensure_future(w.proc.wait())] = w
            late = {f for f in waits if not f.done()}
            left = self.stop_at - time.monotonic()
            if not late and not self.starting or left <= 0:
                break
            self.started.clear()
            up = asyncio.ensure_future(self.started.wait())
            await asyncio.wait({*late, up}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            up.cancel()
        for fut in late:
            self._kill_late(waits[fut])
        if late:
            await asyncio.wait(late)

    def _tell_stop(self, w: Worker) -> None:
        if not w.told:
            w.told = True
            write_msg(w.writer, {"t": "stop"})

    def _kill_late(self, w: Worker) -> None:
        if w.killed or w.proc.returncode is not None:
            return
        w.killed = True
        log.error("gateway worker %d did not stop within %.0fs; killing it", w.process, self.stop_after)
        try:
            w.proc.kill()
        except ProcessLookupError:
            pass
