"""The gateway's upstream client against raw TCP servers that misbehave on purpose."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.gateway.upstream import HIGH_WATER, Upstream
from orchestrator.gateway.upstreamerrors import ConnectFailed, UpstreamFailed, UpstreamTimeout

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\": 1}\r\n"


class RawServer:
    """Answers each request with whatever ``script(conn_no, request_no, writer)`` writes."""

    def __init__(self, script):
        self.script, self.connections, self.requests = script, 0, 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                if await self.script(conn, self.requests, writer) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def call(up: Upstream, port: int, first_byte_s: float = 2.0, total_s: float = 5.0):
    return await up.request("127.0.0.1", port, HEAD, b"{}", first_byte_timeout_s=first_byte_s, total_timeout_s=total_s)


async def test_keep_alive_reuses_one_connection():
    async def ok(_c, _r, w):
        w.write(OK)
    async with RawServer(ok) as srv:
        up = Upstream(1.0)
        for _ in range(5):
            r = await call(up, srv.port)
            assert r.status == 200 and r.content_type == "application/json" and r.content_length == 11
            assert await r.read() == b'{"ok": 1}\r\n'
            r.release()
        assert (srv.connections, srv.requests) == (1, 5)
        up.close()


async def test_idle_connection_closed_by_the_replica_is_replaced_transparently():
    async def close_idle(conn, _r, w):
        if conn == 1 and srv.requests > 1:
            return "close"  # the replica timed out the idle connection just as the next request went out
        w.write(OK)
    async with RawServer(close_idle) as srv:
        up = Upstream(1.0)
        for _ in range(2):
            r = await call(up, srv.port)
            assert await r.read() == b'{"ok": 1}\r\n'
            r.release()
        assert (srv.connections, srv.requests) == (2, 3)  # the second request went out twice
        up.close()


async def test_a_request_the_replica_had_a_while_is_not_sent_again_on_a_fresh_connection():
    """A reused connection closed without an answer after the replica had the request for seconds: it worked on
    it (then died, or dropped it); sent again there, the engine did the work twice.  The caller decides (another
    replica, or the client's error)."""
    async def slow_then_close(conn, req, w):
        if req == 1:
            w.write(OK)
            return None
        await asyncio.sleep(1.5)   # generating
        return "close"
    async with RawServer(slow_then_close) as srv:
        up = Upstream(1.0)
        r = await call(up, srv.port)
        assert await r.read() == b'{"ok": 1}\r\n'
        r.release()
        with pytest.raises(UpstreamFailed):
            await call(up, srv.port, first_byte_s=10.0, total_s=10.0)
        assert (srv.connections, srv.requests) == (1, 2)   # not a third time
        up.close()


async def test_interim_1xx_responses_are_skipped():
    async def continue_then_ok(_c, _r, w):
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK)
    async with RawServer(continue_then_ok) as srv:
        up = Upstream(1.0)
        for _ in range(2):  # and the connection stays usable
            r = await call(up, srv.port)
            assert r.status == 200 and r.content_type == "application/json" and "link" not in r.headers
            assert await r.read() == b'{"ok": 1}\r\n'
            r.release()
        assert srv.connections == 1
        up.close()


async def test_chunked_body_is_handed_out_as_it_arrives():
    gate = asyncio.Event()

    async def stream(_c, _r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"7\r\ndata: 1\r\n")
        await gate.wait()
        w.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
    async with RawServer(stream) as srv:
        up = Upstream(1.0)
        r = await call(up, srv.port)
        chunks = r.iter_chunks()
        assert await asyncio.wait_for(chunks.__anext__(), 2) == b"data: 1"  # before the second was even sent
        gate.set()
        assert [c async for c in chunks] == [b"data: 2"]
        r.release()
        r2 = await call(up, srv.port)  # the connection went back to the pool after the last chunk
        r2.close()
        assert srv.connections == 1
        up.close()


async def test_failures_are_typed_and_never_reuse_the_connection():
    async def garbage(_c, _r, w):
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def hang(_c, _r, _w):
        await asyncio.sleep(30)

    async def short(_c, _r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\"")
        return "close"
    up = Upstream(1.0)
    async with RawServer(garbage) as srv:
        with pytest.raises(UpstreamFailed):
            await call(up, srv.port)
    async with RawServer(hang) as srv:
        with pytest.raises(UpstreamTimeout):
            await call(up, srv.port, first_byte_s=0.3)
        assert not up._idle.get(("127.0.0.1", srv.port))
    async with RawServer(short) as srv:
        r = await call(up, srv.port)
        with pytest.raises(UpstreamFailed):
            await r.read()
        r.release()
        assert not up._idle.get(("127.0.0.1", srv.port))
    port = srv.port  # closed now
    with pytest.raises(ConnectFailed):
        await call(up, port)
    up.close()


