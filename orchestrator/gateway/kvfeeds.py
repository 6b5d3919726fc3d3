"""The KV-cache event feeds of a gateway process's replicas (:class:`~.kvevents.Feed`, one per replica),
kept to the set of READY replicas the routing table lists, all writing into one :class:`KvIndex`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import zmq.asyncio

from .kvevents import Feed, FeedOptions, FeedStats, FeedTarget
from .kvindex import KvIndex

log = logging.getLogger(__name__)


class Feeds:
    """The feeds of a gateway's replicas, kept to the set given to :meth:`sync`, writing into one KvIndex."""

    def __init__(self, index: KvIndex, options: FeedOptions | None = None,
                 clock: Callable[[], float] = time.time):
        self.index = index
        self._opt = options or FeedOptions()
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._feeds: dict[str, Feed] = {}
        self._stopping: set[asyncio.Task] = set()

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._feeds

    def sync(self, replicas: Mapping[str, FeedTarget | tuple]) -> None:
        """Feed exactly ``replicas`` (job id -> (endpoint, replay_endpoint, topic)); call on the event loop.
        Feeds of replicas no longer listed (or whose endpoints changed) stop, and their indexes are dropped."""
        wanted = {job: t if isinstance(t, FeedTarget) else FeedTarget(*t) for job, t in replicas.items()}
        for job in list(self._feeds):
            if wanted.get(job) != self._feeds[job].target:
                self._remove(job)
        for job, target in wanted.items():
            if job not in self._feeds:
                feed = Feed(job, target, self.index.replica(job), self._ctx, self._opt, self._clock)
                self._feeds[job] = feed
                feed.start()

    def _remove(self, job: str) -> None:
        task = self._feeds.pop(job).cancel()
        self.index.drop(job)
        if task is not None and not task.done():
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def stats(self) -> dict[str, FeedStats]:
        return {job: feed.stats for job, feed in self._feeds.items()}

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop every feed (waiting at most ``timeout_s``) and close the ZMQ context."""
        for job in list(self._feeds):
            self._remove(job)
        pending = set(self._stopping)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout_s)
            if late:
                log.warning("kv events: %d feed(s) did not stop within %.1fs", len(late), timeout_s)
        self._ctx.destroy(linger=0)
