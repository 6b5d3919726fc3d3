"""The Responses API's stored responses through the gateway (orchestrator/gateway/stored.py): a response lives in
the memory of the replica that made it (vLLM's store), so reading it, polling a background one, cancelling it
and continuing it (``previous_response_id``) reach that replica, for the key that made it only."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness, Sim
from orchestrator.gateway import stored

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    routing: round_robin
  - name: other
    engine: simulator
    container: {enabled: false}
"""
KEYS = """\
api_keys:
  - {name: alice, key: sk-alice}
  - {name: bob, key: sk-bob}
"""
STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def client(h: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0, timeout=30)


def holders(sims: list[Sim], rid: str) -> list[str]:
    """The simulators whose own store has response ``rid``."""
    out = []
    for s in sims:
        try:
            s.get(f"/v1/responses/{rid}")
            out.append(s.name)
        except OSError:
            pass
    return out


def call(h: Harness, method: str, path: str, key: str = "sk-alice") -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    c.request(method, path, headers={"Authorization": f"Bearer {key}"})
    r = c.getresponse()
    data = json.loads(r.read() or b"{}")
    c.close()
    return r.status, data


def test_a_stored_response_is_read_continued_and_cancelled_on_its_replica_by_its_key_only(tmp_path):
    sims = [Sim(f"st-{i}", "--tokens-per-s", "200", env=STORE) for i in range(2)]
    h = Harness(tmp_path, MODELS, KEYS)
    try:
        h.set_ready([s.backend(slot=i) for i, s in enumerate(sims)])
        alice, bob = client(h, "sk-alice"), client(h, "sk-bob")
        made = [alice.responses.create(model="m", input=f"question {i}", max_output_tokens=4,
                                       extra_body={"request_id": "resp_mine"}) for i in range(6)]
        # the gateway names each (a client's own request_id replaced: another's could collide with it)
        assert all(re.fullmatch(r"resp_[0-9a-f]{48}", r.id) for r in made) and len({r.id for r in made}) == 6
        where = {r.id: holders(sims, r.id) for r in made}
        assert all(len(w) == 1 for w in where.values()), where
        assert {w[0] for w in where.values()} == {"st-0", "st-1"}   # (spread over both replicas)
        usage = h.gateway.tenants.by_name["alice"].usage   # model -> [requests, prompt, completion tokens]
        wait_for(lambda: usage["m"][0] == 6, 10, "the six counted")
        before = list(usage["m"])
        for r in made:   # read back, each from the replica that holds it, as often as asked
            for _ in range(2):
                got = alice.responses.retrieve(r.id)
                assert got.id == r.id and got.output_text == r.output_text
        # continued where its history is: the follow-up's prompt holds the first turn
        first = made[0]
        nxt = alice.responses.create(model="m", input="and then?", previous_response_id=first.id, max_output_tokens=3)
        assert nxt.previous_response_id == first.id and holders(sims, nxt.id) == where[first.id]
        assert nxt.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        # another key finds nothing: not to read, not to continue, not to cancel
        for act in (lambda: bob.responses.retrieve(first.id), lambda: bob.responses.cancel(first.id),
                    lambda: bob.responses.create(model="m", input="x", previous_response_id=first.id)):
            with pytest.raises(openai.NotFoundError) as e:
                act()
            assert e.value.body["param"] == "response_id" and first.id in e.value.message
        # reading is no generation: the key is charged for the ones it made (and its follow-up), not the reads
        wait_for(lambda: usage["m"][0] == before[0] + 12 + 1, 10, "the reads and the follow-up counted")
        assert usage["m"][1:] == [before[1] + nxt.usage.input_tokens, before[2] + nxt.usage.output_tokens]

        # a background response: queued at once, polled and cancelled on its replica
        bg = alice.responses.create(model="m", input="long", background=True, max_output_tokens=1000,
                                    extra_body={"ignore_eos": True})
        assert bg.status == "queued" and len(holders(sims, bg.id)) == 1
        assert alice.responses.retrieve(bg.id).status in ("queued", "in_progress")
        assert alice.responses.cancel(bg.id).status == "cancelled"
        assert alice.responses.retrieve(bg.id).status == "cancelled"
        # a background response is answered with no usage: the gateway follows it to its end and charges it then
        # (a cancelled one, left by vLLM without usage nor output, its prompt)
        short = alice.responses.create(model="m", input="short", background=True, max_output_tokens=3,
                                       extra_body={"ignore_eos": True})
        done = wait_for(lambda: (r := alice.responses.retrieve(short.id)).status == "incomplete" and r, 10, "done")
        wait_for(lambda: usage["m"][2] == before[2] + nxt.usage.output_tokens + 3, 10, "its tokens charged")
        prompts = before[1] + nxt.usage.input_tokens + done.usage.input_tokens
        wait_for(lambda: usage["m"][1] > prompts, 10, "the cancelled one's prompt charged")
        # a stream's response too (its id in its first event)
        events = list(alice.responses.create(model="m", input="streamed", max_output_tokens=3, stream=True))
        done = events[-1].response
        assert events[0].response.id == done.id and alice.responses.retrieve(done.id).output_text == done.output_text

        # ids the gateway cannot place, and paths and methods it does not proxy
        assert call(h, "GET", "/v1/responses/resp_1")[0] == 404
        assert call(h, "GET", "/v1/responses/resp_" + "0" * 48)[0] == 404
        assert call(h, "DELETE", f"/v1/responses/{first.id}")[0] == 405
        assert call(h, "GET", f"/v1/responses/{first.id}/cancel")[0] == 405
        assert call(h, "GET", f"/v1/responses/{first.id}/input_items")[1]["error"]["code"] == "unknown_url"
        # its replica gone, so is the response (vLLM keeps it in the replica's memory)
        gone = where[first.id][0]
        h.set_ready([s.backend(slot=i) for i, s in enumerate(sims) if s.name != gone])
        status, err = call(h, "GET", f"/v1/responses/{first.id}")
        assert status == 404 and err["error"]["code"] == "response_not_found"
    finally:
        h.close()
        for s in sims:
            s.stop()


