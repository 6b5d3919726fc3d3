"""Writing to a client that may stop reading: a stream's events and a large whole answer's pieces wait for a
client whose socket is full for ``stream_idle_timeout_s`` at most, then its connection is closed (it would hold
its replica's slot, a drain, and the body, for ever); a client that keeps up costs nothing more."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.payload import BytesPayload

SLOW_CLIENT_BYTES = 16384   # unsent in the client's socket's buffer: it has stopped reading (its kernel's is full)


async def paced(tr, size: int, idle_s: float, write) -> None:
    """``await write()``, ``size`` bytes to the client on ``tr``; timed at ``idle_s`` only when the socket's
    buffer is full enough that it may block (a client that keeps up costs nothing more): past it the connection
    is closed and ConnectionResetError raised."""
    if tr is None or tr.get_write_buffer_size() + size < SLOW_CLIENT_BYTES:
        return await write()
    try:
        async with asyncio.timeout(idle_s):
            await write()
    except TimeoutError:
        tr.abort()
        raise ConnectionResetError(f"the client read nothing for {idle_s:.0f}s") from None


async def send(request: web.BaseRequest, resp: web.StreamResponse, data: bytes, idle_s: float,
               eof: bool = False) -> None:
    """Write to the client (with ``eof``, the end of the response).  One that keeps its connection but stops
    reading (a loop that breaks out of a stream without closing it) gets ``idle_s`` before its connection is
    closed: it would hold its replica's slot, and a drain, for ever."""
    write = resp.write_eof if eof else resp.write
    await paced(request.transport, len(data), idle_s, lambda: write(data))


WHOLE_PIECE = 256 * 1024   # a large whole answer is written in pieces of this size, each timed as a stream's


class PacedBody(BytesPayload):
    """A whole answer too large for one socket buffer (embeddings), written as a stream's events are: a client that
    stops reading it is let go after ``idle_s`` (aiohttp writes a plain body without a timeout, and the connection
    held it for ever), one that reads slowly keeps its pace.  Written after the handler returned, as any whole
    answer: the replica's slot and connection are free by then, and the request counted whole."""

    def __init__(self, data: bytes, idle_s: float):
        super().__init__(data)
        self.idle_s = idle_s

    async def write(self, writer) -> None:
        view = memoryview(self._value)
        for at in range(0, len(view), WHOLE_PIECE):
            piece = view[at:at + WHOLE_PIECE]
            await paced(writer.transport, len(piece), self.idle_s, lambda: writer.write(piece))

    async def write_with_length(self, writer, content_length: int | None) -> None:
        await self.write(writer)   # (always whole here: its Content-Length is its size)
