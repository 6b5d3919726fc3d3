"""The gateway's live view of each model's READY replicas.

Holds per-replica in-flight counts, passive failure tracking with growing
ejection, per-model admission (a cap per replica and a bounded wait queue),
and the engine load scraped from each replica.  The reconciler pushes a new
set of READY backends with :meth:`Pools.update`; draining replicas vanish from
routing at once while their in-flight count stays visible for the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable

from . import balancer
from ..config import ModelConfig
from ..fleet.reconciler import Backend


@dataclasses.dataclass
class Slot:
    """A routable replica and what the gateway knows about it."""

    backend: Backend
    inflight: int = 0
    failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    waiting: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    head_tail: bytes = b""  # the proxy's cached "Host: ...\r\nAuthorization: ...\r\n\r\n" for this backend


class NoReplica(Exception):
    """No replica became available within the queue timeout."""


class QueueFull(Exception):
    """The model's wait queue is full."""


class ModelPool:
    def __init__(self, model: ModelConfig, max_queue: int, rng: random.Random, clock: Callable[[], float]):
        self.model = model
        self.slots: dict[str, Slot] = {}
        self._changed = asyncio.Event()
        self.waiters = 0
        self.max_queue = max_queue
        self.rng, self.clock = rng, clock
        self.rr = 0

    def routable(self, exclude: set[str]) -> list[Slot]:
        """Replicas that may take a request now: not excluded, not ejected (unless too many are: then panic
        mode uses them all), under the in-flight cap.  One pass; this runs for every request."""
        now = self.clock()
        cap = self.model.max_inflight_per_replica
        healthy: list[Slot] = []
        alive: list[Slot] = []
        for s in self.slots.values():
            if exclude and s.backend.job_id in exclude:
                continue
            alive.append(s)
            if s.ejected_until <= now:
                healthy.append(s)
        pool = healthy if len(healthy) * 2 >= len(alive) else alive
        return [s for s in pool if s.inflight < cap]

    def choose(self, slots: list[Slot], body: dict, headers) -> Slot:
        cands = [balancer.Candidate(s.backend.job_id, s.inflight, s.waiting, s.kv_usage) for s in slots]
        policy = self.model.routing
        if policy == "round_robin":
            self.rr += 1
            pick = balancer.round_robin(cands, self.rr)
        elif policy == "prefix_affinity":
            pick = balancer.prefix_affinity(cands, balancer.affinity_key(body, headers))
        elif policy == "load_aware":
            pick = balancer.load_aware(cands, self.rng)
        else:
            pick = balancer.least_outstanding(cands, self.rng)
        return self.slots[pick.key]

    def try_acquire(self, body: dict, headers, exclude: set[str]) -> Slot | None:
        """A replica with room now, or None."""
        slots = self.routable(exclude)
        if not slots:
            return None
        slot = slots[0] if len(slots) == 1 else self.choose(slots, body, headers)
        slot.inflight += 1
        return slot

    async def acquire(self, body: dict, headers, exclude: set[str], timeout_s: float,
                      on_wait: Callable[[int], None] = lambda _n: None) -> Slot:
        """Wait up to ``timeout_s`` in the bounded queue for a replica with room; for when
        :meth:`try_acquire` found none (the proxy tries that first, without a coroutine)."""
        if self.waiters >= self.max_queue:
            raise QueueFull()
        deadline = time.monotonic() + timeout_s
        self.waiters += 1
        on_wait(self.waiters)
        try:
            while True:
                changed = self._changed
                slot = self.try_acquire(body, headers, exclude)
                if slot is not None:
                    return slot
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReplica()
                try:
                    await asyncio.wait_for(changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass  # re-check: ejections expire with time
        finally:
            self.waiters -= 1
            on_wait(self.waiters)

    def notify(self) -> None:
        """Wake every waiter to look again (a replica appeared or one has room)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class Pools:
    """All models' pools plus in-flight counts by job id (read by the drain logic)."""

    def __init__(self, models: list[ModelConfig], max_queue: int, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rng = rng or random.Random()
        self.clock = clock
        self.max_queue = max_queue
        self.pools: dict[str, ModelPool] = {}
        self.names: dict[str, str] = {}
        self.inflight_by_job: dict[str, int] = {}
        self.external_inflight: Callable[[str], int] | None = None
        self.set_models(models)

    def set_models(self, models: list[ModelConfig]) -> None:
        keep = {}
        for m in models:
            pool = self.pools.get(m.name) or ModelPool(m, self.max_queue, self.rng, self.clock)
            pool.model = m
            keep[m.name] = pool
        self.pools = keep
        self.names = {alias: m.name for m in models for alias in m.served_names}

    def resolve(self, name: str) -> ModelPool | None:
        model = self.names.get(name)
        return self.pools.get(model) if model else None

    def update(self, ready: dict[str, list[Backend]]) -> None:
        """Replace each model's routable set (called by the reconciler every tick)."""
        for name, pool in self.pools.items():
            backends = {b.job_id: b for b in ready.get(name, [])}
            for jid in list(pool.slots):
                if jid not in backends:
                    del pool.slots[jid]
            for jid, b in backends.items():
                if jid in pool.slots:
                    if pool.slots[jid].backend != b:
                        pool.slots[jid].backend, pool.slots[jid].head_tail = b, b""
                else:
                    pool.slots[jid] = Slot(b, inflight=self.inflight_by_job.get(jid, 0))
            if pool.slots and pool.waiters:
                pool.notify()

    def inflight(self, job_id: str) -> int:
        """Requests on this job in this process plus, with gateway workers, in theirs."""
        n = self.inflight_by_job.get(job_id, 0)
        return n + self.external_inflight(job_id) if self.external_inflight else n

    def started(self, slot: Slot) -> None:
        jid = slot.backend.job_id
        self.inflight_by_job[jid] = self.inflight_by_job.get(jid, 0) + 1

    def finished(self, pool: ModelPool, slot: Slot, ok: bool | None) -> bool:
        """Release a request; ``ok`` None means 'no verdict'.  Returns True if the replica was ejected."""
        jid = slot.backend.job_id
        slot.inflight = max(0, slot.inflight - 1)
        n = self.inflight_by_job.get(jid, 1) - 1
        if n <= 0:
            self.inflight_by_job.pop(jid, None)
        else:
            self.inflight_by_job[jid] = n
        ejected = False
        if ok is True:
            slot.failures = 0
            slot.ejections = 0 if slot.ejected_until < self.clock() - 60 else slot.ejections
        elif ok is False:
            slot.failures += 1
            if slot.failures >= 3 and slot.ejected_until <= self.clock():
                now = self.clock()
                ejected_now = sum(1 for s in pool.slots.values() if s.ejected_until > now)
                if (ejected_now + 1) * 2 <= len(pool.slots):  # never eject more than half
                    slot.ejections += 1
                    slot.ejected_until = now + min(60.0, 2.0 * 2 ** (slot.ejections - 1))
                    slot.failures = 0
                    ejected = True
        if pool.waiters:
            pool.notify()
        return ejected
