"""The fleet's durable per-key usage: deltas from the gateway processes' cumulative counters, the SQLite
ledger across a restart, period totals, ``slurmfleet usage`` and the per-key ``/metrics`` series."""

from __future__ import annotations

import calendar
import csv
import io
import json
import os
import sqlite3
import time

import pytest

from conftest import metric_sum
from orchestrator import cli
from orchestrator.contract import GatewayReport, TenantUsage
from orchestrator.fleet.usage import UsageLedger, hour_bucket
from orchestrator.fleet.usagequery import key_usage, query
from orchestrator.observability.metrics import FreeSpace, Metrics, storage_stats

T0 = calendar.timegm((2026, 11, 1, 10, 30, 0))   # 2026-11-01T10:30 UTC
H = 3600


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def rep(process: int, inc: str, **keys: dict) -> GatewayReport:
    """keys: name -> {model: (requests, prompt, completion)} (cumulative), or a TenantUsage."""
    return GatewayReport(process, 1, incarnation=inc, tenants={
        k: v if isinstance(v, TenantUsage) else TenantUsage(models=v) for k, v in keys.items()})


@pytest.fixture
def ledger(tmp_path):
    led = UsageLedger(tmp_path / "usage.sqlite3", Clock())
    yield led
    led.close()


def stored(path) -> dict:
    with sqlite3.connect(path) as db:
        return {row[:4]: row[4:] for row in db.execute("SELECT hour, key, grp, model, requests, prompt_tokens, "
                                                        "completion_tokens FROM usage")}


def test_deltas_over_two_processes_and_a_restarted_incarnation(ledger):
    groups = {"a": "nlp", "b": None}
    steps = [   # (report, totals after it)
        (rep(1, "x", a={"m": (1, 10, 5)}), {("a", "m"): (1, 10, 5)}),
        (rep(2, "y", a={"m": (2, 20, 2)}, b={"n": (1, 1, 1)}), {("a", "m"): (3, 30, 7), ("b", "n"): (1, 1, 1)}),
        (rep(1, "x", a={"m": (3, 30, 15), "n": (1, 4, 4)}),
         {("a", "m"): (5, 50, 17), ("a", "n"): (1, 4, 4), ("b", "n"): (1, 1, 1)}),
        # process 1 restarted: its new incarnation counts from zero, so (1, 3, 3) is all new
        (rep(1, "z", a={"m": (1, 3, 3)}), {("a", "m"): (6, 53, 20), ("a", "n"): (1, 4, 4), ("b", "n"): (1, 1, 1)}),
        # the last report of the old incarnation arrives late (a departed process): only its own news count
        (rep(1, "x", a={"m": (4, 40, 20), "n": (1, 4, 4)}),
         {("a", "m"): (7, 63, 25), ("a", "n"): (1, 4, 4), ("b", "n"): (1, 1, 1)}),
    ]
    for i, (r, want) in enumerate(steps):
        ledger.observe(r, groups)
        assert ledger.totals() == want, i
    assert ledger.flush()
    hour = "2026-11-01T10"
    assert stored(ledger.path) == {(hour, "a", "nlp", "m"): (7, 63, 25), (hour, "a", "nlp", "n"): (1, 4, 4),
                                   (hour, "b", "", "n"): (1, 1, 1)}


def test_the_session_fallback_keeps_a_months_hours_not_all_of_them(tmp_path):
    clock = Clock()
    led = UsageLedger(tmp_path / "usage.sqlite3", clock)
    try:
        for h in range(24 * 60):   # sixty days of a key's use, a report an hour
            clock.t = T0 + h * H
            led.observe(rep(1, "x", a={"m": (h + 1, h + 1, 0)}), {"a": None})
        assert 24 * 31 < len(led._session) <= 24 * 32 + 1   # (it used to keep every hour for ever)
    finally:
        led.close()


def test_the_same_report_twice_adds_nothing(ledger):
    r = rep(1, "x", a={"m": (2, 10, 5)})
    for again in (r, rep(1, "x", a={"m": (2, 10, 5)})):   # the very object, and an equal new one
        ledger.observe(r, {})
        ledger.observe(again, {})
    assert ledger.totals() == {("a", "m"): (2, 10, 5)}
    assert ledger.flush() and ledger.flush()
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (2, 10, 5)}


def test_a_counter_that_went_down_started_again(ledger):
    """A key removed and added again by reloads in one incarnation counts from zero."""
    ledger.observe(rep(1, "x", a={"m": (5, 50, 50)}), {})
    ledger.observe(rep(1, "x", a={"m": (1, 7, 3)}), {})
    assert ledger.totals() == {("a", "m"): (6, 57, 53)}


def test_a_key_its_process_forgot_and_a_reload_added_back_counts_from_zero(ledger):
    """Removed by a reload, the key leaves the reports a minute later; added back, it counts from zero again
    (its first report, every counter above the old one's, was taken as a rise: (1, 30, 15) of (2, 50, 20))."""
    ledger.observe(rep(1, "x", a={"m": (1, 20, 5)}, b={"m": (1, 1, 1)}), {})
    ledger.observe(rep(1, "x", b={"m": (1, 1, 1)}), {})
    ledger.observe(rep(1, "x", a={"m": (2, 50, 20)}, b={"m": (1, 1, 1)}), {})
    assert ledger.totals() == {("a", "m"): (3, 70, 25), ("b", "m"): (1, 1, 1)}


def test_rejections_are_counted_as_deltas(ledger):
    ledger.observe(rep(1, "x", a=TenantUsage(rejected={"rpm": 2})), {})
    ledger.observe(rep(1, "x", a=TenantUsage(rejected={"rpm": 5, "budget": 1})), {})
    ledger.observe(rep(2, "y", a=TenantUsage(rejected={"rpm": 1})), {})
    assert ledger.rejections() == {("a", "rpm"): 6, ("a", "budget"): 1}
    assert ledger.totals() == {}


