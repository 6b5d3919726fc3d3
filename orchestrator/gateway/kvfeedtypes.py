"""What one replica's KV-event feed is told and what it counts: where it subscribes (:class:`FeedTarget`), its
options (:class:`FeedOptions`) and its counters (:class:`FeedStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from ..kvrelay import client_options


@dataclass(frozen=True)
class FeedTarget:
    """Where one replica publishes: the PUB endpoint, its replay ROUTER (optional) and the topic; and the job's
    relay's CURVE server key when its events come through it (:mod:`orchestrator.kvrelay`; never logged)."""
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    curve_key: bytes = field(default=b"", repr=False)

    def secure(self, sock: zmq.Socket) -> None:
        """Before connecting: a node's address may be IPv6 (libzmq then resolves and connects either family),
        and the relay's CURVE key when there is one."""
        sock.ipv6 = True
        if self.curve_key:
            client_options(sock, self.curve_key)


@dataclass
class FeedStats:
    """Counters of one feed, for the gateway's metrics."""
    batches: int = 0  # batches applied (live and replayed)
    events_applied: int = 0
    gaps: int = 0  # times events were found missing (seq jumps, a late first message)
    replayed: int = 0  # gaps filled whole from the replay socket
    replays: int = 0  # replay requests answered
    replay_failures: int = 0  # replays that could not fill what was missing (a gap: reset; a rebuild: kept, approximate)
    resets: int = 0  # times the index was cleared and marked approximate
    rebuilds: int = 0  # full rebuilds after an unknown parent
    unknown_parents: int = 0
    restarts: int = 0  # publisher restarts seen (seq went back)
    errors: int = 0  # malformed messages and session errors
    last_seq: int | None = None
    lag_s: float | None = None  # now - ts of the latest live batch
    lags: list[float] = field(default_factory=list, compare=False)  # each live batch's, since the last export


@dataclass(frozen=True)
class FeedOptions:
    replay_timeout_s: float = 5.0  # silence that ends a replay answer (first frame or between frames)
    replay_attempts: int = 5  # answers in a row that bring nothing new before a heal gives up (an answer may
                              # lose its tail past the ROUTER's HWM: asking again from there goes on while it advances)
    replay_max_s: float = 600.0  # the longest one heal goes on asking, however much each answer advances
    settle_s: float = 300.0  # approximate -> exact after this long in sync; also the rebuild rate limit
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    rcvhwm: int = 100_000  # live batches held while a replay runs (vLLM's own PUB hwm)
    # ZMTP heartbeats on the live subscription: a connection that answers no PING within the timeout is
    # dropped and made again (a half-open TCP connection, after a node's network went away, would otherwise
    # keep the feed waiting for ever while the index goes stale; the seq gap after reconnecting is replayed).
    # The TTL tells the publisher's side to drop a subscriber it has not heard from for as long.
    heartbeat_ivl_s: float = 5.0
    heartbeat_timeout_s: float = 15.0

    def heartbeats(self, sock: zmq.Socket) -> None:
        ivl, timeout = int(1000 * self.heartbeat_ivl_s), int(1000 * self.heartbeat_timeout_s)
        sock.heartbeat_ivl, sock.heartbeat_timeout, sock.heartbeat_ttl = ivl, timeout, timeout
