"""kv_aware at the in-flight cap (``orchestrator/gateway/kvqueue.py``): a request waits for the full replica that
caches its prompt instead of prefilling it again elsewhere (for at most ``HOLD_S``), and when a replica has room
the waiter with the most of its prompt cached there takes it, within the queue's priority classes."""

from __future__ import annotations

import asyncio
import random
import time

from orchestrator.contract import ModelRoutes, Replica, RoutingTable
from orchestrator.gateway import kvqueue
from orchestrator.gateway.admission import AdmissionQueue, Waiter
from orchestrator.gateway.pool import Pools
from orchestrator.config import GatewayConfig
from orchestrator.reqstats import RequestStats
from tests.test_kv_routing import DOC, chat, ep, model, tok_dir  # noqa: F401  (tok_dir: the module's fixture)

THIRD = " ".join(f"entry {i} in the changelog of a third project that nobody asked about." for i in range(40))
OTHER = " ".join(f"line {i} of an unrelated manual about the storage quotas of another team." for i in range(40))


async def two_replicas(tok_dir, cap: int = 1) -> Pools:
    pools = Pools(GatewayConfig(), [model(tok_dir, max_inflight_per_replica=cap)], random.Random(0), stats=RequestStats())
    pools.apply(RoutingTable(1, {"m": ModelRoutes(2, (Replica("j1", "m", 0, ep("j1", False)),
                                                      Replica("j2", "m", 1, ep("j2", False))))}))
    return pools


async def test_a_request_waits_for_the_full_replica_that_caches_its_prompt(tok_dir):
    pools = await two_replicas(tok_dir)
    pool = pools.pools["m"]
    try:
        a = pool.try_acquire(chat(DOC, "first question"), {}, set())
        home = a.slot.job_id
        other = "j2" if home == "j1" else "j1"
        assert pool.try_acquire(chat(DOC, "second question"), {}, set()) is None   # held: its prompt is at home
        b = pool.try_acquire(chat(OTHER, "a question"), {}, set())   # cached nowhere: the replica with room
        assert b is not None and b.slot.job_id == other
        b.release()
        waiting = asyncio.create_task(pool.acquire(chat(DOC, "second question"), {}, set(), 10.0))
        await asyncio.sleep(0.1)
        assert not waiting.done()   # the other replica has room, but would prefill the document again
        a.release()
        lease = await asyncio.wait_for(waiting, 5.0)
        assert lease.slot.job_id == home and lease.prefill < 60   # the document was cached there
        lease.release()
    finally:
        await pools.close()


async def test_the_hold_ends_after_hold_s_and_any_replica_with_room_will_do(tok_dir, monkeypatch):
    monkeypatch.setattr(kvqueue, "HOLD_S", 0.3)
    pools = await two_replicas(tok_dir)
    pool = pools.pools["m"]
    try:
        a = pool.try_acquire(chat(DOC, "first question"), {}, set())
        t0 = time.monotonic()
        lease = await asyncio.wait_for(pool.acquire(chat(DOC, "second question"), {}, set(), 10.0), 5.0)
        assert lease.slot is not a.slot and time.monotonic() - t0 >= 0.3
        assert lease.prefill > 300   # it prefills the document again, as it had to
        lease.release()
        a.release()
    finally:
        await pools.close()


async def test_a_replica_with_room_goes_to_the_waiter_with_its_prompt_cached_there_not_the_oldest(tok_dir):
    pools = await two_replicas(tok_dir)
    pool = pools.pools["m"]
    try:
        a = pool.try_acquire(chat(DOC, "q0"), {}, set())
        b = pool.try_acquire(chat(OTHER, "q0"), {}, set())
        assert a.slot is not b.slot   # both replicas full: one caches DOC, the other OTHER
        first = asyncio.create_task(pool.acquire(chat(THIRD, "q1"), {}, set(), 10.0))   # waits first, cached nowhere
        await asyncio.sleep(0.05)
        second = asyncio.create_task(pool.acquire(chat(DOC, "q1"), {}, set(), 10.0))
        await asyncio.sleep(0.05)
        a.release()   # DOC's replica has room: the second waiter, whose prompt it caches, goes before the first
        lease = await asyncio.wait_for(second, 5.0)
        assert lease.slot is a.slot and not first.done()
        b.release()
        lease2 = await asyncio.wait_for(first, 5.0)
        assert lease2.slot is b.slot
        lease.release()
        lease2.release()
    finally:
        await pools.close()


async def test_below_the_cap_nothing_waits(tok_dir):
    pools = await two_replicas(tok_dir, cap=2)
    pool = pools.pools["m"]
    try:
        a = pool.try_acquire(chat(DOC, "q0"), {}, set())
        b = pool.try_acquire(chat(DOC, "q1"), {}, set())
        assert b is not None and b.slot is a.slot   # its cached replica had room
        c = pool.try_acquire(chat(DOC, "q2"), {}, set())
        assert c is None   # now it is full: held for it
        a.release()
        b.release()
    finally:
        await pools.close()


