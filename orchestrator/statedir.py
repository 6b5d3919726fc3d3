"""The state directory's layout, owned by one object.

One directory per fleet, on a file system every node and the daemon see::

    <state_dir>/endpoints/<jobid>.json       a running job's endpoint record (written by the job)
    <state_dir>/endpoints/<jobid>.<restart>.draining  that run of the job got SLURM's early warning (USR1)
    <state_dir>/endpoints/<jobid>.drain      an operator asked to drain the job (the daemon's mark)
    <state_dir>/gpu/<jobid>.<rank>.json      the NVML exporter's latest reading on each node
    <state_dir>/logs/<model>-<jobid>.log     each job's output
    <state_dir>/jobs/<jobid>.<restart>.node.sh  the node script of each run of the job: written by its batch
                                             script (folder 0700, file 0600), run by ``bash FILE`` on every
                                             node of the job, removed when the batch script exits
    <state_dir>/admin.key                    the generated admin key (mode 0600)
    <state_dir>/daemon.lock                  held (flock) by the one daemon of this state dir; its pid
    <state_dir>/usage-spool/<incarnation>.json  a gateway worker's last usage counters, written when its
                                             daemon died; the next daemon books them once and removes them
    <state_dir>/submitting.json              replica sbatch calls whose outcome is not known yet (a restart
                                             watches squeue for their jobs before submitting those slots)
    <state_dir>/pins.json                    ``slurmfleet scale`` pins, with the digest of the config they
                                             were set under (a restart on the same config keeps them)
    <state_dir>/nodes.json                   per model: nodes excluded after failures, a crash loop's back-off,
                                             the jobs followed, since when an autoscaled model had no request
                                             (fleet.nodememory)

The daemon, the job templates (through :meth:`StateDir.template_paths`), discovery, the GPU reader and
the admin API all take their paths from here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path

from .durable import write_whole

log = logging.getLogger(__name__)


class StateDirShared(RuntimeError):
    """``state_dir`` is a folder every user writes to: not the fleet's own."""


class StateDirBusy(RuntimeError):
    """Another daemon runs on this state dir."""


class StateDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.endpoints = self.root / "endpoints"
        self.gpu = self.root / "gpu"
        self.logs = self.root / "logs"
        self.jobs = self.root / "jobs"
        self.admin_key = self.root / "admin.key"
        self.pins = self.root / "pins.json"
        self.submitting = self.root / "submitting.json"   # replica sbatch calls of unknown outcome (fleet.submitting)
        self.nodes = self.root / "nodes.json"   # bad nodes and jobs followed, kept across a restart (fleet.nodememory)
        self.usage_spool = self.root / "usage-spool"
        self.files = self.root / "files"   # the Files API's files (orchestrator.batchfiles)

    def create(self) -> None:
        """The folders, private to the fleet's user (0700): records hold each job's secret, node scripts
        the model's arguments and environment.  :class:`StateDirShared` for a folder others write to (``/tmp``:
        made private, it would no longer be theirs), or one another user owns (made first where anyone may make
        folders, it would let them swap a job's node script or plant endpoint records)."""
        with contextlib.suppress(FileNotFoundError):
            mode = self.root.stat().st_mode
            if mode & (stat.S_ISVTX | stat.S_IWOTH):
                raise StateDirShared(f"state_dir {self.root} is a folder every user writes to ({stat.filemode(mode)}): "
                                     f"the fleet's records hold secrets and must be its own folder, such as "
                                     f"{self.root / 'slurmfleet'}")
        for up in Path(os.path.realpath(self.root)).parents:   # another user who may rename the folder away (a
            with contextlib.suppress(FileNotFoundError):      # folder above it they write to, without the sticky
                mode = up.stat().st_mode                      # bit) puts one of their own in its place
                if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                    raise StateDirShared(f"state_dir {self.root} is in {up}, which every user may write to "
                                         f"({stat.filemode(mode)}): another user could move it aside and put a "
                                         f"folder of their own in its place; put it where only its user writes")
                if mode & stat.S_IWGRP and not mode & stat.S_ISVTX:
                    log.warning("state_dir %s is in %s, which its group may write to (%s): a member of the group "
                                "could move it aside and put a folder of their own in its place", self.root, up,
                                stat.filemode(mode))
        for d in (self.root, self.endpoints, self.gpu, self.logs, self.jobs):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat() if d is self.root else d.lstat()   # (the root may be a link to it; a folder in it not)
            if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                what = f"{stat.filemode(st.st_mode)}, uid {st.st_uid}"
                raise StateDirShared(f"{d} is not a folder of this user (uid {os.geteuid()}; it is {what}): the "
                                     f"fleet's state_dir and its folders must be its user's own")
            if d in (self.root, self.jobs) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                d.chmod(0o700 if d in (self.root, self.jobs) else stat.S_IMODE(st.st_mode) & ~0o022)

    def lock(self) -> int | None:
        """Take the state dir for this process (an exclusive ``flock`` on ``daemon.lock``, released by the kernel
        when the process ends, however it ends) and write its pid there.  Returns the descriptor to keep open;
        None when the file system has no such locks (then two daemons are not prevented, and it is logged).
        :class:`StateDirBusy` when another process holds it: two daemons on one state dir would each submit
        the fleet's jobs and cancel the other's."""
        path = self.root / "daemon.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirBusy(f"another slurmfleet daemon (pid {holder or 'unknown'}) runs on state_dir "
                                   f"{self.root}: one daemon per state dir (it submits and cancels the fleet's jobs)")
            log.warning("cannot lock %s (%s): nothing stops a second daemon on this state dir", path, exc)
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def record(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.json"

    def draining_marks(self, job_id: str) -> list[Path]:
        """Each run's ``<jobid>.<restart>.draining`` (and an earlier version's ``<jobid>.draining``)."""
        return list(self.endpoints.glob(f"{job_id}.*draining"))

    def drain_request(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.drain"

    def replace_request(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.replace"

    def cancel_mark(self, job_id: str) -> Path:
        """The daemon cancelled the job (it may run on for its stop's grace): a restarted daemon neither routes to
        it nor counts its end as a crash."""
        return self.endpoints / f"{job_id}.cancel"

    def node_scripts(self, job_id: str) -> list[Path]:
        """Each run's (and one an earlier version named ``<jobid>.node.sh``)."""
        return list(self.jobs.glob(f"{job_id}.*node.sh"))

    def python_folders(self, job_id: str) -> list[Path]:
        """Each run's ``<jobid>.<restart>.pylib`` (the engine's middleware and the KV relay)."""
        return list(self.jobs.glob(f"{job_id}.*.pylib"))

    def gpu_files(self, job_id: str) -> list[Path]:
        return list(self.gpu.glob(f"{job_id}.*.json"))

    def log_pattern(self, model: str) -> str:
        """The job's ``--output`` (``%j`` is SLURM's job id)."""
        safe = model.replace("/", "_").replace(":", "_")
        return f"{self.logs}/{safe}-%j.log"

    def template_paths(self) -> dict[str, str]:
        """The folders the job scripts write into (the job appends the file names)."""
        return {"endpoints": str(self.endpoints), "gpu": str(self.gpu), "jobs": str(self.jobs)}

    def write_private(self, path: Path, text: str) -> None:
        """Write ``path`` whole, mode 0600 (:func:`orchestrator.durable.write_whole`)."""
        write_whole(path, text.encode())

    def save_pins(self, config_digest: str, pins: dict[str, int]) -> None:
        """The operator's ``slurmfleet scale`` pins (model -> replicas), durable before the answer: a daemon
        killed and started again on the same config keeps them (a reload, or a changed config, drops them)."""
        if pins:
            self.write_private(self.pins, json.dumps({"config": config_digest, "pins": pins}))
        else:
            self.pins.unlink(missing_ok=True)

    def load_pins(self, config_digest: str) -> dict[str, int]:
        """The pins saved under this config ({} when none, or when they were set under another config)."""
        try:
            doc = json.loads(self.pins.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.pins, exc)
            return {}
        if doc.get("config") != config_digest:
            log.info("dropping the scale pins of %s: the config changed since they were set", self.pins)
            return {}
        return {str(k): int(v) for k, v in doc.get("pins", {}).items()}


def log_tail(path: str, limit: int = 8192) -> str:
    """How a job's output file ends (its last non-empty line), for `slurmfleet status`; "" when unreadable."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - limit))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f"its log {path} ends: {lines[-1][:300]}" if lines else f"its log {path} is empty"
