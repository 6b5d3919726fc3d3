"""Fairness benchmark: a noisy key flooding at 10x its fair share next to a normal key, on the local SLURM cluster.

    flock /tmp/heavy.lock .venv/bin/python bench/fairness.py                  # ~5 minutes (+ ~10 s set-up)
    flock /tmp/heavy.lock .venv/bin/python bench/fairness.py --phase-s 15     # a quick check of the machinery

One ``slurmfleet serve`` daemon (fleet ``fair<tag>``, ``gateway.workers: 2``, its own ports and state directory
under ``/tmp/sf-fairness-<tag>-*/``, kept with the daemon log) serves one simulator model on 2 replicas
(``ttft_s`` 0.15, ``tokens_per_s`` 10, ``max_num_seqs`` 16; every request streams 16 tokens, so one takes
about 0.15 + 15/10 = 1.65 s and the two replicas serve at most 2 x 16 / 1.65 = 19.4 requests/s; beyond that
requests wait in the engines and then in the gateway's queue).

Two named keys: ``normal`` (no limits) and ``noisy`` with ``rpm`` = its fair share (``--noisy-rpm``, 240: 4
requests/s) and ``max_concurrent`` (``--noisy-max-concurrent``, 8 of the 32 engine slots; 0 leaves it out).
Why both: rpm is a sliding 60 s window, so a client flooding at 10x its rpm gets the whole minute's requests
admitted in the first ~6 s of each window (40 requests/s, twice what the replicas serve), and the normal key's
requests queue behind them in the engines for seconds: an rpm limit alone bounds the noisy key's volume, not
its share of the replicas at any moment. ``max_concurrent`` bounds that share (``--noisy-max-concurrent 0``
measures rpm alone: in one run the normal key's p99 TTFT went from 0.155 s solo to 6.9 s, 45x).

Load (open loop, seeded Poisson arrivals, streaming ``/v1/chat/completions``, each client in a process of its
own so that the flood's client-side work does not delay the normal client's clock):

* ``normal``: ``--normal-rps`` (4) requests/s for the whole run;
* ``noisy`` flood: 10x its rpm (``--flood-x``), i.e. 40 requests/s, never honouring Retry-After, in phases 2
  and 4;
* ``polite``: the noisy key in phase 3, one request at a time (non-streamed, 1 token: faster than its rpm),
  sleeping ``Retry-After`` after each 429 before the next.

Phases (``--phase-s`` T, default 75 s; ``--polite-s`` P, default 30 s), all in one run, on one fleet:

1. ``solo``       T   normal alone: its TTFT baseline;
2. ``limited``    T   normal + the noisy flood, the noisy key's limits enforced by slurmfleet;
3. ``polite``     P   normal + the polite noisy client (the key's window is full of the flood's requests);
   then the config is rewritten with the noisy key's limits removed and ``slurmfleet reload`` applied (the
   normal load goes on through it: no request may fail), and after a 3 s gap
4. ``unlimited``  T   the peer: the same two loads through the same fleet with yes/no keys (what a proxy that
   only checks keys does).

Measured: the normal key's TTFT (client side: request sent -> first streamed event) p50/p99 per phase and its
ratio to solo; the noisy key's requests sent / admitted / refused (by error code) and admitted per minute;
every 429's ``Retry-After`` and ``x-ratelimit-*`` headers; the most noisy requests admitted in any 60 s window
while its limits were on; the polite client's share of retries (after waiting Retry-After) that were admitted.
Accounting: after the load, each replica's own ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``
(``/metrics`` with the job's secret), then the daemon is stopped (SIGTERM: the ledger is flushed) and
``slurmfleet usage --json --by key model`` is read: the totals must be equal, and each key's must equal what
its clients saw (usage chunks / answers; the normal client streams without asking for usage and counts its
token events).  The ledger's ``requests`` are the requests a replica answered (not those refused by the key's
limits or by the gateway's own queue, a 429 ``queue_full`` or a 503): they are compared with the clients'
count of those; the replicas' ``vllm:request_success_total`` with the requests answered.

Targets (exit status 1 if one is missed): normal p99 TTFT with the noisy flood <= 1.2x solo; the ledger equals
the replicas' counters exactly; no 429 without ``Retry-After`` >= 1 (and every key-limit 429 with its
``x-ratelimit-*`` headers and OpenAI's type, ``requests`` or ``tokens``); after an rpm 429 the key never had room again
more than 1 s before its Retry-After (the flood probes 40 times a second, so its next admission is when room
came back); noisy admitted <= rpm in every 60 s window while limited; no normal request failed while limited
(the reload included; the peer's queue_full 429s are its result, not a failure of the run); the polite
client's retries admitted >= 90%; and, for the benchmark to mean anything, the peer (phase 4) degrades the
normal key's p99 by more than 1.2x.
Writes JSON (configs, per-phase results, every request) to ``--out`` (default /tmp/fairness.json).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent   # bench.autoscale: the cluster lock and ports, as there
sys.path.insert(0, str(ROOT))

from bench.autoscale import cluster_shared, free_port
from orchestrator.devtools.localcluster import LocalCluster

ADMIN_KEY = "bench-admin"
MODEL = "sim"
SIM = {"ttft_s": 0.15, "tokens_per_s": 10.0, "max_num_seqs": 16}
MAX_TOKENS = 16
SERVICE_S = SIM["ttft_s"] + (MAX_TOKENS - 1) / SIM["tokens_per_s"]
KEYS = {"normal": "sk-fair-normal", "noisy": "sk-fair-noisy"}
RELOAD_GAP_S = 3.0
REQUEST_TIMEOUT_S = 180.0
WINDOW_S = 60.0


# -- the fleet --------------------------------------------------------------------------------------------------
def fleet_config(name: str, run_dir: Path, conf: Path, ports: set[int], noisy_limits: dict) -> dict:
    model = {"name": MODEL, "engine": "simulator", "replicas": 2, "gpus_per_node": 1, "cpus_per_task": 1,
             "container": {"enabled": False}, "probe": {"interval_s": 0.5, "timeout_s": 2, "startup_timeout_s": 60},
             "drain": {"timeout_s": 10, "handover_lead_s": 60}, "simulator": dict(SIM),
             "backoff": {"base_s": 1, "max_s": 4}}
    return {"fleet": name, "state_dir": str(run_dir / "state"),
            "cluster": {"partition": "gpu", "slurm_conf": str(conf)},
            "gateway": {"host": "127.0.0.1", "port": free_port(ports), "workers": 2,
                        "api_keys": keys_config(noisy_limits)},
            "daemon": {"tick_interval_s": 0.5, "admin_port": free_port(ports), "admin_api_keys": [ADMIN_KEY]},
            "models": [model]}


def keys_config(noisy_limits: dict) -> list[dict]:
    return [{"name": "normal", "key": KEYS["normal"]}, {"name": "noisy", "key": KEYS["noisy"], **noisy_limits}]


def admin(cfg: dict, method: str, path: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{cfg['daemon']['admin_port']}{path}", method=method,
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def ready_jobs(cfg: dict) -> list[str]:
    try:
        st = admin(cfg, "GET", "/admin/status")
    except (urllib.error.URLError, OSError, ValueError):
        return []
    m = next((m for m in st.get("models", []) if m["model"] == MODEL), None)
    return sorted(r["job_id"] for r in (m or {}).get("replicas", []) if r["state"] == "READY")


def replica_counters(state_dir: Path, jobs: list[str]) -> dict[str, dict[str, float]]:
    """Each replica's own counters (from its endpoint record: host, port, secret)."""
    out = {}
    for job in jobs:
        rec = json.loads((state_dir / "endpoints" / f"{job}.json").read_text())
        req = urllib.request.Request(f"http://{rec['host']}:{rec['port']}/metrics",
                                     headers={"Authorization": f"Bearer {rec['secret']}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        out[job] = {c: sum(float(v) for v in re.findall(rf"^vllm:{c}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))
                    for c in ("prompt_tokens", "generation_tokens", "request_success")}
    return out