def test_flushed_counts_survive_a_restart_and_add_up(tmp_path):
    path, clock = tmp_path / "usage.sqlite3", Clock()
    first = UsageLedger(path, clock)
    first.observe(rep(1, "x", a={"m": (2, 100, 50)}), {"a": "g"})
    first.flush()
    first.observe(rep(1, "x", a={"m": (3, 110, 60)}), {"a": "g"})
    first.close()   # close flushes too
    second = UsageLedger(path, clock)   # the daemon again: its gateway processes count from zero
    assert second.totals() == {} and second.period_tokens("a", T0 - 1800) == 170
    second.observe(rep(1, "w", a={"m": (1, 5, 5)}), {"a": "g"})
    assert second.period_tokens("a", T0 - 1800) == 180
    second.close()
    assert stored(path) == {("2026-11-01T10", "a", "g", "m"): (4, 115, 65)}


def test_a_killed_daemons_workers_spool_is_booked_exactly_once_beyond_what_it_had_flushed(tmp_path):
    """SIGKILL of the daemon: its gateway workers finish their requests and spool their last counters; the next
    daemon books them, less what the dead one had written, once, whatever it had only in memory."""
    path, clock = tmp_path / "usage.sqlite3", Clock()
    dead = UsageLedger(path, clock)
    dead.observe(rep(1, "w1", a={"m": (2, 100, 50)}, b={"m": (1, 7, 3)}), {"a": "g"})
    dead.observe(rep(2, "w2", a={"m": (1, 10, 10)}), {"a": "g"})
    dead.flush()
    dead.observe(rep(1, "w1", a={"m": (3, 150, 80)}, b={"m": (1, 7, 3)}), {"a": "g"})   # in memory only: lost
    del dead   # (killed: no close)
    # w1 served on to the end; w2 was killed with its daemon (no spool); w3 never reported at all
    final = {"w1": {"a": {"m": (4, 160, 120), "n": (1, 5, 5)}, "b": {"m": (1, 7, 3)}}, "w3": {"a": {"m": (1, 1, 1)}}}
    new = UsageLedger(path, clock)
    for inc, tenants in final.items():
        assert new.ingest(inc, tenants, {"a": "g"})
    assert new.ingest("w1", final["w1"], {"a": "g"})   # a spool booked again (a crash before its removal): nothing
    new.close()
    assert stored(path) == {("2026-11-01T10", "a", "g", "m"): (4 + 1 + 1, 160 + 10 + 1, 120 + 10 + 1),
                            ("2026-11-01T10", "a", "g", "n"): (1, 5, 5),
                            ("2026-11-01T10", "b", "", "m"): (1, 7, 3)}
    with sqlite3.connect(path) as db:   # w1's booked counters went with its spool; w2's stay (it may spool yet)
        assert sorted({r[0] for r in db.execute("SELECT incarnation FROM seen")}) == ["w2"]
    clock.t += 8 * 86400   # a week on, a worker killed with its daemon never will: its rows go
    later = UsageLedger(path, clock)
    assert later.ingest("w4", {}, {})
    later.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM seen").fetchone()[0] == 0


def test_spools_of_a_daemon_down_past_the_week_are_each_booked_beyond_what_it_had_flushed(tmp_path):
    """A daemon SIGKILLed with three workers, started again eight days later: booking the first spool purged the
    other two workers' booked counters as a week stale, so their spools were booked whole (counted twice)."""
    path, clock, spool = tmp_path / "usage.sqlite3", Clock(), tmp_path / "usage-spool"
    dead = UsageLedger(path, clock, spool=spool)
    for p, inc in enumerate(("w1", "w2", "w3"), 1):
        dead.observe(rep(p, inc, a={"m": (2, 20, 10)}), {})
    assert dead.flush()
    del dead   # (killed: no close)
    spool.mkdir()
    for inc in ("w1", "w2", "w3"):   # each served one more request and spooled its last counters
        (spool / f"{inc}.json").write_text("{}")
    clock.t += 8 * 86400
    new = UsageLedger(path, clock, spool=spool)
    for inc in ("w1", "w2", "w3"):
        assert new.ingest(inc, {"a": {"m": (3, 30, 15)}}, {})
        (spool / f"{inc}.json").unlink()   # (as book_spool does once booked)
    new.close()
    assert {r["key"]: (r["requests"], r["completion_tokens"]) for r in query(path, 0, clock.t + H, ["key"])} == \
        {"a": (9, 45)}


def test_a_live_workers_idle_key_keeps_its_booked_counters_past_a_week(tmp_path):
    """A `seen` row is rewritten only when its counters move, and rows older than a week were purged as a dead
    worker's: a live worker's key idle for a week lost its row, so after a SIGKILL its spool was booked whole
    again (k counted twice).  The live workers' rows are made recent hourly; a dead one's still age out."""
    path, clock = tmp_path / "usage.sqlite3", Clock()
    led = UsageLedger(path, clock)   # (never closed: its daemon is SIGKILLed)
    led.observe(rep(1, "a", j={"m": (1, 1, 1)}), {})
    led.observe(rep(2, "b", k={"m": (5, 100, 50)}), {})
    assert led.flush()
    for _ in range(8 * 24):   # eight days: worker a serves j now and then, k stays idle on worker b
        clock.t += H
        led.observe(rep(1, "a", j={"m": (2, 2, 2)}), {})
        assert led.flush()
    nxt = UsageLedger(path, clock)   # both workers spooled their last counters as they exited
    assert nxt.ingest("a", {"j": {"m": (2, 2, 2)}}, {}) and nxt.ingest("b", {"k": {"m": (5, 100, 50)}}, {})
    nxt.close()
    assert {r["key"]: r["requests"] for r in query(path, 0, clock.t + H, ["key"])} == {"j": 2, "k": 5}


