"""Bad nodes, crash back-offs, the jobs followed and idle models' quiet, remembered across a daemon's restart.

The control loop suspects a node that lost a replica or on which one never came up, and excludes it from a
model's submissions for ``backoff.node_exclude_s`` after ``node_failure_threshold`` such failures
(:meth:`~.replica.ModelRuntime.count_crash`).  That memory was the process's: a daemon started again submitted
to the bad node at once, and the jobs pending with it excluded (their ``--exclude``) were never let onto it when
the exclusion ended, which only the daemon that excluded it knew.

Kept per model in ``<state_dir>/nodes.json`` (written whole at each change, off the event loop), with the model's
job shape (:meth:`~orchestrator.config.ModelConfig.job_hash`): a model whose shape changed while the daemon was
down starts with a clean slate, as a reload's does.  Read back, every exclusion is restored, those that ended
meanwhile too (the next tick ends them, and lets the pending jobs onto their nodes), and an adopted pending job
of the model is taken to exclude them all (what it excludes is not in squeue's listing; an update sets it to
the nodes still excluded).

A model's crash loop is kept with them (``backoff``: the early failures in a row, the next submission's time,
the last error and log), so a daemon started again (an upgrade, a supervisor bringing a crashed daemon back) waits
out the back-off and goes on doubling it, where it submitted at once and started again from ``base_s``.

Each model's entry also names the jobs the daemon followed (``jobs``: job id -> slot), so the next daemon can
tell a job that ended while none watched it (:func:`~.observe.ended_unwatched`) from one it never had, and,
for an autoscaled model without a request, since when it had none (``quiet_since``): a daemon started again
counts its idle time from there (:meth:`~.autoscale.Autoscaler.restore_quiet`), so a restart does not hold an
idle model's replicas for another ``scale_to_zero_after_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from concurrent.futures import Executor
from pathlib import Path

from ..config import ModelConfig
from ..durable import write_whole
from ..observability.metrics import BACKOFF_CAUSES
from .replica import ModelRuntime, ReplicaFacts

log = logging.getLogger("slurmfleet.reconciler")


def snapshot(models: Mapping[str, ModelRuntime], cfg_models: list[ModelConfig], now: float,
             followed: Mapping[str, ReplicaFacts] | None = None, quiet: Mapping[str, float] | None = None) -> dict:
    """What is kept: per configured model with a bad node, its shape, exclusions and the failures that still
    count (within ``node_exclude_s``); per configured model with jobs, the jobs followed (``followed``: the
    reconciler's, job id -> facts) and their slots; per autoscaled model without a request now, since when
    (``quiet``: wall time, kept to the second: the file is not written again for a clock's jitter)."""
    names, out = {m.name for m in cfg_models}, {}
    for name, t in (quiet or {}).items():
        if name in names:
            out.setdefault(name, {})["quiet_since"] = math.floor(t)
    for f in (followed or {}).values():
        if f.model in names:
            out.setdefault(f.model, {}).setdefault("jobs", {})[f.job_id] = f.slot
    for m in cfg_models:
        rt = models.get(m.name)
        if rt is None:
            continue
        window = m.backoff.node_exclude_s
        failures = {n: kept for n, ts in rt.node_failures.items() if (kept := [t for t in ts if now - t < window])}
        entry: dict = dict(excluded=dict(rt.excluded), failures=failures) if rt.excluded or failures else {}
        if rt.crashes or rt.backoff_until > now:   # a crash loop's back-off (or a job count limit's)
            entry["backoff"] = {"crashes": rt.crashes, "crashed_at": rt.crashed_at, "until": rt.backoff_until,
                                "slot": rt.crash_slot, "cause": rt.backoff_cause, "error": rt.last_error,
                                "log": rt.last_log}
        if entry:
            out.setdefault(m.name, {}).update(job=m.job_hash(), **entry)
    return out


def followed_jobs(doc: dict, model: str) -> dict[str, int]:
    """The jobs of ``model`` the daemon that wrote ``doc`` followed, and their slots ({} when unreadable)."""
    entry = doc.get(model)
    jobs = entry.get("jobs") if isinstance(entry, dict) else None
    try:
        return {str(j): int(s) for j, s in jobs.items()} if isinstance(jobs, dict) else {}
    except (TypeError, ValueError):
        return {}


def quiet_since(doc: dict, model: str, now: float) -> float | None:
    """Since when (wall time, at most ``now``) ``model`` had no request as the daemon that wrote ``doc`` last
    saw it; None when it had some, or nothing readable is kept."""
    entry = doc.get(model)
    t = entry.get("quiet_since") if isinstance(entry, dict) else None
    if type(t) not in (int, float) or not math.isfinite(t):
        return None
    return min(float(t), now)


def restore(doc: dict, rt: ModelRuntime, m: ModelConfig, now: float) -> bool:
    """Put a model's kept bad nodes back into ``rt`` (its shape unchanged; an exclusion at most
    ``node_exclude_s`` from now, a clock set back meanwhile not making it longer); whether there were any."""
    entry = doc.get(m.name)
    if not isinstance(entry, dict) or entry.get("job") != m.job_hash():
        return False
    latest = now + m.backoff.node_exclude_s

    def moment(t) -> float:
        t = float(t)
        if not math.isfinite(t):
            raise ValueError(f"{t} is no time")
        return t
    try:
        rt.excluded = {str(n): min(moment(t), latest) for n, t in (entry.get("excluded") or {}).items()}
        rt.node_failures = {str(n): [min(moment(t), now) for t in ts]
                            for n, ts in (entry.get("failures") or {}).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        log.error("model %s: unreadable bad nodes kept (%s): none restored", m.name, exc)
        rt.excluded, rt.node_failures = {}, {}
        return False
    if rt.excluded:
        log.warning("model %s: nodes excluded before the restart, until their time: %s", m.name,
                    ", ".join(sorted(rt.excluded)))
    return _restore_backoff(entry.get("backoff"), rt, m, now) or bool(rt.excluded or rt.node_failures)


def _restore_backoff(b, rt: ModelRuntime, m: ModelConfig, now: float) -> bool:
    """A crash loop's back-off kept (``b``) put back into ``rt``: the early failures in a row, and the next
    submission no sooner than the last daemon said (at most ``backoff.max_s`` from now)."""
    if not isinstance(b, dict):
        return False
    try:
        crashes, crashed_at, until = int(b["crashes"]), float(b["crashed_at"]), float(b["until"])
        slot = None if b.get("slot") is None else int(b["slot"])
        if crashes < 0 or not (math.isfinite(crashed_at) and math.isfinite(until)):
            raise ValueError("no back-off")
    except (KeyError, TypeError, ValueError) as exc:
        log.error("model %s: unreadable back-off kept (%s): none restored", m.name, exc)
        return False
    rt.crashes, rt.crashed_at, rt.crash_slot = crashes, min(crashed_at, now), slot
    rt.backoff_until = min(until, now + m.backoff.max_s)
    rt.backoff_cause = b.get("cause") if b.get("cause") in BACKOFF_CAUSES else "crash"
    rt.last_error = b["error"] if isinstance(b.get("error"), str) else None
    rt.last_log = b["log"] if isinstance(b.get("log"), str) else None
    if rt.backoff_until > now:
        log.warning("model %s: backing off as before the restart (%d early failures in a row): next submission in "
                    "%.0fs", m.name, crashes, rt.backoff_until - now)
    return True


class NodeMemory:
    """``nodes.json``: read once when the daemon starts, written (in ``pool``'s thread, one write at a time, the
    tick never waiting for it) when what it keeps changed.  ``path`` None: kept in memory only."""

    def __init__(self, path: Path | None = None, pool: Executor | None = None):
        self.path, self.pool = path, pool
        self.saved: dict = {}
        self.loaded: dict = {}
        self.writing: asyncio.Future | None = None
        self.failing = False   # (said once, until a write works again)
        if path is None:
            return
        try:
            doc = json.loads(path.read_text())
            self.loaded = self.saved = doc if isinstance(doc, dict) else {}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.error("unreadable %s (%s): no bad node of before the restart is remembered", path, exc)

    def save(self, doc: dict) -> None:
        """Start writing ``doc`` unless the file holds it or a write is under way (a write that failed, or a
        change meanwhile, is tried again at the next tick's)."""
        if self.path is None or doc == self.saved or self.writing is not None and not self.writing.done():
            return
        path = self.path

        def write() -> None:
            if doc:
                write_whole(path, json.dumps(doc).encode())
            else:
                path.unlink(missing_ok=True)

        def done(fut: asyncio.Future) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is None and not fut.cancelled():
                self.saved = doc
                if self.failing:
                    log.info("the bad nodes are kept in %s again", path)
                self.failing = False
            elif not self.failing:
                self.failing = True
                log.error("cannot keep the bad nodes in %s (tried again at each tick): %s", path, exc)
        try:
            self.writing = asyncio.get_running_loop().run_in_executor(self.pool, write)
        except RuntimeError:   # (the pool shut down: the daemon is stopping)
            return
        self.writing.add_done_callback(done)

    async def synced(self) -> None:
        """The write under way done (tests; a daemon never waits for it)."""
        if self.writing is not None:
            await asyncio.gather(self.writing, return_exceptions=True)
