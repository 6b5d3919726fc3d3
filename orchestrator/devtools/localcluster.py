"""A real SLURM cluster on this one host, for the demo and the tests.

Debian's slurmctld/slurmd/munge, no systemd: one munged, one slurmctld and one
slurmd per node (``slurmd -N nodeX``; Debian builds with MULTIPLE_SLURMD).
Fake GPUs are character devices (clones of /dev/null) named in gres.conf, so
SLURM hands jobs ``CUDA_VISIBLE_DEVICES``.  Everything lives in one directory;
``up`` is idempotent and ``down`` stops only the PIDs it wrote.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("SLURMFLEET_CLUSTER_DIR", f"/tmp/slurmfleet-cluster-{os.getuid()}"))


class ClusterError(RuntimeError):
    """The local cluster could not be started or queried."""


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """Layout and settings of one local cluster."""

    root: Path = DEFAULT_DIR
    nodes: int = 4
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    memory_mb_per_node: int = 16000
    ctld_port: int = 16817
    slurmd_base_port: int = 16900
    partition: str = "gpu"

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- files -----------------------------------------------------------
    def _write_files(self) -> None:
        r = self.root
        for sub in ("etc", "munge", "ctld", "log", "run", "dev", "spool"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o755)
        os.chmod(r / "munge", 0o711)  # the socket's directory needs o+x
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for i in range(self.gpus_per_node):
            dev = r / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # char device like /dev/null
        host = socket.gethostname()
        last = self.nodes
        ports = f"[{self.slurmd_base_port + 1}-{self.slurmd_base_port + last}]" if last > 1 else str(self.slurmd_base_port + 1)
        nodes = f"node[1-{last}]" if last > 1 else "node1"
        gpu_files = f"{r}/dev/gpu[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else f"{r}/dev/gpu0"
        conf = f"""# written by slurmfleet local-cluster; do not edit
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
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
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
NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports} CPUs={self.cpus_per_node} RealMemory={self.memory_mb_per_node} Gres=gpu:{self.gpus_per_node} State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=ALL Default=NO MaxTime=5 State=UP
"""
        self.conf.write_text(conf)
        (r / "etc" / "gres.conf").write_text(f"NodeName={nodes} Name=gpu File={gpu_files}\n")
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
        # a zombie or a recycled pid is not ours
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                return None
        except OSError:
            return None
        return pid

    def _spawn(self, name: str, argv: list[str]) -> None:
        if self._alive(name):
            return
        log = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            close_fds=True, start_new_session=True, env=self.env(),
        )
        log.close()
        self._pidfile(name).write_text(f"{proc.pid}\n")

    def _daemon_names(self) -> list[str]:
        return ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.node_names)]

    def up(self, timeout_s: float = 60.0) -> float:
        """Start whatever is not running; return seconds until every node is idle."""
        t0 = time.monotonic()
        for tool in ("munged", "slurmctld", "slurmd", "sinfo"):
            if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
                raise ClusterError(f"{tool} not found: apt-get install slurmctld slurmd slurm-client munge")
        self._write_files()
        r = self.root
        munged = shutil.which("munged") or "/usr/sbin/munged"
        if not self._alive("munged"):  # a socket left by a munged that is gone would pass the wait below
            (r / "munge" / "munge.sock").unlink(missing_ok=True)
        self._spawn("munged", [munged, "-F", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge/munge.sock", f"--pid-file={r}/run/munged.real.pid",
                               f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munge.seed", "--force"])
        self._wait(lambda: (r / "munge" / "munge.sock").exists(), 10, "munged socket")
        slurmctld = shutil.which("slurmctld") or "/usr/sbin/slurmctld"
        self._spawn("slurmctld", [slurmctld, "-D", "-f", str(self.conf)])
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0 and b"UP" in self._run(["scontrol", "ping"]).stdout,
                   timeout_s, "slurmctld")
        slurmd = shutil.which("slurmd") or "/usr/sbin/slurmd"
        for n in self.node_names:
            self._spawn(f"slurmd-{n}", [slurmd, "-D", "-f", str(self.conf), "-N", n])
        # a node left DOWN by a failure test comes back
        self._run(["scontrol", "update", f"nodename={','.join(self.node_names)}", "state=resume"])
        self._wait(self._all_idle_or_alloc, timeout_s, "nodes to become idle")
        return time.monotonic() - t0

    def _all_idle_or_alloc(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.decode()
        states = [line.split()[1] for line in out.splitlines() if line.strip()]
        if len(states) < self.nodes:
            return False
        if any(s.startswith(("down", "drain", "fail")) for s in states):
            self._run(["scontrol", "update", f"nodename={','.join(self.node_names)}", "state=resume"])
        return all(s.rstrip("*~#") in ("idle", "allocated", "mixed", "completing") for s in states)

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
        try:
            return subprocess.run(argv, env=self.env(), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=15)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, b"", b"timeout")

    @staticmethod
    def _wait(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.3)
        raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Stop the daemons this cluster started (by PID file), newest first."""
        stopped = []
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
            nodes = self._run(["sinfo", "-h", "-N", "-o", "%N %T %G"]).stdout.decode()
        return {"dir": str(self.root), "slurm_conf": str(self.conf), "daemons": daemons,
                "nodes": [line.split() for line in nodes.splitlines() if line.strip()]}
