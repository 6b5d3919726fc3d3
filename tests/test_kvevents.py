"""The KV-events subscriber against real ZMQ sockets: a small publisher written here to vLLM's protocol, and
(when .venv-vllm exists) vLLM's own ZmqEventPublisher in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from orchestrator.gateway.kvevents import END_SEQ, Feed, FeedOptions, FeedTarget, decode_batch
from orchestrator.gateway.kvfeeds import Feeds
from orchestrator.gateway.kvindex import AllBlocksCleared, BlockRemoved, BlockStored, KvIndex, ReplicaIndex, block_keys

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
TOKENS = list(range(2000, 2160))  # 10 blocks of 16
KEYS = block_keys(TOKENS, 16)
DEADLINE_S = 60.0


def stored(hashes, parent, first_block, bs=16):
    """A BlockStored as vLLM's msgspec encoder writes it: a map tagged by "type", fields by name."""
    start = first_block * bs
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": TOKENS[start:start + len(hashes) * bs], "block_size": bs, "lora_id": None,
            "medium": "GPU", "lora_name": None, "group_idx": 0}


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def h(i: int) -> bytes:
    return b"%032d" % i  # stands in for a 32-byte sha256


async def until(cond, what: str, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class TinyPublisher:
    """vLLM's publisher protocol in a few lines: PUB (topic, 8-byte seq, msgpack [ts, events, rank]) and a
    ROUTER that answers (empty, start seq) with the buffered batches from there and an END_SEQ marker.
    ``publish(..., send=False)`` buffers a batch without sending it: a message lost on the wire."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer_steps: int = 1000, topic: str = ""):
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)   # (a PUB that also tells when a subscriber is in: see caught_up)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.target = FeedTarget(self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                                 self.router.getsockopt_string(zmq.LAST_ENDPOINT), topic)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replay_starts: list[int] = []
        self.replay_limit: int | None = None   # frames per replay answer, END lost too (past the ROUTER's HWM)
        self.replay_answers: int | None = None   # replay requests answered from now on, the later ones ignored
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, events, send: bool = True, ts: float | None = None) -> int:
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time() if ts is None else ts, events, 0])
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """A new engine on the same endpoints: its seqs start again at 0, its buffer is empty."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_starts.append(first)
            if self.replay_answers is not None:
                if self.replay_answers <= 0:
                    continue
                self.replay_answers -= 1
            answer = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            for seq, payload in answer[:self.replay_limit]:
                await self.router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            if self.replay_limit is None or len(answer) <= self.replay_limit:
                await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@contextlib.asynccontextmanager
async def settling_feed(ctx, **publisher):
    """job-a's feed subscribed to a TinyPublisher, on a fake clock (``now[0]``) that settles an approximate index
    after 60 s: (now, pub, kv, feeds, job-a's index)."""
    now = [1000.0]
    pub = TinyPublisher(ctx, **publisher)
    kv = KvIndex(16)
    feeds = Feeds(kv, FeedOptions(settle_s=60.0), clock=lambda: now[0])
    try:
        feeds.sync({"job-a": pub.target})
        await subscribed(pub, feeds, "job-a")
        yield now, pub, kv, feeds, kv.replica("job-a")
    finally:
        await feeds.close()
        await pub.close()


async def subscribed(pub: TinyPublisher, feeds: Feeds, job: str) -> None:
    """Publish empty batches until the feed receives one: its subscription is live, nothing more is lost."""
    before = feeds.stats()[job].batches
    end = time.monotonic() + DEADLINE_S
    while feeds.stats()[job].batches == before:
        assert time.monotonic() < end, "the feed never received a live batch"
        await pub.publish([])
        await asyncio.sleep(0.05)

@contextlib.asynccontextmanager
async def one_feed(pub, target=None):
    """A feed of ``job-a`` on ``pub`` (or ``target``), subscribed: (index, feeds, job-a's replica index);
    closes both at the end."""
    kv = KvIndex(16)
    feeds = Feeds(kv)
    try:
        feeds.sync({"job-a": target or pub.target})
        await subscribed(pub, feeds, "job-a")
        yield kv, feeds, kv.replica("job-a")
    finally:
        await feeds.close()
        await pub.close()



@contextlib.asynccontextmanager
async def caught_up(pub, blocks: int):
    """A feed of ``job-a`` that has its ``blocks`` from the replay alone (no live batch seen yet; its SUB socket
    connected): (index, feeds, job-a's replica index); closes both at the end."""
    kv = KvIndex(16)
    feeds = Feeds(kv)
    try:
        feeds.sync({"job-a": pub.target})
        idx = kv.replica("job-a")
        await until(lambda: len(idx) == blocks and not idx.approximate, "the catch-up")
        await asyncio.wait_for(pub.pub.recv(), DEADLINE_S)   # the SUB socket's subscription is in: live from now
        yield kv, feeds, idx
    finally:
        await feeds.close()
        await pub.close()


async def test_feed_follows_the_stream_and_heals_a_dropped_message(ctx):
    pub = TinyPublisher(ctx)
    await pub.publish([stored([h(0), h(1)], None, 0)])  # before anyone listens: from the replay only
    async with one_feed(pub) as (kv, feeds, idx):
        assert not idx.approximate and kv.match(KEYS)["job-a"] == 2
        assert pub.replay_starts[0] == 0
        await pub.publish([stored([h(2), h(3)], h(1), 2)])
        await until(lambda: kv.match(KEYS)["job-a"] == 4, "the live batch")
        lost = await pub.publish([stored([h(4)], h(3), 4)], send=False)  # lost on the wire
        await pub.publish([stored([h(5)], h(4), 5), removed([h(0)])])  # the seq jump gives it away
        await until(lambda: len(idx) == 5, "the gap healed")
        stats = feeds.stats()["job-a"]
        assert stats.gaps == 1 and lost in pub.replay_starts and stats.resets == 0
        assert kv.match(KEYS)["job-a"] == 0  # block 0 evicted: no prefix any more
        assert KEYS[5] in idx and not idx.approximate
        assert stats.last_seq == pub.seq - 1 and stats.events_applied >= 5
        assert stats.lag_s is not None and -5 < stats.lag_s < 30


async def test_gap_beyond_the_replay_buffer_resets_to_approximate(ctx):
    async with settling_feed(ctx, buffer_steps=2) as (now, pub, kv, feeds, idx):
        await pub.publish([stored([h(0), h(1)], None, 0)])
        await until(lambda: len(idx) == 2, "the first blocks")
        kv.record("job-a", KEYS[:3])  # what the gateway routed there
        for i in range(3):  # three lost; the buffer keeps two: the first missing one is gone
            await pub.publish([stored([h(9000 + i)], None, 0)], send=False)
        await pub.publish([stored([h(2)], h(1), 2)])  # unknown parent after the reset: skipped, no alarm
        await until(lambda: feeds.stats()["job-a"].resets == 1, "the reset")
        stats = feeds.stats()["job-a"]
        assert stats.gaps == 1 and stats.replay_failures == 1 and stats.rebuilds == 0
        # cleared, then filled from the oldest batch still buffered (the last lost one: h(9002), block 0)
        assert idx.approximate and len(idx) == 1 and idx.engine_blocks == 1
        assert kv.match(KEYS)["job-a"] == 3  # the routed keys stand in
        now[0] += 61.0
        await pub.publish([stored([h(3)], h(2), 3)])  # extends a block it doesn't know: not settled yet
        await until(lambda: feeds.stats()["job-a"].unknown_parents == 2, "the second unknown parent")
        assert idx.approximate
        now[0] += 61.0  # in sync for settle_s, nothing unknown extended: exact again
        await pub.publish([removed([h(9001)])])
        await until(lambda: not idx.approximate, "exact again after settle_s")
        assert kv.match(KEYS)["job-a"] == 1  # events only


async def test_an_undecodable_batch_is_history_lost(ctx):
    """A batch that cannot be decoded may have held removals: the index is reset from the next seq (cleared,
    approximate), as after a gap no replay fills.  It used to be kept (approximate) and, after settle_s, exact
    again with the evicted blocks counted as hits."""
    async with settling_feed(ctx) as (now, pub, kv, feeds, idx):
        await pub.publish([stored([h(0), h(1)], None, 0)])
        await until(lambda: len(idx) == 2, "the store")
        await pub.publish([removed([h(0), h(1)]), {"type": "BlockStored", "block_hashes": [h(9)]}])   # malformed
        await until(lambda: feeds.stats()["job-a"].errors == 1, "the undecodable batch")
        assert idx.approximate and len(idx) == 0 and feeds.stats()["job-a"].resets == 1
        now[0] += 61.0
        last = await pub.publish([stored([h(50)], None, 5)])
        await until(lambda: feeds.stats()["job-a"].last_seq == last, "a later batch")
        assert not idx.approximate and kv.match(KEYS)["job-a"] == 0 and len(idx) == 1


async def test_an_undecodable_batch_in_a_replay_leaves_the_index_approximate(ctx):
    """The replay from seq 0 went on after an undecodable batch reset the index and said "complete", and the
    catch-up marked the cleared index exact."""
    pub = TinyPublisher(ctx)
    await pub.publish([stored([h(0), h(1)], None, 0)])   # the history before the gateway came: seq 0, 1, 2
    await pub.publish([removed([h(0)]), {"type": "BlockStored", "block_hashes": [h(9)]}])   # malformed
    last = await pub.publish([stored([h(50)], None, 5)])
    kv = KvIndex(16)
    feeds = Feeds(kv, FeedOptions(settle_s=60.0))
    try:
        feeds.sync({"job-a": pub.target})
        await until(lambda: feeds.stats().get("job-a") and feeds.stats()["job-a"].last_seq == last, "the replay")
        idx = kv.replica("job-a")
        assert feeds.stats()["job-a"].resets == 1 and idx.approximate and len(idx) == 1
    finally:
        await feeds.close()
        await pub.close()


async def test_a_gap_is_counted_replayed_where_its_replay_completes(ctx):
    """The feed counts replayed gaps itself: the metric took gaps - resets, so a reset that was no gap (here the
    first catch-up against a buffer that lost seq 0) hid a replayed gap."""
    pub = TinyPublisher(ctx, buffer_steps=5)
    for i in range(20):   # history before the gateway came, the buffer keeps the last 5
        await pub.publish([stored([h(i)], None, 0)], send=False)
    async with one_feed(pub) as (kv, feeds, idx):
        gaps, blocks = feeds.stats()["job-a"].gaps, idx.engine_blocks
        await pub.publish([stored([h(100)], None, 0)], send=False)   # lost on the wire, healed from the buffer
        await pub.publish([stored([h(101)], None, 0)])
        await until(lambda: feeds.stats()["job-a"].gaps == gaps + 1 and idx.engine_blocks == blocks + 2,
                    "the gap replayed")
        stats = feeds.stats()["job-a"]
        assert stats.resets == 1 and stats.replay_failures == 1 and stats.replayed == stats.gaps >= 1


async def test_a_history_replayed_in_parts_makes_the_index_exact_once_it_is_whole(ctx):
    """Replay answers that lose their tail (and END) past the ROUTER's high-water mark, and a replay socket that
    stops answering: the first catch-up gives up part way, the index approximate; the heal at the next live
    batch brings the rest, and an index with every batch from seq 0 on applied is exact, without waiting
    settle_s (it used to stay approximate for good)."""
    pub = TinyPublisher(ctx)
    pub.replay_limit = 20
    pub.replay_answers = 3   # then silence: the catch-up ends with 60 of the 150
    for i in range(150):   # published before the gateway subscribed: only a replay has them
        await pub.publish([stored([h(i)], None, 0)] if i == 0 else [], send=False)
    kv = KvIndex(16)
    feeds = Feeds(kv, FeedOptions(replay_timeout_s=0.2, settle_s=3600.0))
    try:
        feeds.sync({"job-a": pub.target})
        idx = kv.replica("job-a")
        await until(lambda: len(pub.replay_starts) == 4, "the catch-up's unanswered request")
        pub.replay_answers = None
        await subscribed(pub, feeds, "job-a")
        await until(lambda: feeds.stats()["job-a"].last_seq >= 150, "the live batch after the history")
        stats = feeds.stats()["job-a"]
        assert stats.resets == 0 and stats.gaps >= 1 and len(pub.replay_starts) >= 6   # in parts, nothing lost
        assert not idx.approximate and len(idx) == 1
    finally:
        await feeds.close()
        await pub.close()


async def test_a_catch_up_asks_again_for_as_long_as_each_answer_advances(ctx):
    """A history that takes more replay answers than ``replay_attempts`` (each loses its tail and END past the
    ROUTER's high-water mark, but each brings more) is fetched whole at the catch-up: the index is exact before
    any live batch, with no reset (it used to give up after ``replay_attempts`` answers)."""
    pub = TinyPublisher(ctx)
    pub.replay_limit = 20
    for i in range(150):   # 8 answers' worth, published before the gateway subscribed
        await pub.publish([stored([h(i)], None, 0)] if i == 0 else [], send=False)
    kv = KvIndex(16)
    # (each answer, cut at the high-water mark, ends by its timeout: 0.5 s leaves room for a stalled loop)
    feeds = Feeds(kv, FeedOptions(replay_timeout_s=0.5, replay_attempts=2, settle_s=3600.0))
    try:
        feeds.sync({"job-a": pub.target})
        idx = kv.replica("job-a")
        await until(lambda: feeds.stats()["job-a"].last_seq == 149, "the whole history", deadline_s=20.0)
        await until(lambda: not idx.approximate, "exact from the catch-up alone", deadline_s=5.0)
        stats = feeds.stats()["job-a"]
        assert stats.resets == 0 and stats.gaps == 0 and stats.replay_failures == 0 and stats.replays >= 8
        assert pub.replay_starts[:8] == [0, 20, 40, 60, 80, 100, 120, 140] and len(idx) == 1
    finally:
        await feeds.close()
        await pub.close()


async def test_a_long_replay_leaves_the_event_loop_free(ctx):
    """Thousands of buffered batches applied at a (re)connect: other tasks (the requests being proxied) keep
    running; the longest stall of the loop stays a slice, not the whole replay."""
    pub = TinyPublisher(ctx, buffer_steps=10_000)   # vLLM's own buffer
    bs = 16
    for i in range(6000):
        hashes = [h(i * 32 + k) for k in range(32)]
        toks = [(i * 32 + k) % 50_000 for k in range(32 * bs)]
        await pub.publish([{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                            "token_ids": toks, "block_size": bs, "lora_id": None, "medium": "GPU"}], send=False)
    kv = KvIndex(16)
    feeds = Feeds(kv)
    gaps, stop = [], asyncio.Event()

    async def ticker():
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    try:
        t0 = time.monotonic()
        feeds.sync({"job-a": pub.target})
        await until(lambda: feeds.stats()["job-a"].batches >= 6000, "the replay applied")
        took = time.monotonic() - t0
        stop.set()
        await t
        # the replay took a while (the loop was busy with it), but no single stall was more than a part of it
        # (0.5 s at least: a loaded machine deschedules the process that long now and then)
        assert max(gaps) < max(0.5, took / 4), (max(gaps), took)
    finally:
        stop.set()
        await feeds.close()
        await pub.close()


async def test_publisher_restart_and_all_blocks_cleared(ctx):
    pub = TinyPublisher(ctx)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([stored([h(0), h(1), h(2)], None, 0)])
        await until(lambda: len(idx) == 3, "blocks")
        idx.approximate = True  # pretend it had lost track: a clear makes it exact again
        await pub.publish([{"type": "AllBlocksCleared"}])
        await until(lambda: len(idx) == 0 and not idx.approximate, "the clear")
        await pub.publish([stored([h(0)], None, 0)])
        await until(lambda: len(idx) == 1, "blocks after the clear")
        pub.restart()  # seq back to 0: a new engine, an empty cache
        await pub.publish([stored([h(7), h(8)], None, 0)])
        await until(lambda: feeds.stats()["job-a"].restarts == 1 and len(idx) == 2, "the restart")
        assert not idx.approximate and kv.match(KEYS)["job-a"] == 2


async def test_a_restart_before_any_live_batch_is_seen_is_a_restart(ctx):
    """The gateway caught up from the replay (no live batch yet) and then the engine restarted on the same
    endpoints: its seqs 0, 1, ... are below the next expected one, but newer than every batch applied, so they
    are a new engine's (not live copies of replayed batches): the index is rebuilt, not left with the old
    engine's blocks."""
    pub = TinyPublisher(ctx)
    await pub.publish([stored([h(0), h(1), h(2)], None, 0)], send=False)   # the old engine, before we subscribed
    for _ in range(30):
        await pub.publish([removed([h(999)])], send=False)
    async with caught_up(pub, 3) as (kv, feeds, idx):
        pub.restart()   # a new engine: seq 0 again, an empty cache
        await pub.publish([stored([h(50)], None, 0)])
        await pub.publish([removed([h(999)])])
        await until(lambda: feeds.stats()["job-a"].restarts == 1, "the restart")
        await until(lambda: feeds.stats()["job-a"].last_seq == 1, "the new engine's batches")
        assert kv.match(KEYS)["job-a"] == 1 and not idx.approximate and idx.engine_blocks == 1


async def test_a_live_copy_of_a_replayed_batch_is_not_a_restart(ctx):
    """A batch published while the catch-up's replay ran arrives live too, with a seq already applied: it is
    skipped, and the index goes on (no restart, nothing cleared)."""
    pub = TinyPublisher(ctx)
    await pub.publish([stored([h(0), h(1)], None, 0)], send=False)
    last = await pub.publish([removed([h(999)])], send=False)
    async with caught_up(pub, 2) as (kv, feeds, idx):
        seq, payload = pub.buffer[-1]
        assert seq == last
        await pub.pub.send_multipart([pub.topic, seq.to_bytes(8, "big"), payload])   # the live copy
        await pub.publish([stored([h(2)], h(1), 2)])
        await until(lambda: feeds.stats()["job-a"].last_seq == last + 1, "the next batch")
        stats = feeds.stats()["job-a"]
        assert stats.restarts == 0 and stats.gaps == 0 and kv.match(KEYS)["job-a"] == 3 and not idx.approximate


async def test_unknown_parent_while_exact_rebuilds_from_replay(ctx):
    pub = TinyPublisher(ctx)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([stored([h(0), h(1)], None, 0)])
        await pub.publish([stored([h(3)], h(2), 3)])  # h(2) never announced: history lost without a seq gap
        await until(lambda: feeds.stats()["job-a"].rebuilds == 1, "the rebuild")
        await pub.publish([stored([h(4)], h(1), 2)])
        await until(lambda: len(idx) == 3, "blocks after the rebuild")
        stats = feeds.stats()["job-a"]
        assert stats.unknown_parents >= 2 and stats.rebuilds == 1  # once per settle_s, not per event
        # the whole history never announced h(2) either: the engine holds a block the index lacks
        assert idx.approximate and kv.match(KEYS)["job-a"] == 3


async def test_a_partial_block_store_asks_for_no_rebuild(ctx):
    """A 16-token store after the engine's 64-token blocks is a prompt's partial last block (vLLM's
    cache_partial_block), its parent a 16-token boundary's hash no store named: not history lost."""
    pub = TinyPublisher(ctx)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([stored([h(0)], None, 0, bs=64)])
        last = await pub.publish([stored([h(9)], h(8), 5)])   # tokens 80..95, after the fine hash at 80
        await until(lambda: feeds.stats()["job-a"].last_seq == last, "the partial store")
        stats = feeds.stats()["job-a"]
        assert stats.unknown_parents == 0 and stats.rebuilds == 0 and not idx.approximate
        assert kv.match(KEYS)["job-a"] == 4 and idx.engine_block_size == 64


async def send_without_events(pub: TinyPublisher, events) -> None:
    """A batch buffered for replay whose live copy lost its events: history lost without a seq gap."""
    seq = await pub.publish(events, send=False)
    await pub.pub.send_multipart([pub.topic, seq.to_bytes(8, "big"), msgpack.packb([time.time(), [], 0])])


async def test_a_rebuild_from_seq_0_makes_the_index_exact_and_one_within_settle_s_leaves_it_approximate(ctx,
                                                                                                     monkeypatch):
    """An unknown parent while exact: the replay from seq 0 brings the block missed, exact again.  A second one
    within settle_s is not rebuilt: the index, known to lack a block, is approximate (it used to stay exact).
    While the replay refills the cleared index (in slices, with pauses, a round trip per hole), it is approximate:
    it was taken for exact, and a replica that held a hot prefix scored nothing meanwhile."""
    from orchestrator.gateway.kvevents import Feed
    seen: list[bool] = []
    apply = Feed._apply

    def replaying(self, seq, payload, live):
        if not live:
            seen.append(self.index.approximate)
        return apply(self, seq, payload, live)
    monkeypatch.setattr(Feed, "_apply", replaying)
    pub = TinyPublisher(ctx)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([stored([h(0), h(1)], None, 0)])
        await send_without_events(pub, [stored([h(2)], h(1), 2)])
        await pub.publish([stored([h(3)], h(2), 3)])
        await until(lambda: feeds.stats()["job-a"].rebuilds == 1 and len(idx) == 4, "the rebuild")
        assert not idx.approximate and feeds.stats()["job-a"].resets == 0
        assert len(seen) >= 3 and all(seen[-3:]), seen   # the rebuild's 3 batches: each applied while approximate
        await send_without_events(pub, [stored([h(4)], h(3), 4)])
        last = await pub.publish([stored([h(5)], h(4), 5)])
        await until(lambda: feeds.stats()["job-a"].last_seq == last, "the second unknown parent")
        stats = feeds.stats()["job-a"]
        assert stats.rebuilds == 1 and stats.unknown_parents == 2 and idx.approximate and kv.match(KEYS)["job-a"] == 4


async def test_a_rebuild_the_replay_buffer_cannot_serve_from_seq_0_keeps_the_index(ctx):
    """The engine published more than its replay buffer holds: a rebuild cannot have seq 0, so the index is kept
    (approximate), not cleared: it used to be wiped, losing a hot prefix vLLM never announces again, and each
    later unknown parent wiped it again."""
    pub = TinyPublisher(ctx, buffer_steps=20)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([stored([h(0), h(1), h(2), h(3)], None, 0)])   # a hot prefix, cached for good
        await until(lambda: len(idx) == 4, "the store")
        for _ in range(30):   # the engine goes on: its replay buffer forgets seq 0
            await pub.publish([])
        await pub.publish([stored([h(77)], h(66), 8)])   # extends a block the feed never saw
        await until(lambda: feeds.stats()["job-a"].rebuilds == 1 and idx.approximate, "the rebuild")
        last = await pub.publish([stored([h(78)], h(67), 8)])
        await until(lambda: feeds.stats()["job-a"].last_seq == last, "the next unknown parent")
        stats = feeds.stats()["job-a"]
        assert kv.match(KEYS)["job-a"] == 4 and idx.approximate and len(idx) == 4
        assert stats.resets == 0 and stats.rebuilds == 1 and stats.replay_failures == 1


async def test_without_replay_socket_a_late_start_is_approximate(ctx):
    pub = TinyPublisher(ctx)
    await pub.publish([stored([h(0)], None, 0)])  # missed, and nothing can replay it
    async with one_feed(pub, (pub.target.endpoint, None, "")) as (kv, feeds, idx):
        stats = feeds.stats()["job-a"]
        assert idx.approximate and stats.resets == 1 and stats.replays == 0 and pub.replay_starts == []


async def test_topic_filter_and_sync_drops_removed_replicas(ctx):
    a, b = TinyPublisher(ctx, topic="kv@a"), TinyPublisher(ctx, topic="kv@b")
    kv = KvIndex(16)
    feeds = Feeds(kv)
    try:
        feeds.sync({"job-a": a.target, "job-b": b.target})
        await subscribed(a, feeds, "job-a")
        await subscribed(b, feeds, "job-b")
        await a.publish([stored([h(0), h(1)], None, 0)])
        await b.publish([stored([h(0)], None, 0)])
        await until(lambda: kv.match(KEYS) == {"job-a": 2, "job-b": 1}, "both replicas")
        tasks = {t.get_name() for t in asyncio.all_tasks()}
        assert {"kvfeed:job-a", "kvfeed:job-b"} <= tasks
        feeds.sync({"job-a": a.target})
        assert "job-b" not in feeds and "job-b" not in kv.job_ids()
        assert kv.match(KEYS) == {"job-a": 2}
        await until(lambda: "kvfeed:job-b" not in {t.get_name() for t in asyncio.all_tasks()}, "job-b's task ends")
        moved = FeedTarget(b.target.endpoint, b.target.replay_endpoint, "kv@b")
        feeds.sync({"job-a": moved})  # job-a now elsewhere: a fresh feed and index
        await until(lambda: kv.replica("job-a").approximate is False and kv.match(KEYS)["job-a"] == 1,
                    "job-a re-fed from the other publisher")
    finally:
        t0 = time.monotonic()
        await feeds.close(timeout_s=2.0)
        assert time.monotonic() - t0 < 5.0
        await a.close()
        await b.close()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kvfeed:")]


class FreezingProxy:
    """A TCP proxy on loopback whose ``freeze()`` makes every connection it carries a half-open one: the bytes
    are read and dropped, nothing is closed (a node whose network went away).  Later connections carry again."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.port = int(port)
        self.frozen: set[int] = set()
        self.generation = self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def freeze(self) -> None:
        self.frozen.add(self.generation)
        self.generation += 1

    async def _carry(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        gen = self.generation
        self.connections += 1
        up_r, up_w = await asyncio.open_connection(self.host, self.port)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                if gen not in self.frozen:
                    w.write(data)
                    await w.drain()
        with contextlib.suppress(Exception):
            await asyncio.gather(pump(client_r, up_w), pump(up_r, client_w))
        for w in (client_w, up_w):
            w.close()

    async def close(self) -> None:
        self.server.close()


async def test_a_half_open_connection_is_found_by_heartbeats_and_made_again(ctx):
    """The subscription's TCP connection goes silent without closing: the heartbeats drop it, libzmq connects
    again, and what was published meanwhile is replayed as a gap.  (Without heartbeats the feed would wait on
    the dead connection for ever, its index stale.)"""
    pub = TinyPublisher(ctx)
    proxy = FreezingProxy(pub.target.endpoint)
    through = FeedTarget(await proxy.start(), pub.target.replay_endpoint, "")
    kv = KvIndex(16)
    feeds = Feeds(kv, FeedOptions(heartbeat_ivl_s=0.2, heartbeat_timeout_s=1.0))
    try:
        feeds.sync({"job-a": through})
        await subscribed(pub, feeds, "job-a")
        idx = kv.replica("job-a")
        assert proxy.connections == 1 and not idx.approximate
        proxy.freeze()
        await pub.publish([stored([h(0), h(1)], None, 0)])   # into the dead connection
        end = time.monotonic() + DEADLINE_S
        while kv.match(KEYS)["job-a"] != 2:   # live batches go out until one arrives over a new connection
            assert time.monotonic() < end, (proxy.connections, feeds.stats()["job-a"])
            await pub.publish([])
            await asyncio.sleep(0.1)
        stats = feeds.stats()["job-a"]
        assert proxy.connections >= 2 and stats.gaps >= 1 and stats.resets == 0 and not idx.approximate
    finally:
        await feeds.close()
        await proxy.close()
        await pub.close()


def test_decode_batch_shapes():
    ts, events = decode_batch(msgpack.packb([1.5, [stored([h(0)], None, 0), removed([7]), {"type": "AllBlocksCleared"},
                                                   {"type": "SomethingNew", "x": 1}]]))
    assert ts == 1.5 and [type(e) for e in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert events[0].block_hashes == [h(0)] and events[0].token_ids == TOKENS[:16] and events[1].block_hashes == [7]
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb({"ts": 1.0}))
    # a hybrid model's second KV-cache group publishes the same hashes: only the first group's events count
    _, events = decode_batch(msgpack.packb([2.0, [{**stored([h(0)], None, 0), "group_idx": 1},
                                                  {**removed([h(0)]), "group_idx": 1}, {**removed([h(1)]), "group_idx": 0}]]))
    assert [(type(e), e.block_hashes) for e in events] == [(BlockRemoved, [h(1)])]


# -- vLLM's own publisher --------------------------------------------------------------------------------

VLLM_PUBLISHER = r'''
import json, os, sys, time
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

class DropOne:
    """Wraps the PUB socket to lose the next message on the wire (it stays in the replay buffer)."""
    def __init__(self, sock):
        self.sock, self.drop = sock, 0
    def send_multipart(self, frames, *a, **kw):
        if self.drop:
            self.drop -= 1
            return None
        return self.sock.send_multipart(frames, *a, **kw)
    def close(self, *a, **kw):
        return self.sock.close(*a, **kw)

pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
cfg = pub.get_publisher_config()
wrapped = pub._pub = DropOne(pub._pub)
print(json.dumps({"endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint}), flush=True)

def event(e):
    if e["type"] == "BlockStored":
        return BlockStored(block_hashes=[bytes.fromhex(x) for x in e["hashes"]],
                           parent_block_hash=bytes.fromhex(e["parent"]) if e["parent"] else None,
                           token_ids=e["tokens"], block_size=e["bs"], lora_id=None, medium="GPU",
                           lora_name=None, group_idx=0)
    if e["type"] == "BlockRemoved":
        return BlockRemoved(block_hashes=[bytes.fromhex(x) for x in e["hashes"]], medium="GPU")
    return AllBlocksCleared()

for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("drop"):
        wrapped.drop += 1
    pub.publish(KVEventBatch(ts=time.time(), events=[event(e) for e in cmd["events"]]))
pub.shutdown()
'''


class VllmPublisher:
    """vLLM's ZmqEventPublisher in a .venv-vllm subprocess, fed batches over stdin."""

    def __init__(self, script: Path):
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_LOGGING_LEVEL="WARNING")
        self.script, self.env = script, env

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            str(VLLM_PY), str(self.script), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=self.env)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 180)
        ends = json.loads(line)
        self.target = FeedTarget(ends["endpoint"], ends["replay_endpoint"], "kv")
        return self

    async def publish(self, events, drop: bool = False) -> None:
        self.proc.stdin.write((json.dumps({"events": events, "drop": drop}) + "\n").encode())
        await self.proc.stdin.drain()

    async def __aexit__(self, *exc):
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def vstored(hashes, parent, first_block, bs=16):
    start = first_block * bs
    return {"type": "BlockStored", "hashes": [x.hex() for x in hashes], "parent": parent.hex() if parent else None,
            "tokens": TOKENS[start:start + len(hashes) * bs], "bs": bs}


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm (.ci/setup-vllm)")
@pytest.mark.timeout(400)
async def test_vllm_publisher_feeds_the_index(tmp_path):
    script = tmp_path / "publisher.py"
    script.write_text(VLLM_PUBLISHER)
    kv = KvIndex(16)
    feeds = Feeds(kv)
    async with VllmPublisher(script) as pub:
        await pub.publish([vstored([h(0), h(1)], None, 0)])  # before the feed connects: healed by the replay
        await asyncio.sleep(0.5)
        try:
            feeds.sync({"job-v": pub.target})
            idx = kv.replica("job-v")
            await until(lambda: len(idx) == 2 and not idx.approximate, "the replayed batch", 120)
            assert feeds.stats()["job-v"].replays >= 1
            before = feeds.stats()["job-v"].batches
            end = time.monotonic() + 120
            while feeds.stats()["job-v"].batches == before:  # until a live batch arrives
                assert time.monotonic() < end, "no live batch from vLLM's publisher"
                await pub.publish([])
                await asyncio.sleep(0.2)
            await pub.publish([vstored([h(2), h(3)], h(1), 2)])
            await until(lambda: kv.match(KEYS)["job-v"] == 4, "a live batch", 120)
            await pub.publish([vstored([h(4)], h(3), 4)], drop=True)  # lost on the wire, kept for replay
            await pub.publish([vstored([h(5)], h(4), 5), {"type": "BlockRemoved", "hashes": [h(3).hex()]}])
            await until(lambda: len(idx) == 5, "the gap healed through vLLM's replay socket", 120)
            stats = feeds.stats()["job-v"]
            assert stats.gaps == 1 and stats.resets == 0 and stats.replays >= 2 and not idx.approximate
            assert kv.match(KEYS)["job-v"] == 3 and KEYS[4] in idx and KEYS[5] in idx
            assert stats.lag_s is not None and stats.lag_s < 60
            await pub.publish([{"type": "AllBlocksCleared"}])
            await until(lambda: len(idx) == 0, "the clear", 120)
            feeds.sync({})
            assert kv.job_ids() == []
        finally:
            await feeds.close()


