"""Per-key limits over several gateway processes: the fleet's allocation (pure, table-tested) and the
gateway's admission queue order."""

from __future__ import annotations

import asyncio
import random

import pytest

from orchestrator.contract import GatewayReport, TenantUsage
from orchestrator.fleet.quota import Limits, QuotaBook, allocate, split
from orchestrator.gateway.admission import AdmissionQueue, Waiter


def report(process: int, inc: str = "a", **keys: tuple) -> GatewayReport:
    """keys: name -> (requests, tokens, demand, inflight)."""
    return GatewayReport(process, 1, incarnation=inc,
                         tenants={k: TenantUsage(*v) for k, v in keys.items()})


@pytest.mark.parametrize("amount,weights,want", [
    (10, {1: 1, 2: 1}, {1: 5, 2: 5}),
    (1, {1: 1, 2: 1, 3: 1, 4: 1}, {1: 1, 2: 0, 3: 0, 4: 0}),   # whole shares; the sum is the amount
    (40, {1: 101, 2: 1, 3: 1, 4: 1}, {1: 39, 2: 1, 3: 0, 4: 0}),   # 38.8 + 3 x 0.4: remainders
    (0, {1: 5, 2: 1}, {1: 0, 2: 0}),
    (7, {1: 0.5}, {1: 7}),
])
def test_split_whole_shares_sum_to_the_amount(amount, weights, want):
    got = split(amount, weights)
    assert sum(got.values()) == amount
    assert got == want


def test_one_process_gets_everything_left_of_the_window():
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(0, 0, 0, 0))])
    book.observe(10.0, [report(0, k=(25, 1000, 25, 3))])
    a = allocate(10.0, {"k": Limits(rpm=60, tpm=5000, max_concurrent=4)}, book.history, book.live)[0]
    assert a.incarnation == "a"
    k = a.keys["k"]
    assert (k.requests_upto, k.requests_left) == (25 + 35, 35)
    assert (k.tokens_upto, k.tokens_left) == (1000 + 4000, 4000)
    assert k.concurrent == 4            # 3 in flight + the 1 left
    assert k.requests_reset_s == pytest.approx(60.0)   # the first counted use (t=10) leaves at t=70
    # a window that holds none says more than a window (60 s would be a use counted this instant)
    idle = allocate(10.0, {"k": Limits(rpm=60)}, {}, {0: "a"})[0].keys["k"]
    assert idle.requests_reset_s > 60 and idle.requests_left == 60


def test_an_allowance_says_when_its_tokens_are_the_budgets_not_the_minutes():
    """A key with both a tpm and a budget: its tokens left are the smaller, and the gateway's refusal names the
    one that bound (a key near its budget was told it hit its tokens per minute). Found by a review."""
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(0, 0, 0, 0))])
    lim = {"k": Limits(tpm=100_000, budget_tokens=1_000_000)}
    near = allocate(1.0, lim, book.history, book.live, budget_used={"k": 999_000})[0].keys["k"]
    assert near.tokens_left == 1000 and near.tokens_by_budget and not near.budget_exhausted
    far = allocate(1.0, lim, book.history, book.live, budget_used={"k": 10})[0].keys["k"]
    assert far.tokens_left == 100_000 and not far.tokens_by_budget


def test_a_key_whose_counters_start_again_counts_what_it_did_since_never_less_than_nothing():
    """A key removed by one reload and added back by another starts its counters at 0 in the same process:
    its use in the window is the counters' rises (3 requests), not last - first (-497: 507 left of 10)."""
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(500, 9000, 500, 0))])
    book.observe(60.0, [report(0)])                  # removed: its reports no longer carry it
    book.observe(100.0, [report(0, k=(3, 40, 3, 0))])  # added back: counting from 0 again, 3 requests since
    k = allocate(100.0, {"k": Limits(rpm=10, tpm=100)}, book.history, book.live)[0].keys["k"]
    assert (k.requests_left, k.tokens_left) == (7, 60)


def test_a_key_added_back_is_granted_from_its_new_counters_not_its_old_ones():
    """A reload removed the key (its process forgot it a minute after its last request) and another adds it
    back: the process counts it from 0 again.  Its last sample (1,000 requests) stayed in the book as the
    baseline, and the new key was granted 1,000 + 60 requests against its rpm of 60 until its next report."""
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(1000, 50000, 1000, 0))])
    for t in (100.0, 200.0, 400.0):
        book.observe(t, [report(0)])                 # forgotten: the reports no longer carry it
    k = allocate(400.0, {"k": Limits(rpm=60, tpm=1000)}, book.history, book.live)[0].keys["k"]
    assert (k.requests_upto, k.tokens_upto) == (60, 1000)


