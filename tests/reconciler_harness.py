"""The reconciler on a fake clock, for tests: SLURM, the endpoint records and the probes are fakes the test
drives; nothing sleeps."""

from __future__ import annotations

import random

import yaml

from fakes import FakeSlurm
from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.discovery import Discovered
from orchestrator.fleet.probe import ProbeResult
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.render import Renderer
from orchestrator.fleet.replica import Endpoint, expand_hostlist
from orchestrator.observability.metrics import Metrics

T0 = 1_700_000_000.0


def fleet_cfg(daemon: dict | None = None, cluster: dict | None = None, **model):
    m = {"name": "m", "engine": "simulator", "replicas": 1, "container": {"enabled": False},
         "probe": {"interval_s": 1}, **model}
    doc = {"fleet": "f", "state_dir": "/nonexistent/sf", "daemon": daemon or {}, "cluster": cluster or {}, "models": [m]}
    return load_config_text(yaml.safe_dump(doc), "f.yaml", {})


class Harness:
    """A real Reconciler on a fake clock; this object is also its discovery (every RUNNING job has
    published its record) and its prober (a job answers ``warmup_s`` after it started, unless ``down``)."""

    def __init__(self, daemon: dict | None = None, submitting=None, node_memory=None, **model):
        self.now = T0
        self.slurm = FakeSlurm("f", clock=lambda: self.now)
        self.warmup_s = 0.0
        self.down: set[str] = set()
        self.unpublished: set[str] = set()   # RUNNING jobs whose endpoint record is gone (their engine stopped)
        self.draining: set[str] = set()      # jobs that got SLURM's USR1 time-limit warning
        self.requested: set[str] = set()     # jobs an operator drained (their marks in the state dir)
        self.replace: set[str] = set()       # ... asked to have replaced (drain --replace)
        self.cancelled: set[str] = set()     # jobs the daemon cancelled while they ran (their marks)
        self.busy: dict[str, int] = {}       # requests in flight per job
        self.updates: list[set[str]] = []    # the READY job ids of model m, per on_update
        self.cfg = fleet_cfg(daemon, **model)
        self.restart(submitting, node_memory)
        self.slurm.on_cancel = self.not_routed

    def restart(self, submitting=None, nodes=None) -> None:
        """A new daemon's reconciler (nothing of the last one's memory) on the same SLURM, clock and records."""
        self.updates = []
        self.rec = Reconciler(self.cfg, self.slurm, Renderer(), self, self, Metrics(),
                              clock=lambda: self.now, inflight=lambda jid: self.busy.get(jid, 0),
                              on_update=self.on_update, rng=random.Random(0), mono=lambda: self.now,
                              submitting=submitting, nodes=nodes)

    def not_routed(self, job_id: str) -> None:
        """Every scancel in these tests comes after the gateway was told to stop routing to the job."""
        assert job_id not in self.ready(), f"scancel {job_id} while the gateway still routes to it"

    def on_update(self, ready) -> None:
        routes = ready.get("m", ())  # a list of replicas, or a routes object holding them (.replicas)
        self.updates.append({r.job_id for r in getattr(routes, "replicas", routes)})

    async def scan(self) -> Discovered:
        eps = {jid: Endpoint(jid, "10.0.0.1", 8000, "s", j.restart_count, j.start_time or 0.0,
                             expand_hostlist(j.nodelist)[0])
               for jid, j in self.slurm.jobs.items() if j.state == "RUNNING" and jid not in self.unpublished}
        return Discovered(eps, frozenset(self.draining), frozenset(self.requested), frozenset(self.replace),
                          frozenset(self.cancelled))

    async def remove(self, job_ids) -> None:
        self.requested -= set(job_ids)
        self.replace -= set(job_ids)
        self.cancelled -= set(job_ids)

    async def mark_cancel(self, job_id: str) -> None:
        self.cancelled.add(job_id)

    async def mark_drain(self, job_id: str, replace: bool = False) -> None:
        (self.replace if replace else self.requested).add(job_id)

    def prune_logs(self, live, keep_s: float, now: float) -> None:
        pass

    async def probe(self, ep, served_name, timeout_s, deep=False, deep_timeout_s=10.0) -> ProbeResult:
        started = self.slurm.jobs[ep.job_id].start_time
        ok = served_name == "m" and ep.job_id not in self.down and (   # (no warm-up: a wall clock stepped back
            self.warmup_s <= 0 or self.now - started >= self.warmup_s)   # an hour does not fail an engine)
        return ProbeResult(ok, None if ok else "connection refused")

    async def tick(self, n: int = 1, advance_s: float = 0.0) -> None:
        for _ in range(n):
            self.now += advance_s
            await self.rec.tick()

    async def run_until(self, pred, step: float, limit: float = 1000.0) -> float:
        """Tick every ``step`` seconds until ``pred()``; the time that took."""
        start = self.now
        while not pred():
            assert self.now - start < limit, "condition never held"
            await self.tick(advance_s=step)
        return self.now - start

    @property
    def sbatches(self) -> int:
        return len(self.slurm.scripts)

    def ready(self) -> set[str]:
        return self.updates[-1] if self.updates else set()

    def newest(self) -> str:
        return max(self.slurm.jobs, key=int)
