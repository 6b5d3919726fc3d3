"""The gateway's HTTP server plumbing: aiohttp's low-level server, with

* the errors aiohttp itself answers (a malformed request line, conflicting lengths, oversized headers,
  too many headers, ...) in the OpenAI error shape instead of plain text;
* a cap on open client connections: past it a new connection is closed at once, so idle or slow
  clients cannot take the process's file descriptors (which its probes, scrapes and replicas need);
* a deadline for a new connection's first request head (``header_timeout_s``: slowloris and silent
  connections), and aiohttp's keep-alive timeout for idle connections between requests;
* a minimum rate for a request's body once its head is in (:func:`within_body_deadline`: a body that
  trickles or stops held its connection and handler for ever), for every handler, Files API uploads too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


def openai_error_body(status: int, message: str, etype: str = "invalid_request_error",
                      code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code or str(status)}}).encode()


log = logging.getLogger("slurmfleet.gateway")
FD_RESERVE = 256  # descriptors kept for everything but client connections (replicas, files, subprocesses)
BODY_MIN_RATE = 1024  # bytes/s: the least average rate of a request body, after header_timeout_s of grace
# set on a request whose handler the body's deadline cancelled: its client got a 408, not a 499
BODY_LATE = web.RequestKey("slurmfleet.body_late", bool)


async def within_body_deadline(request: web.BaseRequest, handler: Callable[[web.BaseRequest], Awaitable],
                               grace_s: float) -> web.StreamResponse:
    """``handler(request)``, answered 408 (and the connection closed) if the body is not whole by ``grace_s``
    plus one second per :data:`BODY_MIN_RATE` bytes received: a slow client (a large upload over a poor link,
    even one that stalls a while) keeps its pace, one that trickles a byte now and then or stops does not.  A
    body already in costs nothing (:class:`Server` calls the handler itself); once it is whole, nothing is timed."""
    payload = request.content
    loop = asyncio.get_running_loop()
    due = loop.time() + grace_s
    handle = None
    try:
        async with asyncio.timeout(None) as deadline:
            def check() -> None:
                nonlocal handle
                if payload.is_eof():
                    return
                at = due + payload.total_bytes / BODY_MIN_RATE
                if loop.time() >= at:
                    request[BODY_LATE] = True
                    deadline.reschedule(loop.time())   # cancels the handler (its own clean-up runs)
                else:
                    handle = loop.call_at(at, check)
            handle = loop.call_at(due, check)
            return await handler(request)
    except TimeoutError:
        if not deadline.expired():
            raise
        log.debug("request body from %s too slow: %d bytes in", request.remote, payload.total_bytes)
        out = web.Response(status=408, content_type="application/json", body=openai_error_body(
            408, f"The request body did not arrive in time (at least {BODY_MIN_RATE} bytes/s after the first "
                 f"{grace_s:g}s).", "invalid_request_error", "request_timeout"))
        await out.prepare(request)   # written here, then the connection closed: aiohttp would linger to read
        await out.write_eof()        # what is left of the body (up to 10 s) before closing
        request.protocol.force_close()
        return out
    finally:
        if handle is not None:
            handle.cancel()


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one (a daemon should not stop at the usual 1,024);
    returns the limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def connection_cap(configured: int) -> int:
    """Client connections one process may hold: the configured cap, within the open-files limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(configured, soft - FD_RESERVE)) if soft != resource.RLIM_INFINITY else configured


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection handler: refuses connections over the cap, gives a new connection
    ``header_timeout_s`` for its first request, and answers its own errors as OpenAI-style JSON."""

    def connection_made(self, transport) -> None:
        server = self._manager
        if len(server._connections) >= server.max_connections:
            server.refused += 1
            transport.abort()  # never registered: connection_lost finds nothing to remove
            self._manager = None
            return
        super().connection_made(transport)
        if self._keepalive_timeout > 0:  # the first head is due sooner than an idle keep-alive times out
            close_time = self._loop.time() + min(server.header_timeout_s, self._keepalive_timeout)
            self._next_keepalive_close_time = close_time
            if self._keepalive_handle is not None:
                self._keepalive_handle.cancel()
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        resp = super().handle_error(request, status, exc, message)  # logs, and refuses if bytes went out
        if status >= 500:
            text, etype = "The gateway failed to handle the request.", "server_error"
        else:
            reason = getattr(exc, "message", None) or (str(exc) if exc else None) or HTTPStatus(status).phrase
            text, etype = f"Malformed HTTP request: {reason}", "invalid_request_error"
        out = web.Response(status=status, body=openai_error_body(status, text, etype, "bad_request" if status == 400
                                                                  else None), content_type="application/json")
        out.force_close()
        resp.force_close()
        return out


class Server(web.Server):
    """``web.Server`` whose connections use :class:`OpenAIErrorHandler`."""

    def __init__(self, handler, *, max_connections: int, header_timeout_s: float, **kwargs):
        def guarded(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:   # (no coroutine of its own: a body
            # already in, as most are, costs one call)
            return handler(request) if request.content.is_eof() else within_body_deadline(
                request, handler, self.header_timeout_s)
        super().__init__(guarded, **kwargs)
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.refused = 0

    def __call__(self) -> RequestHandler:
        return OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


async def stop_serving(runner: web.ServerRunner, grace_s: float, cancel_wait_s: float = 5.0) -> None:
    """Stop accepting, give the requests in flight ``grace_s`` to end, cancel those still running (as a client
    that leaves cancels its own: leases and tenant counts are freed, the replica's connection closed) and wait for
    them a little, then close the connections.  (aiohttp's own shutdown waits twice its timeout for a stream, once
    for it and once after failing its body, and a deadline around it that cancels it leaves the stream running.)"""
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        await asyncio.sleep(0)   # (requests that came just before the sites stopped start being handled)
        server.pre_shutdown()    # idle connections close now, busy ones once their request ends
        loop = asyncio.get_running_loop()

        def busy() -> list[RequestHandler]:
            return [c for c in server.connections if c._request_in_progress]
        for limit, cancel in ((grace_s, True), (cancel_wait_s, False)):
            deadline = loop.time() + limit
            while busy() and loop.time() < deadline:
                await asyncio.sleep(0.05)
            for c in busy() if cancel else ():
                if c._task_handler is not None:
                    c._task_handler.cancel()
    await runner.cleanup()