class _FakeSock:
    def __init__(self, owner):
        self.owner = owner
        self.pending = None

    def setsockopt(self, *a):
        pass

    def connect(self, *a):
        pass

    def close(self, linger=0):
        pass

    async def send_multipart(self, frames):
        pass

    def recv_multipart(self):
        fut = asyncio.get_running_loop().create_future()
        self.owner.recvs.append(fut)
        return fut


class _FakeCtx:
    def __init__(self):
        self.recvs = []

    def socket(self, kind):
        return _FakeSock(self)


async def test_cancel_while_a_replay_frame_arrives_stops_the_feed():
    # on 3.11 asyncio.wait_for dropped a cancel that met a frame (CPython gh-86296): a removed feed lived on
    ctx = _FakeCtx()
    feed = Feed("job-a", FeedTarget("tcp://x:1", "tcp://x:2"), ReplicaIndex(16), ctx,
                FeedOptions(replay_timeout_s=30))
    task = feed.start()
    for _ in range(100):          # the SUB socket never receives; the replay DEALER's recv is awaited
        await asyncio.sleep(0)
        if ctx.recvs:
            break
    assert ctx.recvs, "the feed never asked for a replay"
    # a frame arrives, and in the same turn of the loop the replica leaves the routing table (Feeds._remove)
    ctx.recvs[-1].set_result([b"", b"", END_SEQ, b""])
    feed.cancel()
    await asyncio.sleep(0.2)
    try:
        assert task.done(), "the cancelled feed task is still running (cancellation swallowed by wait_for)"
    finally:
        task.cancel()
        await asyncio.sleep(0)


