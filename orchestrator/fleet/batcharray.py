"""Dedicated mode: a batch as its own SLURM job array, one task per shard, each running ``vllm run-batch``.

The work folder (under the state dir) holds everything, so a restarted daemon picks the batch up where it was::

    array.json              the array's state: shard sizes, the array's job id, each retried shard's job and
                            retry count, the sbatch calls not answered yet, shards given up, cancel, merged
                            counts (written whole: temp + rename)
    shard-000i.jsonl        shard i's input lines: contiguous ranges of the input, split streaming
    shard-000i.idx          one JSON ``[input line number, custom_id]`` per line of the shard
    out/shard-000i.jsonl    shard i's answers in ``vllm run-batch``'s format: it exists only once the task
                            wrote one line per input line and exited 0 (``.part`` while it runs)
    logs/shard-i.<job>.log  each attempt's output

One ``sbatch --array=0-(N-1)%K`` (``sbatch/batch-array.sh.j2``) starts every task as the fleet's YAML starts
the model (container, binds, env, GPUs, partition, account, qos, time limit, vLLM arguments); a task ends
with its shard, which frees its GPUs.  squeue (``-r``: one row per task) gives each task's state and pending
reason.  A task that ends without its shard's output is resubmitted alone (``--array=i``, starting the shard
over) up to ``max_task_retries`` times; a retry is held while tasks of the array still wait and ``K`` tasks
run, so at most ``K`` run at once.  (A task that exited 0 renamed its whole output; when that file is not
visible here yet -- a shared file system's lag -- the shard waits ``settle_s`` before it counts as failed.)
A pending reason that never clears (``replica.fatal_pending``) cancels the array and fails the batch
(:class:`ArrayBlocked`), as the fleet blocks a model.  When every shard is done (or given up) the answers are
merged in input order into the batch's output and error files, in the shared runner's format (``id``
``batch_req_<hex>-<line>``, :mod:`orchestrator.fleet.batchrun`); a given-up shard's lines become error lines
(``shard_failed``), a cancelled batch keeps the shards done (an expired one: the other lines get ``batch_expired``
error lines).  A restarted executor adopts the array: its job id is in ``array.json``; an sbatch of unknown outcome
(a timeout, a crash) is awaited in squeue by the job name, and adopted, before another goes; any other job of
that name is a duplicate, cancelled (:mod:`orchestrator.fleet.batchsubmit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..batches import DEDICATED_ENDPOINTS as ENDPOINTS
from ..config import FleetConfig, ModelConfig
from ..durable import write_whole
from .batchshards import LineCounter, logged_progress, merge, shard_usage, split_input
from .render import Renderer
from .batchrules import TASK_ID, live_jobs, retry_slots, sort_jobs, to_hold_or_release, verdict
from .batchsubmit import Submissions
from .replica import ENDED_SLURM, QUEUED_SLURM, fatal_pending, held_for_good
from .slurm import CliSlurm, JobInfo, SlurmError

log = logging.getLogger("slurmfleet.batches")
SAFE_DIR = re.compile(r"^/[^\s'\"\\$`;|&<>%:,]*$")   # a work dir sbatch's --output, bash and a --bind take literally


class ArrayBlocked(Exception):
    """The array cannot run: sbatch refuses it, or SLURM holds a task for a reason that never clears."""


class ArrayBatch:
    """One batch run as a job array: :meth:`run` until every shard is done or given up (the merged files then in
    place), :meth:`progress` at any time, :meth:`cancel` to stop it, :meth:`cleanup` once they are handed over."""

    def __init__(self, rec: dict, fleet: FleetConfig, model: ModelConfig, lines: Iterable[tuple[int, bytes]],
                 work_dir: str | Path, output: str | Path, errors: str | Path, slurm: CliSlurm, shards: int,
                 max_parallel: int | None = None, max_task_retries: int = 2, poll_s: float = 2.0,
                 settle_s: float = 30.0, renderer: Renderer | None = None, submit_confirm_s: float | None = None):
        if not re.fullmatch(r"batch_[A-Za-z0-9]+", str(rec.get("id"))):
            raise ValueError(f"not a batch id: {rec.get('id')!r}")
        if model.nodes != 1:
            raise ValueError(f"model {model.name} runs on {model.nodes} nodes; a batch task runs on one")
        if rec.get("endpoint") not in ENDPOINTS:
            raise ValueError(f"vllm run-batch does not serve {rec.get('endpoint')} (only {', '.join(ENDPOINTS)})")
        if not SAFE_DIR.fullmatch(str(work_dir)):
            raise ValueError(f"work dir {work_dir!r}: an absolute path without spaces, quotes or shell characters")
        if shards < 1 or (max_parallel is not None and max_parallel < 1) or max_task_retries < 0:
            raise ValueError("shards and max_parallel must be at least 1, max_task_retries at least 0")
        self.rec, self.bid, self.fleet, self.model, self.lines = rec, rec["id"], fleet, model, lines
        self.work, self.output, self.errors = Path(work_dir), Path(output), Path(errors)
        self.slurm, self.shards, self.max_parallel, self.max_task_retries = slurm, shards, max_parallel, max_task_retries
        self.poll_s, self.settle_s, self.renderer = poll_s, settle_s, renderer or Renderer()
        self.job_name = f"{fleet.job_name}-{self.bid}"
        self.st = self._load()
        self.subs = Submissions(self.st, self._save, slurm, submit_confirm_s or fleet.daemon.submit_confirm_s, rec["id"])
        self.rows: dict[int, JobInfo | None] = {}   # each shard's current attempt as squeue last showed it
        self.done: set[int] = set()
        self.submitted: dict[int, float] = {}      # shard -> when its attempt was submitted (loop time)
        self.completed_at: dict[tuple[str, int], float] = {}   # (task, shard) -> first seen COMPLETED
        self.live: set[str] = set()   # the jobs of the batch's name with a task not ended, as squeue last showed
        self.counters: dict[int, LineCounter] = {}
        self.wake = asyncio.Event()
        self.looked = 0.0   # when squeue last answered (loop time; 0: not yet)
        self.prompt_tokens = self.completion_tokens = 0   # of the merged answers
        self.usage: dict[int, tuple[int, int, int]] = {}   # a done shard's (answered, prompt, completion)

    # -- state ------------------------------------------------------------------------------------------
    def _load(self) -> dict:
        try:
            return json.loads((self.work / "array.json").read_text())
        except (FileNotFoundError, ValueError):
            return {"version": 1, "batch": self.bid, "counts": None, "max_parallel": None, "job": None,
                    "attempts": {}, "retries": {}, "given_up": {}, "cancelled": False, "blocked": None, "merged": None}

    def _save(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        write_whole(self.work / "array.json", json.dumps(self.st, separators=(",", ":")).encode())

    def _attempt(self, i: int) -> str | None:
        return self.st["attempts"].get(str(i), self.st["job"])

    def _retries(self, i: int) -> int:
        return int(self.st["retries"].get(str(i), 0))

    def script(self, array: str) -> str:
        """The array's job script for the tasks ``array`` (``0-3%2``; a retry: ``2``)."""
        return self.renderer.array_script(self.fleet, self.model, self.bid, self.job_name, self.work, array)

    # -- running ----------------------------------------------------------------------------------------
    async def run(self) -> tuple[int, int]:
        """Split, submit (or adopt), watch, retry, merge: (completed, failed).  Cancelling this coroutine
        leaves the array running for the next executor to adopt; :meth:`cancel` stops the array."""
        if self.st["merged"] is not None:
            c, f, self.prompt_tokens, self.completion_tokens = self.st["merged"]
            return c, f
        if self.st["blocked"]:
            raise ArrayBlocked(self.st["blocked"])
        if self.st["counts"] is None and self.st["cancelled"] and not self.st.get("expired"):
            self.st["counts"] = []   # cancelled before its split: nothing submitted (expired: split for its lines)
        if self.st["counts"] is None:
            await asyncio.to_thread(self._split)
        if self.st["cancelled"]:
            await self._cancel_jobs()
        since = up = 0.0   # (the cancel; the first look after it: merged once a look since finds its jobs gone, none
        while True:   # awaited, or 2 minutes after that first look; not before: with SLURM down, its tasks start later)
            self._scan_done()
            if self.st["cancelled"]:
                since = since or asyncio.get_running_loop().time()
                up = up or (self.looked if self.looked > since else 0.0)
                if not self.subs.pending and (self.st["job"] is None or up and not self.live) or \
                        up and self.looked > up + max(120.0, self.subs.confirm_s):
                    break
            elif all(i in self.done or str(i) in self.st["given_up"] for i in range(len(self.st["counts"]))):
                break
            await self._tick()
            self.wake.clear()
            try:   # (not wait_for: on 3.11 it drops a cancel that meets the wake)
                async with asyncio.timeout(self.poll_s):
                    await self.wake.wait()
            except TimeoutError:
                pass
        if not self.st["cancelled"] and any(self._attempt(i) != self.st["job"] for i in self.done):
            if not self.looked:   # (a restart with every shard done: the retries are not known yet)
                await self._look()
            await self._cancel_spare_retries()
        return await self._merge()

    async def _cancel_spare_retries(self) -> None:
        """Cancel a retry still queued for a shard whose first output came late (one running exits at once), and a
        task SLURM holds for good (a special exit, a failed launch: ended; released, it would run beside its retry)."""
        for i, row in sorted(self.rows.items()):
            spare = i in self.done and self._attempt(i) != self.st["job"]   # (a retry: a job of its own)
            if row is not None and (held_for_good(row.state, row.reason) or (spare and row.state in QUEUED_SLURM)):
                with contextlib.suppress(SlurmError):
                    await self.slurm.cancel(self._attempt(i) if spare else row.job_id)

    async def _merge(self) -> tuple[int, int]:
        given_up = {int(k): v for k, v in self.st["given_up"].items()}
        c, f, self.prompt_tokens, self.completion_tokens = await asyncio.to_thread(
            merge, self.work, len(self.st["counts"]), self.bid, given_up, self.output, self.errors,
            bool(self.st.get("expired")))
        self.st["merged"] = [c, f, self.prompt_tokens, self.completion_tokens]
        self.st["held"] = None
        self._save()
        log.info("batch %s: array merged, %d completed, %d failed", self.bid, c, f)
        return c, f

    def _split(self) -> None:
        total = int(self.rec["request_counts"]["total"])
        n = min(self.shards, max(1, total))
        for d in (self.work, self.work / "out", self.work / "logs"):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        counts = split_input(self.lines, total, n, self.work)
        self.st.update(counts=counts, max_parallel=min(n, self.max_parallel or n))
        self._save()
        log.info("batch %s: %d lines split into %d shards", self.bid, sum(counts), n)

    def _scan_done(self) -> None:
        for i, n in enumerate(self.st["counts"]):
            if i not in self.done and (n == 0 or LineCounter().count(self._out(i)) == n):
                self.done.add(i)

    def _out(self, i: int) -> Path:
        return self.work / "out" / f"shard-{i:04d}.jsonl"

    async def _look(self) -> bool:
        """squeue the batch's jobs: adopt what an sbatch of unknown outcome made, cancel a stray (cancelled: every
        job live), give up the sbatch calls awaited too long.  False: squeue failed."""
        try:
            rows = await self.slurm.list_array_tasks(self.job_name)
        except SlurmError as e:
            log.warning("batch %s: squeue failed (%s); trying again", self.bid, e)
            return False
        strays = self._observe(rows)
        await (self._cancel_jobs(rows) if self.st["cancelled"] else self.subs.scancel(strays, 10, stray=True))
        self.subs.expire()
        self.looked = asyncio.get_running_loop().time()
        return True

    async def _tick(self) -> None:
        if not await self._look():
            return
        self._scan_done()   # after squeue: a task that ended done shows its output now
        if self.st["job"] is None and not self.st["cancelled"]:
            return await self._start()
        await self._cancel_spare_retries()
        now = asyncio.get_running_loop().time()
        if self.st["cancelled"]:
            return
        for i, row in self.rows.items():
            if row is not None and row.state == "PENDING" and fatal_pending(row.reason):
                await self._block(f"shard {i}'s task {row.job_id} cannot start: SLURM says {row.reason}")
        states = [self._state(i, now) for i in range(len(self.st["counts"]))]
        retry = []
        for i, state in enumerate(states):
            if i in self.done or str(i) in self.st["given_up"]:
                continue
            v = verdict(False, state, self._retries(i), self.max_task_retries)
            row = self.rows.get(i)
            last = f"{row.state}{' ' + row.reason if row.reason else ''}" if row else "gone from squeue"
            if v == "retry":
                retry.append(i)
            elif v == "give_up":
                self.st["given_up"][str(i)] = (f"shard {i}: its task ended without the shard's output "
                                               f"{self._retries(i) + 1} times (last: {last})")
                self._save()
                log.warning("batch %s: %s; giving it up", self.bid, self.st["given_up"][str(i)])
        await self._apply_hold()
        if self.st.get("held"):   # a retry would be a new job: it waits for the release
            return
        base_pending = any(self._attempt(i) == self.st["job"] and s == "PENDING" and not self.subs.awaited(str(i))
                           for i, s in enumerate(states))   # (a retry awaited reads PENDING: not the array's task)
        for i in retry[:retry_slots(states, base_pending, self.st["max_parallel"])]:
            await self._retry(i)

    def _state(self, i: int, now: float) -> str | None:
        row = self.rows.get(i)
        if self.subs.awaited(str(i)) or (row is None and now - self.submitted.get(i, -1e9) < 30):
            return "PENDING"   # just submitted (squeue shows it at the next look), or its sbatch's outcome unknown
        if row is not None and row.state == "COMPLETED" and i not in self.done:
            # exit 0 means the task renamed its whole output: on a shared file system the rename may reach
            # this host a little later, so the shard counts as failed only once settle_s passed without it
            seen = self.completed_at.setdefault((row.job_id, i), now)
            return "COMPLETING" if now - seen < self.settle_s else "COMPLETED"
        return None if row is None else "FAILED" if held_for_good(row.state, row.reason) else row.state   # (held: ended)

    def _observe(self, rows: list[JobInfo]) -> set[str]:
        """Each shard's current task from squeue's rows; the array and the retries an sbatch of unknown outcome
        (a timeout, a crash) made are adopted.  Returns the strays (:func:`~.batchrules.sort_jobs`)."""
        n = len(self.st["counts"])
        base, adopt, strays = sort_jobs(rows, self.st["job"], {int(k): v for k, v in self.st["attempts"].items()}, n)
        if changed := base != self.st["job"]:
            log.info("batch %s: adopting job array %s", self.bid, base)
            self.st["job"] = base
            self.subs.confirmed("array")
        for i, job in sorted(adopt.items()):
            log.info("batch %s: adopting job %s, shard %d's retry", self.bid, job, i)
            self.st["attempts"][str(i)] = job
            self.subs.confirmed(str(i))
        if changed or adopt:
            self._save()
        by = {(m[1], int(m[2])): r for r in rows if (m := TASK_ID.match(r.job_id))}
        self.rows = {i: by.get((self._attempt(i) or "", i)) for i in range(n)}
        self.live = live_jobs(rows)
        return strays

    async def _start(self) -> None:
        """Submit the array (not while an sbatch of it whose outcome is unknown is awaited in squeue)."""
        n = len(self.st["counts"])
        try:
            job = await self.subs.sbatch("array", spec := f"0-{n - 1}%{self.st['max_parallel']}", self.script(spec))
        except SlurmError as e:
            await self._block(f"SLURM refuses the batch's job array: {e}")
        if job is None:
            return
        self.st["job"] = job
        self.submitted.update(dict.fromkeys(range(n), asyncio.get_running_loop().time()))
        self._save()
        log.info("batch %s: submitted job array %s (%d shards, %d at once)", self.bid, job, n, self.st["max_parallel"])
        if self.st.get("held"):   # held before it was submitted: at once (adopted: by the same look's _apply_hold)
            self.st.setdefault("held_jobs", []).append(self.st["job"])   # listed first (releasable after a crash)
            self._save()
            with contextlib.suppress(SlurmError):   # (the next look holds what is still waiting)
                await self.slurm.hold(self.st["job"])

    async def _retry(self, i: int) -> None:
        if self.st.get("held"):   # held while an earlier retry's sbatch ran
            return
        try:   # (counted before sbatch, saved with its record: a crash never gives more)
            job = await self.subs.sbatch(str(i), str(i), self.script(str(i)))
        except SlurmError as e:
            await self._block(f"SLURM refuses shard {i}'s retry: {e}")
        if job is None:   # (counted: given back if it never shows up in squeue)
            return
        self.st["attempts"][str(i)] = job
        self._save()
        self.submitted[i] = asyncio.get_running_loop().time()
        log.info("batch %s: shard %d's task ended without its output; retry %d of %d is job %s_%d", self.bid, i,
                 self._retries(i), self.max_task_retries, job, i)

    async def _block(self, why: str) -> None:
        self.st["blocked"] = why
        self._save()
        await self._cancel_jobs()
        raise ArrayBlocked(why)

    def hold(self, why: str | None) -> None:
        """Hold (``why``: shown in :meth:`progress`, kept across a restart) or release (None) the tasks not
        started (``JobHeldUser``) and the retries; applied by the array's own next look, at once."""
        if self.st.get("held") != why:
            self.st["held"] = why
            self._save()
            log.info("batch %s: %s", self.bid, f"array held: {why}" if why else "array released")
            self.wake.set()

    def release(self) -> None:
        self.hold(None)

    async def _apply_hold(self) -> None:
        """Level-triggered (:func:`~.batchrules.to_hold_or_release`): a job submitted or adopted meanwhile is
        held too, and a release is never undone by a hold racing it.  A SlurmError: the next look again."""
        held, mine = bool(self.st.get("held")), self.st.setdefault("held_jobs", [])
        live = {i: r for i, r in self.rows.items() if i not in self.done and str(i) not in self.st["given_up"]}
        for job in to_hold_or_release(live.values(), held, mine):
            if held and job not in mine:   # listed before it is held: a crash between leaves it releasable
                mine.append(job)
                self._save()
            try:
                await (self.slurm.hold if held else self.slurm.release)(job)
            except SlurmError as e:
                log.warning("batch %s: cannot %s job %s yet: %s", self.bid, "hold" if held else "release", job, e)
                continue
            if not held:   # released: an operator's own hold of it later is theirs
                mine.remove(job)
                self._save()

    async def merge_done(self) -> tuple[int, int]:
        """A blocked array's shards done (and given up) into the batch's files, as a cancel: (completed, failed)."""
        if self.st["merged"] is None and self.st["counts"] is not None:
            self._scan_done()
            await self._merge()
        c, f = self.st["merged"][:2] if self.st["merged"] else (0, 0)
        return c, f

    async def shard_usage(self) -> dict[int, tuple[int, int, int]]:
        """Per shard done so far: (lines answered, prompt tokens, completion tokens), its answers read once."""
        if self.st["counts"] is None:
            return {}
        self._scan_done()
        for i in sorted(self.done - self.usage.keys() - {int(k) for k in self.st["given_up"]}):
            try:
                self.usage[i] = (0, 0, 0) if self.st["counts"][i] == 0 else \
                    await asyncio.to_thread(shard_usage, self._out(i))
            except OSError as e:   # (its files went with a cleanup): not counted
                log.warning("batch %s: cannot read shard %d's answers: %s", self.bid, i, e)
        return dict(self.usage)

    async def cancel(self, expired: bool = False) -> None:
        """Stop the array (scancel); :meth:`run` then merges the shards already done and returns (``expired``:
        the lines of the shards not done get ``batch_expired`` error lines)."""
        self.st.update(cancelled=True, held=None, expired=expired)
        self._save()
        await self._cancel_jobs()
        self.wake.set()

    async def _cancel_jobs(self, rows: list[JobInfo] | None = None) -> None:
        """scancel the array, its retries and every job squeue lists under the batch's name with a task not ended
        (made by an sbatch whose outcome was unknown: a timeout, a crash); given a look's ``rows``, the jobs live
        there, each at most every 10 s (a job whose sbatch was in flight at the cancel shows up later)."""
        if rows is not None:
            return await self.subs.scancel(live_jobs(rows), again_after=10)
        listed: list[JobInfo] = []
        if self.st["counts"] is not None:   # (before the split nothing was submitted)
            with contextlib.suppress(SlurmError):
                listed = await self.slurm.list_array_tasks(self.job_name)
        await self.subs.scancel({self.st["job"], *self.st["attempts"].values(), *live_jobs(listed)} - {None})

    def cleanup(self) -> None:
        """Remove the work folder (the shards, their answers, the logs): once the merged files are handed over."""
        shutil.rmtree(self.work, ignore_errors=True)

    # -- reporting --------------------------------------------------------------------------------------
    def progress(self) -> dict:
        """Per shard: ``state`` (SLURM's state of its current task, or done / failed / cancelled),
        ``reason`` (SLURM's pending reason), ``job`` (``<array job>_<task>``), ``lines`` and ``done``
        (lines answered so far), ``errors`` (of those, the ones answered with an error), ``retries``; and the
        totals."""
        counts, st, shards = self.st["counts"] or [], self.st, []
        for i, n in enumerate(counts):
            row, attempt = self.rows.get(i), self._attempt(i)
            errors: int | None = 0   # lines answered with an error (the merge's failed ones), of done; None:
            if i in self.done:         # a shard done whose answers are not read yet
                state, done = "done", n
                errors = n - min(n, self.usage[i][0]) if i in self.usage else None
            else:
                state = ("failed" if str(i) in st["given_up"] else "cancelled" if st["cancelled"] else
                         row.state if row else "SUBMITTED" if attempt else "UNSUBMITTED")
                active = row is not None and row.state not in ENDED_SLURM and row.state != "PENDING"
                counter = self.counters.setdefault(i, LineCounter(answers=True))
                written = counter.count(self._out(i).with_name(self._out(i).name + ".part")) if active else 0
                done = min(n, max(written, logged_progress(self.work / "logs" / f"shard-{i}.{attempt}.log"))) \
                    if active else 0
                errors = min(done, counter.lines - counter.ok) if active else 0   # (vLLM's log: not known yet)
            shards.append({"shard": i, "state": state, "reason": row.reason if row and row.state == "PENDING" and state != "done" else None,
                           "job": row.job_id if row else f"{attempt}_{i}" if attempt else None, "node": row.nodelist if row else "",
                           "lines": n, "done": done, "errors": errors, "retries": self._retries(i)})
        return {"batch": self.bid, "job_id": st["job"], "job_name": self.job_name, "splitting": st["counts"] is None,
                "shards": shards, "total": sum(counts), "done": sum(s["done"] for s in shards),
                "shards_done": len(self.done), "given_up": len(st["given_up"]), "blocked": st["blocked"], "waiting": self.subs.waiting,
                "held": st.get("held") if st["merged"] is None else None,   # (merged: nothing is left to hold)
                "cancelled": st["cancelled"], "merged": st["merged"] is not None}
