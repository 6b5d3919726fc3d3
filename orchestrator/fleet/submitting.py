"""Replica submissions whose outcome is not known yet, kept across a daemon's restart.

A replica's sbatch is recorded here (its nonce, model, slot, job shape and a deadline) before it runs, and
forgotten once sbatch answers with a job id or with a refusal that made no job.  An sbatch that timed out stays
until squeue shows a job with its nonce (adopted) or until the deadline (``daemon.submit_confirm_s``; then the
slot is submitted again).  Kept in ``<state_dir>/submitting.json`` (written whole), so a daemon killed during
an sbatch, or while it watched for one that timed out, does not submit that replica again when it starts and
squeue does not list the job yet (slurmctld registers a job whose sbatch timed out late, or not at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import types
from collections.abc import AsyncIterator, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..durable import write_whole
from .replica import Placeholder

if TYPE_CHECKING:
    from .discovery import Discovery

log = logging.getLogger("slurmfleet.reconciler")


class Submitting(MutableMapping[str, Placeholder]):
    """nonce -> :class:`Placeholder`, written to ``path`` at each change (None: in memory only), off the event loop
    in ``io``'s thread (the daemon's :class:`~.discovery.Discovery`, whose one thread does the state dir's I/O, in
    order: a state dir on a shared file system may be slow or hang), waited for ``io.timeout_s`` at most (a
    thread of its own and 10 s without ``io``).  ``max_wait_s`` bounds the deadlines read back (a clock that ran
    ahead must not keep a slot from being submitted)."""

    def __init__(self, path: Path | None = None, max_wait_s: float = 120.0, io: "Discovery | None" = None):
        self.path, self.timeout_s = path, io.timeout_s if io is not None else 10.0
        self._items: dict[str, Placeholder] = {}
        self._pool = (io.pool if io is not None else ThreadPoolExecutor(1, thread_name_prefix="submitting")) \
            if path is not None else None
        self._last: asyncio.Future | None = None
        if path is None:
            return
        try:
            doc = json.loads(path.read_text())
            latest = time.time() + max_wait_s
            self._items = {p["nonce"]: Placeholder(str(p["model"]), int(p["slot"]), str(p["config_hash"]),
                                                   str(p["nonce"]), min(float(p["deadline"]), latest))
                           for p in doc["submitting"]}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("unreadable %s (%s): no submission of unknown outcome is watched for", path, exc)
        for p in self._items.values():
            log.warning("sbatch of %s slot %d (nonce %s) had no answer when the daemon stopped: watching squeue "
                        "for its job before submitting the slot again", p.model, p.slot, p.nonce)

    @contextlib.asynccontextmanager
    async def watch(self, p: Placeholder) -> AsyncIterator[types.SimpleNamespace]:
        """Around one sbatch: ``p`` is recorded (and written) before it runs and forgotten after it, unless the
        body sets ``keep`` on what it gets (an sbatch that may have made a job: watched for until the deadline)
        or the daemon stops while it runs (the next daemon watches for its job)."""
        self[p.nonce] = p
        await self.synced()
        w = types.SimpleNamespace(keep=False)
        try:
            yield w
        except asyncio.CancelledError:
            w.keep = True
            raise
        finally:
            if not w.keep:
                self.pop(p.nonce, None)

    async def synced(self) -> None:
        """The last change is written (or ``timeout_s`` passed: logged, and the daemon goes on)."""
        if self._last is not None and not self._last.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._last), self.timeout_s)
            except asyncio.TimeoutError:
                log.warning("writing %s takes over %.0fs: the file system hangs?", self.path, self.timeout_s)

    def __getitem__(self, nonce: str) -> Placeholder:
        return self._items[nonce]

    def __setitem__(self, nonce: str, p: Placeholder) -> None:
        self._items[nonce] = p
        self._save()

    def __delitem__(self, nonce: str) -> None:
        del self._items[nonce]
        self._save()

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def shift(self, step_s: float) -> None:
        """The wall clock stepped: the deadlines move with it (each keeps its length)."""
        if self._items:
            self._items = {k: dataclasses.replace(p, deadline=p.deadline + step_s) for k, p in self._items.items()}
            self._save()

    def _save(self) -> None:
        if self._pool is None:
            return
        data = json.dumps({"submitting": [dataclasses.asdict(p) for p in self._items.values()]}).encode()
        self._last = asyncio.get_running_loop().run_in_executor(self._pool, self._write, data)

    def _write(self, data: bytes) -> None:
        try:
            write_whole(self.path, data)
        except OSError as exc:   # (the submission goes on: a restart just does not know of it)
            log.error("cannot write %s: %s", self.path, exc)
