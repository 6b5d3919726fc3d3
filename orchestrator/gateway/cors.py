"""Cross-origin requests from browsers (CORS), for ``gateway.cors_allowed_origins``.

The gateway answers for the whole endpoint, so it alone says which web pages may call it: a replica's own
``Access-Control-*`` headers (vLLM's ``--allowed-origins``) never reach a client (:mod:`.headers`), or the
proxied paths would allow what the gateway's own (``/v1/models``, files, batches) refuse.

* A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from an allowed origin is
  answered 204 with the methods the gateway serves and the request headers the browser asked for (the
  ``openai`` JavaScript SDK sends several of its own); from another origin, 403.  It needs no key: browsers
  send preflights without credentials.
* Every other response to a request whose ``Origin`` is allowed carries ``Access-Control-Allow-Origin`` and
  exposes the headers a client reads (``x-request-id``, ``Retry-After``, the ``x-ratelimit-*`` ones).
* Credentials (cookies) are never allowed: keys travel in ``Authorization``.

Off (no origin listed, the default, as vLLM's): the gateway's requests are the plain :class:`web.BaseRequest`,
and an ``OPTIONS`` is answered as before (405 on the API's paths).
"""

from __future__ import annotations

from aiohttp import web

from ..errors import error_response

METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED = ", ".join(["x-request-id", "Retry-After", "x-should-retry", "x-slurmfleet-fallback-from", *(
    f"x-ratelimit-{w}-{k}" for w in ("limit", "remaining", "reset") for k in ("requests", "tokens"))])
MAX_AGE_S = 600   # how long a browser may keep a preflight's answer


class Cors:
    """The allowed origins: exact ``scheme://host[:port]`` strings, or ``*`` for any."""

    def __init__(self, origins: list[str]):
        self.any = "*" in origins
        self.origins = frozenset(origins)

    @classmethod
    def of(cls, origins: list[str]) -> Cors | None:
        return cls(origins) if origins else None

    def allowed(self, origin: str) -> str | None:
        """What ``Access-Control-Allow-Origin`` says to ``origin``: ``*``, the origin itself, or None."""
        if self.any:
            return "*"
        return origin if origin in self.origins else None

    def preflight(self, request: web.BaseRequest) -> web.Response | None:
        """The answer to a preflight; None for an ``OPTIONS`` that is not one (answered as before)."""
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if origin is None or method is None:
            return None
        allow = self.allowed(origin)
        if allow is None:
            return error_response(403, f"Cross-origin requests from {origin!r} are not allowed "
                                  "(gateway.cors_allowed_origins).", "invalid_request_error", "cors_origin_not_allowed")
        headers = {"Access-Control-Allow-Origin": allow, "Access-Control-Allow-Methods": METHODS,
                   "Access-Control-Max-Age": str(MAX_AGE_S)}
        if asked := request.headers.get("Access-Control-Request-Headers"):
            headers["Access-Control-Allow-Headers"] = asked
        if allow != "*":
            headers["Vary"] = "Origin"
        return web.Response(status=204, headers=headers)


class CorsRequest(web.BaseRequest):
    """A request whose response, whatever answers it (a proxied stream, an error, the gateway's own paths),
    gets the CORS headers when its ``Origin`` is allowed: set as the response is prepared."""

    ATTRS = web.BaseRequest.ATTRS | frozenset({"cors"})

    def __init__(self, *args, cors: Cors, **kwargs):
        super().__init__(*args, **kwargs)
        self.cors = cors

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        h = response.headers
        if not self.cors.any and "Origin" not in h.get("Vary", ""):   # (every answer, whatever its Origin: a shared
            h["Vary"] = f"{h['Vary']}, Origin" if "Vary" in h else "Origin"   # cache must not serve one to another)
        origin = self.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in h:   # (a preflight's own)
            return
        allow = self.cors.allowed(origin)
        if allow is None:
            return
        h["Access-Control-Allow-Origin"] = allow
        h["Access-Control-Expose-Headers"] = EXPOSED