def test_what_a_dead_process_admitted_after_its_last_live_report_still_counts():
    """A worker's last report arrives as it dies (the hub keeps it as departed): its admissions since the
    previous report count in the window, or the survivors were granted them again."""
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(0, 0, 0, 0)), report(1, k=(0, 0, 0, 0))])
    book.observe(1.0, [report(0, k=(0, 0, 0, 0))], departed=[report(1, k=(20, 0, 20, 0))])
    a = allocate(1.0, {"k": Limits(rpm=60)}, book.history, book.live)
    assert set(a) == {0} and a[0].keys["k"].requests_left == 40


def test_the_window_slides_and_old_uses_stop_counting():
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(0, 0, 0, 0))])
    book.observe(1.0, [report(0, k=(60, 0, 60, 0))])       # the whole rpm at t=1
    lim = {"k": Limits(rpm=60)}
    assert allocate(30.0, lim, book.history, book.live)[0].keys["k"].requests_upto == 60   # nothing left
    assert allocate(30.0, lim, book.history, book.live)[0].keys["k"].requests_reset_s == pytest.approx(31.0)
    book.observe(61.5, [report(0, k=(60, 0, 60, 0))])
    k = allocate(61.5, lim, book.history, book.live)[0].keys["k"]
    assert (k.requests_upto, k.requests_left) == (120, 60)   # the t=1 burst left the window


def test_shares_follow_demand_never_promise_more_than_is_left_and_move_once_seen():
    book = QuotaBook()
    book.observe(0.0, [report(p, k=(0, 0, 0, 0)) for p in (1, 2, 3, 4)])
    # process 1 saw 100 asks in the last 2 s, the others none; 10 admitted in all so far
    book.observe(1.0, [report(1, k=(10, 0, 100, 0)), *[report(p, k=(0, 0, 0, 0)) for p in (2, 3, 4)]])
    lim = {"k": Limits(rpm=50)}
    count = {1: 10, 2: 0, 3: 0, 4: 0}
    # before any allowance each process acts on the even split (12 each): those still count as promised
    first = allocate(1.0, lim, book.history, book.live)
    held = {p: max(50 // 4 - count[p], 0) for p in count}
    assert sum(max(first[p].keys["k"].requests_upto - count[p], held[p]) for p in count) <= 40
    # once every process routes on that table, the idle shares move to where the demand is
    second = allocate(1.0, lim, book.history, book.live, in_effect={p: [first[p].keys] for p in count})
    shares = {p: second[p].keys["k"].requests_upto - count[p] for p in count}
    assert sum(shares.values()) == 40            # exactly what is left: never over the limit
    assert shares[1] >= 30 and all(shares[p] >= 1 for p in (2, 3, 4))   # a quiet process keeps a little


def test_processes_not_reporting_yet_keep_their_even_split_out_of_the_others_shares():
    """At the daemon's start the first tick saw only the workers that had reported: the whole limit went to
    them while the others admitted their even split (limit // workers) uncounted: 70 requests of an rpm of 40
    with 4 workers.  What the missing ones may admit is held back; once all report, nothing is."""
    lim = {"k": Limits(rpm=40, tpm=4000, max_concurrent=8)}
    book = QuotaBook()
    book.observe(0.0, [report(1, k=(0, 0, 5, 0))])
    one = allocate(0.0, lim, book.history, book.live, expected=4)[1].keys["k"]
    assert (one.requests_upto, one.tokens_upto, one.concurrent) == (10, 1000, 2)   # 40 - 3 x 10 ...
    assert one.requests_upto + 3 * (40 // 4) == 40                                    # ... so 40 in all
    assert allocate(0.0, lim, book.history, book.live)[1].keys["k"].requests_upto == 40   # (as it was)
    book.observe(0.5, [report(p, k=(0, 0, 5 if p == 1 else 0, 0)) for p in (1, 2, 3, 4)])
    al = allocate(0.5, lim, book.history, book.live, expected=4,
                  in_effect={p: [{"k": one}] if p == 1 else [] for p in (1, 2, 3, 4)})
    al = allocate(0.5, lim, book.history, book.live, expected=4, in_effect={p: [al[p].keys] for p in al})
    assert sum(al[p].keys["k"].requests_upto for p in (1, 2, 3, 4)) == 40   # all reporting: the whole limit


def test_a_process_that_died_still_counts_for_the_window_but_gets_nothing():
    book = QuotaBook()
    book.observe(0.0, [report(1, "old", k=(0, 0, 0, 0)), report(2, k=(0, 0, 0, 0))])
    book.observe(1.0, [report(1, "old", k=(30, 0, 30, 2)), report(2, k=(0, 0, 0, 0))])
    book.observe(2.0, [report(1, "new"), report(2, k=(0, 0, 0, 0))])   # process 1 restarted
    al = allocate(2.0, {"k": Limits(rpm=40, max_concurrent=4)}, book.history, book.live)
    assert al[1].incarnation == "new"
    k1, k2 = al[1].keys["k"], al[2].keys["k"]
    assert k1.requests_left == 10                     # the dead incarnation's 30 still count
    assert k1.requests_upto + k2.requests_upto == 10  # both count from zero: 10 in all
    assert k1.concurrent + k2.concurrent == 4         # its in-flight requests died with it


def test_budget_and_tpm_take_the_smaller_and_an_exhausted_budget_says_when_it_resets():
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(5, 900, 5, 0))])
    lim = {"k": Limits(tpm=10_000, budget_tokens=1000)}
    k = allocate(0.0, lim, book.history, book.live, {"k": 900}, {"k": 3600.0})[0].keys["k"]
    assert (k.tokens_left, k.tokens_upto, k.budget_exhausted) == (100, 1000, False)
    k = allocate(0.0, lim, book.history, book.live, {"k": 1000}, {"k": 3600.0})[0].keys["k"]
    assert (k.tokens_left, k.budget_exhausted, k.tokens_reset_s) == (0, True, 3600.0)


