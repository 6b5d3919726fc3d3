"""Named keys on the real cluster: a request limit that holds over four gateway worker processes, usage
that survives a daemon restart, priority classes ordering a saturated model, and a token budget running
out."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from conftest import ROOT, fleet_config, metric_sum, sim_model, wait_for

pytestmark = pytest.mark.cluster


async def _burst(url: str, key: str, tasks: int, seconds: float, body: dict) -> tuple[int, list]:
    """``tasks`` clients, each on a new connection per request (the kernel spreads them over the workers),
    asking for ``seconds``: (answered, refusals as (status, Retry-After, error type))."""
    ok, refused = 0, []
    end = time.monotonic() + seconds

    async def client() -> None:
        nonlocal ok
        while time.monotonic() < end:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.post(url + "/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    data = await r.json()
                    if r.status == 200:
                        ok += 1
                    else:
                        refused.append((r.status, r.headers.get("Retry-After"), data["error"]["type"]))
                        await asyncio.sleep(0.05)
    await asyncio.gather(*(client() for _ in range(tasks)))
    return ok, refused


def usage(config, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "usage", "--config", str(config), "--json", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_rpm_holds_over_four_workers_and_usage_survives_a_restart(tmp_path, fleet_name, daemons):
    keys = [{"name": "capped", "key": "sk-capped", "rpm": 40}, {"name": "free", "key": "sk-free", "group": "g"},
            {"name": "team", "key": "sk-team", "group": "lab"},
            {"name": "old", "key": "sk-old", "expires_at": "2020-01-01T00:00:00Z"},
            {"name": "resp", "key": "sk-resp"}, {"name": "other", "key": "sk-other"}]
    # m2 has no replica (replicas: 0) and m as its fallback; m's engine keeps the Responses API's store
    m = sim_model("m", env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name, [m, sim_model("m2", 0, gateway={"fallbacks": ["m"]})],
                       gateway={"workers": 4, "api_keys": keys, "groups": {"lab": {"budget_tokens": 20}}})
    d = daemons(cfg)
    wait_for(lambda: d.ready("m"), 60, "a READY replica")
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    ok, refused = asyncio.run(_burst(d.gateway, "sk-capped", 16, 6.0, body))
    print(f"rpm 40 over 4 workers: {ok} answered, {len(refused)} refused in 6 s")
    assert 36 <= ok <= 40            # never over the limit; at most a few under while shares move
    assert refused and all(s == 429 and t == "requests" and int(ra) >= 1 for s, ra, t in refused)   # (OpenAI's type)
    free_ok, _ = asyncio.run(_burst(d.gateway, "sk-free", 1, 0.5, {**body, "max_tokens": 7}))
    assert free_ok >= 1
    # every worker: a fallback answers m2's requests, an expired key is refused, a group's spent budget holds
    for _ in range(8):   # (a new connection each: the kernel spreads them over the workers)
        req = urllib.request.Request(d.gateway + "/v1/completions", json.dumps({**body, "model": "m2"}).encode(),
                                     {"Authorization": "Bearer sk-free", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["model"] == "m" and r.headers["x-slurmfleet-fallback-from"] == "m2"
    expired, _ = asyncio.run(_burst(d.gateway, "sk-old", 4, 0.5, body))
    assert expired == 0
    # a stored response made through one worker is read back through every worker, by its key only
    def call(method: str, path: str, key: str, data: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(d.gateway + path, json.dumps(data).encode() if data else None,
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    status, made = call("POST", "/v1/responses", "sk-resp", {"model": "m", "input": "hi", "max_output_tokens": 3})
    assert status == 200 and made["status"] in ("completed", "incomplete")
    for _ in range(8):
        assert call("GET", f"/v1/responses/{made['id']}", "sk-resp") == (200, made)
    assert call("GET", f"/v1/responses/{made['id']}", "sk-other")[0] == 404
    assert asyncio.run(_burst(d.gateway, "sk-team", 1, 0.01, {**body, "max_tokens": 30}))[0] == 1   # 30 > 20
    team = [1]   # the team's requests answered: until the fleet has counted its tokens (half a second or so)

    def spent() -> bool:
        answered, refused = asyncio.run(_burst(d.gateway, "sk-team", 1, 0.01, body))
        team[0] += answered
        return bool(refused)
    wait_for(spent, 15, "the group's budget spent")
    team_ok, refused = asyncio.run(_burst(d.gateway, "sk-team", 8, 1.0, body))
    assert team_ok == 0 and refused and all(st == 429 and t == "insufficient_quota" for st, _, t in refused)
    assert d.stop(signal.SIGTERM) == 0
    rows = {r["key"]: r for r in usage(cfg, "--by", "key")}
    assert rows["capped"]["requests"] == ok                      # every answered request, none lost at SIGTERM
    assert rows["free"]["requests"] == free_ok + 8 and rows["free"]["completion_tokens"] == 7 * free_ok + 2 * 8
    d2 = daemons(cfg)
    wait_for(lambda: d2.ready("m"), 60, "the replica re-adopted")
    more, _ = asyncio.run(_burst(d2.gateway, "sk-free", 1, 0.3, {**body, "max_tokens": 7}))
    assert d2.stop(signal.SIGTERM) == 0
    rows = {r["key"]: r for r in usage(cfg, "--by", "key")}
    assert rows["free"]["requests"] == free_ok + 8 + more
    assert rows["free"]["completion_tokens"] == 7 * (free_ok + more) + 2 * 8
    groups = {r["group"]: r for r in usage(cfg, "--by", "group")}
    assert groups["g"]["requests"] == free_ok + 8 + more and groups["lab"]["requests"] == team[0]


def booked(config) -> int | None:
    """Requests of key ``k`` in the usage ledger now (read while the daemon may be writing it: None if not read)."""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "usage", "--config", str(config), "--json", "--by", "key"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    try:
        return next((r["requests"] for r in json.loads(out.stdout) if r["key"] == "k"), 0)
    except ValueError:
        return None


def test_usage_of_a_stream_that_ends_in_the_shutdown_grace_survives_a_sigkill_in_it(tmp_path, fleet_name, daemons):
    """SIGTERM while two streams run: the short one ends in the grace and is written down within a flush,
    though a SIGKILL cuts the grace short while the long one still runs (the usage loop stopped at the
    SIGTERM: all of the grace's counts were lost)."""
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", simulator={"tokens_per_s": 5})],
                       gateway={"api_keys": [{"name": "k", "key": "sk-k"}]})
    d = daemons(cfg)
    wait_for(lambda: d.ready("m"), 60, "a READY replica")

    async def scenario() -> None:
        async def stream(n: int) -> int:
            async with aiohttp.ClientSession() as s:
                async with s.post(d.gateway + "/v1/completions", headers={"Authorization": "Bearer sk-k"},
                                  json={"model": "m", "prompt": "x", "max_tokens": n, "stream": True,
                                        "ignore_eos": True}) as r:
                    return len([x async for x in r.content if x.startswith(b"data: {")])
        short, long = asyncio.ensure_future(stream(15)), asyncio.ensure_future(stream(400))
        await asyncio.to_thread(wait_for, lambda: metric_sum(d.metrics(), "slurmfleet_key_inflight", key="k") == 2,
                                15, "both streams under way")   # (the short one: 3 s of tokens)
        d.send(signal.SIGTERM)
        assert await short == 15   # ended in the grace
        await asyncio.to_thread(wait_for, lambda: booked(cfg) == 1, 20, "the short stream written down")
        d.send(signal.SIGKILL)     # the grace (30 s) cut short, the long stream still open
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
    asyncio.run(scenario())
    d.proc.wait(10)
    rows = {r["key"]: r for r in usage(cfg, "--by", "key")}
    assert rows["k"]["requests"] == 1 and rows["k"]["completion_tokens"] == 15


