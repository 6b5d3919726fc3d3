"""Fakes at the process boundary (SLURM, a full disk), shared by the tests."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from orchestrator.fleet.slurm import JobInfo, SlurmError
from orchestrator.timefmt import parse_time_limit


def error_file_fails_once(monkeypatch) -> list[str]:
    """The file store's first hand-over of a batch's error file fails as on a full disk: the ids it failed."""
    from orchestrator.batchfiles import FileStore
    real, failed = FileStore.publish, []

    def full_disk(self, fid, owner, purpose, filename, lines, **kw):
        if filename.endswith("_error.jsonl") and not failed:
            failed.append(fid)
            raise OSError(28, "No space left on device")
        return real(self, fid, owner, purpose, filename, lines, **kw)
    monkeypatch.setattr(FileStore, "publish", full_disk)
    return failed


def sbatch_option(script: str, key: str) -> str | None:
    """The value of ``#SBATCH --key=...`` in a rendered script (None when absent)."""
    prefix = f"#SBATCH --{key}="
    return next((ln[len(prefix):] for ln in script.splitlines() if ln.startswith(prefix)), None)


class FakeSlurm:
    """Answers like squeue/sbatch/scancel would, on an injectable clock; scripted failures.

    New jobs start RUNNING on ``node`` at once (``start_state`` to change that).  ``submit_errors`` are raised
    by the next sbatch calls, one each (``cancel_errors`` by the next scancel calls); ``scripts`` holds every
    script sbatch was given, ``cancels`` every scancel that went through; ``ignore_cancel`` makes scancel
    succeed without ending the job; ``on_cancel(job_id)`` runs first (a test's invariant check).
    """

    def __init__(self, fleet: str, clock: Callable[[], float] = time.time):
        self.fleet, self.clock = fleet, clock
        self.jobs: dict[str, JobInfo] = {}
        self.next_id = 100
        self.listing_fails = 0
        self.empty_listings = 0
        self.submits = 0
        self.scripts: list[str] = []
        self.cancels: list[str] = []
        self.signals: list[tuple[str, str]] = []   # (job, signal) of the cancels sent as a signal to the batch shell
        self.submit_errors: list[SlurmError] = []
        self.node = "node1"
        self.start_state = "RUNNING"
        self.ignore_cancel = False
        self.cancel_errors: list[SlurmError] = []
        self.exclude_updates: list[tuple[str, tuple[str, ...]]] = []   # scontrol update ExcNodeList
        self.exclude_errors: list[Exception] = []   # raised (first in, first out) by the next updates
        self.on_cancel: Callable[[str], None] = lambda _jid: None
        # sbatch --test-only: the scripts it was shown, and what it answers each (None: it would take the job)
        self.tested: list[str] = []
        self.judge: Callable[[str], SlurmError | None] = lambda _script: None

    async def list_jobs(self) -> list[JobInfo]:
        if self.listing_fails:
            self.listing_fails -= 1
            raise SlurmError("squeue", "Unable to contact slurm controller (connect failure)", transient=True)
        if self.empty_listings:
            self.empty_listings -= 1
            return []
        return list(self.jobs.values())

    def create(self, script: str) -> str:
        """The job sbatch would make of ``script`` (also usable for one whose sbatch 'failed')."""
        jid = str(self.next_id)
        self.next_id += 1
        now = self.clock()
        running = self.start_state == "RUNNING"
        limit = sbatch_option(script, "time")
        nodes = int(sbatch_option(script, "nodes") or 1)   # (several: node1's name, then node[1-N])
        nodelist = self.node if nodes == 1 else f"{self.node.rstrip('0123456789')}[1-{nodes}]"
        limit_s = parse_time_limit(limit) if limit else None
        # squeue's EndTime of a running job is when its time limit ends it (a job that ended: when it did)
        self.jobs[jid] = JobInfo(jid, f"slurmfleet-{self.fleet}", self.start_state, None, now,
                                 now if running else None, now + limit_s if running and limit_s else None, limit_s,
                                 nodelist if running else "", 0, self.node if running else None,
                                 sbatch_option(script, "comment") or "")
        return jid

    async def submit(self, script: str) -> str:
        self.submits += 1
        self.scripts.append(script)
        if self.submit_errors:
            raise self.submit_errors.pop(0)
        return self.create(script)

    async def will_run(self, script: str) -> None:
        self.tested.append(script)
        if (err := self.judge(script)) is not None:
            raise err

    async def set_excluded(self, job_id: str, nodes) -> None:
        if self.exclude_errors:
            raise self.exclude_errors.pop(0)
        self.exclude_updates.append((job_id, tuple(nodes)))

    async def cancel(self, job_id: str, signal: str | None = None) -> None:
        """(A signal to the batch shell, which stops the job itself: the job ends the same, noted in signals.)"""
        self.on_cancel(job_id)
        if self.cancel_errors:
            raise self.cancel_errors.pop(0)
        self.cancels.append(job_id)
        if signal:
            self.signals.append((job_id, signal))
        if not self.ignore_cancel:
            self.set(job_id, state="CANCELLED", end_time=self.clock())

    def set(self, job_id: str, **changes) -> None:
        """Change what squeue says about a job (state, reason, nodelist, times...)."""
        self.jobs[job_id] = dataclasses.replace(self.jobs[job_id], **changes)

    def end(self, job_id: str, state: str = "FAILED", **changes) -> None:
        self.set(job_id, state=state, end_time=self.clock(), **changes)
