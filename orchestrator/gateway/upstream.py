"""The gateway's client to the replicas: pooled keep-alive HTTP/1.1 on asyncio protocols.

The proxy's hot path needs little of a general HTTP client (no redirects, cookies, proxies, TLS or compression)
and pays for every layer it has, so this one sends a pre-built request head and parses the answer with
``httptools`` (llhttp, the parser uvicorn uses).  Per replica it keeps idle connections (newest first, dropped
before the engine's own keep-alive timeout), hands out the response body as it arrives (SSE is never buffered)
with back-pressure, and gives a connection back only when its response was read to the end.  First-byte and total
deadlines are enforced by one sweeper task for all requests, which costs far less than a timer armed and cancelled
per request.

Errors are split the way the proxy retries: :class:`ConnectFailed` (nothing was sent) and :class:`UpstreamFailed`
(the connection broke or answered garbage).  A reused idle connection that the replica closed just as the request
went out is retried once on a fresh connection, since nothing reached the engine.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import AsyncIterator

import httptools

from .upstreamerrors import ConnectFailed, UpstreamFailed, UpstreamTimeout

HIGH_WATER = 256 * 1024
SWEEP_S = 0.05
END_WAIT_S = 1.0   # how long a response read to its last event waits for the body's end to keep its connection
STALE_CLOSE_S = 1.0   # a reused connection closed this soon after the request went out had been closed idle


class _Conn(asyncio.Protocol):
    """One TCP connection; carries at most one response at a time."""

    __slots__ = ("key", "transport", "parser", "resp", "closed", "idle_since", "got_bytes", "interim")

    def __init__(self, key: tuple[str, int]):
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.got_bytes = False
        self.interim = False  # parsing a 1xx response, which precedes the real one

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.resp is None:  # bytes nobody asked for: the connection is not reusable
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.resp._fail(UpstreamFailed(f"bad response from replica: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.resp is not None and not self.resp.complete:
            self.resp._fail(UpstreamFailed("replica closed the connection" + (f": {exc}" if exc else "")))

    def pause_writing(self) -> None:  # request heads and bodies are small; the kernel buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        resp.raw_headers.append((name, value))  # type: ignore[union-attr]
        if len(name) in (12, 14):  # the two the proxy reads, caught here rather than decoding every header
            lname = name.lower()
            if lname == b"content-type":
                resp.content_type = value.decode("latin-1")  # type: ignore[union-attr]
            elif lname == b"content-length" and value.isdigit():
                resp.content_length = int(value)  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue, 103 Early Hints: not the answer, which follows
            self.interim = True
            resp = self.resp
            resp.raw_headers.clear()  # type: ignore[union-attr]
            resp.content_type = resp.content_length = None  # type: ignore[union-attr]
            return
        self.resp._headers_done(status)  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.resp._feed(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        resp = self.resp
        resp.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
        resp._complete()  # type: ignore[union-attr]

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """A replica's answer: status and headers at once, the body as it arrives."""

    __slots__ = ("_conn", "_pool", "status", "raw_headers", "_headers", "_chunks", "_buffered", "_waiter",
                 "_exc", "complete", "keep_alive", "_released", "_headers_waiter", "_first_byte_deadline", "_deadline",
                 "_loop", "_idle_s", "_paused", "_fed", "_whole", "_parked",
                 "content_type", "content_length")

    def __init__(self, conn: _Conn, pool: Upstream, loop: asyncio.AbstractEventLoop):
        # the loop is handed in: asyncio.get_running_loop() costs a getpid() system call per use, which on a
        # sandboxed or mitigated kernel is a measurable share of a proxied request
        self._conn, self._pool, self._loop = conn, pool, loop
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: dict[str, str] | None = None
        self.content_type: str | None = None
        self.content_length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False   # reading paused for a slow client (until half the high water mark is left)
        self._fed = False      # body bytes came: from then on a stream is bound by its silence
        self._whole = False    # read() takes the whole body: no back-pressure, reading is never paused
        self._waiter: asyncio.Future | None = None
        self._headers_waiter: asyncio.Future | None = loop.create_future()
        self._exc: Exception | None = None
        self.complete = False
        self.keep_alive = False
        self._released = False
        self._parked = False   # read to its last event; goes back to the pool when the body's end comes
        self._first_byte_deadline = self._deadline = 0.0
        self._idle_s = 0.0   # a stream's silence limit (0: the total deadline holds)

    @property
    def headers(self) -> dict[str, str]:
        """Header names lower-cased; a repeated header keeps its last value."""
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}
        return self._headers

    # fed by the connection
    def _arm(self, first_byte_s: float, total_s: float, idle_s: float = 0.0) -> None:
        now = self._loop.time()
        self._first_byte_deadline, self._deadline = now + first_byte_s, now + total_s
        self._idle_s = idle_s
        self._pool._watch[self] = None  # the pool's sweeper enforces both deadlines

    def _check_deadlines(self, now: float) -> None:
        waiting_headers = self._headers_waiter is not None
        if now >= self._deadline and self._idle_s and self._paused:
            self._deadline = now + self._idle_s   # a stream paused for a slow client: not the replica's silence
        if now >= self._deadline or (waiting_headers and now >= self._first_byte_deadline):
            what = "first byte" if waiting_headers else "end of the response" if not self._idle_s else (
                f"stream's next bytes ({self._idle_s:g}s silent)" if self._fed else "stream's first bytes")
            self._fail(UpstreamTimeout(f"replica timed out waiting for the {what}"))
            self._conn.abort()
            self._pool._watch.pop(self, None)

    def _headers_done(self, status: int) -> None:
        self.status = status
        if self._idle_s and "text/event-stream" not in (self.content_type or ""):
            self._idle_s = 0.0   # a stream is bound by silence from its first bytes on (vLLM sends its headers at
            # once: the wait in the engine's queue and the prefill stay under the total deadline), not by length
        w, self._headers_waiter = self._headers_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        if not (data[:1] == b":" and b"data:" not in data):   # SSE comments alone (vLLM's keep-alives, which its
            self._fed = True                                   # server sends while the engine is stuck too) are
            if self._idle_s:                                   # silence: the total deadline, then the silence
                self._deadline = self._loop.time() + self._idle_s   # limit, still run
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._whole and not self._paused and self._conn.transport is not None:
            self._conn.transport.pause_reading()
            self._paused = True
        self._wake()

    def _complete(self) -> None:
        self.complete = True
        if self._parked:
            self.release()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        self._exc = exc
        if self._parked:
            self.release()   # (the connection is closed or aborted: release drops it)
        w, self._headers_waiter = self._headers_waiter, None
        if w is not None and not w.done():
            w.set_exception(exc)
        self._wake()

    # read by the proxy
    async def _wait_headers(self) -> None:
        if self._headers_waiter is not None:
            await self._headers_waiter

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive; raises :class:`UpstreamFailed` if it is cut short."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._paused and self._buffered <= HIGH_WATER // 2:
                    self._resume()
                yield data
                continue
            if self.complete:
                return
            if self._exc is not None:
                raise self._exc
            self._waiter = self._loop.create_future()
            await self._waiter

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True   # reading it all anyway
        self._resume()
        while not self.complete:
            if self._exc is not None:
                raise self._exc
            self._waiter = self._loop.create_future()
            await self._waiter
        chunks, self._chunks, self._buffered = self._chunks, collections.deque(), 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _resume(self) -> None:
        if self._paused and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        self._paused = False

    def release(self) -> None:
        """Give the connection back if the response was read to its end, else close it (reading resumed: a
        connection paused by a large body's last bytes would never see its next answer)."""
        if self._released or self._parked and not self.complete and self._exc is None:
            return   # (parked by release_at_end: its end, its failure or its deadline releases it)
        self._released = True
        self._pool._watch.pop(self, None)
        conn = self._conn
        conn.resp = None
        if self.complete and self.keep_alive and not self._chunks and not conn.closed:
            self._resume()
            self._pool._put(conn)
        else:
            conn.abort()

    def release_at_end(self) -> None:
        """:meth:`release` once the body has ended: an event stream's last event (``[DONE]``) can come a moment
        before its chunked terminator, and releasing then would close a connection that is about to be
        reusable.  Waits at most ``END_WAIT_S``; bytes other than the end after it close the connection."""
        if self.complete or self._released or self._chunks or self._exc is not None or self._conn.closed:
            self.release()
            return
        self._parked = True
        self._idle_s = 0.0
        self._deadline = min(self._deadline, self._loop.time() + END_WAIT_S)
        self._resume()

    def quiet(self, for_s: float) -> bool:
        """A stream bound by silence with nothing buffered nor paused, and no bytes for ``for_s``."""
        return bool(self._idle_s) and not self._chunks and not self._paused and (
            self._loop.time() >= self._deadline - self._idle_s + for_s)

    def stop(self) -> None:
        """End the body here, as complete (a stream its replica never ends), its connection closed."""
        self.keep_alive = False
        self._complete()
        self._conn.abort()

    def close(self) -> None:
        """Drop the connection now (the replica sees the client go away and aborts the request)."""
        self._conn.abort()
        self.release()


