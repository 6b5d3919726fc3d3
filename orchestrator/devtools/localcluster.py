"""A real SLURM cluster on this one host, for the demo and the tests.

Debian's slurmctld/slurmd/munge, no systemd: one munged, one slurmctld and one
slurmd per node (``slurmd -N nodeX``; Debian builds with MULTIPLE_SLURMD).
Fake GPUs are character devices (clones of /dev/null) named in gres.conf, so
SLURM hands jobs ``CUDA_VISIBLE_DEVICES``; they are typed, ``a100`` on odd nodes
and ``h100`` on even ones, each node's type also its feature (a model's ``gpu_type``
and ``constraint`` can be tried).  Everything lives in one directory;
``up`` is idempotent and ``down`` stops only the PIDs it wrote.

Works on Slurm 22.05 (Debian 12) and 24.11 (Debian 13): the release is read
from ``slurmd -V``; from 24.05 on, slurmd always starts a cgroup plugin and
exits where no cgroup file system is usable, so ``cgroup.conf`` says
``CgroupPlugin=disabled`` there (22.05 rejects that value: no file there).

Its directory and ports are settings (flags of ``slurmfleet local-cluster``, or
the environment), so two clusters can share a host::

    SLURMFLEET_CLUSTER_DIR              default /tmp/slurmfleet-cluster-<uid>
    SLURMFLEET_CLUSTER_CTLD_PORT        slurmctld's port, default 16817
    SLURMFLEET_CLUSTER_SLURMD_PORT_BASE node i's slurmd listens on BASE+i, default 16900
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from .slurmrelease import CGROUP_CONF_HEADER, SlurmRelease, cgroup_conf, detect_release
from .slurmrelease import exe as _exe

ENV_DIR = "SLURMFLEET_CLUSTER_DIR"
ENV_CTLD_PORT = "SLURMFLEET_CLUSTER_CTLD_PORT"
ENV_SLURMD_PORT_BASE = "SLURMFLEET_CLUSTER_SLURMD_PORT_BASE"
DEFAULT_CTLD_PORT = 16817
DEFAULT_SLURMD_PORT_BASE = 16900


class ClusterError(RuntimeError):
    """The local cluster could not be started or queried."""


class DaemonExited(ClusterError):
    """One of the cluster's daemons exited while ``up`` waited for it."""


def default_dir() -> Path:
    """``$SLURMFLEET_CLUSTER_DIR``, else /tmp/slurmfleet-cluster-<uid>."""
    return Path(os.environ.get(ENV_DIR) or f"/tmp/slurmfleet-cluster-{os.getuid()}")


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    port = int(raw) if raw.isdecimal() else -1
    if not 0 < port < 65536:   # (a port the cluster's own checks refuse would not name the variable it came from)
        raise ClusterError(f"${name}={raw!r} is not a port number")
    return port


def default_ctld_port() -> int:
    return _env_port(ENV_CTLD_PORT, DEFAULT_CTLD_PORT)


def default_slurmd_port_base() -> int:
    return _env_port(ENV_SLURMD_PORT_BASE, DEFAULT_SLURMD_PORT_BASE)