@pytest.mark.parametrize("when", ["serving", "stopping"])
def test_streams_a_sigkilled_daemons_workers_finish_are_booked_by_the_next_daemon(tmp_path, fleet_name, daemons,
                                                                                  when):
    """SIGKILL of the daemon with two gateway workers, while it serves or in its own shutdown: the workers serve
    their streams to the end and spool the counts the dead daemon never wrote; the next daemon books them, once
    (before: all of it was lost)."""
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", simulator={"tokens_per_s": 20})],
                       gateway={"workers": 2, "api_keys": [{"name": "k", "key": "sk-k"}]})
    d = daemons(cfg)
    wait_for(lambda: d.ready("m"), 60, "a READY replica")

    async def scenario() -> list[int]:
        async def stream(n: int) -> int:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.post(d.gateway + "/v1/completions", headers={"Authorization": "Bearer sk-k"},
                                  json={"model": "m", "prompt": "x", "max_tokens": n, "stream": True,
                                        "ignore_eos": True}) as r:
                    return len([x async for x in r.content if x.startswith(b"data: {")])
        streams = [asyncio.ensure_future(stream(40)) for _ in range(4)]   # 2 s each, over both workers
        await asyncio.sleep(0.8)
        if when == "stopping":   # (the workers were told to stop: they finish their streams in the grace)
            d.send(signal.SIGTERM)
            await asyncio.sleep(0.3)
        d.send(signal.SIGKILL)
        return await asyncio.gather(*streams)
    got = asyncio.run(scenario())
    assert got == [40] * 4   # the workers served them to the end
    d.proc.wait(10)
    spool = tmp_path / "state" / "usage-spool"
    wait_for(lambda: spool.is_dir() and list(spool.glob("*.json")), 15, "a worker's spool")
    d2 = daemons(cfg)
    wait_for(lambda: not list(spool.glob("*.json")) and d2.status()["ticks"] >= 2, 30, "the spools booked")
    assert d2.stop(signal.SIGTERM) == 0
    rows = {r["key"]: r for r in usage(cfg, "--by", "key")}
    assert rows["k"]["requests"] == 4 and rows["k"]["completion_tokens"] == 4 * 40


