"""The gateway's HTTP server plumbing: aiohttp's low-level server, with

* the errors aiohttp itself answers (a malformed request line, conflicting lengths, oversized headers,
  too many headers, ...) in the OpenAI error shape instead of plain text;
* a cap on open client connections: past it a new connection is closed at once, so idle or slow
  clients cannot take the process's file descriptors (which its probes, scrapes and replicas need);
* a deadline for a new connection's first request head (``header_timeout_s``: slowloris and silent
  connections), and aiohttp's keep-alive timeout for idle connections between requests.
"""

from __future__ import annotations

import json
import logging
import resource
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


def openai_error_body(status: int, message: str, etype: str = "invalid_request_error",
                      code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code or str(status)}}).encode()


log = logging.getLogger("slurmfleet.gateway")
FD_RESERVE = 256  # descriptors kept for everything but client connections (replicas, files, subprocesses)


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
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.refused = 0

    def __call__(self) -> RequestHandler:
        return OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)
