"""The job's KV-event relay (``orchestrator/kvrelay.py``) in front of a simulator publishing on loopback, as a
``kv_aware`` job runs them: a subscriber or replay asker without the job's secret gets nothing (vLLM's own
publisher answers anyone who can reach the node, with every prompt's token ids); the gateway's feed, which
derives the relay's key from the secret in the endpoint record, gets the events and their replay."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import threading
import time

import pytest
import zmq

from conftest import free_port
from gateway_harness import Sim
from orchestrator.gateway.kvevents import FeedTarget
from orchestrator.gateway.kvfeeds import Feeds
from orchestrator.gateway.kvindex import KvIndex
from orchestrator.kvrelay import END_SEQ, client_options, relay, server_key
from test_simulator_kvcache import complete

SECRET = "s3cret-of-the-job"


class Relayed:
    """A simulator with events on loopback and the relay in a thread, its public ports ``port``/``replay``."""

    def __init__(self) -> None:
        self.port, self.replay = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="sfkv.")   # as the job makes it: ipc sockets, 0700
        events, replay = f"ipc://{self.dir}/events", f"ipc://{self.dir}/replay"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "replay_endpoint": replay,
               "topic": "kv.r"}
        self.sim = Sim("r", "--ttft-s", "0", "--tokens-per-s", "2000", "--kv-events-config", json.dumps(cfg),
                       secret=SECRET)
        self.ctx = zmq.Context()
        self.args = (events, f"tcp://*:{self.port}", replay, f"tcp://*:{self.replay}", SECRET)   # as the job binds
        self.runs = 0
        self.start_relay()

    def start_relay(self) -> None:
        """The relay in a thread (again: as the job's loop starts it again after it died)."""
        self.runs += 1
        self.stop = self.ctx.socket(zmq.PAIR)
        self.stop.bind(f"inproc://stop-{self.runs}")
        theirs = self.ctx.socket(zmq.PAIR)
        theirs.connect(f"inproc://stop-{self.runs}")
        self.thread = threading.Thread(target=relay, args=(self.ctx, *self.args, theirs), daemon=True)
        self.thread.start()

    def stop_relay(self) -> None:
        if self.stop.closed:
            return
        self.stop.send(b"stop")
        self.thread.join(10)
        self.stop.close(0)

    def sub(self, secret: str | None) -> zmq.Socket:
        s = self.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            client_options(s, server_key(secret))
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{self.port}")
        return s

    def ask_replay(self, secret: str | None, timeout_s: float) -> list[int] | None:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            client_options(d, server_key(secret))
        d.connect(f"tcp://127.0.0.1:{self.replay}")
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        try:
            while d.poll(int(timeout_s * 1000)):
                frames = d.recv_multipart()
                if frames[2] == END_SEQ:
                    return seqs
                seqs.append(int.from_bytes(frames[2], "big"))
            return None
        finally:
            d.close(0)

    def close(self) -> None:
        self.stop_relay()
        self.ctx.destroy(linger=0)   # (a test that failed left its sockets open: term() waited for them for ever)
        self.sim.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_only_the_jobs_secret_opens_the_events_and_their_replay():
    r = Relayed()
    try:
        keyed, plain, wrong = r.sub(SECRET), r.sub(None), r.sub("another-jobs-secret")
        for n in range(30):   # a SUB misses what goes out before its subscription arrives: until one comes
            complete(r.sim, f"a tenant's private prompt {n} " + "x " * 16, 1)
            if keyed.poll(1000):
                break
        else:
            raise AssertionError("no event reached the keyed subscriber")
        topic, seq, _payload = keyed.recv_multipart()
        assert topic == b"kv.r" and int.from_bytes(seq, "big") >= 0
        complete(r.sim, "one more prompt " + "y " * 16, 1)
        assert keyed.poll(5000)
        assert not plain.poll(500) and not wrong.poll(500)   # nothing, not even the handshake
        assert r.ask_replay(None, 1.0) is None and r.ask_replay("another-jobs-secret", 1.0) is None
        seqs = r.ask_replay(SECRET, 5.0)
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0, seqs
        for s in (keyed, plain, wrong):
            s.close(0)
    finally:
        r.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("[::1]", marks=pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="no IPv6 loopback here"))])
