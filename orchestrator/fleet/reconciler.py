"""The level-triggered control loop.  Each tick: ONE squeue for the whole fleet, one scan of the endpoint records,
all due probes at once, then per model a plan (``planner.plan_model``) executed idempotently.  Anything missed heals
on the next tick; a restarted daemon rebuilds everything from squeue and the records (re-adoption)."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable

from ..config import FleetConfig, ModelConfig
from ..contract import ModelRoutes
from ..statedir import StateDir
from .discovery import Discovery
from .probe import Prober, probe_all
from ..observability.metrics import Metrics
from .planner import Cancel, Drain, Submit, Undrain, View, handover_lead_s, plan_model, reload_changes
from .render import JobTag, Renderer
from .gauges import export_gauges
from .routes import model_routes
from .autoscale import Autoscaler, Capacity, capacity_of
from .replica import (STOPPING_SLURM, TERMINAL_SLURM, ModelRuntime, Placeholder, Policy, end_reason,
                      ReplicaFacts, State, derive_state, expand_hostlist, fatal_pending)
from .slurm import SlurmClient, SlurmError
from .submitting import Submitting
from .nodememory import NodeMemory, restore, snapshot
from .observe import ended_unwatched, observe, vanished

log = logging.getLogger(__name__)


CLOCK_STEP_S = 2.0   # the wall clock moved this much more than the monotonic one from one tick to the next: a step
VANISHED_KEEP_S = 600.0   # the record of a job that left squeue without an end is kept this long (an odd listing)
LOG_PRUNE_S = 3600.0   # how often old job logs are looked for (daemon.log_retention_s)


class Reconciler:
    def __init__(self, cfg: FleetConfig, slurm: SlurmClient, renderer: Renderer, discovery: Discovery,
                 prober: Prober, metrics: Metrics, *, clock: Callable[[], float] = time.time,
                 inflight: Callable[[str], int] = lambda _jid: 0,
                 on_update: Callable[[dict[str, ModelRoutes]], None] = lambda _r: None,
                 rng: random.Random | None = None, autoscaler: Autoscaler | None = None,
                 mono: Callable[[], float] = time.monotonic, submitting: Submitting | None = None,
                 nodes: NodeMemory | None = None):
        self.cfg = cfg
        self.mono = mono   # the autoscaler's clock: its windows and delays must not jump with the wall clock's steps
        self.slurm, self.renderer, self.discovery, self.prober, self.metrics = slurm, renderer, discovery, prober, metrics
        self.clock, self.inflight, self.on_update = clock, inflight, on_update
        self.rng = rng or random.Random()
        self.autoscaler = autoscaler or Autoscaler()
        self.observed = self._doubted = False   # squeue read once (adopted jobs known); a first listing not believed
        self.replicas: dict[str, ReplicaFacts] = {}
        self.models: dict[str, ModelRuntime] = {}
        self.placeholders = submitting if submitting is not None else Submitting()   # sbatch outcomes not known yet
        self.nodes = nodes or NodeMemory()   # bad nodes kept across a restart (restored at the first listing)
        self.finished: set[str] = set()
        self.vanished: dict[str, float] = {}   # job -> when it left squeue with no end state seen (not cancelled)
        self.removed: dict[str, ModelConfig] = {}   # models a reload removed, as they were (their drains go on)
        self.sbatch_stalled, self.planned_at = False, 0.0   # an sbatch of this tick had no answer; its plans' start
        self.untagged: set[str] = set()   # jobs of ours whose Comment lost the tag (said once: observe.lost_tag)
        self.ticks, self.last_tick_error, self.routed = 0, None, set()   # (routed: the last table's READY jobs)
        self._offset: float | None = None   # wall - monotonic at the last tick
        self.next_log_prune = 0.0   # (wall clock) old job logs are looked for once an hour

    # -- inputs from outside ------------------------------------------------------------------
    def runtime(self, name: str) -> ModelRuntime:
        return self.models.setdefault(name, ModelRuntime())

    def desired(self, m: ModelConfig) -> int:
        """The replica count to keep: ``slurmfleet scale``'s pin, else the autoscaler's target, else the file's."""
        if (pin := self.runtime(m.name).desired_override) is not None:
            return pin
        if m.autoscale is None:
            return m.replicas
        target = self.autoscaler.target(m.name)   # (within the bounds now: a reload's, before its next step)
        return m.autoscale.min_replicas if target is None else min(m.autoscale.max_replicas, max(
            m.autoscale.min_replicas, target))

    def capacity(self, m: ModelConfig, now: float) -> Capacity:
        """The model's replicas as the autoscaler counts them (see :func:`capacity_of`)."""
        return capacity_of(m, [(f, self.state_of(f, now)) for f in self.replicas.values() if f.model == m.name],
                           [(p.nonce, p.slot) for p in self.placeholders.values() if p.model == m.name], now,
                           self.cfg.gateway.workers)

    def apply_config(self, cfg: FleetConfig) -> list[str]:
        """Swap in a new config (already validated); the next tick applies the diff."""
        old = {m.name: m for m in self.cfg.models}
        changes = reload_changes(self.cfg.models, cfg.models)
        for m in cfg.models:
            prev = old.pop(m.name, None)
            rt = self.runtime(m.name)
            pinned = rt.desired_override is not None
            if pinned and prev is not None:   # (said: the reply and the log tell what a reload changes)
                changes.append(f"model {m.name}: `slurmfleet scale` pin ({rt.desired_override} replicas) dropped, "
                               f"back to {m.count_label}")
            rt.blocked, rt.desired_override = None, None  # the file is the truth again
            if (prev is None or prev.autoscale is None) != (m.autoscale is None) or (pinned and m.autoscale):
                # autoscaling on, or unpinned: it starts from the replicas that exist, not from its target before
                self.autoscaler.forget(m.name)
            if prev is None or prev.job_hash() != m.job_hash():   # (re-added too: its old crashes are history)
                rt.forget_failures()
        for name in old:
            self.autoscaler.forget(name)
        self.removed = {**{n: m for n, m in self.removed.items() if cfg.model(n) is None}, **old}
        self.cfg = cfg
        return changes

    def scale(self, model: str, n: int | None) -> None:
        """Pin the model at ``n`` replicas until the next reload (autoscaling paused); None: unpin (an
        autoscaled model's autoscaler starts again from the replicas that exist)."""
        if self.cfg.model(model) is None:
            raise KeyError(model)
        rt = self.runtime(model)
        was, rt.desired_override = rt.desired_override, n
        if n is None and was is not None:   # (unpinning one not pinned changes nothing: its autoscaler goes on)
            self.autoscaler.forget(model)

    async def request_drain(self, job_id: str, replace: bool = False) -> str | None:
        """An operator's drain, marked in the state dir first: a restarted daemon goes on with it.  With
        ``replace``, a READY replica serves until a successor is READY (a handover, as near its time limit);
        one that serves nothing yet is simply drained.  What it does ("replacing", "draining"), or None for no
        such replica."""
        if (f := self.replicas.get(job_id)) is None:
            return None
        replace = replace and f.drain_requested_at is None and self.state_of(f) == State.READY
        if replace:
            f.replace_requested = True
        elif f.drain_requested_at is None or f.drain_reason == "scale_down":   # (never called off, as a scale-down's;
            f.drain_requested_at, f.drain_reason = f.drain_requested_at or self.clock(), "operator"   # set before the mark)
        await self.discovery.mark_drain(job_id, replace)
        return "replacing" if replace else "draining"

    def state_of(self, f: ReplicaFacts, now: float | None = None) -> State:
        policy = Policy(m.probe.startup_timeout_s, m.probe.failure_threshold) if (m := self.cfg.model(f.model)) else Policy()
        return derive_state(f, self.clock() if now is None else now, policy)

    # -- the tick -------------------------------------------------------------------------------
    async def tick(self) -> None:
        t0 = time.monotonic()
        try:
            await self._tick()
        finally:
            self.ticks += 1
            self.metrics.tick_seconds.observe(time.monotonic() - t0)

    def _wall(self) -> float:
        """The wall clock; when it steps (NTP, a resumed VM) the daemon's own timestamps move along: its timers
        (probes, drains, back-off, exclusions, placeholders) keep their lengths, SLURM's times their clock."""
        now, offset = self.clock(), self._offset
        self._offset = now - self.mono()
        if offset is not None and abs(step := self._offset - offset) >= CLOCK_STEP_S:
            log.warning("the wall clock stepped by %+.1fs: the daemon's timers move with it", step)
            for x in (*self.replicas.values(), *self.models.values()):
                x.shift(step)
            self.placeholders.shift(step)
            self.vanished = {j: t + step for j, t in self.vanished.items()}
        return now

    async def _tick(self) -> None:
        try:
            jobs = await self.slurm.list_jobs()
        except SlurmError as exc:  # submit or cancel nothing on a view we cannot see; the next tick heals
            self.metrics.tick_errors.inc()
            self.last_tick_error = str(exc)
            log.warning("squeue failed (%s); probing the known replicas, changing no job this tick", exc)
            now = self._wall()
            await probe_all(self.replicas.values(), self.cfg, self.prober, self.metrics, now)  # (an engine that
            # dies while SLURM is down still leaves routing)
            self._publish(now)
            return
        self.last_tick_error = None
        now = self._wall()
        found = await self.discovery.scan()
        if not self.observed and found.endpoints and not self._doubted and not any(
                (t := JobTag.decode(j.comment)) is not None and t.owned_by(self.cfg.fleet, self.cfg.state_dir)
                for j in jobs):
            # a new daemon whose first squeue lists none of the jobs whose records say they run: one odd answer
            # must not resubmit the fleet and delete those records; a second listing decides
            self._doubted = True
            log.warning("squeue lists none of this fleet's jobs, yet %d endpoint records say they run: "
                        "waiting for the next listing", len(found.endpoints))
            return
        if not self.observed:   # (before adoption: an adopted pending job excludes what its model does)
            for m in self.cfg.models:
                restore(self.nodes.loaded, self.runtime(m.name), m, now)
        observe(self, jobs, now)
        alive = {j.job_id for j in jobs if j.state not in TERMINAL_SLURM}
        self.vanished = {jid: t for jid, t in self.vanished.items() if now - t < VANISHED_KEEP_S and jid not in alive}
        unlisted = [jid for jid in found.endpoints.keys() | found.requested | found.replace | found.cancelled
                    if jid not in self.replicas and jid not in alive and jid not in self.vanished]
        if not self.observed:   # a new daemon's first listing without them keeps their records as a running
            self.vanished.update(dict.fromkeys(unlisted, now))   # daemon does (a job writes its record once)
            ended_unwatched(self, jobs, found, now)
        await self.discovery.remove(unlisted if self.observed else [])
        if self.observed and self.cfg.daemon.log_retention_s and now >= self.next_log_prune:
            self.next_log_prune = now + LOG_PRUNE_S
            self.discovery.prune_logs(frozenset({j.job_id for j in jobs} | self.replicas.keys()),
                                      self.cfg.daemon.log_retention_s, now)
        self.observed = True
        for f in self.replicas.values():
            # sticky until a requeue (a scan may miss the mark); only a running job's (a requeued one's is stale)
            f.time_limit_warned |= f.slurm_state == "RUNNING" and found.warned(f.job_id, f.restart_count)
            ep = found.endpoints.get(f.job_id)
            if ep is None and f.endpoint is not None and f.slurm_state == "RUNNING" and not f.time_limit_warned:
                ep = f.endpoint   # a scan that missed the record (a shared FS's blip): the probes judge the engine
                # (a job warned of its limit removes its record as it stops its engines: it is stopping)
            valid = (ep is not None and f.slurm_state == "RUNNING" and ep.restart_count == f.restart_count
                     and ep.node == next(iter(expand_hostlist(f.nodelist)), None))  # written on the job's head
            if (ep if valid else None) != f.endpoint:
                f.endpoint = ep if valid else None
                f.consecutive_failures, f.last_probe_time = 0, None
                if valid:  # a new engine must prove itself; a job that ended keeps its history for _count_crash
                    f.first_ready_time = None
            if f.job_id in found.requested and f.drain_reason in ("", "scale_down"):   # an operator's (a restart)
                f.drain_requested_at, f.drain_reason = f.drain_requested_at or now, "operator"
            f.replace_requested |= f.job_id in found.replace
            if f.job_id in found.cancelled and f.cancel_requested_at is None and f.adopted_at == now and (
                    f.slurm_state == "RUNNING" or f.slurm_state in STOPPING_SLURM):   # cancelled by a daemon before
                f.cancel_requested_at = now   # a restart (adopted this tick): stopping, not routed to, no crash
        await probe_all(self.replicas.values(), self.cfg, self.prober, self.metrics, now)
        self.sbatch_stalled, self.planned_at = False, self.mono()
        try:
            await self._settle_ended(now)
            for name in [m.name for m in self.cfg.models]:
                m = self.cfg.model(name)   # (as it is now: a reload may land while an sbatch of this tick waits)
                if m is not None:
                    await self._guarded(name, self._reconcile_model(m, now))
            for name in {f.model for f in self.replicas.values()} - {m.name for m in self.cfg.models}:
                await self._guarded(name, self._execute(plan_model(name, 0, "<removed>", self._views(name, now),
                                                                   handover_lead_s=0), None, now))
        finally:   # one model's unforeseen error stops neither the others nor routing and drains
            self._publish(now)  # draining replicas leave routing before any of them is cancelled
            await self._finish_drains(now)
            self.nodes.save(snapshot(self.models, self.cfg.models, now, self.replicas,   # (in the background)
                                     self.autoscaler.quiet(now, self.mono())))

    async def _guarded(self, model: str, work) -> None:
        try:
            await work
        except Exception as exc:  # noqa: BLE001 - (a template, a fork failing): the next tick tries again
            self.runtime(model).last_error = f"{type(exc).__name__}: {exc}"
            log.exception("model %s: its reconcile failed; the other models go on", model)

    async def _settle_ended(self, now: float) -> None:
        ended = []
        for jid, f in list(self.replicas.items()):
            state = self.state_of(f, now)
            if state == State.FAILED:
                reason = end_reason(f)
                if not (reason == "time_limit" and f.drain_reason == "time_limit"):   # (its handover counted it:
                    self.metrics.restarts.labels(f.model, reason).inc()              # its successor holds the slot)
                    self.runtime(f.model).vacated[f.slot] = (f"replaces job {jid}, {reason}", now)
                log.warning("job %s (%s slot %d) ended %s: replacing it", jid, f.model, f.slot, f.slurm_state)
                if reason in ("failed", "node_lost"):
                    self._count_crash(f, now, reason)
            if state in (State.FAILED, State.GONE):
                del self.replicas[jid]
                if f.slurm_state is not None:
                    self.finished.add(jid)
                elif f.cancel_requested_at is None:   # two listings without it: if they were wrong and it is back,
                    vanished(self, f, now)            # its engine's record must still be there (it is written once)
                    continue
                ended.append(jid)
        await self.discovery.remove(ended)

    def _count_crash(self, f: ReplicaFacts, now: float, reason: str) -> None:
        if (m := self.cfg.model(f.model)) is not None:
            self.runtime(f.model).count_crash(f, now, reason, m.backoff, self.rng,   # (a path: no I/O in the tick)
                                              StateDir(self.cfg.state_dir).log_pattern(f.model).replace("%j", f.job_id))

    def _views(self, name: str, now: float) -> list[View]:
        views = [View(f.job_id, f.slot, self.state_of(f, now), f.config_hash, f.time_left_s(now), f.time_limit_warned,
                      f.replace_requested, False, self.inflight(f.job_id), f.drain_reason, f.consecutive_failures > 0,
                      f.adopted_at is not None and f.first_ready_time is None)
                 for f in self.replicas.values() if f.model == name]
        return views + [View(f"pending-{p.nonce}", p.slot, State.QUEUED, p.config_hash, placeholder=True)
                        for p in self.placeholders.values() if p.model == name]

    async def _reconcile_model(self, m: ModelConfig, now: float) -> None:
        rt = self.runtime(m.name)
        for f in [f for f in self.replicas.values() if f.model == m.name]:
            if self.state_of(f, now) == State.QUEUED and fatal_pending(f.reason):
                if not f.restart_count:   # (requeued after it ran as configured: the cluster's doing, only replaced)
                    rt.blocked = f"job {f.job_id} cannot start: SLURM says {f.reason} (fix the config, then reload)"
                log.error("model %s: %s", m.name, rt.blocked or f"requeued job {f.job_id} cannot start again: SLURM "
                          f"says {f.reason}; replacing it")
                await self._cancel(f, "blocked", now)
        todo = rt.expire_exclusions(now, mine := [f for f in self.replicas.values() if f.model == m.name])
        todo += [f for f in mine if f.job_id in rt.unexclude and f.slurm_state == "PENDING" and f not in todo]
        rt.unexclude = set()
        for f in todo:
            try:   # a job submitted while a node was excluded: it waits no more for the others (again next tick)
                await self.slurm.set_excluded(f.job_id, f.excluded)
            except SlurmError as exc:
                rt.unexclude.add(f.job_id)
                log.warning("job %s: its excluded nodes could not be updated (%s)", f.job_id, exc)
        if rt.crashes and (self._ready_for(m.name, now, rt.crashed_at) or -1.0) >= m.backoff.early_failure_s:
            rt.crashes, rt.last_error = 0, None   # (none READY since the crash: no reset, early_failure_s 0 too)
        # a job ending on its own (COMPLETING, not by us) is awaited: only its end says if it crashed (bounded)
        ending = any(f.model == m.name and f.slurm_state in STOPPING_SLURM and f.cancel_requested_at is None
                     and not f.requeued and now - (f.end_time or now) < self.cfg.daemon.rescancel_after_s
                     for f in self.replicas.values())
        may = 0 if rt.blocked or now < rt.backoff_until or ending else (1 if rt.crashes else None)
        self.metrics.set_backoff(m.name, rt.backoff_cause, max(0.0, rt.backoff_until - now))
        self.metrics.blocked.labels(m.name).set(1 if rt.blocked else 0)
        if m.autoscale is not None and self.autoscaler.target(m.name) is None:
            cap = self.capacity(m, now)
            self.autoscaler.adopt(m.name, max(cap.slots, cap.active), m.autoscale, self.mono())
        actions = plan_model(m.name, self.desired(m), m.job_hash(), self._views(m.name, now),
                             handover_lead_s=handover_lead_s(m), max_surge=m.max_surge, max_submits=may)
        await self._execute(actions, m, now)

    def _ready_for(self, name: str, now: float, since: float) -> float | None:
        """How long a replica READY after ``since`` (the last crash) has served, None if none (not one all along)."""
        ages = [now - f.first_ready_time for f in self.replicas.values()
                if f.model == name and f.first_ready_time is not None and f.first_ready_time >= since]
        return max(ages, default=None)

    async def _execute(self, actions, m: ModelConfig | None, now: float) -> None:
        if any(isinstance(a, Cancel) and a.job_id in self.routed for a in actions):
            self._publish(now)   # (READY a moment ago, now held or suspended by SLURM: out of routing first)
        for a in actions:
            f = None if isinstance(a, Submit) else self.replicas.get(a.job_id)
            if isinstance(a, Submit) and m is not None:
                # (a rejection this tick, or a crash its cancels counted, backs off the rest of its sbatches; an sbatch
                # without an answer, or the tick's sbatches over two ticks' time, those of every model: the next tick's)
                if self.runtime(m.name).may_submit(now, a.slot, a.urgent) and not self.sbatch_stalled and \
                        self.mono() - self.planned_at < 2 * self.cfg.daemon.tick_interval_s:   # (its probes wait)
                    await self._submit(m, a.slot, a.reason, now)
            elif isinstance(a, Drain) and f and f.drain_requested_at is None:
                log.info("draining job %s (%s slot %d): %s", f.job_id, f.model, f.slot, a.reason)
                f.drain_requested_at, f.drain_reason = now, a.reason
                if a.reason in ("time_limit", "config_change") and a.replaced:   # (not a scale-down beside it)
                    self.metrics.restarts.labels(f.model, a.reason).inc()
            elif isinstance(a, Undrain) and f and f.drain_reason == "scale_down" and f.cancel_requested_at is None:
                log.info("job %s (%s slot %d) serves again: its scale-down is called off", f.job_id, f.model, f.slot)
                f.drain_requested_at, f.drain_reason = None, ""
            elif isinstance(a, Cancel) and f:
                # counted once, when its scancel went through (a failed one is tried again next tick)
                if await self._cancel(f, a.reason, now) and a.reason in ("unhealthy", "config_change"):
                    self.metrics.restarts.labels(f.model, a.reason).inc()
                    if a.reason == "unhealthy" and f.slurm_state not in ("SUSPENDED", "STOPPED"):   # (suspended by
                        self._count_crash(f, now, "failed" if f.first_ready_time is None else "unhealthy")   # SLURM)

    async def _submit(self, m: ModelConfig, slot: int, reason: str, now: float) -> None:
        rt = self.runtime(m.name)
        nonce = uuid.uuid4().hex[:12]
        script = self.renderer.render(self.cfg, m, slot, nonce, tuple(sorted(rt.excluded)))
        # recorded (durably) before sbatch runs: a job it makes is adopted by its nonce, after a restart too
        async with self.placeholders.watch(Placeholder(m.name, slot, m.job_hash(), nonce,
                                                       now + self.cfg.daemon.submit_confirm_s)) as watch:
            try:
                job_id = await self.slurm.submit(script)
            except SlurmError as exc:
                if outcome := rt.sbatch_failed(m, exc, now, stale=self.cfg.model(m.name) != m):
                    self.metrics.submissions.labels(m.name, outcome).inc()
                watch.keep = outcome == "error" and exc.started   # (one that never ran made no job)
                self.sbatch_stalled |= outcome == "error"
                if watch.keep:   # (watched from its answer: an sbatch may take as long as the watch)
                    self.placeholders[nonce] = dataclasses.replace(
                        self.placeholders[nonce], deadline=self.clock() + self.cfg.daemon.submit_confirm_s)
                    await self.placeholders.synced()
                    log.warning("model %s: transient sbatch failure (%s); the job may exist: watching for nonce %s",
                                m.name, exc, nonce)
                return
        rt.submitted += 1
        if (rt.last_error or "").startswith("sbatch failed"):   # (an sbatch went through: that error is over)
            rt.last_error = None
        self.metrics.submissions.labels(m.name, "ok").inc()
        if (was := rt.vacated.pop(slot, None)) and reason == "scale_up" and now - was[1] < 600 + m.backoff.max_s:
            reason = was[0]   # (a slot left empty since: a new one; a crash loop's replacement waits up to max_s)
        log.info("submitted job %s for %s slot %d (%s)", job_id, m.name, slot, reason)
        self.replicas[job_id] = ReplicaFacts(job_id, m.name, slot, m.job_hash(), submit_time=now,
                                             excluded=tuple(sorted(rt.excluded)), engine_hash=m.engine_hash())

    async def _cancel(self, f: ReplicaFacts, reason: str, now: float) -> bool:
        # running on several nodes (the job's own, whatever the config says now): a TERM to its batch shell first
        soft = len(expand_hostlist(f.nodelist)) > 1 and f.cancel_requested_at is None and f.slurm_state == "RUNNING"
        if f.cancel_requested_at is None and f.slurm_state == "RUNNING":   # it stops for a grace: a restarted
            # daemon must know it is ours to end (marked first: one killed just after the scancel adopted it as a
            # replica, routed to it while it stopped and counted its end a crash; a mark whose scancel never
            # came makes the next daemon send it once rescancel_after_s has passed)
            await self.discovery.mark_cancel(f.job_id)
        try:
            await self.slurm.cancel(f.job_id, "TERM" if soft else None)   # (a signal to a PENDING job is refused)
        except SlurmError as exc:
            log.warning("scancel %s failed (%s); will retry", f.job_id, exc)
            return False
        log.info("cancelled job %s (%s slot %d): %s", f.job_id, f.model, f.slot, reason)
        f.cancel_requested_at = now
        return True

    async def _finish_drains(self, now: float) -> None:
        for f in list(self.replicas.values()):
            if f.cancel_requested_at is not None:
                if f.slurm_state == "RUNNING" and now - f.cancel_requested_at > self.cfg.daemon.rescancel_after_s:
                    await self._cancel(f, "still running after scancel", now)
                continue
            if f.drain_requested_at is None:
                continue
            m = self.cfg.model(f.model) or self.removed.get(f.model)   # (a removed model's drains: its own timeout)
            timeout = m.drain.timeout_s if m else 30.0
            busy = self.inflight(f.job_id)
            if busy == 0 or now - f.drain_requested_at >= timeout or f.slurm_state != "RUNNING":
                await self._cancel(f, f"drained ({busy} requests still in flight)" if busy else "drained", now)

    def _publish(self, now: float) -> None:
        """The fleet's gauges, then the routing table's models (READY replicas, what a model without one waits for)."""
        states: dict[str, list[tuple[ReplicaFacts, State]]] = {m.name: [] for m in self.cfg.models}
        for f in self.replicas.values():
            states.setdefault(f.model, []).append((f, self.state_of(f, now)))
        export_gauges(self.metrics, self.cfg.models, states, self.desired, now)
        routes = {m.name: model_routes(m, states[m.name], self.runtime(m.name), self.desired(m), now)
                  for m in self.cfg.models}
        self.routed = {r.job_id for mr in routes.values() for r in mr.replicas}
        self.on_update(routes)