def test_a_hybrid_models_full_attention_group_is_followed_not_its_sliding_window_one():
    """vLLM numbers a hybrid model's KV-cache groups in the order its layers come: Gemma's or gpt-oss's group 0
    is sliding-window, which frees a prompt's leading blocks while the full-attention group still holds them
    (a hit needs the full-attention prefix): the index followed group 0 and predicted misses where vLLM hits.
    The stores' kv_cache_spec_kind says which group holds whole prefixes; that one is followed."""
    from orchestrator.gateway.kvevents import Groups
    from orchestrator.gateway.kvindex import ReplicaIndex
    groups, idx = Groups(), ReplicaIndex()
    four = [h(0), h(1), h(2), h(3)]

    def both(kind0: str, kind1: str) -> bytes:
        return msgpack.packb([1.0, [{**stored(four, None, 0), "group_idx": 0, "kv_cache_spec_kind": kind0},
                                    {**stored(four, None, 0), "group_idx": 1, "kv_cache_spec_kind": kind1}]])
    for payload in (both("sliding_window", "full_attention"),
                    msgpack.packb([2.0, [{**removed([h(0), h(1)]), "group_idx": 0}]])):   # out of the window
        for ev in decode_batch(payload, groups)[1]:
            assert idx.apply(ev) is not False
    assert groups.follow == 1 and len(idx) == 4 and idx.prefix(KEYS) == 4
    plain = Groups()   # one group of full attention (or none named): group 0, as before
    assert [type(e) for e in decode_batch(both("full_attention", "full_attention"), plain)[1]] == [BlockStored]
    assert plain.follow == 0 and not plain.changed