def test_the_gateways_feed_follows_a_relayed_engine_exactly(host):
    """The feed with the job's secret in its target catches up from the replay and follows the live events
    through the relay: the index is exact and holds the prompt's blocks; also where the node's address is
    IPv6 (the endpoint record brackets it; the relay's "*" binds both families)."""
    r = Relayed()

    async def main() -> None:
        kv = KvIndex(16)
        feeds = Feeds(kv)
        try:
            feeds.sync({"job-r": FeedTarget(f"tcp://{host}:{r.port}", f"tcp://{host}:{r.replay}", "kv.r",
                                            server_key(SECRET))})
            end = time.monotonic() + 30
            idx = kv.replica("job-r")
            while not (len(idx) and not idx.approximate and feeds.stats()["job-r"].batches >= 2):
                assert time.monotonic() < end, feeds.stats()
                await asyncio.to_thread(complete, r.sim, f"question {time.monotonic()} " + "z " * 40, 1)
                await asyncio.sleep(0.2)
        finally:
            await feeds.close()
    try:
        asyncio.run(main())
    finally:
        r.close()


def test_the_feed_heals_through_a_relay_that_was_down():
    """The relay dies and the job starts it again on the same ports: what the engine published meanwhile never
    reached the gateway's feed; the feed reconnects, sees the gap at the next live batch, gets it from the
    replay through the new relay, and its index is exact again with the blocks stored while the relay was
    down."""
    r = Relayed()

    async def main() -> None:
        kv = KvIndex(16)
        feeds = Feeds(kv)
        try:
            feeds.sync({"job-r": FeedTarget(f"tcp://127.0.0.1:{r.port}", f"tcp://127.0.0.1:{r.replay}", "kv.r",
                                            server_key(SECRET))})
            idx = kv.replica("job-r")
            end = time.monotonic() + 30
            while not (len(idx) and not idx.approximate and feeds.stats()["job-r"].batches >= 2):
                assert time.monotonic() < end, feeds.stats()
                await asyncio.to_thread(complete, r.sim, f"question {time.monotonic()} " + "z " * 40, 1)
                await asyncio.sleep(0.2)
            await asyncio.to_thread(r.stop_relay)
            missed = [20_000 + i for i in range(64)]   # 4 blocks the feed never sees live
            await asyncio.to_thread(complete, r.sim, missed, 1)
            keys = kv.keys(missed)[:4]
            await asyncio.sleep(0.5)
            assert idx.prefix(keys) == 0
            await asyncio.to_thread(r.start_relay)
            end = time.monotonic() + 30
            while not (idx.prefix(keys) == 4 and not idx.approximate):
                assert time.monotonic() < end, (feeds.stats(), idx.prefix(keys))
                await asyncio.to_thread(complete, r.sim, f"after {time.monotonic()} " + "w " * 40, 1)
                await asyncio.sleep(0.3)
            st = feeds.stats()["job-r"]
            assert st.gaps >= 1 and st.replays >= 1 and st.resets == 0, st
        finally:
            await feeds.close()
    try:
        asyncio.run(main())
    finally:
        r.close()


def test_a_replay_answer_that_never_ends_does_not_keep_its_socket():
    """An engine whose answer loses its end marker (cut at its ROUTER's high-water mark): the relay closes the
    asker's DEALER to the engine after ``idle_s`` without a frame (each such answer kept one for ever, and the
    askers ask again under new identities)."""
    from zmq.utils.monitor import recv_monitor_message
    d = tempfile.mkdtemp(prefix="sfkv.")
    ctx = zmq.Context()
    try:
        engine = ctx.socket(zmq.ROUTER)               # a replay socket that takes requests and answers nothing
        engine.bind(f"ipc://{d}/replay")
        mon = engine.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        stop = ctx.socket(zmq.PAIR)
        stop.bind("inproc://stop-idle")
        theirs = ctx.socket(zmq.PAIR)
        theirs.connect("inproc://stop-idle")
        port = free_port()
        t = threading.Thread(target=relay, args=(ctx, f"ipc://{d}/events", f"tcp://127.0.0.1:{free_port()}",
                                                 f"ipc://{d}/replay", f"tcp://127.0.0.1:{port}", SECRET, theirs),
                             kwargs={"idle_s": 0.5}, daemon=True)
        t.start()
        asker = ctx.socket(zmq.DEALER)
        client_options(asker, server_key(SECRET))
        asker.connect(f"tcp://127.0.0.1:{port}")
        asker.send_multipart([b"", (0).to_bytes(8, "big")])
        assert engine.poll(5000) and engine.recv_multipart()[1:] == [b"", (0).to_bytes(8, "big")]
        events = []
        end = time.monotonic() + 10
        while zmq.EVENT_DISCONNECTED not in events and time.monotonic() < end:
            if mon.poll(500):
                events.append(recv_monitor_message(mon)["event"])
        assert events[:1] == [zmq.EVENT_ACCEPTED] and zmq.EVENT_DISCONNECTED in events, events
        stop.send(b"stop")
        t.join(10)
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(d, ignore_errors=True)