async def test_a_prompt_that_cannot_be_tokenized_fails_no_waiter(tok_dir):
    """The election tokenizes every waiter it reads: one client's bad prompt (token ids out of any vocabulary)
    must not fail the others' requests; it waits and is sent like any prompt cached nowhere."""
    pools = await two_replicas(tok_dir)
    pool = pools.pools["m"]
    try:
        a = pool.try_acquire(chat(DOC, "q0"), {}, set())
        b = pool.try_acquire(chat(OTHER, "q0"), {}, set())
        good = [asyncio.create_task(pool.acquire(chat(OTHER, f"question {i}"), {}, set(), 10.0)) for i in range(3)]
        await asyncio.sleep(0.05)
        bad = asyncio.create_task(pool.acquire({"model": "m", "prompt": [-1] * 32}, {}, set(), 10.0))
        huge = asyncio.create_task(pool.acquire({"model": "m", "prompt": [2**40] * 32}, {}, set(), 10.0))
        await asyncio.sleep(0.05)
        a.release()
        b.release()
        leases = []
        for t in [*good, bad, huge]:   # each gets a replica in turn, as the others release theirs
            lease = await asyncio.wait_for(t, 5.0)
            leases.append(lease)
            lease.release()
        assert len(leases) == 5
    finally:
        await pools.close()


class FakeQueueKv:
    """KvRouting's ``cached`` answer, per body: (prompt tokens, cached tokens per replica)."""

    def __init__(self, table: dict[str, tuple[int, dict[str, int]]]):
        self.table = table

    def cached(self, model, body, slots):
        return self.table[body["id"]]


class S:
    def __init__(self, job_id: str):
        self.job_id = job_id


def test_the_election_starvation_guard_priority_classes_and_holds():
    j1, j2 = S("j1"), S("j2")
    kv = FakeQueueKv({"hit": (1000, {"j1": 900, "j2": 0}), "cold": (1000, {"j1": 0, "j2": 0}),
                      "held": (1000, {"j1": 0, "j2": 900})})
    q = kvqueue.KvQueue(kv, "m")
    rooms = lambda exclude: ([j1, j2], [j1])   # noqa: E731  (j2 is full)
    now = 100.0
    cold, hit = Waiter(0, "a", set(), {"id": "cold"}, now - 5), Waiter(0, "b", set(), {"id": "hit"}, now)
    assert q.elect([cold, hit], rooms, now) is hit                      # cached beats older
    cold.start = now - kvqueue.STARVE_S
    assert q.elect([cold, hit], rooms, now) is cold                     # unless the older one starves
    held = Waiter(0, "c", set(), {"id": "held"}, now)
    assert q.elect([held], rooms, now) is None                          # it waits for j2
    held.start = now - kvqueue.HOLD_S
    assert q.elect([held], rooms, now) is held                          # for HOLD_S at most
    low = Waiter(1, "d", set(), {"id": "hit"}, now)
    top = Waiter(0, "e", set(), {"id": "cold"}, now)
    assert q.elect([top, low], rooms, now) is top                       # a higher class first, cached or not
    assert q.elect([Waiter(0, "f", set(), {"id": "held"}, now), low], rooms, now) is low   # unless it holds


def test_of_several_starved_waiters_the_oldest_goes_first_cached_or_not():
    """Past ``STARVE_S`` a waiter goes before any younger one: among several starved waiters the oldest takes the
    replica, even when a younger starved one (first in queue order, e.g. another key's turn) has its prompt
    cached there."""
    j1, j2 = S("j1"), S("j2")
    kv = FakeQueueKv({"hit": (1000, {"j1": 900, "j2": 0}), "cold": (1000, {"j1": 0, "j2": 0})})
    q = kvqueue.KvQueue(kv, "m")
    rooms = lambda exclude: ([j1, j2], [j1])   # noqa: E731  (j2 is full)
    now = 100.0
    old = Waiter(0, "a", set(), {"id": "cold"}, now - 3 * kvqueue.STARVE_S)
    young = Waiter(0, "b", set(), {"id": "hit"}, now - kvqueue.STARVE_S)
    assert q.elect([young, old], rooms, now) is old
    assert q.elect([old, young], rooms, now) is old
    fresh = Waiter(0, "c", set(), {"id": "hit"}, now)
    assert q.elect([fresh, young], rooms, now) is young   # starved before cached, as before


def test_the_queue_lists_its_waiters_in_serving_order():
    q = AdmissionQueue()
    ws = [Waiter(1, "x", set()), Waiter(1, "x", set()), Waiter(1, "y", set()), Waiter(0, "z", set()),
          Waiter(1, "y", set())]
    for w in ws:
        q.add(w)
    assert list(q.first(10)) == [ws[3], ws[0], ws[2], ws[1], ws[4]]   # class 0, then x and y in turn
    assert list(q.first(2)) == [ws[3], ws[0]]
