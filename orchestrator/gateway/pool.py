"""The gateway's live view of each model's READY replicas, and the lease a request holds on one.

:meth:`Pools.apply` takes each new :class:`~orchestrator.contract.RoutingTable`.  A request takes a :class:`Lease` on
a replica (:meth:`ModelPool.try_acquire`, or :meth:`ModelPool.acquire` to wait in the model's bounded queue), sets
its outcome and releases it: that one release updates the one in-flight count per replica (a :class:`Slot`),
passive failure tracking and ejection.  A replica that leaves the table stops getting requests at once; its slot
lives on while requests are still in flight on it, so drains see them.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..config import GatewayConfig, ModelConfig
from ..contract import EMPTY_TABLE, QueueState, Replica, RoutingTable
from ..modelgateway import limits
from ..reqstats import RequestStats
from .balancer import POLICIES
from .genconfig import generation_limits
from .admission import AdmissionQueue, Waiter
from .kvqueue import LOOK, KvQueue
from .retry import revive

if TYPE_CHECKING:
    from .kvroute import KvRouting


class Slot:
    """A replica and what this gateway process knows about it."""

    __slots__ = ("replica", "job_id", "model", "label", "load", "inflight", "failures", "ejections",
                 "ejected_until", "routed", "unrouted_at", "head_tail", "prefill_pending")

    def __init__(self, replica: Replica):
        self.inflight = self.failures = self.ejections = 0
        self.prefill_pending = 0   # kv_aware: predicted uncached prompt tokens of its requests before their first byte
        self.ejected_until = 0.0
        self.routed = False   # in its model's routing set now
        self.unrouted_at = 0.0  # time.monotonic() when it left it (its generations move after a grace time)
        self.set_replica(replica)

    def set_replica(self, replica: Replica) -> None:
        self.replica, self.job_id, self.model = replica, replica.job_id, replica.model
        self.label = str(replica.slot)
        self.load = replica.load
        self.head_tail = b""  # cached by tail(): "Host: ...\r\nAuthorization: ...\r\n\r\n" for this replica

    def tail(self) -> bytes:
        """The end of every request head to this replica: its Host line, its secret, the blank line."""
        if not self.head_tail:
            ep = self.replica.endpoint
            host = f"[{ep.host}]" if ":" in ep.host else ep.host
            self.head_tail = f"Host: {host}:{ep.port}\r\nAuthorization: Bearer {ep.secret}\r\n\r\n".encode()
        return self.head_tail


class Lease:
    """One request's hold on one replica: ``ok`` is the outcome (True served, False failed, None no
    verdict); :meth:`release` gives the replica back exactly once."""

    __slots__ = ("slot", "pool", "ok", "prefill", "held")

    def __init__(self, slot: Slot, pool: "ModelPool", prefill: int = 0):   # (held: got after a cold start's hold)
        self.slot, self.pool, self.ok, self.prefill, self.held = slot, pool, None, prefill, False
        slot.inflight += 1
        if prefill:
            slot.prefill_pending += prefill

    def first_byte(self) -> None:
        """The replica answered: this request's prefill is done (kv_aware counts the prefill still ahead)."""
        if self.prefill:
            self.slot.prefill_pending -= self.prefill
            self.prefill = 0

    def release(self) -> bool:
        """Returns True when this outcome got the replica ejected."""
        pool = self.pool
        if pool is None:
            return False
        self.pool = None
        if self.prefill:
            self.first_byte()
        slot, ok = self.slot, self.ok
        slot.inflight -= 1
        ejected = False
        if ok is True:
            if slot.failures:
                slot.failures = 0
            if slot.ejections and slot.ejected_until < pool.owner.clock() - pool.owner.cfg.eject_max_s:
                slot.ejections = 0
        elif ok is False:
            ejected = pool.failed(slot)
        if not slot.routed and slot.inflight == 0:
            pool.owner.forget(slot)
        if pool.waiting_since:
            pool.notify()
        return ejected


class NoReplica(Exception):
    """No replica became available within the wait (``waited_s``; ``held``: a cold start's hold, longer), or
    the model is blocked (``args[0]``)."""

    def __init__(self, why: str = "", waited_s: float = 0.0, held: bool = False):
        super().__init__(*((why,) if why else ()))
        self.waited_s, self.held = waited_s, held


class QueueFull(Exception):
    """The model's wait queue is full."""