def test_keys_without_limits_get_no_allowance_and_allocation_is_pure():
    book = QuotaBook()
    book.observe(0.0, [report(0, k=(1, 1, 1, 0), free=(9, 9, 9, 0))])
    lim = {"k": Limits(rpm=10)}
    a = allocate(5.0, lim, book.history, book.live)
    assert set(a[0].keys) == {"k"}
    assert a == allocate(5.0, lim, book.history, book.live)


def test_admission_queue_strict_classes_then_round_robin_between_keys():
    q = AdmissionQueue()
    order = [Waiter(1, "noisy", set()) for _ in range(5)] + [Waiter(1, "calm", set()), Waiter(2, "low", set()),
                                                             Waiter(0, "vip", set())]
    for w in order:
        q.add(w)
    served = []
    while (w := q.head()) is not None:
        served.append(w.key)
        q.remove(w, served=True)
    assert served == ["vip", "noisy", "calm", "noisy", "noisy", "noisy", "noisy", "low"]


def one_busy_slot():
    """A model's pool with one replica of one slot, which a lease holds: (pools, pool, that lease)."""
    from orchestrator.config import GatewayConfig, ModelConfig
    from orchestrator.contract import Endpoint, ModelRoutes, Replica, RoutingTable
    from orchestrator.gateway.pool import Pools
    m = ModelConfig(name="m", engine="simulator", container={"enabled": False}, max_inflight_per_replica=1)
    pools = Pools(GatewayConfig(), [m], rng=random.Random(1))
    pools.apply(RoutingTable(1, {"m": ModelRoutes(1, (Replica("j", "m", 0, Endpoint("j", "h", 1, "s")),))}))
    pool = pools.pools["m"]
    return pools, pool, pool.try_acquire({}, {}, set())


def test_pool_serves_its_queue_by_class_when_a_replica_frees(monkeypatch):
    async def go():
        pools, pool, busy = one_busy_slot()
        got = []

        async def ask(rank, key):
            lease = await pool.acquire({}, {}, set(), 10, rank, key)
            got.append(key)
            await asyncio.sleep(0)
            lease.ok = True
            lease.release()
        tasks = [asyncio.create_task(ask(1, "a")), asyncio.create_task(ask(1, "a")),
                 asyncio.create_task(ask(1, "b")), asyncio.create_task(ask(2, "low"))]
        await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(ask(0, "vip")))   # queued last, served first
        await asyncio.sleep(0.05)
        busy.ok = True
        busy.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return got
    assert asyncio.run(go()) == ["vip", "a", "b", "a", "low"]


