"""Shared fixtures: the real local SLURM cluster, free ports, fleet configs, daemon processes."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHIMS = ROOT / "tests" / "shims"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # an xdist worker has COLUMNS=80 in its environment: `ps -o args` (and anything else that reads it) would
    # cut command lines there
    os.environ.pop("COLUMNS", None)


_PORTS = random.Random()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768+): a port taken from that range can be
    handed to an outgoing connection before the test binds it (load tests make thousands); the jobs' own
    ports are drawn from 20000-59999 by the templates, so test ports stay in 10000-19999."""
    for _ in range(200):
        port = _PORTS.randrange(10000, 20000)
        if 16000 <= port < 18000:  # the local SLURM clusters' ports (16817, 16900+; other releases nearby)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 10000-19999")


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


class ClusterLock:
    """A readers-writer lock over the one local SLURM cluster, for every pytest process of this host (the
    xdist workers, or two runs at once).

    A test with jobs on the cluster holds it shared (the autouse ``_cluster_share``; the real-vLLM module
    fleet for the whole module). What changes every job's world -- a node set DOWN kills every job on it, a
    partition set DOWN holds every new job -- runs inside ``exclusive()``, once no other test holds it.
    flock, plus a gate file that a waiting writer holds, so readers that come and go cannot starve it.
    Re-entrant within one process (a count); closing a descriptor releases its lock."""

    def __init__(self, path: Path):
        self.path, self.gate = path, path.with_name(path.name + ".gate")
        self.fd: int | None = None
        self.depth = 0

    def _open(self, p: Path) -> int:
        return os.open(p, os.O_RDWR | os.O_CREAT, 0o600)

    def _take(self, fd: int, mode: int) -> None:
        gate = self._open(self.gate)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # behind a writer that waits
            fcntl.flock(fd, mode)
        finally:
            os.close(gate)

    @contextlib.contextmanager
    def shared(self):
        if self.depth == 0:
            self.fd = self._open(self.path)
            self._take(self.fd, fcntl.LOCK_SH)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                os.close(self.fd)
                self.fd = None

    @contextlib.contextmanager
    def exclusive(self):
        """The cluster to this process alone. Holding it shared more than once here (say, a module fleet
        and a test) would wait on itself: refused."""
        if self.depth > 1:
            raise RuntimeError("exclusive cluster section while this process holds the cluster for more "
                               "than the calling test (a module-scoped fleet?)")
        fd = self.fd if self.depth else self._open(self.path)
        if self.depth:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._take(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if self.depth:
                fcntl.flock(fd, fcntl.LOCK_SH)  # the calling test's share again
            else:
                os.close(fd)


CLUSTER_LOCK = ClusterLock(Path(tempfile.gettempdir()) / f"slurmfleet-tests-{os.getuid()}.lock")
cluster_exclusive = CLUSTER_LOCK.exclusive


VLLM_GROUP = "vllm"


def vllm_group(root: Path) -> tuple[set[str], set[str]]:
    """What runs in xdist group "vllm", read from the test sources: (files whose module mark names the group,
    tests whose code calls ``cluster_exclusive``)."""
    files, tests = set(), set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        src = path.read_text()
        rel = path.relative_to(root).as_posix()
        try:
            body = ast.parse(src).body
        except SyntaxError:  # its collection error says so
            continue
        for node in body:
            text = ast.get_source_segment(src, node) or ""
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                if f'xdist_group("{VLLM_GROUP}")' in text:
                    files.add(rel)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "cluster_exclusive(" in text:
                tests.add(f"{rel}::{node.name}")
    return files, tests


def pytest_collection_modifyitems(items):
    """Modules marked with an xdist_group first (stable): the real-vLLM module then starts its engines at once,
    and the group's exclusive tests come after it on its worker."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups decided here, from the test ids.

    xdist marks a test's group by appending ``@group`` to its node id, which pytest 9.2's node ids no longer
    take (xdist 3.8): every test would be a group of its own. So the controller groups them itself: the
    real-vLLM module (its fleet is started once per worker), and the tests that take the cluster exclusively
    (``cluster_exclusive``). A group runs on one worker in collection order (the vLLM module first, see
    pytest_collection_modifyitems), so an exclusive test never waits on that module's fleet, which holds the
    cluster for minutes."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    files, tests = vllm_group(config.rootpath)

    class Scheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope != nodeid:  # an xdist that marks node ids
                return scope
            base = nodeid.split("[", 1)[0]
            return VLLM_GROUP if base.split("::", 1)[0] in files or base in tests else nodeid

    return Scheduling(config, log)


def _cluster_running(c) -> bool:
    """Every daemon of the local cluster alive and every node usable (as LocalCluster.up() leaves it)."""
    st = c.status()
    nodes = [n for n in st["nodes"] if len(n) > 1]  # one line per node and partition
    usable = ("idle", "allocated", "mixed", "completing", "planned")
    return (all(st["daemons"].values()) and {n[0] for n in nodes} == set(c.node_names)
            and all(n[1].rstrip("*~#!%$@^-") in usable for n in nodes))


@pytest.fixture(scope="session")
def cluster():
    """The project's own local SLURM cluster (started if it is not running).

    Each xdist worker has its own session: LocalCluster.up() rewrites slurm.conf, starts what is missing
    and resumes every node, which must not happen beside another worker's tests (it would resume the node
    a test set DOWN). So a running cluster is only checked; one that is down (or has a node left DOWN by
    an interrupted run) is brought up with the cluster held exclusively."""
    from orchestrator.devtools.localcluster import LocalCluster

    c = LocalCluster()
    os.environ["SLURM_CONF"] = str(c.conf)
    if not _cluster_running(c):
        with CLUSTER_LOCK.exclusive():
            if not _cluster_running(c):
                c.up()
    yield c


@pytest.fixture(autouse=True)
def _cluster_share(request):
    """Tests on the cluster (marked ``cluster``, or using the fixture) hold it shared (see ClusterLock),
    teardown included."""
    if request.node.get_closest_marker("cluster") is None and "cluster" not in request.fixturenames:
        yield
        return
    with CLUSTER_LOCK.shared():
        yield


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
    # back-off from 1 s (not 10 s): a job that fails at start for a reason of its own (an engine port taken
    # meanwhile, a test's SIGKILL) costs a test a second, not tens
    m = {"name": name, "engine": "simulator", "replicas": replicas, "gpus_per_node": 1, "cpus_per_task": 1,
         "container": {"enabled": False}, "probe": {"interval_s": 0.5, "timeout_s": 2, "startup_timeout_s": 60},
         "drain": {"timeout_s": 10, "handover_lead_s": 60}, "simulator": {"ttft_s": 0.01, "tokens_per_s": 500},
         "backoff": {"base_s": 1, "max_s": 4}}
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
        "daemon": {"tick_interval_s": 0.5, "admin_port": free_port(), "admin_api_keys": ["admin-secret"]},
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
        self.argv_prefix: list[str] = []  # e.g. ["prlimit", "--nofile=512:512", "--"]
        self.proc: subprocess.Popen | None = None
        self.log = config.parent / f"daemon-{uuid.uuid4().hex[:6]}.log"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.cfg['gateway']['port']}"

    @property
    def admin(self) -> str:
        scheme = "https" if self.cfg["daemon"].get("admin_tls") else "http"
        return f"{scheme}://127.0.0.1:{self.cfg['daemon']['admin_port']}"

    @property
    def tls(self):
        """With daemon.admin_tls: a context that takes the daemon's certificate (tests check it themselves)."""
        if not self.cfg["daemon"].get("admin_tls"):
            return None
        import ssl
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        return ctx

    def start(self) -> "DaemonProc":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.fh = open(self.log, "ab")
        self.proc = subprocess.Popen([*self.argv_prefix, sys.executable, "-m", "orchestrator", "serve",
                                      "--config", str(self.config),
                                      *self.extra], stdout=self.fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_for(lambda: self._up(), 20, "daemon admin API")
        return self

    def _up(self) -> bool:
        if self.proc and self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            # (another test process's daemon on a port both chose: not up; this one exits, address in use)
            return self.status().get("fleet", self.cfg["fleet"]) == self.cfg["fleet"]   # (a refusal: up)
        except OSError:
            return False

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.admin + path, method=method,
                                     headers={"Authorization": "Bearer admin-secret"},
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.tls) as r:
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
        with urllib.request.urlopen(self.admin + "/metrics", timeout=10, context=self.tls) as r:
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
        for attempt in range(3):
            d = DaemonProc(config, extra)
            started.append(d)
            try:
                return d.start()
            except AssertionError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                # a port free when the test chose it, taken since by another test process (pytest-xdist) before
                # the daemon bound it: the config gets new ones (a later daemon of this config reads them too)
                cfg = yaml.safe_load(config.read_text())
                cfg["gateway"]["port"], cfg["daemon"]["admin_port"] = free_port(), free_port()
                config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        raise AssertionError("unreachable")

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


def present(usage: dict) -> dict:
    """A whole answer's usage without its null fields (vLLM dumps every field of its model, null or not)."""
    return {k: v for k, v in usage.items() if v is not None}


def field_paths(obj: dict, at: str = "") -> set[str]:
    """A JSON answer's field names as dotted paths (a list of objects: its first's), values aside."""
    out = set()
    for k, v in obj.items():
        out.add(at + k)
        inner = v[0] if isinstance(v, list) and v and isinstance(v[0], dict) else v
        if isinstance(inner, dict):
            out |= field_paths(inner, f"{at}{k}.")
    return out