def test_each_attempt_names_the_response_for_the_replica_that_makes_it(tmp_path):
    """A response made on a retry (the first replica refused the connection) is named for the replica that made
    it, not the one tried first: it can be read back."""
    good = Sim("st-good", env=STORE)
    dead = Sim("st-dead", "--fault", "refuse", env=STORE)
    h = Harness(tmp_path, MODELS, KEYS)
    try:
        h.set_ready([dead.backend(slot=0), good.backend(slot=1)])
        alice = client(h, "sk-alice")
        for i in range(30):   # (until the balancer has tried the dead one first: a retry)
            r = alice.responses.create(model="m", input=f"q{i}", max_output_tokens=2)
            assert alice.responses.retrieve(r.id).id == r.id
            if h.metric("slurmfleet_request_retries_total", model="m") >= 1:
                break
        assert h.metric("slurmfleet_request_retries_total", model="m") >= 1
        # and a response of model m is not found as another model's
        assert stored.find([h.gateway.pools.pools["other"]], "alice", r.id) is None
        assert stored.find(h.gateway.pools.pools.values(), "alice", r.id)[1].job_id == "job-st-good"
    finally:
        h.close()
        good.stop()
        dead.stop()


def test_a_key_out_of_budget_can_still_read_and_cancel_its_responses(tmp_path):
    """A read or a cancel spends no token: a spent budget refuses the key's new responses, not its reads nor the
    cancel that stops a background response it would otherwise be charged for."""
    sim = Sim("st-budget", "--tokens-per-s", "200", env=STORE)
    h = Harness(tmp_path, MODELS, "api_keys:\n  - {name: carol, key: sk-carol, budget_tokens: 10}\n")
    try:
        h.set_ready([sim.backend()])
        carol = client(h, "sk-carol")
        h.tenancy_tick()
        bg = carol.responses.create(model="m", input="a long one", background=True, max_output_tokens=2000,
                                    extra_body={"ignore_eos": True})
        made = carol.responses.create(model="m", input="one two three", max_output_tokens=8)
        wait_for(lambda: h.gateway.tenants.by_name["carol"].usage["m"][0] == 2, 10, "both counted")
        h.tenancy_tick()   # the fleet's view: the budget spent
        with pytest.raises(openai.RateLimitError) as e:
            carol.responses.create(model="m", input="more", max_output_tokens=1)
        assert e.value.body["code"] == "insufficient_quota"
        assert carol.responses.retrieve(made.id).output_text == made.output_text
        assert carol.responses.cancel(bg.id).status == "cancelled"
    finally:
        h.close()
        sim.stop()