async def test_request_timeout_cuts_a_slow_body():
    async def slow(_c, _r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(30)
    async with RawServer(slow) as srv:
        up = Upstream(1.0)
        for first_byte_s, total_s in ((1.0, 0.5), (0.2, 0.6)):  # total first; first byte in time, then total
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await call(up, srv.port, first_byte_s=first_byte_s, total_s=total_s)
            got = []
            with pytest.raises(UpstreamTimeout, match="end of the response"):
                async for c in r.iter_chunks():
                    got.append(c)
            assert got == [b"abc"] and total_s - 0.05 <= loop.time() - t0 < total_s + 1
        up.close()


async def test_a_stream_runs_past_the_total_deadline_while_it_goes_on_and_fails_when_it_falls_silent():
    """An event stream is bound by silence (a stuck engine), not by its length (a long generation): with a
    0.6 s total deadline and a 0.5 s silence limit, 2 s of an event every 0.2 s arrive whole; a stream that
    falls silent fails after the silence limit."""
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def steady(_c, _r, w):
        w.write(sse)
        for i in range(10):
            w.write(b"9\r\ndata: %d\n\n\r\n" % i)
            await w.drain()
            await asyncio.sleep(0.2)
        w.write(b"0\r\n\r\n")

    async def stalls(_c, _r, w):
        w.write(sse + b"9\r\ndata: 0\n\n\r\n")
        await asyncio.sleep(30)

    up = Upstream(1.0)
    async with RawServer(steady) as srv:
        r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=0.6,
                             stream_idle_timeout_s=0.5)
        assert b"".join([c async for c in r.iter_chunks()]).count(b"data:") == 10
        r.release()
    async with RawServer(stalls) as srv:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=30.0,
                             stream_idle_timeout_s=0.5)
        with pytest.raises(UpstreamTimeout, match="silent"):
            async for _ in r.iter_chunks():
                pass
        assert 0.45 <= loop.time() - t0 < 5
    up.close()


async def test_a_streams_silence_limit_starts_at_its_first_bytes_and_spares_a_slow_client():
    """vLLM sends a stream's headers at once: the wait in its queue and the prefill (here 1 s, twice the 0.5 s
    silence limit) stay under the total deadline.  A client slow enough that reading stays paused (the buffer
    between half and all of the high water mark) is not the replica's silence either."""
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def queued(_c, _r, w):
        w.write(sse)
        await w.drain()
        await asyncio.sleep(1.0)
        for i in range(3):
            w.write(b"9\r\ndata: %d\n\n\r\n" % i)
        w.write(b"0\r\n\r\n")

    event = b"data: " + b"x" * 8186 + b"\n\n"   # 8 KiB events, 64 of them in one burst: past the high water mark

    async def burst(_c, _r, w):
        w.write(sse)
        for _ in range(64):
            w.write(b"%x\r\n%s\r\n" % (len(event), event))
        await w.drain()
        w.write(b"0\r\n\r\n")

    up = Upstream(1.0)
    async with RawServer(queued) as srv:
        r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=5.0,
                             stream_idle_timeout_s=0.5)
        assert b"".join([c async for c in r.iter_chunks()]).count(b"data:") == 3
        r.release()
    async with RawServer(burst) as srv:
        r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=0.3,
                             stream_idle_timeout_s=0.3)
        got, stalled = b"", False
        await asyncio.sleep(0.3)   # the burst arrives: reading pauses past the high water mark
        async for c in r.iter_chunks():
            got += c
            if not stalled and r._buffered <= HIGH_WATER:   # the client has read some, not half the buffer
                assert r._paused and r._buffered > HIGH_WATER // 2
                await asyncio.sleep(1.5)   # then stalls: past the silence limit, reading still paused
                stalled = True
        assert stalled and got.count(b"data:") == 64
    up.close()


async def test_a_connection_whose_large_body_was_read_whole_is_reusable():
    """A body past the high water mark read whole (a large non-streamed answer): its last bytes paused reading,
    and the connection went back idle paused, so the next request on it never saw its answer (a timeout)."""
    big = b"x" * (HIGH_WATER + 50_000)

    async def large(_c, _r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big))
    async with RawServer(large) as srv:
        up = Upstream(1.0)
        for i in range(3):
            r = await call(up, srv.port, first_byte_s=1.0)
            if i == 1:
                await asyncio.sleep(0.2)   # the whole body buffered before read(): reading paused meanwhile
            assert await r.read() == big
            r.release()
            assert up._idle[("127.0.0.1", srv.port)][0].transport.is_reading()
        assert (srv.connections, srv.requests) == (1, 3)
        up.close()


async def test_idle_connections_of_a_replica_gone_are_closed_and_forgotten():
    """A replica whose node vanished sends no FIN: its idle connections are closed after idle_timeout_s by the
    sweeper, not kept (with their descriptors) for as long as the gateway runs."""
    async def ok(_c, _r, w):
        w.write(OK)
    async with RawServer(ok) as srv:
        up = Upstream(1.0, idle_timeout_s=0.2)
        r = await call(up, srv.port)
        await r.read()
        r.release()
        conn = up._idle[("127.0.0.1", srv.port)][0]
        await asyncio.sleep(0.8)
        assert up._idle == {} and conn.closed
        up.close()