def test_only_the_gpus_copies_are_followed_not_an_offloading_connectors():
    """vLLM's offloading connector publishes its CPU (or STORAGE) copy of a block in the same stream, the same
    hash: taken for a second GPU copy, the block outlived its GPU eviction and still scored as a hit."""
    idx = ReplicaIndex()

    def apply(*events) -> None:
        for ev in decode_batch(msgpack.packb([1.0, list(events)]))[1]:
            assert idx.apply(ev)
    apply(stored([h(0)], None, 0), {**stored([h(0)], None, 0), "medium": "CPU"})
    apply({**removed([h(0)]), "medium": "CPU"})   # the CPU copy dropped: the GPU's stays
    assert idx.prefix(KEYS) == 1
    apply({**stored([h(0)], None, 0), "medium": "STORAGE"}, removed([h(0)]))   # the GPU's evicted
    assert idx.prefix(KEYS) == 0 and idx.engine_blocks == 0
    apply({**stored([h(0)], None, 0), "medium": None})   # (a publisher that names no medium: the engine's own)
    assert idx.prefix(KEYS) == 1


def test_all_blocks_cleared_resets_the_index_whichever_group_it_follows():
    """AllBlocksCleared has no fields (vLLM's reset_prefix_cache drops the whole pool, every group's blocks): it was
    read as group 0's and dropped once a hybrid model's full-attention group 1 was followed, so the index kept
    blocks the engine had dropped, and a store of the same hash again held it twice: its removal left it held."""
    from orchestrator.gateway.kvevents import Groups
    groups, idx = Groups(), ReplicaIndex()

    def apply(*events) -> list:
        out = decode_batch(msgpack.packb([1.0, list(events)]), groups)[1]
        for ev in out:
            assert idx.apply(ev)
        return out
    apply({**stored([h(0)], None, 0), "group_idx": 0, "kv_cache_spec_kind": "sliding_window"},
          {**stored([h(0)], None, 0), "group_idx": 1, "kv_cache_spec_kind": "full_attention"})
    assert groups.follow == 1 and len(idx) == 1
    assert [type(e) for e in apply({"type": "AllBlocksCleared"})] == [AllBlocksCleared]
    assert len(idx) == 0 and idx.engine_blocks == 0
    apply({**stored([h(0)], None, 0), "group_idx": 1})
    apply({**removed([h(0)]), "group_idx": 1})
    assert len(idx) == 0 and idx.engine_blocks == 0 and idx.prefix(KEYS) == 0


