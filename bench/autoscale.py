"""Autoscaling benchmark: one compressed day replayed into four fleets at once, on the local SLURM cluster.

    flock /tmp/heavy.lock .venv/bin/python bench/autoscale.py                 # 16 minutes (+ ~1 min set-up)
    flock /tmp/heavy.lock .venv/bin/python bench/autoscale.py --minutes 4     # a quick check

Four ``slurmfleet serve`` daemons run side by side (fleet names ``as<tag>-max|-one|-ema|-auto``, their own
ports and state directories under ``/tmp/sf-autoscale-<tag>-*/``, kept with the daemon logs), each serving one
simulator model (``gpus_per_node: 1``, ``cpus_per_task: 1``; at most 4 + 1 + 4 + 4 = 13 of the local cluster's
16 GPUs):

(a) ``max``  ``replicas: MAX`` (fixed at the maximum);
(b) ``one``  ``replicas: 1``;
(c) ``ema``  the peer baseline, reimplemented here (not in slurmfleet): a fleet of ``replicas: 0`` whose count
     this script sets through the admin API (``POST /admin/scale``) from its own loop: every ``POLL_S`` = 5 s it
     samples the requests in flight to that fleet (sent by the load generator and not finished: in the gateway
     queue or on a replica), folds them into an exponential moving average ``avg = a*x + (1-a)*avg`` with
     ``a = EMA_ALPHA`` = 0.4 (time constant -5 s / ln(0.6) = 9.8 s, about (d)'s 10 s window) and sets
     ``ceil(avg / TARGET)`` clamped to [0, MAX]. The average is kept to 2 decimals (truncated), so after a load
     it reaches 0 (and the count 0) about 65 s after the last request, comparable with (d)'s
     ``scale_to_zero_after_s``.
     The peer answers 404 "Model Not Loaded" while it has no replica: modelled here by the load generator,
     which does not send a request to (c) while (c) has no READY replica (per the latest 1 s status sample) and
     counts it as failed at once; it never reaches slurmfleet's gateway, so (c) does not benefit from the
     held-request wake. Such a refused request is counted as demand in the next poll's sample (the peer must
     see a request to leave zero at all; without this the rule would stay at zero for ever);
(d) ``auto`` slurmfleet's autoscaler: ``autoscale: {min_replicas: 0, max_replicas: MAX,
     target_inflight_per_replica: TARGET (6), window_s: 10, scale_up_delay_s: 5, scale_down_delay_s:
     30 x minutes/16, scale_to_zero_after_s: 30 x minutes/16, cold_start_hold_s: 120, tolerance: 0.3,
     engine_waiting_high: 0, kv_cache_high: 0.9, pressure_scale_up_delay_s: 2, trend_window_s: 90}``
     (the delays that track the day scale with ``--minutes``; the window and the up delays are set by the
     cold start, a few seconds here, and do not; the trend window is the default until 2026-12-07, 90 s, kept
     for this compressed day: the default is now 300 s).

Replicas (the simulator): ``ttft_s`` 0.25, ``tokens_per_s`` 4, ``max_num_seqs`` 10; every request asks for 12
streamed tokens, so one takes about 0.25 + 11/4 = 3.0 s and one replica runs 10 at once: it saturates at 10
in flight (about 3.3 requests/s); beyond that requests wait in the engine and their TTFT grows by whole
request times. TARGET = 6 in flight per replica (60 % of a replica's slots: the headroom that open-loop Poisson
arrivals need) is used by both (c) and (d).

Load: open-loop Poisson arrivals (one seeded arrival schedule, sent to all four gateways at the same instants, in
a shuffled order each time),
streaming ``/v1/chat/completions``. The rate is ``level(t) x BURST / 3.0 s`` with BURST = 22 requests in flight
at level 1 (ceil(22 / 6) = 4 replicas: the burst needs the maximum). The day, as fractions of ``--minutes``:

    idle 6 %  |  ramp 16 % (level 0.05 -> 1)  |  burst 18 % (1)  |  steady middle 35 % (0.5)  |  idle 25 %

Below about 8 minutes the ramp (0.16 x the day) is shorter than a reactive autoscaler's lag (averaging window
+ up delay + a ~4 s cold start): short runs check the machinery, not the numbers.

Measured per fleet over the trace (after (a) and (b) are READY):

* replica-seconds held: every second one ``squeue`` counts each fleet's jobs PENDING, CONFIGURING, RUNNING or
  COMPLETING (every state that holds or waits for a GPU), integrated over the trace;
* requests ok / failed (an HTTP error, a broken stream, a client timeout of 180 s, or, for (c), refused at zero);
* TTFT (client side: request sent -> first streamed chunk) p50 / p99 over the successful requests outside cold
  starts; a request is a cold start if it was sent while its fleet had zero READY replicas (the latest 1 s
  ``/admin/status`` sample); for (d) its TTFT is reported as the cold-start wait.

Prints a markdown table (plus one per phase) and the targets of issue 11 item 6, and writes everything (configs,
per-second timeline, per-request records, (c)'s decisions) as JSON to ``--out``.  All jobs (``scancel --name
slurmfleet-<fleet>``) and daemons are cleaned up at exit, Ctrl-C and SIGTERM included.  While it runs it holds
the test suite's cluster lock shared (as a cluster test does), so no test sets a node DOWN under it; a local
cluster that is not running is started first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.devtools.localcluster import LocalCluster

ADMIN_KEY = "bench-admin"
MODEL = "sim"
SIM = {"ttft_s": 0.25, "tokens_per_s": 4.0, "max_num_seqs": 10}
MAX_TOKENS = 12
SERVICE_S = SIM["ttft_s"] + (MAX_TOKENS - 1) / SIM["tokens_per_s"]   # one request alone on a replica
TARGET = 6.0          # in flight per replica, for (c) and (d)
POLL_S = 5.0          # (c)'s poll
EMA_ALPHA = 0.4       # (c)'s EMA weight of a new sample
REQUEST_TIMEOUT_S = 180.0
HELD_STATES = "PENDING,CONFIGURING,RUNNING,COMPLETING"
# the day: (name, fraction of the trace, level at its start, level at its end)
PHASES = (("idle", 0.06, 0.0, 0.0), ("ramp", 0.16, 0.05, 1.0), ("burst", 0.18, 1.0, 1.0),
          ("middle", 0.35, 0.5, 0.5), ("idle-end", 0.25, 0.0, 0.0))


# -- the trace ---------------------------------------------------------------------------------------------------
def phase_at(t: float, total: float) -> tuple[str, float]:
    """(phase name, load level) at ``t`` seconds into a trace of ``total`` seconds."""
    start = 0.0
    for name, frac, lo, hi in PHASES:
        end = start + frac * total
        if t < end or name == PHASES[-1][0]:
            x = min(1.0, max(0.0, (t - start) / (end - start))) if end > start else 0.0
            return name, lo + (hi - lo) * x
        start = end
    raise AssertionError("unreachable")


def arrivals(total: float, burst_inflight: float, seed: int) -> list[float]:
    """Poisson arrival times of rate ``level(t) * burst_inflight / SERVICE_S`` (thinning a homogeneous process
    at the peak rate)."""
    rng = random.Random(seed)
    peak = burst_inflight / SERVICE_S
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= total:
            return out
        if rng.random() < phase_at(t, total)[1]:
            out.append(t)


def ema_step(avg: float, sample: float, max_replicas: int) -> tuple[float, int]:
    """(c)'s rule, one poll: the new average and the replica count it sets.  The average is kept to 2 decimals,
    truncated (rounding would stick at 0.01: 0.6 x 0.01 rounds back up)."""
    avg = math.floor((EMA_ALPHA * sample + (1 - EMA_ALPHA) * avg) * 100 + 1e-9) / 100
    return avg, max(0, min(max_replicas, math.ceil(avg / TARGET - 1e-9)))


# -- processes and the cluster -------------------------------------------------------------------------------------
def free_port(taken: set[int]) -> int:
    """A free port in 10000-19999 (below the ephemeral range, away from the local clusters' 16000-17999 and
    from the jobs' 20000-59999)."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(10000, 20000)
        if 16000 <= port < 18000 or port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free port in 10000-19999")


@contextlib.contextmanager
def cluster_shared(cluster: LocalCluster):
    """Hold the test suite's cluster lock (tests/conftest.py ClusterLock) shared, starting the cluster (held
    exclusively) when it is not running."""
    lock = Path(tempfile.gettempdir()) / f"slurmfleet-tests-{os.getuid()}.lock"
    gate = lock.with_name(lock.name + ".gate")

    def take(mode: int) -> int:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        g = os.open(gate, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(g, fcntl.LOCK_EX)   # behind a writer that waits
            fcntl.flock(fd, mode)
        finally:
            os.close(g)
        return fd

    if not cluster_running(cluster):
        fd = take(fcntl.LOCK_EX)
        try:
            if not cluster_running(cluster):
                print("local SLURM cluster not running: starting it", flush=True)
                cluster.up()
        finally:
            os.close(fd)
    fd = take(fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(fd)


def cluster_running(c: LocalCluster) -> bool:
    """Every daemon alive and every node usable (as tests/conftest.py checks it)."""
    st = c.status()
    nodes = [n for n in st["nodes"] if len(n) > 1]
    usable = ("idle", "allocated", "mixed", "completing", "planned")
    return (all(st["daemons"].values()) and {n[0] for n in nodes} == set(c.node_names)
            and all(n[1].rstrip("*~#!%$@^-") in usable for n in nodes))


# -- the fleets ----------------------------------------------------------------------------------------------------
@dataclass
class Fleet:
    key: str          # a, b, c, d
    label: str
    name: str         # the SLURM fleet name
    cfg: dict
    dir: Path
    proc: subprocess.Popen | None = None
    log: Path | None = None
    # live state, from the monitor
    ready: int = 0
    held: int = 0
    desired: int | None = None
    job_ids: set[str] = field(default_factory=set)
    # load generator counters
    inflight: int = 0
    refused_since_poll: int = 0
    records: list[list] = field(default_factory=list)   # [t_sent, ttft or None, ok, cold, status]
    replica_s: float = 0.0
    phase_replica_s: dict[str, float] = field(default_factory=dict)

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.cfg['gateway']['port']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.cfg['daemon']['admin_port']}"


def model_config(fixed: int | None, auto: dict | None) -> dict:
    m = {"name": MODEL, "engine": "simulator", "gpus_per_node": 1, "cpus_per_task": 1,
         "container": {"enabled": False}, "probe": {"interval_s": 0.5, "timeout_s": 2, "startup_timeout_s": 60},
         "drain": {"timeout_s": 10, "handover_lead_s": 60}, "simulator": dict(SIM),
         "backoff": {"base_s": 1, "max_s": 4}}
    if auto is not None:
        m["autoscale"] = auto
    else:
        m["replicas"] = fixed
    return m


def autoscale_config(max_replicas: int, minutes: float) -> dict:
    k = minutes / 16.0
    return {"min_replicas": 0, "max_replicas": max_replicas, "target_inflight_per_replica": TARGET,
            "window_s": 10, "scale_up_delay_s": 5, "scale_down_delay_s": round(30 * k, 1),
            "scale_to_zero_after_s": round(30 * k, 1), "cold_start_hold_s": 120, "tolerance": 0.3,
            "engine_waiting_high": 0, "kv_cache_high": 0.9, "pressure_scale_up_delay_s": 2, "trend_window_s": 90}


def make_fleets(run_dir: Path, tag: str, max_replicas: int, minutes: float, conf: Path) -> list[Fleet]:
    ports: set[int] = set()
    spec = [("a", f"(a) fixed {max_replicas}", "max", model_config(max_replicas, None)),
            ("b", "(b) fixed 1", "one", model_config(1, None)),
            ("c", "(c) 5 s-poll EMA", "ema", model_config(0, None)),
            ("d", "(d) slurmfleet autoscale", "auto", model_config(None, autoscale_config(max_replicas, minutes)))]
    fleets = []
    for key, label, suffix, model in spec:
        name = f"as{tag}-{suffix}"
        d = run_dir / name
        d.mkdir(parents=True)
        cfg = {"fleet": name, "state_dir": str(d / "state"),
               "cluster": {"partition": "gpu", "slurm_conf": str(conf)},
               "gateway": {"host": "127.0.0.1", "port": free_port(ports)},
               "daemon": {"tick_interval_s": 0.5, "admin_port": free_port(ports), "admin_api_keys": [ADMIN_KEY]},
               "models": [model]}
        (d / "fleet.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        fleets.append(Fleet(key, label, name, cfg, d))
    return fleets


def start_daemon(f: Fleet, env: dict[str, str]) -> None:
    f.log = f.dir / "daemon.log"
    # a session of its own: a Ctrl-C in the terminal reaches this script, which stops the daemons in order
    f.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config", str(f.dir / "fleet.yaml"),
                               "--cancel-jobs-on-exit"], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                              stdout=open(f.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def cleanup(fleets: list[Fleet], env: dict[str, str]) -> None:
    """Stop every daemon (SIGTERM, SIGKILL after 30 s), then cancel every job of every fleet."""
    for f in fleets:
        if f.proc and f.proc.poll() is None:
            f.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for f in fleets:
        if f.proc and f.proc.poll() is None:
            try:
                f.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                f.proc.kill()
                f.proc.wait()
    if not fleets:
        return
    for f in fleets:
        subprocess.run(["scancel", "--name", f"slurmfleet-{f.name}"], env=env, capture_output=True, timeout=30, check=False)
    deadline = time.monotonic() + 20
    while True:
        left = subprocess.run(["squeue", "-h", "-o", "%i %j %T", "--name",
                               ",".join(f"slurmfleet-{f.name}" for f in fleets)],
                              env=env, capture_output=True, text=True, timeout=30, check=False).stdout.split("\n")
        left = [ln for ln in left if ln.strip()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    print("cleanup: daemons stopped, jobs cancelled" + (f"; still listed: {left}" if left else ""), flush=True)


# -- the run -------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, fleets: list[Fleet], env: dict[str, str]):
        self.args = args
        self.fleets = fleets
        self.by_key = {f.key: f for f in fleets}
        self.env = env
        self.total = args.minutes * 60.0
        self.t0 = 0.0        # monotonic start of the trace
        self.timeline: list[dict] = []
        self.ema_log: list[dict] = []
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.admin_session: aiohttp.ClientSession | None = None
        self.stop = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def status(self, f: Fleet) -> dict:
        assert self.admin_session
        async with self.admin_session.get(f.admin + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json()

    async def scale(self, f: Fleet, n: int) -> None:
        assert self.admin_session
        async with self.admin_session.post(f.admin + "/admin/scale", json={"model": MODEL, "replicas": n},
                                           headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                           timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise RuntimeError(f"scale {f.name} to {n}: HTTP {r.status}: {await r.text()}")

    async def refresh(self, f: Fleet) -> None:
        try:
            st = await self.status(f)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return   # keep the last sample
        m = next(m for m in st["models"] if m["model"] == MODEL)
        f.ready, f.desired = m["ready"], m["desired"]

    async def squeue(self) -> dict[str, list[tuple[str, str]]]:
        names = ",".join(f"slurmfleet-{f.name}" for f in self.fleets)
        p = await asyncio.create_subprocess_exec("squeue", "-h", "-t", HELD_STATES, "--name", names, "-o", "%i|%j|%T",
                                                 env=self.env, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 20)
        if p.returncode != 0:
            raise RuntimeError(f"squeue: {err.decode().strip()}")
        jobs: dict[str, list[tuple[str, str]]] = {f.name: [] for f in self.fleets}
        for line in out.decode().splitlines():
            jid, name, state = (line.split("|") + ["", ""])[:3]
            name = name.removeprefix("slurmfleet-")
            if name in jobs:
                jobs[name].append((jid.strip(), state.strip()))
        return jobs

    async def monitor(self) -> None:
        """Each second: one squeue (jobs held per fleet, integrated) and every fleet's /admin/status (READY)."""
        last: float | None = None
        while not self.stop.is_set():
            tick = time.monotonic()
            try:
                jobs = await self.squeue()
            except (RuntimeError, TimeoutError) as exc:
                print(f"  monitor: {exc}", flush=True)
                jobs = None
            await asyncio.gather(*(self.refresh(f) for f in self.fleets))
            t = self.now()
            if jobs is not None:
                for f in self.fleets:
                    f.held = len(jobs[f.name])
                    if t >= 0:
                        f.job_ids.update(j for j, _ in jobs[f.name])
            if t >= 0:
                if last is None:
                    last = 0.0   # the first sample of the trace stands for its first second
                dt = min(t, self.total) - last
                if dt > 0:
                    phase = phase_at(last, self.total)[0]
                    for f in self.fleets:
                        f.replica_s += f.held * dt
                        f.phase_replica_s[phase] = f.phase_replica_s.get(phase, 0.0) + f.held * dt
                last = min(t, self.total)
                self.timeline.append({"t": round(t, 2), **{f.key: {"held": f.held, "ready": f.ready,
                                                                   "desired": f.desired, "inflight": f.inflight}
                                                           for f in self.fleets}})
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))

    async def ema_baseline(self) -> None:
        """(c): the peer's rule, every POLL_S seconds."""
        f = self.by_key["c"]
        avg, current = 0.0, 0
        while not self.stop.is_set():
            await asyncio.sleep(POLL_S)
            sample = f.inflight + f.refused_since_poll
            f.refused_since_poll = 0
            avg, want = ema_step(avg, sample, self.args.max_replicas)
            self.ema_log.append({"t": round(self.now(), 2), "sample": sample, "avg": avg, "set": want})
            if want != current:
                try:
                    await self.scale(f, want)
                    current = want
                except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                    print(f"  (c) scale to {want} failed: {exc}", flush=True)

    async def one(self, f: Fleet, t_sched: float, idx: int) -> None:
        t_sent = self.now()
        cold = f.ready == 0
        if f.key == "c" and cold:   # the peer answers 404 'Model Not Loaded' at zero: not sent, failed
            f.refused_since_poll += 1
            f.records.append([round(t_sent, 3), None, False, True, "404-at-zero"])
            return
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {idx}: tell me a story"}],
                "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
        f.inflight += 1
        t_start = time.monotonic()
        ttft, ok, status = None, False, ""
        try:
            async with self.sessions[f.key].post(f.gateway + "/v1/chat/completions", json=body) as r:
                status = str(r.status)
                if r.status != 200:
                    await r.read()
                else:
                    done = False
                    async for line in r.content:
                        if ttft is None and line.startswith(b"data: {"):
                            ttft = time.monotonic() - t_start
                        elif line.startswith(b"data: [DONE]"):
                            done = True
                    ok = done and ttft is not None
                    if not ok:
                        status = "broken-stream"
        except TimeoutError:
            status = "timeout"
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        finally:
            f.inflight -= 1
        f.records.append([round(t_sent, 3), round(ttft, 4) if ttft is not None else None, ok, cold, status])

    async def load(self, schedule: list[float]) -> None:
        tasks = set()
        order = random.Random(self.args.seed)   # (each arrival to the four fleets in a shuffled order: none is
        for i, t in enumerate(schedule):           # always the last one served on this 2-core machine)
            delay = t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            for f in order.sample(self.fleets, len(self.fleets)):
                task = asyncio.create_task(self.one(f, t, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        rest = self.total - self.now()
        if rest > 0:
            await asyncio.sleep(rest)
        if tasks:
            await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 10)

    async def progress(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(30)
            t = self.now()
            phase, level = phase_at(min(t, self.total), self.total)
            print(f"  t={t:5.0f}s {phase:<8} level {level:.2f}  " + "  ".join(
                f"{f.key}: jobs {f.held} ready {f.ready} in flight {f.inflight:2d} ok "
                f"{sum(1 for r in f.records if r[2])} failed {sum(1 for r in f.records if not r[2])}"
                for f in self.fleets), flush=True)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        for f in self.fleets:
            self.sessions[f.key] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        self.admin_session = aiohttp.ClientSession()
        try:
            await self._run()
        finally:
            for s in [*self.sessions.values(), self.admin_session]:
                await s.close()

    async def _run(self) -> None:
        a, b = self.by_key["a"], self.by_key["b"]
        self.t0 = time.monotonic() + 1e9   # negative times until the trace starts
        mon = asyncio.create_task(self.monitor())
        t_wait = time.monotonic()
        while not (a.ready == self.args.max_replicas and b.ready == 1):
            for f in self.fleets:
                if f.proc and f.proc.poll() is not None:
                    raise RuntimeError(f"daemon {f.name} exited {f.proc.returncode}: see {f.log}")
            if time.monotonic() - t_wait > 240:
                raise RuntimeError(f"fixed fleets not READY after 240 s: (a) {a.ready}, (b) {b.ready}")
            await asyncio.sleep(0.5)
        print(f"(a) and (b) READY after {time.monotonic() - t_wait:.0f}s; trace starts "
              f"({self.total:.0f}s)", flush=True)
        schedule = arrivals(self.total, self.args.burst_inflight, self.args.seed)
        self.t0 = time.monotonic()
        tasks = [asyncio.create_task(c) for c in (self.ema_baseline(), self.progress())]
        try:
            await self.load(schedule)
            await asyncio.sleep(1.5)   # the monitor's last sample reaches the end of the trace
        finally:
            self.stop.set()
            for t in [*tasks, mon]:
                t.cancel()
            await asyncio.gather(*tasks, mon, return_exceptions=True)
        self.daemon_metrics = {}
        for f in self.fleets:
            try:
                assert self.admin_session
                async with self.admin_session.get(f.admin + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    text = await r.text()
                self.daemon_metrics[f.key] = {
                    ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                    if ln.startswith(("slurmfleet_cold_start_seconds_count", "slurmfleet_cold_start_seconds_sum",
                                      "slurmfleet_autoscale_decisions_total", "slurmfleet_job_submissions_total",
                                      "slurmfleet_replica_startup_seconds_count",
                                      "slurmfleet_replica_startup_seconds_sum"))}
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass


# -- results -------------------------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def summarize(f: Fleet, total: float) -> dict:
    recs = f.records
    warm = [r[1] if r[2] else math.inf for r in recs if not r[3]]   # (one that failed outside a cold start: infinite)
    cold = [r[1] for r in recs if r[2] and r[3]]
    failures: dict[str, int] = {}
    for r in recs:
        if not r[2]:
            failures[r[4]] = failures.get(r[4], 0) + 1
    phases = {}
    start = 0.0
    for name, frac, _, _ in PHASES:
        end = start + frac * total
        pr = [r for r in recs if start <= r[0] < end or (name == PHASES[-1][0] and r[0] >= end)]
        pw = [r[1] if r[2] else math.inf for r in pr if not r[3]]
        phases[name] = {"seconds": round(end - start, 1), "requests": len(pr),
                        "failed": sum(1 for r in pr if not r[2]), "ttft_p50_s": pct(pw, 50), "ttft_p99_s": pct(pw, 99),
                        "replica_s": round(f.phase_replica_s.get(name, 0.0), 1),
                        "mean_jobs": round(f.phase_replica_s.get(name, 0.0) / (end - start), 2) if end > start else None}
        start = end
    return {"fleet": f.name, "label": f.label, "replica_s": round(f.replica_s, 1), "jobs_seen": len(f.job_ids),
            "requests": len(recs), "ok": sum(1 for r in recs if r[2]), "failed": sum(1 for r in recs if not r[2]),
            "failures": failures, "ttft_p50_s": pct(warm, 50), "ttft_p99_s": pct(warm, 99),
            "ttft_max_s": max(warm) if warm else None, "warm_ok": len(warm),
            "cold_requests": sum(1 for r in recs if r[3]), "cold_ok": len(cold),
            "cold_wait_p50_s": pct(cold, 50), "cold_wait_max_s": max(cold) if cold else None, "phases": phases}


def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(res: dict[str, dict]) -> str:
    a = res["a"]
    lines = [("| fleet | replica-s | vs (a) | jobs | ok | failed | TTFT p50 (s) | TTFT p99 (s) | p99 vs (a) "
              "| cold-start requests | cold-start wait p50 / max (s) |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in "abcd":
        r = res[k]
        ratio = r["replica_s"] / a["replica_s"] if a["replica_s"] else None
        p99r = r["ttft_p99_s"] / a["ttft_p99_s"] if r["ttft_p99_s"] and a["ttft_p99_s"] else None
        cold = "-" if not r["cold_requests"] else (
            f"{fmt(r['cold_wait_p50_s'])} / {fmt(r['cold_wait_max_s'])}" if r["cold_ok"] else "refused (404)")
        lines.append(f"| {r['label']} | {r['replica_s']:.0f} | {fmt(ratio)}x | {r['jobs_seen']} | {r['ok']} "
                     f"| {r['failed']} | {fmt(r['ttft_p50_s'], 3)} | {fmt(r['ttft_p99_s'], 3)} | {fmt(p99r)}x "
                     f"| {r['cold_requests']} | {cold} |")
    lines += ["", "| phase (s) | " + " | ".join(f"{res[k]['label']}: mean jobs / failed / TTFT p99" for k in "abcd")
              + " |", "|---|" + "---:|" * 4]
    for name, *_ in PHASES:
        ph = {k: res[k]["phases"][name] for k in "abcd"}
        lines.append(f"| {name} ({ph['a']['seconds']:.0f}, {ph['a']['requests']} req) | " + " | ".join(
            f"{fmt(ph[k]['mean_jobs'])} / {ph[k]['failed']} / {fmt(ph[k]['ttft_p99_s'], 3)}" for k in "abcd") + " |")
    return "\n".join(lines)


def targets(res: dict[str, dict]) -> list[tuple[str, bool, str]]:
    a, c, d = res["a"], res["c"], res["d"]
    rs = d["replica_s"] / a["replica_s"] if a["replica_s"] else float("inf")
    out = [("(d) replica-seconds <= 0.6x (a)", rs <= 0.6, f"{rs:.3f}x"),
           ("(d) fails 0 requests", d["failed"] == 0, f"{d['failed']} failed")]
    if a["ttft_p99_s"] and d["ttft_p99_s"]:
        p = d["ttft_p99_s"] / a["ttft_p99_s"]
        out.append(("(d) TTFT p99 <= 1.5x (a) outside cold starts", p <= 1.5,
                    f"{d['ttft_p99_s']:.3f}s vs {a['ttft_p99_s']:.3f}s = {p:.2f}x"))
    out.append(("(d) fewer replica-seconds than (c)", d["replica_s"] < c["replica_s"],
                f"{d['replica_s']:.0f} vs {c['replica_s']:.0f}"))
    if c["ttft_p99_s"] and d["ttft_p99_s"]:
        out.append(("(d) lower TTFT p99 than (c)", d["ttft_p99_s"] < c["ttft_p99_s"],
                    f"{d['ttft_p99_s']:.3f}s vs {c['ttft_p99_s']:.3f}s"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=16.0, help="length of the whole day (default 16)")
    ap.add_argument("--max-replicas", type=int, default=4, help="(a)'s count and (c)/(d)'s maximum (default 4)")
    ap.add_argument("--burst-inflight", type=float, default=22.0,
                    help="requests in flight the burst offers (default 22: ceil(22/6) = 4 replicas)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, help="JSON results (default /tmp/slurmfleet-autoscale-<time>.json)")
    args = ap.parse_args()
    out = args.out or Path(f"/tmp/slurmfleet-autoscale-{time.strftime('%Y%m%d-%H%M%S')}.json")

    cluster = LocalCluster()
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    tag = uuid.uuid4().hex[:4]
    run_dir = Path(tempfile.mkdtemp(prefix=f"sf-autoscale-{tag}-"))
    fleets: list[Fleet] = []

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even when started with SIGINT ignored (`cmd &`)
    with cluster_shared(cluster):
        try:
            fleets = make_fleets(run_dir, tag, args.max_replicas, args.minutes, cluster.conf)
            print(f"run dir {run_dir}; fleets " + ", ".join(f"{f.key}={f.name}" for f in fleets), flush=True)
            for f in fleets:
                start_daemon(f, env)
            bench = Bench(args, fleets, env)
            asyncio.run(bench.run())
        except KeyboardInterrupt:
            print("interrupted: cleaning up", flush=True)
            cleanup(fleets, env)
            sys.exit(130)
        except BaseException:
            cleanup(fleets, env)
            raise
        cleanup(fleets, env)

    res = {f.key: summarize(f, bench.total) for f in fleets}
    table = render(res)
    checks = targets(res)
    print()
    print(f"## Autoscaling benchmark: {args.minutes:g} min day, max {args.max_replicas} replicas, "
          f"burst {args.burst_inflight:g} in flight")
    print()
    print(table)
    print()
    for what, ok, detail in checks:
        print(f"- {'PASS' if ok else 'FAIL'}  {what}: {detail}")
    doc = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "simulator": SIM, "max_tokens": MAX_TOKENS, "service_s": SERVICE_S, "target_per_replica": TARGET,
           "ema": {"poll_s": POLL_S, "alpha": EMA_ALPHA}, "phases": PHASES,
           "configs": {f.key: f.cfg for f in fleets}, "results": res,
           "targets": [{"target": w, "pass": ok, "detail": d} for w, ok, d in checks],
           "daemon_metrics": getattr(bench, "daemon_metrics", {}), "ema_decisions": bench.ema_log,
           "timeline": bench.timeline, "requests": {f.key: f.records for f in fleets},
           "markdown": table, "run_dir": str(run_dir)}
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {out}; daemon logs under {run_dir}")


if __name__ == "__main__":
    main()