class ModelPool:
    def __init__(self, model: ModelConfig, owner: "Pools"):
        self.model = model
        self.owner = owner
        self.policy = owner.make_policy(model)
        self.slots: dict[str, Slot] = {}
        self.desired = 0
        self.waiting_on = ""   # from the routing table: why no replica is READY
        self.waiting_from = 0.0   # ... and since when (epoch s; 0: no such moment)
        self.blocked = ""      # from the routing table: the model cannot get a replica as configured
        self._gen = 0   # notify() counts the queue's and the replicas' changes (kv_aware's election reads it)
        self.waiting_since: list[float] = []   # monotonic start of each queued request
        self.hold_reported = -math.inf         # when a request held for a cold start last told the fleet
        self.queue = AdmissionQueue()
        self.kvq = self._kv_queue(model)
        self.gen_limits = generation_limits(model)   # (a continued generation's length: .resume)
        self.limits = limits(owner.cfg, model.gateway)   # its timeouts and queue: its own, else the gateway's
        self._elected: tuple[int, float, Waiter | None] = (-1, 0.0, None)

    def waited_on(self) -> str:
        """The end of a cold start's 503: what the fleet waits for, and for how long now ("." when it did not say)."""
        if not self.waiting_on:
            return "."
        age = f" for {max(0.0, time.time() - self.waiting_from):.0f}s" if self.waiting_from else ""
        return f"; {self.waiting_on}{age}."

    def _kv_queue(self, model: ModelConfig) -> KvQueue | None:
        kv = self.owner.kv
        return KvQueue(kv, model.name) if model.routing == "kv_aware" and kv is not None else None

    def set_model(self, model: ModelConfig) -> None:
        if model.routing != self.model.routing:
            self.policy = self.owner.make_policy(model)
            self.kvq = self._kv_queue(model)
        self.model = model
        self.gen_limits, self.limits = generation_limits(model), limits(self.owner.cfg, model.gateway)

    def candidates(self, exclude: set[str]) -> tuple[list[Slot], list[Slot]]:
        """(replicas that may take requests, those of them under the in-flight cap now): not excluded, not
        ejected (unless too many are: then panic mode uses them all).  One pass; this runs for every request."""
        now = self.owner.clock()
        cap = self.model.max_inflight_per_replica
        healthy: list[Slot] = []
        alive: list[Slot] = []
        for s in self.slots.values():
            if exclude and s.job_id in exclude:
                continue
            alive.append(s)
            if s.ejected_until <= now:
                healthy.append(s)
        pool = healthy if len(healthy) * 2 >= len(alive) else alive
        return pool, [s for s in pool if s.inflight < cap]

    def routable(self, exclude: set[str]) -> list[Slot]:
        """Replicas that may take a request now (:meth:`candidates` under the cap)."""
        return self.candidates(exclude)[1]

    def try_acquire(self, body: dict, headers: Mapping[str, str], exclude: set[str], hold: bool = True) -> Lease | None:
        """A lease on a replica with room now, or None.  kv_aware (``hold``): None too while the replica that
        caches the prompt has no room and the others would prefill it again (:mod:`.kvqueue`)."""
        cands, slots = self.candidates(exclude)
        if not slots:
            return None
        policy = self.policy
        if not policy.sees_every_request:
            return Lease(slots[0] if len(slots) == 1 else policy.choose(slots, body, headers), self)
        if hold and self.kvq is not None and len(slots) < len(cands) and self.kvq.holds(body, cands, slots):
            return None
        slot = policy.choose(slots, body, headers)
        return Lease(slot, self, policy.charge())

    def _elect(self) -> Waiter | None:
        """kv_aware: the waiter that takes the next replica with room, once per queue change (and 50 ms)."""
        now = time.monotonic()
        gen, at, w = self._elected
        if gen == self._gen and now - at < 0.05:
            return w
        w = self.kvq.elect(self.queue.first(LOOK), self.candidates, now)
        self._elected = (self._gen, now, w)
        return w

    def hold_s(self, held: bool | None = None) -> float:
        """How long a request may wait, from its arrival, by the current config (a reload applies to those
        waiting): the queue timeout, or for one ``held`` (it met the model with no READY replica; None: if it
        has none now) an autoscaled model's cold-start hold."""
        auto = self.model.autoscale
        held = not self.slots if held is None else held
        return auto.cold_start_hold_s if held and auto is not None else self.limits.queue_timeout_s

    async def acquire(self, body: dict, headers: Mapping[str, str], exclude: set[str], timeout_s: float | None,
                      rank: int = 0, key: str = "", since: float | None = None, dead: dict[str, float] | None = None
                      ) -> Lease:
        """Wait up to ``timeout_s`` in the bounded queue for a replica with room; for when
        :meth:`try_acquire` found none or others wait already.  The queue serves by
        :class:`AdmissionQueue`'s order (priority class ``rank``, then round-robin over keys).
        ``timeout_s`` None: :meth:`hold_s`, read anew as it waits (a reload applies); the cold-start hold once
        the model had no READY replica meanwhile (a request waiting behind a full replica that dies is held).
        ``since``, ``dead``: a held request that waits again after the replica that ended its hold refused its
        connection: its wait ends when the first would have, and those replicas count as none (until
        :func:`revive` takes them out of ``dead`` and ``exclude``)."""
        dead = {} if dead is None else dead
        if why := self._ended():   # (first: a model that cannot get a replica is a 503 that says why, not a 429)
            raise NoReplica(why)
        if len(self.waiting_since) >= self.limits.max_queue and rank >= 0 and not dead:   # (a generation moving
            raise QueueFull()   # off a dead replica; a held request back from one that refused it: in, in its place)
        start = time.monotonic()
        origin = start if since is None else min(since, start)
        held = False
        self.waiting_since.append(origin)
        me = Waiter(rank, key, exclude, body, origin)   # (back from a dead replica: its place by its arrival)
        me.wake = asyncio.Event()
        self.queue.add(me)
        served = False
        try:
            while True:
                me.wake.clear()
                if dead:
                    revive(dead, exclude, time.monotonic())
                if self.kvq is not None:   # kv_aware: the elected waiter (:mod:`.kvqueue`)
                    lease = self.try_acquire(body, headers, exclude, hold=False) if self._elect() is me else None
                else:   # only the head takes a replica (a head that excludes replicas, a retry, lets the others try)
                    head = self.queue.head()
                    lease = self.try_acquire(body, headers, exclude) if head is me or head.exclude else None
                if lease is not None:
                    served, lease.held = True, held
                    return lease
                # stopping: a new request that must wait for room ends now (not a stream carried on elsewhere: its
                # client has part of its answer, and the grace is for it)
                if why := self._ended() or (self.owner.closing if rank >= 0 else ""):
                    raise NoReplica(why)
                held = held or timeout_s is None and all(j in dead for j in self.slots)
                limit = self.hold_s(held) if timeout_s is None else timeout_s
                left = origin + limit - time.monotonic()
                if left <= 0:
                    raise NoReplica("", limit, held)
                try:   # re-check: ejections expire with time, and so do kv_aware's holds
                    async with asyncio.timeout(min(left, 1.0 if self.kvq is None else 0.25)):
                        await me.wake.wait()
                except TimeoutError:
                    pass
        finally:
            self.waiting_since.remove(origin)
            self.queue.remove(me, served)
            if self.waiting_since:
                self.notify()   # the next in line looks (a replica may still have room)

    def queue_state(self, now: float) -> QueueState:
        if not self.waiting_since:
            return QueueState()
        return QueueState(len(self.waiting_since), max(0.0, now - min(self.waiting_since)))

    def _ended(self) -> str:
        """Why a request held for want of a READY replica cannot wait (blocked, or the gateway is stopping)."""
        return "" if self.slots else self.blocked or self.owner.closing

    def notify(self) -> None:
        """A replica appeared or has room, or the queue changed: wake the waiters that may take one now, the
        head (kv_aware, or a head that excludes replicas and so lets the others try: the first ``LOOK``), not
        the whole queue (each release woke every waiter: 2.5 ms a hand-off with 256 queued). A waiter that
        leaves, served or not, notifies in turn: a blocked model's or a stopping gateway's queue ends in order."""
        self._gen += 1
        head = self.queue.head()
        for w in (head,) if head is None or (self.kvq is None and not head.exclude) else self.queue.first(LOOK):
            if w is not None and w.wake is not None:
                w.wake.set()

    def failed(self, slot: Slot) -> bool:
        """A request on this replica failed: eject it after enough failures in a row."""
        gw = self.owner.cfg
        now = self.owner.clock()
        if slot.ejected_until > now:   # (the requests it held when it was ejected fail with it: not counted again)
            return False
        slot.failures += 1
        if slot.failures < gw.eject_after_failures or not slot.routed:
            return False
        ejected_now = sum(1 for s in self.slots.values() if s.ejected_until > now)
        if (ejected_now + 1) * 2 > len(self.slots):  # never eject more than half
            return False
        slot.ejections += 1
        slot.ejected_until = now + min(gw.eject_max_s, gw.eject_base_s * 2 ** min(slot.ejections - 1, 40))
        slot.failures = 0
        return True