def test_spools_of_a_daemon_that_stopped_in_order_add_nothing_and_one_read_before_its_report_counts_once(tmp_path):
    """Workers spool as they exit, also when their daemon stops in order: it marks those spools booked as it
    closes its ledger.  A spool read while its worker's last report is still on its way counts once."""
    path, clock = tmp_path / "usage.sqlite3", Clock()
    led = UsageLedger(path, clock)
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}), {})
    led.observe(rep(2, "w2", a={"m": (1, 10, 10)}), {})
    assert led.ingest("w2", {"a": {"m": (3, 30, 30)}}, {})   # w2 spooled before its last report was read
    led.observe(rep(2, "w2", a={"m": (3, 30, 30)}), {}, last=True)      # that report: nothing more
    led.observe(rep(1, "w1", a={"m": (4, 200, 90)}), {}, last=True)     # w1's last report
    led.close()
    nxt = UsageLedger(path, clock)
    for inc, final in (("w1", {"a": {"m": (4, 200, 90)}}), ("w2", {"a": {"m": (3, 30, 30)}})):
        assert nxt.ingest(inc, final, {})                     # (the spools the workers left: booked already)
    nxt.close()
    assert stored(path) == {("2026-11-01T10", "a", "", "m"): (7, 230, 120)}


def test_a_flush_writes_a_workers_booked_counters_only_when_they_moved(tmp_path, monkeypatch):
    """(every report is a new object: a key whose counters did not move is not written again at every flush)"""
    led = UsageLedger(tmp_path / "usage.sqlite3", Clock())
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}, b={"m": (1, 1, 1)}), {})
    led.flush()
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}, b={"m": (2, 2, 2)}), {})   # only b moved
    assert set(led._dirty) == {("w1", "b")}
    led.flush()
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}, b={"m": (2, 2, 2)}), {})
    assert not led._dirty
    led.close()


def test_a_clean_stop_leaves_no_worker_counters_behind(tmp_path):
    led = UsageLedger(tmp_path / "usage.sqlite3", Clock())
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}), {})
    led.observe(rep(0, "main", a={"m": (1, 1, 1)}), {})   # (the daemon's own process never spools)
    led.flush()
    with sqlite3.connect(tmp_path / "usage.sqlite3") as db:
        assert [r[0] for r in db.execute("SELECT incarnation FROM seen")] == ["w1"]
    led.observe(rep(1, "w1", a={"m": (2, 100, 50)}), {}, last=True)   # (its process ended)
    led.close()
    with sqlite3.connect(tmp_path / "usage.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM seen").fetchone()[0] == 0


def test_the_spool_of_a_worker_still_running_as_its_daemon_stops_in_order_is_the_next_daemons_to_book(tmp_path):
    """The ledger's close marked the spool of every worker incarnation it had seen booked, one still running too (one
    started again as the daemon stopped, never told to stop): it served on and spooled as it ended, and the next
    daemon skipped its spool (all it served after its last report read was lost).  Only the spools of workers whose
    process ended are marked; the others' booked counters stay, for their spools."""
    from orchestrator.fleet.reports import ReportHub
    from orchestrator.fleet.tenancy import Tenancy
    from orchestrator.fleetfile import load_config_text
    path, clock, hub = tmp_path / "usage.sqlite3", Clock(), ReportHub()
    led = UsageLedger(path, clock)
    ten = Tenancy(load_config_text("fleet: f\nstate_dir: /nonexistent/sf\nmodels: []\n", "f.yaml", {}), hub, led,
                  lambda *a: 1)
    hub.receive(rep(1, "gone", a={"m": (2, 20, 10)}))
    hub.receive(rep(2, "late", a={"m": (5, 50, 30)}))
    ten.tick()
    hub.retire(1)   # its last report read, its process ended; "late" is still there
    ten.settle()
    led.close()
    nxt = UsageLedger(path, clock)
    assert nxt.ingest("gone", {"a": {"m": (2, 20, 10)}}, {})   # (booked already: nothing)
    assert nxt.ingest("late", {"a": {"m": (9, 90, 60)}}, {})   # served 4 more requests after its last report
    nxt.close()
    assert stored(path) == {("2026-11-01T10", "a", "", "m"): (2 + 9, 20 + 90, 10 + 60)}


def test_a_charge_by_reference_adds_only_what_is_new_across_restarts(tmp_path):
    path, clock = tmp_path / "usage.sqlite3", Clock()
    first = UsageLedger(path, clock)
    first.charge_upto("batch:b1", "a", "g", "m", (3, 12, 6))
    first.charge_upto("batch:b1", "a", "g", "m", (3, 12, 6))      # the same work again: nothing more
    assert first.totals() == {("a", "m"): (3, 12, 6)} and first.period_tokens("a", T0 - 1800) == 18
    assert stored(path) == {("2026-11-01T10", "a", "g", "m"): (3, 12, 6)}   # written at once, not at a flush
    first.charge_upto("batch:b1", "a", "g", "m", (5, 20, 10))     # two more lines of the same batch
    assert first.totals() == {("a", "m"): (5, 20, 10)}
    first.observe(rep(1, "x", a={"m": (1, 5, 5)}), {"a": "g"})     # the gateway's counts add to it
    first.close()
    second = UsageLedger(path, clock)   # a restart that charges the batch again (its files read back)
    second.charge_upto("batch:b1", "a", "g", "m", (5, 20, 10))
    second.charge_upto("batch:b1", "a", "g", "m", (4, 30, 9))     # (a file cut: nothing taken back, what grew added)
    second.charge_upto("batch:b2", "a", "g", "m", (1, 1, 1))
    assert second.totals() == {("a", "m"): (1, 11, 1)} and second.period_tokens("a", T0 - 1800) == 52
    second.close()
    assert stored(path) == {("2026-11-01T10", "a", "g", "m"): (7, 36, 16)}


