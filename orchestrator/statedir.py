"""The state directory's layout, owned by one object.

One directory per fleet, on a file system every node and the daemon see::

    <state_dir>/endpoints/<jobid>.json       a running job's endpoint record (written by the job)
    <state_dir>/endpoints/<jobid>.draining   the job got SLURM's early warning (USR1)
    <state_dir>/endpoints/<jobid>.drain      an operator asked to drain the job (the daemon's mark)
    <state_dir>/gpu/<jobid>.<rank>.json      the NVML exporter's latest reading on each node
    <state_dir>/logs/<model>-<jobid>.log     each job's output
    <state_dir>/jobs/<jobid>.node.sh         the job's node script: written by its batch script (folder
                                             0700, file 0600), run by ``bash FILE`` on every node of the
                                             job, removed when the batch script exits
    <state_dir>/admin.key                    the generated admin key (mode 0600)

The daemon, the job templates (through :meth:`StateDir.template_paths`), discovery, the GPU reader and
the admin API all take their paths from here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


class StateDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.endpoints = self.root / "endpoints"
        self.gpu = self.root / "gpu"
        self.logs = self.root / "logs"
        self.jobs = self.root / "jobs"
        self.admin_key = self.root / "admin.key"
        self.files = self.root / "files"   # the Files API's files (orchestrator.batchfiles)

    def create(self) -> None:
        """The folders, private to the fleet's user (0700): records hold each job's secret, node scripts
        the model's arguments and environment."""
        for d in (self.root, self.endpoints, self.gpu, self.logs, self.jobs):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (self.root, self.jobs):
            with contextlib.suppress(PermissionError):
                d.chmod(0o700)

    def record(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.json"

    def draining_mark(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.draining"

    def drain_request(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.drain"

    def replace_request(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.replace"

    def node_script(self, job_id: str) -> Path:
        return self.jobs / f"{job_id}.node.sh"

    def gpu_files(self, job_id: str) -> list[Path]:
        return list(self.gpu.glob(f"{job_id}.*.json"))

    def log_pattern(self, model: str) -> str:
        """The job's ``--output`` (``%j`` is SLURM's job id)."""
        safe = model.replace("/", "_").replace(":", "_")
        return f"{self.logs}/{safe}-%j.log"

    def template_paths(self) -> dict[str, str]:
        """The folders the job scripts write into (the job appends the file names)."""
        return {"endpoints": str(self.endpoints), "gpu": str(self.gpu), "jobs": str(self.jobs)}
