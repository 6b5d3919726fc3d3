"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``, for every error the
gateway and the admin API answer."""

from __future__ import annotations

from aiohttp import web


def error_response(status: int, message: str, etype: str, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": code or str(status)}}
    return web.json_response(body, status=status, headers=headers)
