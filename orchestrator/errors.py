"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``, for every error the
gateway and the admin API answer."""

from __future__ import annotations

from aiohttp import web

# the openai SDKs' own header: an answer they do not send again (they retry a 408, 409, 429 and 5xx twice by default)
NO_RETRY = {"x-should-retry": "false"}


def error_response(status: int, message: str, etype: str, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": code or str(status)}}
    return web.json_response(body, status=status, headers=headers)


def method_not_allowed(method: str, path: str, allow: str) -> web.Response:
    """OpenAI's 405 for a method ``path`` does not take, with the ``Allow`` header of those it does."""
    return error_response(405, f"Invalid method for URL ({method} {path}).", "invalid_request_error",
                          "method_not_allowed", {"Allow": allow})


def unknown_url(method: str, path: str) -> web.Response:
    """OpenAI's 404 for a path it has no route for."""
    return error_response(404, f"Invalid URL ({method} {path}).", "invalid_request_error", "unknown_url")