def test_priority_classes_order_a_saturated_model_and_a_budget_runs_out(tmp_path, fleet_name, daemons):
    keys = [{"name": "vip", "key": "sk-vip", "priority": "high"},
            {"name": "bulk", "key": "sk-bulk", "priority": "low"},
            {"name": "small", "key": "sk-small", "budget_tokens": 30, "budget_period": "day"}]
    model = sim_model("p", scheduling_policy="priority", max_inflight_per_replica=1,
                      simulator={"max_num_seqs": 1, "tokens_per_s": 100})
    d = daemons(fleet_config(tmp_path / "f.yaml", fleet_name, [model], gateway={"api_keys": keys}))
    wait_for(lambda: d.ready("p"), 60, "a READY replica")
    done: list[str] = []

    async def one(s: aiohttp.ClientSession, key: str, tokens: int) -> None:
        async with s.post(d.gateway + "/v1/completions", json={"model": "p", "prompt": "x", "max_tokens": tokens},
                          headers={"Authorization": f"Bearer sk-{key}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
            done.append(key)

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            # bulk requests of 1 s each: the vip ones, sent 0.3 s later, queue while the first is in service
            bulk = [asyncio.create_task(one(s, "bulk", 100)) for _ in range(6)]
            await asyncio.to_thread(wait_for, lambda: metric_sum(d.metrics(), "slurmfleet_key_inflight", key="bulk")
                                    == 6, 15, "the bulk requests in (one served, five queued)")
            vip = [asyncio.create_task(one(s, "vip", 20)) for _ in range(3)]
            await asyncio.gather(*bulk, *vip)
    asyncio.run(run())
    print("completion order:", done)
    # the three vip requests, queued last, are served before every bulk request still queued
    assert done[1:4] == ["vip"] * 3, done

    async def small() -> list[tuple[int, dict, dict]]:
        out = []
        async with aiohttp.ClientSession() as s:
            for i in range(2):
                async with s.post(d.gateway + "/v1/completions", json={"model": "p", "prompt": "x", "max_tokens": 40},
                                  headers={"Authorization": "Bearer sk-small"}) as r:
                    out.append((r.status, dict(r.headers), await r.json()))
                if i == 0:   # the fleet counts the tokens (from the reports), then tells the gateway (next table)
                    await asyncio.to_thread(wait_for, lambda: metric_sum(
                        d.metrics(), "slurmfleet_key_tokens_total", key="small", kind="completion") >= 40,
                        15, "the small key's tokens counted")
                    await asyncio.sleep(1.0)
        return out
    (s1, _, _), (s2, h2, b2) = asyncio.run(small())
    assert s1 == 200 and s2 == 429 and b2["error"]["type"] == "insufficient_quota"
    assert int(h2["Retry-After"]) == pytest.approx(86400 - time.time() % 86400, abs=10)   # at the next UTC day
