"""One squeue listing into the reconciler's facts: jobs adopted, requeues seen, SLURM's fields copied, jobs that
left the listing counted out (gone after two listings without them), placeholders resolved or expired; and, on a
new daemon's first listing, the jobs that ended while no daemon watched them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .nodememory import followed_jobs
from .render import JobTag
from .replica import END_REASON, HELD_FOR_GOOD, QUEUED_SLURM, STOPPING_SLURM, TERMINAL_SLURM, ReplicaFacts
from .slurm import JobInfo

if TYPE_CHECKING:
    from .discovery import Discovered
    from .reconciler import Reconciler

log = logging.getLogger("orchestrator.fleet.reconciler")


def observe(rec: Reconciler, jobs: list[JobInfo], now: float) -> None:
    seen: set[str] = set()
    for j in jobs:
        tag = JobTag.decode(j.comment)
        if tag is None or not tag.owned_by(rec.cfg.fleet, rec.cfg.state_dir):
            if j.job_id not in rec.replicas:   # (another fleet's, another user's, anything else: never touched)
                continue
            lost_tag(rec, j)   # one of ours whose Comment was changed: followed by its id
            tag = None
        seen.add(j.job_id)
        if tag is not None:
            rec.placeholders.pop(tag.nonce, None)
        f = rec.replicas.get(j.job_id)
        if f is None:
            if j.job_id in rec.finished and j.state in ("PENDING", "RUNNING"):
                # ended, and back (an admin's requeue): it holds its resources again, so it is ours again
                log.warning("job %s (model %s) is %s again after it ended", j.job_id, tag.model, j.state)
                rec.finished.discard(j.job_id)
            elif j.job_id in rec.finished or j.state in TERMINAL_SLURM:
                rec.finished.add(j.job_id)
                continue
            m = rec.cfg.model(tag.model)
            h = m.adopted_hash(tag.config_hash) if m else tag.config_hash
            # (a tag of an earlier release names no engine: its settings', when they are current, else its own)
            eng = tag.engine or (m.engine_hash() if m and h == m.job_hash() else h)
            f = rec.replicas[j.job_id] = ReplicaFacts(j.job_id, tag.model, tag.slot, h, slurm_state=j.state,
                                                      restart_count=j.restart_count, adopted_at=now, engine_hash=eng)
            if j.state == "PENDING":   # (what it excludes is not listed: its model's exclusions, updated as they end)
                f.excluded = tuple(sorted(rec.runtime(tag.model).excluded))
            log.info("adopted job %s (model %s slot %d, %s)", j.job_id, tag.model, tag.slot, j.state)
        if j.state not in HELD_FOR_GOOD and (j.restart_count > f.restart_count or (   # (held: replaced)
                f.slurm_state == "RUNNING" and j.state in QUEUED_SLURM)):
            log.warning("job %s was requeued by SLURM (restart %d): its node was lost", j.job_id, j.restart_count)
            rec.metrics.restarts.labels(f.model, "node_lost").inc()
            f.endpoint, f.first_ready_time, f.consecutive_failures, f.last_probe_time = None, None, 0, None
            f.time_limit_warned, f.requeued = False, True   # (the new run clears its own .draining mark)
        if f.slurm_state in QUEUED_SLURM and j.state == "RUNNING" and j.start_time and j.submit_time:
            rec.metrics.pending_seconds.labels(f.model).observe(max(0.0, j.start_time - j.submit_time))
        f.slurm_state, f.reason, f.requeued = j.state, j.reason, f.requeued and j.state in STOPPING_SLURM
        f.submit_time, f.start_time, f.end_time = j.submit_time, j.start_time, j.end_time
        f.time_limit_s, f.nodelist, f.restart_count = j.time_limit_s, j.nodelist, j.restart_count
    for jid, f in rec.replicas.items():
        if jid in seen:
            f.missing_listings = 0
        else:
            # gone only when two listings in a row agree: one odd answer must not cost a fleet
            f.missing_listings += 1
            if f.missing_listings >= 2:
                f.slurm_state = None
    listed = {j.job_id for j in jobs}
    rec.finished &= listed  # forget what squeue forgot
    rec.untagged &= listed
    for nonce, p in list(rec.placeholders.items()):
        if now > p.deadline:
            log.warning("submission %s of %s never appeared in squeue; will submit again", nonce, p.model)
            del rec.placeholders[nonce]


def lost_tag(rec: Reconciler, j: JobInfo) -> None:
    """A job this daemon submitted or adopted whose Comment no longer holds slurmfleet's tag (a site's job_submit
    plugin rewrites it, or ``scontrol update Comment=``): it is still ours (it was counted out of the listing, and
    replaced every two ticks, none ever cancelled).  Said once per job, in the log and the model's status: a daemon
    started again cannot tell such jobs from others' and would leave them running beside their replacements."""
    if j.job_id in rec.untagged:
        return
    rec.untagged.add(j.job_id)
    f = rec.replicas[j.job_id]
    why = (f"job {j.job_id}'s SLURM comment no longer holds slurmfleet's tag (it is now {j.comment[:80]!r}: a "
           "site's job_submit plugin or `scontrol update Comment=`): it is followed by its id, but a restarted "
           "daemon cannot adopt it; slurmfleet needs --comment")
    log.error("model %s: %s", f.model, why)
    rec.runtime(f.model).last_error = why