def _port_taken(port: int) -> bool:
    """Something already listens on ``port`` (another cluster, another program)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


GPU_TYPES = ("a100", "h100")   # the fake GPUs' types, node by node in turn


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """Layout and settings of one local cluster (directory and ports default to the environment)."""

    root: Path = dataclasses.field(default_factory=default_dir)
    nodes: int = 4
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    memory_mb_per_node: int = 16000
    ctld_port: int = dataclasses.field(default_factory=default_ctld_port)
    slurmd_base_port: int = dataclasses.field(default_factory=default_slurmd_port_base)
    partition: str = "gpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ClusterError("a local cluster needs at least one node and one GPU per node")
        if not 1 <= self.ctld_port <= 65535:
            raise ClusterError(f"slurmctld port {self.ctld_port} is not a port number")
        if not 0 <= self.slurmd_base_port or self.slurmd_base_port + self.nodes > 65535:
            raise ClusterError(f"slurmd ports {self.slurmd_base_port + 1}-{self.slurmd_base_port + self.nodes} "
                               "are not port numbers")
        if self.ctld_port in self.slurmd_ports:
            raise ClusterError(f"slurmctld port {self.ctld_port} is one of the slurmd ports "
                               f"{self.slurmd_ports[0]}-{self.slurmd_ports[-1]}")

    @property
    def slurmd_ports(self) -> list[int]:
        """Node i (node1, node2, ...) listens on slurmd_base_port + i."""
        return [self.slurmd_base_port + i for i in range(1, self.nodes + 1)]

    @property
    def gpu_types(self) -> list[str]:
        """Each node's fake GPUs' type, in gres.conf and as the node's feature (node1 a100, node2 h100, node3
        a100, ...): a model's ``gpu_type`` and ``constraint`` can be tried here as on a mixed site."""
        return [GPU_TYPES[i % len(GPU_TYPES)] for i in range(self.nodes)]

    @functools.cached_property   # (it writes the instance's __dict__, which a frozen dataclass allows)
    def release(self) -> SlurmRelease | None:
        """This host's Slurm (``slurmd -V``), read once."""
        return detect_release()

    def describe(self) -> str:
        """One line: which release, how many nodes, which ports, where."""
        rel = f"Slurm {self.release}" if self.release else "Slurm (release unknown: slurmd -V said none)"
        ports = self.slurmd_ports
        slurmd = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
        kinds = "/".join(dict.fromkeys(self.gpu_types))
        return (f"{rel}, {self.nodes} nodes x {self.gpus_per_node} GPUs ({kinds}), slurmctld port {self.ctld_port}, "
                f"slurmd ports {slurmd}, dir {self.root}")

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- files -----------------------------------------------------------
    def render(self, host: str, release: SlurmRelease | None) -> dict[str, str]:
        """The files of ``etc/`` for this host and release: slurm.conf, gres.conf, and cgroup.conf where the
        release needs one."""
        r = self.root
        kinds = self.gpu_types
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
            f"RealMemory={self.memory_mb_per_node} Gres=gpu:{kind}:{self.gpus_per_node} Feature={kind} State=UNKNOWN"
            for n, port, kind in zip(self.node_names, self.slurmd_ports, kinds))
        gpu_files = f"{r}/dev/gpu[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else f"{r}/dev/gpu0"
        conf = f"""# written by slurmfleet local-cluster for Slurm {release or "(release unknown)"}; do not edit
ClusterName=slurmfleet
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.real.pid
SlurmdPidFile={r}/run/slurmd.%n.real.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=1
EnforcePartLimits=NO
MinJobAge=3600
KillWait=5
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
{node_lines}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=ALL Default=NO MaxTime=5 State=UP
"""
        files = {"slurm.conf": conf, "gres.conf": "".join(f"NodeName={n} Name=gpu Type={kind} File={gpu_files}\n"
                                                          for n, kind in zip(self.node_names, kinds))}
        cgroup = cgroup_conf(release)
        if cgroup is not None:
            files["cgroup.conf"] = cgroup
        return files

    def _write_files(self) -> None:
        r = self.root
        for d in (r, *(r / sub for sub in ("etc", "munge", "ctld", "log", "run", "dev", "spool"))):
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            st = os.lstat(d)   # (in /tmp another user may have made it first: its key, its slurm.conf, its links)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise ClusterError(f"{d} is not a folder of this user's (uid {st.st_uid}, mode {oct(st.st_mode)}): "
                                   f"remove it, or set {ENV_DIR}")
            os.chmod(d, 0o711 if d.name == "munge" and d.parent == r else 0o755)  # (munge: the socket needs o+x)
        key = r / "munge" / "munge.key"
        if not key.exists():   # (made unreadable to others from its first byte)
            with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400), "wb") as f:
                f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        for i in range(self.gpus_per_node):
            dev = r / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # char device like /dev/null
        files = self.render(socket.gethostname(), self.release)
        cgroup = r / "etc" / "cgroup.conf"
        if "cgroup.conf" not in files and cgroup.exists() and cgroup.read_text().startswith(CGROUP_CONF_HEADER):
            cgroup.unlink()  # ours, from a newer release in this directory: 22.05 would reject it
        for name, text in files.items():
            (r / "etc" / name).write_text(text)
        for n in self.node_names:
            (r / "spool" / n).mkdir(parents=True, exist_ok=True)
        (r / "env").write_text(f"export SLURM_CONF={self.conf}\n")

    # -- processes -------------------------------------------------------
    def _pidfile(self, name: str) -> Path:
        return self.root / "run" / f"{name}.pid"

    def _alive(self, name: str) -> int | None:
        try:
            pid = int(self._pidfile(name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        # a zombie, or a recycled pid (a stale file after a reboot kept /tmp: `down` would kill whatever has it
        # now), is not ours: each of our daemons has this cluster's root in its command line
        try:
            for _ in range(20):   # an exec under way shows no command line yet: the kernel sets it up after the
                stat = Path(f"/proc/{pid}/stat").read_text()   # close-on-exec that let Popen return (a loaded
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()   # machine widens that moment: a daemon
                if cmdline or stat.rsplit(")", 1)[1].split()[0] == "Z":   # just started was called dead; a
                    break                                                  # zombie has none for good)
                time.sleep(0.01)
            if stat.rsplit(")", 1)[1].split()[0] == "Z" or str(self.root).encode() not in cmdline:
                return None
        except OSError:
            return None
        return pid

    def _spawn(self, name: str, argv: list[str]) -> None:
        if self._alive(name):
            return
        out = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            close_fds=True, start_new_session=True, env=self.env(),
        )
        out.close()
        # written whole (a reader never sees it empty), and not the file the daemon writes itself: slurmctld
        # truncates its SlurmctldPidFile before writing it, and a wait that read it then called it dead
        tmp = self._pidfile(name).with_suffix(".tmp")
        tmp.write_text(f"{proc.pid}\n")
        tmp.replace(self._pidfile(name))

    def _daemon_names(self) -> list[str]:
        return ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.node_names)]

    def up(self, timeout_s: float = 60.0) -> float:
        """Start whatever is not running; return seconds until every node is idle."""
        t0 = time.monotonic()
        for tool in ("munged", "slurmctld", "slurmd", "sinfo"):
            if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
                raise ClusterError(f"{tool} not found: apt-get install slurmctld slurmd slurm-client munge")
        # ports some other program holds (another local cluster?) would leave a daemon that exits at once
        wanted = [("slurmctld", self.ctld_port, "--ctld-port", ENV_CTLD_PORT)] + [
            (f"slurmd-{n}", port, "--slurmd-port-base", ENV_SLURMD_PORT_BASE)
            for n, port in zip(self.node_names, self.slurmd_ports)]
        for name, port, flag, env in wanted:
            if not self._alive(name) and _port_taken(port):
                raise ClusterError(f"port {port} (for {name}) is already in use, by another local cluster or "
                                   f"program: choose other ports with {flag} or ${env}, and another "
                                   f"directory with --dir or ${ENV_DIR}")
        self._write_files()
        r = self.root
        munged = _exe("munged")
        if not self._alive("munged"):  # a socket left by a munged that is gone would pass the wait below
            (r / "munge" / "munge.sock").unlink(missing_ok=True)
        self._spawn("munged", [munged, "-F", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge/munge.sock", f"--pid-file={r}/run/munged.real.pid",
                               f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munge.seed", "--force"])
        self._wait(self._munge_answers, 10, "munged", "munged")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait(self._ctld_up, timeout_s, "slurmctld", "slurmctld")
        slurmd = _exe("slurmd")
        for n in self.node_names:
            self._spawn(f"slurmd-{n}", [slurmd, "-D", "-f", str(self.conf), "-N", n])
        # a node left DOWN by a failure test comes back
        self._run(["scontrol", "update", f"nodename={','.join(self.node_names)}", "state=resume"])
        self._wait(self._all_idle_or_alloc, timeout_s, "nodes to become idle",
                   *(f"slurmd-{n}" for n in self.node_names))
        return time.monotonic() - t0

    def _munge_answers(self) -> bool:
        sock = self.root / "munge" / "munge.sock"
        if not sock.exists() or not shutil.which("munge"):   # (the socket is made before munged listens)
            return sock.exists()
        return self._run(["munge", "-n", "-S", str(sock)]).returncode == 0

    def _ctld_up(self) -> bool:
        r = self._run(["scontrol", "ping"])
        return r.returncode == 0 and b"UP" in r.stdout

    def _all_idle_or_alloc(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.decode()
        states = [line.split()[1] for line in out.splitlines() if line.strip()]
        if len(states) < self.nodes:
            return False
        if any(s.startswith(("down", "drain", "fail")) for s in states):
            self._run(["scontrol", "update", f"nodename={','.join(self.node_names)}", "state=resume"])
        # "planned" (23.02 and later): idle, but the backfill scheduler has promised it to a pending job
        return all(s.rstrip("*~#") in ("idle", "allocated", "mixed", "completing", "planned") for s in states)

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
        try:
            return subprocess.run(argv, env=self.env(), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=15)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, b"", b"timeout")

    def _wait(self, pred, timeout_s: float, what: str, *daemons: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return
            dead = [d for d in daemons if self._pidfile(d).exists() and not self._alive(d)]
            if dead:  # say so at once, with its last words, instead of waiting out the timeout
                raise DaemonExited(f"{', '.join(dead)} exited while waiting for {what}; "
                                   f"{self._last_words(dead[0])}")
            time.sleep(0.3)
        raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    def _last_words(self, name: str) -> str:
        """The last lines of its output and of its own log file (where slurmctld and slurmd say why)."""
        own = {"munged": "munged.log", "slurmctld": "slurmctld.log"}.get(name, f"slurmd.{name[7:]}.log")
        said = []
        for file, what in ((f"{name}.out", "its output ends"), (own, f"{own} ends")):
            try:
                tail = (self.root / "log" / file).read_text(errors="replace").strip().splitlines()[-3:]
            except OSError:
                tail = []
            if tail:
                said.append(f"{what}: " + " | ".join(tail))
        return "; ".join(said) or f"see {self.root / 'log'}"

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Cancel its jobs (nothing ends their engines once slurmctld is gone), then stop its daemons, newest first."""
        jobs, unknown = [], ""
        for _ in range(3 if self._alive("slurmctld") else 0):   # (a busy slurmctld may time one out)
            r = self._run(["squeue", "-h", "-o", "%i"])
            if r.returncode == 0:
                jobs, unknown = r.stdout.split(), ""
                break
            unknown = f"its jobs unknown (squeue: {r.stderr.decode(errors='replace').strip()[:200]})"
        if jobs and self._run(["scancel", *(j.decode() for j in jobs)]).returncode == 0:   # (slurmd ends them)
            deadline = time.monotonic() + timeout_s
            while self._run(["squeue", "-h", "-o", "%i"]).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.3)
        stopped = [f"{len(jobs)} jobs"] if jobs else [unknown] if unknown else []
        for name in reversed(self._daemon_names()):
            pid = self._alive(name)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self._alive(name) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(name):
                os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            self._pidfile(name).unlink(missing_ok=True)
            stopped.append(name)
        return stopped

    def status(self) -> dict[str, object]:
        daemons = {name: self._alive(name) for name in self._daemon_names()}
        nodes = ""
        if daemons.get("slurmctld"):
            nodes = self._run(["sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %T %G"]).stdout.decode()
        return {"dir": str(self.root), "slurm_conf": str(self.conf), "daemons": daemons,
                "nodes": [line.split() for line in nodes.splitlines() if line.strip()],
                "release": str(self.release) if self.release else None,
                "slurmctld_port": self.ctld_port, "slurmd_ports": self.slurmd_ports}
