"""A background response of the Responses API is charged once, whichever gateway process or daemon dies while it
runs (orchestrator/fleet/background.py, orchestrator/gateway/stored.py): the process that follows it lists it in
its reports until it charges it; the fleet hands those of a process that is gone to a live one through the
routing table, and writes those not charged yet with the usage ledger's counters for the next daemon."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import time
import urllib.request

import pytest

from conftest import fleet_config, metric_sum, sim_model, wait_for
from gateway_harness import Harness, Sim
from orchestrator.contract import Background, GatewayReport
from orchestrator.fleet.background import SCHEMA, BackgroundBook
from orchestrator.fleet.usage import UsageLedger
from orchestrator.gateway import stored

X, Y = Background("resp_x", "alice", "m", "job-1", 7), Background("resp_y", "bob", "m", "job-2", 9)


def rep(process: int, version: int, *bs: Background, inc: str = "") -> GatewayReport:
    return GatewayReport(process, version, incarnation=inc or f"inc{process}", background=bs)


def test_a_gone_processes_responses_go_to_the_least_loaded_live_process_until_one_charges_them():
    book = loaded()
    book.observe([rep(1, 5, X, Y), rep(2, 5), rep(3, 5)], [], 0)
    assert book.adopt([1, 2, 3]) == {} and book.pending() == 2   # followed: nothing to hand out
    # worker 1 dies: both of its responses are orphans, one to each of the others (fewest, then lowest)
    book.observe([rep(2, 5), rep(3, 5)], [rep(1, 5, X, Y)], 1)
    given = book.adopt([2, 3])
    assert given == {2: (X,), 3: (Y,)}
    book.published(6)
    # a process not on table 6 yet has not taken it: still handed to it
    book.observe([rep(2, 5), rep(3, 5)], [], 2)
    assert book.adopt([2, 3]) == given and book.pending() == 2
    # 2 takes X (lists it); 3 routes on table 6 without Y: it took Y and charged it already
    book.observe([rep(2, 6, X), rep(3, 6)], [], 3)
    assert book.adopt([2, 3]) == {} and book.pending() == 1
    # 2 dies following X: handed on to 3
    book.observe([rep(3, 6)], [rep(2, 6, X)], 4)
    assert book.adopt([3]) == {3: (X,)}
    book.published(7)
    # 3 dies before it saw table 7: X again, to the process started in its place
    book.observe([rep(4, 6)], [rep(3, 6)], 5)
    assert book.adopt([4]) == {4: (X,)}
    book.published(8)
    # 4 took it and charged it, then died: its last report (table 8, without X) settles it
    book.observe([rep(5, 8)], [rep(4, 8)], 6)
    assert book.adopt([5]) == {} and book.pending() == 0


def test_a_worker_that_exits_while_its_daemon_runs_spools_what_another_took_and_charged_it_is_not_handed_out_again():
    """A worker stopped (SIGTERM, the daemon restarts it) while following X: its last report and its spool list X.
    Worker 2 takes X over and charges it; the spool, booked seconds later, must not make it an orphan again."""
    book = loaded()
    book.observe([rep(1, 5, X), rep(2, 5)], [], 0)
    book.observe([rep(2, 5)], [rep(1, 5, X)], 1)
    assert book.adopt([2]) == {2: (X,)}
    book.published(6)
    book.observe([rep(2, 6, X)], [], 2)   # taken
    book.observe([rep(2, 7)], [], 3)      # charged
    assert book.adopt([2]) == {} and book.pending() == 0
    book.spooled("inc1", [X], [])         # worker 1's spool, booked at the next flush
    book.observe([rep(2, 7)], [], 4)
    assert book.adopt([2]) == {} and book.pending() == 0
    # one charged before its process was seen routing on the table that handed it out (never listed) alike
    book.observe([rep(2, 7, Y), rep(3, 7)], [], 5)
    book.observe([rep(3, 7)], [rep(2, 7, Y)], 6)
    assert book.adopt([3]) == {3: (Y,)}
    book.published(8)
    book.observe([rep(3, 8)], [], 7)
    book.spooled("inc2", [Y], [])
    assert book.adopt([3]) == {} and book.pending() == 0


def test_a_process_does_not_take_over_a_background_response_it_charged_already():
    """Handed out again (a late spool of the process it was taken from): its key is not charged twice."""
    class Table:
        adopt = {2: (X, Y)}
    gw = type("Gw", (), {})()
    gw.process, gw.shutting_down, gw.following, later = 2, False, stored.Following(), []
    gw.later, gw.on_follow = later.append, lambda: None
    gw.following.now[X.rid] = X
    gw.following.settle(X.rid)   # X followed and charged
    stored.take(gw, Table)
    assert gw.following.report() == (Y,) and len(later) == 1
    later[0].close()
    stored.take(gw, Table)   # (each once)
    assert gw.following.report() == (Y,) and len(later) == 1


def test_a_response_handed_to_a_stopping_process_is_handed_out_again_once_it_is_gone_not_taken_for_charged():
    """A process that stops follows nothing new; its reports went on with the table that handed it X, without X,
    which the fleet read as "taken and charged": X was never charged.  It lists X to its end now."""
    class Table:
        adopt = {2: (X,)}
    gw = type("Gw", (), {})()
    gw.process, gw.shutting_down, gw.following, later = 2, True, stored.Following(), []
    gw.later, gw.on_follow = later.append, lambda: None
    stored.take(gw, Table)
    assert later == [] and gw.following.report() == (X,)
    book = loaded()
    book.observe([rep(1, 5, X), rep(2, 5)], [], 0)
    book.observe([rep(2, 5)], [rep(1, 5, X)], 1)   # X's process gone: handed to 2, which is stopping
    assert book.adopt([2]) == {2: (X,)}
    book.published(6)
    book.observe([rep(2, 6, *gw.following.report())], [], 2)   # its report on that table lists X
    assert book.pending() == 1
    book.observe([rep(3, 6)], [rep(2, 6, *gw.following.report())], 3)   # gone: X goes to the next process
    assert book.adopt([3]) == {3: (X,)}


def loaded(hold_s: float = 40, spool=None, clock=lambda: 0.0) -> BackgroundBook:
    """A book as a daemon with an empty ledger file starts it."""
    book = BackgroundBook(hold_s, spool, clock)
    book.load(sqlite3.connect(":memory:"))
    return book


def rows(db: sqlite3.Connection) -> list[tuple[str, str]]:
    return db.execute("SELECT rid, incarnation FROM background ORDER BY rid").fetchall()


def test_the_rows_name_the_worker_whose_spool_may_still_come():
    book = loaded()
    book.observe([rep(0, 1, X), rep(1, 1, Y, inc="w1")], [], 0)
    assert book.dirty
    db = sqlite3.connect(":memory:")
    book.write(db)
    book.written()
    assert not book.dirty
    assert rows(db) == [("resp_x", ""), ("resp_y", "w1")]   # (process 0 dies with its daemon: it never spools)
    # handed to worker 2: its row names it as soon as the table that hands it out is published
    book.observe([rep(0, 1, X), rep(2, 1, inc="w2")], [rep(1, 1, Y, inc="w1")], 1)
    assert book.adopt([2]) == {2: (Y,)}
    book.published(2)
    book.write(db)
    assert rows(db) == [("resp_x", ""), ("resp_y", "w2")]
    # a second SIGTERM: the daemon exits while worker 2 is alive (it may charge Y in its grace): its spool decides
    book.close()
    book.write(db)
    assert rows(db) == [("resp_x", ""), ("resp_y", "w2")]
    # an orderly stop: every worker's last report is in, no spool will come
    book.observe([rep(0, 1, X)], [rep(2, 2, Y, inc="w2")], 2)
    book.close()
    book.write(db)
    assert rows(db) == [("resp_x", ""), ("resp_y", "")]


def test_a_killed_daemons_worker_settles_by_its_spool_what_it_followed_or_was_handed(tmp_path):
    db = sqlite3.connect(":memory:")
    db.execute(SCHEMA)
    z = Background("resp_z", "carol", "m", "job-3", 5)
    db.executemany("INSERT INTO background VALUES (?, ?, ?, ?, ?, ?)", [
        ("resp_x", "alice", "m", "job-1", 7, ""), ("resp_y", "bob", "m", "job-2", 9, "w1"),
        ("resp_z", "carol", "m", "job-3", 5, "w1")])
    now = [100.0]
    # (still followed, charged): Y followed on, Z charged by w1 after the last write / both charged / neither
    # mentioned (handed to w1 in a table it never applied): they are not charged
    for spooled, expect in ((([Y], ["resp_z"]), {3: (X, Y)}), (([], ["resp_y", "resp_z"]), {3: (X,)}),
                            (([], []), {3: (X, Y, z)})):
        nxt = BackgroundBook(40, tmp_path, lambda: now[0])
        nxt.load(db)
        nxt.observe([rep(3, 1, inc="w3")], [], 101)
        assert nxt.adopt([3]) == {3: (X,)} and nxt.pending() == 3   # Y and Z wait for w1's spool
        nxt.spooled("w1", *spooled)
        nxt.observe([rep(3, 1, inc="w3")], [], 102)
        assert nxt.adopt([3]) == expect, spooled
    # a response the rows held for w1 that another worker's spool says it still followed: one row, its orphan
    nxt = BackgroundBook(40, tmp_path, lambda: now[0])
    nxt.load(db)
    nxt.spooled("w2", [Y], [])
    nxt.observe([rep(3, 1, inc="w3")], [], 102)
    out = sqlite3.connect(":memory:")
    nxt.write(out)
    assert rows(out) == [("resp_x", ""), ("resp_y", ""), ("resp_z", "w1")]
    # no spool: after the hold; but not while a spool is on disk (the ledger locked: not booked yet)
    nxt = BackgroundBook(40, tmp_path, lambda: now[0])
    nxt.load(db)
    (tmp_path / "w1.json").write_text("{}")
    nxt.observe([rep(3, 1, inc="w3")], [], 141)
    assert nxt.adopt([3]) == {3: (X,)}
    (tmp_path / "w1.json").unlink()
    nxt.observe([rep(3, 1, inc="w3")], [], 142)
    assert nxt.adopt([3]) == {3: (X, Y, z)}


def test_what_the_last_daemon_left_is_not_written_over_before_it_could_be_read(tmp_path):
    ledger = UsageLedger(tmp_path / "usage.sqlite3")
    first = BackgroundBook(40)
    ledger.attach(first)
    first.observe([rep(0, 1, X)], [], 0)
    assert ledger.flush()
    nxt = UsageLedger(tmp_path / "usage.sqlite3")
    book = BackgroundBook(40)
    read, tries = book.load, []

    def locked_once(db):   # (the file locked as the daemon starts)
        tries.append(db)
        if len(tries) == 1:
            raise sqlite3.OperationalError("database is locked")
        read(db)
    book.load = locked_once
    nxt.attach(book)
    assert not book.loaded
    book.observe([rep(0, 1, Y)], [], 1)
    assert not book.dirty
    assert nxt.flush() and book.loaded   # read at the next flush, then written with what it held (X) and Y
    assert [r for (r,) in sqlite3.connect(tmp_path / "usage.sqlite3").execute(
        "SELECT rid FROM background ORDER BY rid")] == ["resp_x", "resp_y"]
    assert book.adopt([0]) == {0: (X,)}   # (X: the last daemon's, handed out)


def test_a_dead_workers_background_response_is_charged_once_by_another_process(tmp_path):
    """A worker died while a background response of its ran: the fleet hands it to the live gateway process,
    which follows it on its replica and charges the key what the response ended with, once."""
    sim = Sim("bg-take", "--tokens-per-s", "50", env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    h = Harness(tmp_path, "  - name: m\n    engine: simulator\n    container: {enabled: false}\n",
                "api_keys:\n  - {name: alice, key: sk-alice}\n")
    try:
        h.set_ready([sim.backend()])
        # what worker 1 did before it died: a background response made on the replica, under the id it gave it
        rid = stored.response_id(sim.secret, "alice", secrets.token_hex(8))
        body = {"model": "m", "input": "a question", "background": True, "max_output_tokens": 30,
                "ignore_eos": True, "request_id": rid}
        req = urllib.request.Request(sim.url + "/v1/responses", data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {sim.secret}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["status"] == "queued"
        b = Background(rid, "alice", "m", "job-bg-take", 3)
        h.hub.receive(GatewayReport(1, h.publisher.table.version, incarnation="w1", background=(b,)))
        h.tenancy_tick()
        assert h.tenancy.background.live == {rid: (b, "w1")}
        h.hub.retire(1)
        h.tenancy_tick()   # the orphan handed to process 0, the one left
        assert h.publisher.table.adopt == {0: (b,)}
        assert h.gateway.report().background == (b,)   # taken at once, listed until charged
        usage = h.gateway.tenants.by_name["alice"].usage
        done = wait_for(lambda: (d := json.loads(sim.get(f"/v1/responses/{rid}")))["status"] == "incomplete" and d,
                        15, "the response's end")
        wait_for(lambda: usage.get("m", [0, 0, 0])[1:] == [done["usage"]["input_tokens"], 30], 15, "charged")
        assert h.gateway.report().background == ()
        for _ in range(3):   # settled: not handed out again
            h.tenancy_tick(flush=True)
        assert h.publisher.table.adopt == {} and h.tenancy.background.pending() == 0
        assert usage["m"][1:] == [done["usage"]["input_tokens"], 30]   # once
        assert h.tenancy.ledger.totals()[("alice", "m")][1:] == (done["usage"]["input_tokens"], 30)
    finally:
        h.close()
        sim.stop()


def test_a_background_response_outlives_its_daemon_and_is_charged_by_the_next(tmp_path):
    """The daemon was killed while a background response ran (no orderly stop): the ledger's file holds it, and
    the next daemon's gateway takes it over and charges it once; if its replica is gone by then, its prompt."""
    sim = Sim("bg-next", "--tokens-per-s", "20", env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    models = "  - name: m\n    engine: simulator\n    container: {enabled: false}\n"
    keys = "api_keys:\n  - {name: alice, key: sk-alice}\n"
    h = Harness(tmp_path, models, keys)
    try:
        h.set_ready([sim.backend()])
        made = [json.loads(urllib.request.urlopen(urllib.request.Request(
            h.base + "/v1/responses", data=json.dumps({
                "model": "m", "input": f"question {i}", "background": True, "max_output_tokens": n,
                "ignore_eos": True}).encode(), headers={"Authorization": "Bearer sk-alice",
                                                        "Content-Type": "application/json"}), timeout=10).read())
            for i, n in enumerate((40, 2000))]
        assert [m["status"] for m in made] == ["queued", "queued"]
        h.tenancy_tick(flush=True)   # written down with the ledger's counters
        rows = sqlite3.connect(tmp_path / "usage.sqlite3").execute("SELECT rid FROM background").fetchall()
        assert sorted(r for (r,) in rows) == sorted(m["id"] for m in made)
    finally:
        h.close()   # (killed: no tenancy close, nothing more written)
    # the next daemon, on the same state directory: the first response's replica is still there, the second's
    # gone by then (its job ended), so that one is charged its prompt
    h2 = Harness(tmp_path, models, keys)
    try:
        assert h2.tenancy.background.pending() == 2
        h2.set_ready([sim.backend()])
        h2.tenancy_tick()
        assert {b.rid for b in h2.publisher.table.adopt[0]} == {m["id"] for m in made}
        usage = h2.gateway.tenants.by_name["alice"].usage
        done = wait_for(lambda: (d := json.loads(sim.get(f"/v1/responses/{made[0]['id']}")))["status"] == "incomplete"
                        and d, 15, "the first's end")
        wait_for(lambda: usage.get("m", [0, 0, 0])[2] == 40, 15, "its completion charged")
        assert h2.gateway.report().background[0].rid == made[1]["id"]   # the other still running
        h2.set_ready([])
        sim.stop()   # its job ended: the second response gone with it
        wait_for(lambda: h2.gateway.report().background == (), 30, "the second settled")
        assert usage["m"][1:] == [done["usage"]["input_tokens"] + 3, 40]   # (its prompt: 12 bytes of JSON / 4)
        for _ in range(2):
            h2.tenancy_tick(flush=True)
        assert h2.tenancy.background.pending() == 0 and h2.publisher.table.adopt == {}
        rows = sqlite3.connect(tmp_path / "usage.sqlite3").execute("SELECT rid FROM background").fetchall()
        assert rows == []
    finally:
        h2.close()
        sim.stop()


def test_a_killed_workers_background_responses_are_charged_by_the_others(tmp_path, fleet_name, daemons):
    """On the cluster, through gateway worker processes: background responses spread over two workers, one of
    them SIGKILLed while they run; every response is charged once, by whichever process ends up following it.
    (Not marked ``cluster``: it checks the gateway's workers, not a SLURM release's behaviour, so the other
    release's pass of ``.ci/other-release`` leaves it out; its fixtures hold the cluster all the same.)"""
    from test_daemon import worker_pids
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model(
        "m", 1, simulator={"tokens_per_s": 50}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})],
        gateway={"workers": 2, "api_keys": [{"name": "alice", "key": "sk-alice"}]}))
    wait_for(lambda: len(d.ready("m")) == 1, 60, "READY")

    def create(i: int) -> tuple[str, str]:
        req = urllib.request.Request(d.gateway + "/v1/responses", data=json.dumps({
            "model": "m", "input": f"question {i}", "background": True, "max_output_tokens": 100,
            "ignore_eos": True}).encode(), headers={"Authorization": "Bearer sk-alice",
                                                    "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:   # (a connection each: the kernel spreads them)
            return json.loads(r.read())["id"], r.headers["x-request-id"][:16]
    made = [create(i) for i in range(4)]
    while len({w for _, w in made}) < 2 and len(made) < 30:   # (until both workers follow some)
        made.append(create(len(made)))
    assert len({w for _, w in made}) == 2
    pending = lambda: metric_sum(d.metrics(), "slurmfleet_key_background_responses", key="alice")  # noqa: E731
    wait_for(lambda: pending() == len(made), 5, "the fleet knows every response to charge")
    os.kill(sorted(worker_pids(d.proc.pid))[0], signal.SIGKILL)

    def read(rid: str) -> dict:
        req = urllib.request.Request(f"{d.gateway}/v1/responses/{rid}", headers={"Authorization": "Bearer sk-alice"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        except OSError:   # (a connection the killed worker's socket had taken, before its successor listens)
            return {"status": ""}
    ends = [wait_for(lambda: (x := read(rid))["status"] == "incomplete" and x, 30, "its end") for rid, _ in made]
    prompt = sum(e["usage"]["input_tokens"] for e in ends)
    charged = lambda kind: metric_sum(d.metrics(), "slurmfleet_key_tokens_total", key="alice", kind=kind)  # noqa: E731
    wait_for(lambda: charged("completion") == len(made) * 100, 30, "every response charged")
    time.sleep(1)   # (two reports: no second charge comes)
    assert charged("completion") == len(made) * 100 and charged("prompt") == prompt
    assert pending() == 0 and "took over background response" in d.logs()


def test_a_workers_spool_settles_its_responses_once_in_the_transaction_that_books_it(tmp_path):
    """A spool booked now hands on what its worker still followed, in the transaction that books its counters;
    one booked already (marked by a daemon that stopped in order, its file left behind) settles nothing again."""
    from orchestrator.fleet.reports import ReportHub
    from orchestrator.fleet.tenancy import Tenancy
    from orchestrator.fleetfile import load_config_text
    from orchestrator.gateway.worker import spool_usage
    from orchestrator.statedir import StateDir

    cfg = load_config_text(f"fleet: f\nstate_dir: {tmp_path}/s\ngateway: {{api_keys: [{{name: alice, key: sk-a}}]}}\n"
                           "models: []\n", "f.yaml", {})
    state = StateDir(cfg.state_dir)
    state.create()
    path = state.root / "usage.sqlite3"
    for booked_before in (False, True):
        spool_usage(state, rep(1, 1, X, inc="w1"), ("resp_old",))
        ledger = UsageLedger(path, spool=state.usage_spool)
        if booked_before:
            with sqlite3.connect(path) as db:
                db.execute("DELETE FROM background")
                db.execute("INSERT OR IGNORE INTO charged (ref, hour) VALUES ('spool:w1', '2026-12-06T17')")
        tenancy = Tenancy(cfg, ReportHub(), ledger, lambda *a: 0)
        tenancy.book_spool()
        assert not list(state.usage_spool.glob("*.json"))
        written = sqlite3.connect(path).execute("SELECT rid FROM background").fetchall()
        assert (tenancy.background.pending(), written) == ((0, []) if booked_before else (1, [("resp_x",)]))
        assert not tenancy.background.dirty
        ledger.close()


@pytest.mark.cluster
def test_a_background_response_outlives_a_killed_daemon_and_is_charged_once(tmp_path, fleet_name, daemons):
    """On the cluster: the daemon is SIGKILLed while a background response runs on its replica (its job goes on in
    SLURM); the next daemon re-adopts the job, takes the response over and charges it once, by the ledger."""
    from test_tenants_cluster import usage
    config = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model(
        "m", 1, simulator={"tokens_per_s": 50}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})],
        gateway={"api_keys": [{"name": "alice", "key": "sk-alice"}]})
    d = daemons(config)
    wait_for(lambda: len(d.ready("m")) == 1, 60, "READY")
    req = urllib.request.Request(d.gateway + "/v1/responses", data=json.dumps({
        "model": "m", "input": "a long story", "background": True, "max_output_tokens": 150,
        "ignore_eos": True}).encode(), headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        rid = json.loads(r.read())["id"]
    ledger = sqlite3.connect(tmp_path / "state" / "usage.sqlite3")
    wait_for(lambda: ledger.execute("SELECT rid FROM background").fetchall() == [(rid,)], 10, "written down")
    d.stop(signal.SIGKILL)   # (3 s of generation in all: it ends under the next daemon, or before its takeover)
    d2 = daemons(config)
    wait_for(lambda: [u["completion_tokens"] for u in usage(config, "--by", "key")] == [150], 60, "charged")
    time.sleep(1)   # (two tenancy ticks: no second charge)
    assert [u["completion_tokens"] for u in usage(config, "--by", "key")] == [150]
    assert "took over background response" in d2.logs()
    assert ledger.execute("SELECT rid FROM background").fetchall() == []