def test_a_hand_off_wakes_the_head_of_the_queue_not_every_waiter():
    """64 requests queued behind one replica slot are served in order, each hand-off waking the waiter that takes
    it (every release woke all of them, twice: the CPU of a hand-off grew with the queue, 2.5 ms at 256), and a
    model that leaves the fleet still ends every one of them at once."""
    from orchestrator.config import GatewayConfig
    from orchestrator.gateway.pool import NoReplica

    async def go():
        pools, pool, busy = one_busy_slot()
        looks, order = [0], []   # a waiter that wakes looks at the queue's head
        real = pool.queue.head

        def counted():
            looks[0] += 1
            return real()
        pool.queue.head = counted

        async def ask(i):
            lease = await pool.acquire({}, {}, set(), 60, 0, "k")
            order.append(i)
            await asyncio.sleep(0.001)   # (the others wait again meanwhile)
            lease.ok = True
            lease.release()
        tasks = [asyncio.create_task(ask(i)) for i in range(64)]
        await asyncio.sleep(0.2)
        looks[0] = 0
        busy.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert order == list(range(64)) and looks[0] <= 10 * 64, looks   # (every waiter woken: about 2,000)
        busy = pool.try_acquire({}, {}, set())
        held = [asyncio.create_task(pool.acquire({}, {}, set(), 60, 0, "k")) for _ in range(20)]
        await asyncio.sleep(0.2)
        pools.set_models(GatewayConfig(), [])   # removed from the fleet: every held request ends now
        done = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 5)
        assert all(isinstance(x, NoReplica) for x in done)
    asyncio.run(go())


def test_an_idle_keys_allowance_does_not_change_from_tick_to_tick():
    # the table is republished only when something in it changes: an idle limited key must not churn it
    book = QuotaBook()
    book.observe(0.0, [report(1, k=(5, 50, 5, 0)), report(2)])
    lim = {"k": Limits(rpm=60, tpm=1000, max_concurrent=2)}
    later = [allocate(t, lim, book.history, book.live) for t in (100.0, 100.5, 101.0)]
    assert later[0] == later[1] == later[2]


def test_a_worker_that_died_is_held_nothing_for_as_it_admits_nothing_until_its_first_allowance():
    """A worker started again after its process died admits a limited key nothing before its first allowance
    (the gateway's ``restarted``): the fleet held its even split back from the others all the same, while it
    was gone (for ever if it could not start: a key got half its rpm with two workers) and once back."""
    lim = {"k": Limits(rpm=40)}
    book = QuotaBook()
    book.observe(0.0, [report(1, k=(0, 0, 5, 0)), report(2, k=(0, 0, 0, 0))])
    both = allocate(0.0, lim, book.history, book.live, expected=2, first=book.first)
    book.observe(1.0, [report(1, k=(0, 0, 5, 0))], departed=[report(2, k=(0, 0, 0, 0))])   # worker 2 died
    alone = allocate(1.0, lim, book.history, book.live, expected=2, first=book.first,
                     in_effect={1: [both[1].keys]})
    assert alone[1].keys["k"].requests_upto == 40   # (was 20: the dead worker's even split held back)
    # without what it first reported as, a worker not there yet is one starting: its even split is held back
    assert allocate(1.0, lim, book.history, book.live, expected=2,
                    in_effect={1: [both[1].keys]})[1].keys["k"].requests_upto == 20
    book.observe(2.0, [report(1, k=(0, 0, 5, 0)), report(2, "b", k=(0, 0, 1, 0))])   # started again
    assert book.first == {1: "a", 2: "a"} and book.live == {1: "a", 2: "b"}
    back = allocate(2.0, lim, book.history, book.live, expected=2, first=book.first,
                    in_effect={1: [alone[1].keys]})
    # process 1 still may act on its 40 until it routes on a newer table: nothing is left for process 2 yet,
    # and nothing was held for it (it admits nothing before this allowance)
    assert back[2].keys["k"].requests_upto == 0 and back[1].keys["k"].requests_upto < 40
    settled = allocate(2.0, lim, book.history, book.live, expected=2, first=book.first,
                       in_effect={1: [back[1].keys], 2: [back[2].keys]})
    assert sum(settled[p].keys["k"].requests_upto for p in (1, 2)) == 40 and settled[2].keys["k"].requests_upto > 0


def test_a_worker_seen_only_as_it_departed_is_no_worker_still_to_come():
    """A worker that died between two ticks was never seen live: its even split stayed held back from the others
    for ever, as if it were still starting."""
    lim = {"k": Limits(rpm=40)}
    book = QuotaBook()
    book.observe(0.0, [report(1, k=(0, 0, 5, 0))], departed=[report(2, k=(0, 0, 0, 0))])
    assert book.first == {1: "a", 2: "a"} and book.live == {1: "a"}
    assert allocate(0.0, lim, book.history, book.live, expected=2, first=book.first)[1].keys["k"].requests_upto == 40