def post(gateway: str, key: str, body: dict) -> int:
    req = urllib.request.Request(gateway + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# -- the clients (each in a process of its own) -------------------------------------------------------------------
def poisson(rng: random.Random, rate: float, spans: list[tuple[float, float]]) -> list[float]:
    out = []
    for lo, hi in spans:
        t = lo
        while True:
            t += rng.expovariate(rate)
            if t >= hi:
                break
            out.append(t)
    return out


def chat(text: str, max_tokens: int, stream: bool, usage: bool) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def request(session, url: str, key: str, body: dict, t0: float) -> dict:
    """One request: its record (t = sent, relative to t0)."""
    import aiohttp

    rec: dict = {"t": round(time.time() - t0, 4), "status": None, "ok": False}
    start = time.monotonic()
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            rec["status"] = r.status
            if r.status != 200:
                raw = await r.read()
                try:
                    err = json.loads(raw)["error"]
                    rec.update(etype=err.get("type"), code=err.get("code"), msg=err.get("message"))
                except (ValueError, KeyError, TypeError):
                    rec["msg"] = raw[:200].decode(errors="replace")
                rec["retry_after"] = r.headers.get("Retry-After")
                rec["xrl"] = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-ratelimit-")}
            elif body.get("stream"):
                done, tokens, usage = False, 0, None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        if "ttft" not in rec:
                            rec["ttft"] = round(time.monotonic() - start, 4)
                        ev = json.loads(line[6:])
                        if ev.get("usage") and not ev.get("choices"):
                            usage = ev["usage"]
                        elif ev.get("choices") and "role" not in ev["choices"][0].get("delta", {}):
                            tokens += 1
                    elif line.startswith(b"data: [DONE]"):
                        done = True
                rec["ok"] = done and "ttft" in rec
                rec["tokens"] = tokens
                if usage:
                    rec["usage"] = [usage["prompt_tokens"], usage["completion_tokens"]]
                if not rec["ok"]:
                    rec["status"] = "broken-stream"
            else:
                data = await r.json()
                rec["ok"] = True
                rec["usage"] = [data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"]]
    except TimeoutError:
        rec["status"] = "timeout"
    except aiohttp.ClientError as exc:
        rec["status"] = type(exc).__name__
    rec["e2e"] = round(time.monotonic() - start, 4)
    return rec


async def open_loop(url: str, key: str, schedule: list[float], t0: float, usage: bool, tag: str) -> list[dict]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        tasks = []
        for i, t in enumerate(schedule):
            delay = t0 + t - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            body = chat(f"{tag} request {i}: tell me a story", MAX_TOKENS, True, usage)
            tasks.append(asyncio.create_task(request(s, url, key, body, t0)))
        return list(await asyncio.gather(*tasks))


async def polite_loop(url: str, key: str, start: float, end: float, t0: float) -> list[dict]:
    """One request at a time; after a 429, sleep Retry-After before the next (marked ``after_wait``)."""
    import aiohttp

    out: list[dict] = []
    waited = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await asyncio.sleep(max(0.0, t0 + start - time.time()))
        i = 0
        while time.time() - t0 < end:
            rec = await request(s, url, key, chat(f"polite request {i}", 1, False, False), t0)
            rec["after_wait"] = waited
            out.append(rec)
            i += 1
            waited = False
            if rec["status"] == 429:
                try:
                    wait = float(rec.get("retry_after") or "")
                except ValueError:
                    wait = 1.0
                rec["slept"] = wait
                if time.time() - t0 + wait >= end:
                    break
                await asyncio.sleep(wait)
                waited = True
    return out


def client_main(kind: str, args: dict, path: str) -> None:
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if kind == "polite":
        recs = run(polite_loop(args["url"], args["key"], args["start"], args["end"], args["t0"]))
    else:
        recs = run(open_loop(args["url"], args["key"], args["schedule"], args["t0"], args["usage"], kind))
    Path(path).write_text(json.dumps(recs))


# -- results ----------------------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def max_in_window(ts: list[float], w: float) -> tuple[int, float | None]:
    """The most of ``ts`` in any half-open window of ``w`` seconds, and where it starts."""
    ts = sorted(ts)
    best, at = 0, None
    for i, t in enumerate(ts):
        n = bisect.bisect_left(ts, t + w) - i
        if n > best:
            best, at = n, t
    return best, at


def reason(rec: dict) -> str:
    msg = rec.get("msg") or ""
    if rec.get("code") == "queue_full":
        return "queue_full"
    return ("rpm" if "requests per minute" in msg else "tpm" if "tokens per minute" in msg
            else "concurrency" if "in flight" in msg else str(rec.get("code") or rec["status"]))


def key_refused(rec: dict) -> bool:
    """Refused by the key's own limits (not by the gateway's queue)."""
    return rec["status"] == 429 and rec.get("code") in ("rate_limit_exceeded", "insufficient_quota")


def reached(rec: dict) -> bool:
    """A replica answered it (it was refused neither by the key's limits nor by the gateway's queue)."""
    return not key_refused(rec) and rec.get("code") not in ("queue_full", "no_replica")


def check_429(rec: dict, rpm: int | None) -> list[str]:
    """What a 429 lacks: Retry-After >= 1 always; for a key's limit also its type and x-ratelimit-* headers."""
    bad = []
    ra = rec.get("retry_after")
    if ra is None or not ra.isdigit() or int(ra) < 1:
        bad.append("retry-after")
    if rec.get("code") != "queue_full":
        if rec.get("etype") not in ("requests", "tokens", "rate_limit_exceeded"):   # (OpenAI's rpm, tpm; ours)
            bad.append("type")
        xrl = rec.get("xrl") or {}
        if rpm is not None and (xrl.get("x-ratelimit-limit-requests") != str(rpm)
                                or "x-ratelimit-remaining-requests" not in xrl
                                or "x-ratelimit-reset-requests" not in xrl):
            bad.append("x-ratelimit")
    return bad


def summarize(args, spans: dict[str, tuple[float, float]], normal: list[dict], noisy: list[dict],
              polite: list[dict], reload_t: float) -> dict:
    def within(recs, name):
        lo, hi = spans[name]
        return [r for r in recs if lo <= r["t"] < hi]

    phases = {}
    solo_p99 = None
    for name in spans:
        nr = within(normal, name)
        ttft = [r["ttft"] for r in nr if r["ok"]]
        p99 = pct(ttft, 99)
        if name == "solo":
            solo_p99 = p99
        nz = within(noisy, name) + within(polite, name)
        nfail: dict[str, int] = {}
        for r in nr:
            if not r["ok"]:
                k = reason(r) if r["status"] == 429 else str(r["status"])
                nfail[k] = nfail.get(k, 0) + 1
        refused: dict[str, int] = {}
        for r in nz:
            if not r["ok"]:
                k = reason(r) if r["status"] == 429 else str(r["status"])
                refused[k] = refused.get(k, 0) + 1
        secs = spans[name][1] - spans[name][0]
        admitted = sum(1 for r in nz if r["ok"])
        phases[name] = {
            "seconds": round(secs, 1), "normal_sent": len(nr), "normal_failed": sum(nfail.values()),
            "normal_failures": nfail,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": p99, "ttft_max_s": max(ttft) if ttft else None,
            "p99_vs_solo": p99 / solo_p99 if p99 and solo_p99 else None,
            "noisy_sent": len(nz), "noisy_admitted": admitted, "noisy_refused": refused,
            "noisy_admitted_per_min": round(admitted / secs * 60, 1) if secs > 0 else None}
    limited = sorted(r["t"] for r in noisy + polite if r["ok"] and r["t"] < reload_t)
    most, at = max_in_window(limited, WINDOW_S)
    bad429: dict[str, int] = {}
    n429 = 0
    retry_after: dict[str, dict[str, int]] = {}
    for r in normal + noisy + polite:
        if r["status"] != 429:
            continue
        n429 += 1
        limited_now = r["t"] < reload_t
        for b in check_429(r, args.noisy_rpm if limited_now else None):
            bad429[b] = bad429.get(b, 0) + 1
        d = retry_after.setdefault(reason(r), {})
        d[str(r.get("retry_after"))] = d.get(str(r.get("retry_after")), 0) + 1
    # rpm refusals: when was the noisy key next admitted (the flood asks 40 times a second, so that is when the
    # window had room again)?  Retry-After is ceil(seconds until the oldest counted request leaves the window),
    # and the fleet sees counters every 0.5 s: room again within [Retry-After - 1, Retry-After + 1.5] s is right
    accuracy = {"early": 0, "right": 0, "late": 0, "late_with_retry_after_1": 0}
    for r in noisy + polite:
        if r["status"] != 429 or r["t"] >= reload_t or reason(r) != "rpm":
            continue
        i = bisect.bisect_right(limited, r["t"])
        ra = int(r["retry_after"])
        if i < len(limited):
            dt = limited[i] - r["t"]
            k = "early" if dt < ra - 1 else "right" if dt <= ra + 1.5 else "late"
            accuracy["late_with_retry_after_1" if k == "late" and ra == 1 else k] += 1
    waits = [r for r in polite if r.get("after_wait")]
    pol_ok = [r["t"] for r in polite if r["ok"]]
    return {"phases": phases, "noisy_most_in_60s_limited": most, "noisy_most_window_start_s": at,
            "responses_429": n429, "rpm_retry_after_vs_next_admission": accuracy, "bad_429": bad429, "retry_after_by_reason": retry_after,
            "polite": {"sent": len(polite), "admitted": len(pol_ok), "refused": sum(1 for r in polite if not r["ok"]),
                       "retries_after_wait": len(waits), "retries_admitted": sum(1 for r in waits if r["ok"]),
                       "retry_admitted_share": (sum(1 for r in waits if r["ok"]) / len(waits)) if waits else None,
                       "admitted_per_min": round(len(pol_ok) / args.polite_s * 60, 1) if args.polite_s else None,
                       "other_failures": sum(1 for r in polite if not r["ok"] and r["status"] != 429)}}


def accounting(ledger: list[dict], replicas: dict[str, dict[str, float]], normal: list[dict], noisy: list[dict],
               polite: list[dict], warmup: int) -> dict:
    rep = {c: int(sum(r[c] for r in replicas.values())) for c in ("prompt_tokens", "generation_tokens",
                                                                  "request_success")}
    by_key: dict[str, dict[str, int]] = {}
    for row in ledger:
        k = by_key.setdefault(row["key"], {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        for c in k:
            k[c] += row[c]
    led = {c: sum(k[c] for k in by_key.values()) for c in ("requests", "prompt_tokens", "completion_tokens")}
    nz = [r for r in noisy + polite if r["ok"]]
    # the ledger counts the requests a replica answered (not those refused by the key's limits or by the
    # gateway's own queue: 429 queue_full, 503 no_replica); the replicas count those they finished
    client = {"normal": {"requests": sum(1 for r in normal if reached(r)) + warmup,
                         "completion_tokens": sum(r.get("tokens", 0) for r in normal if r["ok"]) + warmup * MAX_TOKENS},
              "noisy": {"requests": sum(1 for r in noisy + polite if reached(r)),
                        "prompt_tokens": sum(r["usage"][0] for r in nz),
                        "completion_tokens": sum(r["usage"][1] for r in nz)}}
    answered = sum(1 for r in normal + noisy + polite if r["ok"]) + warmup
    mismatches = []
    if led["prompt_tokens"] != rep["prompt_tokens"]:
        mismatches.append(f"prompt tokens: ledger {led['prompt_tokens']} != replicas {rep['prompt_tokens']}")
    if led["completion_tokens"] != rep["generation_tokens"]:
        mismatches.append(f"completion tokens: ledger {led['completion_tokens']} != replicas {rep['generation_tokens']}")
    if rep["request_success"] != answered:
        mismatches.append(f"requests: replicas finished {rep['request_success']} != clients answered {answered}")
    for key, c in client.items():
        for f, v in c.items():
            got = by_key.get(key, {}).get(f, 0)
            if got != v:
                mismatches.append(f"{key} {f}: ledger {got} != clients {v}")
    return {"ledger_rows": ledger, "ledger_by_key": by_key, "ledger_total": led, "replicas": replicas,
            "replicas_total": rep, "clients": client, "clients_answered": answered, "mismatches": mismatches}


def fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(args, res: dict, acct: dict) -> str:
    ph = res["phases"]
    lines = ["| phase (s) | normal sent / failed | normal TTFT p50 (s) | p99 (s) | p99 vs solo | noisy sent "
             "| admitted | refused | admitted/min (phase mean; rpm " + str(args.noisy_rpm) + ") |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, p in ph.items():
        refused = ", ".join(f"{k} {v}" for k, v in sorted(p["noisy_refused"].items())) or "-"
        lines.append(f"| {name} ({p['seconds']:.0f}) | {p['normal_sent']} / {p['normal_failed']} "
                     f"| {fmt(p['ttft_p50_s'])} | {fmt(p['ttft_p99_s'])} | {fmt(p['p99_vs_solo'], 2)}x "
                     f"| {p['noisy_sent']} | {p['noisy_admitted']} | {refused} "
                     f"| {fmt(p['noisy_admitted_per_min'], 1) if p['noisy_sent'] else '-'} |")
    led, rep = acct["ledger_total"], acct["replicas_total"]
    lines += ["", (f"Noisy requests admitted in any 60 s window while its limits were on: at most "
              f"{res['noisy_most_in_60s_limited']} (rpm {args.noisy_rpm}).")]
    cl = acct["clients"]
    lines += ["", "| tokens | `slurmfleet usage --json --by key model` | replicas' own counters | equal |",
              "|---|---:|---:|---|"]
    for what, a, b in (("prompt", led["prompt_tokens"], rep["prompt_tokens"]),
                       ("completion", led["completion_tokens"], rep["generation_tokens"])):
        lines.append(f"| {what} | {a} | {b} | {'yes' if a == b else 'NO'} |")
    lines += ["", "| key | ledger requests / prompt / completion | clients' | equal |", "|---|---:|---:|---|"]
    for key in ("normal", "noisy"):
        k = acct["ledger_by_key"].get(key, {})
        c = cl[key]
        mine = "/".join(str(c.get(f, "-")) for f in ("requests", "prompt_tokens", "completion_tokens"))
        same = all(k.get(f, 0) == v for f, v in c.items())
        lines.append(f"| {key} | {k.get('requests', 0)} / {k.get('prompt_tokens', 0)} / {k.get('completion_tokens', 0)} "
                     f"| {mine.replace('/', ' / ')} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def targets(args, res: dict, acct: dict) -> list[tuple[str, bool | None, str]]:
    """(target, met or None where the run gave nothing to judge it by, detail)."""
    ph = res["phases"]
    lim, peer = ph["limited"], ph["unlimited"]
    pol = res["polite"]
    failed = {n: p["normal_failed"] for n, p in ph.items() if p["normal_failed"] and n != "unlimited"}
    out = [("normal p99 TTFT with the noisy flood (limited) <= 1.2x solo",
            lim["p99_vs_solo"] is not None and lim["p99_vs_solo"] <= 1.2,
            f"{fmt(lim['ttft_p99_s'])}s vs {fmt(ph['solo']['ttft_p99_s'])}s = {fmt(lim['p99_vs_solo'], 2)}x"),
           ("token counts: ledger == replicas' counters, and == each key's clients", not acct["mismatches"],
            "; ".join(acct["mismatches"]) or "0 mismatches"),
           ("every 429 has Retry-After >= 1 (key limits: type and x-ratelimit-* headers too)", not res["bad_429"],
            f"{res['responses_429']} 429s, lacking: {res['bad_429'] or 'none'}"),
           ("rpm 429s: the key had room again no sooner than Retry-After - 1 s (never told to wait too long)",
            res["rpm_retry_after_vs_next_admission"]["early"] == 0,
            ", ".join(f"{k} {v}" for k, v in res["rpm_retry_after_vs_next_admission"].items())),
           (f"noisy admitted <= rpm ({args.noisy_rpm}) in every 60 s window while limited",
            res["noisy_most_in_60s_limited"] <= args.noisy_rpm,
            f"at most {res['noisy_most_in_60s_limited']} (window from t={fmt(res['noisy_most_window_start_s'], 1)}s)"),
           ("no normal request failed while limited (the reload included)", not failed, str(failed or "0 failed")),
           ("polite client: >= 90% of retries after Retry-After admitted",
            None if pol["retry_admitted_share"] is None else pol["retry_admitted_share"] >= 0.9,
            f"{pol['retries_admitted']}/{pol['retries_after_wait']}; admitted {pol['admitted_per_min']}/min"
            + ("" if pol["retries_after_wait"] else " (no retry: every Retry-After reached past the phase)")),
           ("the peer (no limits) degrades normal p99 > 1.2x solo (else the run shows nothing)",
            peer["p99_vs_solo"] is not None and peer["p99_vs_solo"] > 1.2, f"{fmt(peer['p99_vs_solo'], 2)}x")]
    return out


# -- the run ----------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=75.0, help="seconds of phases solo, limited, unlimited (75)")
    ap.add_argument("--polite-s", type=float, default=30.0, help="seconds of the polite phase (30)")
    ap.add_argument("--normal-rps", type=float, default=4.0, help="the normal key's requests/s (4)")
    ap.add_argument("--noisy-rpm", type=int, default=240, help="the noisy key's rpm: its fair share (240)")
    ap.add_argument("--noisy-max-concurrent", type=int, default=8, help="its max_concurrent; 0: none (8)")
    ap.add_argument("--flood-x", type=float, default=10.0, help="the flood's rate as a multiple of rpm (10)")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--out", type=Path, default=Path("/tmp/fairness.json"))
    args = ap.parse_args()

    cluster = LocalCluster()
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    tag = uuid.uuid4().hex[:4]
    run_dir = Path(tempfile.mkdtemp(prefix=f"sf-fairness-{tag}-"))
    name = f"fair{tag}"
    limits = {"rpm": args.noisy_rpm}
    if args.noisy_max_concurrent:
        limits["max_concurrent"] = args.noisy_max_concurrent
    cfg = fleet_config(name, run_dir, cluster.conf, set(), limits)
    cfg_path = run_dir / "fleet.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    gateway = f"http://127.0.0.1:{cfg['gateway']['port']}"
    log_path = run_dir / "daemon.log"
    proc: subprocess.Popen | None = None
    children: list[mp.Process] = []

    def on_term(*_):
        raise KeyboardInterrupt

    def stop_daemon() -> int | None:
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def cleanup() -> None:
        for c in children:
            if c.is_alive():
                c.kill()
        stop_daemon()
        subprocess.run(["scancel", "--name", f"slurmfleet-{name}"], env=env, capture_output=True, timeout=30,
                       check=False)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    T, P = args.phase_s, args.polite_s
    spans = {"solo": (0.0, T), "limited": (T, 2 * T), "polite": (2 * T, 2 * T + P),
             "reload": (2 * T + P, 2 * T + P + RELOAD_GAP_S),
             "unlimited": (2 * T + P + RELOAD_GAP_S, 3 * T + P + RELOAD_GAP_S)}
    end = spans["unlimited"][1]
    with cluster_shared(cluster):
        try:
            print(f"run dir {run_dir}; fleet {name}; noisy limits {limits}; phases {T:g}/{T:g}/{P:g}/{T:g} s",
                  flush=True)
            with open(log_path, "ab") as log:   # the daemon keeps its own copy of the descriptor
                proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config", str(cfg_path),
                                         "--cancel-jobs-on-exit"], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            t_wait = time.monotonic()
            while len(jobs := ready_jobs(cfg)) < 2:
                if proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {proc.returncode}: see {log_path}")
                if time.monotonic() - t_wait > 180:
                    raise RuntimeError(f"2 READY replicas not there after 180 s: see {log_path}")
                time.sleep(0.5)
            print(f"2 replicas READY after {time.monotonic() - t_wait:.0f}s: jobs {jobs}", flush=True)
            warmup = 0
            for i in range(8):   # connections and code paths warm; counted by the accounting check
                status = post(gateway, KEYS["normal"], chat(f"warm-up {i}", MAX_TOKENS, False, False))
                if status != 200:
                    raise RuntimeError(f"warm-up request answered {status}: see {log_path}")
                warmup += 1
            rng = random.Random(args.seed)
            t0 = time.time() + 2.0
            url = gateway + "/v1/chat/completions"
            flood = args.flood_x * args.noisy_rpm / 60.0
            plans = {"normal": {"url": url, "key": KEYS["normal"], "t0": t0, "usage": False,
                                "schedule": poisson(rng, args.normal_rps, [(0.0, end)])},
                     "noisy": {"url": url, "key": KEYS["noisy"], "t0": t0, "usage": True,
                               "schedule": poisson(rng, flood, [spans["limited"], spans["unlimited"]])},
                     "polite": {"url": url, "key": KEYS["noisy"], "t0": t0, "start": spans["polite"][0],
                                "end": spans["polite"][1]}}
            ctx = mp.get_context("fork")
            paths = {k: run_dir / f"client-{k}.json" for k in plans}
            for k, plan in plans.items():
                c = ctx.Process(target=client_main, args=(k, plan, str(paths[k])), name=f"fairness-{k}")
                c.start()
                children.append(c)
            print(f"load: normal {args.normal_rps:g}/s for {end:.0f}s; noisy flood {flood:g}/s in limited and "
                  f"unlimited (rpm {args.noisy_rpm} = {args.noisy_rpm / 60:g}/s)", flush=True)
            time.sleep(max(0.0, t0 + spans["reload"][0] - time.time()))
            new = {**cfg, "gateway": {**cfg["gateway"], "api_keys": keys_config({})}}
            cfg_path.write_text(yaml.safe_dump(new, sort_keys=False))
            t_reload = time.time() - t0
            out = subprocess.run([sys.executable, "-m", "orchestrator", "reload", "--config", str(cfg_path)],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=False)
            reload_res = {"t": round(t_reload, 3), "rc": out.returncode, "took_s": round(time.time() - t0 - t_reload, 3),
                          "output": (out.stdout + out.stderr).strip()}
            print(f"t={t_reload:.1f}s reload: rc {out.returncode}: {reload_res['output']}", flush=True)
            if out.returncode != 0:
                raise RuntimeError("reload failed")
            for c in children:
                c.join(end + REQUEST_TIMEOUT_S + 60 - (time.time() - t0))
                if c.exitcode != 0:
                    raise RuntimeError(f"client {c.name} exited {c.exitcode}")
            print(f"load done at t={time.time() - t0:.0f}s; reading the replicas' counters", flush=True)
            time.sleep(3.0)
            jobs_end = ready_jobs(cfg)
            counters = replica_counters(Path(cfg["state_dir"]), sorted(set(jobs) | set(jobs_end)))
            rc = stop_daemon()
            print(f"daemon stopped (rc {rc})", flush=True)
            use = subprocess.run([sys.executable, "-m", "orchestrator", "usage", "--config", str(cfg_path), "--json",
                                  "--by", "key", "model"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=60, check=False)
            if use.returncode != 0:
                raise RuntimeError(f"slurmfleet usage failed: {use.stderr}")
            ledger = json.loads(use.stdout)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", flush=True)
            cleanup()
            sys.exit(130)
        except BaseException:
            cleanup()
            raise
        cleanup()

    recs = {k: json.loads(p.read_text()) for k, p in paths.items()}
    res = summarize(args, spans, recs["normal"], recs["noisy"], recs["polite"], t_reload)
    acct = accounting(ledger, counters, recs["normal"], recs["noisy"], recs["polite"], warmup)
    if jobs != jobs_end:
        acct["mismatches"].append(f"replicas changed during the run: {jobs} -> {jobs_end} (counters incomplete)")
    table = render(args, res, acct)
    checks = targets(args, res, acct)
    print()
    print(f"## Fairness benchmark: normal {args.normal_rps:g}/s, noisy flood {args.flood_x:g}x its rpm "
          f"{args.noisy_rpm}" + (f" (max_concurrent {args.noisy_max_concurrent})" if args.noisy_max_concurrent
                                 else "") + f", phases {T:g}/{T:g}/{P:g}/{T:g} s")
    print()
    print(table)
    print()
    pol = res["polite"]
    print(f"polite client (phase polite): {pol['sent']} sent, {pol['admitted']} admitted ({pol['admitted_per_min']}/min), "
          f"{pol['retries_admitted']}/{pol['retries_after_wait']} retries after Retry-After admitted; "
          f"Retry-After values by reason: {res['retry_after_by_reason']}")
    print(f"usage ledger by key: {json.dumps(acct['ledger_by_key'])}; clients: {json.dumps(acct['clients'])}")
    print()
    for what, ok, detail in checks:
        print(f"- {'N/A ' if ok is None else 'PASS' if ok else 'FAIL'}  {what}: {detail}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip() or ((ROOT / "COMMIT").read_text().strip()
                                                            if (ROOT / "COMMIT").exists() else None)
    doc = {"commit": commit, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "simulator": SIM, "max_tokens": MAX_TOKENS, "service_s": SERVICE_S, "noisy_limits": limits,
           "spans_s": spans, "reload": reload_res, "config": cfg, "results": res, "accounting": acct,
           "targets": [{"target": w, "pass": ok, "detail": d} for w, ok, d in checks], "markdown": table,
           "run_dir": str(run_dir), "requests": recs}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {args.out}; daemon log {log_path}")
    sys.exit(0 if all(ok is not False for _, ok, _ in checks) else 1)


if __name__ == "__main__":
    main()
