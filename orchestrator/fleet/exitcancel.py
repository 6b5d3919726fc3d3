"""``serve --cancel-jobs-on-exit``: the fleet's jobs cancelled as the daemon stops."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..config import FleetConfig
from .render import JobTag
from .replica import TERMINAL_SLURM
from .slurm import SlurmClient, SlurmError

if TYPE_CHECKING:
    from .reconciler import Reconciler

log = logging.getLogger("orchestrator.daemon")


async def cancel_fleet_jobs(reconciler: Reconciler, slurm: SlurmClient, cfg: FleetConfig, deadline_s: float) -> None:
    """--cancel-jobs-on-exit: the known replicas and every unended job of this fleet (and state dir) one fresh
    squeue lists (a job whose sbatch this stop cut short or that timed out, all of them before the first
    listing), all at once within ``deadline_s``; the known ones alone when squeue does not answer."""
    t0 = time.monotonic()
    ids = {jid for jid, f in reconciler.replicas.items() if f.slurm_state not in TERMINAL_SLURM}
    try:
        jobs = await asyncio.wait_for(slurm.list_jobs(), deadline_s / 2)
    except (SlurmError, asyncio.TimeoutError) as exc:
        log.warning("--cancel-jobs-on-exit: squeue failed (%s); cancelling the known jobs", exc or "no answer")
        jobs = []
    for j in jobs:
        if j.state in TERMINAL_SLURM:
            ids.discard(j.job_id)
        elif (t := JobTag.decode(j.comment)) is not None and t.owned_by(cfg.fleet, cfg.state_dir):
            ids.add(j.job_id)
    log.info("--cancel-jobs-on-exit: cancelling %d jobs", len(ids))
    tasks = {asyncio.create_task(slurm.cancel(jid)): jid for jid in sorted(ids)}
    left = max(1.0, deadline_s - (time.monotonic() - t0))
    done, pending = await asyncio.wait(tasks, timeout=left) if tasks else ((), ())
    for t, jid in tasks.items():   # (best effort at exit: logged; cancel() is True for one still waiting)
        if t.cancel() or t.exception() is not None:
            log.warning("scancel %s failed: %s", jid, "no answer" if t in pending else t.exception())
