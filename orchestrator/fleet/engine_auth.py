"""ASGI middleware that makes every path of a vLLM server ask for the job's secret.

vLLM's own ``--api-key`` check guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: on the
cluster network anyone could call ``/invocations``, ``/tokenize``, ``/metrics`` or ``/load`` of a
replica.  The job passes ``--middleware slurmfleet_engine_auth.RequireSecret`` to ``vllm serve``; this
file is copied next to the job (see ``sbatch/node.sh.j2``) and imported by vLLM from there, so it uses
nothing but the standard library.  The secret comes from ``VLLM_API_KEY`` (the job sets it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os


class RequireSecret:
    """Answers 401 to any HTTP or WebSocket request without ``Authorization: Bearer <VLLM_API_KEY>``."""

    def __init__(self, app):
        self.app = app
        secret = os.environ.get("VLLM_API_KEY", "")
        if not secret:
            raise RuntimeError("slurmfleet_engine_auth: VLLM_API_KEY is not set; refusing to serve unguarded")
        self.digest = hashlib.sha256(secret.encode()).digest()

    def authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.strip().encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": {"message": "Unauthorized", "type": "invalid_request_error",
                                     "param": None, "code": "401"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
