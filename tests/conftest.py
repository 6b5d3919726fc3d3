"""Shared fixtures: the real local SLURM cluster, free ports, fleet configs, daemon processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHIMS = ROOT / "tests" / "shims"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_sum(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` (with these label values) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(pred, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def cluster():
    """The project's own local SLURM cluster (started if it is not running)."""
    from orchestrator.devtools.localcluster import LocalCluster

    c = LocalCluster()
    c.up()
    os.environ["SLURM_CONF"] = str(c.conf)
    yield c


def slurm(*argv: str, check: bool = True) -> str:
    env = {**os.environ, "SLURM_TIME_FORMAT": "%s"}
    r = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise AssertionError(f"{argv}: {r.stderr}")
    return r.stdout


def fleet_jobs(fleet: str, states: str = "PENDING,RUNNING,CONFIGURING,COMPLETING") -> list[dict]:
    out = slurm("squeue", "-h", "-t", states, "--name", f"slurmfleet-{fleet}", "-O",
                "JobID:|,State:|,NodeList:|,Comment:|")
    jobs = []
    for line in out.splitlines():
        jid, state, nodes, comment = (line.split("|") + ["", "", "", ""])[:4]
        jobs.append({"job_id": jid.strip(), "state": state.strip(), "nodes": nodes.strip(), "comment": comment})
    return jobs


@pytest.fixture
def fleet_name(cluster):
    name = "t" + uuid.uuid4().hex[:8]
    yield name
    slurm("scancel", "--name", f"slurmfleet-{name}", check=False)


def sim_model(name: str, replicas: int = 1, **kw) -> dict:
    m = {"name": name, "engine": "simulator", "replicas": replicas, "gpus_per_node": 1, "cpus_per_task": 1,
         "container": {"enabled": False}, "probe": {"interval_s": 1, "timeout_s": 2, "startup_timeout_s": 60},
         "drain": {"timeout_s": 10, "handover_lead_s": 60}, "simulator": {"ttft_s": 0.01, "tokens_per_s": 500}}
    for k, v in kw.items():
        if isinstance(v, dict) and isinstance(m.get(k), dict):
            m[k] = {**m[k], **v}
        else:
            m[k] = v
    return m


def fleet_config(path: Path, fleet: str, models: list[dict], **top) -> Path:
    cfg = {
        "fleet": fleet,
        "state_dir": str(path.parent / "state"),
        "cluster": {"partition": "gpu", "slurm_conf": os.environ.get("SLURM_CONF")},
        "gateway": {"host": "127.0.0.1", "port": free_port(), "queue_timeout_s": 20},
        "daemon": {"tick_interval_s": 1, "admin_port": free_port(), "admin_api_keys": ["admin-secret"]},
        "models": models,
    }
    for k, v in top.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class DaemonProc:
    """``slurmfleet serve`` as a real process."""

    def __init__(self, config: Path, extra: tuple[str, ...] = ()):
        self.config = config
        self.cfg = yaml.safe_load(config.read_text())
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.log = config.parent / f"daemon-{uuid.uuid4().hex[:6]}.log"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.cfg['gateway']['port']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.cfg['daemon']['admin_port']}"

    def start(self) -> "DaemonProc":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.fh = open(self.log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config", str(self.config),
                                      *self.extra], stdout=self.fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_for(lambda: self._up(), 20, "daemon admin API")
        return self

    def _up(self) -> bool:
        if self.proc and self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            self.status()
            return True
        except OSError:
            return False

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.admin + path, method=method,
                                     headers={"Authorization": "Bearer admin-secret"},
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def status(self) -> dict:
        return self.request("GET", "/admin/status")[1]

    def model(self, name: str) -> dict:
        return next(m for m in self.status()["models"] if m["model"] == name)

    def ready(self, name: str) -> list[dict]:
        return [r for r in self.model(name)["replicas"] if r["state"] == "READY"]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.admin + "/metrics", timeout=10) as r:
            return r.read().decode()

    def send(self, sig: int) -> None:
        assert self.proc
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def logs(self) -> str:
        return self.log.read_text()


@pytest.fixture
def daemons():
    started: list[DaemonProc] = []

    def make(config: Path, *extra: str) -> DaemonProc:
        d = DaemonProc(config, extra)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        try:
            d.stop(signal.SIGKILL if d.proc and d.proc.poll() is None else signal.SIGTERM, timeout=10)
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture
def shim_path(monkeypatch):
    """Put the vllm and apptainer shims first on PATH (jobs inherit it through sbatch)."""
    monkeypatch.setenv("PATH", f"{SHIMS}:{os.environ['PATH']}")
    monkeypatch.setenv("SF_TEST_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
