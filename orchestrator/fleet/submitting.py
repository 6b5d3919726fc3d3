"""Replica submissions whose outcome is not known yet, kept across a daemon's restart.

A replica's sbatch is recorded here (its nonce, model, slot, job shape and a deadline) before it runs, and
forgotten once sbatch answers with a job id or with a refusal that made no job.  An sbatch that timed out stays
until squeue shows a job with its nonce (adopted) or until the deadline (``daemon.submit_confirm_s``; then the
slot is submitted again).  Kept in ``<state_dir>/submitting.json`` (written whole), so a daemon killed during
an sbatch, or while it watched for one that timed out, does not submit that replica again when it starts and
squeue does not list the job yet (slurmctld registers a job whose sbatch timed out late, or not at all).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from ..durable import write_whole
from .replica import Placeholder

log = logging.getLogger("slurmfleet.reconciler")


class Submitting(MutableMapping[str, Placeholder]):
    """nonce -> :class:`Placeholder`, written to ``path`` at each change (None: in memory only)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._items: dict[str, Placeholder] = {}
        if path is None:
            return
        try:
            doc = json.loads(path.read_text())
            self._items = {p["nonce"]: Placeholder(str(p["model"]), int(p["slot"]), str(p["config_hash"]),
                                                   str(p["nonce"]), float(p["deadline"])) for p in doc["submitting"]}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("unreadable %s (%s): no submission of unknown outcome is watched for", path, exc)
        for p in self._items.values():
            log.warning("sbatch of %s slot %d (nonce %s) had no answer when the daemon stopped: watching squeue "
                        "for its job before submitting the slot again", p.model, p.slot, p.nonce)

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
        self._items = {k: dataclasses.replace(p, deadline=p.deadline + step_s) for k, p in self._items.items()}
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"submitting": [dataclasses.asdict(p) for p in self._items.values()]}
        try:
            write_whole(self.path, json.dumps(doc).encode())
        except OSError as exc:   # (the submission goes on: a restart just does not know of it)
            log.error("cannot write %s: %s", self.path, exc)
