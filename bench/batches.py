"""Batch benchmark: a 20,000-line batch beside a steady interactive load, on the local SLURM cluster.

    flock /tmp/heavy.lock .venv/bin/python bench/batches.py                       # ~8 minutes (+ ~15 s set-up)
    flock /tmp/heavy.lock .venv/bin/python bench/batches.py --quick               # a check of the machinery
    flock /tmp/heavy.lock .venv/bin/python bench/batches.py --rss-lines 1000000   # memory on a 1M-line input

One ``slurmfleet serve`` daemon (fleet ``bat<tag>``, ``gateway.workers`` ``--workers`` (2), its own ports and
state directory under ``/tmp/sf-batches-<tag>-*/``, kept with the daemon log) serves one simulator model
``sim`` on 2 replicas with ``scheduling_policy: priority`` (the engines take waiting requests lowest
``priority`` first; the batch runner's requests carry the gateway's lowest class) and the default
``max_inflight_per_replica`` (64).  Simulator: ``ttft_s`` 0.1, ``tokens_per_s`` 50, ``max_num_seqs`` 16.
A batch line is a non-streamed chat completion of 8 tokens (0.1 + 7/50 = 0.24 s on a free slot: the 32 slots
serve at most 133 lines/s); an interactive request streams 16 tokens (0.1 + 15/50 = 0.4 s).

Keys: ``interactive`` and ``batcher`` (both the default class ``normal``); the batch is the ``batcher``'s,
run by the daemon's batch runner with its own key (class ``_batches``, below every configured class).

Phases, in one run on one fleet:

1. ``solo``    ``--solo-s`` (60 s): the interactive load alone: open-loop seeded Poisson arrivals at
   ``--rps`` (4) requests/s, streaming ``/v1/chat/completions``, client-side TTFT (request sent -> first
   streamed event), the client in a process of its own.
2. ``batch``   the same interactive load goes on; the ``--lines`` (20,000) line file, uploaded (openai SDK,
   ``client.files.create``) before phase 1, becomes a batch (``client.batches.create``) at the phase's start;
   it is polled (``client.batches.retrieve``, every 0.5 s) until ``completed`` (or ``--batch-timeout-s``).
   Every second the replicas' own ``vllm:num_requests_running`` / ``waiting`` are read (the slots the batch
   takes).  Measured: batch wall time (create -> completed seen) and lines/s, also between 10% and 90% done.
3. ``after``   ``--after-s`` (20 s): the interactive load alone again (does the fleet recover; a second baseline).
4. ``direct``  no interactive load: the same ``--lines`` request bodies sent straight to the gateway by one
   client (aiohttp, the ``batcher`` key) with a fixed concurrency ``--direct-concurrency`` = the replicas'
   slots, 2 x 16 = 32: lines/s.  The batch's lines/s over this is the throughput ratio.

The batch's output file is downloaded (``client.files.content``): every ``custom_id`` must be in it exactly
once, each answered 200.

Targets (exit status 1 if one is missed): interactive TTFT p99 during the batch <= 1.10x solo; the batch
completes with every line answered (``completed`` == lines, ``failed`` == 0) and every custom_id exactly once
in the output; no interactive request failed.  The throughput ratio (batch / direct) is reported, no target.

``--rss-lines N`` (instead of the phases above): memory on a large input.  A very fast simulator
(``ttft_s`` 0, ``tokens_per_s`` 10000, ``max_num_seqs`` 64; lines ask for 1 token).  N lines are written to
a JSONL file on disk (streamed), uploaded through ``/v1/files`` as a streamed multipart body (aiohttp reads
the file in chunks), and made a batch; the resident set (``VmRSS`` of ``/proc/<pid>/status``) of the daemon
and of each of its descendant Python processes (the gateway workers) is sampled every 0.1 s: before the
upload, its peak during the upload (and ``VmHWM``), and while the batch runs for ``--rss-run-s`` (120 s),
with a sample at every 50,000 lines done; then the batch is cancelled.  Reported per process and summed, and
as bytes per input line.  Writes ``--out`` (default /tmp/batches-rss.json).

Writes JSON (config, phases, timelines, every interactive request) to ``--out`` (default /tmp/batches.json).
All jobs (``scancel --name slurmfleet-<fleet>``) and the daemon are cleaned up at exit, Ctrl-C and SIGTERM
included; the cluster lock is held shared as in bench/autoscale.py.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.autoscale import cluster_shared, free_port
from bench.fairness import pct, request
from orchestrator.devtools.localcluster import LocalCluster

ADMIN_KEY = "bench-admin"
MODEL = "sim"
SIM = {"ttft_s": 0.1, "tokens_per_s": 50.0, "max_num_seqs": 16}
SIM_FAST = {"ttft_s": 0.0, "tokens_per_s": 10000.0, "max_num_seqs": 64}
MAX_TOKENS_INTERACTIVE = 16
MAX_TOKENS_BATCH = 8
KEYS = {"interactive": "sk-bat-interactive", "batcher": "sk-bat-batcher"}
REQUEST_TIMEOUT_S = 180.0
TARGET_P99_X = 1.10


# -- the fleet --------------------------------------------------------------------------------------------------
def fleet_config(name: str, run_dir: Path, conf: Path, workers: int, sim: dict) -> dict:
    ports: set[int] = set()
    model = {"name": MODEL, "engine": "simulator", "replicas": 2, "gpus_per_node": 1, "cpus_per_task": 1,
             "container": {"enabled": False}, "scheduling_policy": "priority",
             "probe": {"interval_s": 0.5, "timeout_s": 2, "startup_timeout_s": 60},
             "drain": {"timeout_s": 10, "handover_lead_s": 60}, "simulator": dict(sim),
             "backoff": {"base_s": 1, "max_s": 4}}
    return {"fleet": name, "state_dir": str(run_dir / "state"),
            "cluster": {"partition": "gpu", "slurm_conf": str(conf)},
            "gateway": {"host": "127.0.0.1", "port": free_port(ports), "workers": workers,
                        "api_keys": [{"name": k, "key": v} for k, v in KEYS.items()]},
            "daemon": {"tick_interval_s": 0.5, "admin_port": free_port(ports), "admin_api_keys": [ADMIN_KEY]},
            "models": [model]}


class Fleet:
    """One daemon on the local cluster: start, wait for 2 READY replicas, stop, clean up."""

    def __init__(self, tag: str, prefix: str, workers: int, sim: dict):
        self.cluster = LocalCluster()
        self.env = {**os.environ, "SLURM_CONF": str(self.cluster.conf)}
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"sf-{prefix}-{tag}-"))
        self.name = f"bat{tag}"
        self.cfg = fleet_config(self.name, self.run_dir, self.cluster.conf, workers, sim)
        self.cfg_path = self.run_dir / "fleet.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.cfg, sort_keys=False))
        self.gateway = f"http://127.0.0.1:{self.cfg['gateway']['port']}"
        self.log_path = self.run_dir / "daemon.log"
        self.state_dir = Path(self.cfg["state_dir"])
        self.proc: subprocess.Popen | None = None
        self.children: list[mp.Process] = []
        self.jobs: list[str] = []

    def admin(self, path: str) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.cfg['daemon']['admin_port']}{path}",
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def ready_jobs(self) -> list[str]:
        try:
            st = self.admin("/admin/status")
        except (urllib.error.URLError, OSError, ValueError):
            return []
        m = next((m for m in st.get("models", []) if m["model"] == MODEL), None)
        return sorted(r["job_id"] for r in (m or {}).get("replicas", []) if r["state"] == "READY")

    def start(self) -> None:
        with open(self.log_path, "ab") as log:   # the daemon keeps its own copy of the descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config",
                                          str(self.cfg_path), "--cancel-jobs-on-exit"], cwd=ROOT,
                                         env={**self.env, "PYTHONUNBUFFERED": "1"}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        t = time.monotonic()
        while len(jobs := self.ready_jobs()) < 2:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: see {self.log_path}")
            if time.monotonic() - t > 180:
                raise RuntimeError(f"2 READY replicas not there after 180 s: see {self.log_path}")
            time.sleep(0.5)
        self.jobs = jobs
        print(f"2 replicas READY after {time.monotonic() - t:.0f}s: jobs {jobs}", flush=True)
        for i in range(8):   # connections and code paths warm
            status, _ = post(self.gateway + "/v1/chat/completions", KEYS["interactive"], chat_body(f"warm-up {i}", 4))
            if status != 200:
                raise RuntimeError(f"warm-up request answered {status}: see {self.log_path}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self) -> None:
        for c in self.children:
            if c.is_alive():
                c.kill()
        self.stop()
        subprocess.run(["scancel", "--name", f"slurmfleet-{self.name}"], env=self.env, capture_output=True,
                       timeout=30, check=False)

    def gauges(self) -> dict[str, dict[str, float]]:
        """Each replica's running / waiting requests (its own /metrics, with its endpoint record's secret)."""
        out = {}
        for job in self.jobs:
            try:
                rec = json.loads((self.state_dir / "endpoints" / f"{job}.json").read_text())
                req = urllib.request.Request(f"http://{rec['host']}:{rec['port']}/metrics",
                                             headers={"Authorization": f"Bearer {rec['secret']}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    text = r.read().decode()
            except (OSError, ValueError, KeyError):
                continue
            out[job] = {g: sum(float(v) for v in re.findall(rf"^vllm:num_requests_{g}\{{[^}}]*\}} (\S+)$", text,
                                                            re.MULTILINE)) for g in ("running", "waiting")}
        return out


def post(url: str, key: str, body: dict) -> tuple[int, dict | None]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None


def chat_body(text: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def batch_line(i: int, max_tokens: int) -> dict:
    return {"custom_id": f"r{i:07d}", "method": "POST", "url": "/v1/chat/completions",
            "body": chat_body(f"batch line {i}: summarise this", max_tokens)}


def on_term(*_) -> None:
    raise KeyboardInterrupt


def run_async(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# -- the interactive client (a process of its own) --------------------------------------------------------------
async def interactive_loop(url: str, rate: float, seed: int, t0: float, stop) -> list[dict]:
    """Open loop: seeded Poisson arrivals from t0 until ``stop`` is set."""
    import aiohttp

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        tasks, t, i = [], 0.0, 0
        while not stop.is_set():
            t += rng.expovariate(rate)
            delay = t0 + t - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if stop.is_set():
                break
            body = chat_body(f"interactive request {i}: tell me a story", MAX_TOKENS_INTERACTIVE, True)
            tasks.append(asyncio.create_task(request(s, url, KEYS["interactive"], body, t0)))
            i += 1
        return list(await asyncio.gather(*tasks))


def interactive_main(url: str, rate: float, seed: int, t0: float, stop, path: str) -> None:
    Path(path).write_text(json.dumps(run_async(interactive_loop(url, rate, seed, t0, stop))))


# -- the direct client ------------------------------------------------------------------------------------------
async def direct_run(url: str, bodies: list[dict], concurrency: int) -> dict:
    import aiohttp

    statuses: collections.Counter = collections.Counter()
    it = iter(bodies)

    async def worker(s: aiohttp.ClientSession) -> None:
        for body in it:
            try:
                async with s.post(url, json=body, headers={"Authorization": f"Bearer {KEYS['batcher']}"}) as r:
                    await r.read()
                    statuses[r.status] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[type(exc).__name__] += 1
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        t = time.monotonic()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        wall = time.monotonic() - t
    return {"lines": len(bodies), "concurrency": concurrency, "wall_s": round(wall, 2),
            "lines_per_s": round(len(bodies) / wall, 2), "statuses": {str(k): v for k, v in statuses.items()}}


# -- results ----------------------------------------------------------------------------------------------------
def phase_stats(recs: list[dict], lo: float, hi: float) -> dict:
    rs = [r for r in recs if lo <= r["t"] < hi]
    ttft = [r["ttft"] for r in rs if r["ok"]]
    failed = collections.Counter(str(r["status"]) for r in rs if not r["ok"])
    return {"seconds": round(hi - lo, 1), "sent": len(rs), "failed": sum(failed.values()), "failures": dict(failed),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "ttft_max_s": max(ttft) if ttft else None}


def rate_between(timeline: list[dict], total: int, lo: float, hi: float) -> float | None:
    """Lines/s between the polls that first saw ``lo`` and ``hi`` of the batch done."""
    a = next((p for p in timeline if p["done"] >= lo * total), None)
    b = next((p for p in timeline if p["done"] >= hi * total), None)
    if a is None or b is None or b["t"] <= a["t"]:
        return None
    return round((b["done"] - a["done"]) / (b["t"] - a["t"]), 2)


def check_output(text: str, lines: int) -> dict:
    seen: collections.Counter = collections.Counter()
    statuses: collections.Counter = collections.Counter()
    for raw in text.splitlines():
        o = json.loads(raw)
        seen[o["custom_id"]] += 1
        statuses[o["response"]["status_code"]] += 1
    want = {f"r{i:07d}" for i in range(lines)}
    return {"output_lines": sum(seen.values()), "distinct": len(seen), "missing": len(want - set(seen)),
            "duplicated": sum(1 for v in seen.values() if v > 1), "unknown": len(set(seen) - want),
            "statuses": {str(k): v for k, v in statuses.items()}}


def fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# -- the main benchmark -----------------------------------------------------------------------------------------
def main_bench(args) -> int:
    import openai

    tag = uuid.uuid4().hex[:4]
    fleet = Fleet(tag, "batches", args.workers, SIM)
    lines = [batch_line(i, MAX_TOKENS_BATCH) for i in range(args.lines)]
    data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
    client = openai.OpenAI(base_url=fleet.gateway + "/v1", api_key=KEYS["batcher"], max_retries=0, timeout=120)
    paths = {"interactive": fleet.run_dir / "client-interactive.json"}
    timeline: list[dict] = []
    gauges: list[dict] = []
    signal.signal(signal.SIGTERM, on_term)
    with cluster_shared(fleet.cluster):
        try:
            print(f"run dir {fleet.run_dir}; fleet {fleet.name}; workers {args.workers}; {args.lines} lines; "
                  f"interactive {args.rps:g}/s", flush=True)
            fleet.start()
            t = time.monotonic()
            f = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
            upload_s = time.monotonic() - t
            print(f"uploaded {len(data)} bytes, {args.lines} lines in {upload_s:.2f}s: {f.id}", flush=True)
            stop = mp.get_context("fork").Event()
            t0 = time.time() + 1.0
            c = mp.get_context("fork").Process(
                target=interactive_main, name="batches-interactive",
                args=(fleet.gateway + "/v1/chat/completions", args.rps, args.seed, t0, stop,
                      str(paths["interactive"])))
            c.start()
            fleet.children.append(c)
            time.sleep(max(0.0, t0 + args.solo_s - time.time()))
            b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            t_create = time.time() - t0
            print(f"t={t_create:.1f}s batch {b.id} created ({b.status}, {b.request_counts.total} lines)", flush=True)
            next_gauge = 0.0
            while True:
                b = client.batches.retrieve(b.id)
                now = time.time() - t0
                done = b.request_counts.completed + b.request_counts.failed
                timeline.append({"t": round(now, 2), "status": b.status, "done": done,
                                 "completed": b.request_counts.completed, "failed": b.request_counts.failed})
                if now >= next_gauge:
                    gauges.append({"t": round(now, 2), "replicas": fleet.gauges()})
                    next_gauge = now + 1.0
                    if len(gauges) % 15 == 0:
                        print(f"t={now:.0f}s {b.status}: {done}/{args.lines} done", flush=True)
                if b.status in ("completed", "failed", "expired", "cancelled"):
                    break
                if now - t_create > args.batch_timeout_s:
                    print(f"batch not done after {args.batch_timeout_s:g}s: cancelling", flush=True)
                    client.batches.cancel(b.id)
                    args.batch_timeout_s = float("inf")
                time.sleep(0.5)
            t_done = time.time() - t0
            print(f"t={t_done:.1f}s batch {b.status}: {b.request_counts.completed} completed, "
                  f"{b.request_counts.failed} failed in {t_done - t_create:.1f}s", flush=True)
            time.sleep(max(0.0, t0 + t_done + args.after_s - time.time()))
            t_end = time.time() - t0
            stop.set()
            c.join(REQUEST_TIMEOUT_S + 30)
            if c.exitcode != 0:
                raise RuntimeError(f"interactive client exited {c.exitcode}")
            batch = b.model_dump()
            out = check_output(client.files.content(b.output_file_id).text, args.lines) if b.output_file_id else {}
            errors = client.files.content(b.error_file_id).text.splitlines()[:5] if b.error_file_id else []
            print(f"output: {out}", flush=True)
            time.sleep(2.0)
            print(f"direct: {args.lines} requests at concurrency {args.direct_concurrency}", flush=True)
            direct = run_async(direct_run(fleet.gateway + "/v1/chat/completions", [x["body"] for x in lines],
                                          args.direct_concurrency))
            print(f"direct: {direct}", flush=True)
            rc = fleet.stop()
            print(f"daemon stopped (rc {rc})", flush=True)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", flush=True)
            return 130
        finally:
            fleet.cleanup()

    recs = json.loads(paths["interactive"].read_text())
    phases = {"solo": phase_stats(recs, 0.0, t_create), "batch": phase_stats(recs, t_create, t_done),
              "after": phase_stats(recs, t_done, t_end)}
    solo99 = phases["solo"]["ttft_p99_s"]
    for p in phases.values():
        p["p99_vs_solo"] = round(p["ttft_p99_s"] / solo99, 3) if p["ttft_p99_s"] and solo99 else None
        p["p50_vs_solo"] = (round(p["ttft_p50_s"] / phases["solo"]["ttft_p50_s"], 3)
                            if p["ttft_p50_s"] and phases["solo"]["ttft_p50_s"] else None)
    wall = t_done - t_create
    counts = batch["request_counts"]
    res = {"batch_wall_s": round(wall, 2), "batch_lines_per_s": round(counts["completed"] / wall, 2),
           "batch_lines_per_s_10_90": rate_between(timeline, args.lines, 0.1, 0.9),
           "direct_lines_per_s": direct["lines_per_s"],
           "ratio": round(counts["completed"] / wall / direct["lines_per_s"], 3)}
    res["ratio_10_90"] = (round(res["batch_lines_per_s_10_90"] / direct["lines_per_s"], 3)
                          if res["batch_lines_per_s_10_90"] else None)
    busy = [sum(r["running"] for r in g["replicas"].values()) for g in gauges]
    waiting = [sum(r["waiting"] for r in g["replicas"].values()) for g in gauges]
    res["engines_running_mean"] = round(sum(busy) / len(busy), 1) if busy else None
    res["engines_waiting_mean"] = round(sum(waiting) / len(waiting), 2) if waiting else None
    res["engines_seconds_waiting_gt0"] = sum(1 for w in waiting if w > 0)
    table = render(args, phases, res, counts, out)
    checks = [
        (f"interactive TTFT p99 during the batch <= {TARGET_P99_X:.2f}x solo",
         phases["batch"]["p99_vs_solo"] is not None and phases["batch"]["p99_vs_solo"] <= TARGET_P99_X,
         f"{fmt(phases['batch']['ttft_p99_s'])}s vs {fmt(solo99)}s = {fmt(phases['batch']['p99_vs_solo'], 2)}x"),
        ("the batch completes, every line answered",
         batch["status"] == "completed" and counts["completed"] == args.lines and counts["failed"] == 0,
         f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed of {counts['total']}"
         + (f"; errors {errors}" if errors else "")),
        ("output: every custom_id exactly once, each 200",
         bool(out) and out["output_lines"] == args.lines and out["missing"] == 0 and out["duplicated"] == 0
         and out["statuses"] == {"200": args.lines}, json.dumps(out)),
        ("no interactive request failed", not any(p["failed"] for p in phases.values()),
         ", ".join(f"{n} {p['failures']}" for n, p in phases.items() if p["failed"]) or "0 failed")]
    print()
    print(f"## Batch benchmark: {args.lines} lines beside {args.rps:g} interactive requests/s, "
          f"gateway.workers {args.workers}")
    print()
    print(table)
    print()
    for what, ok, detail in checks:
        print(f"- {'PASS' if ok else 'FAIL'}  {what}: {detail}")
    doc = {"commit": commit(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "simulator": SIM, "max_tokens": {"interactive": MAX_TOKENS_INTERACTIVE, "batch": MAX_TOKENS_BATCH},
           "config": fleet.cfg, "upload_s": round(upload_s, 3), "spans_s": {"solo": [0, t_create],
           "batch": [t_create, t_done], "after": [t_done, t_end]}, "phases": phases, "throughput": res,
           "batch": batch, "output_check": out, "direct": direct,
           "targets": [{"target": w, "pass": ok, "detail": d} for w, ok, d in checks], "markdown": table,
           "timeline": timeline, "engine_gauges": gauges, "run_dir": str(fleet.run_dir), "requests": recs}
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nJSON: {args.out}; daemon log {fleet.log_path}")
    return 0 if all(ok for _, ok, _ in checks) else 1


def render(args, phases: dict, res: dict, counts: dict, out: dict) -> str:
    lines = ["| phase (s) | interactive sent / failed | TTFT p50 (s) | p90 (s) | p99 (s) | p99 vs solo |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, p in phases.items():
        lines.append(f"| {name} ({p['seconds']:.0f}) | {p['sent']} / {p['failed']} | {fmt(p['ttft_p50_s'])} "
                     f"| {fmt(p['ttft_p90_s'])} | {fmt(p['ttft_p99_s'])} | {fmt(p['p99_vs_solo'], 2)}x |")
    lines += ["", f"| batch of {args.lines} lines | wall (s) | lines/s | lines/s 10-90% | vs direct |",
              "|---|---:|---:|---:|---:|",
              (f"| Batch API (beside the interactive load) | {res['batch_wall_s']:.1f} "
               f"| {res['batch_lines_per_s']:.1f} | {fmt(res['batch_lines_per_s_10_90'], 1)} | {fmt(res['ratio'], 2)}x |"),
              (f"| direct, {args.direct_concurrency} at once (alone) | {args.lines / res['direct_lines_per_s']:.1f} "
               f"| {res['direct_lines_per_s']:.1f} | - | 1.00x |"), "",
              (f"Batch: {counts['completed']} completed, {counts['failed']} failed; output {out.get('output_lines')} "
               f"lines, {out.get('distinct')} distinct custom_ids, {out.get('missing')} missing, "
               f"{out.get('duplicated')} duplicated. Engines while it ran: {res['engines_running_mean']} of 32 slots "
               f"running on average, {res['engines_waiting_mean']} waiting on average "
               f"({res['engines_seconds_waiting_gt0']} one-second samples with any waiting).")]
    return "\n".join(lines)


def commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() or ((ROOT / "COMMIT").read_text().strip() if (ROOT / "COMMIT").exists() else None)


# -- memory on a large input ------------------------------------------------------------------------------------
def rss_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in KiB, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    got = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE))
    return int(got.get("VmRSS", 0)), int(got.get("VmHWM", 0))


def python_tree(root: int) -> dict[int, str]:
    """The daemon and its descendant Python processes: pid -> a short name."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo, workers = {}, [root], 0
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = " ".join(c.decode(errors="replace") for c in cmd if c)
        if pid == root:
            out[pid] = f"daemon ({pid})"
        elif "orchestrator.gateway.worker" in text:
            workers += 1
            out[pid] = f"gateway worker {workers} ({pid})"
        elif "python" in text:
            out[pid] = f"{text[:60]} ({pid})"
        todo += sorted(p for p, pp in parent.items() if pp == pid)
    return out


