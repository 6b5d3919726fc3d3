"""Endpoint discovery: the records jobs publish under ``<state_dir>/endpoints/``.

A running job writes ``<job_id>.json`` (write then rename) once its engine's
port is bound, and ``<job_id>.draining`` when SLURM's early-warning signal
arrives.  A record whose ``job_id`` is not its file's name is ignored (the
reconciler also checks that its ``node`` is the job's head node in squeue).  Reads and removals run in a
thread of their own: the event loop never touches the (possibly network) file system, and a file system that
hangs costs a tick ``timeout_s``, not the control loop (a scan that does not come back is a missed one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

from ..statedir import StateDir
from .replica import Endpoint

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Discovered:
    endpoints: dict[str, Endpoint]
    draining: frozenset[str]                        # jobs that got SLURM's early warning
    requested: frozenset[str] = frozenset()         # jobs an operator asked to drain
    replace: frozenset[str] = frozenset()           # ... to drain once a successor serves
    cancelled: frozenset[str] = frozenset()         # jobs the daemon cancelled (still stopping)

    def warned(self, job_id: str, restart_count: int) -> bool:
        """Whether that run of the job got SLURM's early warning (its mark, or an earlier version's, per job)."""
        return not self.draining.isdisjoint((job_id, f"{job_id}.{restart_count}"))


def parse_record(text: str) -> Endpoint:
    """Parse one endpoint record; raise ValueError when it is not one."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("record is not an object")
    port = int(data["port"])
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port}")
    host = str(data["host"])
    kv = {}
    if int(data.get("kv_port") or 0) > 0:   # the engine publishes its KV-cache events (routing: kv_aware)
        h = f"[{host}]" if ":" in host else host
        kv = {"kv_events": f"tcp://{h}:{int(data['kv_port'])}", "kv_topic": str(data.get("kv_topic", "")),
              "kv_replay": f"tcp://{h}:{int(data['kv_replay_port'])}" if int(data.get("kv_replay_port") or 0) else "",
              "kv_curve": bool(data.get("kv_curve"))}
    return Endpoint(job_id=str(data["job_id"]), host=host, port=port, secret=str(data["secret"]),
                    restart_count=int(data.get("restart_count", 0)), start_time=float(data.get("start_time", 0)),
                    node=str(data.get("node", "")), **kv)


