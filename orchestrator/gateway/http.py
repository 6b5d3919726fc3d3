"""The gateway's HTTP server plumbing: aiohttp's low-level server, with the errors aiohttp itself
answers (a malformed request line, conflicting lengths, oversized headers, too many headers, ...)
in the OpenAI error shape instead of plain text, and a bounded idle time on keep-alive connections."""

from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


def openai_error_body(status: int, message: str, etype: str = "invalid_request_error",
                      code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code or str(status)}}).encode()


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors as OpenAI-style JSON."""

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

    def __call__(self) -> RequestHandler:
        return OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)