class RssSampler:
    """Samples the tree's VmRSS every ``every`` seconds in a thread; ``mark`` snapshots it now."""

    def __init__(self, root: int, every: float = 0.1):
        self.root, self.every = root, every
        self.procs = python_tree(root)
        self.peak: dict[int, int] = {}
        self.samples: list[dict] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def now(self) -> dict[str, int]:
        out = {}
        for pid, name in self.procs.items():
            r = rss_kib(pid)
            if r:
                out[name] = r[0]
        return out

    def hwm(self) -> dict[str, int]:
        return {name: r[1] for pid, name in self.procs.items() if (r := rss_kib(pid))}

    def _loop(self) -> None:
        while not self.halt.wait(self.every):
            for pid, name in self.procs.items():
                r = rss_kib(pid)
                if r:
                    self.peak[name] = max(self.peak.get(name, 0), r[0])

    def reset_peak(self) -> None:
        self.peak = {}

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()


def write_input(path: Path, n: int) -> int:
    with open(path, "wb") as f:
        f.writelines(json.dumps(batch_line(i, 1), separators=(",", ":")).encode() + b"\n" for i in range(n))
        return f.tell()


async def upload_file(gateway: str, path: Path) -> tuple[int, dict]:
    import aiohttp

    fh = open(path, "rb")  # noqa: ASYNC230, SIM115 (aiohttp reads it in chunks as it sends)
    try:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", fh, filename=path.name, content_type="application/jsonl")
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s,
                    s.post(gateway + "/v1/files", data=form,
                           headers={"Authorization": f"Bearer {KEYS['batcher']}"}) as r):
            return r.status, await r.json(content_type=None)
    finally:
        fh.close()


