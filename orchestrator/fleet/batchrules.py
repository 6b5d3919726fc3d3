"""A dedicated batch's job array (:mod:`orchestrator.fleet.batcharray`): what to do, decided from what squeue
shows, pure and table-tested: a shard's fate, how many retries may go, which jobs to hold or release, which
listed jobs are the array's, which a retry to adopt, which strays to cancel."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .replica import ENDED_SLURM, TERMINAL_SLURM
from .slurm import JobInfo

TASK_ID = re.compile(r"^(\d+)_(\d+)$")   # an array task as squeue -r names it: <array job id>_<task id>


def verdict(complete: bool, state: str | None, retries: int, max_retries: int) -> str:
    """What to do with a shard: ``done`` (its output is whole), ``wait`` (its task is queued or running),
    ``retry`` (its task ended, or left squeue, without the output) or ``give_up`` (no retries left)."""
    if complete:
        return "done"
    if state is not None and state not in ENDED_SLURM:   # (held for good by SLURM: ended, for the shard)
        return "wait"
    return "retry" if retries < max_retries else "give_up"


def retry_slots(states: list[str | None], base_pending: bool, max_parallel: int) -> int:
    """How many retries may be submitted now: none while the array itself still has tasks waiting (SLURM's
    ``%K`` counts only its own tasks), else up to ``K`` tasks queued or running in all."""
    if base_pending:
        return 0
    return max(0, max_parallel - sum(1 for s in states if s is not None and s not in ENDED_SLURM))


def to_hold_or_release(rows: Iterable[JobInfo | None], held: bool, mine: Iterable[str]) -> list[str]:
    """The jobs to act on, from the current tasks of the shards not done: held, every job with a task waiting
    unheld (a job submitted or adopted since the hold too); not held, the jobs this batch held (``mine``)
    with a task still waiting in its hold (an operator's hold of another job, or an admin's, stays)."""
    mine = set(mine)
    return sorted({m[1] for r in rows if r is not None and r.state == "PENDING" and (m := TASK_ID.match(r.job_id))
                   and ((held and not (r.reason or "").startswith("JobHeld")) or
                        (not held and r.reason == "JobHeldUser" and m[1] in mine))})


def live_jobs(rows: Iterable[JobInfo]) -> set[str]:
    """The jobs with a task not ended (one SLURM holds for good too: released, it would run)."""
    return {m[1] for r in rows if r.state not in TERMINAL_SLURM and (m := TASK_ID.match(r.job_id))}


def sort_jobs(rows: Iterable[JobInfo], base: str | None, attempts: dict[int, str],
              shards: int) -> tuple[str | None, dict[int, str], set[str]]:
    """The jobs listed under the batch's name, sorted out: (the array: ``base``, or, not known yet, the oldest
    listed; the retries to adopt: shard -> a job newer than the shard's attempt (``attempts``, else the array)
    whose only task is that shard, once that attempt's task ended or left squeue; the strays: every other job
    with a task not ended, a duplicate of an sbatch whose outcome was unknown that must not run beside the
    job kept (two tasks of a shard delete each other's output))."""
    tasks: dict[str, dict[int, JobInfo]] = {}
    for r in rows:
        if m := TASK_ID.match(r.job_id):
            tasks.setdefault(m[1], {})[int(m[2])] = r
    jobs = sorted(tasks, key=int)
    base = base or (jobs[0] if jobs else None)
    current = {i: attempts.get(i, base) for i in range(shards)}
    adopt: dict[int, str] = {}
    strays: set[str] = set()
    for job in jobs:
        if job == base or job in current.values():
            continue
        only = next(iter(tasks[job])) if len(tasks[job]) == 1 else -1
        if 0 <= only < shards and int(job) > int(current[only]):
            row = tasks.get(current[only], {}).get(only)
            if row is None or row.state in ENDED_SLURM:
                adopt[only] = current[only] = job
                continue
        if live_jobs(tasks[job].values()):
            strays.add(job)
    return base, adopt, strays
