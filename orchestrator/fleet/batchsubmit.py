"""A dedicated batch's sbatch calls (:mod:`orchestrator.fleet.batcharray`) whose outcome is not known.

sbatch can fail after slurmctld took the job (it timed out, its output was cut), and the daemon can die while
it runs: the job then exists, and squeue may not list it for a while.  So each sbatch of the array or of a
shard's retry is recorded in the array's state (``array.json``'s ``submitting``: ``array`` or the shard's
number -> when, and the ``--array`` it submits) and saved before it runs; the entry goes once the job id is
known (sbatch answered, or squeue lists the job under the batch's name: adopted).  While one waits, nothing
of it is submitted again; it is given up only after ``confirm_s`` without the job in squeue (as the fleet's
replicas' submissions, :mod:`orchestrator.fleet.reconciler`).  One that shows up after all is a stray,
cancelled (:func:`~.batchrules.sort_jobs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from .replica import refused_for_now
from .slurm import CliSlurm, SlurmError

log = logging.getLogger("slurmfleet.batches")
NOT_NOW_S = 60.0   # an sbatch SLURM refused for now (a drained partition, a job count limit) is tried again after


class Submissions:
    """The sbatch calls awaited in squeue, kept in ``st["submitting"]`` (``save`` writes ``st`` whole), and the
    batch's scancel calls."""

    def __init__(self, st: dict, save: Callable[[], None], slurm: CliSlurm, confirm_s: float, bid: str):
        self.st, self.save, self.slurm, self.confirm_s, self.bid = st, save, slurm, confirm_s, bid
        self.scancelled: dict[str, float] = {}   # job -> when it was last scancelled (monotonic)
        self.later: dict[str, float] = {}   # key -> when an sbatch SLURM refused for now may go again (monotonic)
        self.waiting: str | None = None   # why one waits (shown in the array's progress)
        st.setdefault("submitting", {})

    @property
    def pending(self) -> dict[str, dict]:
        return self.st["submitting"]

    def awaited(self, key: str) -> bool:
        """An sbatch of ``key`` may have made a job squeue does not show yet: submit nothing of it."""
        return key in self.pending

    def confirmed(self, key: str) -> None:
        """Its job id is known (not saved here: the caller saves it with the job id)."""
        self.pending.pop(key, None)

    def _drop(self, key: str) -> None:
        """No job came of it: a retry gives its count back."""
        self.pending.pop(key, None)
        if key != "array":
            self.st["retries"][key] = max(0, int(self.st["retries"].get(key, 0)) - 1)

    async def sbatch(self, key: str, spec: str, script: str) -> str | None:
        """Record (a shard's retry: counted with it, so a crash never gives more), submit: the job id (scancelled
        if the batch was cancelled meanwhile); None when sbatch failed transiently (the job may exist: awaited in
        squeue) or an earlier sbatch of ``key`` is still awaited or SLURM refused it for now (:meth:`not_now`:
        nothing submitted).  SLURM refusing it (no job made) raises its SlurmError, the record dropped."""
        if self.awaited(key) or time.monotonic() < self.later.get(key, 0.0):
            return None
        self.pending[key] = {"at": time.time(), "array": spec}
        if key != "array":
            self.st["retries"][key] = int(self.st["retries"].get(key, 0)) + 1
        self.save()
        try:
            job = await self.slurm.submit(script)
        except SlurmError as e:
            if not e.transient or not e.started:   # (refused, or it never reached slurmctld: no job was made)
                self._drop(key)
                self.save()
                if e.transient or self.not_now(key, e):
                    return None
                raise
            log.warning("batch %s: sbatch --array=%s failed (%s); the job may exist: awaiting it in squeue for %.0fs "
                        "before submitting it again", self.bid, spec, e, self.confirm_s)
            return None
        self.confirmed(key)
        self.later.pop(key, None)
        self.waiting = None if not self.later else self.waiting
        if self.st.get("cancelled"):   # cancelled while its sbatch ran (a look may not list it yet): at once
            await self.scancel([job])
        return job

    def not_now(self, key: str, e: SlurmError) -> bool:
        """Whether SLURM refused ``key``'s sbatch for now, not for good: its partition set DRAIN or INACTIVE
        (a maintenance), or for a shard's retry (one job of a shape SLURM took) the user's or QOS's job count
        limit, which frees as tasks end (an array's own refusal may be its size: its tasks count one each).  Such
        an sbatch goes again after :data:`NOT_NOW_S` (the array's running shards left running)."""
        cause = refused_for_now(str(e))
        if cause is None or cause == "submit_limit" and key == "array":
            return False
        if key not in self.later:
            log.warning("batch %s: SLURM refuses the sbatch of %s for now (%s); trying again every %.0fs", self.bid,
                        f"shard {key}'s retry" if key != "array" else "the job array", e, NOT_NOW_S)
        self.later[key] = time.monotonic() + NOT_NOW_S
        self.waiting = f"SLURM refuses its sbatch for now: {str(e).strip().splitlines()[-1]}"
        return True

    def expire(self) -> None:
        """After a look that did not find them: drop the records older than ``confirm_s``."""
        gone = [k for k, v in self.pending.items() if time.time() - float(v["at"]) > self.confirm_s]
        for key in gone:
            log.warning("batch %s: the sbatch of --array=%s never appeared in squeue in %.0fs: taken as not made",
                        self.bid, self.pending[key]["array"], self.confirm_s)
            self._drop(key)
        if gone:
            self.save()

    async def scancel(self, jobs: Iterable[str], again_after: float = 0.0, stray: bool = False) -> None:
        """scancel each of ``jobs`` not scancelled in the last ``again_after`` seconds (``stray``: a job of the
        batch's name neither its array nor a retry: a duplicate, logged)."""
        for job in sorted(jobs):
            if time.monotonic() - self.scancelled.get(job, -1e9) < again_after:
                continue
            self.scancelled[job] = time.monotonic()
            if stray:
                log.warning("batch %s: job %s of the batch's name is neither its array nor a retry (a duplicate "
                            "made by an sbatch whose outcome was unknown); cancelling it", self.bid, job)
            try:
                await self.slurm.cancel(job)
            except SlurmError as e:
                self.scancelled.pop(job, None)   # (not cancelled: asked again at the next look)
                log.warning("batch %s: scancel %s failed: %s", self.bid, job, e)
