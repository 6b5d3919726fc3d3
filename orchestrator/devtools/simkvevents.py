"""KV-cache events on the wire exactly as vLLM's ``ZmqEventPublisher`` sends them.

Configuration is vLLM's ``--kv-events-config`` JSON (``KVEventsSettings.from_json``).  When enabled with the
``zmq`` publisher, a PUB socket sends each batch as three frames: the topic (UTF-8), the batch's sequence
number (8 bytes, big-endian, from 0, one per batch) and the msgpack of the batch, encoded as vLLM's msgspec
encoder encodes its ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` whose events are maps,
the ``type`` tag (the class name) first and then the fields in declaration order, fields whose value is their
default left out.  An endpoint with ``*`` or ``::`` in it, or an ``ipc://``/``inproc://`` one, is bound, any
other is connected to; ``tcp://*:0`` binds a free port (``endpoint`` then says which).

The optional replay ROUTER socket (always bound) answers a request ``[identity, b"", start_seq (8 bytes,
big-endian)]`` with every buffered batch from that sequence number on, each ``[identity, b"", topic, seq,
payload]``, then the end marker ``[identity, b"", b"", (-1 as 8 signed big-endian bytes), b""]``.  The last
``buffer_steps`` batches are kept.  Everything runs on the simulator's event loop: publishing never blocks
(a PUB socket drops at its high-water mark) and the replay socket is served by a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, fields

import msgpack
import zmq
import zmq.asyncio

from orchestrator.devtools.simcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# the fields vLLM declares for each event, in order, with their defaults (a field left out when at its default)
_MISSING = object()
_WIRE_FIELDS: dict[type, tuple[tuple[str, object], ...]] = {
    BlockStored: (("block_hashes", _MISSING), ("parent_block_hash", _MISSING), ("token_ids", _MISSING),
                  ("block_size", _MISSING), ("lora_id", _MISSING), ("medium", _MISSING),
                  ("lora_name", _MISSING), ("extra_keys", None), ("group_idx", None),
                  ("kv_cache_spec_kind", None), ("kv_cache_spec_sliding_window", None), ("locality", None),
                  ("ownership", None), ("session_id", None)),
    BlockRemoved: (("block_hashes", _MISSING), ("medium", _MISSING), ("group_idx", None), ("locality", None),
                   ("ownership", None)),
    AllBlocksCleared: (),
}


def event_to_wire(event: KVEvent) -> dict:
    """The map msgspec makes of a vLLM event: the tag, then the non-default fields in vLLM's order."""
    out: dict = {"type": type(event).__name__}
    for name, default in _WIRE_FIELDS[type(event)]:
        value = getattr(event, name, default)
        if default is _MISSING or value != default:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def encode_batch(events: list[KVEvent], ts: float, data_parallel_rank: int | None = 0) -> bytes:
    """The msgpack of vLLM's ``KVEventBatch(ts, events, data_parallel_rank)`` (an array: it is array-like)."""
    return msgpack.packb([float(ts), [event_to_wire(e) for e in events], data_parallel_rank], use_bin_type=True)


@dataclass
class KVEventsSettings:
    """vLLM's ``KVEventsConfig``: the same keys and defaults."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # vLLM's queue to its publisher thread; nothing queues here
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"Unknown event publisher '{self.publisher}'")

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsSettings:
        """Parse ``--kv-events-config``; ValueError names what is wrong (unknown keys included)."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")  # noqa: TRY004 - argparse reports it
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}")
        return cls(**raw)

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket | zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind and say where: a ``tcp://...:0`` endpoint gets the port the system chose."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        return f"{endpoint[:-2]}:{port}"
    return endpoint


class KVEventPublisher:
    """vLLM's ZMQ PUB + replay ROUTER publisher, on an asyncio loop.  ``publish`` from the loop's thread."""

    def __init__(self, settings: KVEventsSettings, data_parallel_rank: int = 0):
        self.settings = settings
        self.data_parallel_rank = data_parallel_rank
        self._topic = settings.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._next_seq = 0
        self._sync_ctx = zmq.Context()  # the PUB socket is used synchronously (it never blocks)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(settings.endpoint):
            self.endpoint = _bind(self._pub, settings.endpoint)
        else:
            self._pub.connect(settings.endpoint)
            self.endpoint = settings.endpoint
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task | None = None
        if settings.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, settings.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int | None:
        """Send one batch (nothing for no events); its sequence number."""
        if not events:
            return None
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(events, time.time() if ts is None else ts, self.data_parallel_rank)
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        with contextlib.suppress(zmq.Again):  # a PUB socket never blocks; it drops at the high-water mark
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # as vLLM: a malformed request gets no answer
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