class Pools:
    """Every model's pool, and every replica slot of this process (routable, or with requests in flight)."""

    def __init__(self, cfg: GatewayConfig, models: list[ModelConfig], rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, stats: RequestStats | None = None):
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.clock = clock
        self.stats = stats if stats is not None else RequestStats()
        self.kv: KvRouting | None = None   # made when a model routes kv_aware
        self.closing = ""   # why held requests end now (the gateway is stopping: no replica will come)
        self.pools: dict[str, ModelPool] = {}
        self.names: dict[str, str] = {}
        self.jobs: dict[str, Slot] = {}
        self.table: RoutingTable = EMPTY_TABLE
        self.set_models(cfg, models)

    def make_policy(self, model: ModelConfig):
        """The model's routing policy; kv_aware's is bound to the KV state :meth:`set_models` made first."""
        policy = POLICIES[model.routing](self.rng)
        if model.routing == "kv_aware":
            policy.bind(self.kv, model.name)
        return policy

    async def close(self) -> None:
        """Stop the KV-cache event feeds (bounded)."""
        if self.kv is not None:
            await self.kv.close()

    def set_models(self, cfg: GatewayConfig, models: list[ModelConfig]) -> None:
        self.cfg = cfg
        if self.kv is not None or any(m.routing == "kv_aware" for m in models):
            if self.kv is None:
                from .kvroute import KvRouting   # pyzmq and the tokenizer only where a model routes this way
                self.kv = KvRouting(self.stats, self.rng)
            self.kv.set_models(models)
        keep = {}
        for m in models:
            pool = self.pools.get(m.name)
            if pool is None:
                pool = ModelPool(m, self)
            else:
                pool.set_model(m)
            keep[m.name] = pool
        for name, pool in self.pools.items():
            if name not in keep:
                for slot in pool.slots.values():
                    self._unroute(slot)
                pool.slots = {}
                pool.blocked = f"model {name} was removed from the fleet"   # its held requests end now
                pool.notify()
        self.pools = keep
        self.names = {n: m.name for m in models for n in (*m.served_names, *m.lora_adapters)}   # (LoRA adapters too)
        self.apply(self.table)

    def resolve(self, name: str) -> ModelPool | None:
        model = self.names.get(name)
        return self.pools.get(model) if model else None

    def apply(self, table: RoutingTable) -> None:
        """Route on ``table`` from now on: replicas not in it get no new request."""
        self.table = table
        for name, pool in self.pools.items():
            routes = table.models.get(name)
            # before the fleet's first table, the config's count stands in for the reconciler's
            pool.desired = routes.desired if routes else (pool.model.replicas if table.version == 0 else 0)
            ready = {r.job_id: r for r in routes.replicas} if routes else {}
            blocked = routes.blocked if routes else ""
            pool.waiting_on = routes.waiting_on if routes else ""
            pool.waiting_from = routes.waiting_from if routes else 0.0
            for jid in [j for j in pool.slots if j not in ready]:
                self._unroute(pool.slots.pop(jid))
            for jid, r in ready.items():
                slot = self.jobs.get(jid)
                if slot is None:
                    slot = self.jobs[jid] = Slot(r)
                elif slot.replica != r:
                    if slot.replica.endpoint != r.endpoint or slot.model != r.model:
                        slot.set_replica(r)
                    else:  # only the load changed: keep the cached request head
                        slot.replica, slot.load = r, r.load
                slot.routed = True
                pool.slots[jid] = slot
            if pool.waiting_since and (pool.slots or blocked != pool.blocked):
                pool.notify()
            pool.blocked = blocked
        if self.kv is not None:
            self.kv.sync(table)

    def _unroute(self, slot: Slot) -> None:
        slot.routed = False
        slot.unrouted_at = time.monotonic()
        if slot.inflight == 0:
            self.forget(slot)

    def forget(self, slot: Slot) -> None:
        if self.jobs.get(slot.job_id) is slot and not slot.routed:
            del self.jobs[slot.job_id]

    def close_queues(self, why: str) -> None:
        """Requests held for want of a READY replica end now with ``why`` (the gateway is stopping)."""
        self.closing = why
        for pool in self.pools.values():   # every waiter looks now (a new one ends: not at its next second's look)
            for w in [w for w in pool.queue.first(len(pool.waiting_since)) if w.wake is not None]:
                w.wake.set()

    def inflight_by_job(self) -> dict[str, int]:
        return {jid: s.inflight for jid, s in self.jobs.items() if s.inflight}

    def inflight_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.jobs.values():
            if s.inflight:
                out[s.model] = out.get(s.model, 0) + s.inflight
        return out

    def queued(self) -> dict[str, QueueState]:
        now = time.monotonic()
        return {name: p.queue_state(now) for name, p in self.pools.items() if p.waiting_since}
