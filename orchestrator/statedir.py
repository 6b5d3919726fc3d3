"""The state directory's layout, owned by one object.

One directory per fleet, on a file system every node and the daemon see::

    <state_dir>/endpoints/<jobid>.json       a running job's endpoint record (written by the job)
    <state_dir>/endpoints/<jobid>.draining   the job got SLURM's early warning (USR1)
    <state_dir>/gpu/<jobid>.<rank>.json      the NVML exporter's latest reading on each node
    <state_dir>/logs/<model>-<jobid>.log     each job's output
    <state_dir>/admin.key                    the generated admin key (mode 0600)

The daemon, the job templates (through :meth:`StateDir.template_paths`), discovery, the GPU reader and
the admin API all take their paths from here.
"""

from __future__ import annotations

from pathlib import Path


class StateDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.endpoints = self.root / "endpoints"
        self.gpu = self.root / "gpu"
        self.logs = self.root / "logs"
        self.admin_key = self.root / "admin.key"

    def create(self) -> None:
        for d in (self.endpoints, self.gpu, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    def record(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.json"

    def draining_mark(self, job_id: str) -> Path:
        return self.endpoints / f"{job_id}.draining"

    def gpu_files(self, job_id: str) -> list[Path]:
        return list(self.gpu.glob(f"{job_id}.*.json"))

    def log_pattern(self, model: str) -> str:
        """The job's ``--output`` (``%j`` is SLURM's job id)."""
        safe = model.replace("/", "_").replace(":", "_")
        return f"{self.logs}/{safe}-%j.log"

    def template_paths(self) -> dict[str, str]:
        """The folders the job scripts write into (the job appends the file names)."""
        return {"endpoints": str(self.endpoints), "gpu": str(self.gpu)}
