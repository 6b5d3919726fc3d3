"""Subscriber to vLLM's KV-cache events (``--kv-events-config``), keeping a :class:`KvIndex` current.

Wire format, as vLLM's ``ZmqEventPublisher`` sends it:
 * PUB, multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter from 0, one per batch;
   ``payload`` msgpack of an array-like ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` (``ts`` from
   time.time() in the engine; the rank may be nil or absent).  Each event is a map tagged by its
   ``"type"`` (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) with fields by name; fields at their
   default are left out.
 * ROUTER (replay): a request ``(empty, start seq as 8 big-endian bytes)`` from a DEALER is answered with
   every batch still buffered whose seq >= start, each ``(empty, topic, seq, payload)``, then the end marker
   ``(empty, b"", seq -1 as 8 signed big-endian bytes, b"")``.  The buffer keeps the newest
   ``buffer_steps`` batches, so a start older than its oldest entry comes back with a later first seq.

One :class:`Feed` per replica, one asyncio task each (no threads); :class:`~.kvfeeds.Feeds` manages the set.

Keeping in sync (``Feed``):
 * on connecting, the feed asks the replay socket for everything from seq 0 (or from where it left off):
   a history complete from seq 0 makes the index exact.  An answer that lost its tail past the ROUTER's
   high-water mark is followed by another from where it stopped, for as long as each one brings more;
 * a live seq beyond the next expected one (a gap), or a first live message after seq 0 with no history,
   is healed from the replay socket while live messages wait in the SUB socket's queue (its high-water
   mark is raised for that); replayed batches already applied are skipped when they arrive live;
 * a live seq at or below the last live one means the publisher restarted (a new engine): the index is
   cleared and synced anew; so does, before any live batch, a seq already replayed in a batch newer (its
   engine time) than every batch applied: not the live copy of a replayed batch, but a new engine's;
 * when the replay cannot fill the gap (no replay socket, no answer, or its buffer no longer holds the
   first missing seq), or a batch cannot be decoded, the index is cleared and marked approximate, and
   applying goes on from the oldest batch that can be had.  It becomes exact again when the engine clears
   its cache (AllBlocksCleared), when a restarted publisher is followed from seq 0, or after ``settle_s`` in
   sync without a ``BlockStored`` whose parent is unknown (such a store extends a block the reset forgot,
   one still cached: a hot prefix that is never evicted keeps the replica approximate, rightly).  Meanwhile
   :meth:`KvIndex.match` also consults the routed-keys fallback;
 * a live connection that answers no heartbeat for ``heartbeat_timeout_s`` (a half-open TCP connection) is
   made again, and what was published meanwhile is a gap like any other;
 * a ``BlockStored`` whose parent is unknown while the index is exact means history was lost without a
   seq gap: the index is rebuilt from a replay from seq 0, at most once per ``settle_s``, if the publisher still
   holds seq 0; else (or rate-limited, or the parent still unknown after it) the index is kept, approximate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from .kvfeedtypes import FeedOptions, FeedStats, FeedTarget
from .kvindex import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, ReplicaIndex

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that closes a replay answer."""
MAX_LAGS = 4096  # live batches' lags kept between two exports (one every half second: vLLM batches every few ms)
REPLAY_SLICE_S = 0.02  # a replay being applied gives the event loop a turn this often (seconds)


# the KV-cache spec kinds (vLLM's KVCacheSpecKind) whose group holds a request's whole prefix, as a prefix hit needs
WHOLE_PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class Groups:
    """Which KV-cache group the index follows.  A hybrid model (sliding window or Mamba layers beside full
    attention) publishes the same hashes for each group, and its sliding-window group frees a prompt's leading
    blocks while the full-attention group still holds them: the index follows the first group whose stores say
    (``kv_cache_spec_kind``) that it caches whole prefixes; group 0 (or none named, an older vLLM) until one does."""

    def __init__(self) -> None:
        self.follow, self.learned = 0, False
        self.changed = False   # the group followed changed: what the index holds is another group's (its reader resets it)

    def see(self, raws: list) -> None:
        """Learn from a batch's events (before they are read)."""
        for raw in raws if not self.learned else ():
            if isinstance(raw, dict) and raw.get("type") == "BlockStored" and \
                    raw.get("kv_cache_spec_kind") in WHOLE_PREFIX_KINDS:
                group, self.learned = raw.get("group_idx") or 0, True
                self.changed, self.follow = group != self.follow, group
                return