def test_a_reference_known_to_the_process_counts_at_once_for_the_budget_even_when_the_file_is_locked(ledger):
    """(A batch's lines charged while the file could not be written reached no budget until it could: an owner with
    a spent budget ran on.)  Queued charges (write=False) are written by the next flush, in one transaction."""
    assert ledger.charge_upto("batch:b", "a", None, "m", (1, 10, 10), write=False) is True
    assert stored(ledger.path) == {} and ledger.pending_rows == 1
    assert ledger.totals() == {("a", "m"): (1, 10, 10)}   # (counted at once: against what the file held of it)
    assert ledger.flush() is True
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (1, 10, 10)}
    assert ledger.totals() == {("a", "m"): (1, 10, 10)} and ledger.period_tokens("a", T0 - 1800) == 20
    other = sqlite3.connect(ledger.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")   # (the file locked)
    assert ledger.charge_upto("batch:b", "a", None, "m", (3, 30, 30)) is False
    assert ledger.charge_upto("batch:b", "a", None, "m", (4, 40, 40), write=False) is True
    assert ledger.totals() == {("a", "m"): (4, 40, 40)} and ledger.period_tokens("a", T0 - 1800) == 80
    other.execute("ROLLBACK")
    other.close()
    assert ledger.flush() is True
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (4, 40, 40)}
    assert ledger.totals() == {("a", "m"): (4, 40, 40)} and ledger.period_tokens("a", T0 - 1800) == 80


def test_a_period_read_again_counts_the_charges_not_written_yet(ledger):
    """(Counted in memory and waiting for the flush, they were in neither the file nor the rows a new period's read
    adds: the budget lost them for the rest of the period.)"""
    ledger.charge_upto("batch:b", "a", None, "m", (1, 10, 10))
    ledger.charge_upto("batch:b", "a", None, "m", (2, 20, 20), write=False)
    assert ledger.period_tokens("a", T0 - 1800) == 40
    assert ledger.period_tokens("a", T0 - 5 * H) == 40   # (another period: read from the file again)
    assert ledger.flush() is True and ledger.period_tokens("a", T0 - 5 * H) == 40
    assert ledger.period_tokens("a", T0 - 6 * H) == 40


def test_a_charge_waiting_across_an_hour_is_booked_in_the_hours_it_was_charged_in(ledger):
    ledger.charge_upto("batch:b", "a", None, "m", (1, 10, 10))
    ledger.charge_upto("batch:b", "a", None, "m", (2, 20, 20), write=False)
    ledger.clock.t += H
    ledger.charge_upto("batch:b", "a", None, "m", (3, 30, 30), write=False)
    assert ledger.flush() is True
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (2, 20, 20),
                                   ("2026-11-01T11", "a", "", "m"): (1, 10, 10)}


def test_after_a_restart_a_batchs_charges_count_at_once_though_the_file_cannot_be_written(tmp_path):
    """The counters a reference was charged are read from the file (reads still work): what it adds counts for the
    budget at once, not only once written."""
    path, clock = tmp_path / "usage.sqlite3", Clock()
    first = UsageLedger(path, clock)
    first.charge_upto("batch:b", "a", None, "m", (2, 20, 20))
    first.close()
    second = UsageLedger(path, clock)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    assert second.charge_upto("batch:b", "a", None, "m", (3, 30, 30)) is False
    assert second.totals() == {("a", "m"): (1, 10, 10)}
    other.execute("ROLLBACK")
    other.close()
    assert second.flush() is True and second.totals() == {("a", "m"): (1, 10, 10)}
    assert stored(path) == {("2026-11-01T10", "a", "", "m"): (3, 30, 30)}


def test_counters_that_go_down_within_an_hour_take_nothing_back_before_their_write(ledger):
    ledger.charge_upto("batch:b", "a", None, "m", (2, 20, 20), write=False)
    ledger.charge_upto("batch:b", "a", None, "m", (1, 10, 10), write=False)   # (its output file cut)
    assert ledger.flush() is True
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (2, 20, 20)} == \
        {("2026-11-01T10", "a", "", "m"): ledger.totals()[("a", "m")]}


def test_a_reference_whose_counted_charge_waits_is_not_forgotten_to_count_it_again(ledger, monkeypatch):
    from orchestrator.fleet import usagecharges
    monkeypatch.setattr(usagecharges, "MEMO", 2)
    ledger.charge_upto("batch:a", "k", None, "m", (1, 10, 10))
    ledger.charge_upto("batch:a", "k", None, "m", (2, 20, 20), write=False)   # counted, waiting
    for ref in ("batch:b", "batch:c", "batch:d"):   # (more references than the process keeps)
        ledger.charge_upto(ref, "k", None, "m", (1, 1, 1), write=False)
    ledger.charge_upto("batch:a", "k", None, "m", (3, 30, 30), write=False)
    assert ledger.flush() is True
    assert ledger.totals()[("k", "m")] == stored(ledger.path)[("2026-11-01T10", "k", "", "m")] == (6, 33, 33)


def test_a_reference_an_earlier_version_charged_whole_counts_nothing_more(tmp_path):
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(path, Clock())
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO charged (ref, hour) VALUES ('batch:b1:shard-0', '2026-11-01T09')")
    for counts in ((3, 12, 6), (5, 20, 9)):
        ledger.charge_upto("batch:b1:shard-0", "a", None, "m", counts)
    assert ledger.totals() == {} and stored(path) == {}
    ledger.close()


def test_the_counters_of_a_reference_not_charged_for_90_days_go(tmp_path):
    path, clock = tmp_path / "usage.sqlite3", Clock()
    ledger = UsageLedger(path, clock)
    ledger.charge_upto("batch:old", "a", None, "m", (1, 1, 1))
    clock.t += 60 * 86400
    ledger.charge_upto("batch:new", "a", None, "m", (1, 1, 1))
    clock.t += 31 * 86400
    ledger.close()
    with sqlite3.connect(path) as db:
        assert [r for (r,) in db.execute("SELECT ref FROM charged_upto")] == ["batch:new"]


def test_a_reference_an_earlier_version_charged_once_is_not_charged_again(tmp_path):
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(path, Clock())
    with sqlite3.connect(path) as db:   # (a dedicated batch's shard, charged by charge_once before this version)
        db.execute("INSERT INTO charged (ref, hour) VALUES ('batch:b1:shard-0', '2026-11-01T09')")
    assert ledger.charge_upto("batch:b1:shard-0", "a", None, "m", (3, 12, 6)) is True
    assert ledger.charge_upto("batch:b1:shard-1", "a", None, "m", (1, 2, 3)) is True
    assert ledger.totals() == {("a", "m"): (1, 2, 3)}
    ledger.close()