def api(fleet: Fleet, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(fleet.gateway + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEYS['batcher']}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def rss_bench(args) -> int:
    tag = uuid.uuid4().hex[:4]
    fleet = Fleet(tag, "batches-rss", args.workers, SIM_FAST)
    n = args.rss_lines
    input_path = fleet.run_dir / "input.jsonl"
    signal.signal(signal.SIGTERM, on_term)
    marks: list[dict] = []
    with cluster_shared(fleet.cluster):
        try:
            print(f"run dir {fleet.run_dir}; fleet {fleet.name}; workers {args.workers}; {n} lines", flush=True)
            t = time.monotonic()
            size = write_input(input_path, n)
            print(f"wrote {size} bytes ({n} lines) in {time.monotonic() - t:.1f}s", flush=True)
            fleet.start()
            time.sleep(3.0)
            sampler = RssSampler(fleet.proc.pid)
            before, hwm_before = sampler.now(), sampler.hwm()
            print(f"processes {sorted(sampler.procs.values())}; RSS before (KiB) {before}", flush=True)
            sampler.start()
            t = time.monotonic()
            status, f = run_async(upload_file(fleet.gateway, input_path))
            upload_s = time.monotonic() - t
            if status != 200:
                raise RuntimeError(f"upload answered {status}: {f}")
            up_peak, up_hwm, after_upload = dict(sampler.peak), sampler.hwm(), sampler.now()
            print(f"uploaded in {upload_s:.1f}s ({size / upload_s / 2**20:.1f} MiB/s): {f['id']}; sampled peak RSS "
                  f"(KiB) {up_peak}; VmHWM {up_hwm}", flush=True)
            sampler.reset_peak()
            b = api(fleet, "POST", "/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})
            t_create = time.monotonic()
            next_mark, last = 0, {}
            while time.monotonic() - t_create < args.rss_run_s:
                time.sleep(1.0)
                b = api(fleet, "GET", f"/v1/batches/{b['id']}")
                rc = b["request_counts"]
                done = rc["completed"] + rc["failed"]
                snap = sampler.now()
                last = {"t": round(time.monotonic() - t_create, 1), "done": done, "rss_kib": snap}
                if done >= next_mark:
                    marks.append(last)
                    print(f"t={last['t']:.0f}s {done} done: RSS (KiB) {snap}", flush=True)
                    next_mark = (done // 50_000 + 1) * 50_000
                if b["status"] not in ("validating", "in_progress"):
                    break
            if marks[-1] is not last:
                marks.append(last)
            run_peak = dict(sampler.peak)
            api(fleet, "POST", f"/v1/batches/{b['id']}/cancel")
            t = time.monotonic()
            while (b := api(fleet, "GET", f"/v1/batches/{b['id']}"))["status"] not in ("cancelled", "completed"):
                if time.monotonic() - t > 120:
                    raise RuntimeError(f"batch not cancelled after 120 s: {b['status']}")
                time.sleep(0.5)
            time.sleep(1.0)
            after_cancel = sampler.now()
            sampler.stop()
            print(f"batch {b['status']} with {b['request_counts']}; RSS after (KiB) {after_cancel}", flush=True)
            rc = fleet.stop()
            print(f"daemon stopped (rc {rc})", flush=True)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", flush=True)
            return 130
        finally:
            input_path.unlink(missing_ok=True)
            fleet.cleanup()
    subprocess.run(["rm", "-rf", str(fleet.state_dir / "files"), str(fleet.state_dir / "batches")], check=False)

    def total(d: dict) -> int:
        return sum(d.values())
    res = {"lines": n, "bytes": size, "upload_s": round(upload_s, 2), "processes": sorted(sampler.procs.values()),
           "rss_before_kib": before, "rss_peak_upload_kib": up_peak, "vmhwm_before_kib": hwm_before,
           "vmhwm_after_upload_kib": up_hwm, "rss_after_upload_kib": after_upload, "rss_peak_run_kib": run_peak,
           "rss_at_marks": marks, "rss_after_cancel_kib": after_cancel, "batch": b,
           "lines_done_in_run": marks[-1]["done"] if marks else 0, "run_s": args.rss_run_s}
    # the 0.1 s samples can miss the upload's peak (the duplicate check's table doubling): VmHWM does not
    res["upload_growth_bytes_per_line"] = round((total(up_hwm) - total(hwm_before)) * 1024 / n, 1)
    res["run_growth_bytes_per_line"] = round((total(run_peak) - total(after_upload)) * 1024 / n, 1)
    lines = [("| process | RSS before (MiB) | VmHWM before | VmHWM after upload (peak) | RSS after upload "
              "| peak RSS while running | RSS after cancel |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for k in sorted(before):
        lines.append(f"| {re.sub(r' [(].*', '', k)} | {mib(before[k])} | {mib(hwm_before.get(k))} "
                     f"| {mib(up_hwm.get(k))} | {mib(after_upload.get(k))} | {mib(run_peak.get(k))} "
                     f"| {mib(after_cancel.get(k))} |")
    lines.append(f"| all | {mib(total(before))} | {mib(total(hwm_before))} | {mib(total(up_hwm))} "
                 f"| {mib(total(after_upload))} | {mib(total(run_peak))} | {mib(total(after_cancel))} |")
    table = "\n".join(lines)
    summary = (f"{n} lines ({size / 2**20:.0f} MiB) uploaded in {upload_s:.1f}s; "
               f"{res['lines_done_in_run']} lines done in {args.rss_run_s:g}s of running, then cancelled. "
               f"Peak growth in the upload (VmHWM, all processes): {res['upload_growth_bytes_per_line']} bytes per "
               f"input line; while running (peak RSS over RSS after the upload): "
               f"{res['run_growth_bytes_per_line']} bytes per input line.")
    print()
    print(f"## Batch memory: {n} lines, gateway.workers {args.workers}")
    print()
    print(table)
    print()
    print(summary)
    doc = {"commit": commit(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "simulator": SIM_FAST, "config": fleet.cfg, "results": res, "markdown": table, "summary": summary,
           "run_dir": str(fleet.run_dir)}
    out = args.out if args.out != Path("/tmp/batches.json") else Path("/tmp/batches-rss.json")
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nJSON: {out}; daemon log {fleet.log_path}")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=20_000, help="lines of the batch (20000)")
    ap.add_argument("--rps", type=float, default=4.0, help="interactive requests/s (4)")
    ap.add_argument("--solo-s", type=float, default=60.0, help="seconds of the interactive load alone (60)")
    ap.add_argument("--after-s", type=float, default=20.0, help="seconds of it alone after the batch (20)")
    ap.add_argument("--batch-timeout-s", type=float, default=600.0, help="cancel the batch after this (600)")
    ap.add_argument("--direct-concurrency", type=int, default=2 * SIM["max_num_seqs"],
                    help="the direct client's requests at once (32: the replicas' slots)")
    ap.add_argument("--workers", type=int, default=2, help="gateway.workers (2)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="2000 lines, 15 s solo, 5 s after: the machinery")
    ap.add_argument("--rss-lines", type=int, default=0, help="instead: memory on an input of this many lines")
    ap.add_argument("--rss-run-s", type=float, default=120.0, help="seconds the large batch runs (120)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/batches.json"))
    args = ap.parse_args()
    if args.quick:
        args.lines, args.solo_s, args.after_s = 2000, 15.0, 5.0
        args.rss_run_s = min(args.rss_run_s, 20.0)
    sys.exit(rss_bench(args) if args.rss_lines else main_bench(args))


if __name__ == "__main__":
    main()
