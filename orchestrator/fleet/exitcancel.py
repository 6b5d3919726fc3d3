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
LATE_AT = 0.6   # the share of the deadline after which the fleet is listed again when an sbatch's outcome is unknown


async def cancel_fleet_jobs(reconciler: Reconciler, slurm: SlurmClient, cfg: FleetConfig, deadline_s: float) -> None:
    """--cancel-jobs-on-exit: the known replicas and every unended job of this fleet (and state dir) one fresh
    squeue lists (a job whose sbatch this stop cut short or that timed out, all of them before the first
    listing), all at once within ``deadline_s``; the known ones alone when squeue does not answer.  With an
    sbatch whose outcome is not known (in flight when the stop cut it short: its command goes on, and may make
    its job after the first listing), the fleet is listed again late in the deadline, and what is new cancelled."""
    t0 = time.monotonic()
    ids = {jid for jid, f in reconciler.replicas.items() if f.slurm_state not in TERMINAL_SLURM}
    rounds = 2 if getattr(reconciler, "placeholders", None) else 1
    done: set[str] = set()
    for r in range(rounds):
        until = deadline_s * (LATE_AT if r + 1 < rounds else 1.0)
        if r:
            await asyncio.sleep(max(0.0, deadline_s * LATE_AT - (time.monotonic() - t0)))
        try:
            jobs = await asyncio.wait_for(slurm.list_jobs(), max(0.5, min(deadline_s / 2, until - (time.monotonic() - t0))))
        except (SlurmError, asyncio.TimeoutError) as exc:
            log.warning("--cancel-jobs-on-exit: squeue failed (%s); cancelling the known jobs", exc or "no answer")
            jobs = []
        for j in jobs:
            if j.state in TERMINAL_SLURM:
                ids.discard(j.job_id)
            elif (t := JobTag.decode(j.comment)) is not None and t.owned_by(cfg.fleet, cfg.state_dir):
                ids.add(j.job_id)
        ids -= done
        if not r or ids:
            log.info("--cancel-jobs-on-exit: cancelling %d jobs%s", len(ids), " (listed again)" if r else "")
        await _cancel(slurm, ids, max(1.0, until - (time.monotonic() - t0)))
        done |= ids
        ids = set()


async def _cancel(slurm: SlurmClient, ids: set[str], timeout_s: float) -> None:
    """``ids`` scancelled all at once, waited for ``timeout_s`` at most."""
    tasks = {asyncio.create_task(slurm.cancel(jid)): jid for jid in sorted(ids)}
    done, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else ((), ())
    for t, jid in tasks.items():   # (best effort at exit: logged; cancel() is True for one still waiting)
        if t.cancel() or t.exception() is not None:
            log.warning("scancel %s failed: %s", jid, "no answer" if t in pending else t.exception())