def test_the_rpm_and_tpm_windows_carry_over_to_the_next_daemon_and_leave_it_on_time():
    """What keys with a rate limit used in the last minute (every process: live, dead, a counter that started
    again) is written as rows per second, and a new daemon's book counts it in its window until it leaves."""
    import sqlite3

    from orchestrator.fleet.quotawindow import SCHEMA, QuotaWindow
    limits = {"a": Limits(rpm=10, tpm=1000), "b": Limits(max_concurrent=2), "c": Limits(tpm=500)}
    clock, wall = [100.0], [5000.0]
    book = QuotaBook()
    for t, reps, gone in ((40, [report(1, "i1", a=(1, 10, 1, 0))], []),   # (before the window)
                          (70, [report(1, "i1", a=(3, 30, 3, 0), b=(5, 5, 5, 0))], []),
                          (80, [report(2, "i2", a=(2, 20, 2, 0), c=(1, 7, 1, 0))], [report(1, "i1", a=(4, 40, 4, 0))]),
                          (90, [report(2, "i2", a=(1, 5, 1, 0), c=(1, 7, 1, 0))], [])):   # (a from zero again)
        book.observe(t, reps, gone)
    store = QuotaWindow(book, lambda: limits, lambda: clock[0], lambda: wall[0])
    db = sqlite3.connect(":memory:")
    assert not store.dirty   # (nothing written over the last daemon's rows before they are read)
    store.load(db)
    assert store.dirty
    store.write(db)
    store.written()
    assert not store.dirty
    # in the window (after 40): a used 2+1 (i1 to 70, then 80), 2 (i2 at 80) and 1 again (at 90); b has no rate limit
    assert sorted(db.execute("SELECT * FROM quota_window")) == [
        ("a", 4970, 2, 20), ("a", 4980, 3, 30), ("a", 4990, 1, 5), ("c", 4980, 1, 7)]
    # the file moved away (a corrupt one: the ledger starts a new one): the next write is whole, not a diff
    fresh = sqlite3.connect(":memory:")
    book.observe(95, [report(2, "i2", a=(2, 6, 2, 0), c=(1, 7, 1, 0))])
    clock[0], wall[0] = 101.0, 5001.0
    assert store.dirty
    store.write(fresh)
    store.written()
    assert sorted(fresh.execute("SELECT * FROM quota_window")) == [
        ("a", 4970, 2, 20), ("a", 4980, 3, 30), ("a", 4990, 1, 5), ("a", 4995, 1, 1), ("c", 4980, 1, 7)]
    assert not store.dirty

    # a daemon started 5 s later (its own clock at 7): counted until each use leaves the window; a row ahead of
    # its wall clock (the last daemon's ran ahead, then was set back) is dropped
    db.execute("INSERT INTO quota_window VALUES ('a', 9000, 5, 50)")
    nxt = QuotaBook()
    clock2 = [7.0]
    again = QuotaWindow(nxt, lambda: limits, lambda: clock2[0], lambda: 5005.0)
    again.load(db)
    assert not again.dirty   # (read back, the same rows: nothing to write)
    assert sorted(db.execute("SELECT at FROM quota_window")) == [(4970,), (4980,), (4980,), (4990,)]
    got = allocate(7.0, limits, nxt.history, {3: "i3"}, expected=1)[3].keys
    assert (got["a"].requests_left, got["a"].tokens_left, got["c"].tokens_left) == (4, 945, 493)
    assert got["a"].requests_reset_s == 26   # (a use in wall second 4970 leaves the window by 5031)
    nxt.observe(36.0, [report(3, "i3")])     # wall 5034: that use has left
    got = allocate(36.0, limits, nxt.history, {3: "i3"}, expected=1)[3].keys
    assert (got["a"].requests_left, got["a"].tokens_left) == (6, 965)

    # a daemon started in the first half of the second of the last use: that use counts from now, not later (it
    # leaves within one window, never 61 s)
    one = sqlite3.connect(":memory:")
    one.execute(SCHEMA)
    one.execute("INSERT INTO quota_window VALUES ('a', 5006, 1, 1)")
    quick = QuotaBook()
    QuotaWindow(quick, lambda: limits, lambda: 50.0, lambda: 5006.2).load(one)
    assert allocate(50.0, limits, quick.history, {3: "i3"}, expected=1)[3].keys["a"].requests_reset_s == 60