def _event(raw: Mapping[str, Any], follow: int) -> KvEvent | None:
    kind = raw.get("type")
    if kind == "AllBlocksCleared":   # (no fields: vLLM's reset of the whole pool, every group's blocks)
        return AllBlocksCleared()
    # another group's copy of the same hashes (see Groups), or an offloading connector's CPU/STORAGE one: the index
    # is of the GPU's cache, the one that makes a prefill cheap, and a copy elsewhere must not outlive its eviction
    if (raw.get("group_idx") or 0) != follow or raw.get("medium") not in (None, "GPU"):
        return None
    if kind == "BlockStored":
        return BlockStored(block_hashes=raw["block_hashes"], parent_block_hash=raw.get("parent_block_hash"),
                           token_ids=raw["token_ids"], block_size=raw["block_size"],
                           lora_name=raw.get("lora_name"), extra_keys=raw.get("extra_keys"))
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=raw["block_hashes"])
    return None  # a kind this gateway doesn't know: newer vLLM


def decode_batch(payload: bytes, groups: Groups | None = None) -> tuple[float, list[KvEvent]]:
    """``(ts, events)`` of one msgpack ``KVEventBatch`` payload, the events of the group ``groups`` follows (it
    learns from them first; group 0 without it); unknown event kinds are left out."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not an array-like KVEventBatch")
    if groups is not None:
        groups.see(batch[1])
    follow = groups.follow if groups is not None else 0
    events = [ev for ev in (_event(raw, follow) for raw in batch[1] if isinstance(raw, dict)) if ev is not None]
    return float(batch[0]), events


class Feed:
    """One replica's event stream applied to its :class:`ReplicaIndex` (see the module doc for the rules)."""

    def __init__(self, job_id: str, target: FeedTarget, index: ReplicaIndex, ctx: zmq.asyncio.Context,
                 options: FeedOptions | None = None, clock: Callable[[], float] = time.time):
        self.job_id = job_id
        self.target = target
        self.index = index
        self.stats = FeedStats()
        self._ctx = ctx
        self._opt = options or FeedOptions()
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._expected: int | None = None  # next seq to apply; None: nothing applied since (re)start
        self._last_live: int | None = None
        self._newest_ts: float | None = None  # the latest engine time of a batch applied (restart detection)
        self._approx_since: float | None = None
        self._last_rebuild: float | None = None
        self._rebuild_wanted = False
        self._whole = False  # every batch from seq 0 on is applied (none lost, none undecodable): exact
        self._refilling = False   # a rebuild refills the cleared index: approximate until it has caught up
        self._groups = Groups()

    def start(self) -> asyncio.Task:
        """Run the feed as a named task on the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kvfeed:{self.job_id}")
        return self._task

    def cancel(self) -> asyncio.Task | None:
        """Ask the task to stop; returns it (to await) or None if it never started."""
        if self._task is not None:
            self._task.cancel()
        return self._task

    async def stop(self, timeout_s: float = 2.0) -> None:
        task = self.cancel()
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)

    # -- the task ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self._opt.backoff_min_s
        while True:
            before = self.stats.batches
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.errors += 1
                log.exception("kv events feed %s (%s) failed; reconnecting", self.job_id, self.target.endpoint)
            if self.stats.batches > before:
                backoff = self._opt.backoff_min_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._opt.backoff_max_s)

    async def _session(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._opt.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.target.topic.encode())
            self._opt.heartbeats(sub)
            self.target.secure(sub)
            sub.connect(self.target.endpoint)
            await self._catch_up()
            while True:
                await self._on_live(await sub.recv_multipart())
        finally:
            sub.close(linger=0)

    async def _catch_up(self) -> None:
        """On (re)connecting: fetch what was published since we left off (from seq 0 the first time)."""
        if not self.target.replay_endpoint:
            return
        fresh = self._expected is None
        status = await self._fill(self._expected or 0, None)
        if fresh and status == "complete" and (self._whole or not self._expected):   # (none lost in the replay)
            self._set_exact()

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.errors += 1
            log.warning("kv events feed %s: malformed message of %d frames", self.job_id, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        if (self._last_live is not None and seq <= self._last_live) or self._restarted_since_catch_up(seq, frames[2]):
            log.info("kv events feed %s: publisher restarted (seq %d after %s)", self.job_id, seq,
                     self._last_live if self._last_live is not None else f"{self._expected} replayed")
            self.stats.restarts += 1
            self.index.clear()
            self.index.approximate = True
            self._expected = None
        self._last_live = seq
        if self._expected is None:
            if seq == 0:
                self.index.clear()
                self._set_exact()  # the whole history is ahead of us
            else:
                self.stats.gaps += 1
                await self._heal(0, seq, from_scratch=True)
        elif seq > self._expected:
            self.stats.gaps += 1
            await self._heal(self._expected, seq)
        if self._expected is None or seq >= self._expected:
            self._apply(seq, frames[2], live=True)
        if self._rebuild_wanted:
            await self._rebuild()

    def _restarted_since_catch_up(self, seq: int, payload: bytes) -> bool:
        """The first live batch after a catch-up has a seq already replayed: a copy of that replayed batch (it
        went out while the replay ran), unless it is newer than every batch applied: a new engine's (a restart
        between the old engine's last batch and this one, its seqs from 0 again)."""
        if self._last_live is not None or self._expected is None or seq >= self._expected \
                or self._newest_ts is None:
            return False
        try:
            ts = decode_batch(payload)[0]
        except Exception:  # noqa: BLE001 -- undecodable: _apply counts it
            return False
        return ts > self._newest_ts

    async def _heal(self, want: int, until: int, from_scratch: bool = False) -> None:
        """Make batches ``want .. until-1`` applied, from the replay socket, or reset so ``until`` applies next."""
        status = await self._fill(want, until) if self.target.replay_endpoint else "none"
        if status == "complete":
            self.stats.replayed += 1
            if from_scratch and self._whole:   # (an undecodable batch in the replay: history lost, approximate)
                self._set_exact()
        elif status == "none":
            if self.target.replay_endpoint:
                self.stats.replay_failures += 1
            self._reset(until)

    async def _rebuild(self) -> None:
        """Re-read the whole history after an unknown parent (at most once per settle_s).  The index is replaced
        only by a history from seq 0; otherwise (or skipped, or the parent still unknown) it is kept, approximate."""
        self._rebuild_wanted = False
        now = self._clock()
        if self.index.approximate:
            return
        if not self.target.replay_endpoint or (
                self._last_rebuild is not None and now - self._last_rebuild < self._opt.settle_s):
            return self._lacking()   # history is known to be missing
        self._last_rebuild = now
        self.stats.rebuilds += 1
        log.info("kv events feed %s: unknown parent block, rebuilding from a replay", self.job_id)
        upto = self._expected
        try:
            status = await self._fill(0, upto, rebuild=True)
        finally:
            self._refilling = False
        self.stats.replay_failures += status in ("late", "none")
        if status == "none":   # cleared, then the history from seq 0 came only in part
            self._reset(upto)
        elif status != "complete" or self._rebuild_wanted or not self._whole:   # seq 0 gone, the parent unknown,
            self._lacking()                                                    # or a batch in it undecodable
        else:
            self._set_exact()
        self._rebuild_wanted = False

    # -- replay ------------------------------------------------------------------------------------------

    async def _fill(self, want: int, until: int | None, rebuild: bool = False) -> str:
        """Apply replayed batches from ``want`` on.  "complete": contiguous through ``until - 1`` (through
        the publisher's newest when ``until`` is None); "reset": the publisher no longer held ``want``, so the
        index was reset and filled from its oldest batch on; "none": no usable answer.  With ``rebuild`` the
        index is cleared first if the answer starts at seq 0, else left alone: "late"."""
        status = "complete"
        stalls, give_up = 0, time.monotonic() + self._opt.replay_max_s
        while stalls < self._opt.replay_attempts and time.monotonic() < give_up:
            reply, ended = await self._request(want)
            self.stats.replays += reply is not None
            if rebuild:
                if not reply or reply[0][0] != 0:
                    return "late"
                rebuild = False
                self.index.clear()   # (refilled batch by batch, with pauses: approximate until it has caught up,
                self.index.approximate, self._approx_since = True, self._clock()   # the routed keys standing in)
                self._refilling = True
            if reply is None:
                return "none"
            start = want
            fresh = [(s, p) for s, p in reply if s >= want]
            if fresh and fresh[0][0] > want:
                self.stats.replay_failures += 1
                self._reset(fresh[0][0])
                want, status = fresh[0][0], "reset"
            hole = False
            lap = time.monotonic()
            for s, payload in fresh:
                if s != want:
                    hole = True  # frames lost past the ROUTER's high-water mark: ask again from here
                    break
                self._apply(s, payload, live=False)
                want = s + 1
                if time.monotonic() - lap > REPLAY_SLICE_S:   # a long replay (vLLM buffers 10,000 batches)
                    await asyncio.sleep(0)                     # must not stall the requests being proxied
                    lap = time.monotonic()
            if until is not None and want >= until:
                return status
            if until is None and ended and not hole:
                if self._expected is None:
                    self._expected = want  # nothing published yet: the next live seq is `want`
                return status
            if not fresh and ended:
                break  # the publisher holds nothing from `want` although later seqs went out: give up
            stalls = 0 if want > start else stalls + 1   # ask on while each answer brings more
        return "none"

    async def _request(self, start: int) -> tuple[list[tuple[int, bytes]] | None, bool]:
        """One replay request: the (seq, payload) answered, None if nothing came; and whether END came."""
        sock = self._ctx.socket(zmq.DEALER)
        got: list[tuple[int, bytes]] = []
        answered = ended = False
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            self.target.secure(sock)
            sock.connect(self.target.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                try:   # (not wait_for: on 3.11 it drops a cancel that meets a frame, and a removed feed lived on)
                    async with asyncio.timeout(self._opt.replay_timeout_s):
                        frames = await sock.recv_multipart()
                except TimeoutError:
                    break
                answered = True
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stats.errors += 1
                    continue
                if frames[2] == END_SEQ:
                    ended = True
                    break
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            sock.close(linger=0)
        if not answered:
            log.warning("kv events feed %s: no replay answer from %s", self.job_id, self.target.replay_endpoint)
            return None, False
        return got, ended

    # -- applying ----------------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        self._whole = seq == 0 or (self._whole and seq == self._expected)
        self._expected = seq + 1
        self.stats.last_seq = seq
        try:
            ts, events = decode_batch(payload, self._groups)
        except Exception as exc:  # noqa: BLE001 -- a batch lost (its removals too): as a gap no replay can fill
            self.stats.errors += 1
            log.warning("kv events feed %s: undecodable batch %d: %s", self.job_id, seq, exc)
            return self._reset(seq + 1)
        if self._groups.changed:   # a hybrid model's full-attention group, learned: group 0's blocks were another's
            self._groups.changed = False
            if len(self.index):
                self.index.clear()
                self._lacking()
        now = self._clock()
        if live:
            self.stats.lag_s = now - ts
            if len(self.stats.lags) < MAX_LAGS:   # (each observed at the next export; past this many, the rest not)
                self.stats.lags.append(now - ts)
        if self._newest_ts is None or ts > self._newest_ts:
            self._newest_ts = ts
        index = self.index
        for ev in events:
            if not index.apply(ev):
                self.stats.unknown_parents += 1
                if not index.approximate or self._refilling:   # (a rebuild that meets one ends approximate)
                    self._rebuild_wanted = True
                elif self._approx_since is not None:
                    self._approx_since = now  # still missing blocks the engine holds: not settled yet
            elif isinstance(ev, AllBlocksCleared) and not self._refilling:
                self._set_exact()  # nothing cached that we don't know of
        self.stats.batches += 1
        self.stats.events_applied += len(events)
        if index.approximate and not self._refilling and (self._whole or (  # all history, from however many replays
                self._approx_since is not None and now - self._approx_since >= self._opt.settle_s)):
            self._set_exact()

    def _reset(self, next_seq: int) -> None:
        """Give up on the history before ``next_seq``: clear, approximate, and apply from ``next_seq`` on."""
        self.stats.resets += 1
        self._whole = False
        self.index.clear()
        self.index.approximate = True
        self._approx_since = self._clock()
        self._expected = next_seq

    def _lacking(self) -> None:
        """The index lacks blocks the engine holds (kept as it is): approximate, and not whole, until it settles."""
        self._whole = False
        if not self.index.approximate:
            self.index.approximate = True
            self._approx_since = self._clock()

    def _set_exact(self) -> None:
        self.index.approximate = False
        self._approx_since = None