def ended_unwatched(rec: Reconciler, jobs: list[JobInfo], found: Discovered, now: float) -> None:
    """A new daemon's first listing: a job the previous daemon followed (``nodes.json``) that squeue now lists
    ended, or not at all, ended while no daemon watched it (the daemon was stopped, killed or restarting).  Each
    is said once, counted in ``slurmfleet_replica_restarts_total`` for SLURM's end state while squeue still
    lists it ("unknown" once it forgot the job) and named by its slot's replacement; one the previous daemon
    had cancelled (its ``.cancel`` mark) is no restart."""
    listed = {j.job_id: j for j in jobs}
    for m in rec.cfg.models:
        for jid, slot in sorted(followed_jobs(rec.nodes.loaded, m.name).items()):
            if jid in rec.replicas or jid in found.cancelled:
                continue
            j = listed.get(jid)
            state = j.state if j is not None else None
            reason = "unknown" if state is None else "time_limit" if found.warned(jid, j.restart_count) \
                else END_REASON.get(state, "failed")
            rec.metrics.restarts.labels(m.name, reason).inc()
            rec.runtime(m.name).vacated[slot] = (f"replaces job {jid}, {reason}, ended while no daemon watched", now)
            log.warning("job %s (%s slot %d) ended while no daemon watched it (%s): replacing it", jid, m.name,
                        slot, f"squeue: {state}" if state else "squeue no longer lists it")


def vanished(rec: Reconciler, f: ReplicaFacts, now: float) -> None:
    """A job of ours that left squeue between two looks with no end state seen (a short ``MinJobAge`` purges an
    ended job within seconds), not cancelled by the daemon nor drained: it ended for a reason not known.  One that
    never came up counts as a failure, as one seen FAILED would (its model backs off, its nodes are suspect): a
    model whose every job failed at its start was otherwise submitted again every other tick, for ever.  One that
    served is replaced at once (two odd listings of squeue look the same).  Kept in ``rec.vanished``: if the looks
    were wrong and it is back, its engine's record is still known."""
    rec.vanished[f.job_id] = now
    if f.drain_reason:   # (a handover's, a scale-down's: the daemon ended it)
        return
    rec.metrics.restarts.labels(f.model, "unknown").inc()
    rec.runtime(f.model).vacated[f.slot] = (f"replaces job {f.job_id}, gone from squeue with no end state seen", now)
    log.warning("job %s (%s slot %d) left squeue with no end state seen: replacing it", f.job_id, f.model, f.slot)
    if f.first_ready_time is None:
        rec._count_crash(f, now, "failed")