def test_a_background_stream_is_charged_once_when_it_ends_though_its_client_left(tmp_path):
    """A background response asked as a stream: vLLM generates it to its end even when its client leaves the
    stream.  Its key is charged once, what it ended with: not the stream's count and the end's both, nor only
    the events its client read."""
    sim = Sim("st-bgs", "--tokens-per-s", "100", env=STORE)
    h = Harness(tmp_path, MODELS, KEYS)
    try:
        h.set_ready([sim.backend()])
        alice = client(h, "sk-alice")
        usage = h.gateway.tenants.by_name["alice"].usage   # model -> [requests, prompt, completion tokens]
        events = list(alice.responses.create(model="m", input="one", background=True, stream=True,
                                             max_output_tokens=5, extra_body={"ignore_eos": True}))
        assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 5
        stream = alice.responses.create(model="m", input="two", background=True, stream=True,
                                        max_output_tokens=40, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        stream.close()   # (left after its first event)
        rid = first.response.id
        # its events replayed from its replica's store (vLLM's `?stream=true&starting_after=N`), through the gateway
        replay = list(alice.responses.retrieve(rid, stream=True, starting_after=first.sequence_number))
        assert [e.sequence_number for e in replay] == list(range(first.sequence_number + 1, len(replay) + 1))
        assert replay[-1].type == "response.completed" and replay[-1].response.usage.output_tokens == 40
        assert "".join(e.delta for e in replay if e.type == "response.output_text.delta") == \
            replay[-1].response.output_text
        with pytest.raises(openai.NotFoundError):   # (another key's: not replayed)
            client(h, "sk-bob").responses.retrieve(rid, stream=True)
        with pytest.raises(openai.BadRequestError) as e:   # (vLLM would replay from the end, then from the start)
            alice.responses.retrieve(rid, stream=True, starting_after=-2)
        assert e.value.body["param"] == "starting_after"
        status, err = call(h, "GET", f"/v1/responses/{rid}?stream=true&starting_after=1&starting_after=-1")
        assert status == 400 and err["error"]["param"] == "starting_after"   # (vLLM reads the last one)
        done = wait_for(lambda: (r := alice.responses.retrieve(rid)).status == "incomplete" and r, 15, "its end")
        assert done.usage.output_tokens == 40   # (generated on without its client)
        prompts = events[-1].response.usage.input_tokens + done.usage.input_tokens
        wait_for(lambda: usage["m"][1:] == [prompts, 5 + 40], 15, "both charged once")
    finally:
        h.close()
        sim.stop()


def test_a_background_response_counts_in_flight_on_its_replica_until_it_ends(tmp_path):
    """Its POST is answered `queued` at once, and its engine goes on generating it: it held no lease, so its
    replica looked idle to the autoscaler (the first a scale-down took) and to a drain (cancelled at once: the
    response lost).  Its follow now holds one until it ends."""
    sim = Sim("st-bgl", "--tokens-per-s", "20", env=STORE)
    h = Harness(tmp_path, MODELS, KEYS)
    try:
        h.set_ready([sim.backend()])
        r = client(h, "sk-alice").responses.create(model="m", input="x", background=True, max_output_tokens=40,
                                                   extra_body={"ignore_eos": True})
        assert r.status in ("queued", "in_progress")
        assert h.call(asyncio.sleep(0.3)) is None and h.gateway.pools.inflight_by_job() == {"job-st-bgl": 1}
        wait_for(lambda: client(h, "sk-alice").responses.retrieve(r.id).status == "incomplete", 15, "its end")
        wait_for(lambda: not h.gateway.pools.inflight_by_job(), 15, "its lease given back at its end")
    finally:
        h.close()
        sim.stop()


def test_a_cancelled_background_streams_events_end_with_it_not_at_the_idle_timeout(tmp_path, caplog):
    """vLLM never ends the event stream of a background response that was cancelled (its store's replay waits for
    a `response.completed` that never comes), the one its POST streams nor a replay: the gateway ends both once
    the response is cancelled, with the events sent so far and no error, and the key's slots are free again."""
    caplog.set_level("INFO", "orchestrator.gateway.server")
    sim = Sim("st-bgc", "--tokens-per-s", "20", env=STORE)
    h = Harness(tmp_path, MODELS, KEYS)
    try:
        h.set_ready([sim.backend()])
        alice = client(h, "sk-alice")
        stream = iter(alice.responses.create(model="m", input="long", background=True, stream=True,
                                             max_output_tokens=400, extra_body={"ignore_eos": True}))
        first = next(stream)
        rid = first.response.id
        replay = iter(alice.responses.retrieve(rid, stream=True))
        assert next(replay).sequence_number == 0
        with ThreadPoolExecutor(2) as pool:
            rest = [pool.submit(list, it) for it in (stream, replay)]
            time.sleep(1.0)   # (both streams read on: some of its 400 tokens at 20/s)
            assert alice.responses.cancel(rid).status == "cancelled"
            got = [f.result(timeout=60) for f in rest]   # (the SDK's read times out after 30 s of silence)
        for events in got:   # what came before the cancel, then the end: no error, no completion
            assert events and all(e.type not in ("error", "response.completed") for e in events)
        wait_for(lambda: h.gateway.tenants.by_name["alice"].inflight == 0, 15, "the key's slots free")
        assert caplog.text.count(f"ended the event stream of cancelled response {rid}") == 2
        # vLLM keeps no usage for a cancelled response, yet its client read (and may replay) what it generated:
        # its key is charged the output of its event log, as the replica's /tokenize counts it, with its prompt
        text = "".join(e.delta for e in got[1] if e.type == "response.output_text.delta")
        req = urllib.request.Request(sim.url + "/tokenize", data=json.dumps({
            "model": "m", "prompt": text, "add_special_tokens": False}).encode(), headers={
            "Authorization": f"Bearer {sim.secret}", "Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=10).read())["count"]
        usage = h.gateway.tenants.by_name["alice"].usage["m"]   # requests, prompt, completion tokens
        assert out >= 10 and usage[1] > 0 and usage[2] == out, (usage, out)
    finally:
        h.close()
        sim.stop()


def test_a_read_reaches_its_replica_while_the_replica_is_full(tmp_path):
    """A read or a cancel generates nothing: it goes straight to the replica that holds the response, not through
    the model's queue and cap, where a full replica (its own background work, say) refused it 429."""
    sim = Sim("st-full", "--tokens-per-s", "100", env=STORE)
    h = Harness(tmp_path, MODELS.replace("  - name: m\n", "  - name: m\n    max_inflight_per_replica: 1\n"
                                         "    gateway: {max_queue: 0}\n", 1), KEYS)
    try:
        h.set_ready([sim.backend()])
        alice = client(h, "sk-alice")
        made = alice.responses.create(model="m", input="kept", max_output_tokens=3)
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(lambda: len(list(alice.responses.create(
                model="m", input="long", stream=True, max_output_tokens=200, extra_body={"ignore_eos": True}))))
            wait_for(lambda: h.gateway.pools.inflight_by_model().get("m") == 1, 10, "its one slot taken")
            with pytest.raises(openai.RateLimitError):   # (a generation: no room, no queue)
                alice.responses.create(model="m", input="more", max_output_tokens=1)
            assert alice.responses.retrieve(made.id).id == made.id
            assert busy.result(30) > 200
    finally:
        h.close()
        sim.stop()


def test_a_response_a_fallback_made_is_continued_by_that_fallback(tmp_path):
    """A response that a fallback model answered (the model asked had no replica) lives on the fallback's replica:
    continued with the model first asked, it goes there, and says so, rather than a 404."""
    sim = Sim("st-fb", served="m", env=STORE)
    models = MODELS + "  - name: big\n    engine: simulator\n    container: {enabled: false}\n" \
                      "    gateway: {queue_timeout_s: 0.3, fallbacks: [m]}\n"
    h = Harness(tmp_path, models, KEYS)
    try:
        h.set_ready([sim.backend()])
        alice = client(h, "sk-alice")
        first = alice.responses.with_raw_response.create(model="big", input="hi", max_output_tokens=2)
        assert first.parse().model == "m" and first.headers["x-slurmfleet-fallback-from"] == "big"
        nxt = alice.responses.with_raw_response.create(model="big", input="and?", max_output_tokens=2,
                                                       previous_response_id=first.parse().id)
        assert nxt.parse().model == "m" and nxt.parse().previous_response_id == first.parse().id
        assert nxt.headers["x-slurmfleet-fallback-from"] == "big"
    finally:
        h.close()
        sim.stop()