def test_a_charge_the_file_refuses_is_written_by_the_next_flush(ledger):
    other = sqlite3.connect(ledger.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    assert ledger.charge_upto("batch:b1", "a", None, "m", (2, 4, 6)) is False
    assert stored(ledger.path) == {} and ledger.pending_rows == 1
    assert ledger.totals() == {("a", "m"): (2, 4, 6)}   # (counted at once all the same)
    other.execute("ROLLBACK")
    other.close()
    assert ledger.flush() is True and ledger.pending_rows == 0
    ledger.charge_upto("batch:b1", "a", None, "m", (2, 4, 6))
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (2, 4, 6)} and ledger.totals() == {("a", "m"): (2, 4, 6)}


def test_period_tokens_across_hour_buckets(ledger):
    clock = ledger.clock
    ledger.observe(rep(1, "x", a={"m": (1, 100, 0)}), {})        # 10:30
    ledger.flush()
    clock.t += H                                                 # 11:30
    ledger.observe(rep(1, "x", a={"m": (2, 100, 10)}), {})
    this_hour, last_hour = T0 - 1800 + H, T0 - 1800
    assert ledger.period_tokens("a", this_hour) == 10             # pending only
    assert ledger.period_tokens("a", last_hour) == 110            # the file's 10:00 row and the pending one
    assert ledger.period_tokens("b", last_hour) == 0
    ledger.observe(rep(1, "x", a={"m": (3, 100, 30)}), {})        # kept up to date without reading the file
    assert ledger.period_tokens("a", last_hour) == 130
    ledger.flush()
    clock.t += 2 * H                                              # 13:30: a new period reads the file again
    ledger.observe(rep(1, "x", a={"m": (4, 100, 31)}), {})
    assert ledger.period_tokens("a", T0 - 1800 + 3 * H) == 1
    assert ledger.period_tokens("a", T0 - 1800 + H) == 31         # 11:00 (10 + 20) + 13:00 (1)
    assert ledger.period_tokens("a", T0 - 1800 - 24 * H) == 131
    ledger.flush()
    assert sorted(h for h, *_ in stored(ledger.path)) == ["2026-11-01T10", "2026-11-01T11", "2026-11-01T13"]


def test_a_corrupt_file_never_raises_and_loses_nothing_once_moved_away(tmp_path, caplog):
    path = tmp_path / "usage.sqlite3"
    path.write_bytes(b"this is not a database at all" * 200)
    led = UsageLedger(path, Clock())      # logs, does not raise
    led.observe(rep(1, "x", a={"m": (1, 10, 10)}), {})
    assert led.period_tokens("a", T0 - 1800) == 20               # from what this daemon saw
    assert led.flush() is False and led.pending_rows == 1
    assert "cannot" in caplog.text and str(path) in caplog.text
    path.rename(tmp_path / "usage.sqlite3.corrupt")              # what the log tells the operator to do
    led.observe(rep(1, "x", a={"m": (2, 20, 20)}), {})
    assert led.flush() is True and led.pending_rows == 0
    assert stored(path) == {("2026-11-01T10", "a", "", "m"): (2, 20, 20)}


