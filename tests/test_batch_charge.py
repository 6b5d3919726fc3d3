"""A shared batch's owner is charged by the runner from what the batch's files hold, each line once: across a stop
that loses the lines in flight (sent again, charged once), a ledger that cannot be written as the batch ends, and a
batch an earlier version began (whose gateway charged the lines it answered)."""

from __future__ import annotations

import asyncio
import io
import json
import time

import openai
import pytest

from gateway_harness import Harness, Sim
from orchestrator.batches import BatchStore

MODEL = "  - name: m\n    engine: simulator\n    container: {enabled: false}\n"
KEYS = "api_keys:\n  - {name: alice, key: sk-alice}\n"


@pytest.fixture
def batch(tmp_path):
    """``make(n, *simulator args)``: a gateway, a simulator, alice's client and her batch of ``n`` lines; closed
    after the test."""
    made: list = []

    def make(n: int, *sim_args: str):
        h, sim, c, b = setup(tmp_path, n, *sim_args)
        made.extend([h, sim])
        return h, sim, c, b
    yield make
    for x in made:
        (x.close if isinstance(x, Harness) else x.stop)()


def completed(c: openai.OpenAI, b):
    """The batch, once completed."""
    return wait(lambda: (x := c.batches.retrieve(b.id)).status == "completed" and x, "the batch completed")


def setup(tmp_path, n: int, *sim_args: str):
    h = Harness(tmp_path, MODEL, KEYS)
    sim = Sim("b0", *sim_args)
    h.route_to([sim])
    h.cfg.gateway._batch_key = "runner-secret"
    h.call(asyncio.sleep(0))
    h.gateway.set_config(h.cfg)
    c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-alice", max_retries=0)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "word " * (i + 1), "max_tokens": 3}} for i in range(n)]
    f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                       purpose="batch")
    return h, sim, c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")


def ledger_in(h: Harness, root):
    from orchestrator.fleet.usage import UsageLedger

    async def make():   # (opened in the harness's loop, where the runner charges it)
        return UsageLedger(root / "usage.sqlite3")
    return h.call(make())


def charging(ledger):
    """The runner's charge, into ``ledger`` (as the daemon wires it)."""
    return lambda ref, owner, m, counts, write=True: ledger.charge_upto(ref, owner, None, m, counts, write)


def wait(pred, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def output_counts(c: openai.OpenAI, b) -> tuple[int, int, int]:
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    return (len(out), sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out),
            sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out))


def test_lines_lost_in_flight_by_a_stop_are_sent_again_and_charged_once(tmp_path, batch):
    """(The gateway charged a line when its answer was whole, before the runner wrote it down: a stop in between
    lost the line, the next start sent it again, and the owner paid twice.)"""
    h, sim, c, b = batch(40, "--ttft-s", "0.2")
    ledger = ledger_in(h, tmp_path)
    charge = {"charge": charging(ledger)}
    _, stop = h.batch_runner(tmp_path, 8, **charge)
    wait(lambda: c.batches.retrieve(b.id).request_counts.completed >= 8, "a part of the batch answered")
    stop()   # the lines in flight are lost: their answers come to no one
    _, stop = h.batch_runner(tmp_path, 8, **charge)
    b = completed(c, b)
    stop()
    assert sim.served() > 40   # (lines were sent twice)
    assert b.request_counts.completed == 40
    assert ledger.totals() == {("alice", "m"): output_counts(c, b)}   # each line once, as its output holds
    assert not h.gateway.tenants.by_name["alice"].usage   # (the gateway charged no one)


def test_a_batch_does_not_end_before_its_owner_is_charged(tmp_path, batch):
    h, sim, c, b = batch(6)
    charged, refuse = [], [True]

    def charge(ref, owner, model, counts, write=True):
        if not write:
            return True   # (queued for the ledger's next flush)
        if refuse[0]:
            return False   # (the ledger's file locked or full: kept, asked again)
        charged.append((ref, owner, model, counts))
        return True
    _, stop = h.batch_runner(tmp_path, 8, charge=charge)
    store = BatchStore(tmp_path / "batches")
    wait(lambda: store.load(b.id)["request_counts"]["completed"] == 6, "every line answered")
    time.sleep(1.5)
    assert c.batches.retrieve(b.id).status == "in_progress" and not charged   # its counts not final yet
    refuse[0] = False
    b = completed(c, b)
    stop()
    assert charged[-1] == (f"batch:{b.id}", "alice", "m", output_counts(c, b))


def test_a_batch_an_earlier_version_began_charges_only_the_lines_answered_since(tmp_path, batch):
    """Its first two lines were answered, and charged by that version's gateway, before the upgrade."""
    h, sim, c, b = batch(3)
    store = BatchStore(tmp_path / "batches")
    rec = store.load(b.id)
    store.save({**rec, "status": "in_progress", "in_progress_at": rec["created_at"]})
    body = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 50, "completion_tokens": 70}}
    (tmp_path / "batches" / f"{b.id}.output.jsonl").write_bytes(b"".join(
        json.dumps({"id": f"batch_req_{b.id[6:]}-{n}", "custom_id": f"r{n - 1}", "response": {
            "status_code": 200, "request_id": f"{b.id}-{n}", "body": body}, "error": None}).encode() + b"\n"
        for n in (1, 2)))   # (an input's lines count from 1)
    ledger = ledger_in(h, tmp_path)
    _, stop = h.batch_runner(tmp_path, 8, charge=charging(ledger))
    b = completed(c, b)
    stop()
    assert sim.served() == 1 and b.request_counts.completed == 3
    n, prompt, completion = output_counts(c, b)
    assert ledger.totals() == {("alice", "m"): (1, prompt - 100, completion - 140)}