async def test_keep_alive_comments_alone_are_silence_for_a_streams_deadlines():
    """vLLM's API server sends ``: keep-alive`` comments (--sse-keep-alive-interval) while its engine is stuck:
    they neither end the wait for the first data under the total deadline nor restart the silence limit (a hung
    replica's stream never ended)."""
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    keep = b"e\r\n: keep-alive\n\n\r\n"

    def stuck(first: bool):
        async def script(_c, _r, w):
            w.write(sse)
            if first:
                w.write(b"9\r\ndata: 0\n\n\r\n")
            for _ in range(40):
                w.write(keep)
                await w.drain()
                await asyncio.sleep(0.1)
        return script

    up = Upstream(1.0)
    for first, total_s, what in ((False, 1.0, "first bytes"), (True, 30.0, "next bytes")):
        async with RawServer(stuck(first)) as srv:
            r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=total_s,
                                 stream_idle_timeout_s=0.8)
            t0, got = asyncio.get_running_loop().time(), b""
            with pytest.raises(UpstreamTimeout, match=what):
                async for c in r.iter_chunks():
                    got += c
            assert got.count(b"keep-alive") >= 5 and asyncio.get_running_loop().time() - t0 < 2.5
            r.close()
    up.close()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = b"e\r\ndata: [DONE]\n\n\r\n"


async def read_to_done(r) -> None:
    async for c in r.iter_chunks():
        if b"[DONE]" in c:
            return


@pytest.mark.parametrize("after_done, connections", [(b"0\r\n\r\n", 1), (b"3\r\nxyz\r\n0\r\n\r\n", 2), (None, 2)])
async def test_a_stream_released_at_its_last_event_keeps_its_connection_only_for_a_clean_end(
        monkeypatch, after_done, connections):
    """A stream read to its ``[DONE]`` is released before its chunked terminator comes (a write of its own,
    after the event): release() then closed a connection about to be reusable, so each resumable stream
    opened a new one.  release_at_end() waits for the end (a release() after it does not cut the wait short);
    bytes after it, or no end, still close it."""
    from orchestrator.gateway import upstream as mod
    monkeypatch.setattr(mod, "END_WAIT_S", 0.3)

    async def stream(_c, n, w):
        if n == 1:
            w.write(SSE_HEAD + DONE)
            await w.drain()
            await asyncio.sleep(0.1)   # the terminator comes after the gateway has read [DONE]
            if after_done is not None:
                w.write(after_done)
            else:
                await asyncio.sleep(1.0)   # no end within END_WAIT_S
        else:
            w.write(OK)
    async with RawServer(stream) as srv:
        up = Upstream(1.0)
        r = await call(up, srv.port)
        await read_to_done(r)
        assert not r.complete
        r.release_at_end()
        r.release()   # (the proxy's own release after it, in a finally, leaves it parked)
        await asyncio.sleep(0.5)
        assert r._conn.closed == (connections == 2)   # (no end within END_WAIT_S: closed by the sweeper)
        r2 = await call(up, srv.port)
        assert await r2.read() == b'{"ok": 1}\r\n'
        r2.release()
        assert srv.connections == connections
        up.close()


async def test_a_stream_is_quiet_only_read_up_and_silent_and_a_stop_ends_it_cleanly():
    """What the gateway ends a stream its replica never ends by (a cancelled background response's): ``quiet``
    only once everything that came was read and nothing came for a while; ``stop`` then ends the body as
    complete, no error, and the connection is not reused."""
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def then_silent(_c, _r, w):
        w.write(sse + b"9\r\ndata: 0\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(b"9\r\ndata: 1\n\n\r\n")
        await w.drain()   # (then silent: the server waits for the next request until the client closes)

    up = Upstream(1.0)
    async with RawServer(then_silent) as srv:
        r = await up.request("127.0.0.1", srv.port, HEAD, b"{}", first_byte_timeout_s=2.0, total_timeout_s=30.0,
                             stream_idle_timeout_s=30.0)
        chunks = r.iter_chunks()
        assert await anext(chunks) == b"data: 0\n\n"
        assert not r.quiet(5.0)   # (bytes came just now)
        await asyncio.sleep(0.5)
        assert not r.quiet(0.2)   # (the second event came and waits to be read)
        assert await anext(chunks) == b"data: 1\n\n"
        await asyncio.sleep(0.3)
        assert r.quiet(0.2)
        r.stop()
        assert [c async for c in chunks] == []   # (the end, no UpstreamFailed)
        r.release()
        assert srv.connections == 1 and not up._idle   # (closed, not pooled)
    up.close()