class Upstream:
    """Keep-alive connections per replica ``(host, port)``."""

    def __init__(self, connect_timeout_s: float, idle_timeout_s: float = 4.0, max_idle_per_replica: int = 256):
        self.connect_timeout_s, self.idle_timeout_s = connect_timeout_s, idle_timeout_s
        self.max_idle = max_idle_per_replica
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: dict[Response, None] = {}  # responses not yet released, for the deadline sweeper
        self._sweeper: asyncio.Task | None = None

    def _bind(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        self._sweeper = self._loop.create_task(self._sweep(), name="upstream-deadlines")
        return self._loop

    async def _sweep(self) -> None:
        """Time out requests every ``SWEEP_S``: one task for all of them is far cheaper than a timer armed and
        cancelled per request (timeouts here are seconds to minutes, so 50 ms of slack is nothing)."""
        loop = self._loop
        prune_at = 0.0
        while True:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            if self._watch:
                for resp in list(self._watch):
                    resp._check_deadlines(now)
            if now >= prune_at:
                prune_at = now + self.idle_timeout_s
                self._prune()

    def _prune(self) -> None:
        """Close the idle connections past ``idle_timeout_s`` and forget replicas with none: those of replicas
        gone (a lost node sends no FIN) would hold their descriptors for as long as the gateway runs."""
        oldest_ok = time.monotonic() - self.idle_timeout_s
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and c.idle_since >= oldest_ok]
            for c in set(idle).difference(keep):
                c.abort()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def _put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        conn.got_bytes = False
        idle.append(conn)

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_ok = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()  # newest first: the least likely to have been closed by the replica
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.abort()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(key), key[0], key[1])
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {exc or type(exc).__name__}") from None
        return conn

    async def request(self, host: str, port: int, head: bytes, body: bytes = b"", *, first_byte_timeout_s: float,
                      total_timeout_s: float, stream_idle_timeout_s: float = 0.0) -> Response:
        """Send ``head`` (request line and headers, ending in a blank line) and ``body``; return once the
        response headers are in.  The caller must :meth:`Response.release` or :meth:`Response.close` it.

        Raises :class:`ConnectFailed`, :class:`UpstreamTimeout` (no headers within ``first_byte_timeout_s``)
        or :class:`UpstreamFailed`; the body raises :class:`UpstreamTimeout` past ``total_timeout_s``, or, for
        an event stream when ``stream_idle_timeout_s`` is set, after that long without a byte."""
        key = (host, port)
        conn = self._take_idle(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(key)
            resp = Response(conn, self, self._loop or self._bind())
            conn.resp = resp
            resp._arm(first_byte_timeout_s, total_timeout_s, stream_idle_timeout_s)
            conn.transport.write(head + body if body else head)  # type: ignore[union-attr]
            sent = resp._loop.time()
            try:
                await resp._wait_headers()
                return resp
            except UpstreamFailed as exc:
                resp.close()
                # the replica had closed the idle connection (its keep-alive ran out as the request went): once more,
                if reused and not conn.got_bytes and not isinstance(exc, UpstreamTimeout) and (
                        resp._loop.time() - sent < STALE_CLOSE_S):
                    conn, reused = None, False   # fresh; not after it had it a while (it worked on it, then died)
                    continue
                raise
            except BaseException:  # cancelled while waiting: the connection is in an unknown state
                resp.close()
                raise

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
