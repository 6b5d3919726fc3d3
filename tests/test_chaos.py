"""Chaos on the real local cluster: engines killed and jobs cancelled under load, slurmctld frozen while an
engine dies, more idle connections than the daemon has descriptors.  Each counts failed requests.

The fast half of the chaos suite (hostile config files, HTTP garbage, forged records, dead replicas with
the retry budget spent) is tests/test_hardening.py and tests/test_reconciler*.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import DaemonProc, cluster_exclusive, fleet_config, sim_model, slurm, wait_for

pytestmark = pytest.mark.cluster


def engine_pids(port: str) -> list[int]:
    """The simulator process serving on this port (the engine of one replica)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"orchestrator.devtools.simulator" in argv and port.encode() in argv:
                out.append(int(p.name))
    return out


class Load:
    """Client threads sending non-streamed completions until stopped; counts answers by status."""

    def __init__(self, gateway: str, model: str, threads: int = 4):
        self.url, self.model = gateway + "/v1/completions", model
        self.codes: dict[int, int] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "x", "max_tokens": 8}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
                self.errors.append(e.read().decode(errors="replace")[:200])
            except OSError as e:
                code = -1
                self.errors.append(repr(e))
            self.codes[code] = self.codes.get(code, 0) + 1

    @property
    def ok(self) -> int:
        return self.codes.get(200, 0)

    def finish(self) -> dict[int, int]:
        self.stop.set()
        for t in self.threads:
            t.join(70)
        return self.codes


def chaos_fleet(tmp_path: Path, fleet_name: str, replicas: int = 3, **top) -> Path:
    # 40 tokens at 200/s: each request holds its replica ~0.2 s, so a kill always finds requests in flight
    # a replica that served and was killed is replaced at once (no crash-loop back-off: early_failure_s)
    model = sim_model("c", replicas, simulator={"tokens_per_s": 200}, probe={"interval_s": 0.5, "failure_threshold": 2},
                      backoff={"early_failure_s": 1})
    return fleet_config(tmp_path / "f.yaml", fleet_name, [model], **top)


def test_engine_kills_and_scancels_under_load_fail_no_request(tmp_path, fleet_name, daemons):
    d = daemons(chaos_fleet(tmp_path, fleet_name))
    wait_for(lambda: len(d.ready("c")) == 3, 60, "3 READY")
    load = Load(d.gateway, "c")
    try:
        for round_ in range(2):
            wait_for(lambda: load.ok > 50 * (round_ + 1), 60, "traffic")
            victim = d.ready("c")[0]
            pids = engine_pids(victim["endpoint"].rsplit(":", 1)[1])
            assert pids, victim
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: victim["job_id"] not in {r["job_id"] for r in d.ready("c")}, 30, "killed replica out")
            wait_for(lambda: len(d.ready("c")) == 3, 60, "replaced")
            before = load.ok
            cancelled = d.ready("c")[-1]["job_id"]
            slurm("scancel", cancelled)
            wait_for(lambda: cancelled not in {r["job_id"] for r in d.ready("c")}, 30, "cancelled replica out")
            wait_for(lambda: len(d.ready("c")) == 3 and load.ok > before + 20, 60, "replaced, traffic on")
    finally:
        codes = load.finish()
    print(f"engine SIGKILL x2 + scancel x2 under load: {codes}")
    assert set(codes) == {200}, (codes, load.errors[:3])


def test_slurmctld_frozen_while_an_engine_dies_fails_no_request(tmp_path, fleet_name, daemons, cluster):
    d = daemons(chaos_fleet(tmp_path, fleet_name, cluster={"command_timeout_s": 2}))
    wait_for(lambda: len(d.ready("c")) == 3, 60, "3 READY")
    ctld = cluster.status()["daemons"]["slurmctld"]
    load = Load(d.gateway, "c")
    try:
        wait_for(lambda: load.ok > 50, 60, "traffic")
        with cluster_exclusive():
            os.kill(ctld, signal.SIGSTOP)  # squeue now times out: the daemon cannot see SLURM
            try:
                wait_for(lambda: d.status()["last_tick_error"], 20, "the daemon to notice SLURM is gone")
                victim = d.ready("c")[0]
                for pid in engine_pids(victim["endpoint"].rsplit(":", 1)[1]):
                    os.kill(pid, signal.SIGKILL)
                # probes go on without SLURM: the dead engine leaves routing while slurmctld is frozen
                wait_for(lambda: victim["job_id"] not in {r["job_id"] for r in d.ready("c")}, 20, "dead engine out")
                before = load.ok
                wait_for(lambda: load.ok > before + 50, 30, "traffic on the other two")
            finally:
                os.kill(ctld, signal.SIGCONT)
        wait_for(lambda: len(d.ready("c")) == 3, 90, "replaced once SLURM answers")
    finally:
        codes = load.finish()
    print(f"slurmctld frozen, engine SIGKILL under load: {codes}")
    assert set(codes) == {200}, (codes, load.errors[:3])


def test_more_idle_connections_than_descriptors_leave_the_daemon_serving(tmp_path, fleet_name):
    """The daemon runs with 512 open files at most; 800 idle clients connect.  Connections over the gateway's
    cap (512 - 256 kept for everything else) are closed at once; the daemon, its probes and its /metrics go
    on meanwhile; the idle ones are closed after header_timeout_s, and clients are served again."""
    cfg = chaos_fleet(tmp_path, fleet_name, replicas=2, gateway={"header_timeout_s": 5})
    d = DaemonProc(cfg)
    d.argv_prefix = ["prlimit", "--nofile=512:512", "--"]
    d.start()
    conns: list[socket.socket] = []
    try:
        wait_for(lambda: len(d.ready("c")) == 2, 60, "2 READY")
        port = d.cfg["gateway"]["port"]
        t0 = time.monotonic()
        for _ in range(800):
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        # those closed at once, counted before header_timeout_s (5 s) closes the others
        while (refused := sum(1 for c in conns if closed(c))) < 800 - 256 - 128 and time.monotonic() - t0 < 4.0:
            time.sleep(0.1)
        for _ in range(6):  # while the crowd holds the gateway: probes pass, /metrics and status answer
            assert d.proc.poll() is None and 'slurmfleet_replicas_desired{model="c"} 2.0' in d.metrics()
            assert len(d.ready("c")) == 2
            time.sleep(0.5)
        wait_for(lambda: all(closed(c) for c in conns), 30, "every idle connection closed (header_timeout_s)")
        cleared = time.monotonic() - t0
        load = Load(d.gateway, "c", threads=2)
        try:
            wait_for(lambda: load.ok >= 40, 60, "requests served again")
        finally:
            codes = load.finish()
        print(f"800 idle connections, nofile 512: {refused} closed at once, all closed after {cleared:.1f}s; "
              f"then {codes}")
        assert refused >= 800 - 256 - 128, refused  # the cap, and at most the accept backlog still queued
        assert set(codes) == {200} and d.proc.poll() is None, codes
    finally:
        for c in conns:
            c.close()
        d.stop()
        slurm("scancel", "--name", f"slurmfleet-{fleet_name}", check=False)


def closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
