"""The SLURM client: a small protocol and an implementation on the SLURM CLI.

Every command runs through ``asyncio.create_subprocess_exec`` with a timeout and
``SLURM_CONF`` passed on.  The fleet listing is ONE ``squeue`` call filtered by
SLURM itself (``--me --name=<fleet job name> -t all``), in the text form that
honours filters on every release (22.05's ``--json`` ignores them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from ..timefmt import parse_time_limit

log = logging.getLogger(__name__)

SQUEUE_FIELDS = ("JobID", "Name", "State", "Reason", "SubmitTime", "StartTime", "EndTime", "TimeLimit",
                 "NodeList", "RestartCnt", "BatchHost", "Comment")
SQUEUE_FORMAT = ",".join(f"{f}:|" for f in SQUEUE_FIELDS)
# one row per array task (``squeue -r``), its id as ``<array job id>_<task id>``
ARRAY_FORMAT = SQUEUE_FORMAT.replace("JobID:|", "JobArrayID:|", 1)

_TRANSIENT = re.compile(
    r"unable to contact slurm controller|temporarily unable|socket timed out|connection refused|zero bytes were transmitted|"
    r"temporarily unavailable|communication connection failure|slurm_load_jobs error: .*timed out|"
    r"connect failure|resource temporarily unavailable|try again|controller is in standby|in standby mode|"
    r"sending authentication credential|invalid authentication credential|munge|"
    # no slurm.conf where the command looks (and no DNS SRV record): this host's setup, not the job's fault
    r"could not establish a configuration source|unable to process configuration file", re.IGNORECASE)
# failures before a command reached slurmctld at all (no connection, no configuration): an sbatch that failed so
# made no job, and is not awaited in squeue (a cold start's held requests waited 2 minutes for one)
UNSENT = re.compile(r"unable to contact slurm controller|connection refused|could not establish a configuration "
                    r"source|unable to process configuration file", re.IGNORECASE)
# scontrol hold/release's answer for tasks it had nothing to do with (ended, running, not held, or forgotten:
# slurmctld purges a job MinJobAge after its end) or did act on
ALONE = re.compile(r"no error|already finished|no longer pending|not pending|not held|job is not suspended|"
                   r"invalid job id", re.IGNORECASE)


# the daemon's environment variables that never reach a SLURM command (nor, through sbatch, a job), but
# SLURM_KEPT: where the cluster's config is, the token of a site that authenticates with JWT, and the cluster
# every command goes to (sbatch, squeue and scancel alike)
SLURM_INPUTS = ("SLURMFLEET_", "SBATCH_", "SQUEUE_", "SCANCEL_", "SCONTROL_", "SRUN_", "SALLOC_", "SLURM_")
SLURM_KEPT = frozenset({"SLURM_CONF", "SLURM_JWT", "SLURM_CLUSTERS"})


class SlurmError(Exception):
    """A SLURM command failed; ``transient`` says whether retrying may help."""

    def __init__(self, command: str, message: str, transient: bool, started: bool = True):
        self.command = command
        self.transient = transient
        self.started = started   # False: the command never ran (an sbatch that did not start submitted nothing)
        super().__init__(f"{command}: {message}")


def classify(stderr: str) -> bool:
    """True when the error text means 'try again later', False when it is permanent."""
    return bool(_TRANSIENT.search(stderr))


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """One job as squeue reports it."""

    job_id: str
    name: str
    state: str
    reason: str | None
    submit_time: float | None
    start_time: float | None
    end_time: float | None
    time_limit_s: int | None
    nodelist: str
    restart_count: int
    batch_host: str | None
    comment: str


def _epoch(value: str) -> float | None:
    value = value.strip()
    if not value or value in ("N/A", "Unknown", "None", "0"):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _limit(value: str) -> int | None:
    value = value.strip()
    if value in ("", "NOT_SET", "INVALID", "N/A"):
        return None
    try:
        return parse_time_limit(value)
    except ValueError:
        return None


def parse_squeue(text: str) -> list[JobInfo]:
    """Parse ``squeue -h -O <SQUEUE_FORMAT>`` output (times as epoch seconds)."""
    jobs = []
    n = len(SQUEUE_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", n - 1)
        if len(parts) < n:
            continue
        comment = parts[-1].rstrip()
        comment = comment[:-1] if comment.endswith("|") else comment
        job_id, name, state, reason, submit, start, end, limit, nodelist, restarts, batch_host = (
            p.strip() for p in parts[:-1])
        state = state.split()[0].rstrip("+") if state else "UNKNOWN"
        jobs.append(JobInfo(
            job_id=job_id, name=name, state=state,
            reason=None if reason in ("None", "", "(null)") else reason,
            submit_time=_epoch(submit), start_time=_epoch(start), end_time=_epoch(end),
            time_limit_s=_limit(limit), nodelist="" if nodelist in ("(null)", "") else nodelist,
            restart_count=int(restarts) if restarts.isdigit() else 0,
            batch_host=None if batch_host in ("n/a", "(null)", "") else batch_host,
            comment="" if comment == "(null)" else comment,
        ))
    return jobs


class SlurmClient(Protocol):
    """What the daemon needs from SLURM."""

    async def submit(self, script: str) -> str: ...
    async def will_run(self, script: str) -> None: ...
    async def list_jobs(self) -> list[JobInfo]: ...
    async def cancel(self, job_id: str, signal: str | None = None) -> None: ...
    async def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None: ...


class CliSlurm:
    """SlurmClient on sbatch/squeue/scancel."""

    def __init__(self, job_name: str, slurm_conf: str | None = None, timeout_s: float = 30.0,
                 observer=None, bin_dir: str | None = None):
        self.job_name = job_name
        self.timeout_s = timeout_s
        self.observer = observer  # callable(command, seconds, ok) or None
        self.bin_dir = bin_dir
        self.kill_wait_s = 5.0   # a command killed at its timeout, waited for at most this long
        # sbatch exports its environment to the job (and SLURM keeps it): slurmfleet's own keys stay here.  The
        # SLURM tools' input variables stay here too: sbatch takes SBATCH_* over the script's #SBATCH lines
        # (a login's SBATCH_ACCOUNT, SBATCH_TIMELIMIT or SBATCH_JOB_NAME would change every job, the last
        # one hiding them all from squeue --name), squeue and scancel their SQUEUE_*/SCANCEL_* over their
        # arguments, and a daemon run inside an allocation has SLURM_* of its own that srun in the jobs would
        # read as theirs (SLURM_MEM_PER_CPU beside the job's SLURM_MEM_PER_NODE is an srun error)
        env = {k: v for k, v in os.environ.items()
               if (k in SLURM_KEPT or not k.startswith(SLURM_INPUTS)) and k != "OPENAI_API_KEY"}
        if slurm_conf or os.environ.get("SLURM_CONF"):   # (cluster.slurm_conf, else the environment's)
            env["SLURM_CONF"] = slurm_conf or os.environ["SLURM_CONF"]
        env["SLURM_TIME_FORMAT"] = "%s"
        self.env: Mapping[str, str] = env

    def _exe(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    async def _run(self, argv: Sequence[str], stdin: bytes | None = None) -> str:
        cmd = argv[0]
        t0 = time.monotonic()
        ok = False
        try:
            if (conf := self.env.get("SLURM_CONF")) and not os.path.exists(conf):   # (the tools wait a minute on
                raise SlurmError(cmd, f"SLURM_CONF {conf} does not exist (cluster.slurm_conf, else the "   # one, and
                                 "environment's)", transient=True, started=False)   # do not name it)
            try:
                proc = await asyncio.create_subprocess_exec(
                    self._exe(cmd), *argv[1:], env=dict(self.env),
                    stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            except FileNotFoundError:
                raise SlurmError(cmd, "command not found (is slurm-client installed?)", transient=False,
                                 started=False) from None
            except OSError as exc:   # fork's EAGAIN, EMFILE, ENOMEM, a tool not executable: this tick's trouble
                raise SlurmError(cmd, f"cannot start it: {exc}", transient=True, started=False) from None
            try:
                out, err = await asyncio.wait_for(proc.communicate(stdin), self.timeout_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                try:   # one in uninterruptible sleep (a hung NFS) dies when it wakes: reaped then, not waited for
                    await asyncio.wait_for(proc.wait(), self.kill_wait_s)
                except asyncio.TimeoutError:
                    log.warning("%s (pid %d) did not die within %.0fs of SIGKILL: left behind", cmd, proc.pid,
                                self.kill_wait_s)
                raise SlurmError(cmd, f"timed out after {self.timeout_s:.0f}s", transient=True) from None
            if proc.returncode != 0:
                text = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
                raise SlurmError(cmd, text or f"exit {proc.returncode}", transient=classify(text),
                                 started=not UNSENT.search(text))
            ok = True
            return out.decode(errors="replace")
        finally:
            if self.observer is not None:
                self.observer(cmd, time.monotonic() - t0, ok)

    async def submit(self, script: str) -> str:
        out = await self._run(["sbatch", "--parsable"], stdin=script.encode())
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError("sbatch", f"unexpected output {out.strip()!r}", transient=True)
        return job_id

    async def will_run(self, script: str) -> None:
        """``sbatch --test-only``: SLURM judges the job and submits nothing; a SlurmError with its reason when it
        would refuse it (it also refuses a job no node up now can take: see :mod:`.preflight`)."""
        await self._run(["sbatch", "--test-only"], stdin=script.encode())

    async def list_jobs(self) -> list[JobInfo]:
        # --all: jobs in a partition hidden from this user (Hidden=YES, AllowGroups) too, which sbatch -p takes;
        # without it they are never listed, so never adopted nor cancelled, and submitted again every other tick
        out = await self._run(["squeue", "-h", "-a", "-t", "all", "--me", f"--name={self.job_name}", "-O",
                               SQUEUE_FORMAT])
        return [j for j in parse_squeue(out) if j.name == self.job_name]

    async def list_array_tasks(self, name: str) -> list[JobInfo]:
        """Every task of the job arrays named ``name`` (pending ones too, one row each), ``job_id`` as
        ``<array job id>_<task id>``."""
        out = await self._run(["squeue", "-h", "-a", "-r", "-t", "all", "--me", f"--name={name}", "-O", ARRAY_FORMAT])
        return [j for j in parse_squeue(out) if j.name == name]

    async def hold(self, job_id: str) -> None:
        """Hold a job's tasks that have not started (an array's too), as its user may (``uhold``: the pending
        reason is ``JobHeldUser``, for root as well); tasks running or ended are left alone."""
        await self._tasks_left_alone(["scontrol", "uhold", job_id])

    async def release(self, job_id: str) -> None:
        """Release a held job's tasks."""
        await self._tasks_left_alone(["scontrol", "release", job_id])

    async def _tasks_left_alone(self, argv: list[str]) -> None:
        # on an array, scontrol answers per range of tasks and fails when any had ended ("1_0-1: Job has
        # already finished" beside "1_2-5: No error"): the tasks it could act on were acted on
        try:
            await self._run(argv)
        except SlurmError as e:
            lines = [x for x in str(e).splitlines() if x.strip()]
            if not lines or not all(ALONE.search(x) for x in lines):
                raise

    async def cancel(self, job_id: str, signal: str | None = None) -> None:
        """scancel; with a ``signal``, only to the job's batch shell (which stops the job's steps itself)."""
        await self._run(["scancel", *([f"--signal={signal}", "--batch"] if signal else []), job_id])

    async def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        """A pending job's ``--exclude`` becomes ``nodes`` (none: every node again)."""
        await self._run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"])