async def test_a_feed_that_learns_the_full_attention_group_late_drops_what_it_held_of_another(ctx):
    """A first batch of the sliding-window group alone was applied as group 0's; the full-attention group's
    stores then show which one to follow: the blocks held were another group's, so the index starts again,
    approximate (that group's earlier stores went unseen)."""
    pub = TinyPublisher(ctx)
    async with one_feed(pub) as (kv, feeds, idx):
        await pub.publish([{**stored([h(0), h(1)], None, 0), "group_idx": 0, "kv_cache_spec_kind": "sliding_window"}])
        await until(lambda: len(idx) == 2, "group 0's store")
        last = await pub.publish([{**stored([h(2)], h(1), 2), "group_idx": 1, "kv_cache_spec_kind": "full_attention"}])
        await until(lambda: feeds.stats()["job-a"].last_seq == last, "group 1's store")
        assert idx.approximate and len(idx) == 0


async def test_each_live_batchs_lag_is_kept_for_the_next_export(ctx):
    """slurmfleet_kv_event_lag_seconds observes every live batch's age when applied (it observed the latest
    batch's once per export, every half second: a lag spike between two exports was not seen)."""
    async with settling_feed(ctx) as (now, pub, kv, feeds, idx):
        stats = feeds.stats()["job-a"]
        stats.lags.clear()
        before = stats.batches
        lags = [0.001 * (i + 1) for i in range(9)] + [2.5]
        for lag in lags:
            await pub.publish([], ts=now[0] - lag)
        await until(lambda: stats.batches == before + len(lags), "the live batches")
        assert stats.lags == pytest.approx(lags) and stats.lag_s == pytest.approx(2.5)