def test_a_locked_file_keeps_the_rows_for_the_next_flush(ledger):
    ledger.observe(rep(1, "x", a={"m": (1, 1, 1)}), {})
    other = sqlite3.connect(ledger.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    t = time.monotonic()
    assert ledger.flush() is False and ledger.pending_rows == 1
    assert time.monotonic() - t < 2                               # the event loop is never held long
    other.execute("ROLLBACK")
    other.close()
    assert ledger.flush() is True
    assert stored(ledger.path) == {("2026-11-01T10", "a", "", "m"): (1, 1, 1)}


def fill(path) -> None:
    """Two days of usage: keys a (group nlp) and b (no group), models m and n."""
    clock = Clock()
    led = UsageLedger(path, clock)
    groups = {"a": "nlp", "b": None}
    led.observe(rep(1, "x", a={"m": (1, 10, 1)}, b={"n": (2, 20, 2)}), groups)       # 2026-11-01T10
    clock.t += 24 * H                                                                  # 2026-11-02T10
    led.observe(rep(1, "x", a={"m": (2, 20, 2), "n": (1, 100, 10)}, b={"n": (3, 30, 3)}), groups)
    led.close()


@pytest.mark.parametrize("by,want", [
    (["key"], [("a", 3, 120, 12), ("b", 3, 30, 3)]),
    (["group"], [(None, 3, 30, 3), ("nlp", 3, 120, 12)]),
    (["model"], [("m", 2, 20, 2), ("n", 4, 130, 13)]),
    (["day"], [("2026-11-01", 3, 30, 3), ("2026-11-02", 3, 120, 12)]),
    (["key", "model"], [("a", "m", 2, 20, 2), ("a", "n", 1, 100, 10), ("b", "n", 3, 30, 3)]),
    (["hour"], [("2026-11-01T10", 3, 30, 3), ("2026-11-02T10", 3, 120, 12)]),
    ([], [(6, 150, 15)]),
])
def test_query_groups_by_any_dimension(tmp_path, by, want):
    fill(tmp_path / "u.sqlite3")
    rows = query(tmp_path / "u.sqlite3", T0 - 2 * 24 * H, T0 + 2 * 24 * H, by)
    assert [tuple(r[b] for b in by) + (r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] \
        == want
    assert all(r["tokens"] == r["prompt_tokens"] + r["completion_tokens"] for r in rows)


@pytest.mark.parametrize("since,until,want", [
    (T0 - 1800, T0 + 1, 33),                 # from 10:00 of the first day, up to and with the hour of until
    (T0, T0, 33),                            # since falls in the 10:00 hour: the whole hour
    (T0 + H, T0 + 24 * H - 1801, 0),         # between the two (until: 09:59:59 of the second day)
    (T0 + H, T0 + 24 * H, 132),              # until falls in the second day's 10:00 hour
    (T0 - 1800 - 24 * H, T0 - 1800, 0),      # until is 10:00 sharp: hours before it only
])
def test_query_bounds_are_whole_hours(tmp_path, since, until, want):
    fill(tmp_path / "u.sqlite3")
    assert sum(r["tokens"] for r in query(tmp_path / "u.sqlite3", since, until, [])) == want


def usage_cli(tmp_path, capsys, *argv: str) -> tuple[int, str, str]:
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"fleet: usage-test\nstate_dir: {tmp_path / 'state'}\nmodels: []\n")
    args = cli.build_parser().parse_args(["usage", "-c", str(cfg), "--since", "2026-10-31", "--until",
                                          "2026-11-03", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_says_when_there_is_no_usage_file(tmp_path, capsys):
    code, out, err = usage_cli(tmp_path, capsys)
    assert code == 1 and out == ""
    assert "no usage recorded yet" in err and str(tmp_path / "state" / "usage.sqlite3") in err


@pytest.mark.parametrize("by,header,first,total", [
    ("key", ["key"], ["a", "3", "120", "12", "132"], ["total", "6", "150", "15", "165"]),
    ("group", ["group"], ["-", "3", "30", "3", "33"], ["total", "6", "150", "15", "165"]),
    ("model", ["model"], ["m", "2", "20", "2", "22"], ["total", "6", "150", "15", "165"]),
    ("day", ["day"], ["2026-11-01", "3", "30", "3", "33"], ["total", "6", "150", "15", "165"]),
    ("key,day", ["key", "day"], ["a", "2026-11-01", "1", "10", "1", "11"],
     ["total", "", "6", "150", "15", "165"]),
])
def test_cli_table(tmp_path, capsys, by, header, first, total):
    fill(tmp_path / "state" / "usage.sqlite3")
    code, out, err = usage_cli(tmp_path, capsys, "--by", by)
    assert code == 0, err
    lines = [[c.strip() for c in line.strip("│┃").split("│" if "│" in line else "┃")]
             for line in out.splitlines() if line.startswith(("│", "┃"))]
    assert lines[0] == header + ["requests", "prompt tokens", "completion tokens", "tokens"]
    assert lines[1] == first and lines[-1] == total
    assert "usage 2026-10-31 00:00 to 2026-11-03 00:00 UTC" in out


def test_cli_json_and_csv(tmp_path, capsys):
    fill(tmp_path / "state" / "usage.sqlite3")
    code, out, _ = usage_cli(tmp_path, capsys, "--by", "group", "model", "--json")
    assert code == 0
    assert json.loads(out) == [
        {"group": None, "model": "n", "requests": 3, "prompt_tokens": 30, "completion_tokens": 3, "tokens": 33},
        {"group": "nlp", "model": "m", "requests": 2, "prompt_tokens": 20, "completion_tokens": 2, "tokens": 22},
        {"group": "nlp", "model": "n", "requests": 1, "prompt_tokens": 100, "completion_tokens": 10, "tokens": 110}]
    code, out, _ = usage_cli(tmp_path, capsys, "--by", "key,day", "--csv")
    assert code == 0
    assert list(csv.reader(io.StringIO(out))) == [
        ["key", "day", "requests", "prompt_tokens", "completion_tokens", "tokens"],
        ["a", "2026-11-01", "1", "10", "1", "11"], ["a", "2026-11-02", "2", "110", "11", "121"],
        ["b", "2026-11-01", "2", "20", "2", "22"], ["b", "2026-11-02", "1", "10", "1", "11"]]
    code, out, _ = usage_cli(tmp_path, capsys, "--by", "group", "--csv")
    assert out.splitlines()[1:] == [",3,30,3,33", "nlp,3,120,12,132"]   # no group: an empty field


@pytest.mark.parametrize("text,want", [
    ("now", T0),
    ("24h", T0 - 24 * H),
    ("7d", T0 - 7 * 24 * H),
    ("2w", T0 - 14 * 24 * H),
    ("30m", T0 - 1800),
    ("2026-11-01", T0 - 10.5 * H),
    ("2026-11-01T13:00", T0 + 2.5 * H),
    ("2026-11-01T13:00+01:00", T0 + 1.5 * H),
])
def test_cli_times(text, want):
    assert cli._when(text, now=T0) == want


@pytest.mark.parametrize("argv", [["--since", "yesterday"], ["--by", "tenant"], ["--json", "--csv"]])
def test_cli_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["usage", *argv])
    assert exc.value.code == 2


def test_metrics_show_the_ledgers_errors_rows_waiting_and_the_state_dirs_free_space(ledger, tmp_path):
    """(A ledger that could not be written said so only in the log, once a minute.)"""
    free = FreeSpace(tmp_path)
    metrics = Metrics(storage=lambda: storage_stats(free, ledger, 1 << 30))
    assert "\nslurmfleet_state_dir_free_bytes " not in metrics.render().decode()   # (not sampled yet)
    free.read()   # (what the daemon's scrape loop samples in a thread)
    text = metrics.render().decode()
    assert metric_sum(text, "slurmfleet_usage_ledger_errors_total") == 0
    assert metric_sum(text, "slurmfleet_usage_ledger_pending_rows") == 0
    assert metric_sum(text, "slurmfleet_state_dir_min_free_bytes") == 1 << 30
    st = os.statvfs(tmp_path)
    assert metric_sum(text, "slurmfleet_state_dir_free_bytes") == pytest.approx(st.f_bavail * st.f_frsize, rel=0.01)
    other = sqlite3.connect(ledger.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")   # (another process holds the file)
    ledger.observe(rep(1, "x", a={"m": (1, 2, 3)}), {})
    assert ledger.flush() is False and ledger.charge_upto("batch:b", "a", None, "m", (1, 1, 1)) is False
    text = metrics.render().decode()
    assert metric_sum(text, "slurmfleet_usage_ledger_errors_total") == 2
    assert metric_sum(text, "slurmfleet_usage_ledger_pending_rows") == 2
    other.execute("ROLLBACK")
    other.close()
    assert ledger.flush() is True
    assert metric_sum(metrics.render().decode(), "slurmfleet_usage_ledger_pending_rows") == 0
    gone = FreeSpace(tmp_path / "gone")
    gone.read()
    text = Metrics(storage=lambda: storage_stats(gone, ledger, 1 << 30)).render().decode()
    assert "\nslurmfleet_state_dir_free_bytes " not in text and "\nslurmfleet_state_dir_min_free_bytes 1.07" in text


def test_metrics_per_key_series(ledger):
    ledger.observe(rep(1, "x", a=TenantUsage(models={"m": (3, 30, 12)}, rejected={"rpm": 2})), {})
    ledger.observe(rep(2, "y", a=TenantUsage(models={"m": (1, 5, 1), "n": (1, 7, 7)}, rejected={"rpm": 1})), {})
    ledger.observe(rep(2, "y", stranger=TenantUsage(models={"m": (9, 9, 9)})), {})   # not configured (any more)
    live = [rep(1, "x", a=TenantUsage(inflight=2)), rep(2, "y", a=TenantUsage(inflight=1))]
    metrics = Metrics(key_usage=lambda: key_usage(ledger, live, ["a", "b"]))
    text = metrics.render().decode()
    for name, labels, want in [
        ("slurmfleet_key_requests_total", {"key": "a", "model": "m"}, 4),
        ("slurmfleet_key_requests_total", {"key": "a", "model": "n"}, 1),
        ("slurmfleet_key_tokens_total", {"key": "a", "model": "m", "kind": "prompt"}, 35),
        ("slurmfleet_key_tokens_total", {"key": "a", "model": "m", "kind": "completion"}, 13),
        ("slurmfleet_key_tokens_total", {"key": "a", "model": "n", "kind": "completion"}, 7),
        ("slurmfleet_key_rejections_total", {"key": "a", "reason": "rpm"}, 3),
        ("slurmfleet_key_inflight", {"key": "a"}, 3),
    ]:
        assert metric_sum(text, name, **labels) == want, (name, labels)
    # every configured key has its refusal and in-flight series from zero; an unconfigured name has none
    assert 'slurmfleet_key_rejections_total{key="b",reason="budget"} 0.0' in text
    assert 'slurmfleet_key_inflight{key="b"} 0.0' in text
    assert "stranger" not in text
    assert "# TYPE slurmfleet_key_tokens_total counter" in text


def test_metrics_of_an_open_gateway_name_its_anonymous_tenant(ledger):
    ledger.observe(rep(0, "x", anonymous={"m": (1, 2, 3)}), {})
    text = Metrics(key_usage=lambda: key_usage(ledger, [], [])).render().decode()
    assert metric_sum(text, "slurmfleet_key_requests_total", key="anonymous", model="m") == 1
    assert metric_sum(text, "slurmfleet_key_rejections_total", key="anonymous") == 0
    assert 'slurmfleet_key_inflight{key="anonymous"} 0.0' in text
    # without a source (the default) the families are there, empty
    assert "slurmfleet_key_requests_total{" not in Metrics().render().decode()


def test_hour_bucket_is_utc():
    assert hour_bucket(T0) == "2026-11-01T10" and hour_bucket(T0 + 13.5 * H) == "2026-11-02T00"


def test_a_key_a_reload_removes_keeps_its_group_for_what_ends_after(tmp_path):
    """The tokens of a key's requests that end after a reload removed it reach the ledger (the README promises
    it) under the key's group: they were booked under no group, and `usage --by group` showed them under -."""
    from orchestrator.fleet.reports import ReportHub
    from orchestrator.fleet.tenancy import Tenancy
    from orchestrator.fleetfile import load_config_text
    text = "fleet: f\nstate_dir: /nonexistent/sf\nmodels: []\ngateway:\n  api_keys:\n{keys}"
    both = "    - {name: alice, key: sk-a, group: research}\n    - {name: bob, key: sk-b}\n"
    hub = ReportHub()
    led = UsageLedger(tmp_path / "usage.sqlite3", Clock())
    ten = Tenancy(load_config_text(text.format(keys=both), "f.yaml", {}), hub, led, lambda *a: 1)
    hub.receive(rep(1, "x", alice={"m": (1, 10, 5)}))
    ten.tick()
    ten.set_config(load_config_text(text.format(keys="    - {name: bob, key: sk-b}\n"), "f.yaml", {}))
    hub.receive(rep(1, "x", alice={"m": (2, 20, 25)}))   # its request in flight at the reload ends
    ten.tick()
    led.flush()
    rows = {r["group"]: r for r in query(tmp_path / "usage.sqlite3", T0 - H, T0 + H, ["group"])}
    assert set(rows) == {"research"} and rows["research"]["completion_tokens"] == 25
    led.close()


def test_a_spool_is_booked_in_the_hour_it_was_written_not_the_hour_it_was_read(tmp_path):
    """A daemon killed at 23:58 and started the next morning booked its workers' spools on the next day (the
    next month's budget, the wrong invoice): a spool says when it was written."""
    path, clock = tmp_path / "usage.sqlite3", Clock()
    written = clock.t - 10 * 3600
    new = UsageLedger(path, clock)
    assert new.ingest("w1", {"a": {"m": (1, 10, 5)}}, {"a": "g"}, at=written)
    assert new.ingest("w2", {"a": {"m": (1, 1, 1)}}, {"a": "g"}, at=clock.t + 3600)   # (a clock ahead: now)
    new.close()
    assert stored(path) == {(hour_bucket(written), "a", "g", "m"): (1, 10, 5),
                            (hour_bucket(clock.t), "a", "g", "m"): (1, 1, 1)}


def test_a_workers_spool_carries_when_it_was_written_to_the_tenancy_that_books_it(tmp_path):
    from orchestrator.fleet.reports import ReportHub
    from orchestrator.fleet.tenancy import Tenancy
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.worker import spool_usage
    from orchestrator.statedir import StateDir

    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}/s\ngateway: {{api_keys: [{{name: a, key: sk-a}}]}}\n"
                           "models: []\n", "f.yaml", {})
    state = StateDir(cfg.state_dir)
    state.create()
    t0 = time.time()
    spool_usage(state, rep(1, "w1", a={"m": (1, 10, 5)}))
    doc = json.loads(next(state.usage_spool.glob("*.json")).read_text())
    assert t0 <= doc["at"] <= time.time()
    clock = Clock()
    clock.t = doc["at"] + 30 * 3600   # read by a daemon started the next day
    ledger = UsageLedger(state.root / "usage.sqlite3", clock)
    Tenancy(cfg, ReportHub(), ledger, lambda *a: 0).book_spool()
    ledger.close()
    assert stored(state.root / "usage.sqlite3") == {(hour_bucket(doc["at"]), "a", "", "m"): (1, 10, 5)}


def test_marks_of_spools_booked_90_days_ago_go_but_one_whose_file_is_still_there(tmp_path):
    """(each worker incarnation a daemon stopped or lost left a `charged` row for good: one per worker and
    restart, for ever)"""
    path, spool, clock = tmp_path / "usage.sqlite3", tmp_path / "usage-spool", Clock()
    spool.mkdir()
    (spool / "w2.json").write_text("{}")   # its removal failed after it was booked
    ledger = UsageLedger(path, clock, spool)
    with sqlite3.connect(path) as db:   # (an earlier version's whole charge)
        db.execute("INSERT INTO charged (ref, hour) VALUES ('batch:b1:shard-0', '2026-11-01T09')")
    for inc in ("w1", "w2"):
        assert ledger.ingest(inc, {"a": {"m": (1, 1, 1)}}, {})
    clock.t += 30 * 86400
    assert ledger.ingest("w3", {"a": {"m": (1, 1, 1)}}, {})
    clock.t += 61 * 86400
    ledger.close()
    with sqlite3.connect(path) as db:
        assert sorted(r for (r,) in db.execute("SELECT ref FROM charged")) == ["spool:w2", "spool:w3"]
    again = UsageLedger(path, clock, spool)
    assert again.ingest("w2", {"a": {"m": (1, 1, 1)}}, {})   # still booked once
    again.close()
    assert sum(r["requests"] for r in query(path, 0, clock.t + H, ["key"])) == 3


async def test_a_hung_state_dir_never_blocks_a_scrape_and_is_read_by_one_thread_at_a_time(ledger, tmp_path,
                                                                                           monkeypatch):
    """statvfs of a hung NFS or Lustre mount does not return: it ran in the scrape, on the daemon's event loop, and
    froze the daemon (its ticks, the admin API, a gateway in its process).  Now a thread samples it, one at a
    time, and a scrape shows the last sample."""
    import asyncio
    import threading
    real, hung, calls = os.statvfs, threading.Event(), []

    def statvfs(path):
        calls.append(path)
        hung.wait(10)
        return real(path)
    monkeypatch.setattr(os, "statvfs", statvfs)
    free = FreeSpace(tmp_path)
    metrics = Metrics(storage=lambda: storage_stats(free, ledger, 1 << 30))
    for _ in range(3):
        free.sample()
        await asyncio.sleep(0.05)
        assert "slurmfleet_state_dir_min_free_bytes" in metrics.render().decode()   # (at once, as it hangs)
    assert len(calls) == 1 and free.free is None
    hung.set()
    for _ in range(100):
        if free.free is not None:
            break
        await asyncio.sleep(0.05)
    assert metric_sum(metrics.render().decode(), "slurmfleet_state_dir_free_bytes") > 0


async def test_a_stuck_state_dir_holds_the_ledgers_flush_not_the_event_loop(tmp_path, monkeypatch):
    """The tenancy loop flushed the ledger (every 2 s) on the event loop: a state dir stalled on NFS or Lustre
    stalled every client of a gateway in the daemon's process.  The flush writes in the ledger's own thread; the
    counting goes on meanwhile, no second write is queued behind the stuck one, a budget read while it is out
    does without the file, and what it held lands once the file answers."""
    import asyncio

    from stuckio import Stuck
    from orchestrator.fleet import tenancy as tenancy_mod
    from orchestrator.fleet.reports import ReportHub
    from orchestrator.fleetfile import load_config_text

    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}/s\ngateway: {{api_keys: [{{name: a, key: sk-a}}, "
                           "{name: c, key: sk-c, budget_tokens: 1000, budget_period: day}]}\nmodels: []\n", "f.yaml", {})
    path = tmp_path / "s" / "usage.sqlite3"
    ledger, hub, counts = UsageLedger(path), ReportHub(), {"m": (1, 10, 5)}
    hub.attach(0, lambda: rep(0, "i", a=dict(counts)))
    tenancy = tenancy_mod.Tenancy(cfg, hub, ledger, lambda *a: 0)
    tenancy.turn()   # (the budget's period read: cached)
    stuck, real = Stuck(), UsageLedger._connect

    def connect(self):
        stuck.wait()
        return real(self)
    monkeypatch.setattr(UsageLedger, "_connect", connect)
    monkeypatch.setattr(tenancy_mod, "INTERVAL_S", 0.02)
    task = asyncio.create_task(tenancy.run())
    try:
        gap = await stuck.longest_gap()
        assert gap < 0.25, f"the event loop stood still {gap:.2f}s while the ledger was written"
        counts["m"] = (2, 20, 10)   # counted meanwhile
        ticks = tenancy.ticks
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        assert ledger.period_tokens("c", time.time() - 3600) == 0 and time.monotonic() - t0 < 0.2   # (a miss)
        assert tenancy.ticks > ticks + 4 and stuck.calls == 1 and ledger.pending_rows == 2   # (out, and since)
        assert ledger.totals() == {("a", "m"): (2, 20, 10)}
        stuck.release.set()
        for _ in range(300):
            if stored(path).get((hour_bucket(time.time()), "a", "", "m")) == (2, 20, 10) and not ledger.pending_rows:
                break
            await asyncio.sleep(0.01)
        assert stored(path) == {(hour_bucket(time.time()), "a", "", "m"): (2, 20, 10)} and ledger.pending_rows == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ledger.close()