class Discovery:
    """Reads and cleans the endpoint directory."""

    def __init__(self, state: StateDir, timeout_s: float = 30.0):
        self.state = state
        self.dir = state.endpoints
        self.timeout_s = timeout_s
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="discovery")
        self.sweeper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logsweep")   # (old job logs)
        self._scanning: asyncio.Future | None = None
        self._pruning: concurrent.futures.Future | None = None

    def _scan(self) -> Discovered:
        endpoints: dict[str, Endpoint] = {}
        draining: set[str] = set()
        requested: set[str] = set()
        replace: set[str] = set()
        cancelled: set[str] = set()
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return Discovered({}, frozenset())
        for entry in entries:
            name = entry.name
            if name.endswith(".draining"):   # <jobid>.<restart>.draining: that run got the warning (an earlier
                draining.add(name[: -len(".draining")])   # version's <jobid>.draining: the job's run, whichever)
            elif name.endswith(".drain"):
                requested.add(name[: -len(".drain")])
            elif name.endswith(".replace"):
                replace.add(name[: -len(".replace")])
            elif name.endswith(".cancel"):
                cancelled.add(name[: -len(".cancel")])
            elif name.endswith(".json"):
                try:
                    ep = parse_record(Path(entry.path).read_text())
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring bad endpoint record %s: %s", entry.path, exc)
                    continue
                if f"{ep.job_id}.json" != name:  # a record speaks only for the job its file is named after
                    log.warning("ignoring endpoint record %s: it names job %s", entry.path, ep.job_id)
                    continue
                endpoints[ep.job_id] = ep
        return Discovered(endpoints, frozenset(draining), frozenset(requested), frozenset(replace),
                          frozenset(cancelled))

    def close(self) -> None:
        """At exit: a scan or removal stuck on a hung file system is not waited for, nor is one queued behind it."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sweeper.shutdown(wait=False, cancel_futures=True)

    async def scan(self) -> Discovered:
        """The records now.  One that fails or is not back within ``timeout_s`` (a shared file system that
        hangs) is a missed scan: nothing found, so the reconciler keeps the endpoints it knows and its probes
        judge the engines; the next tick waits on the same scan, never a second one beside it."""
        if self._scanning is None or self._scanning.done():
            self._scanning = asyncio.get_running_loop().run_in_executor(self.pool, self._scan)
        try:
            return await asyncio.wait_for(asyncio.shield(self._scanning), self.timeout_s)
        except (asyncio.TimeoutError, OSError) as exc:
            log.warning("cannot read the endpoint records in %s (%s): a missed scan", self.dir,
                        exc.strerror if isinstance(exc, OSError) else f"no answer in {self.timeout_s:.0f}s")
            return Discovered({}, frozenset())

    async def _run(self, what: str, fn, *args) -> None:
        """``fn`` in the file system's thread, waited for ``timeout_s`` at most (it goes on after that)."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)),
                                   self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s in %s takes over %.0fs: the file system hangs?", what, self.dir, self.timeout_s)
        except OSError as exc:
            log.warning("%s in %s failed: %s", what, self.dir, exc)

    def _remove(self, job_ids: list[str]) -> None:
        for jid in job_ids:
            for path in [*self.state.gpu_files(jid), self.state.record(jid), *self.state.draining_marks(jid),
                         self.state.drain_request(jid), self.state.replace_request(jid), self.state.cancel_mark(jid),
                         *self.state.node_scripts(jid)]:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("cannot remove record of job %s: %s", jid, exc)
            for folder in self.state.python_folders(jid):   # (a run killed before its own clean-up)
                shutil.rmtree(folder, ignore_errors=True)

    def _mark(self, path: Path, job_id: str, what: str) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as exc:   # it goes on; only a restart of the daemon before the job ends forgets it
            log.warning("cannot mark job %s as %s in %s: %s", job_id, what, self.dir, exc)

    async def mark_cancel(self, job_id: str) -> None:
        """Keep the daemon's cancel of a running ``job_id`` (:attr:`Discovered.cancelled`, until the job is gone)."""
        await self._run("marking a cancel", self._mark, self.state.cancel_mark(job_id), job_id, "cancelled")

    async def mark_drain(self, job_id: str, replace: bool = False) -> None:
        """Keep an operator's drain of ``job_id`` (:attr:`Discovered.requested`, or with ``replace``
        :attr:`Discovered.replace`, until the job is gone)."""
        path = (self.state.replace_request if replace else self.state.drain_request)(job_id)
        await self._run("marking a drain", self._mark, path, job_id, "drained")

    def _prune_logs(self, live: frozenset[str], keep_s: float, now: float) -> int:
        """Remove the job logs (``<model>-<jobid>.log``) of jobs not in ``live`` unchanged for ``keep_s``."""
        gone = 0
        try:
            entries = list(os.scandir(self.state.logs))
        except FileNotFoundError:
            return 0
        failed: OSError | None = None
        for entry in entries:
            jid = entry.name[:-4].rpartition("-")[2] if entry.name.endswith(".log") else ""
            if not jid.isdecimal() or jid in live:
                continue
            try:
                if entry.is_file(follow_symlinks=False) and \
                        now - entry.stat(follow_symlinks=False).st_mtime > keep_s:
                    os.unlink(entry.path)
                    gone += 1
            except FileNotFoundError:
                pass
            except OSError as exc:   # (one file that will not go does not keep the others)
                failed = exc
        if gone:
            log.info("removed %d job log%s unchanged for %g days (daemon.log_retention_s) from %s", gone,
                     "s" * (gone != 1), keep_s / 86400, self.state.logs)
        if failed is not None:
            log.warning("cannot remove old job logs in %s: %s", self.state.logs, failed)
        return gone

    def prune_logs(self, live: frozenset[str], keep_s: float, now: float) -> None:
        """Start removing old logs of jobs that have left squeue (``live``: the jobs it lists, and those still
        followed), in a thread of its own: a folder grown for months on a slow file system neither holds the
        tick nor queues the endpoint scans behind it; one sweep at a time."""
        if self._pruning is None or self._pruning.done():
            self._pruning = self.sweeper.submit(self._prune_logs, live, keep_s, now)

    async def remove(self, job_ids: list[str]) -> None:
        """Remove stale records (jobs that ended without cleaning up, e.g. SIGKILL or node loss)."""
        if job_ids:
            await self._run("removing records", self._remove, job_ids)
